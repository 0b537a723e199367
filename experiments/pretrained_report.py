"""The results of a pretrained-recovery study (`experiments.pretrained`): collected from its run
directories into one results JSON, and rendered from that JSON into markdown tables and PNG plots.

Definitions (every number below is computed here from the results JSON, never typed):

* branch point value v0: the trunk's validation loss after the step before the branch point (the state saved);
* immediate damage: the validation loss right after the rebuild, before any step, minus v0;
* gap: a branch's validation loss minus the failure-free branch's of the same seed, at the same step;
* noise sigma: the reference's evaluation noise, the sample standard deviation over the seeds (data orders) of the
  failure-free branches' validation loss at each evaluation after the branch point, averaged over those evaluations;
* back within noise: the first evaluation (in steps after the failure) from which the gap stays <= sigma at every
  later evaluation of the curve; "not within N" when the last evaluation is still above.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from statistics import mean, stdev
from typing import Any

__all__ = ["collect", "analyse", "render_tables", "render_plots", "write_report", "load_results", "render_section",
           "update_docs", "SECTION_BEGIN", "SECTION_END"]



def unranked(study: dict[str, Any]) -> str:
    """Why a study without held-out evaluation ranks no init."""
    t = study["base"]["train"]
    tokens = t["eval_batches"] * t["microbatch_size"] * (t.get("seq_len") or study["base"]["model"]["context_length"])
    return (f"\nNot ranked: each immediate damage above is one evaluation of {tokens:,} tokens of the run's own "
            "validation split, with no paired interval, and sigma is the spread of failure-free training over data "
            "orders, not the error of an evaluation; a study with `heldout` set ranks inits by paired intervals.\n")

SECTION_BEGIN = "<!-- rendered by experiments.pretrained_report.render_section: do not edit -->"
SECTION_END = "<!-- end of the rendered section -->"


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    from checkfree.rundir import read_jsonl

    return read_jsonl(path) if path.is_file() else []


def _run_data(d: Path) -> dict[str, Any]:
    """What the report needs of one run directory."""
    try:
        summary = json.loads((d / "summary.json").read_text())
    except (OSError, json.JSONDecodeError):
        summary = {"status": "missing"}
    metrics, events = _read_jsonl(d / "metrics.jsonl"), _read_jsonl(d / "events.jsonl")
    val = [[m["step"], m["val_loss"]] for m in metrics if isinstance(m.get("val_loss"), (int, float))]
    damage = [e["val_loss"] for e in events if e.get("event") == "recovered_eval"]
    rec = [{k: e.get(k) for k in ("stage", "method", "sources", "coefficients", "omega_scope")}
           for e in events if e.get("event") in ("recovery", "fallback")]
    try:
        commit = json.loads((d / "run.json").read_text()).get("commit")
    except (OSError, json.JSONDecodeError):
        commit = None  # a trunk, or a run of a version that did not record it
    held = _read_jsonl(d / "heldout.jsonl")
    return {"status": summary.get("status"), "wall_s": summary.get("wall_s"), "val": val, "commit": commit,
            **({"heldout": held} if held else {}),
            "recovered_val": damage[0] if damage else None, "recoveries": rec,
            "loss": [[m["step"], m["loss"]] for m in metrics],
            "step_time_s": [m["step_time_s"] for m in metrics if "step_time_s" in m]}


def _trunk_data(d: Path, branch_at: list[int], max_norm: float) -> dict[str, Any]:
    run = _run_data(d)
    metrics = {m["step"]: m for m in _read_jsonl(d / "metrics.jsonl")}
    points = {}
    for at in branch_at:
        m = metrics.get(at - 1, {})
        val = [v for s, v in run["val"] if s == at - 1]
        points[str(at)] = {"val": val[0] if val else None,
                           **{k: m.get(k) for k in ("grad_norms", "grad_norms_pre", "block_grad_norms",
                                                    "block_grad_norms_pre")},
                           "clipped": [p > max_norm for p in m.get("grad_norms_pre", [])]}
    return {**run, "points": points}


def collect(study, work: Path, runs, cells: list[dict[str, Any]], *, missing_inits: list[str], commit: str,
            command: str, wall_s: float) -> dict[str, Any]:
    """The study's results JSON: settings, provenance, trunks, every branch run and every reported cell."""
    import os
    import platform

    from experiments.pretrained import Run as _Run, trunks as _seeds

    max_norm = study.base["train"]["max_grad_norm"]
    trunks = {}
    for t in ("plain", "plus"):
        for ts in _seeds(study):
            d = work / "runs" / _Run("", "trunk", t, trunk_seed=ts).name
            if d.is_dir():
                trunks[trunk_key(t, ts)] = _trunk_data(d, study.branch_at, max_norm)
    run_data = {r.name: {"kind": r.kind, "trunk": r.trunk, "at": r.at, "seed": r.seed, "init": r.init,
                         "stage": r.stage, "steps": r.steps,
                         **({"trunk_seed": r.trunk_seed} if r.trunk_seed is not None else {}),
                         **_run_data(work / "runs" / r.name)} for r in runs}
    seq_len = study.base["train"].get("seq_len") or study.base["model"]["context_length"]
    start = next((x for r in run_data.values() for x in r.get("heldout", []) if x["kind"] == "start"), None)
    held = {c: {"sequences": len(v), "tokens": len(v) * seq_len} for c, v in (start or {}).items()
            if c not in ("kind", "step")}
    return {"study": study.to_dict(), "commit": commit, "command": command, "missing_inits": missing_inits,
            **({"heldout": held} if held else {}),
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                        "loadavg_at_report": list(os.getloadavg())},
            "wall_s_this_invocation": round(wall_s, 1), "trunks": trunks,
            "runs": run_data,
            "cells": cells}


