"""Fault-tolerance strategies on one deterministic CPU trace (tiny preset, few steps).

The lossless strategies must end with exactly the weights of a failure-free run that took
the same number of effective steps; the others must at least report the same figures.
"""

from __future__ import annotations

import ast
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from checkfree import costmodel
from cli.main import main as cli_main
from checkfree.failures import write_trace
from checkfree.recovery import UnrecoverableFailure
from checkfree.rundir import read_jsonl
from checkfree.simulator import Simulator
from checkfree.strategies import STRATEGIES, Strategy
from checkfree.strategies.state import capture_worker, optim_from_wire, optim_to_wire

STEPS = 8
FIGURES = ("stall_s", "bytes_moved", "extra_memory_bytes", "lost_steps", "recovery_s", "simulated_hours")
LOSSLESS = ("checkpoint", "redundant", "gemini", "reft", "baft")
# Failures by iteration: 1 (before any snapshot: back to the initial state), 6, and 7 (stage 0,
# an edge: plain CheckFree falls back). Snapshots / checkpoints every 2 steps.
TRACE = [(1, 1), (6, 2), (7, 0)]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Two shared cores: one intra-op thread is several times faster under load."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _cfg(base, tmp, *, strategy="checkfree", trace=None, steps=STEPS, **strategy_fields):
    cfg = replace(base, train=replace(base.train, num_steps=steps, num_microbatches=2, microbatch_size=4, eval_every=0),
                  recovery=replace(base.recovery, strategy=strategy, fallback="copy"),
                  strategy=replace(base.strategy, **{"checkpoint_every": 2, "snapshot_every": 2, **strategy_fields}),
                  failures=replace(base.failures))
    if trace is not None:
        path = tmp / f"trace-{len(list(tmp.iterdir()))}.csv"
        write_trace(path, trace)
        cfg.failures.trace = str(path)
    return cfg


def _run(cfg, out):
    sim = Simulator(cfg, out, progress=False)
    return sim, sim.run()


def _states(sim):
    return [{k: v.clone() for k, v in w.state_dict().items()} for w in sim.workers]


def _assert_same_weights(a, b, label):
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.keys() == y.keys()
        for k in x:
            assert torch.equal(x[k], y[k]), f"{label}: stage {i} {k} differs"


@pytest.fixture(scope="module")
def replay(tiny_cfg_module, tmp_path_factory):
    """The failure-free reference and every strategy on TRACE."""
    tmp = tmp_path_factory.mktemp("replay")
    ref, _ = _run(_cfg(tiny_cfg_module, tmp, strategy="checkpoint"), tmp / "reference")
    runs = {}
    for name in sorted(STRATEGIES):
        sim, summary = _run(_cfg(tiny_cfg_module, tmp, strategy=name, trace=TRACE), tmp / name)
        runs[name] = (_states(sim), summary, tmp / name)
    return _states(ref), runs


@pytest.fixture(scope="module")
def tiny_cfg_module(session_cache):
    from checkfree.config import preset

    cfg = preset("tiny")
    cfg.data.cache_dir = session_cache
    return cfg


@pytest.mark.parametrize("name", LOSSLESS)
def test_lossless_strategy_matches_failure_free_run(replay, name):
    ref, runs = replay
    states, summary, out = runs[name]
    assert summary["status"] == "completed" and summary["failures"] == 3 and summary["fallbacks"] == 0
    _assert_same_weights(states, ref, name)
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["iteration"] for m in metrics] == list(range(len(metrics)))
    assert len(metrics) == STEPS + summary["lost_steps"] and metrics[-1]["step"] == STEPS - 1
    if name == "redundant":
        assert summary["lost_steps"] == 0 and summary["stall_s"] > 0
    else:
        assert summary["lost_steps"] > 0


