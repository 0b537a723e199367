"""Every message of the distributed runtime, defined once: the request each RPC carries and the reply it gets,
as frozen `msgspec` structs. The coordinator and the peers build and read these; the wire carries their builtin
form (`to_wire`: a dict of msgpack types, defaults left out) in the header of a `checkfree.net.wire` message, and
the receiver's one admission check turns a header back into its type (`from_wire`: every field's type, nested
ones included, or a ProtocolError naming the field at fault). A reply is checked the same way by its caller
(a malformed one is a `BadReply`, a failed call).

Why msgspec (docs/architecture.md; benchmarks/messages.py times it beside a hand-checked dict, pydantic and
msgspec's own codec): frozen structs, unions tagged by a field, integer-keyed maps that travel with string keys
and defaults left off the wire, all checked by one C validator that names the field at fault, nested ones
included; its check costs a few microseconds per message, the order of the msgpack codec the wire already pays
for a header and of pydantic's strict validation (pydantic, which hivemind brings, has no tagged struct unions
without a model per variant and a discriminator). The wire keeps its own codec (checkfree.net.wire: one envelope
for headers and tensors).

A request's RPC name is its `rpc`; ASSIGN is a union tagged by `mode` (`check_request` picks the variant by its
tag: msgspec converts into a union several times slower), a copy's origin (`Origin`) and where a snapshot goes
(`Keep`) unions tagged by `kind`. Keys of integer-keyed maps (stages, microbatches) travel as
strings. Every request also carries the envelope's fields (`Envelope`: the run, the membership token).
"""

from __future__ import annotations

import re
from typing import Any, ClassVar, ForwardRef, Generic, TypeVar, Union, cast, get_args, get_origin

import msgspec

from checkfree.net.errors import TransportError
from checkfree.protocol import RPC, ProtocolError
from checkfree.recovery import Neighbours

__all__ = ["Message", "Request", "Envelope", "BadReply", "Ok", "StepFigures", "PeerCopy", "OwnCopy", "StorageCopy",
           "ParityCopy", "InitialState", "Origin", "Assign", "AssignFresh", "AssignLoad", "AssignRecover",
           "AssignRestore", "AssignHandover", "AssignPromote", "AssignReplica", "AssignRequest", "Assigned",
           "BackupShare", "CopyWork", "CopyChunk", "RunStep", "StepDone", "Pass", "Forward", "Backward", "GetPass", "ComponentGrad", "Commit",
           "Committed", "SoftErrors", "Abort", "Reroute", "Rerouted", "Reduce", "Reduced", "GetWeights", "Weights",
           "GetState", "State", "KeepHolders", "KeepParity", "KeepStorage", "Keep", "Snapshot", "Snapshotted",
           "StoreSnapshot", "Stored", "FetchSnapshot", "Restore", "TakeReplica", "ReplicaTaken", "ReplicaGrad",
           "GetReplica", "BackupStart", "BackupTaken", "BackupPart", "BackupCommit", "BackupsHeld", "BackupFetch",
           "BackupAssembly", "BackupsInFlight", "ReftChunk", "ReftFetch", "ParityMeta", "CompanionStore",
           "CompanionFetch", "CompanionStop", "Ping", "Pong",
           "Shutdown", "Ready", "LastCommit", "Adopt", "Adopted", "Join", "Joined", "Report", "Leave", "Left",
           "Status", "RunStatus", "Follow", "Following", "REQUESTS", "REPLIES", "reply_type", "to_wire", "as_record", "from_wire", "reply_of",
           "reply_to",
           "required_fields", "REQUEST_FIELDS", "request", "check_request", "envelope"]

T = TypeVar("T")
R = TypeVar("R")


