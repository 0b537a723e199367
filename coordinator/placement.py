"""Placement: which standby serves which stage. Standbys fill empty stages first, all at once at the start
(fresh, or loaded from a save), then stage groups below `train.replicas` (the fewest replicas first, then the
slowest): all of them at the start, later (a group that lost a replica) only while more than the reserve of
standbys remain (`train.reserve`, default 1: a wholly lost stage needs a standby at once); with `train.reserve`
set, every standby beyond it joins the group of the slowest stage by measured speed (checkfree.stage_groups.slowest),
once every stage has been measured. A new replica copies a live sibling's exact state (weights, Adam, step), as a
handover does. With no standby left, a replica of the largest group may be borrowed to rebuild a lost stage."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Protocol

import torch

from msgspec.structs import replace

from checkfree.config import RunConfig
from checkfree.stage_groups import slowest, stage_load
from checkfree.messages import AssignFresh, AssignLoad, AssignReplica, AssignRequest, Assigned
from coordinator.common import CALL_ERRORS
from coordinator.members import Membership
from coordinator.outputs import Outputs
from coordinator.rpc import Rpc
from coordinator.stage_table import StageTable

__all__ = ["Placement", "Speeds"]

log = logging.getLogger("coordinator.coordinator")


class Speeds(Protocol):
    """Where the peers' measured speeds come from (the step driver's measure)."""

    def speeds(self) -> Mapping[str, float]: ...


class Placement:
    """Gives stages to standbys, writing the stage table through its methods."""

    def __init__(self, cfg: RunConfig, rpc: Rpc, table: StageTable, membership: Membership, outputs: Outputs,
                 measured: Speeds) -> None:
        self.cfg, self.rpc, self.table, self.members, self.out = cfg, rpc, table, membership, outputs
        self.timeouts = rpc.timeouts
        self.measured = measured  # each peer's measured speed (the step driver)

    async def assign(self, pid: str, assign: AssignRequest, timeout: float | None = None, tensors=()) -> Assigned:
        """Give `assign.stage` to `pid` (bounded by step_timeout unless told otherwise). A peer whose
        assignment fails is passed over and, in case it is merely slow and goes on to host the stage
        anyway, retired."""
        try:
            reply, _ = await self.rpc.call(pid, replace(assign, epoch=self.table.next_epoch()),
                                           timeout=timeout or self.timeouts.step_timeout, tensors=tensors)
        except CALL_ERRORS:
            self.members.suspect(pid)
            self.members.drop(pid)
            raise
        self.table.assign(assign.stage, pid)
        return reply

    async def fill(self, saved: dict[int, bytes] | None, step: int) -> None:
        """Give every stage to a standby, all at once (each peer builds its stage in parallel):
        fresh, or (resuming) loaded from the saved states. A failed assignment is retried with
        another standby."""
        while missing := [s for s in range(self.cfg.num_stages) if s not in self.table.served()]:
            first = await self.members.take_standby(f"serve stage {missing[0]}")
            pids = [first, *[p for p in self.members.standbys() if p != first][:len(missing) - 1]]
            await asyncio.gather(*(self._assign_initial(s, pid, saved, step) for s, pid in zip(missing, pids)))

    async def _assign_initial(self, stage: int, pid: str, saved: dict[int, bytes] | None, step: int) -> None:
        tensors: list[torch.Tensor]
        assign: AssignFresh | AssignLoad
        if saved is None:
            mode, step, tensors, assign = "fresh", 0, [], AssignFresh(stage=stage)
        else:
            mode, tensors = "load", [torch.frombuffer(bytearray(saved[stage]), dtype=torch.uint8)]
            assign = AssignLoad(stage=stage, step=step)
        try:  # a peer starting up may take long to build its first stage: part of joining
            await self.assign(pid, assign, timeout=self.timeouts.join_timeout, tensors=tensors)
        except CALL_ERRORS as e:
            log.warning("assigning stage %d to %s failed: %s", stage, pid, e)
            return
        self.out.event("assign", step=step, stage=stage, peer_id=pid, mode=mode)

    async def fill_groups(self, step: int, *, first: bool) -> None:
        """Standbys join groups: below `train.replicas` first, then (with `train.reserve`) beyond it into the
        slowest measured stage. `first`: before the first step (no standby is kept back then)."""
        cfg = self.cfg
        target, reserve, m = cfg.train.replicas, cfg.train.reserve, cfg.train.num_microbatches
        keep = 0 if first else 1 if reserve is None else reserve  # standbys kept for stage recoveries
        while len(self.table.served()) == cfg.num_stages and (standbys := self.members.standbys()):
            groups = {s: self.table.group(s) for s in range(cfg.num_stages)}
            speeds = self.measured.speeds()
            below = [s for s in groups if len(groups[s]) < target]
            if below and len(standbys) > keep:
                stage = min(below, key=lambda s: (len(groups[s]), -stage_load(m, groups[s], speeds), s))
            elif reserve is not None and len(standbys) > reserve and all(
                    p in speeds for g in groups.values() for p in g):
                stage = slowest(groups, m, speeds)
            else:
                return
            await self._add_replica(stage, standbys[0], step)  # (one that fails to join is no standby any more)

    async def _add_replica(self, stage: int, pid: str, step: int) -> None:
        """`pid` joins `stage`'s group with a copy of the primary's exact state."""
        source = self.table.peer(stage)
        t0 = time.perf_counter()
        try:
            reply, _ = await self.rpc.call(pid, AssignReplica(stage=stage, source=source, step=step,
                                                                    epoch=self.table.next_epoch()),
                                           timeout=self.timeouts.step_timeout)
        except CALL_ERRORS as e:
            log.warning("stage %d's new replica %s failed to join: %s", stage, pid, e)
            self.members.suspect(pid)
            self.members.drop(pid)
            return
        self.table.add_replica(stage, pid)
        replicas = len(self.table.group(stage))
        self.out.event("replica_joined", step=step, stage=stage, peer_id=pid, source=source,
                       bytes=reply.bytes, join_s=round(time.perf_counter() - t0, 6), replicas=replicas)
        self.out.status(f"peer {pid[:12]} joined stage {stage}'s group ({replicas} replicas), "
                        f"copied from {source[:12]}")

    def borrow_replica(self, step: int, lost: int) -> str | None:
        """No standby is left and `lost` must be rebuilt: take a replica from the group with the most replicas
        (the fastest of those groups, by measured load), which keeps the others. None: every group has one."""
        groups = {s: self.table.group(s) for s in self.table.served() if s != lost}
        big = [s for s, g in groups.items() if len(g) >= 2]
        if not big:
            return None
        m, speeds = self.cfg.train.num_microbatches, self.measured.speeds()
        stage = max(big, key=lambda s: (len(groups[s]), -stage_load(m, groups[s], speeds), -s))
        pid = groups[stage][-1]
        rest = self.table.leave(stage, pid)
        self.out.event("replica_moved", step=step, stage=stage, peer_id=pid, to_stage=lost, replicas=len(rest))
        self.out.status(f"no standby: replica {pid[:12]} of stage {stage} leaves its group to rebuild stage {lost}")
        return pid
