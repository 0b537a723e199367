"""`checkfree local`: a whole swarm on this machine, with real processes and real SIGKILLs.

The launcher starts the coordinator and S + spares peers as separate OS processes (each in
its own process group, so a kill takes its DHT process and p2p daemon with it, like a
machine vanishing), kills peers with SIGKILL by the seeded schedule or the trace when the
coordinator reaches the failure's step, starts a replacement process after every kill,
shows live progress, and on exit or Ctrl-C tears everything down.

This module is the command (its flags, the demo churn, checks before any process starts); the processes
themselves are swarm/launcher.py's `LocalSwarm`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path

from checkfree.flags import (
    TIMEOUT_FLAGS,
    add_run_arguments,
    add_timeout_arguments,
    add_transport_arguments,
    config_from_args,
    timeouts_from_args,
    warn_if_overwriting,
)
from checkfree.failures import schedule_from_config, write_trace
from checkfree.wan import WanEmulator
from checkfree.stage_groups import check_swarm_groups
from swarm.launcher import LocalSwarm, SwarmOptions
from swarm.netlab import NetLab

__all__ = ["add_parser", "run_local", "demo_trace", "LocalSwarm", "SwarmOptions", "NetLab"]


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
    d = p.add_mutually_exclusive_group()
    d.add_argument("--dashboard", default="127.0.0.1:0", metavar="HOST:PORT",
                   help="where the coordinator serves its live dashboard, /status and /metrics (default: a free port "
                        "on 127.0.0.1; the address is printed). A non-loopback HOST needs $CHECKFREE_SECRET, the "
                        "bearer token its clients send")
    d.add_argument("--no-dashboard", action="store_true", help="serve no dashboard")
    c = p.add_argument_group("testing and chaos (fault injection of the local swarm; not for production runs)")
    c.add_argument("--crash-trace", metavar="FILE",
                   help="`step,stage` lines: SIGKILL only these stages' training processes at these steps (a process "
                        "crash; their other processes, e.g. reft's snapshot companion, live on)")
    c.add_argument("--reduce-kill-trace", metavar="FILE",
                   help="`step,stage` lines (stage groups): one replica of the stage SIGKILLs itself (its process group) "
                        "half-way through that step's gradient all-reduce")
    c.add_argument("--preempt-trace", metavar="FILE",
                   help="`step,stage` lines: SIGTERM (a preemption notice) these stages' peers at these steps")
    c.add_argument("--chaos-recovery-kills", default="", metavar="ITERS",
                   help="comma-separated iterations at which the chosen replacement is killed during its recovery")
    c.add_argument("--chaos-rebuild-kills", default="", metavar="ITERS",
                   help="comma-separated iterations at which the peer rebuilding a failed stage is SIGKILLed in the "
                        "middle of its rebuild (after its first weight pull); the next standby takes over")
    c.add_argument("--chaos-joins", default="", metavar="ITERS",
                   help="comma-separated iterations at which one more peer is started (a standby joining mid-run)")
    c.add_argument("--dump-recovery", metavar="DIR",
                   help="peers save the weights served and rebuilt in recoveries, and their final state")
    c.add_argument("--kill-coordinator-at", type=int, metavar="STEP",
                   help="SIGKILL the coordinator once it has finished step STEP-1, before anything of step STEP "
                        "(coordinator failover test)")
    c.add_argument("--coordinator-failover", choices=("standby", "restart"), default="standby",
                   help="after --kill-coordinator-at: a hot standby coordinator started with the run takes over "
                        "(default), or a new coordinator is started with --takeover")
    c.add_argument("--kill-coordinator-in", choices=("step", "commit", "faults"), default="step",
                   help="where the coordinator dies: between steps (SIGKILL by the launcher), half-way through "
                        "committing step STEP (it SIGKILLs itself after committing half of the stages), or once the "
                        "faults of step STEP's iteration have fired, before it saw them (the peers it killed die "
                        "with it)")
    c.add_argument("--standby-out", metavar="DIR",
                   help="with --coordinator-failover standby: the standby coordinator's own run directory (no "
                        "shared disk): it gets the run's config, record and membership from the coordinator over "
                        "the network, and the run's record goes on there once it has taken over")
    add_transport_arguments(p, port=False)
    p.add_argument("--netns", action="store_true",
                   help="run every process in a network namespace of its own, wired to one bridge (needs root and "
                        "iproute2), so that --partition-trace can cut a peer's link")
    p.add_argument("--hosts", action="store_true",
                   help="put every process on an emulated machine of its own: a network namespace with its own "
                        "address on a public segment, or (--nat-peers) behind a NAT router namespace of its own "
                        "(iptables MASQUERADE, nothing in); with --wan, each host's link is shaped (tc tbf) to the "
                        "profile's slowest link. A SIGKILL of a peer is then the loss of its whole host: every "
                        "process on it at once. Needs root, iproute2 and iptables")
    p.add_argument("--nat-peers", type=int, default=0, metavar="N",
                   help="with --hosts: N peers sit behind NAT (reached through the coordinator's relay unless "
                        "--no-relay); they are started first and the others once they have joined, so that they "
                        "serve stages; replacements are public")
    p.add_argument("--no-relay", action="store_true",
                   help="relays off for every process: a peer behind NAT cannot take part (it exits with one line "
                        "saying so)")
    c.add_argument("--partition-trace", metavar="FILE",
                   help="`step,stage` lines: cut these stages' peers off the network (alive but unreachable) at these "
                        "steps; the link comes back one iteration later (needs --netns)")
    from coordinator.scheduler_cli import add_chaos_slow_argument, add_peer_kill_argument

    add_chaos_slow_argument(c)
    add_peer_kill_argument(c)
    p.set_defaults(func=run_local)


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
    what = "a replica of stage" if cfg.train.replicas > 1 else "stage"  # (stage groups: lost mid-step, rerouted)
    print(f"swarm: demo churn (--no-churn for a failure-free run): {what} {first} SIGKILLed at step {steps[0]}, "
          f"{what} {second} at step {steps[1]}", flush=True)
    return path


def _peer_faults(args: argparse.Namespace, cfg, failures: list) -> bool:
    """Whether the run's faults arm peers (a peer dies or slows down by its own fault hook): its peers are then
    started with --fault-hook, the hook's control channel (checkfree.peer_faults); else with none."""
    replica_kills = cfg.train.replicas > 1 and bool(failures)  # (a stage group's replica dies after a forward)
    return bool(replica_kills or args.reduce_kill_trace or args.chaos_rebuild_kills or args.chaos_slow
                or args.chaos_peer_kill)


