"""The coordinator: owns a distributed run.

It holds the config, admits peers (JOIN), assigns stages (waiting peers fill empty stages,
the rest wait as standbys), drives each step (RUN_STEP on every stage peer, then COMMIT
once all are ready), detects failures (expired DHT heartbeats, failure reports from peers
whose call to a neighbour failed, failed pings, stragglers that ran over step_timeout), retires
failed peers that may still be running (a healed partition), orders recoveries (which standby rebuilds
which stage from which live neighbours), and writes the same run directory as the
simulator. A step interrupted by a failure is aborted (partial gradients dropped) and run
again after recovery; nothing is committed until every stage is ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from checkfree.auth import coordinator_proof, join_token, load_secret, record_ok, verify
from checkfree.config import RunConfig, config_from_dict
from checkfree.data import DataError, build_tokenizer, save_run_tokenizer
from checkfree.export import save_export
from checkfree.failures import FailureSchedule
from checkfree.model import plan_stages
from checkfree.pipeline import route
from checkfree.net.transport import (RemoteError, TransportError, announce, dht_maddrs, live_members_async,
                                     rpc_note, start_transport, stop_transport)
from checkfree.protocol import (READY_COORDINATOR, READY_STANDBY, RPC, RUN_OVER, Kind, ProtocolError, Timeouts, coordinator_from_records, coordinator_key,
                                coordinator_record, members_key, plan_to_wire, require)
from checkfree.recovery import RECOVERY_RULES, UnrecoverableFailure, plan_recovery
from checkfree.rundir import RunWriter, read_jsonl
from checkfree.saves import newest_save, read_save, write_save
from checkfree.strategies.averaging import recovery_fields
from checkfree.softerrors import ESCALATE_AFTER_SKIPS

__all__ = ["CoordinatorOptions", "Coordinator"]

log = logging.getLogger(__name__)
CALL_ERRORS = (TransportError, RemoteError, asyncio.TimeoutError, OSError)
ROLLBACK_STRATEGIES = ("checkpoint", "gemini")  # rollback strategies that run for real in the swarm


class Rollback(Exception):
    """Every stage was rolled back; training resumes at `step`."""

    def __init__(self, step: int) -> None:
        super().__init__(f"rolled back to step {step}")
        self.step = step
EVAL_ATTEMPT = 10_000
STEP_FIGURES = ("bytes_sent", "inflight_peak", "activation_peak_bytes", "peak_rss_bytes")  # a peer's, per step


def _step_figures(by_stage: dict[int, dict], num_stages: int) -> dict:
    """A step record's figures from its stages' replies: the tensor bytes sent (summed) and, per stage
    (None: not reported), the most microbatches whose activations it held at once, their bytes, and
    its peer process's peak resident memory so far."""
    per_stage = {k: [by_stage.get(s, {}).get(k) for s in range(num_stages)] for k in STEP_FIGURES[1:]}
    return {"wire_bytes": sum(int(r.get("bytes_sent", 0)) for r in by_stage.values()), **per_stage}


@dataclass(kw_only=True)
class CoordinatorOptions:
    run_id: str = "checkfree"
    out: str = "runs/latest"
    initial_peers: list[str] = field(default_factory=list)
    host_maddrs: list[str] = field(default_factory=lambda: ["/ip4/127.0.0.1/tcp/0"])
    announce_maddrs: list[str] | None = None
    identity_path: str | None = None
    startup_timeout: float = 30.0
    transport: str = "hivemind"  # RPC transport: hivemind (p2pd) or libp2p (py-libp2p); every peer must use the same
    libp2p_port: int = 0  # --transport libp2p: TCP port of the libp2p listener (0: any free port)
    tcp_port: int = 0  # --transport tcp: port of the TCP RPC listener (0: any free port)
    timeouts: Timeouts = field(default_factory=Timeouts)
    chaos: FailureSchedule | None = None  # local swarm: ask the launcher to SIGKILL these (step, stage)
    preempt: FailureSchedule | None = None  # local swarm: ask the launcher to SIGTERM these (preemption notices)
    chaos_recovery_kills: frozenset[int] = frozenset()  # local swarm: at these iterations, kill the chosen replacement
    chaos_rebuild_kills: frozenset[int] = frozenset()  # ...or have it SIGKILL itself after its first weight pull
    partition: FailureSchedule | None = None  # local swarm (--netns): cut these (step, stage) peers off the network
    slow: dict[int, tuple[float, int]] = field(default_factory=dict)  # diagnostic: stage -> (s per compute, from step)
    shutdown_peers: bool = True  # tell peers the run ended (they exit unless started with --stay)
    max_attempts: int = 5  # attempts of one step before the run gives up
    save_final: bool = True  # gather every stage into final_weights.safetensors at the end
    secret_file: str | None = None  # run secret (else $CHECKFREE_SECRET; neither: an open swarm)
    takeover: bool = False  # take over a running run whose coordinator is gone (state from the DHT and peers)
    standby: bool = False  # watch the run's coordinator; take over when it stops answering
    die_in_commit: int | None = None  # local swarm chaos: SIGKILL own process group half-way through this commit
    save_every: int = 0  # gather every stage's full state into <out>/saves every N steps (0: never)
    keep_saves: int = 2
    resume: bool = False  # continue the run in `out` from its newest save
    tensorboard: bool = False  # also write metrics as TensorBoard scalars into <out>/tensorboard


@dataclass
class Member:
    peer_id: str
    joined: float
    stage: int = -1
    leaving: bool = False
    handover: bool = False  # leaving gracefully, waiting to hand its exact state to a standby
    observer: bool = False  # joined to read (export), never assigned a stage


class CoordinatorAlive(RuntimeError):
    """A takeover was refused: the run's coordinator still answers its peers."""


