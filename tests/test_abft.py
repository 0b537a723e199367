"""ABFT-protected attention: single faults corrected in outputs and gradients, no false
positives, escalation, clean-path exactness, and a short training run under faults."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from checkfree.abft import (
    FAULT_KINDS,
    SITES,
    AttentionGuard,
    FaultInjector,
    UncorrectableSoftError,
    check_and_correct,
    default_threshold,
    flip_bit,
    install_guard,
    near_inf,
    remove_guard,
)
from checkfree.config import ModelConfig
from checkfree.model import Attention, PipelineStage, apply_rope, init_stage, plan_stages

CFG = ModelConfig(vocab_size=64, d_model=32, num_heads=4, num_layers=2, context_length=16)
KINDS: tuple = FAULT_KINDS + (7.5,)  # a chosen (non-extreme) value is only seen by the full check


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    """Tiny tensors: one intra-op thread is faster and immune to a loaded machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_attention(seed: int = 0, bias: bool = True) -> Attention:
    torch.manual_seed(seed)
    attn = Attention(CFG)
    if bias:
        for name in ("wq", "wk", "wv", "wo"):
            setattr(attn, name, nn.Linear(CFG.d_model, CFG.d_model, bias=True))
    return attn


def make_input(seed: int = 1, batch: int = 2, scale: float = 1.0) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, CFG.context_length, CFG.d_model, generator=gen) * scale).requires_grad_(True)


def run(attn: Attention, x: Tensor, guard: AttentionGuard | None) -> tuple[Tensor, dict[str, Tensor]]:
    """Forward + backward of a fixed scalar loss; returns the output and all gradients."""
    attn.guard = guard
    attn.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    y = attn(x)
    w = torch.linspace(-1, 1, y.numel()).view_as(y)
    ((y * w).sum() + y.pow(2).sum()).backward()  # depends on y, as a downstream loss would
    grads = {"x": x.grad}
    grads.update({n: p.grad for n, p in attn.named_parameters()})
    attn.guard = None
    return y.detach(), grads


def explicit_attention(attn: Attention, x: Tensor) -> Tensor:
    """Hand-written explicit attention math, op for op what the guard computes."""
    b, t, c = x.shape
    q = apply_rope(attn.split_heads(F.linear(x, attn.wq.weight, attn.wq.bias)), attn.rope_cos, attn.rope_sin)
    k = apply_rope(attn.split_heads(F.linear(x, attn.wk.weight, attn.wk.bias)), attn.rope_cos, attn.rope_sin)
    mask = torch.zeros(t, t).masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    p = torch.softmax(torch.add(mask, q @ k.transpose(-2, -1), alpha=1.0 / math.sqrt(attn.head_dim)), dim=-1)
    v = attn.split_heads(F.linear(x, attn.wv.weight, attn.wv.bias))
    return F.linear((p @ v).transpose(1, 2).reshape(b, t, c), attn.wo.weight, attn.wo.bias)


def assert_close_all(y: Tensor, grads: dict[str, Tensor], y_ref: Tensor, grads_ref: dict[str, Tensor]) -> None:
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-5)
    for name, g in grads.items():
        assert torch.isfinite(g).all(), name
        torch.testing.assert_close(g, grads_ref[name], rtol=1e-4, atol=1e-5, msg=lambda m: f"grad {name}: {m}")


# --- clean path ------------------------------------------------------------------------


def test_clean_path_bitwise_identical_across_modes_and_explicit_math() -> None:
    attn, x = make_attention(), make_input()
    y_off, g_off = run(attn, x, AttentionGuard(mode="off"))
    for mode in ("range", "full"):
        guard = AttentionGuard(mode=mode, injector=FaultInjector())
        y, g = run(attn, x, guard)
        assert torch.equal(y, y_off)
        assert all(torch.equal(g[n], g_off[n]) for n in g_off)
        assert guard.detected == guard.corrected == guard.escalated == 0
    assert torch.equal(explicit_attention(attn, x).detach(), y_off)
    # against the module's own fused SDPA path: equal to round-off only
    y_sdpa, g_sdpa = run(attn, x, None)
    torch.testing.assert_close(y_off, y_sdpa, rtol=0, atol=1e-6)
    for n in g_off:
        torch.testing.assert_close(g_off[n], g_sdpa[n], rtol=1e-5, atol=1e-6)


def test_clean_path_without_bias_matches_module() -> None:
    attn, x = make_attention(bias=False), make_input()
    y, _ = run(attn, x, AttentionGuard(mode="full"))
    y_ref, _ = run(attn, x, None)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-6)


# --- single faults -----------------------------------------------------------------------


@pytest.mark.parametrize("site", SITES)
@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_single_fault_corrected_in_output_and_gradients(site: str, kind: object) -> None:
    attn, x = make_attention(), make_input()
    y_ref, g_ref = run(attn, x, AttentionGuard(mode="range"))
    mode = "full" if isinstance(kind, float) else "range"
    for seed in (0, 1):  # two seeded-random positions
        guard = AttentionGuard(mode=mode, injector=FaultInjector.from_schedule([(0, site, kind)], seed=seed))
        y, g = run(attn, x, guard)
        assert (guard.injected, guard.detected, guard.corrected, guard.escalated) == (1, 1, 1, 0)
        assert_close_all(y, g, y_ref, g_ref)


