"""ASSIGN: the coordinator tells a standby peer which stage to serve, and where its state comes from.

The modes of an assignment:

* `fresh`: a newly initialised stage (the start of a run).
* `recover`: rebuild a lost stage from live neighbours' weights (CheckFree; peers.recovery).
* `restore`: take the lost stage's snapshot (rollback strategies; peers.snapshots); with `edges`, its
  embedding / head from their live co-holders, and with `serve_step`, serve from that step on
  (checkfree+snap: a lone stage restored, nobody rolls back).
* `handover`: take a leaving peer's exact state (peers.recovery).
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

from checkfree.protocol import RPC, ProtocolError, require
from checkfree.worker import StageWorker
from peers.checks import check_blob
from peers.compute import ComputeQueue
from peers.debug import DebugHooks
from peers.recovery import Recovery
from peers.snapshots import Snapshots
from peers.stage import HostedStage

__all__ = ["MODES", "Assignment"]

log = logging.getLogger(__name__)

MODES = ("fresh", "recover", "restore", "handover", "load", "promote", "replica")


class Assignment:
    """Makes this standby peer serve the stage the coordinator assigns it."""

    def __init__(self, hosted: HostedStage, compute: ComputeQueue, recovery: Recovery, snapshots: Snapshots,
                 debug: DebugHooks, release: Callable[[], Awaitable[None]] | None = None) -> None:
        self.hosted, self.compute, self.recovery, self.snapshots, self.debug = (hosted, compute, recovery,
                                                                                snapshots, debug)
        self.release = release  # lets this peer's stage go (a stage group's replica moved to rebuild a lost stage)
        # how long an ASSIGN waits for this peer's JOIN reply (see HostedStage.joining)
        self.timeout = recovery.net.t.rpc_timeout

    async def on_assign(self, header: dict, tensors: list, peer) -> tuple[dict, list]:
        cfg, stage, mode = await self.hosted.joining(self.timeout), header["stage"], header["mode"]
        if self.hosted.worker is not None and header.get("release") is True and self.release is not None:
            log.info("leaving stage %d's group to serve stage %d", self.hosted.index, stage)
            await self.release()
        if self.hosted.worker is not None:
            raise ProtocolError(f"this peer already hosts stage {self.hosted.index}")
        if not 0 <= stage < cfg.num_stages:
            raise ProtocolError(f"stage {stage} out of range for {cfg.num_stages} stages")
        if mode not in MODES:
            raise ProtocolError(f"unknown assign mode {mode!r}")
        t0 = time.perf_counter()
        reply: dict[str, Any] = {"stage": stage}
        self.debug.arm_rebuild_kill(header)
        if mode == "recover":  # builds the stage while it pulls the weights
            worker, rebuilt = await self.recovery.recover(stage, header)
            reply.update(rebuilt)
        else:
            worker = await self.compute.run(self.hosted.build, stage)
        if mode == "restore":
            donors = await self.recovery.components(stage, header)
            reply.update(await self.snapshots.restore_new(worker, header, donors))
            await self.compute.run(self.debug.dump, f"restored-step{header.get('serve_step', header['step'])}"
                                   f"-stage{stage}", worker.state_dict(), reply)
        elif mode == "load":  # resuming a run: the saved state travels with the message
            require(header, step=int)
            blob = check_blob(tensors, "the saved state of assign mode 'load'")
            try:
                reply["omega"] = await self.compute.run(self.hosted.load_bytes, worker, blob)
            except (ValueError, KeyError, RuntimeError) as e:
                raise ProtocolError(f"the saved state of stage {stage} does not load: {e}") from None
        elif mode in ("handover", "promote", "replica"):
            reply.update(await self.recovery.take_handover(worker, header, RPC.GET_REPLICA if mode == "promote"
                                                           else RPC.GET_STATE))
        self.debug.arm_delay(header)
        self._serve(worker, reply.pop("omega", 0.0), header.get("serve_step", header.get("step", 0)))
        reply["assign_s"] = time.perf_counter() - t0
        log.info("serving stage %d (%s)", stage, mode)
        return reply, []

    def _serve(self, worker: StageWorker, omega: float, step: object) -> None:
        """Start serving `worker`, its weights ready for `step` (0 unless the message says)."""
        self.hosted.serve(worker, omega, step if isinstance(step, int) else 0)
