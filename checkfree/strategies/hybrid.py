"""checkfree+snap: CheckFree+ with a neighbour's in-memory snapshot of each stage.

Every K steps (``strategy.snapshot_every``) each stage sends its full state (weights and
Adam state) to one neighbour: stage i to i+1, the last stage to S-2. When a stage is lost
and its snapshot holder is alive, that stage alone is restored from the snapshot (up to
K-1 steps stale); nobody rolls back, so no step is lost. A stage without a usable snapshot
is rebuilt by CheckFree+ (weighted average / edge copy), with the snapshot-restored stages
counting as live sources, so two adjacent failures are recoverable when one of them has a
snapshot. The embedding / head of a restored stage, and their Adam state, are taken from
the live co-holder so that the CheckFree+ replicas stay identical. A snapshot whose holder
fails is gone with it (the holder's replacement holds none until the next snapshot).
"""

from __future__ import annotations

from checkfree.config import RunConfig
from checkfree.pipeline import edge_holders
from checkfree.plans import Failure, Holder, Protect, RecoveryPlan, Snapshot, Source
from checkfree.strategies.averaging import AveragingStrategy, average_plan

__all__ = ["SnapshotAveragingStrategy"]


class SnapshotAveragingStrategy(AveragingStrategy):
    name = "checkfree+snap"
    restores_in_parallel = True  # the simulator's price: snapshots and rebuilds travel at the same time

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__(cfg, "checkfree+")
        self.name = "checkfree+snap"
        self.every = cfg.strategy.snapshot_every

    def holder(self, stage: int) -> int:
        last = self.cfg.num_stages - 1
        return stage + 1 if stage < last else last - 1

    def protection_due(self, step: int) -> list[Protect]:
        if (step + 1) % self.every:
            return []
        return [Snapshot(step + 1, {s: (self.holder(s),) for s in range(self.cfg.num_stages)})]

    def component_donors(self, stage: int, failed: frozenset[int]) -> dict[str, int]:
        """For each replicated component a restored ``stage`` holds, the live co-holder it is copied from."""
        out = {}
        for comp, holders in edge_holders(self.cfg.num_stages, True).items():
            live = [h for h in holders if h != stage and h not in failed]
            if stage in holders and live:
                out[comp] = live[0]
        return out

    def recovery_plan(self, failure: Failure) -> RecoveryPlan:
        """Every lost stage whose snapshot's holder lives is restored from it alone (its components from the live
        co-holders); the others are averaged, the restored ones among their sources."""
        copies, failed = failure.copies, failure.failed
        restored: dict[int, Source] = {s: Holder(self.holder(s), copies.step, self.component_donors(s, failed))
                                       for s in sorted(failed) if self.holder(s) in copies.holders(s)}
        rest = failed - set(restored)
        if not rest:
            return RecoveryPlan(failure.step, failed, restored)
        averaged = average_plan(Failure(failure.step, frozenset(rest), copies), self.cfg.num_stages,
                                self.rule.name, self.cfg.recovery.fallback)
        return RecoveryPlan(failure.step, failed, {**restored, **averaged.sources}, fallback=averaged.fallback)
