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
the last complete backup (lost steps between n and 2n-1), which every stage then gives its holder anew (the
copies the lost peers held); a lost stage whose holder failed too goes to the storage checkpoint if
configured, else to the declared fallback.
"""

from __future__ import annotations

from dataclasses import dataclass

from checkfree.baselines import BackupPlan, common_windows, plan_backup
from checkfree.config import RunConfig
from checkfree.plans import (BackupPart, BackupSeal, BackupStart, Failure, Holder, Protect, RecoveryPlan, Snapshot,
                             Source)
from checkfree.strategies.base import Figures, StrategyContext
from checkfree.strategies.rollback import InMemoryStrategy

__all__ = ["BaftStrategy", "BackupClock"]


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
        sent = self.sent_from
        completed = sent is not None and step - sent == self.rounds
        if sent is not None and completed:
            self.complete_step, self.sent_from = sent + 1, None
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

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__(cfg)
        self.plans: list[BackupPlan] | None = None
        self.clock = BackupClock()

    @property
    def rounds(self) -> int:
        """n: the steps one backup takes."""
        return self.clock.rounds

    def holder(self, stage: int) -> int:
        last = self.cfg.num_stages - 1
        return stage + 1 if stage < last else last - 1

    def backup_holders(self) -> dict[int, tuple[int, ...]]:
        """Who keeps each stage's backup: the stage itself and its holder."""
        return {s: (s, self.holder(s)) for s in range(self.cfg.num_stages)}

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
        assert self.plans is not None, "no backup planned yet"
        plan = self.plans[stage]
        per = [sum(plan.bytes_in(k, w) for w in range(len(plan.windows))) for k in range(self.rounds)]
        total = sum(per) or 1
        return sum(per[:part]) / total, sum(per[:part + 1]) / total

    def protection_due(self, step: int) -> list[Protect]:
        """After committing `step`: the backup in flight is sealed once its last part has gone, and the next one
        starts."""
        completed, started = self.clock.after(step)
        due: list[Protect] = []
        if completed:
            due.append(BackupSeal(self.clock.complete_step, self.backup_holders()))
        if started:
            due.append(BackupStart(step + 1))
        return due + super().protection_due(step)

    def in_step(self, step: int) -> BackupPart | None:
        """The part of the backup in flight that step `step`'s bubbles carry (None: none)."""
        part, sent = self.clock.part(step), self.clock.sent_from
        if part is None or self.plans is None or sent is None:
            return None
        stages = range(self.cfg.num_stages)
        return BackupPart(sent + 1, part, {s: self.part_bounds(s, part) for s in stages},
                          {s: self.holder(s) for s in stages})

    def interrupted(self) -> None:
        self.clock.abandon()  # an incomplete backup is worthless

    def refill(self, step: int, from_storage: bool) -> tuple[Protect, ...]:
        return (Snapshot(step, self.backup_holders()),)

    def recovery_plan(self, failure: Failure) -> RecoveryPlan:
        copies = failure.copies
        copy_of: dict[int, Source] = {s: Holder(self.holder(s), copies.step) for s in failure.failed
                                      if self.holder(s) in copies.holders(s)}
        lost = sorted(set(failure.failed) - set(copy_of))
        return self.rollback(failure, copy_of, {s: f"stage {s}'s backup holder {self.holder(s)} failed too"
                                                for s in lost})

    # ---- the simulator's prices --------------------------------------------------------
    def step_figures(self, ctx: StrategyContext, step: int) -> Figures:
        """The part of the backup in flight that this step's bubbles carried."""
        k = self.clock.part(step)
        moved = 0 if k is None or self.plans is None else sum(p.bytes_in(k, w) for p in self.plans
                                                               for w in range(len(p.windows)))
        return Figures(bytes_moved=moved)

    def memory(self, sizes: dict[int, int]) -> int:
        """A peer holds its in-flight copy, its own complete backup and its predecessor's."""
        return max((2 * sizes[p] + sum(sizes[s] for s in sizes if self.holder(s) == p) for p in sizes), default=0)

    def refill_bytes(self, plan: RecoveryPlan, sizes: dict[int, int]) -> int:
        """The dead holders' backups of their live predecessors are sent again (from storage: every backup)."""
        if plan.fallback is not None and plan.fallback.name == "checkpoint":
            return sum(sizes.values())
        return sum(sizes[s] for s in sizes if self.holder(s) in plan.failed and s not in plan.failed)
