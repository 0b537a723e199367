"""From run directories to the paper's numbers: target, time to target, tables, raw JSON.

Time to target. The target is a validation loss: `--target` if given, else the failure-free
run's validation loss at `target_fraction` of the steps (the last evaluation at or before
that step), per seed. A run reaches it at the first evaluation (in execution order,
recomputations after a rollback included) whose validation loss is <= the target; the
simulated wall-clock and the executed iterations at that point are linearly interpolated
between that evaluation and the previous one. A run that never gets there (within its steps
or its iteration budget, or because it aborted) has "not reached".

Simulated hours are the simulator's `sim_time_s` (the cost model, `--cost-profile`).
The paper's own accounting (Table 2: hours = iterations to target x iteration time, 91.3 s,
or 151.04 s for redundant computation) is given beside it: `paper_hours`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from statistics import mean, stdev
from typing import Any

from checkfree.rundir import read_jsonl
from experiments.runner import run_dir
from experiments.spec import (
    PAPER_ITERATION_S,
    PAPER_REDUNDANT_ITERATION_S,
    RunSpec,
    Settings,
    paper_p,
    rate_label,
)

__all__ = ["load_run", "reference_target", "time_to_target", "analyse", "fmt_hours", "NOT_REACHED",
           "markdown_table", "write_results"]

NOT_REACHED = "not reached"


def _num(x: Any) -> float:
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan


def load_run(out: Path, spec: RunSpec) -> dict[str, Any]:
    """A run's spec, summary, validation curve, training losses and failures."""
    d = run_dir(out, spec)
    summary = json.loads((d / "summary.json").read_text()) if (d / "summary.json").is_file() else {"status": "missing"}
    metrics = read_jsonl(d / "metrics.jsonl") if (d / "metrics.jsonl").is_file() else []
    events = read_jsonl(d / "events.jsonl") if (d / "events.jsonl").is_file() else []
    val, losses = [], []
    for i, m in enumerate(metrics):
        it = m.get("iteration", i)  # the swarm's metrics have no iteration: one line per executed step
        losses.append([it, m["step"], round(_num(m["loss"]), 5)])
        if "val_loss" in m and math.isfinite(_num(m["val_loss"])):
            val.append({"iteration": it, "step": m["step"], "sim_time_s": _num(m.get("sim_time_s")),
                        "val_loss": _num(m["val_loss"])})
    failures = [{"iteration": e.get("iteration", e.get("step")), "step": e.get("step"), "stage": e.get("stage")}
                for e in events if e.get("event") == "failure"]
    return {"spec": spec.to_dict(), "summary": summary, "val": val, "loss": losses, "failures": failures,
            "fallbacks": sum(1 for e in events if e.get("event") == "fallback")}


def reference_target(ref: dict[str, Any], settings: Settings) -> float:
    """The failure-free run's validation loss at `target_fraction` of the steps."""
    if settings.target is not None:
        return settings.target
    limit = settings.target_fraction * settings.steps
    points = [v for v in ref["val"] if v["step"] + 1 <= limit + 1e-9]
    if not points:
        raise ValueError(f"the failure-free run {ref['spec']['name']} has no evaluation before step {limit:g}; "
                         f"lower --eval-every or raise --target-fraction")
    return points[-1]["val_loss"]


def time_to_target(run: dict[str, Any], target: float) -> dict[str, Any] | None:
    """Interpolated {sim_time_s, iteration, step} where val first reaches `target`; None if never."""
    prev = None
    for v in run["val"]:
        if v["val_loss"] <= target:
            if prev is None or not prev["val_loss"] > v["val_loss"]:
                frac = 1.0
            else:
                frac = (prev["val_loss"] - target) / (prev["val_loss"] - v["val_loss"])
            a = prev or v

            def lerp(key: str) -> float:
                return a[key] + frac * (v[key] - a[key])

            # `iteration` counts executed iterations up to and including the evaluated one
            return {"sim_time_s": lerp("sim_time_s"), "iterations": lerp("iteration") + 1, "step": v["step"],
                    "val_loss": v["val_loss"]}
        prev = v
    return None


def _paper_iteration_s(strategy: str) -> float:
    return PAPER_REDUNDANT_ITERATION_S if strategy == "redundant" else PAPER_ITERATION_S


