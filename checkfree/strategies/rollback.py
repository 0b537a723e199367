"""What the strategies that keep copies of stage states in peers' memory share (redundant, gemini, reft, baft):
the optional storage fallback and the plan of a global rollback.

When a lost stage's in-memory copies are all gone, every stage rolls back to the last persistent checkpoint if
``strategy.storage_fallback`` is set (the strategy then also writes checkpoints every
``strategy.checkpoint_every`` steps), and otherwise the lost stages get the declared fallback
(``recovery.fallback``) once the others rolled back.
"""

from __future__ import annotations

from checkfree.config import RunConfig
from checkfree.plans import Failure, Own, Protect, RecoveryPlan, Source, rollback_plan
from checkfree.strategies.base import Strategy

__all__ = ["InMemoryStrategy"]


class InMemoryStrategy(Strategy):
    """Base of strategies whose copies live in peers' memory."""

    lossless = True

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__(cfg)
        self.storage = cfg.strategy.storage_fallback
        self.checkpoint_every = cfg.strategy.checkpoint_every if self.storage else None

    def refill(self, step: int, from_storage: bool) -> tuple[Protect, ...]:
        """The protection due after a rollback to `step` (every stage is at `step` then): the copies the lost peers
        held, given to their replacements (or, `from_storage`, every copy anew)."""
        return ()

    def rollback(self, failure: Failure, copy_of: dict[int, Source], reasons: dict[int, str]) -> RecoveryPlan:
        """Every stage rolls back to the in-memory copies (a failed stage from `copy_of`); `reasons`: the failed
        stages with no copy left, and why. See `checkfree.plans.rollback_plan`."""
        plan = rollback_plan(failure, copy_of, reasons, own=Own(), storage=self.storage,
                             fallback=self.cfg.recovery.fallback, num_stages=self.cfg.num_stages)
        target = plan.rollback_to
        if not target:
            return plan
        from_storage = plan.fallback is not None and plan.fallback.name == "checkpoint"
        return RecoveryPlan(plan.step, plan.failed, plan.sources, target, plan.fallback,
                            self.refill(target, from_storage))
