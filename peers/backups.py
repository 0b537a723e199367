"""BAFT's backups on a peer (`--strategy baft`): this stage's backup is taken as of a step (BACKUP_START), then
sent to the holder (the next stage; the last stage's to the one before it) part by part, each part in a bubble
of the step that carries it: once this peer's compute thread is idle in that step (a later stage waits for its
first activation; the first stage for its first gradient after its forwards), so the schedule the peers really
run decides the timing. The coordinator names the part and its share of the backup in RUN_STEP (the plan of
`checkfree.strategies.baft`). The holder assembles the parts (BACKUP_PART); at BACKUP_COMMIT a backup every part
of which arrived becomes the holder's copy and the owner's own, in `Snapshots.held`, from where a rollback
restores it (RESTORE, FETCH_SNAPSHOT) as gemini's snapshots.

A peer that leaves (a handover) hands its backups in flight to the peer its stage goes to (BACKUP_FETCH, asked by
that peer with the backup's step named in its ASSIGN): this stage's backup being sent, and the parts of its
predecessors' that arrived here. The new peer sends and assembles the rest in its place, so the backup seals as
if nobody had left (the coordinator names the new peer in the leaving one's place: coordinator/protection.py).
"""

from __future__ import annotations

import logging

from checkfree.net.transport import TransportError
from checkfree.messages import (BackupAssembly, BackupCommit, BackupFetch, BackupPart, BackupShare, BackupsHeld,
                                BackupsInFlight, BackupStart, BackupTaken, Ok)
from checkfree.protocol import ProtocolError
from checkfree.serialize import blob_tensor, state_to_bytes
from checkfree.strategies.state import capture_worker, unit_nbytes
from peers.checks import check_blob
from peers.compute import ComputeQueue
from peers.membership import Membership
from peers.snapshots import Snapshots
from peers.stage import HostedStage

__all__ = ["Backups"]

log = logging.getLogger(__name__)

MAX_BACKUP_BYTES = 1 << 36  # a declared backup larger than this (64 GiB) is refused before anything is allocated