def trunk_key(trunk: str, trunk_seed: int | None) -> str:
    """A trunk's key in results.json: "plain" / "plus", or "plain/t1" in a study of several trunks."""
    return trunk if trunk_seed is None else f"{trunk}/t{trunk_seed}"


def load_results(path: str | Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


# ---- analysis --------------------------------------------------------------------------------------------------


def _ms(vals: list[float], digits: int = 3) -> str:
    """'mean ± std' of the finite values; the value alone when they are all equal; '—' when none."""
    vals = [v for v in vals if v is not None and math.isfinite(v)]
    if not vals:
        return "—"
    if len(set(vals)) == 1:  # one value, or the same for every seed
        return f"{vals[0]:.{digits}f}"
    return f"{mean(vals):.{digits}f} ± {stdev(vals):.{digits}f}"


def _ref_runs(data: dict[str, Any], at: int, trunk: str = "plain") -> dict[int, dict[str, Any]]:
    return {r["seed"]: r for r in data["runs"].values()
            if r["kind"] == "reference" and r["at"] == at and r["trunk"] == trunk and r["status"] == "completed"}


def noise(data: dict[str, Any], at: int, trunk: str = "plain") -> float | None:
    """The reference's evaluation noise at branch point `at` (module docstring)."""
    refs = list(_ref_runs(data, at, trunk).values())
    if len(refs) < 2:
        return None
    by_step: dict[int, list[float]] = {}
    for r in refs:
        for s, v in r["val"]:
            by_step.setdefault(s, []).append(v)
    stds = [stdev(v) for v in by_step.values() if len(v) == len(refs)]
    return mean(stds) if stds else None


def _gaps(run: dict[str, Any], ref: dict[str, Any]) -> list[tuple[int, float]]:
    refv = dict((s, v) for s, v in ref["val"])
    return [(s - run["at"] + 1, v - refv[s]) for s, v in run["val"] if s in refv]


def _back_within(gaps: list[tuple[int, float]], sigma: float) -> int | None:
    """Steps after the failure from which every gap is <= sigma; None if the last one is above."""
    if not gaps or gaps[-1][1] > sigma:
        return None
    first = gaps[-1][0]
    for steps, g in reversed(gaps):
        if g > sigma:
            break
        first = steps
    return first


def analyse(data: dict[str, Any]) -> dict[str, Any]:
    """Per cell: damage, gap curve, steps back within noise; per branch point: v0 and sigma."""
    study, runs = data["study"], data["runs"]
    points = {}
    for trunk, t in data["trunks"].items():
        for at, p in t["points"].items():
            points[f"{trunk}@{at}"] = {"v0": p["val"], "sigma": noise(data, int(at), trunk)}
    out = []
    for c in data["cells"]:
        run = runs.get(c["run"], {})
        trunk = run.get("trunk", "plain")
        pt = points.get(f"{trunk_key(trunk, c.get('trunk_seed'))}@{c['at']}", {})
        ok = run.get("status") == "completed"
        damage = run["recovered_val"] - pt["v0"] if ok and run.get("recovered_val") is not None and pt.get("v0") \
            is not None else None
        row = {**c, "trunk": trunk, "status": run.get("status"), "damage": damage, "gaps": None, "back_within": None}
        ref = _ref_runs(data, c["at"], trunk).get(c["seed"])
        if ok and run.get("kind") == "curve" and ref is not None:
            row["gaps"] = _gaps(run, ref)
            if pt.get("sigma") is not None:
                row["back_within"] = _back_within(row["gaps"], pt["sigma"])
        out.append(row)
    return {"points": points, "cells": out, "recover_steps": study["recover_steps"]}


# ---- paired held-out analysis (issue 39) ----------------------------------------------------------------------


def is_paired(data: dict[str, Any]) -> bool:
    """Whether the study evaluated its branches on the held-out sequences (experiments.heldout), per sequence."""
    return any(r.get("heldout") for r in data["runs"].values())


def _line(run: dict[str, Any], kind: str, step: int | None = None) -> dict[str, Any] | None:
    return next((x for x in run.get("heldout", []) if x["kind"] == kind and (step is None or x["step"] == step)),
                None)


def paired_analysis(data: dict[str, Any]) -> dict[str, Any]:
    """Per (branch point, stage, corpus): each init's immediate damage (loss right after the rebuild minus the saved
    state's, per held-out sequence and trunk) and the paired difference of every two inits, with their 95 %
    intervals; per curve: the gap to the failure-free branch of the same trunk at every evaluation (interval), the
    steps until the gap is back inside the paired interval of zero (and stays), and the area under the gap."""
    from experiments.heldout import curve_rows
    from experiments.paired import auc, crossed_interval

    runs = data["runs"]
    cells = [c for c in data["cells"] if runs.get(c["run"], {}).get("status") == "completed"]
    refs = {(r["at"], r.get("trunk_seed"), r["seed"]): r for r in runs.values()
            if r["kind"] == "reference" and r["trunk"] == "plain" and r["status"] == "completed"}
    out: dict[str, Any] = {"damage": {}, "diffs": {}, "curves": {}, "corpora": []}
    for at in data["study"]["branch_at"]:
        for k in sorted({c["stage"] for c in cells if c["at"] == at and c.get("trunk", "plain") != "plus"}):
            cs = [c for c in cells if c["at"] == at and c["stage"] == k and runs[c["run"]]["trunk"] == "plain"]
            inits = list(dict.fromkeys(c["init"] for c in cs))
            units = sorted({(c.get("trunk_seed"), c["seed"]) for c in cs})
            after: dict[str, dict[tuple, dict]] = {i: {} for i in inits}  # init -> unit -> recovered line
            for c in cs:
                line = _line(runs[c["run"]], "recovered")
                if line is not None:
                    after[c["init"]][(c.get("trunk_seed"), c["seed"])] = line
            start = {u: _line(refs[(at, *u)], "start") for u in units if (at, *u) in refs}
            corpora = [x for x in next(iter(start.values()), {}) if x not in ("kind", "step")] if start else []
            out["corpora"] = corpora or out["corpora"]
            full = [i for i in inits if set(after[i]) == set(units) and set(start) == set(units)]
            for corpus in corpora:
                mats = {i: [after[i][u][corpus] for u in units] for i in full}
                v0 = [start[u][corpus] for u in units]
                out["damage"][(at, k, corpus)] = {i: crossed_interval(_minus(m, v0)) for i, m in mats.items()}
                out["diffs"][(at, k, corpus)] = {(i, j): crossed_interval(_minus(mats[i], mats[j]))
                                                 for i in full for j in full if i != j}
            for i in inits:  # the curves of this stage
                curve = [c for c in cs if c["init"] == i and runs[c["run"]]["kind"] == "curve"]
                if not curve or not all((at, c.get("trunk_seed"), c["seed"]) in refs for c in curve):
                    continue
                for corpus in corpora:
                    series = []  # per evaluation: (steps after the failure, gaps per unit: trunks x sequences)
                    ref0 = [start[(c.get("trunk_seed"), c["seed"])][corpus] for c in curve]
                    evals = [x["step"] for x in runs[curve[0]["run"]].get("heldout", []) if x["kind"] == "eval"]
                    n = len(_line(runs[curve[0]["run"]], "eval", evals[0])[corpus]) if evals else 0
                    rows = curve_rows(len(ref0[0]), n) if n else []
                    rec = [_line(runs[c["run"]], "recovered")[corpus] for c in curve]
                    series.append((0, _minus([[v[r] for r in rows] for v in rec], [[v[r] for r in rows] for v in ref0])))
                    for s in evals:
                        own = [_line(runs[c["run"]], "eval", s) for c in curve]
                        ref = [_line(refs[(at, c.get("trunk_seed"), c["seed"])], "eval", s) for c in curve]
                        if any(x is None for x in own + ref):
                            break
                        series.append((s - at + 1, _minus([x[corpus] for x in own], [x[corpus] for x in ref])))
                    if len(series) < 2:
                        continue
                    gaps = [(s, crossed_interval(g)) for s, g in series]
                    back = None
                    for s, iv in reversed(gaps):
                        if iv.excludes_zero:
                            break
                        back = s
                    steps = [s for s, _ in series]
                    areas = [[auc(steps, [series[e][1][t][j] for e in range(len(series))])
                              for j in range(len(series[0][1][0]))] for t in range(len(series[0][1]))]
                    out["curves"][(at, k, i, corpus)] = {"gaps": gaps, "back": back, "last": steps[-1],
                                                         "auc": crossed_interval(areas), "areas": areas}
    return out


def _minus(a: list[list[float]], b: list[list[float]]) -> list[list[float]]:
    return [[x - y for x, y in zip(ra, rb)] for ra, rb in zip(a, b)]


def ordered(intervals: dict[str, Any], diffs: dict[tuple[str, str], Any]) -> str:
    """The inits by mean, smallest first, joined by "<" where the paired interval of the two neighbours lies below 0
    and by "≈" where it contains 0: no sentence ranks two inits whose interval contains 0."""
    order = sorted(intervals, key=lambda i: intervals[i].mean)
    text = order[0] if order else ""
    for a, b in zip(order, order[1:]):
        d = diffs.get((a, b))
        text += (" < " if d is not None and d.below else " ≈ ") + b
    return text


def _paired_tables(p: dict[str, Any], at: int) -> str:
    from experiments.paired import crossed_interval

    parts = []
    for corpus in p["corpora"]:
        keys = [key for key in p["damage"] if key[0] == at and key[2] == corpus]
        if not keys:
            continue
        stages = [key[1] for key in keys]
        inits = list(dict.fromkeys(i for key in keys for i in p["damage"][key]))
        n = next(iter(p["damage"][keys[0]].values())).how
        parts.append(f"\nImmediate damage on held-out `{corpus}` (loss right after the rebuild minus the saved "
                     f"state's, per held-out sequence and trunk; mean [95 % interval, {n}]):\n\n")
        rows = [[i] + [p["damage"][key][i].text() if i in p["damage"][key] else "—" for key in keys] for i in inits]
        parts.append(_table(["init"] + [f"stage {k}" for k in stages], rows))
        parts.append("\nPaired difference to the smallest (the same sequences and trunks; an interval that contains 0 "
                     "is no difference), and the order it licenses (`<`: the interval lies below 0; `≈`: it contains "
                     "0):\n\n")
        rows = []
        for key in keys:
            dam, diffs = p["damage"][key], p["diffs"][key]
            best = min(dam, key=lambda i: dam[i].mean)
            rows.append([f"stage {key[1]}", ordered(dam, diffs)] + [
                "; ".join(f"{i} {diffs[(i, best)].text()}" for i in dam if i != best)])
        parts.append(_table(["stage", "order", "each init minus the smallest"], rows))
        curves = {key: v for key, v in p["curves"].items() if key[0] == at and key[3] == corpus}
        if curves:
            parts.append(f"\nRecovery on held-out `{corpus}`: steps until the gap to the failure-free branch is back "
                         f"inside the paired interval of zero and stays there ('not within N': still outside at the "
                         f"last evaluation, N steps on); area under the gap in nat-steps (mean [95 % interval]):\n\n")
            cstages = sorted({key[1] for key in curves})
            cinits = list(dict.fromkeys(key[2] for key in curves))
            rows = []
            for i in cinits:
                row = [i]
                for k in cstages:
                    c = curves.get((at, k, i, corpus))
                    row.append("—" if c is None else (f"{c['back']} steps" if c["back"] is not None
                                                       else f"not within {c['last']}") + f"; area {c['auc'].text(2)}")
                rows.append(row)
            parts.append(_table(["init"] + [f"stage {k}" for k in cstages], rows))
            for k in cstages:
                cs = {key[2]: v for key, v in curves.items() if key[1] == k}
                areas = {i: v["auc"] for i, v in cs.items()}
                diffs = {(a, b): crossed_interval(_minus(cs[a]["areas"], cs[b]["areas"]))
                         for a in cs for b in cs if a != b}
                parts.append(f"\nStage {k}, by area under the gap: {ordered(areas, diffs)}.\n")
    return "".join(parts)


# ---- rendering -------------------------------------------------------------------------------------------------


def _num(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4f}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows]) + "\n"


