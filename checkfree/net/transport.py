"""The networking API in one import: start a process's DHT and RPC transport, call and serve, keep
membership. The implementation lives in small modules of this package:

- `base`: the `Transport` protocol that the three RPC transports implement, and `Handler`;
- `errors`: `TransportError`, `TransportTimeout`, `RemoteError`, and `failed_request` (a server's error reply);
- `streams`: length-prefixed request/reply framing over asyncio streams, the idle-stream pool;
- `hivemind_transport` (default), `libp2p_transport`, `tcp_transport`: the three transports;
- `membership`: DHT sub-keys with an expiry (`announce`, `heartbeat`, `live_members`);
- `addresses`: the libp2p and tcp transports' RPC addresses, published in and looked up from the DHT;
- `factory`: `start_transport` / `stop_transport` (the DHT in its own process, tied to this one, plus one
  transport chosen by name), `check_transport`;
- `wire` (the message format), `lifeline` (children that die with their parent), `auth` (in checkfree).
"""

from __future__ import annotations

from checkfree.net import TRANSPORTS
from checkfree.net.addresses import learn_addresses, rpc_addrs_key
from checkfree.net.base import Handler, Transport
from checkfree.net.errors import (
    REFUSALS,
    RefusalLog,
    RemoteError,
    TransportError,
    TransportTimeout,
    failed_request,
)
from checkfree.net.factory import (
    check_transport,
    rpc_note,
    start_transport,
    stop_transport,
)
from checkfree.net.hivemind_transport import HivemindTransport
from checkfree.net.heartbeats import (
    announce,
    dht_maddrs,
    heartbeat,
    live_members,
    live_members_async,
)
from checkfree.net.streams import StreamPool, stream_pool_default


def sign_requests(transport: Transport, header: dict) -> None:
    """Merge `header` into every request `transport` sends from now on (e.g. the run's membership token)."""
    transport.extra_header = dict(header)


__all__ = [
    "TRANSPORTS", "Handler", "Transport", "HivemindTransport", "RemoteError", "TransportError", "TransportTimeout",
    "RefusalLog", "REFUSALS", "failed_request", "StreamPool", "stream_pool_default", "check_transport",
    "start_transport", "stop_transport", "rpc_note", "announce", "heartbeat", "live_members", "live_members_async",
    "dht_maddrs", "learn_addresses", "rpc_addrs_key", "sign_requests",
]
