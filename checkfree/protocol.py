"""The distributed runtime's messages and timeouts, defined once for peers and coordinator.

Every RPC carries a msgpack header (and, for tensors, raw payloads: see checkfree.net.wire); its fields are a
typed message of checkfree.messages, which is also the receiver's admission check.
Every header names the run (`run`); a request for another run is refused. Requests that
belong to a step also carry `step` and `attempt`: a step interrupted by a failure is
aborted and re-run as the next attempt, and messages of an aborted attempt are refused.

Timeout hierarchy (each one a flag of `checkfree peer`, `checkfree scheduler` and `checkfree local`):

    heartbeat_ttl < rpc_timeout < step_timeout < join_timeout

* heartbeat_ttl: a peer's DHT heartbeat expires this long after its last refresh
  (refreshed every ttl/2, jittered: HEARTBEATS_PER_TTL); a silent peer (frozen, partitioned, dead) is a
  suspect after it, and is declared failed when a ping (bounded by min(5 s, rpc_timeout)) fails too.
* rpc_timeout: one call (a forward, a backward, a weight transfer, an abort) must answer
  within it; a neighbour whose call fails is reported to the coordinator.
* step_timeout: a whole step (all microbatches' forward and backward) must finish in it; a
  peer that spent most of a timed-out step computing names itself a straggler
  (STRAGGLER_MARK) and is replaced like a failed one.
* join_timeout: how long a run waits for peers to join and build their first stage (or for a
  replacement to appear) before it gives up with a clear message.

Each is smaller than the next because each failure it detects must be settled inside the next
wait: a dead peer's heartbeat expires before a call to it times out, a call times out (and the
attempt is aborted) before the step does, and a step is re-run before the run gives up.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from checkfree.auth import record_ok, sign_record

__all__ = ["RPC", "Timeouts", "DHT_PREFIX", "coordinator_key", "members_key", "ProtocolError", "READY_PEER",
           "READY_COORDINATOR", "READY_STANDBY", "coordinator_record", "coordinator_from_records", "STEP_TIMEOUT_MARK",
           "STRAGGLER_MARK", "RUN_OVER", "EXIT_COORDINATOR_GONE", "EXIT_RUN_OVER", "StepFailed", "Kind",
           "HEARTBEATS_PER_TTL"]

DHT_PREFIX = "checkfree"
# a peer refreshes its DHT heartbeat this many times per heartbeat_ttl (jittered 0.8-1x): two chances before it
# expires. Every refresh is a DHT store that costs the whole swarm's DHT processes and p2pd daemons ~10-20 ms of CPU
# (benchmarks.idle), so a third refresh per TTL would cost 50 % more for a late beat that only costs a ping.
HEARTBEATS_PER_TTL = 2
READY_PEER = "peer ready:"
READY_COORDINATOR = "coordinator ready:"
READY_STANDBY = "coordinator standby:"
STEP_TIMEOUT_MARK = "step timeout:"  # starts a peer's RUN_STEP error when its step ran over step_timeout
STRAGGLER_MARK = "[straggler]"  # ...and ends it when the peer's own computing filled most of the step
RUN_OVER = "run over"  # starts the coordinator's refusal of a JOIN that arrives after the run ended
# exit codes of `checkfree peer` beyond 0 (done), 2 (bad input / network error) and 130 (signal)
EXIT_COORDINATOR_GONE = 4  # no coordinator answered for --coordinator-timeout
EXIT_RUN_OVER = 5  # tried to join a run that has already ended


class RPC:
    """Protocol names of the handlers."""

    # served by peers
    ASSIGN = "cf.assign"  # become stage k: fresh, or rebuilt by a recovery plan
    RUN_STEP = "cf.run_step"  # run a step's (or an evaluation's) microbatches; answers when done
    COMMIT = "cf.commit"  # clip and apply the optimizer step of a finished step
    ABORT = "cf.abort"  # drop an interrupted step's activations and gradients
    FORWARD = "cf.forward"  # an activation from the previous hop
    BACKWARD = "cf.backward"  # a gradient from the next hop
    COMPONENT_GRAD = "cf.component_grad"  # CheckFree+: this holder's embedding/head gradient
    GET_WEIGHTS = "cf.get_weights"  # this stage's weights (and omega) for a replacement or export
    SNAPSHOT = "cf.snapshot"  # capture full state; keep it and send it to holders, or write it to storage
    STORE_SNAPSHOT = "cf.store_snapshot"  # hold another stage's snapshot in memory (gemini)
    FETCH_SNAPSHOT = "cf.fetch_snapshot"  # hand a held snapshot to a replacement
    RESTORE = "cf.restore"  # roll back to a snapshot (own memory or storage) or to the initial state
    GET_STATE = "cf.get_state"  # full state now (weights + optimizer): a leaving peer's lossless handover
    TAKE_REPLICA = "cf.take_replica"  # redundant: hold a current replica of the successor stage (from `source`)
    REPLICA_GRAD = "cf.replica_grad"  # redundant: the successor's gradient of a committed step, for its replica
    GET_REPLICA = "cf.get_replica"  # redundant: the replica's full state, for the promotion of a lost stage
    BACKUP_START = "cf.backup_start"  # baft: take a backup as of `step`, to be sent in the next steps' bubbles
    BACKUP_PART = "cf.backup_part"  # baft: a part of the predecessor's backup, sent in a bubble
    BACKUP_COMMIT = "cf.backup_commit"  # baft: the backup of `step` is complete where every part arrived
    BACKUP_FETCH = "cf.backup_fetch"  # baft: a leaving peer's backups in flight, for the peer its stage is handed to
    COPY_PART = "cf.copy_part"  # snap: a part of the update of a neighbour's compressed copy, streamed in a step
    REFT_CHUNK = "cf.reft_chunk"  # reft: a chunk of a group member's snapshot, for this peer's parity block
    REFT_FETCH = "cf.reft_fetch"  # reft: this peer's snapshot and parity block, to decode a lost member
    REROUTE = "cf.reroute"  # stage groups: a lost replica's microbatches go to a sibling (which computes them)
    GET_PASS = "cf.get_pass"  # stage groups: the activation this peer sent for a microbatch, for a sibling's redo
    REDUCE = "cf.reduce"  # stage groups: sum the step's gradients within the stage's group (gloo all-reduce)
    ADOPT = "cf.adopt"  # a new coordinator takes over the run (the old one is gone): report this peer's state
    PING = "cf.ping"
    SHUTDOWN = "cf.shutdown"
    # served by the coordinator
    JOIN = "cf.join"
    REPORT = "cf.report"  # a peer's call to a neighbour failed
    LEAVE = "cf.leave"  # graceful leave (SIGTERM)
    STATUS = "cf.status"  # stage -> peer table, step
    FOLLOW = "cf.follow"  # a standby coordinator's copy of the run: its config, record, step and membership


class Kind:
    """What an error reply says happened (``RemoteError.kind``): callers branch on these words,
    never on an error's text."""

    BAD_REQUEST = "bad_request"  # malformed or wrong for the protocol (the default of ProtocolError)
    UNAUTHORIZED = "unauthorized"  # missing or wrong run token / coordinator proof
    RUN_OVER = "run_over"  # a JOIN after the run ended
    TAKING_OVER = "taking_over"  # the coordinator is adopting the run's peers: retry
    COORDINATOR_ALIVE = "coordinator_alive"  # an ADOPT refused: this peer's coordinator still answers
    STEP_FAILED = "step_failed"  # a step attempt ended without result (aborted, superseded, a neighbour lost)
    STEP_TIMEOUT = "step_timeout"  # the attempt ran over step_timeout while others computed
    STRAGGLER = "straggler"  # ...and this peer's own computing filled most of it
    SOFT_ERROR = "soft_error"  # an uncorrectable soft error survived a recompute
    INTERNAL = "internal"  # a bug in a handler


