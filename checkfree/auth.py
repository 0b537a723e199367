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
* DHT records carry a MAC over their whole content, the writer's peer id, the record kind and
  an expiry time (`sign_record` / `record_ok`): peers' heartbeats and the coordinator's address
  record. Readers with the secret ignore records without a valid MAC or past their expiry, so a
  stranger cannot announce itself as a member or as the coordinator, alter what a member said
  (its stage, its state) or replay an old record once it has expired (a copy can be replayed
  only until the expiry its writer chose: one heartbeat TTL for heartbeats). Heartbeats are
  advisory anyway (a missing one only triggers a ping; assignment needs an authenticated
  join), so no forged or replayed record can admit a peer or hide a failure.

The secret comes from `--secret-file` or the CHECKFREE_SECRET environment variable (never
the command line, where other users could read it); `checkfree local` makes a random one.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import time
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


def _record_mac(secret: bytes, run_id: str, kind: str, peer_id: str, value: dict) -> str:
    content = json.dumps({k: v for k, v in value.items() if k != "mac"}, sort_keys=True, separators=(",", ":"))
    return _mac(secret, "record", kind, run_id, peer_id, content)


def sign_record(secret: bytes | None, run_id: str, kind: str, peer_id: str, value: dict, ttl: float) -> dict:
    """A DHT record `value` written by `peer_id`; when the run has a secret, with an `expires` time
    (Unix seconds, now + `ttl`: the record's DHT expiry) and a MAC over all of it."""
    if secret is None:
        return value
    record = {**value, "expires": round(time.time() + ttl, 3)}
    return {**record, "mac": _record_mac(secret, run_id, kind, peer_id, record)}


def record_ok(secret: bytes | None, run_id: str, kind: str, peer_id: object, value: object) -> bool:
    """Whether a DHT record read back was written by a holder of the secret, unaltered and not
    expired (always true without a secret)."""
    if not isinstance(value, dict) or not isinstance(peer_id, str):
        return False
    if secret is None:
        return True
    expires = value.get("expires")
    if not isinstance(expires, (int, float)) or not math.isfinite(expires) or expires < time.time():
        return False
    try:
        return verify(_record_mac(secret, run_id, kind, peer_id, value), value.get("mac"))
    except (TypeError, ValueError):  # content that JSON cannot hold was not signed by us
        return False
