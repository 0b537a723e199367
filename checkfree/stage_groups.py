"""Stage groups: several data-parallel replicas serve one stage. Pure functions shared by the coordinator (which
replica computes which microbatch, where a joining peer goes, a lost replica's microbatches moved to a sibling)
and the simulator (the same table, for its `replica_lost` / `rerouted` events).

Every microbatch of a step visits every stage once (CheckFree+ swaps only reorder them), so a step's table names
one replica per stage for each microbatch: `hops[mb][i]` is the peer of the microbatch's i-th hop. The
replicas of a stage split the step's M microbatches in proportion to their measured speed (microbatches per
second of computing in the last step; equal shares until measured), interleaved so that every replica starts
at once; the replicas then sum their gradients, so the step's update is the whole batch's, as with one peer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["spread", "hop_table", "move", "slowest", "stage_load", "check_swarm_groups"]


def check_swarm_groups(cfg) -> None:
    """Refuse (ValueError) stage groups the swarm does not run: they run with the averaging strategies only (a
    rollback or redundancy strategy keeps one peer per stage)."""
    from checkfree.strategies import build_strategy
    from checkfree.strategies.averaging import AveragingStrategy

    t = cfg.train
    if t.stage_groups and not isinstance(build_strategy(cfg), AveragingStrategy):
        raise ValueError(f"stage groups (--replicas {t.replicas}, --reserve {t.reserve}) run in the swarm with the "
                         f"averaging strategies (checkfree, checkfree+, uniform, copy, random); "
                         f"{cfg.recovery.strategy} keeps one peer per stage")


def _speeds(replicas: Sequence[str], speeds: Mapping[str, float] | None) -> dict[str, float]:
    """Each replica's speed; an unknown or non-positive one counts as the mean of the known (1.0 when none is)."""
    speeds = speeds or {}
    known = [speeds[r] for r in replicas if speeds.get(r, 0) > 0]
    mean = sum(known) / len(known) if known else 1.0
    return {r: speeds[r] if speeds.get(r, 0) > 0 else mean for r in replicas}


def spread(num_microbatches: int, replicas: Sequence[str], speeds: Mapping[str, float] | None = None) -> list[str]:
    """The replica that computes each microbatch of one stage: one each first (while there are microbatches: every
    replica keeps being measured), then each next microbatch to the replica that would finish its share soonest
    ((count + 1) / speed), ties to the earlier one in `replicas`. Unknown or non-positive speeds count as the mean
    of the known ones (all equal when none is known)."""
    if not replicas:
        raise ValueError("a stage group needs at least one replica")
    w = _speeds(replicas, speeds)
    counts = dict.fromkeys(replicas, 0)
    order = {r: i for i, r in enumerate(replicas)}
    out = []
    for mb in range(num_microbatches):
        r = replicas[mb] if mb < len(replicas) else min(replicas, key=lambda x: ((counts[x] + 1) / w[x], order[x]))
        counts[r] += 1
        out.append(r)
    return out


def hop_table(routes: Sequence[Sequence[int]], groups: Mapping[int, Sequence[str]],
              speeds: Mapping[str, float] | None = None) -> list[list[str]]:
    """The peer of every hop of every microbatch (`routes[mb]` lists its stages in visiting order)."""
    by_stage = {s: spread(len(routes), g, speeds) for s, g in groups.items()}
    return [[by_stage[s][mb] for s in stages] for mb, stages in enumerate(routes)]


def move(hops: list[list[str]], dead: str, to: str) -> list[int]:
    """Give every hop of `dead` to its sibling `to` (in place); the microbatches moved."""
    moved = []
    for mb, peers in enumerate(hops):
        for i, p in enumerate(peers):
            if p == dead:
                peers[i] = to
                moved.append(mb)
    return moved


def stage_load(num_microbatches: int, replicas: Sequence[str], speeds: Mapping[str, float]) -> float:
    """Seconds a stage group needs for a step's microbatches: M over the sum of its replicas' speeds (unknown
    speeds: the mean of the known)."""
    if not replicas:
        return float(num_microbatches)
    return num_microbatches / sum(_speeds(replicas, speeds).values())


def slowest(groups: Mapping[int, Sequence[str]], num_microbatches: int, speeds: Mapping[str, float]) -> int:
    """The stage a new replica helps most: the group with the longest measured step share (before any
    measurement: the fewest replicas), ties to the lower stage."""
    return max(sorted(groups), key=lambda s: (stage_load(num_microbatches, groups[s], speeds), -s))
