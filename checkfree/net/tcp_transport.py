"""The ``Transport`` request/response interface over direct TCP connections (``--transport tcp``).

For trusted networks only (one VPC or LAN, like torch.distributed's Gloo): **no encryption**. Anyone who
can see the traffic can read activations and weights, and anyone on the path can alter them. Use the
default ``--transport hivemind`` (TLS/noise via p2pd, NAT traversal) on the open internet.

Same async API (the ``checkfree.net.base.Transport`` protocol), wire format and error semantics as ``HivemindTransport``: ``peer_id``
(a string: the process's hivemind DHT peer id when started by ``start_transport``), ``register``,
``unregister``, ``call(peer_id, name, header, tensors, *, timeout)``, ``extra_header``, ``shutdown``;
``RemoteError`` / ``TransportTimeout`` / ``TransportError`` from a call, ``WireError`` locally for
tensors or headers that cannot be encoded. Messages are read and written by the same helpers
(``read_message``, ``write_frames``), so a declared length above ``max_message_bytes`` is refused before
anything is allocated.

Connections. A caller dials ``host:port`` of the peer (its ``/ip4/HOST/tcp/PORT/p2p/<id>`` multiaddr,
looked up through ``address_resolver`` before the first call), runs the handshake below and then sends
requests one at a time: each request is a one-byte protocol-name length, the name (UTF-8), then one
wire message; the reply is one wire message. After a successful call the connection goes back to a
per-peer pool of idle connections for the next call to that peer, whatever its protocol (concurrent
calls open more connections, at most ``POOL_MAX_IDLE_PER_PEER`` idle ones are kept, each for
``pool_idle`` seconds). A failed, refused or timed-out call closes its connection, and no call is ever
retried: a request is delivered at most once. A server answers any failure while reading, decoding or
handling a request with ``{"error": "<ExceptionType>: <message>"}``, then stops reading that connection
(its framing may be lost) and closes it once the caller has closed or ``linger_timeout`` has passed;
other connections are not affected. TCP_NODELAY is set on both ends.

The connection handshake (each side proves the run secret over fresh nonces): ``checkfree.net.tcp_handshake``.

Measured on a loaded 2-core VM (``python -m benchmarks.transport --no-libp2p``, three runs, load average
8.5-10.3; echo of one float32 tensor, all paths interleaved; MiB/s, run 1 / 2 / 3):

    | payload MiB | tcp transport | raw TCP socket | tcp / raw | hivemind transport |
    |---|---|---|---|---|
    | 1 | 702 / 1102 / 1055 | 1134 / 1589 / 1196 | 0.62 / 0.69 / 0.88 | 191 / 334 / 317 |
    | 4 | 1215 / 1422 / 1351 | 531 / 913 / 664 | 2.29 / 1.56 / 2.04 | 320 / 331 / 346 |
    | 16 | 447 / 470 / 1223 | 378 / 244 / 480 | 1.18 / 1.93 / 2.55 | 303 / 248 / 343 |
    | 64 | 384 / 318 / 244 | 115 / 131 / 83 | 3.33 / 2.42 / 2.92 | 284 / 271 / 290 |

(ratios above 1: the raw baseline's ``readexactly`` is slow at large payloads, see the README.) End to
end, ``checkfree local --preset small --steps 15 --eval-every 0 --seed 0 --transport hivemind|tcp``, four
alternating pairs at load 6-10: median step 0.294 s (hivemind) vs 0.252 s (tcp), per pair x0.76-0.97;
``--preset tiny --seed 3``, four pairs at load 7-12: 0.218 s vs 0.171 s, per pair x0.68-1.03; losses equal
to float round-off.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence

import torch

from checkfree.net.base import Handler
from checkfree.net.errors import (
    REFUSALS,
    RemoteError,
    TransportError,
    TransportTimeout,
    failed_request,
    warn_once,
)
from checkfree.net.framed import FramedReader, adopt
from checkfree.net.streams import (
    Stream,
    StreamPool,
    discard_until_eof,
    dispatch,
    exchange,
    read_message,
    reply_within,
    write_frames,
)
from checkfree.net.tcp_handshake import HANDSHAKE_MAX_BYTES, HandshakeError, accept_handshake, dial_handshake
from checkfree.net.wire import DEFAULT_MAX_MESSAGE_BYTES, WireError, encode_message

__all__ = ["HANDSHAKE_MAX_BYTES", "HandshakeError", "RemoteError", "TcpTransport", "TransportError", "TransportTimeout",
           "parse_tcp_maddr", "start_tcp_transport"]

logger = logging.getLogger(__name__)

UNAUTHENTICATED = ("--transport tcp without a run secret: peer ids are NOT authenticated and anyone who can reach "
                   "port(s) of this process can call it; nothing is encrypted either way (use it on trusted networks "
                   "only)")

READER_LIMIT = 4 << 20  # the StreamReader's buffer until `adopt` takes the connection over (before any byte)
POOL_IDLE_SECONDS = 30.0  # a caller drops a pooled connection idle for longer (servers wait 2x)
POOL_MAX_IDLE_PER_PEER = 8


def parse_tcp_maddr(maddr: str) -> tuple[str, int, str | None]:
    """``/ip4|ip6|dns|dns4|dns6/HOST/tcp/PORT[/p2p/ID]`` -> (host, port, id or None); ``TransportError`` otherwise."""
    parts = str(maddr).split("/")
    ok = len(parts) in (5, 7) and parts[0] == "" and parts[1] in ("ip4", "ip6", "dns", "dns4", "dns6") \
        and parts[3] == "tcp" and parts[4].isdigit() and (len(parts) == 5 or (parts[5] == "p2p" and parts[6]))
    if not ok:
        raise TransportError(f"not a TCP multiaddr: {maddr!r} (expected /ip4/HOST/tcp/PORT/p2p/<peer id>)")
    return parts[2], int(parts[4]), parts[6] if len(parts) == 7 else None


def _nodelay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class TcpTransport:
    """Request/response RPC over direct TCP connections; see the module docstring for the protocol.

    ``secret``: the run secret (both sides must hold the same one, or both none). ``read_timeout`` bounds
    the wait for a request's body, ``handshake_timeout`` a new connection's handshake, ``idle_timeout``
    how long a server keeps a connection with no request, ``linger_timeout`` how long it keeps one open
    after an error reply, waiting for the caller to close.
    """

    kind = "tcp"  # the --transport name

    def __init__(
        self,
        peer_id: str,
        *,
        secret: bytes | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        read_timeout: float = 120.0,
        handshake_timeout: float = 10.0,
        linger_timeout: float = 10.0,
        idle_timeout: float = 2 * POOL_IDLE_SECONDS,
        pool_idle: float = POOL_IDLE_SECONDS,
        warn_unauthenticated: bool = True,
    ) -> None:
        if not peer_id or "/" in peer_id or len(peer_id.encode()) > 256:
            raise TransportError(f"invalid peer id {peer_id!r}")
        self._peer_id = peer_id
        self.secret = secret
        self.max_message_bytes = max_message_bytes
        self.read_timeout = read_timeout
        self.handshake_timeout = handshake_timeout
        self.linger_timeout = linger_timeout
        self.idle_timeout = idle_timeout
        self.pool_idle = pool_idle
        # (false where the process that starts this one warned for it: reft's snapshot companion)
        self._warn_unauthenticated = warn_unauthenticated
        self._handlers: dict[str, Handler] = {}
        self._addresses: dict[str, list[tuple[str, int]]] = {}
        self._pool = StreamPool(pool_idle, POOL_MAX_IDLE_PER_PEER)  # idle connections by peer id
        self._servers: list[asyncio.Server] = []
        self._serving: dict[asyncio.StreamWriter, asyncio.Task] = {}  # server side: closed/cancelled at shutdown
        self.maddrs: list[str] = []
        self.extra_header: dict = {}  # merged into every request (e.g. the run membership token)
        # asked for the addresses of a peer whose address is unknown (e.g. a DHT lookup)
        self.address_resolver: Callable[[str], Awaitable[Sequence[str]]] | None = None
        self.tasks: set[asyncio.Task] = set()  # live as long as the transport (cancelled at shutdown)
        self.connections_opened = 0  # connections this caller opened (a call on a pooled one opens none)

    @property
    def peer_id(self) -> str:
        return self._peer_id

    # ------------------------------------------------------------ lifecycle

    async def start(self, hosts: Sequence[str] = ("127.0.0.1",), port: int = 0) -> None:
        """Listen on ``hosts`` at TCP ``port`` (0: a free port, the same one for every host)."""
        if self.secret is None and self._warn_unauthenticated:
            warn_once(logger, UNAUTHENTICATED)
        try:
            for host in hosts:
                server = await asyncio.start_server(self._on_connection, host, port, limit=READER_LIMIT)
                self._servers.append(server)
                port = server.sockets[0].getsockname()[1]
                kind = "ip6" if ":" in host else "ip4"
                self.maddrs.append(f"/{kind}/{host}/tcp/{port}/p2p/{self._peer_id}")
        except OSError as e:
            await self.shutdown()
            raise TransportError(f"tcp transport cannot listen on {list(hosts)} port {port}: {e}") from e

    async def shutdown(self) -> None:
        """Stop listening, close pooled and served connections, cancel ``tasks``."""
        for task in self.tasks:
            task.cancel()
        self.close_idle_streams()
        for server in self._servers:
            server.close()
        for writer, task in list(self._serving.items()):
            writer.close()
            task.cancel()
        for server in self._servers:
            await server.wait_closed()
        self._servers.clear()
        self._handlers.clear()

    def get_visible_maddrs(self) -> list[str]:
        """``/ip4/HOST/tcp/PORT/p2p/<peer id>`` for each listening address (or as set for announcing)."""
        return list(self.maddrs)

    def add_peer_address(self, maddr: str, peer_id: str | None = None) -> str:
        """Remember an address of a peer (a multiaddr with ``/p2p/<id>``, or without it plus ``peer_id``)."""
        host, port, embedded = parse_tcp_maddr(maddr)
        if embedded is not None and peer_id is not None and embedded != str(peer_id):
            raise TransportError(f"multiaddr {maddr} names peer {embedded}, not {peer_id}")
        peer = embedded or (str(peer_id) if peer_id else None)
        if not peer:
            raise TransportError(f"multiaddr {maddr!r} has no /p2p/<peer id> and no peer_id was given")
        known = self._addresses.setdefault(peer, [])
        if (host, port) not in known:
            known.append((host, port))
        return peer

    # ------------------------------------------------------------ server side

    async def register(self, name: str, handler: Handler) -> None:
        """Serve ``handler`` under protocol ``name`` (names of at most 255 UTF-8 bytes)."""
        if not 0 < len(name.encode()) < 256:
            raise ValueError(f"protocol name {name!r} must be 1-255 UTF-8 bytes")
        self._handlers[name] = handler

    async def unregister(self, name: str) -> None:
        self._handlers.pop(name, None)

    async def _on_connection(self, stream_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        reader = adopt(stream_reader, writer)
        _nodelay(writer)
        self._serving[writer] = asyncio.current_task()  # type: ignore[assignment]
        where = writer.get_extra_info("peername")
        try:
            try:
                peer = await asyncio.wait_for(self._accept(reader, writer), self.handshake_timeout)
            except (HandshakeError, WireError, asyncio.TimeoutError) as e:
                text = str(e) or f"no handshake within handshake_timeout={self.handshake_timeout:g} s"
                REFUSALS.warn("tcp: refused connection from %s: %s: %s", where, type(e).__name__, text)
                await self._reply_error(reader, writer, f"{type(e).__name__}: handshake refused: {text}")
                return
            await self._serve(peer, reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError) as e:
            logger.debug("tcp: connection from %s broke: %r", where, e)
        except asyncio.CancelledError:  # shutdown; raising it out of this task makes asyncio log an error
            logger.debug("tcp: connection from %s closed at shutdown", where)
        finally:
            self._serving.pop(writer, None)
            writer.close()

    async def _accept(self, reader: FramedReader, writer: asyncio.StreamWriter) -> str:
        """Server half of the handshake; returns the caller's (proven, with a secret) peer id."""
        return await accept_handshake(reader, writer, self._peer_id, self.secret)

    async def _reply_error(self, reader: FramedReader, writer: asyncio.StreamWriter, reply: str | dict) -> None:
        """Answer an error reply (``{"error": text[, "kind": ...]}``) and wait (bounded) for the caller to close,
        so that the reply is not lost to a reset caused by unread request bytes."""
        with contextlib.suppress(ConnectionError):
            await write_frames(writer, encode_message(reply if isinstance(reply, dict) else {"error": reply}))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(discard_until_eof(reader), self.linger_timeout)

    async def _serve(self, peer: str, reader: FramedReader, writer: asyncio.StreamWriter) -> None:
        """Answer requests on one connection until the caller closes it, it idles for ``idle_timeout`` or a
        request fails (then an error reply, and the connection is closed)."""
        while True:
            try:
                size = await asyncio.wait_for(reader.read(1), self.idle_timeout)
            except asyncio.TimeoutError:
                return
            if not size:
                return  # the caller closed the connection between requests
            name = "?"
            try:
                try:
                    name_bytes, (header, tensors) = await asyncio.wait_for(
                        self._read_request(reader, size[0]), self.read_timeout)
                except asyncio.TimeoutError:
                    raise asyncio.TimeoutError(f"no complete request within read_timeout={self.read_timeout:g} s") from None
                name = name_bytes.decode("utf-8", errors="replace")
                frames = await dispatch(self._handlers, name, header, tensors, peer)
            except (asyncio.IncompleteReadError, ConnectionError) as e:
                logger.debug("tcp %s: peer %s closed the connection mid-request: %r", name, peer, e)
                return
            except Exception as e:  # decoding, handler and reply-encoding errors all go back to the caller
                text = failed_request(e, f"tcp {name}", peer, (asyncio.TimeoutError, WireError, TransportError))
                await self._reply_error(reader, writer, text)
                return
            await write_frames(writer, frames)

    async def _read_request(self, reader: FramedReader,
                            size: int) -> tuple[bytes, tuple[dict, list[torch.Tensor]]]:
        """The rest of a request whose first byte (``size``, the protocol name's length) was read."""
        name = await reader.readexactly(size) if size else b""
        return name, await read_message(reader, self.max_message_bytes)

    # ------------------------------------------------------------ client side

    async def call(
        self,
        peer_id: object,
        name: str,
        header: dict,
        tensors: Sequence[torch.Tensor] = (),
        *,
        timeout: float,
    ) -> tuple[dict, list[torch.Tensor]]:
        """Send one request to ``name`` on ``peer_id`` and return its reply ``(header, tensors)``.

        ``peer_id``: a peer id whose address is known or can be resolved, or a full multiaddr
        ``/ip4/HOST/tcp/PORT/p2p/<id>``. Raises ``RemoteError`` if the remote side answered with an error,
        ``TransportTimeout`` after ``timeout`` seconds, ``TransportError`` for unreachable peers, failed
        handshakes, broken connections or invalid replies, and ``WireError`` (locally, before sending) for
        tensors/headers that cannot be encoded.
        """
        peer = str(peer_id)
        if peer.startswith("/"):
            peer = self.add_peer_address(peer)
        if self.extra_header:
            header = {**self.extra_header, **header}
        name_bytes = name.encode()
        if not 0 < len(name_bytes) < 256:
            raise ValueError(f"protocol name {name!r} must be 1-255 UTF-8 bytes")
        frames = [bytes([len(name_bytes)]) + name_bytes, *encode_message(header, tensors)]
        return await reply_within(self._call(peer, name, frames), timeout, peer, name)

    async def _call(self, peer: str, name: str, frames: list) -> tuple[dict, list[torch.Tensor]]:
        conn = self._pool.take(peer) or await self._open(peer)
        return await exchange(conn, frames, self.max_message_bytes, f"peer {peer}", f"the connection for '{name}'",
                               self._pool, peer)

    async def _addresses_of(self, peer: str) -> list[tuple[str, int]]:
        """Known addresses of ``peer``, else what ``address_resolver`` finds (remembered)."""
        if not self._addresses.get(peer) and self.address_resolver is not None:
            # (imported here: it imports hivemind's DHT, ~1 s of CPU that a process resolving no address, such as
            # reft's snapshot companion, one per peer, does not pay)
            from checkfree.net.addresses import learn_addresses

            await learn_addresses(self, peer)
        return list(self._addresses.get(peer, ()))

    async def _open(self, peer: str) -> Stream:
        """A new connection to ``peer``, handshake done: tries its addresses in order."""
        addrs = await self._addresses_of(peer)
        if not addrs:
            raise TransportError(f"no known address of peer {peer} (not published in the DHT, or call it by "
                                 f"its full multiaddr /ip4/HOST/tcp/PORT/p2p/<id>)")
        errors = []
        for host, port in addrs:
            try:
                stream_reader, writer = await asyncio.open_connection(host, port, limit=READER_LIMIT)
            except OSError as e:
                errors.append(f"{host}:{port}: {e}")
                continue
            reader = adopt(stream_reader, writer)
            _nodelay(writer)
            try:
                await self._handshake(peer, reader, writer)
            except BaseException as e:
                writer.close()
                if isinstance(e, HandshakeError):
                    self._forget(peer)
                raise
            self.connections_opened += 1
            return reader, writer
        self._forget(peer)
        raise TransportError(f"cannot connect to peer {peer}: {'; '.join(errors)}")

    def _forget(self, peer: str) -> None:
        """After a failed connection: look the address up again next time (moved, or a bad record)."""
        if self.address_resolver is not None:
            self._addresses.pop(peer, None)

    async def _handshake(self, peer: str, reader: FramedReader, writer: asyncio.StreamWriter) -> None:
        """Caller half of the handshake; ``HandshakeError`` if it fails."""
        await dial_handshake(reader, writer, self._peer_id, peer, self.secret)

    def close_idle_streams(self) -> None:
        """Close every pooled connection (the next calls open new ones)."""
        self._pool.close_all()


async def start_tcp_transport(peer_id: str, hosts: Sequence[str] = ("127.0.0.1",), port: int = 0,
                              **kwargs: object) -> TcpTransport:
    """A started ``TcpTransport`` (keyword arguments go to its constructor)."""
    transport = TcpTransport(peer_id, **kwargs)  # type: ignore[arg-type]
    await transport.start(hosts, port)
    return transport
