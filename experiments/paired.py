"""Paired differences between recovery inits, with 95 % intervals: what a table or a sentence may rank.

Two inits are compared on the same units (issue 39): the same held-out sequences after the same trunk and the
same data order, or, in the CPU matrix, the same seed (initialisation, data order and failure trace). A
difference is a per-unit difference, and its interval says what the units' sampling allows:

* over held-out sequences and trunks (`crossed_interval`): each unit is one held-out sequence evaluated after
  one trunk; both the sequences and the trunks are samples of what the claim is about, so a bootstrap
  replicate draws trunks with replacement and, independently, sequences with replacement, and takes the mean of
  the differences over the drawn (trunk, sequence) pairs. `scipy.stats.bootstrap` resamples the observations of
  one level (its `paired=True` resamples the pairs of one index); these units are crossed, two indices drawn
  independently, which it does not do: hence the resampling here, on numpy, in a few lines;
* over seeds (`seed_interval`): a handful of paired runs, each one number: Student's t interval of the mean
  paired difference (`scipy.stats.ttest_1samp(...).confidence_interval`), the equivalent for a few units.

An ordering "A < B" is stated only when the interval of A - B lies below 0 (`Interval.below`), and a table that
ranks inits prints the intervals (`Interval.text`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

__all__ = ["Interval", "crossed_interval", "seed_interval", "auc", "RESAMPLES", "LEVEL"]

RESAMPLES = 2000  # bootstrap replicates (a fixed seed: the same files give the same interval)
LEVEL = 0.95


@dataclass(frozen=True)
class Interval:
    """The mean of paired differences and its 95 % interval; n: the units it rests on; how: the method."""

    mean: float
    lo: float
    hi: float
    n: int
    how: str

    @property
    def below(self) -> bool:
        """The whole interval is below 0 (the first of the pair is smaller)."""
        return self.hi < 0

    @property
    def above(self) -> bool:
        return self.lo > 0

    @property
    def excludes_zero(self) -> bool:
        return self.below or self.above

    def text(self, digits: int = 3) -> str:
        """'+0.123 [+0.050, +0.190]'."""
        return f"{self.mean:+.{digits}f} [{self.lo:+.{digits}f}, {self.hi:+.{digits}f}]"

    def to_dict(self) -> dict:
        return {"mean": self.mean, "lo": self.lo, "hi": self.hi, "n": self.n, "how": self.how}


def crossed_interval(diffs: Sequence[Sequence[float]] | np.ndarray, *, resamples: int = RESAMPLES,
                     seed: int = 0) -> Interval:
    """The mean of `diffs` (trunks x sequences: one paired difference per held-out sequence per trunk) and its
    percentile bootstrap 95 % interval, trunks and sequences each drawn with replacement (module docstring). One
    trunk: sequences only."""
    d = np.asarray(diffs, dtype=np.float64)
    if d.ndim != 2 or d.shape[0] < 1 or d.shape[1] < 2:
        raise ValueError(f"paired differences must be trunks x sequences with at least 2 sequences, got {d.shape}")
    if not np.isfinite(d).all():
        raise ValueError("paired differences hold non-finite values")
    rng = np.random.default_rng(seed)
    t, n = d.shape
    # a replicate's mean over its drawn (trunk, sequence) pairs, from how often it drew each trunk and sequence
    wt = np.stack([np.bincount(r, minlength=t) for r in rng.integers(0, t, (resamples, t))]) if t > 1 else \
        np.ones((resamples, 1))
    wn = np.stack([np.bincount(c, minlength=n) for c in rng.integers(0, n, (resamples, n))])
    means = np.einsum("rt,tn,rn->r", wt, d, wn) / (t * n)
    alpha = (1 - LEVEL) / 2
    lo, hi = np.quantile(means, [alpha, 1 - alpha])
    how = f"bootstrap over {n} sequences" + (f" x {t} trunks" if t > 1 else "")
    return Interval(float(d.mean()), float(lo), float(hi), t * n, how)


def seed_interval(diffs: Sequence[float]) -> Interval | None:
    """The mean of a few paired differences (one per seed) and Student's t 95 % interval; None under 2 seeds. All
    differences equal (e.g. all 0): the interval is that value."""
    from scipy import stats

    d = [float(x) for x in diffs]
    if len(d) < 2 or not all(math.isfinite(x) for x in d):
        return None
    m = sum(d) / len(d)
    if max(d) == min(d):
        return Interval(m, m, m, len(d), f"t over {len(d)} seeds")
    ci = stats.ttest_1samp(d, 0.0).confidence_interval(LEVEL)
    return Interval(m, float(ci.low), float(ci.high), len(d), f"t over {len(d)} seeds")


def auc(steps: Sequence[float], gaps: Sequence[float]) -> float:
    """Area under a gap curve (trapezoids), from the failure (step 0, gap `gaps[0]` if steps[0] == 0) to the last
    evaluation: nat-steps."""
    if len(steps) != len(gaps) or not steps:
        raise ValueError("steps and gaps must be non-empty and of one length")
    return float(np.trapezoid(gaps, steps)) if len(steps) > 1 else 0.0
