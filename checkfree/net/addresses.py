"""Where to reach a peer's RPC when it is not hivemind's (libp2p, tcp): each process publishes its RPC
multiaddrs in the DHT under ``rpc_addrs_key(peer_id)`` (refreshed by a heartbeat) and looks a peer's up there
before its first call."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Sequence
from typing import Any

from hivemind.dht import DHT
from hivemind.utils.multiaddr import Multiaddr

from checkfree.net.errors import TransportError
from checkfree.net.heartbeats import announce, heartbeat, live_members_async

__all__ = ["RPC_ADDRS_TTL", "RPC_ADDRS_ATTEMPTS", "rpc_addrs_key", "listen_ips", "announced_maddrs",
           "publish_rpc_addrs", "learn_addresses", "announce_rpc_addrs"]

logger = logging.getLogger("checkfree.net.transport")

RPC_ADDRS_TTL = 60.0  # libp2p, tcp: lifetime of a process's address record in the DHT (refreshed every ttl/3)

RPC_ADDRS_ATTEMPTS = 3  # libp2p, tcp: stores of that record tried at start-up before giving up



def rpc_addrs_key(peer_id: str) -> str:
    """DHT key under which a libp2p- or tcp-transport process publishes its RPC multiaddrs."""
    return f"checkfree/rpc-addrs/{peer_id}"


def listen_ips(maddrs: Sequence[str]) -> list[tuple[str, str]]:
    """The distinct (ip4|ip6, address) pairs of ``maddrs``, in order."""
    found = []
    for m in maddrs:
        for proto in ("ip4", "ip6"):
            with contextlib.suppress(Exception):
                found.append((proto, Multiaddr(str(m))[proto]))
    return list(dict.fromkeys(found))


def announced_maddrs(bound: Sequence[str], announce_maddrs: Sequence[str] | None, peer_id: str) -> list[str]:
    """What an RPC listener publishes: the IPs of ``announce_maddrs`` (if given) at its bound TCP port, else
    its own ``bound`` multiaddrs (with a warning if those name a wildcard address nobody else can dial)."""
    if announce_maddrs:
        port = Multiaddr(bound[0])["tcp"]
        return [f"/{proto}/{ip}/tcp/{port}/p2p/{peer_id}" for proto, ip in listen_ips(announce_maddrs)]
    if any(ip in ("0.0.0.0", "::") for _, ip in listen_ips(bound)):
        logger.warning("the RPC transport listens on all interfaces but announces %s: remote peers cannot dial "
                       "that; give --announce-maddrs with this machine's public address", list(bound))
    return list(bound)


async def publish_rpc_addrs(dht: DHT, t: Any, announce_maddrs: Sequence[str] | None) -> Any:
    """Publish ``t``'s addresses (see ``announced_maddrs``) under ``rpc_addrs_key(t.peer_id)`` (refreshed by a
    task in ``t.tasks``), set ``t.address_resolver`` to look other peers' addresses up there; returns ``t``,
    or shuts it down and raises."""
    try:
        t.maddrs = announced_maddrs(t.maddrs, announce_maddrs, t.peer_id)
        await announce_rpc_addrs(dht, t)
    except BaseException:
        await t.shutdown()
        raise
    return t


async def learn_addresses(t: Any, peer: str) -> None:
    """Ask ``t.address_resolver`` (the DHT lookup set by ``publish_rpc_addrs``) for ``peer``'s addresses and
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


async def announce_rpc_addrs(dht: DHT, t: Any) -> None:
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