def test_every_strategy_reports_the_figures_side_by_side(replay):
    _, runs = replay
    table = {}
    for name, (_, summary, out) in runs.items():
        assert summary["status"] == "completed", name
        for key in FIGURES:
            assert isinstance(summary[key], (int, float)) and summary[key] >= 0, (name, key)
        table[name] = {k: summary[k] for k in FIGURES}
        outcomes = [e for e in read_jsonl(out / "events.jsonl") if e["event"] == "failure_outcome"]
        assert len(outcomes) == 3 and all({"recovery_s", "bytes_moved", "lost_steps"} <= e.keys() for e in outcomes)
        times = [m["sim_time_s"] for m in read_jsonl(out / "metrics.jsonl")]
        assert times == sorted(times) and summary["simulated_hours"] == pytest.approx(summary["sim_time_s"] / 3600)
    assert table["checkfree"]["extra_memory_bytes"] == 0 and table["checkfree"]["lost_steps"] == 0
    assert table["redundant"]["extra_memory_bytes"] > 0 and table["gemini"]["extra_memory_bytes"] > 0
    assert runs["checkfree"][1]["fallbacks"] == 1  # plain CheckFree cannot rebuild stage 0
    assert runs["checkfree+snap"][1]["fallbacks"] == 0


def test_checkpoint_writes_complete_files_and_recomputes_lost_steps(replay):
    _, runs = replay
    _, summary, out = runs["checkpoint"]
    dirs = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert dirs == [f"step-{STEPS:08d}"]  # only the last complete checkpoint is kept
    assert sorted(p.name for p in (out / "checkpoints" / dirs[0]).iterdir()) == [f"stage-{i}.bin" for i in range(4)]
    outcomes = [e for e in read_jsonl(out / "events.jsonl") if e["event"] == "failure_outcome"]
    assert [(o["iteration"], o["step"], o["rollback_to"], o["lost_steps"]) for o in outcomes] == [
        (1, 1, 0, 1), (6, 5, 4, 1), (7, 5, 4, 1)]
    assert [m["step"] for m in read_jsonl(out / "metrics.jsonl")] == [0, 0, 1, 2, 3, 4, 4, 4, 5, 6, 7]
    assert summary["lost_steps"] == 3 and summary["iterations"] == 11


def test_redundant_two_adjacent_failures_go_to_fallback(tiny_cfg_module, tmp_path):
    cfg = _cfg(tiny_cfg_module, tmp_path, strategy="redundant", trace=[(2, 1), (2, 2)], steps=3)
    cfg.recovery.fallback = "abort"
    with pytest.raises(UnrecoverableFailure, match="replica holder 1 failed"):
        _run(cfg, tmp_path / "abort")
    cfg.recovery.fallback = "random"
    _, summary = _run(cfg, tmp_path / "random")
    events = read_jsonl(tmp_path / "random" / "events.jsonl")
    assert [(e["event"], e["stage"], e.get("method")) for e in events if e["event"] in ("recovery", "fallback")] == [
        ("recovery", 1, "promote-replica"), ("fallback", 2, "random")]
    assert summary["fallbacks"] == 1 and summary["status"] == "completed"


def test_gemini_whole_group_lost_falls_back_to_checkpoint_storage(replay, tiny_cfg_module, tmp_path):
    ref, _ = replay
    # m = 2 over 4 peers: groups {0, 1} and {2, 3}; both of the first group fail at step 5
    cfg = _cfg(tiny_cfg_module, tmp_path, strategy="gemini", trace=[(5, 0), (5, 1)], storage_fallback=True,
               checkpoint_every=4, snapshot_every=1)
    sim, summary = _run(cfg, tmp_path / "g")
    (outcome,) = [e for e in read_jsonl(tmp_path / "g" / "events.jsonl") if e["event"] == "failure_outcome"]
    assert outcome["fallback"] == "checkpoint" and outcome["rollback_to"] == 4 and outcome["lost_steps"] == 1
    _assert_same_weights(_states(sim), ref, "gemini via storage")
    cfg.strategy.storage_fallback = False
    cfg.recovery.fallback = "abort"
    with pytest.raises(UnrecoverableFailure, match=r"every holder of stage\(s\) 0 \[0, 1\]"):
        _run(cfg, tmp_path / "abort")


def test_reft_two_losses_in_one_group_go_to_fallback(tiny_cfg_module, tmp_path):
    cfg = _cfg(tiny_cfg_module, tmp_path, strategy="reft", trace=[(3, 2), (3, 3)], reft_group=2, steps=4)
    cfg.recovery.fallback = "abort"
    with pytest.raises(UnrecoverableFailure, match="parity group"):
        _run(cfg, tmp_path / "abort")
    cfg.recovery.fallback = "copy"
    _, summary = _run(cfg, tmp_path / "copy")
    assert summary["fallbacks"] == 2 and summary["status"] == "completed"


