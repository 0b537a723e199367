"""snap: compressed copies (checkfree.snapcodec), their differential updates and the streams' plan logic
(checkfree.strategies.streamed), in the simulator. Quick: no process, the tiny model or tensors."""

from __future__ import annotations

import copy

import pytest
import torch

from checkfree.config import ModelConfig, RunConfig, preset
from checkfree.plans import Copies, Failure, Holder, StreamSent
from checkfree.recovery import Neighbours
from checkfree.rundir import read_jsonl
from checkfree.serialize import state_from_bytes, state_to_bytes
from checkfree.simulator import Simulator
from checkfree.snapcodec import (FORMATS, CopyFormat, apply_update, encode_and_mirror, encode_update,
                                 full_precision_nbytes, held_nbytes, pack, restore_state, stage_shapes, tree_nbytes,
                                 unpack, update_nbytes)
from checkfree.strategies import build_strategy


def _state(weights: dict[str, torch.Tensor], moments: bool = True) -> dict:
    optim = {k: {"step": torch.tensor(7.0), "exp_avg": torch.randn_like(v) * 1e-3,
                 "exp_avg_sq": torch.rand_like(v) * 1e-6} for k, v in weights.items()} if moments else {}
    groups = [{"name": "main", "lr": 1e-3, "betas": (0.9, 0.999)}]
    return {"model": weights, "optim": {"state": optim, "groups": groups},
            "lr_scale": 1.0, "step": 0, "rng": torch.get_rng_state(), "norm": 0.25}


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"blocks.0.attn.wq.weight": torch.randn(48, 32, generator=g) * 0.05,
            "blocks.0.norm.weight": torch.ones(32) + torch.randn(32, generator=g) * 0.01,
            "head.out.weight": torch.randn(50, 20, generator=g)}  # 1000 values: int4 groups of 64 pad the last


def _steps(held, fmt: CopyFormat) -> dict[str, torch.Tensor]:
    """Each value's quantization step in the held copy (its row's or group's scale)."""
    out = {}
    for k, e in held.weights.items():
        if "scale" not in e:
            continue
        shape = tuple(e["shape"])
        per = shape[-1] if fmt.weights == "int8" else fmt.group
        out[k] = e["scale"].repeat_interleave(per)[:torch.Size(shape).numel()].view(shape)
    return out


