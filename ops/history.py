"""A run's history read from its run directory (checkfree/rundir.py): the loss curve, the step rate, the failures
and recoveries, and the stages' last known peers, folded from metrics.jsonl and events.jsonl as they grow.

`RunHistory(out).poll()` reads what the files gained since the last poll, at most `max_bytes` of each per call
(a long run's backlog is caught up over several polls; `caught_up` says when it is), so a poll has a bounded cost
wherever the coordinator is serving the dashboard from. Memory is bounded too: the loss curve is thinned to at
most `MAX_POINTS` points (every other point dropped whenever it doubles), and only the newest `MAX_EVENTS`
notable events are kept. The same reader serves a live coordinator's dashboard and `checkfree status RUN_DIR`.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from checkfree.config import RunConfig, config_from_dict

__all__ = ["JsonlTail", "RunHistory", "NOTABLE", "MAX_POINTS", "MAX_EVENTS"]

log = logging.getLogger(__name__)

MAX_POINTS = 500  # loss-curve points kept (thinned as the run grows)
MAX_EVENTS = 30  # newest notable events kept
RATE_WINDOW = 20  # steps over which the step rate is measured
# events an operator wants to see, newest first on the dashboard
NOTABLE = ("failure", "recovery", "fallback", "straggler", "handover", "leave", "retired", "replica_lost",
           "replica_joined", "replica_moved", "coordinator_takeover", "resume", "join_refused", "aborted_step")
_COUNTED = {"failure": "failures", "recovery": "recoveries", "fallback": "fallbacks"}  # as checkfree.rundir counts


class JsonlTail:
    """The complete lines a JSON-lines file gained since the last read, at most `max_bytes` a read. A file
    that shrank or was replaced (a resumed run drops a cut last line) is read again from its start: `reset`
    is then True once, and the caller drops what it folded so far."""

    def __init__(self, path: Path, max_bytes: int) -> None:
        self.path, self.max_bytes = path, max_bytes
        self.offset, self.caught_up, self.reset = 0, False, False
        self.inode: int | None = None

    def read(self) -> list[dict[str, Any]]:
        try:
            f = open(self.path, "rb")
        except FileNotFoundError:
            self.caught_up = True
            return []
        with f:
            st = os.fstat(f.fileno())
            self.reset = self.inode is not None and (st.st_ino != self.inode or st.st_size < self.offset)
            if self.reset:
                self.offset = 0
            self.inode = st.st_ino
            f.seek(self.offset)
            data = f.read(self.max_bytes)
            if len(data) == self.max_bytes:
                data += f.readline()  # the line the bound cut: complete it (a line longer than the bound too)
        self.caught_up = self.offset + len(data) >= st.st_size  # (what was appended since waits for the next read)
        end = data.rfind(b"\n") + 1  # a cut last line (being written) waits for the next read
        self.offset += end
        records = []
        for line in data[:end].splitlines():
            try:
                record = json.loads(line, parse_constant=lambda _: None) if line.strip() else None  # (NaN: None)
            except ValueError:
                log.warning("%s: skipping a line that is not JSON: %.80r", self.path, line)
                continue
            if isinstance(record, dict):
                records.append(record)
        return records


def _number(value: Any) -> float | None:
    """A finite number from a metrics field (non-finite ones are written as strings there)."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
        else None


