"""`checkfree COMMAND ...`: the entry point (console script `checkfree`, and `python -m checkfree`).

It sits above every layer: the library (`checkfree/`) defines the run flags and `simulate`; the
peer daemon (`peers/`), the coordinator and launchers (`coordinator/`, `swarm/`, `faults/`, `ops/`) and the experiments add
their own subcommands. Kept out of `checkfree/`, which must not import the layers above it.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from checkfree.flags import config_from_args
from checkfree.recovery import UnrecoverableFailure

__all__ = ["main", "build_parser", "SUBCOMMANDS", "MODES"]

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="checkfree", description="Train LLM pipelines on unreliable peers.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, spec in SUBCOMMANDS.items():
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


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("checkfree")
    except PackageNotFoundError:
        return "unknown (not installed)"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
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
