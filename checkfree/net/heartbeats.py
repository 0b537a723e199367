"""Membership in the hivemind DHT: sub-keys stored with an expiry and refreshed by a heartbeat, so an entry
disappears ~ttl seconds after its owner stops refreshing it; and the DHT's own addresses."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from hivemind.dht import DHT
from hivemind.utils import get_dht_time

__all__ = ["announce", "heartbeat", "live_members", "live_members_async", "dht_maddrs", "DHT_RPC_TIMEOUT",
           "heartbeat_stall"]

logger = logging.getLogger("checkfree.net.transport")

DHT_RPC_TIMEOUT = 3.0  # a DHT node's wait for one Kademlia RPC (hivemind's default, set by checkfree.net.factory)
# A store (a heartbeat) stalls while the DHT still routes to a node that died: its searches and the store each wait
# out the dead node's RPC once. Measured here: 9 s, with the dead node's packets dropped (its network namespace
# deleted, as a vanished machine's are). Meanwhile the peer's entry expires, and a reader does not see the peer.
HEARTBEAT_STALL = 3 * DHT_RPC_TIMEOUT


def heartbeat_stall(dht: Any) -> float:
    """How long the heartbeats in `dht` may be missing after a DHT node died (0 for a DHT with no routing)."""
    return getattr(dht, "heartbeat_stall", HEARTBEAT_STALL)


async def dht_maddrs(dht: DHT) -> list[str]:
    """The DHT's visible multiaddrs: what other processes pass as ``initial_peers``."""
    return [str(m) for m in await asyncio.get_running_loop().run_in_executor(None, dht.get_visible_maddrs)]


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