class Coordinator:
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
        if cfg is not None:
            self._configure(cfg)
        elif not (opts.takeover or opts.standby):
            raise ValueError("a coordinator needs a config unless it takes over a running run")

    def _configure(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        opts = self.opts
        from checkfree.strategies import build_strategy

        name = cfg.recovery.strategy
        if name not in RECOVERY_RULES and name not in ROLLBACK_STRATEGIES:
            raise ValueError(f"strategy {name!r} runs in the simulator only; the distributed runtime supports "
                             f"{sorted(RECOVERY_RULES)} and {list(ROLLBACK_STRATEGIES)}")
        self.strategy = build_strategy(cfg)
        self.plus = self.strategy.plus
        self.snap_step = 0  # gemini: step of the last complete in-memory snapshot
        self.snap_holders: dict[int, list[str]] = {}  # stage -> peers holding its snapshot
        self.ckpt_step = 0  # checkpoint (or gemini's storage fallback): last complete checkpoint
        self.storage_dir = str(Path(cfg.strategy.storage_dir or Path(opts.out) / "checkpoints").resolve())
        self._chaos_done: set[int] = set()
        self._recovery_killed: set[int] = set()
        self.norms = [0.0] * cfg.num_stages
        self.soft_skips: dict[int, int] = {}  # stage -> consecutive attempts lost to soft errors
        self.soft_counts: dict[str, dict] = {}  # peer -> its guard's counters (dead peers' kept)
        plan_stages(cfg.model.num_layers, cfg.num_stages)

    # ---- peer-facing handlers ----------------------------------------------------------
    def _check_run(self, header: dict) -> None:
        require(header, run=str)
        if header["run"] != self.opts.run_id:
            raise ProtocolError(f"request for run {header['run']!r}; this coordinator runs {self.opts.run_id!r}")

    async def _on_join(self, header: dict, tensors: list, peer) -> tuple[dict, list]:
        self._check_run(header)
        require(header, peer_id=str)
        if self.over is not None:
            raise ProtocolError(f"{RUN_OVER}: run {self.opts.run_id!r} has ended ({self.over}); nothing to join",
                                Kind.RUN_OVER)
        if self.cfg is None:
            raise ProtocolError("this coordinator is taking over the run; retry in a moment", Kind.TAKING_OVER)
        pid = str(peer)
        if header["peer_id"] != pid:
            raise ProtocolError(f"peer {pid} tried to join as {header['peer_id']}")
        if self.secret is not None and not verify(join_token(self.secret, self.opts.run_id, pid), header.get("token")):
            self._event("join_refused", peer_id=pid, reason="bad or missing token")
            raise ProtocolError(f"peer {pid} is not authorized: missing or wrong run token (start it with the run's "
                                "secret: --secret-file or $CHECKFREE_SECRET)", Kind.UNAUTHORIZED)
        if pid in self.members:
            raise ProtocolError(f"peer {pid} has already joined run {self.opts.run_id!r} (duplicate join refused)")
        observer = header.get("role") == "observer"
        self.members[pid] = Member(pid, time.time(), observer=observer)
        self.member_event.set()
        self._event("join", peer_id=pid, observer=observer)
        reply = {"config": self.cfg.to_json(), "status": "standby"}
        if self.secret is not None:
            reply["proof"] = coordinator_proof(self.secret, self.opts.run_id, str(self.transport.peer_id), pid)
        return reply, []

    async def _on_report(self, header: dict, tensors: list, peer) -> tuple[dict, list]:
        self._check_run(header)
        require(header, stage=int, peer_id=str, reason=str)
        reporter = self.members.get(str(peer))
        if reporter is None:
            raise ProtocolError(f"unknown peer {peer}: reports are accepted from members only")
        if reporter.leaving and reporter.stage < 0:  # e.g. a partitioned peer's report arriving after it was replaced
            raise ProtocolError(f"peer {peer} was retired from the run: its report is ignored")
        if self.stage_peer.get(header["stage"]) == header["peer_id"]:
            self.reported.add(header["peer_id"])
            log.info("peer %s reports stage %d unreachable: %s", peer, header["stage"], header["reason"][:200])
        return {"ok": True}, []

    async def _on_leave(self, header: dict, tensors: list, peer) -> tuple[dict, list]:
        self._check_run(header)
        m = self.members.get(str(peer))
        if m is None:
            raise ProtocolError(f"unknown peer {peer}")
        m.leaving = True
        m.handover = m.stage >= 0 and bool(self._standbys())
        self._event("leave", peer_id=m.peer_id, stage=m.stage, handover=m.handover)
        return {"ok": True, "handover": m.handover}, []

    async def _on_status(self, header: dict, tensors: list, peer) -> tuple[dict, list]:
        self._check_run(header)
        if self.secret is not None and str(peer) not in self.members and not verify(
                join_token(self.secret, self.opts.run_id, str(peer)), header.get("token")):
            raise ProtocolError(f"unknown peer {peer}: status is for members only")
        if self.cfg is None:
            raise ProtocolError("this coordinator is not running the run (standby or taking over)")
        return {"step": self.step, "stages": {str(s): p for s, p in self.stage_peer.items()},
                "standby": self._standbys(), "config": self.cfg.to_json()}, []

    # ---- helpers -----------------------------------------------------------------------
    def _event(self, event: str, **fields) -> None:
        if self.writer is not None:
            self.writer.event(event, **fields)

    def _standbys(self) -> list[str]:
        return [m.peer_id for m in sorted(self.members.values(), key=lambda m: m.joined)
                if m.stage < 0 and not m.leaving and not m.observer and m.peer_id not in self.reported]

    async def _call(self, pid: str, name: str, header: dict, timeout: float, tensors=()):
        return await self.transport.call(pid, name, {"run": self.opts.run_id, **header}, tensors, timeout=timeout)

    async def _alive(self, pid: str) -> bool:
        try:
            await self._call(pid, RPC.PING, {}, timeout=min(5.0, self.t.rpc_timeout))
            return True
        except CALL_ERRORS:
            return False

    def _status(self, text: str) -> None:
        print(f"status: {text}", flush=True)

    # ---- membership and assignment -----------------------------------------------------
    async def _take_standby(self, why: str) -> str:
        """The oldest live standby; waits (visibly, bounded by join_timeout) if there is none."""
        start = time.monotonic()
        deadline = start + self.t.join_timeout
        while True:
            for pid in self._standbys():
                if await self._alive(pid):
                    return pid
                self.reported.add(pid)
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no standby peer joined within join_timeout={self.t.join_timeout:g} s ({why}); "
                                   "start more peers with `checkfree peer --initial-peers ...`")
            if time.monotonic() - start > 2.0:
                self._status(f"waiting for a peer to {why} ({len(self.stage_peer)}/{self.cfg.num_stages} stages "
                             f"served, {left:.0f} s left)")
            self.member_event.clear()
            try:
                await asyncio.wait_for(self.member_event.wait(), min(left, 2.0 if time.monotonic() - start < 2 else 10.0))
            except asyncio.TimeoutError:
                pass

    async def _assign(self, stage: int, pid: str, header: dict, timeout: float | None = None, tensors=()) -> dict:
        """Give `stage` to `pid` (bounded by step_timeout unless told otherwise). A peer whose
        assignment fails is passed over and, in case it is merely slow and goes on to host the stage
        anyway, retired."""
        try:
            reply, _ = await self._call(pid, RPC.ASSIGN, {"stage": stage, **header},
                                        timeout=timeout or self.t.step_timeout, tensors=tensors)
        except CALL_ERRORS:
            self.reported.add(pid)
            self.members[pid].leaving = True
            raise
        self.members[pid].stage = stage
        self.stage_peer[stage] = pid
        return reply

    async def _fill_initial(self, saved: dict[int, bytes] | None = None) -> None:
        """Give every stage to a standby, all at once (each peer builds its stage in parallel):
        fresh, or (resuming) loaded from the saved states. A failed assignment is retried with
        another standby."""
        while missing := [s for s in range(self.cfg.num_stages) if s not in self.stage_peer]:
            first = await self._take_standby(f"serve stage {missing[0]}")
            pids = [first, *[p for p in self._standbys() if p != first][:len(missing) - 1]]
            await asyncio.gather(*(self._assign_initial(s, pid, saved) for s, pid in zip(missing, pids)))

    async def _assign_initial(self, stage: int, pid: str, saved: dict[int, bytes] | None) -> None:
        mode, step = ("fresh", 0) if saved is None else ("load", self.step)
        tensors = () if saved is None else [torch.frombuffer(bytearray(saved[stage]), dtype=torch.uint8)]
        try:  # a peer starting up may take long to build its first stage: part of joining
            reply = await self._assign(stage, pid, {"mode": mode, "step": step, **self._slow_header(stage)},
                                       timeout=self.t.join_timeout, tensors=tensors)
        except CALL_ERRORS as e:
            log.warning("assigning stage %d to %s failed: %s", stage, pid, e)
            return
        self.norms[stage] = float(reply.get("omega", 0.0))
        self._event("assign", step=step, stage=stage, peer_id=pid, mode=mode)

    async def _save(self, step: int) -> bool:
        """Gather every stage's full state, ready to run `step`, and write it to <out>/saves in a
        thread (training goes on meanwhile; the previous save is awaited first). False: a stage
        could not give its state at that step (nothing is written)."""
        replies = await asyncio.gather(*(self._call(self.stage_peer[s], RPC.GET_STATE, {"step": step},
                                                    timeout=self.t.step_timeout)
                                         for s in range(self.cfg.num_stages)), return_exceptions=True)
        bad = [s for s, r in enumerate(replies) if isinstance(r, BaseException) or r[0].get("next_step") != step]
        if bad:
            log.warning("save at step %d skipped: stage(s) %s not at that step or unreachable", step, bad)
            return False
        blobs = {s: r[1][0].numpy().tobytes() for s, r in enumerate(replies)}
        if self._saving is not None:
            await self._saving
        meta = {"iteration": self.iteration, "run_id": self.opts.run_id}
        self._saving = asyncio.create_task(asyncio.to_thread(write_save, self.opts.out, step, blobs, meta,
                                                             self.opts.keep_saves))
        self._event("save", step=step, bytes=sum(len(b) for b in blobs.values()))
        return True

    def _resume_point(self) -> dict[int, bytes]:
        """--resume: the newest save's states; training continues at its step."""
        path = newest_save(self.opts.out)
        if path is None:
            raise FileNotFoundError(f"--resume: {self.opts.out} has no complete save (run with --save-every N)")
        meta, blobs = read_save(path, self.cfg.num_stages)
        self.step = self.iteration = int(meta["step"])
        return blobs

    def _slow_header(self, stage: int) -> dict:
        """Diagnostic (local swarm, --chaos-slow): the first peer of `stage` computes slowly."""
        if stage not in self.opts.slow:
            return {}
        delay, start = self.opts.slow[stage]
        return {"inject_delay": [delay, start]}

    async def _detect(self) -> set[int]:
        """Stages whose peer is gone: expired heartbeat, a report confirmed by a failed ping, or a leave."""
        try:
            live = await self._heartbeats()
        except Exception as e:  # the DHT read is advisory: pings decide
            log.warning("reading heartbeats failed: %r", e)
            live = None
        failed = set()
        for stage, pid in list(self.stage_peer.items()):
            m = self.members[pid]
            if m.handover and await self._handover(stage, pid):
                continue
            suspect = m.leaving or pid in self.reported or (live is not None and pid not in live)
            if suspect and (m.leaving or not await self._alive(pid)):
                failed.add(stage)
            elif suspect:
                self.reported.discard(pid)  # a false report (e.g. from a partitioned neighbour): it answers
        back = live is not None and any(p in live for p in self._unretired())
        if back and (self._retire_task is None or self._retire_task.done()):
            self._retire_task = asyncio.create_task(self._retire())  # a retired peer is back: tell it again
        # a stage nobody serves (its peer died while no coordinator was there to see it)
        return failed | (set(range(self.cfg.num_stages)) - set(self.stage_peer))

    async def _heartbeats(self) -> dict[str, dict]:
        """Peers with a live DHT heartbeat (with a run secret: only records a member signed)."""
        found = await live_members_async(self.dht, members_key(self.opts.run_id)) or {}
        return {p: v for p, v in found.items() if record_ok(self.secret, self.opts.run_id, "member", p, v)}

    def _unretired(self) -> list[str]:
        return [p for p, m in self.members.items() if m.leaving and m.stage < 0 and p not in self._retired]

    async def _retire(self) -> None:
        """Tell failed peers to shut down: a failed peer may still be running (broken weights, soft
        errors, a straggler, a partition). One that cannot be reached now is told again when its
        heartbeat reappears (a healed partition: see _detect) and when the run ends."""
        pids = self._unretired()
        results = await asyncio.gather(*(self._call(p, RPC.SHUTDOWN, {}, timeout=2.0) for p in pids),
                                       return_exceptions=True)
        for pid, r in zip(pids, results):
            if not isinstance(r, Exception) and pid not in self._retired:
                self._retired.add(pid)
                self._event("retired", step=self.step, peer_id=pid)

    async def _handover(self, stage: int, pid: str) -> bool:
        """A peer leaving gracefully hands its exact state (weights and optimizer) to a standby:
        no recovery, nothing lost. False: it could not be done; the stage is then recovered."""
        self.members[pid].handover = False
        standbys = self._standbys()
        if not standbys:
            return False
        new = standbys[0]
        t0 = time.perf_counter()
        try:
            reply, _ = await self._call(new, RPC.ASSIGN, {"stage": stage, "mode": "handover", "source": pid,
                                                       "step": self.step}, timeout=self.t.step_timeout)
        except CALL_ERRORS as e:
            log.warning("handover of stage %d from %s to %s failed: %s", stage, pid, new, e)
            self.reported.add(new)
            return False
        self.members[new].stage, self.stage_peer[stage] = stage, new
        self.members[pid].stage = -1
        self.norms[stage] = float(reply.get("omega", self.norms[stage]))
        self._event("handover", step=self.step, stage=stage, strategy=self.cfg.recovery.strategy, source_peer=pid,
                    peer_id=new, bytes=reply.get("bytes", 0), handover_s=round(time.perf_counter() - t0, 6))
        (done,) = await asyncio.gather(self._call(pid, RPC.SHUTDOWN, {}, timeout=5.0), return_exceptions=True)
        if not isinstance(done, Exception):
            self._retired.add(pid)
        return True

    # ---- recovery ---------------------------------------------------------------------
    async def _recover(self, step: int, failed: set[int]) -> None:
        strategy = self.cfg.recovery.strategy
        detected = time.time()
        for s in sorted(failed):
            pid = self.stage_peer.pop(s, None)
            if pid is not None:
                self.members[pid].stage = -1
                self.members[pid].leaving = True
            self._event("failure", step=step, stage=s, strategy=strategy, peer_id=pid)
        await self._retire()
        if strategy in ROLLBACK_STRATEGIES:
            await self._rollback(step, failed)
        try:
            plans = plan_recovery(failed, self.cfg.num_stages, strategy, self.cfg.recovery.fallback)
        except UnrecoverableFailure as e:
            self._event("fallback", step=step, stage=min(failed), strategy=strategy, fallback="abort", reason=str(e))
            raise
        for plan in plans:
            sources = {str(s): self.stage_peer[s] for s in (*plan.sources, *plan.edge_sources.values())}
            pid, reply, t0 = await self._assign_replacement(
                step, plan.stage, {"mode": "recover", "plan": plan_to_wire(plan), "sources": sources, "step": step},
                chaos=True)
            self.norms[plan.stage] = 0.0
            fields = recovery_fields(plan, dict(zip(plan.sources, reply.get("coefficients", []))),
                                     self.cfg.recovery.omega_scope)
            fields.update(peer_id=pid, norms=reply.get("norms", []), transfer_s=reply.get("transfer_s"),
                          rebuild_s=reply.get("rebuild_s"), bytes=reply.get("bytes"),
                          recovery_time_s=round(time.perf_counter() - t0, 6),
                          since_detection_s=round(time.time() - detected, 6))
            kind = "fallback" if plan.fallback else "recovery"
            extra = {"fallback": plan.fallback, "reason": plan.reason} if plan.fallback else {}
            self._event(kind, step=step, stage=plan.stage, strategy=strategy, **extra, **fields)
            coeffs = "/".join(f"{c:.2f}" for c in fields["coefficients"])
            edges = "".join(f", {c} copied from stage {h}" for c, h in plan.edge_sources.items())
            self._status(f"stage {plan.stage} {kind}: {plan.method} of stage(s) "
                         f"{', '.join(map(str, plan.sources)) or '-'}" + (f" (coefficients {coeffs})" if coeffs else "")
                         + f"{edges} on peer {pid[-8:]}, {fields['recovery_time_s']:.2f} s")

    async def _assign_replacement(self, step: int, stage: int, header: dict,
                                  chaos: bool = False) -> tuple[str, dict, float]:
        """Give `stage` to a standby; a standby that dies while taking it over is reported and the
        next one is tried. Returns (peer, reply, time the successful assignment started)."""
        while True:
            pid = await self._take_standby(f"replace stage {stage}")
            extra = {}
            if chaos:
                await self._chaos_replacement(pid, stage)
                extra = self._chaos_rebuild(pid, stage)
            t0 = time.perf_counter()
            try:
                return pid, await self._assign(stage, pid, {**header, **extra}), t0
            except CALL_ERRORS as e:
                log.warning("replacement %s died while taking over stage %d: %s", pid, stage, e)
                self._event("recovery_retry", step=step, stage=stage, peer_id=pid, reason=str(e)[:300])

    # ---- rollback strategies (checkpoint, gemini): real snapshots in peers' memory / files
    async def _protect(self, step: int) -> None:
        """After committing `step`: take the strategy's snapshot / checkpoint when due. A
        snapshot counts only once every stage has completed it; the previous one is kept until then."""
        st, name, nxt = self.cfg.strategy, self.cfg.recovery.strategy, step + 1
        if name == "gemini" and nxt % st.snapshot_every == 0:
            from checkfree.strategies.gemini import placement

            holders = {s: [self.stage_peer[h] for h in hs]
                       for s, hs in enumerate(placement(self.cfg.num_stages, st.gemini_replicas))}
            if await self._snapshot_all(nxt, lambda s: {"holders": holders[s]}):
                self.snap_step, self.snap_holders = nxt, holders
        if (name == "checkpoint" or st.storage_fallback) and nxt % st.checkpoint_every == 0:
            if await self._snapshot_all(nxt, lambda s: {"storage": self.storage_dir}):
                self.ckpt_step = nxt

    async def _snapshot_all(self, step: int, extra) -> bool:
        t0 = time.perf_counter()
        calls = [self._call(p, RPC.SNAPSHOT, {"step": step, **extra(s)}, self.t.step_timeout)
                 for s, p in sorted(self.stage_peer.items())]
        results = await asyncio.gather(*calls, return_exceptions=True)
        errors = [r for r in results if isinstance(r, Exception)]
        kind = "storage" if "storage" in extra(0) else "memory"
        self._event("snapshot", step=step, kind=kind, complete=not errors, seconds=round(time.perf_counter() - t0, 6),
                    bytes=sum(r[0]["bytes"] for r in results if not isinstance(r, Exception)),
                    sent=sum(r[0].get("sent", 0) for r in results if not isinstance(r, Exception)))
        return not errors

    async def _rollback(self, step: int, failed: set[int]) -> None:
        """Roll every stage back to the last complete snapshot; replacements fetch the lost
        stages' copies from a live holder (gemini) or from storage (checkpoint)."""
        name, strategy = self.cfg.recovery.strategy, self.cfg.recovery.strategy
        live = set(self.stage_peer.values())
        source: dict[int, dict] = {}
        target = self.ckpt_step if name == "checkpoint" else self.snap_step
        if name == "gemini":
            lost = [s for s in failed if self.snap_step and not any(h in live for h in self.snap_holders.get(s, []))]
            if lost and self.cfg.strategy.storage_fallback:
                name, target = "checkpoint", self.ckpt_step  # a whole group is gone: fall back to storage
                self._event("fallback", step=step, stage=min(lost), strategy=strategy, fallback="checkpoint",
                            reason=f"every holder of stage(s) {sorted(lost)} failed")
            elif lost:
                reason = f"every holder of stage(s) {sorted(lost)} failed and no storage fallback is configured"
                self._event("fallback", step=step, stage=min(lost), strategy=strategy, fallback="abort", reason=reason)
                raise UnrecoverableFailure(reason)
        for s in range(self.cfg.num_stages):
            if target == 0:
                source[s] = {"source": "init"}
            elif name == "checkpoint":
                source[s] = {"storage": self.storage_dir}
            elif s in failed:
                source[s] = {"source": next(h for h in self.snap_holders[s] if h in live)}
            else:
                source[s] = {"source": self.stage_peer[s]}
        t0 = time.perf_counter()
        await asyncio.gather(*(self._call(p, RPC.RESTORE, {"step": target, **source[s]}, self.t.step_timeout)
                               for s, p in self.stage_peer.items()))
        for s in sorted(failed):
            pid, reply, _ = await self._assign_replacement(step, s, {"mode": "restore", "step": target, **source[s]})
            self.norms[s] = float(reply.get("omega", 0.0))
            self._event("recovery", step=step, stage=s, strategy=strategy, method="rollback", rollback_to=target,
                        lost_steps=step - target, source=source[s].get("source", "storage"), peer_id=pid,
                        bytes=reply.get("bytes", 0), recovery_time_s=round(time.perf_counter() - t0, 6))
        raise Rollback(target)

    # ---- steps ------------------------------------------------------------------------
    async def _all(self, name: str, header: dict, timeout: float) -> dict[int, dict | Exception]:
        stages = sorted(self.stage_peer)
        results = await asyncio.gather(*(self._call(self.stage_peer[s], name, header, timeout) for s in stages),
                                       return_exceptions=True)
        return {s: (r if isinstance(r, Exception) else r[0]) for s, r in zip(stages, results)}

    def _route_table(self, step: int, evaluate: bool) -> list[list[int]]:
        """Stage order of every microbatch of the step, CheckFree+ swaps included (announced so
        that peers can check they agree; evaluation runs the plain route)."""
        s, m = self.cfg.num_stages, self.cfg.train.num_microbatches
        if evaluate:
            return [list(range(s))] * self.cfg.train.eval_batches
        return [[h.stage for h in route(s, self.plus, step, mb, m)] for mb in range(m)]

    async def _attempt(self, step: int, attempt: int, evaluate: bool) -> dict[int, dict] | None:
        """One attempt: RUN_STEP on every stage; the first error aborts the attempt everywhere."""
        header = {"step": step, "attempt": attempt, "evaluate": evaluate,
                  "peers": {str(s): p for s, p in self.stage_peer.items()}, "routes": self._route_table(step, evaluate)}
        tasks = {s: asyncio.create_task(self._call(p, RPC.RUN_STEP, header, self.t.step_timeout + self.t.rpc_timeout))
                 for s, p in self.stage_peer.items()}
        done, pending = await asyncio.wait(tasks.values(), return_when=asyncio.FIRST_EXCEPTION)
        errors = {s: t.exception() for s, t in tasks.items() if t in done and t.exception() is not None}
        if not errors:
            return {s: t.result()[0] for s, t in tasks.items()}
        if pending and any(getattr(e, "kind", None) in (Kind.STEP_TIMEOUT, Kind.STRAGGLER) for e in errors.values()):
            # every peer's step deadline passes at about the same time: hear them all before aborting,
            # since only the straggler itself can tell that its own computing filled the step
            _, pending = await asyncio.wait(pending, timeout=self.t.rpc_timeout)
            errors = {s: t.exception() for s, t in tasks.items() if t.done() and t.exception() is not None}
        await self._all(RPC.ABORT, {}, self.t.rpc_timeout)  # makes the others' RUN_STEP return at once
        if pending:  # (asyncio.wait refuses an empty set: every call may have failed at once)
            await asyncio.wait(pending, timeout=self.t.rpc_timeout)
        for t in pending:
            t.cancel()
        log.warning("step %d attempt %d failed: %s", step, attempt,
                    "; ".join(f"stage {s}: {str(e)[:200]}" for s, e in errors.items()))
        for s, e in errors.items():
            if not isinstance(e, RemoteError):  # the peer itself did not answer
                self.reported.add(self.stage_peer[s])
            elif e.kind == Kind.SOFT_ERROR:
                self._soft_error(step, s)
            elif e.kind == Kind.STRAGGLER:  # slower than step_timeout: treated as failed, recovered before the retry
                pid = self.stage_peer[s]
                self._event("straggler", step=step, stage=s, peer_id=pid, reason=e.remote_message[:300])
                self.members[pid].leaving = True
        return None

    def _soft_error(self, step: int, stage: int) -> None:
        """An uncorrectable soft error survived the peer's recompute: the attempt is redone;
        a stage that keeps producing them is treated as failed and recovered."""
        self.soft_skips[stage] = self.soft_skips.get(stage, 0) + 1
        self._event("soft_error_skip", step=step, stage=stage, strategy=self.cfg.recovery.strategy)
        if self.soft_skips[stage] >= ESCALATE_AFTER_SKIPS:
            self.soft_skips[stage] = 0
            self._event("soft_error_escalation", step=step, stage=stage, strategy=self.cfg.recovery.strategy)
            self.members[self.stage_peer[stage]].leaving = True

    async def _run_step(self, step: int, evaluate: bool = False) -> dict[int, dict]:
        """Run a step (or an evaluation) to completion: recover failed stages, abort and retry
        an interrupted attempt. Evaluation attempts are numbered from EVAL_ATTEMPT so their
        messages never mix with the training step's."""
        base = EVAL_ATTEMPT if evaluate else self._attempt_floor.get(step, 0)
        for attempt in range(base, base + self.opts.max_attempts):
            failed = await self._detect()
            if failed:
                await self._recover(step, failed)
            results = await self._attempt(step, attempt, evaluate)
            if results is not None:
                self._last_attempt = attempt
                return results
            self._event("aborted_step", step=step, attempt=attempt, evaluate=evaluate)
        raise RuntimeError(f"step {step} failed {self.opts.max_attempts} times without a detectable peer failure; "
                           "check the peers' logs (slow peers: raise --step-timeout)")

    async def _commit(self, step: int) -> dict[int, dict]:
        if step == self.opts.die_in_commit:  # chaos: half of the stages commit, then this coordinator is gone
            half = sorted(self.stage_peer)[: self.cfg.num_stages // 2]
            await asyncio.gather(*(self._call(self.stage_peer[s], RPC.COMMIT, {"step": step,
                                                                             "attempt": self._last_attempt},
                                              self.t.rpc_timeout) for s in half))
            print(f"CHAOS coordinator dies in the commit of step {step} (stages {half} committed)", flush=True)
            os.killpg(os.getpgid(0), signal.SIGKILL)
        results = await self._all(RPC.COMMIT, {"step": step, "attempt": self._last_attempt}, self.t.rpc_timeout)
        for s, r in results.items():
            if isinstance(r, Exception):  # dies between ready and commit: its replacement rebuilds next step
                self.reported.add(self.stage_peer[s])
        return results

    async def _chaos_replacement(self, pid: str, stage: int) -> None:
        """Local swarm chaos: kill the peer just chosen to rebuild `stage` (a failure during recovery)."""
        if self.iteration not in self.opts.chaos_recovery_kills or self.iteration in self._recovery_killed:
            return
        self._recovery_killed.add(self.iteration)
        print(f"CHAOS kill step={self.iteration} stage={stage} peer={pid} during-recovery", flush=True)
        await self._wait_dead(pid)

    def _chaos_rebuild(self, pid: str, stage: int) -> dict:
        """Local swarm chaos (--chaos-rebuild-kills): the replacement dies (SIGKILL) in the middle of
        its rebuild, after its first weight pull; the next standby must rebuild from the live sources."""
        if self.iteration not in self.opts.chaos_rebuild_kills or self.iteration in self._recovery_killed:
            return {}
        self._recovery_killed.add(self.iteration)
        print(f"CHAOS rebuild-kill step={self.iteration} stage={stage} peer={pid}", flush=True)
        return {"chaos_die_after_pulls": 1}

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
        while await self._alive(pid) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    def _scheduled(self, schedule: FailureSchedule | None, step: int) -> list[tuple[int, str]]:
        """(stage, peer) of the stages `schedule` names at `step` that have a peer."""
        stages = sorted(schedule.at(step)) if schedule else []
        return [(s, self.stage_peer[s]) for s in stages if s in self.stage_peer]

    async def _chaos(self, step: int) -> None:
        """Local swarm only: ask the launcher to SIGKILL, SIGTERM or cut off the network (--netns) the
        scheduled stages' peers, then wait until that is in effect, so that the failure lands at the
        start of this step. `step` is the iteration (executed steps, re-runs included), as in the
        simulator. A partition is healed at the next iteration, once its stage has been recovered."""
        if step in self._chaos_done:  # each scheduled failure fires once, even if the iteration is retried
            return
        self._chaos_done.add(step)
        for pid in self._partitioned:
            print(f"CHAOS heal step={step} peer={pid}", flush=True)
            self._event("chaos_heal", step=step, peer_id=pid)
        self._partitioned.clear()
        for stage, pid in self._scheduled(self.opts.partition, step):
            print(f"CHAOS partition step={step} stage={stage} peer={pid}", flush=True)
            self._event("chaos_partition", step=step, stage=stage, peer_id=pid)
            await self._launcher_ack()  # the link is cut now; detecting it is left to timeouts and heartbeats
            self._partitioned.append(pid)
        for stage, pid in self._scheduled(self.opts.chaos, step):
            print(f"CHAOS kill step={step} stage={stage} peer={pid}", flush=True)
            self._event("chaos_kill", step=step, stage=stage, peer_id=pid)
            await self._wait_dead(pid)
            self.reported.add(pid)
        for stage, pid in self._scheduled(self.opts.preempt, step):
            print(f"CHAOS term step={step} stage={stage} peer={pid}", flush=True)
            deadline = time.monotonic() + self.t.rpc_timeout
            while not self.members[pid].leaving and time.monotonic() < deadline:
                await asyncio.sleep(0.05)  # the preempted peer announces its leave

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
            commits = await self._commit(step)
            self.iteration += 1
            attempts = self._last_attempt + 1
            loss = sum(float(v) for r in results.values() for v in r["losses"].values())
            post = [commits[s].get("post", math.nan) if isinstance(commits[s], dict) else math.nan
                    for s in range(cfg.num_stages)]
            self.soft_skips.clear()
            for s, r in commits.items():
                if isinstance(r, dict):
                    self.norms[s] = float(r["omega"])
                    self.soft_counts[self.stage_peer[s]] = r.get("soft_errors", {})
                    if not r.get("weights_finite", True):  # numeric guard: a broken stage is a failed stage
                        self._event("nonfinite_weights", step=step, stage=s, peer_id=self.stage_peer[s])
                        self.members[self.stage_peer[s]].leaving = True
                    if r.get("skipped"):
                        self._event("skipped_step", step=step, stage=s, reason="non-finite gradient")
            lr = next((r["lr"] for r in commits.values() if isinstance(r, dict)), math.nan)
            block_post = [commits[s].get("block_post", math.nan) if isinstance(commits[s], dict) else math.nan
                          for s in range(cfg.num_stages)]
            record = {"step": step, "loss": loss, "lr": lr, "grad_norms": post, "block_grad_norms": block_post,
                      "step_time_s": round(time.perf_counter() - t0, 6), "attempts": attempts,
                      "live_peers": len(self.stage_peer), **_step_figures(results, cfg.num_stages)}
            await self._protect(step)
            if (cfg.train.eval_every and (step + 1) % cfg.train.eval_every == 0) or step == cfg.train.num_steps - 1:
                try:
                    ev = await self._run_step(step, evaluate=True)
                except Rollback as r:
                    writer.metric(record)
                    step = r.step
                    continue
                losses = [float(v) for r in ev.values() for v in r["losses"].values()]
                record["val_loss"] = last_val = sum(losses) / len(losses)
            writer.metric(record)
            if self.opts.save_every and (step + 1) % self.opts.save_every == 0 and step + 1 < cfg.train.num_steps:
                await self._save(step + 1)
            c = writer.counts
            val = f", val {last_val:.4f}" if "val_loss" in record else ""
            print(f"step {step}: loss {loss:.4f}{val}, {record['step_time_s'] * 1000:.0f} ms, peers "
                  f"{len(self.stage_peer)}+{len(self._standbys())}, failures {c['failures']}, recoveries "
                  f"{c['recoveries']}, fallbacks {c['fallbacks']}", flush=True)
            step += 1

    def _keep_tokenizer(self) -> None:
        """The run directory keeps its tokenizer (tokenizer.json) when this machine can build it."""
        try:
            tok = build_tokenizer(self.cfg.data, self.cfg.model.vocab_size)
        except DataError as e:
            log.warning("the run directory gets no tokenizer.json: %s", e)
            return
        save_run_tokenizer(tok, self.opts.out)

    async def _gather_final(self) -> None:
        states = {}
        for s in range(self.cfg.num_stages):
            reply, tensors = await self._call(self.stage_peer[s], RPC.GET_WEIGHTS, {"part": "all"},
                                              timeout=self.t.step_timeout)
            states[s] = dict(zip(reply["keys"], tensors))
        save_export(self.cfg, states, Path(self.opts.out) / "final_weights.safetensors")

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
        announcer = None
        loop, task = asyncio.get_running_loop(), asyncio.current_task()
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):  # a graceful stop: save, record, tell peers
            loop.add_signal_handler(sig, task.cancel)
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
            print(f"{READY_COORDINATOR} peer_id={pid} run={self.opts.run_id} addrs={addrs}", flush=True)
            if not (self.opts.takeover or self.opts.standby):
                await self._fill_initial(saved)
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
                summary = self.writer.summary(status, error, run_id=self.opts.run_id, soft_errors=soft)
                self.writer.close()
            if announcer is not None:
                announcer.cancel()
            if self.opts.shutdown_peers and self.cfg is not None:
                await self._retire()  # failed peers that came back since (a healed partition)
                await self._shutdown_peers(f"run {status}")
            await stop_transport(self.dht, self.transport)
        return summary

    # ---- coordinator failover ---------------------------------------------------------
    async def _watch(self) -> None:
        """Standby: poll the run's coordinator (found in the DHT) every heartbeat_ttl/2;
        return once it has failed to answer twice in a row."""
        key, watched, misses = coordinator_key(self.opts.run_id), None, 0
        deadline = time.monotonic() + self.t.join_timeout
        while True:
            try:
                found = await live_members_async(self.dht, key) or {}
            except Exception as e:  # the DHT read is advisory: the STATUS call decides
                log.debug("DHT lookup of the coordinator failed: %r", e)
                found = {}
            current = coordinator_from_records(found, self.secret, self.opts.run_id, self.transport.kind,
                                               exclude=str(self.transport.peer_id))
            if current is not None and current != watched:
                watched, misses = current, 0
                print(f"standby: watching coordinator {watched}", flush=True)
            if watched is None:
                if time.monotonic() > deadline:
                    raise TransportError(f"no coordinator of run {self.opts.run_id!r} found in the DHT within "
                                         f"join_timeout={self.t.join_timeout:g} s: nothing to stand by for")
            else:
                try:
                    await self._call(watched, RPC.STATUS, {}, timeout=min(5.0, self.t.rpc_timeout))
                    misses = 0
                except CALL_ERRORS as e:
                    misses += 1
                    log.info("coordinator %s did not answer (%d): %s", watched, misses, e)
                if misses >= 2:
                    print(f"standby: coordinator {watched} stopped answering; taking over", flush=True)
                    return
            await asyncio.sleep(self.t.heartbeat_ttl / 2)

    async def _take_over(self) -> None:
        """Rebuild the run's state from its peers (found by their DHT heartbeats) and continue
        from the step they are at. Peers report their stage, the step their weights are ready
        for, their norm, and a finished but uncommitted step: if the old coordinator died
        half-way through a commit, the stages it did not reach commit now, so every stage
        is at the same step; an unfinished step is dropped and run again. A stage nobody
        serves is recovered by the run's strategy like any failure."""
        while True:
            t0 = time.perf_counter()
            try:
                replies = await self._adopt_peers()
                break
            except CoordinatorAlive as e:
                if not self.opts.standby:
                    raise
                print(f"standby: {e}; standing by again", flush=True)
                await self._watch()
        configs = {r["config"] for r in replies.values() if r.get("config")}
        if len(configs) != 1:
            raise RuntimeError(f"cannot take over run {self.opts.run_id!r}: its peers report "
                               f"{'no' if not configs else 'different'} run configs")
        cfg = config_from_dict(json.loads(configs.pop()))
        self._configure(cfg)
        metrics = Path(self.opts.out) / "metrics.jsonl"
        resume = metrics.exists()
        # the same run directory: keep counting (and the run's clock) where the old coordinator stopped
        self.writer = RunWriter(self.opts.out, cfg.to_json(), resume=resume, tokens_per_step=cfg.tokens_per_step,
                                tensorboard=self.opts.tensorboard)
        holders: dict[int, list[tuple[str, dict]]] = {}
        for i, (pid, r) in enumerate(replies.items()):
            self.members[pid] = Member(pid, time.time() + i * 1e-6)
            if r["stage"] >= 0:
                holders.setdefault(r["stage"], []).append((pid, r))
        step = max((r["next_step"] for hs in holders.values() for _, r in hs), default=0)
        to_commit: dict[int, tuple[str, dict]] = {}
        lagging = []
        for stage, hs in sorted(holders.items()):
            hs.sort(key=lambda x: -x[1]["next_step"])
            for pid, _ in hs[1:]:  # two peers claim one stage (a handover was cut short): keep the newest
                self.members[pid].leaving = True
            pid, r = hs[0]
            self.members[pid].stage, self.stage_peer[stage] = stage, pid
            self.norms[stage] = float(r["omega"])
            ready = r.get("ready")
            if r["next_step"] == step:
                continue
            if r["next_step"] == step - 1 and ready and ready["step"] == step - 1:
                to_commit[stage] = (pid, ready)
            else:  # its weights are behind the others: a failed stage
                lagging.append(stage)
                self.members[pid].leaving = True
        commits = await asyncio.gather(*(self._call(pid, RPC.COMMIT, {"step": ready["step"], "attempt": ready["attempt"]},
                                                    self.t.rpc_timeout) for pid, ready in to_commit.values()),
                                       return_exceptions=True)
        for (stage, (pid, _)), c in zip(to_commit.items(), commits):
            if isinstance(c, Exception):
                lagging.append(stage)
                self.members[pid].leaving = True
            else:
                self.norms[stage] = float(c[0]["omega"])
                replies[pid]["last_commit"] = {"step": step - 1, "losses": to_commit[stage][1]["losses"],
                                               "lr": c[0]["lr"], "post": c[0]["post"],
                                               **{k: v for k, v in to_commit[stage][1].items() if k in STEP_FIGURES}}
        await self._all(RPC.ABORT, {}, self.t.rpc_timeout)  # drop finished-but-uncommitted work of `step`
        seen = [r["finished"] for r in replies.values() if r.get("finished")]  # [step, attempt]
        seen += [[r["ready"]["step"], r["ready"]["attempt"]] for r in replies.values() if r.get("ready")]
        # the re-run of `step` must not reuse an attempt number its peers saw (they refuse stale attempts)
        self._attempt_floor[step] = max((a for st, a in seen if st == step and a < EVAL_ATTEMPT), default=-1) + 1
        self.step = self.iteration = step
        self._rebuild_protection(replies)
        recorded = self._record_missing_step(step - 1, replies, metrics if resume else None)
        self._event("coordinator_takeover", step=step, peers=len(replies), stages=len(self.stage_peer),
                    committed_stages=sorted(to_commit), lagging_stages=sorted(lagging),
                    missing_stages=sorted(set(range(cfg.num_stages)) - set(self.stage_peer)),
                    recorded_step=recorded, takeover_s=round(time.perf_counter() - t0, 6))
        print(f"status: took over run {self.opts.run_id!r} at step {step}: {len(self.stage_peer)}/{cfg.num_stages} "
              f"stages served, {len(self._standbys())} standby, {len(to_commit)} commits completed, "
              f"{len(lagging)} lagging stage(s)", flush=True)

    async def _adopt_peers(self) -> dict[str, dict]:
        """ADOPT every peer with a live heartbeat until every stage is served (or two heartbeat
        TTLs pass with at least one stage served; bounded by join_timeout)."""
        start = time.monotonic()
        replies: dict[str, dict] = {}
        refused: dict[str, str] = {}
        me = str(self.transport.peer_id)
        while True:
            try:
                live = await self._heartbeats()
            except Exception as e:
                log.warning("reading heartbeats failed: %r", e)
                live = {}
            new = [p for p in live if p not in replies and p != me]

            async def adopt(p: str):
                header = {}
                if self.secret is not None:
                    header["proof"] = coordinator_proof(self.secret, self.opts.run_id, me, p)
                return await self._call(p, RPC.ADOPT, header, timeout=self.t.rpc_timeout)

            for p, r in zip(new, await asyncio.gather(*(adopt(p) for p in new), return_exceptions=True)):
                if isinstance(r, RemoteError) and r.kind == Kind.COORDINATOR_ALIVE:
                    refused[p] = str(r)
                elif isinstance(r, Exception):
                    continue
                elif self.secret is None or verify(join_token(self.secret, self.opts.run_id, p), r[0].get("token")):
                    replies[p] = r[0]
                else:  # a stranger answering for a forged heartbeat must not hand us a stage
                    self._event("join_refused", peer_id=p, reason="ADOPT reply without a valid run token")
            if refused and not replies:
                raise CoordinatorAlive(next(iter(refused.values())))
            served = {r["stage"] for r in replies.values() if r.get("stage", -1) >= 0}
            cfg = next((r["config"] for r in replies.values() if r.get("config")), None)
            stages = json.loads(cfg)["num_stages"] if cfg else None
            waited = time.monotonic() - start
            if stages is not None and (len(served) >= stages or (served and waited > 2 * self.t.heartbeat_ttl)):
                return replies
            if waited > self.t.join_timeout:
                raise TransportError(f"no peer of run {self.opts.run_id!r} answered within join_timeout="
                                     f"{self.t.join_timeout:g} s: nothing to take over")
            await asyncio.sleep(0.2)

    def _rebuild_protection(self, replies: dict[str, dict]) -> None:
        """Rollback strategies after a takeover: the newest snapshot every stage has a live
        holder of (gemini, in peers' memory) and the newest complete checkpoint in storage."""
        by_step: dict[int, dict[int, list[str]]] = {}
        for pid, r in replies.items():
            for stage, st in (r.get("snapshots") or {}).items():
                by_step.setdefault(int(st), {}).setdefault(int(stage), []).append(pid)
        full = [st for st, hs in by_step.items() if len(hs) == self.cfg.num_stages]
        if full:
            self.snap_step = max(full)
            self.snap_holders = by_step[self.snap_step]
        steps: dict[int, set[int]] = {}
        for f in Path(self.storage_dir).glob("stage*-step*.pt"):
            stage, _, st = f.stem[len("stage"):].partition("-step")
            if stage.isdigit() and st.isdigit():
                steps.setdefault(int(st), set()).add(int(stage))
        complete = [st for st, ss in steps.items() if len(ss) == self.cfg.num_stages and st <= self.step]
        self.ckpt_step = max(complete, default=0)

    def _record_missing_step(self, step: int, replies: dict[str, dict], metrics: Path | None) -> bool:
        """The step the old coordinator committed but did not record (it died in between):
        its record is rebuilt from the peers' last commits when every stage has one."""
        if step < 0 or (metrics is not None and any(m.get("step") == step for m in read_jsonl(metrics))):
            return False
        last = {r["stage"]: r["last_commit"] for r in replies.values()
                if r.get("stage", -1) >= 0 and (r.get("last_commit") or {}).get("step") == step}
        if len(last) != self.cfg.num_stages:
            return False
        self.writer.metric({"step": step, "loss": sum(float(v) for c in last.values() for v in c["losses"].values()),
                            "lr": next(iter(last.values()))["lr"], "attempts": None,
                            "grad_norms": [last[s]["post"] for s in range(self.cfg.num_stages)],
                            "block_grad_norms": [last[s].get("block_post") for s in range(self.cfg.num_stages)],
                            "live_peers": len(self.stage_peer), "recorded_by": "takeover",
                            **_step_figures(last, self.cfg.num_stages)})
        return True

    async def _announce(self, pid: str) -> None:
        while True:
            try:
                await announce(self.dht, coordinator_key(self.opts.run_id), "main",
                               coordinator_record(self.secret, self.opts.run_id, pid, self.transport.kind,
                                                  ttl=self.t.heartbeat_ttl * 3),
                               ttl=self.t.heartbeat_ttl * 3)
            except Exception as e:
                log.warning("announcing the coordinator failed: %r", e)
            await asyncio.sleep(self.t.heartbeat_ttl)

    async def _shutdown_peers(self, reason: str) -> None:
        live = [m.peer_id for m in self.members.values() if not m.leaving and not m.observer]
        await asyncio.gather(*(self._call(p, RPC.SHUTDOWN, {"reason": reason}, timeout=5.0) for p in live),
                             return_exceptions=True)
