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


class BaftStrategy(InMemoryStrategy):
    name = "baft"

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__(cfg)
        self.plans: list[BackupPlan] | None = None
        self.rounds = 1  # n: steps one backup takes
        self.complete: dict[int, StageState] | None = None  # last complete backup (None: initial state)
        self.complete_step = 0
        self.sending: dict[int, StageState] | None = None  # backup in flight
        self.sent_from = 0  # the step after which the in-flight backup was taken

    def holder(self, stage: int) -> int:
        last = self.cfg.num_stages - 1
        return stage + 1 if stage < last else last - 1

    def _plan(self, ctx: StrategyContext, states: dict[int, StageState]) -> None:
        idle = ctx.cost.idle_windows()
        plans = []
        for s, st in states.items():
            h = self.holder(s)
            # no reserve: the cost model's t_f / t_b already include the stage's own sends
            windows = common_windows(idle[s], idle[h])
            bw = ctx.cost.bandwidth_Bps(s, h)
            try:
                plans.append(plan_backup(_chunks(list(unit_nbytes(st).values()), windows, bw), windows, bw,
                                         self.cfg.strategy.baft_max_iterations))
            except ValueError as e:
                raise ValueError(f"baft: stage {s}'s backup does not fit in the bubbles of "
                                 f"{self.cfg.strategy.baft_max_iterations} step(s); raise --baft-max-iterations ({e})") from e
        self.plans, self.rounds = plans, max(p.iterations for p in plans)

    def _memory(self, ctx: StrategyContext) -> int:
        """A peer holds its in-flight copy, its own complete backup and its predecessor's."""
        size = {s: state_nbytes(st) for s, st in (self.sending or self.complete or {}).items()}
        if not size:
            return 0
        return max(2 * size[p] + sum(size[s] for s in size if self.holder(s) == p) for p in size)

    def protect(self, ctx: StrategyContext, step: int) -> Figures:
        moved = 0
        if self.sending is not None:
            k = step - self.sent_from  # this step's bubbles carried part k-1 of the backup
            moved = sum(p.bytes_in(k - 1, w) for p in self.plans for w in range(len(p.windows)))
            if k == self.rounds:
                self.complete, self.complete_step, self.sending = self.sending, self.sent_from + 1, None
        if self.sending is None:
            self.sending = {s: ctx.capture(s, step + 1) for s in range(ctx.num_stages)}
            self.sent_from = step
            if self.plans is None:
                self._plan(ctx, self.sending)
        return Figures(bytes_moved=moved, extra_memory_bytes=self._memory(ctx))

    def reprotect(self, ctx: StrategyContext, step: int) -> int:
        self.complete = {s: ctx.capture(s, step) for s in range(ctx.num_stages)}
        self.complete_step, self.sending = step, None
        return sum(state_nbytes(st) for st in self.complete.values())

    def on_failure(self, ctx: StrategyContext, step: int, failed: set[int]) -> FailureOutcome:
        self.sending = None  # an incomplete backup is worthless
        sources = {s: self.holder(s) for s in failed if self.holder(s) not in failed}
        lost = set(failed) - set(sources)
        if self.complete is None or not lost:
            return self._rollback(ctx, step, failed, sources, set())
        reason = ", ".join(f"stage {s}'s backup holder {self.holder(s)} failed too" for s in sorted(lost))
        return self.lost_copies(ctx, step, failed, lost, reason,
                                lambda: self._rollback(ctx, step, failed, sources, lost))

    def _rollback(self, ctx: StrategyContext, step: int, failed: set[int], sources: dict[int, int],
                  skip: set[int]) -> FailureOutcome:
        out = self.restore_all(ctx, step, self.complete, self.complete_step, failed, sources, skip)
        if self.complete is not None:  # dead holders' backups of their live predecessors are re-sent
            out.figures.bytes_moved += sum(state_nbytes(self.complete[s]) for s in range(ctx.num_stages)
                                           if self.holder(s) in failed and s not in failed)
        return out
