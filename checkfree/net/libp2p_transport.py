"""The ``Transport`` request/response interface on py-libp2p (pure Python, no p2pd daemon).

Selectable alternative to ``checkfree.net.hivemind_transport.HivemindTransport`` (hivemind's go-libp2p daemon). Same
async API, same wire format, same error semantics:

- ``peer_id`` (base58 string), ``await register(name, handler)``, ``await unregister(name)``,
  ``await call(peer_id, name, header, tensors, *, timeout) -> (header, tensors)``, ``await shutdown()``;
- one call = one yamux stream on protocol ``/checkfree/<name>/1.0.0``: the caller writes one
  ``checkfree.net.wire`` message (8-byte length prefix, read with ``body_length`` then ``decode_body``),
  the server answers with one message and both sides half-close (yamux has a real FIN, so no linger
  trick is needed for the reply to arrive);
- ``call`` raises the same ``RemoteError`` / ``TransportTimeout`` / ``TransportError`` classes as ``Transport``
  (imported from there), and ``WireError`` locally for tensors or headers that cannot be encoded.

This module holds the lifecycle (start, the host in the trio thread, shutdown) and the calling side; the parts
it is composed of (each an object it builds, the owner of its state):

- serving (``register``, error replies, where handlers run): `checkfree.net.libp2p_server`;
- addresses and fixed ports (the ways to make a peer reachable): `checkfree.net.libp2p_addresses`;
- the trio thread and the asyncio <-> trio bridge: `checkfree.net.libp2p_bridge`;
- imports of py-libp2p: `checkfree.net.libp2p_support` (it lets hivemind and py-libp2p share one process).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import torch

from checkfree.net.base import Handler
from checkfree.net.errors import (
    RemoteError,
    TransportError,
    TransportTimeout,
    remote_error,
)
from checkfree.net.libp2p_addresses import Libp2pAddressBook
from checkfree.net.libp2p_bridge import TrioThread, error_text
from checkfree.net.libp2p_server import Libp2pServer
from checkfree.net.libp2p_support import (
    ID,
    LIBP2P_IMPORT_ERROR,
    NOISE_PROTOCOL_ID,
    IncompleteRead,
    NoiseTransport,
    create_new_x25519_key_pair,
    generate_new_ed25519_identity,
    identity_key_pair,
    multiaddr,
    new_host,
    protocol_id,
    t_close,
    t_read_body,
    t_reset,
    t_write_frames,
    trio,
)
from checkfree.net.wire import (
    DEFAULT_MAX_MESSAGE_BYTES,
    WireError,
    decode_body,
    encode_message,
)

__all__ = [
    "LIBP2P_IMPORT_ERROR",
    "Libp2pTransport",
    "RemoteError",
    "TransportError",
    "TransportTimeout",
    "identity_key_pair",
    "protocol_id",
    "start_libp2p_transport",
]

logger = logging.getLogger(__name__)

DEFAULT_LISTEN_MADDRS = ("/ip4/127.0.0.1/tcp/0",)


class Libp2pTransport:
    """Request/response RPC over a py-libp2p host (TCP + noise + yamux) running in its own trio thread.

    Create with ``await start_libp2p_transport(...)``; stop with ``await t.shutdown()``.
    ``max_message_bytes`` caps requests and replies; ``read_timeout`` bounds how long the server waits
    for a (possibly stalled) request body; ``linger_timeout`` bounds how long it drains a stream after
    replying, waiting for the caller to close.

    Composed of three parts, each built here with what it needs and the owner of its state: ``trio_thread`` (the
    `TrioThread`: the thread, the trio token, the nursery jobs run in), ``server`` (the `Libp2pServer`: the
    handlers and the incoming streams) and ``addresses`` (the `Libp2pAddressBook`: the peers' addresses and the
    resolver). The transport owns the host (started in the trio thread and handed to the server and the address
    book) and the calling side.
    """

    kind = "libp2p"  # the --transport name

    def __init__(
        self,
        listen_maddrs: Sequence[str] = DEFAULT_LISTEN_MADDRS,
        *,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        read_timeout: float = 120.0,
        linger_timeout: float = 10.0,
        shutdown_timeout: float = 10.0,
        key_pair: Any = None,
    ) -> None:
        if LIBP2P_IMPORT_ERROR is not None:
            raise TransportError(
                f"py-libp2p is not available ({LIBP2P_IMPORT_ERROR}); install it with pip install 'checkfree[libp2p]'"
            ) from LIBP2P_IMPORT_ERROR
        self.listen_maddrs = [multiaddr.Multiaddr(str(m)) for m in listen_maddrs]
        self.max_message_bytes = max_message_bytes
        self.shutdown_timeout = shutdown_timeout
        self._key_pair = key_pair if key_pair is not None else generate_new_ed25519_identity()
        self._peer_id = ID.from_pubkey(self._key_pair.public_key).to_base58()
        self.trio_thread = TrioThread(f"libp2p-trio-{self._peer_id[-6:]}", shutdown_timeout)
        self.server = Libp2pServer(self.trio_thread, max_message_bytes=max_message_bytes, read_timeout=read_timeout,
                                   linger_timeout=linger_timeout)
        self.addresses = Libp2pAddressBook(self.trio_thread)
        self._host: Any = None  # the libp2p host, in the trio thread
        self.maddrs: list[str] = []
        self.extra_header: dict = {}  # merged into every request (e.g. the run membership token)
        self.tasks: set[asyncio.Task] = set()  # asyncio tasks that live as long as the transport (cancelled at shutdown)

    # ------------------------------------------------------------ lifecycle

    async def start(self, startup_timeout: float = 15.0) -> None:
        """Start the trio thread and the libp2p host; fill ``self.maddrs``. Raises ``TransportError``."""
        if self.trio_thread.started:
            raise TransportError("libp2p transport already started")
        ready: concurrent.futures.Future = concurrent.futures.Future()
        self.trio_thread.start(self._t_main, ready)
        try:
            self.maddrs = await asyncio.wait_for(asyncio.wrap_future(ready), startup_timeout)
        except Exception as e:
            await self.trio_thread.stop()
            if isinstance(e, asyncio.TimeoutError):
                raise TransportError(
                    f"libp2p host did not start within startup_timeout={startup_timeout:g} s"
                ) from None
            raise TransportError(
                f"libp2p host failed to listen on {[str(m) for m in self.listen_maddrs]}: {error_text(e)}"
            ) from e

    async def _t_main(self, ready: concurrent.futures.Future) -> None:
        noise = NoiseTransport(self._key_pair, noise_privkey=create_new_x25519_key_pair().private_key)
        host = new_host(
            key_pair=self._key_pair,
            sec_opt={NOISE_PROTOCOL_ID: noise},
            muxer_preference="YAMUX",
            listen_addrs=self.listen_maddrs,
        )
        async with host.run(listen_addrs=self.listen_maddrs):
            self._host = host
            self.server.attach(host)
            self.addresses.attach(host)

            def up() -> None:
                if not host.get_transport_addrs():
                    raise TransportError(
                        "no listener came up (address already in use, or not an address of this machine? "
                        "libp2p logged the reason)"
                    )
                ready.set_result([str(m) for m in host.get_addrs()])

            await self.trio_thread.serve(up)
            with trio.move_on_after(self.shutdown_timeout / 2) as scope:
                scope.shield = True
                await host.close()

    async def shutdown(self) -> None:
        """Unregister all handlers, close all connections and stop the trio thread (idempotent)."""
        if self.trio_thread.closed:
            return
        for task in self.tasks:
            task.cancel()
        for name in self.server.names():
            try:
                await self.server.unregister(name)
            except Exception as e:
                logger.debug("unregister %s failed: %r", name, e)
        await self.trio_thread.stop()

    # ------------------------------------------------------------ the parts' services

    async def register(self, name: str, handler: Handler) -> None:
        """Serve ``handler`` under protocol ``/checkfree/<name>/1.0.0`` (`Libp2pServer.register`)."""
        await self.server.register(name, handler)

    async def unregister(self, name: str) -> None:
        await self.server.unregister(name)

    def add_peer_address(self, maddr: str, peer_id: str | None = None) -> str:
        """Remember an address of a peer; returns its peer id (`Libp2pAddressBook.add_peer_address`)."""
        return self.addresses.add_peer_address(maddr, peer_id)

    async def connect(self, maddr: str, *, timeout: float = 30.0) -> str:
        """Dial a peer at a full multiaddr now (and remember its address); returns its peer id."""
        return await self.addresses.connect(maddr, timeout=timeout)

    @property
    def address_resolver(self) -> Callable[[str], Awaitable[Sequence[str]]] | None:
        """Asked for the addresses of a peer called by bare id when none are known (e.g. a DHT lookup)."""
        return self.addresses.address_resolver

    @address_resolver.setter
    def address_resolver(self, resolver: Callable[[str], Awaitable[Sequence[str]]] | None) -> None:
        self.addresses.use_resolver(resolver)

    @property
    def read_timeout(self) -> float:
        return self.server.read_timeout

    @property
    def linger_timeout(self) -> float:
        return self.server.linger_timeout

    @property
    def peer_id(self) -> str:
        return self._peer_id

    def get_visible_maddrs(self) -> list[str]:
        """Full listen multiaddrs of this transport, ``/ip4/.../tcp/PORT/p2p/<peer id>``, for others to dial."""
        return list(self.maddrs)

    # ------------------------------------------------------------ client side

    async def call(
        self,
        peer_id: Any,
        name: str,
        header: dict,
        tensors: Sequence[torch.Tensor] = (),
        *,
        timeout: float,
    ) -> tuple[dict, list[torch.Tensor]]:
        """Send one request to ``name`` on ``peer_id`` and return its reply ``(header, tensors)``.

        ``peer_id``: a base58 peer id whose address is known (see the module docstring) or a full
        multiaddr ``/ip4/.../tcp/PORT/p2p/<id>``. Raises ``RemoteError`` if the remote side answered with an
        error, ``TransportTimeout`` after ``timeout`` seconds, ``TransportError`` for unreachable peers,
        unknown protocols, broken streams or invalid replies, and ``WireError`` (locally, before sending)
        for tensors/headers that cannot be encoded.
        """
        peer, addrs = self.addresses.target(peer_id)
        if self.extra_header:
            header = {**self.extra_header, **header}
        frames = encode_message(header, tensors)

        async def exchange() -> memoryview:
            known = await self.addresses.resolve(peer, addrs)
            return await self.trio_thread.submit(self._t_call, peer, known, name, frames)

        try:
            body = await asyncio.wait_for(exchange(), timeout)
        except asyncio.TimeoutError:
            raise TransportTimeout(f"call '{name}' to peer {peer} timed out after {timeout:g} s") from None
        except TransportError:
            if self.address_resolver is not None:  # look the address up again next time (moved, or a bad record)
                self.addresses.forget(peer)
            raise
        try:
            reply_header, reply_tensors = decode_body(body)
        except WireError as e:
            raise TransportError(f"invalid reply from peer {peer} for '{name}': {e}") from e
        if "error" in reply_header:
            raise remote_error(peer, name, reply_header)
        return reply_header, reply_tensors

    async def _t_open(self, peer: str, addrs: Sequence[str], name: str) -> Any:
        pid = self.addresses.t_remember(peer, addrs)
        try:
            return await self._host.new_stream(pid, [protocol_id(name)])
        except Exception as e:
            text = error_text(e)
            if "protocols not supported" in text or "protocol not supported" in text:
                raise TransportError(
                    f"peer {peer} does not serve '{name}' (protocols not supported: {protocol_id(name)}): {text}"
                ) from e
            if "No known addresses" in text:
                text += (
                    " -- its address is unknown: call it by full multiaddr (/ip4/.../tcp/PORT/p2p/<id>), "
                    "or add_peer_address()/connect() it first"
                )
            raise TransportError(f"cannot open stream '{name}' to peer {peer}: {text}") from e

    async def _t_call(self, peer: str, addrs: Sequence[str], name: str, frames: list) -> memoryview:
        stream = await self._t_open(peer, addrs, name)
        try:
            await t_write_frames(stream, frames)
            body = await t_read_body(stream, self.max_message_bytes)
        except BaseException as e:
            await t_reset(stream)
            if isinstance(e, IncompleteRead):
                raise TransportError(f"peer {peer} closed stream '{name}' before a full reply ({e})") from e
            if isinstance(e, WireError):
                raise TransportError(f"invalid reply from peer {peer} for '{name}': {e}") from e
            if isinstance(e, Exception) and not isinstance(e, TransportError):
                raise TransportError(f"stream '{name}' to peer {peer} failed: {error_text(e)}") from e
            raise
        await t_close(stream)
        return body

    # ------------------------------------------------------------ raw access (tests, benchmarks)

    async def raw_exchange(self, peer_id: Any, name: str, data: bytes, *, timeout: float) -> memoryview:
        """Write raw ``data`` on a new stream to ``name`` and return the body of the one reply message."""
        peer, addrs = self.addresses.target(peer_id)

        async def run() -> memoryview:
            stream = await self._t_open(peer, addrs, name)
            try:
                await stream.write(data)
                return await t_read_body(stream, self.max_message_bytes)
            finally:
                await t_close(stream)

        try:
            return await asyncio.wait_for(self.trio_thread.submit(run), timeout)
        except asyncio.TimeoutError:
            raise TransportTimeout(f"raw exchange with {peer} timed out after {timeout:g} s") from None


async def start_libp2p_transport(
    listen_maddrs: Sequence[str] = DEFAULT_LISTEN_MADDRS,
    initial_peers: Sequence[str] = (),
    *,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    startup_timeout: float = 15.0,
    connect_timeout: float = 30.0,
    **kwargs: Any,
) -> Libp2pTransport:
    """Start a ``Libp2pTransport`` listening on ``listen_maddrs`` (default loopback TCP, port 0).

    ``initial_peers`` are full multiaddrs (with ``/p2p/<id>``) dialed right away; any of them failing
    raises ``TransportError`` (after shutting the new transport down). Other keyword arguments go to
    ``Libp2pTransport`` (``read_timeout``, ``linger_timeout``, ``shutdown_timeout``, ``key_pair``).
    """
    transport = Libp2pTransport(listen_maddrs, max_message_bytes=max_message_bytes, **kwargs)
    await transport.start(startup_timeout)
    try:
        for maddr in initial_peers:
            await transport.connect(str(maddr), timeout=connect_timeout)
    except BaseException:
        await transport.shutdown()
        raise
    return transport
