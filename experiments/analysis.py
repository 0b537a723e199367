"""From run directories to results.json, and from results.json to the numbers the reports show.

Two steps, so that every report (table.md, the README's rendered regions) is computed by the same
code from the same committed file:

* `load_run` reads one run directory into a *record*: what the run wrote (spec, summary,
  provenance, validation curve with its recorded clock, training losses, failures, recoveries with
  their coefficients, how often each stage's gradient was clipped). `write_results` stores the
  records of an experiment with its settings; `read_results` loads them back.
* `derive` computes, from records, everything a table shows: the simulated clock priced by the
  current cost model (experiments.clock), the target, the time to target, hours.

Time to target. The target is a validation loss: `--target` if given, else the failure-free
run's validation loss at `target_fraction` of the steps (the last evaluation at or before
that step), per seed. A run reaches it at the first evaluation (in execution order,
recomputations after a rollback included) whose validation loss is <= the target; the
simulated wall-clock and the executed iterations at that point are linearly interpolated
between that evaluation and the previous one. A run that never gets there (within its steps
or its iteration budget, or because it aborted) has not reached it.

The paper's own accounting (Table 2: hours = iterations to target x iteration time, 91.3 s,
or 151.04 s for redundant computation) is given beside the simulated hours: `paper_hours`.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

from checkfree.costmodel import CostModel
from checkfree.rundir import read_jsonl
from experiments.clock import repriced_s, run_config, stale_terms
from experiments.runner import run_dir
from experiments.spec import PAPER_ITERATION_S, PAPER_REDUNDANT_ITERATION_S, RunSpec, Settings

__all__ = ["load_run", "reference_target", "time_to_target", "derive", "analyse", "write_results", "read_results",
           "settings_from_dict", "CLIPPED", "RESULTS_FORMAT"]

RESULTS_FORMAT = 2
CLIPPED = 1.0 - 1e-4  # a stage's post-clip gradient norm at or above this was clipped (max_norm 1.0)


def _num(x: Any) -> float:
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan


def _json(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _clipped_share(metrics: list[dict[str, Any]]) -> list[float]:
    """Per stage: the share of executed steps whose post-clip gradient norm hit the clip (max_norm 1.0)."""
    norms = [m["grad_norms"] for m in metrics if m.get("grad_norms")]
    if not norms:
        return []
    return [round(sum(1 for n in norms if _num(n[s]) >= CLIPPED) / len(norms), 4) for s in range(len(norms[0]))]


def load_run(out: Path, spec: RunSpec) -> dict[str, Any]:
    """The record of one run: spec, summary, provenance, validation curve (recorded clock), training losses,
    failures, recoveries (sources and coefficients) and each stage's share of clipped steps."""
    d = run_dir(out, spec)
    summary = _json(d / "summary.json") or {"status": "missing"}
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
    recoveries = [{k: e.get(k) for k in ("step", "stage", "method", "sources", "coefficients", "omega_scope")}
                  | {"fallback": e.get("fallback")} for e in events if e.get("event") in ("recovery", "fallback")]
    return {"spec": spec.to_dict(), "summary": summary, "provenance": _json(d / "provenance.json"), "val": val,
            "loss": losses, "failures": failures, "recoveries": recoveries,
            "fallbacks": sum(1 for e in events if e.get("event") == "fallback"),
            "clipped_share": _clipped_share(metrics)}


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


def _reprice(r: dict[str, Any]) -> None:
    """The validation curve's clock with the step term of the current cost model (experiments.clock)."""
    cfg = run_config(r["spec"]["config"])
    prov = r.get("provenance") or {}
    r["clock_stale"] = stale_terms(prov.get("cost_model"), cfg) if r["spec"]["runtime"] == "sim" else []
    if "step_s" not in prov or r["spec"]["runtime"] != "sim":
        return
    step_s = CostModel(cfg).step_s()
    for v in r["val"]:
        v["sim_time_s_recorded"] = v["sim_time_s"]
        v["sim_time_s"] = repriced_s(v["sim_time_s"], v["iteration"], prov["step_s"], step_s)


def derive(runs: dict[str, dict[str, Any]], settings: Settings) -> dict[str, Any]:
    """Every run record with its clock re-priced and its time to target (targets from each seed's failure-free
    run); the records are copied, not changed."""
    runs = copy.deepcopy(runs)
    for r in runs.values():
        _reprice(r)
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
        r["final_val_loss"] = r["val"][-1]["val_loss"] if r["val"] else None
        r["total_hours"] = (max(v["sim_time_s"] for v in r["val"]) / 3600.0) if r["val"] else None
    return {"settings": settings.to_dict(), "targets": targets, "runs": runs}


def analyse(out: Path, specs: list[RunSpec], settings: Settings) -> tuple[dict[str, Any], dict[str, Any]]:
    """(records, derived) of the distinct runs of `specs`."""
    records = {s.name: load_run(out, s) for s in {s.name: s for s in specs}.values()}
    return records, derive(records, settings)


def _clean(x: Any) -> Any:
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def write_results(records: dict[str, dict[str, Any]], settings: Settings, path: Path) -> None:
    """results.json of an experiment: its settings and every run's record (what the runs wrote; nothing
    derived, so that a report re-reads it with the current code)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"format": RESULTS_FORMAT, "settings": settings.to_dict(), "runs": records}
    path.write_text(json.dumps(_clean(data), sort_keys=True, separators=(",", ":")))


def settings_from_dict(d: dict[str, Any]) -> Settings:
    return Settings(**{k: v for k, v in d.items() if k in Settings.__dataclass_fields__})


def read_results(path: Path) -> tuple[dict[str, dict[str, Any]], Settings]:
    """The records and settings of a results.json written by `write_results`."""
    data = json.loads(Path(path).read_text())
    if data.get("format") != RESULTS_FORMAT:
        raise ValueError(f"{path}: results format {data.get('format')!r}, this code reads {RESULTS_FORMAT}; "
                         f"rewrite it with `checkfree experiment ... --report-only` from the run directories")
    for r in data["runs"].values():  # JSON null back to NaN where the clock was not finite
        for v in r["val"]:
            v["sim_time_s"] = math.nan if v["sim_time_s"] is None else v["sim_time_s"]
    return data["runs"], settings_from_dict(data["settings"])
