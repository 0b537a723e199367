"""The pretrained-model section of experiments/README.md (regions `pretrained.studies`, `pretrained.conclusion`).

`pretrained.studies` is `experiments.pretrained_report.render_section` of `<results>/pretrained` (every
study directory holding a results.json: its command, seeds, and mean ± std per init and stage).
`pretrained.conclusion` states, per study, what its measurements may rank: for a study with held-out
evaluation (issue 39), the inits by immediate damage, per branch point, failed stage and corpus, ordered only where
the paired 95 % interval of two neighbours excludes 0; for one without, that it ranks nothing, and why. A new
study dropped into `<results>/pretrained/<name>/` is picked up by `checkfree experiment report --readme`.
"""

from __future__ import annotations

from pathlib import Path

from experiments.pretrained_report import load_results, render_section
from experiments.readme import renderer

__all__ = ["ROOT", "studies", "conclusion"]

ROOT = "pretrained"  # under the results root


def _study_dirs(results: Path) -> list[Path]:
    root = Path(results) / ROOT
    return sorted(p for p in root.iterdir() if (p / "results.json").is_file()) if root.is_dir() else []


@renderer("pretrained.studies")
def studies(results: Path) -> str:
    if not _study_dirs(results):
        return "No pretrained study has results yet.\n"
    return render_section(Path(results) / ROOT, link_prefix="results/pretrained/")


@renderer("pretrained.conclusion")
def conclusion(results: Path) -> str:
    """Per study: what it may rank. A paired study: per branch point, failed stage and held-out corpus, the inits
    in the order their paired 95 % intervals license (`<` only where the interval excludes 0). A study without
    held-out evaluation: no ranking, and why."""
    from experiments.pretrained_report import is_paired, ordered, paired_analysis, unranked

    parts = []
    for d in _study_dirs(results):
        data = load_results(d / "results.json")
        if not is_paired(data):
            parts.append(f"* Study `{d.name}`: {unranked(data['study']).strip()}\n")
            continue
        p = paired_analysis(data)
        lines = [f"  * branch at step {at}, stage {k}, held-out `{corpus}`: {ordered(v, p['diffs'][(at, k, corpus)])}\n"
                 for (at, k, corpus), v in sorted(p["damage"].items())]
        parts.append(f"* Study `{d.name}`, immediate damage, smallest first (`<`: the paired 95 % interval excludes 0; "
                     f"`≈`: it contains 0):\n" + "".join(lines))
    return "".join(parts) or "No pretrained study has results yet.\n"
