"""`checkfree plot`: PNGs of a simulator run and of a swarm run with failures (the in-process tier), and one-line
errors for what is not a run directory."""

from __future__ import annotations

import copy
import json

import matplotlib.image
import pytest

from checkfree.data import build_data
from checkfree.failures import FailureSchedule
from checkfree.plot import event_marks, plot_run, read_run
from checkfree.simulator import Simulator
from cli.main import main
from harness.inprocess import run_swarm

pytestmark = pytest.mark.timeout(240)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _tiny(tiny_cfg, steps: int):
    cfg = copy.deepcopy(tiny_cfg)
    cfg.train.num_steps, cfg.train.eval_every = steps, 2
    return cfg


def _assert_png(path) -> None:
    assert path.read_bytes()[:8] == PNG_MAGIC, path
    height, width, _ = matplotlib.image.imread(path).shape  # decodes the whole image
    assert width > 200 and height > 100, (path, width, height)


def test_plot_of_a_simulator_run_says_it_has_no_wire_bytes(tiny_cfg, tmp_path, capsys):
    Simulator(_tiny(tiny_cfg, 4), tmp_path / "sim", progress=False).run()
    assert main(["plot", str(tmp_path / "sim")]) == 0
    out = capsys.readouterr().out
    for name in ("loss.png", "step_time.png"):
        _assert_png(tmp_path / "sim" / "plots" / name)
        assert f"wrote {tmp_path / 'sim' / 'plots' / name}" in out
    assert not (tmp_path / "sim" / "plots" / "wire_bytes.png").exists()
    assert "no wire_bytes in metrics.jsonl (a simulator run" in out


def test_plot_of_a_swarm_run_with_failures_marks_them(tiny_cfg, tmp_path):
    """The in-process swarm (real coordinator and peers) loses stage 1 at step 2 and stage 2 at step 4."""
    cfg = _tiny(tiny_cfg, 6)
    build_data(cfg.data, vocab_size=cfg.model.vocab_size, context_length=cfg.model.context_length,  # as `local` does:
               seed=cfg.train.seed, microbatch_size=cfg.train.microbatch_size, progress=False)  # once, not per peer
    run_swarm(cfg, tmp_path / "swarm", peers=cfg.num_stages + 2, kills=FailureSchedule([(2, 1), (4, 2)]),
              save_final=False)
    written, notes = plot_run(tmp_path / "swarm", tmp_path / "png")
    assert [p.name for p in written] == ["loss.png", "step_time.png", "wire_bytes.png"] and notes == []
    for path in written:
        _assert_png(path)
    marks = event_marks(read_run(tmp_path / "swarm"))
    assert marks["failure"] == [(2, 1), (4, 2)]
    assert marks["recovery"] == [(2, 1), (4, 2)]


def test_a_resumed_runs_repeated_steps_are_plotted_once(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    lines = [{"step": 0, "loss": 5.0}, {"step": 1, "loss": "nan"}, {"step": 1, "loss": 4.0}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"step": 2, "lo')
    records = read_run(run)
    assert [(m["step"], m["loss"]) for m in records.metrics] == [(0, 5.0), (1, 4.0)]  # the cut last line dropped
    assert records.events == []


@pytest.mark.parametrize("case, message", [
    ("missing", "no such run directory"),
    ("file", "not a directory"),
    ("empty", "no metrics.jsonl: not a run directory"),
    ("no-steps", "metrics.jsonl has no step records yet: nothing to plot"),
    ("bad-line", "metrics.jsonl:1: not a JSON line"),
])
def test_what_is_not_a_run_directory_is_a_one_line_error(tmp_path, capsys, case, message):
    run = tmp_path / "run"
    if case == "file":
        run.write_text("x")
    elif case != "missing":
        run.mkdir()
    if case in ("no-steps", "bad-line"):
        (run / "metrics.jsonl").write_text("" if case == "no-steps" else "{not json\n")
    assert main(["plot", str(run)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("checkfree: error:") and err.count("\n") == 1, err
    assert not (run / "plots").exists() if run.is_dir() else True
