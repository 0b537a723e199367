"""The `checkfree` command: thin front-ends over the config tree.

Subcommands register themselves from their own packages (peers, coordinator, swarm, faults, ops, experiments)
through `SUBCOMMANDS`; this module only knows how to turn shared flags into a RunConfig.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

from checkfree.config import PRESETS, SNAPSHOT_FORMATS, RunConfig, config_from_dict, preset
from checkfree.costmodel import NETWORKS
from checkfree.failures import schedule_from_config, write_trace
from checkfree.net import TRANSPORTS  # the package alone: hivemind is not loaded
from checkfree.recovery import FALLBACKS, RECOVERY_RULES
from checkfree.wirecodec import WIRE_DTYPES

__all__ = ["add_run_arguments", "config_from_args", "override_config", "CONFIG_FLAGS", "add_network_arguments", "add_transport_arguments",
           "network_options", "add_timeout_arguments", "timeouts_from_args", "warn_if_overwriting",
           "interrupt_on_signals"]



def strategy_names() -> list[str]:
    try:
        from checkfree.strategies import STRATEGIES

        return sorted(STRATEGIES)
    except ImportError:
        return sorted(RECOVERY_RULES)


# Every flag that sets a config field is declared once, with the field's dotted key: the mapping below is
# generated from these declarations, values are merged into the typed tree by OmegaConf (which checks
# types and names), and --help shows each flag's key and the default preset's value.
CONFIG_FLAGS: dict[str, tuple[str, Callable[[Any], Any]]] = {}  # argparse dest -> (config key, converter)
DEFAULT_PRESET = "tiny"


def _keyed(group: argparse._ActionsContainer, flag: str, key: str, *, help: str,
           convert: Callable[[Any], Any] = lambda v: v, **kwargs: Any) -> None:
    """Add a flag that sets config `key`; its help ends with the key and the default preset's value."""
    value: Any = preset(DEFAULT_PRESET)
    for part in key.split("."):
        value = getattr(value, part)
    shown = "none" if value is None else str(value).lower() if isinstance(value, bool) else value
    action = group.add_argument(flag, help=f"{help} [{key}; {DEFAULT_PRESET}: {shown}]", **kwargs)
    CONFIG_FLAGS[action.dest] = (key, convert)