def _inits(cells: list[dict[str, Any]]) -> list[str]:
    return list(dict.fromkeys(c["init"] for c in cells))


def _init_by_stage(cells: list[dict[str, Any]], cell) -> str:
    """A table of inits (rows) by failed stage (columns); `cell(cells of one init and stage)` -> its text."""
    stages = sorted({c["stage"] for c in cells})
    rows = [[init] + [cell([c for c in cells if c["init"] == init and c["stage"] == k]) for k in stages]
            for init in _inits(cells)]
    return _table(["init"] + [f"stage {k}" for k in stages], rows)


def _damage_cell(cs: list[dict[str, Any]]) -> str:
    same = {c["coincides_with"] for c in cs} - {None}
    return _ms([c["damage"] for c in cs]) + (f" (= {', '.join(sorted(same))})" if same else "")


def _recovery_cell(cs: list[dict[str, Any]]) -> str:
    if not cs:
        return "—"
    back = [c["back_within"] for c in cs]
    n_in = sum(b is not None for b in back)
    steps = _ms([float(b) for b in back if b is not None], 1) if n_in else "—"
    return f"{steps} [{n_in}/{len(cs)} seeds]; end gap {_ms([c['gaps'][-1][1] for c in cs if c['gaps']])}"


def _damage_table(a: dict[str, Any], at: int) -> str:
    return _init_by_stage([c for c in a["cells"] if c["at"] == at and c["trunk"] == "plain"], _damage_cell)


