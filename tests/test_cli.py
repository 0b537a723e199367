"""The command line as a user meets it: defaults shown, --print-config, --version, `python -m
checkfree`, -v anywhere, output that reads well in a log file, and one-line errors for bad input."""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys

import pytest

from cli.main import build_parser, main

pytestmark = pytest.mark.timeout(120)


def _run(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "checkfree", *args], capture_output=True, text=True, timeout=100,
                          cwd=cwd, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_help_shows_a_default_for_every_flag_that_has_one():
    for name, command in _commands(build_parser()).items():
        formatter = command._get_formatter()
        for action in command._actions:
            if (not action.option_strings or action.default in (None, False, argparse.SUPPRESS)
                    or isinstance(action, argparse._HelpAction)):
                continue
            text = formatter._expand_help(action) if action.help else ""
            assert "default" in text, f"checkfree {name} {action.option_strings[0]}: {text!r}"


def test_print_config_version_module_entry_and_verbose_anywhere(tmp_path):
    proc = _run("simulate", "--preset", "small", "--steps", "7", "--print-config")
    assert proc.returncode == 0, proc.stderr
    cfg = json.loads(proc.stdout)
    assert cfg["preset"] == "small" and cfg["train"]["num_steps"] == 7 and cfg["model"]["d_model"] == 96
    assert not (tmp_path / "runs").exists()
    version = _run("--version")
    assert version.returncode == 0 and version.stdout.startswith("checkfree ")
    args = build_parser().parse_args(["simulate", "-v", "--steps", "3"])
    assert args.verbose is True
    assert build_parser().parse_args(["-v", "simulate"]).verbose is True
    assert build_parser().parse_args(["simulate"]).verbose is False
    peer = build_parser().parse_args(["peer", "--initial_peers", "/ip4/1.2.3.4/tcp/1/p2p/x"])
    assert peer.initial_peers == ["/ip4/1.2.3.4/tcp/1/p2p/x"]  # hivemind's / Petals' spelling
    assert build_parser().parse_args(["local", "--threads", "2"]).threads_per_peer == 2


_PROBE = """import json, sys
from cli.main import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
seen = [m for m in ('torch', 'hivemind', 'aiohttp', 'swarm.launcher') if m in sys.modules]
import checkfree.net.transport  # hivemind, without running scipy.optimize
deferred = type(sys.modules['scipy.optimize']).__name__
import scipy.optimize
print(json.dumps([seen, deferred, scipy.optimize.linprog.__name__, type(sys.modules['scipy.optimize']).__name__]))
"""


def test_a_command_imports_only_what_it_needs():
    """Every spawned process pays its imports (2 cores, 6-10 processes a swarm): `--version` imports no torch, a
    peer's command line neither the launcher nor the dashboard's web server (cli.main._only: its subcommand's
    parser alone), hivemind's import runs no scipy.optimize until it is used (checkfree.net.DEFERRED); and a
    command line parses the same with its subcommand's parser alone as with the whole one."""
    runs = {}
    for args in (["--version"], ["peer", "--help"]):
        proc = subprocess.run([sys.executable, "-c", _PROBE, *args], capture_output=True, text=True, timeout=100)
        assert proc.returncode == 0, proc.stderr
        runs[args[0]] = json.loads(proc.stdout.splitlines()[-1])
    assert runs["--version"][0] == [] and runs["peer"][0] == ["torch"]
    assert runs["peer"][1:] == ["_Deferred", "linprog", "module"]
    for argv in (["-v", "peer", "--initial_peers", "/ip4/1.2.3.4/tcp/1/p2p/x", "--threads", "1"],
                 ["local", "--stages", "3", "--no-churn", "-v"], ["scheduler", "--stages", "2"],
                 ["simulate", "--steps", "3", "--preset", "small"]):
        assert vars(build_parser(argv[argv[0] == "-v"]).parse_args(argv)) == vars(build_parser().parse_args(argv))


_SHARING = "import cli.main, hivemind, torch.multiprocessing as m; print(m.get_sharing_strategy())"


def test_checkfree_processes_share_memory_without_named_segments_unless_told():
    """A checkfree process (cli.main imported before hivemind) shares memory by file descriptors, torch's Linux
    default, not by hivemind's `file_system` (a torch_shm_manager per process, /dev/shm segments a SIGKILL leaves
    behind); a strategy set in the environment is kept."""
    env = {k: v for k, v in os.environ.items() if k != "HIVEMIND_MEMORY_SHARING_STRATEGY"}
    for given, expected in ((None, "file_descriptor"), ("file_system", "file_system")):
        run_env = env if given is None else {**env, "HIVEMIND_MEMORY_SHARING_STRATEGY": given}
        proc = subprocess.run([sys.executable, "-c", _SHARING], capture_output=True, text=True, timeout=100,
                              env=run_env)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.split()[-1] == expected


def test_simulate_output_in_a_log_file_has_no_carriage_returns(tmp_path):
    proc = subprocess.run(f"{sys.executable} -m checkfree simulate --steps 40 --eval-every 20 --out {tmp_path / 'r'} "
                          f"> {tmp_path / 'log'} 2>&1", shell=True, timeout=100)
    assert proc.returncode == 0
    log = (tmp_path / "log").read_text()
    assert "\r" not in log
    lines = [x for x in log.splitlines() if x.startswith("train ")]
    assert lines[0].startswith("train 2/40 (5%) loss=") and "val=" not in lines[0]  # no val=nan before evaluating
    assert lines[-1].startswith("train 40/40 (100%)") and "val=" in lines[-1]
    assert len(lines) == 20  # one line per 5% of the run


