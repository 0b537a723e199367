"""What an accelerator run's phases, paths and studies took, derived from its files: the basis of the caps and the
science shares of the next run (benchmarks.accelerator CAPS_S, phases.PATH_S, science.SHARES_S / SMOLLM2_STEP_S).

    python -m benchmarks.accelerator --timings DIR    # DIR: call2-science.tar.gz unpacked; writes timings.json

`derive` reads `call1.json`, `call2.json` (benchmarks/results/accelerator/) and the unpacked science tarball (the
runs' metrics and events, which are not committed: 20 MB) and keeps the few numbers the plan needs in
`benchmarks/results/accelerator/timings.json`; `timings_markdown` renders them (`--render` writes them into the
results README). An item's start is the call's start plus the phases and items before it (their recorded walls).
"""

from __future__ import annotations

import calendar
import json
import statistics
import time
from pathlib import Path
from typing import Any

__all__ = ["derive", "timings_markdown", "TIMINGS"]

TIMINGS = "timings.json"


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def _span(values: list[float], digits: int = 2) -> list[float] | None:
    return [round(min(values), digits), round(max(values), digits)] if values else None


def _runs(root: Path) -> list[dict[str, Any]]:
    """Each run folder under root: steps, median step time, first step and the resume's wall-clock times."""
    out = []
    for d in sorted(p for p in root.glob("**/runs/*") if (p / "metrics.jsonl").is_file()):
        m, ev = _jsonl(d / "metrics.jsonl"), _jsonl(d / "events.jsonl")
        times = [x["step_time_s"] for x in m if x.get("step_time_s") is not None]
        out.append({"name": d.name, "steps": len(m), "step_s": statistics.median(times) if times else None,
                    "first_step": m[0].get("time") if m else None,
                    # wall-clock per step, evaluations, recoveries and fallbacks included
                    "wall_step_s": (m[-1]["time"] - m[0]["time"]) / (len(m) - 1) if len(m) > 1 else None,
                    "resume": next((e.get("time") for e in ev if e.get("event") == "resume"), None)})
    return out


def derive(results: Path, science: Path | None) -> dict[str, Any]:
    """The timings of the run recorded under `results`, the science tarball unpacked at `science`."""
    calls = {c: json.loads((results / f"call{c}.json").read_text()) for c in (1, 2) if (results / f"call{c}.json").is_file()}
    t: dict[str, Any] = {"source": "call1.json, call2.json and the unpacked call2-science.tar.gz of the run "
                                   f"started {calls[1]['started'] if 1 in calls else '?'}"}
    if 1 in calls:
        ph = calls[1]["phases"]
        env, cor, speed = (ph.get(k, {}) for k in ("env", "correctness", "speed"))
        runs = (cor.get("results") or {}).get("runs") or {}
        paths = (speed.get("results") or {}).get("paths") or {}
        walls = {k: r["wall_s"] for k, r in paths.items() if r.get("ok")}
        t["call1"] = {
            "env_s": env.get("wall_s"),
            "probe_s": {k: v.get("s") for k, v in ((env.get("results") or {}).get("transport") or {}).items()
                        if isinstance(v, dict)},
            "correctness": {"s": cor.get("wall_s"), "cap_s": cor.get("cap_s"), "status": cor.get("status"),
                            "processes_at_once": len(runs),
                            "swarm_s": _span([r["wall_s"] for k, r in runs.items() if k.endswith("/swarm")], 1),
                            "sim_s": _span([r["wall_s"] for k, r in runs.items() if not k.endswith("/swarm")], 1),
                            "hf": "done" if (cor.get("results") or {}).get("hf") else "not reached"},
            "speed": {"s": speed.get("wall_s"), "cap_s": speed.get("cap_s"), "path_s": walls,
                      "not_measured": [k for k, r in paths.items() if not r.get("ok")],
                      # the recovery's own wall was not recorded in the first run: the phase less its paths
                      "recovery_and_setup_s": round(speed["wall_s"] - sum(walls.values()), 1) if speed.get("wall_s") else None}}
    if 2 in calls:
        ph = calls[2]["phases"]
        sci = (ph.get("science") or {}).get("results") or {}
        start = calendar.timegm(time.strptime(calls[2]["started"][:19], "%Y-%m-%dT%H:%M:%S")) + ph["env"]["wall_s"]
        items: dict[str, Any] = {}
        for name, rec in sci.items():
            if isinstance(rec, dict) and "wall_s" in rec:
                items[name] = {"start": start, "s": rec["wall_s"], "cap_s": rec.get("cap_s"), "status": rec.get("status")}
                start += rec["wall_s"]
        t["call2"] = {"env_s": ph["env"].get("wall_s"), "items": {k: {kk: v for kk, v in i.items() if kk != "start"}
                                                                  for k, i in items.items()}}
        if science is not None:
            t.update(_science(science, items, results))
    return t


