"""Weights between peers: a live stage serves them, a replacement pulls them and rebuilds.

Serving: GET_WEIGHTS answers with a part of this stage's weights (blocks, embedding, head or
all) and its omega, and for a replicated component its Adam state too; GET_STATE answers with
the stage's full state, for a leaving peer's lossless handover.

Pulling: a replacement told to `recover` a lost stage (peers.assign) builds the stage without
weights on the compute thread while it pulls every source's weights at once, then applies the
library's rebuild (checkfree.recovery.rebuild_stage) on the compute thread; one told to take a
`handover` pulls the leaving peer's full state.
"""

from __future__ import annotations

import asyncio
import logging
import time

import torch

from checkfree.costmodel import stage_params
from checkfree.pipeline import COMPONENTS
from checkfree.messages import (AssignHandover, AssignPromote, AssignRecover, AssignReplica, AssignRestore, GetReplica,
                                GetState, GetWeights, State, Weights)
from checkfree.peer_hook import PeerHook, WeightPulled
from checkfree.protocol import ProtocolError
from checkfree.recovery import Neighbours, rebuild_stage, recovered_optimizer_state
from checkfree.serialize import blob_tensor, tensor_blob
from checkfree.strategies.state import optim_from_wire, optim_to_wire, state_nbytes
from checkfree.worker import StageWorker
from peers.compute import ComputeQueue
from peers.debug import Dumps
from peers.membership import Membership
from peers.stage import HostedStage

__all__ = ["Rebuild"]

log = logging.getLogger(__name__)