def test_reft_one_loss_per_group_is_bit_exact(replay, tiny_cfg_module, tmp_path):
    ref, _ = replay
    cfg = _cfg(tiny_cfg_module, tmp_path, strategy="reft", trace=[(5, 0), (5, 3)], reft_group=2)
    sim, summary = _run(cfg, tmp_path / "r")
    assert summary["fallbacks"] == 0 and summary["lost_steps"] == 1
    _assert_same_weights(_states(sim), ref, "reft, one loss in each of two groups")


def test_baft_spreads_backup_over_steps_when_bubbles_are_short(replay, tiny_cfg_module, tmp_path, monkeypatch):
    ref, _ = replay
    geo = costmodel.get_profile("paper-geo")
    slow = replace(geo, bandwidth_Bps=tuple(tuple(b / 500 for b in row) for row in geo.bandwidth_Bps))
    monkeypatch.setitem(costmodel.PROFILES, "slow", lambda: slow)
    cfg = _cfg(tiny_cfg_module, tmp_path, strategy="baft", trace=[(6, 2)], cost_profile="slow", baft_max_iterations=8)
    sim, summary = _run(cfg, tmp_path / "b")
    n = sim.strategy.rounds
    assert n > 1
    assert n <= summary["lost_steps"] <= 2 * n - 1
    _assert_same_weights(_states(sim), ref, "baft over several steps")
    cfg.strategy.baft_max_iterations = 1
    with pytest.raises(ValueError, match="baft-max-iterations"):
        _run(cfg, tmp_path / "too-short")


def test_hybrid_restores_from_snapshot_without_rollback(tiny_cfg_module, tmp_path):
    cfg = _cfg(tiny_cfg_module, tmp_path, strategy="checkfree+snap", snapshot_every=3)
    sim = Simulator(cfg, tmp_path / "h", progress=False)
    try:
        for step in range(3):
            sim.train_step(step)
            sim.executor.after_step(step)  # snapshot after step 2 (resumes at 3)
        at3 = _states(sim)
        for step in range(3, 5):
            sim.train_step(step)
            sim.executor.after_step(step)
        at5 = _states(sim)
        assert sim.recover(5, {1}) == 5  # no rollback
        now = _states(sim)
        assert all(torch.equal(now[1][k], at3[1][k]) for k in now[1] if k.startswith("blocks."))
        assert all(torch.equal(now[1][k], at5[0][k]) for k in now[1] if k.startswith("embed."))  # live co-holder
        for s in (0, 2, 3):
            assert all(torch.equal(now[s][k], at5[s][k]) for k in now[s])
        # adjacent failures: stage 1's holder is stage 2, also gone, so 1 is averaged from 0 and
        # the snapshot-restored 2 (its holder 3 is alive)
        assert sim.recover(5, {1, 2}) == 5
        after = _states(sim)
        assert all(torch.equal(after[2][k], at3[2][k]) for k in after[2] if k.startswith("blocks."))
        assert all(torch.equal(after[2][k], at5[3][k]) for k in after[2] if k.startswith("head."))
    finally:
        sim.writer.close()
    events = read_jsonl(tmp_path / "h" / "events.jsonl")
    rec = [(e["stage"], e["method"], e.get("sources")) for e in events if e["event"] in ("recovery", "fallback")]
    assert rec == [(1, "snapshot", None), (2, "snapshot", None), (1, "average", [0, 2])]


def test_hybrid_averages_when_no_snapshot_yet(tiny_cfg_module, tmp_path):
    cfg = _cfg(tiny_cfg_module, tmp_path, strategy="checkfree+snap", trace=[(1, 2), (4, 2)], snapshot_every=3, steps=5)
    _, summary = _run(cfg, tmp_path / "h")
    rec = [e for e in read_jsonl(tmp_path / "h" / "events.jsonl") if e["event"] == "recovery"]
    assert [(e["step"], e["method"]) for e in rec] == [(1, "average"), (4, "snapshot")]
    assert summary["lost_steps"] == 0 and summary["iterations"] == 5


