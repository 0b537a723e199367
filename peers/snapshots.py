"""Snapshots of the rollback strategies: Gemini keeps them in peers' memory, checkpoint in files.

On the coordinator's SNAPSHOT a stage captures its full state (weights, Adam, LR scale, RNG,
data position) and writes it to the shared storage, or keeps it and sends it to the peers that
hold it for others (STORE_SNAPSHOT; at most one per stage). A replacement assigned in mode
`restore` takes the lost stage's snapshot from storage or a holder (FETCH_SNAPSHOT); on RESTORE
a live stage rolls back to its own. Files: `checkfree.strategies.storage` (the simulator's layout).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from checkfree.baselines.parity import BytesLike
from checkfree.messages import (AssignRestore, FetchSnapshot, InitialState, KeepHolders, KeepParity, KeepStorage, Ok,
                                Origin, OwnCopy, ParityCopy, PeerCopy, Restore, Snapshot, Snapshotted, StorageCopy,
                                Stored, StoreSnapshot)
from checkfree.net.errors import RemoteError
from checkfree.protocol import Kind, ProtocolError
from checkfree.serialize import blob_tensor, state_from_bytes, tensor_blob
from checkfree.snapcodec import restore_state
from checkfree.strategies import storage
from checkfree.strategies.state import state_nbytes
from checkfree.worker import StageWorker
from peers.checks import check_blob
from peers.compute import ComputeQueue
from peers.membership import Membership
from peers.reft_parity import Parity
from peers.stage import HostedStage
from peers.step import StepTracker
from peers.streamed_copies import Streams, is_copy_blob

__all__ = ["Snapshots"]

log = logging.getLogger(__name__)


class Snapshots:
    """The snapshots this peer holds, its own stage's and others', by stage."""

    def __init__(self, membership: Membership, hosted: HostedStage, steps: StepTracker,
                 compute: ComputeQueue, companion_host: str = "127.0.0.1", streams: Streams | None = None) -> None:
        self.membership, self.hosted, self.steps, self.compute = membership, hosted, steps, compute
        self.streams = streams  # snap: the compressed copies held here, and this stage's mirror
        self.held: dict[int, tuple[int, Any]] = {}  # stage -> (step, serialized full state: a bytes-like object)
        # reft: stage -> this peer's own copy that a newer snapshot round replaced before the coordinator named that
        # round complete (RUN_STEP's `snapshot_step`, RESTORE): a round left incomplete (a member lost or late
        # mid-round) leaves the coordinator's ledger at the older copy, which a rollback then restores
        self.previous: dict[int, tuple[int, Any]] = {}
        self.parity = Parity(membership, hosted, self.held, self.own, companion_host)  # reft

    def steps_held(self) -> dict[int, int]:
        """The step of each snapshot held here, by stage (for a new coordinator)."""
        return {k: v[0] for k, v in self.held.items()}

    def _own_or_refuse(self, stage: int, step: int, what: str) -> Any:
        """The copy of `stage` as of `step` held here (`own`); a ProtocolError naming the step held if none."""
        blob = self.own(stage, step)
        if blob is None:
            held = self.held.get(stage)
            raise ProtocolError(f"no {what} of stage {stage} at step {step} here "
                                f"(have: {None if held is None else held[0]})")
        return blob

    # ---- handlers --------------------------------------------------------------------
    async def on_snapshot(self, snapshot: Snapshot, tensors: list, peer) -> tuple[Snapshotted, list]:
        """Capture this stage's full state as of `step` and keep it where `keep` says: in memory (if this peer is
        among its holders) and sent to the other holders, with a parity group (reft), or as a file in storage."""
        stage, step, keep = self.hosted.serving().index, snapshot.step, snapshot.keep
        t0 = time.perf_counter()
        blob = await self.compute.run(self.hosted.capture_bytes, step)
        sent = 0
        if isinstance(keep, KeepStorage):  # the coordinator seals it once every stage has written
            await self.compute.run(storage.write_stage, keep.storage, step, stage, blob)
        elif isinstance(keep, KeepParity):  # reft: own copy here (the last complete one kept), a chunk to each member
            old = self.held.get(stage)
            if old is not None and old[0] != step:
                self.previous[stage] = old
            self.held[stage] = (step, blob)
            sent = await self.parity.snapshot(step, blob, keep.group, keep.index)
            return Snapshotted(bytes=len(blob), sent=sent, seconds=time.perf_counter() - t0,
                               companion=self.parity.companion_addr if self.parity.kept else None), []
        else:
            assert isinstance(keep, KeepHolders)
            if self.membership.me in keep.peers:  # gemini keeps its own copy (a rollback of a live stage reads it)
                self.held[stage] = (step, blob)
            payload = blob_tensor(blob)
            for pid in keep.peers:
                if pid != self.membership.me:
                    await self.membership.call(pid, StoreSnapshot(owner=stage, step=step), self.membership.timeouts.step_timeout,
                                        [payload])
                    sent += len(blob)
        return Snapshotted(bytes=len(blob), sent=sent, seconds=time.perf_counter() - t0), []

    async def on_store_snapshot(self, store: StoreSnapshot, tensors: list, peer) -> tuple[Stored, list]:
        """Hold another stage's snapshot (bounded: at most one blob per stage)."""
        cfg = self.hosted.cfg
        if cfg is None or not 0 <= store.owner < cfg.num_stages:
            raise ProtocolError(f"snapshot of stage {store.owner} out of range for "
                                f"{cfg.num_stages if cfg else '?'} stages")
        self.held[store.owner] = (store.step, check_blob(tensors, "a snapshot"))
        return Stored(held=sorted(self.held)), []

    async def on_fetch_snapshot(self, fetch: FetchSnapshot, tensors: list, peer) -> tuple[Ok, list]:
        """Hand a held snapshot (snap: a compressed copy) to a replacement."""
        if self.streams is not None and self.streams.holds(fetch.owner, fetch.step):
            return Ok(), [blob_tensor(await self.streams.fetch(fetch.owner, fetch.step))]
        return Ok(), [blob_tensor(self._own_or_refuse(fetch.owner, fetch.step, "snapshot"))]

    async def on_restore(self, restore: Restore, tensors: list, peer) -> tuple[Ok, list]:
        """Roll this live stage back to its copy of `step` (own memory, a holder, storage), or to its initial
        state. Its own copies of later steps are of a run abandoned now, and dropped (`settle`)."""
        stage = self.hosted.serving().index
        if isinstance(restore.origin, InitialState):
            self.hosted.rolled_back(0.0, 0, await self.compute.run(self.hosted.build, stage))
        else:
            blob = await self._blob(stage, restore.step, restore.origin)
            omega = await self.compute.run(self.hosted.load_bytes, self.hosted.worker, blob)
            self.hosted.rolled_back(omega, restore.step)
        self.steps.reset()
        self.settle(restore.step)
        if self.held.get(stage, (-1,))[0] > restore.step:  # (a round after it, left incomplete)
            del self.held[stage]
        self.parity.rolled_back(restore.step)
        return Ok(), []

    def settle(self, step: int) -> None:
        """The newest complete snapshot is of `step` (the coordinator's ledger, named in RUN_STEP and RESTORE): of
        this peer's own copies (`previous`, and the newest one) and parity blocks, that of `step` is kept, the
        other dropped (a newer one's round was left incomplete, or a rollback abandoned it)."""
        for stage, prev in list(self.previous.items()):
            del self.previous[stage]
            if prev[0] == step and self.held.get(stage, (None,))[0] != step:
                self.held[stage] = prev
        self.parity.settle(step)

    def own(self, stage: int, step: int) -> Any | None:
        """This peer's copy of `stage` at `step` (the newest, or the one a round not known complete replaced)."""
        return next((h[1] for h in (self.held.get(stage), self.previous.get(stage)) if h is not None and h[0] == step),
                    None)

    async def take_held(self, source: str, held: dict[int, int], stage: int) -> int:
        """A handover of `stage`: hold the snapshots the leaving peer `source` holds (`held`: owner stage -> step)
        in its place (under ReFT its own, with its parity block); the bytes moved. One it does not have (a
        snapshot round left incomplete replaced it) is skipped with a warning: it was lost before the handover. A
        source that cannot be reached fails the handover (the coordinator then recovers the stage)."""
        if self.hosted.cfg is None or not all(0 <= o < self.hosted.joined().num_stages for o in held):
            raise ProtocolError(f"assign 'held' names stages out of range: {sorted(held)!r:.200}")
        moved = 0
        for owner, step in sorted(held.items()):
            if self.hosted.companion and owner == stage:  # reft: its own snapshot and parity block
                moved += await self.parity.take_over(source, stage, step)
                continue
            try:
                _, tensors = await self.membership.call(source, FetchSnapshot(owner=owner, step=step),
                                                 self.membership.timeouts.step_timeout)
            except RemoteError as e:
                if e.kind != Kind.BAD_REQUEST:
                    raise
                log.warning("handover from %s: no snapshot of stage %d at step %d there (%s)", source, owner, step,
                            e.remote_message)
                continue
            self.keep(owner, step, check_blob(tensors, "a handed-over snapshot"))
            moved += len(self.held[owner][1])
        return moved

    def keep(self, stage: int, step: int, blob: BytesLike) -> None:
        """Hold `stage`'s snapshot (or backup) of `step` (at most one per stage)."""
        self.held[stage] = (step, blob)

    # ---- a replacement's side ----------------------------------------------------------
    async def restore_new(self, worker: StageWorker, assign: AssignRestore, donors: dict | None = None) -> dict:
        """A replacement takes the lost stage's copy (assign mode `restore`), its replicated components from
        `donors` (component -> (weights, Adam state)) when given: the Assigned reply's fields and its omega."""
        t0 = time.perf_counter()
        origin, step = assign.origin, assign.step
        if isinstance(origin, InitialState):
            return {"omega": 0.0, "restore_s": 0.0, "bytes": 0}
        via = {}
        if isinstance(origin, ParityCopy):  # reft: from the lost peer's companion, or decoded from parity
            blob, via["restored_from"], fetched = await self.parity.decode(step, origin)
            self.held[worker.index] = (step, blob)  # this replacement's own snapshot now, as the lost one's
        else:
            blob = await self._blob(worker.index, step, origin)
            fetched = len(blob)
        state = state_from_bytes(blob)
        if is_copy_blob(state):  # snap: a compressed copy, decoded here; this peer mirrors it from now on
            held = await self.compute.run(Streams.decode, blob)
            state = await self.compute.run(restore_state, held)
            if self.streams is not None:
                self.streams.adopt_mirror(held)
        norm = await self.compute.run(self.hosted.load_state, worker, state, donors)
        moved = sum(state_nbytes(list(d)) for d in (donors or {}).values())
        return {"omega": norm, "restore_s": time.perf_counter() - t0, "bytes": fetched + moved, **via}

    async def _blob(self, stage: int, step: int, origin: Origin) -> Any:
        """The copy of `stage` at `step` from `origin`: own memory, a holder peer, or storage."""
        if isinstance(origin, StorageCopy):
            return storage.read_stage(origin.storage, step, stage)
        if isinstance(origin, OwnCopy) or isinstance(origin, PeerCopy) and origin.peer == self.membership.me:
            return self._own_or_refuse(stage, step, "own snapshot")
        if not isinstance(origin, PeerCopy):
            raise ProtocolError(f"a copy of kind {type(origin).__struct_config__.tag!r} cannot restore this stage")
        _, (blob,) = await self.membership.call(origin.peer, FetchSnapshot(owner=stage, step=step), self.membership.timeouts.step_timeout)
        return tensor_blob(blob)
