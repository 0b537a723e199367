"""Markdown tables of an experiment, from `analysis.derive`'s output (shared by table.md and the README).

A cell over several seeds is the mean, the sample standard deviation and each seed's value when every
seed reached the target, and says in words how many did when some did not:
"reached in 2 of 3 seeds (66 / not reached / 53.9)".
"""

from __future__ import annotations

import math
from statistics import mean, stdev
from typing import Any, Callable

from experiments.spec import (
    PAPER_ITERATION_S,
    PAPER_REDUNDANT_ITERATION_S,
    Settings,
    rate_label,
)

__all__ = ["NOT_REACHED", "STALE", "fmt_hours", "fmt_iterations", "seed_spread", "markdown_table", "group", "cell",
           "rate_header", "convergence_tables", "local_table", "mapping_table", "seeds_table",
           "label_checkpoint_intervals", "ablation_selection", "ablation_table", "swap_gaps", "PAPER_FIG2_PPL"]

NOT_REACHED = "not reached"
STALE = " †"  # the run's strategy terms were priced by an older cost model (experiments.clock)
STALE_NOTE = ("† the strategy part of this clock (stalls, recoveries) was priced by a cost model that differs from "
              "the current one; the step term is re-priced (experiments/clock.py). Re-run to price it all anew.\n")
# Paper Fig. 2 (500M, 16%): perplexity after 10,000 iterations (authors' plot script).
PAPER_FIG2_PPL = {"checkfree": 22.60, "copy": 29.24, "random": 121.03}


def fmt_hours(h: float | None) -> str:
    if h is None:
        return NOT_REACHED
    return f"{h:.4g}" if h < 100 else f"{h:.1f}"


def fmt_iterations(x: float | None) -> str:
    return NOT_REACHED if x is None else f"{x:.1f}"


def seed_spread(vals: list[float], fmt: Callable[[float], str] = lambda v: f"{v:.4g}") -> str:
    """' ± s (n=k: v1 / v2 / ...)': the sample standard deviation over seeds and each seed's value ('' for one)."""
    if len(vals) < 2:
        return ""
    return f" ± {stdev(vals):.2g} (n={len(vals)}: {' / '.join(fmt(v) for v in vals)})"


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def group(analysis: dict[str, Any], strategy: str, rate: float, runtime: str = "sim",
          label: str | None = None) -> list[dict[str, Any]]:
    """The runs (one per seed, in seed order) of one strategy label at one rate."""
    label = label or strategy
    rs = [r for r in analysis["runs"].values()
          if r["spec"]["strategy"] == strategy and r["spec"]["rate"] == rate and r["spec"]["runtime"] == runtime
          and r["spec"]["label"] == label]
    return sorted(rs, key=lambda r: r["spec"]["seed"])


def cell(rs: list[dict[str, Any]], key: str = "hours",
         fmt: Callable[[float | None], str] = fmt_hours) -> tuple[float | None, str]:
    """(mean or None, text) of `key` over the seeds' runs `rs`: the mean ± spread when every seed has a value,
    else how many seeds reached the target, in words, with each seed's value."""
    if not rs:
        return None, "missing"
    statuses = {r["summary"].get("status") for r in rs}
    if statuses & {"missing", "error"}:
        return None, "error" if "error" in statuses else "missing"
    vals = [r[key] for r in rs]
    stale = STALE if key in ("hours", "total_hours") and any(r.get("clock_stale") for r in rs) else ""
    if all(v is not None for v in vals):
        m = mean(vals)
        return m, fmt(m) + seed_spread(vals, fmt) + stale
    k = sum(v is not None for v in vals)
    if len(vals) == 1:
        return None, NOT_REACHED
    return None, f"reached in {k} of {len(vals)} seeds ({' / '.join(fmt(v) for v in vals)})" + stale


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


def rate_header(settings: Settings, rate: float) -> str:
    return f"{rate_label(rate)} (p={settings.p(rate):.3g})" if rate else "0%"


