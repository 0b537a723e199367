"""Who serves which stage: the one record of it on the coordinator, and its only writer.

Each served stage has a primary peer and, with stage groups, more replicas (`group`: the primary first). Every
change of a group's membership starts a new generation (its replicas form a new gloo group for the gradient
reduce). The other parts read the table through its methods and change it through `assign`, `add_replica`,
`leave`, `lose` and `renew`.
"""

from __future__ import annotations

from collections import Counter

__all__ = ["StageTable"]


class StageTable:
    """Stage -> the peers serving it (the primary first), and each group's generation."""

    def __init__(self) -> None:
        self._primary: dict[int, str] = {}
        self._extra: dict[int, list[str]] = {}  # stage -> its replicas beyond the primary
        self._gen: Counter[int] = Counter()
        self.counts = Counter(replicas_joined=0, replicas_lost=0)  # the summary's stage-group figures
        self._epoch = 0  # assignments made in this run (`Assign.epoch`), a takeover's predecessors' included

    # ---- reads -----------------------------------------------------------------------------
    def peer(self, stage: int) -> str:
        """The primary peer of a served `stage`."""
        return self._primary[stage]

    def served(self) -> list[int]:
        return sorted(self._primary)

    def primaries(self) -> dict[int, str]:
        """Stage -> its primary peer (a copy)."""
        return dict(sorted(self._primary.items()))

    def group(self, stage: int) -> list[str]:
        """Every peer serving `stage`, the primary first (empty: nobody serves it)."""
        return [self._primary[stage], *self._extra.get(stage, [])] if stage in self._primary else []

    def groups(self) -> dict[int, list[str]]:
        return {s: self.group(s) for s in self.served()}

    def stage_of(self, pid: str) -> int:
        """The stage `pid` serves (-1: none)."""
        return next((s for s in self._primary if pid in self.group(s)), -1)

    def grouped(self) -> bool:
        """Whether some stage has more than one replica now (a step runs as a group step)."""
        return any(self._extra.values())

    def replica_counts(self, num_stages: int) -> list[int]:
        return [len(self.group(s)) for s in range(num_stages)]

    def generation(self, stage: int) -> int:
        return self._gen[stage]

    # ---- changes ---------------------------------------------------------------------------
    def next_epoch(self) -> int:
        """The epoch of an assignment made now: later than every one made before in the run."""
        self._epoch += 1
        return self._epoch

    def epochs_seen(self, epoch: int) -> None:
        """A takeover: the peers serve under assignments up to `epoch`; the next ones come after."""
        self._epoch = max(self._epoch, epoch)

    def assign(self, stage: int, pid: str) -> None:
        """`pid` serves `stage` now, as its primary (a new stage, or a handover's replacement)."""
        self._primary[stage] = pid

    def add_replica(self, stage: int, pid: str) -> None:
        """`pid` joins `stage`'s group."""
        self._extra.setdefault(stage, []).append(pid)
        self._gen[stage] += 1
        self.counts["replicas_joined"] += 1

    def leave(self, stage: int, pid: str, *, lost: bool = False) -> list[str]:
        """Take `pid` out of `stage`'s group (a sibling remains: the primary if `pid` was); the replicas left.
        `lost`: it is gone (counted), not moved."""
        rest = [p for p in self.group(stage) if p != pid]
        self._primary[stage], self._extra[stage] = rest[0], rest[1:]
        self._gen[stage] += 1
        self.counts["replicas_lost"] += lost
        return rest

    def lose(self, stage: int) -> list[str]:
        """Every peer of `stage` is gone (a failed stage); the peers it had."""
        gone = self.group(stage)
        self._primary.pop(stage, None)
        self._extra.pop(stage, None)
        self._gen[stage] += 1
        return gone

    def renew(self, stage: int) -> None:
        """`stage`'s group is broken (a reduce failed in it): its replicas form a new one."""
        self._gen[stage] += 1
