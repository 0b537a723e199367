"""Failed peers told to go: a failed peer may still be running (broken weights, soft errors, a straggler, a
partition), and must stop serving its old stage. A peer the coordinator never had (a stray a takeover could not
ADOPT) is ADOPTed first, or it would refuse this coordinator's SHUTDOWN. One that cannot be reached now is told
again when its heartbeat reappears (a healed partition: coordinator/detection.py) and when the run ends."""

from __future__ import annotations

import asyncio
import logging
import time

from checkfree.messages import Shutdown
from coordinator.common import RunClock
from coordinator.members import Membership
from coordinator.outputs import Outputs
from coordinator.rpc import Rpc
from coordinator.stage_table import StageTable

__all__ = ["Retirement"]

log = logging.getLogger("coordinator.coordinator")


class Retirement:
    """The failed peers told to shut down, and the strays among them."""

    def __init__(self, rpc: Rpc, table: StageTable, membership: Membership, outputs: Outputs, clock: RunClock) -> None:
        self.rpc, self.table, self.members, self.out, self.clock = rpc, table, membership, outputs, clock
        self._retired: set[str] = set()  # failed peers already told to shut down
        # peers that serve a stage but answer to a coordinator that is gone (cut off while this one took over the
        # run, or back after it): retiring one ADOPTs it first, or it would refuse this coordinator's SHUTDOWN
        self._strays: set[str] = set()
        self._task: asyncio.Task | None = None  # a retirement started in the background (`again`)

    def stray(self, pid: str) -> None:
        """`pid` serves a stage of this run but was never this coordinator's (a takeover could not ADOPT it): a
        failed peer, retired once it answers."""
        self.members.admit(pid, time.time())
        self.members.drop(pid)
        self._strays.add(pid)

    def retired(self, pid: str) -> None:
        """`pid` was told to shut down (a handover's leaving peer)."""
        self._retired.add(pid)

    def unretired(self) -> list[str]:
        """Failed peers serving no stage that have not been told to go yet."""
        return [p for p in self.members.dropped() if self.table.stage_of(p) < 0 and p not in self._retired]

    def again(self) -> None:
        """A retired peer is back (its heartbeat): tell them again, in the background (one retirement at a time)."""
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self.retire())

    async def retire(self) -> None:
        """Tell failed peers to shut down."""
        pids = await self._adopt_strays(self.unretired())
        results = await self.rpc.gather(pids, Shutdown(), 2.0)
        for pid, r in zip(pids, results):
            if not isinstance(r, Exception) and pid not in self._retired:
                self._retired.add(pid)
                self.out.event("retired", step=self.clock.step, peer_id=pid)

    async def _adopt_strays(self, pids: list[str]) -> list[str]:
        """`pids` with the strays among them ADOPTed first (left out while they do not answer: next time)."""
        strays = [p for p in pids if p in self._strays]
        if not strays:
            return pids
        results = await asyncio.gather(*(self.rpc.adopt(p, min(10.0, self.rpc.timeouts.rpc_timeout)) for p in strays),
                                       return_exceptions=True)
        for pid, r in zip(strays, results):
            if isinstance(r, Exception):
                log.info("stray peer %s could not be adopted to retire it: %s", pid, r)
            else:
                self._strays.discard(pid)
        return [p for p in pids if p not in self._strays]