def _status(rs: list[dict[str, Any]]) -> str:
    counts: dict[str, int] = {}
    for r in rs:
        st = str(r["summary"].get("status"))
        counts[st] = counts.get(st, 0) + 1
    return ", ".join(f"{v} {k}" if len(rs) > 1 else k for k, v in sorted(counts.items())) or "missing"


def convergence_tables(analysis: dict[str, Any], settings: Settings, strategies: list[str],
                       rates: list[float], heading: str = "###") -> str:
    """The paper's Table 2 at CPU scale, plus ratios, failures, iterations and the paper's accounting (each
    under a `heading` of that level)."""
    header = ["strategy"] + [rate_header(settings, r) for r in rates]
    ref = sorted((r for r in analysis["runs"].values() if r["spec"]["label"] == "no failures"
                  and r["spec"]["runtime"] == "sim"), key=lambda r: r["spec"]["seed"])

    def rows(fn) -> list[list[str]]:
        return [[s] + [fn(s, rate) for rate in rates] for s in strategies]

    def values(key: str, fmt=fmt_hours):
        return lambda s, rate: cell(group(analysis, s, rate), key, fmt)[1]

    def ratio_vs(base: str):
        def fn(s: str, rate: float) -> str:
            b = group(analysis, base, rate)
            btot = [r["total_hours"] for r in b if r["total_hours"] is not None and not r["reached"]]
            h, text = cell(group(analysis, s, rate))
            return text if text in ("error", "missing") else _ratio(cell(b)[0], btot, h)
        return fn

    def failures(s: str, rate: float) -> str:
        rs = group(analysis, s, rate)
        if not rs:
            return "missing"
        tot = mean(len(r["failures"]) for r in rs)
        before = mean(r["failures_before_target"] for r in rs)
        fb = mean(r["fallbacks"] for r in rs)
        return f"{tot:.3g} ({before:.3g}) {rs[0]['spec']['trace_kind']}" + (f", {fb:.3g} fallback" if fb else "")

    def ref_row(key: str, fmt=fmt_hours) -> list[str]:
        return ["no failures"] + [cell(ref, key, fmt)[1]] * len(rates)

    stale = any(r.get("clock_stale") for r in analysis["runs"].values())
    many = len({r["spec"]["seed"] for r in analysis["runs"].values()}) > 1
    parts = [
        f"{heading} Simulated hours to the target validation loss\n\n"
        f"Cost profile `{settings.cost_profile}`, priced by the current cost model"
        + ("; each cell: mean ± standard deviation (n seeds: each seed's value)" if many else "") + ".\n\n",
        markdown_table(header, [ref_row("hours")] + rows(values("hours"))),
        STALE_NOTE if stale else "",
        f"\n{heading} Speed-up vs checkpointing (checkpoint hours / strategy hours; > 1: faster)\n\n",
        markdown_table(header, rows(ratio_vs("checkpoint"))),
        f"\n{heading} Speed-up vs redundant computation (redundant hours / strategy hours)\n\n",
        markdown_table(header, rows(ratio_vs("redundant"))),
        f"\n{heading} Failures seen: whole run (before reaching the target), trace replayed"
        + (" (means over the seeds)" if many else "") + "\n\n",
        markdown_table(header, rows(failures)),
        f"\n{heading} Iterations to target (executed steps, recomputations included)\n\n",
        markdown_table(header, [ref_row("iterations_to_target", fmt_iterations)]
                       + rows(values("iterations_to_target", fmt_iterations))),
        f"\n{heading} The paper's accounting: iterations to target x the paper's iteration time "
        f"({PAPER_ITERATION_S} s; redundant {PAPER_REDUNDANT_ITERATION_S} s), hours\n\n",
        markdown_table(header, [ref_row("paper_hours")] + rows(values("paper_hours"))),
        f"\n{heading} Run status\n\n",
        markdown_table(header, rows(lambda s, rate: _status(group(analysis, s, rate)))),
    ]
    return "".join(parts)


