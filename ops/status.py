"""The state of a swarm as one typed value, `SwarmStatus`: what the dashboard, /status, /metrics and
`checkfree status` show.

It is built in exactly two ways:

* `snapshot(view, history)`: a running coordinator's live state, as its read-only view
  (`Coordinator.view()`: which peer serves which stage, the replicas, the standbys, each peer's measured speed,
  the step) plus its run directory's history (ops/history.py: the loss curve, the step rate, failures and
  recoveries). It reads no part of the coordinator itself;
* `from_run_dir(out)`: a run directory alone (a finished run, or one seen from another machine): the same
  history, and each stage's last known peers folded from its events.

`LiveStatus` is a running coordinator's source for the dashboard: the files are read in a worker thread at most
every `min_interval` seconds (however many clients poll), and the snapshot is taken in the event loop, between
two of the coordinator's awaits, so it is consistent.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import asdict, dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ops.history import RunHistory

if TYPE_CHECKING:  # (not at run time: `checkfree status` needs no coordinator, hivemind included)
    from coordinator.coordinator import Coordinator, CoordinatorView

__all__ = ["PeerState", "PeerView", "StageView", "SwarmStatus", "describe", "snapshot", "from_run_dir", "LiveStatus"]


class PeerState(StrEnum):
    SERVING = "serving"  # hosts its stage and answers
    SUSPECT = "suspect"  # reported unreachable (a neighbour's call failed, a missed heartbeat): being checked
    LEAVING = "leaving"  # preempted, retired or failed: being replaced
    STANDBY = "standby"  # joined, waiting for a stage
    LAST_KNOWN = "last known"  # from a run's files: the peer that held the stage when the files were written


@dataclass(frozen=True)
class PeerView:
    peer_id: str
    state: PeerState
    microbatches_per_s: float | None = None  # measured compute speed (live only)
    reach: str | None = None  # how the coordinator reaches it: direct | relayed (probed at its join; live only)


@dataclass(frozen=True)
class StageView:
    stage: int
    peers: tuple[PeerView, ...]  # its replicas, the primary first; empty: lost, being recovered

    @property
    def state(self) -> str:
        return "lost" if not self.peers else "ok" if any(p.state in (PeerState.SERVING, PeerState.LAST_KNOWN)
                                                         for p in self.peers) else "degraded"


@dataclass(frozen=True)
class SwarmStatus:
    source: str  # "live" (a coordinator's) or "files" (a run directory's)
    run_id: str
    status: str  # starting | waiting for peers | running | recovering | standby | completed | aborted | ...
    step: int  # live: the step being run; files: the step after the newest recorded one
    num_steps: int | None
    strategy: str | None
    tokens_per_step: int | None
    stages: tuple[StageView, ...]
    standbys: tuple[PeerView, ...] | None  # None: not known (a run's files do not record them)
    loss: float | None
    val_loss: float | None
    steps_per_s: float | None  # over the newest steps, wall clock (recoveries included)
    loss_curve: tuple[tuple[int, float], ...]
    val_curve: tuple[tuple[int, float], ...]
    counts: dict[str, int]  # failures, recoveries, fallbacks
    events: tuple[dict[str, Any], ...]  # the newest notable events (ops.history.NOTABLE), oldest first
    complete: bool  # the history has been read to the end of the files (False while a long backlog is read)
    time: float

    @property
    def tokens_per_s(self) -> float | None:
        return self.steps_per_s * self.tokens_per_step if self.steps_per_s and self.tokens_per_step else None

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready (/status): the fields, plus `tokens_per_s`, each stage's `state` and each event's `detail`."""
        d = asdict(self)
        d["tokens_per_s"] = self.tokens_per_s
        for view, out in zip(self.stages, d["stages"]):
            out["state"] = view.state
        d["events"] = [{**e, "detail": describe(e)} for e in self.events]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SwarmStatus:
        """Inverse of `as_dict` (what `checkfree status ADDRESS` reads from /status)."""
        def peers(ps: list[dict]) -> tuple[PeerView, ...]:
            return tuple(PeerView(p["peer_id"], PeerState(p["state"]), p.get("microbatches_per_s"), p.get("reach"))
                         for p in ps)

        fields = {k: d[k] for k in cls.__dataclass_fields__}
        fields.update(stages=tuple(StageView(v["stage"], peers(v["peers"])) for v in d["stages"]),
                      standbys=None if d["standbys"] is None else peers(d["standbys"]),
                      loss_curve=tuple(map(tuple, d["loss_curve"])), val_curve=tuple(map(tuple, d["val_curve"])),
                      events=tuple({k: v for k, v in e.items() if k != "detail"} for e in d["events"]))
        return cls(**fields)


