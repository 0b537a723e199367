"""The pretrained-recovery study (`experiments.pretrained`) and what it needs of the library: the training
sequence length as its own setting, an HF model's defaults, the simulator's evaluation right after a rebuild
and its pre-clip norms."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from checkfree.config import ModelConfig
from checkfree.hf import save_hf
from checkfree.model import LlamaModel
from checkfree.rundir import read_jsonl
from cli.main import build_parser, main
from checkfree.flags import config_from_args
from experiments.pretrained import INITS, Run, branch_norms, make_study, run_study, signature
from experiments.pretrained_report import analyse, load_results, render_tables


TEXT = "".join(f"Scene {i}. To be, or not to be, that is the question; whether 'tis nobler in the mind.\n"
               for i in range(600))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small corpus and a token cache of this module's own (the tokenizer is trained once)."""
    root = tmp_path_factory.mktemp("corpus")
    (root / "corpus.txt").write_text(TEXT)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CHECKFREE_CACHE", str(root / "cache"))
        yield str(root / "corpus.txt")


def _sim(tmp: Path, corpus: str, *flags: str) -> Path:
    out = tmp / "run"
    assert main(["simulate", "--preset", "tiny", "--data", corpus, "--no-progress", "--out", str(out), *flags]) == 0
    return out


def test_seq_len_is_its_own_setting(corpus, tmp_path, capsys):
    out = _sim(tmp_path, corpus, "--steps", "2", "--seq-len", "16", "--eval-every", "0")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model"]["context_length"] == 32 and cfg["train"]["seq_len"] == 16
    m = read_jsonl(out / "metrics.jsonl")[0]
    assert m["tokens_per_s"] == pytest.approx(4 * 8 * 16 / m["step_time_s"], rel=1e-3)  # 16 tokens a sequence
    capsys.readouterr()
    assert main(["simulate", "--preset", "tiny", "--seq-len", "33", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert "--seq-len must be in 1..32" in err and len(err.splitlines()) == 1


def test_hf_model_defaults_are_for_fine_tuning(tmp_path):
    cfg = ModelConfig(vocab_size=64, d_model=16, num_heads=2, num_layers=2, context_length=4096)
    save_hf(cfg, LlamaModel(cfg).state_dict(), tmp_path / "hf")
    args = build_parser().parse_args(["simulate", "--init-from", str(tmp_path / "hf"), "--stages", "2"])
    run = config_from_args(args)
    assert (run.model.context_length, run.seq_len, run.train.lr) == (4096, 256, 1e-4)
    args = build_parser().parse_args(["simulate", "--init-from", str(tmp_path / "hf"), "--stages", "2",
                                      "--seq-len", "64", "--lr", "3e-4"])
    run = config_from_args(args)
    assert (run.seq_len, run.train.lr) == (64, 3e-4)


def test_simulator_evaluates_right_after_a_recovery(corpus, tmp_path):
    (tmp_path / "trace.csv").write_text("3,1\n")
    out = _sim(tmp_path, corpus, "--steps", "5", "--trace", str(tmp_path / "trace.csv"), "--save-every", "3",
               "--set", "train.eval_after_recovery=true")
    events = [e for e in read_jsonl(out / "events.jsonl") if e["event"] == "recovered_eval"]
    assert [(e["step"], e["stages"]) for e in events] == [(3, [1])] and events[0]["val_loss"] > 0
    # the same rebuild from the save at step 3, without training: the same damage, bit for bit
    import shutil

    from checkfree.config import config_from_dict
    from checkfree.simulator import Simulator

    shutil.copytree(out / "saves", tmp_path / "again" / "saves")
    cfg = config_from_dict(json.loads((out / "config.json").read_text()))
    assert Simulator(cfg, tmp_path / "again", progress=False, resume=True).rebuild_and_evaluate({1}) == \
        events[0]["val_loss"]
    assert json.loads((tmp_path / "again" / "summary.json").read_text())["status"] == "completed"
    m = read_jsonl(out / "metrics.jsonl")[0]
    assert all(pre >= post for pre, post in zip(m["grad_norms_pre"], m["grad_norms"]))
    assert all(pre >= post for pre, post in zip(m["block_grad_norms_pre"], m["block_grad_norms"]))


def test_omega_variants_and_coincident_inits():
    line = {"grad_norms_pre": [3.0, 2.0, 0.5, 4.0], "grad_norms": [1.0, 1.0, 0.5, 1.0],
            "block_grad_norms_pre": [1.5, 2.0, 0.5, 2.0], "block_grad_norms": [0.5, 1.0, 0.5, 0.5]}
    by = {i.label: i for i in INITS}
    assert branch_norms(line, by["checkfree pre/stage"]) == [3.0, 2.0, 0.5, 4.0]
    assert branch_norms(line, by["checkfree post/blocks"]) == [0.5, 1.0, 0.5, 0.5]
    sig = {label: signature(by[label], 1, branch_norms(line, by[label]), 4, seed=0) for label in by
           if by[label].strategy != "identity"}
    # stage 1's neighbours 0 and 2: both clipped post-clip over the stage? 1.0 vs 0.5: no; over the blocks 0.5/0.5: yes
    assert sig["checkfree post/blocks"] == sig["uniform"] != sig["checkfree post/stage"]
    assert sig["random"] != signature(by["random"], 1, [0.0] * 4, 4, seed=1)  # drawn from the seed
    # two stages that clipped: post-clip norms max_norm * pre / (pre + 1e-6), equal to ~1e-7: the same rebuild
    clipped = {"grad_norms_pre": [1.92, 2.0, 1.21, 0.5], "grad_norms": [1.92 / (1.92 + 1e-6), 1.0, 1.21 / (1.21 + 1e-6), 0.5],
               "block_grad_norms_pre": [1.0] * 4, "block_grad_norms": [1.0] * 4}
    assert signature(by["checkfree post/stage"], 1, branch_norms(clipped, by["checkfree post/stage"]), 4, 0) == \
        sig["uniform"]


@pytest.mark.processes  # the study's runs go to a process pool
def test_tiny_study_end_to_end_resumes_and_renders(corpus, tmp_path):
    study = make_study("tiny", seeds=[0, 1], curve_stages=[1], inits=["uniform", "checkfree post/stage", "copy",
                                                                      "random"])
    study.base["data"]["source"] = corpus
    logs: list[str] = []
    results = run_study(study, tmp_path / "work", tmp_path / "results", log=logs.append)
    data = load_results(results / "results.json")
    assert all(r["status"] == "completed" for r in data["runs"].values()), data["runs"]
    assert (results / "table.md").read_text() == render_tables(data)
    assert (results / "damage-at4.png").is_file() and (results / "recovery-at4.png").is_file()
    a = analyse(data)
    cells = {(c["init"], c["stage"], c["seed"]): c for c in a["cells"]}
    assert {c["trunk"] for c in a["cells"]} == {"plain", "plus"}
    # the deterministic inits' damage does not depend on the data order: one run serves both seeds
    assert cells[("copy", 2, 0)]["run"] == cells[("copy", 2, 1)]["run"]
    assert cells[("random", 2, 0)]["run"] != cells[("random", 2, 1)]["run"]
    for c in a["cells"]:
        assert c["damage"] is not None and (c["gaps"] is not None) == (c["stage"] == 1 or c["trunk"] == "plus")
    assert cells[("uniform", 1, 0)]["gaps"][0][0] == study.eval_every  # a curve's first gap: eval_every steps on
    # started again: every run reused
    logs.clear()
    run_study(study, tmp_path / "work", tmp_path / "results", log=logs.append)
    assert any("0 to run" in line for line in logs), logs
    assert not list((tmp_path / "work").rglob("saves/step-*/stage-0.bin"))[2:]  # only the two trunks keep saves


@pytest.mark.processes  # it starts OS processes (the quick tier's watch saw them: docs/testing.md)
def test_a_study_restores_stages_from_snap_copies_made_from_the_trunk_age_steps_before(corpus, tmp_path):
    """The snap inits: the trunk also saves the steps the copies are made from (branch point minus age); a branch
    restores the failed stage from its copy of that step (the recovery event says which), a copy of the current
    step damages less than CheckFree's rebuild, and the curve of a copy trains on with its snapshot period."""
    from checkfree.rundir import read_jsonl
    from experiments.pretrained import copy_steps

    study = make_study("tiny", seeds=[0], curve_stages=[1], plus_steps=0, inits=[
        "checkfree post/stage", "snap int8 age 1", "snap int4 age 0"])
    study.base["data"]["source"] = corpus
    assert copy_steps(study) == [3, 4]
    results = run_study(study, tmp_path / "work", tmp_path / "results", log=lambda m: None)
    data = load_results(results / "results.json")
    assert all(r["status"] == "completed" for r in data["runs"].values()), data["runs"]
    cells = {(c["init"], c["stage"]): c for c in analyse(data)["cells"]}
    for (init, stage), c in cells.items():
        if init.startswith("snap"):
            events = [e for e in read_jsonl(tmp_path / "work" / "runs" / c["run"] / "events.jsonl")
                      if e["event"] == "recovery"]
            assert [(e["method"], e["snapshot_step"]) for e in events][:1] == [
                ("snapshot", 4 - int(init.split("age ")[1]))], (init, stage)
    assert cells[("snap int4 age 0", 2)]["damage"] < cells[("checkfree post/stage", 2)]["damage"]
    assert cells[("snap int8 age 1", 1)]["gaps"]


def test_run_names_are_distinct():
    runs = {Run("s", "curve", "plain", 4, seed, init.label, stage, 4).name for seed in (0, 1) for init in INITS
            for stage in (1, 2)}
    assert len(runs) == 2 * len(INITS) * 2


def test_docs_results_are_rendered_from_the_result_files():
    """docs/pretrained.md's results block is `render_section` of the committed results, byte for byte."""
    from experiments.pretrained_report import SECTION_BEGIN, SECTION_END, render_section

    root = Path(__file__).resolve().parent.parent
    docs = (root / "docs" / "pretrained.md").read_text()
    block = docs.split(SECTION_BEGIN, 1)[1].split(SECTION_END, 1)[0]
    expected = render_section(root / "experiments" / "results" / "pretrained", "../experiments/results/pretrained/")
    assert expected and block == f"\n\n{expected}\n"


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:  # gone meanwhile
        return b""


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_sigterm_ends_the_study_with_its_pool_workers(tmp_path):
    """SIGTERM (what `timeout`, systemd and CI send) to `checkfree experiment pretrained --jobs 2` ends the study
    and the pool's worker processes with it: they were left running, orphaned, until their run ended (seconds here,
    hours for SmolLM2's). Ended with the study, they are gone within 2 s of its exit; left alone, they were not."""
    import contextlib
    import os
    import signal
    import subprocess
    import sys
    import time

    from checkfree.net.lifeline import outliving, process_tree

    env = {**os.environ, "CHECKFREE_CACHE": str(tmp_path / "cache")}
    proc = subprocess.Popen([sys.executable, "-m", "checkfree", "experiment", "pretrained", "--study", "tiny",
                             "--jobs", "2", "--work", str(tmp_path / "work"), "--results", str(tmp_path / "results")],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline, seen = time.monotonic() + 240, set()
        while len(seen) < 2 and proc.poll() is None and time.monotonic() < deadline:
            seen = {p for p in process_tree(proc.pid) if b"spawn_main" in _cmdline(p)}
            time.sleep(0.2)  # polling for the pool's workers (a condition, bounded), not a wait for readiness
        assert len(seen) >= 2, f"no pool workers seen; the study printed:\n{proc.stdout.read() if proc.poll() is not None else ''}"
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        assert not outliving(seen, timeout=2.0), "the pool's workers outlived the study"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        for p in seen:  # (only if the test failed: nothing is left to end otherwise)
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)


def test_paired_intervals():
    """The crossed bootstrap draws trunks and sequences; a difference every unit shares is its own interval; the
    t interval over seeds; an order is stated only where the interval lies below 0."""
    import numpy as np

    from experiments.paired import crossed_interval, seed_interval
    from experiments.pretrained_report import ordered

    rng = np.random.default_rng(0)
    d = rng.normal(0.5, 0.1, (3, 200))
    iv = crossed_interval(d)
    assert iv.lo < 0.5 < iv.hi and iv.above and iv.n == 600 and crossed_interval(d) == iv  # seeded: reproducible
    assert crossed_interval(np.full((2, 5), 0.25)).text() == "+0.250 [+0.250, +0.250]"
    noise = crossed_interval(rng.normal(0.0, 1.0, (1, 50)))
    assert not noise.excludes_zero and "50 sequences" in noise.how
    with pytest.raises(ValueError, match="at least 2 sequences"):
        crossed_interval([[1.0]])
    assert seed_interval([1.0]) is None and seed_interval([0.1, 0.2, 0.3]).lo < 0.2
    a, b, c = (crossed_interval(rng.normal(m, 0.05, (1, 100))) for m in (0.0, 1.0, 1.01))
    diffs = {("a", "b"): crossed_interval(np.full((1, 3), -1.0)), ("b", "c"): crossed_interval([[-0.2, 0.1, 0.0]])}
    assert ordered({"c": c, "a": a, "b": b}, diffs) == "a < b ≈ c"


def test_omega_window_averages_the_last_steps():
    from checkfree.recovery import OmegaWindow

    w = OmegaWindow(3)
    assert [w.add(x) for x in (1.0, 2.0, 6.0, 4.0)] == [1.0, 1.5, 3.0, 4.0]
    assert OmegaWindow(2, start=2.0).add(4.0) == 3.0 and OmegaWindow().add(5.0) == 5.0
    with pytest.raises(ValueError, match="omega_window"):
        OmegaWindow(0)
    line = {"grad_norms_pre": [2.0, 2.0], "grad_norms": [1.0, 1.0], "block_grad_norms_pre": [1.0, 1.0],
            "block_grad_norms": [1.0, 1.0]}
    other = {**line, "grad_norms": [0.5, 0.25]}
    assert branch_norms([line, other], INITS[1]) == [0.75, 0.625]  # checkfree post/stage over a window of 2


def test_omega_window_and_own_optimizer_in_the_simulator(corpus, tmp_path):
    """--omega-window N: the recovery's coefficients are the window's means of the neighbours' omegas (as their
    metrics lines recorded them); recovery.optimizer own: the rebuilt stage starts with the Adam moments the executor
    holds for it, and warns when it holds none."""
    (tmp_path / "trace.csv").write_text("4,1\n")
    out = _sim(tmp_path, corpus, "--steps", "5", "--trace", str(tmp_path / "trace.csv"), "--omega-window", "3",
               "--eval-every", "0")
    lines = read_jsonl(out / "metrics.jsonl")
    rec = next(e for e in read_jsonl(out / "events.jsonl") if e["event"] == "recovery")
    prev, nxt = (sum(m["grad_norms"][s] for m in lines[1:4]) / 3 for s in (0, 2))
    a, b = nxt + 1e-4, prev + 1e-4
    assert rec["coefficients"] == pytest.approx([b / (a + b), a / (a + b)], rel=1e-6)

    from checkfree.config import preset
    from checkfree.simulator import Simulator

    cfg = preset("tiny")
    cfg.data.source, cfg.train.num_steps, cfg.train.eval_every = corpus, 3, 0
    cfg.recovery.strategy, cfg.recovery.optimizer = "random", "own"
    cfg.failures.trace = str(tmp_path / "t2.csv")
    (tmp_path / "t2.csv").write_text("2,1\n")
    sim = Simulator(cfg, tmp_path / "own", progress=False)
    sim.train_step(0)
    kept = sim.workers[1].optimizer_state("blocks.")
    sim.executor.own_optimizer[1] = kept
    sim.recover(1, {1})
    got = sim.workers[1].optimizer_state("blocks.")
    assert set(got) == set(kept) and all(torch.equal(got[k]["exp_avg"], kept[k]["exp_avg"]) for k in kept)
    assert not sim.workers[1].optimizer_state("embed.")  # nothing else kept
    sim.executor.own_optimizer.clear()
    sim.recover(2, {2})
    assert not sim.workers[2].optimizer_state("blocks.")
    sim.writer.close()
    assert any(e["event"] == "warning" and e["stage"] == 2 for e in read_jsonl(tmp_path / "own" / "events.jsonl"))


def _kjv_db(path: Path) -> Path:
    """A KJV database of the package's schema, two short books (the real one is 15 MB)."""
    import sqlite3

    con = sqlite3.connect(path)
    con.execute("CREATE TABLE Bible(TestamentID INT, BookID INT, ChapterID INT, VerseID INT, Index_ TEXT, "
                "IndexTypeID INT, NumParagraphs INT, Passage1 TEXT, Passage2 TEXT)")
    for book in (1, 2):
        for v in range(1, 120):
            con.execute("INSERT INTO Bible VALUES (1, ?, 1, ?, ?, 0, 1, ?, '')",
                        (book, v, f"1:{v}", f"1:{v} And the LORD spake unto Moses, saying, this is verse {v}."))
    con.commit()
    con.close()
    return path


def test_heldout_sets_are_the_same_tokens_every_time(corpus, tmp_path):
    from checkfree.config import preset
    from checkfree.data import DataError
    from experiments.heldout import build_heldout, kjv_text

    db = _kjv_db(tmp_path / "kjv.db")
    assert kjv_text(db)[0].startswith("And the LORD spake unto Moses, saying, this is verse 1.\nAnd")  # no "1:1"
    cfg = preset("tiny")
    cfg.data.source = corpus
    h = build_heldout(cfg, tokens=320, kjv_path=db)
    again = build_heldout(cfg, tokens=320, kjv_path=db)
    assert h.describe() == {"val": {"sequences": 10, "tokens": 320}, "kjv": {"sequences": 10, "tokens": 320}}
    assert all(torch.equal(h.sequences[c], again.sequences[c]) for c in h.sequences)
    with pytest.raises(DataError, match="does not exist"):
        build_heldout(cfg, tokens=320, kjv_path=tmp_path / "missing.db")
    with pytest.raises(ValueError, match="held-out corpora"):
        build_heldout(cfg, ["wiki"])


@pytest.mark.processes  # (it starts OS processes: the quick tier's watch saw them, docs/testing.md)
def test_tiny_paired_study_ranks_only_where_the_interval_excludes_zero(corpus, tmp_path):
    """Two trunks, paired held-out evaluation on both corpora: every cell's damage with its interval, the paired
    differences, the curves' steps back inside the interval of zero and their areas; the own-Adam init coincides
    with random for the immediate damage (the optimizer only matters once it trains) and not on the curve."""
    import re

    from experiments.paired import Interval
    from experiments.pretrained_report import ordered, paired_analysis

    study = make_study("tiny-paired")
    study.base["data"]["source"] = corpus
    study.heldout["kjv_path"] = str(_kjv_db(tmp_path / "kjv.db"))
    results = run_study(study, tmp_path / "work", tmp_path / "results", log=lambda *_: None)
    data = load_results(results / "results.json")
    assert all(r["status"] == "completed" for r in data["runs"].values())
    assert data["heldout"] == {"val": {"sequences": 20, "tokens": 640}, "kjv": {"sequences": 20, "tokens": 640}}
    p = paired_analysis(data)
    assert set(p["damage"]) == {(10, k, c) for k in (1, 2) for c in ("val", "kjv")}
    assert all(isinstance(iv, Interval) and iv.n == 40 for v in p["damage"].values() for iv in v.values())
    assert {key[2] for key in p["curves"]} == set(study.inits) and all(c["gaps"][0][0] == 0 for c in p["curves"].values())
    cells = {(c["init"], c["stage"], c["trunk_seed"]): c for c in data["cells"]}
    assert cells[("random own-adam", 1, 0)]["coincides_with"] == "random"
    assert cells[("random own-adam", 2, 0)]["coincides_with"] is None
    text = (results / "table.md").read_text()
    for key, v in p["damage"].items():  # every "<" of an order rests on a paired interval below 0, every "≈" on one with 0
        line = ordered(v, p["diffs"][key])
        names, ops = re.split(r" [<≈] ", line), re.findall(r" ([<≈]) ", line)
        assert len(names) == len(v) and line in text
        for a, op, b in zip(names, ops, names[1:]):
            assert (op == "<") == p["diffs"][key][(a, b)].below
