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

import json
import math
import os
import time
from pathlib import Path
from statistics import mean
from typing import Any

from experiments import plots
from experiments.analysis import (
    NOT_REACHED,
    analyse,
    convergence_tables,
    fmt_hours,
    local_table,
    mapping_table,
    markdown_table,
    seed_spread,
    write_results,
)
from experiments.runner import run_specs
from experiments.spec import (
    LOCAL_STRATEGIES,
    PAPER_CHECKPOINT_EVERY,
    RunSpec,
    Settings,
    make_spec,
    rate_label,
    reference_spec,
    write_traces,
)

__all__ = ["EXPERIMENTS", "specs_for", "report", "run_experiment"]

EXPERIMENTS = ("convergence", "ablation-init", "ablation-ckpt", "ablation-rate", "ablation-swap")
INIT_STRATEGIES = ["random", "copy", "uniform", "checkfree", "identity"]
# Paper Fig. 2 (500M, 16%): perplexity after 10,000 iterations (authors' plot script).
PAPER_FIG2_PPL = {"checkfree": 22.60, "copy": 29.24, "random": 121.03}


def _rates(settings: Settings, experiment: str) -> list[float]:
    return {"convergence": settings.rates, "ablation-init": [settings.init_rate],
            "ablation-ckpt": [settings.ckpt_rate], "ablation-rate": settings.plus_rates,
            "ablation-swap": []}[experiment]


def specs_for(experiment: str, settings: Settings, out: Path) -> list[RunSpec]:
    """The runs an experiment needs (traces are written as a side effect)."""
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
        else:
            raise ValueError(f"unknown experiment {experiment!r}; choose one of {EXPERIMENTS}")
    return specs


# --- reports -------------------------------------------------------------------------------

def _header(experiment: str, settings: Settings, analysis: dict[str, Any], command: str, run_stats: dict) -> str:
    s = settings
    targets = ", ".join(f"seed {k}: {v:.4f}" for k, v in sorted(analysis["targets"].items()))
    det = next((r["spec"]["config"]["strategy"]["detection_s"] for r in analysis["runs"].values()), None)
    tdef = (f"fixed `--target {s.target}`" if s.target is not None else
            f"the failure-free run's validation loss after {s.target_fraction:g} of the {s.steps} steps ({targets})")
    lines = [
        f"# {experiment}: {s.preset} preset, {s.steps} steps, seeds {s.seeds}\n",
        f"Command: `{command}`\n" if command else "",
        ("Matrix invocations (from matrix_log.jsonl):\n\n" + _matrix_log(Path(s.out)) + "\n") if _matrix_log(Path(s.out)) else "",
        f"* runs: {run_stats['runs']} ({run_stats['statuses']}); summed run wall-clock {run_stats['run_wall_s'] / 60:.1f} "
        f"min (processes in parallel: {s.jobs})",
        f"* target validation loss: {tdef}",
        f"* rate scale k = {s.rate_scale:g} (one CPU step stands for k paper iterations); checkpoint every "
        f"{s.ckpt_every} steps (paper {PAPER_CHECKPOINT_EVERY} / k); snapshots every {s.snap_every} steps; "
        f"recovery/detection time {s.detection if s.detection != 'auto' else 'auto (paper 30 s, time-compressed)'}"
        + (f" = {det:.3g} s" if det is not None else " (the profile's)") + "; "
        f"cost profile `{s.cost_profile}`",
        f"* unrecoverable (adjacent) failures: fallback `{s.fallback}`; redundant/gemini/reft/baft storage fallback: "
        f"{'yes' if s.storage_fallback else 'no'}; iteration budget of rollback strategies {s.max_iterations} "
        f"({s.max_iter_factor:g} x steps)",
        "",
    ]
    return "\n".join(lines) + "\n"


def _run_stats(analysis: dict[str, Any]) -> dict[str, Any]:
    runs = analysis["runs"].values()
    statuses: dict[str, int] = {}
    for r in runs:
        st = str(r["summary"].get("status"))
        statuses[st] = statuses.get(st, 0) + 1
    wall = sum(float(r["summary"].get("wall_s") or 0.0) for r in runs)
    return {"runs": len(analysis["runs"]), "statuses": ", ".join(f"{v} {k}" for k, v in sorted(statuses.items())),
            "run_wall_s": wall}


