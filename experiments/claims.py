"""Sentences and verdicts computed from the results: what the README may say about them.

`findings` states what the numbers of a matrix show (who reached the target, who was fastest, who ended
lowest), seed by seed; `paper_claims` takes the paper's claims one by one and says, seed by seed, whether
they hold here. Every verdict counts seeds; "not reached" is slower than any time that reached it, and a
comparison where neither run reached the target is undecided.
"""

from __future__ import annotations

import math
from pathlib import Path
from statistics import mean
from typing import Any

from experiments.readme import renderer
from experiments.sections import load
from experiments.spec import rate_label
from experiments.tables import markdown_table

__all__ = ["verdict", "findings", "paper_claims"]

INF = math.inf


def _by_seed(analysis: dict[str, Any], strategy: str | None = None, rate: float | None = None,
             label: str | None = None) -> dict[int, dict[str, Any]]:
    out = {}
    for r in analysis["runs"].values():
        sp = r["spec"]
        if sp["runtime"] != "sim" or (strategy and sp["strategy"] != strategy) or (rate is not None and sp["rate"] != rate):
            continue
        if (label or strategy) and sp["label"] != (label or strategy):
            continue
        out[sp["seed"]] = r
    return out


def _val(r: dict[str, Any], key: str) -> float:
    v = r.get(key)
    return INF if v is None else v


def _fmt(x: float, digits: str = ".1f") -> str:
    return "not reached" if x == INF else format(x, digits)


def verdict(outcomes: list[bool | None]) -> str:
    """'holds in k of n seeds' (with the undecided ones named)."""
    n, k = len(outcomes), sum(1 for o in outcomes if o)
    undecided = sum(1 for o in outcomes if o is None)
    text = f"holds in all {n} seeds" if k == n else f"holds in no seed" if k == 0 else f"holds in {k} of {n} seeds"
    return text + (f" ({undecided} undecided: neither run reached the target)" if undecided else "")


def _less(a: float, b: float) -> bool | None:
    return None if a == INF and b == INF else a < b


def _increasing(xs: list[float]) -> bool | None:
    """Each value above the one before (not reached counts as above anything; two not reached: undecided)."""
    if any(a == INF and b == INF for a, b in zip(xs, xs[1:])):
        return None
    return all(a < b for a, b in zip(xs, xs[1:]))


# --- findings ------------------------------------------------------------------------------

def findings(results: Path, matrix: str) -> str:
    analysis, s = load(results, matrix, "convergence")
    seeds = sorted(s.seeds)
    lines = []
    everywhere = [st for st in s.strategies
                  if all(_by_seed(analysis, st, r).get(x, {}).get("reached") for r in s.rates for x in seeds)]
    missed = [f"{st} at {rate_label(r)} ({sum(1 for x in _by_seed(analysis, st, r).values() if x['reached'])} of "
              f"{len(seeds)})" for st in s.strategies for r in s.rates
              if not all(x["reached"] for x in _by_seed(analysis, st, r).values())]
    lines.append(f"Reached the target in every seed at every rate: {', '.join(everywhere) or 'none'}. "
                 f"Reached it in fewer seeds (how many): {'; '.join(missed) or 'none'}.")
    ref = _by_seed(analysis, label="no failures")
    for rate in s.rates:
        fastest, lowest, below = [], [], {}
        for seed in seeds:
            runs = {st: _by_seed(analysis, st, rate).get(seed) for st in s.strategies}
            runs = {k: v for k, v in runs.items() if v}
            fastest.append(min(runs, key=lambda k: _val(runs[k], "iterations_to_target")))
            lowest.append(min(runs, key=lambda k: _val(runs[k], "final_val_loss")))
            for k, v in runs.items():
                if v["final_val_loss"] is not None and v["final_val_loss"] < ref[seed]["final_val_loss"]:
                    below[k] = below.get(k, 0) + 1
        lines.append(f"At {rate_label(rate)}, seed by seed ({' / '.join(map(str, seeds))}): fewest iterations to the "
                     f"target {' / '.join(fastest)}; lowest final validation loss {' / '.join(lowest)}. Ended below "
                     f"the failure-free run's final validation loss (seeds): "
                     + (", ".join(f"{k} {v}" for k, v in sorted(below.items(), key=lambda kv: -kv[1])) or "none") + ".")
    lines.append(_init_finding(results, matrix))
    swap, _ = load(results, matrix, "ablation-swap")
    plain, plus = _by_seed(swap, label="no failures"), _by_seed(swap, "checkfree+", 0.0)
    cost = [(_val(plus[x], "iterations_to_target") / _val(plain[x], "iterations_to_target") - 1) * 100
            for x in sorted(set(plain) & set(plus))]
    if cost:
        lines.append("Without failures, CheckFree+ (its swapped microbatches) needed "
                     f"{mean(cost):+.0f} % iterations to the target against the plain pipeline, mean over the seeds "
                     f"(per seed: {' / '.join(f'{c:+.0f} %' for c in cost)}).")
    return "".join(f"* {x}\n" for x in lines)


