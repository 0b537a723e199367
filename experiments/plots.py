"""PNG figures of an experiment (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from experiments.spec import ALL_STRATEGIES, rate_label  # noqa: E402

__all__ = ["color", "val_curves", "seed_bands", "convergence_figures", "ttt_bars", "ablation_figure", "save"]

_PALETTE = plt.get_cmap("tab20").colors


_COLORS = dict(zip(ALL_STRATEGIES, ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
                                     "#17becf", "#bcbd22", "#7f7f7f", "#aec7e8"]))


def color(label: str) -> Any:
    """A fixed colour per strategy (black for the failure-free reference)."""
    if label == "no failures":
        return "black"
    if label in _COLORS:
        return _COLORS[label]
    return _PALETTE[sum(map(ord, label)) % 20]


def save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def val_curves(ax, runs: list[dict[str, Any]], x: str, *, target: float | None = None, mark_failures: bool = False,
               label_fn=None, color_fn=None) -> None:
    """Validation loss of each run against simulated hours (x='hours') or executed iterations
    (x='iterations'); failures as x markers on the curve."""
    for r in runs:
        val = r["val"]
        if not val:
            continue
        lab = label_fn(r) if label_fn else r["spec"]["label"]
        if x == "hours":
            xs = [v["sim_time_s"] / 3600.0 for v in val]
        else:
            xs = [v["iteration"] + 1 for v in val]
        ys = [v["val_loss"] for v in val]
        style = "--" if r["spec"]["label"] == "no failures" else "-"
        c = color_fn(r) if color_fn else color(r["spec"]["label"])
        ax.plot(xs, ys, style, color=c, label=lab, lw=1.3 if style == "-" else 1.6)
        if mark_failures and r["failures"] and x == "iterations":
            fx = [f["iteration"] + 1 for f in r["failures"] if f["iteration"] + 1 <= xs[-1]]
            if fx:
                its = np.array(xs, dtype=float)
                fy = np.interp(fx, its, np.array(ys, dtype=float))
                ax.plot(fx, fy, "x", color=c, ms=4, mew=1.0)
    if target is not None and math.isfinite(target):
        ax.axhline(target, color="grey", lw=0.8, ls=":", label=f"target {target:.3f}")
    ax.set_ylabel("validation loss")
    ax.set_xlabel("simulated wall-clock (h)" if x == "hours" else "iterations executed (recomputations included)")
    ax.grid(alpha=0.3)


def seed_bands(ax, runs: list[dict[str, Any]], x: str, *, key=None, color_fn=None) -> None:
    """A shaded band from the lowest to the highest validation loss over the seeds of each curve (runs grouped
    by `key`, default their label), point by point (x: the seeds' mean); nothing for a curve with one seed."""
    key = key or (lambda r: r["spec"]["label"])
    groups: dict[Any, list[dict[str, Any]]] = {}
    for r in runs:
        if r["val"]:
            groups.setdefault(key(r), []).append(r)
    for rs in groups.values():
        if len(rs) < 2:
            continue
        n = min(len(r["val"]) for r in rs)
        vals = np.array([[v["val_loss"] for v in r["val"][:n]] for r in rs], dtype=float)
        if x == "hours":
            xs = np.mean([[v["sim_time_s"] / 3600.0 for v in r["val"][:n]] for r in rs], axis=0)
        else:
            xs = np.array([v["iteration"] + 1 for v in rs[0]["val"][:n]], dtype=float)
        c = color_fn(rs[0]) if color_fn else color(rs[0]["spec"]["label"])
        ax.fill_between(xs, vals.min(axis=0), vals.max(axis=0), color=c, alpha=0.15, lw=0)


def _ylim(ax, runs: list[dict[str, Any]], target: float | None) -> None:
    """Zoom on the interesting range: from the best loss to a bit above the target."""
    vals = [v["val_loss"] for r in runs for v in r["val"]]
    if not vals:
        return
    lo = min(vals)
    hi = (target if target is not None else np.median(vals))
    span = max(hi - lo, 1e-3)
    ax.set_ylim(lo - 0.1 * span, hi + 1.5 * span)


def convergence_figures(analysis: dict[str, Any], rates: list[float], strategies: list[str], outdir: Path,
                        prefix: str = "convergence") -> list[Path]:
    """Validation loss vs simulated wall-clock and vs iterations (failures marked), one panel per rate."""
    paths = []
    ref = [r for r in analysis["runs"].values() if r["spec"]["label"] == "no failures"
           and r["spec"]["runtime"] == "sim"]
    target = next(iter(analysis["targets"].values()), None)
    if analysis["settings"].get("target") is not None:
        target = analysis["settings"]["target"]
    seed0 = min((r["spec"]["seed"] for r in analysis["runs"].values()), default=0)
    for x, name in (("hours", "val_vs_wallclock"), ("iterations", "val_vs_steps")):
        fig, axes = plt.subplots(1, len(rates), figsize=(6.2 * len(rates), 4.8), squeeze=False, sharey=True)
        for ax, rate in zip(axes[0], rates):
            runs = [r for r in analysis["runs"].values() if r["spec"]["rate"] == rate and r["spec"]["runtime"] == "sim"
                    and r["spec"]["label"] in strategies and r["spec"]["seed"] == seed0]
            runs.sort(key=lambda r: strategies.index(r["spec"]["label"]))
            shown = runs + [r for r in ref if r["spec"]["seed"] == seed0]
            val_curves(ax, shown, x, target=target, mark_failures=(x == "iterations"))
            every_seed = [r for r in analysis["runs"].values() if r["spec"]["rate"] == rate
                          and r["spec"]["runtime"] == "sim" and r["spec"]["label"] in strategies]
            seed_bands(ax, every_seed + ref, x)
            _ylim(ax, shown, target)
            seeds = len({r["spec"]["seed"] for r in every_seed})
            ax.set_title(f"failure rate {rate_label(rate)} (seed {seed0}"
                         + (f"; bands: min-max over {seeds} seeds)" if seeds > 1 else ")")
                         + (": x = failure" if x == "iterations" else ""))
        axes[0][-1].legend(fontsize=7, loc="upper right", ncol=2)
        paths.append(save(fig, outdir / f"{prefix}_{name}.png"))
    paths.append(ttt_bars(analysis, rates, strategies, outdir / f"{prefix}_time_to_target.png"))
    return paths


def ttt_bars(analysis: dict[str, Any], rates: list[float], strategies: list[str], path: Path,
             key: str = "hours", ylabel: str = "simulated hours to target") -> Path:
    """Grouped bars: time to target per strategy and rate (mean over seeds). A run that never
    reached the target gets a hatched bar at its total simulated time (a lower bound) marked n/r."""
    fig, ax = plt.subplots(figsize=(max(8.0, 1.1 * len(strategies) * len(rates) * 0.45), 4.8))
    width = 0.8 / max(1, len(strategies))
    for j, s in enumerate(strategies):
        for i, rate in enumerate(rates):
            rs = [r for r in analysis["runs"].values() if r["spec"]["label"] == s and r["spec"]["rate"] == rate
                  and r["spec"]["runtime"] == "sim"]
            if not rs:
                continue
            xpos = i + (j - (len(strategies) - 1) / 2) * width
            vals = [r[key] for r in rs]
            if all(v is not None for v in vals):
                ax.bar(xpos, float(np.mean(vals)), width, color=color(s), label=s if i == 0 else None)
            else:
                tot = [r["total_hours"] if key == "hours" else None for r in rs]
                h = max([t for t in tot if t is not None], default=0.0)
                ax.bar(xpos, h, width, color=color(s), alpha=0.35, hatch="//", label=s if i == 0 else None)
                ax.text(xpos, h, "n/r", ha="center", va="bottom", fontsize=6, rotation=90)
    ref = [r[key] for r in analysis["runs"].values() if r["spec"]["label"] == "no failures" and r[key] is not None]
    if ref:
        ax.axhline(float(np.mean(ref)), color="black", ls="--", lw=1, label="no failures")
    ax.set_xticks(range(len(rates)), [f"{rate_label(r)} failure rate" for r in rates])
    ax.set_ylabel(ylabel)
    ax.set_title("time to target (hatched n/r: not reached; bar = total simulated time of the run)")
    ax.legend(fontsize=7, ncol=3)
    ax.grid(axis="y", alpha=0.3)
    return save(fig, path)


def ablation_figure(experiment: str, analysis: dict[str, Any], settings, path: Path) -> Path:
    """Two panels of an ablation: the first seed's validation curves (with min-max bands over the seeds) against
    iterations and against simulated hours (ablation-swap: the swap's validation-loss gap per seed instead)."""
    from experiments.tables import ablation_selection, swap_gaps

    runs = ablation_selection(experiment, analysis, settings)
    seed0 = settings.seeds[0]
    sel = [r for r in runs if r["spec"]["seed"] == seed0]
    target = settings.target if settings.target is not None else analysis["targets"].get(seed0)
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    color_fn, label_fn = None, None
    if experiment == "ablation-ckpt":
        longest = max(1, settings.scaled_interval(max(settings.ckpt_intervals)))
        color_fn = lambda r: color(r["spec"]["label"]) if not r["spec"]["label"].startswith("checkpoint") else \
            plt.get_cmap("Blues")(0.4 + 0.6 * r["spec"]["config"]["strategy"]["checkpoint_every"] / longest)
    elif experiment == "ablation-rate":
        rates = sorted(settings.plus_rates)
        color_fn = lambda r: "black" if r["spec"]["label"] == "no failures" else \
            plt.get_cmap("viridis")(rates.index(r["spec"]["rate"]) / max(1, len(rates) - 1) * 0.9)
        label_fn = lambda r: r["spec"]["label"] if r["spec"]["label"] == "no failures" else \
            f"checkfree+ @ {rate_label(r['spec']['rate'])}"
    titles = {"ablation-init": f"recovery initialisation, {rate_label(settings.init_rate)} failures (inner trace)",
              "ablation-ckpt": f"checkpoint frequency vs CheckFree+, {rate_label(settings.ckpt_rate)} failures",
              "ablation-rate": "CheckFree+ at several failure rates",
              "ablation-swap": "no failures: plain pipeline vs CheckFree+ swaps"}
    val_curves(axes[0], sel, "iterations", target=target, mark_failures=experiment != "ablation-swap",
               color_fn=color_fn, label_fn=label_fn)
    axes[0].set_title(titles[experiment] + f" (seed {seed0})")
    if len(settings.seeds) > 1:
        seed_bands(axes[0], runs, "iterations", key=lambda r: (r["spec"]["label"], r["spec"]["rate"]),
                   color_fn=color_fn)
    axes[0].legend(fontsize=7)
    if experiment == "ablation-swap":
        for seed, gaps in swap_gaps(analysis).items():
            axes[1].plot([k + 1 for k, _ in gaps], [g for _, g in gaps], color=color("checkfree+"),
                         alpha=1.0 if seed == seed0 else 0.5, label=f"seed {seed}")
        axes[1].axhline(0, color="grey", lw=0.8)
        axes[1].set_xlabel("step")
        axes[1].set_ylabel("val loss: checkfree+ minus plain")
        axes[1].set_title("the swap's cost (> 0: CheckFree+ behind)")
        axes[1].legend(fontsize=7)
        axes[1].grid(alpha=0.3)
    else:
        val_curves(axes[1], sel, "hours", target=target, color_fn=color_fn, label_fn=label_fn)
    return save(fig, path)
