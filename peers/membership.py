"""A peer's membership of a run: its network handles, and the coordinator it answers to.

Finding the coordinator in the DHT and joining (the reply is the run's config), the DHT
heartbeat that announces the peer while it lives, the watch that gives up on a coordinator
silent for too long, the graceful leave, and `admit`: the one check every request to this
peer passes (peers.checks), with the coordinator and secret it needs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol, TypeVar

import torch

from hivemind.utils.multiaddr import Multiaddr

from checkfree.auth import (
    coordinator_proof,
    join_token,
    load_secret,
    sign_record,
    verify,
)
from checkfree.config import RunConfig, config_from_dict
from checkfree.net.transport import (
    RemoteError,
    Transport,
    TransportError,
    TransportTimeout,
    announce,
    live_members_async,
    sign_requests,
    start_transport,
)
from checkfree.protocol import (
    HEARTBEATS_PER_TTL,
    Kind,
    Timeouts,
    coordinator_from_records,
    coordinator_key,
    members_key,
)
from checkfree.net.relay import ECHO, Reachability, RelayTransport, members_only, unreachable_message
from checkfree.net.transport import dht_maddrs
from checkfree.messages import Join, Leave, Message, Request, Status, reply_to, request, to_wire
from checkfree.strategies.state import state_nbytes
from checkfree.wan import WanEmulator
from peers.checks import admit
from peers.stage import HostedStage

__all__ = ["Handler", "Served", "Membership", "PeerUnreachable"]

R = TypeVar("R")

log = logging.getLogger(__name__)

class PeerOptions(Protocol):
    """What membership reads of the daemon's options (peers.daemon.PeerOptions) beyond the transport's start."""

    relay: bool  # may be reached through a relay when nobody can connect to it
    relay_via: list[str]  # relays named by the user (multiaddrs), else the coordinator's
    serve_relay: bool  # relays for peers behind NAT


Handler = Callable[[dict, list, Any], Awaitable[tuple[dict, list]]]  # what the transport serves
Served = Callable[[Any, list, Any], Awaitable[tuple[Message, list]]]  # a part's handler: typed request and reply


class PeerUnreachable(TransportError):
    """Nobody can reach this peer and it may not be relayed: one line, the cause and the flag that fixes it."""


class Membership:
    """This peer in the run's swarm: transport, DHT, run secret, and who its coordinator is."""

    def __init__(self, run_id: str, timeouts: Timeouts, secret_file: str | None, hosted: HostedStage,
                 stop: asyncio.Event) -> None:
        self.run_id, self.timeouts, self.hosted, self.stop = run_id, timeouts, hosted, stop
        self.secret = load_secret(secret_file)  # None: an open swarm
        self.transport: Transport | None = None
        self.dht = None
        self.coordinator: str | None = None
        self.adopter: str | None = None  # the coordinator that last ADOPTed this peer (failover), if any
        self.last_contact = time.monotonic()  # the newest sign of life from the coordinator
        self.run_finished = False  # the coordinator said the run ended
        self.wan: WanEmulator | None = None  # the run's emulated network (train.wan), once joined
        self.opts: PeerOptions | None = None  # the daemon's options, once started
        self.relay: RelayTransport | None = None  # the transport, wrapped for relays (the probe, relayed calls)
        self.reach: Reachability | None = None  # how the coordinator reaches this peer (probed before joining)

    async def start(self, opts) -> None:
        """This peer's DHT and transport (`opts`: the daemon's PeerOptions); with a run secret every request it
        makes carries its membership token."""
        self.opts = opts
        self.dht, transport = await start_transport(
            [*opts.initial_peers, *opts.relay_via], opts.host_maddrs, opts.announce_maddrs, opts.identity_path,
            opts.startup_timeout, transport=opts.transport, libp2p_port=opts.libp2p_port,
            tcp_port=opts.tcp_port, secret=self.secret)
        self.transport = self.relay = await RelayTransport(transport, serve_relay=opts.serve_relay,
                                                           admit=members_only(self.secret, self.run_id)).start()
        if self.relay.kind != "memory":
            self.relay.route(self.dht, self.run_id, self.secret)
        if self.secret is not None:
            sign_requests(self.transport, {"token": self.token()})


    def emulate(self, wan: WanEmulator) -> None:
        """The run's emulated network: calls between stages are held back as its links would."""
        self.wan = wan

    def finish(self) -> None:
        """The coordinator said the run ended."""
        self.run_finished = True

    def adopted_by(self, coordinator: str) -> None:
        """A new coordinator took this peer over (a sign of its life too). A peer still joining joins it
        rather than the coordinator the DHT names, whose record can outlive it."""
        self.coordinator = self.adopter = coordinator
        self.heard_from_coordinator()

    def wire(self) -> Transport:
        """This peer's transport (once started)."""
        assert self.transport is not None, "the peer's transport is not started"
        return self.transport

    def relays(self) -> tuple[RelayTransport, PeerOptions]:
        """This peer's relaying transport and its options (once started)."""
        assert self.relay is not None and self.opts is not None, "the peer's transport is not started"
        return self.relay, self.opts

    @property
    def me(self) -> str:
        return str(self.wire().peer_id)

    def token(self) -> str | None:
        """This peer's membership token (None in an open swarm)."""
        return join_token(self.secret, self.run_id, self.me) if self.secret is not None else None

    def admitted(self, name: str, handler: Served) -> Handler:
        """`handler` behind the one admission check of RPC `name` (peers.checks.admit): it gets the typed
        request, and its typed reply goes on the wire. A request from the coordinator is a sign of its life."""

        async def admitted(header: dict, tensors: list, peer) -> tuple[dict, list]:
            if self.coordinator is not None and str(peer) == self.coordinator:
                self.heard_from_coordinator()
            message = admit(name, header, str(peer), run_id=self.run_id, secret=self.secret,
                            coordinator=self.coordinator, me=self.me)
            reply, out = await handler(message, tensors, peer)
            return to_wire(reply), out

        return admitted

    async def call(self, peer: str, message: Request[R], timeout: float, tensors: Sequence[torch.Tensor] = (), *,
                   link: tuple[int, int] | None = None) -> tuple[R, list[torch.Tensor]]:
        """`message` to `peer`, for this run; its reply as the reply type of its request (checkfree.messages: a
        `Request[R]` is answered with an `R`; a malformed one is a BadReply, a failed call). `link`: (this end's
        stage, the peer's stage) of a transfer between stages, held back by the run's emulated network if it has one
        (checkfree.wan), the request on the way there and the reply on the way back."""
        name, header, transport, wan = message.rpc, request(self.run_id, message), self.wire(), self.wan
        if wan is None or link is None:
            reply, out = await transport.call(peer, name, header, tensors, timeout=timeout)
            return reply_to(message, reply), out

        async def shaped() -> tuple[R, list[torch.Tensor]]:
            await wan.carry(link[0], link[1], state_nbytes(tensors))
            reply, out = await transport.call(peer, name, header, tensors, timeout=timeout)
            await wan.carry(link[1], link[0], state_nbytes(out))
            return reply_to(message, reply), out

        try:  # the emulated links' time counts against the timeout, as a real WAN's would
            return await asyncio.wait_for(shaped(), timeout)
        except TimeoutError:
            raise TransportTimeout(f"{name} to {peer} over the emulated {wan.name} link {link[0]} -> {link[1]} "
                                   f"took over {timeout:g} s") from None

    def allowance(self, src: int, dst: int, nbytes: float) -> float:
        """Seconds to add to a call's timeout for `nbytes` crossing the link `src` -> `dst` of the run's emulated
        network (twice what the link needs: a timeout a slow link cannot trip by accident); 0 on loopback. A
        transfer's timeout is the RPC timeout plus this (a 100M-parameter stage's weights over a 0.01 GiB/s link
        take ~37 s, more than the 30 s RPC timeout)."""
        if self.wan is None:
            return 0.0
        latency, bandwidth = self.wan.link(src, dst)
        return 2 * (latency + nbytes / bandwidth)

    def heard_from_coordinator(self) -> None:
        self.last_contact = time.monotonic()

    # ---- joining -----------------------------------------------------------------------
    async def join(self) -> RunConfig | None:
        """Find the coordinator and join; the run's config, or None if told to stop first."""
        me = self.me
        join = Join(peer_id=me)  # (with a run secret its token travels in every request's envelope: `start`)
        deadline = time.monotonic() + self.timeouts.join_timeout
        while True:
            found = None if self.stop.is_set() else self.adopter or await self._find_coordinator()
            if found is None:  # stopped (SIGTERM/SIGINT) before a coordinator was found
                return None
            # a new coordinator that ADOPTed this peer while it looked is the one it answers to
            target = self.coordinator = self.adopter or found
            try:
                if self.reach is None:
                    self.reach = await self.reachability(target)
                joined, _ = await self.call(target, join, self.timeouts.rpc_timeout)
                break
            except PeerUnreachable:  # nothing a retry changes
                raise
            except (TimeoutError, TransportError, OSError, RemoteError) as e:
                # the DHT may still name a coordinator that died (its record outlives it by up to
                # 3 heartbeat TTLs), or a new one may still be taking over: look again
                retry = not isinstance(e, RemoteError) or e.kind == Kind.TAKING_OVER
                if not retry or time.monotonic() > deadline:
                    raise
                log.info("joining coordinator %s failed (%s); looking for the coordinator again", target, e)
                self.coordinator = self.adopter  # None, unless a new coordinator ADOPTed this peer meanwhile
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.stop.wait(), 1.0)
        if self.secret is not None and not verify(
                coordinator_proof(self.secret, self.run_id, target, me), joined.proof):
            raise TransportError(f"the coordinator {target} found in the DHT failed authentication: "
                                 "it does not hold this run's secret")
        return config_from_dict(json.loads(joined.config))

    async def own_addresses(self) -> list[str]:
        """The addresses others would dial to reach this peer's RPC: the DHT's (hivemind), else the RPC listener's."""
        relay, _ = self.relays()
        if relay.kind == "hivemind":
            return [a for a in await dht_maddrs(self.dht) if "p2p-circuit" not in a]
        return list(getattr(relay.inner, "maddrs", []))

    async def reachability(self, coordinator: str) -> Reachability:
        """How the coordinator reaches this peer (`reachability_probe`); not directly: register with the relay (the
        coordinator, or --relay-via) and publish the route there, so that every caller sends its requests through it."""
        reach = await self.reachability_probe(coordinator)
        if not reach.direct:
            relay, opts = self.relays()
            follow = (lambda: self.coordinator) if not opts.relay_via else None  # (a new coordinator relays)
            await relay.use_relay(reach.via, self.dht, self.run_id, self.secret, self.timeouts.rpc_timeout, follow)
            print(f"peer: the coordinator could not connect to this peer (behind NAT or a firewall): reached through "
                  f"the relay {reach.via} (--no-relay to refuse)", flush=True)
        return reach

    async def check(self, rounds: int = 3, nbytes: int = 4 << 20) -> int:
        """`checkfree peer --check`: find the coordinator, say how it reaches this peer, and the latency and
        bandwidth between them (echoes of a small and a `nbytes` message, best of `rounds`). 0: this peer can take
        part; 2: it cannot (the line says why)."""
        import torch

        coordinator = await self._find_coordinator()
        if coordinator is None:
            return 130
        try:
            reach = await self.reachability_probe(coordinator)
        except PeerUnreachable as e:
            print(f"check: {e}", flush=True)
            return 2
        timeout, wire = self.timeouts.rpc_timeout, self.wire()
        small, big = [], []
        payload = torch.zeros(nbytes // 4, dtype=torch.float32)
        for _ in range(rounds):
            start = time.perf_counter()
            await wire.call(coordinator, ECHO, {}, [], timeout=timeout)
            small.append(time.perf_counter() - start)
            start = time.perf_counter()
            await wire.call(coordinator, ECHO, {}, [payload], timeout=timeout)
            big.append(time.perf_counter() - start)
        rtt, bw = min(small), 2 * nbytes / max(min(big) - min(small), 1e-9) / 2**20
        how = ("directly" if reach.direct else
               f"only through a relay ({reach.via}): others reach this peer through it (behind NAT or a firewall)")
        connect = min(reach.probe.get("rtt_ms", {}).values(), default=None)
        print(f"check: coordinator {coordinator} reaches this peer {how}", flush=True)
        print(f"check: latency {rtt * 1e3:.1f} ms round trip (a small request)"
              + (f", {connect:.1f} ms for the coordinator's TCP connect to this peer" if connect is not None else ""),
              flush=True)
        print(f"check: bandwidth {bw:.1f} MiB/s ({nbytes / 2**20:g} MiB each way, best of {rounds})", flush=True)
        return 0

    async def reachability_probe(self, coordinator: str) -> Reachability:
        """Ask the coordinator to connect to this peer's addresses. Reached: direct. Not reached: through a relay
        (the coordinator, or --relay-via), or, with relays off or a transport that cannot be relayed, a
        `PeerUnreachable` whose one line names the cause and the flag that fixes it."""
        if self.wire().kind == "memory":  # the in-process tier: one address space
            return Reachability(True)
        relay, opts = self.relays()
        relays = [str(Multiaddr(m)["p2p"]) for m in opts.relay_via]
        allowed = opts.relay and relay.kind == "hivemind"
        addrs = await self.own_addresses()
        probe = await relay.probe(coordinator, addrs, allowed, self.timeouts.rpc_timeout,
                                           via=relays[0] if relays and allowed else None)
        if probe.get("reachable"):
            return Reachability(True, probe=probe)
        cause = (f"this peer cannot be reached: the coordinator {coordinator} could not connect to any of its "
                 f"addresses ({', '.join(probe.get('tried', addrs)) or 'none'}), so it is behind NAT or a firewall")
        if not opts.relay:
            raise PeerUnreachable(unreachable_message(probe.get("tried", addrs), probe.get("errors", {}), coordinator))
        if relay.kind != "hivemind":
            raise PeerUnreachable(f"{cause}, and only --transport hivemind can be relayed (this peer uses "
                                  f"--transport {relay.kind}). Use --transport hivemind, or forward the port "
                                  f"and give --announce-maddrs")
        if not relays and probe.get("relay") is False:
            raise PeerUnreachable(f"{cause}, and the coordinator relays for no peer (it was started with --no-relay). "
                                  f"Give --relay-via with a public peer started with --serve-relay, or forward a "
                                  f"port and give --announce-maddrs")
        return Reachability(False, relays[0] if relays else coordinator, probe)

    async def _find_coordinator(self) -> str | None:
        """The coordinator's peer id; None if this peer is told to stop while it looks."""
        key = coordinator_key(self.run_id)
        start = time.monotonic()
        deadline, note = start + self.timeouts.join_timeout, start + 30.0
        while time.monotonic() < deadline and not self.stop.is_set():
            if self.adopter is not None:  # a new coordinator ADOPTed this peer while it looked
                return self.adopter
            if time.monotonic() > note:  # waiting is visible, never silent
                print(f"peer: still looking for the coordinator of run {self.run_id!r} "
                      f"({time.monotonic() - start:.0f} s of --join-timeout {self.timeouts.join_timeout:g})", flush=True)
                note += 30.0
            try:
                found = await self._unless_stopped(live_members_async(self.dht, key)) or {}
            except (ConnectionError, OSError, EOFError) as e:
                # a signal to the whole process group can end the DHT process a moment before our
                # own handler sets `stop`: give the signal a second to arrive before retrying
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.stop.wait(), 1.0)
                log.debug("DHT lookup of the coordinator failed: %r", e)
                found = {}
            # a record signed with our secret first; else any (its JOIN reply must still prove the
            # secret, and a peer with the wrong secret then hears why it is refused)
            coordinator = coordinator_from_records(found, self.secret, self.run_id, self.wire().kind,
                                                   unsigned_ok=True)
            if coordinator is not None:
                return coordinator
            await asyncio.sleep(0.2)
        if self.stop.is_set():
            return None
        raise TransportError(f"no coordinator for run {self.run_id!r} found in the DHT within "
                             f"join_timeout={self.timeouts.join_timeout:g} s: is `checkfree scheduler --run-id "
                             f"{self.run_id}` running and reachable from --initial-peers?")

    async def _unless_stopped(self, coro: Awaitable[Any]) -> Any:
        """Await `coro`, or give up (None) once this peer is told to stop: a signal to the whole
        process group also ends the DHT process, whose replies would then never come."""
        task, stop = asyncio.ensure_future(coro), asyncio.ensure_future(self.stop.wait())
        try:
            await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if not task.done():
            task.cancel()
            return None
        return task.result()

    # ---- staying a member ----------------------------------------------------------------
    async def heartbeat(self) -> None:
        """Refresh this peer's membership entry every ttl / HEARTBEATS_PER_TTL (jittered), and at once when its stage
        or state changes (a new coordinator taking over reads a stage from it), until cancelled."""
        key, me = members_key(self.run_id), self.me
        while True:
            try:
                value = {"stage": self.hosted.index, "state": self.hosted.state.value}
                await announce(self.dht, key, me, sign_record(self.secret, self.run_id, "member", me, value,
                                                              self.timeouts.heartbeat_ttl),
                               self.timeouts.heartbeat_ttl)
            except Exception as e:  # noqa: BLE001 - a missed beat is survivable; the next one retries
                log.warning("heartbeat failed: %r", e)
            await self.hosted.changes(self.timeouts.heartbeat_ttl / HEARTBEATS_PER_TTL * random.uniform(0.8, 1.0))

    async def watch_coordinator(self, limit: float) -> bool:
        """Return True once no coordinator has been heard from for `limit` seconds (False once the
        run has finished): asked nothing for a heartbeat TTL, the peer asks the coordinator for its
        STATUS; a new coordinator taking over ADOPTs this peer (a contact too). Without this, the
        peers of a run whose coordinator died would wait (and bill) forever."""
        while not self.run_finished:
            await asyncio.sleep(min(self.timeouts.heartbeat_ttl, limit / 4))
            if self.coordinator is not None and time.monotonic() - self.last_contact > self.timeouts.heartbeat_ttl:
                try:
                    await self.call(self.coordinator, Status(), min(5.0, self.timeouts.rpc_timeout))
                    self.heard_from_coordinator()
                except RemoteError:  # it answers, if only with an error (e.g. taking over): alive
                    self.heard_from_coordinator()
                except (TimeoutError, TransportError, OSError) as e:
                    log.debug("coordinator %s did not answer: %r", self.coordinator, e)
            silent = time.monotonic() - self.last_contact
            if silent > limit:
                print(f"peer: no coordinator of run {self.run_id!r} has answered for {silent:.0f} s "
                      f"(--coordinator-timeout {limit:g}); leaving", flush=True)
                return True
        return False

    async def leave(self, deadline: float, *, tell_coordinator: bool = True) -> None:
        """Graceful leave (SIGTERM, e.g. a spot preemption notice): tell the coordinator; if it
        has a replacement ready, keep serving until our exact state has been handed over (the
        coordinator then sends SHUTDOWN, which sets `stop`) or `deadline` seconds pass.
        tell_coordinator=False: the coordinator itself asked this peer to go."""
        self.hosted.leave()
        if self.coordinator is None or not tell_coordinator:
            return
        try:
            left, _ = await self.call(self.coordinator, Leave(peer_id=self.me), min(5.0, self.timeouts.rpc_timeout))
        except (TransportError, RemoteError) as e:
            log.info("could not announce leave to the coordinator: %s", e)
            return
        if left.handover and self.hosted.worker is not None:
            log.info("handing stage %d over before leaving (deadline %.0f s)", self.hosted.index, deadline)
            self.stop.clear()
            try:
                await asyncio.wait_for(self.stop.wait(), deadline)
            except TimeoutError:
                log.warning("no handover within %.0f s; leaving anyway", deadline)
