"""`checkfree local`: a whole swarm on this machine, with real processes and real SIGKILLs.

The launcher starts the coordinator and S + spares peers as separate OS processes (each in
its own process group, so a kill takes its DHT process and p2p daemon with it, like a
machine vanishing), kills peers with SIGKILL by the seeded schedule or the trace when the
coordinator reaches the failure's step, starts a replacement process after every kill,
shows live progress, and on exit or Ctrl-C tears everything down.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import secrets
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from checkfree.auth import SECRET_ENV
from checkfree.cli import (
    TIMEOUT_FLAGS,
    add_run_arguments,
    add_timeout_arguments,
    add_transport_arguments,
    config_from_args,
    timeouts_from_args,
    warn_if_overwriting,
)
from checkfree.failures import schedule_from_config, write_trace
from checkfree.progress import Progress
from checkfree.protocol import READY_COORDINATOR, READY_STANDBY
from checkfree.wan import WanEmulator
from scheduler.injector import parse_chaos_line
from scheduler.netlab import NetLab
from scheduler.processes import Proc, await_line, kill_group, spawn

__all__ = ["add_parser", "LocalSwarm", "SwarmOptions", "NetLab"]

STEP_LINE = re.compile(r"^step (\d+): loss ([-+\w.]+)(?:, val ([-+\w.]+))?.*peers (\d+)\+(\d+), failures (\d+), "
                       r"recoveries (\d+), fallbacks (\d+)")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("local", help="run a whole swarm (coordinator + peers) on this machine with injected churn",
                       description="Local swarm: coordinator and peers as separate processes on loopback; peers are "
                                   "SIGKILLed by --failure-rate/--trace and replaced by fresh processes.")
    add_run_arguments(p)
    p.add_argument("--spares", type=int, default=2, help="standby peers kept running (default 2)")
    p.add_argument("--no-churn", action="store_true",
                   help="a failure-free run. Without it, a run given no failures (no --trace, --failure-rate, "
                        "--hourly-failure-rate or --config) shows what the project is for: an intermediate stage "
                        "and then an edge stage (CheckFree+; another intermediate one otherwise) are SIGKILLed "
                        "and rebuilt, each recovery printed as one line")
    p.add_argument("--threads-per-peer", "--threads", type=int, default=1,
                   help="torch threads per peer process (default 1)")
    add_timeout_arguments(p, step_timeout=90.0, join_timeout=120.0)
    p.add_argument("--ready-timeout", type=float, default=120.0, help="seconds for a process to print its ready line")
    p.add_argument("--run-id", help="run name (default: derived from --out)")
    c = p.add_argument_group("testing and chaos (fault injection of the local swarm; not for production runs)")
    c.add_argument("--preempt-trace", metavar="FILE",
                   help="`step,stage` lines: SIGTERM (a preemption notice) these stages' peers at these steps")
    c.add_argument("--chaos-recovery-kills", default="", metavar="ITERS",
                   help="comma-separated iterations at which the chosen replacement is killed during its recovery")
    c.add_argument("--chaos-rebuild-kills", default="", metavar="ITERS",
                   help="comma-separated iterations at which the peer rebuilding a failed stage is SIGKILLed in the "
                        "middle of its rebuild (after its first weight pull); the next standby takes over")
    c.add_argument("--dump-recovery", metavar="DIR",
                   help="peers save the weights served and rebuilt in recoveries, and their final state")
    c.add_argument("--kill-coordinator-at", type=int, metavar="STEP",
                   help="SIGKILL the coordinator once it has finished step STEP-1 (coordinator failover test)")
    c.add_argument("--coordinator-failover", choices=("standby", "restart"), default="standby",
                   help="after --kill-coordinator-at: a hot standby coordinator started with the run takes over "
                        "(default), or a new coordinator is started with --takeover")
    c.add_argument("--kill-coordinator-in", choices=("step", "commit"), default="step",
                   help="where the coordinator dies: between steps (SIGKILL by the launcher), or half-way through "
                        "committing step STEP (it SIGKILLs itself after committing half of the stages)")
    add_transport_arguments(p, port=False)
    p.add_argument("--netns", action="store_true",
                   help="run every process in a network namespace of its own, wired to one bridge (needs root and "
                        "iproute2), so that --partition-trace can cut a peer's link")
    c.add_argument("--partition-trace", metavar="FILE",
                   help="`step,stage` lines: cut these stages' peers off the network (alive but unreachable) at these "
                        "steps; the link comes back one iteration later (needs --netns)")
    from scheduler.cli import add_chaos_slow_argument

    add_chaos_slow_argument(c)
    p.set_defaults(func=run_local)


@dataclass(kw_only=True)
class SwarmOptions:
    out: Path
    run_id: str
    spares: int = 2
    threads_per_peer: int = 1
    ready_timeout: float = 120.0
    progress: bool = True
    shared_flags: list[str] = field(default_factory=list)
    peer_flags: list[str] = field(default_factory=list)
    coordinator_flags: list[str] = field(default_factory=list)
    kill_coordinator_at: int | None = None
    failover: str = "standby"  # standby | restart
    kill_coordinator_in: str = "step"  # step | commit
    netns: bool = False  # every process in its own network namespace (NetLab)
    progress_lines: bool = True  # print each peer's start-up milestones










class LocalSwarm:
    """Processes of one local run; `run()` returns the coordinator's exit code."""

    def __init__(self, config_path: Path, chaos_path: Path, opts: SwarmOptions) -> None:
        self.config_path, self.chaos_path, self.opts = config_path, chaos_path, opts
        self.coordinator: Proc | None = None
        self.standby: Proc | None = None
        self.old_coordinators: list[Proc] = []
        self.peers: list[Proc] = []
        self.addr = ""
        self.secret = secrets.token_hex(16)  # every local swarm is authenticated
        self.kills = 0
        self.preempted = 0
        self.partitioned = 0
        self.lab = NetLab() if opts.netns else None
        (opts.out / "logs").mkdir(parents=True, exist_ok=True)
        self._n = 0

    def _spawn(self, name: str, args: list[str], stdin=subprocess.DEVNULL) -> Proc:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(self.opts.threads_per_peer),
               SECRET_ENV: self.secret}
        link, prefix = 0, []
        if self.lab is not None:  # its own namespace, listening on its address there (the last flag wins)
            link, prefix, addr = self.lab.add()
            args = [*args, "--host-maddrs", f"/ip4/{addr}/tcp/0"]
        return spawn(args, env, log=self.opts.out / "logs" / f"{name}.log", prefix=prefix, stdin=stdin, name=name,
                     link=link, announce=name.startswith("peer") and self.opts.progress_lines)

    def _await_ready(self, proc: Proc, prefix: str) -> str:
        return await_line(proc, prefix, self.opts.ready_timeout)

    def start_peer(self) -> Proc:
        """Start a peer process; it becomes a standby once it has joined (no waiting here)."""
        self._n += 1
        proc = self._spawn(f"peer{self._n}", ["peer", "--run-id", self.opts.run_id, "--initial-peers", self.addr,
                                              "--threads", str(self.opts.threads_per_peer), *self.opts.shared_flags,
                                              *self.opts.peer_flags])
        self.peers.append(proc)
        return proc

    def kill_peer(self, peer_id: str) -> None:
        """SIGKILL the peer's whole process group (its DHT process and p2pd too), then replace it."""
        proc = next((p for p in self.peers if p.peer_id == peer_id), None)
        if proc is None:
            print(f"swarm: asked to kill unknown peer {peer_id}", flush=True)
            return
        kill_group(proc, gone_within=0)
        self.peers.remove(proc)
        self.kills += 1
        self.start_peer()

    def preempt_peer(self, peer_id: str) -> None:
        """SIGTERM a peer (a spot preemption notice): it leaves by itself, handing its stage
        over if it can. A fresh spare is started in its place."""
        proc = next((p for p in self.peers if p.peer_id == peer_id), None)
        if proc is None:
            print(f"swarm: asked to preempt unknown peer {peer_id}", flush=True)
            return
        proc.popen.send_signal(signal.SIGTERM)
        self.preempted += 1
        self.start_peer()

    def _coordinator_args(self, *extra: str) -> list[str]:
        o = self.opts
        return ["scheduler", "--config", str(self.config_path), "--out", str(o.out), "--run-id", o.run_id,
                "--chaos-trace", str(self.chaos_path), "--shutdown-peers", *o.shared_flags, *o.coordinator_flags,
                *extra]

    def _spawn_coordinator(self, name: str, *extra: str) -> Proc:
        return self._spawn(name, self._coordinator_args(*extra),
                           stdin=subprocess.PIPE)  # the launcher acknowledges partitions on it

    def partition_peer(self, peer_id: str, heal: bool = False) -> None:
        """Cut a peer's link (it stays alive but unreachable) and start a spare in its place, then tell the
        coordinator (on its stdin) that the cut is in effect; or heal the link."""
        proc = next((p for p in self.peers if p.peer_id == peer_id), None)
        if proc is None or self.lab is None:
            print(f"swarm: cannot partition peer {peer_id} (unknown, or no --netns)", flush=True)
        elif heal:
            self.lab.heal(proc.link)
            state = "alive" if proc.popen.poll() is None else f"exited {proc.popen.returncode}"
            print(f"swarm: partition of peer {peer_id} healed (process {state})", flush=True)
        else:
            self.lab.cut(proc.link)
            self.partitioned += 1
            self.start_peer()
        if not heal:
            with contextlib.suppress(OSError):  # the coordinator waits for this line
                self.coordinator.popen.stdin.write("partitioned\n")
                self.coordinator.popen.stdin.flush()

    def run(self) -> int:
        o = self.opts
        extra = []
        if o.kill_coordinator_at is not None and o.kill_coordinator_in == "commit":
            extra = ["--chaos-die-in-commit", str(o.kill_coordinator_at)]
        self.coordinator = self._spawn_coordinator("coordinator", *extra)
        line = self._await_ready(self.coordinator, READY_COORDINATOR)
        self.addr = re.search(r"addrs=([^,\s]+)", line).group(1)
        if o.kill_coordinator_at is not None and o.failover == "standby":
            self.standby = self._spawn_coordinator("coordinator-standby", "--standby", "--initial-peers", self.addr)
            self._await_ready(self.standby, READY_STANDBY)
        cfg = json.loads(self.config_path.read_text())
        first = [self.start_peer() for _ in range(cfg["num_stages"] + o.spares)]
        for proc in first:  # all start in parallel; a peer that cannot start is an error (while the run is on)
            if (not proc.ready.wait(o.ready_timeout) or not proc.peer_id) and self.coordinator.popen.poll() is None:
                raise RuntimeError(f"a peer did not start within {o.ready_timeout:g} s; see {proc.log}")
        return self._follow(cfg["train"]["num_steps"])

    def _follow(self, num_steps: int) -> int:
        bar = Progress(num_steps, "swarm", enabled=self.opts.progress)
        try:
            while True:
                if (line := self.coordinator.lines.get()) is None:
                    if self.opts.kill_coordinator_at is not None and self.coordinator.popen.wait() == -signal.SIGKILL:
                        self.kill_coordinator()  # it died in its commit, as asked
                        continue
                    break
                if (self.opts.kill_coordinator_in == "step" and (m := STEP_LINE.match(line)) is not None
                        and int(m.group(1)) + 1 == self.opts.kill_coordinator_at):
                    self.kill_coordinator()
                if (chaos := parse_chaos_line(line)) is not None:
                    action, fields = chaos
                    if action == "kill":
                        self.kill_peer(fields["peer"])
                    elif action == "rebuild-kill":  # the replacement kills itself mid-rebuild
                        self.kills += 1
                        self.start_peer()
                    elif action == "term":
                        self.preempt_peer(fields["peer"])
                    elif action in ("partition", "heal"):
                        self.partition_peer(fields["peer"], heal=action == "heal")
                elif (m := STEP_LINE.match(line)) is not None:
                    bar.update(int(m.group(1)) + 1, loss=m.group(2), live=m.group(4), spare=m.group(5),
                               failures=m.group(6), recoveries=m.group(7))
                elif line.startswith("status:") or "Error" in line or "error" in line:
                    bar.write(line)
            return self.coordinator.popen.wait()
        finally:
            bar.close()

    def kill_coordinator(self) -> None:
        """SIGKILL the coordinator's process group; the standby takes over, or a new coordinator
        is started with --takeover, bootstrapping from live peers."""
        old = self.coordinator
        kill_group(old, gone_within=0)
        self.old_coordinators.append(old)
        self.opts.kill_coordinator_at = None
        live = [p.addrs for p in self.peers if p.addrs and p.popen.poll() is None]
        self.addr = live[0]  # later peers bootstrap from a live peer
        print(f"swarm: coordinator SIGKILLed; {self.opts.failover} coordinator takes over", flush=True)
        if self.standby is not None:
            self.coordinator, self.standby = self.standby, None
        else:
            self.coordinator = self._spawn_coordinator("coordinator-takeover", "--takeover", "--initial-peers",
                                                       *live[:2])

    def teardown(self) -> None:
        """Stop the coordinator first (SIGTERM: it records the run's end, saves if asked and tells the
        peers to exit), then SIGTERM whatever still runs, then SIGKILL whole process groups: all
        within about 13 s, whatever state the run was in."""
        coordinators = [p for p in [self.coordinator, self.standby, *self.old_coordinators] if p is not None]
        self._stop(coordinators, wait_s=8, group=False)  # its DHT and p2pd must outlive its goodbyes
        procs = [*coordinators, *self.peers]
        self._stop(procs, wait_s=4)
        deadline = time.monotonic() + 3.0
        for p in procs:  # the group may hold a DHT child or p2pd even after the leader exited: gone within 3 s
            kill_group(p, gone_within=max(0.0, deadline - time.monotonic()))
        if self.lab is not None:
            self.lab.close()
        # the p2pd of a SIGKILLed peer cannot remove its socket file: remove those nothing listens on any more
        from checkfree.net.lifeline import sweep_stale_sockets

        sweep_stale_sockets(min_age_s=1.0)

    @staticmethod
    def _stop(procs: list[Proc], wait_s: float, group: bool = True) -> None:
        """SIGTERM each process (or its whole group) and wait up to `wait_s` for all to exit."""
        for p in procs:
            if p.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    if group:
                        os.killpg(p.popen.pid, signal.SIGTERM)
                    else:
                        p.popen.terminate()
        deadline = time.monotonic() + wait_s
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.popen.wait(timeout=max(0.1, deadline - time.monotonic()))