def local_table(analysis: dict[str, Any], heading: bool = True) -> str:
    """Swarm runs beside the simulator runs of the same configuration and trace (under a heading if `heading`)."""
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
                         str(hit["step"] + 1) if hit else NOT_REACHED, f"{float(s.get('wall_s') or math.nan):.0f}"])
        if twins:
            rows.append(_local_delta(r, twins[0]))
    if not rows:
        return ""
    header = ["runtime", "strategy", "rate", "seed", "status", "failures", "recoveries", "fallbacks",
              "final val loss", "steps to target", "real wall-clock s"]
    title = "### Distributed runtime (`checkfree local`, real processes and SIGKILLs) vs the simulator\n\n"
    return (title if heading else "") + markdown_table(header, rows)


def _local_delta(local: dict[str, Any], sim: dict[str, Any]) -> list[str]:
    """The row comparing a swarm run's curves with its simulator twin's."""
    a = {v["step"]: v["val_loss"] for v in local["val"]}
    b = {v["step"]: v["val_loss"] for v in sim["val"]}
    common = sorted(set(a) & set(b))
    la = {step: loss for _, step, loss in local["loss"]}
    lb = {step: loss for _, step, loss in sim["loss"]}
    steps = sorted(set(la) & set(lb))
    first = next((k for k in steps if abs(la[k] - lb[k]) > 1e-4), None)
    same = f"train loss equal to 1e-4 through step {first - 1}" if first is not None else \
        f"train loss equal to 1e-4 at all {len(steps)} steps"
    diff = f"val: max {max(abs(a[k] - b[k]) for k in common):.2e} over {len(common)} evals" if common else ""
    return ["Δ (local - sim)", "", "", "", "", "", "", "", diff, same, ""]


def mapping_table(settings: Settings, rates: list[float]) -> str:
    """The paper's hourly rates, its per-iteration probabilities and the per-step ones of the runs."""
    rows = []
    for r in rates:
        if r == 0:
            continue
        rows.append([rate_label(r), f"{settings.paper_p(r):.4g}", f"{settings.rate_scale:g}", f"{settings.p(r):.4g}",
                     f"{settings.p(r) * settings.steps:.2f}"])
    return markdown_table(["paper hourly rate", "paper p per iteration", "rate scale k", "p per step",
                           "expected failures per stage in the run"], rows)


def intervals_table(settings: Settings) -> str:
    """The per-iteration intervals of the paper and of the runs (time-compressed by k)."""
    k = settings.rate_scale
    rows = [["checkpoint interval (Table 2)", f"{settings.paper_checkpoint_every:g} iterations",
             f"{settings.ckpt_every} steps"],
            ["checkpoint-interval ablation (Fig. 4b)", " / ".join(f"{c:g}" for c in settings.ckpt_intervals),
             " / ".join(f"{settings.scaled_interval(c)}" for c in settings.ckpt_intervals) + " steps"],
            ["in-memory snapshots (gemini, reft, checkfree+snap)", "10 iterations (the project's default)",
             f"{settings.snap_every} steps"],
            ["iteration budget of strategies that roll back", "", f"{settings.max_iterations} iterations "
             f"({settings.max_iter_factor:g} x {settings.steps} steps)"]]
    return markdown_table(["quantity", "paper", f"these runs (k = {k:g})"], rows)


def seeds_table(runs: list[dict[str, Any]]) -> str:
    """Each (label, rate) over its seeds: mean ± standard deviation and the per-seed values."""
    groups: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["spec"]["label"], r["spec"]["rate"]), []).append(r)
    rows = []
    for (label, rate), rs in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        rs.sort(key=lambda r: r["spec"]["seed"])
        rows.append([f"{label} @ {rate_label(rate)}", ",".join(str(r["spec"]["seed"]) for r in rs),
                     cell(rs, "final_val_loss", lambda v: "n/a" if v is None else f"{v:.4f}")[1],
                     cell(rs, "iterations_to_target", fmt_iterations)[1], cell(rs, "hours")[1],
                     f"{mean(len(r['failures']) for r in rs):.3g}"])
    return markdown_table(["run", "seeds", "final val loss", "iterations to target", "simulated h to target",
                           "failures (mean)"], rows)


