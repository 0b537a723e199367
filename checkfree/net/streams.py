"""Length-prefixed request/reply streams over asyncio: chunked writes, reads into one fresh buffer that is
released at once when the read fails (received in place, `checkfree.net.framed`), a pool of idle streams for
reuse, and one call's exchange and timeout. Shared by the hivemind and tcp transports (the libp2p one runs the
same framing under trio)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np
import torch

from checkfree.net.errors import TransportError, TransportTimeout, remote_error
from checkfree.net.framed import FramedReader
from checkfree.net.wire import (
    PREFIX_BYTES,
    WireError,
    body_length,
    decode_body,
    encode_message,
)

__all__ = ["WRITE_CHUNK_BYTES", "WRITE_HIGH_WATER", "READ_CHUNK_BYTES", "SOCKET_SEND_BUFFER_BYTES", "POOL_IDLE_SECONDS",
           "POOL_MAX_IDLE_PER_KEY", "Stream", "StreamPool", "write_frames", "read_message", "discard_until_eof",
           "exchange", "reply_within", "quiet_disconnects", "stream_pool_default", "read_body", "read_body_into", "dispatch"]

logger = logging.getLogger("checkfree.net.transport")

WRITE_CHUNK_BYTES = 1 << 20

WRITE_HIGH_WATER = 4 << 20

READ_CHUNK_BYTES = 4 << 20

SOCKET_SEND_BUFFER_BYTES = 4 << 20

POOL_IDLE_SECONDS = 30.0  # a caller drops a pooled stream idle for longer (servers wait idle_timeout = 2x)

POOL_MAX_IDLE_PER_KEY = 8  # idle streams kept per (peer, protocol); more are closed after their call


async def write_frames(writer: asyncio.StreamWriter, frames: Sequence[bytes | memoryview]) -> None:
    """Write frames in bounded chunks so that the asyncio write buffer never copies a whole payload.

    The kernel send buffer of the unix socket to p2pd is raised (default ~208 KiB, capped by
    net.core.wmem_max): measured +15-40 % echo throughput for 1-16 MiB payloads.
    """
    transport = writer.transport
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_SEND_BUFFER_BYTES)
    if transport.get_write_buffer_limits()[1] < WRITE_HIGH_WATER:
        transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)
    for frame in frames:
        view = memoryview(frame).cast("B")
        for start in range(0, view.nbytes, WRITE_CHUNK_BYTES):
            writer.write(view[start : start + WRITE_CHUNK_BYTES])
            await writer.drain()
    await writer.drain()


async def read_message(reader: FramedReader | asyncio.StreamReader, max_message_bytes: int,
                        prefix: bytes | None = None) -> tuple[dict, list[torch.Tensor]]:
    """Read one length-prefixed message into a fresh writable buffer and decode it (``prefix``: its
    8-byte length prefix, if the caller has already read it).

    The declared length is checked against ``max_message_bytes`` before the buffer is allocated. The
    buffer is not zero-filled (unlike ``bytearray(length)``), so its pages are only committed as bytes
    arrive: a peer that declares a large message and stalls costs address space, not memory; a read that
    fails or is abandoned releases its buffer at once. A ``FramedReader`` (the transports' connections)
    receives the body in place; a plain ``StreamReader`` (a test's raw connection) is read chunk by chunk.
    """
    if prefix is None:
        prefix = await reader.readexactly(PREFIX_BYTES)
    length = body_length(prefix, max_message_bytes=max_message_bytes)
    if isinstance(reader, FramedReader):
        return decode_body(await read_body_into(reader, length))

    async def read_some(n: int) -> bytes:
        chunk = await reader.read(n)
        if not chunk:
            raise asyncio.IncompleteReadError(b"", n)
        return chunk

    return decode_body(await read_body(read_some, length))


async def read_body(read_some: Callable[[int], Awaitable[bytes]], length: int) -> memoryview:
    """`length` bytes from as many `read_some(at most n)` calls as it takes (it raises at the end of the stream),
    into one fresh buffer that is not zero-filled (its pages are committed as bytes arrive). Works under asyncio
    and trio alike. A read that fails or is abandoned releases the buffer at once: its exception often sits in a
    reference cycle (traceback -> asyncio.wait_for's frame -> the task -> the exception), which used to keep
    the buffer alive until the next garbage collection."""
    body: np.ndarray = np.empty(length, dtype=np.uint8)
    view = body.data
    pos, chunk = 0, b""
    try:
        while pos < length:
            chunk = await read_some(min(length - pos, READ_CHUNK_BYTES))
            view[pos : pos + len(chunk)] = chunk
            pos += len(chunk)
    except BaseException:
        view.release()
        del view, body, chunk
        raise
    return view


async def read_body_into(reader: FramedReader, length: int) -> memoryview:
    """`length` bytes received in place into one fresh buffer that is not zero-filled (see `read_body`)."""
    body: np.ndarray = np.empty(length, dtype=np.uint8)
    view = body.data
    try:
        await reader.readinto(view)
    except BaseException:
        view.release()
        del view, body
        raise
    return view


async def dispatch(handlers: dict, name: str, header: dict, tensors: list[torch.Tensor], peer: Any) -> list:
    """The encoded reply of the handler registered under `name` (looked up per request: once unregistered, a
    reused stream or connection gets an error reply too); TransportError when there is none."""
    handler = handlers.get(name)
    if handler is None:
        raise TransportError(f"no handler registered for '{name}'")
    reply_header, reply_tensors = await handler(header, tensors, peer)
    return encode_message(reply_header, reply_tensors)



def quiet_disconnects(loop: asyncio.AbstractEventLoop) -> None:
    """A stream the other side closed before its first byte (hivemind's p2pd client handler meets
    this whenever a peer dies or a connection is dropped) is expected under churn: a debug line, not
    asyncio's `Unhandled exception in client_connected_cb` traceback. So is a stream handler cancelled
    as its process shuts down (a RUN_STEP waiting for its step when the peer is told to go): asyncio's
    stream callback asks the cancelled task for its exception and logs `Exception in callback`."""

    def handler(loop: asyncio.AbstractEventLoop, context: dict) -> None:
        exc = context.get("exception")
        cancelled = isinstance(exc, asyncio.CancelledError) and "StreamReaderProtocol" in str(context.get("message"))
        if cancelled or isinstance(exc, (asyncio.IncompleteReadError, ConnectionError)):
            logger.debug("%s: %r", context.get("message"), exc)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)


async def discard_until_eof(reader: FramedReader | asyncio.StreamReader) -> None:
    while await reader.read(READ_CHUNK_BYTES):
        pass


Stream = tuple[FramedReader, asyncio.StreamWriter]


class StreamPool:
    """Idle request/reply streams (or connections) kept for reuse, by key, one call at a time each: an entry
    is dropped when idle for more than ``max_idle`` seconds or closed by its remote end, and at most
    ``max_per_key`` idle ones are kept per key (more are closed)."""

    def __init__(self, max_idle: float, max_per_key: int) -> None:
        self.max_idle = max_idle
        self.max_per_key = max_per_key
        self.idle: dict[Any, list[tuple[FramedReader, asyncio.StreamWriter, float]]] = {}

    def _fresh(self, reader: FramedReader, writer: asyncio.StreamWriter, since: float, now: float) -> bool:
        open_ = not (reader.at_eof() or reader.exception() is not None or writer.is_closing())
        return open_ and now - since <= self.max_idle

    def take(self, key: Any) -> Stream | None:
        """The most recently used idle stream under ``key`` that is still open, or None."""
        idle = self.idle.get(key)
        now = time.monotonic()
        while idle:
            reader, writer, since = idle.pop()
            if self._fresh(reader, writer, since, now):
                return reader, writer
            writer.close()
        return None

    def put(self, key: Any, reader: FramedReader, writer: asyncio.StreamWriter) -> None:
        """Keep a stream for reuse; also drop every pooled stream that expired or was closed remotely."""
        now = time.monotonic()
        for k in list(self.idle):
            kept = []
            for entry in self.idle[k]:
                if self._fresh(*entry, now):
                    kept.append(entry)
                else:
                    entry[1].close()
            if kept:
                self.idle[k] = kept
            else:
                del self.idle[k]
        idle = self.idle.setdefault(key, [])
        if len(idle) < self.max_per_key:
            idle.append((reader, writer, now))
        else:
            writer.close()

    def close_all(self) -> None:
        for entries in self.idle.values():
            for _, writer, _ in entries:
                writer.close()
        self.idle.clear()


async def exchange(stream: Stream, frames: Sequence[bytes | memoryview], max_message_bytes: int, peer: str,
                    what: str, pool: StreamPool | None, key: Any) -> tuple[dict, list[torch.Tensor]]:
    """Write one request on ``stream`` and read its reply. Afterwards the stream goes back to ``pool`` under
    ``key`` if the call succeeded (an error reply makes the server close it), else it is closed: a failed,
    timed-out (cancelled) or refused call never leaves its stream for reuse. ``peer``/``what`` name the
    remote end and the stream in errors."""
    reader, writer = stream
    reusable = False
    try:
        await write_frames(writer, frames)
        reply = await read_message(reader, max_message_bytes)
        reusable = "error" not in reply[0]
        return reply
    except (asyncio.IncompleteReadError, ConnectionError) as e:
        raise TransportError(f"{peer} closed {what} before a full reply ({e!r})") from e
    except WireError as e:
        raise TransportError(f"invalid reply from {peer} on {what}: {e}") from e
    finally:
        if reusable and pool is not None:
            pool.put(key, reader, writer)
        else:
            writer.close()


async def reply_within(exchange: Awaitable[tuple[dict, list[torch.Tensor]]], timeout: float, peer: Any,
                        name: str) -> tuple[dict, list[torch.Tensor]]:
    """The reply of one call's ``exchange``: ``TransportTimeout`` after ``timeout`` s, ``RemoteError`` for an
    error reply."""
    try:
        reply_header, reply_tensors = await asyncio.wait_for(exchange, timeout)
    except asyncio.TimeoutError:
        raise TransportTimeout(f"call '{name}' to peer {peer} timed out after {timeout:g} s") from None
    if "error" in reply_header:
        raise remote_error(peer, name, reply_header)
    return reply_header, reply_tensors


def stream_pool_default() -> bool:
    """Whether callers reuse streams: yes unless the environment sets ``CHECKFREE_STREAM_POOL=0``."""
    return os.environ.get("CHECKFREE_STREAM_POOL", "1").strip().lower() not in ("0", "false", "no", "off")

