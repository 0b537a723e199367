"""Faults from outside, for the local swarm and the in-process tier (`checkfree scheduler`'s --chaos-* flags): the
schedule (`FaultSchedule`) and the `Injector` that acts it out. None of it runs in production: the coordinator has
one hook point (`Coordinator(cfg, opts, hook=...)`, None by default) and knows no schedule.

The injector acts in two places, both outside the coordinator's logic:

* at the coordinator's hook, `injector(point, coordinator)`: "started" (its transport is up: the injector wraps it
  in a `checkfree.net.faulty.FaultyTransport`), "iteration" (an iteration starts: the scheduled SIGKILLs, SIGTERMs
  and partitions are asked of the launcher, one `CHAOS ...` line each, acknowledged on stdin, or in the in-process
  tier of `FaultSchedule.handler`, and awaited; with --chaos-die-at, the launcher SIGKILLs the coordinator's process
  group first, and the coordinator that takes over fires the iteration's faults), "commit" (--chaos-die-in-commit:
  half the stages commit, then the launcher SIGKILLs the coordinator's process group);
* at the SEND point of the coordinator's transport (`crossing`): a request leaves with the fields a peer acts on
  (its one hook, peers/debug.py): a replica dies after its first forward of a step (RUN_STEP) or half-way through
  the gradient all-reduce (REDUCE; every member of its group then reduces in two buckets); the replacement chosen
  at an iteration dies after its first weight pull, or is killed as its ASSIGN leaves (recover, promote); a
  slowed stage's peers compute slowly (ASSIGN fresh, load, replica).

The CHAOS line protocol the launcher reads (`chaos_line`, `parse_chaos_line`) is written and read here only.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from checkfree.failures import FailureSchedule
from checkfree.messages import (AssignFresh, AssignLoad, AssignPromote, AssignRecover, AssignReplica, Commit, Reduce,
                                RunStep, check_request)
from checkfree.net.faulty import Crossing, FaultyTransport, Point

if TYPE_CHECKING:
    from scheduler.coordinator import Coordinator

__all__ = ["FaultSchedule", "Injector", "chaos_line", "parse_chaos_line"]

# The launcher protocol: the coordinator prints one line per request, `CHAOS <action> key=value ...`; the
# launcher acts (and, for a partition, acknowledges on stdin).
CHAOS_ACTIONS = ("kill", "crash", "rebuild-kill", "replica-kill", "term", "partition", "heal", "coordinator-dies")

log = logging.getLogger("scheduler.coordinator")


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


@dataclass(kw_only=True)
class FaultSchedule:
    """What the injector does to a run, by iteration (executed steps, re-runs after a rollback included: the
    simulator's failure clock)."""

    kills: FailureSchedule | None = None  # SIGKILL these (step, stage) peers (a stage group: one replica mid-step)
    preempt: FailureSchedule | None = None  # SIGTERM these (preemption notices)
    crash: FailureSchedule | None = None  # SIGKILL only these peers' main process
    reduce_kills: FailureSchedule | None = None  # stage groups: a replica dies mid-reduce at (step, stage)
    recovery_kills: frozenset[int] = frozenset()  # at these iterations, kill the replacement as it is assigned
    rebuild_kills: frozenset[int] = frozenset()  # ...or have it SIGKILL itself after its first weight pull
    partition: FailureSchedule | None = None  # (--netns) cut these (step, stage) peers off the network
    slow: dict[int, tuple[float, int]] = field(default_factory=dict)  # diagnostic: stage -> (s per compute, from step)
    die_in_commit: int | None = None  # SIGKILL the coordinator's process group half-way through this step's commit
    # ...or as the iteration that runs this step starts (a partition of the last iteration healed, nothing of this
    # one fired: the coordinator that takes over fires it, so each fault fires once)
    die_at: int | None = None
    # the in-process tier: requests (action, fields) go to this coroutine instead of to the launcher
    handler: Callable[[str, dict], Awaitable[None]] | None = None


class Injector:
    """Acts out a `FaultSchedule` on one coordinator (see the module docstring): its hook, and the injector of the
    `FaultyTransport` around its transport."""

    def __init__(self, schedule: FaultSchedule) -> None:
        self.s = schedule
        self.c: Coordinator | None = None  # the coordinator, from its first hook call on
        self.iteration = 0
        self._done: set[int] = set()  # iterations whose scheduled failures fired
        self._recovery_killed: set[int] = set()
        self._partitioned: list[str] = []  # peers cut off the network, healed at the next iteration
        self._stdin: asyncio.StreamReader | None = None  # the launcher's acknowledgements
        self._die_mid_step: dict[str, int] = {}  # replica -> step it dies in (after its first forward)
        self._die_in_reduce: dict[str, int] = {}  # replica -> step it dies in (half-way through the reduce)

    # ---- the coordinator's hook ------------------------------------------------------------
    async def __call__(self, point: str, coordinator: Coordinator) -> None:
        self.c = coordinator
        if point == "started":
            coordinator.rpc.wrap(lambda t: FaultyTransport(t, self.crossing))
        elif point == "iteration":
            await self._at_iteration(coordinator.iteration)
        elif point == "commit":
            await self._in_commit(coordinator.step)

    async def _at_iteration(self, iteration: int) -> None:
        """Ask the launcher to SIGKILL, SIGTERM or cut off the network (--netns) the scheduled stages' peers, then
        wait until that is in effect, so that the failure lands at the start of this iteration (executed steps,
        re-runs included, as in the simulator). A partition is healed at the next iteration, once its stage has
        been recovered."""
        self.iteration = iteration
        if iteration in self._done:  # each scheduled failure fires once, even if the iteration is retried
            return
        self._done.add(iteration)
        out, s = self.c.out, self.s
        for pid in self._partitioned:
            await self._ask("heal", step=iteration, peer=pid)
            out.event("chaos_heal", step=iteration, peer_id=pid)
        self._partitioned.clear()
        if s.die_at is not None and self.c.step == s.die_at:
            await self._die(step=self.c.step)
        for stage, pid in self._scheduled(s.partition, iteration):
            out.event("chaos_partition", step=iteration, stage=stage, peer_id=pid)
            await self._ask("partition", ack=True, step=iteration, stage=stage, peer=pid)  # detection: timeouts
            self._partitioned.append(pid)
        for action, schedule in (("kill", s.kills), ("crash", s.crash)):
            for stage, pid in self._scheduled(schedule, iteration):  # crash: the training process alone
                await self._kill(action, schedule, iteration, stage, pid)
        for stage, _ in self._scheduled(s.reduce_kills, iteration):
            if len(group := self.c.table.group(stage)) > 1:
                self._arm_replica_kill(iteration, stage, group[-1], "reduce")
        for stage, pid in self._scheduled(s.preempt, iteration):
            await self._ask("term", step=iteration, stage=stage, peer=pid)
            deadline = time.monotonic() + self.c.rpc.t.rpc_timeout
            while not self.c.members.leaving(pid) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)  # the preempted peer announces its leave

    async def _kill(self, action: str, schedule: FailureSchedule, iteration: int, stage: int, pid: str) -> None:
        """A scheduled kill of `stage`'s peer; in a stage group one replica mid-step, or (`all`) every one now."""
        group, whole = self.c.table.group(stage), {}
        if action == "kill" and len(group) > 1:
            if not schedule.all_of(iteration, stage):
                self._arm_replica_kill(iteration, stage, group[-1], "step")
                return
            whole = {"whole_group": True}
        for p in group[::-1] if whole else [pid]:
            await self._ask(action, step=iteration, stage=stage, peer=p)
            self.c.out.event(f"chaos_{action}", step=iteration, stage=stage, peer_id=p, **whole)
            await self._wait_dead(p)
            self.c.members.suspect(p)

    def _arm_replica_kill(self, step: int, stage: int, pid: str, during: str) -> None:
        """Stage groups: replica `pid` of `stage` SIGKILLs itself in this step, after its first forward (`during`
        "step") or half-way through the gradient all-reduce ("reduce"); the launcher starts a fresh spare."""
        if during == "step":
            self._die_mid_step[pid] = step
        else:
            self._die_in_reduce[pid] = step
        self.c.out.event("chaos_kill", step=step, stage=stage, peer_id=pid, during=during)
        if self.s.handler is None:
            print(chaos_line("replica-kill", step=step, stage=stage, peer=pid), flush=True)

    async def _in_commit(self, step: int) -> None:
        """--chaos-die-in-commit: half of the stages commit `step`, then the launcher is asked to SIGKILL this
        coordinator's whole process group, from outside, and this coordinator waits for it (a standby must finish
        the half-done commit)."""
        if step != self.s.die_in_commit:
            return
        c = self.c
        half = c.table.served()[: c.cfg.num_stages // 2]
        commit = Commit(step=step, attempt=c.driver.last_attempt)
        await asyncio.gather(*(c.rpc.call(c.table.peer(s), commit, c.rpc.t.rpc_timeout) for s in half))
        await self._die(step=step, committed=",".join(map(str, half)))

    async def _die(self, **fields: object) -> None:
        """Ask the launcher to SIGKILL this coordinator's process group, and wait for it."""
        await self._ask("coordinator-dies", **fields)
        await asyncio.Event().wait()  # until the SIGKILL

    # ---- the coordinator's transport ---------------------------------------------------------
    async def crossing(self, c: Crossing) -> dict | None:
        """A request the coordinator sends (SEND): the fields the scheduled faults add to it, or None."""
        if c.point is not Point.SEND or c.rpc not in (AssignFresh.rpc, RunStep.rpc, Reduce.rpc):
            return None
        request = check_request(c.rpc, {**c.header})
        if isinstance(request, RunStep):
            fields = self._step_fields(c.other, request)
        elif isinstance(request, Reduce):
            fields = self._reduce_fields(c.other, request)
        else:
            fields = await self._assign_fields(c.other, request)
        return {**c.header, **fields} if fields else None

    def _step_fields(self, pid: str, run_step: RunStep) -> dict:
        """A replica armed to die mid-step is told so in its RUN_STEP of that step."""
        if run_step.evaluate or self._die_mid_step.get(pid) != run_step.step:
            return {}
        del self._die_mid_step[pid]
        return {"chaos_die_after_forwards": 1}

    def _reduce_fields(self, pid: str, reduce: Reduce) -> dict:
        """A replica armed to die mid-reduce dies after the first of two buckets; its group reduces in two."""
        group = self.c.table.group(self.c.table.stage_of(pid))
        victim = next((p for p in group if self._die_in_reduce.get(p) == reduce.step), None)
        if victim is None:
            return {}
        if pid == victim:
            del self._die_in_reduce[pid]
            return {"buckets": 2, "chaos_die_in_reduce": True}
        return {"buckets": 2}

    async def _assign_fields(self, pid: str, assign: object) -> dict:
        """ASSIGN: a slowed stage's new peer computes slowly (--chaos-slow); the replacement chosen at a scheduled
        iteration is killed now (--chaos-recovery-kills: its ASSIGN then fails, the next standby is tried) or told
        to SIGKILL itself after its first weight pull (--chaos-rebuild-kills)."""
        if isinstance(assign, (AssignFresh, AssignLoad, AssignReplica)):
            slow = self.s.slow.get(assign.stage)
            return {} if slow is None else {"inject_delay": list(slow)}
        if not isinstance(assign, (AssignRecover, AssignPromote)) or self.iteration in self._recovery_killed:
            return {}
        it, stage = self.iteration, assign.stage
        if it in self.s.recovery_kills:
            self._recovery_killed.add(it)
            await self._ask("kill", step=it, stage=stage, peer=pid, during="recovery")
            await self._wait_dead(pid)
        elif it in self.s.rebuild_kills:
            self._recovery_killed.add(it)
            print(chaos_line("rebuild-kill", step=it, stage=stage, peer=pid), flush=True)
            return {"chaos_die_after_pulls": 1}
        return {}

    # ---- the launcher -----------------------------------------------------------------------
    async def _ask(self, action: str, *, ack: bool = False, **fields: object) -> None:
        """One fault-injection request: to the in-process handler when there is one (it returns once it has
        acted), else a CHAOS line for the launcher (``ack``: and wait for its acknowledgement on stdin)."""
        if self.s.handler is not None:
            await self.s.handler(action, fields)
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
            await asyncio.wait_for(self._stdin.readline(), self.c.rpc.t.rpc_timeout)
        except asyncio.TimeoutError:
            log.warning("no acknowledgement from the launcher within rpc_timeout; going on")

    async def _wait_dead(self, pid: str) -> None:
        """Until a peer the launcher was asked to kill stops answering (bounded by join_timeout)."""
        deadline = time.monotonic() + self.c.rpc.t.join_timeout
        while await self.c.rpc.alive(pid) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    def _scheduled(self, schedule: FailureSchedule | None, step: int) -> list[tuple[int, str]]:
        """(stage, peer) of the stages `schedule` names at `step` that have a peer."""
        stages = sorted(schedule.at(step)) if schedule else []
        return [(s, self.c.table.peer(s)) for s in stages if s in self.c.table.served()]
