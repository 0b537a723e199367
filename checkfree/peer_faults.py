"""Faults from outside, at a peer's own protocol points: a peer hook (checkfree.peer_hook) that acts out faults
armed from outside. For tests and chaos runs only: a production peer has no hook.

`PeerFaults` is given to a peer daemon as its hook (`checkfree peer --fault-hook`, or an in-process harness's
`PeerDaemon(opts, hook=PeerFaults(kill=...))`). It is armed with `Arm` values: in-process by `arm(...)`, or by
the peer's coordinator-side injector through its control channel, `FAULT_RPC`, an RPC the hook serves on the
peer's own transport once started (`arm_peer`). Nothing else serves it: a peer started without a hook has no
such channel, and its requests carry nothing a fault needs. What it arms:

    DieAfterPasses   SIGKILL at the (mb+1)-th forward (or backward) pass computed in an attempt of step `step` or
                     later (mb modulo the passes the peer computes): a death mid-forward or mid-backward
    DieInReduce      SIGKILL after bucket `bucket` of the gradient all-reduce of a step attempt (stage groups)
    DieAtCommit      SIGKILL as the COMMIT of step `step` is taken, before the optimizer step
    DieAfterPulls    SIGKILL after `pulls` weight pulls of a rebuild
    Slow             sleep `seconds` on the compute thread before every pass from step `from_step` on

The kill is `kill(peer_id, why)`: by default a SIGKILL of this process (of its process group, when it leads
one, as the local swarm starts peers: its DHT process and p2pd die with it); an in-process harness passes its
own (`checkfree.net.in_memory.MemoryNetwork.kill` and the cancellation of the peer's tasks).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal, Union

import msgspec

from checkfree.net.base import Transport
from checkfree.peer_hook import (BucketReduced, CommitTaken, PassComputed, PassStarting, PeerEvent, StepStarted,
                                 WeightPulled)

__all__ = ["FAULT_RPC", "Arm", "DieAfterPasses", "DieInReduce", "DieAtCommit", "DieAfterPulls", "Slow", "PeerFaults",
           "arm_peer", "sigkill"]

log = logging.getLogger(__name__)

FAULT_RPC = "cf.fault_hook"  # the control channel: served only by a peer started with a PeerFaults hook


class _Arm(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind"):
    pass


class DieAfterPasses(_Arm, frozen=True, tag="passes"):
    pass_kind: Literal["forward", "backward"]
    step: int
    mb: int = 0


class DieInReduce(_Arm, frozen=True, tag="reduce"):
    step: int
    attempt: int
    bucket: int = 0


class DieAtCommit(_Arm, frozen=True, tag="commit"):
    step: int


class DieAfterPulls(_Arm, frozen=True, tag="pulls"):
    pulls: int = 1


class Slow(_Arm, frozen=True, tag="slow"):
    seconds: float
    from_step: int = 0


Arm = Union[DieAfterPasses, DieInReduce, DieAtCommit, DieAfterPulls, Slow]


def sigkill(peer_id: str, why: str) -> None:
    """This process, now (its process group with it when it leads one)."""
    print(f"fault hook: SIGKILL of this {why}", flush=True)
    if os.getpgrp() == os.getpid():
        os.killpg(os.getpid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


async def arm_peer(transport: Transport, peer_id: str, arm: Arm, timeout: float) -> None:
    """Arm `peer_id`'s hook through its control channel (a RemoteError there: it was started without one)."""
    await transport.call(peer_id, FAULT_RPC, {"arm": msgspec.to_builtins(arm)}, timeout=timeout)


class PeerFaults:
    """A peer hook that acts out the faults armed on it (see the module docstring). Events arrive from the event
    loop and from the compute thread: the armed state is guarded by a lock; the kill and the sleep run outside
    it."""

    def __init__(self, kill: Callable[[str, str], None] = sigkill, *, channel: bool = True) -> None:
        self.kill = kill
        self.channel = channel  # serve FAULT_RPC (armed by a coordinator-side injector); else `arm` only
        self.peer_id = ""
        self._lock = threading.Lock()
        self._armed: list[Arm] = []
        self._due: list[tuple[DieAfterPasses, int]] = []  # the attempt under way: (fault, its pass number)
        self._computed: dict[str, int] = {}  # passes computed in the attempt under way, by kind
        self._pulls = 0

    async def started(self, transport: Transport) -> None:
        self.peer_id = str(transport.peer_id)
        if self.channel:
            await transport.register(FAULT_RPC, self._on_arm)

    async def _on_arm(self, header: dict, tensors: list, peer: Any) -> tuple[dict, Sequence]:
        self.arm(msgspec.convert(header.get("arm"), Arm))
        return {}, []

    def arm(self, fault: Arm) -> None:
        with self._lock:
            self._armed.append(fault)
            if isinstance(fault, DieAfterPulls):
                self._pulls = 0  # (counted from now)
        if isinstance(fault, Slow):
            log.warning("diagnostic: %.3g s delay per forward/backward from step %d", fault.seconds, fault.from_step)

    # ---- the hook ---------------------------------------------------------------------------------
    def __call__(self, event: PeerEvent) -> None:
        if isinstance(event, PassStarting):
            slow = self._slow(event.step)
            if slow:
                time.sleep(slow)
            return
        with self._lock:
            why = self._kills(event)
        if why is not None:
            self.kill(self.peer_id, why)

    def _slow(self, step: int) -> float:
        with self._lock:
            return max((a.seconds for a in self._armed if isinstance(a, Slow) and step >= a.from_step), default=0.0)

    def _kills(self, event: PeerEvent) -> str | None:
        """Under the lock: why `event` kills this peer (the fault disarmed), or None."""
        if isinstance(event, StepStarted):
            self._start(event)
        elif isinstance(event, PassComputed):
            return self._computed_pass(event)
        elif isinstance(event, WeightPulled):
            self._pulls += 1
            pulls = next((a for a in self._armed if isinstance(a, DieAfterPulls) and self._pulls >= a.pulls), None)
            return self._fire(pulls, f"replacement after pulling {event.part} of stage {event.stage}")
        elif isinstance(event, BucketReduced):
            reduce = next((a for a in self._armed if isinstance(a, DieInReduce) and (a.step, a.attempt, a.bucket) == (
                event.step, event.attempt, event.bucket) and event.bucket + 1 < event.buckets), None)
            return self._fire(reduce, f"replica half-way through the gradient all-reduce of step {event.step}")
        elif isinstance(event, CommitTaken):
            commit = next((a for a in self._armed if isinstance(a, DieAtCommit) and a.step == event.step), None)
            return self._fire(commit, f"peer as it takes the COMMIT of step {event.step}")
        return None

    def _start(self, event: StepStarted) -> None:
        """A training attempt: the pass that kills, for each pass fault armed for its step or an earlier one."""
        self._computed = {}
        self._due = [] if event.evaluate or event.passes == 0 else [
            (a, a.mb % event.passes + 1) for a in self._armed if isinstance(a, DieAfterPasses) and event.step >= a.step]

    def _computed_pass(self, event: PassComputed) -> str | None:
        n = self._computed[event.kind] = self._computed.get(event.kind, 0) + 1
        due = next((a for a, at in self._due if a.pass_kind == event.kind and at == n), None)
        if due is not None:
            self._due = [(a, at) for a, at in self._due if a is not due]
        return self._fire(due, f"peer after its {event.kind} pass {n} of step {event.step} (microbatch {event.mb})")

    def _fire(self, due: Arm | None, why: str) -> str | None:
        if due is None:
            return None
        self._armed.remove(due)
        return why
