from __future__ import annotations

import json

import pytest
import torch

from checkfree.failures import write_trace
from checkfree.recovery import UnrecoverableFailure
from checkfree.rundir import read_jsonl
from checkfree.simulator import Simulator
from checkfree.strategies.state import capture_worker


def _run(cfg, out, **over):
    for section, values in over.items():
        for k, v in values.items():
            setattr(getattr(cfg, section), k, v)
    sim = Simulator(cfg, out, progress=False)
    return sim, sim.run()


def test_run_directory_contract(tiny_cfg, tmp_path):
    tiny_cfg.train.num_steps, tiny_cfg.train.eval_every = 6, 3
    _, summary = _run(tiny_cfg, tmp_path / "r")
    for key in ("steps", "final_loss", "final_val_loss", "failures", "recoveries", "fallbacks", "wall_s"):
        assert key in summary
    metrics = read_jsonl(tmp_path / "r" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(6))
    assert {"step", "loss", "lr", "grad_norms", "step_time_s"} <= metrics[0].keys()
    assert len(metrics[0]["grad_norms"]) == 4 and "val_loss" in metrics[2] and "val_loss" not in metrics[0]
    assert json.loads((tmp_path / "r" / "config.json").read_text())["num_stages"] == 4


def test_checkfree_plus_replicas_bit_identical(tiny_cfg, tmp_path):
    tiny_cfg.recovery.strategy = "checkfree+"
    tiny_cfg.train.num_steps = 8
    sim, _ = _run(tiny_cfg, tmp_path / "r")
    w = sim.workers
    for a, b in zip(w[0].module.embed.parameters(), w[1].module.embed.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(w[2].module.head.parameters(), w[3].module.head.parameters()):
        assert torch.equal(a, b)
    first = w[0].module.embed.weight
    assert not torch.equal(first, Simulator(tiny_cfg, tmp_path / "fresh", progress=False).workers[0].module.embed.weight)


def test_adjacent_failures_trigger_fallback_event(tiny_cfg, tmp_path):
    trace = tmp_path / "t.csv"
    write_trace(trace, [(2, 1), (2, 2)])
    tiny_cfg.train.num_steps = 4
    tiny_cfg.failures.trace = str(trace)
    with pytest.raises(UnrecoverableFailure, match="adjacent"):
        _run(tiny_cfg, tmp_path / "abort")
    events = read_jsonl(tmp_path / "abort" / "events.jsonl")
    assert [e["event"] for e in events] == ["run_start", "failure", "failure", "fallback"]
    assert json.loads((tmp_path / "abort" / "summary.json").read_text())["status"] == "aborted"
    tiny_cfg.recovery.fallback = "random"
    _, summary = _run(tiny_cfg, tmp_path / "random")
    assert summary["fallbacks"] == 2 and summary["recoveries"] == 0 and summary["status"] == "completed"


def test_trace_replays_identically(tiny_cfg, tmp_path):
    trace = tmp_path / "t.csv"
    write_trace(trace, [(1, 2), (3, 1)])
    tiny_cfg.train.num_steps = 5
    tiny_cfg.failures.trace = str(trace)
    runs = [_run(tiny_cfg, tmp_path / f"r{i}")[0] for i in range(2)]
    m = [read_jsonl(tmp_path / f"r{i}" / "metrics.jsonl") for i in range(2)]
    assert [x["loss"] for x in m[0]] == [x["loss"] for x in m[1]]
    e = [read_jsonl(tmp_path / f"r{i}" / "events.jsonl") for i in range(2)]
    strip = lambda ev: [{k: v for k, v in x.items() if k not in ("time", "recovery_time_s")} for x in ev]  # noqa: E731
    assert strip(e[0]) == strip(e[1])
    rec = [x for x in e[0] if x["event"] == "recovery"]
    assert [(x["step"], x["stage"], x["sources"]) for x in rec] == [(1, 2, [1, 3]), (3, 1, [0, 2])]
    assert all(len(x["coefficients"]) == 2 and sum(x["coefficients"]) == pytest.approx(1) for x in rec)
    for a, b in zip(runs[0].workers, runs[1].workers):
        for (k, x), y in zip(a.state_dict().items(), b.state_dict().values()):
            assert torch.equal(x, y), k


def test_recovered_stage_gets_scaled_lr(tiny_cfg, tmp_path):
    trace = tmp_path / "t.csv"
    write_trace(trace, [(2, 1)])
    tiny_cfg.train.num_steps = 4
    tiny_cfg.failures.trace = str(trace)
    sim, _ = _run(tiny_cfg, tmp_path / "r")
    lrs = [g["lr"] for w in sim.workers for g in w.optimizer.param_groups]
    assert lrs[1] == pytest.approx(tiny_cfg.train.lr * 1.1) and lrs[0] == pytest.approx(tiny_cfg.train.lr)


@pytest.mark.parametrize("strategy,rate", [("checkfree", 0.0), ("checkfree+", 0.02)])
def test_loss_falls_on_tiny(tiny_cfg, tmp_path, strategy, rate):
    tiny_cfg.train.num_steps, tiny_cfg.train.eval_every = 75, 37  # (at 75 steps: last ten 4.31, val 4.15-4.20)
    tiny_cfg.recovery.strategy, tiny_cfg.recovery.fallback = strategy, "copy"
    tiny_cfg.failures.rate = rate
    _, summary = _run(tiny_cfg, tmp_path / "r")
    losses = [m["loss"] for m in read_jsonl(tmp_path / "r" / "metrics.jsonl")]
    assert losses[0] > 6.0
    assert sum(losses[-10:]) / 10 < 4.6, losses[-10:]
    assert summary["final_val_loss"] < 4.8
    if rate:
        assert summary["failures"] > 0


def test_stage_with_non_finite_weights_is_treated_as_failed_and_recovered(tiny_cfg, tmp_path):
    tiny_cfg.train.num_steps = 5
    sim = Simulator(tiny_cfg, tmp_path / "r", progress=False)
    broken = sim.workers[2]
    real_step = broken.optimizer.step

    def corrupting_step(*a, **kw):  # a memory fault after the update of step 2
        out = real_step(*a, **kw)
        if corrupting_step.calls == 2:
            with torch.no_grad():
                broken.module.blocks[0].mlp.w1.weight[0, 0] = float("nan")
        corrupting_step.calls += 1
        return out

    corrupting_step.calls = 0
    broken.optimizer.step = corrupting_step
    summary = sim.run()
    events = read_jsonl(tmp_path / "r" / "events.jsonl")
    assert [(e["event"], e["step"], e["stage"]) for e in events if e["event"] in ("nonfinite_weights", "failure")] \
        == [("nonfinite_weights", 2, 2), ("failure", 3, 2)]
    assert summary["recoveries"] == 1
    for w in sim.workers:
        assert all(torch.isfinite(v).all() for v in w.state_dict().values())


def _component_optim(worker, comp):
    """The worker's Adam state of one component, by parameter name."""
    return {n: st for n, st in capture_worker(worker, 0, 0.0)["optim"]["state"].items() if n.startswith(comp + ".")}


def _assert_same_component(a, b, comp, label):
    for (k, x), y in zip(getattr(a.module, comp).state_dict().items(), getattr(b.module, comp).state_dict().values()):
        assert torch.equal(x, y), f"{label}: {comp} weight {k} differs"
    oa, ob = _component_optim(a, comp), _component_optim(b, comp)
    assert oa.keys() == ob.keys() and oa, f"{label}: {comp} Adam state on {sorted(oa)} vs {sorted(ob)}"
    for name in oa:
        assert oa[name].keys() == ob[name].keys()
        for field in oa[name]:
            assert torch.equal(oa[name][field], ob[name][field]), f"{label}: Adam {field} of {name} differs"


@pytest.mark.parametrize("stage,partner,comp", [(0, 1, "embed"), (3, 2, "head"), (1, 0, "embed")])
def test_checkfree_plus_recovery_continues_the_replica_exactly(tiny_cfg, tmp_path, stage, partner, comp):
    """A replicated component (embedding / head) is copied exactly on recovery, with its
    partner's Adam state and no recovery LR scale, so the two replicas stay bit-identical;
    the rebuilt blocks still train at LR x lr_scale with a fresh optimizer."""
    tiny_cfg.recovery.strategy = "checkfree+"
    sim = Simulator(tiny_cfg, tmp_path / "r", progress=False)
    try:
        for step in range(7):
            if step == 3:
                assert sim.recover(step, {stage}) == step
                _assert_same_component(sim.workers[stage], sim.workers[partner], comp, "right after recovery")
                blocks = {n for n in capture_worker(sim.workers[stage], 0, 0.0)["optim"]["state"]
                          if n.startswith("blocks.")}
                assert not blocks, "the rebuilt blocks start with a fresh optimizer"
            _, stats = sim.train_step(step)
            assert not any(s.skipped for s in stats)
            _assert_same_component(sim.workers[stage], sim.workers[partner], comp, f"after step {step}")
        lrs = {g["name"]: g["lr"] for g in sim.workers[stage].optimizer.param_groups}
        assert lrs["main"] == pytest.approx(tiny_cfg.train.lr * tiny_cfg.recovery.lr_scale)
        assert lrs[comp] == pytest.approx(tiny_cfg.train.lr)
        assert stats[stage].lr == pytest.approx(tiny_cfg.train.lr * tiny_cfg.recovery.lr_scale)
        for g in sim.workers[partner].optimizer.param_groups:
            assert g["lr"] == pytest.approx(tiny_cfg.train.lr)
    finally:
        sim.writer.close()


def test_checkfree_plus_edge_failure_in_a_full_run_keeps_replicas(tiny_cfg, tmp_path):
    trace = tmp_path / "t.csv"
    write_trace(trace, [(2, 0), (4, 3)])
    tiny_cfg.recovery.strategy = "checkfree+"
    tiny_cfg.train.num_steps = 7
    tiny_cfg.failures.trace = str(trace)
    sim, summary = _run(tiny_cfg, tmp_path / "r")
    assert summary["recoveries"] == 2 and summary["fallbacks"] == 0
    _assert_same_component(sim.workers[0], sim.workers[1], "embed", "end of run")
    _assert_same_component(sim.workers[2], sim.workers[3], "head", "end of run")


def test_a_run_until_a_step_trains_the_steps_before_it_as_the_whole_run_does_and_saves_there(tiny_cfg, tmp_path):
    """`run(until=N)`: the steps before N with the whole run's schedule (warmup-cosine over all its steps), the
    evaluations and saves they have in it, and the save of the state ready for step N; nothing after."""
    tiny_cfg.train.num_steps, tiny_cfg.train.eval_every = 6, 2
    tiny_cfg.train.lr_schedule, tiny_cfg.train.warmup_steps = "warmup-cosine", 1
    Simulator(tiny_cfg, tmp_path / "whole", progress=False).run()
    part = Simulator(tiny_cfg, tmp_path / "part", progress=False, save_steps=(4,)).run(until=4)
    assert part["status"] == "completed"
    whole, got = read_jsonl(tmp_path / "whole" / "metrics.jsonl"), read_jsonl(tmp_path / "part" / "metrics.jsonl")
    assert [m["step"] for m in got] == [0, 1, 2, 3]
    assert [(m["lr"], m["loss"], m.get("val_loss")) for m in got] == [
        (m["lr"], m["loss"], m.get("val_loss")) for m in whole[:4]]
    assert (tmp_path / "part" / "saves" / "step-00000004" / "meta.json").is_file()
    with pytest.raises(ValueError, match="until must be within 1..6"):
        Simulator(tiny_cfg, tmp_path / "bad", progress=False).run(until=7)
