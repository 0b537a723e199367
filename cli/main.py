"""`checkfree COMMAND ...`: the entry point (console script `checkfree`, and `python -m checkfree`).

It sits above every layer: the library (`checkfree/`) defines the run flags and `simulate`; the
peer daemon (`peers/`), the coordinator and launchers (`coordinator/`, `swarm/`, `faults/`, `ops/`) and the experiments add
their own subcommands. Kept out of `checkfree/`, which must not import the layers above it.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import importlib
import logging
import os
import sys

# hivemind shares its futures' state through torch's `file_system` strategy unless told otherwise: every process then
# starts a torch_shm_manager, which holds a swarm's teardown 2 s after its last client, and a SIGKILLed process leaves
# its /dev/shm/torch_* segments behind (seen here: two per local swarm run). torch's own Linux default,
# `file_descriptor`, keeps no named segment. Set before anything imports hivemind; a value already set is kept.
os.environ.setdefault("HIVEMIND_MEMORY_SHARING_STRATEGY", "file_descriptor")

__all__ = ["main", "build_parser", "SUBCOMMANDS", "MODES", "PRELOAD"]

# name -> "module:function" that adds the subparser; imported lazily so `checkfree simulate`
# does not pay for hivemind's import.
SUBCOMMANDS = {
    "simulate": "checkfree.flags:add_simulate",
    "local": "swarm.local_cli:add_parser",
    "scheduler": "coordinator.scheduler_cli:add_parser",
    "peer": "peers.peer_cli:add_parser",
    "export": "ops.export_cli:add_parser",
    "experiment": "experiments.cli:add_parser",
    "chaos": "faults.chaos:add_parser",
    "plot": "checkfree.plot:add_parser",
    "status": "ops.status_cli:add_parser",
    "pretrained": "checkfree.pretrained:add_parser",
}
# command -> its modes: name -> "module:function" that adds the mode's subparser to the command's modes (e.g.
# `checkfree chaos dst`, which runs coordinators and peers together, a layer above both)
MODES = {"chaos": {"dst": "dst.cli:add_parser"}}
# what the local swarm's fork server (swarm/zygote.py) imports before it forks peers and coordinators: the modules
# every one of them would import (~3 s of CPU each: torch 2.2, hivemind 0.7, the dashboard's web server 0.6; not
# torch._dynamo, which checkfree/worker.py's optimizer steps no longer import); importing only, no torch op
PRELOAD = ("torch", "torch.optim", "numpy", "hivemind", "checkfree.flags", "checkfree.auth",
           "checkfree.failures", "checkfree.worker", "checkfree.peer_faults", "checkfree.net.transport",
           "checkfree.net.lifeline", "peers.peer_cli", "peers.daemon", "coordinator.scheduler_cli",
           "coordinator.coordinator", "faults.injector", "ops.dashboard", "ops.status")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; `only`: a parser with that one subcommand (its module alone imported; "": none),
    which parses that subcommand's command lines as the whole one does (`main` picks it: `_only`)."""
    parser = argparse.ArgumentParser(prog="checkfree", description="Train LLM pipelines on unreliable peers.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, spec in SUBCOMMANDS.items():
        if only is not None and name != only:
            continue
        module, func = spec.split(":")
        try:
            modes = getattr(importlib.import_module(module), func)(sub)
        except ModuleNotFoundError as e:
            if not module.startswith(e.name or "\0"):
                raise
            continue
        for mode_spec in MODES.get(name, {}).values():
            mode_module, mode_func = mode_spec.split(":")
            getattr(importlib.import_module(mode_module), mode_func)(modes)
    for command in sub.choices.values():
        command.formatter_class = DefaultsHelpFormatter
        command.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                             help="debug logging (also accepted before the command)")
        if any("--preset" in a.option_strings for a in command._actions):
            command.add_argument("--print-config", action="store_true",
                                 help="print the resolved configuration (preset + --config + flags) as JSON and exit")
    return parser


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """--help shows every default a flag has (flags whose help already names it are left alone;
    flags without a default take the preset's value: see --print-config)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if ("default" in text or not action.option_strings or default in (None, False, argparse.SUPPRESS)
                or isinstance(action, (argparse._HelpAction, argparse._VersionAction))):
            return text
        shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else "%(default)s"
        return f"{text} (default: {shown or 'none'})"


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("checkfree")
    except PackageNotFoundError:
        return "unknown (not installed)"


def _only(argv: list[str]) -> str | None:
    """The one subcommand a command line needs the parser of (None: all of them). A process started as
    `checkfree peer ...` then imports the peer's modules and not every other command's (the launcher's, the
    dashboard's web server: ~0.5 s of every spawned process's start); `checkfree --version` imports none. Help
    and any command line not of that form (an unknown command, a misspelt flag before it) get the whole parser,
    so that their output lists every command."""
    command = next((a for a in argv if not a.startswith("-")), None)
    if command is None:
        return "" if "--version" in argv and set(argv) <= {"--version", "-v", "--verbose"} else None
    before = argv[:argv.index(command)]
    return command if command in SUBCOMMANDS and set(before) <= {"-v", "--verbose"} else None


_EXIT_HOOKED = False


def _freeze_at_exit() -> None:
    """Make the interpreter's exit skip its final garbage collections: with torch and hivemind loaded they took
    1-6 s of CPU in every process of a swarm (the coordinator, each peer and the launcher, all at once on the
    same cores), the largest part of a local swarm's teardown. The objects alive at exit are frozen (gc.freeze):
    modules are still cleared and plain objects freed (files flushed and closed); only cyclic garbage left at
    exit is not collected (Python does not promise to finalise it either). Everything that must happen before
    a process goes (transports stopped, the run's end recorded, files written) is done explicitly before this."""
    global _EXIT_HOOKED
    if not _EXIT_HOOKED:  # (atexit runs it once, at interpreter exit: harmless when main() runs in-process)
        _EXIT_HOOKED = True
        atexit.register(gc.freeze)


def main(argv: list[str] | None = None) -> int:
    _freeze_at_exit()
    args_in = sys.argv[1:] if argv is None else argv
    only = _only(args_in)
    parser = build_parser(only)
    if only and only not in _commands(parser):  # its module is missing (an optional extra): the whole parser says so
        parser = build_parser()
    args = parser.parse_args(args_in)
    from checkfree.flags import config_from_args  # (not before: `checkfree --version` imports no torch)
    from checkfree.recovery import UnrecoverableFailure

    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if getattr(args, "print_config", False):
            print(config_from_args(args).to_json())
            return 0
        return args.func(args)
    except UnrecoverableFailure as e:
        print(f"checkfree: run aborted: {e}", file=sys.stderr)
        return 3
    except (ValueError, FileNotFoundError, TimeoutError, RuntimeError) as e:
        print(f"checkfree: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("checkfree: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        from checkfree.net.transport import TransportError  # hivemind is imported on this path only

        if not isinstance(e, TransportError):
            raise
        print(f"checkfree: network error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
