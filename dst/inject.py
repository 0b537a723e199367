"""A schedule's faults, acted out at protocol points: the injector of every `FaultyTransport` of a swarm.

It watches the messages that cross the swarm's transports (`checkfree.net.faulty`), each request read as its
type (`checkfree.messages.check_request`, as its receiver reads it), and keeps the protocol's clock from them
alone: the iteration is the number of commit rounds the coordinator has started (a round: its COMMITs of one step
attempt; a takeover's completion of a half-done commit is the same round), the stage table is the newest training
RUN_STEP's. When a fault's point is reached it acts through the `Harness` (kill a peer or the coordinator, send a
peer SIGTERM, start a peer, arm a peer's fault hook: checkfree.peer_faults) or on the message (drop, delay), and
logs what it did as a `Fired` record: the victims, and the failures the simulator must see for it.
"""

from __future__ import annotations

import asyncio
import bisect
import time
from dataclasses import dataclass, field
from typing import Protocol

from checkfree.messages import (REQUESTS, AssignPromote, AssignRecover, AssignReplica, AssignRestore,
                                Backward, Commit, Forward, Message, Reduce, RunStep, check_request)
from checkfree.net.errors import TransportError
from checkfree.net.faulty import Crossing, Point
from checkfree.peer_faults import Arm, DieInReduce
from checkfree.protocol import RPC
from dst.schedule import Fault, Kind, Schedule

__all__ = ["Harness", "Fired", "Injector", "REBUILD_MODES", "PULLS"]

COORDINATOR = (Kind.COORDINATOR_FAILOVER, Kind.COORDINATOR_RESTART)
REBUILD_MODES = (AssignRecover, AssignRestore, AssignPromote, AssignReplica)  # ASSIGNs that pull a stage's state
PULLS = (RPC.GET_WEIGHTS, RPC.GET_STATE, RPC.GET_REPLICA, RPC.FETCH_SNAPSHOT, RPC.REFT_FETCH)


def _request(c: Crossing) -> Message | None:
    """The request `c` carries, as its type (None: not an RPC of the protocol's, e.g. a reft companion's)."""
    return check_request(c.rpc, c.header) if c.rpc in REQUESTS else None


class Harness(Protocol):
    """What the injector asks of the swarm it runs in."""

    def kill(self, pid: str) -> None: ...  # SIGKILL of a peer or a coordinator (coordinators: failover follows)

    def terminate(self, pid: str) -> None: ...  # SIGTERM of a peer

    def start_peer(self) -> None: ...  # a new peer process (it joins as a standby)

    def arm(self, pid: str, fault: Arm) -> None: ...  # arm a peer's fault hook (checkfree.peer_faults)


@dataclass
class Fired:
    """A fault that acted: at `iteration` (its step `step`), on `victims`; `expect` the simulator's failures it
    stands for, as (iteration, stage, whole group), or None when only the swarm's own record can tell (SIGTERM:
    a handover loses nothing, a leave without one is a failure)."""

    fault: Fault
    iteration: int
    step: int
    victims: list[str]
    expect: list[tuple[int, int, bool]] | None
    mode: str = ""  # mid-rebuild: the ASSIGN mode the victim was carrying out
    at: float = field(default_factory=time.time)

    def describe(self) -> str:
        where = f"it {self.iteration} (step {self.step})"
        return f"{self.fault.kind.value} at {where} on {', '.join(v[-6:] for v in self.victims) or '-'}"


@dataclass
class _Round:
    """The training RUN_STEP round in progress: its step, attempt and stage table."""

    step: int = -1
    attempt: int = -1
    table: dict[int, list[str]] = field(default_factory=dict)
    hops: list[list[str]] | None = None
    num_mb: int = 0


