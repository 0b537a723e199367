"""A whole swarm in one process for the deterministic simulation tests: the real `Coordinator` and `PeerDaemon`s
over the memory network, each in a `SimProcess` of its own, every transport wrapped by the schedule's injector.

What a launcher does for `checkfree local` this harness does in-process: it starts the coordinator (and a hot
standby coordinator when the schedule kills the coordinator), S x R + spares peers, acts on the injector's
requests (a SIGKILL ends a whole `SimProcess`: its transport, its tasks; a SIGTERM sets the peer's stop event, as
its signal handler does; a killed coordinator is followed by its standby or a coordinator started with
takeover), waits for the run to end, and tears everything down: peers still running are told to stop, then
killed. What is left after that (tasks, threads) is a leak.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
from dataclasses import dataclass, field
from pathlib import Path

from checkfree.config import RunConfig
from checkfree.net.faulty import FaultyTransport
from checkfree.net.lifeline import living, process_tree
from checkfree.net.faulty import Injector as FaultInjector
from checkfree.net.in_memory import MEMORY, MemoryTransport, SimProcess
from checkfree.peer_faults import Arm, PeerFaults
from checkfree.protocol import Timeouts
from checkfree.recovery import UnrecoverableFailure
from dst.inject import Injector
from dst.schedule import Kind, Schedule
from peers.daemon import PeerDaemon, PeerOptions
from coordinator.common import CoordinatorOptions
from coordinator.coordinator import Coordinator

__all__ = ["SimSwarm", "TIMEOUTS", "peers_needed"]

TIMEOUTS = Timeouts(heartbeat_ttl=2.0, rpc_timeout=20.0, step_timeout=60.0, join_timeout=60.0)
RUN_ID = "dst"


def peers_needed(schedule: Schedule) -> int:
    """S x R peers and enough spares for every peer the schedule may take away (each kill, partition, SIGTERM
    and rebuild kill), plus one."""
    s = schedule.setup
    taken = 0
    for f in schedule.faults:
        if f.kind is Kind.KILL_GROUP:
            taken += s.replicas
        elif f.kind is Kind.KILL_ADJACENT:
            taken += 2 * s.replicas
        elif f.kind not in (Kind.SLOW, Kind.JOIN, Kind.COORDINATOR_FAILOVER, Kind.COORDINATOR_RESTART):
            taken += 1
    return s.stages * s.replicas + taken + 1


@dataclass
class _Coordinator:
    coordinator: Coordinator
    process: SimProcess
    task: asyncio.Task | None = None
    killed: bool = False


@dataclass
class SimSwarm:
    """One schedule's swarm; `run()` returns the final coordinator's summary (None if none was written)."""

    cfg: RunConfig
    out: Path
    schedule: Schedule
    rules: FaultInjector | None = None  # more faults, tried before the schedule's (e.g. a test's FaultRules)
    # the hot standby's own run directory (None: `out`, shared with the coordinator): its copy of the run comes over
    # FOLLOW (coordinator/record_feed.py), and the run's record goes on there once it took over
    standby_out: Path | None = None
    injector: Injector = field(init=False)
    daemons: dict[str, PeerDaemon] = field(default_factory=dict)
    hooks: dict[str, PeerFaults] = field(default_factory=dict)  # each peer's fault hook, armed by the injector
    processes: dict[str, SimProcess] = field(default_factory=dict)
    tasks: dict[str, asyncio.Task] = field(default_factory=dict)
    killed: set[str] = field(default_factory=set)
    coordinators: list[_Coordinator] = field(default_factory=list)
    error: str | None = None  # an exception that ended the run other than an abort (a bug)
    leaks: list[str] = field(default_factory=list)
    _loop: asyncio.AbstractEventLoop | None = None
    _children: set[int] = field(default_factory=set)  # this process's children before the swarm started
    _joining: list[asyncio.Task] = field(default_factory=list)
    _peers_started: list[PeerDaemon] = field(default_factory=list)  # every peer started, in `daemons` or not yet

    def __post_init__(self) -> None:
        self.injector = Injector(self.schedule, self)

    # ---- the harness the injector acts through --------------------------------------------------
    def kill(self, pid: str) -> None:
        if pid in self.killed:
            return
        self.killed.add(pid)
        MEMORY.kill(pid)
        d = self.daemons.get(pid)
        if d is not None and d.snapshots.parity.companion is not None:  # reft's snapshot companion: same machine
            with contextlib.suppress(ProcessLookupError):
                d.snapshots.parity.companion.kill()
        # (a coordinator started this moment, the successor of one killed in the same crossing, has no transport yet)
        c = next((c for c in self.coordinators
                  if c.coordinator.rpc.transport is not None and str(c.coordinator.rpc.transport.peer_id) == pid), None)
        if c is not None:
            c.killed = True
            if self.schedule.needs(Kind.COORDINATOR_RESTART):
                self._start_coordinator(None, takeover=True)

    def terminate(self, pid: str) -> None:
        self._daemon(pid).stop.set()  # what its SIGTERM handler does

    def _daemon(self, pid: str) -> PeerDaemon:
        """The peer `pid`, also one whose transport exists but whom `_start_peer`'s poll has not registered yet: over
        the memory network it can join, be assigned a stage and be sent a step within that poll's 10 ms (a SIGTERM
        then failed the harness with a KeyError and was never delivered: the seed-41 soak's schedule #503)."""
        if pid in self.daemons:
            return self.daemons[pid]
        return next(d for d in self._peers_started
                    if d.membership.transport is not None and str(d.membership.transport.peer_id) == pid)

    def start_peer(self) -> None:
        self._joining.append(asyncio.get_running_loop().create_task(self._start_peer()))

    def arm(self, pid: str, fault: Arm) -> None:
        self.hooks[pid].arm(fault)

    def _die(self, pid: str, why: str) -> None:
        """A peer's own death by its fault hook (mid-reduce), from its compute thread or the event loop: the
        in-process SIGKILL; raises so that the dying peer computes nothing more."""
        self._loop.call_soon_threadsafe(self.kill, pid)
        if threading.current_thread() is threading.main_thread():
            self.kill(pid)
            raise asyncio.CancelledError
        raise RuntimeError(f"in-process SIGKILL of peer {pid} ({why})")

    # ---- processes ----------------------------------------------------------------------------
    def _start_coordinator(self, cfg: RunConfig | None, **opts) -> _Coordinator:
        opts.setdefault("out", str(self.out))
        options = CoordinatorOptions(run_id=RUN_ID, transport="memory", timeouts=TIMEOUTS, save_final=False, **opts)
        c = _Coordinator(Coordinator(cfg, options), SimProcess(f"coordinator{len(self.coordinators)}"))
        c.task = c.process.start(self._coordinate(c))
        self.coordinators.append(c)
        return c

    async def _coordinate(self, c: _Coordinator) -> dict | None:
        """A coordinator's run; None if it was killed (its standby or successor goes on) or aborted."""
        try:
            return await c.coordinator.run()
        except UnrecoverableFailure:
            return None  # the summary says so
        except (KeyboardInterrupt, asyncio.CancelledError):
            if c.killed:
                return None
            raise

    async def _started(self, c: _Coordinator) -> None:
        while c.coordinator.rpc.transport is None:
            if c.task.done():
                c.task.result()
            await asyncio.sleep(0.01)

    def _wrap(self, transport: MemoryTransport) -> FaultyTransport:
        """Every transport joins through the injector; a coordinator's is known to it as one."""
        if transport.process is not None and transport.process.name.startswith("coordinator"):
            self.injector.coordinators.add(str(transport.peer_id))
        wrapped = FaultyTransport(transport, self.injector)
        return wrapped if self.rules is None else FaultyTransport(wrapped, self.rules)

    async def _start_peer(self) -> None:
        hook = PeerFaults(self._die, channel=False)  # (armed in-process: `arm`)
        d = PeerDaemon(PeerOptions(run_id=RUN_ID, transport="memory", timeouts=TIMEOUTS, leave_deadline=10.0,
                                   coordinator_timeout=30.0), hook)
        self._peers_started.append(d)
        proc = SimProcess(f"peer{len(self._peers_started) - 1}")
        task = proc.start(d.run())
        while d.membership.transport is None:
            if task.done():
                task.result()
            await asyncio.sleep(0.01)
        pid = str(d.membership.transport.peer_id)
        self.daemons[pid], self.processes[pid], self.tasks[pid], self.hooks[pid] = d, proc, task, hook

    async def run(self) -> dict | None:
        self._loop = asyncio.get_running_loop()
        self._children = living(process_tree(os.getpid())) - {os.getpid()}
        # signals reach this process, not its in-process peers and coordinators: their handlers stay off the loop
        # (a SIGTERM of a peer is the harness's `terminate`), and Ctrl-C stops the whole run
        self._loop.add_signal_handler = lambda *args, **kwargs: None  # type: ignore[method-assign]
        self._loop.remove_signal_handler = lambda sig: True  # type: ignore[method-assign]
        MEMORY.reset()
        MEMORY.track(self._loop)
        MEMORY.wrap = self._wrap
        try:
            first = self._start_coordinator(self.cfg)
            await self._started(first)
            if self.schedule.needs(Kind.COORDINATOR_FAILOVER):
                await self._started(self._start_coordinator(None, standby=True, out=str(self.standby_out or self.out)))
            for _ in range(peers_needed(self.schedule)):
                await self._start_peer()
            return await self._await_end()
        finally:
            await self._teardown()
            MEMORY.reset()
            self._loop.set_task_factory(None)

    async def _await_end(self) -> dict | None:
        """The summary of the coordinator that finishes the run (a killed one hands over to the next: its standby,
        or the coordinator started in its place)."""
        for c in self.coordinators:  # (the list grows when a killed coordinator is restarted)
            try:
                summary = await c.task
            except Exception as e:  # noqa: BLE001 - a coordinator that failed otherwise than by an abort: a bug
                self.error = f"{type(e).__name__}: {e}"
                return None
            if not c.killed:
                return summary
        self.error = "the coordinator was killed and nobody took over"
        return None

    async def _end_companions(self) -> None:
        """Child processes still running once every peer has ended: reft's snapshot companions. A killed peer's
        goes with it (its machine died; a companion whose start the kill cut short is known by no peer), a peer
        that stopped gracefully must have stopped its own: one still running is a leak."""
        companions = {d.snapshots.parity.companion.pid: pid for pid, d in self.daemons.items()
                      if d.snapshots.parity.companion is not None}
        for child in sorted(living(process_tree(os.getpid())) - {os.getpid()} - self._children):
            owner = companions.get(child)
            if owner is not None and owner not in self.killed:
                self.leaks.append(f"peer {owner}'s snapshot companion (process {child}) outlived it")
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
        for d in self.daemons.values():
            if d.snapshots.parity.companion is not None:
                await asyncio.to_thread(d.snapshots.parity.companion.wait)
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0]:  # (companions whose start was cut short: no Popen reaps them)
                pass

    async def _teardown(self) -> None:
        """As a launcher's: heal, then peers still running are told to stop (SIGTERM), then killed."""
        self.injector.cut.clear()
        self.injector.slow.clear()
        for c in self.coordinators:
            if not c.task.done():
                self.kill(str(c.coordinator.rpc.transport.peer_id)) if c.coordinator.rpc.transport else c.task.cancel()
        await asyncio.gather(*(c.task for c in self.coordinators), *self._joining, return_exceptions=True)
        live = [t for t in self.tasks.values() if not t.done()]
        if live:
            await asyncio.wait(live, timeout=3)  # (told to stop by the coordinator: they end at once)
        for pid, t in self.tasks.items():
            if not t.done():
                self.daemons[pid].stop.set()
        live = [t for t in self.tasks.values() if not t.done()]
        if live:  # (a reft peer waits for its snapshot companion's process, slow to start on a busy machine)
            await asyncio.wait(live, timeout=30)
        for pid, t in self.tasks.items():
            if not t.done():
                self.leaks.append(f"peer {pid} still running after SIGTERM")
                self.kill(pid)
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        await self._end_companions()
        await asyncio.sleep(0)
        me = asyncio.current_task()
        left = [t for t in asyncio.all_tasks() if t is not me and not t.done()]
        if left:
            await asyncio.wait(left, timeout=2)
        for t in [t for t in left if not t.done()]:
            self.leaks.append(f"task left running: {t.get_coro()!r:.160}")
            t.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*left, return_exceptions=True)
