"""The one admission check of a peer (peers.checks.admit), as a pure function: the run, the header
fields, then who may send what — with and without a run secret."""

from __future__ import annotations

import pytest

from checkfree.auth import coordinator_proof, join_token
from checkfree.protocol import RPC, Kind, ProtocolError
from peers.checks import RULES, Access, admit

RUN, ME, COORD, MEMBER, STRANGER = "r", "me", "coord", "member", "stranger"
SECRET = b"secret"


def _admit(name: str, header: dict, caller: str, secret: bytes | None, coordinator: str | None = COORD) -> None:
    admit(name, {"run": RUN, **header}, caller, run_id=RUN, secret=secret, coordinator=coordinator, me=ME)


_NESTED = {"mode": "fresh", "keep": {"kind": "holders", "peers": []}, "origin": {"kind": "init"}}


def _minimal(name: str) -> dict:
    """A header with every field the RPC's rule requires (values of the right type; a tagged union: a variant)."""
    return {k: _NESTED.get(k, {int: 0, str: "x", dict: {}, bool: False, list: []}[t])
            for k, t in RULES[name].fields.items()}


@pytest.mark.parametrize("secret", [None, SECRET])
@pytest.mark.parametrize("name", sorted(n for n, r in RULES.items() if r.access is Access.COORDINATOR))
def test_control_rpcs_are_the_coordinators_alone(name: str, secret: bytes | None) -> None:
    _admit(name, _minimal(name), COORD, secret)
    with pytest.raises(ProtocolError, match="only the run's coordinator may .* is not authorized") as e:
        _admit(name, _minimal(name), STRANGER, secret)
    assert e.value.kind == Kind.UNAUTHORIZED
    with pytest.raises(ProtocolError, match="only the run's coordinator"):  # before it knows its coordinator
        _admit(name, _minimal(name), COORD, secret, coordinator=None)


@pytest.mark.parametrize("name", sorted(n for n, r in RULES.items() if r.access is Access.MEMBER))
def test_data_rpcs_need_the_run_token_only_with_a_secret(name: str) -> None:
    header = _minimal(name)
    _admit(name, header, STRANGER, None)  # an open swarm
    _admit(name, {**header, "token": join_token(SECRET, RUN, MEMBER)}, MEMBER, SECRET)
    _admit(name, header, COORD, SECRET)
    for caller, token in ((STRANGER, None), (STRANGER, join_token(SECRET, RUN, MEMBER)), (MEMBER, "0" * 64)):
        with pytest.raises(ProtocolError, match="is not authorized for this run"):
            _admit(name, {**header, "token": token}, caller, SECRET)


def test_ping_is_open_and_adopt_needs_a_coordinator_proof() -> None:
    _admit(RPC.PING, {}, STRANGER, SECRET, coordinator=None)
    _admit(RPC.ADOPT, {"proof": coordinator_proof(SECRET, RUN, "new", ME)}, "new", SECRET)
    _admit(RPC.ADOPT, {}, "new", None)
    for proof in (None, coordinator_proof(SECRET, RUN, STRANGER, ME)):
        with pytest.raises(ProtocolError, match="not authorized to coordinate"):
            _admit(RPC.ADOPT, {"proof": proof}, "new", SECRET)


def test_malformed_requests_are_refused_with_the_field_at_fault_before_who_sent_them() -> None:
    with pytest.raises(ProtocolError, match="request for run 'other'"):
        admit(RPC.ABORT, {"run": "other"}, STRANGER, run_id=RUN, secret=None, coordinator=COORD, me=ME)
    with pytest.raises(ProtocolError, match="missing field 'mode'"):
        _admit(RPC.ASSIGN, {"stage": 1}, STRANGER, None)
    with pytest.raises(ProtocolError, match="field 'hop' must be int"):
        _admit(RPC.FORWARD, {**_minimal(RPC.FORWARD), "hop": "1"}, MEMBER, None)


def test_every_rpc_a_peer_serves_has_a_rule() -> None:
    served = {v for k, v in vars(RPC).items() if k.isupper()} - {RPC.JOIN, RPC.REPORT, RPC.LEAVE, RPC.STATUS,
                                                                  RPC.FOLLOW}
    assert served == set(RULES)


def test_requests_are_defined_once_and_checked_at_both_ends():
    """Every RPC's header is a type of checkfree.messages: the peers' admission rules, the coordinator's handlers
    and the senders all use those types (a sender cannot build a request without its required fields)."""
    from checkfree.messages import REQUEST_FIELDS, Forward, check_request, request
    from checkfree.protocol import RPC, ProtocolError
    from peers.checks import RULES

    served_by_peers = {n for n in vars(RPC).values() if isinstance(n, str) and n.startswith("cf.")} - {
        RPC.JOIN, RPC.REPORT, RPC.LEAVE, RPC.STATUS, RPC.FOLLOW}
    assert set(RULES) == served_by_peers and all(RULES[n].fields == REQUEST_FIELDS[n] for n in RULES)
    forward = Forward(step=1, attempt=0, mb=2, hop=1)
    assert request("r", forward) == {"run": "r", "step": 1, "attempt": 0, "mb": 2, "hop": 1}
    assert check_request(RPC.FORWARD, request("r", forward)) == forward
    with pytest.raises(TypeError, match="hop"):
        Forward(step=1, attempt=0, mb=2)
    with pytest.raises(ProtocolError, match="field 'stage' must be int, got str"):
        check_request(RPC.REPORT, {"run": "r", "stage": "1", "peer_id": "p", "reason": "x"})
    with pytest.raises(ProtocolError, match="unknown request 'cf.nope'"):
        check_request("cf.nope", {"run": "r"})
    with pytest.raises(ProtocolError, match="field 'keep.peers\\[0\\]' must be str, got int"):  # nested fields too
        check_request(RPC.SNAPSHOT, {"run": "r", "step": 1, "keep": {"kind": "holders", "peers": [1]}})
    with pytest.raises(ProtocolError, match="field 'mode' cannot be 'sideways'"):
        check_request(RPC.ASSIGN, {"run": "r", "stage": 1, "mode": "sideways"})