@pytest.mark.parametrize("site", SITES)
def test_fault_at_chosen_position_and_first_last_element(site: str) -> None:
    attn, x = make_attention(), make_input()
    y_ref, g_ref = run(attn, x, AttentionGuard())
    for row, col in ((0, 0), (-1, -1), (5, 3)):
        guard = AttentionGuard(injector=FaultInjector.from_schedule([(0, site, "nan", row, col)]))
        y, g = run(attn, x, guard)
        assert guard.corrected == 1
        assert_close_all(y, g, y_ref, g_ref)


def test_inject_only_goes_nan_without_detection() -> None:
    attn, x = make_attention(), make_input()
    for site in SITES:
        guard = AttentionGuard(mode="off", injector=FaultInjector.from_schedule([(0, site, "nan", 20, 1)]))
        y, g = run(attn, x, guard)
        assert guard.injected == 1 and guard.detected == 0
        assert not torch.isfinite(y).all(), site
        assert not all(torch.isfinite(t).all() for t in g.values()), site


def test_faults_in_different_sections_and_calls_all_corrected() -> None:
    attn, x = make_attention(), make_input()
    y_ref, g_ref = run(attn, x, AttentionGuard())
    schedule = [(0, "q", "inf"), (0, "v", "near_inf"), (0, "out", "nan"), (1, "scores", "-inf"), (1, "context", "nan")]
    guard = AttentionGuard(injector=FaultInjector.from_schedule(schedule, seed=3))
    for _ in range(2):
        y, g = run(attn, x, guard)
        assert_close_all(y, g, y_ref, g_ref)
    assert (guard.injected, guard.corrected, guard.escalated) == (5, 5, 0)


def test_range_mode_ignores_sub_threshold_values_full_mode_fixes_them() -> None:
    attn, x = make_attention(), make_input()
    y_ref, _ = run(attn, x, AttentionGuard())
    guard = AttentionGuard(mode="range", injector=FaultInjector.from_schedule([(0, "v", 7.5, 3, 3)]))
    y, _ = run(attn, x, guard)
    assert guard.triggered == guard.detected == 0 and not torch.allclose(y, y_ref)
    guard = AttentionGuard(mode="range", threshold=5.0, injector=FaultInjector.from_schedule([(0, "v", 7.5, 3, 3)]))
    y, _ = run(attn, x, guard)
    assert guard.corrected == 1
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-5)


def test_float64_threshold_follows_dtype() -> None:
    attn, x = make_attention().double(), make_input().double()
    y_ref, g_ref = run(attn, x, AttentionGuard())
    guard = AttentionGuard(injector=FaultInjector.from_schedule([(0, "context", "near_inf"), (0, "q", "nan")]))
    y, g = run(attn, x, guard)
    assert guard.corrected == 2 and y.dtype == torch.float64
    assert_close_all(y, g, y_ref, g_ref)


# --- no false positives --------------------------------------------------------------


def test_no_false_positives_over_many_clean_inputs() -> None:
    guard = AttentionGuard(mode="full")
    for seed in range(8):
        attn = make_attention(seed)
        attn.guard = guard
        with torch.no_grad():
            for j, scale in enumerate((1e-3, 1e-1, 1.0, 10.0, 100.0)):
                attn(make_input(seed * 10 + j, batch=3, scale=scale))
    assert guard.checks == 8 * 5 * 6
    assert guard.detected == guard.corrected == guard.escalated == 0


