"""The renderers of experiments/README.md's regions (see experiments/readme.py for the mechanism).

Each reads committed files under the results root: `<matrix>/<report>/results.json` (the run records,
priced and analysed anew by `analysis.derive`), `<matrix>/matrix_log.jsonl`, and for the recipes the code
itself (experiments/recipes.py, experiments/compute.py). Region names are `<matrix>.<what>`.
"""

from __future__ import annotations

import tempfile
from dataclasses import replace
from functools import lru_cache
from pathlib import Path
from statistics import mean, median
from typing import Any

from experiments.analysis import derive, read_results
from experiments.provenance import logged_runs, read_log
from experiments.readme import renderer
from experiments.spec import Settings
from experiments.tables import (
    ablation_selection,
    convergence_tables,
    intervals_table,
    local_table,
    mapping_table,
    markdown_table,
    seeds_table,
)

__all__ = ["load", "MATRICES", "ABLATIONS"]

MATRICES = ("small", "local")  # results directories the README reports
ABLATIONS = ("ablation-init", "ablation-init-blocks", "ablation-ckpt", "ablation-rate", "ablation-swap")


@lru_cache(maxsize=32)
def _load(path: str, mtime_ns: int) -> tuple[dict[str, Any], Settings]:
    records, settings = read_results(Path(path))
    return derive(records, settings), settings


def load(results: Path, matrix: str, report: str) -> tuple[dict[str, Any], Settings]:
    """(derived analysis, settings) of `<results>/<matrix>/<report>/results.json`."""
    path = Path(results) / matrix / report / "results.json"
    if not path.is_file():
        raise ValueError(f"{path}: no such result file (run the matrix, or `--report-only` from its run directories)")
    return _load(str(path), path.stat().st_mtime_ns)


def _reports(results: Path, matrix: str) -> list[Path]:
    return sorted(p.parent for p in (Path(results) / matrix).glob("*/results.json"))


def _commit(code: dict[str, Any] | None) -> str:
    code = code or {}
    return f"`{(code.get('commit') or 'unknown')[:10]}`" + (" (dirty)" if code.get("dirty") else "")


# --- what was run --------------------------------------------------------------------------

def provenance(results: Path, matrix: str) -> str:
    """The invocations of a matrix (matrix_log.jsonl) and the code versions of the runs its reports use."""
    log = read_log(Path(results) / matrix)
    ends = {x["invocation"]: x for x in log if x.get("event") == "end"}
    rows = []
    for x in log:
        if x.get("event") not in ("start", "report"):
            continue
        end = ends.get(x["invocation"], {})
        ran = f"{end['runs_run']} of {x['runs_in_matrix']}" if x["event"] == "start" and end else ""
        rows.append([f"`{x['command']}`", _commit(x.get("code")), x["started"],
                     "report only" if x["event"] == "report" else end.get("status", "no end line"), ran,
                     f"{end['wall_s'] / 60:.0f}" if end else "",
                     " / ".join(f"{v:g}" for v in end.get("load_average_at_end") or [])])
    runs: dict[str, dict[str, Any]] = {}
    for rdir in _reports(results, matrix):
        runs.update(load(results, matrix, rdir.name)[0]["runs"])
    logged = logged_runs(log)
    missing = sorted(n for n in runs if n not in logged)
    versions: dict[str, int] = {}
    for r in runs.values():
        key = _commit((r.get("provenance") or {}).get("code"))
        versions[key] = versions.get(key, 0) + 1
    wall = sum(float(r["summary"].get("wall_s") or 0.0) for r in runs.values())
    text = markdown_table(["invocation", "code", "started", "status", "runs run", "wall-clock min",
                           "load average at the end"], rows)
    text += (f"\nThe reports use {len(runs)} runs (their own wall-clock summed: {wall / 3600:.1f} h); code: "
             + ", ".join(f"{k}: {v} runs" for k, v in sorted(versions.items())) + ". "
             + ("Every one of them is in an invocation's log." if not missing else
                f"{len(missing)} are in no invocation's log: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}.")
             + "\n")
    return text


