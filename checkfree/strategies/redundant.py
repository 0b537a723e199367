"""Redundant computation (Bamboo, NSDI'23): each stage keeps a current replica of its
ring successor, weights and Adam state.

In Bamboo stage i runs stage i+1's forward pass as well; to keep the replica's optimizer
state exact, the successor ships its (clipped) gradient after the backward and the holder
applies the same Adam step (the swarm does exactly that: peers/replicas.py). The simulator copies the
successor's full state after every step, the cheapest equivalent in one process, and charges what the real
system does: the extra forward per microbatch and the gradient shipment (`CostModel.redundant_extra_s`), and
the replica's memory. A lost stage is replaced by promoting its predecessor's replica: no step is lost; the
new peers then take their successors' replicas. When the holder failed too (two ring-adjacent failures), the
storage checkpoint is used if configured, else the declared fallback.
"""

from __future__ import annotations

from checkfree.plans import (Failure, Fallback, Init, Protect, RecoveryPlan, RefreshReplicas, Replica, Source,
                             Storage, TakeReplicas, fallback_rebuilds)
from checkfree.strategies.base import Figures, StrategyContext
from checkfree.strategies.rollback import InMemoryStrategy

__all__ = ["RedundantStrategy"]


class RedundantStrategy(InMemoryStrategy):
    name = "redundant"
    peer_service = "replicas"  # each peer holds its successor's replica (peers/replicas.py)

    def holder(self, stage: int) -> int:
        return (stage - 1) % self.cfg.num_stages

    def protection_at_start(self) -> list[Protect]:
        return [TakeReplicas(tuple(range(self.cfg.num_stages)))]

    def protection_due(self, step: int) -> list[Protect]:
        """After every step the replicas take it (the swarm: in the COMMIT itself)."""
        return [RefreshReplicas(), *super().protection_due(step)]

    def protection_after_handover(self, stages: tuple[int, ...]) -> list[Protect]:
        """The leaving peer held its successor's replica: the new peer takes it."""
        return [TakeReplicas(stages)]

    def recovery_plan(self, failure: Failure) -> RecoveryPlan:
        step, failed, n = failure.step, failure.failed, self.cfg.num_stages
        promoted = {s: Replica(self.holder(s)) for s in failed if self.holder(s) not in failed}
        reasons = {s: f"stage {s}'s replica holder {self.holder(s)} failed too" for s in sorted(failed - set(promoted))}
        every = tuple(range(n))
        if reasons and self.storage:
            target = failure.copies.storage_step
            sources: dict[int, Source] = {s: Storage(target) if target else Init() for s in range(n)}
            return RecoveryPlan(step, failed, sources, rollback_to=target, fallback=Fallback("checkpoint", reasons),
                                then=(TakeReplicas(every),))
        rebuilds, fb = fallback_rebuilds(set(reasons), n, self.cfg.recovery.fallback, reasons) if reasons \
            else ({}, None)
        if fb is not None and fb.name == "abort":
            return RecoveryPlan(step, failed, {}, fallback=fb)
        return RecoveryPlan(step, failed, {**promoted, **rebuilds}, fallback=fb,
                            then=(TakeReplicas(tuple(sorted(failed))),))

    # ---- the simulator's prices --------------------------------------------------------
    def step_figures(self, ctx: StrategyContext, step: int) -> Figures:
        """Every microbatch's redundant forward and the gradients shipped to the holders (the replicas' sizes as
        last taken: the parameters do not change size)."""
        grads = [float(sum(v.numel() * 4 for v in ctx.weights(s).values())) for s in range(ctx.num_stages)]
        return Figures(stall_s=ctx.cost.redundant_extra_s(grads), bytes_moved=int(sum(grads)))

    def refill_bytes(self, plan: RecoveryPlan, sizes: dict[int, int]) -> int:
        """The promoted stages' new peers copy their successors' replicas (from storage: every replica anew)."""
        if plan.fallback is not None and plan.fallback.name == "checkpoint":
            return sum(sizes.values())
        return sum(sizes[(s + 1) % len(sizes)] for s, src in plan.sources.items() if isinstance(src, Replica))