def _init_finding(results: Path, matrix: str) -> str:
    """Per seed, the recovery init with the lowest final validation loss (ablation-init, omega over the stage)."""
    init, si = load(results, matrix, "ablation-init")
    runs = [r for r in init["runs"].values() if r["spec"]["rate"] == si.init_rate and r["spec"]["runtime"] == "sim"]
    inits = sorted({r["spec"]["strategy"] for r in runs})
    seeds = sorted({r["spec"]["seed"] for r in runs})
    lowest = [min((r for r in runs if r["spec"]["seed"] == x), key=lambda r: _val(r, "final_val_loss"))["spec"]["strategy"]
              for x in seeds]
    means = {k: mean(r["final_val_loss"] for r in runs if r["spec"]["strategy"] == k) for k in inits}
    return (f"Recovery initialisation at {rate_label(si.init_rate)} ({', '.join(inits)}), seed by seed "
            f"({' / '.join(map(str, seeds))}): lowest final validation loss {' / '.join(lowest)}; by the mean over "
            f"the seeds, lowest first: " + " < ".join(f"{k} {means[k]:.4f}" for k in sorted(means, key=means.get)) + ".")


# --- the paper's claims --------------------------------------------------------------------

def _per_seed(a: dict[int, dict], b: dict[int, dict], key: str) -> tuple[str, list[bool | None]]:
    """'a / b' per seed (key's values) and whether a < b in each."""
    seeds = sorted(set(a) & set(b))
    text = "; ".join(f"{_fmt(_val(a[x], key), '.3g')} vs {_fmt(_val(b[x], key), '.3g')}" for x in seeds)
    return text, [_less(_val(a[x], key), _val(b[x], key)) for x in seeds]


