"""The `checkfree` command: thin front-ends over the config tree.

Subcommands register themselves from their own packages (peers, scheduler, experiments)
through `SUBCOMMANDS`; this module only knows how to turn shared flags into a RunConfig.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

from checkfree.config import PRESETS, RunConfig, config_from_dict, preset
from checkfree.failures import schedule_from_config, write_trace
from checkfree.net import TRANSPORTS  # the package alone: hivemind is not loaded
from checkfree.recovery import FALLBACKS, RECOVERY_RULES

__all__ = ["add_run_arguments", "config_from_args", "add_network_arguments", "add_transport_arguments",
           "network_options", "add_timeout_arguments", "timeouts_from_args", "warn_if_overwriting",
           "interrupt_on_signals"]



def strategy_names() -> list[str]:
    try:
        from checkfree.strategies import STRATEGIES

        return sorted(STRATEGIES)
    except ImportError:
        return sorted(RECOVERY_RULES)


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """Flags shared by every command that starts a run."""
    g = p.add_argument_group("run")
    g.add_argument("--config", help="a config.json to start from (e.g. from an earlier run directory)")
    g.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="model/training preset (default tiny)")
    g.add_argument("--stages", type=int, help="pipeline stages S (default: the preset's)")
    g.add_argument("--layers", type=int, help="override the preset's number of layers")
    g.add_argument("--d-model", type=int, help="override the preset's residual width")
    g.add_argument("--heads", type=int, help="override the preset's attention heads")
    g.add_argument("--strategy", help=f"recovery strategy: {', '.join(strategy_names())} (default checkfree)")
    g.add_argument("--fallback", choices=FALLBACKS, help="what an unrecoverable failure does (default abort)")
    g.add_argument("--lr-scale", type=float, help="LR multiplier of a recovered stage (default 1.1)")
    g.add_argument("--norm-kind", choices=("post-clip", "pre-clip"), help="omega: gradient norm after/before clip")
    g.add_argument("--norm-power", type=int, choices=(1, 2), help="omega: plain (1) or squared (2) norm")
    g.add_argument("--steps", type=int, help="optimizer steps")
    g.add_argument("--microbatches", type=int, help="microbatches per step (M)")
    g.add_argument("--microbatch-size", type=int, help="sequences per microbatch")
    g.add_argument("--lr", type=float, help="learning rate")
    g.add_argument("--lr-schedule", choices=("constant", "warmup-cosine"), help="learning-rate schedule (default: "
                   "the preset's; constant in every preset)")
    g.add_argument("--warmup-steps", type=int, help="warmup-cosine: linear warmup steps (default: the preset's)")
    g.add_argument("--seed", type=int, help="training seed (init and data)")
    g.add_argument("--eval-every", type=int, help="steps between validation evaluations")
    g.add_argument("--device", help="auto | cpu | cuda | cuda:N (default auto)")
    g.add_argument("--bf16", action="store_true", help="bf16 autocast of the forward pass")
    g.add_argument("--schedule", choices=("gpipe", "1f1b"), help="pipeline schedule in the swarm (default gpipe)")
    g.add_argument("--wire-dtype", choices=("float32", "bfloat16", "float16"),
                   help="dtype of activations/gradients sent between peers (default float32)")
    g.add_argument("--data", help="'shakespeare' (default), a text file or directory, or hf:<dataset>[:<data_files>]")
    g.add_argument("--tokenizer", help="tokenizer.json path or HF tokenizer name (default: train a BPE)")
    g.add_argument("--model-config", metavar="FILE",
                   help="the model's shape from an HF Llama config.json (default: the preset's shape)")
    g.add_argument("--init-from", metavar="DIR|NAME",
                   help="start every stage from an HF Llama model (directory or hub name): its config.json sets the "
                        "shape unless --model-config is given, its tokenizer.json the tokenizer unless --tokenizer "
                        "is; every peer needs the directory (default: seeded random init)")
    f = p.add_argument_group("failures")
    f.add_argument("--failure-rate", type=float, help="probability a stage fails per step")
    f.add_argument("--hourly-failure-rate", type=float, help="probability a stage fails per hour (with --iteration-time)")
    f.add_argument("--iteration-time", type=float, help="seconds per iteration for --hourly-failure-rate (default 91.3)")
    f.add_argument("--trace", help="replay failures from a `step,stage` trace file")
    f.add_argument("--failure-seed", type=int, help="seed of the failure draws")
    f.add_argument("--protect-edges", choices=("yes", "no"), help="never fail the first/last stage (default: yes "
                   "for plain strategies, no for checkfree+)")
    st = p.add_argument_group("strategies (checkpoint, redundant, gemini, reft, baft, checkfree+snap) and cost model")
    st.add_argument("--checkpoint-every", type=int, help="checkpoint: steps between checkpoints (default 50)")
    st.add_argument("--storage-dir", help="checkpoint storage directory (default <out>/checkpoints)")
    st.add_argument("--storage-fallback", choices=("yes", "no"), help="gemini/reft/baft/redundant: also checkpoint "
                    "every --checkpoint-every steps and roll back to it when in-memory copies are lost (default no)")
    st.add_argument("--snapshot-every", type=int, help="gemini/reft/checkfree+snap: steps between snapshots (default 10)")
    st.add_argument("--gemini-replicas", type=int, help="gemini: peers holding each snapshot, own included (default 2)")
    st.add_argument("--reft-group", type=int, help="reft: stages per XOR-parity group (default 3)")
    st.add_argument("--baft-max-iterations", type=int, help="baft: steps a backup may be spread over (default 4)")
    st.add_argument("--cost-profile", help="simulated wall clock: paper-geo (default) or local")
    st.add_argument("--detection-time", type=float, help="failure-detection delay in s (default: the profile's)")
    s = p.add_argument_group("soft errors (ATTNChecker-style guard)")
    s.add_argument("--abft", action="store_true", help="checksum-guard attention: detect and correct INF/NaN/near-INF")
    s.add_argument("--abft-mode", choices=("range", "full"), help="range: cheap trigger (default) | full: always check")
    s.add_argument("--inject-soft-errors", type=int, metavar="N", help="inject N faults at seeded random sites")
    s.add_argument("--soft-error-seed", type=int, help="seed of the injection sites")
    s.add_argument("--explicit-attention", action="store_true",
                   help="unguarded attention computed with the guard's explicit math (bitwise comparable to --abft)")
    sv = p.add_argument_group("stop and resume")
    sv.add_argument("--save-every", type=int, default=0, metavar="N",
                    help="save every stage's weights and optimizer state into <out>/saves every N steps and at a "
                         "graceful stop (default 0: never)")
    sv.add_argument("--keep-saves", type=int, default=2, metavar="K", help="saves kept (the newest K; default 2)")
    sv.add_argument("--resume", metavar="RUN_DIR",
                    help="continue the run in RUN_DIR from its newest save, with its config.json (flags given "
                         "override it, e.g. a larger --steps), appending to its files")
    p.add_argument("--tensorboard", action="store_true",
                   help="also write metrics.jsonl's numbers as TensorBoard scalars into <out>/tensorboard "
                        "(pip install 'checkfree[tensorboard]')")
    p.add_argument("--out", default="runs/latest", help="run directory (default runs/latest)")
    p.add_argument("--write-trace", help="also write the failure schedule to this trace file")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _set(obj: object, field: str, value: object) -> None:
    if value is not None:
        setattr(obj, field, value)


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """Resolve preset or --config plus overrides into a validated RunConfig."""
    if getattr(args, "resume", None):
        run_dir = Path(args.resume)
        if not (run_dir / "config.json").is_file():
            raise ValueError(f"--resume {args.resume!r}: not a run directory (no config.json)")
        args.config = args.config or str(run_dir / "config.json")  # the run's own, unless given
        args.out = str(run_dir)
    out = Path(getattr(args, "out", None) or ".")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {str(out)!r} is a file, not a run directory")
    if getattr(args, "save_every", 0) < 0 or getattr(args, "keep_saves", 1) < 1:
        raise ValueError(f"--save-every must be >= 0 and --keep-saves >= 1 "
                         f"(got {args.save_every} and {args.keep_saves})")
    if args.config:
        path = Path(args.config)
        if not path.is_file():
            raise ValueError(f"--config {args.config!r} does not exist")
        cfg = config_from_dict(json.loads(path.read_text()))
    else:
        cfg = preset(args.preset)
    if getattr(args, "model_config", None) or getattr(args, "init_from", None):
        from checkfree.hf import configure_from_hf

        configure_from_hf(cfg, model_config=args.model_config, init_from=args.init_from)
    _set(cfg, "num_stages", args.stages)
    if args.layers is not None:
        cfg.model.num_layers = args.layers
    if args.d_model is not None or args.heads is not None:
        import dataclasses

        cfg.model = dataclasses.replace(cfg.model, d_model=args.d_model or cfg.model.d_model,
                                        num_heads=args.heads or cfg.model.num_heads)  # re-validated
    r, t, d, f, st = cfg.recovery, cfg.train, cfg.data, cfg.failures, cfg.strategy
    for obj, pairs in (
        (st, [("checkpoint_every", args.checkpoint_every), ("storage_dir", args.storage_dir),
              ("snapshot_every", args.snapshot_every), ("gemini_replicas", args.gemini_replicas),
              ("reft_group", args.reft_group), ("baft_max_iterations", args.baft_max_iterations),
              ("cost_profile", args.cost_profile), ("detection_s", args.detection_time)]),
        (r, [("strategy", args.strategy), ("fallback", args.fallback), ("lr_scale", args.lr_scale),
             ("norm_kind", args.norm_kind), ("norm_power", args.norm_power)]),
        (t, [("num_steps", args.steps), ("num_microbatches", args.microbatches),
             ("microbatch_size", args.microbatch_size), ("lr", args.lr), ("lr_schedule", args.lr_schedule),
             ("warmup_steps", args.warmup_steps), ("seed", args.seed), ("eval_every", args.eval_every),
             ("device", args.device), ("schedule", args.schedule), ("wire_dtype", args.wire_dtype)]),
        (d, [("source", args.data), ("tokenizer", args.tokenizer)]),
        (f, [("rate", args.failure_rate), ("hourly_rate", args.hourly_failure_rate),
             ("iteration_time_s", args.iteration_time), ("trace", args.trace), ("seed", args.failure_seed)]),
    ):
        for name, value in pairs:
            _set(obj, name, value)
    if args.bf16:
        t.autocast_bf16 = True
    if args.abft:
        cfg.guard.abft = True
    _set(cfg.guard, "mode", args.abft_mode)
    _set(cfg.guard, "inject_soft_errors", args.inject_soft_errors)
    _set(cfg.guard, "seed", args.soft_error_seed)
    if args.explicit_attention:
        cfg.guard.explicit_attention = True
    if args.protect_edges:
        f.protect_edges = args.protect_edges == "yes"
    if args.storage_fallback:
        st.storage_fallback = args.storage_fallback == "yes"
    cfg.strategy = type(st)(**vars(st))  # re-validate the overridden fields
    validate(cfg)
    return cfg


def validate(cfg: RunConfig) -> None:
    """Reject a config that cannot run, with the reason."""
    from checkfree.model import check_pipelinable, plan_stages
    from checkfree.worker import lr_at, resolve_device

    names = strategy_names()
    if cfg.recovery.strategy not in names:
        raise ValueError(f"unknown strategy {cfg.recovery.strategy!r}; choose one of {names}")
    if cfg.recovery.fallback not in FALLBACKS:
        raise ValueError(f"unknown fallback {cfg.recovery.fallback!r}; choose one of {FALLBACKS}")
    plan_stages(cfg.model.num_layers, cfg.num_stages)
    check_pipelinable(cfg.model)
    if cfg.train.init_from is not None:
        from checkfree.hf import check_init_from

        check_init_from(cfg.model, cfg.train.init_from)
    for name, flag in (("num_steps", "--steps"), ("num_microbatches", "--microbatches"),
                       ("microbatch_size", "--microbatch-size")):
        if getattr(cfg.train, name) < 1:
            raise ValueError(f"{flag} must be >= 1, got {getattr(cfg.train, name)}")
    if not 0 <= cfg.failures.rate <= 1:
        raise ValueError(f"--failure-rate must be a probability in [0, 1], got {cfg.failures.rate}")
    if cfg.train.lr <= 0:
        raise ValueError(f"--lr must be positive, got {cfg.train.lr}")
    lr_at(cfg, 0)
    resolve_device(cfg.train.device)
    from checkfree.costmodel import get_profile

    get_profile(cfg.strategy.cost_profile)


def add_network_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of every process that joins the P2P network (peer, scheduler)."""
    g = p.add_argument_group("network")
    g.add_argument("--run-id", default="checkfree", help="name of the run; peers and coordinator must agree")
    g.add_argument("--initial-peers", "--initial_peers", nargs="*", default=[], metavar="MADDR",
                   help="full multiaddrs of running peers/coordinator, e.g. /ip4/1.2.3.4/tcp/31337/p2p/Qm...")
    g.add_argument("--host-maddrs", nargs="*", default=["/ip4/127.0.0.1/tcp/0"], metavar="MADDR",
                   help="where to listen (default loopback only; on a server: /ip4/0.0.0.0/tcp/31337)")
    g.add_argument("--announce-maddrs", nargs="*", metavar="MADDR",
                   help="public addresses to announce (behind NAT: the public IP and forwarded port)")
    g.add_argument("--identity-path", help="file with this peer's private key (a stable peer id across restarts; "
                   "--transport libp2p keeps the RPC key in FILE.libp2p)")
    g.add_argument("--secret-file", help="file holding the run secret (or set $CHECKFREE_SECRET); without one "
                   "the swarm is open to anyone who can reach it")
    g.add_argument("--startup-timeout", type=float, default=30.0,
                   help="seconds to wait for the p2p daemon (raise it if you see 'Daemon failed to start')")
    add_transport_arguments(g)
    add_timeout_arguments(p)