def _science(science: Path, items: dict[str, Any], results: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item, root in (("fig2-124m", science / "fig2-124m"), ("table2-500m", science / "table2-500m")):
        runs = _runs(root)
        if not runs or item not in items:
            continue
        first = min(r["first_step"] for r in runs if r["first_step"])
        out[item] = {"processes": len(runs), "step_s": _span([r["step_s"] for r in runs if r["step_s"]], 3),
                     "wall_step_s": {r["name"].split("-s0-")[0]: round(r["wall_step_s"], 3) for r in runs
                                     if r["wall_step_s"]},
                     "steps": {r["name"].split("-s0-")[0]: r["steps"] for r in runs},
                     "first_step_after_item_start_s": round(first - items[item]["start"], 1)}
    smol = [r for r in _runs(science / "work") if r["resume"]]
    res = results / "science" / "smollm2" / "results.json"
    if smol and "smollm2" in items and res.is_file():
        study = json.loads(res.read_text())
        trunk = study["trunks"]["plain"]
        branches = [v for v in study["runs"].values() if v.get("step_time_s")]
        out["smollm2"] = {
            "trunk": {"steps": len(trunk["step_time_s"]), "step_s": round(statistics.median(trunk["step_time_s"]), 3),
                      "s": trunk["wall_s"]},
            "branch_processes": len(branches),
            "branch_step_s": _span([statistics.median(v["step_time_s"]) for v in branches], 3),
            "branch_step_s_median": round(statistics.median(statistics.median(v["step_time_s"]) for v in branches), 3),
            "branch_steps": _span([len(v["step_time_s"]) for v in branches], 0),
            "first_resume_after_item_start_s": round(min(r["resume"] for r in smol) - items["smollm2"]["start"], 1),
            "resumes_spread_s": round(max(r["resume"] for r in smol) - min(r["resume"] for r in smol), 1),
            "immediate_damage_measured": sum(1 for v in study["runs"].values() if v.get("recovered_val") is not None)}
    return out


def timings_markdown(t: dict[str, Any]) -> str:
    """The timings as a list (every number from timings.json)."""
    lines = [f"From {t['source']} (`benchmarks/results/accelerator/{TIMINGS}`, written by "
             "`python -m benchmarks.accelerator --timings DIR`):", ""]
    c1 = t.get("call1")
    if c1:
        cor, sp = c1["correctness"], c1["speed"]
        lines += [f"* call 1, env: {c1['env_s']} s (the transport probes, one after the matmul peak: "
                  + ", ".join(f"{k} {v} s" for k, v in c1["probe_s"].items()) + ").",
                  f"* call 1, correctness: {cor['processes_at_once']} runs at once, swarms {cor['swarm_s'][0]}-"
                  f"{cor['swarm_s'][1]} s, simulators {cor['sim_s'][0]}-{cor['sim_s'][1]} s; {cor['status']}; "
                  f"the HF check: {cor['hf']}.",
                  "* call 1, speed: " + ", ".join(f"{k} {v} s" for k, v in sp["path_s"].items())
                  + f"; the recovery and the phase's setup {sp['recovery_and_setup_s']} s; not measured: "
                  + (", ".join(sp["not_measured"]) or "none") + f" ({sp['s']} s of its {sp['cap_s']} s cap)."]
    c2 = t.get("call2")
    if c2:
        lines.append(f"* call 2, env: {c2['env_s']} s; the science items: " + "; ".join(
            f"{k} {v['s']} s of its {v['cap_s']} s share ({v['status']})" for k, v in c2["items"].items()) + ".")
    s = t.get("smollm2")
    if s:
        lines.append(f"* SmolLM2: the trunk alone {s['trunk']['steps']} steps in {s['trunk']['s']} s, "
                     f"{s['trunk']['step_s']} s a step (median); {s['branch_processes']} branch processes at once, "
                     f"{s['branch_step_s_median']} s a step (median of their medians, {s['branch_step_s'][0]}-"
                     f"{s['branch_step_s'][1]}), {s['branch_steps'][0]:.0f}-{s['branch_steps'][1]:.0f} of their 500 steps "
                     f"done at the stop; the first branch resumed {s['first_resume_after_item_start_s']} s after the "
                     f"item started, the last {s['resumes_spread_s']} s later; immediate damage measured by "
                     f"{s['immediate_damage_measured']} runs, none reported (a run counts when it finishes).")
    for item in ("fig2-124m", "table2-500m"):
        f = t.get(item)
        if f:
            lines.append(f"* {item}: {f['processes']} runs at once, {f['step_s'][0]}-{f['step_s'][1]} s a step "
                         f"(medians), first step {f['first_step_after_item_start_s']} s after the item started; steps "
                         "done, and the wall-clock a step took with evaluations and recoveries: "
                         + ", ".join(f"{k} {v} ({f['wall_step_s'].get(k)} s)" for k, v in f["steps"].items()) + ".")
    return "\n".join(lines)
