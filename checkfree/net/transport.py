"""Asyncio request/response RPC between peers over hivemind P2P binary streams.

A call is one request/reply exchange on a libp2p stream to ``name`` on the remote peer: the caller writes
one ``checkfree.net.wire`` message and reads one reply message. The server side decodes the request, runs
the registered handler, writes the reply and then waits for the next request on the same stream. Any
failure while decoding or handling is answered with the header ``{"error": "<ExceptionType>: <message>"}``
(no tensors), after which the server closes that stream (its framing may be lost) and keeps serving;
``Transport.call`` turns such replies into ``RemoteError``. A reply header must therefore not use the
key ``"error"`` for anything else.

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

Membership helpers (``announce``, ``heartbeat``, ``live_members``) store DHT sub-keys with an expiry:
an entry disappears ~ttl seconds after its owner stops refreshing it.

``start_transport(..., transport="libp2p" | "tcp")`` keeps the DHT but serves RPC with
``checkfree.net.libp2p_transport.Libp2pTransport`` or ``checkfree.net.tcp_transport.TcpTransport`` (same
interface) instead: each process publishes its RPC multiaddrs under ``rpc_addrs_key(peer_id)`` and looks
a peer's up there before its first call.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import random
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np
import torch
from hivemind.dht import DHT
from hivemind.p2p import P2P, P2PDaemonError, PeerID
from hivemind.utils import get_dht_time
from hivemind.utils.multiaddr import Multiaddr

from checkfree.net.lifeline import TiedDHT, quiet_fd_handoffs, sweep_stale_sockets
from checkfree.net import TRANSPORTS
from checkfree.net.wire import (
    DEFAULT_MAX_MESSAGE_BYTES,
    PREFIX_BYTES,
    WireError,
    body_length,
    decode_body,
    encode_message,
)

__all__ = [
    "TRANSPORTS",
    "Handler",
    "RemoteError",
    "Transport",
    "TransportError",
    "TransportTimeout",
    "announce",
    "StreamPool",
    "check_transport",
    "dht_maddrs",
    "failed_request",
    "heartbeat",
    "learn_addresses",
    "live_members",
    "live_members_async",
    "rpc_addrs_key",
    "rpc_note",
    "start_transport",
    "stop_transport",
    "stream_pool_default",
]

logger = logging.getLogger(__name__)

Handler = Callable[[dict, list[torch.Tensor], PeerID], Awaitable[tuple[dict, Sequence[torch.Tensor]]]]

RPC_ADDRS_TTL = 60.0  # libp2p, tcp: lifetime of a process's address record in the DHT (refreshed every ttl/3)
RPC_ADDRS_ATTEMPTS = 3  # libp2p, tcp: stores of that record tried at start-up before giving up

WRITE_CHUNK_BYTES = 1 << 20
WRITE_HIGH_WATER = 4 << 20
READ_CHUNK_BYTES = 4 << 20
SOCKET_SEND_BUFFER_BYTES = 4 << 20
POOL_IDLE_SECONDS = 30.0  # a caller drops a pooled stream idle for longer (servers wait idle_timeout = 2x)
POOL_MAX_IDLE_PER_KEY = 8  # idle streams kept per (peer, protocol); more are closed after their call


class TransportError(Exception):
    """A call could not be completed: peer unreachable, stream broken, invalid reply, startup failure."""


class TransportTimeout(TransportError, TimeoutError):
    """A call did not complete within its timeout (also an ``asyncio.TimeoutError``)."""


class RemoteError(TransportError):
    """The remote handler (or the remote decoder) failed; ``remote_message`` is its error string and
    ``kind`` what happened, as a word callers branch on (the error's own ``kind``, e.g. a step's
    ``straggler``; ``bad_request`` for malformed input; ``internal`` for a bug), never the text."""

    def __init__(self, message: str, remote_message: str, kind: str = "internal") -> None:
        super().__init__(message)
        self.remote_message = remote_message
        self.kind = kind


def remote_error(peer: Any, name: str, reply_header: dict) -> RemoteError:
    """The RemoteError of an error reply ``{"error": text, "kind": kind}``."""
    kind = reply_header.get("kind")
    return RemoteError(f"peer {peer} failed '{name}': {reply_header['error']}", str(reply_header["error"]),
                       kind if isinstance(kind, str) else "internal")


def _as_peer_id(peer_id: PeerID | str) -> PeerID:
    return peer_id if isinstance(peer_id, PeerID) else PeerID.from_base58(str(peer_id))


async def _write_frames(writer: asyncio.StreamWriter, frames: Sequence[bytes | memoryview]) -> None:
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


async def _read_message(reader: asyncio.StreamReader, max_message_bytes: int,
                        prefix: bytes | None = None) -> tuple[dict, list[torch.Tensor]]:
    """Read one length-prefixed message into a fresh writable buffer and decode it (``prefix``: its
    8-byte length prefix, if the caller has already read it).

    The declared length is checked against ``max_message_bytes`` before the buffer is allocated. The
    buffer is not zero-filled (unlike ``bytearray(length)``), so its pages are only committed as bytes
    arrive: a peer that declares a large message and stalls costs address space, not memory; a read that
    fails or is abandoned releases its buffer at once.
    """
    if prefix is None:
        prefix = await reader.readexactly(PREFIX_BYTES)
    length = body_length(prefix, max_message_bytes=max_message_bytes)
    body = np.empty(length, dtype=np.uint8)
    view = memoryview(body)
    pos, chunk = 0, b""
    try:
        while pos < length:
            chunk = await reader.read(min(length - pos, READ_CHUNK_BYTES))
            if not chunk:
                raise asyncio.IncompleteReadError(b"", length - pos)
            view[pos : pos + len(chunk)] = chunk
            pos += len(chunk)
    except BaseException:
        # An abandoned read's exception often sits in a reference cycle (its traceback holds asyncio.wait_for's
        # frame, which holds the task that holds the exception): drop the buffer now, not at the next gc.
        view.release()
        del view, body, chunk
        raise
    return decode_body(view)


def quiet_disconnects(loop: asyncio.AbstractEventLoop) -> None:
    """A stream the other side closed before its first byte (hivemind's p2pd client handler meets
    this whenever a peer dies or a connection is dropped) is expected under churn: a debug line, not
    asyncio's `Unhandled exception in client_connected_cb` traceback."""

    def handler(loop: asyncio.AbstractEventLoop, context: dict) -> None:
        exc = context.get("exception")
        if isinstance(exc, (asyncio.IncompleteReadError, ConnectionError)):
            logger.debug("%s: %r", context.get("message"), exc)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)


