"""The figures of docs/dst.md, rendered from result files (dst/results/), never typed: `python -m dst.report --write`
writes them into dst/results/measured.md, which the page includes (docs/hooks.py: `<!-- include ... -->`), and a
test checks that the file is what the result files give.

    dst/results/<name>.json   one run's summary: `summarize(report.jsonl)` plus how it was run (command, commit,
                              load average, wall time); a soak's `soak.json`; a determinism study's repeats
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

__all__ = ["summarize", "render", "code_commit", "RESULTS", "MEASURED"]

RESULTS = Path(__file__).resolve().parent / "results"
MEASURED = RESULTS / "measured.md"


def code_commit() -> str:
    """The code's commit (with "+changes" when the work tree differs), for the result files."""
    here = Path(__file__).resolve().parent
    git = ["git", "-C", str(here)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True)
    return (head or "unknown") + ("+changes" if dirty.stdout.strip() else "")


def summarize(report_jsonl: Path) -> dict:
    """The figures of one `checkfree chaos dst` run from its report.jsonl (generated schedules only)."""
    rows = [json.loads(line) for line in report_jsonl.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if isinstance(r["index"], int)]
    fired = Counter(line.split(" at it ")[0] for r in rows for line in r["fired"])
    return {"schedules": len(rows), "divergences": sum(1 for r in rows if r["divergences"]),
            "faults_injected": sum(len(r["fired"]) for r in rows), "fired_by_kind": dict(sorted(fired.items())),
            "strategies": dict(sorted(Counter(r["schedule"]["setup"]["strategy"] for r in rows).items())),
            "statuses": dict(sorted(Counter(str(r["status"]) for r in rows).items())),
            "schedule_seconds": round(sum(r["seconds"] for r in rows), 1),
            "rss_mb": [rows[0]["rss_mb"], max(r["rss_mb"] for r in rows), rows[-1]["rss_mb"]] if rows else [],
            "diverged": [{"index": r["index"], "first": r["divergences"][0][:300]} for r in rows if r["divergences"]]}


def _run(name: str, r: dict) -> list[str]:
    s = r["summary"]
    kinds = ", ".join(f"{k} {n}" for k, n in s["fired_by_kind"].items())
    out = [f"**{name}** (`{r['command']}`, commit {r['commit']}, load average {r['load']} at the start): "
           f"{s['schedules']} schedules, {s['divergences']} divergences, {s['faults_injected']} faults injected "
           f"in {r['wall_s'] / 60:.1f} min of wall time ({s['schedule_seconds'] / max(s['schedules'], 1):.1f} s a "
           f"schedule); resident memory {s['rss_mb'][0]:.0f} MB after the first schedule, {s['rss_mb'][1]:.0f} MB "
           f"at most, {s['rss_mb'][2]:.0f} MB after the last.", "", f"Faults injected by kind: {kinds}.", ""]
    for d in s["diverged"]:
        out.append(f"- schedule #{d['index']} diverged: {d['first']}")
    return out + ([""] if s["diverged"] else [])


def _quarters(samples: list[float]) -> list[float]:
    """The means of `samples` over its four quarters (whether memory stays flat)."""
    q = max(len(samples) // 4, 1)
    return [sum(part) / len(part) for i in range(4) if (part := samples[i * q:(i + 1) * q if i < 3 else None])]


def _short(command: str) -> str:
    """A soak's `checkfree local` command with its list of rebuild kills counted, not spelled out."""
    return re.sub(r"--chaos-rebuild-kills ([0-9,]+)",
                  lambda m: f"--chaos-rebuild-kills <{len(m.group(1).split(','))} steps>", command)


def render(results: Path = RESULTS) -> str:
    """The page's results block from the result files present."""
    lines = ["## Measured", "", "Rendered from the result files in `dst/results/` by `python -m dst.report --write`.", ""]
    for path in sorted(results.glob("run-*.json")):
        lines += _run(path.stem, json.loads(path.read_text()))
    repeats = [json.loads(p.read_text()) for p in sorted(results.glob("repeat-*.json"))]
    if repeats:
        lines += ["**Determinism**: each schedule replayed N times (`checkfree chaos dst --replay FILE --repeat N`); "
                  "an outcome is the run's signature (status, losses, the failures recorded, the faults fired, any "
                  "divergence):", ""]
        lines += [f"- `{' / '.join(x.strip() for x in r['schedule'].splitlines())}` (commit {r['commit']}, load average "
                  f"{r['load']} at the start, {r['wall_s'] / 60:.1f} min): the same outcome in {r['same']} of "
                  f"{r['repeats']} runs, {r['distinct']} distinct, {r['diverged']} diverged" for r in repeats]
        lines.append("")
    for soak in sorted(results.glob("soak-real*.json")):
        s = json.loads(soak.read_text())
        rss = [m for t, _, m in s["rss_mb"] if t >= s["rss_mb"][-1][0] * 0.2]
        partitions = f" ({s['partitions']} of them partitions)" if s.get("netns") else " (no partitions: --no-netns)"
        lines += [f"**Real-process soak** (commit {s['commit']}, load average {s['load']}): `{_short(s['command'])}`, stopped "
                  f"after {s['minutes']} min at step {s['steps']} ({s['status']}): {s['kills']} faults injected by the "
                  f"launcher{partitions}, {s['failures']} stage failures, {s['replicas_lost']} replicas lost, {s['recoveries']} "
                  f"recoveries, {s['fallbacks']} fallbacks, {s['recovery_retries']} recovery retries, "
                  f"{s['handovers']} handovers, {s['takeovers']} coordinator takeovers; lost steps "
                  f"{s['lost_steps']}; resident memory of the swarm's processes {rss[0]:.0f} MB at 20% of the run, "
                  f"{' / '.join(f'{m:.0f}' for m in _quarters(rss))} MB on average over each quarter after that, "
                  f"{max(rss):.0f} MB at most after that, {rss[-1]:.0f} MB at the end; left behind: "
                  f"{'; '.join(s['leftovers']) or 'nothing'}.", ""]
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        MEASURED.parent.mkdir(exist_ok=True)
        MEASURED.write_text(render())
    else:
        print(render(), end="")
