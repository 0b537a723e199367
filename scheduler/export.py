"""`checkfree export`: one safetensors file (+ config JSON) from a finished or a live run."""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
from pathlib import Path

from checkfree.cli import add_network_arguments, network_options

__all__ = ["add_parser", "export_live"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="gather every stage into one safetensors file loadable as the full model",
                       description="From a finished run (--run DIR: its final_weights.safetensors) or a live one "
                                   "(--live with --initial-peers and --run-id: weights pulled from every stage's peer).")
    p.add_argument("--run", help="a finished run directory")
    p.add_argument("--live", action="store_true", help="pull the weights from a running swarm")
    p.add_argument("--output", required=True, help="the .safetensors file to write (config JSON beside it)")
    add_network_arguments(p)
    p.set_defaults(func=run_export)


async def export_live(opts: dict, output: Path) -> Path:
    """Ask the coordinator for the stage table, then each stage's peer for its weights."""
    from checkfree.auth import join_token, load_secret
    from checkfree.config import config_from_dict
    from checkfree.export import save_export
    from checkfree.net.transport import TransportError, live_members_async, start_transport, stop_transport
    from checkfree.protocol import RPC, coordinator_from_records, coordinator_key

    t = opts["timeouts"]
    secret = load_secret(opts.get("secret_file"))
    dht, transport = await start_transport(opts["initial_peers"], opts["host_maddrs"], opts["announce_maddrs"],
                                           opts["identity_path"], opts["startup_timeout"],
                                           transport=opts["transport"], libp2p_port=opts["libp2p_port"],
                                           tcp_port=opts["tcp_port"], secret=secret)
    try:
        found = await live_members_async(dht, coordinator_key(opts["run_id"]))
        coord = coordinator_from_records(found, secret, opts["run_id"], transport.kind)
        if coord is None:
            if not found:
                hint = " (is it running? check --run-id and --initial-peers)"
            elif secret is not None:
                hint = (": there are coordinator records for this run, but none signed with this process's run "
                        "secret (check --secret-file / CHECKFREE_SECRET)")
            else:
                hint = ": none of the records found is a usable coordinator record"
            raise TransportError(f"no coordinator for run {opts['run_id']!r} in the DHT{hint}")
        if secret is not None:  # join as an observer; the token in every request lets the peers serve us
            me = str(transport.peer_id)
            transport.extra_header = {"token": join_token(secret, opts["run_id"], me)}
            await transport.call(coord, RPC.JOIN, {"run": opts["run_id"], "peer_id": me, "role": "observer",
                                                   "token": join_token(secret, opts["run_id"], me)},
                                 timeout=t.rpc_timeout)
        status, _ = await transport.call(coord, RPC.STATUS, {"run": opts["run_id"]}, timeout=t.rpc_timeout)
        cfg = config_from_dict(json.loads(status["config"]))
        states = {}
        for stage, pid in status["stages"].items():
            reply, tensors = await transport.call(pid, RPC.GET_WEIGHTS, {"run": opts["run_id"], "part": "all"},
                                                  timeout=t.step_timeout)
            states[int(stage)] = dict(zip(reply["keys"], tensors))
        return save_export(cfg, states, output)
    finally:
        await stop_transport(dht, transport)


def run_export(args: argparse.Namespace) -> int:
    from checkfree.export import load_export

    output = Path(args.output)
    if not output.parent.is_dir():
        raise ValueError(f"--output {args.output!r}: directory {str(output.parent)!r} does not exist")
    if args.run:
        src = Path(args.run) / "final_weights.safetensors"
        if not src.is_file():
            raise ValueError(f"{src} does not exist: did the run finish? (for a live run use --live)")
        if src.resolve() != output.resolve():
            shutil.copyfile(src, output)
            shutil.copyfile(src.with_suffix(".json"), output.with_suffix(".json"))
    elif args.live:
        asyncio.run(export_live(network_options(args), output))
    else:
        raise ValueError("give --run DIR (finished run) or --live --initial-peers ... --run-id ... (live run)")
    model = load_export(output)
    n = sum(p.numel() for p in model.parameters())
    print(f"exported {n:,} parameters to {output} (config {output.with_suffix('.json')})")
    return 0
