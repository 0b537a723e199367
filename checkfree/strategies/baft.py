"""BAFT: neighbour backups scheduled into GPipe's pipeline bubbles.

Stage i's backup lives on stage i+1; the last stage's on stage S-2 (in GPipe the last and
the first stage share no idle window when M >= S-1, so a ring cannot carry it). Each
backup is cut into units (embedding, each block, head: weights + Adam state; a unit larger
than the largest window is cut into window-sized chunks) packed into
the common idle windows of sender and holder (`checkfree.baselines.plan_backup`, windows
from the cost model's t_f / t_b, which include the stages' own sends); when one step's
bubbles are too short the backup is spread over n steps (n = the largest over stages, so
every stage's backup of the same step completes together). A backup counts only once
complete; the previous one is kept until then. On a failure every stage rolls back to
the last complete backup (lost steps between n and 2n-1); a lost stage whose holder
failed too goes to the storage checkpoint if configured, else to the declared fallback.
"""

from __future__ import annotations

from dataclasses import dataclass

from checkfree.baselines import BackupPlan, common_windows, plan_backup
from checkfree.config import RunConfig
from checkfree.strategies.base import FailureOutcome, Figures, StrategyContext
from checkfree.strategies.rollback import InMemoryStrategy
from checkfree.strategies.state import StageState, state_nbytes, unit_nbytes

__all__ = ["BaftStrategy"]


def _chunks(units: list[int], windows: list[tuple[float, float]], bandwidth: float) -> list[int]:
    """Cut units larger than the largest window can carry into window-sized chunks."""
    cap = int(max((b - a for a, b in windows), default=0.0) * bandwidth)
    if cap <= 0:
        return units  # no window at all: plan_backup reports it
    return [min(cap, u - i) for u in units for i in range(0, max(u, 1), cap)]


@dataclass
class BackupClock:
    """When BAFT's backups start, travel and complete, step by step (the simulator's strategy and the swarm's
    coordinator both keep one). A backup is taken as of the step after `sent_from`; the bubbles of the next
    `rounds` steps carry parts 0 .. rounds-1; it is complete after the last of them."""

    rounds: int = 1
    sent_from: int | None = None  # the backup in flight was taken after this step (None: none in flight)
    complete_step: int = 0  # the step the last complete backup resumes (0: the initial state)

    def after(self, step: int) -> tuple[bool, bool]:
        """After `step` is committed: (the backup in flight is complete now, a new one is taken now)."""
        completed = self.sent_from is not None and step - self.sent_from == self.rounds
        if completed:
            self.complete_step, self.sent_from = self.sent_from + 1, None
        started = self.sent_from is None
        if started:
            self.sent_from = step
        return completed, started

    def part(self, step: int) -> int | None:
        """The part of the backup in flight that the bubbles of step `step` carry (None: none)."""
        k = None if self.sent_from is None else step - self.sent_from - 1
        return k if k is not None and 0 <= k < self.rounds else None

    def abandon(self) -> None:
        """A failure: an incomplete backup is worthless."""
        self.sent_from = None