def analyse(out: Path, specs: list[RunSpec], settings: Settings) -> dict[str, Any]:
    """Every run with its time to target (targets from each seed's failure-free run)."""
    runs = {}
    for spec in {s.name: s for s in specs}.values():
        runs[spec.name] = load_run(out, spec)
    targets: dict[int, float] = {}
    for r in runs.values():
        sp = r["spec"]
        if sp["rate"] == 0 and sp["strategy"] == "checkfree" and sp["runtime"] == "sim" and sp["label"] == "no failures":
            targets[sp["seed"]] = reference_target(r, settings)
    for r in runs.values():
        sp = r["spec"]
        target = settings.target if settings.target is not None else targets.get(sp["seed"])
        r["target"] = target
        hit = time_to_target(r, target) if target is not None else None
        r["reached"] = hit is not None
        r["hit"] = hit
        r["hours"] = hit["sim_time_s"] / 3600.0 if hit and math.isfinite(hit["sim_time_s"]) else None
        r["iterations_to_target"] = hit["iterations"] if hit else None
        r["paper_hours"] = hit["iterations"] * _paper_iteration_s(sp["strategy"]) / 3600.0 if hit else None
        r["failures_before_target"] = (sum(1 for f in r["failures"] if f["iteration"] < hit["iterations"])
                                       if hit else len(r["failures"]))
        last = [v for v in r["val"]]
        r["final_val_loss"] = last[-1]["val_loss"] if last else None
        r["total_hours"] = (max((v["sim_time_s"] for v in last), default=math.nan) / 3600.0) if last else None
    return {"settings": settings.to_dict(), "targets": targets, "runs": runs}


def fmt_hours(h: float | None) -> str:
    if h is None:
        return NOT_REACHED
    return f"{h:.4g}" if h < 100 else f"{h:.1f}"


def _cell(rs: list[dict[str, Any]], key: str = "hours") -> tuple[float | None, str]:
    """Mean over seeds when every seed reached the target, else 'not reached (k/n)'."""
    if not rs:
        return None, "missing"
    vals = [r[key] for r in rs]
    if any(r["summary"].get("status") in ("missing", "error") for r in rs):
        return None, "error" if any(r["summary"].get("status") == "error" for r in rs) else "missing"
    if all(v is not None for v in vals):
        m = mean(vals)
        return m, fmt_hours(m) + seed_spread(vals)
    k = sum(v is not None for v in vals)
    return None, NOT_REACHED + (f" ({k}/{len(vals)} seeds)" if k else "")


def seed_spread(vals: list[float]) -> str:
    """' ± s (n=k: v1 / v2 / ...)': the sample standard deviation over seeds and each seed's value ('' for one)."""
    if len(vals) < 2:
        return ""
    return f" ± {stdev(vals):.2g} (n={len(vals)}: {' / '.join(f'{v:.4g}' for v in vals)})"


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def group(analysis: dict[str, Any], strategy: str, rate: float, runtime: str = "sim",
          label: str | None = None) -> list[dict[str, Any]]:
    """The runs (one per seed) of one strategy label at one rate."""
    label = label or strategy
    return [r for r in analysis["runs"].values()
            if r["spec"]["strategy"] == strategy and r["spec"]["rate"] == rate and r["spec"]["runtime"] == runtime
            and r["spec"]["label"] == label]


def _ratio(base: float | None, base_total: list[float], h: float | None) -> str:
    """base / h (> 1: faster than the baseline). When the baseline never reached the target,
    its total simulated time is a lower bound of its time to target: '> x'."""
    if h is None:
        return NOT_REACHED
    if base is not None:
        return f"{base / h:.2f}x"
    if base_total:
        return f"> {min(base_total) / h:.2f}x"
    return "n/a"


