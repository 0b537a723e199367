"""The failure model: per-stage, per-step Bernoulli failures from a seed, or a trace.

A failure of stage s at step t means the stage's peer is gone at the start of step t;
the stage is rebuilt and step t then runs. Several stages may fail in one step. A trace
file holds one `step,stage` line per failure (stages 0..S-1; `#` comments allowed), so
every strategy can replay exactly the same failures.

With stage groups (several replicas per stage, `train.replicas`), a trace line may carry a third
column: `step,stage` is the loss of one replica of the stage (lossless while a sibling lives),
`step,stage,all` the loss of the whole group (a stage failure: the strategy recovers it). With one
peer per stage the two are the same.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np

from checkfree.config import FailureConfig

__all__ = ["per_step_probability", "bernoulli_schedule", "read_trace", "read_trace_scopes", "write_trace",
           "FailureSchedule", "schedule_from_config"]


def per_step_probability(hourly_rate: float, iteration_time_s: float) -> float:
    """p = 1 - (1 - h)^(T / 3600): an hourly failure probability as one per iteration."""
    if not 0.0 <= hourly_rate < 1.0:
        raise ValueError(f"hourly failure rate must be in [0, 1), got {hourly_rate}")
    if iteration_time_s <= 0:
        raise ValueError(f"iteration time must be positive, got {iteration_time_s}")
    return 1.0 - (1.0 - hourly_rate) ** (iteration_time_s / 3600.0)


def bernoulli_schedule(num_stages: int, num_steps: int, p: float, seed: int,
                       protect: frozenset[int] = frozenset()) -> list[tuple[int, int]]:
    """Independent failures with probability p per stage per step; `protect` never fail."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"failure probability must be in [0, 1], got {p}")
    events: list[tuple[int, int]] = []
    for step in range(num_steps):
        draws = np.random.default_rng([seed, step]).random(num_stages)
        events.extend((step, s) for s in range(num_stages) if draws[s] < p and s not in protect)
    return events


def read_trace(path: str | Path, num_stages: int | None = None) -> list[tuple[int, int]]:
    """Parse a `step,stage[,all]` trace into its (step, stage) failures; errors name the file and line."""
    return read_trace_scopes(path, num_stages)[0]


def read_trace_scopes(path: str | Path, num_stages: int | None = None) -> tuple[list[tuple[int, int]],
                                                                                set[tuple[int, int]]]:
    """Parse a `step,stage[,all]` trace: its (step, stage) failures, and those whose third column says `all`
    (the whole stage group lost; the others lose one replica). Errors name the file and line."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"failure trace {str(p)!r} does not exist")
    events, whole = [], set()
    for lineno, line in enumerate(p.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line or line.replace(" ", "") in ("step,stage", "step,stage,scope"):
            continue
        parts = [x.strip() for x in line.split(",")]
        if len(parts) not in (2, 3) or not all(x.lstrip("-").isdigit() for x in parts[:2]) or (
                len(parts) == 3 and parts[2] not in ("all", "one")):
            raise ValueError(f"{p}:{lineno}: expected 'step,stage' with two integers (and optionally ',all' or "
                             f"',one'), got {line!r}")
        step, stage = int(parts[0]), int(parts[1])
        if step < 0 or stage < 0 or (num_stages is not None and stage >= num_stages):
            raise ValueError(f"{p}:{lineno}: step must be >= 0 and stage in 0..{(num_stages or 1) - 1}, got {line!r}")
        events.append((step, stage))
        if len(parts) == 3 and parts[2] == "all":
            whole.add((step, stage))
    return sorted(set(events)), whole


def write_trace(path: str | Path, events: list[tuple[int, int]],
                whole: set[tuple[int, int]] | frozenset = frozenset()) -> None:
    """A trace file of `events`; those in `whole` carry the third column `all` (a stage group's loss)."""
    Path(path).write_text("step,stage\n" + "".join(f"{t},{s}{',all' if (t, s) in whole else ''}\n"
                                                    for t, s in sorted(events)))


class FailureSchedule:
    """Which stages fail at the start of each step; `whole`: the (step, stage) failures that take the stage's
    whole group of replicas (the others take one replica)."""

    def __init__(self, events: list[tuple[int, int]], whole: set[tuple[int, int]] | frozenset = frozenset()) -> None:
        self.events = sorted(set(events))
        self.whole = frozenset(whole)
        self._by_step: dict[int, set[int]] = defaultdict(set)
        for t, s in self.events:
            self._by_step[t].add(s)

    def at(self, step: int) -> set[int]:
        return set(self._by_step.get(step, ()))

    def all_of(self, step: int, stage: int) -> bool:
        """Whether the failure of `stage` at `step` takes its whole group of replicas."""
        return (step, stage) in self.whole


def schedule_from_config(cfg: FailureConfig, num_stages: int, num_steps: int, plus: bool) -> FailureSchedule:
    """The run's schedule: the trace if given, else Bernoulli failures at the configured rate.

    Plain strategies cannot recover edge stages, and in the paper's runs edge stages never
    fail under plain CheckFree: unless `protect_edges` says otherwise, the first and last
    stage are protected for strategies without CheckFree+."""
    if cfg.trace:
        return FailureSchedule(*read_trace_scopes(cfg.trace, num_stages))
    p = per_step_probability(cfg.hourly_rate, cfg.iteration_time_s) if cfg.hourly_rate is not None else cfg.rate
    protect_edges = (not plus) if cfg.protect_edges is None else cfg.protect_edges
    protect = frozenset({0, num_stages - 1}) if protect_edges else frozenset()
    return FailureSchedule(bernoulli_schedule(num_stages, num_steps, p, cfg.seed, protect))
