"""Stage groups on a peer: several replicas serve one stage and split each step's microbatches.

* REROUTE (from the coordinator, once a replica of some stage is gone in the middle of a step): the lost
  replica's hops go to a live sibling. Every peer of the step moves them in its table; the sibling (`to`)
  then redoes each of those microbatches at its stage: the input activation is pulled from the previous hop's
  peer (GET_PASS: every peer of a group step keeps what it sent until the step ends), the forward is computed
  and sent on; the next hop's peer, which may have seen this microbatch already, then sends its kept gradient
  again instead of computing anything twice, and a previous hop that already has its gradient ignores the
  repeat. The step completes with the same global batch and no attempt is aborted.
* REDUCE (after every microbatch is done, before COMMIT): the replicas of a stage sum their gradients with a
  gloo all-reduce (torch.distributed's `ProcessGroupGloo` over the coordinator's TCPStore, formed once per
  group membership and kept while the group stays the same), in REDUCE_BUCKETS buckets (one gloo call each; every
  member cuts the flat gradient alike), into the gradients themselves. The
  gradients as they were before are kept: if any member fails mid-reduce (the others' gloo calls raise within
  milliseconds of a SIGKILL), every survivor restores them — a partly summed gradient is never committed — and
  the coordinator has a sibling redo the lost replica's microbatches and reduces again in the smaller group.
  Under CheckFree+ the embedding/head holders exchange their component gradients after the reduce.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import socket
import time

import torch.distributed as dist

from checkfree.messages import GetPass, Ok, Reduce, Reduced, Reroute, Rerouted
from checkfree.peer_hook import BucketReduced, PeerHook
from checkfree.protocol import Kind, ProtocolError, StepFailed
from checkfree.wirecodec import encode
from peers.checks import check_activation, check_hop
from peers.compute import ComputeQueue
from peers.membership import Membership
from peers.passes import Passes
from peers.stage import HostedStage
from peers.step import StepRun, StepTracker

__all__ = ["StageGroup", "REDUCE_BUCKETS"]

REDUCE_BUCKETS = 2  # gloo all-reduce calls per REDUCE, each over one part of the flat gradient

_GlooOptions = dist.ProcessGroupGloo._Options  # a group's options: its devices (where it listens), its timeout

log = logging.getLogger(__name__)


class StageGroup:
    """This peer as one replica of its stage's group."""

    def __init__(self, membership: Membership, hosted: HostedStage, steps: StepTracker, compute: ComputeQueue,
                 passes: Passes, hook: PeerHook | None = None) -> None:
        self.membership, self.hosted, self.steps, self.compute, self.passes = membership, hosted, steps, compute, passes
        self.hook = hook  # the peer's fault hook (checkfree.peer_hook), None in production
        self.timeouts = membership.timeouts
        self._pg: dist.ProcessGroupGloo | None = None
        self._prefix: str | None = None  # the store and group membership `_pg` was formed for

    # ---- a lost replica's microbatches ------------------------------------------------------
    async def on_reroute(self, reroute: Reroute, tensors: list, peer) -> tuple[Rerouted, list]:
        """Move the lost replica's (`dead`) hops of `mbs` to `to`; if that is this peer, redo them and answer
        once they are done (their losses, for a head stage)."""
        run = await self.steps.current(reroute.step, reroute.attempt)
        if not run.grouped:
            raise ProtocolError("REROUTE of a step without stage groups")
        dead, to, mbs = reroute.dead, reroute.to, reroute.mbs
        if not all(0 <= mb < len(run.routes) for mb in mbs):
            raise ProtocolError(f"REROUTE names microbatches outside the step: {mbs!r:.200}")
        new = run.reroute(dead, to, mbs, self.membership.me)
        if to != self.membership.me:
            return Rerouted(), []
        t0 = time.perf_counter()
        for mb in new:
            idx = [h.stage for h in run.routes[mb]].index(self.hosted.index)
            self.passes._spawn(run, self._redo(run, mb, idx))
        try:
            await asyncio.wait_for(run.done.wait(), self.timeouts.step_timeout)
        except TimeoutError:
            run.fail(f"the redo of microbatches {new} did not finish within step_timeout")
        if run.error is not None:
            raise StepFailed(run.error, run.kind)
        return Rerouted(losses={mb: run.losses[mb] for mb in new if mb in run.losses}, redone=len(new),
                        redo_s=round(time.perf_counter() - t0, 6), bytes_sent=run.bytes_sent), []

    async def _redo(self, run: StepRun, mb: int, idx: int) -> None:
        """Compute microbatch `mb` at this stage for a lost sibling: its input from the previous hop's peer."""
        x = None
        if idx > 0:
            prev = run.peer(mb, idx - 1)
            try:
                _, ts = await self.membership.call(prev, GetPass(step=run.step, attempt=run.attempt, mb=mb, hop=idx - 1),
                                            self.timeouts.rpc_timeout, link=(self.hosted.index, run.routes[mb][idx - 1].stage))
                x = check_activation(ts, "activation", self.hosted.joined())
            except Exception as e:  # noqa: BLE001 - the attempt fails; the coordinator sees why
                run.fail(f"redo of microbatch {mb}: its input from {prev} could not be had: {e}")
                return
        if mb in run.started:  # the previous hop pushed it meanwhile (its table moved first)
            return
        await self.passes._forward_task(run, mb, idx, x)

    async def on_get_pass(self, get: GetPass, tensors: list, peer) -> tuple[Ok, list]:
        """The activation this peer sent on for microbatch `mb` (waiting until it has computed it)."""
        run = await self.steps.current(get.step, get.attempt)
        if not run.grouped:
            raise ProtocolError("GET_PASS of a step without stage groups")
        mb, idx = check_hop(run, get, self.hosted.index, self.membership.me)
        try:
            await asyncio.wait_for(run.event("sent", mb).wait(), self.timeouts.rpc_timeout)
        except TimeoutError:
            raise ProtocolError(f"microbatch {mb} has no activation here within rpc_timeout") from None
        out = encode(run.sent[mb], self.hosted.joined().train.wire_dtype)
        run.count_sent(sum(t.numel() * t.element_size() for t in out))
        return Ok(), out

    # ---- the gradient all-reduce -----------------------------------------------------------
    async def on_reduce(self, reduce: Reduce, tensors: list, peer) -> tuple[Reduced, list]:
        """Sum this step's gradients over the stage's group (rank `rank` of `size`); then, under CheckFree+,
        exchange the component gradients with the partner stage."""
        run = await self.steps.current(reduce.step, reduce.attempt)
        if not run.ready() or not run.grouped:
            raise ProtocolError(f"step {run.step} is not ready to reduce ({run.error or 'still running'})")
        run.reducing()
        t0 = time.perf_counter()
        try:
            nbytes = await self.compute.run(self._reduce, run, reduce)
        except BaseException as e:
            # the partner stage's COMPONENT_GRAD waiting for these sums hears now that there are none (it waited
            # out its RPC timeout, 20 s, holding the coordinator's retry of the REDUCE back)
            run.reduce_failed(f"the gradient reduce of stage {self.hosted.index} failed here: {e}")
            raise
        reduce_s = time.perf_counter() - t0
        worker = self.hosted.serving()
        if self.hosted.plus:  # the group's sums, which the partner stage's COMPONENT_GRAD waits for
            run.keep_component_grads({c: worker.component_grad(c) for c in worker.components})
        run.reduce_succeeded()
        if self.hosted.plus:
            await self.passes._sync_components(run)
            if run.error is not None:
                raise StepFailed(run.error, run.kind)
        return Reduced(reduce_s=round(reduce_s, 6), reduce_bytes=nbytes), []

    def _reduce(self, run: StepRun, reduce: Reduce) -> int:
        """On the compute thread: restore the gradients of a failed earlier reduce, keep them, all-reduce them in
        buckets, and set the sums; on any failure the kept gradients are restored and StepFailed raised."""
        worker = self.hosted.serving()
        if run.pre_reduce is not None:
            worker.set_flat_grad(run.pre_reduce)
        flat = worker.flat_grad()
        run.keep_pre_reduce(flat.clone())
        if reduce.size == 1:
            return 0
        try:
            pg = self._group(reduce)
            parts = flat.chunk(REDUCE_BUCKETS)
            for i, part in enumerate(parts):
                pg.allreduce([part]).wait()
                if self.hook is not None:
                    self.hook(BucketReduced(run.step, run.attempt, i, len(parts)))
        except Exception as e:
            self.close()  # (a group with a dead member cannot be used again)
            worker.set_flat_grad(run.pre_reduce)
            run.keep_pre_reduce(None)  # restored: a sibling's redo may add to them before the next reduce
            raise StepFailed(f"the gradient all-reduce of stage {self.hosted.index} failed: {str(e)[:300]}",
                             Kind.STEP_FAILED) from None
        worker.set_flat_grad(flat)
        return flat.numel() * flat.element_size()

    def _group(self, reduce: Reduce) -> dist.ProcessGroupGloo:
        """The gloo group of this membership (`prefix`), formed on first use: every member connects through the
        coordinator's TCPStore (`store`: host:port)."""
        key = f"{reduce.store}/{reduce.prefix}"  # (a new coordinator's store numbers its groups afresh)
        if self._pg is not None and self._prefix == key:
            return self._pg
        if self._pg is not None:
            self._pg.abort()
        self._pg = None
        host, _, port = reduce.store.rpartition(":")
        timeout = datetime.timedelta(seconds=self.timeouts.rpc_timeout)
        store = dist.TCPStore(host, int(port), None, False, timeout=timeout)
        options = _GlooOptions()
        options._timeout = timeout
        # gloo's default device is the address this machine's hostname resolves to, the loopback in a network
        # namespace, which the other members cannot reach: listen where the route to the store leaves from
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=route_ip(host, int(port)))]
        self._pg = dist.ProcessGroupGloo(dist.PrefixStore(reduce.prefix, store), reduce.rank, reduce.size, options)
        self._prefix = key
        return self._pg

    def close(self) -> None:
        if self._pg is not None:
            self._pg.abort()
            self._pg = None


def route_ip(host: str, port: int) -> str:
    """This machine's address on the route to `host`:`port`: the one the other members of a gloo group reach it at
    when they reach the store there (no packet is sent)."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, kind, proto) as s:
        s.connect(addr)
        return s.getsockname()[0]
