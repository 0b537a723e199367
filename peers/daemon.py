"""The peer daemon: hosts one stage and serves forward/backward over P2P RPC (hivemind or py-libp2p).

Lifecycle: start the DHT + P2P transport and print the ready line; find the run's
coordinator in the DHT and join (the coordinator answers with the run's config); wait as
a standby until assigned a stage (fresh, or rebuilt by a recovery plan from live
neighbours' weights); then serve steps until told to shut down. A DHT heartbeat with an
expiry announces the peer while it lives. SIGTERM/SIGINT is a graceful leave: the
coordinator is told, then everything is shut down; SIGKILL is detected by the others.

All torch work runs on one compute thread, in arrival order, so the event loop stays
free to answer pings, heartbeats and weight requests while a stage computes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import random
import resource
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import torch

from checkfree.config import RunConfig, config_from_dict
from checkfree.data import TokenData, build_data
from checkfree.net.transport import (RemoteError, Transport, TransportError, announce, dht_maddrs,
                                     live_members_async, rpc_note, start_transport, stop_transport)
from checkfree.net.wire import check_finite
from checkfree.pipeline import COMPONENTS, Hop, edge_holders, route
from checkfree.protocol import (EXIT_COORDINATOR_GONE, EXIT_RUN_OVER, READY_PEER, RPC, Kind, StepFailed, STEP_TIMEOUT_MARK, STRAGGLER_MARK, ProtocolError, Timeouts,
                                coordinator_from_records, coordinator_key, members_key, plan_from_wire, require)
from checkfree.recovery import RecoveryPlan, rebuild_stage, recovered_optimizer_state
from checkfree.auth import coordinator_proof, join_token, load_secret, sign_record, verify
from checkfree.serialize import state_from_bytes, state_to_bytes
from checkfree.strategies.state import (capture_worker, optim_from_wire, optim_to_wire, restore_worker,
                                        state_nbytes)
from checkfree.softerrors import SOFT_ERROR_MARK, UncorrectableSoftError, guard_counts, make_guard
from checkfree.worker import InFlightPeak, StageWorker, resolve_device

__all__ = ["PeerOptions", "PeerDaemon", "PeerState"]

log = logging.getLogger(__name__)


def _write_atomic(path: Path, blob: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(blob)
    os.replace(tmp, path)


WIRE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class PeerState(Enum):
    JOINING = "joining"
    STANDBY = "standby"
    SERVING = "serving"
    LEAVING = "leaving"


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


@dataclass
class StepRun:
    """One attempt of one step (or evaluation) as seen by this peer."""

    step: int
    attempt: int
    evaluate: bool
    peers: dict[int, str]
    routes: list[list[Hop]]
    remaining: int
    done: asyncio.Event = field(default_factory=asyncio.Event)
    losses: dict[int, float] = field(default_factory=dict)
    error: str | None = None
    kind: str = Kind.STEP_FAILED  # what ended the attempt (a Kind), when `error` is set
    component_grads: dict[str, torch.Tensor] = field(default_factory=dict)
    tasks: set[asyncio.Task] = field(default_factory=set)
    bytes_sent: int = 0  # tensor payload bytes this peer sent for the step
    pending_starts: list[int] = field(default_factory=list)  # first-hop microbatches not started yet
    inflight: InFlightPeak = field(default_factory=InFlightPeak)  # the most activations held at once

    def fail(self, message: str, kind: str = Kind.STEP_FAILED) -> None:
        if self.error is None:
            self.error, self.kind = message, kind
        self.done.set()

    def figures(self) -> dict[str, int]:
        """What the coordinator records for this stage and step (metrics.jsonl)."""
        return {"bytes_sent": self.bytes_sent, "inflight_peak": self.inflight.microbatches,
                "activation_peak_bytes": self.inflight.bytes, "peak_rss_bytes": _peak_rss_bytes()}


def _peak_rss_bytes() -> int:
    """This process's peak resident memory so far (its DHT process and p2pd not included)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere


