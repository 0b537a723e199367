"""Every request a peer serves passes one admission check, then the handler's own checks.

`admit` is that one check, made before any handler runs: the run the request names, the
header as its RPC's typed request (checkfree.messages: every field's type, nested ones too), then who
may send it (`authorize`). Who may send what:

* ANYONE: PING, a liveness probe.
* MEMBER: the data RPCs (activations, gradients, weights, snapshots). With a run secret only
  callers whose request carries the run token bound to their own peer id (the transport
  authenticates the peer id, the token proves it holds the secret); in an open swarm anyone.
* COORDINATOR: the control RPCs (assign, run a step, commit, abort, snapshot, restore, shut
  down): from anyone else they could start, commit or abort steps, make this peer write files,
  or leave activations behind.
* NEW_COORDINATOR: ADOPT, a takeover by a coordinator proving the run secret (whether the old
  coordinator is really gone is the handler's question: peers.adoption).

The rest of this module checks message contents: activations, a step's hops and senders, blobs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

import torch

from checkfree.auth import coordinator_proof, join_token, verify
from checkfree.config import RunConfig
from checkfree.net.wire import check_finite
from checkfree.serialize import tensor_blob
from checkfree.messages import REQUEST_FIELDS, Adopt, Envelope, Message, Pass, RunStep, check_request, envelope
from checkfree.protocol import RPC, Kind, ProtocolError
from checkfree.wirecodec import decode

if TYPE_CHECKING:
    from peers.step import StepRun

__all__ = [
    "RULES",
    "Access",
    "Rule",
    "admit",
    "authorize",
    "check_activation",
    "check_blob",
    "check_groups",
    "check_hop",
    "check_hops",
    "check_run",
    "check_sender",
]


class Access(Enum):
    """Who may send a request (see the module docstring)."""

    ANYONE = "anyone"
    MEMBER = "member"
    COORDINATOR = "coordinator"
    NEW_COORDINATOR = "new_coordinator"


@dataclass(frozen=True)
class Rule:
    """What a peer requires of one RPC before its handler runs."""

    access: Access
    fields: dict[str, type] = field(default_factory=dict)  # required header fields beyond `run` (from the type)
    action: str = ""  # what the request does, for a refusal ("only the run's coordinator may ...")


_ACCESS: dict[str, tuple[Access, str]] = {  # who may send each RPC, and what it does (for a refusal)
    RPC.PING: (Access.ANYONE, ""),
    RPC.FORWARD: (Access.MEMBER, ""),
    RPC.BACKWARD: (Access.MEMBER, ""),
    RPC.COMPONENT_GRAD: (Access.MEMBER, ""),
    RPC.GET_WEIGHTS: (Access.MEMBER, ""),
    RPC.GET_STATE: (Access.MEMBER, ""),
    RPC.STORE_SNAPSHOT: (Access.MEMBER, ""),
    RPC.FETCH_SNAPSHOT: (Access.MEMBER, ""),
    RPC.REPLICA_GRAD: (Access.MEMBER, ""),
    RPC.GET_REPLICA: (Access.MEMBER, ""),
    RPC.TAKE_REPLICA: (Access.COORDINATOR, "order a replica"),
    RPC.BACKUP_PART: (Access.MEMBER, ""),
    RPC.BACKUP_FETCH: (Access.MEMBER, ""),
    RPC.COPY_PART: (Access.MEMBER, ""),
    RPC.REFT_CHUNK: (Access.MEMBER, ""),
    RPC.REFT_FETCH: (Access.MEMBER, ""),
    RPC.BACKUP_START: (Access.COORDINATOR, "take a backup"),
    RPC.BACKUP_COMMIT: (Access.COORDINATOR, "complete a backup"),
    RPC.ASSIGN: (Access.COORDINATOR, "assign a stage"),
    RPC.RUN_STEP: (Access.COORDINATOR, "start a step"),
    RPC.COMMIT: (Access.COORDINATOR, "commit a step"),
    RPC.ABORT: (Access.COORDINATOR, "abort a step"),
    RPC.SNAPSHOT: (Access.COORDINATOR, "take a snapshot"),  # it names files and peers
    RPC.RESTORE: (Access.COORDINATOR, "roll a stage back"),
    RPC.SHUTDOWN: (Access.COORDINATOR, "shut this peer down"),
    RPC.REROUTE: (Access.COORDINATOR, "reroute microbatches"),
    RPC.GET_PASS: (Access.MEMBER, ""),
    RPC.REDUCE: (Access.COORDINATOR, "reduce a step's gradients"),
    RPC.ADOPT: (Access.NEW_COORDINATOR, ""),
}
# the header fields come from the requests' one definition (checkfree.messages)
RULES: dict[str, Rule] = {name: Rule(access, dict(REQUEST_FIELDS[name]), action)
                          for name, (access, action) in _ACCESS.items()}


def admit(name: str, header: dict, caller: str, *, run_id: str, secret: bytes | None, coordinator: str | None,
          me: str) -> Message:
    """The one check before every handler: the run, the header as the typed request of `name`, then `authorize`.
    Malformed requests are refused with the field at fault, before (and whoever) they come from; the request."""
    env = check_run(header, run_id)
    message = check_request(name, header)
    authorize(RULES[name], caller, env, message, run_id=run_id, secret=secret, coordinator=coordinator, me=me)
    return message


def authorize(rule: Rule, caller: str, env: Envelope, message: Message, *, run_id: str, secret: bytes | None,
              coordinator: str | None, me: str) -> None:
    """Refuse (Kind.UNAUTHORIZED) a request `caller` may not send; `me` is this peer's id."""
    if rule.access is Access.ANYONE:
        return
    if rule.access is Access.NEW_COORDINATOR:
        assert isinstance(message, Adopt)
        if secret is not None and not verify(coordinator_proof(secret, run_id, caller, me), message.proof):
            raise ProtocolError(f"peer {caller} is not authorized to coordinate this run (no valid coordinator proof)",
                                Kind.UNAUTHORIZED)
        return
    if rule.access is Access.COORDINATOR:
        if coordinator is None or caller != coordinator:
            raise ProtocolError(f"only the run's coordinator may {rule.action}: peer {caller} is not authorized",
                                Kind.UNAUTHORIZED)
        return
    # MEMBER: with a secret, nothing is served before this peer knows its coordinator
    if secret is not None and (coordinator is None or (
            caller != coordinator and not verify(join_token(secret, run_id, caller), env.token))):
        raise ProtocolError(f"peer {caller} is not authorized for this run", Kind.UNAUTHORIZED)