@pytest.mark.parametrize("args, message", [
    (["simulate", "--steps", "-1"], "--steps must be >= 1, got -1"),
    (["local", "--spares", "-1"], "--spares must be >= 0, got -1"),
    (["local", "--heartbeat-ttl", "50"], "ordered --heartbeat-ttl < --rpc-timeout"),
    (["export", "--run", "x", "--output", "/missing/dir/model.safetensors"], "directory '/missing/dir' does not exist"),
    (["simulate", "--save-every", "-2"], "--save-every must be >= 0"),
    (["simulate", "--resume", "/nonexistent-run"], "not a run directory"),
    (["simulate", "--replicas", "0"], "train.replicas must be >= 1, got 0"),
    (["local", "--replicas", "2", "--strategy", "gemini", "--no-churn"],
     "stage groups (--replicas 2, --reserve None) run in the swarm with the averaging strategies"),
])
def test_bad_input_is_one_line_error(args, message, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("checkfree: error: ") and message in err and "\n" not in err


def test_out_naming_a_file_and_overwriting_an_earlier_run(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    assert main(["simulate", "--out", str(tmp_path / "file")]) == 2
    assert "is a file, not a run directory" in capsys.readouterr().err
    out = str(tmp_path / "r")
    assert main(["simulate", "--steps", "2", "--out", out, "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["simulate", "--steps", "2", "--out", out, "--no-progress"]) == 0
    assert "holds an earlier run; its files are replaced" in capsys.readouterr().err


def test_latin1_corpus_is_read_whole_with_a_warning(tmp_path, caplog):
    from checkfree.data import _local

    text = "Les élèves ont mangé des crêpes à Noël. " * 20
    (tmp_path / "fr.txt").write_bytes(text.encode("latin-1"))
    with caplog.at_level(logging.WARNING):
        (docs,) = _local(tmp_path / "fr.txt")
    assert docs == text and "\ufffd" not in docs
    assert "is not UTF-8" in caplog.text and "Latin-1" in caplog.text


def test_tensorboard_gets_the_metrics_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert main(["simulate", "--steps", "6", "--eval-every", "3", "--out", str(tmp_path / "r"), "--no-progress",
                 "--tensorboard"]) == 0
    events = EventAccumulator(str(tmp_path / "r" / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"loss", "lr", "val_loss", "tokens_per_s", "grad_norms/stage_0", "grad_norms/stage_3"} <= tags
    metrics = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [e.value for e in events.Scalars("loss")] == pytest.approx([m["loss"] for m in metrics])
    assert [e.step for e in events.Scalars("val_loss")] == [2, 5]


@pytest.mark.parametrize("strategy, stages, kills", [("checkfree", 4, [(3, 1), (6, 2)]), ("checkfree+", 4, [(3, 1), (6, 0)]),
                                                     ("checkfree+", 2, [(3, 1), (6, 0)]), ("checkfree", 3, [(3, 1), (6, 1)]),
                                                     ("checkfree", 2, None)])
def test_demo_churn_only_kills_stages_the_strategy_recovers(tmp_path, capsys, strategy, stages, kills):
    from checkfree.config import preset
    from checkfree.failures import read_trace
    from swarm.local_cli import demo_trace

    cfg = preset("tiny")
    cfg.num_stages, cfg.train.num_steps, cfg.recovery.strategy = stages, 10, strategy
    trace = demo_trace(cfg, tmp_path / "demo.csv")
    if kills is None:
        assert trace is None and "no demo churn" in capsys.readouterr().out
    else:
        assert read_trace(trace, stages) == kills


def test_set_reaches_every_config_key_with_typed_checks(capsys):
    """Flags and --set go through one mapping into the typed config tree: a flag and the key it names set the
    same field, --set reaches keys without a flag, typos and wrong types are one-line errors."""
    import json as _json

    assert main(["simulate", "--print-config", "--lr", "0.25", "--bf16", "--protect-edges", "no",
                 "--set", "train.weight_decay=0.5", "--set", "model.num_kv_heads=2", "--set", "train.betas=[0.8,0.9]"]) == 0
    cfg = _json.loads(capsys.readouterr().out)
    assert cfg["train"]["lr"] == 0.25 and cfg["train"]["autocast_bf16"] is True
    assert cfg["failures"]["protect_edges"] is False and cfg["train"]["weight_decay"] == 0.5
    assert cfg["model"]["num_kv_heads"] == 2 and cfg["train"]["betas"] == [0.8, 0.9]
    assert main(["simulate", "--print-config", "--lr", "0.25", "--set", "train.lr=0.5"]) == 0  # --set comes last
    assert _json.loads(capsys.readouterr().out)["train"]["lr"] == 0.5
    for bad, message in ((["--set", "train.lrr=1"], "Key 'lrr' not in 'TrainConfig'. Did you mean: 'lr'?"),
                         (["--set", "train.lr=fast"], "Value 'fast' of type 'str' could not be converted to Float"),
                         (["--set", "lr"], "--set expects KEY=VALUE"),
                         (["--set", "model.num_heads=3"], "not divisible by num_heads=3")):
        assert main(["simulate", "--print-config", *bad]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_help_names_each_flags_config_key_and_default():
    from checkfree.flags import CONFIG_FLAGS, DEFAULT_PRESET
    from checkfree.config import preset

    text = " ".join(build_parser()._subparsers._group_actions[0].choices["simulate"].format_help().split())
    assert len(CONFIG_FLAGS) > 40
    for key, _ in CONFIG_FLAGS.values():
        value = preset(DEFAULT_PRESET)
        for part in key.split("."):
            value = getattr(value, part)
        shown = "none" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
        assert f"[{key}; {DEFAULT_PRESET}: {shown}]" in text, key