def _recovery_table(a: dict[str, Any], at: int, trunk: str = "plain") -> str:
    cells = [c for c in a["cells"] if c["at"] == at and c["trunk"] == trunk and c["gaps"] is not None]
    return _init_by_stage(cells, _recovery_cell) if cells else "no finished recovery curve yet\n"


def _omega_table(data: dict[str, Any], at: int) -> str:
    p = data["trunks"]["plain"]["points"][str(at)]
    if p.get("grad_norms") is None:
        return "trunk metrics missing\n"
    rows = [[str(s), f"{p['grad_norms_pre'][s]:.3f}", f"{p['grad_norms'][s]:.3f}",
             f"{p['block_grad_norms_pre'][s]:.3f}", f"{p['block_grad_norms'][s]:.3f}",
             "yes" if p["clipped"][s] else "no"] for s in range(len(p["grad_norms"]))]
    return _table(["stage", "pre-clip, stage", "post-clip, stage", "pre-clip, blocks", "post-clip, blocks",
                   "clipped"], rows)


def _coincidence_lines(a: dict[str, Any]) -> str:
    pairs = sorted({(c["at"], c["stage"], c["init"], c["coincides_with"]) for c in a["cells"] if c["coincides_with"]})
    if not pairs:
        return "No two inits rebuilt the same weights.\n"
    return "".join(f"- branch at {at}, stage {k}: {i} = {j} (same coefficients: run once, reported for both)\n"
                   for at, k, i, j in pairs)


