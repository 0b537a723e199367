"""The run directory every command writes: a contract users' scripts build on.

* config.json   the resolved configuration
* metrics.jsonl one line per step: step, loss, lr, grad_norms, step_time_s[, val_loss]
* events.jsonl  one line per event: event, step, stage, strategy, ... (recovery lines add
                sources and coefficients)
* summary.json  steps, final_loss, final_val_loss, failures, recoveries, fallbacks, wall_s
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

__all__ = ["RunWriter", "read_jsonl"]


def _clean(value: Any) -> Any:
    """JSON has no NaN/Inf: write them as strings so the files stay valid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


class RunWriter:
    """Appends metrics and events line by line (flushed, so a killed run keeps them)."""

    def __init__(self, out: str | Path, config_json: str, *, resume: bool = False) -> None:
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "config.json").write_text(config_json)
        mode = "a" if resume else "w"
        if resume:
            for name in ("metrics.jsonl", "events.jsonl"):
                _drop_partial_line(self.out / name)
        self._metrics = open(self.out / "metrics.jsonl", mode, buffering=1)
        self._events = open(self.out / "events.jsonl", mode, buffering=1)
        self.counts = {"failures": 0, "recoveries": 0, "fallbacks": 0}
        self.started = time.time()

    def restore_counts(self) -> None:
        """Resuming a run directory: count the failures/recoveries/fallbacks already logged."""
        for e in read_jsonl(self.out / "events.jsonl"):
            key = {"failure": "failures", "recovery": "recoveries", "fallback": "fallbacks"}.get(e.get("event"))
            if key:
                self.counts[key] += 1

    def metric(self, record: dict[str, Any]) -> None:
        self._metrics.write(json.dumps(_clean(record)) + "\n")

    def event(self, event: str, **fields: Any) -> None:
        key = {"failure": "failures", "recovery": "recoveries", "fallback": "fallbacks"}.get(event)
        if key:
            self.counts[key] += 1
        record = {"event": event, **fields, "time": time.time()}
        self._events.write(json.dumps(_clean(record)) + "\n")

    def summary(self, **fields: Any) -> dict[str, Any]:
        record = {**fields, **self.counts, "wall_s": round(time.time() - self.started, 3)}
        (self.out / "summary.json").write_text(json.dumps(_clean(record), indent=2))
        return record

    def close(self) -> None:
        self._metrics.close()
        self._events.close()


def _drop_partial_line(path: Path) -> None:
    """A process killed mid-write can leave a cut last line; appending after it would corrupt the next."""
    if not path.exists():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        path.write_bytes(data[: data.rfind(b"\n") + 1])


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
