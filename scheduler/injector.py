"""Fault injection for the local swarm (`checkfree local` chaos flags), kept out of the coordinator's logic:
scheduled SIGKILLs, SIGTERMs and partitions asked of the launcher (one `CHAOS ...` line each, acknowledged on
stdin) or, in the in-process test tier, of `CoordinatorOptions.chaos_handler`; replacements killed during
their recovery, and slowed stages. A production coordinator has none of
these options set, and none of this runs."""

from __future__ import annotations

import asyncio
import logging
import sys
import time

from checkfree.failures import FailureSchedule
from checkfree.protocol import RPC

__all__ = ["ChaosMixin", "chaos_line", "parse_chaos_line"]

# The launcher protocol, written and read here only: the coordinator prints one line per request,
# `CHAOS <action> key=value ...`; the launcher acts (and, for a partition, acknowledges on stdin).
CHAOS_ACTIONS = ("kill", "crash", "rebuild-kill", "replica-kill", "term", "partition", "heal", "coordinator-dies")


def chaos_line(action: str, **fields: object) -> str:
    if action not in CHAOS_ACTIONS:
        raise ValueError(f"unknown chaos action {action!r}")
    return " ".join(["CHAOS", action, *(f"{k.replace('_', '-')}={v}" for k, v in fields.items())])


def parse_chaos_line(line: str) -> tuple[str, dict[str, str]] | None:
    """(action, fields) of a chaos request line, None for any other line."""
    parts = line.split()
    if len(parts) < 2 or parts[0] != "CHAOS" or parts[1] not in CHAOS_ACTIONS:
        return None
    return parts[1], dict(p.split("=", 1) for p in parts[2:] if "=" in p)

log = logging.getLogger("scheduler.coordinator")