@dataclass
class RunHistory:
    """What a run directory's files say; `poll()` folds what they gained."""

    out: Path
    max_bytes: int = 1 << 20
    config: RunConfig | None = None
    steps: int = 0  # the step after the newest one recorded
    loss: float | None = None
    val_loss: float | None = None
    loss_curve: list[tuple[int, float]] = field(default_factory=list)
    val_curve: list[tuple[int, float]] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_COUNTED.values(), 0))
    events: deque = field(default_factory=lambda: deque(maxlen=MAX_EVENTS))
    stages: dict[int, list[str]] = field(default_factory=dict)  # stage -> its peers, last known (from events)
    summary: dict[str, Any] | None = None
    _recent: deque = field(default_factory=lambda: deque(maxlen=RATE_WINDOW))  # (time, step) of the newest records
    _stride: int = 1  # keep every `_stride`-th step of the loss curve
    _recent_loss: tuple[int, float] | None = None  # the newest (step, loss)

    def __post_init__(self) -> None:
        self.out = Path(self.out)
        self._metrics = JsonlTail(self.out / "metrics.jsonl", self.max_bytes)
        self._events = JsonlTail(self.out / "events.jsonl", self.max_bytes)

    @property
    def caught_up(self) -> bool:
        return self._metrics.caught_up and self._events.caught_up

    def poll(self) -> bool:
        """Fold what the files gained (bounded by `max_bytes` each); whether the history is complete."""
        if self.config is None and (self.out / "config.json").exists():
            try:
                self.config = config_from_dict(json.loads((self.out / "config.json").read_text()))
            except ValueError as e:  # (a half-written file is read again at the next poll)
                log.debug("config.json not readable yet: %s", e)
        metrics = self._metrics.read()
        if self._metrics.reset:
            self._forget_metrics()
        for record in metrics:
            self._metric(record)
        events = self._events.read()
        if self._events.reset:
            self._forget_events()
        for record in events:
            self._event(record)
        return self.caught_up

    def read_summary(self) -> None:
        path = self.out / "summary.json"
        try:
            self.summary = json.loads(path.read_text()) if path.exists() else None
        except ValueError:  # written atomically, so only a foreign file can be broken
            raise ValueError(f"{path} is not JSON") from None

    def _forget_metrics(self) -> None:
        self.steps, self.loss, self.val_loss, self._stride, self._recent_loss = 0, None, None, 1, None
        for kept in (self.loss_curve, self.val_curve, self._recent):
            kept.clear()

    def _forget_events(self) -> None:
        self.counts = dict.fromkeys(_COUNTED.values(), 0)
        self.events.clear()
        self.stages.clear()

    def _metric(self, record: dict[str, Any]) -> None:
        step = record.get("step")
        if not isinstance(step, int):
            return
        self.steps = step + 1
        loss, val = _number(record.get("loss")), _number(record.get("val_loss"))
        if loss is not None:
            self.loss, self._recent_loss = loss, (step, loss)
            if step % self._stride == 0 or not self.loss_curve:
                self.loss_curve.append((step, loss))
            if len(self.loss_curve) > MAX_POINTS:
                self._stride *= 2
                self.loss_curve[:] = [p for p in self.loss_curve if p[0] % self._stride == 0]
        if val is not None:
            self.val_loss = val
            self.val_curve.append((step, val))
            del self.val_curve[:-MAX_POINTS]
        if (t := _number(record.get("time"))) is not None:
            self._recent.append((t, step))

    def curve(self) -> list[tuple[int, float]]:
        """The thinned loss curve, ending with the newest step's loss."""
        newest = self._recent_loss
        return self.loss_curve + [newest] if newest is not None and newest not in self.loss_curve[-1:] else self.loss_curve

    def steps_per_s(self) -> float | None:
        """Steps recorded per wall-clock second over the newest RATE_WINDOW steps (recoveries and retries
        included); None before two steps."""
        if len(self._recent) < 2:
            return None
        (t0, s0), (t1, s1) = self._recent[0], self._recent[-1]
        return (s1 - s0) / (t1 - t0) if t1 > t0 and s1 > s0 else None

    def _event(self, record: dict[str, Any]) -> None:
        kind = str(record.get("event"))
        if (key := _COUNTED.get(kind)) is not None:
            self.counts[key] += 1
        if kind in NOTABLE:
            self.events.append(record)
        self._fold_stage(kind, record)

    def _fold_stage(self, kind: str, e: dict[str, Any]) -> None:
        """The stages' last known peers: who was given each stage, lost it, joined or left its group."""
        stage, pid = e.get("stage"), e.get("peer_id")
        if not isinstance(stage, int):
            return
        group = self.stages.setdefault(stage, [])
        if kind in ("assign", "recovery", "fallback", "handover") and isinstance(pid, str):
            self.stages[stage] = [pid, *[p for p in group if p not in (pid, e.get("source_peer"))]]
        elif kind == "failure":
            group.clear()
        elif kind == "replica_joined" and isinstance(pid, str) and pid not in group:
            group.append(pid)
        elif kind in ("replica_lost", "replica_moved") and pid in group:
            group.remove(pid)