def test_packing_round_trips_every_code():
    for bits in (2, 4):
        lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
        codes = torch.arange(lo, hi + 1, dtype=torch.int8).repeat(7)[:-1]  # an odd count: the last byte padded
        packed = pack(codes, bits)
        assert packed.dtype == torch.uint8 and packed.numel() == -(-codes.numel() * bits // 8)
        assert torch.equal(unpack(packed, bits, codes.numel()), codes)


@pytest.mark.parametrize("weights", FORMATS)
@pytest.mark.parametrize("moments", [False, True])
def test_updates_weigh_what_the_plan_says_and_the_mirror_equals_the_holders_copy_bit_for_bit(weights, moments):
    """Full and differential updates weigh exactly `update_nbytes` (the sizes the streams are planned with), go
    through serialisation unchanged, and the owner's mirror (the updates applied as made) and the holder's copy
    (the updates applied as received) stay equal bit for bit over 12 updates; the copy is within half a
    quantization step of the true weights after every unclipped update (int8, int4), within bf16's rounding, or
    exact (float32)."""
    fmt = CopyFormat(weights, group=64, moments=moments)
    w = _weights()
    shapes = {k: tuple(v.shape) for k, v in w.items()}
    mirror = holder = None
    g = torch.Generator().manual_seed(1)
    for step in range(0, 12):
        if step:
            w = {k: v + torch.randn(v.shape, generator=g) * 2e-3 * v.abs().mean() for k, v in w.items()}
        state = _state(w, moments)
        update, made = encode_and_mirror(state, step, fmt, mirror)
        assert state_to_bytes(update) == state_to_bytes(encode_update(state, step, fmt, mirror))
        assert update["kind"] == ("full" if step == 0 or not fmt.differential else "delta")
        assert tree_nbytes(update) == update_nbytes(shapes, fmt, update["kind"])
        received = state_from_bytes(state_to_bytes(update))
        mirror = apply_update(mirror if update["kind"] == "delta" else None, update)
        holder = apply_update(holder if received["kind"] == "delta" else None, received)
        assert holder.step == mirror.step == step
        a, b = state_to_bytes({"c": holder.weights}), state_to_bytes({"c": mirror.weights})
        assert a == b == state_to_bytes({"c": made.weights})  # the owner's mirror as made while encoding
        assert made.step == step and made.meta["norm"] == holder.meta["norm"]
        got = restore_state(holder)["model"]
        for k, v in w.items():
            err = (got[k] - v).abs()
            if weights == "float32" or v.ndim == 1:
                assert torch.equal(got[k], v), k
            elif weights == "bf16":
                assert torch.equal(got[k], v.to(torch.bfloat16).float()), k
            else:
                assert (err <= _steps(holder, fmt)[k] / 2 * (1 + 1e-5)).all(), (k, step)
    assert held_nbytes(shapes, fmt) == holder.nbytes()


def test_a_clipped_difference_is_carried_by_the_next_updates_and_never_accumulates():
    """A row that jumps by far more than a 4-bit difference can say: the first delta clips it, the next ones carry
    the rest (the owner computes each against the holder's copy), and once caught up the copy is within half a
    step again."""
    fmt = CopyFormat("int8")
    w = _weights()
    held = apply_update(None, encode_update(_state(w, False), 0, fmt, None))
    w["blocks.0.attn.wq.weight"][5] += 0.3 * torch.sign(w["blocks.0.attn.wq.weight"][5])  # far beyond 7 steps
    errors = []
    for step in range(1, 40):
        held = apply_update(held, encode_update(_state(w, False), step, fmt, held))
        got = restore_state(held)["model"]["blocks.0.attn.wq.weight"]
        name = "blocks.0.attn.wq.weight"
        errors.append(float(((got - w[name]).abs() / _steps(held, fmt)[name]).max()))
    assert errors[0] > 1 and errors == sorted(errors, reverse=True)
    assert errors[-1] <= 0.5 + 1e-5


def test_the_moments_travel_or_not_and_a_quantized_second_moment_never_falls_below_the_first_squared():
    w = _weights()
    st = _state(w, moments=True)
    st["optim"]["state"]["head.out.weight"]["exp_avg_sq"][0, 0] = 1e-30  # quantizes to zero under a large row
    st["optim"]["state"]["head.out.weight"]["exp_avg"][0, 0] = 0.5e-3
    none = restore_state(apply_update(None, encode_update(st, 3, CopyFormat("int8", moments=False), None)))
    assert none["optim"]["state"] == {} and none["optim"]["groups"] == st["optim"]["groups"]
    kept = restore_state(apply_update(None, encode_update(st, 3, CopyFormat("int8", moments=True), None)))
    for name, m in kept["optim"]["state"].items():
        assert m["step"].item() == 7.0 and (m["exp_avg_sq"] >= m["exp_avg"] ** 2).all()
        assert m["exp_avg"].shape == w[name].shape
    exact = restore_state(apply_update(None, encode_update(st, 3, CopyFormat("float32", moments=True), None)))
    for name, m in exact["optim"]["state"].items():
        want = st["optim"]["state"][name]
        assert torch.equal(m["exp_avg"], want["exp_avg"])
        assert torch.allclose(m["exp_avg_sq"], want["exp_avg_sq"], rtol=1e-6, atol=1e-30)


def test_an_update_for_another_copy_is_refused():
    fmt = CopyFormat("int4", group=16)
    w = _weights()
    held = apply_update(None, encode_update(_state(w, False), 0, fmt, None))
    delta = encode_update(_state(w, False), 4, fmt, held)
    other = apply_update(None, encode_update(_state(w, False), 2, fmt, None))
    with pytest.raises(ValueError, match="step 0 .*cannot apply to the copy of step 2"):
        apply_update(other, delta)
    with pytest.raises(ValueError, match="cannot apply to no copy"):
        apply_update(None, delta)
    with pytest.raises(ValueError, match="unknown copy update kind"):
        apply_update(held, {**delta, "kind": "partial"})
    with pytest.raises(ValueError, match="format"):
        apply_update(held, {**delta, "format": ["int3", 16, False]})
    with pytest.raises(ValueError, match="unknown snapshot format"):
        CopyFormat("int3")


def _smollm2_like(stages: int = 6) -> RunConfig:
    """SmolLM2-135M's shape (its config.json: 30 layers, width 576, 9 heads, 3 KV heads, MLP 1536, 49152 tokens)."""
    cfg = preset("tiny")
    cfg.num_stages = stages
    cfg.model = ModelConfig(vocab_size=49152, d_model=576, num_heads=9, num_kv_heads=3, num_layers=30,
                            context_length=2048, mlp_hidden=1536)
    return cfg


@pytest.mark.parametrize("fmt", [CopyFormat("int8"), CopyFormat("int4", 64)])
def test_a_holders_memory_and_the_bytes_per_step_are_at_most_a_quarter_of_the_full_precision_snapshots(fmt):
    """The must-hold on SmolLM2's shape, every stage: the holder keeps its copy and an update being received, at
    most a quarter of the full-precision snapshot (weights + Adam moments in float32, 12 B/parameter); the bytes a
    stage sends per step at a period of K steps (a delta every K steps) at most a quarter of that snapshot's 12/K
    B/parameter. (With the moments it does not hold: the copy is then 3 B/parameter in int8, and in int4 a copy and
    an update being received weigh 28 %.)"""
    cfg = _smollm2_like()
    for s in range(cfg.num_stages):
        shapes = stage_shapes(cfg, s)
        full = full_precision_nbytes(shapes)
        kind = "delta" if fmt.differential else "full"
        assert held_nbytes(shapes, fmt) + update_nbytes(shapes, fmt, "full") <= full / 4
        for every in (1, 10, 50):
            assert update_nbytes(shapes, fmt, kind) / every <= full / every / 4


def _snap_cfg(tmp_path, every: int = 2, steps: int = 8, **strategy) -> RunConfig:
    cfg = preset("tiny")
    cfg.data.cache_dir = str(tmp_path / "cache")
    cfg.recovery.strategy = "snap"
    cfg.train.num_steps, cfg.train.eval_every = steps, 0
    cfg.strategy.snapshot_every = every
    for k, v in strategy.items():
        setattr(cfg.strategy, f"snapshot_{k}", v)
    return cfg


def test_the_streams_begin_travel_in_parts_and_complete_after_their_last_part(tmp_path):
    """The plan as data: a full update at step 0 in as many parts as the budget (by default a delta's bytes) says,
    a delta every `every` steps once the first is complete, each part counted only when its step is committed and
    it arrived; a voided part makes the next update full."""
    cfg = _snap_cfg(tmp_path, every=3)
    strategy = build_strategy(cfg)
    full, delta = strategy.parts(0, "full"), strategy.parts(0, "delta")
    assert full == 2 and delta == 1  # int8: a delta (4 bits a value and the scales) is about half of a full copy
    seen = []
    for step in range(10):
        parts = strategy.in_step(step).parts
        assert strategy.in_step(step).parts == parts  # every attempt of a step gets the same answer
        seen.append((step, parts[1].step, parts[1].kind, parts[1].part) if 1 in parts else (step, None))
        due = strategy.protection_due(step)
        assert due == ([StreamSent(step, parts)] if parts else [])
        for p in parts.values():
            strategy.copy_part_done(p)
    assert seen[:4] == [(0, 0, "full", 0), (1, 0, "full", 1), (2, None), (3, 3, "delta", 0)]  # a delta due at 3
    assert seen[6] == (6, 6, "delta", 0) and seen[9] == (9, 9, "delta", 0)
    assert strategy.streams[1].complete == 9 and strategy.streams[1].mirrored
    strategy.in_step(10)
    strategy.copy_stream_broken(1)
    assert strategy.in_step(10).parts[1].kind == "full"


def test_the_peers_copy_work_runs_beside_the_compute_thread_at_normal_priority():
    """A peer encodes and applies copy updates on its side thread (peers.compute.SideThread), not on the event
    loop's thread, and at normal priority: at the OS's idle priority it held the GIL while descheduled and stalled
    the event loop (benchmarks/gil_priority.py)."""
    import asyncio
    import os
    import threading

    from peers.compute import SideThread

    side = SideThread()

    async def main() -> tuple[int, int | None]:
        return await side.run(threading.get_ident), await side.run(
            lambda: os.sched_getscheduler(0) if hasattr(os, "sched_getscheduler") else None)

    try:
        ident, policy = asyncio.run(main())
        assert ident != threading.get_ident()
        assert policy in (None, getattr(os, "SCHED_OTHER", None))
    finally:
        side.shutdown()


def test_a_lost_stage_is_restored_from_its_copy_and_rebuilt_by_the_configured_rule_when_its_holder_went_too(tmp_path):
    """The fallback is part of the plan: stage 1's holder is stage 2; losing both, stage 2 is restored from its
    copy at stage 3 and stage 1 (copy gone) is rebuilt by the configured rule from stage 0 and the restored stage
    2, under `Fallback(<rule>)`; afterwards stage 1's stream starts over with a full update at once."""
    for rule, method in (("checkfree", "average"), ("identity", "identity")):
        cfg = _snap_cfg(tmp_path, rebuild=rule)
        strategy = build_strategy(cfg)
        copies = Copies()
        for s in range(4):
            copies.sealed(s, 2, (strategy.holder(s),))
            strategy.streams[s].complete, strategy.streams[s].mirrored = 2, True
        copies.lose({1, 2})
        plan = strategy.recovery_plan(Failure(5, frozenset({1, 2}), copies))
        assert plan.sources[2] == Holder(3, 2, form="int8")
        assert isinstance(plan.sources[1], Neighbours) and plan.sources[1].method == method
        assert plan.rollback_to is None and plan.fallback.name == rule and plan.fallback.stages == [1]
        assert "copy at stage 2 was lost too" in plan.fallback.reasons[1]
        assert strategy.in_step(5).parts[1].kind == "full" and strategy.in_step(5).parts[0].kind == "full"
        assert strategy.streams[2].mirrored  # restored from its copy: its owner mirrors it


def test_the_simulator_restores_from_the_newest_complete_copy_and_falls_back_when_the_holder_is_lost_too(tmp_path,
                                                                                                         session_cache):
    """A trace that loses stage 1, then its holder (stage 2), then stage 1 again before its copy (lost with the
    holder) came back: restored from its copy of step 2 (a whole copy in steps 0-1, a delta in step 2), then stage
    2 from its copy of step 4, then stage 1 rebuilt by CheckFree (its whole copy, begun at step 5, still
    travelling); the copies' steps in the events."""
    cfg = _snap_cfg(tmp_path)
    cfg.data.cache_dir = session_cache  # the session's tokens (tests/conftest.py), not a corpus tokenized again here
    trace = tmp_path / "trace.csv"
    trace.write_text("step,stage\n3,1\n5,2\n6,1\n")
    cfg.failures.trace = str(trace)
    summary = Simulator(cfg, tmp_path / "sim", progress=False).run()
    assert summary["status"] == "completed" and summary["fallbacks"] == 1
    events = [e for e in read_jsonl(tmp_path / "sim" / "events.jsonl") if e["event"] in ("recovery", "fallback")]
    assert [(e["event"], e["step"], e["stage"], e["method"], e.get("snapshot_step")) for e in events] == [
        ("recovery", 3, 1, "snapshot", 2), ("recovery", 5, 2, "snapshot", 4), ("fallback", 6, 1, "average", None)]
    assert events[0]["copy_format"] == "int8" and events[2]["fallback"] == "checkfree"
    assert summary["bytes_moved"] > 0 and summary["extra_memory_bytes"] > 0 and summary["lost_steps"] == 0


def test_bad_snapshot_settings_are_refused(tmp_path):
    with pytest.raises(ValueError, match="plain rule"):
        build_strategy(_snap_cfg(tmp_path, rebuild="checkfree+"))
    with pytest.raises(ValueError, match="unknown recovery strategy"):
        build_strategy(_snap_cfg(tmp_path, rebuild="average"))
    cfg = _snap_cfg(tmp_path)
    with pytest.raises(ValueError, match="snapshot_budget"):
        copy.deepcopy(cfg.strategy).__class__(snapshot_budget=-1)


def test_a_run_from_a_trained_model_gets_snap_by_default_and_a_warning_for_a_strategy_that_damages_it(tmp_path,
                                                                                                      capsys):
    """--init-from without --strategy: snap, said in one line; with --strategy checkfree+ or an averaging one: that
    strategy, and one warning line each, whose figures are the result file's (rendered, never typed)."""
    import argparse

    from checkfree.advice import default_note, measured, warnings_for
    from checkfree.flags import add_run_arguments, config_from_args
    from checkfree.hf import save_hf
    from checkfree.model import LlamaModel

    shape = ModelConfig(vocab_size=64, d_model=16, num_heads=2, num_layers=2, context_length=8)
    model = tmp_path / "model"
    save_hf(shape, LlamaModel(shape).state_dict(), model)
    p = argparse.ArgumentParser()
    add_run_arguments(p)
    cfg = config_from_args(p.parse_args(["--init-from", str(model), "--stages", "2"]))
    assert cfg.recovery.strategy == "snap"
    err = capsys.readouterr().err
    m = measured()
    assert default_note(m) in err and err.count("\n") == 1
    cfg = config_from_args(p.parse_args(["--init-from", str(model), "--stages", "2", "--strategy", "checkfree+"]))
    assert cfg.recovery.strategy == "checkfree+"
    err = capsys.readouterr().err.splitlines()
    assert err == warnings_for("checkfree+", m) and len(err) == 1
    cfg = config_from_args(p.parse_args(["--stages", "2"]))
    assert cfg.recovery.strategy == "checkfree" and capsys.readouterr().err == ""
    fake = {"worst_ratio": 0.00123, "checkfree_damage": {"1": 2.5, "2": 0.75},
            "first_step_loss": {"checkfree": 3.875, "checkfree+": 9.5}}
    assert "0.75 to 2.50 nats" in warnings_for("checkfree", fake)[0]
    assert "9.50, against 3.88" in warnings_for("checkfree+snap", fake)[0]
    assert "at most 0.0012 of what" in default_note(fake) and warnings_for("snap", fake) == []


def test_the_docs_and_the_readme_say_what_the_result_file_says():
    """docs/recovery.md's measured section and the README's line are the renderings of the committed result of
    `python -m benchmarks.snapshots --quick` (every number and comparison from the file), or say it was not
    measured yet where there is none; the file's own ratios are its damages' quotients."""
    from pathlib import Path

    from benchmarks.snapshots import (README_BEGIN, README_END, SECTION_BEGIN, SECTION_END, render_readme,
                                      render_section)
    from checkfree.advice import RESULT_FILE, measured

    root = Path(__file__).resolve().parent.parent
    docs, readme = (root / "docs" / "recovery.md").read_text(), (root / "README.md").read_text()
    section = docs[docs.index(SECTION_BEGIN) + len(SECTION_BEGIN):docs.index(SECTION_END)].strip()
    line = readme[readme.index(README_BEGIN) + len(README_BEGIN):readme.index(README_END)].strip()
    m = measured()
    if m is None:
        assert not RESULT_FILE.exists() and "not measured yet" in section and "not measured yet" in line
        return
    assert section == render_section(m).strip() and line == render_readme(m).strip()
    for s, r in m["ratios"].items():
        assert r == pytest.approx(m["int8_damage"][s] / m["checkfree_damage"][s])
    assert m["worst_ratio"] == max(m["ratios"].values()) and m["eval_tokens"] >= 50_000


def test_the_rendered_section_carries_the_files_numbers(tmp_path):
    """What benchmarks.snapshots writes into the docs, from a result of the quick benchmark's form."""
    from benchmarks.snapshots import render_readme, render_section, update_docs

    fake = {"command": "python -m benchmarks.snapshots --quick --init-from M", "commit": "0123456789abcdef",
            "eval_tokens": 50176, "wall_s": 812.4, "checkfree_damage": {"1": 2.5, "2": 0.75},
            "int8_damage": {"1": 0.001, "2": -0.0005}, "ratios": {"1": 0.0004, "2": -0.000667},
            "worst_ratio": 0.0004, "first_step_loss": {"checkfree": 3.875, "checkfree+": 9.5},
            "costs_int8_p10": [0.042, 0.126]}
    text = render_section(fake)
    assert "| 1 | 2.500 | +0.00100 | +0.00040 |" in text and "worst ratio over the stages: 0.00040" in text
    assert "at most 4.2% of the full-precision" in text and "at most 12.6% of that" in text
    assert "was 9.50, against 3.88" in text and "50176 held-out tokens" in text and "812 s" in text
    assert "at most 0.0004 of what CheckFree's rebuild lost (0.75 to 2.50 nats" in render_readme(fake)
    for name, begin, end in (("docs/recovery.md", "<!-- rendered by benchmarks.snapshots.render_section",
                              "<!-- end of the snapshots section -->"),
                             ("README.md", "<!-- rendered by benchmarks.snapshots.render_readme",
                              "<!-- end of the snapshots line -->")):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(
            f"before\n{begin} from benchmarks/results/snapshots-quick.json -->\nold\n{end}\nafter\n")
    update_docs(fake, tmp_path)
    docs = (tmp_path / "docs/recovery.md").read_text()
    assert "\nold\n" not in docs and text in docs
    assert (tmp_path / "README.md").read_text().endswith("-->\nafter\n")


def _region(text: str, begin: str, end: str) -> str:
    return text[text.index(begin) + len(begin):text.index(end)].strip()


def test_the_current_step_copies_and_the_swarm_rounds_in_the_docs_are_their_result_files():
    """docs/recovery.md's table of the copies of the current step and benchmarks/README.md's swarm rounds are the
    renderings of their committed result files (`--current`, `--swarm`), or say they were not measured yet; each
    file's worst values and ratios are those of its own rows."""
    import json
    from pathlib import Path

    from benchmarks.snapshots import (CURRENT_BEGIN, CURRENT_END, SWARM_FILES, render_current, render_swarm,
                                      swarm_markers)

    root = Path(__file__).resolve().parent.parent
    regions = [("docs/recovery.md", "snapshots-current.json", CURRENT_BEGIN, CURRENT_END, render_current)]
    regions += [("benchmarks/README.md", name, *swarm_markers(name), render_swarm) for name in SWARM_FILES]
    for doc, name, begin, end, render in regions:
        region = _region((root / doc).read_text(), begin, end)
        path = root / "benchmarks" / "results" / name
        if not path.exists():
            assert region == "Not measured yet."
            continue
        result = json.loads(path.read_text())
        assert region == render(result).strip()
        if name == "snapshots-current.json":
            for fmt, by in result["damage"].items():
                assert result["worst"][fmt] == max(by.values()) and sorted(by) == ["1", "2", "3", "4"]
                assert result["met"][fmt] == (result["worst"][fmt] <= result["bounds"][fmt])
            assert result["eval_tokens"] >= 50_000
        else:
            t = result["per_round"]
            assert len(t["snap"]) == len(t["checkfree"]) >= 5
            assert result["ratios"] == pytest.approx([a / b for a, b in zip(t["snap"], t["checkfree"])])
            assert result["overhead"] == pytest.approx(result["median"]["snap"] / result["median"]["checkfree"] - 1)


def test_the_current_step_copies_and_the_swarm_rounds_render_their_files_numbers(tmp_path):
    """What `--current` and `--swarm` write into the docs, from results of their form: bounds met or not as the
    numbers say."""
    from benchmarks.snapshots import render_costs, render_current, render_swarm, update_docs

    current = {"command": "python -m benchmarks.snapshots --current --init-from M", "commit": "0123456789abcdef",
               "eval_tokens": 50176, "wall_s": 401.2, "group": 64,
               "damage": {"int8": {"1": 0.0012, "2": 0.0031}, "int4": {"1": 0.05, "2": 0.125}},
               "worst": {"int8": 0.0031, "int4": 0.125}, "bounds": {"int8": 0.02, "int4": 0.1}}
    text = render_current(current)
    assert "| 2 | +0.00310 | +0.12500 |" in text and "a scale per 64 values" in text and "401 s" in text
    assert "int8 +0.00310 nats (issue 42's bound: at most 0.02: met)" in text
    assert "int4 +0.12500 nats (at most 0.1: not met)" in text
    swarm = {"command": "python -m benchmarks.snapshots --swarm --init-from M", "commit": "0123456789abcdef",
             "wall_s": 900.0, "load": [2.0, 3.5], "steps": 12, "skip": 2,
             "per_round": {"snap": [1.0, 1.1, 2.0], "checkfree": [1.0, 1.0, 1.9]},
             "median": {"snap": 1.1, "checkfree": 1.0}, "overhead": 0.1, "ratios": [1.0, 1.1, 2.0 / 1.9]}
    text = render_swarm(swarm)
    assert "| 1 | 1.100 | 1.000 | 1.100 |" in text and "3 interleaved rounds" in text
    assert "1.100 s/step with streamed copies, 1.000 without: +10.0% (per round +0.0% to +10.0%)" in text
    assert "within 3%: not met" in text and "an update every step (`--snapshot-every 1`" in text
    means = {"snap": [1.2, 1.3, 2.0], "checkfree": [1.0, 1.0, 1.9]}
    text = render_swarm({**swarm, "every": 10, "mean_per_round": means})
    assert "an update every 10 steps (`--snapshot-every 10`" in text
    assert "Mean step time, median over the rounds: 1.300 s with copies, 1.000 without (+30.0%)." in text
    costs = render_costs({"costs_p10": {"int8": {"sent": 0.042, "held": 0.168},
                                        "int8 +moments": {"sent": 0.21, "held": 0.503}}})
    assert "| int8 | 4.2% | met | 16.8% | met |" in costs
    assert "| int8 +moments | 21.0% | met | 50.3% | not met |" in costs
    (tmp_path / "docs").mkdir()
    (tmp_path / "benchmarks").mkdir()
    from benchmarks.snapshots import CURRENT_BEGIN, CURRENT_END, SWARM_BEGIN, SWARM_END

    (tmp_path / "docs/recovery.md").write_text(f"a\n{CURRENT_BEGIN}\nold\n{CURRENT_END}\nb\n")
    (tmp_path / "benchmarks/README.md").write_text(f"a\n{SWARM_BEGIN}\nold\n{SWARM_END}\nb\n")
    update_docs(root=tmp_path, current=current, swarm=swarm)
    assert render_current(current) in (tmp_path / "docs/recovery.md").read_text()
    readme = (tmp_path / "benchmarks/README.md").read_text()
    assert readme == f"a\n{SWARM_BEGIN}\n{render_swarm(swarm)}\n{SWARM_END}\nb\n"


def test_the_codec_cost_table_is_its_result_files_and_the_rewrite_made_the_same_updates():
    """benchmarks/README.md's snapcost table is `benchmarks.snapcost.render` of benchmarks/results/snapcost.json
    (rewrite it with python -m benchmarks.snapcost), and every run there made the same update bytes and mirror
    before and after the codec's rewrite."""
    import json

    from benchmarks.snapcost import BEGIN, END, RESULT, ROOT, render

    result = json.loads(RESULT.read_text())
    assert result["runs"] and all(r["same_update"] and r["same_mirror"] for r in result["runs"])
    text = (ROOT / "benchmarks" / "README.md").read_text()
    assert text[text.index(BEGIN) + len(BEGIN):text.index(END)].strip() == render(result).strip()
