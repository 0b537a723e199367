"""`checkfree scheduler`: run the coordinator of a distributed run."""

from __future__ import annotations

import argparse
import asyncio
import json
import re
from typing import TYPE_CHECKING

from checkfree.flags import (
    add_network_arguments,
    add_run_arguments,
    config_from_args,
    network_options,
    warn_if_overwriting,
)

if TYPE_CHECKING:
    from faults.injector import FaultSchedule

__all__ = ["add_parser", "run_scheduler"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("scheduler", help="coordinate a distributed run (membership, steps, recovery)",
                       description="Coordinator: admits peers, assigns stages, drives steps, orders recoveries. "
                                   "Prints 'coordinator ready: peer_id=... addrs=...' once listening; give one of "
                                   "those addrs to peers as --initial-peers.")
    add_run_arguments(p)
    add_network_arguments(p)
    c = p.add_argument_group("testing and chaos (fault injection of the local swarm; not for production runs)")
    c.add_argument("--chaos-trace", help="(local swarm) ask the launcher to SIGKILL these `step,stage` failures")
    c.add_argument("--preempt-trace", help="(local swarm) ask the launcher to SIGTERM these `step,stage` peers")
    c.add_argument("--crash-trace", help="(local swarm) ask the launcher to SIGKILL only the training process of these "
                   "`step,stage` peers (their other processes, e.g. reft's snapshot companion, live on)")
    c.add_argument("--chaos-recovery-kills", default="", help="(local swarm) comma-separated iterations at which "
                   "the peer chosen to rebuild a failed stage is killed before it finishes")
    c.add_argument("--chaos-rebuild-kills", default="", help="(local swarm) comma-separated iterations at which "
                   "the peer rebuilding a failed stage SIGKILLs itself after its first weight pull (mid-rebuild)")
    c.add_argument("--chaos-joins", default="", help="(local swarm) comma-separated iterations at which the launcher "
                   "starts one more peer (a standby joining mid-run; an iteration twice: two peers)")
    c.add_argument("--chaos-die-in-commit", type=int, metavar="STEP", help="(local swarm) SIGKILL this coordinator's "
                   "process group after it has committed half of the stages of step STEP (failover test)")
    c.add_argument("--chaos-die-at", type=int, metavar="STEP", help="(local swarm) SIGKILL this coordinator's "
                   "process group as the iteration that runs step STEP starts, before that iteration's faults fire "
                   "(failover test)")
    c.add_argument("--chaos-die-after-faults", type=int, metavar="STEP", help="(local swarm) SIGKILL this "
                   "coordinator's process group once the faults of the iteration that runs step STEP have fired, "
                   "before it sees them (failover test: the peers it killed die with it)")
    c.add_argument("--chaos-reduce-trace", help="(local swarm, stage groups) at these `step,stage` lines one replica "
                   "of the stage SIGKILLs itself half-way through the step's gradient all-reduce")
    c.add_argument("--partition-trace", help="(local swarm, --netns) ask the launcher to cut these `step,stage` peers "
                   "off the network for one iteration")
    add_chaos_slow_argument(c)
    add_peer_kill_argument(c)
    p.add_argument("--shutdown-peers", action=argparse.BooleanOptionalAction, default=True,
                   help="tell peers when the run ends (they print 'run finished' and exit unless started with "
                        "--stay); default on")
    p.add_argument("--max-attempts", type=int, default=5, help="attempts of one step before giving up")
    p.add_argument("--dashboard", metavar="HOST:PORT",
                   help="serve a live, read-only dashboard (/), /status (JSON) and /metrics (Prometheus) here; PORT "
                        "alone binds 127.0.0.1, port 0 any free port (the address is printed as 'dashboard: URL'). "
                        "A non-loopback HOST needs the run secret, sent by clients as 'Authorization: Bearer SECRET'")
    f = p.add_argument_group("coordinator failover (the run's config then comes from its peers; config flags are "
                             "ignored)").add_mutually_exclusive_group()
    f.add_argument("--takeover", action="store_true",
                   help="take over a running run whose coordinator died: adopt its peers (give any live peer's "
                        "address as --initial-peers), rebuild the state from them, continue from their step")
    f.add_argument("--standby", action="store_true",
                   help="hot standby: follow the run's coordinator (give its address as --initial-peers), keeping "
                        "a copy of the run's config and record in --out (nothing is copied when --out is the "
                        "coordinator's own run directory), and take over when it stops answering")
    p.set_defaults(func=run_scheduler)


def parse_slow(specs: list[str], num_stages: int) -> dict[int, tuple[float, int]]:
    """`STAGE:SECONDS[@STEP]` -> {stage: (seconds, step)}."""
    out = {}
    for spec in specs:
        m = re.fullmatch(r"(\d+):(\d+(?:\.\d*)?|\.\d+)(?:@(\d+))?", spec.strip())
        if m is None or not int(m.group(1)) < num_stages:
            raise ValueError(f"--chaos-slow {spec!r}: expected STAGE:SECONDS[@STEP] with STAGE < {num_stages}")
        out[int(m.group(1))] = (float(m.group(2)), int(m.group(3) or 0))
    return out


def add_chaos_slow_argument(p: argparse._ActionsContainer) -> None:
    """--chaos-slow, on `checkfree scheduler` and on `checkfree local` (which passes it on)."""
    p.add_argument("--chaos-slow", action="append", default=[], metavar="STAGE:SECONDS[@STEP]",
                   help="diagnostic: the peer of STAGE (every replica of its group) sleeps SECONDS before each forward "
                        "and backward from STEP on (default 0; a slow GPU); slower than --step-timeout, it is replaced "
                        "as a straggler; repeatable")


def add_peer_kill_argument(p: argparse._ActionsContainer) -> None:
    """--chaos-peer-kill, on `checkfree scheduler` and on `checkfree local` (which passes it on)."""
    p.add_argument("--chaos-peer-kill", action="append", default=[], metavar="WHERE:ITERATION:STAGE[:REPLICA[:MB]]",
                   help="(local swarm, peers started with --fault-hook) replica REPLICA (default 0) of STAGE SIGKILLs "
                        "itself at iteration ITERATION: WHERE=forward|backward at its (MB+1)-th pass of that kind "
                        "(default the first), WHERE=commit as it takes the step's COMMIT; repeatable")


def _joins(text: str) -> list[int]:
    """--chaos-joins: iterations, each as often as it is named."""
    try:
        its = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--chaos-joins {text!r}: expected comma-separated iterations, e.g. 3,3,7") from None
    if any(i < 0 for i in its):
        raise ValueError(f"--chaos-joins {text!r}: iterations are >= 0")
    return its


def _iterations(text: str, flag: str) -> frozenset[int]:
    try:
        its = frozenset(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{flag} {text!r}: expected comma-separated iterations, e.g. 3,7") from None
    if any(i < 0 for i in its):
        raise ValueError(f"{flag} {text!r}: iterations are >= 0")
    return its


async def _run(coordinator, out: str, dashboard, secret: bytes | None) -> dict:
    """The coordinator's run, with its dashboard (a ops.dashboard.Bind) served from the same event loop."""
    if dashboard is None:
        return await coordinator.run()
    from ops.dashboard import serve_dashboard
    from ops.status import LiveStatus

    async with serve_dashboard(LiveStatus(coordinator, out), dashboard, secret):
        return await coordinator.run()


def run_scheduler(args: argparse.Namespace) -> int:
    from checkfree.net.transport import TransportError
    from coordinator.coordinator import Coordinator, CoordinatorOptions
    from faults.injector import Injector

    cfg = config_from_args(args)
    dashboard = secret = None
    if args.dashboard is not None:  # a bad address, or a public one without a secret: refused before anything starts
        from checkfree.auth import load_secret
        from ops.dashboard import check_bind, parse_bind

        secret = load_secret(args.secret_file)
        dashboard = check_bind(parse_bind(args.dashboard), secret)
    failover = args.takeover or args.standby
    if not failover:
        warn_if_overwriting(args)
    if failover and not args.initial_peers:
        raise ValueError("--takeover/--standby need --initial-peers: the address of a live peer of the run "
                         "(or, for --standby, of its coordinator)")
    opts = CoordinatorOptions(**network_options(args), out=args.out, shutdown_peers=args.shutdown_peers,
                              max_attempts=args.max_attempts, takeover=args.takeover, standby=args.standby,
                              save_every=args.save_every, keep_saves=args.keep_saves, resume=bool(args.resume),
                              tensorboard=args.tensorboard)
    if args.resume and failover:
        raise ValueError("--resume starts the run again from its saves; --takeover/--standby join a live one")
    schedule = fault_schedule(args, cfg.num_stages)
    coordinator = Coordinator(None if failover else cfg, opts, Injector(schedule) if schedule else None)
    try:
        summary = asyncio.run(_run(coordinator, args.out, dashboard, secret))
    except TransportError as e:
        raise ValueError(str(e)) from e
    print(json.dumps(summary), flush=True)
    return 0


def fault_schedule(args: argparse.Namespace, num_stages: int) -> FaultSchedule | None:
    """The --chaos-* / --*-trace flags as a fault schedule (faults/injector.py); None when none is given."""
    from checkfree.failures import FailureSchedule, read_trace, read_trace_scopes
    from faults.injector import FaultSchedule, parse_peer_kill

    def trace(path: str | None) -> FailureSchedule | None:
        return FailureSchedule(read_trace(path, num_stages)) if path else None

    schedule = FaultSchedule(
        kills=FailureSchedule(*read_trace_scopes(args.chaos_trace, num_stages)) if args.chaos_trace else None,
        preempt=trace(args.preempt_trace), crash=trace(args.crash_trace), partition=trace(args.partition_trace),
        reduce_kills=trace(args.chaos_reduce_trace),
        recovery_kills=_iterations(args.chaos_recovery_kills, "--chaos-recovery-kills"),
        rebuild_kills=_iterations(args.chaos_rebuild_kills, "--chaos-rebuild-kills"),
        slow=parse_slow(args.chaos_slow, num_stages), die_in_commit=args.chaos_die_in_commit,
        die_at=args.chaos_die_at, die_after_faults=args.chaos_die_after_faults,
        peer_kills=tuple(parse_peer_kill(spec, num_stages) for spec in args.chaos_peer_kill),
        joins=tuple(sorted(_joins(args.chaos_joins))))
    return None if schedule == FaultSchedule() else schedule
