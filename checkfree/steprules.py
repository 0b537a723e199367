"""What a step's outcome means, written once for the simulator (`checkfree.simulator`) and the coordinator
(`coordinator.step_driver`, `coordinator.coordinator`): when uncorrectable soft errors make a stage count as failed, and
what each stage's commit result (its `StepStats`, or a peer's COMMIT reply) asks of the run.

Both take an ``event(name, **fields)`` callable: each caller adds its own fields (the simulator the strategy,
the coordinator the peer id), so the rule and the event names live here and only here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from checkfree.softerrors import ESCALATE_AFTER_SKIPS

__all__ = ["StageUpdate", "apply_commits", "SoftErrorRule"]

Event = Callable[..., None]


@dataclass(frozen=True)
class StageUpdate:
    """One stage's result of applying a step's update.

    ``skipped``: the gradient was not finite, the update was not applied and the stage's omega is kept;
    ``weights_finite``: False when the stage's weights broke (the stage is then treated as failed);
    ``omega``: the stage's gradient norm, what a later CheckFree recovery weighs it by."""

    stage: int
    omega: float
    skipped: bool
    weights_finite: bool


def apply_commits(commits: Iterable[StageUpdate], norms: list[float] | None, event: Event) -> set[int]:
    """Record a committed step: every stage that updated keeps its omega in ``norms`` (the simulator's; the
    swarm's peers keep their own: None); a skipped update is
    reported (``skipped_step``); a stage whose weights are no longer finite is reported
    (``nonfinite_weights``) and returned among the stages to recover before the next step."""
    failed: set[int] = set()
    for c in commits:
        if not c.weights_finite:
            event("nonfinite_weights", stage=c.stage)
            failed.add(c.stage)
        if c.skipped:
            event("skipped_step", stage=c.stage, reason="non-finite gradient")
        elif norms is not None:
            norms[c.stage] = c.omega
    return failed


class SoftErrorRule:
    """Steps lost in a row to uncorrectable soft errors, per stage. Each loss is reported
    (``soft_error_skip``); a stage that causes ``ESCALATE_AFTER_SKIPS`` of them in a row is reported
    (``soft_error_escalation``) and is to be treated as failed. A committed step clears the count."""

    def __init__(self) -> None:
        self._lost: dict[int, int] = {}

    def lost(self, stage: int, event: Event, **fields) -> bool:
        """Count a step lost to ``stage``; True when the stage is now to be treated as failed."""
        n = self._lost.get(stage, 0) + 1
        event("soft_error_skip", stage=stage, **fields)
        if n < ESCALATE_AFTER_SKIPS:
            self._lost[stage] = n
            return False
        self._lost.pop(stage, None)
        event("soft_error_escalation", stage=stage)
        return True

    def clear(self) -> None:
        """A step was committed: no stage has lost one in a row."""
        self._lost.clear()
