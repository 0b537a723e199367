"""CheckFree, CheckFree+ and the ablations (uniform, copy, random, identity) as strategies.

Their plan rebuilds every lost stage from its live neighbours (`checkfree.recovery.plan_recovery`); a stage the
rule cannot rebuild (an edge stage under plain CheckFree, two adjacent losses) gets the declared fallback
(``recovery.fallback`` = random | copy | identity | abort). Nothing is stored, so nothing is due after a step.
"""

from __future__ import annotations

from checkfree.config import RunConfig
from checkfree.pipeline import edge_holders
from checkfree.plans import Failure, Fallback, RecoveryPlan
from checkfree.recovery import StateDict, UnrecoverableFailure, get_rule, plan_recovery
from checkfree.strategies.base import Figures, Strategy, StrategyContext

__all__ = ["AveragingStrategy", "average_plan"]


def _nbytes(sd: StateDict) -> int:
    return sum(v.numel() * v.element_size() for v in sd.values())


def average_plan(failure: Failure, num_stages: int, rule: str, fallback: str) -> RecoveryPlan:
    """Rebuild every failed stage by recovery rule `rule` from the other (live) stages; the stages it cannot
    rebuild get `fallback` (abort: a plan with nothing to carry out)."""
    failed = failure.failed
    try:
        rebuilds = plan_recovery(set(failed), num_stages, rule, "random" if fallback == "abort" else fallback)
    except UnrecoverableFailure as e:  # every stage at once: there is nothing to rebuild from
        return RecoveryPlan(failure.step, failed, {}, fallback=Fallback("abort", {min(failed): str(e)}))
    reasons = {p.stage: p.reason for p in rebuilds if p.fallback}
    if reasons and fallback == "abort":
        return RecoveryPlan(failure.step, failed, {}, fallback=Fallback("abort", reasons))
    return RecoveryPlan(failure.step, failed, {p.stage: p for p in rebuilds},
                        fallback=Fallback(fallback, reasons) if reasons else None)


class AveragingStrategy(Strategy):
    """Rebuild lost stages from their live neighbours' weights (a `RecoveryRule` by name)."""

    def __init__(self, cfg: RunConfig, rule: str) -> None:
        super().__init__(cfg)
        self.rule = get_rule(rule)
        self.name, self.plus = rule, self.rule.plus
        self.fails_edges = self.rule.plus  # plain rules: the paper never fails the edge stages
        self._replicas: Figures | None = None

    def recovery_plan(self, failure: Failure) -> RecoveryPlan:
        return average_plan(failure, self.cfg.num_stages, self.rule.name, self.cfg.recovery.fallback)

    def step_figures(self, ctx: StrategyContext, step: int) -> Figures:
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
