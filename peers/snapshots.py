"""Snapshots of the rollback strategies: Gemini keeps them in peers' memory, checkpoint in files.

On the coordinator's SNAPSHOT a stage captures its full state (weights, Adam, LR scale, RNG,
data position) and writes it to the shared storage, or keeps it and sends it to the peers that
hold it for others (STORE_SNAPSHOT; at most one per stage). A replacement assigned in mode
`restore` takes the lost stage's snapshot from storage or a holder (FETCH_SNAPSHOT); on RESTORE
a live stage rolls back to its own. Files: `checkfree.strategies.storage` (the simulator's layout).
"""

from __future__ import annotations

import time
from typing import Any

from checkfree.protocol import RPC, ProtocolError, require
from checkfree.serialize import blob_tensor, tensor_blob
from checkfree.strategies import storage
from checkfree.strategies.state import state_nbytes
from checkfree.worker import StageWorker
from peers.checks import check_blob
from peers.compute import ComputeQueue
from peers.membership import Membership
from peers.parity import Parity
from peers.stage import HostedStage
from peers.step import StepTracker

__all__ = ["Snapshots"]


class Snapshots:
    """The snapshots this peer holds, its own stage's and others', by stage."""

    def __init__(self, membership: Membership, hosted: HostedStage, steps: StepTracker,
                 compute: ComputeQueue, companion_host: str = "127.0.0.1") -> None:
        self.net, self.hosted, self.steps, self.compute = membership, hosted, steps, compute
        self.held: dict[int, tuple[int, Any]] = {}  # stage -> (step, serialized full state: a bytes-like object)
        self.parity = Parity(membership, hosted, self.held, companion_host)  # reft

    def steps_held(self) -> dict[str, int]:
        """The step of each snapshot held here, by stage (for a new coordinator)."""
        return {str(k): v[0] for k, v in self.held.items()}

    # ---- handlers --------------------------------------------------------------------
    async def on_snapshot(self, header: dict, tensors: list, peer) -> tuple[dict, list]:
        """Capture this stage's full state as of `step` and keep it in memory (if this peer is among its `holders`)
        and send it to the other holders, or write it to `storage` as a file."""
        stage = self.hosted.serving().index
        t0 = time.perf_counter()
        blob = await self.compute.run(self.hosted.capture_bytes, header["step"])
        sent = 0
        if isinstance(header.get("storage"), str):  # the coordinator seals it once every stage has written
            await self.compute.run(storage.write_stage, header["storage"], header["step"], stage, blob)
        elif isinstance(header.get("parity"), dict):  # reft: own copy here, a chunk to each group member
            spec = header["parity"]
            if not isinstance(spec.get("group"), list) or not isinstance(spec.get("index"), int):
                raise ProtocolError(f"snapshot 'parity' must be {{group: [peers], index: int}}, got {spec!r:.200}")
            self.held[stage] = (header["step"], blob)
            sent = await self.parity.snapshot(header["step"], blob, spec["group"], spec["index"])
            return {"bytes": len(blob), "sent": sent, "seconds": time.perf_counter() - t0,
                    "companion": self.parity.companion_addr}, []
        else:
            require(header, holders=list)
            if self.net.me in header["holders"]:  # gemini keeps its own copy (a rollback of a live stage reads it)
                self.held[stage] = (header["step"], blob)
            payload = blob_tensor(blob)
            for pid in header["holders"]:
                if pid != self.net.me:
                    await self.net.call(pid, RPC.STORE_SNAPSHOT, self.net.t.step_timeout, [payload], owner=stage,
                                        step=header["step"])
                    sent += len(blob)
        return {"bytes": len(blob), "sent": sent, "seconds": time.perf_counter() - t0}, []

    async def on_store_snapshot(self, header: dict, tensors: list, peer) -> tuple[dict, list]:
        """Hold another stage's snapshot (bounded: at most one blob per stage)."""
        cfg = self.hosted.cfg
        if cfg is None or not 0 <= header["owner"] < cfg.num_stages:
            raise ProtocolError(f"snapshot of stage {header['owner']} out of range for "
                                f"{cfg.num_stages if cfg else '?'} stages")
        self.held[header["owner"]] = (header["step"], check_blob(tensors, "a snapshot"))
        return {"ok": True, "held": sorted(self.held)}, []

    async def on_fetch_snapshot(self, header: dict, tensors: list, peer) -> tuple[dict, list]:
        """Hand a held snapshot to a replacement."""
        held = self.held.get(header["owner"])
        if held is None or held[0] != header["step"]:
            raise ProtocolError(f"no snapshot of stage {header['owner']} at step {header['step']} here "
                                f"(have: {None if held is None else held[0]})")
        return {"ok": True}, [blob_tensor(held[1])]

    async def on_restore(self, header: dict, tensors: list, peer) -> tuple[dict, list]:
        """Roll this live stage back to its snapshot at `step` (own memory or storage), or
        to its initial state for step 0 with source "init"."""
        stage = self.hosted.serving().index
        if header["step"] == 0 and header.get("source") == "init":
            self.hosted.rolled_back(0.0, 0, await self.compute.run(self.hosted.build, stage))
        else:
            blob = await self._blob(stage, header)
            omega = await self.compute.run(self.hosted.load_bytes, self.hosted.worker, blob)
            self.hosted.rolled_back(omega, header["step"])
        self.steps.reset()
        return {"ok": True}, []

    def keep(self, stage: int, step: int, blob: bytes) -> None:
        """Hold `stage`'s snapshot (or backup) of `step` (at most one per stage)."""
        self.held[stage] = (step, blob)

    # ---- a replacement's side ----------------------------------------------------------
    async def restore_new(self, worker: StageWorker, header: dict, donors: dict | None = None) -> dict:
        """A replacement takes the lost stage's snapshot (assign mode `restore`), its replicated components
        from `donors` (component -> (weights, Adam state)) when given."""
        require(header, step=int)
        t0 = time.perf_counter()
        if header["step"] == 0 and header.get("source") == "init":
            return {"omega": 0.0, "restore_s": 0.0, "bytes": 0}
        origin = {}
        if isinstance(header.get("parity"), dict):  # reft: from the lost peer's companion, or decoded from parity
            blob, origin["restored_from"], fetched = await self.parity.decode(header)
            self.held[worker.index] = (header["step"], blob)  # this replacement's own snapshot now, as the lost one's
        else:
            blob = await self._blob(worker.index, header)
            fetched = len(blob)
        norm = await self.compute.run(self.hosted.load_bytes, worker, blob, donors)
        moved = sum(state_nbytes(list(d)) for d in (donors or {}).values())
        return {"omega": norm, "restore_s": time.perf_counter() - t0, "bytes": fetched + moved, **origin}

    async def _blob(self, stage: int, header: dict) -> Any:
        """The snapshot bytes of `stage` at `step`: own memory, a holder peer, or storage."""
        step = header["step"]
        if isinstance(header.get("storage"), str):
            return storage.read_stage(header["storage"], step, stage)
        source = header.get("source")
        if source in (None, self.net.me):
            held = self.held.get(stage)
            if held is None or held[0] != step:
                raise ProtocolError(f"no own snapshot of stage {stage} at step {step}")
            return held[1]
        _, (blob,) = await self.net.call(source, RPC.FETCH_SNAPSHOT, self.net.t.step_timeout, owner=stage, step=step)
        return tensor_blob(blob)
