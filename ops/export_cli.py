"""`checkfree export`: one safetensors file (+ config JSON), or an HF Llama directory
(`--format hf`), from a finished or a live run."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from checkfree.flags import add_network_arguments, network_options

if TYPE_CHECKING:  # (imported where used: the command starts fast)
    import torch

    from checkfree.config import RunConfig

__all__ = ["add_parser", "export_live", "gather_live"]

R = TypeVar("R")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="gather every stage into one safetensors file loadable as the full model, "
                                      "or an HF Llama directory (--format hf)",
                       description="From a finished run (--run DIR: its final_weights.safetensors) or a live one "
                                   "(--live with --initial-peers and --run-id: weights pulled from every stage's peer).")
    p.add_argument("--run", help="a finished run directory")
    p.add_argument("--live", action="store_true", help="pull the weights from a running swarm")
    p.add_argument("--format", choices=("safetensors", "hf"), default="safetensors",
                   help="safetensors: one file + config JSON, loadable by checkfree.export.load_export; hf: a "
                        "directory transformers' AutoModelForCausalLM and AutoTokenizer load (default safetensors)")
    p.add_argument("--output", required=True, help="the .safetensors file to write (config JSON beside it), or the "
                                                   "directory with --format hf")
    p.add_argument("--tokenizer", metavar="FILE", help="--format hf: the tokenizer.json to include (default: the "
                   "run directory's tokenizer.json, or the one the run's data config builds, e.g. with --live)")
    add_network_arguments(p)
    p.set_defaults(func=run_export)


async def export_live(opts: dict, output: Path) -> Path:
    """The live swarm's weights into one safetensors file."""
    from checkfree.export import save_export

    return save_export(*await gather_live(opts), output)


async def gather_live(opts: dict) -> tuple[RunConfig, dict[int, dict[str, torch.Tensor]]]:
    """(RunConfig, {stage: state dict}): the coordinator's stage table, then each stage's peer's weights."""
    from checkfree.auth import join_token, load_secret
    from checkfree.config import config_from_dict
    from checkfree.net.transport import (TransportError, live_members_async, sign_requests, start_transport,
                                         stop_transport)
    from checkfree.messages import GetWeights, Join, Request, Status, reply_to, request
    from checkfree.protocol import coordinator_from_records, coordinator_key

    t = opts["timeouts"]
    secret = load_secret(opts.get("secret_file"))
    dht, transport = await start_transport(opts["initial_peers"], opts["host_maddrs"], opts["announce_maddrs"],
                                           opts["identity_path"], opts["startup_timeout"],
                                           transport=opts["transport"], libp2p_port=opts["libp2p_port"],
                                           tcp_port=opts["tcp_port"], secret=secret)
    from checkfree.net.relay import RelayTransport

    transport = await RelayTransport(transport, serve_relay=False).start()  # peers behind NAT: through their relay
    if transport.kind != "memory":
        transport.route(dht, opts["run_id"], secret)

    async def call(pid: str, message: Request[R], timeout: float) -> tuple[R, list]:
        reply, tensors = await transport.call(pid, message.rpc, request(opts["run_id"], message), timeout=timeout)
        return reply_to(message, reply), tensors

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
            sign_requests(transport, {"token": join_token(secret, opts["run_id"], me)})
            await call(coord, Join(peer_id=me, role="observer"), t.rpc_timeout)
        status, _ = await call(coord, Status(), t.rpc_timeout)
        cfg = config_from_dict(json.loads(status.config))
        states = {}
        for stage, pid in status.stages.items():
            weights, tensors = await call(pid, GetWeights(part="all"), t.step_timeout)
            states[stage] = dict(zip(weights.keys, tensors))
        return cfg, states
    finally:
        await stop_transport(dht, transport)


def run_export(args: argparse.Namespace) -> int:
    output = Path(args.output)
    if not output.parent.is_dir():
        raise ValueError(f"--output {args.output!r}: directory {str(output.parent)!r} does not exist")
    if args.format == "hf":
        return _export_hf(args)
    from checkfree.export import load_export

    if args.run:
        src = _final_weights(args.run)
        if src.resolve() != output.resolve():
            shutil.copyfile(src, output)
            shutil.copyfile(src.with_suffix(".json"), output.with_suffix(".json"))
    elif args.live:
        asyncio.run(export_live(network_options(args), output))
    else:
        raise ValueError(_NO_SOURCE)
    model = load_export(output)
    n = sum(p.numel() for p in model.parameters())
    print(f"exported {n:,} parameters to {output} (config {output.with_suffix('.json')})")
    return 0


_NO_SOURCE = "give --run DIR (finished run) or --live --initial-peers ... --run-id ... (live run)"


def _final_weights(run: str) -> Path:
    src = Path(run) / "final_weights.safetensors"
    if not src.is_file():
        raise ValueError(f"{src} does not exist: did the run finish? (for a live run use --live)")
    return src


def _export_hf(args: argparse.Namespace) -> int:
    """An HF Llama directory: weights, config.json and the run's tokenizer."""
    from safetensors.torch import load_file

    from checkfree.config import ModelConfig, config_from_dict
    from checkfree.data import build_tokenizer
    from checkfree.export import merge_stages
    from checkfree.hf import save_hf

    if args.run:
        src = _final_weights(args.run)
        model_cfg = ModelConfig(**json.loads(src.with_suffix(".json").read_text()))
        full = load_file(str(src))
        run_tok = Path(args.run) / "tokenizer.json"
        tok_file = args.tokenizer or (str(run_tok) if run_tok.is_file() else None)
        run_cfg = config_from_dict(json.loads((Path(args.run) / "config.json").read_text()))
    elif args.live:
        run_cfg, states = asyncio.run(gather_live(network_options(args)))
        model_cfg, full, tok_file = run_cfg.model, merge_stages(run_cfg, states), args.tokenizer
    else:
        raise ValueError(_NO_SOURCE)
    data = run_cfg.data if tok_file is None else dataclasses.replace(run_cfg.data, tokenizer=tok_file)
    tokenizer = build_tokenizer(data, model_cfg.vocab_size)
    out = save_hf(model_cfg, full, args.output, tokenizer=tokenizer)
    n = sum(v.numel() for k, v in full.items() if not (k == "head.out.weight" and model_cfg.tie_embeddings))
    print(f"exported {n:,} parameters as a Hugging Face Llama model to {out} (model.safetensors, config.json, "
          f"tokenizer.json)")
    return 0
