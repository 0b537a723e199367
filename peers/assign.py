"""ASSIGN: the coordinator tells a standby peer which stage to serve, and where its state comes from.

The modes of an assignment:

* `fresh`: a newly initialised stage (the start of a run).
* `recover`: rebuild a lost stage from live neighbours' weights (CheckFree; peers.rebuild).
* `restore`: take the lost stage's snapshot (rollback strategies; peers.snapshots); with `edges`, its
  embedding / head from their live co-holders, and with `serve_step`, serve from that step on
  (checkfree+snap: a lone stage restored, nobody rolls back).
* `handover`: take a leaving peer's exact state (peers.rebuild), and the copies it held (peers.snapshots; baft:
  its backups in flight, peers.backups).
* `promote`: take the lost stage's replica from its predecessor (`source`; redundant computation).
* `replica`: join a stage group: a live replica's (`source`) exact state, as a handover.

With `release`, a replica of a stage group first lets its stage go (no standby was left to rebuild a lost
stage; its group keeps the other replicas).
* `load`: a resumed run's saved state, carried by the message itself.

The reply tells the coordinator what the assignment cost (seconds, bytes moved) and, for a
recovery, the coefficients and norms it used.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from checkfree.messages import (AssignHandover, AssignLoad, AssignPromote, AssignRecover, AssignReplica,
                                AssignRequest, AssignRestore, Assigned)
from checkfree.protocol import ProtocolError
from peers.backups import Backups
from peers.checks import check_blob
from peers.compute import ComputeQueue
from peers.debug import Dumps
from peers.rebuild import Rebuild
from peers.snapshots import Snapshots
from peers.stage import HostedStage

__all__ = ["Assignment"]

log = logging.getLogger(__name__)


class Assignment:
    """Makes this standby peer serve the stage the coordinator assigns it."""

    def __init__(self, hosted: HostedStage, compute: ComputeQueue, rebuild: Rebuild, snapshots: Snapshots,
                 dumps: Dumps, release: Callable[[], Awaitable[None]] | None = None,
                 backups: Backups | None = None) -> None:
        self.hosted, self.compute, self.rebuild, self.snapshots, self.dumps = hosted, compute, rebuild, snapshots, dumps
        self.backups = backups  # baft: a handover takes the leaving peer's backups in flight
        self.release = release  # lets this peer's stage go (a stage group's replica moved to rebuild a lost stage)
        # how long an ASSIGN waits for this peer's JOIN reply (see HostedStage.joining)
        self.timeout = rebuild.membership.timeouts.rpc_timeout

    async def on_assign(self, assign: AssignRequest, tensors: list, peer) -> tuple[Assigned, list]:
        cfg, stage = await self.hosted.joining(self.timeout), assign.stage
        if self.hosted.worker is not None and assign.release and self.release is not None:
            log.info("leaving stage %d's group to serve stage %d", self.hosted.index, stage)
            await self.release()
        if self.hosted.worker is not None:
            raise ProtocolError(f"this peer already hosts stage {self.hosted.index}")
        if not 0 <= stage < cfg.num_stages:
            raise ProtocolError(f"stage {stage} out of range for {cfg.num_stages} stages")
        t0 = time.perf_counter()
        if self.snapshots.streams is not None:  # snap: a new stage here mirrors no copy (a restore adopts one)
            self.snapshots.streams.reset()
        figures: dict[str, Any] = {}  # the Assigned reply's fields, and the stage's omega
        if isinstance(assign, AssignRecover):  # builds the stage while it pulls the weights
            worker, figures = await self.rebuild.recover(stage, assign)
        else:
            worker = await self.compute.run(self.hosted.build, stage)
        step = assign.step
        if isinstance(assign, AssignRestore):
            donors = await self.rebuild.components(stage, assign)
            figures = await self.snapshots.restore_new(worker, assign, donors)
            step = assign.step if assign.serve_step is None else assign.serve_step
            await self.compute.run(self.dumps.dump, f"restored-step{step}-stage{stage}", worker.state_dict(),
                                   figures)
        elif isinstance(assign, AssignLoad):  # resuming a run: the saved state travels with the message
            blob = check_blob(tensors, "the saved state of assign mode 'load'")
            try:
                figures["omega"] = await self.compute.run(self.hosted.load_bytes, worker, blob)
            except (ValueError, KeyError, RuntimeError) as e:
                raise ProtocolError(f"the saved state of stage {stage} does not load: {e}") from None
        elif isinstance(assign, (AssignHandover, AssignPromote, AssignReplica)):
            figures = await self.rebuild.take_handover(worker, assign)
            if isinstance(assign, AssignHandover) and assign.held:  # the snapshots the leaving peer held
                figures["bytes"] += await self.snapshots.take_held(assign.source, assign.held, stage)
            if isinstance(assign, AssignHandover) and assign.backup is not None and self.backups is not None:
                figures["bytes"] += await self.backups.take_over(assign.source, assign.backup)
        self.hosted.serve(worker, figures.pop("omega", 0.0), step, assign.epoch)
        log.info("serving stage %d (%s)", stage, type(assign).__struct_config__.tag)
        return Assigned(stage=stage, assign_s=time.perf_counter() - t0, **figures), []