TIMEOUT_FLAGS = ("heartbeat_ttl", "rpc_timeout", "step_timeout", "join_timeout")


def add_timeout_arguments(p: argparse.ArgumentParser, *, step_timeout: float = 300.0,
                          join_timeout: float = 600.0) -> None:
    """The timeout hierarchy (checkfree.protocol.Timeouts) as flags: peer, scheduler and local."""
    t = p.add_argument_group("timeouts (heartbeat-ttl < rpc-timeout < step-timeout < join-timeout)")
    t.add_argument("--heartbeat-ttl", type=float, default=4.0,
                   help="a peer whose DHT heartbeat is this old is pinged, and declared failed if the ping fails")
    t.add_argument("--rpc-timeout", type=float, default=30.0,
                   help="one forward/backward/weight-transfer/abort call")
    t.add_argument("--step-timeout", type=float, default=step_timeout,
                   help=f"one whole step; a peer slower than this is replaced as a straggler (default {step_timeout:g})")
    t.add_argument("--join-timeout", type=float, default=join_timeout,
                   help=f"waiting for peers or a replacement before giving up (default {join_timeout:g})")


def timeouts_from_args(args: argparse.Namespace):
    """A validated checkfree.protocol.Timeouts from the timeout flags."""
    from checkfree.protocol import Timeouts

    values = {name: getattr(args, name) for name in TIMEOUT_FLAGS}
    try:
        return Timeouts(**values)
    except ValueError:
        given = ", ".join(f"--{k.replace('_', '-')} {v:g}" for k, v in values.items())
        raise ValueError(f"timeouts must be positive and ordered --heartbeat-ttl < --rpc-timeout < --step-timeout "
                         f"< --join-timeout; got {given}") from None


