"""Gemini (SOSP'23) replica placement and recovery probabilities, plus checkpoint timing.

Pure functions, no I/O. A *placement* is a list indexed by machine: ``placement[i]``
is the sorted list of machines whose CPU memory holds machine ``i``'s checkpoint,
always including ``i`` itself. A simultaneous failure set is *recoverable from CPU
memory* iff every failed machine still has at least one surviving holder.

Formulas (from the Gemini and REFT papers):

* exact recovery probability for group placement (``m`` divides ``N``):
  ``sum_j (-1)^j C(N/m, j) C(N-jm, k-jm) / C(N, k)``;
* Gemini's lower bound: 1 if ``k < m`` else ``max(0, 1 - N C(N-m, k-m) / (m C(N, k)))``;
* wasted time per failure: ``t_ckpt + 1/(2f) + t_rtvl`` with ``1/f >= max(t_ckpt, T_iter)``;
* Young-style interval (REFT Eq. 5): ``sqrt(2 O_save / lambda)``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

__all__ = [
    "group_placement",
    "mixed_placement",
    "recovery_probability_group",
    "recovery_probability_lower_bound",
    "recovery_probability_bruteforce",
    "gemini_wasted_time",
    "young_interval",
]


def _check_n_m(N: int, m: int) -> None:
    if not isinstance(N, int) or not isinstance(m, int):
        raise ValueError(f"N and m must be ints, got N={N!r}, m={m!r}")
    if m < 1:
        raise ValueError(f"replica count m must be >= 1, got m={m}")
    if N < m:
        raise ValueError(f"need at least m machines: N={N} < m={m}")


def _check_k(N: int, k: int) -> None:
    if not isinstance(k, int) or not 0 <= k <= N:
        raise ValueError(f"failure count k must be an int in [0, N={N}], got k={k!r}")


def _group(members: list[int]) -> dict[int, list[int]]:
    """Every member of the group holds every member's state."""
    return {i: list(members) for i in members}


def _ring(members: list[int], m: int) -> dict[int, list[int]]:
    """Member at ring position j is held by positions j, j+1, ..., j+m-1 (mod ring size)."""
    r = len(members)
    return {members[j]: sorted(members[(j + d) % r] for d in range(m)) for j in range(r)}


def group_placement(N: int, m: int) -> list[list[int]]:
    """Group placement: N/m consecutive groups of m machines; each holds the group's states.

    Requires ``m`` to divide ``N``. Returns ``placement[i]`` = sorted holders of ``i`` (incl. ``i``).
    """
    _check_n_m(N, m)
    if N % m:
        raise ValueError(f"group placement needs m | N, got N={N}, m={m}; use mixed_placement")
    holders: dict[int, list[int]] = {}
    for g in range(N // m):
        holders.update(_group(list(range(g * m, (g + 1) * m))))
    return [holders[i] for i in range(N)]


def mixed_placement(N: int, m: int) -> list[list[int]]:
    """Gemini's mixed placement: floor(N/m)-1 groups of m, then a ring over the last m + N mod m.

    In the ring each machine's state is held by itself and its next m-1 ring successors.
    Equals :func:`group_placement` when ``m`` divides ``N`` (the ring then has exactly m machines).
    """
    _check_n_m(N, m)
    n_groups = N // m - 1
    holders: dict[int, list[int]] = {}
    for g in range(n_groups):
        holders.update(_group(list(range(g * m, (g + 1) * m))))
    holders.update(_ring(list(range(n_groups * m, N)), m))
    return [holders[i] for i in range(N)]


def recovery_probability_group(N: int, m: int, k: int) -> float:
    """Exact P(no group entirely lost) for group placement when k of N machines fail uniformly.

    Inclusion-exclusion over the N/m groups; requires ``m | N``. N=16, m=2, k=2 -> 14/15.
    """
    _check_n_m(N, m)
    _check_k(N, k)
    if N % m:
        raise ValueError(f"closed form needs m | N, got N={N}, m={m}")
    total = sum(
        (-1) ** j * math.comb(N // m, j) * math.comb(N - j * m, k - j * m)
        for j in range(min(N // m, k // m) + 1)
    )
    return total / math.comb(N, k)


def recovery_probability_lower_bound(N: int, m: int, k: int) -> float:
    """Gemini's corollary: 1 if k < m, else max(0, 1 - N C(N-m, k-m) / (m C(N, k))); needs m | N."""
    _check_n_m(N, m)
    _check_k(N, k)
    if N % m:
        raise ValueError(f"the bound is stated for m | N, got N={N}, m={m}")
    if k < m:
        return 1.0
    return max(0.0, 1.0 - N * math.comb(N - m, k - m) / (m * math.comb(N, k)))


def _check_placement(placement: Sequence[Sequence[int]]) -> int:
    N = len(placement)
    if N == 0:
        raise ValueError("placement must describe at least one machine")
    for i, hs in enumerate(placement):
        if i not in hs:
            raise ValueError(f"machine {i} must hold its own state, holders={list(hs)}")
        if any(not isinstance(h, int) or not 0 <= h < N for h in hs):
            raise ValueError(f"holders of machine {i} must be ints in [0, {N}), got {list(hs)}")
    return N


def recovery_probability_bruteforce(placement: Sequence[Sequence[int]], k: int) -> float:
    """Fraction of all C(N, k) failure sets in which every failed machine keeps a surviving holder."""
    N = _check_placement(placement)
    _check_k(N, k)
    holder_sets = [frozenset(hs) for hs in placement]
    good = total = 0
    for failed in itertools.combinations(range(N), k):
        dead = frozenset(failed)
        total += 1
        good += all(not holder_sets[i] <= dead for i in failed)
    return good / total


def gemini_wasted_time(t_ckpt: float, freq: float, t_rtvl: float, t_iter: float = 0.0) -> float:
    """Expected time lost per failure: t_ckpt + 1/(2 freq) + t_rtvl.

    ``freq`` is checkpoints per time unit; Gemini requires 1/freq >= max(t_ckpt, t_iter)
    (a checkpoint cannot start before the previous one finished, nor more than once an
    iteration). Violations raise ValueError. Example: (42, 1/42, 42) -> 105.
    """
    if min(t_ckpt, t_rtvl, t_iter) < 0:
        raise ValueError(f"times must be >= 0, got t_ckpt={t_ckpt}, t_rtvl={t_rtvl}, t_iter={t_iter}")
    if not freq > 0:
        raise ValueError(f"checkpoint frequency must be > 0, got {freq}")
    period = 1.0 / freq
    need = max(t_ckpt, t_iter)
    if period < need * (1 - 1e-12):
        raise ValueError(f"1/f = {period} must be >= max(t_ckpt, T_iter) = {need}")
    return t_ckpt + period / 2.0 + t_rtvl


def young_interval(o_save: float, lam: float) -> float:
    """Young-style optimal checkpoint interval sqrt(2 o_save / lam) (REFT Eq. 5); (2, 1/3600) -> 120."""
    if o_save < 0:
        raise ValueError(f"save overhead must be >= 0, got {o_save}")
    if not lam > 0:
        raise ValueError(f"failure rate must be > 0, got {lam}")
    return math.sqrt(2.0 * o_save / lam)