class Backups:
    """This stage's backup in flight, and the predecessor's being assembled here."""

    def __init__(self, membership: Membership, hosted: HostedStage, compute: ComputeQueue,
                 snapshots: Snapshots) -> None:
        self.membership, self.hosted, self.compute, self.snapshots = membership, hosted, compute, snapshots
        self.sending: tuple[int, bytes] | None = None  # (step, serialized state)
        self.assembling: dict[int, tuple[int, bytearray, dict[int, int]]] = {}  # owner -> (step, buffer, parts)
        self.sent = 0  # bytes of parts sent (for the step's figures)

    # ---- the owner's side --------------------------------------------------------------
    async def on_backup_start(self, start: BackupStart, tensors: list, peer) -> tuple[BackupTaken, list]:
        """Take this stage's backup as of `step`; its units' bytes let the coordinator plan the bubbles."""
        self.hosted.serving()
        blob, units = await self.compute.run(self._capture, start.step)
        self.sending = (start.step, blob)
        return BackupTaken(bytes=len(blob), units=units), []

    def _capture(self, step: int) -> tuple[bytearray, list[int]]:
        state = capture_worker(self.hosted.serving(), step, self.hosted.omega, clone=False)  # serialised at once
        return state_to_bytes(state), list(unit_nbytes(state).values())

    async def send_part(self, backup: BackupShare) -> None:
        """In this step's bubble: send the share of the backup in flight that the coordinator named."""
        stage = self.hosted.index
        bounds, holder = backup.bounds.get(stage), backup.holders.get(stage)
        if self.sending is None or self.sending[0] != backup.step or bounds is None or holder is None:
            return
        step, blob = self.sending
        lo, hi = int(bounds[0] * len(blob)), int(bounds[1] * len(blob))
        if hi <= lo:
            return
        await self.compute.idle()  # the bubble: nothing of this stage's to compute right now
        part = blob_tensor(memoryview(blob)[lo:hi])
        try:
            await self.membership.call(holder, BackupPart(owner=stage, step=step, offset=lo, total=len(blob)),
                                self.membership.timeouts.step_timeout, [part], link=(stage, backup.holder_stages.get(stage, stage)))
            self.sent += hi - lo
        except (TransportError, TimeoutError) as e:  # the backup stays incomplete: the coordinator keeps the last one
            log.warning("backup part of step %d not delivered to %s: %s", step, holder, e)

    def take_sent(self) -> int:
        sent, self.sent = self.sent, 0
        return sent

    # ---- the holder's side -------------------------------------------------------------
    async def on_backup_part(self, part: BackupPart, tensors: list, peer) -> tuple[Ok, list]:
        """A part of the predecessor's backup: its bytes at `offset` of a backup of `total` bytes."""
        owner, step, offset, total = part.owner, part.step, part.offset, part.total
        data = check_blob(tensors, "a backup part")
        cfg = self.hosted.joined()
        if not 0 <= owner < cfg.num_stages or owner == self.hosted.index:
            raise ProtocolError(f"backup of stage {owner}: not a stage this peer holds backups of")
        if not 0 < total <= MAX_BACKUP_BYTES or not 0 <= offset <= total - len(data):
            raise ProtocolError(f"backup part at {offset} of {len(data)} bytes does not fit a backup of {total} bytes")
        held = self.assembling.get(owner)
        if held is None or held[0] != step or len(held[1]) != total:
            held = (step, bytearray(total), {})
            self.assembling[owner] = held
        held[1][offset:offset + len(data)] = data
        held[2][offset] = len(data)
        return Ok(), []

    async def on_backup_commit(self, commit: BackupCommit, tensors: list, peer) -> tuple[BackupsHeld, list]:
        """The backup of `step` is done: the owner keeps its own copy, a holder each backup whose every byte
        arrived; returns the stages whose backup this peer now holds complete."""
        step, held = commit.step, []
        if self.sending is not None and self.sending[0] == step:
            self.snapshots.keep(self.hosted.index, *self.sending)
            self.sending = None
            held.append(self.hosted.index)
        for owner, (s, buf, parts) in list(self.assembling.items()):
            if s == step and sum(parts.values()) == len(buf):
                self.snapshots.keep(owner, step, bytes(buf))
                del self.assembling[owner]
                held.append(owner)
        return BackupsHeld(held=sorted(held)), []

    # ---- a handover: the backups in flight go to the new peer ------------------------------------
    async def on_backup_fetch(self, fetch: BackupFetch, tensors: list, peer) -> tuple[BackupsInFlight, list]:
        """This leaving peer's backups of `step` still in flight: its own (the first tensor, if `sending`), then
        each predecessor's being assembled here, with the parts that arrived."""
        out, assembling = [], []
        own = self.sending if self.sending is not None and self.sending[0] == fetch.step else None
        if own is not None:
            out.append(blob_tensor(own[1]))
        for owner, (step, buf, parts) in sorted(self.assembling.items()):
            if step == fetch.step:
                assembling.append(BackupAssembly(owner=owner, total=len(buf), parts=dict(parts)))
                out.append(blob_tensor(buf))
        return BackupsInFlight(sending=own is not None, assembling=assembling), out

    async def take_over(self, source: str, step: int) -> int:
        """A handover: the leaving peer's (`source`) backups of `step` in flight, kept here in its place (the
        parts still to send go from here, those still to come arrive here); the bytes moved. None there (it
        never took the backup): nothing taken, the backup does not seal and the coordinator keeps the last one."""
        meta, ts = await self.membership.call(source, BackupFetch(step=step), self.membership.timeouts.step_timeout)
        if len(ts) != int(meta.sending) + len(meta.assembling):
            raise ProtocolError(f"BACKUP_FETCH reply carries {len(ts)} tensors for "
                                f"{int(meta.sending) + len(meta.assembling)} backups")
        cfg, moved = self.hosted.joined(), 0
        if meta.sending:
            blob = bytes(check_blob(ts[:1], "a backup in flight"))
            self.sending, moved = (step, blob), len(blob)
        for a, t in zip(meta.assembling, ts[int(meta.sending):]):
            buf = bytearray(check_blob([t], "a backup being assembled"))
            if not 0 <= a.owner < cfg.num_stages or len(buf) != a.total or \
                    any(n < 0 or not 0 <= o <= a.total - n for o, n in a.parts.items()):
                raise ProtocolError(f"backup of stage {a.owner} being assembled: {a.total} bytes, {len(buf)} sent, "
                                    f"parts {sorted(a.parts.items())!r:.200}")
            self.assembling[a.owner] = (step, buf, dict(a.parts))
            moved += len(buf)
        if not meta.sending and not meta.assembling:
            log.warning("handover from %s: no backup of step %d in flight there", source, step)
        return moved
