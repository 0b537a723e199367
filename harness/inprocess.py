"""The in-process test tier: a coordinator and several peers (the real `Coordinator` and `PeerDaemon`) in one
event loop over the memory network (`checkfree.net.in_memory`), faults injected from outside by the local swarm's
injector (`faults.injector`: a `FaultSchedule` acted out at the coordinator's one hook and around its
transport, peers armed through their fault hooks' control channel, `checkfree.peer_faults`): a scheduled kill is
`MemoryNetwork.kill` (the peer unreachable, its running handlers cancelled) plus the cancellation of the peer's
task, at the point the launcher would SIGKILL it, or where the peer's hook kills it.

For the fast paths of the runtime (steps, routes, recovery orders, rollback, soft errors). What only real
processes show (SIGKILL of a process, p2pd, sockets, signals, the launcher) stays in the subprocess tests.

Each process-to-be runs in its own `contextvars` context with `ROLE` set ("coordinator" or "peer"): what its
tasks spawn inherits it, and the memory transport runs a request's handler in the serving transport's context,
so `benchmarks.control_plane` can tell the coordinator's share of the one event loop's time from the peers'.
Used by the in-process tests (tests/test_inprocess.py, tests/test_stage_groups.py) and benchmarks.control_plane.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from checkfree.config import RunConfig
from checkfree.data import build_data
from checkfree.net.in_memory import MEMORY
from checkfree.peer_faults import PeerFaults
from checkfree.protocol import Timeouts
from peers.daemon import PeerDaemon, PeerOptions
from coordinator.common import CoordinatorOptions
from coordinator.coordinator import Coordinator
from faults.injector import FaultSchedule, Injector

__all__ = ["ROLE", "TIMEOUTS", "InProcessSwarm", "run_swarm"]

FAULT_FIELDS = {f.name for f in dataclasses.fields(FaultSchedule)} - {"handler"}
ROLE: contextvars.ContextVar[str] = contextvars.ContextVar("checkfree_inprocess_role", default="other")

TIMEOUTS = Timeouts(heartbeat_ttl=2.0, rpc_timeout=20.0, step_timeout=60.0, join_timeout=60.0)


@dataclass
class InProcessSwarm:
    """One run: ``peers`` peer daemons (stages + spares) and a coordinator; ``killed`` the peers the fault
    injector killed, in order, as (action, fields)."""

    cfg: RunConfig
    out: Path
    peers: int
    coordinator_options: dict = field(default_factory=dict)
    faults: dict = field(default_factory=dict)  # FaultSchedule's fields (kills, reduce_kills, slow, ...)
    peer_options: dict = field(default_factory=dict)
    on_kill: Callable[[InProcessSwarm, dict], None] | None = None  # called just before each kill
    timeouts: Timeouts = field(default_factory=lambda: TIMEOUTS)  # every process's (the tests': short ones)
    killed: list[tuple[str, dict]] = field(default_factory=list)
    daemons: dict[str, PeerDaemon] = field(default_factory=dict)
    tasks: dict[str, asyncio.Task] = field(default_factory=dict)
    summary: dict | None = None
    coordinator: Coordinator | None = None  # once `run()` has made it

    async def _inject(self, action: str, fields: dict) -> None:
        if action not in ("kill",):
            raise NotImplementedError(f"the in-process tier injects kills only, not {action!r}")
        pid = str(fields["peer"])
        self.killed.append((action, dict(fields)))
        if self.on_kill is not None:
            self.on_kill(self, fields)
        MEMORY.kill(pid)
        task = self.tasks[pid]
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task

    def _die(self, loop: asyncio.AbstractEventLoop, pid: str, why: str) -> None:
        """A peer's own death by its fault hook (a replica mid-step or mid-reduce): the in-process SIGKILL, from the
        event loop or the peer's compute thread; raises so that the dying peer computes nothing more."""
        loop.call_soon_threadsafe(lambda: loop.create_task(self._inject("kill", {"peer": pid, "why": why})))
        if threading.current_thread() is threading.main_thread():
            MEMORY.kill(pid)  # unreachable at once (the task's cancellation follows)
            raise asyncio.CancelledError
        raise RuntimeError(f"in-process fault: peer {pid} killed ({why})")

    async def run(self) -> dict:
        MEMORY.reset()
        opts = CoordinatorOptions(run_id="inproc", out=str(self.out), transport="memory", timeouts=self.timeouts,
                                  **self.coordinator_options)
        schedule = FaultSchedule(handler=self._inject, **self.faults)
        coordinator = self.coordinator = Coordinator(self.cfg, opts, Injector(schedule))
        main = asyncio.create_task(coordinator.run(), context=_context("coordinator"))
        loop = asyncio.get_running_loop()
        for _ in range(self.peers):
            d = PeerDaemon(PeerOptions(run_id="inproc", transport="memory", timeouts=self.timeouts, leave_deadline=2.0,
                                       coordinator_timeout=30.0, **self.peer_options),
                           PeerFaults(lambda pid, why: self._die(loop, pid, why)))
            task = asyncio.create_task(d.run(), context=_context("peer"))
            await asyncio.sleep(0)  # the daemon's transport exists (peer id known) once it has started
            while d.membership.transport is None:
                await asyncio.sleep(0.01)
            pid = str(d.membership.transport.peer_id)
            self.daemons[pid], self.tasks[pid] = d, task
        try:
            summary = await main
        finally:
            live = [t for t in self.tasks.values() if not t.done()]
            if live:  # told to shut down by the coordinator: they end on their own, bounded
                _, pending = await asyncio.wait(live, timeout=10)
                for t in pending:
                    t.cancel()
                await asyncio.gather(*live, return_exceptions=True)
            MEMORY.reset()
        if summary is None:
            raise RuntimeError("the in-process coordinator ended without a run summary")
        return summary


def _context(role: str) -> contextvars.Context:
    """A copy of the current context with ROLE set to `role` (what the launcher's separate process would be)."""
    ctx = contextvars.copy_context()
    ctx.run(ROLE.set, role)
    return ctx


def run_swarm(cfg: RunConfig, out: Path, *, peers: int, dump_dir: str | None = None,
              on_kill: Callable[[InProcessSwarm, dict], None] | None = None, **options) -> InProcessSwarm:
    """Run a swarm in this process to its end; the finished `InProcessSwarm` (its run directory is ``out``).
    ``dump_dir``: the peers' --dump-recovery; ``on_kill(swarm, fields)``: called before each kill; ``options``:
    `FaultSchedule`'s fields (kills, reduce_kills, slow, ...) and `CoordinatorOptions`' (save_final, ...)."""
    faults = {k: v for k, v in options.items() if k in FAULT_FIELDS}
    coordinator_options = {k: v for k, v in options.items() if k not in FAULT_FIELDS}
    # as `checkfree local` does: the token cache is prepared once before the peers start (the coordinator's
    # ASSIGN timeout is not spent on tokenizing a fresh cache)
    build_data(cfg.data, vocab_size=cfg.model.vocab_size, context_length=cfg.seq_len, seed=cfg.train.seed,
               microbatch_size=cfg.train.microbatch_size, progress=False)
    swarm = InProcessSwarm(cfg, out, peers, coordinator_options, faults, {"dump_dir": dump_dir} if dump_dir else {},
                           on_kill)
    swarm.summary = asyncio.run(swarm.run())
    return swarm
