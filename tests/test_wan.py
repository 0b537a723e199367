"""The emulated WAN (`--wan paper-geo`, checkfree.wan) and the cost model's pipeline played out on it."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest
from swarmrun import events, local, simulate, trace

from checkfree.config import preset
from checkfree.costmodel import CostModel, get_profile, swarm_profile
from checkfree.rundir import read_jsonl
from checkfree.wan import WanEmulator

pytestmark = pytest.mark.timeout(300)


def _cfg(wan: str | None = "paper-geo"):
    cfg = preset("tiny")
    cfg.train.wan = wan
    return cfg


def test_links_are_the_cost_models_and_a_link_serializes_its_messages():
    wan = WanEmulator(_cfg())
    cm = CostModel(_cfg(), swarm_profile("paper-geo"))
    geo = get_profile("paper-geo")
    # stage i in region i: us-east -> us-west is 62 ms at 0.15 GiB/s per pair of peers (no x peers_per_stage)
    assert wan.link(0, 1) == (cm.latency_s(0, 1), cm.bandwidth_Bps(0, 1)) == (0.062, geo.bandwidth_Bps[0][1])
    assert wan.link(1, 2)[0] == 0.128 and wan.link(2, 1) == wan.link(1, 2)
    lat, bw = wan.link(1, 2)
    first = wan.hold(1, 2, int(bw))  # one second of bytes
    second = wan.hold(1, 2, int(bw))  # waits behind the first on the same link
    other = wan.hold(2, 1, 1000)  # the reverse direction is a link of its own
    assert first == pytest.approx(1 + lat, abs=0.01) and second == pytest.approx(2 + lat, abs=0.01)
    assert other == pytest.approx(lat + 1000 / bw, abs=0.01)
    t0 = time.monotonic()
    assert asyncio.run(wan.carry(2, 3, 0)) == pytest.approx(0.004, abs=0.002)
    assert time.monotonic() - t0 >= 0.004
    assert len(wan.describe()) == 3 and "128 ms" in wan.describe()[1]
    with pytest.raises(ValueError, match="unknown network"):
        WanEmulator(_cfg("moon"))
    with pytest.raises(ValueError, match="not set"):
        WanEmulator(_cfg(None))


def test_pipeline_model_pays_latency_once_per_hop_and_is_bandwidth_bound_when_links_are_slow():
    cfg = preset("small")
    base = swarm_profile("paper-geo")
    flat = CostModel(cfg, replace(base, latency_s=tuple(tuple(0.0 for _ in r) for r in base.latency_s)))
    cm = CostModel(cfg, base)
    one_way = sum(cm.latency_s(i, i + 1) for i in range(cm.S - 1))
    # latency adds about one trip there and back, not one per pipeline slot (M + S - 1 of them)
    assert 2 * one_way - 1e-6 <= cm.step_s() - flat.step_s() <= 2 * one_way + 0.05
    slow = CostModel(cfg, replace(base, bandwidth_Bps=tuple(tuple(1e5 for _ in r) for r in base.bandwidth_Bps)))
    per_message = slow.activation_bytes / 1e5
    assert slow.step_s() >= 2 * cm.M * per_message  # every microbatch crosses the slowest link both ways
    assert CostModel(cfg, base).pipeline_s(schedule="1f1b") >= cm.pipeline_s(schedule="gpipe") * 0.99
    bigger = replace(cfg, train=replace(cfg.train, num_microbatches=8))
    assert CostModel(bigger, base).step_s() > cm.step_s()


def test_swarm_on_the_emulated_wan_computes_the_same_and_its_hops_take_the_configured_time(tmp_path, tmp_path_factory):
    """A tiny swarm on `--wan paper-geo` over the tcp transport, stage 1 SIGKILLed at step 2: the losses equal
    the simulator's (which equals a loopback swarm's: tests/test_swarm.py), no pass arrives before its link's
    latency, each hop's least delay over steps 1-3 is its link's latency (+-20%, the links of 62 and 128 ms; the
    4 ms link adds the loopback transport's own ~1-3 ms, more than 20% of it: within 50 ms), and the
    replacement's weight pulls crossed the 128 ms link there and back."""
    cache = str(tmp_path_factory.mktemp("cache"))
    args = ("--steps", "4", "--eval-every", "0", "--trace", trace(tmp_path, [(2, 1)]))
    proc, out = local(tmp_path, "wan", *args, "--wan", "paper-geo", "--transport", "tcp", cache=cache, spares=1)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "emulated WAN paper-geo: stage 1 (us-west) <-> stage 2 (eu-west): 128 ms" in proc.stdout
    sim = simulate(tmp_path, "sim", *args, cache=cache)
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["loss"] for m in metrics] == pytest.approx([m["loss"] for m in sim], rel=1e-5)
    wan = WanEmulator(_cfg())
    delays: dict[tuple[int, int], list[float]] = {}
    for m in metrics:
        for dst, by_src in enumerate(m["hop_delay_s"]):
            for src, delay in by_src.items():
                lat, _ = wan.link(int(src), dst)
                assert delay >= lat - 1e-3, (m["step"], src, dst, delay)  # no pass outruns its link
                if m["step"] != 0:  # step 0 pays the peers' first-use costs (~0.1 s more on every hop)
                    delays.setdefault((int(src), dst), []).append(delay)
    assert len(delays) == 6  # every link, both ways
    for (src, dst), seen in delays.items():
        # the least of a hop's steps (a loaded machine only adds to the delay, a busy event loop at either end:
        # CI once saw 0.23 s on the 62 ms link at step 1); its precision is benchmarks/wan.py's to measure
        lat, _ = wan.link(src, dst)
        if lat >= 0.05:
            assert min(seen) == pytest.approx(lat, rel=0.2), (src, dst, seen)
        else:
            assert min(seen) <= lat + 0.05, (src, dst, seen)
    (rec,) = events(out, "recovery")
    assert rec["stage"] == 1 and rec["transfer_s"] >= 2 * 0.128  # the pull from stage 2: request and reply