def test_cli_simulate_with_checkpoint_strategy(tiny_cfg_module, tmp_path, capsys):
    trace = tmp_path / "t.csv"
    write_trace(trace, [(3, 1)])
    (tmp_path / "base.json").write_text(tiny_cfg_module.to_json())
    code = cli_main(["simulate", "--config", str(tmp_path / "base.json"), "--strategy", "checkpoint",
                     "--checkpoint-every", "2", "--steps", "4", "--microbatches", "2", "--microbatch-size", "4",
                     "--trace", str(trace), "--cost-profile", "local", "--out", str(tmp_path / "run"), "--no-progress"])
    assert code == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["strategy"] == "checkpoint" and summary["lost_steps"] == 1 and summary["cost_profile"] == "local"
    assert json.loads((tmp_path / "run" / "config.json").read_text())["strategy"]["checkpoint_every"] == 2
    assert (tmp_path / "run" / "checkpoints" / "step-00000004" / "stage-3.bin").is_file()
    assert cli_main(["simulate", "--strategy", "bogus", "--out", str(tmp_path / "x")]) == 2


def test_capture_restore_is_lossless_with_several_param_groups(tiny_cfg_module, tmp_path):
    """CheckFree+ workers have one optimizer group per replicated component, the rebuilt
    stage 0 a different LR in its main group: a snapshot restored on new peers resumes
    exactly (weights, Adam state, groups' LR)."""
    cfg = _cfg(tiny_cfg_module, tmp_path, strategy="checkfree+")
    sim = Simulator(cfg, tmp_path / "s", progress=False)
    try:
        for step in range(3):
            if step == 1:
                sim.recover(step, {0})
            sim.train_step(step)
        snaps = [sim.ctx.capture(s, 3) for s in range(4)]
        assert [g["name"] for g in snaps[0]["optim"]["groups"]] == ["main", "embed"]
        assert [g["name"] for g in snaps[2]["optim"]["groups"]] == ["main", "head"]
        assert snaps[0]["lr_scale"] == pytest.approx(1.1)

        def run_on():
            for step in (3, 4):
                sim.train_step(step)
            return _states(sim), [capture_worker(w, 5, 0.0)["optim"] for w in sim.workers]

        first, first_optim = run_on()
        for s in range(4):
            sim.ctx.restore(s, snaps[s], replace=True)
        again, again_optim = run_on()
    finally:
        sim.writer.close()
    _assert_same_weights(again, first, "restored CheckFree+ snapshot")
    for a, b in zip(again_optim, first_optim):
        assert a["groups"] == b["groups"] and a["state"].keys() == b["state"].keys()
        for name, st in a["state"].items():
            assert all(torch.equal(v, b["state"][name][k]) for k, v in st.items()), name


def test_optimizer_state_over_the_wire_is_exact_and_checked(tiny_cfg_module):
    from checkfree.worker import StageWorker

    cfg = replace(tiny_cfg_module, recovery=replace(tiny_cfg_module.recovery, strategy="checkfree+"))
    w = StageWorker(cfg, 3)
    st = {"head.out.weight": {"step": torch.tensor(3.0), "exp_avg": torch.randn(512, 32)},
          "head.norm.weight": {"step": torch.tensor(3.0), "exp_avg": torch.rand(32)}}
    keys, tensors = optim_to_wire(st)
    back = optim_from_wire(keys, tensors)
    assert back.keys() == st.keys() and all(torch.equal(back[n][f], st[n][f]) for n in st for f in st[n])
    w.load_optimizer_state(back)
    assert all(torch.equal(w.optimizer_state("head.")[n][f], st[n][f]) for n in st for f in st[n])
    for bad_keys, bad_tensors, match in (([["a"]], [torch.zeros(1)], "not"), ([["a", "b"]], [], "keys"),
                                         ([["a", "b"], ["a", "b"]], [torch.zeros(1)] * 2, "twice")):
        with pytest.raises(ValueError, match=match):
            optim_from_wire(bad_keys, bad_tensors)
    for bad, match in (({"embed.weight": {"step": torch.tensor(1.0)}}, "does not have"),
                       ({"head.norm.weight": {"exp_avg": torch.zeros(5)}}, "shape"),
                       ({"head.norm.weight": {"exp_avg": torch.full((32,), float("nan"))}}, "not finite")):
        with pytest.raises(ValueError, match=match):
            w.load_optimizer_state(bad)


