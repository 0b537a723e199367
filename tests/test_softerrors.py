"""The soft-error guard wired into runs: counts, exactness, and the escalation path."""

from __future__ import annotations

import math

import torch

from checkfree.abft import FaultInjector
from checkfree.rundir import read_jsonl
from checkfree.simulator import Simulator


def _sim(cfg, out, steps=6, **guard):
    cfg.train.num_steps, cfg.train.eval_every = steps, 0
    for k, v in guard.items():
        setattr(cfg.guard, k, v)
    return Simulator(cfg, out, progress=False)


def test_guarded_fault_free_run_bitwise_equals_unguarded_explicit_math(tiny_cfg, tmp_path):
    a = _sim(tiny_cfg, tmp_path / "plain", explicit_attention=True)
    a.run()
    tiny_cfg.guard.explicit_attention = False
    b = _sim(tiny_cfg, tmp_path / "guarded", abft=True)
    summary = b.run()
    la = [m["loss"] for m in read_jsonl(tmp_path / "plain" / "metrics.jsonl")]
    lb = [m["loss"] for m in read_jsonl(tmp_path / "guarded" / "metrics.jsonl")]
    assert la == lb
    for wa, wb in zip(a.workers, b.workers):
        for (k, x), y in zip(wa.state_dict().items(), wb.state_dict().values()):
            assert torch.equal(x, y), k
    assert summary["soft_errors"] == {"injected": 0, "detected": 0, "corrected": 0, "escalated": 0}


def test_injected_faults_corrected_and_loss_tracks_fault_free(tiny_cfg, tmp_path):
    clean = _sim(tiny_cfg, tmp_path / "clean", steps=10, abft=True)
    clean.run()
    faulty = _sim(tiny_cfg, tmp_path / "faulty", steps=10, abft=True, inject_soft_errors=12)
    summary = faulty.run()
    assert summary["soft_errors"]["injected"] == 12
    assert summary["soft_errors"]["corrected"] >= 12 and summary["soft_errors"]["escalated"] == 0
    lc = [m["loss"] for m in read_jsonl(tmp_path / "clean" / "metrics.jsonl")]
    lf = [m["loss"] for m in read_jsonl(tmp_path / "faulty" / "metrics.jsonl")]
    assert all(math.isfinite(x) for x in lf)
    assert all(abs(x - y) < 1e-3 * abs(y) for x, y in zip(lf, lc))


def test_unguarded_injection_produces_nan_steps_but_weights_stay_finite(tiny_cfg, tmp_path):
    sim = _sim(tiny_cfg, tmp_path / "r", steps=10, inject_soft_errors=12)
    summary = sim.run()
    losses = [m["loss"] for m in read_jsonl(tmp_path / "r" / "metrics.jsonl")]
    assert any(isinstance(x, str) and x == "nan" for x in losses)  # NaN written as a string in JSON
    assert summary["soft_errors"]["injected"] == 12 and summary["soft_errors"]["corrected"] == 0
    assert any(e["event"] == "skipped_step" for e in read_jsonl(tmp_path / "r" / "events.jsonl"))
    for w in sim.workers:
        assert all(torch.isfinite(v).all() for v in w.state_dict().values())


def test_uncorrectable_faults_recompute_then_skip_then_recover_the_stage(tiny_cfg, tmp_path):
    sim = _sim(tiny_cfg, tmp_path / "r", steps=4, abft=True)
    # stage 1 has 2 blocks: two faults in one section of one call cannot be corrected (budget 1);
    # calls 0 and 1 fail the first forward and its recompute (step 0 skipped), 2 and 3 likewise
    # at step 1: the second consecutive skip treats stage 1 as failed.
    faults = [(c, "q", "nan", r, 0) for c in range(4) for r in (0, 5)]
    sim.guards[1].injector = FaultInjector.from_schedule(faults)
    sim.workers[1].attach_guard(sim.guards[1])
    summary = sim.run()
    events = [e["event"] for e in read_jsonl(tmp_path / "r" / "events.jsonl")]
    assert events.count("soft_error_skip") == 2 and "soft_error_escalation" in events
    assert summary["failures"] == 1 and summary["recoveries"] == 1
    assert summary["soft_errors"]["escalated"] >= 4
    losses = [m["loss"] for m in read_jsonl(tmp_path / "r" / "metrics.jsonl")]
    assert losses[0] == "nan" and losses[1] == "nan" and math.isfinite(losses[3])
