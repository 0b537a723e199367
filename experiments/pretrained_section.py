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


# ---- numbers quoted in prose (README.md, docs/pretrained.md, docs/identity.md): inline regions -----------------

def _study(results: Path, name: str) -> dict:
    return load_results(Path(results) / ROOT / name / "results.json")


@renderer("pretrained.smollm2.step-time")
def smollm2_step_time(results: Path) -> str:
    from experiments.prose import median_step

    data = _study(results, "smollm2")
    t = data["study"]["base"]["train"]
    tokens = t["num_microbatches"] * t["microbatch_size"] * t["seq_len"]
    return (f"{median_step(data):.1f} s a step of {tokens} tokens (median over every step of its branch runs; "
            f"the trunk's {median_step(data, trunk=True):.1f} s)")


@renderer("pretrained.small.step-time")
def small_step_time(results: Path) -> str:
    from experiments.prose import median_step

    data = _study(results, "small")
    return f"{median_step(data):.2f} s (the trunk's {median_step(data, trunk=True):.2f} s)"


@renderer("pretrained.smollm2.plus-cost")
def smollm2_plus_cost(results: Path) -> str:
    """What the swapped routes alone cost the pretrained model: the CheckFree+ trunk against the plain one, no
    failure, at the branch point."""
    data = _study(results, "smollm2")
    at = str(data["study"]["branch_at"][0])
    plain, plus = (data["trunks"][t]["points"][at]["val"] for t in ("plain", "plus"))
    return (f"validation loss {plus:.3f} against the plain trunk's {plain:.3f} after the same {at} steps: "
            f"{plus - plain:.2f} nats")


@renderer("pretrained.smollm2.damage-range")
def smollm2_damage_range(results: Path) -> str:
    from experiments.prose import _damages

    d = _damages(_study(results, "smollm2"))
    return f"{min(d):.1f} to {max(d):.1f} nats"


@renderer("pretrained.smollm2.identity-damage")
def smollm2_identity_damage(results: Path) -> str:
    from experiments.pretrained_report import analyse

    d = [c["damage"] for c in analyse(_study(results, "smollm2"))["cells"] if c["init"] == "identity" and c["damage"]]
    return f"{min(d):.1f} to {max(d):.1f} nats"


@renderer("pretrained.smollm2.omega-spread")
def smollm2_omega_spread(results: Path) -> str:
    """At the stage where the four CheckFree variants (omega pre/post clip, over the stage/blocks) differ most: their
    damage against uniform's."""
    from experiments.pretrained_report import analyse

    cells = analyse(_study(results, "smollm2"))["cells"]
    stages = sorted({c["stage"] for c in cells})

    def at(k: int, init: str) -> float:
        return next(c["damage"] for c in cells if c["stage"] == k and c["init"] == init and c["damage"] is not None)

    variants = [i for i in dict.fromkeys(c["init"] for c in cells) if i.startswith("checkfree")]
    k = max(stages, key=lambda s: max(at(s, v) for v in variants) - min(at(s, v) for v in variants))
    lo, hi = min(at(k, v) for v in variants), max(at(k, v) for v in variants)
    return f"at stage {k} the choice of omega alone spans {lo:.2f} to {hi:.2f} nats of damage, against uniform's {at(k, 'uniform'):.2f}"


@renderer("pretrained.smollm2.curves")
def smollm2_curves(results: Path) -> str:
    data = _study(results, "smollm2")
    st = data["study"]
    return (f"stage{'s' * (len(st['curve_stages']) > 1)} {', '.join(map(str, st['curve_stages']))} only, over "
            f"{st['recover_steps']} steps")
