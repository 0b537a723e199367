"""Persistent checkpointing: every K steps every stage's full state goes to storage as
files; on a failure every stage rolls back to the last complete checkpoint.

Layout: `checkfree.strategies.storage` (``<storage>/step-<N>/stage-<i>.bin``), the same files the
swarm's peers write, where N is the step training resumes from (= the data position).
"""

from __future__ import annotations

from checkfree.config import RunConfig
from checkfree.serialize import state_from_bytes, state_to_bytes
from checkfree.strategies import storage
from checkfree.strategies.base import FailureOutcome, Figures, Strategy, StrategyContext

__all__ = ["Checkpointer", "CheckpointStrategy"]


class Checkpointer:
    """Writes and reads the checkpoints of one run (also the storage fallback of others), in the layout of
    `checkfree.strategies.storage` (shared with the swarm's peers)."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.last_step = 0  # step of the last complete checkpoint of this run (0: none, re-initialise)

    def maybe_save(self, ctx: StrategyContext, step: int) -> Figures:
        """After `step`: save when (step + 1) is a multiple of K."""
        return self.save(ctx, step + 1) if (step + 1) % self.every == 0 else Figures()

    def save(self, ctx: StrategyContext, next_step: int) -> Figures:
        """Every peer writes its state in parallel; the step waits for the slowest."""
        sizes = [storage.write_stage(ctx.storage_dir, next_step, s, state_to_bytes(ctx.capture(s, next_step)))
                 for s in range(ctx.num_stages)]
        storage.seal(ctx.storage_dir, next_step, ctx.num_stages)
        self.last_step = next_step
        return Figures(stall_s=max(ctx.cost.storage_s(n) for n in sizes), bytes_moved=sum(sizes))

    def rollback(self, ctx: StrategyContext, strategy: str, step: int, failed: set[int], reason: str = "") -> FailureOutcome:
        """Every stage reloads the last complete checkpoint (step 0: re-initialise)."""
        sizes = []
        for s in range(ctx.num_stages):
            if self.last_step == 0:
                ctx.reset(s)
                continue
            blob = storage.read_stage(ctx.storage_dir, self.last_step, s)
            sizes.append(len(blob))
            ctx.restore(s, state_from_bytes(blob), replace=s in failed)
        lost = step - self.last_step
        for s in sorted(failed):
            ctx.event("recovery", step=step, stage=s, strategy=strategy, method="rollback",
                      source="storage" if self.last_step else "init",  # (no checkpoint yet: re-initialised)
                      rollback_to=self.last_step, lost_steps=lost, **({"reason": reason} if reason else {}))
        slowest = max((ctx.cost.storage_s(n) for n in sizes), default=0.0)
        return FailureOutcome(Figures(bytes_moved=sum(sizes), lost_steps=lost, recovery_s=ctx.cost.recovery_s(slowest)),
                              rollback_to=self.last_step, method="rollback-storage")


class CheckpointStrategy(Strategy):
    """The paper's main baseline: checkpoint every ``strategy.checkpoint_every`` steps."""

    name = "checkpoint"
    lossless = True
    swarm_rollback = True

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__(cfg)
        self.storage = Checkpointer(cfg.strategy.checkpoint_every)

    def after_step(self, ctx: StrategyContext, step: int) -> Figures:
        return self.storage.save(ctx, step + 1) if self.checkpoint_due(step + 1) else Figures()

    def on_failure(self, ctx: StrategyContext, step: int, failed: set[int]) -> FailureOutcome:
        return self.storage.rollback(ctx, self.name, step, failed)
