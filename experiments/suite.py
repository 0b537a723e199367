"""The experiments: which runs each needs, and its report (results.json, table.md, PNGs).

* convergence   every strategy x failure rate x seed on one trace per (rate, seed): the
                paper's Table 2 (hours to target, ratios vs checkpointing and redundant
                computation, failures), plots of validation loss vs simulated wall-clock
                and vs iterations, time-to-target bars; `--runtime local` adds swarm runs.
* ablation-init recovery initialisation: random, copy, uniform, checkfree (paper Fig. 2), and identity
                (layer drop: the lost stage a pass-through; the baseline the paper lacks).
* ablation-ckpt checkpointing every 10 / 50 / 100 paper iterations vs CheckFree+ (Fig. 4b).
* ablation-rate CheckFree+ at several failure rates (Fig. 4a).
* ablation-swap the cost of CheckFree+'s swaps without failures: checkfree vs checkfree+ at rate 0 (Fig. 4c).

Runs are shared: every experiment keeps its runs in `<out>/runs/<name>` where the name hashes
the full configuration, so an ablation pointed at the convergence results directory reuses
the convergence runs it needs.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from experiments import plots
from experiments.analysis import analyse, write_results
from experiments.provenance import InvocationLog, read_log
from experiments.runner import pending_specs, run_specs
from experiments.spec import LOCAL_STRATEGIES, RunSpec, Settings, make_spec, reference_spec, write_traces
from experiments.tables import (
    ablation_table,
    convergence_tables,
    intervals_table,
    local_table,
    mapping_table,
    seeds_table,
    ablation_selection,
)

__all__ = ["EXPERIMENTS", "specs_for", "report", "report_name", "run_experiment"]

EXPERIMENTS = ("convergence", "ablation-init", "ablation-ckpt", "ablation-rate", "ablation-swap")
INIT_STRATEGIES = ["random", "copy", "uniform", "checkfree", "identity"]


def _rates(settings: Settings, experiment: str) -> list[float]:
    return {"convergence": settings.rates, "ablation-init": [settings.init_rate],
            "ablation-ckpt": [settings.ckpt_rate], "ablation-rate": settings.plus_rates,
            "ablation-swap": []}[experiment]


def specs_for(experiment: str, settings: Settings, out: Path) -> list[RunSpec]:
    """The runs an experiment needs (traces are written as a side effect)."""
    if experiment not in EXPERIMENTS:
        raise ValueError(f"unknown experiment {experiment!r}; choose one of {EXPERIMENTS}")
    for rate in _rates(settings, experiment):
        settings.p(rate)  # a rate the paper model has no probability for: one clear error before anything is written
    traces = write_traces(settings, out, _rates(settings, experiment))
    specs = [reference_spec(settings, out, traces, seed) for seed in settings.seeds]
    for seed in settings.seeds:
        if experiment == "convergence":
            for rate in settings.rates:
                specs += [make_spec(settings, out, traces, s, rate, seed) for s in settings.strategies]
                if settings.runtime == "local":
                    local = [s for s in settings.strategies if s in LOCAL_STRATEGIES]
                    if not local:
                        raise ValueError(f"--runtime local supports {', '.join(LOCAL_STRATEGIES)}; "
                                         f"none of {settings.strategies} is one of them")
                    specs += [make_spec(settings, out, traces, s, rate, seed, runtime="local") for s in local]
        elif experiment == "ablation-init":
            specs += [make_spec(settings, out, traces, s, settings.init_rate, seed, trace_kind="inner")
                      for s in INIT_STRATEGIES]
        elif experiment == "ablation-ckpt":
            specs += [make_spec(settings, out, traces, "checkpoint", settings.ckpt_rate, seed,
                                checkpoint_every=settings.scaled_interval(c)) for c in settings.ckpt_intervals]
            specs.append(make_spec(settings, out, traces, "checkfree+", settings.ckpt_rate, seed))
        elif experiment == "ablation-rate":
            specs += [make_spec(settings, out, traces, "checkfree+", r, seed) for r in settings.plus_rates]
        elif experiment == "ablation-swap":
            specs.append(make_spec(settings, out, traces, "checkfree+", 0.0, seed))
    return specs


# --- reports -------------------------------------------------------------------------------

def _header(experiment: str, settings: Settings, analysis: dict[str, Any]) -> str:
    s = settings
    targets = ", ".join(f"seed {k}: {v:.4f}" for k, v in sorted(analysis["targets"].items()))
    runs = list(analysis["runs"].values())
    detection = sorted({r["provenance"]["detection_s"] for r in runs if r.get("provenance")})
    statuses: dict[str, int] = {}
    for r in runs:
        statuses[str(r["summary"].get("status"))] = statuses.get(str(r["summary"].get("status")), 0) + 1
    wall = sum(float(r["summary"].get("wall_s") or 0.0) for r in runs)
    tdef = (f"fixed `--target {s.target}`" if s.target is not None else
            f"the failure-free run's validation loss after {s.target_fraction:g} of the {s.steps} steps ({targets})")
    log = _matrix_log(Path(s.out))
    lines = [
        f"# {experiment}: {s.preset} preset, {s.steps} steps, seeds {s.seeds}\n",
        ("Invocations (matrix_log.jsonl):\n\n" + log) if log else "",
        f"* runs: {len(runs)} ({', '.join(f'{v} {k}' for k, v in sorted(statuses.items()))}); summed run "
        f"wall-clock {wall / 60:.1f} min",
        f"* code versions of the runs: {_versions(runs)}",
        f"* target validation loss: {tdef}",
        f"* rate scale k = {s.rate_scale:g} (one step stands for k of the paper's iterations; the authors' "
        f"{s.paper_model} config); detection time {s.detection}"
        + (f" = {', '.join(f'{d:.3g}' for d in detection)} s as the runs used it" if detection else "")
        + f"; cost profile `{s.cost_profile}`",
        f"* unrecoverable (adjacent) failures: fallback `{s.fallback}`; redundant/gemini/reft/baft storage fallback: "
        f"{'yes' if s.storage_fallback else 'no'}; omega over the {s.omega_scope}",
        "",
    ]
    return "\n".join(lines) + "\n"


def _versions(runs: list[dict[str, Any]]) -> str:
    """'<commit> (n runs), ...' over the runs' provenance."""
    counts: dict[str, int] = {}
    for r in runs:
        code = (r.get("provenance") or {}).get("code") or {}
        key = (code.get("commit") or "unknown")[:10] + (" dirty" if code.get("dirty") else "")
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{k} ({v} runs)" for k, v in sorted(counts.items()))


