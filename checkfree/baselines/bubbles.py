"""BAFT: neighbour backups scheduled into GPipe pipeline bubbles, and ring survival.

Pure functions. Times are in any consistent unit (seconds), sizes in bytes, bandwidth in
bytes per time unit. A *window* is a ``(start, end)`` pair with ``start <= end`` measured
from the start of one training iteration; the same windows recur every iteration.

* :func:`gpipe_idle_windows`: per-stage idle windows of one GPipe iteration (S stages,
  M microbatches): stage i idles i*t_f at the start, (S-1-i)(t_f+t_b) between its last
  forward and first backward, and i*t_b at the end; bubble fraction (S-1)/(M+S-1).
* :func:`common_windows`: when both a stage and its neighbour are idle, minus a reserve.
* :func:`plan_backup`: first-fit-decreasing packing of whole layers into windows,
  spilling into later iterations; raises ValueError if ``max_iterations`` do not suffice.
* :func:`ring_survival`: (S/(S-k)) C(S-k, k) / C(S, k) and a brute force (no two failed
  stages ring-adjacent, since stage i's backup lives on stage i+1 mod S).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "Window",
    "LayerSlot",
    "BackupPlan",
    "gpipe_iteration_time",
    "gpipe_bubble_fraction",
    "gpipe_idle_windows",
    "common_windows",
    "plan_backup",
    "ring_survival",
    "ring_survival_bruteforce",
]

Window = tuple[float, float]


def _check_gpipe(S: int, M: int, t_f: float, t_b: float) -> None:
    if S < 1 or M < 1:
        raise ValueError(f"need S >= 1 stages and M >= 1 microbatches, got S={S}, M={M}")
    if t_f < 0 or t_b < 0:
        raise ValueError(f"per-microbatch times must be >= 0, got t_f={t_f}, t_b={t_b}")


def gpipe_iteration_time(S: int, M: int, t_f: float, t_b: float) -> float:
    """Length of one GPipe iteration (flush included): (M + S - 1)(t_f + t_b)."""
    _check_gpipe(S, M, t_f, t_b)
    return (M + S - 1) * (t_f + t_b)


def gpipe_bubble_fraction(S: int, M: int) -> float:
    """Idle fraction of every stage in GPipe: (S - 1) / (M + S - 1)."""
    _check_gpipe(S, M, 0.0, 0.0)
    return (S - 1) / (M + S - 1)


def gpipe_idle_windows(S: int, M: int, t_f: float, t_b: float) -> list[list[Window]]:
    """Idle windows of each stage within one iteration, sorted; zero-length windows omitted.

    Stage i runs forwards on [i t_f, (i+M) t_f] and backwards on
    [(M+S-1) t_f + (S-1-i) t_b, (M+S-1) t_f + (S-1-i+M) t_b]; the iteration ends at
    (M+S-1)(t_f+t_b).
    """
    T = gpipe_iteration_time(S, M, t_f, t_b)
    out = []
    for i in range(S):
        fwd_end = (i + M) * t_f
        bwd_start = (M + S - 1) * t_f + (S - 1 - i) * t_b
        bwd_end = bwd_start + M * t_b
        spans = [(0.0, i * t_f), (fwd_end, bwd_start), (bwd_end, T)]
        out.append([(float(a), float(b)) for a, b in spans if b > a])
    return out


def _merge(windows: Sequence[Window]) -> list[Window]:
    """Sorted union of windows (overlapping or touching windows are fused)."""
    merged: list[list[float]] = []
    for a, b in sorted(windows):
        if b < a:
            raise ValueError(f"window end before start: {(a, b)}")
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def common_windows(a: Sequence[Window], b: Sequence[Window], reserve: float = 0.0) -> list[Window]:
    """Windows where both ``a`` and ``b`` are idle, each shrunk by ``reserve`` at both ends.

    ``reserve`` keeps room for the pipeline's own traffic; windows shorter than
    ``2 * reserve`` vanish. Result sorted, disjoint, all of positive length.
    """
    if reserve < 0:
        raise ValueError(f"reserve must be >= 0, got {reserve}")
    out = []
    for (a0, a1), (b0, b1) in itertools.product(_merge(a), _merge(b)):
        lo, hi = max(a0, b0) + reserve, min(a1, b1) - reserve
        if hi > lo:
            out.append((lo, hi))
    return sorted(out)


@dataclass(frozen=True)
class LayerSlot:
    """Layer ``layer`` is sent in ``window`` (index) of iteration ``iteration`` during [start, end]."""

    layer: int
    iteration: int
    window: int
    start: float
    end: float
    nbytes: int


@dataclass(frozen=True)
class BackupPlan:
    """Assignment of every layer to exactly one (iteration, window); ``iterations`` = iterations used."""

    slots: tuple[LayerSlot, ...]
    iterations: int
    windows: tuple[Window, ...]
    bandwidth: float

    def bytes_in(self, iteration: int, window: int) -> int:
        """Bytes scheduled into one window of one iteration."""
        return sum(s.nbytes for s in self.slots if (s.iteration, s.window) == (iteration, window))


def _check_plan_args(layer_bytes: Sequence[int], windows: Sequence[Window], bandwidth: float, max_iterations: int) -> None:
    if any(not isinstance(x, int) or x < 0 for x in layer_bytes):
        raise ValueError(f"layer sizes must be non-negative ints, got {list(layer_bytes)}")
    if any(b < a for a, b in windows):
        raise ValueError(f"every window needs start <= end, got {list(windows)}")
    if not bandwidth > 0:
        raise ValueError(f"bandwidth must be > 0, got {bandwidth}")
    if not isinstance(max_iterations, int) or max_iterations < 1:
        raise ValueError(f"max_iterations must be an int >= 1, got {max_iterations!r}")


def plan_backup(
    layer_bytes: Sequence[int], windows: Sequence[Window], bandwidth: float, max_iterations: int
) -> BackupPlan:
    """Pack whole layers into the recurring windows, first-fit decreasing, iteration-major.

    Window j of every iteration carries at most ``(end - start) * bandwidth`` bytes; layers
    are sent back to back inside a window. Layers go largest first into the earliest
    (iteration, window) with room, so later iterations are used only when needed.
    Raises ValueError if some layer does not fit within ``max_iterations`` iterations.
    """
    _check_plan_args(layer_bytes, windows, bandwidth, max_iterations)
    caps = [(b - a) * bandwidth for a, b in windows]
    used: dict[tuple[int, int], float] = {}
    slots = []
    for layer in sorted(range(len(layer_bytes)), key=lambda j: -layer_bytes[j]):
        size = layer_bytes[layer]
        bins = itertools.product(range(max_iterations), range(len(windows)))
        spot = next((t for t in bins if size <= caps[t[1]] - used.get(t, 0.0)), None)
        if spot is None:
            raise ValueError(
                f"layer {layer} ({size} B) does not fit in {max_iterations} iteration(s) of windows "
                f"with capacities {caps} B; total {sum(layer_bytes)} B"
            )
        start = windows[spot[1]][0] + used.get(spot, 0.0) / bandwidth
        used[spot] = used.get(spot, 0.0) + size
        slots.append(LayerSlot(layer, spot[0], spot[1], start, start + size / bandwidth, size))
    slots.sort(key=lambda s: (s.iteration, s.window, s.start))
    n_iter = max((s.iteration for s in slots), default=-1) + 1
    return BackupPlan(tuple(slots), n_iter, tuple(windows), float(bandwidth))


def _check_ring(S: int, k: int) -> None:
    if S < 2:
        raise ValueError(f"a backup ring needs S >= 2 stages, got {S}")
    if not 0 <= k <= S:
        raise ValueError(f"failure count k must be in [0, S={S}], got {k}")


def ring_survival(S: int, k: int) -> float:
    """P(no two of k uniformly failed stages are ring-adjacent): (S/(S-k)) C(S-k, k) / C(S, k)."""
    _check_ring(S, k)
    if 2 * k > S:
        return 0.0  # C(S-k, k) = 0; also avoids S/(S-k) with k = S
    return S / (S - k) * math.comb(S - k, k) / math.comb(S, k)


def ring_survival_bruteforce(S: int, k: int) -> float:
    """Enumerate all C(S, k) failure sets; survivable iff no failed i has failed (i+1) mod S."""
    _check_ring(S, k)
    good = total = 0
    for failed in itertools.combinations(range(S), k):
        dead = set(failed)
        total += 1
        good += all((i + 1) % S not in dead for i in dead)
    return good / total
