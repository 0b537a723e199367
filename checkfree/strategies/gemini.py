"""Gemini (SOSP'23): snapshots in the CPU memory of m peers, every K steps.

Placement over the N = S peers (one stage each) is Gemini's group placement when m divides
S, else its mixed placement (`checkfree.baselines.placement`). Each peer sends its state to
the m-1 other holders in the links' idle time; only what does not fit in K steps of idle
time stalls. A failure rolls every stage back to the snapshot: live stages from their own
copy, a lost stage from its nearest live holder. When every holder of a stage is gone (a
whole group), the storage checkpoint is used if configured, else the declared fallback.
"""

from __future__ import annotations

from checkfree.baselines import group_placement, mixed_placement
from checkfree.config import RunConfig
from checkfree.strategies.base import FailureOutcome, Figures, StrategyContext
from checkfree.strategies.rollback import InMemoryStrategy
from checkfree.strategies.state import StageState, state_nbytes

__all__ = ["GeminiStrategy", "placement"]


def placement(num_stages: int, m: int) -> list[list[int]]:
    """holders[i]: the peers (stages) whose memory holds stage i's snapshot, i included."""
    if m > num_stages:
        raise ValueError(f"gemini_replicas={m} exceeds the {num_stages} peers of the pipeline")
    return group_placement(num_stages, m) if num_stages % m == 0 else mixed_placement(num_stages, m)


class GeminiStrategy(InMemoryStrategy):
    name = "gemini"
    swarm_rollback = True
    snapshots_in_memory = True

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__(cfg)
        self.every = cfg.strategy.snapshot_every
        self.holders = placement(cfg.num_stages, cfg.strategy.gemini_replicas)
        self.snap: dict[int, StageState] | None = None
        self.snap_step = 0
        self.memory = 0

    def _replicate(self, ctx: StrategyContext, next_step: int) -> tuple[int, float]:
        """Take the snapshot of every stage; returns (bytes sent, slowest peer's send time)."""
        self.snap = {s: ctx.capture(s, next_step) for s in range(ctx.num_stages)}
        self.snap_step = next_step
        size = {s: state_nbytes(st) for s, st in self.snap.items()}
        held = [sum(size[i] for i in range(ctx.num_stages) if p in self.holders[i]) for p in range(ctx.num_stages)]
        self.memory = max(held)
        sends = {i: [(size[i], h) for h in self.holders[i] if h != i] for i in size}
        moved = sum(n for v in sends.values() for n, _ in v)
        slowest = max(sum(ctx.cost.transfer_s(n, i, h) for n, h in v) for i, v in sends.items())
        return moved, slowest

    def snapshot_due(self, next_step: int) -> bool:
        return next_step % self.every == 0

    @staticmethod
    def restore_source(stage: int, live_holders: list[int], cost) -> int:
        """The live holder (by stage) a lost stage's snapshot is fetched from: the cheapest link to it."""
        return min(live_holders, key=lambda h: (cost.transfer_s(1, h, stage), h))

    def protect(self, ctx: StrategyContext, step: int) -> Figures:
        if not self.snapshot_due(step + 1):
            return Figures(extra_memory_bytes=self.memory)
        moved, slowest = self._replicate(ctx, step + 1)
        return Figures(stall_s=ctx.cost.background_stall_s(slowest, self.every), bytes_moved=moved,
                       extra_memory_bytes=self.memory)

    def reprotect(self, ctx: StrategyContext, step: int) -> int:
        return self._replicate(ctx, step)[0]

    def on_failure(self, ctx: StrategyContext, step: int, failed: set[int]) -> FailureOutcome:
        alive = {s: [h for h in self.holders[s] if h not in failed] for s in failed}
        sources = {s: self.restore_source(s, hs, ctx.cost) for s, hs in alive.items() if hs}
        lost = set(failed) - set(sources)
        if self.snap is None or not lost:
            out = self.restore_all(ctx, step, self.snap, self.snap_step, failed, sources)
            out.figures.bytes_moved += self._rereplication(failed)
            return out
        return self.lost_copies(ctx, step, failed, lost, self.lost_reason(lost),
                                lambda: self.restore_all(ctx, step, self.snap, self.snap_step, failed, sources, lost))

    def lost_reason(self, lost: set[int]) -> str:
        return "every holder of stage(s) " + ", ".join(f"{s} {self.holders[s]}" for s in sorted(lost)) + " failed"

    def _rereplication(self, failed: set[int]) -> int:
        """Bytes to refill the replacements' memory with the copies the dead peers held."""
        if self.snap is None:
            return 0
        return sum(state_nbytes(self.snap[i]) for d in failed for i in range(len(self.holders))
                   if i != d and d in self.holders[i])