def setup(results: Path, matrix: str) -> str:
    """Model, scale and target of a matrix, from its convergence report."""
    analysis, s = load(results, matrix, "convergence")
    run = next(iter(analysis["runs"].values()))
    cfg = run["spec"]["config"]
    m, t = cfg["model"], cfg["train"]
    detection = sorted({r["provenance"]["detection_s"] for r in analysis["runs"].values() if r.get("provenance")})
    targets = ", ".join(f"seed {k}: {v:.4f}" for k, v in sorted(analysis["targets"].items()))
    return "\n".join([
        f"* model: `{s.preset}` preset: d_model {m['d_model']}, {m['num_layers']} layers, {cfg['num_stages']} stages, "
        f"vocabulary {m['vocab_size']}, context {m['context_length']}; {t['num_microbatches']} microbatches of "
        f"{t['microbatch_size']} sequences per step; data `{cfg['data']['source']}`",
        f"* {s.steps} steps per run, seeds {', '.join(map(str, s.seeds))} (seed = initialisation, data order and "
        f"failure trace), evaluation every {s.eval_every} steps",
        f"* target: the failure-free run's validation loss after {s.target_fraction:g} of the steps ({targets})"
        if s.target is None else f"* target: validation loss {s.target}",
        f"* rate scale k = {s.rate_scale:g}; cost profile `{s.cost_profile}`; detection time `{s.detection}`"
        + (f" = {', '.join(f'{d:.3g}' for d in detection)} s per recovery" if detection else "")
        + f"; unrecoverable failures: fallback `{s.fallback}`",
    ]) + "\n"


def mapping(results: Path, matrix: str) -> str:
    _, s = load(results, matrix, "convergence")
    return mapping_table(s, sorted(set(s.rates) | set(s.plus_rates) - {0.0})) + "\n" + intervals_table(s)


def convergence(results: Path, matrix: str) -> str:
    analysis, s = load(results, matrix, "convergence")
    return convergence_tables(analysis, s, s.strategies, s.rates, heading="####")


def ablation(results: Path, matrix: str, report: str) -> str:
    analysis, s = load(results, matrix, report)
    return seeds_table(ablation_selection(report.replace("-blocks", ""), analysis, s))


def local(results: Path, matrix: str) -> str:
    analysis, _ = load(results, matrix, "convergence")
    lines = [local_table(analysis, heading=False)]
    for r in analysis["runs"].values():
        if r["spec"]["runtime"] == "local":
            steps = ", ".join(f"{f['step']} (stage {f['stage']})" for f in r["failures"])
            lines.append(f"\nFailures the swarm saw (step, stage): {steps}.\n")
    return "".join(lines)


# --- omega and clipping --------------------------------------------------------------------

def _weights(runs: list[dict[str, Any]]) -> list[float]:
    """The weight each CheckFree recovery gave its lower neighbour (stage i-1)."""
    return [rec["coefficients"][0] for r in runs for rec in r["recoveries"]
            if rec["method"] == "average" and not rec.get("fallback") and len(rec["coefficients"]) == 2]


