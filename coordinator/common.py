"""Types and constants shared by the parts of the coordinator (coordinator/coordinator.py and the parts it wires)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from checkfree.net.transport import RemoteError, TransportError
from checkfree.messages import Committed, StepFigures, as_record
from checkfree.protocol import Timeouts

__all__ = ["CoordinatorOptions", "Hook", "Member", "CoordinatorAlive", "RunClock", "Rollback", "CALL_ERRORS", "settle",
           "EVAL_ATTEMPT", "STEP_FIGURES", "step_figures", "COMMIT_FIGURES", "commit_figures"]

CALL_ERRORS = (TransportError, RemoteError, asyncio.TimeoutError, OSError)

T = TypeVar("T")


async def settle(calls: Iterable[Awaitable[T]]) -> list[T | Exception]:
    """Every call's result, or the exception it raised, in order (asyncio.gather with return_exceptions); a
    cancellation or an exit (a BaseException that is no Exception) is not a failed call: it propagates."""
    results = await asyncio.gather(*calls, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException) and not isinstance(r, Exception):
            raise r
    return cast(list[T | Exception], results)

# the coordinator's one hook point: hook(point, coordinator) at "started" (its transport is up), "iteration" (an
# iteration starts) and "commit" (before a step's COMMIT); None in production (faults from outside:
# faults/injector.py)
Hook = Callable[[str, Any], Awaitable[None]]


class RunClock:
    """Where the run is: the step being run, and the iterations executed (re-runs after a rollback included: the
    simulator's failure clock and the fault schedules'). The coordinator's training loop moves it; its parts read
    it (an event's step, STATUS)."""

    def __init__(self) -> None:
        self._step = 0
        self._iteration = 0

    @property
    def step(self) -> int:
        return self._step

    @property
    def iteration(self) -> int:
        return self._iteration

    def at(self, step: int, iteration: int | None = None) -> None:
        """The run is at `step` (and, if given, at `iteration`)."""
        self._step = step
        if iteration is not None:
            self._iteration = iteration

    def executed(self) -> None:
        """One more iteration has been executed (a step committed)."""
        self._iteration += 1


class Rollback(Exception):
    """Every stage was rolled back; training resumes at `step`."""

    def __init__(self, step: int) -> None:
        super().__init__(f"rolled back to step {step}")
        self.step = step


EVAL_ATTEMPT = 10_000

# a peer's, per step (hop_delay_s only on an emulated WAN: the mean one-way delay of the passes that arrived, by
# sending stage)
STEP_FIGURES = ("bytes_sent", "inflight_peak", "activation_peak_bytes", "peak_rss_bytes", "hop_delay_s", "backup_bytes")
_OPTIONAL = ("hop_delay_s", "backup_bytes")  # only an emulated WAN / BAFT reports these



def step_figures(by_stage: Mapping[int, StepFigures], num_stages: int) -> dict:
    """A step record's figures from its stages' replies: the tensor bytes sent (summed) and, per stage
    (None: not reported), the most microbatches whose activations it held at once, their bytes, and
    its peer process's peak resident memory so far."""
    fields = {s: as_record(r) for s, r in by_stage.items()}
    per_stage = {k: [fields.get(s, {}).get(k) for s in range(num_stages)] for k in STEP_FIGURES[1:]
                 if k not in _OPTIONAL or any(k in r for r in fields.values())}
    return {"wire_bytes": sum(r.bytes_sent for r in by_stage.values()), **per_stage}


# a peer's, per committed step: redundant computation's, and the bytes of snap's copy part sent in the step
COMMIT_FIGURES = ("redundant_s", "replica_bytes", "copy_bytes")


def commit_figures(by_stage: dict[int, Committed | Exception], num_stages: int) -> dict:
    """A step record's figures from its stages' COMMIT replies, per stage: the seconds of redundant forwards and
    the gradient bytes shipped to the replica's holder (only when some stage reports them)."""
    replies = [as_record(r) if isinstance(r, Committed) else {} for r in (by_stage.get(s) for s in range(num_stages))]
    return {k: [r.get(k) for r in replies] for k in COMMIT_FIGURES if any(k in r for r in replies)}


@dataclass(kw_only=True)
class CoordinatorOptions:
    run_id: str = "checkfree"
    out: str = "runs/latest"
    initial_peers: list[str] = field(default_factory=list)
    host_maddrs: list[str] = field(default_factory=lambda: ["/ip4/127.0.0.1/tcp/0"])
    announce_maddrs: list[str] | None = None
    identity_path: str | None = None
    startup_timeout: float = 30.0
    transport: str = "hivemind"  # RPC transport: hivemind (p2pd) or libp2p (py-libp2p); every peer must use the same
    libp2p_port: int = 0  # --transport libp2p: TCP port of the libp2p listener (0: any free port)
    tcp_port: int = 0  # --transport tcp: port of the TCP RPC listener (0: any free port)
    timeouts: Timeouts = field(default_factory=Timeouts)
    relay: bool = True  # relay requests for joining peers it cannot reach (behind NAT); --no-relay: for none
    relay_via: list[str] = field(default_factory=list)  # (a peer's flag; unused by the coordinator)
    shutdown_peers: bool = True  # tell peers the run ended (they exit unless started with --stay)
    max_attempts: int = 5  # attempts of one step before the run gives up
    save_final: bool = True  # gather every stage into final_weights.safetensors at the end
    secret_file: str | None = None  # run secret (else $CHECKFREE_SECRET; neither: an open swarm)
    takeover: bool = False  # take over a running run whose coordinator is gone (state from the DHT and peers)
    standby: bool = False  # watch the run's coordinator; take over when it stops answering
    save_every: int = 0  # gather every stage's full state into <out>/saves every N steps (0: never)
    keep_saves: int = 2
    resume: bool = False  # continue the run in `out` from its newest save
    tensorboard: bool = False  # also write metrics as TensorBoard scalars into <out>/tensorboard


@dataclass
class Member:
    """A peer of the run, as membership knows it (which stage it serves is the stage table's: StageTable)."""

    peer_id: str
    joined: float
    leaving: bool = False  # failed, lost or retiring: never given a stage again
    handover: bool = False  # leaving gracefully, waiting to hand its exact state to a standby
    left: bool = False  # it announced its leave (LEAVE), rather than being retired or lost
    observer: bool = False  # joined to read (export), never assigned a stage
    configured: bool = True  # it has the run's config (False: adopted by a takeover before its JOIN was answered)


def heartbeat_stage(heartbeat: object) -> int:
    """The stage a peer's DHT heartbeat says it serves (-1: none, or not a peer's heartbeat)."""
    stage = heartbeat.get("stage") if isinstance(heartbeat, dict) else None
    return stage if isinstance(stage, int) and not isinstance(stage, bool) else -1


class CoordinatorAlive(RuntimeError):
    """A takeover was refused: the run's coordinator still answers its peers."""

