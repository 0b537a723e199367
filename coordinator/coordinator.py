"""The coordinator: owns a distributed run.

It holds the config, admits peers, assigns stages, drives each step (RUN_STEP on every stage peer, then COMMIT
once all are ready), detects failures, orders recoveries by the strategy's plan and writes the same run directory
as the simulator. A step interrupted by a failure is aborted (partial gradients dropped) and run again after
recovery; nothing is committed until every stage is ready.

It is composed of parts, each the only writer of its own state, built with what it needs (as the peer daemon,
peers/daemon.py; torchft's Manager composes its process group and checkpoint transport beside a lighthouse that
decides membership only):

    coordinator/rpc.py              the transport: requests of this run to peers, heartbeats
    coordinator/stage_table.py      who serves which stage (stage groups' replicas included)
    coordinator/members.py          JOIN/REPORT/LEAVE/STATUS, who is in the run, suspects, standbys
    coordinator/detection.py        failure detection between steps, handovers
    coordinator/retirement.py       failed peers told to go (strays adopted first)
    coordinator/placement.py        standbys given stages and stage groups' places
    coordinator/step_driver.py      step attempts (coordinator/group_steps.py: a group step), soft errors, COMMIT
    coordinator/recovery_driver.py  the strategy's recovery plans, carried out
    coordinator/protection.py       the strategy's protection (snapshots, checkpoints, backups, replicas) and its ledger
    coordinator/outputs.py          the run directory, measured figures, saves and resume, final weights
    coordinator/failover.py         a standby coordinator watching, a takeover adopting the run from its peers
    coordinator/record_feed.py      a standby's copy of the run (config, record, step, membership) over FOLLOW

This module wires them, keeps the training loop (`_train`) and the run's lifecycle (`run`). Faults come from
outside: the one hook point (`hook`, None in production) is where faults/injector.py acts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import functools
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from checkfree.config import RunConfig
from checkfree.stage_groups import check_swarm_groups
from checkfree.model import plan_stages
from checkfree.net.transport import dht_maddrs, rpc_note
from checkfree.pipeline import evaluates_after
from checkfree.messages import Committed, Follow, StepDone
from checkfree.protocol import READY_COORDINATOR, READY_STANDBY, Timeouts
from checkfree.recovery import UnrecoverableFailure
from checkfree.steprules import StageUpdate, apply_commits
from checkfree.strategies import build_strategy
from checkfree.strategies.base import Strategy
from checkfree.wan import WanEmulator
from coordinator.common import (EVAL_ATTEMPT, CoordinatorAlive, CoordinatorOptions, Hook, Member, Rollback, RunClock,
                              commit_figures, step_figures)
from coordinator.detection import Detector
from coordinator.failover import Failover
from coordinator.members import MembersView, Membership
from coordinator.outputs import Outputs
from coordinator.placement import Placement
from coordinator.protection import Protection
from coordinator.record_feed import RecordFeed
from coordinator.recovery_driver import Recovery
from coordinator.retirement import Retirement
from coordinator.rpc import Rpc
from coordinator.stage_table import StageTable
from coordinator.step_driver import StepDriver

__all__ = ["CoordinatorOptions", "Coordinator", "CoordinatorAlive", "CoordinatorView", "Member"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CoordinatorView:
    """A running coordinator read at one moment, by its parts' views: what the dashboard shows and what a fault
    injector reads (neither reaches into the parts)."""

    run_id: str
    cfg: RunConfig | None  # None: a standby or a takeover that has not adopted the run yet
    step: int
    iteration: int
    groups: dict[int, tuple[str, ...]]  # served stage -> its peers, the primary first
    members: MembersView
    speeds: Mapping[str, float]  # peer -> measured microbatches per second
    opened: bool  # the run directory is open
    last_attempt: int  # the attempt that completed the newest step
    timeouts: Timeouts
    # peer -> how this coordinator reaches it (direct / relayed / unreachable), probed at its join
    reach: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def stage_of(self, pid: str) -> int:
        """The stage `pid` serves (-1: none)."""
        return next((s for s, g in self.groups.items() if pid in g), -1)


@dataclass(frozen=True)
class _RunParts:
    """The parts that need the run's config, built once it is known (a takeover adopts it from the peers)."""

    cfg: RunConfig
    strategy: Strategy
    protection: Protection
    driver: StepDriver
    placement: Placement
    recovery: Recovery
    detector: Detector


