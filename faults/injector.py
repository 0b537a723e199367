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
* at the SEND point of the coordinator's transport (`crossing`), before a request leaves: the peer it goes to is
  armed through the control channel of its fault hook (checkfree.peer_faults; a peer started with --fault-hook,
  or the in-process tier's), never through a field of the request: a replica dies after its first forward of a
  step (RUN_STEP) or half-way through the gradient all-reduce (REDUCE); a scheduled peer dies at its (mb+1)-th
  forward or backward pass of an iteration (RUN_STEP, --chaos-peer-kill forward|backward); the replacement chosen
  at an iteration dies after its first weight pull, or is killed as its ASSIGN leaves (recover, promote); a
  slowed stage's peers compute slowly (ASSIGN fresh, load, replica). At "commit", a scheduled peer is armed to die
  as it takes the COMMIT (--chaos-peer-kill commit).

The CHAOS line protocol the launcher reads (`chaos_line`, `parse_chaos_line`) is written and read here only.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from checkfree.failures import FailureSchedule
from checkfree.messages import (AssignFresh, AssignLoad, AssignPromote, AssignRecover, AssignReplica, Commit, Reduce,
                                RunStep, check_request)
from checkfree.net.base import Transport
from checkfree.net.faulty import Crossing, FaultyTransport, Point
from checkfree.peer_hook import PassKind
from checkfree.peer_faults import Arm, DieAfterPasses, DieAfterPulls, DieAtCommit, DieInReduce, Slow, arm_peer
from coordinator.common import CALL_ERRORS

if TYPE_CHECKING:
    from coordinator.coordinator import Coordinator

__all__ = ["FaultSchedule", "PeerKill", "Injector", "chaos_line", "parse_chaos_line", "parse_peer_kill"]

# The launcher protocol: the coordinator prints one line per request, `CHAOS <action> key=value ...`; the
# launcher acts (and, for a partition, acknowledges on stdin).
CHAOS_ACTIONS = ("kill", "crash", "rebuild-kill", "replica-kill", "self-kill", "term", "partition", "heal",
                 "coordinator-dies", "join")
PEER_KILLS = ("forward", "backward", "commit")  # where a --chaos-peer-kill lands

log = logging.getLogger("coordinator.coordinator")


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


@dataclass(frozen=True)
class PeerKill:
    """Replica `replica` (modulo its group's size) of `stage` dies at iteration `iteration`: at its (mb+1)-th forward
    or backward pass (modulo the passes it computes), or as it takes the COMMIT."""

    during: str  # forward | backward | commit
    iteration: int
    stage: int
    replica: int = 0
    mb: int = 0


def parse_peer_kill(spec: str, num_stages: int) -> PeerKill:
    """`forward|backward|commit:ITERATION:STAGE[:REPLICA[:MB]]` (--chaos-peer-kill)."""
    parts = spec.strip().split(":")
    try:
        numbers = [int(x) for x in parts[1:]]
    except ValueError:
        numbers = []
    if parts[0] not in PEER_KILLS or not 2 <= len(numbers) <= 4 or min(numbers) < 0 or numbers[1] >= num_stages:
        raise ValueError(f"--chaos-peer-kill {spec!r}: expected forward|backward|commit:ITERATION:STAGE[:REPLICA[:MB]] "
                         f"with STAGE < {num_stages}")
    return PeerKill(parts[0], *numbers)


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
    peer_kills: tuple[PeerKill, ...] = ()  # peers armed to die mid-forward, mid-backward or mid-commit
    joins: tuple[int, ...] = ()  # a new peer is started as each of these iterations starts (once per entry)
    die_in_commit: int | None = None  # SIGKILL the coordinator's process group half-way through this step's commit
    # ...or as the iteration that runs this step starts (a partition of the last iteration healed, nothing of this
    # one fired: the coordinator that takes over fires it, so each fault fires once)
    die_at: int | None = None
    # ...or once the faults of the iteration that runs this step fired, before it saw them (the peers it killed die
    # with it: the coordinator that takes over finds them gone and does not fire them again, as they serve no stage)
    die_after_faults: int | None = None
    # the in-process tier: requests (action, fields) go to this coroutine instead of to the launcher
    handler: Callable[[str, dict], Awaitable[None]] | None = None


class Injector:
    """Acts out a `FaultSchedule` on one coordinator (see the module docstring): its hook, and the injector of the
    `FaultyTransport` around its transport."""

    def __init__(self, schedule: FaultSchedule) -> None:
        self.schedule = schedule
        self._coordinator: Coordinator | None = None  # the coordinator, from its first hook call on
        self.iteration = 0
        self._done: set[int] = set()  # iterations whose scheduled failures fired
        self._recovery_killed: set[int] = set()
        self._partitioned: list[str] = []  # peers cut off the network, healed at the next iteration
        self._stdin: asyncio.StreamReader | None = None  # the launcher's acknowledgements
        self._die_mid_step: dict[str, int] = {}  # replica -> step it dies in (after its first forward)
        self._die_in_reduce: dict[str, int] = {}  # replica -> step it dies in (half-way through the reduce)
        self._peer_kills = list(schedule.peer_kills)  # not armed yet
        self._inner: Transport | None = None  # the coordinator's transport inside the FaultyTransport (arms go there)

    # ---- the coordinator's hook ------------------------------------------------------------
    @property
    def coordinator(self) -> Coordinator:
        """The coordinator whose hook this is (from its first call on)."""
        assert self._coordinator is not None, "the injector has not been called by a coordinator yet"
        return self._coordinator

    async def __call__(self, point: str, coordinator: Coordinator) -> None:
        self._coordinator = coordinator
        if point == "started":
            coordinator.rpc.wrap(self._wrap)
        elif point == "iteration":
            await self._at_iteration(coordinator.view().iteration)
        elif point == "commit":
            step = coordinator.view().step
            await self._arm_commit_kills(step)
            await self._in_commit(step)

    def _group(self, stage: int) -> tuple[str, ...]:
        """The peers of `stage` now, the primary first (the coordinator's view; empty: nobody serves it)."""
        return self.coordinator.view().groups.get(stage, ())

    def _wrap(self, transport: Transport) -> Transport:
        self._inner = transport
        return cast(Transport, FaultyTransport(transport, self.crossing))

    async def _at_iteration(self, iteration: int) -> None:
        """Ask the launcher to SIGKILL, SIGTERM or cut off the network (--netns) the scheduled stages' peers, then
        wait until that is in effect, so that the failure lands at the start of this iteration (executed steps,
        re-runs included, as in the simulator). A partition is healed at the next iteration, once its stage has
        been recovered."""
        self.iteration = iteration
        if iteration in self._done:  # each scheduled failure fires once, even if the iteration is retried
            return
        self._done.add(iteration)
        out, s = self.coordinator.out, self.schedule
        for pid in self._partitioned:
            await self._ask("heal", step=iteration, peer=pid)
            out.event("chaos_heal", step=iteration, peer_id=pid)
        self._partitioned.clear()
        step = self.coordinator.view().step
        if s.die_at is not None and step == s.die_at:
            await self._die(step=step)
        for _ in range(s.joins.count(iteration)):  # a standby joining mid-run
            out.event("chaos_join", step=iteration)
            await self._ask("join", step=iteration)
        for stage, pid in self._scheduled(s.partition, iteration):
            out.event("chaos_partition", step=iteration, stage=stage, peer_id=pid)
            await self._ask("partition", ack=True, step=iteration, stage=stage, peer=pid)  # detection: timeouts
            self._partitioned.append(pid)
        for action, schedule in (("kill", s.kills), ("crash", s.crash)):
            for stage, pid in self._scheduled(schedule, iteration):  # crash: the training process alone
                await self._kill(action, schedule, iteration, stage, pid)
        for stage, _ in self._scheduled(s.reduce_kills, iteration):
            if len(group := self._group(stage)) > 1:
                self._arm_replica_kill(iteration, stage, group[-1], "reduce")
        for stage, pid in self._scheduled(s.preempt, iteration):
            await self._ask("term", step=iteration, stage=stage, peer=pid)
            deadline = time.monotonic() + self.coordinator.view().timeouts.rpc_timeout
            while pid not in self.coordinator.view().members.leaving and time.monotonic() < deadline:
                await asyncio.sleep(0.05)  # the preempted peer announces its leave
        if s.die_after_faults is not None and step == s.die_after_faults:
            await self._die(step=step, after="faults")

    async def _kill(self, action: str, schedule: FailureSchedule | None, iteration: int, stage: int, pid: str) -> None:
        """A scheduled kill of `stage`'s peer; in a stage group one replica mid-step, or (`all`) every one now."""
        group, whole = self._group(stage), {}
        if action == "kill" and len(group) > 1:
            if schedule is None or not schedule.all_of(iteration, stage):
                self._arm_replica_kill(iteration, stage, group[-1], "step")
                return
            whole = {"whole_group": True}
        for p in group[::-1] if whole else [pid]:
            await self._ask(action, step=iteration, stage=stage, peer=p)
            self.coordinator.out.event(f"chaos_{action}", step=iteration, stage=stage, peer_id=p, **whole)
            await self._wait_dead(p)
            self.coordinator.members.suspect(p)

    async def _arm_commit_kills(self, step: int) -> None:
        """--chaos-peer-kill commit: the scheduled peers of this iteration die as they take its COMMIT."""
        for kill in self._due("commit"):
            pid = self._victim(kill)
            if pid is not None:
                self._self_kill(kill, pid)
                await self._arm(pid, DieAtCommit(step=step))

    def _due(self, *during: str) -> list[PeerKill]:
        """The peer kills of the current iteration landing `during`, taken off the schedule."""
        due = [k for k in self._peer_kills if k.during in during and k.iteration == self.iteration]
        self._peer_kills = [k for k in self._peer_kills if k not in due]
        return due

    def _victim(self, kill: PeerKill) -> str | None:
        group = self._group(kill.stage)
        return group[kill.replica % len(group)] if group else None

    def _self_kill(self, kill: PeerKill, pid: str) -> None:
        """A peer armed to kill itself: recorded, and (local swarm) the launcher told to start a spare."""
        fields = dict(step=kill.iteration, stage=kill.stage, peer=pid, during=kill.during)
        self.coordinator.out.event("chaos_kill", step=kill.iteration, stage=kill.stage, peer_id=pid, during=kill.during)
        if self.schedule.handler is None:
            print(chaos_line("self-kill", **fields), flush=True)

    async def _arm(self, pid: str, arm: Arm) -> None:
        """Arm `pid`'s fault hook through its control channel before the request that reaches it leaves. A peer
        with no hook cannot be armed: an error line, and the fault does not happen."""
        try:
            assert self._inner is not None  # (wrapped at "started", before any peer joined)
            await arm_peer(self._inner, pid, arm, self.coordinator.view().timeouts.rpc_timeout)
        except CALL_ERRORS as e:
            log.error("fault not armed on peer %s (%s): %s; was it started with --fault-hook?", pid, arm, e)

    def _arm_replica_kill(self, step: int, stage: int, pid: str, during: str) -> None:
        """Stage groups: replica `pid` of `stage` SIGKILLs itself in this step, after its first forward (`during`
        "step") or half-way through the gradient all-reduce ("reduce"); the launcher starts a fresh spare."""
        if during == "step":
            self._die_mid_step[pid] = step
        else:
            self._die_in_reduce[pid] = step
        self.coordinator.out.event("chaos_kill", step=step, stage=stage, peer_id=pid, during=during)
        if self.schedule.handler is None:
            print(chaos_line("replica-kill", step=step, stage=stage, peer=pid), flush=True)

    async def _in_commit(self, step: int) -> None:
        """--chaos-die-in-commit: half of the stages commit `step`, then the launcher is asked to SIGKILL this
        coordinator's whole process group, from outside, and this coordinator waits for it (a standby must finish
        the half-done commit)."""
        if step != self.schedule.die_in_commit:
            return
        c = self.coordinator
        view = c.view()
        assert view.cfg is not None  # (a commit: the run is configured)
        half = sorted(view.groups)[: view.cfg.num_stages // 2]
        commit = Commit(step=step, attempt=view.last_attempt)
        await asyncio.gather(*(c.rpc.call(view.groups[s][0], commit, view.timeouts.rpc_timeout) for s in half))
        await self._die(step=step, committed=",".join(map(str, half)))

    async def _die(self, **fields: Any) -> None:
        """Ask the launcher to SIGKILL this coordinator's process group, and wait for it."""
        await self._ask("coordinator-dies", **fields)
        await asyncio.Event().wait()  # until the SIGKILL

    # ---- the coordinator's transport ---------------------------------------------------------
    async def crossing(self, c: Crossing) -> dict | None:
        """A request the coordinator sends (SEND): the peer it goes to armed first, if a fault says so. The request
        itself goes on unchanged (None)."""
        if c.point is not Point.SEND or c.rpc not in (AssignFresh.rpc, RunStep.rpc, Reduce.rpc):
            return None
        request = check_request(c.rpc, {**c.header})
        if isinstance(request, RunStep):
            arms = self._step_arms(c.other, request)
        elif isinstance(request, Reduce):
            arms = self._reduce_arms(c.other, request)
        else:
            arms = await self._assign_arms(c.other, request)
        for arm in arms:
            await self._arm(c.other, arm)
        return None

    def _step_arms(self, pid: str, run_step: RunStep) -> list[Arm]:
        """A replica armed to die mid-step dies after its first forward of that step; a peer scheduled to die at a
        pass of this iteration (--chaos-peer-kill forward|backward), at that pass."""
        if run_step.evaluate:
            return []
        arms: list[Arm] = []
        if self._die_mid_step.get(pid) == run_step.step:
            del self._die_mid_step[pid]
            arms.append(DieAfterPasses(pass_kind="forward", step=run_step.step))
        for kill in [k for k in self._peer_kills if k.during != "commit" and k.iteration == self.iteration]:
            if self._victim(kill) == pid:
                self._peer_kills.remove(kill)
                self._self_kill(kill, pid)
                arms.append(DieAfterPasses(pass_kind=cast(PassKind, kill.during), step=run_step.step, mb=kill.mb))
        return arms

    def _reduce_arms(self, pid: str, reduce: Reduce) -> list[Arm]:
        """A replica armed to die mid-reduce dies after the first bucket of the step's all-reduce."""
        if self._die_in_reduce.get(pid) != reduce.step:
            return []
        del self._die_in_reduce[pid]
        return [DieInReduce(step=reduce.step, attempt=reduce.attempt)]

    async def _assign_arms(self, pid: str, assign: object) -> list[Arm]:
        """ASSIGN: a slowed stage's new peer computes slowly (--chaos-slow); the replacement chosen at a scheduled
        iteration is killed now (--chaos-recovery-kills: its ASSIGN then fails, the next standby is tried) or
        SIGKILLs itself after its first weight pull (--chaos-rebuild-kills)."""
        if isinstance(assign, (AssignFresh, AssignLoad, AssignReplica)):
            slow = self.schedule.slow.get(assign.stage)
            return [] if slow is None else [Slow(seconds=slow[0], from_step=slow[1])]
        if not isinstance(assign, (AssignRecover, AssignPromote)) or self.iteration in self._recovery_killed:
            return []
        it, stage = self.iteration, assign.stage
        if it in self.schedule.recovery_kills:
            self._recovery_killed.add(it)
            await self._ask("kill", step=it, stage=stage, peer=pid, during="recovery")
            await self._wait_dead(pid)
        elif it in self.schedule.rebuild_kills:
            self._recovery_killed.add(it)
            print(chaos_line("rebuild-kill", step=it, stage=stage, peer=pid), flush=True)
            return [DieAfterPulls(pulls=1)]
        return []

    # ---- the launcher -----------------------------------------------------------------------
    async def _ask(self, action: str, *, ack: bool = False, **fields: Any) -> None:
        """One fault-injection request: to the in-process handler when there is one (it returns once it has
        acted), else a CHAOS line for the launcher (``ack``: and wait for its acknowledgement on stdin)."""
        if self.schedule.handler is not None:
            await self.schedule.handler(action, fields)
            return
        print(chaos_line(action, **fields), flush=True)
        if ack:
            await self._launcher_ack()

    async def _launcher_ack(self) -> None:
        """Local swarm: wait (up to rpc_timeout) for the launcher's line on stdin saying it has acted."""
        loop = asyncio.get_running_loop()
        stdin = self._stdin
        if stdin is None:
            stdin = self._stdin = asyncio.StreamReader()
            await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)
        try:
            await asyncio.wait_for(stdin.readline(), self.coordinator.view().timeouts.rpc_timeout)
        except asyncio.TimeoutError:
            log.warning("no acknowledgement from the launcher within rpc_timeout; going on")

    async def _wait_dead(self, pid: str) -> None:
        """Until a peer the launcher was asked to kill stops answering (bounded by join_timeout)."""
        deadline = time.monotonic() + self.coordinator.view().timeouts.join_timeout
        while await self.coordinator.rpc.alive(pid) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    def _scheduled(self, schedule: FailureSchedule | None, step: int) -> list[tuple[int, str]]:
        """(stage, peer) of the stages `schedule` names at `step` that have a peer."""
        stages = sorted(schedule.at(step)) if schedule else []
        groups = self.coordinator.view().groups
        return [(s, groups[s][0]) for s in stages if s in groups]
