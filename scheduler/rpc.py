"""The coordinator's end of the wire: its DHT and RPC transport, the requests of its run to peers, and the
peers' heartbeats. Every other part of the coordinator calls peers through this one."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from checkfree.auth import join_token, load_secret, record_ok
from checkfree.net.transport import live_members_async, sign_requests, start_transport, stop_transport
from checkfree.protocol import RPC, members_key, request
from scheduler.common import CALL_ERRORS, CoordinatorOptions

__all__ = ["Rpc"]


class Rpc:
    """The coordinator's transport, once started (`start`)."""

    def __init__(self, opts: CoordinatorOptions) -> None:
        self.opts, self.t = opts, opts.timeouts
        self.run_id = opts.run_id
        self.secret = load_secret(opts.secret_file)  # None: an open swarm
        self.dht = None
        self.transport = None

    async def start(self) -> str:
        """Start the DHT and the transport; this coordinator's peer id."""
        o = self.opts
        self.dht, self.transport = await start_transport(
            o.initial_peers, o.host_maddrs, o.announce_maddrs, o.identity_path, o.startup_timeout,
            transport=o.transport, libp2p_port=o.libp2p_port, tcp_port=o.tcp_port, secret=self.secret)
        if self.secret is not None:  # lets a standby read the coordinator's STATUS
            sign_requests(self.transport, {"token": join_token(self.secret, self.run_id, self.me)})
        return self.me

    async def stop(self) -> None:
        await stop_transport(self.dht, self.transport)

    @property
    def me(self) -> str:
        return str(self.transport.peer_id)

    @property
    def kind(self) -> str:
        return self.transport.kind

    async def register(self, name: str, handler) -> None:
        await self.transport.register(name, handler)

    async def call(self, pid: str, name: str, header: dict, timeout: float,
                   tensors: Sequence = ()) -> tuple[dict, list]:
        """One request of this run to peer `pid` (its header checked against the request's definition)."""
        return await self.transport.call(pid, name, request(name, self.run_id, **header), tensors, timeout=timeout)

    async def gather(self, pids: Sequence[str], name: str, header: dict, timeout: float) -> list:
        """`name` to every one of `pids` at once: each reply, or the exception its call raised."""
        return await asyncio.gather(*(self.call(p, name, header, timeout) for p in pids), return_exceptions=True)

    async def alive(self, pid: str) -> bool:
        """Whether `pid` answers a ping (bounded by min(5 s, rpc_timeout))."""
        try:
            await self.call(pid, RPC.PING, {}, timeout=min(5.0, self.t.rpc_timeout))
            return True
        except CALL_ERRORS:
            return False

    async def heartbeats(self) -> dict[str, dict]:
        """Peers with a live DHT heartbeat (with a run secret: only records a member signed)."""
        found = await live_members_async(self.dht, members_key(self.run_id)) or {}
        return {p: v for p, v in found.items() if record_ok(self.secret, self.run_id, "member", p, v)}

