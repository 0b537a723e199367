"""The accelerator run's results as Markdown: the summary each call writes beside its JSON, and the rendered region
of docs/performance.md, both from the result files alone (`callN.json`, as benchmarks.accelerator writes them and
as they are committed under benchmarks/results/accelerator/). Every number shown is read from a file here.

    python -m benchmarks.accelerator --render      # docs/performance.md's region from the committed files
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from benchmarks.accelerator import SCIENCE_ITEMS

__all__ = ["RESULTS", "BEGIN", "END", "summary_markdown", "render_region", "render_docs", "load_calls"]

RESULTS = Path("benchmarks/results/accelerator")
BEGIN, END = "<!-- BEGIN rendered: accelerator -->", "<!-- END rendered: accelerator -->"
NO_RUN = ("No accelerator run is recorded yet: `benchmarks/results/accelerator/` holds no `call1.json` or "
          "`call2.json`. The script is ready (benchmarks/README.md, \"On a GPU\"); this region is rendered from its "
          "files by `python -m benchmarks.accelerator --render`.")


def _f(x: Any, fmt: str = ".4g") -> str:
    if x is None:
        return "—"
    if isinstance(x, float) and not math.isfinite(x):
        return "∞"
    return format(x, fmt) if isinstance(x, (int, float)) and not isinstance(x, bool) else str(x)


def _yes(x: Any) -> str:
    return "yes" if x is True else ("**no**" if x is False else "—")


def _phase_line(name: str, rec: dict) -> str:
    return f"* {name}: {rec.get('status')} in {_f(rec.get('wall_s'))} s (cap {_f(rec.get('cap_s'))} s)"


def _env(res: dict) -> list[str]:
    info, peak, tr, v = (res.get(k) or {} for k in ("device_info", "peak", "transport", "versions"))
    lines = [f"Device: {info.get('name', info.get('device', '—'))}" + (
        f" (compute capability {info['capability']}, {info['multiprocessors']} multiprocessors, "
        f"{info['memory_total'] / 2**30:.0f} GiB)" if "capability" in info else "") +
        f"; torch {v.get('torch', '—')} (CUDA {v.get('cuda', '—')}), transformers {v.get('transformers', '—')}, "
        f"Python {v.get('python', '—')}."]
    if peak:
        lines.append(f"Measured matmul peak (torch.matmul, mean of 10 after 3 warm-ups): bf16 "
                     f"{_f(peak.get('bf16_tflops'))} TFLOP/s at n = {_f(peak.get('bf16_n'))}, float32 (TF32 off) "
                     f"{_f(peak.get('fp32_tflops'))} TFLOP/s at n = {_f(peak.get('fp32_n'))}.")
    if tr:
        lines.append(f"Swarm transport: **{tr.get('chosen')}** (hivemind's daemon started: "
                     f"{_yes((tr.get('hivemind') or {}).get('ok'))}; tcp: {_yes((tr.get('tcp') or {}).get('ok'))})"
                     + (f"; {tr['note']}" if tr.get("note") else "") + ".")
    return lines


def _hf_lines(hf: dict) -> list[str]:
    """The HF in/out check: each part as far as it got, a failed part with its error."""
    def failed(part: dict) -> str:
        err = str(part.get("error") or "").strip().splitlines()
        return f"**failed**: `{err[-1][:200]}`" if err else "**failed**"

    export, out, inw, inr = (hf.get(k) for k in ("export", "out", "in_weights", "in_runs"))
    parts = []
    if export is not None and not export.get("ok"):
        parts.append(f"HF export (`checkfree export --format hf`): {failed(export)}.")
    if out is not None:
        parts.append(f"HF out: transformers' {out.get('class')} on the device, max logit difference "
                     f"{_f(out.get('max_logit_diff'), '.2e')} (tolerance {_f(out.get('tol'))}): {_yes(out.get('ok'))}."
                     if "max_logit_diff" in out else f"HF out: {failed(out)}.")
    if inw is not None:
        parts.append(f"HF in (`--init-from`): {inw.get('tensors')} tensors equal to the export's: {_yes(inw.get('ok'))}."
                     if "tensors" in inw else f"HF in (`--init-from`): {failed(inw)}.")
    def run(name: str, r) -> str:
        if not isinstance(r, dict):
            return f"the {name}: {r or 'still running'}"
        if r.get("finished") is False:
            return f"the {name}: {r['error'].split(' (')[0]}, {r.get('steps_done')} steps written"
        return f"the {name}: ok in {_f(r.get('wall_s'))} s" if r.get("ok") else f"the {name}: {failed(r)}"

    if inr is not None:
        cmp = inr.get("compare") or {}
        how = (f" (max loss difference {_f(cmp.get('max_loss_diff'), '.2e')})" if "max_loss_diff" in cmp else "")
        runs = "" if inr.get("ok") else "; ".join(run({"sim": "simulator"}.get(n, n), inr[n])
                                                  for n in ("sim", "swarm") if n in inr)
        parts.append(f"A run from it, swarm = simulator: {_yes(inr.get('ok'))}{how}" + (f" ({runs})." if runs else ".")
                     if "error" not in inr else f"A run from it: {failed(inr)}.")
    elif export is not None and export.get("ok"):
        sofar = hf.get("in_runs_so_far")
        parts.append("A run from it: not finished" + (f" ({run('simulator', sofar.get('sim'))}; "
                                                       f"{run('swarm', sofar.get('swarm'))})." if sofar else "."))
    if not parts and hf.get("error"):
        parts.append(f"HF in/out: {failed(hf)}.")
    return [" ".join(parts)] if parts else []


def _correctness(res: dict) -> list[str]:
    setup = res.get("setup") or {}
    if setup.get("only") == "hf":
        src = res.get("source_run") or {}
        lines = [f"The HF in/out check alone, from a simulator run of its own (`{' '.join(setup.get('source') or [])}`"
                 f": {'ok' if src.get('ok') else ('**failed**' if src else 'not finished')}); the swarm over "
                 f"`{setup.get('transport')}`; tolerances: logits {_f((setup.get('tolerances') or {}).get('logits'))}, "
                 f"losses {_f((setup.get('tolerances') or {}).get('fp32'))}."]
        if res.get("hf"):
            lines += [""] + _hf_lines(res["hf"])
        if "error" in res:
            lines += ["", "Error: `" + str(res["error"]).strip().splitlines()[-1][:300] + "`"]
        return lines
    lines = [f"Swarm (real processes, `{setup.get('transport')}`) against the simulator, `{setup.get('preset')}` "
             f"preset, {setup.get('steps')} steps; tolerance: float32 {_f((setup.get('tolerances') or {}).get('fp32'))}, "
             f"bf16 {_f((setup.get('tolerances') or {}).get('bf16'))} (relative, per step).", "",
             "| case | equal | max loss difference | max val-loss difference | recoveries (step/stage/method) | same "
             "recoveries | max coefficient difference | floor (the simulator twice) | bf16 vs float32 |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, c in (res.get("checks") or {}).items():
        recs = ", ".join(f"{r['step']}/{r['stage']}/{r['method']}" for r in c.get("recoveries") or [])
        lines.append(f"| {name}{' (simulator twice: ' + c['swarm'] + ')' if c.get('swarm') else ''} | {_yes(c.get('ok'))} | {_f(c.get('max_loss_diff'), '.2e')} | "
                     f"{_f(c.get('max_val_loss_diff'), '.2e')} | {recs or '—'} | {_yes(c.get('recoveries_same'))} | "
                     f"{_f(c.get('max_coefficient_diff'), '.2e')} | "
                     f"{_f((c.get('floor') or {}).get('max_loss_diff'), '.2e')} | "
                     f"{_f((c.get('vs_fp32') or {}).get('max_loss_diff'), '.2e')} |")
    if res.get("hf"):
        lines += [""] + _hf_lines(res["hf"])
    if "error" in res:
        lines += ["", "Error: `" + str(res["error"]).strip().splitlines()[-1][:300] + "`"]
    return lines


def _speed(res: dict) -> list[str]:
    s = res.get("setup") or {}
    lines = [f"`{s.get('preset')}` shape, {s.get('stages')} stages, {s.get('microbatches')} microbatches of "
             f"{s.get('microbatch_size')} sequences ({_f(s.get('tokens_per_step'), ',')} tokens a step), bf16 autocast: "
             f"{_yes(s.get('bf16'))}; {_f(s.get('steps'))} steps, the first {_f(s.get('warmup'))} left out; model FLOPs "
             f"{_f(s.get('flops_per_step'), '.3e')} a step; MFU against the measured bf16 peak "
             f"{_f(s.get('peak_bf16_tflops'))} TFLOP/s.", "",
             "| path | s/step (median) | tokens/s | MFU | torch gpipe ÷ path (above 1: faster) | max loss difference to torch gpipe |",
             "|---|---|---|---|---|---|"]
    for name, r in (res.get("paths") or {}).items():
        if not r.get("ok"):
            lines.append(f"| {name} | not measured: {str(r.get('cut') or r.get('error') or '')[:120]} | | | | |")
            continue
        lines.append(f"| {name} | {_f(r.get('period_s'), '.4f')} | {_f(r.get('tokens_per_s'), ',.0f')} | "
                     f"{_f(r.get('mfu') * 100 if r.get('mfu') is not None else None, '.2f')} % | "
                     f"{_f(r.get('torch_gpipe_over_path'), '.3f')} | {_f(r.get('max_loss_diff_to_torch_gpipe'), '.2e')} |")
    if s.get("comparison"):
        lines += ["", "The comparison: " + s["comparison"] + "."]
    rec = res.get("recovery") or {}
    if rec.get("ok"):
        lines += ["", f"Recovery of a {rec.get('stage_params', 0) / 1e6:.1f}M-parameter stage (`{rec.get('config')}`, "
                      f"SIGKILL of stage 1): detection {_f(rec.get('detection_s'), '.3f')} s, weight transfer "
                      f"{_f(rec.get('transfer_s'), '.3f')} s ({rec.get('bytes', 0) / 2**20:.0f} MiB), averaging "
                      f"{_f(rec.get('averaging_s'), '.3f')} s, detected → rebuilt {_f(rec.get('recovery_total_s'), '.3f')} "
                      f"s; the resumed step {_f(rec.get('resume_step_s'), '.3f')} s, a normal one "
                      f"{_f(rec.get('normal_step_s'), '.3f')} s."]
    elif rec:
        lines += ["", f"Recovery: not measured ({str(rec.get('cut') or rec.get('error'))[:200]})."]
    return lines


FIGURE = re.compile(r"\[([^\]]+)\]\(([^)/\s]+\.png)\)")


def _science(res: dict, figures: Path | None = None) -> list[str]:
    """Each item's status and table. `figures` (the committed science folder, rendering docs/): a table's figure
    links aimed at the item's committed copy (`figures/ITEM/NAME.png`, from docs/), a figure not committed named
    without a link; without it (a call's own summary), the links as the study wrote them."""
    lines = []
    for item in ("smollm2", *SCIENCE_ITEMS):  # ("smollm2": the first run's item, curves and damage at once)
        r = res.get(item)
        if r is None:
            continue
        lines.append(f"**{item}**: {r.get('status') or r.get('cut')}" + (f" in {_f(r.get('wall_s'))} s" if r.get("wall_s")
                                                                        else "") +
                     (f"; cut: {r['cut']}" if r.get("cut") and r.get("status") else "") +
                     (f"; error: `{str(r['error']).strip().splitlines()[0][:200]}`" if r.get("error") else ""))
        if r.get("table"):
            table = r["table"].strip()
            if figures is not None:
                def aim(m: re.Match, item: str = item) -> str:
                    if (figures / item / m.group(2)).is_file():
                        return f"[{m.group(1)}](../{RESULTS.as_posix()}/science/{item}/{m.group(2)})"
                    return f"{m.group(1)} (not committed)"

                table = FIGURE.sub(aim, table)
            # markdown="1": the site (mkdocs' md_in_html) renders the table inside; GitHub does without it
            lines += ["", '<details markdown="1"><summary>table</summary>', "", table, "", "</details>", ""]
    return lines or ["Not run."]


SECTIONS = {"env": _env, "correctness": _correctness, "speed": _speed, "science": _science}


def _dirty(flag: Any) -> str:
    return "with changes" if flag else ("clean" if flag is False else "changes unknown")


def commit_line(record: dict) -> str:
    """Which code ran, and where that is known from: the pack's manifest (the commit the pack was made at; the
    device's copy of the repository carries the session's git metadata, not the code's), else git where it ran."""
    code = record.get("code") or {}
    env = (record.get("phases", {}).get("env", {}).get("results") or {})
    pack_code = ((env.get("pack") or {}).get("code")) or {}
    if code.get("source"):  # recorded by the run itself (benchmarks.accelerator.pack.code_record)
        text = f"Commit {code.get('commit') or 'unknown'} ({_dirty(code.get('dirty'))}; from {code['source']})"
        if code.get("matches_pack") is True:
            text += "; the code that ran is the pack's, file for file"
        elif code.get("matches_pack") is False:
            text += "; **the code that ran differs from the pack's** (the pack is older than the code)"
        return text
    if pack_code.get("commit"):  # a record of the first run: its own `code` is the device copy's git metadata
        text = f"Commit {pack_code['commit']} ({_dirty(pack_code.get('dirty'))}; from the pack's manifest)"
        if code.get("commit") and code.get("commit") != pack_code["commit"]:
            text += (f"; the device's git metadata said {code['commit'][:10]} ({_dirty(code.get('dirty'))}), the "
                     f"session's starting commit, not the code that ran")
        return text
    return f"Commit {code.get('commit') or 'unknown'} ({_dirty(code.get('dirty'))}; from git where it ran)"


def summary_markdown(record: dict, figures: Path | None = None) -> str:
    """One call's summary (written beside callN.json on the device, printed at the end of the call); `figures`:
    see `_science`."""
    lines = [f"# Accelerator run, call {record.get('call')}" + (" (dry run, CPU)" if record.get("dry_run") else ""), "",
             f"{commit_line(record)}; started {record.get('started')}; {_f(record.get('wall_s'))} s.", ""]
    if record.get("device_sh"):
        lines += [f"device.sh: {record['device_sh'].get('error')} (exit {record['device_sh'].get('exit')}).", ""]
    lines += [_phase_line(n, r) for n, r in (record.get("phases") or {}).items()]
    for name, rec in (record.get("phases") or {}).items():
        results = rec.get("results") or {}
        lines += ["", f"## {name}", ""] + (_science(results, figures) if name == "science" else SECTIONS[name](results))
    return "\n".join(lines) + "\n"


CALL_FILE = re.compile(r"call(\d+|hf)(?:-(\d+))?\.json")


def load_calls(results: Path) -> list[tuple[str, dict]]:
    """(file name, record) of every recorded call: call1, call2, then call hf's tries, the earlier ones kept as
    `callhf-N.json` (N = 1 the first) before the latest, `callhf.json`."""
    found = [(m, p) for p in results.glob("call*.json") if (m := CALL_FILE.fullmatch(p.name))]
    order = {"1": 0, "2": 1, "hf": 2}
    found.sort(key=lambda mp: (order.get(mp[0].group(1), 3), mp[0].group(2) is None, int(mp[0].group(2) or 0)))
    return [(p.name, json.loads(p.read_text())) for _, p in found]


def render_region(results: Path) -> str:
    """The Markdown of docs/performance.md's region: every recorded call's sections, or NO_RUN."""
    calls = load_calls(results)
    if not calls:
        return NO_RUN
    parts = []
    for name, rec in calls:
        body = summary_markdown(rec, results / "science").split("\n", 2)[2]  # without the title: the page has its own headings
        what = " (the HF in/out check alone)" if rec.get("call") == "hf" else ""
        parts.append(f"**Call {rec.get('call')}**{what} (`{RESULTS}/{name}`)\n\n"
                     + body.replace("\n## ", "\n#### "))
    return "\n".join(parts).strip()


TIMINGS_BEGIN, TIMINGS_END = "<!-- BEGIN rendered: timings -->", "<!-- END rendered: timings -->"


def _rewrite(page: Path, begin: str, end: str, body: str) -> bool:
    text = page.read_text()
    if begin not in text or end not in text:
        raise ValueError(f"{page}: no {begin} ... {end} region")
    new = re.sub(re.escape(begin) + r".*?" + re.escape(end), lambda _: f"{begin}\n{body}\n{end}", text, flags=re.S)
    if new != text:
        page.write_text(new)
    return new != text


def render_timings(results: Path) -> str:
    from benchmarks.accelerator.timings import TIMINGS, timings_markdown

    path = results / TIMINGS
    return timings_markdown(json.loads(path.read_text())) if path.is_file() else f"No {TIMINGS} yet."


HF_CPU_BEGIN, HF_CPU_END = "<!-- BEGIN rendered: hf-cpu -->", "<!-- END rendered: hf-cpu -->"
HF_CPU = "cpu"  # under the results: call hf run on the CPU (`--device cpu`), callhf-LABEL.json


def render_hf_cpu(results: Path) -> str:
    """Call hf's correctness part run on the CPU (its own `--preset small` run, not the dry run's tiny one), one
    file per variant (`cpu/callhf-LABEL.json`): what each part took, and the run from the export."""
    lines = []
    for path in sorted((results / HF_CPU).glob("callhf-*.json")):
        rec = json.loads(path.read_text())
        cor = (rec.get("phases") or {}).get("correctness") or {}
        res = cor.get("results") or {}
        hf = res.get("hf") or {}
        inr = hf.get("in_runs") or {}
        walls = [("the source run", (res.get("source_run") or {}).get("wall_s"))] + \
            [(name, (hf.get(k) or {}).get("wall_s")) for name, k in (("the export", "export"), ("HF out", "out"),
                                                                    ("HF in", "in_weights"))] + \
            [(f"the {name} from the export", (inr.get(k) or {}).get("wall_s")) for name, k in (("simulator", "sim"),
                                                                                              ("swarm", "swarm"))]
        lines.append(f"* `{HF_CPU}/{path.name}`: {commit_line(rec)}; the correctness phase {cor.get('status')} in "
                     f"{_f(cor.get('wall_s'))} s (cap {_f(cor.get('cap_s'))} s): "
                     + ", ".join(f"{n} {_f(w)} s" for n, w in walls) + ". " + " ".join(_hf_lines(hf)))
    return "\n".join(lines) or f"No {HF_CPU}/callhf-*.json yet."


def render_docs(repo: Path, results: Path | None = None) -> dict[str, bool]:
    """Rewrite the region of docs/performance.md and the rendered regions of the results README (those it has);
    whether each page changed."""
    results = results or repo / RESULTS
    out = {"docs/performance.md": _rewrite(repo / "docs" / "performance.md", BEGIN, END, render_region(results))}
    readme = results / "README.md"
    if readme.is_file():
        changed = False
        for begin, end, render in ((TIMINGS_BEGIN, TIMINGS_END, render_timings), (HF_CPU_BEGIN, HF_CPU_END, render_hf_cpu)):
            if begin in readme.read_text():
                changed |= _rewrite(readme, begin, end, render(results))
        out[str(RESULTS / "README.md")] = changed
    return out