def _row_stats(r: dict[str, Any]) -> list[str]:
    fv = r["final_val_loss"]
    return [f"{fv:.4f}" if fv is not None else "n/a", f"{math.exp(fv):.2f}" if fv is not None else "n/a",
            fmt_hours(r["hours"]), f"{r['iterations_to_target']:.0f}" if r["iterations_to_target"] else NOT_REACHED,
            str(len(r["failures"])), str(r["summary"].get("status"))]


def seeds_table(runs: list[dict[str, Any]]) -> str:
    """Each (label, rate) over its seeds: mean ± standard deviation and the per-seed values."""
    groups: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["spec"]["label"], r["spec"]["rate"]), []).append(r)
    rows = []
    for (label, rate), rs in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        rs.sort(key=lambda r: r["spec"]["seed"])
        fv = [r["final_val_loss"] for r in rs if r["final_val_loss"] is not None]
        it = [r["iterations_to_target"] for r in rs]
        its = (f"{mean(it):.1f}{seed_spread(it)}" if all(v is not None for v in it)
               else f"{NOT_REACHED} ({sum(v is not None for v in it)}/{len(it)} seeds)")
        rows.append([f"{label} @ {rate_label(rate)}", ",".join(str(r["spec"]["seed"]) for r in rs),
                     f"{mean(fv):.4f}{seed_spread(fv)}" if fv else "n/a", its])
    return "### Over seeds (mean ± standard deviation; per-seed values in order)\n\n" + markdown_table(
        ["run", "seeds", "final val loss", "iterations to target"], rows)


def label_checkpoint_intervals(runs: list[dict[str, Any]], rate_scale: float) -> None:
    """Name every checkpoint run of every seed by its interval (the over-seeds table groups runs by label)."""
    for r in runs:
        if r["spec"]["strategy"] == "checkpoint":
            every = r["spec"]["config"]["strategy"]["checkpoint_every"]
            r["spec"]["label"] = f"checkpoint every {every} ({every * rate_scale:g} paper it.)"


def _sorted(runs, key) -> list[dict[str, Any]]:
    return sorted(runs, key=key)


