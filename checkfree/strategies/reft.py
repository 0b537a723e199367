"""REFT: in-memory snapshots every K steps plus RAIM5 XOR parity across groups of stages.

Stages are cut into parity groups of ``strategy.reft_group`` consecutive stages (the remainder
joins the last group). At a snapshot each peer keeps its own serialized state and one
parity block over its group (`checkfree.baselines.raim5_encode` over `state_to_bytes`),
so it stores ~L + L/(n-1) and sends ~L. One lost stage per group is rebuilt bit-exactly
from the group's survivors (`raim5_recover`), whose replacement then holds its snapshot and parity block
again; every stage rolls back to the snapshot. Two or more losses in a group (or a member that holds no
snapshot): storage checkpoint if configured, else the declared fallback.
"""

from __future__ import annotations

from checkfree.config import RunConfig
from checkfree.plans import Copies, Failure, Parity, ParitySnapshot, Protect, RecoveryPlan, Source
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
    peer_service = "companion"  # the swarm keeps each peer's snapshot in a crash-surviving companion process too
    names_complete_rounds = True  # a round left incomplete (a member lost mid-round) replaces no peer's copy

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__(cfg)
        self.parity_groups = parity_groups(cfg.num_stages, cfg.strategy.reft_group)
        if any(len(g) < 2 for g in self.parity_groups):
            raise ValueError(f"reft needs at least 2 stages per parity group, got groups {self.parity_groups}")

    def group_of(self, stage: int) -> list[int]:
        return next(g for g in self.parity_groups if stage in g)

    def snapshot(self, step: int) -> ParitySnapshot:
        return ParitySnapshot(step, tuple(tuple(g) for g in self.parity_groups))

    def protection_due(self, step: int) -> list[Protect]:
        due: list[Protect] = [self.snapshot(step + 1)] if (step + 1) % self.every == 0 else []
        return due + super().protection_due(step)

    def decodable(self, failed: frozenset[int] | set[int], copies: Copies) -> set[int]:
        """The lost stages rebuilt from their group's parity: the only loss of their group, every other member of
        which holds its snapshot and parity block."""
        return {s for s in failed if len(set(self.group_of(s)) & set(failed)) == 1
                and all(copies.holders(m) for m in self.group_of(s) if m != s)}

    def recovery_plan(self, failure: Failure) -> RecoveryPlan:
        step = failure.copies.step
        copy_of: dict[int, Source] = {s: Parity(tuple(self.group_of(s)), step)
                                      for s in self.decodable(failure.failed, failure.copies)}
        lost = sorted(set(failure.failed) - set(copy_of))
        reason = f"stages {lost} failed together with another stage of their parity group (groups {self.parity_groups})"
        return self.rollback(failure, copy_of, {s: reason for s in lost})

    def refill(self, step: int, from_storage: bool) -> tuple[Protect, ...]:
        """From storage, every snapshot and parity block anew (a decode refills the lost member's by itself)."""
        return (self.snapshot(step),) if from_storage else ()

    def refill_bytes(self, plan: RecoveryPlan, sizes: dict[int, int]) -> int:
        """After a rollback from storage: every snapshot and its parity chunks anew."""
        return sum(-(-sizes[s] // (len(g) - 1)) * (len(g) - 1) for g in self.parity_groups for s in g)
