"""Start and stop a process's networking: the hivemind DHT (membership, in its own process with its p2pd,
both tied to this process's life) and one RPC transport beside it, chosen by name (hivemind, libp2p, tcp);
the libp2p and tcp modules are imported only when chosen (and the in-process `memory` network of the fast
test tier)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

from hivemind.dht import DHT
from hivemind.p2p import PeerID
from hivemind.utils.multiaddr import Multiaddr

from checkfree.net import TRANSPORTS
from checkfree.net.addresses import listen_ips, publish_rpc_addrs
from checkfree.net.base import Transport
from checkfree.net.errors import TransportError
from checkfree.net.heartbeats import DHT_RPC_TIMEOUT
from checkfree.net.hivemind_transport import HivemindTransport
from checkfree.net.lifeline import (
    TiedDHT,
    quiet_fd_handoffs,
    socket_files,
    sweep_stale_mp_dirs,
    sweep_stale_sockets,
)
from checkfree.net.streams import quiet_disconnects
from checkfree.net.wire import DEFAULT_MAX_MESSAGE_BYTES

__all__ = ["check_transport", "start_transport", "stop_transport", "rpc_note"]

logger = logging.getLogger("checkfree.net.transport")


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


def check_transport(kind: str) -> None:
    """``TransportError`` for an unknown transport name, or for ``libp2p`` when py-libp2p cannot be imported."""
    if kind not in TRANSPORTS:
        raise TransportError(f"unknown transport {kind!r}; choose one of {', '.join(TRANSPORTS)}")
    if kind == "libp2p":
        from checkfree.net.libp2p_transport import LIBP2P_IMPORT_ERROR

        if LIBP2P_IMPORT_ERROR is not None:
            raise TransportError(f"--transport libp2p needs py-libp2p, which cannot be imported "
                                 f"({LIBP2P_IMPORT_ERROR}): pip install 'checkfree[libp2p]'")


async def _start_libp2p_rpc(dht: DHT, host_maddrs: Sequence[str], announce_maddrs: Sequence[str] | None,
                            identity_path: str | None, port: int, startup_timeout: float,
                            max_message_bytes: int) -> Any:
    """A ``Libp2pTransport`` beside the DHT: listens on the IPs of ``host_maddrs`` at TCP ``port`` (0: any),
    publishes its multiaddrs in the DHT (the IPs of ``announce_maddrs`` if given, at the bound port) and
    looks up the addresses of peers it calls there. With ``identity_path``, its key is kept in
    ``<identity_path>.libp2p`` (a stable peer id across restarts)."""
    from checkfree.net.libp2p_transport import identity_key_pair, start_libp2p_transport

    listen = [f"/{proto}/{ip}/tcp/{port}" for proto, ip in listen_ips(host_maddrs)] or [f"/ip4/127.0.0.1/tcp/{port}"]
    key_pair = identity_key_pair(f"{identity_path}.libp2p") if identity_path else None
    t = await start_libp2p_transport(listen, max_message_bytes=max_message_bytes, startup_timeout=startup_timeout,
                                     key_pair=key_pair)
    return await publish_rpc_addrs(dht, t, announce_maddrs)


async def _start_tcp_rpc(dht: DHT, host_maddrs: Sequence[str], announce_maddrs: Sequence[str] | None, port: int,
                         secret: bytes | None, max_message_bytes: int) -> Any:
    """A ``TcpTransport`` beside the DHT, under the DHT's own peer id: listens on the IPs of ``host_maddrs`` at
    TCP ``port`` (0: any) and publishes/looks up addresses in the DHT like ``_start_libp2p_rpc``."""
    from checkfree.net.tcp_transport import start_tcp_transport

    peer_id = str(await asyncio.get_running_loop().run_in_executor(None, lambda: dht.peer_id))
    hosts = [ip for _, ip in listen_ips(host_maddrs)] or ["127.0.0.1"]
    t = await start_tcp_transport(peer_id, hosts, port, secret=secret, max_message_bytes=max_message_bytes)
    return await publish_rpc_addrs(dht, t, announce_maddrs)


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
) -> tuple[DHT, Transport]:
    """Start a hivemind DHT (own process and p2pd) and an RPC transport: ``hivemind`` (a ``Transport`` on the
    DHT's P2P daemon), ``libp2p`` (a ``Libp2pTransport``, py-libp2p in a trio thread, listening on
    ``libp2p_port``; its peer id is a different one than the DHT's, kept in ``<identity_path>.libp2p`` when
    ``identity_path`` is given, and the DHT carries its addresses) or ``tcp`` (a ``TcpTransport``: direct,
    unencrypted TCP on ``tcp_port`` under the DHT's peer id, its connections authenticated with the run
    ``secret`` when there is one; the DHT carries its addresses). ``memory``: the in-process test tier's network
    (``checkfree.net.in_memory``), no DHT process.

    Fails within ~``startup_timeout`` (+ DHT bootstrap time) with an actionable ``TransportError`` when the
    daemon does not start or no initial peer can be reached. Stop with ``await stop_transport(dht, t)``.
    """
    if transport == "memory":  # the in-process test tier (checkfree.net.in_memory): one Python process only
        from checkfree.net.in_memory import MEMORY, MemoryDHT, MemoryTransport

        t = MemoryTransport(MEMORY)
        return MemoryDHT(MEMORY, t.peer_id), MEMORY.attach(t)
    check_transport(transport)
    peers = _check_initial_peers(initial_peers)
    sweep_stale_sockets()
    sweep_stale_mp_dirs()
    before = socket_files()
    quiet_disconnects(asyncio.get_running_loop())
    quiet_fd_handoffs()
    dht = TiedDHT(  # dies with this process, and takes its p2pd along (lifeline.py)
        initial_peers=peers or None,
        start=False,
        host_maddrs=list(host_maddrs),
        announce_maddrs=list(announce_maddrs) if announce_maddrs else None,
        identity_path=identity_path,
        startup_timeout=startup_timeout,
        **{"wait_timeout": DHT_RPC_TIMEOUT, **dht_kwargs},
    )
    dht.run_in_background(await_ready=False)
    deadline = startup_timeout + 30.0  # p2pd start + DHT bootstrap pings (hivemind's own wait_timeout)
    started = time.monotonic()
    try:
        await asyncio.get_running_loop().run_in_executor(None, dht.wait_until_ready, deadline)
    except Exception as e:
        dht.shutdown()
        await _remove_own_sockets(before)
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
        return dht, HivemindTransport(await dht.replicate_p2p(), max_message_bytes=max_message_bytes, owns_p2p=True)
    except BaseException:
        dht.shutdown()
        raise


async def _remove_own_sockets(before: set[str], wait_s: float = 3.0) -> None:
    """After a failed start: remove the socket files this start created that nothing listens on any more (a p2pd
    stopped before it could clean up after itself), waiting up to `wait_s` for a daemon still shutting down.
    Files of other processes that started meanwhile are left alone: they listen (or are younger than 1 s)."""
    deadline = time.monotonic() + wait_s
    while True:
        new = socket_files() - before
        if new:
            sweep_stale_sockets(min_age_s=1.0, among=new)
        if not socket_files() - before or time.monotonic() > deadline:
            return
        await asyncio.sleep(0.25)


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