def report(experiment: str, settings: Settings, out: Path, specs: list[RunSpec], command: str = "") -> Path:
    """Analyse the runs of `experiment` and write <out>/<experiment>/{results.json,table.md,*.png}."""
    analysis = analyse(out, specs, settings)
    rdir = out / experiment
    rdir.mkdir(parents=True, exist_ok=True)
    write_results(analysis, rdir / "results.json")
    text = _header(experiment, settings, analysis, command, _run_stats(analysis))
    runs = list(analysis["runs"].values())
    target = settings.target if settings.target is not None else next(iter(analysis["targets"].values()), None)
    seed0 = settings.seeds[0]
    if experiment == "convergence":
        strategies = settings.strategies
        text += "Failure rates (the paper's hourly rates, time-compressed):\n\n" + mapping_table(settings, settings.rates)
        text += "\n" + convergence_tables(analysis, settings, strategies, settings.rates)
        lt = local_table(analysis)
        if lt:
            text += "\n" + lt
        figs = plots.convergence_figures(analysis, settings.rates, strategies, rdir)
    else:
        figs = []
        header = ["run", "final val loss", "final perplexity", "simulated h to target", "iterations to target",
                  "failures", "status"]
        rows = []
        fig, axes = plots.plt.subplots(1, 2, figsize=(13, 4.8))
        if experiment == "ablation-init":
            sel = [r for r in runs if r["spec"]["seed"] == seed0]
            sel = _sorted(sel, key=lambda r: (r["spec"]["rate"], r["spec"]["label"]))
            for r in sel:
                paper = PAPER_FIG2_PPL.get(r["spec"]["strategy"]) if r["spec"]["rate"] else None
                rows.append([f"{r['spec']['label']} @ {rate_label(r['spec']['rate'])}"] + _row_stats(r)
                            + [f"{paper:.2f}" if paper else ""])
            header.append("paper Fig. 2 perplexity (500M)")
            plots.val_curves(axes[0], sel, "iterations", target=target, mark_failures=True)
            axes[0].set_title(f"recovery initialisation, {rate_label(settings.init_rate)} failures (inner-stage trace)")
            plots.val_curves(axes[1], sel, "hours", target=target)
        elif experiment == "ablation-ckpt":
            label_checkpoint_intervals(runs, settings.rate_scale)
            sel = [r for r in runs if r["spec"]["seed"] == seed0]
            sel = _sorted(sel, key=lambda r: (r["spec"]["rate"], r["spec"]["label"]))
            header.insert(6, "steps lost to rollbacks")
            for r in sel:
                st = _row_stats(r)
                st.insert(5, str(r["summary"].get("lost_steps", 0)))
                rows.append([f"{r['spec']['label']} @ {rate_label(r['spec']['rate'])}"] + st)
            cf = lambda r: plots.color(r["spec"]["label"]) if not r["spec"]["label"].startswith("checkpoint") else \
                plots.plt.get_cmap("Blues")(0.4 + 0.6 * r["spec"]["config"]["strategy"]["checkpoint_every"]
                                            / max(1, settings.scaled_interval(max(settings.ckpt_intervals))))
            plots.val_curves(axes[0], sel, "hours", target=target, color_fn=cf)
            axes[0].set_title(f"checkpoint frequency vs CheckFree+, {rate_label(settings.ckpt_rate)} failures")
            plots.val_curves(axes[1], sel, "iterations", target=target, mark_failures=True, color_fn=cf)
        elif experiment == "ablation-rate":
            sel = [r for r in runs if r["spec"]["seed"] == seed0 and
                   (r["spec"]["strategy"] == "checkfree+" or r["spec"]["label"] == "no failures")]
            sel = _sorted(sel, key=lambda r: (r["spec"]["label"] != "no failures", r["spec"]["rate"]))
            header.insert(1, "p per step")
            for r in sel:
                rows.append([f"{r['spec']['label']} @ {rate_label(r['spec']['rate'])}", f"{r['spec']['p']:.3g}"]
                            + _row_stats(r))
            rates = sorted(settings.plus_rates)
            cmap = plots.plt.get_cmap("viridis")
            cf = lambda r: "black" if r["spec"]["label"] == "no failures" else \
                cmap(rates.index(r["spec"]["rate"]) / max(1, len(rates) - 1) * 0.9)
            lf = lambda r: r["spec"]["label"] if r["spec"]["label"] == "no failures" else \
                f"checkfree+ @ {rate_label(r['spec']['rate'])}"
            plots.val_curves(axes[0], sel, "iterations", target=target, mark_failures=True, color_fn=cf, label_fn=lf)
            axes[0].set_title("CheckFree+ at several failure rates")
            plots.val_curves(axes[1], sel, "hours", target=target, color_fn=cf, label_fn=lf)
        elif experiment == "ablation-swap":
            sel = [r for r in runs if r["spec"]["seed"] == seed0]
            for r in sel:
                rows.append([f"{r['spec']['label']} (strategy {r['spec']['strategy']}) @ 0%"] + _row_stats(r))
            plain = next((r for r in sel if r["spec"]["label"] == "no failures"), None)
            plus = next((r for r in sel if r["spec"]["strategy"] == "checkfree+"), None)
            plots.val_curves(axes[0], sel, "iterations", target=target)
            axes[0].set_title("no failures: plain pipeline vs CheckFree+ swaps")
            if plain and plus:
                a = {v["step"]: v["val_loss"] for v in plain["val"]}
                b = {v["step"]: v["val_loss"] for v in plus["val"]}
                common = sorted(set(a) & set(b))
                axes[1].plot([k + 1 for k in common], [b[k] - a[k] for k in common], color=plots.color("checkfree+"))
                axes[1].axhline(0, color="grey", lw=0.8)
                axes[1].set_xlabel("step")
                axes[1].set_ylabel("val loss: checkfree+ minus plain")
                axes[1].set_title("the swap's cost (> 0: CheckFree+ behind)")
                axes[1].grid(alpha=0.3)
                gaps = [b[k] - a[k] for k in common]
                text += (f"Validation-loss gap checkfree+ - plain over the run: mean {sum(gaps) / len(gaps):+.4f}, "
                         f"at the end {gaps[-1]:+.4f} (over {len(common)} evaluations).\n\n") if gaps else ""
        if len(settings.seeds) > 1:
            plots.seed_bands(axes[0], [r for r in runs if any(r["spec"]["label"] == s["spec"]["label"]
                                                               and r["spec"]["rate"] == s["spec"]["rate"] for s in sel)],
                             "iterations", key=lambda r: (r["spec"]["label"], r["spec"]["rate"]))
        axes[0].legend(fontsize=7)
        figs.append(plots.save(fig, rdir / f"{experiment.replace('-', '_')}.png"))
        text += markdown_table(header, rows)
        if len(settings.seeds) > 1:
            text += (f"\n(rows above and the curves: seed {seed0}; shaded bands: min-max over the seeds; "
                     f"every seed's numbers are in results.json)\n\n" + seeds_table(runs))
    text += "\nFigures: " + ", ".join(f"[{p.name}]({p.name})" for p in figs) + "\n"
    (rdir / "table.md").write_text(text)
    return rdir


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:  # pragma: no cover
        return None