class Message(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A message body (request or reply)."""


class Request(Message, Generic[R], frozen=True, kw_only=True):
    """A request whose reply is an `R` (`Join` is a `Request[Joined]`): a call returns the reply type of its request,
    for the type checker too (coordinator/rpc.py, peers/membership.py)."""

    rpc: ClassVar[str]


class Envelope(Message, frozen=True, kw_only=True):
    """What every request carries besides its own fields: the run it belongs to, and (with a run secret) the
    sender's membership token."""

    run: str
    token: str | None = None


class BadReply(TransportError):
    """A reply that does not match its type: the peer that sent it is treated like one that did not answer."""


# ---- replies shared by many RPCs ------------------------------------------------------------------------
class Ok(Message, frozen=True, kw_only=True):
    ok: bool = True
    duplicate: bool = False  # a pass that arrived again (a sibling's redo): nothing computed twice


class StepFigures(Message, frozen=True, kw_only=True):
    """What a peer measured of one step (metrics.jsonl: coordinator.common.step_figures)."""

    bytes_sent: int = 0  # tensor payload bytes sent
    inflight_peak: int | None = None  # the most microbatches whose activations were held at once
    activation_peak_bytes: int | None = None
    peak_rss_bytes: int | None = None
    microbatches: int = 0  # computed here (a stage group's replica: its share)
    computing_s: float = 0.0  # the compute thread's busy seconds
    hop_delay_s: dict[int, float] | None = None  # an emulated WAN: mean one-way delay, by sending stage
    backup_bytes: int | None = None  # BAFT: the part of a backup sent in the step's bubbles
    reduce_s: float | None = None  # stage groups: the gradient all-reduce
    replica_microbatches: list[int] | None = None  # stage groups: the microbatches each replica computed


# ---- ASSIGN: a standby told which stage to serve, and where its state comes from --------------------------
class PeerCopy(Message, frozen=True, tag_field="kind", tag="peer", kw_only=True):
    """A copy another peer keeps (a snapshot, a backup)."""

    peer: str


class OwnCopy(Message, frozen=True, tag_field="kind", tag="own", kw_only=True):
    """The copy this peer keeps of its own stage."""


class StorageCopy(Message, frozen=True, tag_field="kind", tag="storage", kw_only=True):
    """The stage's file of a checkpoint in `storage` (checkfree.strategies.storage)."""

    storage: str


class ParityCopy(Message, frozen=True, tag_field="kind", tag="parity", kw_only=True):
    """Decoded from a parity group: its members' peers in order (`group`) and the lost one's `index`; the lost
    peer's snapshot companion is tried first when it may have survived."""

    group: list[str]
    index: int
    companion: str | None = None


class InitialState(Message, frozen=True, tag_field="kind", tag="init", kw_only=True):
    """The stage's initial state (step 0)."""


Origin = Union[PeerCopy, OwnCopy, StorageCopy, ParityCopy, InitialState]


class Assign(Request["Assigned"], frozen=True, tag_field="mode", kw_only=True):
    rpc = RPC.ASSIGN
    stage: int
    release: bool = False  # a stage group's replica lets its stage go first (it rebuilds another)
    # the run's count of assignments when this one was made (`StageTable.next_epoch`, carried on by a takeover): of
    # two peers that claim one stage, the one assigned later is the stage's (the other was replaced)
    epoch: int = 0


class AssignFresh(Assign, frozen=True, tag="fresh", kw_only=True):
    step: int = 0


class AssignLoad(Assign, frozen=True, tag="load", kw_only=True):
    """A resumed run's saved state, carried by the message itself (one uint8 tensor)."""

    step: int


class AssignRecover(Assign, frozen=True, tag="recover", kw_only=True):
    """Rebuild a lost stage from live neighbours' weights (`sources`: stage -> its peer)."""

    plan: Neighbours
    sources: dict[int, str]
    step: int


class AssignRestore(Assign, frozen=True, tag="restore", kw_only=True):
    """Take the lost stage's copy of `step`; with `serve_step`, serve from that step on (restored alone, nobody
    rolls back), its embedding / head from the live co-holders `edges` (component -> [stage, peer])."""

    step: int
    origin: Origin
    serve_step: int | None = None
    edges: dict[str, tuple[int, str]] = {}


class AssignHandover(Assign, frozen=True, tag="handover", kw_only=True):
    """A leaving peer's (`source`) exact state, and the in-memory snapshots it holds (`held`: owner stage -> step,
    fetched from it with FETCH_SNAPSHOT; under ReFT its own, with its parity block, with REFT_FETCH): the new peer
    holds them in its place. Under BAFT, `backup`: the step of the backup in flight, whose parts the leaving peer
    was sending and assembling (BACKUP_FETCH): the new peer sends and assembles the rest in its place."""

    source: str
    step: int
    held: dict[int, int] = {}
    backup: int | None = None


class AssignPromote(Assign, frozen=True, tag="promote", kw_only=True):
    """The replica the lost stage's ring predecessor (`source`) keeps."""

    source: str
    step: int


class AssignReplica(Assign, frozen=True, tag="replica", kw_only=True):
    """Join a stage group: a live replica's (`source`) exact state."""

    source: str
    step: int


AssignRequest = Union[AssignFresh, AssignLoad, AssignRecover, AssignRestore, AssignHandover, AssignPromote,
                      AssignReplica]


class Assigned(Message, frozen=True, kw_only=True):
    stage: int
    assign_s: float = 0.0
    bytes: int = 0  # moved to build the stage
    coefficients: list[float] = []  # a rebuild: each source's
    norms: list[float] = []  # a rebuild: each source's omega
    transfer_s: float | None = None
    rebuild_s: float | None = None
    restore_s: float | None = None
    restored_from: str | None = None  # reft: "companion" when the lost peer's companion served the snapshot


# ---- a step ------------------------------------------------------------------------------------------
class BackupShare(Message, frozen=True, kw_only=True):
    """BAFT: the part of the backup of `step` this step's bubbles carry: each stage's share of its bytes
    (`bounds`) to its holder (`holders`, its stage `holder_stages`)."""

    step: int
    part: int
    holders: dict[int, str]
    holder_stages: dict[int, int]
    bounds: dict[int, tuple[float, float]]


class CopyWork(Message, frozen=True, kw_only=True):
    """snap: what one stage does for its streamed copy in this step (checkfree.plans.CopyPart): send part `part`
    of `parts` of the update of its copy as of `step` (`kind` full, or delta on the holder's copy of `base`) to
    its holder's peer `holder` (stage `holder_stage`); part 0 is encoded first, before this step's commit."""

    step: int
    kind: str
    base: int | None = None
    part: int
    parts: int
    holder: str
    holder_stage: int


class RunStep(Request["StepDone"], frozen=True, kw_only=True):
    rpc = RPC.RUN_STEP
    step: int
    attempt: int
    evaluate: bool
    peers: dict[int, str]  # stage -> its (primary) peer
    routes: list[list[int]] | None = None  # stage order of every microbatch (peers check they agree)
    hops: list[list[str]] | None = None  # stage groups: the peer of every hop of every microbatch
    groups: dict[int, list[str]] | None = None  # stage groups: stage -> its replicas
    backup: BackupShare | None = None
    copies: dict[int, CopyWork] | None = None  # snap: by stage, the part of its streamed copy the step carries
    # reft: the step of the newest snapshot every stage completed (the coordinator's ledger); a peer keeps its own
    # copy of the snapshot before a round until the round is named complete here, then drops the other
    snapshot_step: int | None = None


class StepDone(StepFigures, frozen=True, kw_only=True):
    losses: dict[int, float] = {}  # microbatch -> its share of the step loss (a head stage's)
    stage: int = -1


class Pass(Request[Ok], frozen=True, kw_only=True):
    step: int
    attempt: int
    mb: int
    hop: int


class Forward(Pass, frozen=True, kw_only=True):
    rpc = RPC.FORWARD
    sent: float | None = None  # an emulated WAN: the sender's clock (the receiver measures the hop's delay)


class Backward(Pass, frozen=True, kw_only=True):
    rpc = RPC.BACKWARD
    sent: float | None = None


class GetPass(Pass, frozen=True, kw_only=True):
    rpc = RPC.GET_PASS


class ComponentGrad(Request[Ok], frozen=True, kw_only=True):
    rpc = RPC.COMPONENT_GRAD
    step: int
    attempt: int
    comp: str


class Commit(Request["Committed"], frozen=True, kw_only=True):
    rpc = RPC.COMMIT
    step: int
    attempt: int


class Committed(Message, frozen=True, kw_only=True):
    pre: float
    post: float
    block_post: float
    lr: float
    skipped: bool
    omega: float
    stage: int
    weights_finite: bool = True
    soft_errors: dict[str, int] = {}  # the soft-error guard's counters
    redundant_s: float | None = None  # redundant computation: the step's redundant forwards
    replica_bytes: int | None = None  # ...and the gradients shipped to the replica's holder
    copy_sent: tuple[int, int] | None = None  # snap: (copy step, part) of the part the holder acknowledged
    copy_bytes: int | None = None  # snap: ...its bytes


class SoftErrors(Message, frozen=True, kw_only=True):
    """The detail of a SOFT_ERROR step failure: the guard's counters."""

    soft_errors: dict[str, int] = {}


class Abort(Request[Ok], frozen=True, kw_only=True):
    rpc = RPC.ABORT


class Reroute(Request["Rerouted"], frozen=True, kw_only=True):
    """Stage groups: a lost replica's (`dead`) microbatches `mbs` go to its sibling `to`."""

    rpc = RPC.REROUTE
    step: int
    attempt: int
    dead: str
    to: str
    mbs: list[int]


class Rerouted(StepFigures, frozen=True, kw_only=True):
    ok: bool = True
    losses: dict[int, float] = {}
    redone: int | None = None  # the sibling: the microbatches it redid
    redo_s: float | None = None


class Reduce(Request["Reduced"], frozen=True, kw_only=True):
    """Stage groups: sum the step's gradients over the group (gloo, through the coordinator's TCPStore)."""

    rpc = RPC.REDUCE
    step: int
    attempt: int
    prefix: str
    rank: int
    size: int
    store: str


class Reduced(Message, frozen=True, kw_only=True):
    reduce_s: float
    reduce_bytes: int


# ---- weights and state ---------------------------------------------------------------------------------
class GetWeights(Request["Weights"], frozen=True, kw_only=True):
    rpc = RPC.GET_WEIGHTS
    part: str  # blocks | embed | head | all
    step: int | None = None


class Weights(Message, frozen=True, kw_only=True):
    keys: list[str]
    omega: float
    stage: int
    optim: list[list[str]] = []  # a replicated component's Adam state: [parameter, field] per tensor


class GetState(Request["State"], frozen=True, kw_only=True):
    rpc = RPC.GET_STATE
    step: int


class State(Message, frozen=True, kw_only=True):
    stage: int
    next_step: int = 0


# ---- snapshots, checkpoints and rollbacks ---------------------------------------------------------------
class KeepHolders(Message, frozen=True, tag_field="kind", tag="holders", kw_only=True):
    """Kept in memory by these peers (this one among them or not)."""

    peers: list[str]


class KeepParity(Message, frozen=True, tag_field="kind", tag="parity", kw_only=True):
    """reft: kept here, and a chunk to every other member of the parity group for its parity block."""

    group: list[str]
    index: int


class KeepStorage(Message, frozen=True, tag_field="kind", tag="storage", kw_only=True):
    storage: str


Keep = Union[KeepHolders, KeepParity, KeepStorage]


class Snapshot(Request["Snapshotted"], frozen=True, kw_only=True):
    rpc = RPC.SNAPSHOT
    step: int
    keep: Keep


class Snapshotted(Message, frozen=True, kw_only=True):
    bytes: int
    sent: int = 0
    seconds: float = 0.0
    companion: str | None = None  # reft: where this peer's snapshot companion listens


class StoreSnapshot(Request["Stored"], frozen=True, kw_only=True):
    rpc = RPC.STORE_SNAPSHOT
    owner: int
    step: int


class Stored(Message, frozen=True, kw_only=True):
    ok: bool = True
    held: list[int] = []


class FetchSnapshot(Request[Ok], frozen=True, kw_only=True):
    rpc = RPC.FETCH_SNAPSHOT
    owner: int
    step: int


class Restore(Request[Ok], frozen=True, kw_only=True):
    rpc = RPC.RESTORE
    step: int
    origin: Origin


# ---- redundant computation ---------------------------------------------------------------------------
class TakeReplica(Request["ReplicaTaken"], frozen=True, kw_only=True):
    rpc = RPC.TAKE_REPLICA
    source: str
    step: int


class ReplicaTaken(Message, frozen=True, kw_only=True):
    stage: int
    bytes: int


class ReplicaGrad(Request[Ok], frozen=True, kw_only=True):
    rpc = RPC.REPLICA_GRAD
    step: int
    stage: int
    names: list[str]


class GetReplica(Request[State], frozen=True, kw_only=True):
    rpc = RPC.GET_REPLICA
    step: int


# ---- BAFT's backups ----------------------------------------------------------------------------------
class BackupStart(Request["BackupTaken"], frozen=True, kw_only=True):
    rpc = RPC.BACKUP_START
    step: int


class BackupTaken(Message, frozen=True, kw_only=True):
    bytes: int
    units: list[int]


class BackupPart(Request[Ok], frozen=True, kw_only=True):
    rpc = RPC.BACKUP_PART
    owner: int
    step: int
    offset: int
    total: int


class CopyChunk(Request[Ok], frozen=True, kw_only=True):
    """snap: the bytes [offset, offset + len) of the update (`kind`, on the holder's copy of `base`) of stage
    `owner`'s copy as of `step`, `total` bytes in all: part `part` of `parts`."""

    rpc = RPC.COPY_PART
    owner: int
    step: int
    kind: str
    base: int | None = None
    part: int
    parts: int
    offset: int
    total: int


class BackupCommit(Request["BackupsHeld"], frozen=True, kw_only=True):
    rpc = RPC.BACKUP_COMMIT
    step: int


class BackupsHeld(Message, frozen=True, kw_only=True):
    held: list[int] = []


class BackupFetch(Request["BackupsInFlight"], frozen=True, kw_only=True):
    """A handover: the leaving peer's backups of `step` still in flight, for the peer its stage is handed to."""

    rpc = RPC.BACKUP_FETCH
    step: int


class BackupAssembly(Message, frozen=True, kw_only=True):
    """A predecessor's backup being assembled: `total` bytes, the parts that arrived (offset -> length)."""

    owner: int
    total: int
    parts: dict[int, int] = {}


class BackupsInFlight(Message, frozen=True, kw_only=True):
    """BACKUP_FETCH's reply: the tensors are this stage's backup being sent (if `sending`), then the buffer of each
    of `assembling`, in order."""

    sending: bool = False
    assembling: list[BackupAssembly] = []


# ---- REFT's parity ------------------------------------------------------------------------------------
class ReftChunk(Request[Ok], frozen=True, kw_only=True):
    rpc = RPC.REFT_CHUNK
    step: int
    owner: int
    holder: int
    n: int
    length: int


class ReftFetch(Request["ParityMeta"], frozen=True, kw_only=True):
    rpc = RPC.REFT_FETCH
    step: int


class ParityMeta(Message, frozen=True, kw_only=True):
    """A parity block's place in its group (checkfree.baselines.Raim5Block)."""

    holder: int
    n: int
    lengths: list[int]


class CompanionStore(ParityMeta, frozen=True, kw_only=True):
    """reft: the peer's snapshot and parity block, kept by its companion process (peers/companion.py)."""

    rpc: ClassVar[str] = "cf.companion_store"
    step: int
    stage: int


class CompanionFetch(Message, frozen=True, kw_only=True):
    rpc: ClassVar[str] = "cf.companion_fetch"
    step: int


class CompanionStop(Message, frozen=True, kw_only=True):
    rpc: ClassVar[str] = "cf.companion_stop"


# ---- membership ---------------------------------------------------------------------------------------
class Ping(Request["Pong"], frozen=True, kw_only=True):
    rpc = RPC.PING


class Pong(Message, frozen=True, kw_only=True):
    stage: int
    state: str


class Shutdown(Request[Ok], frozen=True, kw_only=True):
    rpc = RPC.SHUTDOWN
    reason: str | None = None  # "run <status>": the run ended


class Ready(StepFigures, frozen=True, kw_only=True):
    """A finished step attempt that was not committed (for a new coordinator)."""

    step: int
    attempt: int
    losses: dict[int, float] = {}


class LastCommit(StepFigures, frozen=True, kw_only=True):
    step: int
    losses: dict[int, float] = {}
    lr: float = 0.0
    post: float = 0.0
    block_post: float | None = None


class Adopt(Request["Adopted"], frozen=True, kw_only=True):
    rpc = RPC.ADOPT
    proof: str | None = None  # the new coordinator's proof of the run secret


class Adopted(Message, frozen=True, kw_only=True):
    stage: int
    state: str
    next_step: int
    omega: float
    token: str | None = None
    config: str | None = None  # the run's config (JSON)
    ready: Ready | None = None
    finished: tuple[int, int] | None = None  # the newest (step, attempt) that ended here
    last_commit: LastCommit | None = None
    snapshots: dict[int, int] = {}  # stage -> the step of its snapshot held here
    epoch: int = 0  # the `Assign.epoch` of the assignment this peer serves its stage under
    # the peers of the newest step this peer took part in (peer -> stage): a takeover ADOPTs them even if it has not
    # read their DHT heartbeats (a refresh stalls while the DHT still routes to the dead coordinator's node)
    members: dict[str, int] = {}


class Join(Request["Joined"], frozen=True, kw_only=True):
    """(The membership token travels in the envelope.)"""

    rpc = RPC.JOIN
    peer_id: str
    role: str = "peer"  # or "observer": never assigned a stage


class Joined(Message, frozen=True, kw_only=True):
    config: str
    status: str  # "standby": every peer joins as one
    proof: str | None = None  # the coordinator's proof of the run secret


class Report(Request[Ok], frozen=True, kw_only=True):
    """A peer's call to a neighbour failed."""

    rpc = RPC.REPORT
    stage: int
    peer_id: str
    reason: str
    step: int | None = None
    attempt: int | None = None


class Leave(Request["Left"], frozen=True, kw_only=True):
    rpc = RPC.LEAVE
    peer_id: str | None = None


class Left(Message, frozen=True, kw_only=True):
    ok: bool = True
    handover: bool = False  # keep serving until the state is handed over


class Status(Request["RunStatus"], frozen=True, kw_only=True):
    rpc = RPC.STATUS


class RunStatus(Message, frozen=True, kw_only=True):
    step: int
    stages: dict[int, str]
    groups: dict[int, list[str]]
    standby: list[str]
    config: str


class Follow(Request["Following"], frozen=True, kw_only=True):
    """A standby coordinator's pull of what it needs to take over (coordinator/record_feed.py). Its copy of the
    run's record holds the first `metrics` and `events` bytes of the coordinator's metrics.jsonl and events.jsonl;
    the reply carries what follows them, at once if there is any, else once the record grows or `wait` seconds
    have passed (a long poll)."""

    rpc = RPC.FOLLOW
    probe: str  # a file `.standby-<probe>` the standby made in its own run directory: found, the directory is shared
    metrics: int = 0  # bytes of metrics.jsonl the standby's copy holds
    events: int = 0  # bytes of events.jsonl the standby's copy holds
    wait: float = 0.0  # seconds the coordinator may hold the request while there is nothing new


class Following(Message, frozen=True, kw_only=True):
    config: str  # the run's config (JSON)
    step: int  # the step the run is at: its newest commit is step - 1
    members: dict[str, int] = {}  # the run's live members: peer -> the stage it serves (-1: none)
    storage: str = ""  # where the run's checkpoints are (its config's storage_dir, or the coordinator's default)
    shared: bool = False  # the standby's run directory is this coordinator's: nothing to copy
    metrics: str = ""  # the lines of metrics.jsonl after the copy's `metrics` bytes (whole lines)
    events: str = ""  # the lines of events.jsonl after the copy's `events` bytes (whole lines)
    restart: bool = False  # the record is shorter than the copy (it was rewritten): the lines are from its start
    more: bool = False  # there is more to copy than one reply carries


# ---- the registry ------------------------------------------------------------------------------------
REQUESTS: dict[str, Any] = {
    RPC.ASSIGN: AssignRequest, **{c.rpc: c for c in (
        RunStep, Forward, Backward, GetPass, ComponentGrad, Commit, Abort, Reroute, Reduce, GetWeights, GetState,
        Snapshot, StoreSnapshot, FetchSnapshot, Restore, TakeReplica, ReplicaGrad, GetReplica, BackupStart,
        BackupPart, BackupCommit, BackupFetch, CopyChunk, ReftChunk, ReftFetch, Ping, Shutdown, Adopt, Join, Report,
        Leave, Status, Follow)}}


def reply_type(kind: Any) -> type:
    """The reply type of a request type (`Join` -> `Joined`: the `R` of its `Request[R]` base; a union of requests:
    its first variant's)."""
    kind = get_args(kind)[0] if get_origin(kind) is Union else kind
    for klass in kind.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            if get_origin(base) is Request:
                (reply,) = get_args(base)
                return globals()[reply.__forward_arg__] if isinstance(reply, ForwardRef) else reply
    raise TypeError(f"{kind.__name__} does not name its reply type (subclass Request[ReplyType])")


# each RPC's reply type, from its request's type (the reft companion's requests are not the protocol's)
REPLIES: dict[str, type] = {**{name: reply_type(kind) for name, kind in REQUESTS.items()},
                            CompanionStore.rpc: Ok, CompanionFetch.rpc: CompanionStore, CompanionStop.rpc: Ok}


def to_wire(message: Message) -> dict:
    """A message's builtin form: a dict of msgpack types (fields at their default left out, integer keys as
    strings)."""
    return msgspec.to_builtins(message, str_keys=True)


def as_record(message: Message) -> dict:
    """A message's fields that differ from their defaults, as builtins (what a record of metrics.jsonl keeps)."""
    return msgspec.to_builtins(message)


def from_wire(data: Any, kind: type[T] | Any, what: str = "request") -> T:
    """`data` (a decoded header) as `kind`, every field's type checked (nested ones too); ProtocolError names the
    field at fault."""
    try:
        return msgspec.convert(data, kind, str_keys=True)
    except msgspec.ValidationError as e:
        raise ProtocolError(_said(str(e), what)) from None


def reply_of(rpc: str, data: Any) -> Any:
    """A reply to `rpc` as its type; BadReply when it is not one."""
    try:
        return from_wire(data, REPLIES[rpc], "reply")
    except ProtocolError as e:
        raise BadReply(f"malformed reply to {rpc!r}: {e}") from None


def reply_to(message: Request[R], data: Any) -> R:
    """The reply to `message` as its type (statically too: `reply_to(Join(...), data)` is a `Joined`); BadReply
    when it is not one."""
    return cast(R, reply_of(message.rpc, data))


_TYPES = {"array": "list", "object": "dict", "null": "None"}


def _path(at: str | None) -> str:
    return "" if not at else re.sub(r"^\$\.?", "", at)


def _said(msg: str, what: str) -> str:
    """msgspec's validation message in this protocol's words (the field at fault, as `a.b`)."""
    if m := re.match(r"Object missing required field `(\w+)`(?: - at `(.+)`)?", msg):
        field = ".".join(p for p in (_path(m.group(2)), m.group(1)) if p)
        return f"{what} is missing field {field!r}"
    if m := re.match(r"Expected `(.+?)`, got `(.+?)`(?: - at `(.+)`)?", msg):
        want = " or ".join(_TYPES.get(t, t) for t in m.group(1).split(" | "))
        got = "NoneType" if m.group(2) == "null" else _TYPES.get(m.group(2), m.group(2))
        at = _path(m.group(3))
        return f"field {at!r} must be {want}, got {got}" if at else f"{what} must be {want}, got {got}"
    if m := re.match(r"Invalid value (.+?) - at `(.+)`", msg):
        return f"field {_path(m.group(2))!r} cannot be {m.group(1)}"
    return f"malformed {what}: {msg}"


def _shape(t: Any) -> type:
    """The builtin type a field of type `t` travels as (a struct: dict; optional: the type it holds)."""
    args = [a for a in getattr(t, "__args__", ()) if a is not type(None)]
    origin = getattr(t, "__origin__", None)
    if origin is Union or type(t).__name__ == "UnionType":
        return _shape(args[0]) if len(args) == 1 else dict
    if origin in (list, tuple):
        return list
    if origin is dict or isinstance(t, type) and issubclass(t, msgspec.Struct):
        return dict
    return t if isinstance(t, type) else object


def required_fields(kind: Any) -> dict[str, type]:
    """The fields a request of `kind` must carry and the builtin type of each (a tagged union: the fields every
    variant requires, and its tag)."""
    variants = getattr(kind, "__args__", (kind,))
    per = []
    for v in variants:
        info = cast(msgspec.inspect.StructType, msgspec.inspect.type_info(v))
        fields = {f.name: _shape(msgspec.structs.fields(v)[i].type) for i, f in enumerate(info.fields) if f.required}
        if info.tag_field is not None:
            fields[info.tag_field] = str
        per.append(fields)
    return {k: t for k, t in per[0].items() if all(p.get(k) is t for p in per)}


# RPC -> (tag field, tag -> variant) of the requests that are tagged unions
def _struct(kind: Any) -> msgspec.inspect.StructType:
    return cast(msgspec.inspect.StructType, msgspec.inspect.type_info(kind))


_VARIANTS = {name: (_struct(kind.__args__[0]).tag_field, {_struct(v).tag: v for v in kind.__args__})
             for name, kind in REQUESTS.items() if getattr(kind, "__args__", None)}

# what every RPC's header must carry beyond `run` (derived from the types: the admission check converts whole)
REQUEST_FIELDS: dict[str, dict[str, type]] = {name: required_fields(kind) for name, kind in REQUESTS.items()}


def request(run: str, message: Message) -> dict:
    """The header of `message` for run `run`."""
    return {"run": run, **to_wire(message)}


def check_request(name: str, header: Any) -> Message:
    """A received header as the typed request of RPC `name` (its envelope checked too); ProtocolError names the
    field at fault."""
    if name not in REQUESTS:
        raise ProtocolError(f"unknown request {name!r}")
    envelope(header)
    header = _named(header)
    kind = REQUESTS[name]
    if name in _VARIANTS:  # a tagged union: its variant by the tag (msgspec converts into a union ~7x slower)
        tag_field, variants = _VARIANTS[name]
        tag = header.get(tag_field) if isinstance(header, dict) else None
        if not isinstance(tag, str) or tag not in variants:
            from_wire(header, kind)  # the error, in msgspec's words
        kind = variants[tag]
    return from_wire(header, kind)


def envelope(header: Any) -> Envelope:
    """The envelope of a received header (its run and membership token)."""
    return from_wire(_named(header), Envelope)


def _named(header: Any) -> Any:
    """`header` without the keys that are not strings (a field named by bytes is no field)."""
    if isinstance(header, dict) and not all(isinstance(k, str) for k in header):
        return {k: v for k, v in header.items() if isinstance(k, str)}
    return header
