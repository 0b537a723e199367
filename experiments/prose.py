"""Sentences of the documentation that state a measured number, ranking or comparison, each paired with a check
over the result file it comes from (issue 39).

A sentence in README.md, docs/, experiments/README.md or benchmarks/README.md that states what an experiment or a
benchmark measured either renders its numbers from the file (a rendered region, experiments/readme.py: the same
renderers as the tables) or carries the marker `<!-- claim: NAME -->` right after it, NAME being a claim below.
A claim is a function of the repository root (whose result files it reads) returning True while the file still
says what the sentence says; `failures(root)` runs them all, and tests/test_claims.py fails naming the sentence of
every claim that does not hold, and every marker without a claim (or claim without its marker).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Callable

__all__ = ["Claim", "CLAIMS", "claim", "failures", "MARKER", "DOCUMENTS", "pretrained"]

MARKER = re.compile(r"<!-- claim: ([\w.-]+) -->")
DOCUMENTS = ["README.md", "experiments/README.md", "benchmarks/README.md", "docs"]  # where sentences are checked


@dataclass(frozen=True)
class Claim:
    name: str
    doc: str  # the file holding the sentence (repository path)
    sentence: str  # the words it licenses, as written there (whitespace aside)
    files: tuple[str, ...]  # the result files it reads
    check: Callable[[Path], bool]


CLAIMS: dict[str, Claim] = {}


def claim(name: str, doc: str, sentence: str, *files: str) -> Callable[[Callable[[Path], bool]], Callable]:
    """Register `fn(root) -> bool` as the check of `sentence` in `doc`."""
    def register(fn: Callable[[Path], bool]) -> Callable[[Path], bool]:
        if name in CLAIMS:
            raise ValueError(f"claim {name!r} registered twice")
        CLAIMS[name] = Claim(name, doc, " ".join(sentence.split()), files, fn)
        return fn
    return register


def failures(root: Path) -> list[tuple[Claim, str]]:
    """Every claim whose check does not hold on the files under `root` (or cannot read them), with why."""
    out = []
    for c in CLAIMS.values():
        try:
            ok = bool(c.check(Path(root)))
            why = "" if ok else "its check is false"
        except (OSError, KeyError, ValueError, TypeError, IndexError) as e:
            ok, why = False, f"{type(e).__name__}: {e}"
        if not ok:
            out.append((c, why))
    return out


# ---- readers -------------------------------------------------------------------------------------------------

def pretrained(root: Path, study: str) -> dict:
    return json.loads((Path(root) / "experiments/results/pretrained" / study / "results.json").read_text())


def _damages(data: dict) -> list[float]:
    """Every cell's immediate damage (validation loss right after the rebuild minus the saved state's)."""
    from experiments.pretrained_report import analyse

    return [c["damage"] for c in analyse(data)["cells"] if c["damage"] is not None and c["trunk"] == "plain"]


def _cell(data: dict, init: str, stage: int, at: int | None = None) -> list[float]:
    from experiments.pretrained_report import analyse

    return [c["damage"] for c in analyse(data)["cells"]
            if c["init"] == init and c["stage"] == stage and (at is None or c["at"] == at) and c["damage"] is not None]


# ---- the pretrained studies (docs/pretrained.md, README.md, docs/identity.md) ------------------------------------

SMOLLM2 = "experiments/results/pretrained/smollm2/results.json"
SMALL = "experiments/results/pretrained/small/results.json"


@claim("smollm2-every-rebuild-sets-back", "docs/pretrained.md",
       "rebuild tried, from the neighbours or from nothing, set the model back", SMOLLM2)
def _every_rebuild_sets_back(root: Path) -> bool:
    return min(_damages(pretrained(root, "smollm2"))) > 0


@claim("readme-recommendation", "README.md",
       "every rebuild tried, averaging the neighbours included, set it back", SMOLLM2)
def _readme_recommendation(root: Path) -> bool:
    """The README's recommendation (keep the stage's own weights) rests on this: no rebuild without a copy was free."""
    data = pretrained(root, "smollm2")
    inits = {c["init"] for c in data["cells"]}
    return min(_damages(data)) > 0 and any(i.startswith("checkfree") for i in inits)


@claim("smollm2-no-curve-back", "docs/pretrained.md",
       "no init came back within sigma of the failure-free branch in the curve's steps", SMOLLM2)
def _no_curve_back(root: Path) -> bool:
    from experiments.pretrained_report import analyse

    curves = [c for c in analyse(pretrained(root, "smollm2"))["cells"] if c["gaps"]]
    return bool(curves) and all(c["back_within"] is None for c in curves)


@claim("smollm2-post-clip-is-uniform", "docs/pretrained.md",
       "post-clip CheckFree *is* uniform whenever both neighbours clipped", SMOLLM2)
def _post_clip_uniform(root: Path) -> bool:
    data = pretrained(root, "smollm2")
    point = data["trunks"]["plain"]["points"]["10"]
    both = [k for k in range(1, len(point["clipped"]) - 1) if point["clipped"][k - 1] and point["clipped"][k + 1]]
    same = {(c["stage"]) for c in data["cells"] if c["init"] == "checkfree post/stage" and c["coincides_with"] == "uniform"}
    return bool(both) and set(both) <= same


@claim("small-damage-below-smollm2", "docs/pretrained.md",
       "the largest immediate damage from scratch is below the smallest on SmolLM2", SMALL, SMOLLM2)
def _small_below(root: Path) -> bool:
    return max(_damages(pretrained(root, "small"))) < min(_damages(pretrained(root, "smollm2")))


# ---- the benchmarks ----------------------------------------------------------------------------------------------


def _numbers_in(root: Path, path: str, *numbers: str) -> bool:
    """Every one of `numbers` stands, as written, in the file at `path`."""
    text = (Path(root) / path).read_text()
    return all(re.search(rf"(?<![\d.]){re.escape(n)}(?![\d])", text) for n in numbers)


def step_times(data: dict, trunk: bool = False) -> list[float]:
    """Every recorded step time of a study's branch runs (or of its plain trunk)."""
    if trunk:
        return list(data["trunks"]["plain"]["step_time_s"])
    return [x for r in data["runs"].values() for x in r["step_time_s"]]