class RefusalLog:
    """One-line warnings for expected refusals (bad or unauthorized requests, aborted attempts), at
    most `per_window` per `window_s` seconds; the rest are counted and summed up in the next line
    that gets through, so hostile traffic cannot grow a log without bound."""

    def __init__(self, per_window: int = 10, window_s: float = 60.0) -> None:
        self.per_window, self.window_s = per_window, window_s
        self._start, self._shown, self._dropped = -math.inf, 0, 0

    def warn(self, text: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._start > self.window_s:
            if self._dropped:
                logger.warning("(%d similar refusal line(s) suppressed in the last %.0f s)", self._dropped,
                               now - self._start)
            self._start, self._shown, self._dropped = now, 0, 0
        if self._shown >= self.per_window:
            self._dropped += 1
            return
        self._shown += 1
        logger.warning(text, *args)


REFUSALS = RefusalLog()


def expected(e: BaseException) -> bool:
    """An error that normal operation produces (a bad or refused request, an aborted step): a
    one-line warning, not a traceback. Malformed input raises ValueError subclasses (WireError,
    ProtocolError); other expected conditions carry ``expected = True``."""
    return isinstance(e, (ValueError, asyncio.TimeoutError)) or getattr(e, "expected", False)


def failed_request(e: Exception, what: str, peer: Any, bad: tuple[type, ...] = (asyncio.TimeoutError, WireError)) -> dict:
    """Log a request that failed on a server (a rate-limited one-line warning for a ``bad`` request or
    an expected condition, the traceback for a bug in a handler) and return its error reply
    ``{"error": text, "kind": kind}``; ``what`` names the protocol in the log."""
    if isinstance(e, bad) or expected(e):
        REFUSALS.warn("%s: refused request from %s: %s: %s", what, peer, type(e).__name__, str(e)[:300])
        kind = getattr(e, "kind", None) or ("timeout" if isinstance(e, asyncio.TimeoutError) else "bad_request")
    else:
        logger.exception("%s: handler failed for request from %s", what, peer)
        kind = "internal"
    return {"error": f"{type(e).__name__}: {e}", "kind": kind}


async def _discard_until_eof(reader: asyncio.StreamReader) -> None:
    while await reader.read(READ_CHUNK_BYTES):
        pass


Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class StreamPool:
    """Idle request/reply streams (or connections) kept for reuse, by key, one call at a time each: an entry
    is dropped when idle for more than ``max_idle`` seconds or closed by its remote end, and at most
    ``max_per_key`` idle ones are kept per key (more are closed)."""

    def __init__(self, max_idle: float, max_per_key: int) -> None:
        self.max_idle = max_idle
        self.max_per_key = max_per_key
        self.idle: dict[Any, list[tuple[asyncio.StreamReader, asyncio.StreamWriter, float]]] = {}

    def _fresh(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, since: float, now: float) -> bool:
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

    def put(self, key: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
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


async def _exchange(stream: Stream, frames: Sequence[bytes | memoryview], max_message_bytes: int, peer: str,
                    what: str, pool: StreamPool | None, key: Any) -> tuple[dict, list[torch.Tensor]]:
    """Write one request on ``stream`` and read its reply. Afterwards the stream goes back to ``pool`` under
    ``key`` if the call succeeded (an error reply makes the server close it), else it is closed: a failed,
    timed-out (cancelled) or refused call never leaves its stream for reuse. ``peer``/``what`` name the
    remote end and the stream in errors."""
    reader, writer = stream
    reusable = False
    try:
        await _write_frames(writer, frames)
        reply = await _read_message(reader, max_message_bytes)
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


async def _reply_within(exchange: Awaitable[tuple[dict, list[torch.Tensor]]], timeout: float, peer: Any,
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


class Transport:
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
            await self._serve(name, handler, info.peer_id, reader, writer)

        self._handlers[name] = handler
        await self.p2p.add_binary_stream_handler(name, _on_stream)

    async def unregister(self, name: str) -> None:
        self._handlers.pop(name, None)
        await self.p2p.remove_binary_stream_handler(name)

    async def _serve(
        self, name: str, handler: Handler, peer: PeerID, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """Answer requests on one stream until the caller closes it, it idles for ``idle_timeout`` or a
        request fails (after an error reply the stream is closed: its framing may be lost)."""
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
                            _read_message(reader, self.max_message_bytes, prefix), self.read_timeout
                        )
                    except asyncio.TimeoutError:
                        raise asyncio.TimeoutError(
                            f"no complete request within read_timeout={self.read_timeout:g} s") from None
                    reply_header, reply_tensors = await handler(header, tensors, peer)
                    frames = encode_message(reply_header, reply_tensors)
                except (asyncio.IncompleteReadError, ConnectionError) as e:
                    logger.debug("%s: peer %s closed the stream mid-request: %r", name, peer, e)
                    return
                except Exception as e:  # decoding, handler and reply-encoding errors all go back to the caller
                    frames = encode_message(failed_request(e, name, peer))
                    failed = True
                await _write_frames(writer, frames)
                if failed:
                    try:  # wait for the caller to close (no half-close in p2pd), so no reply bytes are dropped
                        await asyncio.wait_for(_discard_until_eof(reader), self.linger_timeout)
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
        return await _reply_within(self._call(peer, name, frames), timeout, peer, name)

    async def _call(self, peer: PeerID, name: str, frames: list) -> tuple[dict, list[torch.Tensor]]:
        key = (peer, name)
        stream = self._pool.take(key)
        if stream is None:
            try:
                _, reader, writer = await self.p2p.call_binary_stream_handler(peer, name)
            except (P2PDaemonError, ConnectionError, OSError) as e:
                raise TransportError(f"cannot open stream '{name}' to peer {peer}: {e}") from e
            self.streams_opened += 1
            stream = reader, writer
        return await _exchange(stream, frames, self.max_message_bytes, f"peer {peer}", f"stream '{name}'",
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


def _check_initial_peers(initial_peers: Sequence[str]) -> list[str]:
    peers = [str(p) for p in initial_peers]
    for addr in peers:
        try:
            maddr = Multiaddr(addr)
            PeerID.from_base58(maddr["p2p"])
        except Exception as e:
            raise TransportError(
                f"invalid initial peer {addr!r}: expected a full multiaddr such as "
                f"/ip4/1.2.3.4/tcp/31337/p2p/Qm... (copy it from the peer's startup log) ({e})"
            ) from e
    return peers


def stream_pool_default() -> bool:
    """Whether callers reuse streams: yes unless the environment sets ``CHECKFREE_STREAM_POOL=0``."""
    return os.environ.get("CHECKFREE_STREAM_POOL", "1").strip().lower() not in ("0", "false", "no", "off")


def check_transport(kind: str) -> None:
    """``TransportError`` for an unknown transport name, or for ``libp2p`` when py-libp2p cannot be imported."""
    if kind not in TRANSPORTS:
        raise TransportError(f"unknown transport {kind!r}; choose one of {', '.join(TRANSPORTS)}")
    if kind == "libp2p":
        from checkfree.net.libp2p_transport import LIBP2P_IMPORT_ERROR

        if LIBP2P_IMPORT_ERROR is not None:
            raise TransportError(f"--transport libp2p needs py-libp2p, which cannot be imported "
                                 f"({LIBP2P_IMPORT_ERROR}): pip install 'checkfree[libp2p]'")


def rpc_addrs_key(peer_id: str) -> str:
    """DHT key under which a libp2p- or tcp-transport process publishes its RPC multiaddrs."""
    return f"checkfree/rpc-addrs/{peer_id}"


def _ips(maddrs: Sequence[str]) -> list[tuple[str, str]]:
    """The distinct (ip4|ip6, address) pairs of ``maddrs``, in order."""
    found = []
    for m in maddrs:
        for proto in ("ip4", "ip6"):
            with contextlib.suppress(Exception):
                found.append((proto, Multiaddr(str(m))[proto]))
    return list(dict.fromkeys(found))


def _announced_maddrs(bound: Sequence[str], announce_maddrs: Sequence[str] | None, peer_id: str) -> list[str]:
    """What an RPC listener publishes: the IPs of ``announce_maddrs`` (if given) at its bound TCP port, else
    its own ``bound`` multiaddrs (with a warning if those name a wildcard address nobody else can dial)."""
    if announce_maddrs:
        port = Multiaddr(bound[0])["tcp"]
        return [f"/{proto}/{ip}/tcp/{port}/p2p/{peer_id}" for proto, ip in _ips(announce_maddrs)]
    if any(ip in ("0.0.0.0", "::") for _, ip in _ips(bound)):
        logger.warning("the RPC transport listens on all interfaces but announces %s: remote peers cannot dial "
                       "that; give --announce-maddrs with this machine's public address", list(bound))
    return list(bound)


async def _publish_rpc_addrs(dht: DHT, t: Any, announce_maddrs: Sequence[str] | None) -> Any:
    """Publish ``t``'s addresses (see ``_announced_maddrs``) under ``rpc_addrs_key(t.peer_id)`` (refreshed by a
    task in ``t.tasks``), set ``t.address_resolver`` to look other peers' addresses up there; returns ``t``,
    or shuts it down and raises."""
    try:
        t.maddrs = _announced_maddrs(t.maddrs, announce_maddrs, t.peer_id)
        await _announce_rpc_addrs(dht, t)
    except BaseException:
        await t.shutdown()
        raise
    return t


async def learn_addresses(t: Any, peer: str) -> None:
    """Ask ``t.address_resolver`` (the DHT lookup set by ``_publish_rpc_addrs``) for ``peer``'s addresses and
    remember every usable one with ``t.add_peer_address``; a failed lookup or a malformed or foreign record is
    logged and skipped (the caller reports a peer whose address stays unknown)."""
    try:
        found = await t.address_resolver(peer)
    except Exception as e:  # noqa: BLE001 - reported by the caller as an unknown address
        logger.debug("address lookup of %s failed: %r", peer, e)
        return
    for maddr in found:
        try:
            t.add_peer_address(str(maddr), peer)
        except Exception as e:  # noqa: BLE001 - a malformed or foreign record: skip it
            logger.debug("ignoring address %r found for %s: %r", maddr, peer, e)


async def _announce_rpc_addrs(dht: DHT, t: Any) -> None:
    key = rpc_addrs_key(t.peer_id)
    for attempt in range(1, RPC_ADDRS_ATTEMPTS + 1):  # a store can fail on a loaded machine (DHT RPC timeouts)
        if await announce(dht, key, "addrs", list(t.maddrs), RPC_ADDRS_TTL):
            break
        logger.warning("publishing this process's %s RPC addresses in the DHT failed (attempt %d of %d)",
                       t.kind, attempt, RPC_ADDRS_ATTEMPTS)
        if attempt < RPC_ADDRS_ATTEMPTS:
            await asyncio.sleep(attempt * random.uniform(0.5, 1.0))
    else:
        raise TransportError(f"could not publish this process's {t.kind} RPC addresses in the DHT "
                             f"({RPC_ADDRS_ATTEMPTS} attempts)")
    t.tasks.add(asyncio.create_task(heartbeat(dht, key, "addrs", list(t.maddrs), RPC_ADDRS_TTL)))

    async def resolve(peer_id: str) -> list[str]:
        found = await live_members_async(dht, rpc_addrs_key(peer_id))
        return [a for v in found.values() if isinstance(v, list) for a in v if isinstance(a, str)]

    t.address_resolver = resolve


async def _start_libp2p_rpc(dht: DHT, host_maddrs: Sequence[str], announce_maddrs: Sequence[str] | None,
                            identity_path: str | None, port: int, startup_timeout: float,
                            max_message_bytes: int) -> Any:
    """A ``Libp2pTransport`` beside the DHT: listens on the IPs of ``host_maddrs`` at TCP ``port`` (0: any),
    publishes its multiaddrs in the DHT (the IPs of ``announce_maddrs`` if given, at the bound port) and
    looks up the addresses of peers it calls there. With ``identity_path``, its key is kept in
    ``<identity_path>.libp2p`` (a stable peer id across restarts)."""
    from checkfree.net.libp2p_transport import identity_key_pair, start_libp2p_transport

    listen = [f"/{proto}/{ip}/tcp/{port}" for proto, ip in _ips(host_maddrs)] or [f"/ip4/127.0.0.1/tcp/{port}"]
    key_pair = identity_key_pair(f"{identity_path}.libp2p") if identity_path else None
    t = await start_libp2p_transport(listen, max_message_bytes=max_message_bytes, startup_timeout=startup_timeout,
                                     key_pair=key_pair)
    return await _publish_rpc_addrs(dht, t, announce_maddrs)


async def _start_tcp_rpc(dht: DHT, host_maddrs: Sequence[str], announce_maddrs: Sequence[str] | None, port: int,
                         secret: bytes | None, max_message_bytes: int) -> Any:
    """A ``TcpTransport`` beside the DHT, under the DHT's own peer id: listens on the IPs of ``host_maddrs`` at
    TCP ``port`` (0: any) and publishes/looks up addresses in the DHT like ``_start_libp2p_rpc``."""
    from checkfree.net.tcp_transport import start_tcp_transport

    peer_id = str(await asyncio.get_running_loop().run_in_executor(None, lambda: dht.peer_id))
    hosts = [ip for _, ip in _ips(host_maddrs)] or ["127.0.0.1"]
    t = await start_tcp_transport(peer_id, hosts, port, secret=secret, max_message_bytes=max_message_bytes)
    return await _publish_rpc_addrs(dht, t, announce_maddrs)


async def start_transport(
    initial_peers: Sequence[str] = (),
    host_maddrs: Sequence[str] = ("/ip4/127.0.0.1/tcp/0",),
    announce_maddrs: Sequence[str] | None = None,
    identity_path: str | None = None,
    startup_timeout: float = 15.0,
    *,
    transport: str = "hivemind",
    libp2p_port: int = 0,
    tcp_port: int = 0,
    secret: bytes | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    **dht_kwargs: Any,
) -> tuple[DHT, Any]:
    """Start a hivemind DHT (own process and p2pd) and an RPC transport: ``hivemind`` (a ``Transport`` on the
    DHT's P2P daemon), ``libp2p`` (a ``Libp2pTransport``, py-libp2p in a trio thread, listening on
    ``libp2p_port``; its peer id is a different one than the DHT's, kept in ``<identity_path>.libp2p`` when
    ``identity_path`` is given, and the DHT carries its addresses) or ``tcp`` (a ``TcpTransport``: direct,
    unencrypted TCP on ``tcp_port`` under the DHT's peer id, its connections authenticated with the run
    ``secret`` when there is one; the DHT carries its addresses).

    Fails within ~``startup_timeout`` (+ DHT bootstrap time) with an actionable ``TransportError`` when the
    daemon does not start or no initial peer can be reached. Stop with ``await stop_transport(dht, t)``.
    """
    check_transport(transport)
    peers = _check_initial_peers(initial_peers)
    sweep_stale_sockets()
    quiet_disconnects(asyncio.get_running_loop())
    quiet_fd_handoffs()
    dht = TiedDHT(  # dies with this process, and takes its p2pd along (lifeline.py)
        initial_peers=peers or None,
        start=False,
        host_maddrs=list(host_maddrs),
        announce_maddrs=list(announce_maddrs) if announce_maddrs else None,
        identity_path=identity_path,
        startup_timeout=startup_timeout,
        **dht_kwargs,
    )
    dht.run_in_background(await_ready=False)
    deadline = startup_timeout + 30.0  # p2pd start + DHT bootstrap pings (hivemind's own wait_timeout)
    started = time.monotonic()
    try:
        await asyncio.get_running_loop().run_in_executor(None, dht.wait_until_ready, deadline)
    except Exception as e:
        dht.shutdown()
        text = str(e)
        if isinstance(e, TimeoutError) and not text:
            text = f"DHT not ready after {time.monotonic() - started:.1f} s"
        if peers and ("bootstrap" in text or "initial_peers" in text):
            hint = (
                f"could not reach any initial peer {peers}: check that those peers are running, that the "
                "address/port/peer id match what they printed at startup and that the port is open "
                "(firewall/NAT; the default host_maddrs listen on 127.0.0.1 only)"
            )
        elif "failed to start" in text.lower() or isinstance(e, TimeoutError):
            hint = f"the p2p daemon did not come up within startup_timeout={startup_timeout:g} s; raise it on slow machines"
        else:
            hint = "hivemind DHT failed to start"
        raise TransportError(f"{hint} ({type(e).__name__}: {text})") from e
    try:
        if transport == "libp2p":
            return dht, await _start_libp2p_rpc(dht, host_maddrs, announce_maddrs, identity_path, libp2p_port,
                                                startup_timeout, max_message_bytes)
        if transport == "tcp":
            return dht, await _start_tcp_rpc(dht, host_maddrs, announce_maddrs, tcp_port, secret, max_message_bytes)
        return dht, Transport(await dht.replicate_p2p(), max_message_bytes=max_message_bytes, owns_p2p=True)
    except BaseException:
        dht.shutdown()
        raise


async def dht_maddrs(dht: DHT) -> list[str]:
    """The DHT's visible multiaddrs: what other processes pass as ``initial_peers``."""
    return [str(m) for m in await asyncio.get_running_loop().run_in_executor(None, dht.get_visible_maddrs)]


def rpc_note(transport: Any) -> str:
    """The ready line's suffix naming a non-default RPC transport and its own addresses ("" for hivemind,
    whose RPC shares the DHT's peer id and addresses)."""
    if transport.kind == "hivemind":
        return ""
    return f" transport={transport.kind} rpc={','.join(transport.get_visible_maddrs())}"


async def stop_transport(dht: DHT, transport: Any) -> None:
    """Shut down a pair created by ``start_transport`` (handlers, P2P replica, DHT process and its p2pd)."""
    try:
        await transport.shutdown()
    finally:
        await asyncio.get_running_loop().run_in_executor(None, dht.shutdown)


async def announce(dht: DHT, key: str, subkey: Any, value: Any, ttl: float) -> bool:
    """Store ``value`` under ``key``/``subkey`` for ``ttl`` seconds; returns whether the store succeeded."""
    future = dht.store(key, value, expiration_time=get_dht_time() + ttl, subkey=subkey, return_future=True)
    return bool(await future)


async def heartbeat(dht: DHT, key: str, subkey: Any, value: Any, ttl: float, period: float | None = None) -> None:
    """Re-announce every ``period`` (default ttl/3) seconds until cancelled; failures are logged, not raised."""
    period = ttl / 3 if period is None else period
    while True:
        try:
            if not await announce(dht, key, subkey, value, ttl):
                logger.warning("heartbeat store for %s/%s was rejected", key, subkey)
        except Exception as e:
            logger.warning("heartbeat store for %s/%s failed: %r", key, subkey, e)
        await asyncio.sleep(period)


def _unpack_members(found: Any) -> dict:
    if found is None or not isinstance(found.value, dict):
        return {}
    now = get_dht_time()
    return {sub: item.value for sub, item in found.value.items() if item.expiration_time > now}


def live_members(dht: DHT, key: str) -> dict:
    """Blocking: ``{subkey: value}`` of the unexpired entries under ``key`` (empty if none)."""
    return _unpack_members(dht.get(key, latest=True))


async def live_members_async(dht: DHT, key: str) -> dict:
    """Non-blocking variant of ``live_members`` for use inside the event loop."""
    return _unpack_members(await dht.get(key, latest=True, return_future=True))
