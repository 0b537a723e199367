"""REFT: in-memory snapshots every K steps plus RAIM5 XOR parity across groups of stages.

Stages are cut into groups of ``strategy.reft_group`` consecutive stages (the remainder
joins the last group). At a snapshot each peer keeps its own serialized state and one
parity block over its group (`checkfree.baselines.raim5_encode` over `state_to_bytes`),
so it stores ~L + L/(n-1) and sends ~L. One lost stage per group is rebuilt bit-exactly
from the group's survivors (`raim5_recover`); then every stage rolls back to the
snapshot. Two or more losses in a group: storage checkpoint if configured, else the
declared fallback.
"""

from __future__ import annotations

from checkfree.baselines import Raim5Block, raim5_encode, raim5_recover, state_from_bytes, state_to_bytes
from checkfree.config import RunConfig
from checkfree.strategies.base import FailureOutcome, Figures, StrategyContext
from checkfree.strategies.rollback import InMemoryStrategy

__all__ = ["ReftStrategy", "parity_groups"]


def parity_groups(num_stages: int, n: int) -> list[list[int]]:
    """Consecutive groups of n stages; a remainder joins the last group (S < n: one group)."""
    count = max(1, num_stages // n)
    groups = [list(range(g * n, (g + 1) * n)) for g in range(count)]
    groups[-1].extend(range(count * n, num_stages))
    return [[s for s in g if s < num_stages] for g in groups]


class ReftStrategy(InMemoryStrategy):
    name = "reft"
    swarm_rollback = True  # the swarm runs it: snapshots and parity really held by the peers (peers/parity.py)
    snapshots_in_memory = True
    snapshot_companion = True  # the swarm keeps each peer's snapshot in a crash-surviving companion process too

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__(cfg)
        self.every = cfg.strategy.snapshot_every
        self.groups = parity_groups(cfg.num_stages, cfg.strategy.reft_group)
        if any(len(g) < 2 for g in self.groups):
            raise ValueError(f"reft needs at least 2 stages per parity group, got groups {self.groups}")
        self.own: dict[int, bytes] | None = None  # each peer's serialized snapshot
        self.parity: dict[int, Raim5Block] = {}  # each peer's parity block
        self.snap_step = 0
        self.memory = 0

    def group_of(self, stage: int) -> list[int]:
        return next(g for g in self.groups if stage in g)

    def snapshot_due(self, next_step: int) -> bool:
        return next_step % self.every == 0

    def decodable(self, failed: set[int]) -> set[int]:
        """The lost stages rebuilt from their group's parity: the only loss of their group."""
        return {s for s in failed if len(set(self.group_of(s)) & failed) == 1}

    def _snapshot(self, ctx: StrategyContext, next_step: int) -> tuple[int, float]:
        """Serialize every stage and encode parity; returns (bytes sent, slowest peer's send time)."""
        self.own = {s: state_to_bytes(ctx.capture(s, next_step)) for s in range(ctx.num_stages)}
        self.snap_step, moved, slowest = next_step, 0, 0.0
        for g in self.groups:
            for block in raim5_encode([self.own[s] for s in g]):
                self.parity[g[block.holder]] = block
            for s in g:  # s sends one chunk of ~L/(n-1) to each other member
                chunk = -(-len(self.own[s]) // (len(g) - 1))
                moved += chunk * (len(g) - 1)
                slowest = max(slowest, sum(ctx.cost.transfer_s(chunk, s, p) for p in g if p != s))
        self.memory = max(len(self.own[s]) + len(self.parity[s].parity) for s in self.own)
        return moved, slowest

    def protect(self, ctx: StrategyContext, step: int) -> Figures:
        if not self.snapshot_due(step + 1):
            return Figures(extra_memory_bytes=self.memory)
        moved, slowest = self._snapshot(ctx, step + 1)
        return Figures(stall_s=ctx.cost.background_stall_s(slowest, self.every), bytes_moved=moved,
                       extra_memory_bytes=self.memory)

    def reprotect(self, ctx: StrategyContext, step: int) -> int:
        return self._snapshot(ctx, step)[0]

    def on_failure(self, ctx: StrategyContext, step: int, failed: set[int]) -> FailureOutcome:
        lost = set(failed) - self.decodable(failed)
        if self.own is None or not lost:
            return self._rollback(ctx, step, failed, set())
        return self.lost_copies(ctx, step, failed, lost, self.lost_reason(lost),
                                lambda: self._rollback(ctx, step, failed, lost))

    def lost_reason(self, lost: set[int]) -> str:
        return f"stages {sorted(lost)} failed together with another stage of their parity group (groups {self.groups})"

    def _rollback(self, ctx: StrategyContext, step: int, failed: set[int], skip: set[int]) -> FailureOutcome:
        """Rebuild each single loss of a group from parity, then roll everyone back."""
        if self.own is None:
            return self.restore_all(ctx, step, None, 0, failed, {})
        states, moved, slowest = {}, 0, 0.0
        for s in range(ctx.num_stages):
            if s in skip:
                continue
            if s not in failed:
                states[s] = state_from_bytes(self.own[s])
                continue
            g = self.group_of(s)
            idx = {p: i for i, p in enumerate(g)}
            survivors = {idx[p]: self.own[p] for p in g if p != s}
            blocks = {idx[p]: self.parity[p] for p in g if p != s}
            states[s] = state_from_bytes(raim5_recover(idx[s], survivors, blocks))
            # each other member p decodes one chunk from one chunk of every other survivor q,
            # then sends it to the replacement
            chunk = -(-len(self.own[s]) // (len(g) - 1))
            moved += chunk * (len(g) - 1) * (len(g) - 1)
            for p in (p for p in g if p != s):
                gather = max((ctx.cost.transfer_s(chunk, q, p) for q in g if q not in (p, s)), default=0.0)
                slowest = max(slowest, gather + ctx.cost.transfer_s(chunk, p, s))
            # the replacement rebuilds its own parity block: one chunk from each other member
            moved += chunk * (len(g) - 1)
        out = self.restore_all(ctx, step, states, self.snap_step, failed, {s: s for s in failed}, skip, "parity")
        out.figures.bytes_moved = moved  # restore_all priced a plain copy; the parity decode is the real cost
        out.figures.recovery_s = ctx.cost.recovery_s(slowest)
        return out
