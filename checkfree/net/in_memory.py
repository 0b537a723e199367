"""An in-process network for the fast test tier: a `MemoryTransport` (the `Transport` protocol) and a
`MemoryDHT` (the part of hivemind's DHT API that membership uses: `store`/`get` of sub-keys with an expiry),
for several peers and a coordinator running in one event loop.

Every message is encoded and decoded with the wire format (`checkfree.net.wire`), so handlers see what a
real transport delivers (fresh tensors, JSON headers) and a handler's failure comes back as the same
`RemoteError`. `MemoryNetwork.kill(peer_id)` is the in-process SIGKILL: the peer's running handlers are
cancelled, calls to it and from it fail as unreachable, and its DHT records stay until they expire (as a
dead process's heartbeat does). `start_transport(..., transport="memory")` joins `MEMORY`, the process's
network; nothing outside one Python process can reach it, so the command line does not offer it.

Processes: a harness that runs each peer's (or coordinator's) main task in a `SimProcess` of its own
(`SimProcess.start`) and calls `MemoryNetwork.track(loop)` gets a whole-process SIGKILL from `kill`: every task
that process created (the handlers it serves, the tasks they spawn, its timers) is cancelled, not only its
transport. A request's handler runs in the serving process (its tasks are the server's, as in a real swarm).

Faults: `MemoryNetwork.wrap`, when set, wraps every transport joining the network (e.g. in a
`checkfree.net.faulty.FaultyTransport`): the one place a harness injects faults at protocol points.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import weakref
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from checkfree.net.base import Handler
from checkfree.net.errors import TransportError, TransportTimeout, failed_request, remote_error
from checkfree.net.streams import dispatch
from checkfree.net.wire import WireError, decode_message, encode_message

__all__ = ["MemoryNetwork", "MemoryTransport", "MemoryDHT", "MEMORY", "SimProcess"]


class SimProcess:
    """One in-process 'process' (a peer daemon or a coordinator): the tasks it created, so that a kill ends
    them all. Code runs in a process when its task was started by `start` or by a task of that process."""

    current: contextvars.ContextVar[SimProcess | None] = contextvars.ContextVar("memory_process", default=None)

    def __init__(self, name: str) -> None:
        self.name = name
        self.tasks: weakref.WeakSet[asyncio.Task] = weakref.WeakSet()
        self.killed = False

    def context(self) -> contextvars.Context:
        ctx = contextvars.copy_context()
        ctx.run(SimProcess.current.set, self)
        return ctx

    def start(self, coro: Coroutine) -> asyncio.Task:
        """Run `coro` as this process's main task; when it returns the process exits: its other tasks are cancelled
        (as `asyncio.run` does at the end of a real process)."""

        async def main() -> Any:
            try:
                return await coro
            finally:
                me = asyncio.current_task()
                for t in self.live_tasks():
                    if t is not me:
                        t.cancel()

        return asyncio.get_running_loop().create_task(main(), context=self.context())

    def live_tasks(self) -> list[asyncio.Task]:
        return [t for t in list(self.tasks) if not t.done()]

    def cancel_all(self) -> None:
        self.killed = True
        for t in self.live_tasks():
            t.cancel()


def _tracking_factory(loop: asyncio.AbstractEventLoop, coro: Coroutine,
                      context: contextvars.Context | None = None) -> asyncio.Task:
    """A task factory recording every task in the `SimProcess` it was created in (its context's)."""
    task = asyncio.Task(coro, loop=loop, context=context)
    proc = SimProcess.current.get() if context is None else context.get(SimProcess.current)
    if proc is not None:
        proc.tasks.add(task)
        if proc.killed:  # created by a dying process's finally: it dies too
            task.cancel()
    return task


@dataclass
class _Record:
    value: Any
    expiration_time: float


@dataclass
class _Found:
    """What hivemind's ``DHT.get`` returns for a key with sub-keys: ``value`` maps sub-key -> record."""

    value: dict
    expiration_time: float


@dataclass
class MemoryNetwork:
    """The transports and DHT records of one process's in-memory swarm."""

    transports: dict[str, MemoryTransport] = field(default_factory=dict)
    records: dict[str, dict[Any, _Record]] = field(default_factory=dict)
    dead: set[str] = field(default_factory=set)
    _ids: Any = field(default_factory=itertools.count)
    # wraps every transport that joins (a fault injector: checkfree.net.faulty); None: none
    wrap: Callable[[MemoryTransport], Any] | None = None

    def new_id(self) -> str:
        return f"mem-{next(self._ids)}"

    def attach(self, transport: MemoryTransport) -> Any:
        """The transport a process joining the network uses: `transport`, wrapped if the network says so."""
        return transport if self.wrap is None else self.wrap(transport)

    def track(self, loop: asyncio.AbstractEventLoop) -> None:
        """Record every task of `loop` in its `SimProcess`, so that `kill` ends a whole process."""
        loop.set_task_factory(cast(Any, _tracking_factory))

    def kill(self, peer_id: str) -> None:
        """The in-process SIGKILL of ``peer_id``: unreachable from now on, its running handlers cancelled, and
        (with `track`) every task of its process."""
        self.dead.add(str(peer_id))
        t = self.transports.pop(str(peer_id), None)
        if t is not None:
            t.cancel_handlers()
            if t.process is not None:
                t.process.cancel_all()

    def reset(self) -> None:
        self.transports.clear()
        self.records.clear()
        self.dead.clear()
        self.wrap = None


MEMORY = MemoryNetwork()


class MemoryTransport:
    """A `checkfree.net.base.Transport` whose calls are handled by another transport of the same network."""

    kind = "memory"

    def __init__(self, network: MemoryNetwork, peer_id: str | None = None) -> None:
        self.network = network
        self._peer_id = peer_id or network.new_id()
        self.extra_header: dict = {}
        self._handlers: dict[str, Handler] = {}
        self._running: set[asyncio.Task] = set()
        self.process = SimProcess.current.get()  # whose handlers these are (None: no process tracking)
        self._context = contextvars.copy_context()  # its owner's: requests are handled as in the owner's process
        network.transports[self._peer_id] = self

    @property
    def peer_id(self) -> str:
        return self._peer_id

    def get_visible_maddrs(self) -> list[str]:
        return [f"/memory/{self._peer_id}"]

    async def register(self, name: str, handler: Handler) -> None:
        self._handlers[name] = handler

    async def unregister(self, name: str) -> None:
        self._handlers.pop(name, None)

    def cancel_handlers(self) -> None:
        for task in self._running:
            task.cancel()

    async def _serve(self, name: str, frames: list, caller: str) -> list:
        """The encoded reply to one request (an error reply when it fails, as the real transports send)."""
        try:
            header, tensors = decode_message(frames)
            return await dispatch(self._handlers, name, header, tensors, caller)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            return encode_message(failed_request(e, f"memory {name}", caller, (asyncio.TimeoutError, WireError,
                                                                               TransportError)))

    async def call(self, peer_id: Any, name: str, header: dict, tensors: Sequence[torch.Tensor] = (), *,
                   timeout: float) -> tuple[dict, list[torch.Tensor]]:
        me, target = self._peer_id, self.network.transports.get(str(peer_id))
        if me in self.network.dead:
            raise TransportError(f"memory transport {me} is dead")
        if target is None:
            raise TransportError(f"peer {peer_id} is unreachable (not in this process's memory network)")
        frames = encode_message({**self.extra_header, **header}, tensors)
        # the handler runs in the serving process (its owner's context): a kill of the caller does not cancel it
        task = asyncio.create_task(target._serve(name, frames, me), context=target._context.copy())
        target._running.add(task)
        task.add_done_callback(target._running.discard)
        try:
            reply = await asyncio.wait_for(asyncio.shield(task), timeout)
        except asyncio.TimeoutError:
            raise TransportTimeout(f"no reply from {peer_id} to '{name}' within {timeout:g} s") from None
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if task.cancelled() and current is not None and not current.cancelling():
                raise TransportError(f"peer {peer_id} died while handling '{name}'") from None
            raise
        reply_header, reply_tensors = decode_message(reply)
        if "error" in reply_header:
            raise remote_error(peer_id, name, reply_header)
        return reply_header, reply_tensors

    async def shutdown(self) -> None:
        self._handlers.clear()
        if self.network.transports.get(self._peer_id) is self:
            del self.network.transports[self._peer_id]


class MemoryDHT:
    """The DHT calls `checkfree.net.heartbeats` makes, over the network's record table (no expiry clock
    other than ``time.time``, which is what hivemind's ``get_dht_time`` returns)."""

    heartbeat_stall = 0.0  # no routing through other nodes: a store never waits for a dead one

    def __init__(self, network: MemoryNetwork, peer_id: str) -> None:
        self.network, self.peer_id = network, peer_id

    def store(self, key: str, value: Any, *, expiration_time: float, subkey: Any = None,
              return_future: bool = False) -> Any:
        ok = self.peer_id not in self.network.dead
        if ok:
            self.network.records.setdefault(key, {})[subkey] = _Record(value, expiration_time)
        return _done(ok) if return_future else ok

    def get(self, key: str, latest: bool = True, return_future: bool = False) -> Any:
        subs = self.network.records.get(key)
        found = None if not subs else _Found(dict(subs), max(r.expiration_time for r in subs.values()))
        return _done(found) if return_future else found

    def get_visible_maddrs(self) -> list[str]:
        return [f"/memory/{self.peer_id}"]

    def shutdown(self) -> None:
        pass


async def _done(value: Any) -> Any:
    return value
