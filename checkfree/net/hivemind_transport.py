"""RPC over hivemind's p2pd binary streams (the default transport).

A call is one request/reply exchange on a libp2p stream to ``name`` on the remote peer: the caller writes
one ``checkfree.net.wire`` message and reads one reply message. The server side decodes the request, runs
the registered handler, writes the reply and then waits for the next request on the same stream. Any
failure while decoding or handling is answered with the header ``{"error": "<ExceptionType>: <message>",
"kind": ...}`` (no tensors), after which the server closes that stream (its framing may be lost) and keeps
serving; ``call`` turns such replies into ``RemoteError``. A reply header must therefore not use the key
``"error"`` for anything else.

Stream reuse: opening a stream costs more than sending a small activation through it (a new unix-socket
connection to p2pd on each side, a yamux stream and protocol negotiation between the daemons), so after a
successful call the caller keeps the stream in a per-(peer, protocol) pool of idle streams and the next
call to the same protocol takes it (one call at a time per stream; concurrent calls open more streams). A
pooled stream is dropped when it is idle for ``pool_idle`` seconds, when its remote end has closed it, or
when its call fails or times out; a call never silently retries on another stream, so every request is
delivered at most once (the same guarantee as a fresh stream). ``CHECKFREE_STREAM_POOL=0`` in the
environment turns reuse off (one stream per call) for A/B measurements. Servers close a stream that stays
idle for ``idle_timeout`` seconds between requests (longer than the callers' ``pool_idle``).

Why binary streams: hivemind's unary protobuf RPC caps messages at 2-4 MiB, activations are bigger.
The p2pd daemon proxy cannot half-close a stream, so the message length prefix (not EOF) delimits a
request; a server that answers with an error lingers until the caller closes so that no reply bytes are
lost on close.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import torch
from hivemind.p2p import P2P, P2PDaemonError, PeerID

from checkfree.net.base import Handler
from checkfree.net.errors import TransportError, failed_request
from checkfree.net.framed import FramedReader, adopt
from checkfree.net.streams import (
    POOL_IDLE_SECONDS,
    POOL_MAX_IDLE_PER_KEY,
    StreamPool,
    discard_until_eof,
    dispatch,
    exchange,
    read_message,
    reply_within,
    stream_pool_default,
    write_frames,
)
from checkfree.net.wire import (
    DEFAULT_MAX_MESSAGE_BYTES,
    PREFIX_BYTES,
    WireError,
    encode_message,
)

__all__ = ["HivemindTransport"]

logger = logging.getLogger("checkfree.net.transport")


def _as_peer_id(peer_id: PeerID | str) -> PeerID:
    return peer_id if isinstance(peer_id, PeerID) else PeerID.from_base58(str(peer_id))


class HivemindTransport:
    """Request/response RPC on top of an existing ``hivemind.p2p.P2P`` instance.

    ``max_message_bytes`` caps both incoming requests and replies. ``read_timeout`` bounds how long the
    server waits for a (possibly stalled) request on a new stream and for a request's body;
    ``idle_timeout`` how long it waits for the next request on a stream it has answered;
    ``linger_timeout`` how long it keeps a stream open after an error reply, waiting for the caller to
    close. ``pool_streams`` (default: on unless ``CHECKFREE_STREAM_POOL=0``) keeps a caller's streams
    for reuse, each for at most ``pool_idle`` seconds of idleness (see the module docstring).
    """

    kind = "hivemind"  # the --transport name

    def __init__(
        self,
        p2p: P2P,
        *,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        read_timeout: float = 120.0,
        linger_timeout: float = 10.0,
        idle_timeout: float = 2 * POOL_IDLE_SECONDS,
        pool_streams: bool | None = None,
        pool_idle: float = POOL_IDLE_SECONDS,
        owns_p2p: bool = False,
    ) -> None:
        self.p2p = p2p
        self.max_message_bytes = max_message_bytes
        self.read_timeout = read_timeout
        self.linger_timeout = linger_timeout
        self.idle_timeout = idle_timeout
        self.pool_streams = stream_pool_default() if pool_streams is None else pool_streams
        self.pool_idle = pool_idle
        self.owns_p2p = owns_p2p
        self._handlers: dict[str, Handler] = {}
        self._pool = StreamPool(pool_idle, POOL_MAX_IDLE_PER_KEY)  # keyed by (peer, protocol)
        self.streams_opened = 0  # streams this caller opened (a call on a pooled stream opens none)
        self.extra_header: dict = {}  # merged into every request (e.g. the run membership token)

    @property
    def peer_id(self) -> PeerID:
        return self.p2p.peer_id

    async def register(self, name: str, handler: Handler) -> None:
        """Serve ``handler`` under protocol ``name``; each incoming stream runs in its own task."""

        async def _on_stream(info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await self._serve(name, info.peer_id, adopt(reader, writer), writer)

        self._handlers[name] = handler
        await self.p2p.add_binary_stream_handler(name, _on_stream)

    async def unregister(self, name: str) -> None:
        self._handlers.pop(name, None)
        await self.p2p.remove_binary_stream_handler(name)

    async def _serve(self, name: str, peer: PeerID, reader: FramedReader, writer: asyncio.StreamWriter) -> None:
        """Answer requests on one stream until the caller closes it, it idles for ``idle_timeout`` or a
        request fails (after an error reply the stream is closed: its framing may be lost). The handler is
        looked up per request: once ``name`` is unregistered, a reused stream gets an error reply too."""
        first = True
        try:
            while True:
                failed = False
                try:
                    try:
                        prefix = await asyncio.wait_for(reader.readexactly(PREFIX_BYTES),
                                                        self.read_timeout if first else self.idle_timeout)
                    except asyncio.IncompleteReadError as e:
                        if not e.partial:
                            return  # the caller closed the stream between requests
                        raise
                    except asyncio.TimeoutError:
                        if not first:
                            return  # an idle pooled stream: the caller has moved on
                        raise
                    first = False
                    try:
                        header, tensors = await asyncio.wait_for(
                            read_message(reader, self.max_message_bytes, prefix), self.read_timeout
                        )
                    except asyncio.TimeoutError:
                        raise asyncio.TimeoutError(
                            f"no complete request within read_timeout={self.read_timeout:g} s") from None
                    frames = await dispatch(self._handlers, name, header, tensors, peer)
                except (asyncio.IncompleteReadError, ConnectionError) as e:
                    logger.debug("%s: peer %s closed the stream mid-request: %r", name, peer, e)
                    return
                except Exception as e:  # decoding, handler and reply-encoding errors all go back to the caller
                    frames = encode_message(failed_request(e, name, peer, (asyncio.TimeoutError, WireError, TransportError)))
                    failed = True
                await write_frames(writer, frames)
                if failed:
                    try:  # wait for the caller to close (no half-close in p2pd), so no reply bytes are dropped
                        await asyncio.wait_for(discard_until_eof(reader), self.linger_timeout)
                    except asyncio.TimeoutError:
                        pass
                    return
        except (ConnectionError, asyncio.IncompleteReadError) as e:
            logger.debug("%s: stream to %s broke while replying: %r", name, peer, e)
        finally:
            writer.close()

    async def call(
        self,
        peer_id: PeerID | str,
        name: str,
        header: dict,
        tensors: Sequence[torch.Tensor] = (),
        *,
        timeout: float,
    ) -> tuple[dict, list[torch.Tensor]]:
        """Send one request to ``name`` on ``peer_id`` and return its reply ``(header, tensors)``.

        Raises ``RemoteError`` if the remote side answered with an error, ``TransportTimeout`` after
        ``timeout`` seconds, ``TransportError`` for unreachable peers, broken streams or invalid replies,
        and ``WireError`` (locally, before sending) for tensors/headers that cannot be encoded.
        """
        peer = _as_peer_id(peer_id)
        if self.extra_header:
            header = {**self.extra_header, **header}
        frames = encode_message(header, tensors)
        return await reply_within(self._call(peer, name, frames), timeout, peer, name)

    async def _call(self, peer: PeerID, name: str, frames: list) -> tuple[dict, list[torch.Tensor]]:
        key = (peer, name)
        stream = self._pool.take(key)
        if stream is None:
            try:
                _, reader, writer = await self.p2p.call_binary_stream_handler(peer, name)
            except (P2PDaemonError, ConnectionError, OSError, EOFError) as e:  # EOF: the daemon closed its stream
                raise TransportError(f"cannot open stream '{name}' to peer {peer}: {e}") from e
            self.streams_opened += 1
            stream = adopt(reader, writer), writer
        return await exchange(stream, frames, self.max_message_bytes, f"peer {peer}", f"stream '{name}'",
                               self._pool if self.pool_streams else None, key)

    def close_idle_streams(self) -> None:
        """Close every pooled stream (the next calls open new ones)."""
        self._pool.close_all()

    async def shutdown(self) -> None:
        """Close pooled streams, unregister all handlers; shut the P2P instance down too if this transport owns it."""
        self.close_idle_streams()
        for name in list(self._handlers):
            try:
                await self.unregister(name)
            except Exception as e:
                logger.debug("unregister %s failed: %r", name, e)
        if self.owns_p2p:
            await self.p2p.shutdown()