def _strategy_reads(tree: ast.AST) -> list[tuple[str, int, bool]]:
    """(attribute, line, written) for every `strategy.x` / `<...>.strategy.x` in a module (not the config's
    `cfg.strategy` section)."""
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        base = node.value
        named = (isinstance(base, ast.Name) and base.id == "strategy") or \
            (isinstance(base, ast.Attribute) and base.attr == "strategy")
        if named and not ast.unparse(base).endswith("cfg.strategy"):
            out.append((node.attr, node.lineno, isinstance(node.ctx, (ast.Store, ast.Del))))
    return out


def test_the_runtimes_read_only_what_the_strategy_contract_declares_and_write_none_of_it(tiny_cfg_module):
    """Everything the executors of plans (checkfree/strategies/execute.py, coordinator/protection.py,
    coordinator/recovery_driver.py) and the other runtime modules read from a strategy is declared on `Strategy`: a class
    attribute, a method, or an attribute its __init__ sets. None of them assigns or deletes a strategy's
    attribute (the ownership test covers mutating calls under peers/ and the coordinator's packages (coordinator/,
    swarm/, faults/, ops/))."""
    root = Path(__file__).resolve().parent.parent
    modules = [p for pkg in ("checkfree", "peers", "coordinator", "swarm", "faults", "ops") for p in (root / pkg).rglob("*.py")
               if "strategies" not in p.relative_to(root).parts]
    modules.append(root / "checkfree" / "strategies" / "execute.py")
    declared = set(dir(Strategy)) | set(vars(Strategy(tiny_cfg_module)))
    reads, bad = 0, []
    for path in modules:
        for attr, line, written in _strategy_reads(ast.parse(path.read_text())):
            reads += 1
            where = f"{path.relative_to(root)}:{line}: strategy.{attr}"
            if attr not in declared:
                bad.append(f"{where} is not declared on Strategy")
            if written:
                bad.append(f"{where} is written by a runtime")
    assert reads >= 30 and not bad, "\n".join(bad)
    # the check sees what it should: an undeclared read and a write
    probe = _strategy_reads(ast.parse("self.strategy.plans = None\nstrategy.plan_units(cost, units)\n"
                                      "cfg.strategy.snapshot_every\n"))
    assert probe == [("plans", 1, True), ("plan_units", 2, False)]


def test_baft_sizing_is_a_pure_function_of_the_measured_sizes_planned_once(tiny_cfg_module, tmp_path):
    """`size_backups` returns the plan of every stage's backup from the measured unit sizes and changes nothing;
    the strategy plans from the first backup's sizes (`backup_taken`) and keeps that plan."""
    from checkfree.costmodel import CostModel
    from checkfree.strategies.baft import BaftStrategy, size_backups

    cfg = _cfg(tiny_cfg_module, tmp_path, strategy="baft")
    units = {s: [3000, 2000, 1000] for s in range(cfg.num_stages)}
    sizing = size_backups(cfg, CostModel(cfg), units)
    assert sizing == size_backups(cfg, CostModel(cfg), units) and len(sizing.plans) == cfg.num_stages
    for s in range(cfg.num_stages):  # the parts cover the backup, in order
        bounds = [sizing.part_bounds(s, k) for k in range(sizing.rounds)]
        assert bounds[0][0] == 0 and bounds[-1][1] == 1 and all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    strategy = BaftStrategy(cfg)
    assert strategy.sizing is None and strategy.in_step(1) is None
    strategy.backup_taken(units)
    strategy.backup_taken({s: [10 ** 15] for s in units})  # a later backup's sizes: the plan is kept
    assert strategy.sizing == sizing and strategy.rounds == sizing.rounds
    with pytest.raises(ValueError, match="baft-max-iterations"):
        size_backups(cfg, CostModel(cfg), {s: [10 ** 15] for s in units})
