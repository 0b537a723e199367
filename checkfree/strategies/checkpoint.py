"""Persistent checkpointing: every K steps every stage's full state goes to storage as
files; on a failure every stage rolls back to the last complete checkpoint.

Layout: ``<storage>/step-<N>/stage-<i>.pt`` (torch.save of a strategies.state dict), where N
is the step training resumes from (= the data position). A checkpoint is written into
``step-<N>.tmp`` and renamed when every stage's file is there, so a directory without the
suffix is complete; the previous complete checkpoint is deleted only after that.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from checkfree.config import RunConfig
from checkfree.strategies.base import FailureOutcome, Figures, Strategy, StrategyContext

__all__ = ["Checkpointer", "CheckpointStrategy"]


class Checkpointer:
    """Writes and reads the checkpoints of one run (also the storage fallback of others)."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.last: Path | None = None  # last complete checkpoint of this run
        self.last_step = 0

    def maybe_save(self, ctx: StrategyContext, step: int) -> Figures:
        """After `step`: save when (step + 1) is a multiple of K."""
        return self.save(ctx, step + 1) if (step + 1) % self.every == 0 else Figures()

    def save(self, ctx: StrategyContext, next_step: int) -> Figures:
        """Every peer writes its state in parallel; the step waits for the slowest."""
        root = Path(ctx.storage_dir)
        final, tmp = root / f"step-{next_step:08d}", root / f"step-{next_step:08d}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        sizes = []
        for s in range(ctx.num_stages):
            path = tmp / f"stage-{s}.pt"
            torch.save(ctx.capture(s, next_step), path)
            sizes.append(path.stat().st_size)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        if self.last is not None and self.last != final:
            shutil.rmtree(self.last, ignore_errors=True)
        self.last, self.last_step = final, next_step
        return Figures(stall_s=max(ctx.cost.storage_s(n) for n in sizes), bytes_moved=sum(sizes))

    def rollback(self, ctx: StrategyContext, strategy: str, step: int, failed: set[int], reason: str = "") -> FailureOutcome:
        """Every stage reloads the last complete checkpoint (step 0: re-initialise)."""
        sizes = []
        for s in range(ctx.num_stages):
            if self.last is None:
                ctx.reset(s)
                continue
            path = self.last / f"stage-{s}.pt"
            sizes.append(path.stat().st_size)
            ctx.restore(s, torch.load(path, map_location="cpu", weights_only=True), replace=s in failed)
        lost = step - self.last_step
        for s in sorted(failed):
            ctx.event("recovery", step=step, stage=s, strategy=strategy, method="rollback", source="storage",
                      rollback_to=self.last_step, lost_steps=lost, **({"reason": reason} if reason else {}))
        slowest = max((ctx.cost.storage_s(n) for n in sizes), default=0.0)
        return FailureOutcome(Figures(bytes_moved=sum(sizes), lost_steps=lost, recovery_s=ctx.cost.recovery_s(slowest)),
                              rollback_to=self.last_step, method="rollback-storage")


class CheckpointStrategy(Strategy):
    """The paper's main baseline: checkpoint every ``strategy.checkpoint_every`` steps."""

    name = "checkpoint"
    lossless = True

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__(cfg)
        self.storage = Checkpointer(cfg.strategy.checkpoint_every)

    def after_step(self, ctx: StrategyContext, step: int) -> Figures:
        return self.storage.maybe_save(ctx, step)

    def on_failure(self, ctx: StrategyContext, step: int, failed: set[int]) -> FailureOutcome:
        return self.storage.rollback(ctx, self.name, step, failed)