def label_checkpoint_intervals(runs: list[dict[str, Any]], rate_scale: float) -> None:
    """Name every checkpoint run of every seed by its interval (the over-seeds table groups runs by label)."""
    for r in runs:
        if r["spec"]["strategy"] == "checkpoint":
            every = r["spec"]["config"]["strategy"]["checkpoint_every"]
            r["spec"]["label"] = f"checkpoint every {every} ({every * rate_scale:g} paper it.)"


def ablation_selection(experiment: str, analysis: dict[str, Any], settings: Settings) -> list[dict[str, Any]]:
    """The runs an ablation shows, every seed, in display order (checkpoint runs labelled by interval)."""
    runs = list(analysis["runs"].values())
    if experiment == "ablation-ckpt":
        label_checkpoint_intervals(runs, settings.rate_scale)
    if experiment == "ablation-rate":
        runs = [r for r in runs if r["spec"]["strategy"] == "checkfree+" or r["spec"]["label"] == "no failures"]
        return sorted(runs, key=lambda r: (r["spec"]["label"] != "no failures", r["spec"]["rate"], r["spec"]["seed"]))
    return sorted(runs, key=lambda r: (r["spec"]["rate"], r["spec"]["label"], r["spec"]["seed"]))


def _row_stats(r: dict[str, Any]) -> list[str]:
    fv = r["final_val_loss"]
    return [f"{fv:.4f}" if fv is not None else "n/a", f"{math.exp(fv):.2f}" if fv is not None else "n/a",
            fmt_hours(r["hours"]) + (STALE if r.get("clock_stale") else ""), fmt_iterations(r["iterations_to_target"]),
            str(len(r["failures"])), str(r["summary"].get("status"))]


def ablation_table(experiment: str, analysis: dict[str, Any], settings: Settings, seed: int) -> str:
    """One row per run of seed `seed` (the columns the paper's figure is about)."""
    header = ["run", "final val loss", "final perplexity", "simulated h to target", "iterations to target",
              "failures", "status"]
    rows = []
    for r in ablation_selection(experiment, analysis, settings):
        if r["spec"]["seed"] != seed:
            continue
        name = f"{r['spec']['label']} @ {rate_label(r['spec']['rate'])}"
        st = _row_stats(r)
        if experiment == "ablation-init":
            paper = PAPER_FIG2_PPL.get(r["spec"]["strategy"]) if r["spec"]["rate"] else None
            rows.append([name] + st + [f"{paper:.2f}" if paper else ""])
        elif experiment == "ablation-ckpt":
            rows.append([name] + st[:5] + [str(r["summary"].get("lost_steps", 0))] + st[5:])
        elif experiment == "ablation-rate":
            rows.append([name, f"{r['spec']['p']:.3g}"] + st)
        else:
            rows.append([f"{r['spec']['label']} (strategy {r['spec']['strategy']}) @ 0%"] + st)
    if experiment == "ablation-init":
        header.append("paper Fig. 2 perplexity (500M)")
    elif experiment == "ablation-ckpt":
        header.insert(6, "steps lost to rollbacks")
    elif experiment == "ablation-rate":
        header.insert(1, "p per step")
    return markdown_table(header, rows)


def swap_gaps(analysis: dict[str, Any]) -> dict[int, list[tuple[int, float]]]:
    """Per seed: (step, validation-loss gap checkfree+ minus the plain pipeline) at each common evaluation, no
    failures (the cost of the swaps, paper Fig. 4c)."""
    out = {}
    runs = [r for r in analysis["runs"].values() if r["spec"]["rate"] == 0 and r["spec"]["runtime"] == "sim"]
    for seed in sorted({r["spec"]["seed"] for r in runs}):
        plain = next((r for r in runs if r["spec"]["seed"] == seed and r["spec"]["label"] == "no failures"), None)
        plus = next((r for r in runs if r["spec"]["seed"] == seed and r["spec"]["strategy"] == "checkfree+"), None)
        if plain and plus:
            a = {v["step"]: v["val_loss"] for v in plain["val"]}
            b = {v["step"]: v["val_loss"] for v in plus["val"]}
            out[seed] = [(k, b[k] - a[k]) for k in sorted(set(a) & set(b))]
    return out
