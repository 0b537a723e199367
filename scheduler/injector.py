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

from collections.abc import Awaitable, Callable

from checkfree.failures import FailureSchedule
from scheduler.common import CoordinatorOptions
from scheduler.membership import Membership
from scheduler.outputs import Outputs
from scheduler.rpc import Rpc
from scheduler.stage_table import StageTable

__all__ = ["Injector", "chaos_line", "parse_chaos_line"]

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


class Injector:
    """The local swarm's fault schedule (CoordinatorOptions' chaos fields), acted on at the coordinator's hook
    points; with no schedule set, every hook does nothing."""

    def __init__(self, opts: CoordinatorOptions, rpc: Rpc, table: StageTable, membership: Membership,
                 outputs: Outputs) -> None:
        self.opts, self.rpc, self.table, self.members, self.out = opts, rpc, table, membership, outputs
        self.t = opts.timeouts
        self.iteration = 0  # executed steps, re-runs after a rollback included (the schedules' clock)
        self._done: set[int] = set()  # iterations whose scheduled failures fired
        self._recovery_killed: set[int] = set()
        self._partitioned: list[str] = []  # peers cut off the network, healed at the next iteration
        self._stdin: asyncio.StreamReader | None = None  # the launcher's acknowledgements
        self._die_mid_step: dict[str, int] = {}  # replica -> step it dies in (after its first forward)
        self._die_in_reduce: dict[str, int] = {}  # replica -> step it dies in (half-way through the reduce)

    def assign_fields(self, stage: int) -> dict:
        """Diagnostic (--chaos-slow): the peers of `stage` (each replica of its group) compute slowly."""
        if stage not in self.opts.slow:
            return {}
        delay, start = self.opts.slow[stage]
        return {"inject_delay": [delay, start]}

    def fault_fields(self, name: str, pid: str, step: int) -> dict:
        """Stage groups: a replica's RUN_STEP or REDUCE that makes it die (mid-step, mid-reduce); every member of
        the victim's group reduces in two buckets then."""
        if name == "cf.run_step" and self._die_mid_step.get(pid) == step:
            del self._die_mid_step[pid]
            return {"chaos_die_after_forwards": 1}
        if name != "cf.reduce":
            return {}
        group = self.table.group(self.table.stage_of(pid))
        victim = next((p for p in group if self._die_in_reduce.get(p) == step), None)
        if victim is None:
            return {}
        if pid == victim:
            del self._die_in_reduce[pid]
            return {"buckets": 2, "chaos_die_in_reduce": True}
        return {"buckets": 2}

    async def replacement_fields(self, pid: str, stage: int) -> dict:
        """The peer just chosen to rebuild `stage`: killed now (--chaos-recovery-kills, a failure during recovery)
        or told to SIGKILL itself after its first weight pull (--chaos-rebuild-kills)."""
        it = self.iteration
        if it in self._recovery_killed:
            return {}
        if it in self.opts.chaos_recovery_kills:
            self._recovery_killed.add(it)
            await self._ask("kill", step=it, stage=stage, peer=pid, during="recovery")
            await self._wait_dead(pid)
            return {}
        if it in self.opts.chaos_rebuild_kills:
            self._recovery_killed.add(it)
            print(chaos_line("rebuild-kill", step=it, stage=stage, peer=pid), flush=True)
            return {"chaos_die_after_pulls": 1}
        return {}

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
        while await self.rpc.alive(pid) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    def _scheduled(self, schedule: FailureSchedule | None, step: int) -> list[tuple[int, str]]:
        """(stage, peer) of the stages `schedule` names at `step` that have a peer."""
        stages = sorted(schedule.at(step)) if schedule else []
        return [(s, self.table.peer(s)) for s in stages if s in self.table.served()]

    async def at_iteration(self, iteration: int) -> None:
        """Ask the launcher to SIGKILL, SIGTERM or cut off the network (--netns) the scheduled stages' peers, then
        wait until that is in effect, so that the failure lands at the start of this iteration (executed steps,
        re-runs included, as in the simulator). A partition is healed at the next iteration, once its stage has
        been recovered."""
        self.iteration = iteration
        if iteration in self._done:  # each scheduled failure fires once, even if the iteration is retried
            return
        self._done.add(iteration)
        for pid in self._partitioned:
            await self._ask("heal", step=iteration, peer=pid)
            self.out.event("chaos_heal", step=iteration, peer_id=pid)
        self._partitioned.clear()
        for stage, pid in self._scheduled(self.opts.partition, iteration):
            self.out.event("chaos_partition", step=iteration, stage=stage, peer_id=pid)
            await self._ask("partition", ack=True, step=iteration, stage=stage, peer=pid)  # detection: timeouts
            self._partitioned.append(pid)
        for action, schedule in (("kill", self.opts.chaos), ("crash", self.opts.crash)):
            for stage, pid in self._scheduled(schedule, iteration):  # crash: the training process alone
                await self._kill(action, schedule, iteration, stage, pid)
        for stage, _ in self._scheduled(self.opts.reduce_kills, iteration):
            if len(group := self.table.group(stage)) > 1:
                self._arm_replica_kill(iteration, stage, group[-1], "reduce")
        for stage, pid in self._scheduled(self.opts.preempt, iteration):
            await self._ask("term", step=iteration, stage=stage, peer=pid)
            deadline = time.monotonic() + self.t.rpc_timeout
            while not self.members.leaving(pid) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)  # the preempted peer announces its leave

    async def _kill(self, action: str, schedule: FailureSchedule, iteration: int, stage: int, pid: str) -> None:
        """A scheduled kill of `stage`'s peer; in a stage group one replica mid-step, or (`all`) every one now."""
        group, whole = self.table.group(stage), {}
        if action == "kill" and len(group) > 1:
            if not schedule.all_of(iteration, stage):
                self._arm_replica_kill(iteration, stage, group[-1], "step")
                return
            whole = {"whole_group": True}
        for p in group[::-1] if whole else [pid]:
            await self._ask(action, step=iteration, stage=stage, peer=p)
            self.out.event(f"chaos_{action}", step=iteration, stage=stage, peer_id=p, **whole)
            await self._wait_dead(p)
            self.members.suspect(p)

    def _arm_replica_kill(self, step: int, stage: int, pid: str, during: str) -> None:
        """Stage groups: replica `pid` of `stage` SIGKILLs itself in this step, after its first forward (`during`
        "step") or half-way through the gradient all-reduce ("reduce"); the launcher starts a fresh spare."""
        if during == "step":
            self._die_mid_step[pid] = step
        else:
            self._die_in_reduce[pid] = step
        self.out.event("chaos_kill", step=step, stage=stage, peer_id=pid, during=during)
        if self.opts.chaos_handler is None:
            print(chaos_line("replica-kill", step=step, stage=stage, peer=pid), flush=True)

    async def in_commit(self, step: int, commit: Callable[[list[int]], Awaitable[object]], num_stages: int) -> None:
        """--kill-coordinator-at ... in commit: half of the stages commit `step` (`commit(stages)`), then the
        launcher is asked to SIGKILL this coordinator's whole process group, from outside, and this coordinator
        waits for it (a standby must finish the half-done commit)."""
        if step != self.opts.die_in_commit:
            return
        half = self.table.served()[: num_stages // 2]
        await commit(half)
        await self._ask("coordinator-dies", step=step, committed=",".join(map(str, half)))
        await asyncio.Event().wait()  # until the SIGKILL