class BaftStrategy(InMemoryStrategy):
    name = "baft"
    swarm_rollback = True  # the swarm runs it: backups really sent in the bubbles (peers/backups.py)
    snapshots_in_memory = True

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__(cfg)
        self.plans: list[BackupPlan] | None = None
        self.clock = BackupClock()
        self.complete: dict[int, StageState] | None = None  # last complete backup (None: initial state)
        self.sending: dict[int, StageState] | None = None  # backup in flight

    @property
    def rounds(self) -> int:
        """n: the steps one backup takes."""
        return self.clock.rounds

    def holder(self, stage: int) -> int:
        last = self.cfg.num_stages - 1
        return stage + 1 if stage < last else last - 1

    @staticmethod
    def restore_source(stage: int, live_holders: list[int], cost) -> int:
        """A lost stage's backup comes from its one holder."""
        return live_holders[0]

    def plan_units(self, cost, units: dict[int, list[int]]) -> None:
        """Plan every stage's backup (its units' bytes: embedding, blocks, head, each with its Adam state) into
        the common bubbles of sender and holder; sets `rounds`."""
        idle = cost.idle_windows()
        plans = []
        for s, sizes in sorted(units.items()):
            h = self.holder(s)
            # no reserve: the cost model's t_f / t_b already include the stage's own sends
            windows = common_windows(idle[s], idle[h])
            bw = cost.bandwidth_Bps(s, h)
            try:
                plans.append(plan_backup(_chunks(list(sizes), windows, bw), windows, bw,
                                         self.cfg.strategy.baft_max_iterations))
            except ValueError as e:
                raise ValueError(f"baft: stage {s}'s backup does not fit in the bubbles of "
                                 f"{self.cfg.strategy.baft_max_iterations} step(s); raise --baft-max-iterations ({e})") from e
        self.plans = plans
        self.clock.rounds = max(p.iterations for p in plans)

    def part_bounds(self, stage: int, part: int) -> tuple[float, float]:
        """The share [lo, hi) of `stage`'s backup that part `part` carries: the plan's bytes of that step."""
        plan = self.plans[stage]
        per = [sum(plan.bytes_in(k, w) for w in range(len(plan.windows))) for k in range(self.rounds)]
        total = sum(per) or 1
        return sum(per[:part]) / total, sum(per[:part + 1]) / total

    def _plan(self, ctx: StrategyContext, states: dict[int, StageState]) -> None:
        self.plan_units(ctx.cost, {s: list(unit_nbytes(st).values()) for s, st in states.items()})

    def _memory(self, ctx: StrategyContext) -> int:
        """A peer holds its in-flight copy, its own complete backup and its predecessor's."""
        size = {s: state_nbytes(st) for s, st in (self.sending or self.complete or {}).items()}
        if not size:
            return 0
        return max(2 * size[p] + sum(size[s] for s in size if self.holder(s) == p) for p in size)

    @property
    def complete_step(self) -> int:
        return self.clock.complete_step

    def protect(self, ctx: StrategyContext, step: int) -> Figures:
        k = self.clock.part(step)  # the part this step's bubbles carried
        moved = 0 if k is None else sum(p.bytes_in(k, w) for p in self.plans for w in range(len(p.windows)))
        completed, started = self.clock.after(step)
        if completed:
            self.complete, self.sending = self.sending, None
        if started:
            self.sending = {s: ctx.capture(s, step + 1) for s in range(ctx.num_stages)}
            if self.plans is None:
                self._plan(ctx, self.sending)
        return Figures(bytes_moved=moved, extra_memory_bytes=self._memory(ctx))

    def reprotect(self, ctx: StrategyContext, step: int) -> int:
        self.complete = {s: ctx.capture(s, step) for s in range(ctx.num_stages)}
        self.clock.complete_step, self.sending = step, None
        self.clock.abandon()
        return sum(state_nbytes(st) for st in self.complete.values())

    def on_failure(self, ctx: StrategyContext, step: int, failed: set[int]) -> FailureOutcome:
        self.sending = None  # an incomplete backup is worthless
        self.clock.abandon()
        sources = {s: self.holder(s) for s in failed if self.holder(s) not in failed}
        lost = set(failed) - set(sources)
        if self.complete is None or not lost:
            return self._rollback(ctx, step, failed, sources, set())
        return self.lost_copies(ctx, step, failed, lost, self.lost_reason(lost),
                                lambda: self._rollback(ctx, step, failed, sources, lost))

    def lost_reason(self, lost: set[int]) -> str:
        return ", ".join(f"stage {s}'s backup holder {self.holder(s)} failed too" for s in sorted(lost))

    def _rollback(self, ctx: StrategyContext, step: int, failed: set[int], sources: dict[int, int],
                  skip: set[int]) -> FailureOutcome:
        out = self.restore_all(ctx, step, self.complete, self.complete_step, failed, sources, skip)
        if self.complete is not None:  # dead holders' backups of their live predecessors are re-sent
            out.figures.bytes_moved += sum(state_nbytes(self.complete[s]) for s in range(ctx.num_stages)
                                           if self.holder(s) in failed and s not in failed)
        return out
