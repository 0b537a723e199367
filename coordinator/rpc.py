"""The coordinator's end of the wire: its DHT and RPC transport, the requests of its run to peers, the peers'
heartbeats and the coordinator's own record in the DHT. Every other part of the coordinator calls peers through
this one."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from checkfree.auth import coordinator_proof, join_token, load_secret, record_ok
from checkfree.net.relay import RelayTransport, members_only
from checkfree.net.transport import (Handler, Transport, announce, live_members_async, sign_requests, start_transport,
                                     stop_transport)
from checkfree.messages import Adopt, Adopted, Ping, Request, reply_to, request
from checkfree.protocol import coordinator_key, coordinator_record, members_key
from coordinator.common import CALL_ERRORS, CoordinatorOptions, settle

__all__ = ["Rpc"]

R = TypeVar("R")

log = logging.getLogger("coordinator.coordinator")


class Rpc:
    """The coordinator's transport, once started (`start`)."""

    def __init__(self, opts: CoordinatorOptions) -> None:
        self.opts, self.timeouts = opts, opts.timeouts
        self.run_id = opts.run_id
        self.secret = load_secret(opts.secret_file)  # None: an open swarm
        self.dht: Any = None  # a hivemind DHT, or the memory network's stand-in
        self.transport: Transport | None = None
        self.reach: dict[str, dict] = {}  # peer -> what the probe at its join found (direct / relayed, rtt)

    async def start(self, refused: Callable[[str], None] | None = None) -> str:
        """Start the DHT and the transport; this coordinator's peer id. `refused` is told each peer whose request
        to the relay (a joining peer's reachability probe) carried no valid run token."""
        o = self.opts
        self.dht, self.transport = await start_transport(
            o.initial_peers, o.host_maddrs, o.announce_maddrs, o.identity_path, o.startup_timeout,
            transport=o.transport, libp2p_port=o.libp2p_port, tcp_port=o.tcp_port, secret=self.secret)
        self.transport = await RelayTransport(self.transport, serve_relay=o.relay, on_probe=self._on_probe,
                                              admit=members_only(self.secret, self.run_id, refused)).start()
        if self.transport.kind != "memory":
            self.transport.route(self.dht, self.run_id, self.secret)
        if self.secret is not None:  # lets a standby read the coordinator's STATUS
            sign_requests(self._wire(), {"token": join_token(self.secret, self.run_id, self.me)})
        return self.me


    def _on_probe(self, peer: str, request: dict, result: dict) -> None:
        """A joining peer's reachability: recorded (the dashboard shows it); one line when it is unreachable."""
        rtt = min(result["rtt_ms"].values(), default=None)
        relayed = not result["reachable"]
        self.reach[peer] = {"mode": "relayed" if relayed else "direct", "rtt_ms": rtt}
        if not relayed:
            return
        errors = "; ".join(f"{a}: {e}" for a, e in list(result["errors"].items())[:2]) or "no address to try"
        cause = f"peer {peer} is behind NAT or a firewall (could not connect to {errors})"
        if request.get("relay") is False:
            print(f"status: {cause} and it has relays off (--no-relay): it cannot take part", flush=True)
            self.reach[peer]["mode"] = "unreachable"
        elif not self.opts.relay:
            print(f"status: {cause} and this coordinator relays for no peer (--no-relay): it cannot take part",
                  flush=True)
            self.reach[peer]["mode"] = "unreachable"
        else:
            via = request.get("via")
            where = f"relay {via}" if isinstance(via, str) and via != self.me else "this coordinator's relay"
            print(f"status: {cause}: it is reached through {where}", flush=True)

    def _wire(self) -> Transport:
        assert self.transport is not None, "the coordinator's transport is not started"
        return self.transport

    def wrap(self, wrapper: Callable[[Transport], Transport]) -> None:
        """The transport from now on is `wrapper(transport)` (a fault injector's, faults/injector.py; never in
        production)."""
        self.transport = wrapper(self._wire())

    async def stop(self) -> None:
        await stop_transport(self.dht, self.transport)

    @property
    def me(self) -> str:
        return str(self._wire().peer_id)

    @property
    def kind(self) -> str:
        return self._wire().kind

    async def register(self, name: str, handler: Handler) -> None:
        await self._wire().register(name, handler)

    async def call(self, pid: str, message: Request[R], timeout: float,
                   tensors: Sequence[torch.Tensor] = ()) -> tuple[R, list[torch.Tensor]]:
        """`message` to peer `pid`, for this run: its reply as the reply type of its request (checkfree.messages:
        a `Request[R]` is answered with an `R`; a malformed one is a BadReply, a failed call) and tensors."""
        reply, out = await self._wire().call(pid, message.rpc, request(self.run_id, message), tensors,
                                             timeout=timeout)
        return reply_to(message, reply), out

    async def adopt(self, pid: str, timeout: float) -> Adopted:
        """ADOPT peer `pid`: this coordinator takes it over from one that is gone (with the proof of the run secret,
        if the run has one)."""
        proof = coordinator_proof(self.secret, self.run_id, self.me, pid) if self.secret is not None else None
        reply, _ = await self.call(pid, Adopt(proof=proof), timeout)
        return reply

    async def gather(self, pids: Sequence[str], message: Request[R],
                     timeout: float) -> list[tuple[R, list[torch.Tensor]] | Exception]:
        """`message` to every one of `pids` at once: each (reply, tensors), or the exception its call raised."""
        return await settle(self.call(p, message, timeout) for p in pids)

    async def alive(self, pid: str) -> bool:
        """Whether `pid` answers a ping (bounded by min(5 s, rpc_timeout))."""
        try:
            await self.call(pid, Ping(), timeout=min(5.0, self.timeouts.rpc_timeout))
            return True
        except CALL_ERRORS:
            return False

    async def heartbeats(self) -> dict[str, dict]:
        """Peers with a live DHT heartbeat (with a run secret: only records a member signed)."""
        found = await live_members_async(self.dht, members_key(self.run_id)) or {}
        return {p: v for p, v in found.items() if record_ok(self.secret, self.run_id, "member", p, v)}

    async def announce(self) -> None:
        """The coordinator's record in the DHT, refreshed every heartbeat_ttl until cancelled."""
        while True:
            try:
                await announce(self.dht, coordinator_key(self.run_id), "main",
                               coordinator_record(self.secret, self.run_id, self.me, self.kind,
                                                  ttl=self.timeouts.heartbeat_ttl * 3),
                               ttl=self.timeouts.heartbeat_ttl * 3)
            except Exception as e:
                log.warning("announcing the coordinator failed: %r", e)
            await asyncio.sleep(self.timeouts.heartbeat_ttl)