class Injector:
    """The injector of one schedule's swarm (see the module docstring)."""

    def __init__(self, schedule: Schedule, harness: Harness) -> None:
        self.setup, self.harness = schedule.setup, harness
        self.pending: list[Fault] = sorted(schedule.faults, key=lambda f: f.iteration)
        self.fired: list[Fired] = []
        self.coordinators: set[str] = set()
        self.iteration = 0  # commit rounds started
        self.commit_times: list[float] = []  # when each commit round started
        self._commit_key: tuple | None = None
        self._commit_iteration = -1
        self._commits_sent = 0
        self.round = _Round()
        self.cut: dict[str, int] = {}  # partitioned peer -> iteration it heals at
        self.slow: dict[str, tuple[int, float]] = {}  # slowed peer -> (iteration it ends at, seconds per message)
        self._passes: dict[tuple[str, str], int] = {}  # (victim, forward|backward) -> passes seen this round
        self._rebuilding: dict[str, tuple[int, str]] = {}  # peer rebuilding a stage -> (its pulls so far, mode)
        self._killed_now: set[str] = set()  # processes killed by the crossing running in them
        self.trail: list[str] = []  # every crossing, one line each (written out when a schedule diverges)
        self.errors: list[str] = []  # the injector's own failures (a harness bug: the schedule's run says nothing)

    # ---- the clock -------------------------------------------------------------------------------
    def iteration_at(self, t: float) -> int:
        """The iteration a swarm event written at time `t` belongs to."""
        return bisect.bisect_left(self.commit_times, t)

    def _watch(self, m: Message | None) -> None:
        """Keep the clock and the stage table from the coordinator's messages."""
        if isinstance(m, RunStep) and not m.evaluate:
            if (m.step, m.attempt) != (self.round.step, self.round.attempt):
                groups = m.groups or {s: [p] for s, p in m.peers.items()}
                self.round = _Round(m.step, m.attempt, {s: list(g) for s, g in groups.items()}, m.hops,
                                    len(m.routes or ()))
                self._passes.clear()
            self._commit_key = None
        elif isinstance(m, Commit):
            key = (m.step, m.attempt)
            if key != self._commit_key:
                self._commit_key, self._commit_iteration, self._commits_sent = key, self.iteration, 0
                self.iteration += 1
                self.commit_times.append(time.time())
            self._commits_sent += 1
        for pid in [p for p, until in self.cut.items() if self.iteration >= until]:
            del self.cut[pid]
        for pid in [p for p, (until, _) in self.slow.items() if self.iteration >= until]:
            del self.slow[pid]

    # ---- the injector ------------------------------------------------------------------------------
    async def __call__(self, c: Crossing) -> dict | None:
        try:
            return await self._cross(c)
        except (TransportError, asyncio.CancelledError):
            raise  # a drop, a partition, a death: what the injector does
        except Exception as e:  # noqa: BLE001 - recorded: a fault the harness failed to inject must not pass unseen
            self.errors.append(f"{c.point.value} {c.rpc} {c.me}->{c.other}: {e!r}")
            raise

    async def _cross(self, c: Crossing) -> dict | None:
        h = c.header
        self.trail.append(f"{time.time():.6f} it{self.iteration} {c.point.value:5} {c.rpc:18} {c.me}->{c.other} "
                          + " ".join(f"{k}={h[k]}" for k in ("step", "attempt", "mb", "hop", "mode", "stage")
                                     if k in h))
        m = _request(c)
        if c.point is Point.SEND and c.me in self.coordinators:
            self._watch(m)
        if c.point is Point.SEND:
            if c.me in self.cut or c.other in self.cut:
                raise TransportError(f"{c.rpc} {c.me} -> {c.other}: partitioned")
            slow = self.slow.get(c.me) or self.slow.get(c.other)
            if slow is not None:
                await asyncio.sleep(slow[1])
        for fault in list(self.pending):
            self._act(fault, c, m)
        self._track_rebuilds(c, m)
        if c.me in self._killed_now:  # the crossing's own process died: its task ends here
            self._killed_now.discard(c.me)
            await asyncio.sleep(0)
            raise TransportError(f"{c.me} was killed")
        return None  # (a message goes on unchanged: a fault's own message acts through the harness or a peer's hook)

    def _fire(self, fault: Fault, victims: list[str], expect: list[tuple[int, int, bool]] | None,
              iteration: int | None = None) -> None:
        it = self.iteration if iteration is None else iteration
        self.pending.remove(fault)
        self.fired.append(Fired(fault, it, self.round.step, victims, expect))
        self.trail.append(f"{time.time():.6f} FIRED {self.fired[-1].describe()}")

    def _kill(self, pid: str, c: Crossing) -> None:
        if pid == c.me:
            self._killed_now.add(pid)
        self.harness.kill(pid)

    def _victim(self, fault: Fault) -> str | None:
        group = self.round.table.get(fault.stage)
        return group[fault.replica % len(group)] if group else None

    def _whole(self, fault: Fault) -> bool:
        """Whether killing one replica of the fault's stage now loses the whole stage (a stage group's last)."""
        return self.setup.replicas > 1 and len(self.round.table.get(fault.stage, [])) <= 1

    def _act(self, f: Fault, c: Crossing, m: Message | None) -> bool | None:
        """Act on `c` (carrying `m`) if it is the point of fault `f`; True if it acted."""
        coordinator_send = c.point is Point.SEND and c.me in self.coordinators
        training_run_step = coordinator_send and isinstance(m, RunStep) and not m.evaluate
        if f.kind is Kind.KILL_MID_REBUILD:
            return None  # armed by the clock, acted on in _track_rebuilds
        if f.kind is Kind.KILL_MID_REDUCE:
            return self._reduce(f, c, m, coordinator_send)
        if f.kind in (Kind.KILL_MID_FORWARD, Kind.KILL_MID_BACKWARD):
            return self._mid_pass(f, c, m)
        if f.kind is Kind.KILL_MID_COMMIT or (f.kind in COORDINATOR and f.where == "commit"):
            if coordinator_send and isinstance(m, Commit) and self._commit_iteration == f.iteration:
                return self._at_commit(f, c)
            return None
        if not (training_run_step and self.iteration == f.iteration):
            return None
        if f.kind in COORDINATOR:
            self._fire(f, [c.me], [])
            self._kill(c.me, c)
            return True
        if f.kind is Kind.JOIN:
            self._fire(f, [], [])
            self.harness.start_peer()
            return True
        if f.kind in (Kind.KILL_GROUP, Kind.KILL_ADJACENT):
            stages = [f.stage] + ([f.stage + 1] if f.kind is Kind.KILL_ADJACENT else [])
            victims = [p for s in stages for p in self.round.table.get(s, [])[::-1]]
            self._fire(f, victims, [(f.iteration, s, self.setup.replicas > 1) for s in stages])
            for p in victims:
                self._kill(p, c)
            return True
        victim = self._victim(f)
        if victim != c.other:
            return None
        if f.kind is Kind.KILL_BEFORE_STEP:
            self._fire(f, [victim], [(f.iteration, f.stage, self._whole(f))])
            self._kill(victim, c)
        elif f.kind is Kind.PARTITION:
            self._fire(f, [victim], [(f.iteration, f.stage, self._whole(f))])
            self.cut[victim] = f.iteration + f.span
            raise TransportError(f"{c.rpc} {c.me} -> {c.other}: partitioned")
        elif f.kind is Kind.SLOW:
            self._fire(f, [victim], [])
            self.slow[victim] = (f.iteration + f.span, f.delay_ms / 1000)
        elif f.kind is Kind.SIGTERM:
            self._fire(f, [victim], None)
            self.harness.terminate(victim)
        return True

    def _at_commit(self, f: Fault, c: Crossing) -> bool | None:
        """Mid-commit: the victim dies as its COMMIT is sent (the others commit); or the coordinator dies once half
        of the round's COMMITs have gone out."""
        if f.kind is Kind.KILL_MID_COMMIT:
            victim = self._victim(f)
            if victim != c.other:
                return None
            self._fire(f, [victim], [(f.iteration + 1, f.stage, self._whole(f))], self._commit_iteration)
            self._kill(victim, c)
            return True
        if self._commits_sent <= sum(map(len, self.round.table.values())) // 2:
            return None
        self._fire(f, [c.me], [], self._commit_iteration)
        self._kill(c.me, c)
        return True

    def _mid_pass(self, f: Fault, c: Crossing, m: Message | None) -> bool | None:
        """Mid-forward / mid-backward: the victim's (mb+1)-th pass of the step (modulo the passes it computes): a
        pass that reaches it (SERVE) or, at its first (forward) or last (backward) hop, one it sends on."""
        forward = f.kind is Kind.KILL_MID_FORWARD
        kind = Forward if forward else Backward
        if self.iteration != f.iteration or not isinstance(m, kind) or (m.step, m.attempt) != (
                self.round.step, self.round.attempt):
            return None
        victim = self._victim(f)
        edge_hop = 1 if forward else self.setup.stages - 2  # the hop a first (last) hop's pass goes to
        mine = (c.point is Point.SERVE and c.me == victim) or (
            c.point is Point.SEND and c.me == victim and m.hop == edge_hop)
        if not mine:
            return None
        key = (victim, kind.rpc)
        self._passes[key] = self._passes.get(key, 0) + 1
        hops = self.round.hops
        computed = sum(1 for row in hops if victim in row) if hops is not None else self.round.num_mb
        if self._passes[key] != f.mb % max(computed, 1) + 1:
            return None
        self._fire(f, [victim], [(f.iteration, f.stage, self._whole(f))])
        self._kill(victim, c)
        return True

    def _reduce(self, f: Fault, c: Crossing, m: Message | None, coordinator_send: bool) -> bool | None:
        """Mid-reduce: the victim of the stage's REDUCE round dies after the first bucket of its all-reduce: its
        fault hook is armed as the REDUCE leaves (the all-reduce runs in gloo, out of the transport's sight)."""
        if not (coordinator_send and isinstance(m, Reduce) and self.iteration == f.iteration
                and f"/s{f.stage}/" in m.prefix and m.size > 1 and m.rank == f.replica % m.size):
            return None
        self._fire(f, [c.other], [(f.iteration, f.stage, False)])
        self.harness.arm(c.other, DieInReduce(step=m.step, attempt=m.attempt))
        return True

    def _track_rebuilds(self, c: Crossing, m: Message | None) -> None:
        """Mid-rebuild: from the fault's iteration on, the first peer that pulls a stage's state for an ASSIGN dies
        after `pulls` pulls (the next standby must take over)."""
        armed = next((f for f in self.pending if f.kind is Kind.KILL_MID_REBUILD and self.iteration >= f.iteration),
                     None)
        if c.point is Point.SERVE and isinstance(m, REBUILD_MODES) and armed:
            self._rebuilding[c.me] = (0, type(m).__struct_config__.tag)  # its mode
        elif c.point is Point.REPLY and c.rpc == RPC.ASSIGN and c.me in self.coordinators:
            self._rebuilding.pop(c.other, None)
        elif c.point is Point.REPLY and c.rpc in PULLS and c.me in self._rebuilding and armed:
            pulls, mode = self._rebuilding[c.me]
            self._rebuilding[c.me] = (pulls + 1, mode)
            if pulls + 1 == armed.pulls:
                del self._rebuilding[c.me]
                self._fire(armed, [c.me], [])
                self.fired[-1].mode = mode
                self._kill(c.me, c)
