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
    return {"status": summary.get("status"), "wall_s": summary.get("wall_s"), "val": val, "commit": commit,
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

    max_norm = study.base["train"]["max_grad_norm"]
    trunks = {t: _trunk_data(work / "runs" / f"trunk-{t}", study.branch_at, max_norm)
              for t in ("plain", "plus") if (work / "runs" / f"trunk-{t}").is_dir()}
    return {"study": study.to_dict(), "commit": commit, "command": command, "missing_inits": missing_inits,
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                        "loadavg_at_report": list(os.getloadavg())},
            "wall_s_this_invocation": round(wall_s, 1), "trunks": trunks,
            "runs": {r.name: {"kind": r.kind, "trunk": r.trunk, "at": r.at, "seed": r.seed, "init": r.init,
                              "stage": r.stage, "steps": r.steps, **_run_data(work / "runs" / r.name)} for r in runs},
            "cells": cells}


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
        pt = points.get(f"{trunk}@{c['at']}", {})
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


def _ranking(cells: list[dict[str, Any]], value, what: str) -> str:
    """One line per failed stage: the inits ordered by the mean of `value(cell)` over seeds, smallest first
    (coinciding inits listed once, with the ones they equal)."""
    lines = []
    for k in sorted({c["stage"] for c in cells}):
        means = {}
        for init in _inits(cells):
            cs = [c for c in cells if c["init"] == init and c["stage"] == k and c["coincides_with"] is None]
            vals = [v for v in (value(c) for c in cs) if v is not None]
            if vals:
                means[init] = mean(vals)
        same: dict[str, list[str]] = {}
        for c in cells:
            if c["stage"] == k and c["coincides_with"] in means:
                same.setdefault(c["coincides_with"], [])
                if c["init"] not in same[c["coincides_with"]]:
                    same[c["coincides_with"]].append(c["init"])
        order = sorted(means, key=means.get)
        if order:
            lines.append(f"- stage {k}, {what}, smallest first: " + " < ".join(
                f"{i}{' (= ' + ', '.join(same[i]) + ')' if same.get(i) else ''} {means[i]:.3f}" for i in order) + "\n")
    return "".join(lines)


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
    for at in st["branch_at"]:
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
        cells = [c for c in a["cells"] if c["at"] == at and c["trunk"] == "plain"]
        ranked = _ranking(cells, lambda c: c["damage"], "immediate damage") + _ranking(
            [c for c in cells if c["gaps"]], lambda c: c["gaps"][-1][1], "gap at the end of the curve")
        if ranked:
            parts.append("\nOrdered (means over seeds, computed from the cells above):\n\n" + ranked)
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