def render_tables(data: dict[str, Any]) -> str:
    """The study's markdown section: provenance, omega at the branch point, damage, recovery, CheckFree+."""
    a = analyse(data)
    st = data["study"]
    runs = data["runs"].values()
    done = sum(r["status"] == "completed" for r in runs)
    walls = [r["wall_s"] for r in runs if r["status"] == "completed" and r.get("wall_s")]
    parts = [f"Study `{st['name']}`: commit `{data['commit']}`, {done} of {len(data['runs'])} branch runs finished "
             f"({sum(walls) / 3600:.2f} h of run wall-clock), seeds {st['seeds']} (data order after the branch), "
             f"trunk seed {st['trunk_seed']}.\n"]
    commits: dict[str, int] = {}
    for r in runs:
        if r["status"] == "completed":
            key = (r.get("commit") or "not recorded")[:12]
            commits[key] = commits.get(key, 0) + 1
    if commits:
        parts.append("Finished runs by the commit that ran them: "
                     + ", ".join(f"`{c}` {n}" for c, n in sorted(commits.items())) + ".\n")
    if data.get("command"):
        parts.append(f"Command: `{data['command']}`\n")
    if data.get("missing_inits"):
        parts.append(f"Not in this build (not run): {', '.join(data['missing_inits'])}.\n")
    if st.get("note"):
        parts.append(st["note"] + "\n")
    paired = is_paired(data)
    pa = paired_analysis(data) if paired else {}
    if paired:
        held = data.get("heldout") or {}
        parts.append(f"Trunks (seeds) {st.get('trunk_seeds')}, each branch trained on with its trunk's data order. "
                     "Every branch evaluated on the same held-out sequences: "
                     + ", ".join(f"`{c}` {v['tokens']:,} tokens ({v['sequences']} sequences)" for c, v in held.items())
                     + f"; a curve's evaluations on {st['heldout'].get('curve_tokens', 'all')} tokens of each.\n")
    for at in st["branch_at"]:
        if paired:
            parts.append(f"\n#### Branch at step {at}\n")
            parts.append(_paired_tables(pa, at))
            continue
        pt = a["points"].get(f"plain@{at}", {})
        sigma = pt.get("sigma")
        parts.append(f"\n#### Branch at step {at}\n\nValidation loss of the saved state v0 = "
                     f"{_num(pt.get('v0'))}; reference noise sigma = {_num(sigma)} (std over seeds of the failure-free branches, "
                     f"mean over their evaluations).\n\nomega at the branch point (the trunk's step {at - 1}):\n\n")
        parts.append(_omega_table(data, at))
        parts.append("\nImmediate damage (validation loss right after the rebuild minus v0; mean ± std over seeds, "
                     "a single value when the rebuild does not depend on the seed):\n\n")
        parts.append(_damage_table(a, at))
        parts.append(f"\nRecovery: steps after the failure until the gap to the failure-free branch stays within "
                     f"sigma (mean ± std over the seeds that got there [seeds within / seeds]); end gap: the gap "
                     f"after {st['recover_steps']} steps (mean ± std):\n\n")
        parts.append(_recovery_table(a, at))
        parts.append(unranked(st))
    if st.get("plus_steps"):
        at = st["branch_at"][-1]
        pt = a["points"].get(f"plus@{at}", {})
        plus = [c for c in a["cells"] if c["trunk"] == "plus"]
        rows = []
        for k in sorted({c["stage"] for c in plus}):
            cs = [c for c in plus if c["stage"] == k]
            rows.append([str(k), _ms([c["damage"] for c in cs]),
                         _ms([c["gaps"][-1][1] for c in cs if c["gaps"]]),
                         f"{sum(c['back_within'] is not None for c in cs)}/{len(cs)}"])
        parts.append(f"\n#### CheckFree+ (its own trunk, trained with the swapped routes), edge stages, branch at "
                     f"{at}\n\nv0 = {_num(pt.get('v0'))}, sigma = {_num(pt.get('sigma'))}\n\n")
        parts.append(_table(["stage", "immediate damage", f"gap after {st['plus_steps']} steps",
                             "seeds back within sigma"], rows))
    parts.append("\nCoincident inits:\n\n" + _coincidence_lines(a))
    return "".join(parts)


