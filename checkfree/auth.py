"""Run membership authentication: a shared run secret, HMAC-SHA256 tokens.

libp2p already authenticates *who* is calling (a peer id is the hash of the public key
the Noise/TLS handshake proved), so what remains is *whether that peer belongs to the run*.
(`--transport tcp` has no keys per peer: `handshake_proof` makes both ends of each connection prove
the secret over fresh nonces and their claimed ids, so an id there is a claim by some secret holder.)

* a peer joins with `join_token(secret, run, peer_id)`; the coordinator admits it only if
  the token verifies, and answers with `coordinator_proof(...)` so the peer knows the
  coordinator it found in the DHT holds the secret too (mutual authentication);
* with a secret configured, peers accept control RPCs only from the coordinator and data
  RPCs (activations, gradients, weights, snapshots) only from peers the coordinator listed
  as members; the coordinator accepts reports, leaves and status requests only from
  members. A stranger can neither join nor inject activations, gradients or weights.
* DHT records carry a MAC bound to the writer's peer id (`sign_record` / `record_ok`): peers'
  heartbeats and the coordinator's address record. Readers with the secret ignore records
  without a valid one, so a stranger cannot announce itself as a member or as the coordinator.
  A copied record only repeats what a member said; heartbeats are advisory anyway (a missing
  one only triggers a ping; assignment needs an authenticated join), so no forged or replayed
  record can admit a peer or hide a failure.

The secret comes from `--secret-file` or the CHECKFREE_SECRET environment variable (never
the command line, where other users could read it); `checkfree local` makes a random one.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

__all__ = ["load_secret", "join_token", "coordinator_proof", "handshake_proof", "verify", "sign_record", "record_ok",
           "SECRET_ENV"]

SECRET_ENV = "CHECKFREE_SECRET"


def load_secret(secret_file: str | None = None) -> bytes | None:
    """The run secret from a file or the environment; None runs an open swarm."""
    if secret_file:
        path = Path(secret_file)
        if not path.is_file():
            raise ValueError(f"--secret-file {secret_file!r} does not exist")
        value = path.read_text().strip()
    else:
        value = os.environ.get(SECRET_ENV, "").strip()
    if not value:
        return None
    if len(value) < 16:
        raise ValueError("the run secret must be at least 16 characters")
    return value.encode()


def _mac(secret: bytes, *parts: str) -> str:
    return hmac.new(secret, "|".join(parts).encode(), hashlib.sha256).hexdigest()


def join_token(secret: bytes, run_id: str, peer_id: str) -> str:
    return _mac(secret, "join", run_id, peer_id)


def coordinator_proof(secret: bytes, run_id: str, coordinator_id: str, peer_id: str) -> str:
    return _mac(secret, "coordinator", run_id, coordinator_id, peer_id)


def handshake_proof(secret: bytes, direction: str, caller_id: str, server_id: str, caller_nonce: bytes,
                    server_nonce: bytes) -> str:
    """`--transport tcp` connection handshake: proves the secret to the other side of one connection (fresh
    nonces: no replay; `direction` "caller" or "server": no reflection of the other side's proof)."""
    return _mac(secret, "tcp-handshake", direction, caller_id, server_id, caller_nonce.hex(), server_nonce.hex())


def verify(expected: str, given: object) -> bool:
    return isinstance(given, str) and hmac.compare_digest(expected, given)


def sign_record(secret: bytes | None, run_id: str, kind: str, peer_id: str, value: dict) -> dict:
    """A DHT record `value` written by `peer_id`, with its MAC when the run has a secret."""
    return value if secret is None else {**value, "mac": _mac(secret, "record", kind, run_id, peer_id)}


def record_ok(secret: bytes | None, run_id: str, kind: str, peer_id: object, value: object) -> bool:
    """Whether a DHT record read back was written by a holder of the secret (always, without one)."""
    if not isinstance(value, dict) or not isinstance(peer_id, str):
        return False
    return secret is None or verify(_mac(secret, "record", kind, run_id, peer_id), value.get("mac"))
