"""Redundant computation (Bamboo, NSDI'23): each stage keeps a current replica of its
ring successor, weights and Adam state.

In Bamboo stage i runs stage i+1's forward pass as well; to keep the replica's optimizer
state exact, the successor ships its (clipped) gradient after the backward and the holder
applies the same Adam step. In one process the cheapest equivalent is to copy the
successor's full state after every step; the figures charge what the real system does: the
extra forward per microbatch and the gradient shipment (`CostModel.redundant_extra_s`),
and the replica's memory. A lost stage is replaced by promoting its predecessor's replica:
no step is lost. When the holder failed too (two ring-adjacent failures), the storage
checkpoint is used if configured, else the declared fallback.
"""

from __future__ import annotations

from checkfree.config import RunConfig
from checkfree.strategies.base import FailureOutcome, Figures, StrategyContext
from checkfree.strategies.rollback import InMemoryStrategy
from checkfree.strategies.state import StageState, state_nbytes

__all__ = ["RedundantStrategy"]


class RedundantStrategy(InMemoryStrategy):
    name = "redundant"
    swarm_replicas = True  # the swarm runs it: each peer holds its successor's replica (peers/replicas.py)

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__(cfg)
        self.replicas: dict[int, StageState] = {}  # stage -> its replica (held by its predecessor)

    def holder(self, stage: int) -> int:
        return (stage - 1) % self.cfg.num_stages

    def promotable(self, failed: set[int]) -> set[int]:
        """The lost stages whose replica survives (its holder, the ring predecessor, is not lost too)."""
        return {s for s in failed if self.holder(s) not in failed}

    def protect(self, ctx: StrategyContext, step: int) -> Figures:
        self.replicas = {s: ctx.capture(s, step + 1) for s in range(ctx.num_stages)}
        grads = [float(sum(v.numel() * 4 for v in r["model"].values())) for _, r in sorted(self.replicas.items())]
        return Figures(stall_s=ctx.cost.redundant_extra_s(grads), bytes_moved=int(sum(grads)),
                       extra_memory_bytes=max(state_nbytes(r) for r in self.replicas.values()))

    def reprotect(self, ctx: StrategyContext, step: int) -> int:
        self.replicas = {s: ctx.capture(s, step) for s in range(ctx.num_stages)}
        return sum(state_nbytes(r) for r in self.replicas.values())

    def on_failure(self, ctx: StrategyContext, step: int, failed: set[int]) -> FailureOutcome:
        if not self.replicas:  # nothing trained yet: every replica is the initial state (the swarm's, taken at the start)
            self.replicas = {s: ctx.capture(s, step) for s in range(ctx.num_stages)}
        lost = set(failed) - self.promotable(failed)
        if not lost:
            return self._promote(ctx, step, failed)
        reason = ", ".join(f"stage {s}'s replica holder {self.holder(s)} failed too" for s in sorted(lost))
        return self.lost_copies(ctx, step, failed, lost, reason, lambda: self._promote(ctx, step, failed - lost))

    def _promote(self, ctx: StrategyContext, step: int, stages: set[int]) -> FailureOutcome:
        """The holder ships each replica to the new peer; the new peer then copies its own
        successor's state to become that stage's replica holder again."""
        moved, slowest = 0, 0.0
        for s in sorted(stages):
            replica = self.replicas[s]
            assert replica["step"] == step, "replicas are refreshed after every step"
            ctx.restore(s, replica, replace=True)
            n = state_nbytes(replica)
            succ = (s + 1) % ctx.num_stages
            moved += n + state_nbytes(self.replicas[succ])
            slowest = max(slowest, ctx.cost.transfer_s(n, self.holder(s), s))
            ctx.event("recovery", step=step, stage=s, strategy=self.name, method="promote-replica",
                      source=self.holder(s), lost_steps=0)
        return FailureOutcome(Figures(bytes_moved=moved, recovery_s=ctx.cost.recovery_s(slowest)),
                              method="promote-replica")