class Coordinator:
    """One run's coordinator: its parts, the training loop, the lifecycle."""

    def __init__(self, cfg: RunConfig | None, opts: CoordinatorOptions, hook: Hook | None = None) -> None:
        """`cfg` None: a takeover (`opts.takeover` or `opts.standby`) adopts the run's config from its peers.
        `hook`: the one hook point (common.Hook), for faults from outside."""
        if cfg is None and not (opts.takeover or opts.standby):
            raise ValueError("a coordinator needs a config unless it takes over a running run")
        self.opts, self.timeouts = opts, opts.timeouts
        self.clock = RunClock()  # the step the run is at, the iterations executed
        self.rpc = Rpc(opts)
        self.table = StageTable()
        self.out = Outputs(opts, self.rpc, self.table)
        self.members = Membership(self.rpc, self.table, self.out, self.clock)
        self.retirement = Retirement(self.rpc, self.table, self.members, self.out, self.clock)
        self.failover = Failover(opts, self.rpc, self.members, self.retirement, self.table, self.out)
        self.feed = RecordFeed(opts, self.rpc, self.members, self.table, self.clock, self.out)  # standbys' copies
        self.hook = hook  # None in production: no fault hook is called
        self.cfg: RunConfig | None = None
        self._parts: _RunParts | None = None  # (`_configure`)
        self._in_commit = False  # between a step's COMMIT and its record (a stop signal is deferred)
        self._stop_after_commit = False
        if cfg is not None:
            self._configure(cfg)

    def _configure(self, cfg: RunConfig) -> None:
        """The parts that need the run's config (refused here, before any peer starts, when it is bad)."""
        self.cfg = cfg
        strategy = build_strategy(cfg)
        check_swarm_groups(cfg)
        plan_stages(cfg.model.num_layers, cfg.num_stages)
        if cfg.train.wan:  # checked now (an unknown profile is an error before any peer starts), shown once
            for line in WanEmulator(cfg).describe():
                print(f"emulated WAN {cfg.train.wan}: {line}", flush=True)
        self.members.configure(cfg)
        protection = Protection(cfg, self.opts, strategy, self.rpc, self.table, self.out)
        driver = StepDriver(cfg, self.opts, self.rpc, self.table, self.members, self.out, protection.in_step,
                            plus=strategy.plus)
        placement = Placement(cfg, self.rpc, self.table, self.members, self.out, driver)
        recovery = Recovery(cfg, strategy, self.rpc, self.table, self.members, self.retirement, placement, protection,
                            self.out)
        detector = Detector(cfg, self.rpc, self.table, self.members, self.retirement, protection, self.out, self.clock)
        self._parts = _RunParts(cfg, strategy, protection, driver, placement, recovery, detector)

    def _configured(self) -> _RunParts:
        assert self._parts is not None, "the coordinator has no run config yet"
        return self._parts

    @property
    def config(self) -> RunConfig:
        """The run's config (once known: `cfg` is None before a takeover adopts it)."""
        return self._configured().cfg

    @property
    def strategy(self) -> Strategy:
        return self._configured().strategy

    @property
    def protection(self) -> Protection:
        return self._configured().protection

    @property
    def driver(self) -> StepDriver:
        return self._configured().driver

    @property
    def placement(self) -> Placement:
        return self._configured().placement

    @property
    def recovery(self) -> Recovery:
        return self._configured().recovery

    @property
    def detector(self) -> Detector:
        return self._configured().detector

    @property
    def step(self) -> int:
        """The step the run is at."""
        return self.clock.step

    @property
    def iteration(self) -> int:
        """Executed steps, re-runs after a rollback included (the fault schedules' clock)."""
        return self.clock.iteration

    def view(self) -> CoordinatorView:
        """This coordinator now, read-only (see CoordinatorView)."""
        return CoordinatorView(
            run_id=self.opts.run_id, cfg=self.cfg, step=self.step, iteration=self.iteration,
            groups={s: tuple(g) for s, g in self.table.groups().items()}, members=self.members.view(),
            speeds=self.driver.speeds() if self._parts is not None else {}, opened=self.out.opened,
            last_attempt=self.driver.last_attempt if self._parts is not None else 0, timeouts=self.timeouts,
            reach={p: dict(r) for p, r in self.rpc.reach.items()})

    # ---- the training loop -----------------------------------------------------------------
    async def _train(self) -> None:
        cfg = self.config
        last_val = math.nan
        step = self.step  # 0, or where a takeover or a resume found the run
        while step < cfg.train.num_steps:
            self.clock.at(step)
            if self.hook is not None:
                await self.hook("iteration", self)
            t0 = time.perf_counter()
            try:
                results = await self._run_step(step)
            except Rollback as r:
                step = r.step
                continue
            self._in_commit = True  # a stop signal waits until this step is recorded (_on_stop_signal)
            commits = await self._commit(step)
            self.protection.committed(commits)
            self.clock.executed()
            record = self._record(step, results, commits, time.perf_counter() - t0)
            await self.protection.protect(step)
            if evaluates_after(step, cfg.train.eval_every, cfg.train.num_steps):
                try:
                    ev = await self._run_step(step, evaluate=True)
                except Rollback as r:
                    self.out.metric(record)
                    step = r.step
                    self._step_done(step)
                    continue
                losses = [v for r in ev.values() for v in r.losses.values()]
                record["val_loss"] = last_val = sum(losses) / len(losses)
            self.out.metric(record)
            await self.feed.synced()  # a standby copying the record has this step's line before the next starts
            if self.opts.save_every and (step + 1) % self.opts.save_every == 0 and step + 1 < cfg.train.num_steps:
                await self.out.save(cfg, step + 1, self.iteration)
            c = self.out.counts()
            val = f", val {last_val:.4f}" if "val_loss" in record else ""
            print(f"step {step}: loss {record['loss']:.4f}{val}, {record['step_time_s'] * 1000:.0f} ms, peers "
                  f"{record['live_peers']}+{len(self.members.standbys())}, failures {c['failures']}, recoveries "
                  f"{c['recoveries']}, fallbacks {c['fallbacks']}", flush=True)
            step += 1
            self._step_done(step)

    async def _run_step(self, step: int, evaluate: bool = False) -> dict[int, StepDone]:
        """Run a step (or an evaluation) to completion: detect and recover failed stages, abort and retry an
        interrupted attempt. Evaluation attempts are numbered from EVAL_ATTEMPT so their messages never mix with
        the training step's."""
        base = EVAL_ATTEMPT if evaluate else self.driver.first_attempt(step)
        for attempt in range(base, base + self.opts.max_attempts):
            while True:  # (a leave is handed over once the failures found with it are recovered)
                found = await self.detector.detect()
                if found.handed_over:  # the copies the leaving peers held left with them
                    await self.protection.handed_over(found.handed_over, step)
                if not found.failed:
                    break
                await self.recovery.recover(step, found.failed)
            if not evaluate:
                await self.placement.fill_groups(step, first=self.iteration == 0)
            results = await self.driver.attempt(step, attempt, evaluate)
            if results is not None:
                self.driver.succeeded(attempt)
                return results
            self.out.event("aborted_step", step=step, attempt=attempt, evaluate=evaluate)
        raise RuntimeError(f"step {step} failed {self.opts.max_attempts} times without a detectable peer failure; "
                           "check the peers' logs (slow peers: raise --step-timeout)")

    async def _commit(self, step: int) -> dict[int, Committed | Exception]:
        if self.hook is not None:
            await self.hook("commit", self)
        return await self.driver.commit(step)

    def _record(self, step: int, results: dict[int, StepDone], commits: dict[int, Committed | Exception],
                took: float) -> dict:
        """The step's metrics line; a stage whose weights broke is treated as failed (recovered before the next
        step); the costs the peers measured are charged."""
        cfg, done = self.config, {s: r for s, r in commits.items() if isinstance(r, Committed)}
        self.driver.committed(commits)
        broken = apply_commits([StageUpdate(s, r.omega, r.skipped, r.weights_finite) for s, r in done.items()], None,
                               functools.partial(self._stage_event, step))
        for s in broken:  # numeric guard: a broken stage is a failed stage
            self.members.drop(self.table.peer(s))
        record: dict[str, Any] = {"step": step, "loss": sum(v for r in results.values() for v in r.losses.values()),
                  "lr": next((r.lr for r in done.values()), math.nan),
                  "grad_norms": [done[s].post if s in done else math.nan for s in range(cfg.num_stages)],
                  "block_grad_norms": [done[s].block_post if s in done else math.nan for s in range(cfg.num_stages)], "step_time_s": round(took, 6),
                  "attempts": self.driver.last_attempt + 1, "live_peers": sum(self.table.replica_counts(cfg.num_stages)),
                  **step_figures(results, cfg.num_stages), **commit_figures(commits, cfg.num_stages)}
        if self._groups_on():  # stage groups: replicas per stage, and the microbatches each computed
            record["replicas"] = self.table.replica_counts(cfg.num_stages)
            record["replica_microbatches"] = [results[s].replica_microbatches if s in results else None
                                              for s in range(cfg.num_stages)]
            if any(r.reduce_s is not None for r in results.values()):
                record["reduce_s"] = [results[s].reduce_s if s in results else None for s in range(cfg.num_stages)]
        if "backup_bytes" in record:  # baft: the parts sent in this step's bubbles
            self.out.charge(bytes_moved=sum(x or 0 for x in record["backup_bytes"]))
        if "redundant_s" in record:  # the step waited for the slowest stage's redundant forwards
            self.out.charge(stall_s=max(x or 0.0 for x in record["redundant_s"]),
                            bytes_moved=sum(x or 0 for x in record["replica_bytes"]))
        return record

    def _stage_event(self, step: int, event: str, stage: int, **fields) -> None:
        """An event of `stage`'s peer at `step` (what a commit's outcome says of it: checkfree.steprules)."""
        self.out.event(event, step=step, stage=stage, peer_id=self.table.peer(stage), **fields)

    def _groups_on(self) -> bool:
        """Whether the run uses stage groups at all (its metrics and summary carry their figures)."""
        return self.config.train.stage_groups or self.table.grouped()

    def _on_stop_signal(self, task: asyncio.Task) -> None:
        """SIGTERM/SIGINT/SIGHUP: stop now or, during a commit, once the step is recorded. A commit is never cut
        in half: the peers would be a step ahead of the run's record and its save would be refused."""
        if self._in_commit:
            self._stop_after_commit = True
        else:
            task.cancel()

    def _step_done(self, next_step: int) -> None:
        """The step is committed and recorded; a stop signal that came meanwhile takes effect now."""
        self._in_commit = False
        if self._stop_after_commit:
            self.clock.at(next_step)
            raise asyncio.CancelledError

    # ---- the run ---------------------------------------------------------------------------
    async def _take_over(self) -> None:
        """A standby (once the run's coordinator stops answering) or a takeover: the run adopted from its peers."""
        if self.opts.standby:
            await self.failover.watch()
        cfg, replies = await self.failover.adopt()
        self._configure(cfg)
        found = await self.failover.resume(cfg, replies, self.driver, self.protection)
        self.clock.at(found.step, found.step)
        record = dict(found.record) if found.record is not None else None
        if found.whole and found.step > 0:
            # the old coordinator may have died between committing the step before and protecting it (a snapshot
            # or checkpoint due then): taken now, as the simulator took it (taking it twice changes nothing)
            await self.protection.protect(found.step - 1)
            if record is not None and evaluates_after(found.step - 1, cfg.train.eval_every, cfg.train.num_steps):
                try:  # the evaluation due after the step it records never ran either
                    ev = await self._run_step(found.step - 1, evaluate=True)
                    losses = [v for r in ev.values() for v in r.losses.values()]
                    record["val_loss"] = sum(losses) / len(losses)
                except Rollback as r:
                    self.clock.at(r.step, r.step)
        if record is not None:
            self.out.metric(record)

    def _open(self) -> dict[int, bytes] | None:
        """A new run's directory (--resume: the run goes on from its newest save: its states)."""
        saved = None
        if self.opts.resume:
            step, saved = self.out.resume_point(self.config)
            self.clock.at(step, step)
        self.out.open(self.config, resume=self.opts.resume)
        self.out.keep_tokenizer(self.config)
        return saved

    async def _fill(self, saved: dict[int, bytes] | None) -> None:
        """Every stage served (fresh, or loaded from the save), stage groups filled, the protection a run starts
        with taken."""
        await self.placement.fill(saved, self.step)
        await self.placement.fill_groups(self.step, first=True)
        await self.protection.start(self.step)
        if saved is not None:
            self.out.event("resume", step=self.step)
            self.out.status(f"resumed run at step {self.step} from {self.opts.out}/saves")

    async def run(self) -> dict | None:
        opts = self.opts
        pid = await self.rpc.start(self.out.refused)
        if self.hook is not None:
            await self.hook("started", self)
        announcer = watcher = summary = None
        loop, task = asyncio.get_running_loop(), asyncio.current_task()
        assert task is not None
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):  # a graceful stop: save, record, tell peers
            loop.add_signal_handler(sig, self._on_stop_signal, task)
        status, error = "failed", None
        try:
            await self.members.register()
            await self.members.serve(Follow, self.feed.on_follow)
            addrs = ",".join(await dht_maddrs(self.rpc.dht)) + rpc_note(self.rpc.transport)
            if opts.standby:
                print(f"{READY_STANDBY} peer_id={pid} run={opts.run_id} addrs={addrs}", flush=True)
            takeover = opts.takeover or opts.standby
            saved = None
            if takeover:
                await self._take_over()
            else:
                saved = self._open()
            announcer = asyncio.create_task(self.rpc.announce())
            watcher = asyncio.create_task(self.detector.watch_heartbeats())
            print(f"{READY_COORDINATOR} peer_id={pid} run={opts.run_id} addrs={addrs}", flush=True)
            if not takeover:
                await self._fill(saved)
            await self._train()
            if opts.save_final:
                await self.out.gather_final(self.config)
            status = "completed"
        except UnrecoverableFailure as e:
            status, error = "aborted", str(e)
            raise
        except asyncio.CancelledError:
            status, error = "interrupted", f"interrupted by a signal (SIGTERM/SIGINT/SIGHUP) before step {self.step}"
            print(f"status: interrupted at step {self.step}; stopping", flush=True)
            await self._save_on_stop()
            raise KeyboardInterrupt from None
        except BaseException as e:
            error = f"{type(e).__name__}: {e}"
            raise
        finally:
            summary = await self._end(status, error, (announcer, watcher), loop)
        return summary

    async def _save_on_stop(self) -> None:
        """Interrupted: with --save-every, a save where the run stopped (best effort: the peers may be going too)."""
        if self.opts.save_every and self.out.opened and len(self.table.served()) == self.config.num_stages:
            with contextlib.suppress(Exception):
                await self.driver.abort()
                if await asyncio.wait_for(self.out.save(self.config, self.step, self.iteration), self.timeouts.step_timeout):
                    print(f"status: saved step {self.step} into {self.opts.out}/saves", flush=True)

    async def _end(self, status: str, error: str | None, background: tuple[asyncio.Task | None, ...],
                   loop) -> dict | None:
        """The summary (None if the run directory never opened), the peers told, the transport stopped."""
        self.members.end(status)
        with contextlib.suppress(Exception):
            await self.out.saved()
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            loop.remove_signal_handler(sig)
        if self.opts.shutdown_peers and self.cfg is not None:
            # failed peers that came back since (a healed partition), told before the run directory closes: their
            # `retired` events belong in it
            try:
                await self.retirement.retire()
            except Exception as e:  # the summary is written whatever happens here
                log.warning("telling failed peers to shut down failed: %r", e)
        summary = None
        if self.out.opened:
            soft = {k: sum(int(c.get(k, 0)) for c in self.driver.soft_counts.values())
                    for k in ("injected", "detected", "corrected", "escalated")}
            groups = ({**self.table.counts, "rerouted_microbatches": self.driver.group_steps.rerouted,
                       "stage_recoveries": self.out.counts()["recoveries"]} if self._groups_on() else {})
            summary = self.out.close(status, error, soft_errors=soft, strategy=self.config.recovery.strategy,
                                           **groups)
        for task in background:
            if task is not None:
                task.cancel()
        if self.opts.shutdown_peers and self.cfg is not None:
            await self.members.shutdown_peers(f"run {status}")
        await self.rpc.stop()
        return summary