def render_plots(data: dict[str, Any], outdir: Path) -> list[Path]:
    """damage.png (damage by init and stage) and recovery-<at>.png (mean gap curves) per branch point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from experiments.plots import color, save

    a = analyse(data)
    paths = []
    for at in data["study"]["branch_at"]:
        cells = [c for c in a["cells"] if c["at"] == at and c["trunk"] == "plain"]
        inits, stages = _inits(cells), sorted({c["stage"] for c in cells})
        fig, ax = plt.subplots(figsize=(8, 4))
        width = 0.8 / max(1, len(inits))
        for j, init in enumerate(inits):
            ys = []
            for k in stages:
                vals = [c["damage"] for c in cells if c["init"] == init and c["stage"] == k and c["damage"] is not None]
                ys.append(mean(vals) if vals else math.nan)
            ax.bar([i + j * width for i in range(len(stages))], ys, width, label=init, color=color(init))
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(stages))], [f"stage {k}" for k in stages])
        ax.set_yscale("symlog", linthresh=0.01)
        ax.set_ylabel("immediate damage (val loss - v0)")
        ax.set_title(f"{data['study']['name']}: damage right after the rebuild, branch at {at}")
        ax.legend(fontsize=7, ncol=2)
        paths.append(save(fig, outdir / f"damage-at{at}.png"))
        curves = [c for c in cells if c["gaps"]]
        cstages = sorted({c["stage"] for c in curves})
        if not cstages:
            continue
        fig, axes = plt.subplots(1, len(cstages), figsize=(5 * len(cstages), 4), squeeze=False)
        sigma = a["points"].get(f"plain@{at}", {}).get("sigma")
        for ax, k in zip(axes[0], cstages):
            for init in inits:
                cs = [c["gaps"] for c in curves if c["init"] == init and c["stage"] == k]
                if not cs:
                    continue
                n = min(len(g) for g in cs)
                xs = [cs[0][i][0] for i in range(n)]
                ax.plot(xs, [mean(g[i][1] for g in cs) for i in range(n)], "-o", ms=3, label=init, color=color(init))
            if sigma is not None:
                ax.axhspan(-sigma, sigma, color="grey", alpha=0.2, label="reference noise ±sigma")
            ax.axhline(0, color="black", lw=0.8)
            ax.set_yscale("symlog", linthresh=0.01)
            ax.set_xlabel("steps after the failure")
            ax.set_ylabel("val loss - failure-free (same seed), mean over seeds")
            ax.set_title(f"stage {k} failed at step {at}")
        axes[0][0].legend(fontsize=7)
        paths.append(save(fig, outdir / f"recovery-at{at}.png"))
    return paths


def write_report(data: dict[str, Any], outdir: Path) -> Path:
    """results.json, table.md and the plots into `outdir`."""
    outdir.mkdir(parents=True, exist_ok=True)
    (outdir / "results.json").write_text(json.dumps(data, indent=1, sort_keys=True))
    (outdir / "table.md").write_text(render_tables(load_results(outdir / "results.json")))
    render_plots(data, outdir)
    return outdir


def render_section(root: str | Path, link_prefix: str = "") -> str:
    """The markdown of every study under `root` (a directory of <study>/results.json), each with its plots
    (linked as `link_prefix` + <study>/<file>): what docs/pretrained.md embeds between SECTION_BEGIN and
    SECTION_END, and what a renderer registry (experiments/README.md) can call."""
    root = Path(root)
    parts = []
    for d in sorted(p for p in root.iterdir() if (p / "results.json").is_file()):
        data = load_results(d / "results.json")
        plots = "".join(f"![{png.stem}]({link_prefix}{d.name}/{png.name})\n" for png in sorted(d.glob("*.png")))
        parts.append(f"### Study `{d.name}`\n\n{render_tables(data)}\n{plots}")
    return "\n".join(parts)


def update_docs(docs: Path, root: Path, link_prefix: str) -> None:
    """Replace the block between SECTION_BEGIN and SECTION_END of `docs` by `render_section(root, link_prefix)`."""
    text = docs.read_text()
    if SECTION_BEGIN not in text or SECTION_END not in text:
        raise ValueError(f"{docs} has no {SECTION_BEGIN!r} ... {SECTION_END!r} block")
    head, rest = text.split(SECTION_BEGIN, 1)
    tail = rest.split(SECTION_END, 1)[1]
    docs.write_text(f"{head}{SECTION_BEGIN}\n\n{render_section(root, link_prefix)}\n{SECTION_END}{tail}")


if __name__ == "__main__":  # python -m experiments.pretrained_report: docs/pretrained.md's results from the files
    update_docs(Path("docs/pretrained.md"), Path("experiments/results/pretrained"), "../experiments/results/pretrained/")
