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

The simulator and the swarm share the decisions: when a snapshot is due, who holds it, which
lost stages it restores (`restorable`) and where their components come from (`component_donors`).
"""

from __future__ import annotations

from checkfree.config import RunConfig
from checkfree.pipeline import edge_holders
from checkfree.strategies.averaging import AveragingStrategy
from checkfree.strategies.base import FailureOutcome, Figures, StrategyContext
from checkfree.strategies.rollback import merge
from checkfree.strategies.state import StageState, state_nbytes, with_components

__all__ = ["SnapshotAveragingStrategy"]


class SnapshotAveragingStrategy(AveragingStrategy):
    name = "checkfree+snap"
    restores_alone = True  # the swarm restores a lost stage from a neighbour's snapshot, nobody rolls back

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__(cfg, "checkfree+")
        self.name = "checkfree+snap"
        self.every = cfg.strategy.snapshot_every
        self.snaps: dict[int, StageState] = {}
        self.memory = 0

    def holder(self, stage: int) -> int:
        last = self.cfg.num_stages - 1
        return stage + 1 if stage < last else last - 1

    @property
    def holders(self) -> list[list[int]]:
        """holders[s]: the stages whose peers hold stage s's snapshot (besides s itself)."""
        return [[self.holder(s)] for s in range(self.cfg.num_stages)]

    def snapshot_due(self, next_step: int) -> bool:
        return next_step % self.every == 0

    def restorable(self, failed: set[int], held: set[int]) -> set[int]:
        """The lost stages restored from their snapshot: those with one (``held``: the stages whose snapshot a
        holder still has) whose holder is not lost too."""
        return {s for s in failed if s in held and self.holder(s) not in failed}

    def component_donors(self, stage: int, failed: set[int]) -> dict[str, int]:
        """For each replicated component a restored ``stage`` holds, the live co-holder it is copied from."""
        out = {}
        for comp, holders in edge_holders(self.cfg.num_stages, True).items():
            live = [h for h in holders if h != stage and h not in failed]
            if stage in holders and live:
                out[comp] = live[0]
        return out

    def after_step(self, ctx: StrategyContext, step: int) -> Figures:
        figs = super().after_step(ctx, step)
        if not self.snapshot_due(step + 1):
            return figs + Figures(extra_memory_bytes=self.memory)
        self.snaps = {s: ctx.capture(s, step + 1) for s in range(ctx.num_stages)}
        size = {s: state_nbytes(st) for s, st in self.snaps.items()}
        self.memory = max(sum(size[s] for s in size if self.holder(s) == p) for p in size)
        slowest = max(ctx.cost.transfer_s(n, s, self.holder(s)) for s, n in size.items())
        return figs + Figures(stall_s=ctx.cost.background_stall_s(slowest, self.every),
                              bytes_moved=sum(size.values()), extra_memory_bytes=self.memory)

    def on_failure(self, ctx: StrategyContext, step: int, failed: set[int]) -> FailureOutcome:
        restored = self.restorable(failed, set(self.snaps))
        moved, slowest = 0, 0.0
        for s in sorted(restored):
            state = self._with_live_edges(ctx, s, self.snaps[s], failed)
            ctx.restore(s, state, replace=True)
            n = state_nbytes(state)
            moved += n
            slowest = max(slowest, ctx.cost.transfer_s(n, self.holder(s), s))
            ctx.event("recovery", step=step, stage=s, strategy=self.name, method="snapshot", source=self.holder(s),
                      snapshot_step=state["step"], staleness=step - state["step"], lost_steps=0,
                      edge_sources=self.component_donors(s, failed))
        out = FailureOutcome(Figures(bytes_moved=moved, recovery_s=ctx.cost.recovery_s(slowest)), method="snapshot")
        self.snaps = {s: snap for s, snap in self.snaps.items() if self.holder(s) not in failed}  # gone with them
        rest = set(failed) - restored
        if not rest:
            return out
        averaged = self.average(ctx, step, rest)
        if not restored:
            return averaged
        both = merge(out, averaged)  # in parallel: the slower of the two
        both.figures.recovery_s = max(out.figures.recovery_s, averaged.figures.recovery_s)
        return both

    def _with_live_edges(self, ctx: StrategyContext, stage: int, snap: StageState, failed: set[int]) -> StageState:
        """The snapshot, with each replicated component (weights + Adam state) taken from a
        live co-holder when there is one."""
        donors = {}
        for comp, h in self.component_donors(stage, failed).items():
            donor = ctx.capture(h, snap["step"])
            donors[comp] = (donor["model"], donor["optim"]["state"])
        return with_components(snap, donors)