def check_run(header: dict, run_id: str) -> Envelope:
    """Every request names the run; a request for another run is refused. The request's envelope."""
    env = envelope(header)
    if env.run != run_id:
        raise ProtocolError(f"request for run {env.run!r}; this peer serves run {run_id!r}")
    return env


def check_activation(tensors: list[torch.Tensor], what: str, cfg: RunConfig | None) -> torch.Tensor:
    """The one activation (or gradient) of a FORWARD (BACKWARD), decoded from the run's wire dtype
    (checkfree.wirecodec): its count, shapes, dtypes, finite values; float32."""
    if cfg is None:
        raise ProtocolError("this peer has not joined a run yet")
    m, t = cfg.model, cfg.train
    check_finite([x for x in tensors if x.is_floating_point()])
    try:
        return decode(tensors, t.wire_dtype, (t.microbatch_size, cfg.seq_len, m.d_model), what)
    except ValueError as e:
        raise ProtocolError(str(e)) from None


def check_hop(run: StepRun, request: Pass, stage: int, me: str | None = None) -> tuple[int, int]:
    """The (microbatch, hop) a FORWARD, BACKWARD or GET_PASS names: in the step's routes and this peer's stage
    (in a stage group: a hop the step's table gives this peer, `me`)."""
    mb, idx = request.mb, request.hop
    if not 0 <= mb < len(run.routes) or not 0 <= idx < len(run.routes[mb]):
        raise ProtocolError(f"microbatch {mb} hop {idx} out of range")
    if run.routes[mb][idx].stage != stage:
        raise ProtocolError(f"microbatch {mb} hop {idx} belongs to stage {run.routes[mb][idx].stage}, "
                            f"not to this peer's stage {stage}")
    if run.hops is not None and me is not None and run.hops[mb][idx] != me:
        raise ProtocolError(f"microbatch {mb} hop {idx} is computed by replica {run.hops[mb][idx]} of stage "
                            f"{stage}, not by this peer")
    return mb, idx


def check_hops(request: RunStep, routes: list) -> list[list[str]]:
    """A RUN_STEP's `hops` table: one peer id per hop of every microbatch of its routes (the types are the
    admission check's)."""
    hops = request.hops or []
    if len(hops) != len(routes) or any(len(h) != len(r) for h, r in zip(hops, routes)):
        raise ProtocolError("RUN_STEP 'hops' must name one peer per hop of every microbatch")
    return [list(h) for h in hops]


def check_groups(request: RunStep) -> dict[int, list[str]]:
    """A RUN_STEP's `groups`: stage -> its replicas' peer ids."""
    groups = request.groups
    if groups is None or not all(k >= 0 and v for k, v in groups.items()):
        raise ProtocolError("RUN_STEP 'groups' must map each stage to a non-empty list of peer ids")
    return {k: list(v) for k, v in groups.items()}


def check_sender(run: StepRun, peer: object, mb: int, idx: int) -> None:
    """Activations and gradients of a step are accepted only from the peer that this step's table
    lists for the sending hop: a retired peer (partitioned, replaced) is refused even if it holds the
    run token."""
    expect = run.peer(mb, idx) if run.grouped else run.peers.get(run.routes[mb][idx].stage)
    if str(peer) != expect:
        raise ProtocolError(f"peer {peer} does not serve stage {run.routes[mb][idx].stage} in step {run.step} "
                            f"attempt {run.attempt}")


def check_blob(tensors: list[torch.Tensor], what: str) -> memoryview:
    """The bytes of a message that carries one serialized state (`what`) as one 1-D uint8 tensor: a view of the
    received message (no copy)."""
    if len(tensors) != 1 or tensors[0].dtype != torch.uint8 or tensors[0].dim() != 1:
        raise ProtocolError(f"{what} is one 1-D uint8 tensor")
    return tensor_blob(tensors[0])
