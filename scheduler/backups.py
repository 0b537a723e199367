"""BAFT in the swarm (`--strategy baft`): every stage's backup is taken after a committed step (BACKUP_START),
sent to its holder in the bubbles of the next `rounds` steps (one part per step, named in RUN_STEP; the peers
time it from the schedule they run: peers/backups.py) and counts once complete (BACKUP_COMMIT: every part
arrived). The clock (when a backup starts, which part a step carries, when it is complete) and the plan (how
many steps, which share per step) are the strategy object's (checkfree.strategies.baft), as in the simulator. A
failure rolls every stage back to the last complete backup through the rollback strategies' path
(scheduler/recovery.py)."""

from __future__ import annotations

import asyncio
import time

from checkfree.protocol import RPC

__all__ = ["BackupsMixin"]


class BackupsMixin:
    """Part of `scheduler.coordinator.Coordinator` (see the module docstring); state lives on the coordinator."""

    async def _backup(self, step: int) -> None:
        """After committing `step`: complete the backup in flight when its last part has gone, start the next."""
        strategy = self.strategy
        completed, started = strategy.clock.after(step)
        if completed:
            await self._seal_backup(strategy.clock.complete_step)
        if started:
            t0 = time.perf_counter()
            stages = sorted(self.stage_peer)
            replies = await asyncio.gather(*(self._call(self.stage_peer[s], RPC.BACKUP_START, {"step": step + 1},
                                                        self.t.step_timeout) for s in stages))
            if strategy.plans is None:  # the plan needs the states' sizes: the first backup's
                strategy.plan_units(self.cost, {s: r[0]["units"] for s, r in zip(stages, replies)})
            self._backup_peers = {s: (self.stage_peer[s], self.stage_peer[strategy.holder(s)]) for s in stages}
            size = {s: int(r[0]["bytes"]) for s, r in zip(stages, replies)}
            # a peer holds its backup in flight, its own complete one and its predecessor's (as the simulator counts)
            memory = max(2 * size[p] + sum(size[s] for s in stages if strategy.holder(s) == p) for p in stages)
            self._charge(stall_s=time.perf_counter() - t0, extra_memory_bytes=memory)  # the next step waits for it

    def _backup_header(self, step: int) -> dict:
        """RUN_STEP's `backup` field: the part of the backup in flight this step's bubbles carry, per stage."""
        clock = getattr(self.strategy, "clock", None)
        part = clock.part(step) if clock is not None else None
        if part is None or not getattr(self, "_backup_peers", None):
            return {}
        h = self.strategy.holder
        return {"backup": {"step": clock.sent_from + 1, "part": part,
                           "holders": {str(s): p[1] for s, p in self._backup_peers.items()},
                           "holder_stages": {str(s): h(s) for s in self._backup_peers},
                           "bounds": {str(s): list(self.strategy.part_bounds(s, part)) for s in self._backup_peers}}}

    async def _seal_backup(self, step: int) -> None:
        """The backup of `step` counts if every stage's holder (and the stage itself) holds it complete."""
        replies = await asyncio.gather(*(self._call(p, RPC.BACKUP_COMMIT, {"step": step}, self.t.rpc_timeout)
                                         for p in self.stage_peer.values()), return_exceptions=True)
        held = {pid: set(r[0]["held"]) for pid, r in zip(self.stage_peer.values(), replies) if not isinstance(r, Exception)}
        complete = all(s in held.get(own, ()) and s in held.get(holder, ())
                       for s, (own, holder) in self._backup_peers.items())
        self._event("snapshot", step=step, kind="backup", complete=complete)
        if complete:
            self.snap_step = step
            self.snap_holders = {s: {s: own, self.strategy.holder(s): holder}
                                 for s, (own, holder) in self._backup_peers.items()}
