"""The run directory every command writes: a contract users' scripts build on.

* config.json   the resolved configuration
* metrics.jsonl one line per step: step, loss, lr, grad_norms, step_time_s, time (Unix
                seconds), tokens_per_s[, val_loss]
* events.jsonl  one line per event: event, step, stage, strategy, time, ... (recovery lines
                add sources and coefficients); the first line is `run_start`
* summary.json  written on every exit path: status (completed | aborted | interrupted |
                failed), steps (completed: the step after the newest recorded one), final_loss
                and final_val_loss (the newest finite ones; null if none), error (unless
                completed), failures, recoveries, fallbacks, wall_s (since `run_start`, across
                coordinator failovers and resumes)
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

__all__ = ["RunWriter", "read_jsonl"]


def _clean(value: Any, nonfinite: Any = str) -> Any:
    """JSON has no NaN/Inf: write them as strings (metrics and events) or as null (the
    summary, whose numbers scripts compare) so the files stay valid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return nonfinite(value)
    if isinstance(value, dict):
        return {str(k): _clean(v, nonfinite) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v, nonfinite) for v in value]
    return value


def _finite(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


class RunWriter:
    """Appends metrics and events line by line (flushed, so a killed run keeps them) and
    derives the summary from what was recorded, so it tells the truth on every exit path.

    `tokens_per_step` (tokens trained per optimizer step) adds `tokens_per_s` to metrics lines.
    `resume` appends to an existing run directory (a resumed run or a coordinator taking over):
    counts, the newest losses and the run's start time are read back from its files."""

    def __init__(self, out: str | Path, config_json: str, *, resume: bool = False,
                 tokens_per_step: int | None = None, tensorboard: bool = False) -> None:
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "config.json").write_text(config_json)
        self.tokens_per_step = tokens_per_step
        self.counts = {"failures": 0, "recoveries": 0, "fallbacks": 0}
        self.steps = 0  # the step after the newest one recorded
        self.last_loss: float | None = None
        self.last_val: float | None = None
        self.started = time.time()
        self.closed = False
        if resume:
            for name in ("metrics.jsonl", "events.jsonl"):
                _drop_partial_line(self.out / name)
            self._read_back()
        mode = "a" if resume else "w"
        self._tb = _tensorboard(self.out / "tensorboard") if tensorboard else None
        self._metrics = open(self.out / "metrics.jsonl", mode, buffering=1)
        self._events = open(self.out / "events.jsonl", mode, buffering=1)
        if not resume:
            self.started = self.event("run_start")

    def _read_back(self) -> None:
        events = read_jsonl(self.out / "events.jsonl") if (self.out / "events.jsonl").exists() else []
        for e in events:
            key = _COUNTED.get(str(e.get("event")))
            if key:
                self.counts[key] += 1
        if events and isinstance(events[0].get("time"), (int, float)):
            self.started = float(events[0]["time"])
        if (self.out / "metrics.jsonl").exists():
            for m in read_jsonl(self.out / "metrics.jsonl"):
                self._note(m)

    def _note(self, record: dict[str, Any]) -> None:
        if isinstance(record.get("step"), int):
            self.steps = record["step"] + 1
        if (loss := _finite(record.get("loss"))) is not None:
            self.last_loss = loss
        if (val := _finite(record.get("val_loss"))) is not None:
            self.last_val = val

    def metric(self, record: dict[str, Any]) -> None:
        record = {**record, "time": round(time.time(), 3)}
        step_s = record.get("step_time_s")
        if self.tokens_per_step and isinstance(step_s, (int, float)) and step_s > 0:
            record["tokens_per_s"] = round(self.tokens_per_step / step_s, 1)
        self._note(record)
        self._metrics.write(json.dumps(_clean(record)) + "\n")
        if self._tb is not None:
            self._scalars(self._tb, record)

    @staticmethod
    def _scalars(tb: Any, record: dict[str, Any]) -> None:
        """The metrics line's numbers as TensorBoard scalars (x axis: the step; per-stage lists as
        `name/stage_i`); non-finite values are skipped."""
        step = record["step"]
        for key, value in record.items():
            values = value if isinstance(value, list) else [value]
            for i, v in enumerate(values):
                if key not in ("step", "time") and isinstance(v, (int, float)) and not isinstance(v, bool) \
                        and math.isfinite(v):
                    tb.add_scalar(f"{key}/stage_{i}" if isinstance(value, list) else key, v, step)

    def event(self, event: str, **fields: Any) -> float:
        """Append an event line; returns its time (nothing is written once the writer is closed,
        e.g. for a late message handled after the run ended)."""
        now = time.time()
        if self.closed:
            return now
        key = _COUNTED.get(event)
        if key:
            self.counts[key] += 1
        record = {"event": event, **fields, "time": now}
        self._events.write(json.dumps(_clean(record)) + "\n")
        return now

    def summary(self, status: str, error: str | None = None, **fields: Any) -> dict[str, Any]:
        """Write summary.json (atomically): the recorded progress plus `fields`."""
        record = {"status": status, "steps": self.steps, "final_loss": self.last_loss,
                  "final_val_loss": self.last_val, **fields, **self.counts,
                  "wall_s": round(time.time() - self.started, 3)}
        if status != "completed":
            record["error"] = error or f"run {status}"
        tmp = self.out / "summary.json.tmp"
        tmp.write_text(json.dumps(_clean(record, lambda v: None), indent=2))
        tmp.replace(self.out / "summary.json")
        return record

    def close(self) -> None:
        self.closed = True
        if self._tb is not None:
            self._tb.close()
        self._metrics.close()
        self._events.close()


_COUNTED = {"failure": "failures", "recovery": "recoveries", "fallback": "fallbacks"}


def _tensorboard(path: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:  # torch's writer needs the tensorboard package
        raise ValueError("--tensorboard needs the tensorboard package: pip install 'checkfree[tensorboard]'") from e
    return SummaryWriter(log_dir=str(path))


def _drop_partial_line(path: Path) -> None:
    """A process killed mid-write can leave a cut last line; appending after it would corrupt the next."""
    if not path.exists():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        path.write_bytes(data[: data.rfind(b"\n") + 1])


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