class ProtocolError(ValueError):
    """A request that is well-formed on the wire but wrong for the protocol; `kind` says how."""

    def __init__(self, message: str, kind: str = Kind.BAD_REQUEST) -> None:
        super().__init__(message)
        self.kind = kind


class StepFailed(RuntimeError):
    """A step attempt that ended without result on this peer (aborted, superseded, timed out, a
    neighbour unreachable, a soft error): expected under churn, so servers log it as one line, not
    a traceback; `kind` (a Kind) tells the coordinator which, `detail` (JSON values) what it may count
    (a soft error: the guard's counters)."""

    expected = True

    def __init__(self, message: str, kind: str = Kind.STEP_FAILED, detail: dict | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.detail = detail or {}


@dataclass(kw_only=True)
class Timeouts:
    """Named waits of the distributed runtime (seconds)."""

    heartbeat_ttl: float = 4.0  # DHT heartbeat expiry; refreshed every ttl / HEARTBEATS_PER_TTL
    rpc_timeout: float = 30.0  # one RPC (forward, backward, weights)
    step_timeout: float = 300.0  # one step
    join_timeout: float = 600.0  # waiting for peers / a replacement

    def __post_init__(self) -> None:
        order = [self.heartbeat_ttl, self.rpc_timeout, self.step_timeout, self.join_timeout]
        if any(t <= 0 for t in order) or order != sorted(order):
            raise ValueError("timeouts must be positive and ordered heartbeat_ttl < rpc_timeout < step_timeout "
                             f"< join_timeout, got {dataclasses.asdict(self)}")


def coordinator_key(run_id: str) -> str:
    return f"{DHT_PREFIX}/{run_id}/coordinator"


def coordinator_record(secret: bytes | None, run_id: str, peer_id: str, transport: str, ttl: float = 12.0) -> dict:
    """What the coordinator announces under `coordinator_key` for `ttl` seconds: its RPC peer id and the
    transport serving it, signed with the run secret (if any) together: a record whose transport was
    altered fails the MAC, and so does one replayed after its expiry."""
    return sign_record(secret, run_id, f"coordinator/{transport}", peer_id, {"peer_id": peer_id, "transport": transport},
                       ttl)


def coordinator_from_records(found: dict, secret: bytes | None, run_id: str, transport: str, *,
                             unsigned_ok: bool = False, exclude: str | None = None) -> str | None:
    """The coordinator's peer id from the live records under `coordinator_key` (None if none fits yet).

    Only records signed with the run secret count (any, without one), unless `unsigned_ok`: then they come
    first and others after (a peer with a wrong secret still reaches the coordinator and is told why it
    is refused). `exclude`: a peer id to pass over (a standby's own). ProtocolError when a signed record
    names another `--transport` than `transport`: the two could never reach each other, so say so instead
    of waiting. (A record without `transport` is a hivemind one.)"""
    def signed(v: dict) -> bool:
        return record_ok(secret, run_id, f"coordinator/{v.get('transport', 'hivemind')}", v["peer_id"], v)

    records = [v for v in found.values() if isinstance(v, dict) and isinstance(v.get("peer_id"), str)
               and v["peer_id"] != exclude]
    records.sort(key=lambda v: not signed(v))
    for v in records:
        theirs = v.get("transport", "hivemind")
        if theirs == transport and (unsigned_ok or signed(v)):
            return v["peer_id"]
        if theirs != transport and signed(v):
            raise ProtocolError(f"the coordinator of run {run_id!r} uses --transport {theirs}, this process "
                                f"--transport {transport}: start every process of a run with the same --transport")
    return None


def members_key(run_id: str) -> str:
    return f"{DHT_PREFIX}/{run_id}/peers"
