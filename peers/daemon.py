"""The peer daemon: hosts one stage and serves forward/backward over P2P RPC (hivemind or py-libp2p).

Lifecycle: start the DHT + P2P transport and print the ready line; find the run's
coordinator in the DHT and join (the coordinator answers with the run's config); wait as
a standby until assigned a stage (fresh, or rebuilt by a recovery plan from live
neighbours' weights); then serve steps until told to shut down. A DHT heartbeat with an
expiry announces the peer while it lives. SIGTERM/SIGINT is a graceful leave: the
coordinator is told, then everything is shut down; SIGKILL is detected by the others.

This module is the supervision only; each RPC is served by the part that owns its state:

    peers/membership.py       joining, heartbeat, coordinator watch, leave; the admission check
    peers/checks.py           the admission check (run, fields, who may send what) and content checks
    peers/assign.py           ASSIGN: a standby told which stage to serve and where its state comes from
    peers/passes.py           RUN_STEP, FORWARD, BACKWARD, COMPONENT_GRAD: running a step's microbatches
    peers/step.py             the step state machine: the active attempt, COMMIT, ABORT
    peers/rebuild.py          GET_WEIGHTS, GET_STATE served; a replacement's pulls and rebuild
    peers/snapshots.py        SNAPSHOT, STORE_SNAPSHOT, FETCH_SNAPSHOT, RESTORE (rollback strategies)
    peers/reft_parity.py      REFT_CHUNK, REFT_FETCH: reft's parity blocks and the decode of a lost member
    peers/backups.py          BACKUP_START, BACKUP_PART, BACKUP_COMMIT, BACKUP_FETCH: BAFT's backups sent in the
                              bubbles, and handed over with a stage
    peers/streamed_copies.py  COPY_PART: snap's compressed copies, streamed in parts inside the steps
    peers/replicas.py         TAKE_REPLICA, REPLICA_GRAD, GET_REPLICA: redundant computation's successor replica
    peers/replica_group.py    REROUTE, GET_PASS, REDUCE: one replica of a stage group
    peers/adoption.py         ADOPT: a new coordinator takes over
    peers/stage.py            the run config and the hosted stage
    peers/compute.py          the one compute thread all torch work runs on
    peers/debug.py            --dump-recovery files

Faults come from outside: the one hook (`hook`, checkfree.peer_hook; None in production) observes the points of
the parts' work, and only when it was given one.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass, field

import torch

from checkfree.net.addresses import listen_ips
from checkfree.net.transport import (
    RemoteError,
    dht_maddrs,
    rpc_note,
    stop_transport,
)
from checkfree.protocol import (
    EXIT_COORDINATOR_GONE,
    EXIT_RUN_OVER,
    READY_PEER,
    RPC,
    Kind,
    Timeouts,
)
from checkfree.messages import Ok, Ping, Pong, Shutdown
from checkfree.peer_hook import PeerHook
from checkfree.wan import WanEmulator
from checkfree.worker import StageWorker
from peers.assign import Assignment
from peers.backups import Backups
from peers.checks import RULES
from peers.compute import ComputeQueue
from peers.debug import Dumps
from peers.adoption import Failover
from peers.replica_group import StageGroup
from peers.membership import Handler, Membership, Served
from peers.passes import Passes
from peers.rebuild import Rebuild
from peers.replicas import Replicas
from peers.snapshots import Snapshots
from peers.stage import HostedStage
from peers.step import StepTracker
from peers.streamed_copies import Streams

__all__ = ["PeerDaemon", "PeerOptions"]

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class PeerOptions:
    """Command-line options of `checkfree peer`."""

    run_id: str = "checkfree"
    initial_peers: list[str] = field(default_factory=list)
    host_maddrs: list[str] = field(default_factory=lambda: ["/ip4/127.0.0.1/tcp/0"])
    announce_maddrs: list[str] | None = None
    identity_path: str | None = None
    startup_timeout: float = 30.0
    transport: str = "hivemind"  # RPC transport: hivemind (p2pd) or libp2p (py-libp2p); must be the coordinator's
    libp2p_port: int = 0  # --transport libp2p: TCP port of the libp2p listener (0: any free port)
    tcp_port: int = 0  # --transport tcp: port of the TCP RPC listener (0: any free port)
    device: str | None = None  # overrides the run's device for this peer
    threads: int | None = None  # torch intra-op threads
    dump_dir: str | None = None  # debugging/tests: weights served and rebuilt in recoveries, final state
    secret_file: str | None = None  # run secret (else $CHECKFREE_SECRET; neither: an open swarm)
    leave_deadline: float = 30.0  # SIGTERM: how long to wait for a lossless handover before leaving
    coordinator_timeout: float = 60.0  # leave (exit 4) when no coordinator has answered for this long
    stay: bool = False  # keep running after the run has finished (default: exit, so a spot instance stops)
    timeouts: Timeouts = field(default_factory=Timeouts)
    relay: bool = True  # reached through a relay when the coordinator cannot connect to it (--no-relay: exit instead)
    relay_via: list[str] = field(default_factory=list)  # relays to use instead of the coordinator (full multiaddrs)
    serve_relay: bool = False  # relay for peers behind NAT (a public peer that opts in)
    check: bool = False  # --check: report reachability, latency and bandwidth to the coordinator, then exit


class PeerDaemon:
    """One peer process: supervises the parts that serve its stage."""

    def __init__(self, opts: PeerOptions, hook: PeerHook | None = None) -> None:
        """`hook`: the peer's one hook point (checkfree.peer_hook), for faults from outside."""
        self.opts = opts
        self.hook = hook
        self.stop = asyncio.Event()
        self.exit_code = 0
        self._told_to_stop = False  # the coordinator sent SHUTDOWN
        self.compute = ComputeQueue()
        self.dumps = Dumps(opts.dump_dir)
        self.hosted = HostedStage()
        self.membership = Membership(opts.run_id, opts.timeouts, opts.secret_file, self.hosted, self.stop)
        self.replicas = Replicas(self.membership, self.hosted, self.compute)
        self.streams = Streams(self.membership, self.hosted, self.compute)
        self.steps = StepTracker(opts.timeouts, self.hosted, self.compute, self.replicas, hook, self.streams)
        ips = listen_ips(opts.host_maddrs)  # reft's snapshot companion listens on this peer's host
        self.snapshots = Snapshots(self.membership, self.hosted, self.steps, self.compute,
                                   ips[0][1] if ips else "127.0.0.1", self.streams)
        self.backups = Backups(self.membership, self.hosted, self.compute, self.snapshots)
        self.passes = Passes(self.membership, self.hosted, self.steps, self.compute, self.replicas, self.backups,
                             hook, self.streams, self.snapshots.settle)
        self.rebuild = Rebuild(self.membership, self.hosted, self.compute, self.dumps, hook)
        self.group = StageGroup(self.membership, self.hosted, self.steps, self.compute, self.passes, hook)
        self.assignment = Assignment(self.hosted, self.compute, self.rebuild, self.snapshots, self.dumps,
                                     self._release, self.backups)
        self.failover = Failover(self.membership, self.hosted, self.steps, self.snapshots)

    def handlers(self) -> dict[str, Handler]:
        """Every RPC this peer serves, each behind the one admission check (peers.checks.RULES)."""
        served: dict[str, Served] = {
            RPC.PING: self._on_ping, RPC.SHUTDOWN: self._on_shutdown,
            RPC.ASSIGN: self.assignment.on_assign,
            RPC.RUN_STEP: self.passes.on_run_step, RPC.FORWARD: self.passes.on_forward,
            RPC.BACKWARD: self.passes.on_backward, RPC.COMPONENT_GRAD: self.passes.on_component_grad,
            RPC.COMMIT: self.steps.on_commit, RPC.ABORT: self.steps.on_abort,
            RPC.GET_WEIGHTS: self.rebuild.on_get_weights, RPC.GET_STATE: self.rebuild.on_get_state,
            RPC.SNAPSHOT: self.snapshots.on_snapshot, RPC.STORE_SNAPSHOT: self.snapshots.on_store_snapshot,
            RPC.FETCH_SNAPSHOT: self.snapshots.on_fetch_snapshot, RPC.RESTORE: self.snapshots.on_restore,
            RPC.TAKE_REPLICA: self.replicas.on_take_replica, RPC.REPLICA_GRAD: self.replicas.on_replica_grad,
            RPC.GET_REPLICA: self.replicas.on_get_replica,
            RPC.BACKUP_START: self.backups.on_backup_start, RPC.BACKUP_PART: self.backups.on_backup_part,
            RPC.BACKUP_COMMIT: self.backups.on_backup_commit, RPC.BACKUP_FETCH: self.backups.on_backup_fetch,
            RPC.COPY_PART: self.streams.on_copy_part,
            RPC.REFT_CHUNK: self.snapshots.parity.on_chunk, RPC.REFT_FETCH: self.snapshots.parity.on_fetch,
            RPC.REROUTE: self.group.on_reroute, RPC.GET_PASS: self.group.on_get_pass,
            RPC.REDUCE: self.group.on_reduce,
            RPC.ADOPT: self.failover.on_adopt,
        }
        assert served.keys() == RULES.keys(), "every RPC served has an admission rule, and only those"
        return {name: self.membership.admitted(name, handler) for name, handler in served.items()}

    async def _register(self) -> None:
        for name, handler in self.handlers().items():
            await self.membership.wire().register(name, handler)

    # ---- lifecycle -------------------------------------------------------------------
    async def run(self) -> int:
        """Serve until stopped; the process's exit code."""
        opts, net = self.opts, self.membership
        if opts.threads:
            torch.set_num_threads(opts.threads)
        await net.start(opts)
        # only now: the DHT process forked above would inherit asyncio's handlers and then ignore the
        # SIGTERM that DHT.shutdown / multiprocessing's exit send it, hanging this peer's exit forever
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop.set)
        hb = None
        try:
            if opts.check:
                return await net.check()
            await self._register()
            if self.hook is not None:  # (before joining: a hook armed from outside opens its channel here)
                await self.hook.started(net.wire())
            addrs = ",".join(await dht_maddrs(net.dht))
            print(f"{READY_PEER} peer_id={net.wire().peer_id} run={opts.run_id} addrs={addrs}"
                  f"{rpc_note(net.transport)}", flush=True)
            hb = asyncio.create_task(net.heartbeat())
            try:
                await self._join()
            except RemoteError as e:
                if e.kind != Kind.RUN_OVER:
                    raise
                print(f"peer: {str(e).splitlines()[0]}; exiting", flush=True)
                return EXIT_RUN_OVER
            watchdog = asyncio.create_task(self._watch_coordinator())
            await self.stop.wait()
            watchdog.cancel()
            await net.leave(opts.leave_deadline, tell_coordinator=not self._told_to_stop)
            return self.exit_code
        finally:
            if hb is not None:
                hb.cancel()
            await self.snapshots.parity.close()
            self.group.close()
            self.compute.shutdown()
            self.streams.shutdown()
            await stop_transport(net.dht, net.transport)

    async def _join(self) -> None:
        cfg = await self.membership.join()
        if cfg is None:  # stopped before a coordinator was found
            return
        self.hosted.configure(cfg, self.opts.device)
        if self.hosted.companion:  # reft's crash-surviving snapshot holder, started while standing by
            self.snapshots.parity.prepare()
        if cfg.train.wan:
            self.membership.emulate(WanEmulator(cfg))
        log.info("joined run %s as standby", self.opts.run_id)
        # pay torch's one-off lazy initialisation (~3 s on a CPU) now, not inside a recovery
        asyncio.create_task(self.compute.run(StageWorker, self.hosted.worker_cfg, cfg.num_stages - 1))

    async def _watch_coordinator(self) -> None:
        if await self.membership.watch_coordinator(self.opts.coordinator_timeout):
            self.exit_code = EXIT_COORDINATOR_GONE
            self.stop.set()

    async def _release(self) -> None:
        """Let the hosted stage go and stand by again (a stage group's replica moved elsewhere by the
        coordinator): its step state, gloo group and weights are dropped."""
        await self.steps.drop("this replica leaves its stage")
        self.steps.reset()
        self.group.close()
        self.streams.reset()
        self.hosted.release()

    # ---- handlers --------------------------------------------------------------------
    async def _on_ping(self, ping: Ping, tensors: list, peer) -> tuple[Pong, list]:
        return Pong(stage=self.hosted.index, state=self.hosted.state.value), []

    async def _on_shutdown(self, shutdown: Shutdown, tensors: list, peer) -> tuple[Ok, list]:
        """The coordinator ends this peer: the run is over, or its stage was handed over."""
        # no leave announcement needed: the coordinator asked (and may ask again: a request delayed by a
        # partition and its retry both arrive once the partition heals; both are answered)
        reason = shutdown.reason
        run_ended = reason is not None and reason.startswith("run ")
        if run_ended and self.membership.run_finished:  # a retry of the same message (e.g. after a partition healed)
            return Ok(), []
        if self.hosted.worker is not None and self.opts.dump_dir:
            tag = f"-{self.membership.me}" if self.hosted.joined().train.stage_groups else ""  # a stage group's replica
            await self.compute.run(self.dumps.dump_final, self.hosted.worker, self.hosted.omega, tag)
        if run_ended:
            self.membership.finish()
            if self.opts.stay:
                print(f"run finished ({reason}); staying (--stay) until stopped", flush=True)
                return Ok(), []
            print(f"run finished ({reason}); exiting", flush=True)
        else:
            log.info("told to shut down by the coordinator")
        self._told_to_stop = True
        asyncio.get_running_loop().call_later(0.1, self.stop.set)
        return Ok(), []