def _yes(value: str) -> bool:
    return value == "yes"


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """Flags shared by every command that starts a run."""
    g = p.add_argument_group("run (each flag sets the config key in brackets; --set reaches every other key)")
    g.add_argument("--config", help="a config.json to start from (e.g. from an earlier run directory)")
    g.add_argument("--preset", default=DEFAULT_PRESET, choices=sorted(PRESETS), help="model/training preset")
    g.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="set any config key, e.g. --set train.weight_decay=0.1 --set model.num_kv_heads=2 (checked "
                        "against the typed config tree; applied after every other flag; --print-config lists the keys)")
    _keyed(g, "--stages", "num_stages", type=int, help="pipeline stages S")
    _keyed(g, "--layers", "model.num_layers", type=int, help="transformer blocks in the whole model")
    _keyed(g, "--d-model", "model.d_model", type=int, help="residual width")
    _keyed(g, "--heads", "model.num_heads", type=int, help="attention heads")
    _keyed(g, "--strategy", "recovery.strategy", help=f"recovery strategy: {', '.join(strategy_names())}")
    _keyed(g, "--fallback", "recovery.fallback", choices=FALLBACKS, help="what an unrecoverable failure does")
    _keyed(g, "--lr-scale", "recovery.lr_scale", type=float, help="LR multiplier of a recovered stage")
    _keyed(g, "--norm-kind", "recovery.norm_kind", choices=("post-clip", "pre-clip"),
           help="omega: gradient norm after/before clip")
    _keyed(g, "--omega-scope", "recovery.omega_scope", choices=("stage", "blocks"),
           help="omega: norm of the stage's whole gradient (embedding/head included, as the authors' code) or of "
                "its transformer blocks only (the parameters averaged)")
    _keyed(g, "--omega-window", "recovery.omega_window", type=int,
           help="omega: the mean over the stage's last N committed steps (default 1: the last step's, as the paper)")
    _keyed(g, "--norm-power", "recovery.norm_power", type=int, choices=(1, 2), help="omega: plain (1) or squared (2) norm")
    _keyed(g, "--steps", "train.num_steps", type=int, help="optimizer steps")
    _keyed(g, "--microbatches", "train.num_microbatches", type=int, help="microbatches per step (M)")
    _keyed(g, "--microbatch-size", "train.microbatch_size", type=int, help="sequences per microbatch")
    _keyed(g, "--seq-len", "train.seq_len", type=int,
           help="tokens per training sequence, at most the model's context length (its RoPE/position limit); "
                "none: the context length (--init-from / --model-config: at most 256)")
    _keyed(g, "--lr", "train.lr", type=float, help="learning rate")
    _keyed(g, "--lr-schedule", "train.lr_schedule", choices=("constant", "warmup-cosine"), help="learning-rate schedule")
    _keyed(g, "--warmup-steps", "train.warmup_steps", type=int, help="warmup-cosine: linear warmup steps")
    _keyed(g, "--seed", "train.seed", type=int, help="training seed (init and data)")
    _keyed(g, "--eval-every", "train.eval_every", type=int, help="steps between validation evaluations (0: never)")
    _keyed(g, "--device", "train.device", help="auto | cpu | cuda | cuda:N")
    _keyed(g, "--bf16", "train.autocast_bf16", action="store_const", const=True, help="bf16 autocast of the forward pass")
    _keyed(g, "--schedule", "train.schedule", choices=("gpipe", "1f1b"), help="pipeline schedule in the swarm")
    _keyed(g, "--wire-dtype", "train.wire_dtype", choices=WIRE_DTYPES,
           help="activations/gradients between peers: as computed, cast to 16 bits, or int8 with a scale per row "
                "(about 1/4 of float32's bytes; see checkfree.wirecodec)")
    _keyed(g, "--wan", "train.wan", choices=NETWORKS,
           help="swarm: emulate this cost profile's network between the stages' peers (stage i in region i mod R, "
                "the profile's latency and bandwidth on every stage-to-stage link; checkfree.wan); default: as is")
    _keyed(g, "--replicas", "train.replicas", type=int,
           help="peers per stage: each stage is served by a group of data-parallel replicas that split the step's "
                "microbatches and sum their gradients; a lost replica costs no recovery (the simulator computes the "
                "same global batch)")
    _keyed(g, "--reserve", "train.reserve", type=int,
           help="swarm: standbys kept for the recovery of a wholly lost stage; any standby beyond them joins the "
                "group of the slowest stage (none: every standby waits)")
    _keyed(g, "--data", "data.source", help="'shakespeare', a text file or directory, or hf:<dataset>[:<data_files>]")
    _keyed(g, "--tokenizer", "data.tokenizer", help="tokenizer.json path or HF tokenizer name (none: train a BPE)")
    g.add_argument("--model-config", metavar="FILE",
                   help="the model's shape from an HF Llama config.json (default: the preset's shape)")
    g.add_argument("--init-from", metavar="DIR|NAME",
                   help="start every stage from an HF Llama model (directory or hub name): its config.json sets the "
                        "shape unless --model-config is given, its tokenizer.json the tokenizer unless --tokenizer "
                        "is; every peer needs the directory (default: seeded random init)")
    f = p.add_argument_group("failures")
    _keyed(f, "--failure-rate", "failures.rate", type=float, help="probability a stage fails per step")
    _keyed(f, "--hourly-failure-rate", "failures.hourly_rate", type=float,
           help="probability a stage fails per hour (with --iteration-time)")
    _keyed(f, "--iteration-time", "failures.iteration_time_s", type=float,
           help="seconds per iteration for --hourly-failure-rate")
    _keyed(f, "--trace", "failures.trace", help="replay failures from a `step,stage` trace file")
    _keyed(f, "--failure-seed", "failures.seed", type=int, help="seed of the failure draws")
    _keyed(f, "--protect-edges", "failures.protect_edges", choices=("yes", "no"), convert=_yes,
           help="never fail the first/last stage (none: yes for plain strategies, no for checkfree+)")
    st = p.add_argument_group("strategies (checkpoint, redundant, gemini, reft, baft, checkfree+snap, snap) and cost "
                                "model")
    _keyed(st, "--checkpoint-every", "strategy.checkpoint_every", type=int, help="checkpoint: steps between checkpoints")
    _keyed(st, "--storage-dir", "strategy.storage_dir", help="checkpoint storage directory (none: <out>/checkpoints)")
    _keyed(st, "--storage-fallback", "strategy.storage_fallback", choices=("yes", "no"), convert=_yes,
           help="gemini/reft/baft/redundant: also checkpoint every --checkpoint-every steps and roll back to it when "
                "in-memory copies are lost")
    _keyed(st, "--snapshot-every", "strategy.snapshot_every", type=int,
           help="gemini/reft/checkfree+snap/snap: steps between snapshots")
    _keyed(st, "--snapshot-format", "strategy.snapshot_format", choices=SNAPSHOT_FORMATS,
           help="snap: how each stage's copy at its neighbour is kept and sent: int8 (a scale per row), int4 (a "
                "scale per --snapshot-group values), bf16 or float32")
    _keyed(st, "--snapshot-group", "strategy.snapshot_group", type=int, help="snap: values per int4 scale")
    _keyed(st, "--snapshot-moments", "strategy.snapshot_moments", choices=("yes", "no"), convert=_yes,
           help="snap: the Adam moments travel too (no: a restored stage starts a fresh optimizer)")
    _keyed(st, "--snapshot-budget", "strategy.snapshot_budget", type=int, metavar="BYTES",
           help="snap: bytes of its copy a stage sends per step, while the step computes (0: a delta's bytes: a "
                "delta travels in one step, the first whole copy in two or three)")
    _keyed(st, "--snapshot-rebuild", "strategy.snapshot_rebuild",
           choices=tuple(r for r, rule in RECOVERY_RULES.items() if not rule.plus),
           help="snap: how a stage whose copy was lost too (its holder died with it) is rebuilt")
    _keyed(st, "--gemini-replicas", "strategy.gemini_replicas", type=int,
           help="gemini: peers holding each snapshot, own included")
    _keyed(st, "--reft-group", "strategy.reft_group", type=int, help="reft: stages per XOR-parity group")
    _keyed(st, "--baft-max-iterations", "strategy.baft_max_iterations", type=int,
           help="baft: steps a backup may be spread over")
    _keyed(st, "--cost-profile", "strategy.cost_profile", help="simulated wall clock: paper-geo or local")
    _keyed(st, "--detection-time", "strategy.detection_s", type=float,
           help="failure-detection delay in s (none: the profile's)")
    s = p.add_argument_group("soft errors (ATTNChecker-style guard)")
    _keyed(s, "--abft", "guard.abft", action="store_const", const=True,
           help="checksum-guard attention: detect and correct INF/NaN/near-INF")
    _keyed(s, "--abft-mode", "guard.mode", choices=("range", "full"), help="range: cheap trigger | full: always check")
    _keyed(s, "--inject-soft-errors", "guard.inject_soft_errors", type=int, metavar="N",
           help="inject N faults at seeded random sites")
    _keyed(s, "--soft-error-seed", "guard.seed", type=int, help="seed of the injection sites")
    _keyed(s, "--explicit-attention", "guard.explicit_attention", action="store_const", const=True,
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
    p.add_argument("--skip-memory-check", action="store_true",
                   help="start even when the memory estimate (checkfree.memory: weights, gradients, Adam, "
                        "activations, logits) exceeds the memory available")
    p.add_argument("--out", default="runs/latest", help="run directory (default runs/latest)")
    p.add_argument("--write-trace", help="also write the failure schedule to this trace file")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def override_config(cfg: RunConfig, values: dict[str, Any], dotlist: Sequence[str] = ()) -> RunConfig:
    """`cfg` with `values` ({dotted key: value}) and then `dotlist` ("key=value" strings) merged in, every
    key and value checked against the typed tree (OmegaConf), every section re-validated."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    for item in dotlist:
        if "=" not in item or not item.split("=", 1)[0].strip():
            raise ValueError(f"--set expects KEY=VALUE (e.g. train.lr=3e-4), got {item!r}")
    nested: dict[str, Any] = {}
    for key, value in values.items():
        *path, last = key.split(".")
        node = nested
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    merged = OmegaConf.structured(cfg)
    for source, layer in (("flags", lambda: OmegaConf.create(nested)),
                          *((f"--set {item}", lambda item=item: OmegaConf.from_dotlist([item])) for item in dotlist)):
        try:
            merged = OmegaConf.merge(merged, layer())
        except OmegaConfBaseException as e:
            raise ValueError(f"{source}: {str(e).splitlines()[0]}") from None
    return config_from_dict(cast(dict[str, Any], OmegaConf.to_container(merged)))


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """Resolve preset or --config, then HF shapes, then the flags and --set, into a validated RunConfig."""
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
    values = {key: convert(getattr(args, dest)) for dest, (key, convert) in CONFIG_FLAGS.items()
              if getattr(args, dest, None) is not None}
    fresh = getattr(args, "init_from", None) and not args.config  # a new run from a trained model
    dotlist = getattr(args, "set", None) or []
    defaulted = fresh and "recovery.strategy" not in values and not any(
        s.split("=", 1)[0].strip() == "recovery.strategy" for s in dotlist)
    if defaulted:  # the measurements' choice for a trained model (checkfree.advice)
        from checkfree.advice import PRETRAINED_DEFAULT

        values["recovery.strategy"] = PRETRAINED_DEFAULT
    cfg = override_config(cfg, values, dotlist)
    validate(cfg)
    if fresh:
        from checkfree.advice import default_note, measured, warnings_for

        m = measured()
        for line in ([default_note(m)] if defaulted else []) + warnings_for(cfg.recovery.strategy, m):
            print(line, file=sys.stderr, flush=True)
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
    if cfg.train.seq_len is not None and not 1 <= cfg.train.seq_len <= cfg.model.context_length:
        raise ValueError(f"--seq-len must be in 1..{cfg.model.context_length} (the model's context length, its "
                         f"position limit), got {cfg.train.seq_len}")
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
    add_relay_arguments(g)
    add_timeout_arguments(p)


def add_relay_arguments(g: argparse._ActionsContainer) -> None:
    """Peers behind NAT (checkfree.net.relay): peer, scheduler and local."""
    g.add_argument("--no-relay", action="store_true",
                   help="relays off. A peer: never be reached through a relay; if the coordinator cannot connect to "
                        "it (behind NAT or a firewall) it exits with one line saying so. The coordinator: relay for "
                        "no peer. Default: the coordinator probes each joining peer and relays for those it cannot "
                        "reach")
    g.add_argument("--relay-via", nargs="*", default=[], metavar="MADDR",
                   help="a peer behind NAT: be reached through this relay (the full multiaddr of a public peer "
                        "started with --serve-relay) instead of the coordinator")


def relay_options(args: argparse.Namespace) -> dict:
    return dict(relay=not args.no_relay, relay_via=list(getattr(args, "relay_via", []) or []))


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
                libp2p_port=args.libp2p_port, tcp_port=args.tcp_port, timeouts=timeouts_from_args(args),
                **relay_options(args))


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
    if not args.skip_memory_check:
        from checkfree.memory import check_fits, simulator_memory
        from checkfree.worker import resolve_device

        check_fits(simulator_memory(cfg, save_every=args.save_every), "this simulation",
                   resolve_device(cfg.train.device))
    warn_if_overwriting(args)
    if cfg.train.wan:
        print(f"warning: --wan {cfg.train.wan} emulates a network between peers; the simulator has none (its "
              f"simulated clock is the cost model's: --cost-profile {cfg.strategy.cost_profile})", file=sys.stderr)
    if args.write_trace:
        from checkfree.strategies import build_strategy

        sched = schedule_from_config(cfg.failures, cfg.num_stages, cfg.train.num_steps,
                                     build_strategy(cfg).fails_edges)
        write_trace(args.write_trace, sched.events)
    summary = Simulator(cfg, args.out, progress=not args.no_progress, save_every=args.save_every,
                        keep_saves=args.keep_saves, resume=bool(args.resume), tensorboard=args.tensorboard).run()
    print(json.dumps(summary, indent=2))
    return 0
