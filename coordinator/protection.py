"""The protection the strategy says is due, carried out on the peers (checkfree.plans.Protect; the simulator
carries out the same items: checkfree.strategies.execute):

    Snapshot         every stage's full state kept by the peers of its holder stages (SNAPSHOT, STORE_SNAPSHOT)
    ParitySnapshot   every stage keeps its own; each member of a parity group builds a parity block (REFT_CHUNK)
    Checkpoint       every stage's file in storage, sealed once all are written
    BackupStart      every stage takes its backup (BACKUP_START); its parts travel in the next steps' bubbles,
                     named in RUN_STEP (`backup_header`)
    BackupSeal       the backup counts where every part arrived (BACKUP_COMMIT)
    RefreshReplicas  nothing to do here: every peer's COMMIT ships its gradients to its replica (peers/replicas.py)
    TakeReplicas     the named stages copy their successors' full state (TAKE_REPLICA)
    StreamSent       snap: the parts of the streamed copies a step carried (named in its RUN_STEP, `in_step`;
                     sent by the peers while the step computes), each acknowledged in its sender's COMMIT reply

A copy counts (the `Copies` ledger) only once every stage completed it; what it cost is measured into the run's
figures.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path

from checkfree.config import RunConfig
from checkfree.plans import (BackupPart, BackupSeal, BackupStart, Checkpoint, Copies, ParitySnapshot, Protect,
                             RecoveryPlan, RefreshReplicas, Snapshot, StreamSent, StreamStep, TakeReplicas)
from checkfree import messages as msg
from checkfree.messages import (BackupCommit, BackupShare, Committed, CopyWork, Keep, KeepHolders, KeepParity,
                                KeepStorage, Snapshotted, TakeReplica)
from checkfree.strategies import Strategy, storage
from coordinator.common import CoordinatorOptions, settle
from coordinator.outputs import Outputs
from coordinator.rpc import Rpc
from coordinator.stage_table import StageTable

__all__ = ["Protection", "storage_dir"]

log = logging.getLogger("coordinator.coordinator")


def storage_dir(cfg: RunConfig, opts: CoordinatorOptions) -> str:
    """Where the run's checkpoints are: the config's storage_dir, else <the coordinator's run directory>/checkpoints
    (a standby taking over elsewhere is told it: coordinator/record_feed.py)."""
    return str(Path(cfg.strategy.storage_dir or Path(opts.out) / "checkpoints").resolve())


class Protection:
    """The copies of the run (the `Copies` ledger) and the protection work that makes them."""

    def __init__(self, cfg: RunConfig, opts: CoordinatorOptions, strategy: Strategy, rpc: Rpc, table: StageTable,
                 outputs: Outputs) -> None:
        self.cfg, self.strategy, self.rpc, self.table, self.out = cfg, strategy, rpc, table, outputs
        self.timeouts = rpc.timeouts
        self.copies = Copies()  # the snapshots, backups and checkpoints that exist, by stage (checkfree.plans)
        self.storage_dir = storage_dir(cfg, opts)
        self._companions: dict[int, str] = {}  # reft: stage -> its peer's snapshot companion address
        self._backup_peers: dict[int, tuple[str, str]] = {}  # baft: stage -> (its peer, its backup holder's)
        self._copy_acks: dict[int, tuple[tuple[int, int] | None, int]] = {}  # snap: the last commit's, by stage

    # ---- the ledger, for the recovery ------------------------------------------------------
    def lost(self, failed: set[int]) -> Copies:
        """The peers of `failed` are gone, and the copies they held: what is left (a copy of the ledger)."""
        self.copies.lose(failed)
        return dataclasses.replace(self.copies)

    def held_by(self, stage: int) -> dict[int, int]:
        """The in-memory snapshots `stage`'s peer holds (owner stage -> step), which a handover of `stage` takes
        along (AssignHandover.held; under ReFT its own snapshot, with its parity block). snap's streamed copies
        are not taken along: they are streamed again (`protection_after_handover`)."""
        if not self.copies.step or self.strategy.copy_format is not None:
            return {}
        return {owner: self.copies.step for owner, holders in sorted(self.copies.held.items()) if stage in holders}

    def backup_in_flight(self, step: int) -> int | None:
        """baft: the step of the backup whose parts are still to travel, from step `step` on (None: none), which a
        handover takes along (AssignHandover.backup: the leaving peer's parts in flight, sent and assembled)."""
        part = self.strategy.in_step(step)
        return part.step if isinstance(part, BackupPart) and self._backup_peers else None

    async def handed_over(self, stages: set[int], step: int) -> None:
        """The peers of `stages` handed their state over and left. The snapshots they held went to the new peers
        with their state (the ledger keeps them; under ReFT the new peer's companion gets its copy at the next
        snapshot, and the old one's left with it), and so did BAFT's backup in flight (the new peers are noted in
        the leaving ones' place); the new peers take what the strategy says they must (redundant computation: the
        replica the leaving peer held)."""
        for stage in stages:
            self.replaced(stage)
        # baft: the new peers send and assemble the backup in flight in the leaving ones' place (AssignHandover.backup)
        moved = {self._backup_peers[s][0]: self.table.peer(s) for s in stages if s in self._backup_peers}
        self._backup_peers = {s: (moved.get(own, own), moved.get(holder, holder))
                              for s, (own, holder) in self._backup_peers.items()}
        if self.strategy.copy_format is not None:  # snap: the copies the leaving peers held are streamed again
            self.copies.lose(stages)
        for item in self.strategy.protection_after_handover(tuple(sorted(stages))):
            await self.protect_item(item, step)

    def companion(self, stage: int) -> str | None:
        """reft: where the lost `stage`'s peer's snapshot companion listened (it may have survived its crash)."""
        return self._companions.get(stage)

    def replaced(self, stage: int) -> None:
        """A new peer serves `stage` (its own companion starts at the next snapshot)."""
        self._companions.pop(stage, None)

    async def recovered(self, plan: RecoveryPlan, step: int) -> None:
        """`plan` was carried out (every stage now at `step`): the ledger notes what it restored, then the
        protection due after it is taken."""
        self.copies.recovered(plan)
        for item in plan.then:
            await self.protect_item(item, step)

    def adopted(self, snapshot_step: int, holders: dict[int, set[int]], storage_step_limit: int) -> None:
        """A takeover: the newest snapshot every stage has a live holder of, and the newest complete checkpoint in
        storage up to `storage_step_limit` (the run's step)."""
        if snapshot_step:
            self.copies.taken(snapshot_step, holders)
        complete = [st for st in storage.complete_steps(self.storage_dir) if st <= storage_step_limit]
        self.copies.checkpointed(max(complete, default=0))

    # ---- protection --------------------------------------------------------------------
    async def start(self, step: int) -> None:
        """The protection a run starts with (redundant computation: every predecessor's replica)."""
        for item in self.strategy.protection_at_start():
            await self.protect_item(item, step)

    async def protect(self, step: int) -> None:
        """After committing `step`: the protection the strategy says is due now."""
        for item in self.strategy.protection_due(step):
            await self.protect_item(item, step + 1)

    async def protect_item(self, item: Protect, step: int) -> None:
        """Carry `item` out; `step`: the step every stage is ready to run."""
        if isinstance(item, Snapshot):
            pids = {s: [self.table.peer(h) for h in hs] for s, hs in item.holders.items()}
            sizes = await self._snapshot_all(item.step, lambda s: KeepHolders(peers=pids[s]))
            held = {h: sum(n for s, n in sizes.items() if h in item.holders[s]) for h in self.table.served()}
            self.out.charge(extra_memory_bytes=max(held.values(), default=0))  # (gemini: a peer's own among them)
            if len(sizes) == self.cfg.num_stages:
                self.copies.taken(item.step, item.holders)
        elif isinstance(item, ParitySnapshot):
            group = {s: g for g in item.parity_groups for s in g}
            sizes = await self._snapshot_all(item.step, lambda s: KeepParity(
                group=[self.table.peer(m) for m in group[s]], index=group[s].index(s)))
            # its own snapshot and a parity block of ~1/(n-1) of its group's largest
            self.out.charge(extra_memory_bytes=max((n - (-max(sizes.get(m, 0) for m in group[s]) // (len(group[s]) - 1))
                                                 for s, n in sizes.items()), default=0))
            if len(sizes) == self.cfg.num_stages:
                self.copies.taken(item.step, {s: (s,) for s in group})
        elif isinstance(item, Checkpoint):
            if len(await self._snapshot_all(item.step, lambda s: KeepStorage(storage=self.storage_dir))) == \
                    self.cfg.num_stages:
                storage.seal(self.storage_dir, item.step, self.cfg.num_stages)
                self.copies.checkpointed(item.step)
        elif isinstance(item, BackupStart):
            await self._backup_start(item.step)
        elif isinstance(item, BackupSeal):
            await self._seal_backup(item)
        elif isinstance(item, TakeReplicas):
            await self._replicate(set(item.stages), step)
        elif isinstance(item, StreamSent):
            self._streamed(item)
        else:
            assert isinstance(item, RefreshReplicas), item  # (done by every peer's COMMIT)

    async def _snapshot_all(self, step: int, keep: Callable[[int], Keep]) -> dict[int, int]:
        """SNAPSHOT on every stage (`keep(stage)`: where it goes); the sizes of the stages that completed it."""
        t0 = time.perf_counter()
        stages = self.table.served()
        results = await settle(self.rpc.call(self.table.peer(s), msg.Snapshot(step=step, keep=keep(s)),
                                             self.timeouts.step_timeout) for s in stages)
        replies: dict[int, Snapshotted] = {s: r[0] for s, r in zip(stages, results) if not isinstance(r, Exception)}
        complete = len(replies) == len(stages)
        for s, r in zip(stages, results):
            if isinstance(r, Exception):  # (the copies of the last complete round stay the ledger's)
                log.warning("the snapshot of step %d on stage %d failed: %s", step, s, str(r)[:300])
        kind = "storage" if isinstance(keep(0), KeepStorage) else "memory"
        seconds = time.perf_counter() - t0
        sizes = {s: r.bytes for s, r in replies.items()}
        sent = sum(r.sent for r in replies.values())
        self.out.event("snapshot", step=step, kind=kind, complete=complete, seconds=round(seconds, 6),
                    bytes=sum(sizes.values()), sent=sent)
        if complete:  # reft: where each stage's snapshot companion listens (it survives a crash of its peer)
            self._companions = {s: r.companion for s, r in replies.items() if r.companion}
        # the next step waited for the snapshot; the bytes went over the network (memory) or to storage
        self.out.charge(stall_s=seconds, bytes_moved=sent if kind == "memory" else sum(sizes.values()))
        return sizes

    # ---- BAFT: backups in the bubbles ---------------------------------------------------
    async def _backup_start(self, step: int) -> None:
        """Every stage takes its backup as of `step` (its parts go out in the next steps' bubbles)."""
        strategy = self.strategy
        t0 = time.perf_counter()
        stages = self.table.served()
        replies = await asyncio.gather(*(self.rpc.call(self.table.peer(s), msg.BackupStart(step=step),
                                                    self.timeouts.step_timeout) for s in stages))
        strategy.backup_taken({s: r[0].units for s, r in zip(stages, replies)})
        self._backup_peers = {s: (self.table.peer(s), self.table.peer(strategy.holder(s))) for s in stages}
        size = {s: r[0].bytes for s, r in zip(stages, replies)}
        # a peer holds its backup in flight, its own complete one and its predecessor's (as the simulator counts)
        self.out.charge(stall_s=time.perf_counter() - t0, extra_memory_bytes=strategy.backup_memory(size))

    def in_step(self, step: int) -> dict:
        """RUN_STEP's `backup` field: the part of the backup in flight this step's bubbles carry, per stage; or
        (snap) its `copies` field: the part of each stage's streamed copy the step carries; and (a strategy that
        `names_complete_rounds`: reft) the step of the newest complete snapshot, whose copies the peers keep (a round
        left incomplete does not replace them)."""
        if self.strategy.names_complete_rounds and self.copies.step:
            return {"snapshot_step": self.copies.step}
        part = self.strategy.in_step(step)
        if isinstance(part, StreamStep):
            return {"copies": {s: CopyWork(step=p.step, kind=p.kind, base=p.base, part=p.part, parts=p.parts,
                                           holder=self.table.peer(p.holder), holder_stage=p.holder)
                               for s, p in part.parts.items()}} if part.parts else {}
        if part is None or not self._backup_peers:
            return {}
        return {"backup": BackupShare(step=part.step, part=part.part,
                                      holders={s: p[1] for s, p in self._backup_peers.items()},
                                      holder_stages={s: part.holders[s] for s in self._backup_peers},
                                      bounds={s: part.bounds[s] for s in self._backup_peers})}

    async def _seal_backup(self, item: BackupSeal) -> None:
        """The backup of `item.step` counts if every stage's holder (and the stage itself) holds it complete."""
        peers = list(self.table.primaries().values())
        replies = await self.rpc.gather(peers, BackupCommit(step=item.step), self.timeouts.rpc_timeout)
        held = {pid: set(r[0].held) for pid, r in zip(peers, replies) if not isinstance(r, Exception)}
        complete = all(s in held.get(own, ()) and s in held.get(holder, ())
                       for s, (own, holder) in self._backup_peers.items())
        self.out.event("snapshot", step=item.step, kind="backup", complete=complete)
        if complete:
            self.copies.taken(item.step, item.holders)

    # ---- snap: streamed copies -------------------------------------------------------------
    def committed(self, commits: dict[int, Committed | Exception]) -> None:
        """A step's COMMIT replies: the copy parts their senders' holders acknowledged (snap)."""
        self._copy_acks = {s: (r.copy_sent, r.copy_bytes or 0) for s, r in commits.items()
                           if isinstance(r, Committed)}

    def _streamed(self, item: StreamSent) -> None:
        """Every part the step carried that its holder acknowledged counts (an update complete with its last one:
        recorded in the ledger); one that did not arrive voids its update (the next one is full)."""
        moved = 0
        for s, part in item.parts.items():
            sent, nbytes = self._copy_acks.get(s, (None, 0))
            if sent is None or tuple(sent) != (part.step, part.part):
                self.strategy.copy_stream_broken(s)
                self.out.event("copy_stream_broken", step=item.step, stage=s, copy_step=part.step, part=part.part)
                continue
            moved += nbytes
            if self.strategy.copy_part_done(part):
                self.copies.sealed(s, part.step, (part.holder,))
                self.out.event("snapshot", step=part.step, kind="stream", stage=s, holder=part.holder,
                               update=part.kind, parts=part.parts, complete=True)
        held = max(self.strategy.held_bytes(h) for h in range(self.cfg.num_stages))
        self.out.charge(bytes_moved=moved, extra_memory_bytes=held)

    # ---- redundant computation: replicas ------------------------------------------------
    async def _replicate(self, stages: set[int], step: int) -> int:
        """Each of `stages` takes a replica of its successor from the successor's peer; returns the bytes moved."""
        s_count = self.cfg.num_stages
        calls = [self.rpc.call(self.table.peer(s), TakeReplica(source=self.table.peer((s + 1) % s_count), step=step),
                               self.timeouts.step_timeout) for s in sorted(stages)]
        replies = await asyncio.gather(*calls)
        moved = sum(r[0].bytes for r in replies)
        self.out.event("replicas", step=step, stages=sorted(stages), bytes=moved)
        self.out.charge(bytes_moved=moved, extra_memory_bytes=max(r[0].bytes for r in replies))
        return moved
