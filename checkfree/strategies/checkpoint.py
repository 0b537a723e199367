"""Persistent checkpointing: every K steps every stage's full state goes to storage as
files; on a failure every stage rolls back to the last complete checkpoint.

Layout: `checkfree.strategies.storage` (``<storage>/step-<N>/stage-<i>.bin``), the same files the
swarm's peers write, where N is the step training resumes from (= the data position).
"""

from __future__ import annotations

from checkfree.config import RunConfig
from checkfree.plans import Failure, Init, RecoveryPlan, Storage
from checkfree.strategies.base import Strategy

__all__ = ["CheckpointStrategy"]


class CheckpointStrategy(Strategy):
    """The paper's main baseline: checkpoint every ``strategy.checkpoint_every`` steps."""

    name = "checkpoint"
    lossless = True

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__(cfg)
        self.checkpoint_every = cfg.strategy.checkpoint_every

    def recovery_plan(self, failure: Failure) -> RecoveryPlan:
        target = failure.copies.storage_step
        return RecoveryPlan(failure.step, failure.failed,
                            {s: Storage(target) if target else Init() for s in range(self.cfg.num_stages)},
                            rollback_to=target)
