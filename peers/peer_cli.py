"""`checkfree peer`: start a peer daemon that joins a run and serves a stage."""

from __future__ import annotations

import argparse
import asyncio

from checkfree.flags import add_network_arguments, network_options

__all__ = ["add_parser"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("peer", help="join a run as a peer that hosts one pipeline stage",
                       description="Peer daemon: joins the run through --initial-peers, waits for a stage, serves it. "
                                   "Prints 'peer ready: peer_id=... addrs=...' once listening.")
    add_network_arguments(p)
    p.add_argument("--device", help="device for this peer's stage (default: the run's, 'auto')")
    p.add_argument("--threads", type=int, help="torch threads for this peer (default: torch's)")
    p.add_argument("--leave-deadline", type=float, default=30.0,
                   help="on SIGTERM, seconds to wait for a lossless handover to a standby before leaving")
    p.add_argument("--coordinator-timeout", type=float, default=60.0,
                   help="leave (exit code 4) when no coordinator has answered for this many seconds (default 60)")
    p.add_argument("--stay", action="store_true",
                   help="keep running after the run has finished (default: print 'run finished' and exit, so an "
                        "unattended spot instance stops)")
    p.add_argument("--serve-relay", action="store_true",
                   help="relay requests for peers behind NAT that name this peer in --relay-via (a publicly "
                        "reachable peer that opts in; the coordinator relays by default)")
    p.add_argument("--check", action="store_true",
                   help="before training: find the coordinator, say whether it can connect to this peer (directly, "
                        "or only through a relay) and the latency and bandwidth between them; exit 0 if this peer "
                        "can take part, 2 if not")
    p.add_argument("--dump-recovery", metavar="DIR",
                   help="save the weights served and rebuilt in recoveries, and the final state (debugging)")
    p.add_argument("--fault-hook", action="store_true",
                   help="testing only (the local swarm's fault injection): serve a control channel through which "
                        "the coordinator's fault injector arms this peer to kill itself or slow down at named points "
                        "of its work (checkfree.peer_faults); never on a production peer")
    p.set_defaults(func=run_peer)


def run_peer(args: argparse.Namespace) -> int:
    from checkfree.net.transport import TransportError
    from peers.daemon import PeerDaemon, PeerOptions

    if args.device:
        from checkfree.worker import resolve_device

        resolve_device(args.device)
    opts = PeerOptions(**network_options(args), device=args.device, threads=args.threads,
                       dump_dir=args.dump_recovery, leave_deadline=args.leave_deadline,
                       coordinator_timeout=args.coordinator_timeout, stay=args.stay,
                       serve_relay=args.serve_relay, check=args.check)
    if opts.coordinator_timeout <= opts.timeouts.heartbeat_ttl:
        raise ValueError(f"--coordinator-timeout ({opts.coordinator_timeout:g} s) must exceed --heartbeat-ttl "
                         f"({opts.timeouts.heartbeat_ttl:g} s)")
    if not opts.initial_peers:
        print(f"note: no --initial-peers: this peer can only find a coordinator that bootstraps from it; it waits "
              f"up to --join-timeout {opts.timeouts.join_timeout:g} s for run {opts.run_id!r} (give the address the "
              "coordinator printed as --initial-peers)", flush=True)
    hook = None
    if args.fault_hook:
        from checkfree.peer_faults import PeerFaults

        hook = PeerFaults()
    try:
        return asyncio.run(PeerDaemon(opts, hook).run())
    except TransportError as e:
        raise ValueError(str(e)) from e