def add_transport_arguments(g: argparse._ActionsContainer, port: bool = True) -> None:
    """--transport and (``port``) --libp2p-port, --tcp-port: the network commands, and `checkfree local` (no
    fixed port)."""
    g.add_argument("--transport", default="hivemind", choices=TRANSPORTS,
                   help="RPC transport between peers: hivemind (go-libp2p daemon, default), libp2p (py-libp2p in "
                        "a thread; pip install 'checkfree[libp2p]') or tcp (direct TCP, NOT encrypted: trusted "
                        "networks only). Every process of a run must use the same one; membership stays on the "
                        "hivemind DHT either way")
    if not port:
        return
    g.add_argument("--libp2p-port", type=int, default=0, metavar="PORT",
                   help="--transport libp2p: TCP port of the libp2p listener, on the IPs of --host-maddrs "
                        "(default 0: any free port; open/forward it on real machines)")
    g.add_argument("--tcp-port", type=int, default=0, metavar="PORT",
                   help="--transport tcp: TCP port of the RPC listener, on the IPs of --host-maddrs "
                        "(default 0: any free port; open it on real machines)")


def network_options(args: argparse.Namespace) -> dict:
    """The keyword arguments shared by PeerOptions and CoordinatorOptions."""
    return dict(run_id=args.run_id, initial_peers=list(args.initial_peers), host_maddrs=list(args.host_maddrs),
                announce_maddrs=args.announce_maddrs, identity_path=args.identity_path,
                startup_timeout=args.startup_timeout, secret_file=args.secret_file, transport=args.transport,
                libp2p_port=args.libp2p_port, tcp_port=args.tcp_port, timeouts=timeouts_from_args(args))