def write_results(analysis: dict[str, Any], path: Path) -> None:
    """The raw JSON of an experiment: settings, targets and every run (summary, curves, failures)."""
    path.parent.mkdir(parents=True, exist_ok=True)

    def clean(x: Any) -> Any:
        if isinstance(x, float):
            return x if math.isfinite(x) else None
        if isinstance(x, dict):
            return {str(k): clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x

    path.write_text(json.dumps(clean(analysis), sort_keys=True, separators=(",", ":")))


def rate_header(settings: Settings, rate: float) -> str:
    return f"{rate_label(rate)} (p={settings.p(rate):.3g})" if rate else "0%"


def convergence_tables(analysis: dict[str, Any], settings: Settings, strategies: list[str],
                       rates: list[float]) -> str:
    """The paper's Table 2 at CPU scale, plus ratios, failures, iterations and the paper's accounting."""
    header = ["strategy"] + [rate_header(settings, r) for r in rates]
    ref = [r for r in analysis["runs"].values() if r["spec"]["label"] == "no failures"]
    ref_cell = _cell(ref)[1]

    def rows(fn) -> list[list[str]]:
        return [[s] + [fn(s, rate) for rate in rates] for s in strategies]

    def hours(s: str, rate: float, key: str = "hours") -> str:
        return _cell(group(analysis, s, rate), key)[1]

    def ratio_vs(base: str):
        def fn(s: str, rate: float) -> str:
            b = group(analysis, base, rate)
            bval = _cell(b)[0]
            btot = [r["total_hours"] for r in b if r["total_hours"] is not None and not r["reached"]]
            return _ratio(bval, btot, _cell(group(analysis, s, rate))[0])
        return fn

    def failures(s: str, rate: float) -> str:
        rs = group(analysis, s, rate)
        if not rs:
            return "missing"
        tot = mean(len(r["failures"]) for r in rs)
        before = mean(r["failures_before_target"] for r in rs)
        fb = mean(r["fallbacks"] for r in rs)
        kind = rs[0]["spec"]["trace_kind"]
        return f"{tot:g} ({before:g}) {kind}" + (f", {fb:g} fallback" if fb else "")

    def iterations(s: str, rate: float) -> str:
        m, txt = _cell(group(analysis, s, rate), "iterations_to_target")
        return txt if m is None else f"{m:.0f}"

    def status(s: str, rate: float) -> str:
        rs = group(analysis, s, rate)
        return ", ".join(sorted({str(r["summary"].get("status")) for r in rs})) or "missing"

    parts = []
    parts.append("### Simulated hours to the target validation loss\n\n"
                 f"Cost profile `{settings.cost_profile}`; failure-free reference: {ref_cell} h.\n\n")
    parts.append(markdown_table(header, [["no failures"] + [ref_cell] * len(rates)] + rows(hours)))
    parts.append("\n### Speed-up vs checkpointing (checkpoint hours / strategy hours; > 1: faster)\n\n")
    parts.append(markdown_table(header, rows(ratio_vs("checkpoint"))))
    parts.append("\n### Speed-up vs redundant computation (redundant hours / strategy hours)\n\n")
    parts.append(markdown_table(header, rows(ratio_vs("redundant"))))
    parts.append("\n### Failures seen: whole run (before reaching the target), trace replayed\n\n")
    parts.append(markdown_table(header, rows(failures)))
    parts.append("\n### Iterations to target (executed steps, recomputations included)\n\n")
    ref_it = _cell(ref, "iterations_to_target")
    parts.append(markdown_table(header, [["no failures"] + [f"{ref_it[0]:.0f}" if ref_it[0] else ref_it[1]] * len(rates)]
                                + rows(iterations)))
    parts.append("\n### The paper's accounting: iterations to target x the paper's iteration time "
                 f"({PAPER_ITERATION_S} s; redundant {PAPER_REDUNDANT_ITERATION_S} s), hours\n\n")
    ref_ph = _cell(ref, "paper_hours")[1]
    parts.append(markdown_table(header, [["no failures"] + [ref_ph] * len(rates)]
                                + rows(lambda s, r: hours(s, r, "paper_hours"))))
    parts.append("\n### Run status\n\n")
    parts.append(markdown_table(header, rows(status)))
    return "".join(parts)


def local_table(analysis: dict[str, Any]) -> str:
    """Swarm runs beside the simulator runs of the same configuration and trace."""
    rows = []
    for r in analysis["runs"].values():
        sp = r["spec"]
        if sp["runtime"] != "local":
            continue
        twins = [x for x in analysis["runs"].values() if x["spec"]["runtime"] == "sim" and x["spec"]["label"] == sp["label"]
                 and x["spec"]["rate"] == sp["rate"] and x["spec"]["seed"] == sp["seed"]]
        for x in [r] + twins:
            s = x["summary"]
            hit = x["hit"]
            rows.append([x["spec"]["runtime"], x["spec"]["label"], rate_label(sp["rate"]), str(sp["seed"]),
                         str(s.get("status")), str(len(x["failures"])), str(s.get("recoveries", "")),
                         str(s.get("fallbacks", "")),
                         f"{x['final_val_loss']:.4f}" if x["final_val_loss"] is not None else "n/a",
                         str(hit["step"] + 1) if hit else NOT_REACHED, f"{_num(s.get('wall_s')):.0f}"])
        if twins:
            a = {v["step"]: v["val_loss"] for v in r["val"]}
            b = {v["step"]: v["val_loss"] for v in twins[0]["val"]}
            common = sorted(set(a) & set(b))
            if common:
                diff = max(abs(a[k] - b[k]) for k in common)
                la = {step: loss for _, step, loss in r["loss"]}
                lb = {step: loss for _, step, loss in twins[0]["loss"]}
                steps = sorted(set(la) & set(lb))
                first = next((k for k in steps if abs(la[k] - lb[k]) > 1e-4), None)
                same = f"train loss equal to 1e-4 through step {first - 1}" if first is not None else \
                    f"train loss equal to 1e-4 at all {len(steps)} steps"
                rows.append(["Δ (local - sim)", "", "", "", "", "", "", "", f"val: max {diff:.2e} over {len(common)} evals",
                             same, ""])
    if not rows:
        return ""
    header = ["runtime", "strategy", "rate", "seed", "status", "failures", "recoveries", "fallbacks",
              "final val loss", "steps to target", "real wall-clock s"]
    return "### Distributed runtime (`checkfree local`, real processes and SIGKILLs) vs the simulator\n\n" + \
        markdown_table(header, rows)


def mapping_table(settings: Settings, rates: list[float]) -> str:
    rows = []
    for r in rates:
        if r == 0:
            continue
        rows.append([rate_label(r), f"{paper_p(r):.4g}", f"{settings.rate_scale:g}", f"{settings.p(r):.4g}",
                     f"{settings.p(r) * settings.steps:.2f}"])
    return markdown_table(["paper hourly rate", "paper p per iteration", "rate scale k", "p per CPU step",
                           "expected failures per stage in the run"], rows)