class ChaosMixin:
    """Part of `scheduler.coordinator.Coordinator` (see the module docstring); state lives on the coordinator."""

    def _slow_header(self, stage: int) -> dict:
        """Diagnostic (local swarm, --chaos-slow): the peers of `stage` (each replica of its group) compute slowly."""
        if stage not in self.opts.slow:
            return {}
        delay, start = self.opts.slow[stage]
        return {"inject_delay": [delay, start]}

    async def _chaos_replacement(self, pid: str, stage: int) -> None:
        """Local swarm chaos: kill the peer just chosen to rebuild `stage` (a failure during recovery)."""
        if self.iteration not in self.opts.chaos_recovery_kills or self.iteration in self._recovery_killed:
            return
        self._recovery_killed.add(self.iteration)
        await self._ask("kill", step=self.iteration, stage=stage, peer=pid, during="recovery")
        await self._wait_dead(pid)

    def _chaos_rebuild(self, pid: str, stage: int) -> dict:
        """Local swarm chaos (--chaos-rebuild-kills): the replacement dies (SIGKILL) in the middle of
        its rebuild, after its first weight pull; the next standby must rebuild from the live sources."""
        if self.iteration not in self.opts.chaos_rebuild_kills or self.iteration in self._recovery_killed:
            return {}
        self._recovery_killed.add(self.iteration)
        print(chaos_line("rebuild-kill", step=self.iteration, stage=stage, peer=pid), flush=True)
        return {"chaos_die_after_pulls": 1}

    async def _ask(self, action: str, *, ack: bool = False, **fields: object) -> None:
        """One fault-injection request: to the in-process handler when there is one (it returns once it has
        acted), else a CHAOS line for the launcher (``ack``: and wait for its acknowledgement on stdin)."""
        if self.opts.chaos_handler is not None:
            await self.opts.chaos_handler(action, fields)
            return
        print(chaos_line(action, **fields), flush=True)
        if ack:
            await self._launcher_ack()

    async def _launcher_ack(self) -> None:
        """Local swarm: wait (up to rpc_timeout) for the launcher's line on stdin saying it has acted."""
        loop = asyncio.get_running_loop()
        if self._stdin is None:
            self._stdin = asyncio.StreamReader()
            await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(self._stdin), sys.stdin)
        try:
            await asyncio.wait_for(self._stdin.readline(), self.t.rpc_timeout)
        except asyncio.TimeoutError:
            log.warning("no acknowledgement from the launcher within rpc_timeout; going on")

    async def _wait_dead(self, pid: str) -> None:
        """Until a peer the launcher was asked to kill stops answering (bounded by join_timeout)."""
        deadline = time.monotonic() + self.t.join_timeout
        while await self._alive(pid) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    def _scheduled(self, schedule: FailureSchedule | None, step: int) -> list[tuple[int, str]]:
        """(stage, peer) of the stages `schedule` names at `step` that have a peer."""
        stages = sorted(schedule.at(step)) if schedule else []
        return [(s, self.stage_peer[s]) for s in stages if s in self.stage_peer]

    async def _chaos(self, step: int) -> None:
        """Local swarm only: ask the launcher to SIGKILL, SIGTERM or cut off the network (--netns) the
        scheduled stages' peers, then wait until that is in effect, so that the failure lands at the
        start of this step. `step` is the iteration (executed steps, re-runs included), as in the
        simulator. A partition is healed at the next iteration, once its stage has been recovered."""
        if step in self._chaos_done:  # each scheduled failure fires once, even if the iteration is retried
            return
        self._chaos_done.add(step)
        for pid in self._partitioned:
            await self._ask("heal", step=step, peer=pid)
            self._event("chaos_heal", step=step, peer_id=pid)
        self._partitioned.clear()
        for stage, pid in self._scheduled(self.opts.partition, step):
            self._event("chaos_partition", step=step, stage=stage, peer_id=pid)
            await self._ask("partition", ack=True, step=step, stage=stage, peer=pid)  # cut now; detection: timeouts
            self._partitioned.append(pid)
        for action, schedule in (("kill", self.opts.chaos), ("crash", self.opts.crash)):
            for stage, pid in self._scheduled(schedule, step):  # crash: the training process alone
                group, whole = self._group(stage), {}
                if action == "kill" and len(group) > 1:  # a stage group: one replica mid-step, or all of them now
                    if not schedule.all_of(step, stage):
                        self._arm_replica_kill(step, stage, group[-1], "step")
                        continue
                    whole = {"whole_group": True}
                for p in group[::-1] if whole else [pid]:
                    await self._ask(action, step=step, stage=stage, peer=p)
                    self._event(f"chaos_{action}", step=step, stage=stage, peer_id=p, **whole)
                    await self._wait_dead(p)
                    self.reported.add(p)
        for stage, _ in self._scheduled(self.opts.reduce_kills, step):
            if len(group := self._group(stage)) > 1:
                self._arm_replica_kill(step, stage, group[-1], "reduce")
        for stage, pid in self._scheduled(self.opts.preempt, step):
            await self._ask("term", step=step, stage=stage, peer=pid)
            deadline = time.monotonic() + self.t.rpc_timeout
            while not self.members[pid].leaving and time.monotonic() < deadline:
                await asyncio.sleep(0.05)  # the preempted peer announces its leave

    def _arm_replica_kill(self, step: int, stage: int, pid: str, during: str) -> None:
        """Local swarm chaos, stage groups: replica `pid` of `stage` SIGKILLs itself in this step, after its first
        forward (`during` "step") or half-way through the gradient all-reduce ("reduce"); the launcher starts a
        fresh spare in its place."""
        (self._die_mid_step if during == "step" else self._die_in_reduce)[pid] = step
        self._event("chaos_kill", step=step, stage=stage, peer_id=pid, during=during)
        if self.opts.chaos_handler is None:
            print(chaos_line("replica-kill", step=step, stage=stage, peer=pid), flush=True)

    async def _chaos_commit(self, step: int) -> None:
        """Local swarm chaos (--kill-coordinator-at ... in commit): half of the stages commit `step`, then the
        launcher is asked to SIGKILL this coordinator's whole process group, from outside, and this coordinator
        waits for it (a standby must finish the half-done commit)."""
        if step != self.opts.die_in_commit:
            return
        half = sorted(self.stage_peer)[: self.cfg.num_stages // 2]
        await asyncio.gather(*(self._call(self.stage_peer[s], RPC.COMMIT, {"step": step, "attempt": self._last_attempt},
                                          self.t.rpc_timeout) for s in half))
        await self._ask("coordinator-dies", step=step, committed=",".join(map(str, half)))
        await asyncio.Event().wait()  # until the SIGKILL