def warn_if_overwriting(args: argparse.Namespace) -> None:
    """One line when a new run replaces an earlier run's files in --out (e.g. the default runs/latest)."""
    out = Path(args.out)
    if not getattr(args, "resume", None) and (out / "metrics.jsonl").exists():
        print(f"note: {out} holds an earlier run; its files are replaced (give --out DIR to keep it, or "
              f"--resume {out} to continue it)", file=sys.stderr, flush=True)


def interrupt_on_signals() -> None:
    """SIGTERM and SIGHUP (what `timeout`, systemd, docker and CI cancellation send, and a closed
    terminal) stop a synchronous command like Ctrl-C does: KeyboardInterrupt, so that its
    cleanup runs (children stopped, summary written). Not for processes that fork a DHT."""

    def interrupt(signum, frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, interrupt)


def add_simulate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("simulate", help="train every stage in one process with injected failures",
                       description="Single-process simulator: all stages in one process, failures by seed or trace.")
    add_run_arguments(p)
    p.set_defaults(func=run_simulate)


def run_simulate(args: argparse.Namespace) -> int:
    from checkfree.simulator import Simulator

    cfg = config_from_args(args)
    warn_if_overwriting(args)
    if args.write_trace:
        from checkfree.strategies import build_strategy

        sched = schedule_from_config(cfg.failures, cfg.num_stages, cfg.train.num_steps,
                                     build_strategy(cfg).fails_edges)
        write_trace(args.write_trace, sched.events)
    summary = Simulator(cfg, args.out, progress=not args.no_progress, save_every=args.save_every,
                        keep_saves=args.keep_saves, resume=bool(args.resume), tensorboard=args.tensorboard).run()
    print(json.dumps(summary, indent=2))
    return 0
