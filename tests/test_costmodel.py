from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from checkfree.config import config_from_dict, preset
from checkfree.costmodel import GIB, CostModel, calibration, get_profile, stage_forward_flops, stage_params
from checkfree.failures import write_trace
from checkfree.rundir import read_jsonl
from checkfree.simulator import Simulator


def test_paper_geo_calibration_matches_the_paper():
    c = calibration("paper-geo")
    assert c["step_s"] == pytest.approx(91.3, rel=0.02)  # paper: ~91.3 s per iteration
    assert c["redundant_step_s"] == pytest.approx(151.04, rel=0.03)  # paper: 151.04 s
    assert c["redundant_step_s"] / c["step_s"] == pytest.approx(1.654, rel=0.03)
    assert c["redundant_mechanistic_step_s"] < c["redundant_step_s"]


def test_profile_tables_are_in_the_papers_ranges():
    p = get_profile("paper-geo")
    n = len(p.regions)
    assert n == 5
    off = [(a, b) for a in range(n) for b in range(n) if a != b]
    lat = [p.latency_s[a][b] for a, b in off]
    bw = [p.bandwidth_Bps[a][b] / GIB for a, b in off]
    assert 0.004 <= min(lat) and max(lat) <= 0.130
    assert 0.01 <= min(bw) and max(bw) <= 0.25
    assert all(p.latency_s[a][b] == p.latency_s[b][a] and p.bandwidth_Bps[a][b] == p.bandwidth_Bps[b][a]
               for a, b in off)


def test_analytic_counts_match_the_model():
    from checkfree.model import PipelineStage, count_parameters, plan_stages

    cfg = preset("tiny")
    specs = plan_stages(cfg.model.num_layers, cfg.num_stages)
    real = [count_parameters(PipelineStage(cfg.model, s, has_embedding=s.is_first, has_head=s.is_last)) for s in specs]
    assert stage_params(cfg) == real
    flops = stage_forward_flops(cfg)
    assert flops[-1] > flops[0] > 0  # the head costs, the embedding lookup does not


def test_cost_model_is_deterministic_and_monotone():
    cfg = preset("paper-500m")
    a, b = CostModel(cfg), CostModel(config_from_dict(cfg.to_dict()))
    assert a.step_s() == b.step_s() and a.redundant_extra_s() == b.redundant_extra_s()
    assert a.transfer_s(0, 0, 1) == 0 and a.transfer_s(10**9, 2, 2) == 0
    assert a.transfer_s(2 * GIB, 0, 1) > a.transfer_s(GIB, 0, 1) > a.latency_s(0, 1)
    assert a.background_stall_s(1.0, 1) == 0.0
    assert a.background_stall_s(a.network_idle_s() * 2 + 5, 2) == pytest.approx(5)
    bigger = replace(cfg, train=replace(cfg.train, num_microbatches=8))
    assert CostModel(bigger).step_s() > a.step_s()
    slow = CostModel(cfg, replace(get_profile("paper-geo"), detection_s=0.0))
    assert slow.recovery_s(3.0) == 3.0 and a.recovery_s(3.0) == 13.0
    cfg.strategy.detection_s = 1.5
    assert CostModel(cfg).recovery_s(0.0) == 1.5


def test_local_profile_reproduces_its_measurement():
    from checkfree.costmodel import LOCAL_MEASUREMENT

    for name in ("tiny", "small"):
        assert CostModel(preset(name), "local").step_s() == pytest.approx(LOCAL_MEASUREMENT[f"{name}_step_s"])
    with pytest.raises(ValueError, match="unknown cost profile"):
        get_profile("moon")


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_simulated_clock_is_deterministic_for_a_trace(tiny_cfg, tmp_path, one_thread):
    trace = tmp_path / "t.csv"
    write_trace(trace, [(2, 1)])
    tiny_cfg.train.num_steps, tiny_cfg.train.num_microbatches, tiny_cfg.train.microbatch_size = 4, 2, 2
    tiny_cfg.recovery.strategy, tiny_cfg.failures.trace = "checkpoint", str(trace)
    tiny_cfg.strategy.checkpoint_every = 2
    runs = []
    for i in range(2):
        summary = Simulator(tiny_cfg, tmp_path / f"r{i}", progress=False).run()
        runs.append((summary, [m["sim_time_s"] for m in read_jsonl(tmp_path / f"r{i}" / "metrics.jsonl")]))
    assert runs[0][1] == runs[1][1]
    keys = ("sim_time_s", "simulated_hours", "stall_s", "bytes_moved", "recovery_s", "lost_steps")
    assert {k: runs[0][0][k] for k in keys} == {k: runs[1][0][k] for k in keys}
    cm = CostModel(tiny_cfg)
    s = runs[0][0]
    # 4 steps + 0 lost (checkpoint at 2, failure at 2) -> 4 iterations; plus stalls and the recovery
    assert s["sim_time_s"] == pytest.approx(s["iterations"] * cm.step_s() + s["stall_s"] + s["recovery_s"], rel=1e-6)
