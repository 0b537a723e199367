"""Wiring of the attention soft-error guard (checkfree.abft) into a run.

One `AttentionGuard` per stage, persistent across replacements of the stage's worker so
that the fault schedule and the counters cover the whole run. `--inject-soft-errors N`
spreads N faults over the stages (seeded) at random attention-matmul outputs of the
training steps. With `--abft` the guard corrects them; without it they are injected
unchecked (to show what they do). What the guard cannot correct escalates:
recompute the microbatch, then skip the step, then treat the stage as failed.
"""

from __future__ import annotations

from typing import cast

from checkfree.abft import AttentionGuard, Mode, UncorrectableSoftError, install_guard
from checkfree.bitflips import FaultInjector
from checkfree.config import RunConfig
from checkfree.model import derive_seed, plan_stages

__all__ = ["make_guard", "guard_counts", "UncorrectableSoftError", "install_guard", "ESCALATE_AFTER_SKIPS", "SOFT_ERROR_MARK"]

SOFT_ERROR_MARK = "SOFT_ERROR"  # in a peer's step error: an uncorrectable soft error survived a recompute
ESCALATE_AFTER_SKIPS = 2  # consecutive skipped steps caused by one stage before it is treated as failed


def make_guard(cfg: RunConfig, stage: int) -> AttentionGuard | None:
    """The stage's guard, or None when neither guarding nor injection is configured."""
    g = cfg.guard
    if not g.abft and not g.inject_soft_errors and not g.explicit_attention:
        return None
    n = g.inject_soft_errors // cfg.num_stages + (1 if stage < g.inject_soft_errors % cfg.num_stages else 0)
    injector = None
    if n:
        spec = plan_stages(cfg.model.num_layers, cfg.num_stages)[stage]
        calls = spec.num_blocks * cfg.train.num_microbatches * cfg.train.num_steps  # training forwards
        if n > calls:
            raise ValueError(f"cannot inject {n} soft errors into stage {stage}: it makes only {calls} attention calls")
        injector = FaultInjector.random(n, derive_seed(g.seed, "soft-errors", stage), calls=range(calls))
    return AttentionGuard(mode=cast(Mode, g.mode) if g.abft else "off", injector=injector)


def guard_counts(guards: list[AttentionGuard | None]) -> dict[str, int]:
    """Run totals of the guards: injected, detected, corrected, escalated."""
    live = [g for g in guards if g is not None]
    return {k: sum(getattr(g, k) for g in live) for k in ("injected", "detected", "corrected", "escalated")}
