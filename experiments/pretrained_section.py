"""The pretrained-model section of experiments/README.md (regions `pretrained.studies`, `pretrained.conclusion`).

`pretrained.studies` is `experiments.pretrained_report.render_section` of `<results>/pretrained` (every
study directory holding a results.json: its command, seeds, and mean ± std per init and stage).
`pretrained.conclusion` states, per study, branch point, failed stage and measure (immediate damage; gap
to the failure-free branch at the end of the recovery curve), which init came out smallest, where the
best CheckFree variant stood, and whether the two differ by more than the study's reference noise sigma;
then it counts those comparisons by winner. A new study dropped into `<results>/pretrained/<name>/` is
picked up by `checkfree experiment report --readme`.
"""

from __future__ import annotations

from pathlib import Path
from statistics import mean
from typing import Any

from experiments.pretrained_report import analyse, load_results, render_section
from experiments.readme import renderer

__all__ = ["ROOT", "comparisons", "studies", "conclusion"]

ROOT = "pretrained"  # under the results root
_MEASURES = {"immediate damage": lambda c: c["damage"],
             "gap at the end of the curve": lambda c: c["gaps"][-1][1] if c["gaps"] else None}


def _study_dirs(results: Path) -> list[Path]:
    root = Path(results) / ROOT
    return sorted(p for p in root.iterdir() if (p / "results.json").is_file()) if root.is_dir() else []


def _means(cells: list[dict[str, Any]], value) -> dict[str, tuple[float, int]]:
    """init -> (mean of value over its seeds, seeds); an init that rebuilt the same weights as another
    (coincides_with) takes that one's value."""
    own: dict[str, list[float]] = {}
    for c in cells:
        v = value(c) if c["coincides_with"] is None else None
        if v is not None:
            own.setdefault(c["init"], []).append(v)
    out = {i: (mean(v), len(v)) for i, v in own.items()}
    for c in cells:
        if c["coincides_with"] in out:
            out.setdefault(c["init"], out[c["coincides_with"]])
    return out


def comparisons(data: dict[str, Any]) -> list[dict[str, Any]]:
    """One record per (branch point, failed stage, measure) with at least two inits measured: the inits'
    means, the smallest, the best CheckFree variant and the noise sigma of that branch point."""
    a = analyse(data)
    out = []
    for at in data["study"]["branch_at"]:
        sigma = a["points"].get(f"plain@{at}", {}).get("sigma")
        cells = [c for c in a["cells"] if c["at"] == at and c["trunk"] == "plain"]
        for k in sorted({c["stage"] for c in cells}):
            for what, value in _MEASURES.items():
                means = _means([c for c in cells if c["stage"] == k], value)
                if len(means) < 2:
                    continue
                best = min(means, key=lambda i: means[i][0])
                cf = [i for i in means if i.startswith("checkfree")]
                out.append({"at": at, "stage": k, "measure": what, "means": means, "best": best, "sigma": sigma,
                            "checkfree": min(cf, key=lambda i: means[i][0]) if cf else None})
    return out


def _line(x: dict[str, Any]) -> str:
    m, best, cf, sigma = x["means"], x["best"], x["checkfree"], x["sigma"]
    ties = sorted(i for i in m if i != best and m[i][0] == m[best][0])
    runs = m[best][1]
    text = f"stage {x['stage']}, {x['measure']}: smallest {best} ({m[best][0]:.3f}, mean of {runs} run{'s' * (runs != 1)})"
    text += f" (tied: {', '.join(ties)})" if ties else ""
    if cf and cf != best and cf not in ties:
        gap = m[cf][0] - m[best][0]
        rank = 1 + sum(1 for i in m if m[i][0] < m[cf][0])
        noise = "sigma not measured" if sigma is None else \
            ("within sigma" if gap <= sigma else f"more than sigma {sigma:.3f}")
        text += f"; best CheckFree variant {cf} ranked {rank} of {len(m)}, {gap:+.3f} ({noise})"
    elif cf:
        text += "; a CheckFree variant is the smallest"
    return text


@renderer("pretrained.studies")
def studies(results: Path) -> str:
    if not _study_dirs(results):
        return "No pretrained study has results yet.\n"
    return render_section(Path(results) / ROOT, link_prefix="results/pretrained/")


@renderer("pretrained.conclusion")
def conclusion(results: Path) -> str:
    parts = []
    for d in _study_dirs(results):
        xs = comparisons(load_results(d / "results.json"))
        if not xs:
            parts.append(f"* Study `{d.name}`: no comparison finished yet.\n")
            continue
        lines = "".join(f"  * branch at step {x['at']}, {_line(x)}\n" for x in xs)
        wins: dict[str, int] = {}
        for x in xs:
            wins[x["best"]] = wins.get(x["best"], 0) + 1
        cf_first = sum(1 for x in xs if x["checkfree"] and x["means"][x["checkfree"]][0] == x["means"][x["best"]][0])
        tally = ", ".join(f"{i} in {n}" for i, n in sorted(wins.items(), key=lambda kv: (-kv[1], kv[0])))
        parts.append(f"* Study `{d.name}`: {len(xs)} comparisons (branch point × failed stage × measure). Smallest: "
                     f"{tally}. A CheckFree variant was smallest or tied for it in {cf_first} of {len(xs)}.\n{lines}")
    return "".join(parts) or "No pretrained study has results yet.\n"