def demo_trace(cfg, path: Path) -> Path | None:
    """The default run's scripted churn: stage 1 at 30% of the steps, then (CheckFree+) the first
    stage or (otherwise) the second-to-last at 60%: only stages the run's strategy recovers. None
    (and a note) when it recovers none of them, e.g. plain CheckFree on two stages."""
    from checkfree.strategies import build_strategy

    n, s = cfg.train.num_steps, cfg.num_stages
    strategy = build_strategy(cfg)
    recoverable = list(range(s)) if strategy.fails_edges else list(range(1, s - 1))
    if not recoverable or n < 3:
        print(f"swarm: no demo churn ({strategy.name} on {s} stages recovers "
              f"{'no stage' if not recoverable else 'nothing in fewer than 3 steps'}); a failure-free run",
              flush=True)
        return None
    first = 1 if 1 in recoverable else recoverable[0]
    others = [st for st in recoverable if st != first]
    second = (0 if 0 in others else others[-1]) if others else first
    steps = (max(1, n * 3 // 10), max(2, n * 6 // 10))
    write_trace(path, [(steps[0], first), (steps[1], second)])
    print(f"swarm: demo churn (--no-churn for a failure-free run): stage {first} SIGKILLed at step {steps[0]}, "
          f"stage {second} at step {steps[1]}", flush=True)
    return path


def run_local(args: argparse.Namespace) -> int:
    from checkfree.cli import interrupt_on_signals
    from checkfree.net.transport import TransportError, check_transport

    interrupt_on_signals()
    try:
        check_transport(args.transport)  # before any process starts
    except TransportError as e:
        raise ValueError(str(e)) from e
    if args.spares < 0:
        raise ValueError(f"--spares must be >= 0, got {args.spares}")
    if args.threads_per_peer < 1:
        raise ValueError(f"--threads-per-peer must be >= 1, got {args.threads_per_peer}")
    cfg = config_from_args(args)
    out = Path(args.out)
    warn_if_overwriting(args)
    out.mkdir(parents=True, exist_ok=True)
    if not (args.no_churn or args.config or args.trace or args.failure_rate is not None
            or args.hourly_failure_rate is not None):
        trace = demo_trace(cfg, out / "demo_trace.csv")
        if trace is not None:
            cfg.failures.trace = str(trace)
    from checkfree.data import build_data
    from checkfree.strategies import build_strategy

    print("preparing data (tokenizer and token cache shared by all peers)...", flush=True)
    build_data(cfg.data, vocab_size=cfg.model.vocab_size, context_length=cfg.model.context_length,
               seed=cfg.train.seed, microbatch_size=cfg.train.microbatch_size)
    if args.kill_coordinator_at is not None and not 1 <= args.kill_coordinator_at < cfg.train.num_steps:
        raise ValueError(f"--kill-coordinator-at must be a step in 1..{cfg.train.num_steps - 1}, "
                         f"got {args.kill_coordinator_at}")
    config_path = out / "swarm_config.json"
    config_path.write_text(cfg.to_json())
    sched = schedule_from_config(cfg.failures, cfg.num_stages, cfg.train.num_steps, build_strategy(cfg).fails_edges)
    chaos_path = out / "chaos_trace.csv"
    write_trace(chaos_path, sched.events)
    if args.write_trace:
        write_trace(args.write_trace, sched.events)
    timeouts_from_args(args)  # validate the hierarchy before any process starts
    flags = [x for name in TIMEOUT_FLAGS for x in ("--" + name.replace("_", "-"), str(getattr(args, name)))]
    flags += ["--transport", args.transport]
    if args.partition_trace and not args.netns:
        raise ValueError("--partition-trace needs --netns (a partition cuts a peer's link in its network namespace)")
    if args.netns and (why := NetLab.unavailable()):
        raise ValueError(f"--netns: {why}")
    from scheduler.cli import parse_slow

    parse_slow(args.chaos_slow, cfg.num_stages)  # refuse a bad spec before any process starts
    run_id = args.run_id or f"local-{abs(hash(str(out.resolve()))) % 10**8}-{os.getpid()}"
    swarm = LocalSwarm(config_path, chaos_path, SwarmOptions(
        out=out, run_id=run_id, spares=args.spares, threads_per_peer=args.threads_per_peer,
        ready_timeout=args.ready_timeout, progress=not args.no_progress, shared_flags=flags,
        peer_flags=["--dump-recovery", args.dump_recovery] if args.dump_recovery else [],
        netns=args.netns,
        coordinator_flags=["--save-every", str(args.save_every), "--keep-saves", str(args.keep_saves)]
        + (["--tensorboard"] if args.tensorboard else [])
        + (["--resume", str(out)] if args.resume else [])
        + (["--preempt-trace", args.preempt_trace] if args.preempt_trace else [])
        + (["--chaos-recovery-kills", args.chaos_recovery_kills] if args.chaos_recovery_kills else [])
        + (["--chaos-rebuild-kills", args.chaos_rebuild_kills] if args.chaos_rebuild_kills else [])
        + (["--partition-trace", args.partition_trace] if args.partition_trace else [])
        + [x for spec in args.chaos_slow for x in ("--chaos-slow", spec)],
        kill_coordinator_at=args.kill_coordinator_at, failover=args.coordinator_failover,
        kill_coordinator_in=args.kill_coordinator_in))
    print(f"swarm: {cfg.num_stages} stages + {args.spares} spares, {len(sched.events)} scheduled failures, "
          f"transport {args.transport}, logs in {out / 'logs'}", flush=True)
    if cfg.train.wan:
        for line in WanEmulator(cfg).describe():
            print(f"swarm: emulated WAN {cfg.train.wan}: {line}", flush=True)
    try:
        return swarm.run()
    finally:
        swarm.teardown()
        summary = out / "summary.json"
        if summary.exists():
            print(summary.read_text())
        print(f"swarm: {swarm.kills} peers SIGKILLed, {swarm.preempted} SIGTERMed, {swarm.partitioned} partitioned; "
              f"run directory {out}", flush=True)