def report(experiment: str, settings: Settings, out: Path, specs: list[RunSpec]) -> Path:
    """Write <out>/<report dir>/{results.json,table.md,*.png} of `experiment` from its run directories."""
    records, analysis = analyse(out, specs, settings)
    rdir = out / report_name(experiment, settings)
    rdir.mkdir(parents=True, exist_ok=True)
    write_results(records, settings, rdir / "results.json")
    text = _header(experiment, settings, analysis)
    if experiment == "convergence":
        text += "Failure rates (the paper's hourly rates, time-compressed):\n\n" + mapping_table(settings, settings.rates)
        text += "\n" + intervals_table(settings)
        text += "\n" + convergence_tables(analysis, settings, settings.strategies, settings.rates)
        lt = local_table(analysis)
        text += ("\n" + lt) if lt else ""
        figs = plots.convergence_figures(analysis, settings.rates, settings.strategies, rdir)
    else:
        seed0 = settings.seeds[0]
        text += f"Seed {seed0}:\n\n" + ablation_table(experiment, analysis, settings, seed0)
        if len(settings.seeds) > 1:
            text += ("\nOver the seeds (mean ± standard deviation; each seed's value in order):\n\n"
                     + seeds_table(ablation_selection(experiment, analysis, settings)))
        figs = [plots.ablation_figure(experiment, analysis, settings, rdir / f"{experiment.replace('-', '_')}.png")]
    text += "\nFigures: " + ", ".join(f"[{p.name}]({p.name})" for p in figs) + "\n"
    (rdir / "table.md").write_text(text)
    return rdir


def _matrix_log(out: Path) -> str:
    """The invocations of `out` (matrix_log.jsonl), one line each."""
    log = read_log(out)
    ends = {x["invocation"]: x for x in log if x.get("event") == "end"}
    lines = []
    for x in log:
        if x.get("event") not in ("start", "report"):
            continue
        code = x.get("code") or {}
        ver = f"{(code.get('commit') or 'unknown')[:10]}{' (dirty)' if code.get('dirty') else ''}"
        end = ends.get(x["invocation"])
        what = ("report only" if x["event"] == "report" else
                f"{end['status']}: ran {end['runs_run']} of {x['runs_in_matrix']} runs in {end['wall_s'] / 60:.1f} min "
                f"(load average at the end {end.get('load_average_at_end')})" if end else "no end line (killed?)")
        lines.append(f"* `{x['command'] or '(api)'}` at {ver}, started {x['started']}: {what}\n")
    return "".join(lines)


def report_name(experiment: str, settings: Settings) -> str:
    """The report directory of an experiment: its name, `-blocks` when omega is taken over the blocks (so the
    two variants of one matrix can share a results directory)."""
    return experiment + ("-blocks" if settings.omega_scope == "blocks" else "")


def run_experiment(experiments: list[str], settings: Settings, *, progress: bool = True, command: str = "",
                   report_only: bool = False, log=print) -> dict[str, Path]:
    """Run (resuming) the union of the experiments' runs, then write each report. Every invocation is
    logged in `<out>/matrix_log.jsonl` (experiments.provenance)."""
    out = Path(settings.out)
    out.mkdir(parents=True, exist_ok=True)
    all_specs = {e: specs_for(e, settings, out) for e in experiments}
    union = list({s.name: s for specs in all_specs.values() for s in specs}.values())
    if report_only:
        InvocationLog.report_only(out, command, settings.to_dict())
    else:
        pending = pending_specs(union, out)
        detection = sorted({s.config["strategy"]["detection_s"] for s in union}, key=str)
        log(f"{len(union)} runs for {', '.join(experiments)} in {out} ({settings.jobs} parallel processes)")
        t0 = time.time()
        with InvocationLog(out, command=command, settings=settings.to_dict(), experiments=experiments,
                           runs_in_matrix=len(union), pending=[s.name for s in pending],
                           detection_s=detection) as invocation:
            results = run_specs(union, out, jobs=settings.jobs, threads=settings.threads, progress=progress, log=log,
                                on_finished=invocation.finished)
        errors = [r for r in results if r["status"] == "error"]
        log(f"ran {len(results)} runs in {time.time() - t0:.0f} s" + (f"; {len(errors)} failed" if errors else ""))
    return {e: report(e, settings, out, specs) for e, specs in all_specs.items()}