def median_step(data: dict, trunk: bool = False) -> float:
    return median(step_times(data, trunk))


# ---- the CPU matrix (README.md) ----------------------------------------------------------------------------------

MATRIX = "experiments/results/small"


def _matrix_runs(root: Path, report: str) -> list[dict]:
    """The report's simulator runs as the experiments page reads them (clock priced, time to target)."""
    from experiments.sections import load

    analysis, _ = load(Path(root) / "experiments/results", "small", report)
    return [r for r in analysis["runs"].values() if r["spec"]["runtime"] == "sim"]


@claim("readme-small-matrix", "README.md",
       "rebuilding a lost stage with random weights or as a pass-through did as well as CheckFree's weighted "
       "average, and CheckFree+ was slower than plain CheckFree in every seed",
       f"{MATRIX}/ablation-init/results.json", f"{MATRIX}/convergence/results.json")
def _readme_small_matrix(root: Path) -> bool:
    """random and identity: a final validation loss no higher than CheckFree's, by the mean paired difference over
    the seeds (the experiments page gives its interval); CheckFree+: more simulated hours to the target than
    CheckFree in every seed at every rate."""
    init = _matrix_runs(root, "ablation-init")
    by = {(r["spec"]["strategy"], r["spec"]["seed"]): r["final_val_loss"] for r in init if r["spec"]["rate"]}
    seeds = sorted({s for _, s in by})
    as_well = all(sum(by[(k, s)] - by[("checkfree", s)] for s in seeds) <= 0 for k in ("random", "identity"))
    conv = _matrix_runs(root, "convergence")
    hours = {(r["spec"]["strategy"], r["spec"]["rate"], r["spec"]["seed"]): r["hours"] for r in conv}
    slower = [hours[("checkfree+", rate, s)] > hours[("checkfree", rate, s)]
              for (k, rate, s) in hours if k == "checkfree" and rate]
    return as_well and bool(slower) and all(slower)


# ---- the test tiers' budgets (docs/testing.md) -------------------------------------------------------------------

QUICK_TIER = "docs/results/quick-tier.txt"
FULL_TIER = "docs/results/full-tier.txt"


def tier_minutes(root: Path, path: str) -> float:
    """The wall time of a tier's run, in minutes, as its file records it: `time`'s `real 2m44.608s`, or GNU time's
    `24:52.38elapsed` (`1:02:03.4elapsed` past an hour)."""
    text = (Path(root) / path).read_text()
    m = re.search(r"^real\s+(\d+)m([\d.]+)s", text, re.M)
    if m:
        return int(m.group(1)) + float(m.group(2)) / 60
    m = re.search(r"(?:(\d+):)?(\d+):([\d.]+)elapsed", text)
    if m is None:  # pytest's own summary line: `635 passed, 1 skipped, 2 warnings in 493.61s (0:08:13)`
        if (p := re.search(r"^=*\s*\d+ passed.* in ([\d.]+)s", text, re.M)) is None:
            raise ValueError(f"{path}: no wall time")
        return float(p.group(1)) / 60
    return int(m.group(1) or 0) * 60 + int(m.group(2)) + float(m.group(3)) / 60


@claim("quick-tier-over-its-budget", "docs/testing.md",
       "and one real-process smoke run | 5 minutes, which the run measured below overran", QUICK_TIER)
def _quick_tier_over_budget(root: Path) -> bool:
    """The quick tier's budget is 5 minutes; the measured run took more. Once a run within it is recorded, this
    fails and the sentence is to say so."""
    return tier_minutes(root, QUICK_TIER) > 5


@claim("readme-full-tier-within-ci", "README.md", "`make test-all` took 28m43.847s, within CI's budget here",
       FULL_TIER)
def _readme_full_tier_within_ci(root: Path) -> bool:
    """README's sentence of the last full run: within CI's 30 minutes on this machine."""
    return tier_minutes(root, FULL_TIER) < 30


@claim("full-tier-within-ci-over-budget", "docs/testing.md",
       "20 minutes, which the run measured below overran, within CI's 30 on this machine", FULL_TIER)
def _full_tier_within_ci_over_budget(root: Path) -> bool:
    """The full tier's budget is 20 minutes and CI allows 30; the measured run took more than the first, less than
    the second. A run over 30 minutes or within 20 fails this, and the sentence is to say so."""
    return 20 < tier_minutes(root, FULL_TIER) < 30