def paper_claims(results: Path, matrix: str) -> str:
    conv, s = load(results, matrix, "convergence")
    rows = []

    def pair(claim: str, paper: str, a: str, b: str, rate: float, key: str, analysis=conv) -> None:
        text, outs = _per_seed(_by_seed(analysis, a, rate), _by_seed(analysis, b, rate), key)
        rows.append([claim, paper, f"{a} vs {b} at {rate_label(rate)}, {key.replace('_', ' ')} per seed: {text}",
                     verdict(outs)])

    paper_ratio = {5.0: "1.57x", 10.0: "1.69x", 16.0: "1.38x"}
    for rate in s.rates:
        pair(f"CheckFree+ reaches the target sooner than checkpointing ({rate_label(rate)})",
             f"{paper_ratio.get(rate, '')} (Table 2, 500M)", "checkfree+", "checkpoint", rate, "hours")
    for rate, paper in ((5.0, "faster, 1.14x"), (16.0, "slower, 0.75x")):
        if rate in s.rates:
            text, outs = _per_seed(_by_seed(conv, "checkfree", rate), _by_seed(conv, "redundant", rate), "hours")
            rows.append([f"CheckFree vs redundant computation ({rate_label(rate)}): {paper.split(',')[0]}",
                         f"{paper} (Table 2)", f"checkfree vs redundant, hours per seed: {text}",
                         verdict(outs if rate == 5.0 else [None if o is None else not o for o in outs])])
    for rate, paper in ((5.0, "14,000 vs 14,500"), (16.0, "18,000 vs 22,000")):
        if rate in s.rates:
            pair(f"CheckFree+ needs fewer iterations than CheckFree ({rate_label(rate)})", f"{paper} (Table 2)",
                 "checkfree+", "checkfree", rate, "iterations_to_target")
    init, si = load(results, matrix, "ablation-init")
    order = ["checkfree", "copy", "random"]
    runs = {k: _by_seed(init, k, si.init_rate) for k in order}
    seeds = sorted(runs["checkfree"])
    ppl = {k: [math.exp(runs[k][x]["final_val_loss"]) for x in seeds] for k in order}
    rows.append([f"Recovery initialisation at {rate_label(si.init_rate)}: weighted average better than copy, copy "
                 "better than random (final perplexity)", "22.60 / 29.24 / 121.03 (Fig. 2, 500M)",
                 "; ".join(f"{k} {mean(v):.1f} ({' / '.join(f'{x:.1f}' for x in v)})" for k, v in ppl.items()),
                 verdict([ppl["checkfree"][i] < ppl["copy"][i] < ppl["random"][i] for i in range(len(seeds))])])
    ckpt = {r: _by_seed(conv, "checkpoint", r) for r in s.rates}
    rows.append(["Checkpointing slows down as failures get more frequent (iterations to target)",
                 "558 / 622 / 634 h (Table 2)",
                 "; ".join(f"seed {x}: " + " / ".join(_fmt(_val(ckpt[r][x], "iterations_to_target")) for r in s.rates)
                           for x in sorted(ckpt[s.rates[0]])),
                 verdict([_increasing([_val(ckpt[r][x], "iterations_to_target") for r in s.rates])
                          for x in sorted(ckpt[s.rates[0]])])])
    rate_a, sr = load(results, matrix, "ablation-rate")
    plus = {r: _by_seed(rate_a, "checkfree+", r) for r in sr.plus_rates}
    rows.append([f"CheckFree+ slows down as failures get more frequent ({' / '.join(map(rate_label, sr.plus_rates))})",
                 "Fig. 4a", "; ".join(f"seed {x}: " + " / ".join(_fmt(_val(plus[r][x], "iterations_to_target"))
                                                                  for r in sr.plus_rates) for x in sorted(plus[0.0])),
                 verdict([_increasing([_val(plus[r][x], "iterations_to_target") for r in sr.plus_rates])
                          for x in sorted(plus[0.0])])])
    swap, _ = load(results, matrix, "ablation-swap")
    text, outs = _per_seed(_by_seed(swap, label="no failures"), _by_seed(swap, "checkfree+", 0.0),
                           "iterations_to_target")
    rows.append(["Without failures CheckFree+ converges more slowly than the plain pipeline (its swaps' cost)",
                 "Fig. 4c", f"plain vs checkfree+, iterations to target per seed: {text}", verdict(outs)])
    ck, sc = load(results, matrix, "ablation-ckpt")
    by_interval: dict[int, dict[int, dict]] = {}
    for r in ck["runs"].values():
        if r["spec"]["strategy"] == "checkpoint":
            by_interval.setdefault(r["spec"]["config"]["strategy"]["checkpoint_every"], {})[r["spec"]["seed"]] = r
    every = sorted(by_interval)
    rows.append([f"More frequent checkpoints converge faster ({rate_label(sc.ckpt_rate)}; every "
                 f"{' / '.join(map(str, every))} steps)", "Fig. 4b",
                 "; ".join(f"seed {x}: " + " / ".join(_fmt(_val(by_interval[e][x], "iterations_to_target"))
                                                      for e in every) for x in sorted(by_interval[every[0]])),
                 verdict([_increasing([_val(by_interval[e][x], "iterations_to_target") for e in every])
                          for x in sorted(by_interval[every[0]])])])
    return markdown_table(["the paper's claim", "paper", "here", "verdict"], rows)


renderer("small.findings")(lambda results: findings(results, "small"))
renderer("small.paper")(lambda results: paper_claims(results, "small"))
