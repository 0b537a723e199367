"""Peers behind NAT: a reachability probe and a request relay in front of any RPC transport.

A peer behind NAT (a home router, a cloud instance with a private address) can open connections but not accept
them: the coordinator reaches it over the connection it opened, but another peer that dials it fails. Two
pieces make such a peer a full member:

* **The probe** (`PROBE`, served by every relay, the coordinator by default). A joining peer sends the
  addresses it listens on; the relay opens a plain TCP connection to each (a fresh one: the libp2p connection
  the peer opened itself proves nothing) and answers which ones took it, and in how long. None: the peer is
  behind NAT or a firewall.
* **The relay** (`RELAY` / `RELAYED`). A peer that nobody can reach registers with a relay it can reach (`REGISTER`)
  and publishes a signed route record in the DHT (`route_key`: "reach me via R"). A caller that finds such a record
  sends the request to R, which forwards it to the peer over the connection the peer opened, and the reply back.
  The peer serves a relayed request as if it came from the original caller (the relay names it; the peer accepts
  that only from the relay it registered with), so every admission check (membership tokens, who may send what)
  runs unchanged against the original caller. A call from the relay itself goes direct.

Why not libp2p's own circuit relay (hivemind's ``use_relay`` / ``use_auto_relay``): measured with hivemind 1.1.12's
p2pd, a peer behind MASQUERADE NAT does get a relay reservation (with ``-relayDiscovery=0``; with hivemind's default
discovery mode none within 30 s), and a call through the circuit works, but every relayed libp2p connection is
reset after 128 KiB or 2 minutes: the daemon registers a second relay service with libp2p's default limits over the
one its ``-relayDataLimit`` / ``-relayTimeLimit`` flags configure. One activation of a small model is more than
that. No relayed connection was upgraded to a direct one by hole punching either (docs/deploy.md). This relay carries
requests at the application level instead, over connections the NAT'd peer opened, with no size or time limit.

Costs, stated: each relayed request crosses two links (caller -> relay -> peer) and the relay's own uplink twice;
`python -m benchmarks.nat` measures a relayed step against a direct one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import torch

from checkfree.auth import join_token, record_ok, sign_record, verify
from checkfree.net.base import Handler
from checkfree.net.errors import RemoteError, TransportError
from checkfree.net.heartbeats import announce, live_members_async
from checkfree.protocol import Kind, ProtocolError

__all__ = ["members_only", "PROBE", "REGISTER", "RELAY", "RELAYED", "ECHO", "ROUTE_TTL", "route_key", "RelayTransport",
           "probe_addresses", "Reachability", "unreachable_message"]

log = logging.getLogger("checkfree.net.transport")

PROBE = "checkfree.probe"  # {"addrs": [maddr]} -> {"reachable": [maddr], "rtt_ms": {maddr: ms}, "errors": {...}}
REGISTER = "checkfree.relay-register"  # a NAT'd peer asks to be reached through this relay
RELAY = "checkfree.relay"  # caller -> relay: {"to", "name", "header", "timeout"}
RELAYED = "checkfree.relayed"  # relay -> peer: {"from", "name", "header"}
ECHO = "checkfree.echo"  # the tensors back (`checkfree peer --check`: latency and bandwidth)
ROUTE_TTL = 30.0  # a route record's lifetime in the DHT (refreshed every third of it)
PROBE_CONNECT_S = 3.0  # a TCP connect to one probed address
ROUTE_CACHE_S = 10.0  # how long a caller trusts what it looked up (a route, or that there is none)


def route_key(run_id: str) -> str:
    """DHT key whose sub-keys (peer ids) say through which relay each relayed peer of the run is reached."""
    return f"checkfree/{run_id}/routes"


def members_only(secret: bytes | None, run_id: str,
                 refused: Callable[[str], None] | None = None) -> Callable[[dict, str], None] | None:
    """The admission of a relay's requests (a probe, a registration, a relayed call) in a run with a secret: only from
    a member of run `run_id`, by the membership token its requests carry; None (anyone) in an open run. `refused`
    (the coordinator's: its run records the refusal) is told the peer refused."""
    if secret is None:
        return None

    def admit(header: dict, peer: str) -> None:
        if not verify(join_token(secret, run_id, peer), header.get("token")):
            if refused is not None:
                refused(peer)
            raise ProtocolError(f"peer {peer} is not authorized: no membership token of run {run_id!r}",
                                Kind.UNAUTHORIZED)

    return admit


def unreachable_message(tried: Sequence[str], errors: dict, prober: str) -> str:
    """The one line for a peer that nobody can reach and that may not be relayed."""
    why = "; ".join(f"{a}: {e}" for a, e in list(errors.items())[:2]) or "no address to try"
    return (f"this peer cannot be reached: the coordinator {prober} could not connect to any of its addresses "
            f"({why}), so it is behind NAT or a firewall, and relays are off (--no-relay). Drop --no-relay to be "
            f"reached through the coordinator's relay, or forward a port and give --host-maddrs /ip4/0.0.0.0/tcp/PORT "
            f"--announce-maddrs /ip4/PUBLIC_IP/tcp/PORT")


def _tcp_target(maddr: str) -> tuple[str, int] | None:
    parts = maddr.strip("/").split("/")
    try:
        i = next(k for k, p in enumerate(parts) if p in ("ip4", "ip6"))
        if parts[i + 2] != "tcp":
            return None
        return parts[i + 1], int(parts[i + 3])
    except (StopIteration, IndexError, ValueError):
        return None


async def probe_addresses(addrs: Sequence[str], timeout: float = PROBE_CONNECT_S) -> dict:
    """Open (and close) a TCP connection to each address; which took it and how fast. Loopback addresses are tried
    only when there is nothing else to try (they name the prober's own machine otherwise)."""
    targets = {a: t for a in addrs if (t := _tcp_target(str(a))) is not None}
    outside = {a: t for a, t in targets.items() if not t[0].startswith("127.") and t[0] != "::1"}
    targets = outside or targets

    async def one(addr: str, host: str, port: int) -> tuple[str, float | None, str]:
        start = time.perf_counter()
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
        except (OSError, asyncio.TimeoutError) as e:
            return addr, None, (type(e).__name__ + (f" {e.strerror}" if getattr(e, "strerror", None) else
                                                    f" after {timeout:g} s" if isinstance(e, asyncio.TimeoutError)
                                                    else ""))
        rtt = (time.perf_counter() - start) * 1e3
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()
        return addr, rtt, ""

    results = await asyncio.gather(*(one(a, h, p) for a, (h, p) in targets.items()))
    return {"reachable": [a for a, rtt, _ in results if rtt is not None],
            "rtt_ms": {a: round(rtt, 3) for a, rtt, _ in results if rtt is not None},
            "errors": {a: err for a, rtt, err in results if rtt is None}, "tried": list(targets)}


class Reachability:
    """What a probe found for this process: reached directly, or through `via` (a relay's peer id)."""

    def __init__(self, direct: bool, via: str | None = None, probe: dict | None = None) -> None:
        self.direct, self.via, self.probe = direct, via, probe or {}

    @property
    def mode(self) -> str:
        return "direct" if self.direct else "relayed"


class RelayTransport:
    """Any `Transport`, plus the probe, the relay (when `serve_relay`) and relayed calls to peers that published a
    route in the DHT. Every process of a run wraps its transport in one (`checkfree.net.factory.start_transport`),
    so any caller reaches a relayed peer; `route(dht, run_id, secret)` turns route lookups on once the run is known.
    """

    def __init__(self, inner: Any, *, serve_relay: bool = True, on_probe: Callable[[str, dict, dict], None] | None = None,
                 admit: Callable[[dict, str], None] | None = None) -> None:
        self.inner = inner
        # raises for a PROBE, REGISTER or RELAY request from a stranger (e.g. without the run's membership token):
        # a relay is neither a port scanner nor a free proxy for anyone who can reach it
        self.admit = admit
        self.kind = inner.kind
        self.serve_relay = serve_relay
        self.on_probe = on_probe  # (caller, request header, result): a relay reports what it found
        self._handlers: dict[str, Handler] = {}
        self._clients: set[str] = set()  # peers registered with this relay
        self._relays: set[str] = set()  # the relays this process registered with (the only ones it takes RELAYED from)
        self._routes: dict[str, tuple[str | None, float]] = {}  # peer -> (relay or None, cached until)
        self._lookup: Callable[[str], Awaitable[str | None]] | None = None
        self._route_task: asyncio.Task | None = None
        self.relayed_calls = 0  # calls this process sent through a relay
        self.forwarded = 0  # requests this relay forwarded

    # --- the Transport interface ---------------------------------------------------------------------------
    @property
    def peer_id(self) -> Any:
        return self.inner.peer_id

    @property
    def extra_header(self) -> dict:
        return self.inner.extra_header

    @extra_header.setter
    def extra_header(self, value: dict) -> None:
        self.inner.extra_header = value

    def __getattr__(self, name: str) -> Any:  # transport-specific extras (maddrs, streams_opened, p2p, ...)
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    async def start(self) -> "RelayTransport":
        await self.inner.register(PROBE, self._on_probe)
        await self.inner.register(ECHO, self._on_echo)
        await self.inner.register(RELAYED, self._on_relayed)
        if self.serve_relay:
            await self.inner.register(REGISTER, self._on_register)
            await self.inner.register(RELAY, self._on_relay)
        return self

    async def register(self, name: str, handler: Handler) -> None:
        self._handlers[name] = handler
        await self.inner.register(name, handler)

    async def unregister(self, name: str) -> None:
        self._handlers.pop(name, None)
        await self.inner.unregister(name)

    async def call(self, peer_id: Any, name: str, header: dict, tensors: Sequence[torch.Tensor] = (), *,
                   timeout: float) -> tuple[dict, list[torch.Tensor]]:
        peer = str(peer_id)
        via = await self._route(peer)
        if via is None or via == str(self.peer_id):
            try:
                return await self.inner.call(peer_id, name, header, tensors, timeout=timeout)
            except RemoteError:
                raise
            except TransportError:
                self._routes.pop(peer, None)  # look again before the next call: it may have become relayed
                raise
        self.relayed_calls += 1
        request = {"to": peer, "name": name, "header": {**self.extra_header, **header}, "timeout": timeout}
        return await self.inner.call(via, RELAY, request, tensors, timeout=timeout)

    async def shutdown(self) -> None:
        if self._route_task is not None:
            self._route_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._route_task
        await self.inner.shutdown()

    # --- routes ---------------------------------------------------------------------------------------------
    def route(self, dht: Any, run_id: str, secret: bytes | None) -> None:
        """Look up relayed peers' routes in `dht` (records of run `run_id`, signed with `secret` if it has one)."""
        key = route_key(run_id)

        async def lookup(peer: str) -> str | None:
            found = await live_members_async(dht, key)
            value = found.get(peer)
            if not isinstance(value, dict) or not record_ok(secret, run_id, "route", peer, value) \
                    or not isinstance(value.get("via"), str):
                return None
            return value["via"]

        self._lookup = lookup

    async def _route(self, peer: str) -> str | None:
        if self._lookup is None:
            return None
        now = time.monotonic()
        cached = self._routes.get(peer)
        if cached is not None and cached[1] > now:
            return cached[0]
        try:
            via = await asyncio.wait_for(self._lookup(peer), 5.0)
        except Exception as e:  # noqa: BLE001 - a failed lookup: try direct, look again next time
            log.debug("route lookup for %s failed: %r", peer, e)
            return cached[0] if cached is not None else None
        self._routes[peer] = (via, now + ROUTE_CACHE_S)
        return via

    async def probe(self, prober: Any, addrs: Sequence[str], relay: bool, timeout: float, via: str | None = None
                    ) -> dict:
        """Ask `prober` (the coordinator) whether it can connect to `addrs`; `relay`: whether this peer will be
        reached through a relay if not, `via` which one if not the prober's (the prober reports it either way)."""
        reply, _ = await self.inner.call(prober, PROBE, {"addrs": list(addrs), "relay": relay, "via": via},
                                         timeout=timeout)
        return reply

    async def use_relay(self, relay: Any, dht: Any, run_id: str, secret: bytes | None, timeout: float,
                        follow: Callable[[], str | None] | None = None) -> None:
        """Register with `relay` and publish this peer's route (refreshed until shutdown): callers reach it there.
        `follow`: where the relay is now (the coordinator, after a failover); the route moves there with it."""
        await self.inner.call(relay, REGISTER, {}, timeout=timeout)
        self._relays.add(str(relay))
        me = str(self.peer_id)
        key = route_key(run_id)
        current = [str(relay)]

        async def publish() -> bool:
            value = sign_record(secret, run_id, "route", me, {"via": current[0]}, ROUTE_TTL)
            return await announce(dht, key, me, value, ROUTE_TTL)

        if not await publish():
            raise TransportError(f"could not publish this peer's route through relay {relay} in the DHT")

        async def refresh() -> None:
            while True:
                await asyncio.sleep(ROUTE_TTL / 3 * random.uniform(0.8, 1.0))
                moved = follow() if follow is not None else None
                with contextlib.suppress(Exception):
                    target = moved if moved and moved != current[0] else current[0]
                    await self.inner.call(target, REGISTER, {}, timeout=timeout)  # a restarted relay learns it again
                    if target != current[0]:
                        log.info("relay moved from %s to %s", current[0], target)
                        self._relays.add(target)
                        current[0] = target
                with contextlib.suppress(Exception):
                    if not await publish():
                        log.warning("refreshing this peer's relay route failed; retrying")

        self._route_task = asyncio.create_task(refresh())

    # --- handlers -------------------------------------------------------------------------------------------
    async def _on_probe(self, header: dict, tensors: list, peer: Any) -> tuple[dict, list]:
        if self.admit is not None:
            self.admit(header, str(peer))
        addrs = header.get("addrs")
        if not isinstance(addrs, list) or not all(isinstance(a, str) for a in addrs) or len(addrs) > 32:
            raise ValueError("probe: 'addrs' must be a list of at most 32 multiaddr strings")
        result = await probe_addresses(addrs)
        result["relay"] = self.serve_relay
        if self.on_probe is not None:
            self.on_probe(str(peer), header, result)
        return result, []

    async def _on_echo(self, header: dict, tensors: list, peer: Any) -> tuple[dict, list]:
        return {}, list(tensors)

    async def _on_register(self, header: dict, tensors: list, peer: Any) -> tuple[dict, list]:
        if self.admit is not None:
            self.admit(header, str(peer))
        self._clients.add(str(peer))
        return {"via": str(self.peer_id)}, []

    async def _on_relay(self, header: dict, tensors: list, peer: Any) -> tuple[dict, list]:
        to, name, inner, timeout = header.get("to"), header.get("name"), header.get("header"), header.get("timeout")
        if not (isinstance(to, str) and isinstance(name, str) and isinstance(inner, dict)
                and isinstance(timeout, (int, float)) and 0 < timeout <= 3600):
            raise ValueError("relay: 'to', 'name', 'header' and 'timeout' (0-3600 s) are required")
        if self.admit is not None:
            self.admit(header, str(peer))
        if to not in self._clients:
            raise TransportError(f"relay: peer {to} is not registered with this relay")
        self.forwarded += 1
        request = {"from": str(peer), "name": name, "header": inner}
        try:
            return await self.inner.call(to, RELAYED, request, tensors, timeout=timeout)
        except RemoteError as e:  # the peer's own error reply, passed back as it was
            return {"error": e.remote_message, "kind": e.kind, **({"detail": e.detail} if e.detail else {})}, []

    async def _on_relayed(self, header: dict, tensors: list, peer: Any) -> tuple[dict, list]:
        if str(peer) not in self._relays:
            raise TransportError(f"relayed request from {peer}, which is not a relay this peer registered with")
        source, name, inner = header.get("from"), header.get("name"), header.get("header")
        handler = self._handlers.get(name) if isinstance(name, str) else None
        if not isinstance(source, str) or not isinstance(inner, dict) or handler is None:
            raise ValueError(f"relayed request: unknown handler {name!r} or malformed header")
        reply, out = await handler(inner, tensors, source)
        return reply, list(out)
