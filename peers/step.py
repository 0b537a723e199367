"""The step state machine of a peer: which step attempt is active, and how it ends.

A step attempt starts with the coordinator's RUN_STEP (peers.passes runs it), and ends in one
of three ways: COMMIT (every stage finished: clip and apply the optimizer step), ABORT (an
attempt interrupted by a failure: its activations and gradients are dropped, and the step
runs again as the next attempt), or a newer attempt superseding it. Messages of an attempt
that has ended here are refused; a message for a newer one waits for its RUN_STEP.
"""

from __future__ import annotations

import asyncio
import resource
import sys
import time
from dataclasses import dataclass, field
from collections.abc import Iterable
from typing import Any, Protocol

import torch

from checkfree.pipeline import Hop
from checkfree.messages import Abort, Commit, Committed, LastCommit, Ok
from checkfree.peer_hook import CommitTaken, PeerHook
from checkfree.protocol import Kind, ProtocolError, Timeouts
from checkfree.softerrors import guard_counts
from checkfree.worker import InFlightPeak
from peers.compute import ComputeQueue
from peers.stage import HostedStage

__all__ = ["StepRun", "StepTracker"]


@dataclass
class StepRun:
    """One attempt of one step (or evaluation) as seen by this peer."""

    step: int
    attempt: int
    evaluate: bool
    peers: dict[int, str]
    routes: list[list[Hop]]
    remaining: int
    done: asyncio.Event = field(default_factory=asyncio.Event)
    losses: dict[int, float] = field(default_factory=dict)
    error: str | None = None
    kind: str = Kind.STEP_FAILED  # what ended the attempt (a Kind), when `error` is set
    component_grads: dict[str, torch.Tensor] = field(default_factory=dict)
    tasks: set[asyncio.Task] = field(default_factory=set)
    bytes_sent: int = 0  # tensor payload bytes this peer sent for the step
    pending_starts: list[int] = field(default_factory=list)  # first-hop microbatches not started yet
    inflight: InFlightPeak = field(default_factory=InFlightPeak)  # the most activations held at once
    # one-way delays of the activations/gradients that arrived here, by sending stage (an emulated WAN only:
    # sender's and receiver's clocks are the same machine's)
    arrivals: dict[int, list[float]] = field(default_factory=dict)
    # stage groups (several replicas per stage; None/empty: one peer per stage, as `peers` says)
    hops: list[list[str]] | None = None  # the peer of every hop of every microbatch (moved by REROUTE)
    groups: dict[int, list[str]] = field(default_factory=dict)  # stage -> its live replicas
    mine: set[int] = field(default_factory=set)  # the microbatches this peer computes
    started: set[int] = field(default_factory=set)  # ...whose forward has started here
    moved: asyncio.Event = field(default_factory=asyncio.Event)  # set (and replaced) by each REROUTE applied here
    backwarded: set[int] = field(default_factory=set)  # ...whose backward has started here
    sent: dict[int, torch.Tensor] = field(default_factory=dict)  # mb -> the activation this peer sent on
    sent_grad: dict[int, torch.Tensor | None] = field(default_factory=dict)  # mb -> the gradient it sent back
    events: dict[tuple[str, int], asyncio.Event] = field(default_factory=dict)  # ("forward"|"sent", mb)
    pre_reduce: torch.Tensor | None = None  # the gradients before the last REDUCE (restored if the group failed)
    reduced: asyncio.Event = field(default_factory=asyncio.Event)  # set when a REDUCE ended, summed or failed
    reduce_error: str | None = None  # why this peer's last REDUCE failed (a retry of the REDUCE may still sum)
    computing_s: float = 0.0  # the compute thread's busy seconds during this attempt (the replica's speed)

    @property
    def grouped(self) -> bool:
        """A stage-group step: the gradients are summed by REDUCE before COMMIT (the component sync comes after
        it), and what this peer sent is kept for a sibling's redo."""
        return self.hops is not None

    def peer(self, mb: int, idx: int) -> str:
        """The peer of hop `idx` of microbatch `mb`."""
        return self.hops[mb][idx] if self.hops is not None else self.peers[self.routes[mb][idx].stage]

    def event(self, kind: str, mb: int) -> asyncio.Event:
        return self.events.setdefault((kind, mb), asyncio.Event())

    def mark(self, kind: str, mb: int) -> None:
        """`kind` ("forward", "sent") happened for microbatch `mb`: what waits for it goes on."""
        self.event(kind, mb).set()

    def track(self, task: asyncio.Task) -> None:
        """A task of this attempt (ended with it), until it is done."""
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def next_start(self) -> int | None:
        """The next first-hop microbatch to start here (None: all started)."""
        while self.pending_starts:
            mb = self.pending_starts.pop(0)
            if mb not in self.started:  # (a redo may have started it)
                return mb
        return None

    def forward_started(self, mb: int) -> None:
        self.started.add(mb)

    def backward_started(self, mb: int) -> None:
        self.backwarded.add(mb)

    async def backward_turn(self, mb: int, here: Iterable[int], timeout: float) -> None:
        """Until every microbatch before `mb` that this peer backpropagates (`here`) has done so (`mark`
        "backward"), the attempt has ended, or `timeout` has passed. A stage's gradients then accumulate in
        microbatch order, as the simulator's do, not in the order the gradients arrive: float addition is not
        associative, and two runs of one schedule differed in their losses (the seed-41 soak's #974, issue 37)."""
        deadline = time.monotonic() + timeout
        for j in sorted(m for m in here if m < mb):
            turn = self.event("backward", j)
            if turn.is_set() or self.error is not None:
                continue
            waits = [asyncio.ensure_future(turn.wait()), asyncio.ensure_future(self.done.wait())]
            try:
                await asyncio.wait(waits, timeout=max(0.0, deadline - time.monotonic()),
                                   return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
            if not turn.is_set():
                return  # (ended, or out of time: no wait outlasts the step's timeout)

    def arrived(self, src: int, delay: float) -> None:
        """A pass from stage `src` took `delay` seconds one way (an emulated WAN)."""
        self.arrivals.setdefault(src, []).append(delay)

    def finish(self) -> None:
        """Every microbatch of this peer's is done."""
        self.done.set()

    def microbatch_done(self) -> bool:
        """One microbatch of this peer's finished its backward here; whether it was the last."""
        self.remaining -= 1
        return self.remaining == 0

    def keep_loss(self, mb: int, loss: float) -> None:
        self.losses[mb] = loss

    def keep_sent(self, mb: int, activation: torch.Tensor) -> None:
        """The activation this peer sent on for `mb` (a sibling's redo may ask for it: GET_PASS)."""
        self.sent[mb] = activation
        self.mark("sent", mb)

    def keep_sent_grad(self, mb: int, grad: torch.Tensor | None) -> None:
        self.sent_grad[mb] = grad

    def keep_component_grads(self, grads: dict[str, torch.Tensor]) -> None:
        """CheckFree+: this holder's embedding / head gradients, for its partner's COMPONENT_GRAD."""
        self.component_grads = grads

    def count_sent(self, nbytes: int) -> None:
        self.bytes_sent += nbytes

    def reducing(self) -> None:
        """A REDUCE of this attempt starts (again): a COMPONENT_GRAD waits for its end."""
        self.reduced.clear()
        self.reduce_error = None

    def reduce_succeeded(self) -> None:
        """This peer's REDUCE summed the group's gradients: a COMPONENT_GRAD waiting for the sums goes on."""
        self.reduced.set()

    def reduce_failed(self, message: str) -> None:
        """This peer's REDUCE failed: a COMPONENT_GRAD waiting for its sums is refused now (a retry may sum)."""
        self.reduce_error = message[:500]
        self.reduced.set()

    def keep_pre_reduce(self, flat: torch.Tensor | None) -> None:
        """The gradients before a REDUCE (None: restored, nothing kept)."""
        self.pre_reduce = flat

    def members(self) -> dict[str, int]:
        """The peers of this step: peer -> the stage it serves."""
        if self.groups:
            return {p: stage for stage, peers in self.groups.items() for p in peers}
        return {p: stage for stage, p in self.peers.items()}

    def reroute(self, dead: str, to: str, mbs: list[int], me: str) -> list[int]:
        """A lost replica's (`dead`) hops of `mbs` go to `to`; the microbatches this peer takes on (if it is `to`)."""
        hops = self.hops
        assert hops is not None, "a REROUTE of a step without stage groups"
        for mb in mbs:
            hops[mb] = [to if p == dead else p for p in hops[mb]]
        for g in self.groups.values():
            if dead in g:
                g.remove(dead)
        new = [mb for mb in mbs if mb not in self.mine] if to == me else []
        self.mine.update(new)
        self.remaining += len(new)
        if new:
            self.done.clear()
        self.moved.set()  # passes that waited for this table (Passes._hop) look again
        self.moved = asyncio.Event()
        return new

    def fail(self, message: str, kind: str = Kind.STEP_FAILED) -> None:
        if self.error is None:
            self.error, self.kind = message, kind
        self.done.set()

    def figures(self) -> dict:
        """What the coordinator records for this stage and step (metrics.jsonl)."""
        out: dict[str, Any] = {"bytes_sent": self.bytes_sent, "inflight_peak": self.inflight.microbatches,
               "activation_peak_bytes": self.inflight.bytes, "peak_rss_bytes": _peak_rss_bytes()}
        # this peer's speed: the microbatches it computed and its compute thread's busy seconds
        out.update(microbatches=len(self.mine) if self.grouped else len(self.routes),
                   computing_s=round(self.computing_s, 6))
        if self.arrivals:
            out["hop_delay_s"] = {s: round(sum(d) / len(d), 6) for s, d in sorted(self.arrivals.items())}
        return out

    def ready(self) -> bool:
        """Finished without error: a training step that may be committed."""
        return self.done.is_set() and self.error is None and not self.evaluate


def _peak_rss_bytes() -> int:
    """This process's peak resident memory so far (its DHT process and p2pd not included)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere


class ReplicaHook(Protocol):
    """What a commit asks of redundant computation (peers.replicas.Replicas): this stage's gradients before its
    step, shipped after it to the predecessor holding its replica, and the step's redundant-forward figures."""

    shipped: int

    @property
    def active(self) -> bool: ...

    def gradients(self) -> Any: ...

    async def ship(self, step: int, peers: dict[int, str], grads: Any) -> None: ...

    def take_seconds(self) -> float: ...


class StreamHook(Protocol):
    """What a commit asks of snap's streamed copy (peers.streamed_copies.Streams): the part this step sent, encoded from
    the weights the step started from and acknowledged by the holder, before the optimizer step changes them."""

    async def before_commit(self) -> tuple[tuple[int, int] | None, int | None]: ...


class StepTracker:
    """The active step attempt of this peer, the newest one that ended, and COMMIT/ABORT."""

    def __init__(self, timeouts: Timeouts, hosted: HostedStage, compute: ComputeQueue,
                 replicas: ReplicaHook | None = None, hook: PeerHook | None = None,
                 streams: StreamHook | None = None) -> None:
        self.timeouts, self.hosted, self.compute, self.replicas = timeouts, hosted, compute, replicas
        self.hook = hook  # the peer's fault hook (checkfree.peer_hook), None in production
        self.streams = streams
        self.run: StepRun | None = None
        self.finished: tuple[int, int] | None = None  # newest (step, attempt) that ended here
        self.members: dict[str, int] = {}  # the peers of the newest attempt started here (peer -> stage)
        self._changed = asyncio.Event()
        self._committing = asyncio.Lock()  # held while a COMMIT is applied

    async def settled(self) -> None:
        """Until no COMMIT is being applied here: a new coordinator must see this peer before or after a commit the
        old one sent, never half-way (it would commit the step again, and this peer refuse it as stale)."""
        async with self._committing:
            pass

    def start(self, run: StepRun) -> None:
        """Make `run` the active attempt (the previous one, if any, has ended)."""
        self._set(run)
        self.members = run.members()

    def _set(self, run: StepRun | None) -> None:
        if self.run is not None:
            self.finished = max(self.finished or (-1, -1), (self.run.step, self.run.attempt))
        self.run = run
        self._changed.set()

    def reset(self) -> None:
        """Forget every attempt (a stage rolled back to a snapshot runs its steps again)."""
        self._set(None)
        self.finished = None

    async def current(self, step: int, attempt: int) -> StepRun:
        """The active attempt a message names. A neighbour may send before the coordinator's
        RUN_STEP reached this peer: a message for a newer step waits (up to rpc_timeout) for
        it; a message for an older or aborted attempt is refused."""
        want = (step, attempt)
        deadline = time.monotonic() + self.timeouts.rpc_timeout
        while True:
            run = self.run
            have = None if run is None else (run.step, run.attempt)
            if run is not None and have == want:
                return run
            if (have is not None and have > want) or (self.finished is not None and self.finished >= want):
                raise ProtocolError(f"stale message for step {want[0]} attempt {want[1]} (active: {have})")
            left = deadline - time.monotonic()
            if left <= 0:
                raise ProtocolError(f"no step {want[0]} attempt {want[1]} started on this peer within "
                                    f"rpc_timeout={self.timeouts.rpc_timeout:g} s (active: {have})")
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except TimeoutError:
                pass

    async def drop(self, reason: str) -> None:
        """End the active attempt here: its tasks, activations and gradients are dropped."""
        run = self.run
        if run is not None:
            run.fail(reason)
            for task in list(run.tasks):
                task.cancel()
        self._set(None)
        if self.hosted.worker is not None:
            await self.compute.run(self.hosted.serving().drop_inflight)

    # ---- handlers --------------------------------------------------------------------
    async def on_commit(self, commit: Commit, tensors: list, peer) -> tuple[Committed, list]:
        """Clip and apply the optimizer step of the finished attempt; its omega for a later recovery."""
        if self.hook is not None:
            self.hook(CommitTaken(commit.step, commit.attempt))
        run = await self.current(commit.step, commit.attempt)
        if not run.ready():
            raise ProtocolError(f"step {run.step} is not ready to commit ({run.error or 'still running'})")
        async with self._committing:
            if self.run is not run:  # a second COMMIT of the attempt (a takeover's) waited for the first
                raise ProtocolError(f"step {run.step} attempt {run.attempt} is committed already")
            return await self._commit(run)

    async def _commit(self, run: StepRun) -> tuple[Committed, list]:
        hosted, replicas = self.hosted, self.replicas
        copy_sent, copy_bytes = await self.streams.before_commit() if self.streams is not None else (None, None)
        grads = await self.compute.run(replicas.gradients) if replicas is not None and replicas.active else None
        stats = await self.compute.run(hosted.serving().step, run.step)
        redundant: dict[str, Any] = {}
        if grads is not None and replicas is not None:  # redundant computation: the predecessor's replica too
            await replicas.ship(run.step, run.peers, grads)
            redundant = {"redundant_s": replicas.take_seconds(), "replica_bytes": replicas.shipped}
        hosted.committed(None if stats.skipped else stats.omega(hosted.joined().recovery), run.step + 1, LastCommit(
            step=run.step, losses=dict(run.losses), lr=stats.lr, post=stats.grad_norm_post,
            block_post=stats.block_grad_norm_post, **run.figures()))
        self._set(None)
        return Committed(pre=stats.grad_norm_pre, post=stats.grad_norm_post, block_post=stats.block_grad_norm_post,
                         lr=stats.lr, skipped=stats.skipped, omega=hosted.omega, stage=hosted.index,
                         weights_finite=stats.weights_finite, soft_errors=guard_counts([hosted.serving().guard]),
                         copy_sent=copy_sent, copy_bytes=copy_bytes, **redundant), []

    async def on_abort(self, abort: Abort, tensors: list, peer) -> tuple[Ok, list]:
        await self.drop("aborted by the coordinator")
        return Ok(), []