class Rebuild:
    """Both ends of a weight transfer for this peer's stage."""

    def __init__(self, membership: Membership, hosted: HostedStage, compute: ComputeQueue, dumps: Dumps,
                 hook: PeerHook | None = None) -> None:
        self.membership, self.hosted, self.compute, self.dumps = membership, hosted, compute, dumps
        self.hook = hook  # the peer's fault hook (checkfree.peer_hook), None in production

    # ---- serving -------------------------------------------------------------------------
    async def on_get_weights(self, get: GetWeights, tensors: list, peer) -> tuple[Weights, list]:
        """This stage's weights of `part`, its omega, and for a replicated component its Adam state."""
        worker = self.hosted.serving()
        part = get.part
        if part not in ("blocks", "embed", "head", "all"):
            raise ProtocolError(f"unknown weights part {part!r}")
        state = await self.compute.run(worker.state_dict)
        items = [(k, v.detach().cpu().contiguous()) for k, v in state.items()
                 if part == "all" or k.startswith(part + ".")]
        stage, omega = self.hosted.index, self.hosted.omega
        if not items:
            raise ProtocolError(f"stage {stage} holds no {part!r} weights")
        if get.step is not None:
            self.dumps.dump(f"served-step{get.step}-stage{stage}-{part}", dict(items), {"omega": omega})
        tensors = [v for _, v in items]
        optim_keys: list = []
        if part in COMPONENTS:  # a replica is recovered exactly: its Adam state comes with it
            optim_keys, optim = optim_to_wire(await self.compute.run(self.hosted.serving().optimizer_state, part + "."))
            tensors += optim
        return Weights(keys=[k for k, _ in items], omega=omega, stage=stage, optim=optim_keys), tensors

    async def on_get_state(self, get: GetState, tensors: list, peer) -> tuple[State, list]:
        """This stage's full state now (weights, Adam, LR scale, omega): a lossless handover."""
        self.hosted.serving()
        blob = await self.compute.run(self.hosted.capture_bytes, get.step)
        return State(stage=self.hosted.index, next_step=self.hosted.next_step), [blob_tensor(blob)]

    # ---- pulling -------------------------------------------------------------------------
    async def take_handover(self, worker: StageWorker, assign: AssignHandover | AssignPromote | AssignReplica) -> dict:
        """Load a leaving peer's (`source`) full state into `worker` (GET_STATE), or the replica a predecessor
        holds of a lost stage (promote: GET_REPLICA): its omega and the bytes moved."""
        stage = assign.stage  # the leaving peer serves the same stage, in the same region
        timeout = self.membership.timeouts.step_timeout + self._allowance(stage, stage)
        ask = GetReplica(step=assign.step) if isinstance(assign, AssignPromote) else GetState(step=assign.step)
        _, (blob,) = await self.membership.call(assign.source, ask, timeout, link=(stage, stage))
        omega = await self.compute.run(self.hosted.load_bytes, worker, tensor_blob(blob))
        return {"omega": omega, "bytes": blob.numel()}

    async def recover(self, stage: int, assign: AssignRecover) -> tuple[StageWorker, dict]:
        """Pull the sources' weights and norms while the compute thread builds the stage (without
        weights: the rebuild brings them), then apply the library's rebuild on the compute thread."""
        plan, peers, step = assign.plan, assign.sources, assign.step
        if any(s not in peers for s in (*plan.sources, *plan.edge_sources.values())):
            raise ProtocolError(f"assign 'sources' names no peer for some stage of the plan {plan.sources}")
        t0 = time.perf_counter()
        worker, (blocks, norms, edges, edge_optim, transfer_s) = await asyncio.gather(
            self.compute.run(self.hosted.build, stage, False), self._pull(stage, plan, peers, step))
        t1 = time.perf_counter()
        coeffs = await self.compute.run(self._rebuild, worker, plan, blocks, norms, edges, edge_optim, step)
        t2 = time.perf_counter()
        log.info("recovery of stage %d: pulls %.3f s, stage ready %.3f s, rebuild %.3f s",
                 stage, transfer_s, t1 - t0, t2 - t1)
        reply = {"coefficients": [coeffs[s] for s in plan.sources] if coeffs else [],
                 "norms": [norms[s] for s in plan.sources], "transfer_s": transfer_s, "rebuild_s": t2 - t1,
                 "bytes": state_nbytes([*blocks.values(), *edges.values(), *edge_optim.values()])}
        await self.compute.run(self.dumps.dump, f"rebuilt-step{step}-stage{plan.stage}", worker.state_dict(), reply)
        return worker, reply

    async def components(self, stage: int, assign: AssignRestore) -> dict[str, tuple[dict, dict]]:
        """The replicated components a restored `stage` takes from live co-holders (`edges`: component ->
        [stage, peer]): weights and Adam state of each, by name (empty without `edges`)."""
        edges = assign.edges
        if not all(c in COMPONENTS for c in edges):
            raise ProtocolError(f"assign 'edges' must map embed/head to [stage, peer], got {list(edges)!r:.200}")
        step = assign.step if assign.serve_step is None else assign.serve_step
        fetched = await asyncio.gather(*(self._fetch(stage, s, pid, comp, step) for comp, (s, pid) in edges.items()))
        return {comp: (w, o) for comp, (w, _, o) in zip(edges, fetched)}

    async def _pull(self, stage: int, plan: Neighbours, peers: dict[int, str],
                    step: int) -> tuple[dict, dict, dict, dict, float]:
        """Every weight pull of `plan` for `stage` at once: blocks and norms per source stage, the replicas'
        weights and Adam state per component, and the seconds it took."""
        t0 = time.perf_counter()
        blocks, edges = await asyncio.gather(
            asyncio.gather(*(self._fetch(stage, s, peers[s], "blocks", step) for s in plan.sources)),
            asyncio.gather(*(self._fetch(stage, s, peers[s], comp, step) for comp, s in plan.edge_sources.items())))
        return ({s: w for s, (w, _, _) in zip(plan.sources, blocks)},
                {s: n for s, (_, n, _) in zip(plan.sources, blocks)},
                {c: w for c, (w, _, _) in zip(plan.edge_sources, edges)},
                {c: o for c, (_, _, o) in zip(plan.edge_sources, edges)}, time.perf_counter() - t0)

    async def _fetch(self, stage: int, source: int, peer_id: str, part: str,
                     step: int) -> tuple[dict[str, torch.Tensor], float, dict]:
        """Stage `source`'s weights of `part` for the rebuild of `stage`, its omega, and (for a component) its
        Adam state."""
        t0 = time.perf_counter()
        timeout = self.membership.timeouts.rpc_timeout + self._allowance(source, stage)
        w, ts = await self.membership.call(peer_id, GetWeights(part=part, step=step), timeout, link=(stage, source))
        log.info("pulled %s of stage %s: %.1f MB in %.3f s", part, w.stage,
                 sum(t.numel() * t.element_size() for t in ts) / 1e6, time.perf_counter() - t0)
        if self.hook is not None:
            self.hook(WeightPulled(part, w.stage))
        if len(w.keys) + len(w.optim) != len(ts):
            raise ProtocolError(f"weights reply has {len(w.keys)} keys and {len(w.optim)} optimizer keys "
                                f"but {len(ts)} tensors")
        return dict(zip(w.keys, ts)), w.omega, optim_from_wire(w.optim, ts[len(w.keys):])

    def _allowance(self, source: int, stage: int) -> float:
        """Extra timeout for pulling stage `source`'s state to `stage` over the run's emulated link: at most its
        weights and two Adam moments in float32 (Membership.allowance; 0 on loopback)."""
        return self.membership.allowance(source, stage, 12 * stage_params(self.hosted.joined())[source])

    def _rebuild(self, worker: StageWorker, plan: Neighbours, blocks: dict, norms: dict, edges: dict,
                 edge_optim: dict, step: int) -> dict[int, float]:
        """On the compute thread: the library's rebuild from the pulled weights, loaded into `worker`
        with a fresh optimizer. Returns the coefficient of each source stage."""
        cfg = self.hosted.joined()
        rc = cfg.recovery
        state, coeffs = rebuild_stage(plan, worker.state_dict(), blocks, norms, edges, eps=rc.eps,
                                      seed=cfg.train.seed + step, std=cfg.model.init_std)
        if rc.optimizer == "own":  # no peer keeps a copy of another stage's Adam state (yet: snapshots may)
            log.warning("recovery.optimizer own: no copy of stage %d's Adam state here; it starts fresh", plan.stage)
        worker.load_recovered(state, rc.lr_scale, recovered_optimizer_state(plan, edge_optim))
        return coeffs
