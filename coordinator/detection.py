"""Failure detection on the coordinator, between steps: the stages whose peer is gone (an expired DHT heartbeat, a
report confirmed by a failed ping, a leave), after the lost replicas of stage groups have left them; a peer leaving
gracefully hands its exact state to a standby (a handover: nothing lost). The heartbeats are read in the
background (`watch_heartbeats`) so that a step's detection finds a fresh read."""

from __future__ import annotations

import asyncio
import logging
import random
import time

from checkfree.config import RunConfig
from checkfree.messages import AssignHandover, Shutdown
from coordinator.common import CALL_ERRORS, RunClock, heartbeat_stage
from coordinator.members import Membership
from coordinator.outputs import Outputs
from coordinator.protection import Protection
from coordinator.retirement import Retirement
from coordinator.rpc import Rpc
from coordinator.stage_table import StageTable

__all__ = ["Detector", "Detection"]

log = logging.getLogger("coordinator.coordinator")


class Detection:
    """What one round of failure detection found: the stages whose every peer is gone (`failed`), and those whose
    leaving peer handed its state over to a standby (`handed_over`)."""

    def __init__(self, failed: set[int], handed_over: set[int]) -> None:
        self.failed, self.handed_over = failed, handed_over


class Detector:
    """Failure detection and handovers; the newest read of the peers' heartbeats."""

    def __init__(self, cfg: RunConfig, rpc: Rpc, table: StageTable, membership: Membership, retirement: Retirement,
                 protection: Protection, outputs: Outputs, clock: RunClock) -> None:
        self.cfg, self.rpc, self.table, self.members, self.retirement = cfg, rpc, table, membership, retirement
        self.protection, self.out, self.clock = protection, outputs, clock
        self.timeouts = rpc.timeouts
        self._live_seen: tuple[float, dict[str, dict]] | None = None  # (when, peers) of the newest heartbeat read

    async def detect(self) -> Detection:
        """Stages whose peer is gone (an expired heartbeat, a report confirmed by a failed ping, a leave), after the
        lost replicas of stage groups left them; a leaving peer's stage is handed over to a standby when it can,
        once no other stage failed (those are recovered first: detect again after the recovery)."""
        try:
            live = await self.heartbeats()
        except Exception as e:  # the DHT read is advisory: pings decide
            log.warning("reading heartbeats failed: %r", e)
            live = None
        await self._prune(live)
        for pid, value in (live or {}).items():
            if not self.members.known(pid) and pid != self.rpc.me and heartbeat_stage(value) >= 0:
                log.warning("peer %s serves stage %d but is not in run %r (cut off while its coordinator was "
                            "replaced): retiring it", pid, heartbeat_stage(value), self.rpc.run_id)
                self.retirement.stray(pid)
        failed, leaving = set(), {}
        for stage, pid in self.table.primaries().items():
            if self.members.handing_over(pid):
                leaving[stage] = pid
            elif await self._gone(pid, live):
                failed.add(stage)
        if live is not None and any(p in live for p in self.retirement.unretired()):
            self.retirement.again()  # a retired peer is back: tell it again
        # a stage nobody serves (its peer died while no coordinator was there to see it)
        failed |= set(range(self.cfg.num_stages)) - set(self.table.served())
        handed = set()
        # the failures found with a leave are planned together first, from the copies as they are (the leaving
        # peer's among them: it serves until its handover); the handover is the next detection's, once they are
        # recovered. A handover first took copies from a stage that had failed too (the seed-7 divergence #1)
        for stage, pid in leaving.items() if not failed else ():
            if await self._handover(stage, pid):
                handed.add(stage)
            elif await self._gone(pid, live):
                failed.add(stage)
        return Detection(failed, handed)

    async def heartbeats(self) -> dict[str, dict]:
        """Peers with a live DHT heartbeat (with a run secret: only records a member signed): the newest read if it
        is younger than a third of a heartbeat TTL (`watch_heartbeats` keeps it so while the coordinator runs),
        else a read now."""
        seen = self._live_seen
        if seen is not None and time.monotonic() - seen[0] < self.timeouts.heartbeat_ttl / 3:
            return seen[1]
        return await self._read_heartbeats()

    async def _read_heartbeats(self) -> dict[str, dict]:
        live = await self.rpc.heartbeats()
        self._live_seen = (time.monotonic(), live)
        return live

    async def watch_heartbeats(self) -> None:
        """Read the heartbeats every ttl/4 (jittered) in the background: a step's failure detection then finds a
        fresh read instead of waiting for one between two steps (a DHT read is ~10 ms on a quiet machine, more on
        a busy one), and the DHT is read about once a second (ttl 4 s), not once per step. A heartbeat that
        expired is seen at most ttl/3 later than by a read of its own."""
        while True:
            try:
                await self._read_heartbeats()
            except Exception as e:  # the DHT read is advisory: `detect` reads again itself, pings decide
                log.debug("reading heartbeats failed: %r", e)
            await asyncio.sleep(self.timeouts.heartbeat_ttl / 4 * random.uniform(0.8, 1.0))

    async def _gone(self, pid: str, live: dict | None) -> bool:
        """A suspect (leaving, reported, no heartbeat) that is leaving or does not answer a ping; a suspect that
        answers is cleared."""
        leaving = self.members.leaving(pid)
        if not (leaving or self.members.suspected(pid) or (live is not None and pid not in live)):
            return False
        if leaving or not await self.rpc.alive(pid):
            return True
        self.members.clear(pid)  # a false report (e.g. from a partitioned neighbour): it answers
        return False

    async def _prune(self, live: dict | None) -> None:
        """Between steps: replicas that are gone leave their group; a stage keeps at least one peer here (when all
        are gone it is a failed stage, recovered by the strategy)."""
        for stage in [s for s in self.table.served() if len(self.table.group(s)) > 1]:
            gone = [pid for pid in self.table.group(stage) if await self._gone(pid, live)]
            rest = [p for p in self.table.group(stage) if p not in gone]
            if gone and not [p for p in rest if await self.rpc.alive(p)]:  # (a group lost at once: not one by one)
                for p in rest:
                    self.members.suspect(p)
                continue  # the whole group: a failed stage (`detect`), recovered by the strategy
            for pid in gone:
                self.members.lose_replica(stage, pid, self.members.why_gone(pid))
                self.members.clear(pid)
                self.members.handover_done(pid)
            if gone:
                await self.retirement.retire()

    async def _handover(self, stage: int, pid: str) -> bool:
        """A peer leaving gracefully hands its exact state (weights and optimizer) to a standby:
        no recovery, nothing lost. False: it could not be done; the stage is then recovered."""
        self.members.handover_done(pid)
        standbys = self.members.standbys()
        if not standbys:
            return False
        new, step = standbys[0], self.clock.step
        t0 = time.perf_counter()
        try:
            reply, _ = await self.rpc.call(new, AssignHandover(stage=stage, source=pid, step=step,
                                                               held=self.protection.held_by(stage),
                                                               backup=self.protection.backup_in_flight(step),
                                                               epoch=self.table.next_epoch()),
                                           timeout=self.timeouts.step_timeout)
        except CALL_ERRORS as e:
            log.warning("handover of stage %d from %s to %s failed: %s", stage, pid, new, e)
            self.members.suspect(new)
            return False
        self.table.assign(stage, new)
        self.out.event("handover", step=step, stage=stage, strategy=self.cfg.recovery.strategy,
                       source_peer=pid, peer_id=new, bytes=reply.bytes,
                       handover_s=round(time.perf_counter() - t0, 6))
        (done,) = await self.rpc.gather([pid], Shutdown(), 5.0)
        if not isinstance(done, Exception):
            self.retirement.retired(pid)
        return True
