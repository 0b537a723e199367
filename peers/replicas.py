"""Redundant computation (Bamboo; `--strategy redundant`): this peer keeps a current replica of its ring
successor's stage (weights and Adam state) and runs the successor's forward pass on its own activations.

* TAKE_REPLICA (from the coordinator): copy the successor's full state now (GET_STATE from its peer); the
  replica's stage is built without a soft-error guard (its forwards are redundant; its updates come from the
  successor's gradients, not from them).
* Every microbatch this stage forwards, the replica forwards too (the successor's input: this stage's output;
  for the last stage, whose successor is stage 0, the microbatch's tokens), on the compute thread after this
  stage's own work, results dropped: the extra compute Bamboo pays, measured per step (`redundant_s`).
* At COMMIT the stage ships its gradients (before clipping) to its predecessor (REPLICA_GRAD), which applies
  the same clip and Adam step to its replica: the replica stays bit-identical to the stage.
* GET_REPLICA: the replica's full state, for the replacement of a lost successor (assign mode `promote`): no
  step is lost.
"""

from __future__ import annotations

import logging
import time

import torch

from checkfree.recovery import OmegaWindow
from checkfree.net.transport import TransportError
from checkfree.pipeline import Hop
from checkfree.messages import GetReplica, GetState, Ok, ReplicaGrad, ReplicaTaken, State, TakeReplica
from checkfree.protocol import ProtocolError
from checkfree.serialize import blob_tensor, state_to_bytes, tensor_blob
from checkfree.strategies.state import capture_worker
from checkfree.worker import StageWorker
from peers.compute import ComputeQueue
from peers.membership import Membership
from peers.stage import HostedStage

__all__ = ["Replicas"]

log = logging.getLogger(__name__)

REDUNDANT_LAST = 100  # compute priority: after this stage's own forwards and backwards


class Replicas:
    """The replica of the successor stage this peer holds (redundant computation only)."""

    def __init__(self, membership: Membership, hosted: HostedStage, compute: ComputeQueue) -> None:
        self.membership, self.hosted, self.compute = membership, hosted, compute
        self.replica: StageWorker | None = None
        self.omega = 0.0  # the replica's omega, windowed as its stage's own (recovery.omega_window)
        self._window = OmegaWindow()
        self.seconds = 0.0  # redundant forwards of the current step
        self.shipped = 0  # gradient bytes shipped to the predecessor by the last commit

    @property
    def active(self) -> bool:
        return self.hosted.redundant and self.hosted.worker is not None

    def successor(self) -> int:
        return (self.hosted.index + 1) % self.hosted.joined().num_stages

    def holder(self) -> int:
        return (self.hosted.index - 1) % self.hosted.joined().num_stages

    # ---- handlers --------------------------------------------------------------------
    async def on_take_replica(self, take: TakeReplica, tensors: list, peer) -> tuple[ReplicaTaken, list]:
        """Copy the successor's full state from its peer (`source`) into a new replica."""
        if not self.active:
            raise ProtocolError("this peer runs no redundant computation (strategy, or no stage)")
        succ = self.successor()
        _, (blob,) = await self.membership.call(take.source, GetState(step=take.step), self.membership.timeouts.step_timeout,
                                         link=(self.hosted.index, succ))
        worker = await self.compute.run(self.hosted.build, succ, True, False)
        self.omega = await self.compute.run(self.hosted.load_bytes, worker, tensor_blob(blob))
        self._window = OmegaWindow(self.hosted.joined().recovery.omega_window, self.omega or None)
        self.replica = worker
        log.info("holding a replica of stage %d (%.1f MB)", succ, blob.numel() / 1e6)
        return ReplicaTaken(stage=succ, bytes=blob.numel()), []

    async def on_replica_grad(self, grad: ReplicaGrad, tensors: list, peer) -> tuple[Ok, list]:
        """The successor's gradients of committed step `step`: the replica takes the same Adam step."""
        replica = self.replica
        if replica is None or grad.stage != replica.index:
            raise ProtocolError(f"no replica of stage {grad.stage} here")
        names = grad.names
        params = dict(replica.module.named_parameters())
        if len(names) != len(tensors) or any(n not in params for n in names):
            raise ProtocolError(f"replica gradients: {len(tensors)} tensors for names {str(names)[:200]}")
        for n, g in zip(names, tensors):
            if g.shape != params[n].shape or g.dtype != params[n].dtype:
                raise ProtocolError(f"replica gradient {n}: {g.dtype} {tuple(g.shape)}, expected "
                                    f"{params[n].dtype} {tuple(params[n].shape)}")
        stats = await self.compute.run(self._apply, replica, names, tensors, grad.step)
        if not stats.skipped:
            self.omega = self._window.add(stats.omega(self.hosted.joined().recovery))
        return Ok(), []

    async def on_get_replica(self, get: GetReplica, tensors: list, peer) -> tuple[State, list]:
        """The replica's full state now (weights, Adam, LR scale, omega), for a promotion."""
        if self.replica is None:
            raise ProtocolError("this peer holds no replica")
        blob = await self.compute.run(self._capture, get.step)
        return State(stage=self.replica.index), [blob_tensor(blob)]

    # ---- the step --------------------------------------------------------------------
    async def forward(self, x: torch.Tensor) -> None:
        """The successor's forward of one microbatch on `x` (its input), after this stage's own work."""
        replica = self.replica
        if replica is None:
            return
        last = self.hosted.joined().num_stages - 1
        hop = Hop(stage=replica.index, embed=replica.index == 0, head=replica.index == last)
        t0 = time.perf_counter()
        await self.compute.run(self._infer, replica, x, hop, priority=REDUNDANT_LAST)
        self.seconds += time.perf_counter() - t0

    def take_seconds(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds

    def gradients(self) -> tuple[list[str], list[torch.Tensor]]:
        """On the compute thread, before the own step: this stage's gradients, for its predecessor's replica."""
        named = [(n, p.grad) for n, p in self.hosted.serving().module.named_parameters() if p.grad is not None]
        return [n for n, _ in named], [g.detach().cpu().clone() for _, g in named]

    async def ship(self, step: int, peers: dict[int, str], grads: tuple[list[str], list[torch.Tensor]]) -> None:
        """Send a committed step's gradients to the predecessor holding this stage's replica (a dead holder
        holds no replica any more: a warning, the commit stands)."""
        holder = peers.get(self.holder())
        names, tensors = grads
        self.shipped = 0
        if holder is None:
            return
        try:
            await self.membership.call(holder, ReplicaGrad(step=step, stage=self.hosted.index, names=names),
                                self.membership.timeouts.rpc_timeout, tensors, link=(self.hosted.index, self.holder()))
            self.shipped = sum(t.numel() * t.element_size() for t in tensors)
        except (TransportError, TimeoutError) as e:
            log.warning("replica gradients of step %d not delivered to stage %d's peer: %s", step, self.holder(), e)

    # ---- on the compute thread --------------------------------------------------------
    @staticmethod
    def _infer(replica: StageWorker, x: torch.Tensor, hop: Hop) -> None:
        with torch.no_grad():
            replica.infer(x, hop)

    @staticmethod
    def _apply(replica: StageWorker, names: list[str], grads: list[torch.Tensor], step: int):
        replica.set_grads(dict(zip(names, grads)))
        return replica.step(step)

    def _capture(self, step: int) -> bytearray:
        assert self.replica is not None
        return state_to_bytes(capture_worker(self.replica, step, self.omega, clone=False))