def omega(results: Path, matrix: str) -> str:
    """CheckFree's recovery coefficients under both omega scopes, and how often each stage's gradient clips."""
    rows = []
    for report in ("ablation-init", "ablation-init-blocks"):
        analysis, s = load(results, matrix, report)
        runs = [r for r in analysis["runs"].values() if r["spec"]["strategy"] == "checkfree" and r["spec"]["rate"]]
        w = _weights(runs)
        equal = sum(1 for x in w if abs(x - 0.5) < 1e-6)
        rows.append([f"over the {s.omega_scope}", str(len(runs)), str(len(w)),
                     f"{min(w):.3f} / {median(w):.3f} / {max(w):.3f}" if w else "n/a", f"{equal} of {len(w)}",
                     f"{mean(r['final_val_loss'] for r in runs):.4f}" if runs else "n/a"])
    text = markdown_table(["omega", "CheckFree runs (seeds)", "recoveries", "weight of stage i-1: min / median / max",
                           "recoveries weighting both neighbours 0.5 (equal omega)", "final val loss, mean"], rows)
    analysis, _ = load(results, matrix, "convergence")
    ref = [r for r in analysis["runs"].values() if r["spec"]["label"] == "no failures" and r["clipped_share"]]
    if ref:
        stages = len(ref[0]["clipped_share"])
        share = [mean(r["clipped_share"][i] for r in ref) for i in range(stages)]
        text += ("\nShare of steps whose gradient was clipped (post-clip norm at the clip, 1.0), failure-free runs, "
                 "mean over the seeds: " + ", ".join(f"stage {i}: {x:.0%}" for i, x in enumerate(share)) + ".\n")
    return text


# --- the paper-scale recipes ---------------------------------------------------------------

def recipes(results: Path) -> str:
    """Each recipe's settings (the authors' figures) and its compute, from the code."""
    from checkfree.config import config_from_dict
    from experiments.compute import DEFAULT_GPU, DEFAULT_MFU, estimate
    from experiments.recipes import RECIPES, recipe
    from experiments.suite import specs_for

    rows, notes = [], []
    for name in RECIPES:
        s = recipe(name, steps=10_000) if name == "paper-124m" else recipe(name)
        experiment = "ablation-init" if name.endswith("fig2") else "convergence"
        with tempfile.TemporaryDirectory(prefix="checkfree-recipe-") as tmp:  # the matrix's runs, on short traces
            specs = list({x.name: x for x in specs_for(experiment, replace(s, steps=2, eval_every=1), Path(tmp))}.values())
        comp = []
        for x in specs:
            cfg = config_from_dict(x.config)
            cfg.train.num_steps, cfg.train.eval_every = s.steps, s.eval_every
            comp.append(estimate(cfg))
        rates = ", ".join(f"{r:g} %: {s.p(r):g}" for r in (s.rates if experiment == "convergence" else [s.init_rate]))
        steps = f"{s.steps:,}" + (" (`--steps` required; 10,000 shown)" if name == "paper-124m" else "")
        rows.append([f"`{name}`", f"`{experiment}`", f"`{s.preset}`", f"`{s.data}`", steps, rates,
                     f"{s.ckpt_every}", f"{s.eval_every} ({s.eval_batches} batches)", str(len(specs)),
                     f"{comp[0].step_flops:.3g}", f"{mean(c.gpu_hours for c in comp):.3g}",
                     f"{sum(c.gpu_hours for c in comp):,.0f}"])
    notes.append(f"GPU-hours: one {DEFAULT_GPU} at an assumed {DEFAULT_MFU:.0%} of its dense BF16 peak "
                 "(experiments/compute.py), evaluations included; strategies that roll back recompute steps, so "
                 "their share is a lower bound.")
    return markdown_table(["recipe", "experiment", "preset", "data", "steps", "p per iteration", "checkpoint every",
                           "evaluation every", "runs (3 seeds)", "FLOPs per step", "GPU-hours per run (mean)",
                           "GPU-hours, whole matrix"], rows) + "\n" + " ".join(notes) + "\n"


# --- registration --------------------------------------------------------------------------

def _register() -> None:
    for m in MATRICES:
        renderer(f"{m}.provenance")(lambda results, m=m: provenance(results, m))
    renderer("small.setup")(lambda results: setup(results, "small"))
    renderer("small.mapping")(lambda results: mapping(results, "small"))
    renderer("small.convergence")(lambda results: convergence(results, "small"))
    for report in ABLATIONS:
        renderer(f"small.{report}")(lambda results, report=report: ablation(results, "small", report))
    renderer("small.omega")(lambda results: omega(results, "small"))
    renderer("local.setup")(lambda results: setup(results, "local"))
    renderer("local.table")(lambda results: local(results, "local"))
    renderer("recipes")(recipes)


_register()