def _matrix_log(out: Path) -> str:
    path = out / "matrix_log.jsonl"
    if not path.is_file():
        return ""
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return "".join(f"* `{x['command'] or '(api)'}` started {x['started']}: ran {x['runs_run']} of {x['runs_in_matrix']} runs in "
                   f"{x['wall_s'] / 60:.1f} min wall-clock (load average at the end {x.get('load_average_at_end')})\n"
                   for x in lines)


def dry_run(experiments: list[str], settings: Settings, log=print) -> int:
    """Check every distinct configuration of the experiments' runs without training: the config resolves, the
    data loads, one training step runs (in the simulator, on this machine's device); then the cost model's
    simulated wall-clock per run (`strategy.cost_profile`) and for the whole matrix. Nothing is kept."""
    import tempfile

    from checkfree.config import config_from_dict
    from checkfree.costmodel import CostModel
    from checkfree.simulator import Simulator

    with tempfile.TemporaryDirectory(prefix="checkfree-dry-run-") as tmp:
        out = Path(tmp)
        specs = list({s.name: s for e in experiments for s in specs_for(e, settings, out)}.values())
        distinct: dict[str, RunSpec] = {}
        for spec in specs:
            distinct.setdefault(spec.label, spec)
        log(f"dry run: {len(specs)} runs, {len(distinct)} distinct configurations ({settings.preset}, "
            f"{settings.steps} steps, data {settings.data or 'the preset corpus'})")
        rows, total_h = [], 0.0
        for spec in specs:
            cfg = config_from_dict(spec.config)
            total_h += CostModel(cfg).step_s() * cfg.train.num_steps / 3600
        for label, spec in distinct.items():
            cfg = config_from_dict(spec.config)
            per_run_h = CostModel(cfg).step_s() * cfg.train.num_steps / 3600
            cfg.train.num_steps, cfg.train.eval_every, cfg.failures.trace = 1, 0, None
            t0 = time.perf_counter()
            Simulator(cfg, out / f"dry-{len(rows)}", progress=False).run()
            step_s = time.perf_counter() - t0
            rows.append([label, spec.strategy, f"{step_s:.1f} s", f"{per_run_h:.2f} h"])
            log(f"  {label}: config, data and one step OK ({step_s:.1f} s here, set-up included); "
                f"cost model: {per_run_h:.2f} h per run")
    log("\n" + markdown_table(["configuration", "strategy", "one step here (with set-up)",
                                f"cost model per run ({settings.cost_profile})"], rows))
    log(f"whole matrix ({len(specs)} runs): {total_h:.1f} h of simulated wall-clock by the cost model")
    return 0


def run_experiment(experiments: list[str], settings: Settings, *, progress: bool = True, command: str = "",
                   report_only: bool = False, log=print) -> dict[str, Path]:
    """Run (resuming) the union of the experiments' runs, then write each report."""
    out = Path(settings.out)
    out.mkdir(parents=True, exist_ok=True)
    all_specs = {e: specs_for(e, settings, out) for e in experiments}
    union = list({s.name: s for specs in all_specs.values() for s in specs}.values())
    (out / "settings.json").write_text(json.dumps(settings.to_dict(), indent=2))
    if not report_only:
        t0 = time.time()
        log(f"{len(union)} runs for {', '.join(experiments)} in {out} ({settings.jobs} parallel processes)")
        results = run_specs(union, out, jobs=settings.jobs, threads=settings.threads, progress=progress, log=log)
        errors = [r for r in results if r["status"] == "error"]
        elapsed = time.time() - t0
        log(f"ran {len(results)} runs in {elapsed:.0f} s" + (f"; {len(errors)} failed" if errors else ""))
        if results:
            with open(out / "matrix_log.jsonl", "a") as f:  # what each invocation ran, and how long it took
                f.write(json.dumps({"command": command, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z",
                                                                               time.localtime(t0)),
                                    "wall_s": round(elapsed), "runs_in_matrix": len(union), "runs_run": len(results),
                                    "errors": len(errors), "load_average_at_end": _loadavg()}) + "\n")
    return {e: report(e, settings, out, specs, command) for e, specs in all_specs.items()}
