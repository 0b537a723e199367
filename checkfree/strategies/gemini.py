"""Gemini (SOSP'23): snapshots in the CPU memory of m peers, every K steps.

Placement over the N = S peers (one stage each) is Gemini's group placement when m divides
S, else its mixed placement (`checkfree.baselines.gemini_placement`). Each peer sends its state to
the m-1 other holders in the links' idle time; only what does not fit in K steps of idle
time stalls. A failure rolls every stage back to the snapshot: live stages from their own
copy, a lost stage from its live holder with the cheapest link. When every holder of a stage is gone (a
whole group), the storage checkpoint is used if configured, else the declared fallback. After a rollback the
snapshot is taken again at the step rolled back to, so the replacements hold the copies the lost peers held.
"""

from __future__ import annotations

from checkfree.baselines import group_placement, mixed_placement
from checkfree.config import RunConfig
from checkfree.costmodel import CostModel
from checkfree.plans import Failure, Holder, Protect, RecoveryPlan, Snapshot, Source
from checkfree.strategies.rollback import InMemoryStrategy

__all__ = ["GeminiStrategy", "placement"]


def placement(num_stages: int, m: int) -> list[list[int]]:
    """holders[i]: the peers (stages) whose memory holds stage i's snapshot, i included."""
    if m > num_stages:
        raise ValueError(f"gemini_replicas={m} exceeds the {num_stages} peers of the pipeline")
    return group_placement(num_stages, m) if num_stages % m == 0 else mixed_placement(num_stages, m)


class GeminiStrategy(InMemoryStrategy):
    name = "gemini"

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__(cfg)
        self.holders = placement(cfg.num_stages, cfg.strategy.gemini_replicas)
        self.cost = CostModel(cfg)  # a lost stage's snapshot comes over the cheapest link

    def snapshot(self, step: int) -> Snapshot:
        return Snapshot(step, {s: tuple(hs) for s, hs in enumerate(self.holders)})

    def protection_due(self, step: int) -> list[Protect]:
        due: list[Protect] = [self.snapshot(step + 1)] if (step + 1) % self.every == 0 else []
        return due + super().protection_due(step)

    def refill(self, step: int, from_storage: bool) -> tuple[Protect, ...]:
        return (self.snapshot(step),)

    def restore_source(self, stage: int, live_holders: list[int]) -> int:
        """The live holder (by stage) a lost stage's snapshot is fetched from: the cheapest link to it."""
        return min(live_holders, key=lambda h: (self.cost.transfer_s(1, h, stage), h))

    def recovery_plan(self, failure: Failure) -> RecoveryPlan:
        copies = failure.copies
        alive = {s: copies.holders(s) for s in failure.failed}
        copy_of: dict[int, Source] = {s: Holder(self.restore_source(s, hs), copies.step) for s, hs in alive.items()
                                      if hs}
        lost = sorted(set(failure.failed) - set(copy_of))
        reason = "every holder of stage(s) " + ", ".join(f"{s} {self.holders[s]}" for s in lost) + " failed"
        return self.rollback(failure, copy_of, {s: reason for s in lost})

    def refill_bytes(self, plan: RecoveryPlan, sizes: dict[int, int]) -> int:
        """A rollback from memory: the replacements get the copies the dead peers held; from storage: every
        holder gets every copy anew."""
        if plan.fallback is not None and plan.fallback.name == "checkpoint":
            return sum(sizes[i] for i, hs in enumerate(self.holders) for h in hs if h != i)
        if plan.fallback is not None:
            return 0
        return sum(sizes[i] for d in plan.failed for i in range(len(self.holders)) if i != d and d in self.holders[i])
