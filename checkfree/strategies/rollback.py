"""Shared machinery of the strategies that keep copies of stage states in peers' memory
(redundant, gemini, reft, baft): the optional storage fallback and the global rollback.

When a stage's in-memory copies are all gone, the strategy rolls every stage back to the
last persistent checkpoint if ``strategy.storage_fallback`` is set (it then also writes
checkpoints every ``strategy.checkpoint_every`` steps), and otherwise applies the declared
fallback (``recovery.fallback``) to the lost stages after rolling the others back.
"""

from __future__ import annotations

from collections.abc import Callable

from checkfree.config import RunConfig
from checkfree.strategies.averaging import declared_fallback
from checkfree.strategies.base import FailureOutcome, Figures, Strategy, StrategyContext
from checkfree.strategies.checkpoint import Checkpointer
from checkfree.strategies.state import StageState, state_nbytes

__all__ = ["InMemoryStrategy", "merge"]


def merge(first: FailureOutcome, then: FailureOutcome) -> FailureOutcome:
    """Two steps of one recovery, one after the other."""
    return FailureOutcome(first.figures + then.figures, first.rollback_to if then.rollback_to is None else then.rollback_to,
                          first.success and then.success, then.fallback or first.fallback,
                          "+".join(m for m in (first.method, then.method) if m))


class InMemoryStrategy(Strategy):
    """Base of strategies whose copies live in peers' memory."""

    lossless = True

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__(cfg)
        self.storage = Checkpointer(cfg.strategy.checkpoint_every) if cfg.strategy.storage_fallback else None

    def when_all_copies_lost(self) -> str:
        """What a stage whose every holder failed gets: the storage checkpoint if there is one, else the
        declared fallback (`recovery.fallback`)."""
        return "checkpoint" if self.storage is not None else self.cfg.recovery.fallback

    def after_step(self, ctx: StrategyContext, step: int) -> Figures:
        figs = self.protect(ctx, step)
        return figs if self.storage is None else figs + self.storage.maybe_save(ctx, step)

    def protect(self, ctx: StrategyContext, step: int) -> Figures:
        """Refresh the in-memory copies after `step`."""
        return Figures()

    def reprotect(self, ctx: StrategyContext, step: int) -> int:
        """After a rollback from storage to `step`: rebuild the in-memory copies of the
        restored state; returns the bytes that costs."""
        return 0

    def lost_reason(self, lost: set[int]) -> str:
        """Why the failed stages `lost` have no surviving copy (the fallback's reason, in both runtimes)."""
        return f"every copy of stage(s) {sorted(lost)} failed"

    def lost_copies(self, ctx: StrategyContext, step: int, failed: set[int], lost: set[int], reason: str,
                    recover_rest: Callable[[], FailureOutcome]) -> FailureOutcome:
        """`lost`: failed stages with no surviving copy. Storage rollback if configured, else
        `recover_rest()` (the strategy's own recovery of everything but `lost`) followed by
        the declared fallback for `lost`."""
        if self.storage is not None:
            out = self.storage.rollback(ctx, self.name, step, failed, reason)
            out.figures.bytes_moved += self.reprotect(ctx, self.storage.last_step)
            out.success, out.fallback = False, "checkpoint"
            return out
        if self.cfg.recovery.fallback == "abort":  # the run ends here: nothing is recovered first (as in the swarm)
            return declared_fallback(ctx, self.name, step, lost, reason)
        return merge(recover_rest(), declared_fallback(ctx, self.name, step, lost, reason))

    def restore_all(self, ctx: StrategyContext, step: int, snap: dict[int, StageState] | None, snap_step: int,
                    failed: set[int], sources: dict[int, int], skip: set[int] = frozenset(),
                    source: str | None = None) -> FailureOutcome:
        """Roll every stage but `skip` back to `snap` (None: the initial state, step 0);
        failed stage s gets its copy from stage `sources[s]` (recorded as such, or as `source`: e.g. reft's parity)."""
        lost_steps = step - snap_step if snap is not None else step
        slowest, moved = 0.0, 0
        for s in range(ctx.num_stages):
            if s in skip:
                continue
            if snap is None:
                ctx.reset(s)
            else:
                ctx.restore(s, snap[s], replace=s in failed)
                if s in failed:
                    n = state_nbytes(snap[s])
                    moved += n
                    slowest = max(slowest, ctx.cost.transfer_s(n, sources[s], s))
        for s in sorted(failed - set(skip)):
            ctx.event("recovery", step=step, stage=s, strategy=self.name, method="rollback",
                      source=(source or sources.get(s)) if snap is not None else "init",
                      rollback_to=snap_step if snap is not None else 0,
                      lost_steps=lost_steps)
        return FailureOutcome(Figures(bytes_moved=moved, lost_steps=lost_steps, recovery_s=ctx.cost.recovery_s(slowest)),
                              rollback_to=snap_step if snap is not None else 0, method="rollback-memory")
