"""Running a step on a peer: RUN_STEP starts it, FORWARD and BACKWARD passes arrive here.

The coordinator's RUN_STEP names the step, its attempt and the stage -> peer table. This stage
computes the first hop of its microbatches from its own data (a pure function of the step),
sends each activation on to the next hop's peer (FORWARD), and a gradient back to the previous
one (BACKWARD); the last hop computes the loss. RUN_STEP answers once every microbatch passing
through this stage has finished its backward pass (under CheckFree+ after the two embedding and
head holders summed their gradients, COMPONENT_GRAD). A failure is a value: the attempt fails,
the peer keeps serving, and a neighbour that cannot be reached is reported to the coordinator.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import torch

from checkfree.hostcopy import to_device, to_host
from checkfree.net.transport import RemoteError, TransportError
from checkfree.pipeline import Hop, edge_holders, plain_route, route
from checkfree.messages import Backward, ComponentGrad, Forward, Ok, Pass, Report, RunStep, StepDone
from checkfree.peer_hook import PassComputed, PassKind, PassStarting, PeerHook, StepStarted
from checkfree.protocol import (
    STEP_TIMEOUT_MARK,
    STRAGGLER_MARK,
    Kind,
    ProtocolError,
    StepFailed,
)
from checkfree.softerrors import SOFT_ERROR_MARK, UncorrectableSoftError, guard_counts
from checkfree.wirecodec import encode
from peers.backups import Backups
from peers.checks import check_activation, check_groups, check_hop, check_hops, check_sender
from peers.compute import BACKWARD_FIRST, ComputeQueue
from peers.membership import Membership
from peers.replicas import Replicas
from peers.stage import HostedStage
from peers.step import StepRun, StepTracker
from peers.streamed_copies import Streams

__all__ = ["Passes"]

log = logging.getLogger(__name__)


class Passes:
    """The microbatches of the active step attempt passing through this peer's stage."""

    def __init__(self, membership: Membership, hosted: HostedStage, steps: StepTracker, compute: ComputeQueue,
                 replicas: Replicas | None = None, backups: Backups | None = None,
                 hook: PeerHook | None = None, streams: Streams | None = None,
                 settle: Callable[[int], None] | None = None) -> None:
        self.membership, self.hosted, self.steps, self.compute = membership, hosted, steps, compute
        self.replicas, self.backups, self.streams = replicas, backups, streams
        self.settle = settle  # the newest complete snapshot's step, as RUN_STEP names it (Snapshots.settle)
        self.hook = hook  # the peer's fault hook (checkfree.peer_hook), None in production
        self.timeouts = membership.timeouts

    # ---- handlers --------------------------------------------------------------------
    async def on_run_step(self, request: RunStep, tensors: list, peer) -> tuple[StepDone, list]:
        """Run this stage's part of a step (or an evaluation) and answer when it is done."""
        stage, cfg = self.hosted.serving().index, self.hosted.joined()
        old = self.steps.run
        if old is not None and not old.done.is_set():
            old.fail("superseded by a new step")
        routes = self._routes(request.step, request.evaluate)
        announced = request.routes
        if announced is not None and announced != [[h.stage for h in hops] for hops in routes]:
            raise ProtocolError(f"the coordinator's route table for step {request.step} differs from this peer's "
                                "(different strategy or config?)")
        run = StepRun(request.step, request.attempt, request.evaluate, dict(request.peers), routes,
                      remaining=len(routes))
        if request.hops is not None:  # a stage group: this peer computes the microbatches the table gives it
            run.hops, run.groups = check_hops(request, routes), check_groups(request)
            run.mine = {mb for mb, peers in enumerate(run.hops) if self.membership.me in peers}
            run.remaining = len(run.mine)
        self.steps.start(run)
        if self.settle is not None and request.snapshot_step is not None:
            self.settle(request.snapshot_step)
        if self.streams is not None and request.copies and not run.evaluate:  # snap: on its own task (COMMIT waits)
            self.streams.step_started(request.copies.get(stage), request.step)
        if self.hook is not None:
            self.hook(StepStarted(run.step, run.attempt, run.evaluate, run.remaining))
        run.pending_starts = [mb for mb, hops in enumerate(routes) if hops[0].stage == stage
                              and run.peer(mb, 0) == self.membership.me]
        window = len(run.pending_starts)
        if cfg.train.schedule == "1f1b" and not run.evaluate:
            window = cfg.num_stages  # at most S microbatches in flight from this first hop
        busy0 = self.compute.busy()
        if run.remaining == 0:  # a replica the table gave no microbatch (more replicas than microbatches)
            run.done.set()
        for _ in range(min(window, len(run.pending_starts))):
            self._start_next(run)
        send = None
        if self.backups is not None and request.backup is not None and not run.evaluate:
            send = asyncio.create_task(self.backups.send_part(request.backup))  # after the forwards queued
            run.tasks.add(send)
        try:
            await asyncio.wait_for(run.done.wait(), self.timeouts.step_timeout)
        except TimeoutError:
            # the peer whose own computing filled most of the step is the straggler; the others were waiting
            busy = self.compute.busy() - busy0
            straggler = busy >= self.timeouts.step_timeout / 2
            run.fail(f"{STEP_TIMEOUT_MARK} step {run.step} timed out after {self.timeouts.step_timeout:g} s on stage "
                     f"{stage}, {busy:.1f} s of it computing{f' {STRAGGLER_MARK}' if straggler else ''}",
                     Kind.STRAGGLER if straggler else Kind.STEP_TIMEOUT)
        run.computing_s = self.compute.busy() - busy0
        if run.error is None and self.hosted.plus and not run.evaluate and not run.grouped:
            await self._sync_components(run)  # (a stage group sums its gradients first: REDUCE does this then)
        if run.error is not None:  # a soft error carries the guard's counters: the peer may be replaced for it
            raise StepFailed(run.error, run.kind, {"soft_errors": guard_counts([self.hosted.serving().guard])}
                             if run.kind == Kind.SOFT_ERROR else None)
        run.inflight = await self.compute.run(self.hosted.serving().take_inflight_peak)  # after this step's queued work
        figures = run.figures()
        if send is not None and self.backups is not None:  # BAFT: the step is done once its part of the backup has
            await send  # gone (in the bubble, if it fit)
            figures["backup_bytes"] = self.backups.take_sent()
        return StepDone(losses=dict(run.losses), stage=stage, **figures), []

    async def on_forward(self, request: Forward, tensors: list, peer) -> tuple[Ok, list]:
        """An activation from the previous hop (checked before waiting for its step)."""
        arrived = time.time()
        x = check_activation(tensors, "activation", self.hosted.joined())
        run = await self.steps.current(request.step, request.attempt)
        mb, idx = await self._hop(run, request)
        if idx > 0:
            check_sender(run, peer, mb, idx - 1)
            self._arrived(run, request, run.routes[mb][idx - 1].stage, arrived)
        if mb in run.started:  # a sibling redoing a lost replica's microbatch: it needs our gradient again
            if mb in run.sent_grad and idx > 0:
                self._spawn(run, self._send(run, mb, idx - 1, Backward, run.sent_grad[mb]))
            return Ok(duplicate=True), []
        self._spawn(run, self._forward_task(run, mb, idx, x))
        return Ok(), []

    async def _hop(self, run: StepRun, request: Forward | Backward) -> tuple[int, int]:
        """The (microbatch, hop) of a pass for this peer (peers.checks.check_hop). In a stage group, a pass for a hop
        the table gives a sibling may be one moved here by a REROUTE not yet arrived: the coordinator tells the
        other peers before the sibling that takes a lost replica's microbatches (they must stop sending to the dead
        one), so their passes can overtake it. Such a pass waits for the REROUTE, up to rpc_timeout."""
        deadline = time.monotonic() + self.timeouts.rpc_timeout
        while True:
            moved = run.moved  # (taken before the check: a REROUTE applied after it sets this one)
            try:
                return check_hop(run, request, self.hosted.index, self.membership.me)
            except ProtocolError:
                mb, idx = request.mb, request.hop
                sibling = (run.grouped and 0 <= mb < len(run.routes) and 0 <= idx < len(run.routes[mb])
                           and run.routes[mb][idx].stage == self.hosted.index)
                left = deadline - time.monotonic()
                if not sibling or run.error is not None or left <= 0:
                    raise
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(moved.wait(), left)

    async def on_backward(self, request: Backward, tensors: list, peer) -> tuple[Ok, list]:
        """A gradient from the next hop (checked before waiting for its step)."""
        arrived = time.time()
        g = check_activation(tensors, "gradient", self.hosted.joined())
        run = await self.steps.current(request.step, request.attempt)
        mb, idx = await self._hop(run, request)
        if run.evaluate:
            raise ProtocolError("an evaluation has no backward pass")
        if idx + 1 < len(run.routes[mb]):
            check_sender(run, peer, mb, idx + 1)
            self._arrived(run, request, run.routes[mb][idx + 1].stage, arrived)
        if mb in run.backwarded:  # sent again for a sibling's redo: this stage's part is done already
            return Ok(duplicate=True), []
        self._spawn(run, self._backward_task(run, mb, idx, g))
        return Ok(), []

    async def on_component_grad(self, request: ComponentGrad, tensors: list, peer) -> tuple[Ok, list]:
        """CheckFree+: this holder's embedding or head gradient of a finished step, for its partner."""
        run = await self.steps.current(request.step, request.attempt)
        await asyncio.wait_for((run.reduced if run.grouped else run.done).wait(), self.timeouts.step_timeout)
        if run.grouped and run.reduce_error is not None:
            raise StepFailed(run.reduce_error)
        if run.error is not None or request.comp not in run.component_grads:
            raise ProtocolError(f"no {request.comp!r} gradient for step {run.step}: {run.error or 'not a holder'}")
        return Ok(), await to_host([run.component_grads[request.comp]])

    def _arrived(self, run: StepRun, request: Forward | Backward, src: int, arrived: float) -> None:
        """On an emulated WAN: record the one-way delay of a pass from stage `src` (its `sent` time to its handler's
        start here, before it waited for its step's RUN_STEP)."""
        sent = request.sent
        if self.membership.wan is not None and isinstance(sent, float) and math.isfinite(sent):
            run.arrived(src, arrived - sent)

    # ---- the step's microbatches -------------------------------------------------------
    def _routes(self, step: int, evaluate: bool) -> list[list[Hop]]:
        c = self.hosted.joined()
        s = c.num_stages
        if evaluate:
            return [plain_route(s) for _ in range(c.train.eval_batches)]
        return [route(s, self.hosted.plus, step, mb, c.train.num_microbatches) for mb in range(c.train.num_microbatches)]

    def _batch(self, run: StepRun, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
        data = self.hosted.data
        assert data is not None, "a stage that reads no data computes no first or last hop"
        if run.evaluate:
            return data.val_batches(self.hosted.joined().train.eval_batches)[mb]
        return data.batch(run.step, mb)

    def _start_next(self, run: StepRun) -> None:
        mb = run.next_start()
        if mb is not None:
            self._spawn(run, self._forward_task(run, mb, 0, None))

    @staticmethod
    def _spawn(run: StepRun, coro) -> None:
        run.track(asyncio.create_task(coro))

    def _mb_done(self, run: StepRun) -> None:
        if run.microbatch_done():
            worker = self.hosted.serving()
            if self.hosted.plus and not run.evaluate and not run.grouped:
                run.keep_component_grads({c: worker.component_grad(c) for c in worker.components})
            run.finish()

    async def _forward_task(self, run: StepRun, mb: int, idx: int, x: torch.Tensor | None) -> None:
        run.forward_started(mb)
        try:
            hop = run.routes[mb][idx]
            inputs, targets = self._batch(run, mb) if (hop.embed or hop.head) else (None, None)
            if hop.embed:
                x = inputs
            key = (run.step, run.attempt, mb)
            if run.evaluate:
                out = await self.compute.run(self.hosted.serving().infer, x, hop)
                if hop.head:
                    assert targets is not None
                    loss = torch.nn.functional.cross_entropy(out.flatten(0, 1), to_device(targets, out.device).flatten())
                    run.keep_loss(mb, await _host_float(loss))
                else:
                    await self._send(run, mb, idx + 1, Forward, out)
                self._mb_done(run)
                return
            if run.error is not None:  # ended (ABORT), though this task went on: an await can swallow a cancel
                return  # (asyncio.wait_for in Python 3.11); nothing of an ended attempt may reach the stage
            out = await self._guarded_forward(key, x, hop, targets)
            if run.grouped:  # (a redo's backward may be waiting for it)
                run.mark("forward", mb)
            if self.hook is not None:
                self.hook(PassComputed("forward", *key))
            if self.replicas is not None and self.replicas.replica is not None:  # redundant computation
                self._spawn(run, self.replicas.forward(inputs if hop.head else out.detach()))
            if not hop.head:
                if run.grouped:  # kept for a sibling's redo, should the next hop's replica be lost
                    run.keep_sent(mb, out)
                await self._send(run, mb, idx + 1, Forward, out)
                return
            run.keep_loss(mb, await _host_float(out))  # this microbatch's share of the step loss (already / M)
            if not math.isfinite(run.losses[mb]):
                log.warning("non-finite loss at step %d microbatch %d", run.step, mb)
            await self._backward_task(run, mb, idx, None)
        except StepFailed as e:  # expected (a soft error the guard could not correct): one line
            log.warning("forward of microbatch %d failed: %s", mb, e)
            run.fail(f"forward of microbatch {mb} failed on stage {self.hosted.index}: {e}", e.kind)
        except Exception as e:  # a failure is a value: the step fails, the peer keeps serving
            log.exception("forward of microbatch %d failed", mb)
            run.fail(f"forward of microbatch {mb} failed on stage {self.hosted.index}: {type(e).__name__}: {e}")

    async def _guarded_forward(self, key: tuple[int, int, int], x: torch.Tensor, hop: Hop,
                               targets: torch.Tensor | None) -> torch.Tensor:
        """Forward with one recompute if the soft-error guard cannot correct a fault; a second
        uncorrectable fault fails the step with a SOFT_ERROR marker the coordinator counts."""
        for attempt in range(2):
            try:
                return await self.compute.run(self._observed(self.hosted.serving().forward, "forward", key), key, x,
                                              hop, targets)
            except UncorrectableSoftError as e:
                await self.compute.run(self.hosted.serving().drop_microbatch, key)
                if attempt == 1:
                    raise StepFailed(f"{SOFT_ERROR_MARK} stage={self.hosted.index}: {e}", Kind.SOFT_ERROR) from e
                log.warning("uncorrectable soft error, recomputing microbatch %s: %s", key, e)

    async def _backward_task(self, run: StepRun, mb: int, idx: int, grad: torch.Tensor | None) -> None:
        run.backward_started(mb)
        try:
            if run.grouped and not run.event("forward", mb).is_set():
                # a redo: the next hop's replica sent its gradient before this peer recomputed the forward
                await asyncio.wait_for(run.event("forward", mb).wait(), self.timeouts.step_timeout)
            here = run.mine if run.grouped else [m for m, r in enumerate(run.routes)
                                                 if any(h.stage == self.hosted.index for h in r)]
            await run.backward_turn(mb, here, self.timeouts.step_timeout)
            if run.error is not None:  # (see _forward_task: its gradient would outlive the ABORT that dropped them)
                return
            key = (run.step, run.attempt, mb)
            grad_in = await self.compute.run(self._observed(self.hosted.serving().backward, "backward", key), key, grad,
                                             priority=BACKWARD_FIRST)
            run.mark("backward", mb)
            if self.hook is not None:
                self.hook(PassComputed("backward", *key))
            if run.grouped:  # kept for a sibling's redo, should the previous hop's replica be lost
                run.keep_sent_grad(mb, grad_in)
            self._mb_done(run)
            if idx == 0 and self.hosted.joined().train.schedule == "1f1b":
                self._start_next(run)  # one microbatch finished here: admit the next
            if idx > 0:
                await self._send(run, mb, idx - 1, Backward, grad_in)
        except Exception as e:
            log.exception("backward of microbatch %d failed", mb)
            run.fail(f"backward of microbatch {mb} failed on stage {self.hosted.index}: {type(e).__name__}: {e}")

    def _observed(self, compute: Callable[..., Any], kind: PassKind, key: tuple[int, int, int]) -> Callable[..., Any]:
        """`compute` (a pass of microbatch `key`), preceded on the compute thread by the hook's PassStarting event
        when the peer has a hook."""
        hook = self.hook
        if hook is None:
            return compute

        def observed(*args: Any, **kwargs: Any) -> Any:
            hook(PassStarting(kind, *key))
            return compute(*args, **kwargs)

        return observed

    # ---- neighbours --------------------------------------------------------------------
    async def _send(self, run: StepRun, mb: int, idx: int, kind: type[Forward] | type[Backward],
                    tensor: torch.Tensor) -> None:
        """Send microbatch `mb`'s activation (FORWARD) or gradient (BACKWARD) to the peer of its hop `idx`."""
        stage, target = run.routes[mb][idx].stage, run.peer(mb, idx)
        # checkfree.wirecodec: as computed, 16-bit or int8; from a GPU through pinned memory on a copy stream, awaited
        # without blocking this loop or the compute thread (checkfree.hostcopy)
        tensors = await to_host(encode(tensor, self.hosted.joined().train.wire_dtype))
        run.count_sent(sum(t.numel() * t.element_size() for t in tensors))
        sent = time.time() if self.membership.wan is not None else None  # the receiver measures the hop's one-way delay
        try:
            await self.membership.call(target, kind(step=run.step, attempt=run.attempt, mb=mb, hop=idx, sent=sent),
                                self.timeouts.rpc_timeout, tensors, link=(self.hosted.index, stage))
        except RemoteError as e:
            run.fail(f"stage {stage} refused {kind.rpc}: {e.remote_message}")
        except (TimeoutError, TransportError, OSError) as e:
            if len(run.groups.get(stage, ())) > 1:  # a replica with live siblings: the coordinator moves its work
                log.warning("replica %s of stage %d unreachable (%s); reported", target, stage, str(e)[:200])
                await self._report(run, stage, str(e), peer_id=target, fail=False)
            else:
                await self._report(run, stage, str(e))

    async def _report(self, run: StepRun, stage: int, reason: str, peer_id: str | None = None,
                      fail: bool = True) -> None:
        """Fail the attempt (unless told not to) and tell the coordinator which neighbour could not be reached."""
        if fail:
            run.fail(f"call to stage {stage} failed: {reason}")
        coordinator = self.membership.coordinator
        if coordinator is None:  # (a peer computes a step only once it has joined a coordinator)
            log.warning("could not report the failure of stage %d: no coordinator known", stage)
            return
        try:
            await self.membership.call(coordinator, Report(step=run.step, attempt=run.attempt, stage=stage,
                                                             peer_id=peer_id or run.peers.get(stage, ""),
                                                             reason=reason[:500]), min(5.0, self.timeouts.rpc_timeout))
        except (TransportError, RemoteError) as e:
            log.warning("could not report the failure of stage %d: %s", stage, e)

    def _partner(self, run: StepRun, stage: int) -> str:
        """The peer of `stage` this peer exchanges component gradients with: its peer, or in stage groups the
        replica of the same rank (modulo the group's size; after REDUCE every replica holds the same sums)."""
        if not run.grouped:
            return run.peers[stage]
        theirs, mine = run.groups[stage], run.groups[self.hosted.index]
        return theirs[mine.index(self.membership.me) % len(theirs)]

    async def _sync_components(self, run: StepRun) -> None:
        """CheckFree+: add the partner holder's embedding/head gradient to ours (same sum on both)."""
        holders = edge_holders(self.hosted.joined().num_stages, True)
        for comp in self.hosted.serving().components:
            partner = next(h for h in holders[comp] if h != self.hosted.index)
            try:
                _, (other,) = await self.membership.call(self._partner(run, partner),
                                                  ComponentGrad(step=run.step, attempt=run.attempt, comp=comp),
                                                  self.timeouts.rpc_timeout, link=(self.hosted.index, partner))
            except RemoteError as e:
                if e.kind != Kind.STEP_FAILED:  # (a failed reduce there: the partner is alive, nothing to report)
                    await self._report(run, partner, str(e))
                else:
                    run.fail(f"no {comp} gradient from stage {partner}: {e.remote_message}")
                return
            except (TransportError, ValueError) as e:
                await self._report(run, partner, str(e))
                return
            if run.error is not None:  # aborted while we waited: its gradients are dropped, the next attempt's
                return  # would start from ours (checked and queued with no await between: ABORT's drop comes after)
            mine = run.component_grads[comp]
            run.count_sent(other.numel() * other.element_size())  # counted once per transfer, at the receiver
            await self.compute.run(_add_component_grad, self.hosted.serving(), comp, mine, other)


async def _host_float(t: torch.Tensor) -> float:
    """A device scalar as a Python float: the copy is awaited off the event loop (a plain float() of a CUDA tensor
    would block this loop until the device is done); on a CPU it is float(t)."""
    return float((await to_host([t.detach().reshape(1)]))[0])


def _add_component_grad(worker, comp: str, mine: torch.Tensor, other: torch.Tensor) -> None:
    """CheckFree+: this holder's component gradient plus the partner's (received in host memory), on the compute
    thread (the upload is the compute stream's work, not the event loop's)."""
    worker.set_component_grad(comp, mine + to_device(other, mine.device))
