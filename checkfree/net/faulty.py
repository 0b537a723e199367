"""Faults from outside: a `Transport` wrapper that acts when a message reaches a named protocol point.

`FaultyTransport(inner, injector)` is a `checkfree.net.base.Transport` that passes every request through
`injector` at three points, then on to `inner` (any transport):

    SEND    this peer is about to send request `rpc` to `other` (nothing has left yet)
    SERVE   this peer has received request `rpc` from `other` (its handler has not run yet)
    REPLY   this peer holds the reply to its request `rpc` to `other` (its caller has not seen it yet)

At each point the injector gets a `Crossing` (point, rpc, this peer, the other peer, the request's header and,
at REPLY, the reply's header) and may

* return `None`: the message goes on unchanged;
* return a header: the request goes on with that header instead (SEND only: e.g. a field a peer acts on);
* sleep: the message is delayed;
* raise `TransportError`: the message is dropped (SEND: it never leaves, the caller sees an unreachable peer;
  REPLY: the reply is lost after the remote side acted; SERVE: the caller gets an error reply);
* kill a peer: the injector's own business (the in-process tier's SIGKILL, a launcher's signal), usually
  followed by a drop.

Production code never builds one: a test harness wraps the transports it starts (the in-process network,
`checkfree.net.in_memory.MemoryNetwork.wrap`). `FaultRules` is a ready-made injector: an ordered list of `Rule`s,
each a point, an RPC name, a predicate and an action (`drop`, `delay`, or any coroutine), firing a bounded
number of times; richer schedules (the deterministic simulation tests, `dst/`) write their own injector.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from checkfree.net.base import Handler, Transport
from checkfree.net.errors import TransportError

__all__ = ["Point", "Crossing", "Injector", "FaultyTransport", "Rule", "FaultRules", "drop", "delay", "hold", "release"]


class Point(enum.Enum):
    """Where a message is when the injector sees it."""

    SEND = "send"
    SERVE = "serve"
    REPLY = "reply"


@dataclass(frozen=True)
class Crossing:
    """One message at one point: `me` is the peer whose transport it crosses, `other` the remote one."""

    point: Point
    rpc: str
    me: str
    other: str
    header: dict
    reply: dict | None = None  # REPLY: the reply's header


# the injector: None (go on), a replacement header (SEND), or raise TransportError (drop)
Injector = Callable[[Crossing], Awaitable[dict | None]]


class FaultyTransport:
    """`inner` with `injector` at every SEND, SERVE and REPLY point (see the module docstring)."""

    def __init__(self, inner: Transport, injector: Injector) -> None:
        self.inner, self.injector = inner, injector

    @property
    def kind(self) -> str:
        return self.inner.kind

    @property
    def extra_header(self) -> dict:
        return self.inner.extra_header

    @extra_header.setter
    def extra_header(self, value: dict) -> None:
        self.inner.extra_header = value

    @property
    def peer_id(self) -> Any:
        return self.inner.peer_id

    def get_visible_maddrs(self) -> list[str]:
        return self.inner.get_visible_maddrs()  # type: ignore[attr-defined]

    async def register(self, name: str, handler: Handler) -> None:
        me = str(self.inner.peer_id)

        async def served(header: dict, tensors: list[torch.Tensor], peer: Any) -> tuple[dict, Sequence[torch.Tensor]]:
            await self.injector(Crossing(Point.SERVE, name, me, str(peer), header))
            return await handler(header, tensors, peer)

        await self.inner.register(name, served)

    async def unregister(self, name: str) -> None:
        await self.inner.unregister(name)

    async def call(self, peer_id: Any, name: str, header: dict, tensors: Sequence[torch.Tensor] = (), *,
                   timeout: float) -> tuple[dict, list[torch.Tensor]]:
        me, other = str(self.inner.peer_id), str(peer_id)
        changed = await self.injector(Crossing(Point.SEND, name, me, other, header))
        if changed is not None:
            header = changed
        reply, out = await self.inner.call(peer_id, name, header, tensors, timeout=timeout)
        await self.injector(Crossing(Point.REPLY, name, me, other, header, reply))
        return reply, out

    async def shutdown(self) -> None:
        await self.inner.shutdown()


# ---- a ready-made injector ----------------------------------------------------------------------
Action = Callable[[Crossing], Awaitable[dict | None]]


def drop(why: str = "dropped by a fault rule") -> Action:
    """An action: the message is lost (the caller sees an unreachable peer)."""

    async def act(c: Crossing) -> dict | None:
        raise TransportError(f"{c.rpc} {c.me} -> {c.other}: {why}")

    return act


def delay(seconds: float) -> Action:
    """An action: the message is held back `seconds`."""

    async def act(c: Crossing) -> dict | None:
        await asyncio.sleep(seconds)
        return None

    return act


def hold(until: asyncio.Event, seconds: float) -> Action:
    """An action: the message waits until `until` is set (at most `seconds`): e.g. until another message has
    crossed a point (`release`): it orders two events that a race would otherwise order by chance."""

    async def act(c: Crossing) -> dict | None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(until.wait(), seconds)
        return None

    return act


def release(event: asyncio.Event) -> Action:
    """An action: set `event` (the message goes on)."""

    async def act(c: Crossing) -> dict | None:
        event.set()
        return None

    return act


@dataclass
class Rule:
    """Act on messages of `rpc` (None: any) at `point` for which `when` holds, at most `times` times (None: always)."""

    point: Point
    rpc: str | None
    action: Action
    when: Callable[[Crossing], bool] = lambda c: True
    times: int | None = 1
    fired: int = 0

    def matches(self, c: Crossing) -> bool:
        return (c.point is self.point and (self.rpc is None or c.rpc == self.rpc)
                and (self.times is None or self.fired < self.times) and self.when(c))


@dataclass
class FaultRules:
    """An injector made of rules, tried in order; the first that matches acts."""

    rules: list[Rule] = field(default_factory=list)

    async def __call__(self, c: Crossing) -> dict | None:
        for rule in self.rules:
            if rule.matches(c):
                rule.fired += 1
                return await rule.action(c)
        return None
