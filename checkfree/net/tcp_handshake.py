"""The handshake of a new ``--transport tcp`` connection (``checkfree.net.tcp_transport``), before any request.

Handshake (every new connection, before any request; each step is one wire message of at most
``HANDSHAKE_MAX_BYTES``):

1. caller -> server: ``{"hello": 1, "peer_id": <caller id>, "nonce": <32 random bytes>, "auth": bool}``
2. server -> caller: the same fields for the server, plus ``"proof"`` = HMAC(secret, "server" | both ids |
   both nonces) when it has a run secret (``checkfree.auth.handshake_proof``)
3. the caller checks that the server's id is the id it meant to call and (with a secret) the server's
   proof, then sends ``{"proof": HMAC(secret, "caller" | ...)}``; 4. the server checks it and answers
   ``{"ok": true}``.

So with a secret (``checkfree local`` always makes one) both sides prove they hold it over fresh nonces
(no replay) with a direction label (no reflection), and the id each side announces is bound to the proof:
a handler's ``peer`` argument is an id claimed by a holder of the secret. Without a secret, ids are
unauthenticated claims (a warning is logged at start). A side whose secret setting differs, a wrong
proof or a server answering as another id fails the handshake: the connection is closed with a log line
(the server answers ``{"error": ...}`` first) and the server keeps serving. Neither side encrypts.
"""

from __future__ import annotations

import asyncio
import logging
import secrets

from checkfree.auth import SECRET_ENV, handshake_proof, verify
from checkfree.net.errors import TransportError
from checkfree.net.framed import FramedReader
from checkfree.net.streams import read_message, write_frames
from checkfree.net.wire import WireError, encode_message

__all__ = ["HANDSHAKE_MAX_BYTES", "NONCE_BYTES", "HandshakeError", "check_hello", "accept_handshake", "dial_handshake"]

logger = logging.getLogger("checkfree.net.tcp_transport")

HANDSHAKE_MAX_BYTES = 4096  # one handshake message (ids, nonces, proofs) is far smaller
NONCE_BYTES = 32


class HandshakeError(TransportError):
    """A connection handshake failed (wrong secret, wrong peer id, malformed or missing messages)."""


def check_hello(hello: dict, secret: bytes | None) -> tuple[str, bytes]:
    """(peer id, nonce) of a handshake hello; ``HandshakeError`` if malformed or its auth setting differs."""
    peer, nonce = hello.get("peer_id"), hello.get("nonce")
    if hello.get("hello") != 1 or not isinstance(peer, str) or not peer or not isinstance(nonce, bytes) \
            or len(nonce) != NONCE_BYTES:
        raise HandshakeError(f"not a checkfree tcp handshake: {str(hello)[:200]}")
    if hello.get("auth") is not (secret is not None):
        mine, theirs = ("a", "no") if secret is not None else ("no", "a")
        raise HandshakeError(f"this side has {mine} run secret, peer {peer} has {theirs} run secret")
    return peer, nonce


async def accept_handshake(reader: FramedReader, writer: asyncio.StreamWriter, me: str,
                           secret: bytes | None) -> str:
    """Server half: returns the caller's (proven, with a secret) peer id; ``HandshakeError`` if it fails."""
    hello, _ = await read_message(reader, HANDSHAKE_MAX_BYTES)
    caller, nonce = check_hello(hello, secret)
    mine = secrets.token_bytes(NONCE_BYTES)
    reply = {"hello": 1, "peer_id": me, "nonce": mine, "auth": secret is not None}
    if secret is not None:
        reply["proof"] = handshake_proof(secret, "server", caller, me, nonce, mine)
    await write_frames(writer, encode_message(reply))
    answer, _ = await read_message(reader, HANDSHAKE_MAX_BYTES)
    if secret is not None and not verify(handshake_proof(secret, "caller", caller, me, nonce, mine),
                                         answer.get("proof")):
        raise HandshakeError(f"peer claiming id {caller} does not prove the run secret (a different "
                             f"--secret-file or ${SECRET_ENV}?)")
    await write_frames(writer, encode_message({"ok": True}))
    return caller


async def dial_handshake(reader: FramedReader, writer: asyncio.StreamWriter, me: str, peer: str,
                         secret: bytes | None) -> None:
    """Caller half, with the server meant to be ``peer``; ``HandshakeError`` if it fails."""
    mine = secrets.token_bytes(NONCE_BYTES)
    hello = {"hello": 1, "peer_id": me, "nonce": mine, "auth": secret is not None}
    try:
        await write_frames(writer, encode_message(hello))
        reply, _ = await read_message(reader, HANDSHAKE_MAX_BYTES)
        if "error" in reply:
            raise HandshakeError(f"peer {peer} refused the connection: {reply['error']}")
        server, nonce = check_hello(reply, secret)
        if server != peer:
            raise HandshakeError(f"the server at this address of {peer} answered as peer {server}")
        if secret is not None and not verify(handshake_proof(secret, "server", me, peer, mine, nonce),
                                             reply.get("proof")):
            raise HandshakeError(f"peer {peer} does not prove the run secret")
        proof = handshake_proof(secret, "caller", me, peer, mine, nonce) if secret else None
        await write_frames(writer, encode_message({"proof": proof}))
        ack, _ = await read_message(reader, HANDSHAKE_MAX_BYTES)
    except (asyncio.IncompleteReadError, ConnectionError, WireError) as e:
        raise HandshakeError(f"connection handshake with peer {peer} failed: {e!r}") from e
    except HandshakeError as e:
        logger.warning("tcp: %s", e)
        raise
    if ack.get("ok") is not True:
        raise HandshakeError(f"peer {peer} refused the connection: {ack.get('error', ack)}")
