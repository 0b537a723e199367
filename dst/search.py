"""Many schedules: hypothesis draws them from a seed, each runs (`dst.run.run_schedule`), a divergent one is shrunk.

`explore(n, seed, ...)` runs `n` schedules. Hypothesis generates them from `seed` (the same seed gives the same
schedules as long as their outcomes are the same); when one diverges, hypothesis shrinks it (every candidate
is a run) for at most `shrink_s` seconds, the smallest divergent schedule found is replayed once more to see
that it reproduces, and the search goes on with the schedules left, from a seed derived from the first. A
schedule's outcome is remembered, so hypothesis asking for the same schedule twice costs one run.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import seed as hseed

from dst.generate import schedules
from dst.run import Outcome, run_schedule
from dst.schedule import Schedule

__all__ = ["Divergence", "Found", "Report", "explore", "replay"]


class Divergence(AssertionError):
    """A schedule broke an invariant (raised for hypothesis, which then shrinks the schedule)."""


@dataclass
class Found:
    """A divergence: the schedule that first showed it, the smallest one shrinking found, and whether replaying
    that one diverged again."""

    first: Outcome
    index: int  # its number among the run's schedules (0-based)
    seed: int  # the hypothesis seed of the part of the search it came from
    shrunk: Outcome | None = None
    replayed: Outcome | None = None


@dataclass
class Report:
    schedules: int = 0
    faults: int = 0
    found: list[Found] = field(default_factory=list)
    seconds: float = 0.0
    rss_mb: list[float] = field(default_factory=list)
    shrink_runs: int = 0


def explore(n: int, seed: int, workdir: Path, cache_dir: str | None = None, *, shrink_s: float = 600.0,
            stop_at_first: bool = False, on_outcome: Callable[[int, Outcome], None] | None = None,
            max_faults: int = 4, tier: str = "inprocess") -> Report:
    """Run `n` generated schedules (see the module docstring) in a tier: "inprocess" (dst.run) or "real"
    (`checkfree local`, dst.real)."""
    report, t0, part = Report(), time.perf_counter(), 0
    while report.schedules < n and not (stop_at_first and report.found):
        part_seed = seed if part == 0 else seed * 1_000_003 + part
        before = report.schedules
        _search(n - report.schedules, part_seed, workdir / f"part{part}", cache_dir, report, shrink_s, on_outcome,
                max_faults, tier)
        part += 1
        if report.schedules == before:  # (hypothesis drew nothing new: the space is spent)
            break
    report.seconds = time.perf_counter() - t0
    return report


def _search(n: int, seed: int, workdir: Path, cache_dir: str | None, report: Report, shrink_s: float,
            on_outcome: Callable[[int, Outcome], None] | None, max_faults: int, tier: str) -> None:
    """One hypothesis run: up to `n` schedules until the first divergence, which it then shrinks."""
    run = _runner(tier)
    seen: dict[str, Outcome] = {}
    failing: list[Outcome] = []
    state = {"shrinking_since": None}

    def check(schedule: Schedule) -> None:
        key = schedule.to_json()
        outcome = seen.get(key)
        if outcome is None:
            shrinking = state["shrinking_since"] is not None
            if shrinking and time.perf_counter() - state["shrinking_since"] > shrink_s:
                return  # out of shrinking time: candidates not run count as passing (the smallest so far stands)
            index = report.schedules if not shrinking else -1
            outcome = run(schedule, workdir / (f"{index:05d}" if not shrinking else f"shrink{len(seen):04d}"),
                          cache_dir)
            seen[key] = outcome
            if shrinking:
                report.shrink_runs += 1
            else:
                report.schedules += 1
                report.faults += len(outcome.fired)
                report.rss_mb.append(outcome.rss_mb)
                if on_outcome is not None:
                    on_outcome(index, outcome)
                if outcome.divergences:
                    report.found.append(Found(outcome, index, seed))
                    state["shrinking_since"] = time.perf_counter()
        if outcome.divergences:
            failing.append(outcome)
            raise Divergence(outcome.divergences[0])

    test = given(schedules(max_faults, tier))(check)
    settings(max_examples=n, database=None, deadline=None, derandomize=False, report_multiple_bugs=False,
             suppress_health_check=list(HealthCheck), verbosity=Verbosity.quiet,
             phases=[Phase.generate, Phase.shrink] if shrink_s > 0 else [Phase.generate])(test)
    try:
        hseed(seed)(test)()
    except Divergence:
        pass
    if report.found and report.found[-1].seed == seed and failing:
        found = report.found[-1]
        found.shrunk = min(failing, key=lambda o: _size(o.schedule))
        found.replayed = replay(found.shrunk.schedule, workdir / "replay", cache_dir, tier)


def _runner(tier: str) -> Callable[[Schedule, Path, str | None], Outcome]:
    if tier == "real":
        from dst.real import run_real

        return run_real
    return run_schedule


def _size(s: Schedule) -> tuple:
    """How big a schedule is, for picking the smallest divergent one: faults, then stages, replicas, steps."""
    return len(s.faults), s.setup.stages * s.setup.replicas, s.setup.steps, s.to_json()


def replay(schedule: Schedule, workdir: Path, cache_dir: str | None = None, tier: str = "inprocess") -> Outcome:
    """Run `schedule` once more (nothing remembered), keeping its run directories."""
    if tier == "real":
        return _runner(tier)(schedule, workdir, cache_dir)
    return run_schedule(schedule, workdir, cache_dir, keep=True)
