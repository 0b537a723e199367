"""`checkfree plot RUN_DIR`: a run directory as pictures (PNG, matplotlib's Agg backend: no display needed).

Reads the run-directory contract (`checkfree.rundir`): metrics.jsonl for the curves, events.jsonl for the
marks. Writes into RUN_DIR/plots/ (or --out):

* loss.png        training loss per step, validation loss where evaluated; failures, recoveries and
                  fallbacks marked at their steps
* step_time.png   seconds per step, the same marks
* wire_bytes.png  tensor payload sent between peers per step (swarm runs only: the simulator moves nothing
                  over a network, which the command says instead of drawing an empty plot)

A step recorded twice (a resumed run re-records the steps after its save) is plotted once, its newest record.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["RunRecords", "read_run", "event_marks", "plot_run", "add_parser"]

MARKS = {  # event -> (legend label, colour, marker): what the loss and step-time plots mark
    "failure": ("failure", "#d62728", "x"),
    "recovery": ("recovery", "#2ca02c", "^"),
    "fallback": ("fallback", "black", "X"),
    "replica_lost": ("replica lost", "#ff7f0e", "v"),
}


@dataclass
class RunRecords:
    """What a run directory recorded: one metrics record per step (sorted by step) and its events."""

    name: str
    metrics: list[dict[str, Any]]
    events: list[dict[str, Any]]
    strategy: str | None


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON lines of `path`; a cut last line (a killed writer) is skipped, any other bad line is an error."""
    lines = path.read_text().split("\n")
    complete, last = lines[:-1], lines[-1]  # `last` is "" when the file ends with a newline
    records = []
    for i, line in enumerate(complete, 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i}: not a JSON line ({e.msg})") from None
    if last.strip():  # no newline after it: complete, or cut by a killed writer (dropped, as rundir does)
        try:
            records.append(json.loads(last))
        except json.JSONDecodeError:
            pass
    return records


def read_run(run_dir: str | Path) -> RunRecords:
    """The records of `run_dir`; ValueError (one line) if it is missing, not a run directory or empty."""
    run = Path(run_dir)
    if not run.exists():
        raise ValueError(f"{run}: no such run directory")
    if not run.is_dir():
        raise ValueError(f"{run}: not a directory (give the run directory, e.g. runs/x)")
    if not (run / "metrics.jsonl").exists():
        raise ValueError(f"{run}: no metrics.jsonl: not a run directory, or the run has not started a step yet")
    by_step = {m["step"]: m for m in _read_jsonl(run / "metrics.jsonl") if isinstance(m.get("step"), int)}
    if not by_step:
        raise ValueError(f"{run}/metrics.jsonl has no step records yet: nothing to plot")
    events = _read_jsonl(run / "events.jsonl") if (run / "events.jsonl").exists() else []
    return RunRecords(run.resolve().name, [by_step[s] for s in sorted(by_step)], events, _strategy(run))


def _strategy(run: Path) -> str | None:
    try:
        return json.loads((run / "config.json").read_text())["recovery"]["strategy"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _series(metrics: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the records with a finite number under `key` (NaN written as "nan" is skipped)."""
    pairs = [(m["step"], float(m[key])) for m in metrics
             if isinstance(m.get(key), (int, float)) and math.isfinite(m[key])]
    return [s for s, _ in pairs], [v for _, v in pairs]


def event_marks(run: RunRecords) -> dict[str, list[tuple[int, int | None]]]:
    """(step, stage) of every event the plots mark, by kind (the keys of MARKS that occurred)."""
    marks: dict[str, list[tuple[int, int | None]]] = {}
    for e in run.events:
        if e.get("event") in MARKS and isinstance(e.get("step"), int):
            marks.setdefault(e["event"], []).append((e["step"], e.get("stage")))
    return marks


def _mark_events(ax, run: RunRecords, steps: list[int], values: list[float]) -> None:
    """Failures as vertical lines (their stage on top), the other events as markers on the curve."""
    import numpy as np

    for kind, hits in event_marks(run).items():
        label, colour, marker = MARKS[kind]
        if kind == "failure":
            for i, (step, stage) in enumerate(hits):
                ax.axvline(step, color=colour, ls="--", lw=0.9, alpha=0.7, label=label if i == 0 else None)
                ax.annotate(f"stage {stage}", (step, 1.0), xycoords=("data", "axes fraction"),
                            color=colour, fontsize=7, ha="center", va="bottom")
        elif steps:
            xs = [step for step, _ in hits]
            ys = np.interp(xs, steps, values)  # the curve's value at the event's step
            ax.plot(xs, ys, marker, color=colour, ms=8 if marker != "x" else 6, ls="none", label=label)


def _figure(run: RunRecords, title: str, ylabel: str):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.0, 4.2))
    ax.set_title(f"{run.name}{f' ({run.strategy})' if run.strategy else ''}: {title}", fontsize=10, pad=14)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    return fig, ax


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path


def _loss(run: RunRecords, out: Path) -> Path:
    fig, ax = _figure(run, "loss", "loss")
    steps, train = _series(run.metrics, "loss")
    ax.plot(steps, train, color="#1f77b4", lw=1.2, label="train loss")
    vsteps, val = _series(run.metrics, "val_loss")
    if vsteps:
        ax.plot(vsteps, val, "o-", color="#9467bd", ms=3, lw=1.2, label="validation loss")
    _mark_events(ax, run, steps, train)
    ax.legend(fontsize=8)
    return _save(fig, out / "loss.png")


def _step_time(run: RunRecords, out: Path) -> Path:
    fig, ax = _figure(run, "time per step", "seconds")
    steps, secs = _series(run.metrics, "step_time_s")
    ax.plot(steps, secs, color="#1f77b4", lw=1.2, label="step time")
    _mark_events(ax, run, steps, secs)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    return _save(fig, out / "step_time.png")


def _wire_bytes(run: RunRecords, out: Path) -> Path | None:
    steps, sent = _series(run.metrics, "wire_bytes")
    if not steps:
        return None
    fig, ax = _figure(run, "tensor payload sent between peers per step", "MiB")
    ax.plot(steps, [b / 2**20 for b in sent], color="#1f77b4", lw=1.2, label="wire bytes")
    _mark_events(ax, run, steps, [b / 2**20 for b in sent])
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    return _save(fig, out / "wire_bytes.png")


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> tuple[list[Path], list[str]]:
    """Write the run's PNGs; returns (the files written, notes on what was not drawn and why)."""
    import matplotlib

    matplotlib.use("Agg")
    run = read_run(run_dir)
    target = Path(out) if out is not None else Path(run_dir) / "plots"
    target.mkdir(parents=True, exist_ok=True)
    written = [_loss(run, target), _step_time(run, target)]
    notes = []
    if (wire := _wire_bytes(run, target)) is not None:
        written.append(wire)
    else:
        notes.append("no wire_bytes in metrics.jsonl (a simulator run sends nothing over a network): "
                     "wire_bytes.png not written")
    return written, notes


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plot", help="PNG plots of a run directory: loss with failures and recoveries marked, "
                                    "step time, bytes on the wire",
                       description="Reads RUN_DIR/metrics.jsonl and events.jsonl; writes loss.png, step_time.png "
                                   "and (swarm runs) wire_bytes.png.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (simulate, local or scheduler --out)")
    p.add_argument("--out", metavar="DIR", help="where to write the PNGs (default: RUN_DIR/plots)")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    written, notes = plot_run(args.run_dir, args.out)
    for path in written:
        print(f"wrote {path}")
    for note in notes:
        print(f"note: {note}")
    return 0