class PeerDaemon:
    """One peer process: the stage it hosts and the handlers serving it."""

    def __init__(self, opts: PeerOptions) -> None:
        self.opts = opts
        self.t = opts.timeouts
        self.state = PeerState.JOINING
        self.cfg: RunConfig | None = None
        self.worker: StageWorker | None = None
        self.omega = 0.0
        self.data: TokenData | None = None
        self.run_state: StepRun | None = None
        self.transport: Transport | None = None
        self.dht = None
        self.coordinator: str | None = None
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")
        self.stop = asyncio.Event()
        self.plus = False
        self._run_changed = asyncio.Event()
        self.snapshots: dict[int, tuple[int, bytes]] = {}
        self.secret = load_secret(opts.secret_file)  # stage -> (step, serialized full state)
        self._queue: asyncio.PriorityQueue = asyncio.PriorityQueue()
        self._seq = 0
        self._pump: asyncio.Task | None = None
        self._finished: tuple[int, int] | None = None  # newest (step, attempt) that ended here
        self.next_step = 0  # the step this stage's weights are ready for (steps committed so far)
        self.last_commit: dict | None = None  # the newest committed step's losses/lr/norm (for a new coordinator)
        self._busy_s = 0.0  # time the compute thread has spent computing, finished work
        self._busy_since: float | None = None  # start of the computation running now
        self.inject_delay: tuple[float, int] | None = None  # diagnostic slowness: (s per compute, from step)
        self._told_to_stop = False  # the coordinator sent SHUTDOWN
        self.exit_code = 0
        self.last_contact = time.monotonic()  # the newest sign of life from the coordinator
        self.finished = False  # the coordinator said the run ended
        self._die_after_pulls: int | None = None  # chaos (--chaos-rebuild-kills): SIGKILL self after this many pulls

    # ---- helpers ---------------------------------------------------------------------
    async def compute(self, fn, *args, priority: int = 1):
        """Run `fn(*args)` on the compute thread. Lower `priority` runs first among waiting
        work (backward passes: 0, everything else: 1), so gradients drain before new
        activations pile up — the 1F1B order within a stage."""
        fut = asyncio.get_running_loop().create_future()
        self._seq += 1
        self._queue.put_nowait((priority, self._seq, fn, args, fut))
        if self._pump is None or self._pump.done():
            self._pump = asyncio.create_task(self._drain())
        return await fut

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._queue.empty():
            _, _, fn, args, fut = self._queue.get_nowait()
            if fut.cancelled():
                continue
            self._busy_since = time.monotonic()
            try:
                result = await loop.run_in_executor(self.pool, fn, *args)
            except BaseException as e:  # handed to the awaiting caller
                if not fut.done():
                    fut.set_exception(e)
            else:
                if not fut.done():
                    fut.set_result(result)
            finally:
                self._busy_s += time.monotonic() - self._busy_since
                self._busy_since = None

    def busy(self) -> float:
        """Seconds the compute thread has spent computing so far (the running computation included)."""
        return self._busy_s + (time.monotonic() - self._busy_since if self._busy_since is not None else 0.0)

    def _slowed(self, fn, step: int):
        """`fn`, preceded on the compute thread by the diagnostic delay (`--chaos-slow`) from its step on:
        a slow GPU or an overloaded host, while the event loop keeps answering pings and heartbeats."""
        if self.inject_delay is None or step < self.inject_delay[1]:
            return fn
        delay = self.inject_delay[0]

        def slow(*args):
            time.sleep(delay)
            return fn(*args)

        return slow

    @property
    def stage(self) -> int:
        return self.worker.index if self.worker is not None else -1

    def _check_run(self, header: dict) -> None:
        require(header, run=str)
        if header["run"] != self.opts.run_id:
            raise ProtocolError(f"request for run {header['run']!r}; this peer serves run {self.opts.run_id!r}")

    async def _current(self, header: dict) -> StepRun:
        """The step run a message belongs to. A neighbour may send before the coordinator's
        RUN_STEP reached this peer: a message for a newer step waits (up to rpc_timeout) for
        it; a message for an older or aborted attempt is refused."""
        self._check_run(header)
        require(header, step=int, attempt=int)
        want = (header["step"], header["attempt"])
        deadline = time.monotonic() + self.t.rpc_timeout
        while True:
            run = self.run_state
            have = None if run is None else (run.step, run.attempt)
            if have == want:
                return run
            if (have is not None and have > want) or (self._finished is not None and self._finished >= want):
                raise ProtocolError(f"stale message for step {want[0]} attempt {want[1]} (active: {have})")
            left = deadline - time.monotonic()
            if left <= 0:
                raise ProtocolError(f"no step {want[0]} attempt {want[1]} started on this peer within "
                                    f"rpc_timeout={self.t.rpc_timeout:g} s (active: {have})")
            self._run_changed.clear()
            try:
                await asyncio.wait_for(self._run_changed.wait(), left)
            except asyncio.TimeoutError:
                pass

    def _set_run(self, run: StepRun | None) -> None:
        if self.run_state is not None:
            self._finished = max(self._finished or (-1, -1), (self.run_state.step, self.run_state.attempt))
        self.run_state = run
        self._run_changed.set()

    def _check_activation(self, tensors: list[torch.Tensor], what: str) -> torch.Tensor:
        if self.cfg is None:
            raise ProtocolError("this peer has not joined a run yet")
        if len(tensors) != 1:
            raise ProtocolError(f"{what} carries {len(tensors)} tensors, expected 1")
        x = tensors[0]
        m, t = self.cfg.model, self.cfg.train
        expect = (t.microbatch_size, m.context_length, m.d_model)
        if tuple(x.shape) != expect:
            raise ProtocolError(f"{what} has shape {tuple(x.shape)}, expected {expect}")
        if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ProtocolError(f"{what} has dtype {x.dtype}, expected a float tensor")
        check_finite([x])
        return x.float()

    # ---- lifecycle -------------------------------------------------------------------
    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        if self.opts.threads:
            torch.set_num_threads(self.opts.threads)
        self.dht, self.transport = await start_transport(
            self.opts.initial_peers, self.opts.host_maddrs, self.opts.announce_maddrs, self.opts.identity_path,
            self.opts.startup_timeout, transport=self.opts.transport, libp2p_port=self.opts.libp2p_port,
            tcp_port=self.opts.tcp_port, secret=self.secret)
        # only now: the DHT process forked above would inherit asyncio's handlers and then ignore the
        # SIGTERM that DHT.shutdown / multiprocessing's exit send it, hanging this peer's exit forever
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop.set)
        hb = None
        if self.secret is not None:  # every request this peer makes carries its membership token
            self.transport.extra_header = {"token": join_token(self.secret, self.opts.run_id,
                                                               str(self.transport.peer_id))}
        try:
            await self._register()
            addrs = ",".join(await dht_maddrs(self.dht))
            print(f"{READY_PEER} peer_id={self.transport.peer_id} run={self.opts.run_id} addrs={addrs}"
                  f"{rpc_note(self.transport)}", flush=True)
            hb = asyncio.create_task(self._heartbeat())
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
            await self._leave()
            return self.exit_code
        finally:
            if hb is not None:
                hb.cancel()
            self.pool.shutdown(wait=False, cancel_futures=True)
            await stop_transport(self.dht, self.transport)

    async def _heartbeat(self) -> None:
        """Refresh this peer's membership entry every ttl/3 (jittered) until cancelled."""
        key, me = members_key(self.opts.run_id), str(self.transport.peer_id)
        while True:
            try:
                value = {"stage": self.stage, "state": self.state.value}
                await announce(self.dht, key, me, sign_record(self.secret, self.opts.run_id, "member", me, value,
                                                              self.t.heartbeat_ttl),
                               self.t.heartbeat_ttl)
            except Exception as e:  # a missed beat is survivable; the next one retries
                log.warning("heartbeat failed: %r", e)
            await asyncio.sleep(self.t.heartbeat_ttl / 3 * random.uniform(0.8, 1.0))

    async def _watch_coordinator(self) -> None:
        """Leave when no coordinator has been heard from for `coordinator_timeout`: asked
        nothing for a heartbeat TTL, the peer asks the coordinator for its STATUS; a new
        coordinator taking over ADOPTs this peer (a contact too). Without this, the peers of
        a run whose coordinator died would wait (and bill) forever."""
        limit = self.opts.coordinator_timeout
        while not self.finished:
            await asyncio.sleep(min(self.t.heartbeat_ttl, limit / 4))
            if self.coordinator is not None and time.monotonic() - self.last_contact > self.t.heartbeat_ttl:
                try:
                    await self.transport.call(self.coordinator, RPC.STATUS, {"run": self.opts.run_id},
                                              timeout=min(5.0, self.t.rpc_timeout))
                    self._heard_from_coordinator()
                except RemoteError:  # it answers, if only with an error (e.g. taking over): alive
                    self._heard_from_coordinator()
                except (TransportError, asyncio.TimeoutError, OSError) as e:
                    log.debug("coordinator %s did not answer: %r", self.coordinator, e)
            silent = time.monotonic() - self.last_contact
            if silent > limit:
                print(f"peer: no coordinator of run {self.opts.run_id!r} has answered for {silent:.0f} s "
                      f"(--coordinator-timeout {limit:g}); leaving", flush=True)
                self.exit_code = EXIT_COORDINATOR_GONE
                self.stop.set()
                return

    def _heard_from_coordinator(self) -> None:
        self.last_contact = time.monotonic()

    async def _register(self) -> None:
        handlers = {RPC.ASSIGN: self._on_assign, RPC.RUN_STEP: self._on_run_step, RPC.COMMIT: self._on_commit,
                    RPC.ABORT: self._on_abort, RPC.FORWARD: self._on_forward, RPC.BACKWARD: self._on_backward,
                    RPC.COMPONENT_GRAD: self._on_component_grad, RPC.GET_WEIGHTS: self._on_get_weights,
                    RPC.SNAPSHOT: self._on_snapshot, RPC.STORE_SNAPSHOT: self._on_store_snapshot,
                    RPC.FETCH_SNAPSHOT: self._on_fetch_snapshot, RPC.RESTORE: self._on_restore,
                    RPC.GET_STATE: self._on_get_state,
                    RPC.PING: self._on_ping, RPC.SHUTDOWN: self._on_shutdown}
        await self.transport.register(RPC.ADOPT, self._on_adopt)  # authorizes the new coordinator itself
        control = {RPC.ASSIGN, RPC.RUN_STEP, RPC.COMMIT, RPC.ABORT, RPC.SNAPSHOT, RPC.RESTORE, RPC.SHUTDOWN}
        for name, handler in handlers.items():
            if name != RPC.PING:
                handler = self._authorized(handler, coordinator_only=name in control)
            await self.transport.register(name, handler)

    def _authorized(self, handler, *, coordinator_only: bool):
        """With a run secret: control RPCs only from the coordinator; data RPCs only from
        callers whose request carries the run token bound to their own peer id (libp2p
        authenticates the caller's peer id, the token proves it holds the secret)."""

        async def wrapped(header: dict, tensors: list, peer) -> tuple[dict, list]:
            if self.coordinator is not None and str(peer) == self.coordinator:
                self._heard_from_coordinator()
            if self.secret is not None:
                caller = str(peer)
                member = verify(join_token(self.secret, self.opts.run_id, caller), header.get("token"))
                if self.coordinator is None or (caller != self.coordinator and (coordinator_only or not member)):
                    raise ProtocolError(f"peer {caller} is not authorized for this run", Kind.UNAUTHORIZED)
            return await handler(header, tensors, peer)

        return wrapped

    async def _find_coordinator(self) -> str | None:
        """The coordinator's peer id; None if this peer is told to stop while it looks."""
        key = coordinator_key(self.opts.run_id)
        start = time.monotonic()
        deadline, note = start + self.t.join_timeout, start + 30.0
        while time.monotonic() < deadline and not self.stop.is_set():
            if time.monotonic() > note:  # waiting is visible, never silent
                print(f"peer: still looking for the coordinator of run {self.opts.run_id!r} "
                      f"({time.monotonic() - start:.0f} s of --join-timeout {self.t.join_timeout:g})", flush=True)
                note += 30.0
            try:
                found = await self._unless_stopped(live_members_async(self.dht, key)) or {}
            except (ConnectionError, OSError, EOFError) as e:
                # a signal to the whole process group can end the DHT process a moment before our
                # own handler sets `stop`: give the signal a second to arrive before retrying
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.stop.wait(), 1.0)
                log.debug("DHT lookup of the coordinator failed: %r", e)
                found = {}
            # a record signed with our secret first; else any (its JOIN reply must still prove the
            # secret, and a peer with the wrong secret then hears why it is refused)
            coordinator = coordinator_from_records(found, self.secret, self.opts.run_id, self.transport.kind,
                                                   unsigned_ok=True)
            if coordinator is not None:
                return coordinator
            await asyncio.sleep(0.2)
        if self.stop.is_set():
            return None
        raise TransportError(f"no coordinator for run {self.opts.run_id!r} found in the DHT within "
                             f"join_timeout={self.t.join_timeout:g} s: is `checkfree scheduler --run-id "
                             f"{self.opts.run_id}` running and reachable from --initial-peers?")

    async def _unless_stopped(self, coro):
        """Await `coro`, or give up (None) once this peer is told to stop: a signal to the whole
        process group also ends the DHT process, whose replies would then never come."""
        task, stop = asyncio.ensure_future(coro), asyncio.ensure_future(self.stop.wait())
        try:
            await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if not task.done():
            task.cancel()
            return None
        return task.result()

    async def _join(self) -> None:
        me = str(self.transport.peer_id)
        request = {"run": self.opts.run_id, "peer_id": me}
        if self.secret is not None:
            request["token"] = join_token(self.secret, self.opts.run_id, me)
        deadline = time.monotonic() + self.t.join_timeout
        while True:
            self.coordinator = await self._find_coordinator()
            if self.coordinator is None:  # stopped (SIGTERM/SIGINT) before a coordinator was found
                return
            try:
                header, _ = await self.transport.call(self.coordinator, RPC.JOIN, request, timeout=self.t.rpc_timeout)
                break
            except (TransportError, asyncio.TimeoutError, OSError, RemoteError) as e:
                # the DHT may still name a coordinator that died (its record outlives it by up to
                # 3 heartbeat TTLs), or a new one may still be taking over: look again
                retry = not isinstance(e, RemoteError) or e.kind == Kind.TAKING_OVER
                if not retry or time.monotonic() > deadline:
                    raise
                log.info("joining coordinator %s failed (%s); looking for the coordinator again", self.coordinator, e)
                self.coordinator = None
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.stop.wait(), 1.0)
        if self.secret is not None and not verify(
                coordinator_proof(self.secret, self.opts.run_id, self.coordinator, me), header.get("proof")):
            raise TransportError(f"the coordinator {self.coordinator} found in the DHT failed authentication: "
                                 "it does not hold this run's secret")
        self.cfg = config_from_dict(json.loads(header["config"]))
        if self.opts.device:
            self.cfg.train.device = self.opts.device
        resolve_device(self.cfg.train.device)
        from checkfree.strategies import build_strategy, worker_config

        strategy = build_strategy(self.cfg)
        self.plus = strategy.plus
        self.worker_cfg = worker_config(self.cfg, strategy)  # routes/replicas of the strategy's pipeline
        self.state = PeerState.STANDBY
        log.info("joined run %s as standby", self.opts.run_id)
        # pay torch's one-off lazy initialisation (~3 s on a CPU) now, not inside a recovery
        asyncio.create_task(self.compute(StageWorker, self.worker_cfg, self.cfg.num_stages - 1))

    async def _leave(self) -> None:
        """Graceful leave (SIGTERM, e.g. a spot preemption notice): tell the coordinator; if
        it has a replacement ready, keep serving until our exact state has been handed over
        (the coordinator then sends SHUTDOWN) or `leave_deadline` passes."""
        self.state = PeerState.LEAVING
        if self.coordinator is None or self._told_to_stop:
            return
        try:
            reply, _ = await self.transport.call(self.coordinator, RPC.LEAVE,
                                                 {"run": self.opts.run_id, "peer_id": str(self.transport.peer_id)},
                                                 timeout=min(5.0, self.t.rpc_timeout))
        except (TransportError, RemoteError) as e:
            log.info("could not announce leave to the coordinator: %s", e)
            return
        if reply.get("handover") and self.worker is not None:
            log.info("handing stage %d over before leaving (deadline %.0f s)", self.stage, self.opts.leave_deadline)
            self.stop.clear()
            try:
                await asyncio.wait_for(self.stop.wait(), self.opts.leave_deadline)
            except asyncio.TimeoutError:
                log.warning("no handover within %.0f s; leaving anyway", self.opts.leave_deadline)

    async def _on_get_state(self, header: dict, tensors: list, peer) -> tuple[dict, list]:
        """This stage's full state now (weights, Adam, LR scale, omega): a lossless handover."""
        self._check_run(header)
        require(header, step=int)
        if self.worker is None:
            raise ProtocolError("this peer hosts no stage")
        blob = await self.compute(self._capture_bytes, header["step"])
        return {"stage": self.stage, "next_step": self.next_step}, [torch.frombuffer(bytearray(blob), dtype=torch.uint8)]

    # ---- assignment and recovery ------------------------------------------------------
    def _needs_data(self, stage: int) -> bool:
        holders = edge_holders(self.cfg.num_stages, self.plus)
        return stage in holders["embed"] or stage in holders["head"]

    def _build(self, stage: int, init: bool = True) -> StageWorker:
        """The stage's worker; init=False leaves its weights unallocated (a recovery loads them)."""
        worker = StageWorker(self.worker_cfg, stage, init=init)
        worker.attach_guard(make_guard(self.cfg, stage))
        if self._needs_data(stage) and self.data is None:
            c = self.cfg
            self.data = build_data(c.data, vocab_size=c.model.vocab_size, context_length=c.model.context_length,
                                   seed=c.train.seed, microbatch_size=c.train.microbatch_size)
        return worker

    def _check_coordinator(self, peer, name: str) -> None:
        """Control messages (assign, run_step, commit, abort) are the coordinator's alone: from
        anyone else they could start, commit or abort steps, or leave activations behind."""
        if self.coordinator is None or str(peer) != self.coordinator:
            raise ProtocolError(f"only the run's coordinator may send {name}; {peer} is not it")

    async def _on_assign(self, header: dict, tensors: list, peer) -> tuple[dict, list]:
        self._check_run(header)
        require(header, stage=int, mode=str)
        self._check_coordinator(peer, RPC.ASSIGN)
        if self.cfg is None:
            raise ProtocolError("this peer has not joined a run yet")
        if self.worker is not None:
            raise ProtocolError(f"this peer already hosts stage {self.stage}")
        stage = header["stage"]
        if not 0 <= stage < self.cfg.num_stages:
            raise ProtocolError(f"stage {stage} out of range for {self.cfg.num_stages} stages")
        mode = header["mode"]
        if mode not in ("fresh", "recover", "restore", "handover", "load"):
            raise ProtocolError(f"unknown assign mode {mode!r}")
        t0 = time.perf_counter()
        reply: dict[str, Any] = {"stage": stage}
        if isinstance(header.get("chaos_die_after_pulls"), int):
            self._die_after_pulls = header["chaos_die_after_pulls"]
        if mode == "recover":  # builds the stage while it pulls the weights
            worker, rebuilt = await self._recover(stage, header)
            reply.update(rebuilt)
        else:
            worker = await self.compute(self._build, stage)
        if mode == "restore":
            reply.update(await self._restore_new(worker, header))
        elif mode == "load":  # resuming a run: the saved state travels with the message
            require(header, step=int)
            if len(tensors) != 1 or tensors[0].dtype != torch.uint8 or tensors[0].dim() != 1:
                raise ProtocolError("assign mode 'load' carries one uint8 tensor: the stage's saved state")
            try:
                reply["omega"] = await self.compute(self._load_bytes, worker, tensors[0].numpy().tobytes())
            except (ValueError, KeyError, RuntimeError) as e:
                raise ProtocolError(f"the saved state of stage {stage} does not load: {e}") from None
        elif mode == "handover":
            require(header, source=str, step=int)
            _, (blob,) = await self.transport.call(header["source"], RPC.GET_STATE,
                                                   {"run": self.opts.run_id, "step": header["step"]},
                                                   timeout=self.t.step_timeout)
            reply["omega"] = await self.compute(self._load_bytes, worker, blob.numpy().tobytes())
            reply["bytes"] = blob.numel()
        if isinstance(header.get("inject_delay"), list):  # diagnostic (--chaos-slow): [seconds, from step]
            self.inject_delay = (float(header["inject_delay"][0]), int(header["inject_delay"][1]))
            log.warning("diagnostic: %.3g s delay per forward/backward from step %d", *self.inject_delay)
        self.worker = worker
        self.omega = reply.pop("omega", 0.0)
        self.next_step = header.get("step", 0) if isinstance(header.get("step", 0), int) else 0
        self.state = PeerState.SERVING
        reply["assign_s"] = time.perf_counter() - t0
        log.info("serving stage %d (%s)", stage, mode)
        return reply, []

    def _dump(self, name: str, state: dict[str, torch.Tensor], meta: dict) -> None:
        """Save a state dict and its metadata under --dump-recovery (off by default)."""
        if not self.opts.dump_dir:
            return
        from safetensors.torch import save_file

        path = Path(self.opts.dump_dir)
        path.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().cpu().contiguous() for k, v in state.items()}, str(path / f"{name}.safetensors"))
        (path / f"{name}.json").write_text(json.dumps(meta))

    def _dump_final(self) -> None:
        """--dump-recovery: the weights and Adam state this stage ends the run with."""
        keys, tensors = optim_to_wire(self.worker.optimizer_state())
        self._dump(f"final-stage{self.stage}", self.worker.state_dict(), {"omega": self.omega})
        self._dump(f"final-stage{self.stage}-optim", {"/".join(k): t for k, t in zip(keys, tensors)},
                   {"lr_scale": self.worker.lr_scale})

    async def _fetch(self, peer_id: str, part: str, step: int) -> tuple[dict[str, torch.Tensor], float, dict]:
        """A live stage's weights of `part`, its omega, and (for a component) its Adam state."""
        t0 = time.perf_counter()
        h, ts = await self.transport.call(peer_id, RPC.GET_WEIGHTS,
                                          {"run": self.opts.run_id, "part": part, "step": step},
                                          timeout=self.t.rpc_timeout)
        log.info("pulled %s of stage %s: %.1f MB in %.3f s", part, h.get("stage"),
                 sum(t.numel() * t.element_size() for t in ts) / 1e6, time.perf_counter() - t0)
        if self._die_after_pulls is not None:  # local swarm chaos: a death in the middle of a rebuild
            self._die_after_pulls -= 1
            if self._die_after_pulls <= 0:
                print(f"CHAOS: SIGKILL of this replacement after pulling {part} of stage {h.get('stage')}",
                      flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
        keys, okeys = h["keys"], h.get("optim", [])
        if not isinstance(okeys, list) or len(keys) + len(okeys) != len(ts):
            raise ProtocolError(f"weights reply has {len(keys)} keys and {okeys!r:.40} optimizer keys "
                                f"but {len(ts)} tensors")
        return dict(zip(keys, ts)), float(h["omega"]), optim_from_wire(okeys, ts[len(keys):])

    async def _recover(self, stage: int, header: dict) -> tuple[StageWorker, dict]:
        """Pull the sources' weights and norms while the compute thread builds the stage (without
        weights: the rebuild brings them), then apply the library's rebuild on the compute thread."""
        require(header, plan=dict, sources=dict, step=int)
        plan = plan_from_wire(header["plan"])
        peers = {int(k): v for k, v in header["sources"].items()}
        t0 = time.perf_counter()
        worker, (blocks, norms, edges, edge_optim, transfer_s) = await asyncio.gather(
            self.compute(self._build, stage, False), self._pull(plan, peers, header["step"]))
        t1 = time.perf_counter()
        coeffs = await self.compute(self._rebuild, worker, plan, blocks, norms, edges, edge_optim, header["step"])
        t2 = time.perf_counter()
        log.info("recovery of stage %d: pulls %.3f s, stage ready %.3f s, rebuild %.3f s",
                 stage, transfer_s, t1 - t0, t2 - t1)
        reply = {"coefficients": [coeffs[s] for s in plan.sources] if coeffs else [],
                 "norms": [norms[s] for s in plan.sources], "transfer_s": transfer_s, "rebuild_s": t2 - t1,
                 "bytes": state_nbytes([*blocks.values(), *edges.values(), *edge_optim.values()])}
        await self.compute(self._dump, f"rebuilt-step{header['step']}-stage{plan.stage}", worker.state_dict(), reply)
        return worker, reply

    async def _pull(self, plan: RecoveryPlan, peers: dict[int, str], step: int) -> tuple[dict, dict, dict, dict, float]:
        """Every weight pull of `plan` at once: blocks and norms per source stage, the replicas'
        weights and Adam state per component, and the seconds it took."""
        t0 = time.perf_counter()
        blocks, edges = await asyncio.gather(
            asyncio.gather(*(self._fetch(peers[s], "blocks", step) for s in plan.sources)),
            asyncio.gather(*(self._fetch(peers[s], comp, step) for comp, s in plan.edge_sources.items())))
        return ({s: w for s, (w, _, _) in zip(plan.sources, blocks)},
                {s: n for s, (_, n, _) in zip(plan.sources, blocks)},
                {c: w for c, (w, _, _) in zip(plan.edge_sources, edges)},
                {c: o for c, (_, _, o) in zip(plan.edge_sources, edges)}, time.perf_counter() - t0)

    def _rebuild(self, worker: StageWorker, plan: RecoveryPlan, blocks: dict, norms: dict, edges: dict,
                 edge_optim: dict, step: int) -> dict[int, float]:
        """On the compute thread: the library's rebuild from the pulled weights, loaded into `worker`
        with a fresh optimizer. Returns the coefficient of each source stage."""
        rc = self.cfg.recovery
        state, coeffs = rebuild_stage(plan, worker.state_dict(), blocks, norms, edges, eps=rc.eps,
                                      seed=self.cfg.train.seed + step, std=self.cfg.model.init_std)
        worker.load_recovered(state, rc.lr_scale, recovered_optimizer_state(plan, edge_optim))
        return coeffs

    # ---- snapshots (gemini: in peers' memory; checkpoint: files) ------------------------
    def _capture_bytes(self, step: int) -> bytes:
        return state_to_bytes(capture_worker(self.worker, step, self.omega))

    def _load_bytes(self, worker: StageWorker, blob: bytes) -> float:
        state = state_from_bytes(blob)
        restore_worker(worker, state)
        return float(state["norm"])

    async def _on_snapshot(self, header: dict, tensors: list, peer) -> tuple[dict, list]:
        """Capture this stage's full state as of `step` (weights, Adam, LR scale, RNG, data
        position) and keep it in memory and send it to the other holders (`holders`), or
        write it to `storage` as a file."""
        self._check_run(header)
        require(header, step=int)
        self._check_coordinator(peer, RPC.SNAPSHOT)  # it names a directory to write and peers to send to
        if self.worker is None:
            raise ProtocolError("this peer hosts no stage")
        t0 = time.perf_counter()
        blob = await self.compute(self._capture_bytes, header["step"])
        sent = 0
        if isinstance(header.get("storage"), str):
            path = Path(header["storage"]) / f"stage{self.stage}-step{header['step']}.pt"
            await self.compute(_write_atomic, path, blob)
        else:
            require(header, holders=list)
            self.snapshots[self.stage] = (header["step"], blob)
            payload = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
            for pid in header["holders"]:
                if pid != str(self.transport.peer_id):
                    await self.transport.call(pid, RPC.STORE_SNAPSHOT, {"run": self.opts.run_id, "owner": self.stage,
                                                                        "step": header["step"]}, [payload],
                                              timeout=self.t.step_timeout)
                    sent += len(blob)
        return {"bytes": len(blob), "sent": sent, "seconds": time.perf_counter() - t0}, []

    async def _on_store_snapshot(self, header: dict, tensors: list, peer) -> tuple[dict, list]:
        self._check_run(header)
        require(header, owner=int, step=int)
        if self.cfg is None or not 0 <= header["owner"] < self.cfg.num_stages:  # at most one blob per stage
            raise ProtocolError(f"snapshot of stage {header['owner']} out of range for "
                                f"{self.cfg.num_stages if self.cfg else '?'} stages")
        if len(tensors) != 1 or tensors[0].dtype != torch.uint8 or tensors[0].dim() != 1:
            raise ProtocolError("a snapshot is one 1-D uint8 tensor")
        self.snapshots[header["owner"]] = (header["step"], tensors[0].numpy().tobytes())
        return {"ok": True, "held": sorted(self.snapshots)}, []

    async def _on_fetch_snapshot(self, header: dict, tensors: list, peer) -> tuple[dict, list]:
        self._check_run(header)
        require(header, owner=int, step=int)
        held = self.snapshots.get(header["owner"])
        if held is None or held[0] != header["step"]:
            raise ProtocolError(f"no snapshot of stage {header['owner']} at step {header['step']} here "
                                f"(have: {None if held is None else held[0]})")
        return {"ok": True}, [torch.frombuffer(bytearray(held[1]), dtype=torch.uint8)]

    async def _snapshot_blob(self, stage: int, header: dict) -> bytes:
        """The snapshot bytes of `stage` at `step`: own memory, a holder peer, or storage."""
        step = header["step"]
        if isinstance(header.get("storage"), str):
            return (Path(header["storage"]) / f"stage{stage}-step{step}.pt").read_bytes()
        source = header.get("source")
        if source in (None, str(self.transport.peer_id)):
            held = self.snapshots.get(stage)
            if held is None or held[0] != step:
                raise ProtocolError(f"no own snapshot of stage {stage} at step {step}")
            return held[1]
        _, (blob,) = await self.transport.call(source, RPC.FETCH_SNAPSHOT, {"run": self.opts.run_id, "owner": stage,
                                                                            "step": step}, timeout=self.t.step_timeout)
        return blob.numpy().tobytes()

    async def _restore_new(self, worker: StageWorker, header: dict) -> dict:
        """A replacement takes the lost stage's snapshot (rollback strategies)."""
        require(header, step=int)
        t0 = time.perf_counter()
        if header["step"] == 0 and header.get("source") == "init":
            return {"omega": 0.0, "restore_s": 0.0, "bytes": 0}
        blob = await self._snapshot_blob(worker.index, header)
        norm = await self.compute(self._load_bytes, worker, blob)
        return {"omega": norm, "restore_s": time.perf_counter() - t0, "bytes": len(blob)}

    async def _on_restore(self, header: dict, tensors: list, peer) -> tuple[dict, list]:
        """Roll this live stage back to its snapshot at `step` (own memory or storage), or
        to its initial state for step 0 with source "init"."""
        self._check_run(header)
        require(header, step=int)
        self._check_coordinator(peer, RPC.RESTORE)
        if self.worker is None:
            raise ProtocolError("this peer hosts no stage")
        stage = self.worker.index
        if header["step"] == 0 and header.get("source") == "init":
            self.worker = await self.compute(self._build, stage)
            self.omega = 0.0
        else:
            blob = await self._snapshot_blob(stage, header)
            self.omega = await self.compute(self._load_bytes, self.worker, blob)
        self._set_run(None)
        self._finished = None
        self.next_step = header["step"]
        return {"ok": True}, []

    async def _on_get_weights(self, header: dict, tensors: list, peer) -> tuple[dict, list]:
        self._check_run(header)
        require(header, part=str)
        if self.worker is None:
            raise ProtocolError("this peer hosts no stage")
        part = header["part"]
        if part not in ("blocks", "embed", "head", "all"):
            raise ProtocolError(f"unknown weights part {part!r}")
        state = await self.compute(self.worker.state_dict)
        items = [(k, v.detach().cpu().contiguous()) for k, v in state.items()
                 if part == "all" or k.startswith(part + ".")]
        if not items:
            raise ProtocolError(f"stage {self.stage} holds no {part!r} weights")
        if isinstance(header.get("step"), int):
            self._dump(f"served-step{header['step']}-stage{self.stage}-{part}", dict(items), {"omega": self.omega})
        reply = {"keys": [k for k, _ in items], "omega": self.omega, "stage": self.stage}
        tensors = [v for _, v in items]
        if part in COMPONENTS:  # a replica is recovered exactly: its Adam state comes with it
            reply["optim"], optim = optim_to_wire(await self.compute(self.worker.optimizer_state, part + "."))
            tensors += optim
        return reply, tensors

    # ---- steps -----------------------------------------------------------------------
    def _routes(self, step: int, evaluate: bool) -> list[list[Hop]]:
        c = self.cfg
        s = c.num_stages
        if evaluate:
            return [[Hop(i, i == 0, i == s - 1) for i in range(s)] for _ in range(c.train.eval_batches)]
        return [route(s, self.plus, step, mb, c.train.num_microbatches) for mb in range(c.train.num_microbatches)]

    def _batch(self, run: StepRun, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
        if run.evaluate:
            return self.data.val_batches(self.cfg.train.eval_batches)[mb]
        return self.data.batch(run.step, mb)

    def _start_next(self, run: StepRun) -> None:
        if run.pending_starts:
            self._spawn(run, self._forward_task(run, run.pending_starts.pop(0), 0, None))

    def _spawn(self, run: StepRun, coro) -> None:
        task = asyncio.create_task(coro)
        run.tasks.add(task)
        task.add_done_callback(run.tasks.discard)

    async def _on_run_step(self, header: dict, tensors: list, peer) -> tuple[dict, list]:
        self._check_run(header)
        require(header, step=int, attempt=int, peers=dict, evaluate=bool)
        self._check_coordinator(peer, RPC.RUN_STEP)
        if self.worker is None:
            raise ProtocolError("this peer hosts no stage")
        old = self.run_state
        if old is not None and not old.done.is_set():
            old.fail("superseded by a new step")
        routes = self._routes(header["step"], header["evaluate"])
        announced = header.get("routes")
        if announced is not None and announced != [[h.stage for h in hops] for hops in routes]:
            raise ProtocolError(f"the coordinator's route table for step {header['step']} differs from this peer's "
                                "(different strategy or config?)")
        run = StepRun(header["step"], header["attempt"], header["evaluate"],
                      {int(k): str(v) for k, v in header["peers"].items()}, routes, remaining=len(routes))
        self._set_run(run)
        run.pending_starts = [mb for mb, hops in enumerate(routes) if hops[0].stage == self.stage]
        window = len(run.pending_starts)
        if self.cfg.train.schedule == "1f1b" and not run.evaluate:
            window = self.cfg.num_stages  # at most S microbatches in flight from this first hop
        busy0 = self.busy()
        for _ in range(min(window, len(run.pending_starts))):
            self._start_next(run)
        try:
            await asyncio.wait_for(run.done.wait(), self.t.step_timeout)
        except asyncio.TimeoutError:
            # the peer whose own computing filled most of the step is the straggler; the others were waiting
            busy = self.busy() - busy0
            straggler = busy >= self.t.step_timeout / 2
            run.fail(f"{STEP_TIMEOUT_MARK} step {run.step} timed out after {self.t.step_timeout:g} s on stage "
                     f"{self.stage}, {busy:.1f} s of it computing{f' {STRAGGLER_MARK}' if straggler else ''}",
                     Kind.STRAGGLER if straggler else Kind.STEP_TIMEOUT)
        if run.error is None and self.plus and not run.evaluate:
            await self._sync_components(run)
        if run.error is not None:
            raise StepFailed(run.error, run.kind)
        run.inflight = await self.compute(self.worker.take_inflight_peak)  # after this step's queued work
        return {"losses": {str(k): v for k, v in run.losses.items()}, "stage": self.stage, **run.figures()}, []

    async def _sync_components(self, run: StepRun) -> None:
        """CheckFree+: add the partner holder's embedding/head gradient to ours (same sum on both)."""
        holders = edge_holders(self.cfg.num_stages, True)
        for comp in self.worker.components:
            partner = next(h for h in holders[comp] if h != self.stage)
            try:
                _, (other,) = await self.transport.call(
                    run.peers[partner], RPC.COMPONENT_GRAD,
                    {"run": self.opts.run_id, "step": run.step, "attempt": run.attempt, "comp": comp},
                    timeout=self.t.rpc_timeout)
            except (TransportError, RemoteError, ValueError) as e:
                await self._report(run, partner, str(e))
                return
            mine = run.component_grads[comp]
            run.bytes_sent += other.numel() * other.element_size()  # counted once per transfer, at the receiver
            await self.compute(self.worker.set_component_grad, comp, mine + other.to(mine.device))

    async def _on_component_grad(self, header: dict, tensors: list, peer) -> tuple[dict, list]:
        run = await self._current(header)
        require(header, comp=str)
        await asyncio.wait_for(run.done.wait(), self.t.step_timeout)
        if run.error is not None or header["comp"] not in run.component_grads:
            raise ProtocolError(f"no {header['comp']!r} gradient for step {run.step}: {run.error or 'not a holder'}")
        return {}, [run.component_grads[header["comp"]].cpu()]

    def _mb_done(self, run: StepRun) -> None:
        run.remaining -= 1
        if run.remaining == 0:
            if self.plus and not run.evaluate:
                run.component_grads = {c: self.worker.component_grad(c) for c in self.worker.components}
            run.done.set()

    async def _send(self, run: StepRun, stage: int, name: str, header: dict, tensor: torch.Tensor) -> None:
        header = {"run": self.opts.run_id, "step": run.step, "attempt": run.attempt, **header}
        tensor = tensor.to(WIRE_DTYPES[self.cfg.train.wire_dtype])  # optional half-precision on the wire
        run.bytes_sent += tensor.numel() * tensor.element_size()
        try:
            await self.transport.call(run.peers[stage], name, header, [tensor], timeout=self.t.rpc_timeout)
        except RemoteError as e:
            run.fail(f"stage {stage} refused {name}: {e.remote_message}")
        except (TransportError, asyncio.TimeoutError, OSError) as e:
            await self._report(run, stage, str(e))

    async def _report(self, run: StepRun, stage: int, reason: str) -> None:
        run.fail(f"call to stage {stage} failed: {reason}")
        try:
            await self.transport.call(self.coordinator, RPC.REPORT,
                                      {"run": self.opts.run_id, "step": run.step, "attempt": run.attempt,
                                       "stage": stage, "peer_id": run.peers.get(stage, ""), "reason": reason[:500]},
                                      timeout=min(5.0, self.t.rpc_timeout))
        except (TransportError, RemoteError) as e:
            log.warning("could not report the failure of stage %d: %s", stage, e)

    async def _forward_task(self, run: StepRun, mb: int, idx: int, x: torch.Tensor | None) -> None:
        try:
            hop = run.routes[mb][idx]
            inputs, targets = self._batch(run, mb) if (hop.embed or hop.head) else (None, None)
            if hop.embed:
                x = inputs
            key = (run.step, run.attempt, mb)
            if run.evaluate:
                out = await self.compute(self.worker.infer, x, hop)
                if hop.head:
                    run.losses[mb] = float(torch.nn.functional.cross_entropy(out.flatten(0, 1), targets.flatten()))
                else:
                    await self._send(run, run.routes[mb][idx + 1].stage, RPC.FORWARD, {"mb": mb, "hop": idx + 1}, out)
                self._mb_done(run)
                return
            out = await self._guarded_forward(key, x, hop, targets)
            if not hop.head:
                await self._send(run, run.routes[mb][idx + 1].stage, RPC.FORWARD, {"mb": mb, "hop": idx + 1}, out)
                return
            run.losses[mb] = float(out)  # this microbatch's share of the step loss (already / M)
            if not math.isfinite(run.losses[mb]):
                log.warning("non-finite loss at step %d microbatch %d", run.step, mb)
            await self._backward_task(run, mb, idx, None)
        except StepFailed as e:  # expected (a soft error the guard could not correct): one line
            log.warning("forward of microbatch %d failed: %s", mb, e)
            run.fail(f"forward of microbatch {mb} failed on stage {self.stage}: {e}", e.kind)
        except Exception as e:  # a failure is a value: the step fails, the peer keeps serving
            log.exception("forward of microbatch %d failed", mb)
            run.fail(f"forward of microbatch {mb} failed on stage {self.stage}: {type(e).__name__}: {e}")

    async def _guarded_forward(self, key, x, hop: Hop, targets):
        """Forward with one recompute if the soft-error guard cannot correct a fault; a second
        uncorrectable fault fails the step with a SOFT_ERROR marker the coordinator counts."""
        for attempt in range(2):
            try:
                return await self.compute(self._slowed(self.worker.forward, key[0]), key, x, hop, targets)
            except UncorrectableSoftError as e:
                await self.compute(self.worker.drop_microbatch, key)
                if attempt == 1:
                    raise StepFailed(f"{SOFT_ERROR_MARK} stage={self.stage}: {e}", Kind.SOFT_ERROR) from e
                log.warning("uncorrectable soft error, recomputing microbatch %s: %s", key, e)

    async def _backward_task(self, run: StepRun, mb: int, idx: int, grad: torch.Tensor | None) -> None:
        try:
            grad_in = await self.compute(self._slowed(self.worker.backward, run.step), (run.step, run.attempt, mb),
                                         grad, priority=0)
            self._mb_done(run)
            if idx == 0 and self.cfg.train.schedule == "1f1b":
                self._start_next(run)  # one microbatch finished here: admit the next
            if idx > 0:
                await self._send(run, run.routes[mb][idx - 1].stage, RPC.BACKWARD, {"mb": mb, "hop": idx - 1},
                                 grad_in)
        except Exception as e:
            log.exception("backward of microbatch %d failed", mb)
            run.fail(f"backward of microbatch {mb} failed on stage {self.stage}: {type(e).__name__}: {e}")

    def _check_hop(self, run: StepRun, header: dict) -> tuple[int, int]:
        require(header, mb=int, hop=int)
        mb, idx = header["mb"], header["hop"]
        if not 0 <= mb < len(run.routes) or not 0 <= idx < len(run.routes[mb]):
            raise ProtocolError(f"microbatch {mb} hop {idx} out of range")
        if run.routes[mb][idx].stage != self.stage:
            raise ProtocolError(f"microbatch {mb} hop {idx} belongs to stage {run.routes[mb][idx].stage}, "
                                f"not to this peer's stage {self.stage}")
        return mb, idx

    @staticmethod
    def _check_sender(run: StepRun, peer, mb: int, idx: int) -> None:
        """Activations and gradients of a step are accepted only from the peer that this step's table
        lists for the sending hop: a retired peer (partitioned, replaced) is refused even if it holds the
        run token."""
        expect = run.peers.get(run.routes[mb][idx].stage)
        if str(peer) != expect:
            raise ProtocolError(f"peer {peer} does not serve stage {run.routes[mb][idx].stage} in step {run.step} "
                                f"attempt {run.attempt}")

    def _check_payload(self, header: dict, tensors: list, what: str) -> torch.Tensor:
        """What can be checked without the step, before waiting for it: a malformed message is
        refused at once with its actual fault (not after rpc_timeout as a 'missing step')."""
        self._check_run(header)
        require(header, step=int, attempt=int, mb=int, hop=int)
        return self._check_activation(tensors, what)

    async def _on_forward(self, header: dict, tensors: list, peer) -> tuple[dict, list]:
        x = self._check_payload(header, tensors, "activation")
        run = await self._current(header)
        mb, idx = self._check_hop(run, header)
        if idx > 0:
            self._check_sender(run, peer, mb, idx - 1)
        self._spawn(run, self._forward_task(run, mb, idx, x))
        return {"ok": True}, []

    async def _on_backward(self, header: dict, tensors: list, peer) -> tuple[dict, list]:
        g = self._check_payload(header, tensors, "gradient")
        run = await self._current(header)
        mb, idx = self._check_hop(run, header)
        if run.evaluate:
            raise ProtocolError("an evaluation has no backward pass")
        if idx + 1 < len(run.routes[mb]):
            self._check_sender(run, peer, mb, idx + 1)
        self._spawn(run, self._backward_task(run, mb, idx, g))
        return {"ok": True}, []

    async def _on_commit(self, header: dict, tensors: list, peer) -> tuple[dict, list]:
        self._check_run(header)
        require(header, step=int, attempt=int)
        self._check_coordinator(peer, RPC.COMMIT)
        run = await self._current(header)
        if not run.done.is_set() or run.error is not None or run.evaluate:
            raise ProtocolError(f"step {run.step} is not ready to commit ({run.error or 'still running'})")
        stats = await self.compute(self.worker.step, run.step)
        if not stats.skipped:
            self.omega = stats.omega(self.cfg.recovery)
        self.next_step = run.step + 1
        self.last_commit = {"step": run.step, "losses": {str(k): v for k, v in run.losses.items()},
                            "lr": stats.lr, "post": stats.grad_norm_post, "block_post": stats.block_grad_norm_post,
                            **run.figures()}
        self._set_run(None)
        return {"pre": stats.grad_norm_pre, "post": stats.grad_norm_post, "block_post": stats.block_grad_norm_post,
                "lr": stats.lr,
                "skipped": stats.skipped, "omega": self.omega, "stage": self.stage,
                "weights_finite": stats.weights_finite,
                "soft_errors": guard_counts([self.worker.guard])}, []

    async def _on_abort(self, header: dict, tensors: list, peer) -> tuple[dict, list]:
        self._check_run(header)
        self._check_coordinator(peer, RPC.ABORT)
        await self._drop_run("aborted by the coordinator")
        return {"ok": True}, []

    async def _drop_run(self, reason: str) -> None:
        """End the current step attempt here: its tasks, activations and gradients are dropped."""
        run = self.run_state
        if run is not None:
            run.fail(reason)
            for task in list(run.tasks):
                task.cancel()
        self._set_run(None)
        if self.worker is not None:
            await self.compute(self.worker.drop_inflight)

    async def _on_adopt(self, header: dict, tensors: list, peer) -> tuple[dict, list]:
        """A new coordinator takes over the run. Accepted only if it proves it holds the run
        secret (when there is one) and this peer's current coordinator no longer answers (no
        split brain: a live coordinator keeps its peers). An unfinished step is dropped; a
        finished one is kept so that the new coordinator can commit it if other stages
        already did. The reply is everything the coordinator needs to rebuild its state."""
        self._check_run(header)
        new, me = str(peer), str(self.transport.peer_id)
        if self.secret is not None and not verify(coordinator_proof(self.secret, self.opts.run_id, new, me),
                                                  header.get("proof")):
            raise ProtocolError(f"peer {new} is not authorized to coordinate this run (no valid coordinator proof)",
                                Kind.UNAUTHORIZED)
        old = self.coordinator
        if old is not None and old != new:
            try:
                await self.transport.call(old, RPC.STATUS, {"run": self.opts.run_id}, timeout=self.t.rpc_timeout)
            except (TransportError, asyncio.TimeoutError, OSError):
                pass  # gone: the takeover may proceed
            except RemoteError:  # it answers, if only with an error: alive
                raise ProtocolError(f"coordinator {old} of run {self.opts.run_id!r} is alive; takeover by {new} "
                                    "refused", Kind.COORDINATOR_ALIVE) from None
            else:
                raise ProtocolError(f"coordinator {old} of run {self.opts.run_id!r} is alive; takeover by {new} refused",
                                    Kind.COORDINATOR_ALIVE)
        run = self.run_state
        if run is not None and (not run.done.is_set() or run.error is not None or run.evaluate):
            await self._drop_run("dropped: the coordinator changed")
            run = None
        self.coordinator = new
        self._heard_from_coordinator()
        log.info("coordinator %s took over run %s (previous: %s)", new, self.opts.run_id, old)
        return {"stage": self.stage, "state": self.state.value, "next_step": self.next_step, "omega": self.omega,
                "token": join_token(self.secret, self.opts.run_id, me) if self.secret is not None else None,
                "config": self.cfg.to_json() if self.cfg is not None else None,
                "ready": None if run is None else {"step": run.step, "attempt": run.attempt,
                                                   "losses": {str(k): v for k, v in run.losses.items()},
                                                   **run.figures()},
                "finished": list(self._finished) if self._finished is not None else None,
                "last_commit": self.last_commit,
                "snapshots": {str(k): v[0] for k, v in self.snapshots.items()}}, []

    async def _on_ping(self, header: dict, tensors: list, peer) -> tuple[dict, list]:
        self._check_run(header)
        return {"stage": self.stage, "state": self.state.value}, []

    async def _on_shutdown(self, header: dict, tensors: list, peer) -> tuple[dict, list]:
        self._check_run(header)
        if self.coordinator is not None and str(peer) != self.coordinator:
            raise ProtocolError("only the run's coordinator may shut this peer down")
        # no leave announcement needed: the coordinator asked (and may ask again: a request delayed by a
        # partition and its retry both arrive once the partition heals; both are answered)
        reason = header.get("reason")
        run_ended = isinstance(reason, str) and reason.startswith("run ")
        if run_ended and self.finished:  # a retry of the same message (e.g. after a partition healed)
            return {"ok": True}, []
        if self.worker is not None and self.opts.dump_dir:
            await self.compute(self._dump_final)
        if run_ended:
            self.finished = True
            if self.opts.stay:
                print(f"run finished ({reason}); staying (--stay) until stopped", flush=True)
                return {"ok": True}, []
            print(f"run finished ({reason}); exiting", flush=True)
        else:
            log.info("told to shut down by the coordinator")
        self._told_to_stop = True
        asyncio.get_running_loop().call_later(0.1, self.stop.set)
        return {"ok": True}, []
