"""CheckFree, CheckFree+ and the ablations (uniform, copy, random) as strategies.

One implementation of the arithmetic: plans come from `checkfree.recovery.plan_recovery`
and states from `rebuild_stage`; this module only moves weights through the context and
prices the transfers. `declared_fallback` reuses the same path for the stages another
strategy could not recover (``recovery.fallback`` = random | copy; abort raises).
"""

from __future__ import annotations

import time

from checkfree.config import RunConfig
from checkfree.pipeline import edge_holders
from checkfree.recovery import (RecoveryPlan, StateDict, UnrecoverableFailure, get_rule, plan_recovery,
                                rebuild_stage, recovered_optimizer_state)
from checkfree.strategies.base import FailureOutcome, Figures, Strategy, StrategyContext
from checkfree.strategies.state import state_nbytes

__all__ = ["recovery_fields", "apply_plans", "declared_fallback", "unrecoverable", "AveragingStrategy"]


def recovery_fields(plan: RecoveryPlan, coeffs: dict[int, float], omega_scope: str) -> dict:
    """The events.jsonl fields describing one recovery (shared with the coordinator)."""
    return {"method": plan.method, "sources": list(plan.sources), "omega_scope": omega_scope,
            "coefficients": [coeffs[s] for s in plan.sources] if coeffs else [],
            "edge_sources": plan.edge_sources, "edges_reinit": list(plan.edges_reinit)}


def _nbytes(sd: StateDict) -> int:
    return sum(v.numel() * v.element_size() for v in sd.values())


def apply_plans(ctx: StrategyContext, strategy: str, step: int, plans: list[RecoveryPlan]) -> tuple[int, float]:
    """Rebuild every planned stage on a new peer from live stages' weights (and a
    replicated component's Adam state, copied with it).

    Returns (bytes moved, seconds of the slowest transfer); sources send in parallel."""
    rc, moved, slowest = ctx.cfg.recovery, 0, 0.0
    for plan in plans:
        t0 = time.perf_counter()
        blocks = {s: {k: v for k, v in ctx.weights(s).items() if k.startswith("blocks.")} for s in plan.sources}
        edges = {c: {k: v for k, v in ctx.weights(h).items() if k.startswith(c + ".")}
                 for c, h in plan.edge_sources.items()}
        edge_optim = {c: ctx.optimizer_state(h, c) for c, h in plan.edge_sources.items()}
        state, coeffs = rebuild_stage(plan, ctx.template(plan.stage), blocks, {s: ctx.norm(s) for s in plan.sources},
                                      edges, eps=rc.eps, seed=ctx.cfg.train.seed + step, std=ctx.cfg.model.init_std)
        ctx.load_recovered(plan.stage, state, rc.lr_scale, recovered_optimizer_state(plan, edge_optim))
        sends = [(s, _nbytes(sd)) for s, sd in blocks.items()] + [
            (plan.edge_sources[c], _nbytes(sd) + state_nbytes(edge_optim[c])) for c, sd in edges.items()]
        moved += sum(n for _, n in sends)
        slowest = max([slowest] + [ctx.cost.transfer_s(n, s, plan.stage) for s, n in sends])
        fields = recovery_fields(plan, coeffs, rc.omega_scope)
        if plan.fallback:
            ctx.event("fallback", step=step, stage=plan.stage, strategy=strategy, fallback=plan.fallback,
                      reason=plan.reason, **fields)
        else:
            ctx.event("recovery", step=step, stage=plan.stage, strategy=strategy,
                      recovery_time_s=round(time.perf_counter() - t0, 6), **fields)
    return moved, slowest


def unrecoverable(strategy: str, stages: set[int] | list[int], reason: str) -> UnrecoverableFailure:
    """The abort of a run whose `strategy` has no copy of `stages` left (the same words in both runtimes)."""
    return UnrecoverableFailure(f"{strategy} cannot recover stage(s) {sorted(stages)}: {reason} (fallback=abort)")


def declared_fallback(ctx: StrategyContext, strategy: str, step: int, stages: set[int], reason: str) -> FailureOutcome:
    """Apply ``recovery.fallback`` to `stages` (every other stage is live): abort raises,
    random re-initialises, copy takes the nearest live stage's blocks. No rollback."""
    fb = ctx.cfg.recovery.fallback
    if fb == "abort":
        ctx.event("fallback", step=step, stage=min(stages), strategy=strategy, fallback="abort", reason=reason)
        raise unrecoverable(strategy, stages, reason)
    plans = plan_recovery(set(stages), ctx.num_stages, fb, fallback=fb)
    for p in plans:
        p.fallback, p.reason = fb, reason
    moved, slowest = apply_plans(ctx, strategy, step, plans)
    return FailureOutcome(Figures(bytes_moved=moved, recovery_s=ctx.cost.recovery_s(slowest)), success=False,
                          fallback=fb, method=f"fallback-{fb}")


class AveragingStrategy(Strategy):
    """Rebuild lost stages from their live neighbours' weights (a `RecoveryRule` by name)."""

    def __init__(self, cfg: RunConfig, rule: str) -> None:
        super().__init__(cfg)
        self.rule = get_rule(rule)
        self.name, self.plus = rule, self.rule.plus
        self.fails_edges = self.rule.plus  # plain rules: the paper never fails the edge stages
        self._replicas: Figures | None = None

    def after_step(self, ctx: StrategyContext, step: int) -> Figures:
        """CheckFree+: both holders of the embedding / head exchange their gradients (bytes;
        no stall: the paper reports the same iteration time as CheckFree) and the second
        holder keeps weights + Adam moments of the replica (memory)."""
        if not self.plus:
            return Figures()
        if self._replicas is None:
            moved, memory = 0, 0
            for comp, holders in edge_holders(ctx.num_stages, True).items():
                n = _nbytes({k: v for k, v in ctx.weights(holders[0]).items() if k.startswith(comp + ".")})
                moved += 2 * n
                memory = max(memory, 3 * n)
            self._replicas = Figures(bytes_moved=moved, extra_memory_bytes=memory)
        return Figures() + self._replicas

    def on_failure(self, ctx: StrategyContext, step: int, failed: set[int]) -> FailureOutcome:
        return self.average(ctx, step, failed)

    def average(self, ctx: StrategyContext, step: int, stages: set[int]) -> FailureOutcome:
        """Rebuild `stages` by this rule from the other (live) stages."""
        try:
            plans = plan_recovery(set(stages), ctx.num_stages, self.rule.name, self.cfg.recovery.fallback)
        except UnrecoverableFailure as e:
            ctx.event("fallback", step=step, stage=min(stages), strategy=self.name, fallback="abort", reason=str(e))
            raise
        moved, slowest = apply_plans(ctx, self.name, step, plans)
        fallbacks = [p.fallback for p in plans if p.fallback]
        return FailureOutcome(Figures(bytes_moved=moved, recovery_s=ctx.cost.recovery_s(slowest)),
                              success=not fallbacks, fallback=fallbacks[0] if fallbacks else None,
                              method=self.rule.inner)
