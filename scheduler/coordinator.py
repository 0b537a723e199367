"""The coordinator: owns a distributed run.

It holds the config, admits peers (JOIN), assigns stages (waiting peers fill empty stages,
the rest wait as standbys), drives each step (RUN_STEP on every stage peer, then COMMIT
once all are ready), detects failures (expired DHT heartbeats, failure reports from peers
whose call to a neighbour failed, failed pings, stragglers that ran over step_timeout), retires
failed peers that may still be running (a healed partition), orders recoveries (which standby rebuilds
which stage from which live neighbours), and writes the same run directory as the
simulator. A step interrupted by a failure is aborted (partial gradients dropped) and run
again after recovery; nothing is committed until every stage is ready.

The coordinator is composed of parts, one module each:

    scheduler/membership.py   JOIN/REPORT/LEAVE/STATUS, standbys and ASSIGN, failure detection, retiring, handover
    scheduler/steps.py        RUN_STEP attempts, the route table, soft errors, COMMIT
    scheduler/recovery.py     recovery orders; snapshots and rollback of the rollback strategies
    scheduler/replicas.py     redundant computation: replicas taken, a lost stage's replica promoted
    scheduler/backups.py      baft: backups started, sent part by part in the bubbles, sealed
    scheduler/outputs.py      saves and resume, the tokenizer, the final weights
    scheduler/groups.py       stage groups: replicas placed, a group step's routes, reroutes and gradient reduce
    scheduler/failover.py     a standby coordinator taking over
    scheduler/injector.py     fault injection for the local swarm (off in production)
    scheduler/common.py       the options and types they share

This module keeps the training loop (`_train`) and the run's lifecycle (`run`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import signal
import time
from pathlib import Path

from checkfree.auth import join_token, load_secret
from checkfree.config import RunConfig
from checkfree.costmodel import CostModel
from checkfree.groups import check_swarm_groups
from checkfree.model import plan_stages
from checkfree.pipeline import evaluates_after
from checkfree.net.transport import (
    dht_maddrs,
    rpc_note,
    start_transport,
    stop_transport,
)
from checkfree.protocol import READY_COORDINATOR, READY_STANDBY, RPC, request
from checkfree.recovery import UnrecoverableFailure
from checkfree.rundir import RunWriter
from checkfree.steprules import Commit, SoftErrorRule, apply_commits
from checkfree.strategies.base import Figures
from checkfree.wan import WanEmulator
from scheduler.backups import BackupsMixin
from scheduler.common import (
    CoordinatorAlive,
    CoordinatorOptions,
    Member,
    Rollback,
    commit_figures,
    step_figures,
)
from scheduler.failover import FailoverMixin
from scheduler.groups import GroupsMixin
from scheduler.injector import ChaosMixin
from scheduler.membership import MembershipMixin
from scheduler.outputs import OutputsMixin
from scheduler.recovery import RecoveryMixin
from scheduler.replicas import ReplicasMixin
from scheduler.steps import StepsMixin

__all__ = ["CoordinatorOptions", "Coordinator", "CoordinatorAlive", "Member"]

log = logging.getLogger(__name__)


class Coordinator(MembershipMixin, StepsMixin, GroupsMixin, RecoveryMixin, ReplicasMixin, BackupsMixin, OutputsMixin,
                  FailoverMixin, ChaosMixin):
    def __init__(self, cfg: RunConfig | None, opts: CoordinatorOptions) -> None:
        """`cfg` None: a takeover (`opts.takeover` or `opts.standby`) adopts the run's config from its peers."""
        self.opts, self.t = opts, opts.timeouts
        self.secret = load_secret(opts.secret_file)
        self.members: dict[str, Member] = {}
        self.stage_peer: dict[int, str] = {}
        self.reported: set[str] = set()
        self.writer: RunWriter | None = None
        self.transport = None
        self.dht = None
        self.step = 0
        self.iteration = 0  # executed steps, re-runs after a rollback included (the chaos clock)
        self.member_event = asyncio.Event()
        self.cfg: RunConfig | None = None
        self._attempt_floor: dict[int, int] = {}  # step -> first attempt number (after a takeover)
        self._retired: set[str] = set()  # failed peers already told to shut down
        self._partitioned: list[str] = []  # local swarm: peers cut off the network, healed at the next iteration
        self._retire_task: asyncio.Task | None = None
        self._stdin: asyncio.StreamReader | None = None  # local swarm: the launcher's acknowledgements
        self._saving: asyncio.Task | None = None  # the save being written in the background
        self.over: str | None = None  # the run's final status once it has ended (late joins are refused)
        self._in_commit = False  # between a step's COMMIT and its record (a stop signal is deferred)
        self._stop_after_commit = False
        self._live_seen: tuple[float, dict[str, dict]] | None = None  # (when, peers) of the newest heartbeat read
        self._init_groups()
        if cfg is not None:
            self._configure(cfg)
        elif not (opts.takeover or opts.standby):
            raise ValueError("a coordinator needs a config unless it takes over a running run")

    def _configure(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        opts = self.opts
        from checkfree.strategies import build_strategy
        from checkfree.strategies.averaging import AveragingStrategy

        name = cfg.recovery.strategy
        self.strategy = build_strategy(cfg)
        swarm_replicas = self.strategy.swarm_replicas
        if not (isinstance(self.strategy, AveragingStrategy) or self.strategy.swarm_rollback or swarm_replicas):
            raise ValueError(f"strategy {name!r} runs in the simulator only: it has no distributed implementation")
        if swarm_replicas and cfg.strategy.storage_fallback:
            raise ValueError(f"{name} in the swarm: when a replica and its holder are lost together it applies "
                             f"--fallback; --storage-fallback runs in the simulator only")
        if self.strategy.snapshots_in_memory and self.strategy.when_all_copies_lost() not in ("checkpoint", "abort"):
            raise ValueError(f"{name} in the swarm: when every holder of a snapshot is lost it rolls back to storage "
                             f"(--storage-fallback yes) or aborts; --fallback {cfg.recovery.fallback} runs in the "
                             f"simulator only")
        check_swarm_groups(cfg)
        self.plus = self.strategy.plus
        if cfg.train.wan:  # checked now (an unknown profile is an error before any peer starts), shown once
            for line in WanEmulator(cfg).describe():
                print(f"emulated WAN {cfg.train.wan}: {line}", flush=True)
        self.cost = CostModel(cfg)  # the strategies' choices that depend on links (a snapshot's source)
        self.figures = Figures()  # what fault tolerance cost this run, measured: summary.json, as the simulator's
        self.snap_step = 0  # gemini, baft: step of the last complete in-memory snapshot / backup
        self._backup_peers: dict[int, tuple[str, str]] = {}  # baft: stage -> (its peer, its backup holder's)
        self.companions: dict[int, str] = {}  # reft: stage -> its peer's snapshot companion address
        self.snap_holders: dict[int, dict[int, str]] = {}  # stage -> {holder stage: peer holding its snapshot}
        self.ckpt_step = 0  # checkpoint (or gemini's storage fallback): last complete checkpoint
        self.storage_dir = str(Path(cfg.strategy.storage_dir or Path(opts.out) / "checkpoints").resolve())
        self._chaos_done: set[int] = set()
        self._recovery_killed: set[int] = set()
        self.norms = [0.0] * cfg.num_stages
        self.soft_rule = SoftErrorRule()  # attempts lost in a row to each stage's soft errors
        self.soft_counts: dict[str, dict] = {}  # peer -> its guard's counters (dead peers' kept)
        plan_stages(cfg.model.num_layers, cfg.num_stages)

    # ---- helpers -----------------------------------------------------------------------
    def _event(self, event: str, **fields) -> None:
        if self.writer is not None:
            self.writer.event(event, **fields)

    async def _call(self, pid: str, name: str, header: dict, timeout: float, tensors=()):
        return await self.transport.call(pid, name, request(name, self.opts.run_id, **header), tensors, timeout=timeout)

    def _charge(self, **figures) -> None:
        """Add measured costs of fault tolerance (checkfree.strategies.base.Figures fields) to the run's."""
        self.figures = self.figures + Figures(**figures)

    def _status(self, text: str) -> None:
        print(f"status: {text}", flush=True)

    async def _train(self) -> None:
        cfg, writer = self.cfg, self.writer
        last_val = math.nan
        step = self.step  # 0, or where a takeover found the run
        while step < cfg.train.num_steps:
            self.step = step
            await self._chaos(self.iteration)
            t0 = time.perf_counter()
            try:
                results = await self._run_step(step)
            except Rollback as r:
                step = r.step
                continue
            self._in_commit = True  # a stop signal waits until this step is recorded (_on_stop_signal)
            commits = await self._commit(step)
            self.iteration += 1
            attempts = self._last_attempt + 1
            loss = sum(float(v) for r in results.values() for v in r["losses"].values())
            post = [commits[s].get("post", math.nan) if isinstance(commits[s], dict) else math.nan
                    for s in range(cfg.num_stages)]
            self.soft_rule.clear()
            done = {s: r for s, r in commits.items() if isinstance(r, dict)}
            for s, r in done.items():
                self.soft_counts[self.stage_peer[s]] = r.get("soft_errors", {})
            broken = apply_commits(
                [Commit(s, float(r["omega"]), bool(r.get("skipped")), bool(r.get("weights_finite", True)))
                 for s, r in done.items()], self.norms,
                lambda event, stage, **f: self._event(event, step=step, stage=stage, peer_id=self.stage_peer[stage], **f))
            for s in broken:  # numeric guard: a broken stage is a failed stage, recovered before the next step
                self.members[self.stage_peer[s]].leaving = True
            lr = next((r["lr"] for r in commits.values() if isinstance(r, dict)), math.nan)
            block_post = [commits[s].get("block_post", math.nan) if isinstance(commits[s], dict) else math.nan
                          for s in range(cfg.num_stages)]
            record = {"step": step, "loss": loss, "lr": lr, "grad_norms": post, "block_grad_norms": block_post,
                      "step_time_s": round(time.perf_counter() - t0, 6), "attempts": attempts,
                      "live_peers": sum(self._replica_counts()), **step_figures(results, cfg.num_stages),
                      **commit_figures(commits, cfg.num_stages)}
            if self._groups_on():  # stage groups: replicas per stage, and the microbatches each computed
                record["replicas"] = self._replica_counts()
                record["replica_microbatches"] = [results.get(s, {}).get("replica_microbatches")
                                                  for s in range(cfg.num_stages)]
                if any("reduce_s" in r for r in results.values()):
                    record["reduce_s"] = [results.get(s, {}).get("reduce_s") for s in range(cfg.num_stages)]
            if "backup_bytes" in record:  # baft: the parts sent in this step's bubbles
                self._charge(bytes_moved=sum(x or 0 for x in record["backup_bytes"]))
            if "redundant_s" in record:  # the step waited for the slowest stage's redundant forwards
                self._charge(stall_s=max(x or 0.0 for x in record["redundant_s"]),
                             bytes_moved=sum(x or 0 for x in record["replica_bytes"]))
            await self._protect(step)
            if evaluates_after(step, cfg.train.eval_every, cfg.train.num_steps):
                try:
                    ev = await self._run_step(step, evaluate=True)
                except Rollback as r:
                    writer.metric(record)
                    step = r.step
                    self._step_done(step)
                    continue
                losses = [float(v) for r in ev.values() for v in r["losses"].values()]
                record["val_loss"] = last_val = sum(losses) / len(losses)
            writer.metric(record)
            if self.opts.save_every and (step + 1) % self.opts.save_every == 0 and step + 1 < cfg.train.num_steps:
                await self._save(step + 1)
            c = writer.counts
            val = f", val {last_val:.4f}" if "val_loss" in record else ""
            print(f"step {step}: loss {loss:.4f}{val}, {record['step_time_s'] * 1000:.0f} ms, peers "
                  f"{record['live_peers']}+{len(self._standbys())}, failures {c['failures']}, recoveries "
                  f"{c['recoveries']}, fallbacks {c['fallbacks']}", flush=True)
            step += 1
            self._step_done(step)

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
            self.step = next_step
            raise asyncio.CancelledError

    # ---- main -------------------------------------------------------------------------
    async def run(self) -> dict:
        self._last_attempt = 0
        self.dht, self.transport = await start_transport(
            self.opts.initial_peers, self.opts.host_maddrs, self.opts.announce_maddrs, self.opts.identity_path,
            self.opts.startup_timeout, transport=self.opts.transport, libp2p_port=self.opts.libp2p_port,
            tcp_port=self.opts.tcp_port, secret=self.secret)
        pid = str(self.transport.peer_id)
        if self.secret is not None:  # lets a standby read the coordinator's STATUS
            self.transport.extra_header = {"token": join_token(self.secret, self.opts.run_id, pid)}
        announcer = watcher = None
        loop, task = asyncio.get_running_loop(), asyncio.current_task()
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):  # a graceful stop: save, record, tell peers
            loop.add_signal_handler(sig, self._on_stop_signal, task)
        status, error = "failed", None
        try:
            for name, h in ((RPC.JOIN, self._on_join), (RPC.REPORT, self._on_report), (RPC.LEAVE, self._on_leave),
                            (RPC.STATUS, self._on_status)):
                await self.transport.register(name, h)
            addrs = ",".join(await dht_maddrs(self.dht)) + rpc_note(self.transport)
            if self.opts.standby:
                print(f"{READY_STANDBY} peer_id={pid} run={self.opts.run_id} addrs={addrs}", flush=True)
                await self._watch()
            if self.opts.takeover or self.opts.standby:
                await self._take_over()
            else:
                saved = self._resume_point() if self.opts.resume else None
                self.writer = RunWriter(self.opts.out, self.cfg.to_json(), tokens_per_step=self.cfg.tokens_per_step,
                                        resume=self.opts.resume, tensorboard=self.opts.tensorboard)
                self._tokenizer_task = asyncio.create_task(asyncio.to_thread(self._keep_tokenizer))
            announcer = asyncio.create_task(self._announce(pid))
            watcher = asyncio.create_task(self._watch_heartbeats())
            print(f"{READY_COORDINATOR} peer_id={pid} run={self.opts.run_id} addrs={addrs}", flush=True)
            if not (self.opts.takeover or self.opts.standby):
                await self._fill_initial(saved)
                await self._fill_groups()
                if self.strategy.swarm_replicas:  # redundant: every predecessor's replica
                    await self._replicate(set(range(self.cfg.num_stages)), self.step)
                if saved is not None:
                    self._event("resume", step=self.step)
                    self._status(f"resumed run at step {self.step} from {self.opts.out}/saves")
            await self._train()
            if self.opts.save_final:
                await self._gather_final()
            status = "completed"
        except UnrecoverableFailure as e:
            status, error = "aborted", str(e)
            raise
        except asyncio.CancelledError:
            status, error = "interrupted", f"interrupted by a signal (SIGTERM/SIGINT/SIGHUP) before step {self.step}"
            print(f"status: interrupted at step {self.step}; stopping", flush=True)
            if self.opts.save_every and self.writer is not None and len(self.stage_peer) == self.cfg.num_stages:
                with contextlib.suppress(Exception):  # best effort: the peers may be going too
                    await self._all(RPC.ABORT, {}, self.t.rpc_timeout)
                    if await asyncio.wait_for(self._save(self.step), self.t.step_timeout):
                        print(f"status: saved step {self.step} into {self.opts.out}/saves", flush=True)
            raise KeyboardInterrupt from None
        except BaseException as e:
            error = f"{type(e).__name__}: {e}"
            raise
        finally:
            self.over = status
            if self._saving is not None:
                with contextlib.suppress(Exception):
                    await self._saving
            for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
                loop.remove_signal_handler(sig)
            summary = None
            if self.writer is not None:
                soft = {k: sum(int(c.get(k, 0)) for c in self.soft_counts.values())
                        for k in ("injected", "detected", "corrected", "escalated")}
                groups = ({**self.group_counts, "stage_recoveries": self.writer.counts["recoveries"]}
                          if self._groups_on() else {})
                summary = self.writer.summary(status, error, run_id=self.opts.run_id, soft_errors=soft,
                                              strategy=self.cfg.recovery.strategy, **groups, **self.figures.as_dict())
                self.writer.close()
            for background in (announcer, watcher):
                if background is not None:
                    background.cancel()
            if self.opts.shutdown_peers and self.cfg is not None:
                await self._retire()  # failed peers that came back since (a healed partition)
                await self._shutdown_peers(f"run {status}")
            await stop_transport(self.dht, self.transport)
        return summary