def describe(e: dict[str, Any]) -> str:
    """One event's particulars in a few words: how a stage was rebuilt (from which sources, with which
    coefficients), what a fallback did, why a peer was dropped."""
    parts = []
    if e.get("method") or e.get("sources"):
        sources = " of stage(s) " + ", ".join(map(str, e["sources"])) if e.get("sources") else ""
        parts.append(f"{e.get('method') or 'rebuilt'}{sources}")
    if e.get("fallback"):
        parts.append(f"fallback {e['fallback']}")
    if e.get("source") is not None:
        src = e["source"]
        parts.append(f"from {'…' + src[-8:] if isinstance(src, str) and len(src) > 16 else src}")
    if e.get("coefficients"):
        parts.append("coefficients " + " / ".join(f"{c:.3f}" for c in e["coefficients"] if isinstance(c, (int, float))))
    if e.get("edge_sources"):
        parts.append(", ".join(f"{c} from stage {st}" for c, st in e["edge_sources"].items()))
    if e.get("rollback_to") is not None:
        parts.append(f"rolled back to step {e['rollback_to']}")
    if isinstance(t := e.get("recovery_time_s"), (int, float)):
        parts.append(f"{t:.2f} s")
    if e.get("reason"):
        parts.append(str(e["reason"])[:160])
    return ", ".join(parts)


def _history_fields(h: RunHistory) -> dict[str, Any]:
    cfg = h.config
    return dict(num_steps=cfg.train.num_steps if cfg else None, strategy=cfg.recovery.strategy if cfg else None,
                tokens_per_step=cfg.tokens_per_step if cfg else None, loss=h.loss, val_loss=h.val_loss,
                steps_per_s=h.steps_per_s(), loss_curve=tuple(h.curve()), val_curve=tuple(h.val_curve),
                counts=dict(h.counts), events=tuple(h.events), complete=h.caught_up, time=time.time())


def snapshot(coordinator: CoordinatorView, history: RunHistory) -> SwarmStatus:
    """A running coordinator's state (its read-only view) with its run's history."""
    c, members = coordinator, coordinator.members
    cfg = c.cfg

    def view(pid: str, standby: bool = False) -> PeerView:
        state = (PeerState.LEAVING if pid not in members.known or pid in members.leaving
                 else PeerState.SUSPECT if pid in members.suspects
                 else PeerState.STANDBY if standby else PeerState.SERVING)
        speed = c.speeds.get(pid)
        reach = c.reach.get(pid, {}).get("mode")
        return PeerView(pid, state, speed if speed is not None and math.isfinite(speed) else None, reach)

    stages = tuple(StageView(s, tuple(view(p) for p in c.groups.get(s, ()))) for s in range(cfg.num_stages)) if cfg \
        else ()
    if members.over is not None:
        status = members.over
    elif cfg is None:
        status = "standby"  # a standby coordinator watching, or one taking over
    elif not c.opened:
        status = "starting"
    elif any(not v.peers for v in stages):
        status = "waiting for peers" if not history.steps and not history.counts["failures"] else "recovering"
    else:
        status = "running"
    step = history.steps if members.over is not None else c.step  # (once over: the step after the last one)
    return SwarmStatus(source="live", run_id=c.run_id, status=status, step=step, stages=stages,
                       standbys=tuple(view(p, standby=True) for p in members.standbys), **_history_fields(history))


def from_run_dir(out: str | Path) -> SwarmStatus:
    """A run directory's state: its whole history, its summary, each stage's last known peers."""
    out = Path(out)
    if not (out / "config.json").is_file():
        raise ValueError(f"{out} is not a run directory (it has no config.json)")
    h = RunHistory(out)
    while not h.poll():
        pass
    h.read_summary()
    summary = h.summary or {}
    num_stages = h.config.num_stages if h.config else 1 + max(h.stages, default=-1)
    stages = tuple(StageView(s, tuple(PeerView(p, PeerState.LAST_KNOWN) for p in h.stages.get(s, [])))
                   for s in range(num_stages))
    return SwarmStatus(source="files", run_id=str(summary.get("run_id") or out.name),
                       status=str(summary.get("status") or "no summary (running, or killed)"),
                       step=int(summary.get("steps", h.steps)), stages=stages, standbys=None, **_history_fields(h))


class LiveStatus:
    """A running coordinator's dashboard source: `await source()` -> its SwarmStatus. The run directory's files
    are read in a worker thread, at most every `min_interval` s and by one poll at a time."""

    def __init__(self, coordinator: Coordinator, out: str | Path, min_interval: float = 0.5) -> None:
        self.coordinator, self.min_interval = coordinator, min_interval
        self.history = RunHistory(Path(out))
        self._polled = -math.inf
        self._lock = asyncio.Lock()

    async def __call__(self) -> SwarmStatus:
        async with self._lock:  # (the snapshot, too: no poll thread changes the history while it is read)
            if time.monotonic() - self._polled >= self.min_interval:
                await asyncio.to_thread(self.history.poll)
                self._polled = time.monotonic()
            return snapshot(self.coordinator.view(), self.history)