def run_local(args: argparse.Namespace) -> int:
    from checkfree.flags import interrupt_on_signals
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
    if not args.skip_memory_check:  # every process of the swarm on this machine
        from checkfree.memory import PROCESS_BYTES, StageMemory, check_fits, swarm_memory

        peers = [swarm_memory(cfg, s) for s in range(cfg.num_stages) for _ in range(cfg.train.replicas)]
        total = sum(peers, StageMemory(process=(args.spares + 1) * PROCESS_BYTES))  # + standbys, coordinator
        from checkfree.worker import resolve_device

        what = (f"this swarm ({len(peers)} peers, up to {max(p.total for p in peers) / 2**30:.1f} GiB each, "
                f"+ {args.spares} spares and the coordinator)")
        device = resolve_device(cfg.train.device)
        # on a GPU every peer's weights, Adam state and activations share its free memory; the processes, the host's
        check_fits(total, what, device)
        if device.type == "cuda":
            check_fits(StageMemory(process=total.process), what)
    check_swarm_groups(cfg)  # stage groups with a strategy that keeps one peer per stage: before anything is written
    timeouts_from_args(args)  # the timeout hierarchy, too
    from checkfree.auth import load_secret
    from ops.dashboard import check_bind, parse_bind

    secret = load_secret()  # $CHECKFREE_SECRET (checked now) is the swarm's secret if set; else a random one
    if not args.no_dashboard:  # a non-loopback dashboard needs a secret the user knows: $CHECKFREE_SECRET
        check_bind(parse_bind(args.dashboard), secret)
    dashboard = [] if args.no_dashboard else ["--dashboard", args.dashboard]
    out = Path(args.out)
    warn_if_overwriting(args)
    out.mkdir(parents=True, exist_ok=True)
    if not (args.no_churn or args.config or args.trace or args.failure_rate is not None
            or args.hourly_failure_rate is not None):
        trace = demo_trace(cfg, out / "demo_trace.csv")
        if trace is not None:
            cfg = dataclasses.replace(cfg, failures=dataclasses.replace(cfg.failures, trace=str(trace)))
    from checkfree.data import build_data
    from checkfree.strategies import build_strategy

    print("preparing data (tokenizer and token cache shared by all peers)...", flush=True)
    build_data(cfg.data, vocab_size=cfg.model.vocab_size, context_length=cfg.seq_len,
               seed=cfg.train.seed, microbatch_size=cfg.train.microbatch_size)
    if args.kill_coordinator_at is not None and not 1 <= args.kill_coordinator_at < cfg.train.num_steps:
        raise ValueError(f"--kill-coordinator-at must be a step in 1..{cfg.train.num_steps - 1}, "
                         f"got {args.kill_coordinator_at}")
    if args.standby_out and (args.kill_coordinator_at is None or args.coordinator_failover != "standby"):
        raise ValueError("--standby-out needs --kill-coordinator-at with --coordinator-failover standby")
    if args.standby_out and Path(args.standby_out).resolve() == out.resolve():
        raise ValueError("--standby-out must be a directory of its own, not the run directory --out")
    config_path = out / "swarm_config.json"
    config_path.write_text(cfg.to_json())
    sched = schedule_from_config(cfg.failures, cfg.num_stages, cfg.train.num_steps, build_strategy(cfg).fails_edges)
    chaos_path = out / "chaos_trace.csv"
    write_trace(chaos_path, sched.events, sched.whole)
    if args.write_trace:
        write_trace(args.write_trace, sched.events, sched.whole)
    flags = [x for name in TIMEOUT_FLAGS for x in ("--" + name.replace("_", "-"), str(getattr(args, name)))]
    flags += ["--transport", args.transport]
    if args.partition_trace and not args.netns:
        raise ValueError("--partition-trace needs --netns (a partition cuts a peer's link in its network namespace)")
    if args.netns and (why := NetLab.unavailable()):
        raise ValueError(f"--netns: {why}")
    if args.nat_peers and not args.hosts:
        raise ValueError("--nat-peers needs --hosts (a peer behind NAT sits on an emulated host)")
    if args.nat_peers < 0:
        raise ValueError(f"--nat-peers must be >= 0, got {args.nat_peers}")
    if args.hosts and (why := NetLab.nat_unavailable() if args.nat_peers else NetLab.unavailable()):
        raise ValueError(f"--hosts: {why}")
    if args.hosts and args.transport != "hivemind" and args.nat_peers:
        raise ValueError("--nat-peers: only --transport hivemind reaches peers behind NAT (through a relay)")
    if args.no_relay:
        flags.append("--no-relay")
    host_rate = None
    if args.hosts and cfg.train.wan:
        from checkfree.costmodel import get_profile

        bw = get_profile(cfg.train.wan).bandwidth_Bps
        host_rate = min(x for i, row in enumerate(bw) for j, x in enumerate(row) if i != j)
    from coordinator.scheduler_cli import parse_slow
    from faults.injector import parse_peer_kill

    parse_slow(args.chaos_slow, cfg.num_stages)  # refuse a bad spec before any process starts
    for spec in args.chaos_peer_kill:
        parse_peer_kill(spec, cfg.num_stages)
    run_id = args.run_id or f"local-{abs(hash(str(out.resolve()))) % 10**8}-{os.getpid()}"
    swarm = LocalSwarm(config_path, chaos_path, SwarmOptions(
        out=out, run_id=run_id, spares=args.spares, threads_per_peer=args.threads_per_peer,
        ready_timeout=args.ready_timeout, progress=not args.no_progress, shared_flags=flags,
        peer_flags=(["--dump-recovery", args.dump_recovery] if args.dump_recovery else [])
        + (["--fault-hook"] if _peer_faults(args, cfg, sched.events) else []),
        netns=args.netns, hosts=args.hosts, nat_peers=args.nat_peers, host_rate_Bps=host_rate,
        coordinator_flags=["--save-every", str(args.save_every), "--keep-saves", str(args.keep_saves), *dashboard]
        + (["--tensorboard"] if args.tensorboard else [])
        + (["--resume", str(out)] if args.resume else [])
        + (["--preempt-trace", args.preempt_trace] if args.preempt_trace else [])
        + (["--crash-trace", args.crash_trace] if args.crash_trace else [])
        + (["--chaos-reduce-trace", args.reduce_kill_trace] if args.reduce_kill_trace else [])
        + (["--chaos-recovery-kills", args.chaos_recovery_kills] if args.chaos_recovery_kills else [])
        + (["--chaos-rebuild-kills", args.chaos_rebuild_kills] if args.chaos_rebuild_kills else [])
        + (["--chaos-joins", args.chaos_joins] if args.chaos_joins else [])
        + (["--partition-trace", args.partition_trace] if args.partition_trace else [])
        + [x for spec in args.chaos_slow for x in ("--chaos-slow", spec)]
        + [x for spec in args.chaos_peer_kill for x in ("--chaos-peer-kill", spec)],
        kill_coordinator_at=args.kill_coordinator_at, failover=args.coordinator_failover,
        kill_coordinator_in=args.kill_coordinator_in,
        standby_out=Path(args.standby_out) if args.standby_out else None))
    groups = f" x {cfg.train.replicas} replicas" if cfg.train.replicas > 1 else ""
    print(f"swarm: {cfg.num_stages} stages{groups} + {args.spares} spares, {len(sched.events)} scheduled failures, "
          f"transport {args.transport}, logs in {out / 'logs'}", flush=True)
    if cfg.train.wan:
        for line in WanEmulator(cfg).describe():
            print(f"swarm: emulated WAN {cfg.train.wan}: {line}", flush=True)
    if host_rate is not None:
        print(f"swarm: emulated hosts: every host's link shaped to {host_rate / 2**20:g} MiB/s each way (tc tbf; "
              f"the {cfg.train.wan} profile's slowest link); delays per stage pair as above", flush=True)
    try:
        return swarm.run()
    finally:
        swarm.teardown()
        where = out  # the run directory, or the standby's own that the run's record went on in once it took over
        if args.standby_out and (Path(args.standby_out) / "summary.json").exists():
            where = Path(args.standby_out)
        summary = where / "summary.json"
        if summary.exists():
            print(summary.read_text())
        print(f"swarm: {swarm.kills} peers SIGKILLed, {swarm.preempted} SIGTERMed, {swarm.partitioned} partitioned; "
              f"run directory {where}", flush=True)