@settings(max_examples=60, deadline=None)
@given(
    nb=st.integers(1, 3),
    m=st.integers(2, 24),
    k=st.integers(1, 24),
    n=st.integers(2, 24),
    log_scale=st.floats(-3, 3),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_checksums_clean_products_never_flagged(
    nb: int, m: int, k: int, n: int, log_scale: float, bias: bool, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(nb, m, k, generator=gen) * 10**log_scale
    b = torch.randn(nb, k, n, generator=gen)
    bb = torch.randn(n, generator=gen) if bias else None
    c = a @ b + (bb if bias else 0)
    before = c.clone()
    assert not check_and_correct(c, a, b, bb).detected
    assert torch.equal(c, before)


@settings(max_examples=60, deadline=None)
@given(
    m=st.integers(2, 20),
    n=st.integers(2, 20),
    kind=st.sampled_from(KINDS),
    data=st.data(),
)
def test_checksums_repair_any_single_fault(m: int, n: int, kind: object, data: st.DataObject) -> None:
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    a, b, bias = torch.randn(2, m, 8, generator=gen), torch.randn(1, 8, n, generator=gen), torch.randn(n, generator=gen)
    c = a @ b + bias
    truth = c.clone()
    bi, i, j = data.draw(st.integers(0, 1)), data.draw(st.integers(0, m - 1)), data.draw(st.integers(0, n - 1))
    c[bi, i, j] = near_inf(c[bi, i, j]) if kind == "near_inf" else float(kind)
    result = check_and_correct(c, a, b, bias)
    assert result.detected and result.corrected == 1
    torch.testing.assert_close(c, truth, rtol=1e-5, atol=1e-5)


# --- escalation ----------------------------------------------------------------------


def test_two_faults_in_one_section_escalate() -> None:
    attn, x = make_attention(), make_input()
    for schedule in ([(0, "q", "inf"), (0, "scores", "nan")], [(0, "v", "nan"), (0, "context", "near_inf")]):
        guard = AttentionGuard(injector=FaultInjector.from_schedule(schedule, seed=2))
        with pytest.raises(UncorrectableSoftError) as err:
            run(attn, x, guard)
        assert guard.escalated == 1 and err.value.site == schedule[1][1]


def test_bad_values_sharing_rows_and_columns_escalate_even_without_budget() -> None:
    attn, x = make_attention(), make_input()
    square = [(0, "scores", "nan", r, c) for r in (9, 10) for c in (2, 5)]  # a 2x2 block: every line holds two
    guard = AttentionGuard(max_faults_per_section=None, injector=FaultInjector.from_schedule(square))
    with pytest.raises(UncorrectableSoftError):
        run(attn, x, guard)
    assert guard.escalated == 1
    # two bad values in one row only: the columns repair them
    y_ref, g_ref = run(attn, x, AttentionGuard())
    row = [(0, "k", "inf", 4, 1), (0, "k", "nan", 4, 7)]
    guard = AttentionGuard(max_faults_per_section=None, injector=FaultInjector.from_schedule(row))
    y, g = run(attn, x, guard)
    assert guard.corrected == 2
    assert_close_all(y, g, y_ref, g_ref)


def test_corrupted_operands_escalate() -> None:
    a, b = torch.randn(1, 4, 3), torch.randn(1, 3, 5)
    c = a @ b
    a[0, 1, 1] = float("nan")
    c[0, 1, 1] = float("nan")
    with pytest.raises(UncorrectableSoftError):
        check_and_correct(c, a, b)


# --- helpers -------------------------------------------------------------------------


def test_bit_flips_and_thresholds() -> None:
    one = torch.tensor(0.5)
    assert flip_bit(one, 31).item() == -0.5
    assert flip_bit(flip_bit(one, 30), 30).item() == 0.5
    assert flip_bit(one, 30).item() == 0.5 * 2.0**128
    for v in (0.0, 0.3, -1.25, 3.0, 1e-40):
        out = near_inf(torch.tensor(v)).item()
        assert math.isfinite(out) and abs(out) > 1e10
    assert default_threshold(torch.float32) == 1e10
    assert default_threshold(torch.float16) == torch.finfo(torch.float16).max / 4


def test_random_schedule_is_seeded() -> None:
    a, b = FaultInjector.random(5, seed=7, calls=range(100)), FaultInjector.random(5, seed=7, calls=range(100))
    assert a.schedule == b.schedule and len({f.call for f in a.schedule}) == 5
    assert [f.call for f in FaultInjector.random(3, seed=1).schedule] == [0, 1, 2]


def test_install_and_remove_guard() -> None:
    spec = plan_stages(CFG.num_layers, 2)[0]
    stage = PipelineStage(CFG, spec, has_embedding=True, has_head=False)
    guard = AttentionGuard()
    assert install_guard(stage, guard) == spec.num_blocks
    assert all(b.attn.guard is guard for b in stage.blocks)
    assert remove_guard(stage) == spec.num_blocks
    assert all(b.attn.guard is None for b in stage.blocks)


# --- training ------------------------------------------------------------------------


def train(guard: AttentionGuard | None, steps: int = 8) -> list[float]:
    """A short Adam run of a 2-stage tiny pipeline on a fixed synthetic task."""
    specs = plan_stages(CFG.num_layers, 2)
    stages = [
        PipelineStage(CFG, specs[0], has_embedding=True, has_head=False),
        PipelineStage(CFG, specs[1], has_embedding=False, has_head=True),
    ]
    for s in stages:
        init_stage(s, seed=0)
        install_guard(s, guard)
    opt = torch.optim.Adam([p for s in stages for p in s.parameters()], lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, CFG.vocab_size, (4, CFG.context_length + 1), generator=gen)
    losses = []
    for _ in range(steps):
        logits = stages[1](stages[0](tokens[:, :-1], embed=True), head=True)
        loss = F.cross_entropy(logits.reshape(-1, CFG.vocab_size), tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_training_with_faults_tracks_fault_free_loss() -> None:
    steps = 8
    clean = train(AttentionGuard(), steps)
    assert clean[-1] < clean[0]
    make = lambda: FaultInjector.random(8, seed=11, calls=range(2 * steps))  # noqa: E731
    guard = AttentionGuard(injector=make())
    guarded = train(guard, steps)
    assert guard.injected == guard.corrected == 8 and guard.escalated == 0
    assert guarded == pytest.approx(clean, rel=1e-4, abs=1e-5)
    unguarded = train(AttentionGuard(mode="off", injector=make()), steps)
    assert not math.isfinite(unguarded[-1])
