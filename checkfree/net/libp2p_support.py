"""py-libp2p made importable beside hivemind, its identities and protocol ids, and the trio-side stream helpers of
`checkfree.net.libp2p_transport`.

protobuf: hivemind's ``crypto.proto`` and py-libp2p's ``libp2p/crypto/pb/crypto.proto`` both define
``crypto.pb.KeyType/PublicKey/PrivateKey``, so importing both packages into protobuf's single default
descriptor pool fails ("duplicate symbol 'crypto.pb.KeyType'"), whichever comes first. Importing this
module installs a router that gives the generated ``*_pb2`` modules of the ``libp2p`` package a private
descriptor pool (everyone else keeps the default one), so both coexist in one process. Import libp2p
through this module (or after importing it): a bare ``import libp2p`` before it breaks hivemind.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from checkfree.net.errors import TransportError
from checkfree.net.streams import read_body
from checkfree.net.wire import PREFIX_BYTES, body_length

__all__ = ["LIBP2P_IMPORT_ERROR", "READ_CHUNK_BYTES", "WRITE_CHUNK_BYTES", "IncompleteRead", "identity_key_pair",
           "protocol_id", "t_close", "t_read_body", "t_read_some", "t_reset", "t_write_frames"]

logger = logging.getLogger(__name__)

WRITE_CHUNK_BYTES = 1 << 20
READ_CHUNK_BYTES = 4 << 20


# ---------------------------------------------------------------- protobuf isolation (see module docstring)


def _isolate_libp2p_protobufs() -> None:
    """Route ``descriptor_pool.Default()`` calls made by ``libp2p.*`` modules to a private pool. Idempotent."""
    try:
        from google.protobuf import descriptor_pool
    except ImportError:  # no protobuf: libp2p cannot be imported either
        return
    if getattr(descriptor_pool.Default, "_checkfree_libp2p_router", False):
        return
    if "libp2p" in sys.modules:
        logger.warning(
            "libp2p was imported before checkfree.net.libp2p_transport: its protobufs live in the default "
            "descriptor pool and importing hivemind in this process will fail (duplicate crypto.pb symbols)"
        )
    original = descriptor_pool.Default
    private = descriptor_pool.DescriptorPool()

    def default() -> Any:
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller == "libp2p" or caller.startswith("libp2p."):
            return private
        return original()

    default._checkfree_libp2p_router = True  # type: ignore[attr-defined]
    default._checkfree_private_pool = private  # type: ignore[attr-defined]
    descriptor_pool.Default = default


_isolate_libp2p_protobufs()

try:
    import multiaddr
    import trio
    from libp2p import generate_new_ed25519_identity, new_host
    from libp2p.crypto.ed25519 import Ed25519PrivateKey
    from libp2p.crypto.keys import KeyPair
    from libp2p.crypto.x25519 import create_new_key_pair as create_new_x25519_key_pair
    from libp2p.peer.id import ID
    from libp2p.peer.peerstore import PERMANENT_ADDR_TTL
    from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
    from libp2p.security.noise.transport import Transport as NoiseTransport

    LIBP2P_IMPORT_ERROR: ImportError | None = None
except ImportError as _e:  # optional dependency: pip install 'checkfree[libp2p]'
    LIBP2P_IMPORT_ERROR = _e
    # the names exist either way (None); Libp2pTransport refuses to start with LIBP2P_IMPORT_ERROR's message
    multiaddr = trio = generate_new_ed25519_identity = new_host = Ed25519PrivateKey = KeyPair = None  # type: ignore
    create_new_x25519_key_pair = ID = PERMANENT_ADDR_TTL = NOISE_PROTOCOL_ID = NoiseTransport = None  # type: ignore


def identity_key_pair(path: str) -> Any:
    """The ed25519 key pair kept in file ``path`` (made there, mode 0600, if missing): a stable peer id."""
    try:
        with open(path, "rb") as f:
            private = Ed25519PrivateKey.from_bytes(f.read())
    except FileNotFoundError:
        private = generate_new_ed25519_identity().private_key
        with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
            f.write(private.to_bytes())
    except Exception as e:
        raise TransportError(f"cannot read the libp2p identity in {path}: {type(e).__name__}: {e}") from e
    return KeyPair(private, private.get_public_key())


def protocol_id(name: str) -> str:
    """The libp2p protocol id that serves handler ``name``."""
    return f"/checkfree/{name}/1.0.0"


class IncompleteRead(Exception):
    """The stream ended (EOF or reset) before a whole message arrived."""


# ---------------------------------------------------------------- trio-side stream helpers


async def t_read_exactly(stream: Any, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = await t_read_some(stream, n - len(buf))
        buf += chunk
    return bytes(buf)


async def t_read_some(stream: Any, n: int) -> bytes:
    """One read of at most ``n`` bytes (may return fewer); EOF/reset become ``IncompleteRead``."""
    try:
        chunk = await stream.read(n)
    except trio.Cancelled:
        raise
    except Exception as e:  # StreamEOF, StreamReset, StreamError, connection errors
        raise IncompleteRead(f"{type(e).__name__}: {e}") from e
    if not chunk:
        raise IncompleteRead("end of stream")
    return chunk


async def t_read_body(stream: Any, max_message_bytes: int) -> memoryview:
    """Read one length-prefixed message body into a fresh writable buffer (no decoding here).

    The declared length is checked (``WireError``) before the buffer is allocated; the buffer is not
    zero-filled, so a peer that declares a large message and stalls costs address space, not memory, and a
    read that fails or is abandoned releases it at once (as ``checkfree.net.streams.read_message`` does). Reads return whatever
    has arrived, so the body is assembled from as many reads as it takes.
    """
    length = body_length(await t_read_exactly(stream, PREFIX_BYTES), max_message_bytes=max_message_bytes)
    return await read_body(lambda n: t_read_some(stream, n), length)


async def t_write_frames(stream: Any, frames: Sequence[bytes | memoryview]) -> None:
    for frame in frames:
        view = memoryview(frame).cast("B")
        for start in range(0, view.nbytes, WRITE_CHUNK_BYTES):
            await stream.write(view[start : start + WRITE_CHUNK_BYTES])


async def t_reset(stream: Any) -> None:
    with trio.CancelScope(shield=True), trio.move_on_after(2):
        with contextlib.suppress(Exception):
            await stream.reset()


async def t_close(stream: Any) -> None:
    with trio.CancelScope(shield=True), trio.move_on_after(2):
        with contextlib.suppress(Exception):
            await stream.close()
