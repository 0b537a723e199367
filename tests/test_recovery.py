from __future__ import annotations

import pytest
import torch

from checkfree.config import ModelConfig
from checkfree.model import PipelineStage, StageSpec, init_stage, plan_stages
from checkfree.recovery import (UnrecoverableFailure, checkfree_average, identity_init, omega, plan_recovery,
                                random_init, rebuild_stage, recovered_optimizer_state, uniform_average)


def test_checkfree_average_hand_computed():
    prev = {"w": torch.tensor([1.0, 2.0])}
    nxt = {"w": torch.tensor([3.0, 6.0])}
    out = checkfree_average(prev, nxt, prev_norm=0.5, next_norm=0.25)
    # a = 0.25 + 1e-4 = 0.2501 (next's own norm), b = 0.5 + 1e-4 = 0.5001
    # (0.2501*3 + 0.5001*1) / 0.7502 = 1.2504 / 0.7502 ; (0.2501*6 + 0.5001*2) / 0.7502 = 2.5008 / 0.7502
    assert out["w"].tolist() == pytest.approx([1.666755532, 3.333511064], abs=1e-6)


def test_checkfree_average_matches_formula_on_random_state_dicts():
    g = torch.Generator().manual_seed(0)
    prev = {f"blocks.0.k{i}": torch.randn(5, 3, generator=g) for i in range(4)}
    nxt = {k: torch.randn(5, 3, generator=g) for k in prev}
    pn, nn_ = 0.37, 0.91
    out = checkfree_average(prev, nxt, prev_norm=pn, next_norm=nn_, eps=1e-4)
    a, b = nn_ + 1e-4, pn + 1e-4
    for k in prev:
        torch.testing.assert_close(out[k], (a * nxt[k] + b * prev[k]) / (a + b))


def test_uniform_and_omega_options():
    out = uniform_average({"w": torch.tensor([0.0])}, {"w": torch.tensor([2.0])})
    assert out["w"].item() == 1.0
    assert omega(3.0, 1.0) == 1.0
    assert omega(3.0, 1.0, kind="pre-clip") == 3.0
    assert omega(3.0, 0.5, power=2) == 0.25
    with pytest.raises(ValueError):
        omega(1.0, 1.0, kind="bogus")


def test_plan_intermediate_uses_both_live_neighbours():
    (plan,) = plan_recovery({2}, 5, "checkfree")
    assert plan.method == "average" and plan.sources == (1, 3) and plan.fallback is None


def test_plain_checkfree_cannot_recover_edges():
    with pytest.raises(UnrecoverableFailure, match="first stage"):
        plan_recovery({0}, 4, "checkfree")
    (plan,) = plan_recovery({3}, 4, "checkfree", fallback="random")
    assert plan.fallback == "random" and plan.method == "random" and "last stage" in plan.reason
    assert plan.edges_reinit == ("head",)


def test_adjacent_failures_go_to_fallback_never_dead_sources():
    with pytest.raises(UnrecoverableFailure, match="adjacent"):
        plan_recovery({1, 2}, 5, "checkfree")
    plans = plan_recovery({1, 2}, 5, "checkfree", fallback="copy")
    assert [p.fallback for p in plans] == ["copy", "copy"]
    for p in plans:
        assert not set(p.sources) & {1, 2}
    assert plans[0].sources == (0,) and plans[1].sources == (3,)


def test_checkfree_plus_recovers_edges_by_copy_and_replicas():
    first, last = plan_recovery({0, 5}, 6, "checkfree+")
    assert (first.method, first.sources, first.edge_sources) == ("copy", (1,), {"embed": 1})
    assert (last.method, last.sources, last.edge_sources) == ("copy", (4,), {"head": 4})
    (inner,) = plan_recovery({1}, 6, "checkfree+")
    assert inner.sources == (0, 2) and inner.edge_sources == {"embed": 0}
    with pytest.raises(UnrecoverableFailure):
        plan_recovery({0, 1}, 6, "checkfree+")


def test_rebuild_stage_averages_blocks_and_restores_edges_exactly():
    g = torch.Generator().manual_seed(1)
    tmpl = {"blocks.0.w": torch.zeros(2, 2), "blocks.1.w": torch.zeros(2, 2), "embed.weight": torch.zeros(4, 2)}
    b0 = {"blocks.0.w": torch.randn(2, 2, generator=g), "blocks.1.w": torch.randn(2, 2, generator=g)}
    b2 = {"blocks.0.w": torch.randn(2, 2, generator=g)}  # a shallower neighbour
    emb = {"embed.weight": torch.randn(4, 2, generator=g)}
    (plan,) = plan_recovery({1}, 4, "checkfree+")
    state, coeffs = rebuild_stage(plan, tmpl, {0: b0, 2: b2}, {0: 0.2, 2: 0.6}, {"embed": emb})
    expect = checkfree_average({"w": b0["blocks.0.w"]}, {"w": b2["blocks.0.w"]}, prev_norm=0.2, next_norm=0.6)
    assert torch.equal(state["blocks.0.w"], expect["w"])
    assert torch.equal(state["blocks.1.w"], b0["blocks.1.w"])  # only one source has it
    assert torch.equal(state["embed.weight"], emb["embed.weight"])
    assert coeffs[2] == pytest.approx((0.6 + 1e-4) / 0.8002) and sum(coeffs.values()) == pytest.approx(1.0)


def test_rebuild_refuses_non_finite_sources():
    (plan,) = plan_recovery({1}, 3, "checkfree")
    bad = {"blocks.0.w": torch.tensor([float("nan")])}
    with pytest.raises(ValueError, match="non-finite"):
        rebuild_stage(plan, {"blocks.0.w": torch.zeros(1)}, {0: bad, 2: bad}, {0: 1.0, 2: 1.0}, {})


def test_random_init_deterministic():
    t = {"a": torch.zeros(3, 3), "n": torch.zeros(3)}
    x, y = random_init(t, seed=5), random_init(t, seed=5)
    assert torch.equal(x["a"], y["a"]) and torch.equal(x["n"], torch.ones(3))


def test_unknown_strategy_and_fallback():
    with pytest.raises(ValueError, match="unknown recovery strategy"):
        plan_recovery({1}, 4, "bogus")
    with pytest.raises(ValueError, match="unknown fallback"):
        plan_recovery({1}, 4, "checkfree", fallback="pray")


def test_recovered_optimizer_state_copies_replicas_only():
    g = torch.Generator().manual_seed(2)
    st = {"step": torch.tensor(7.0), "exp_avg": torch.randn(4, 2, generator=g),
          "exp_avg_sq": torch.rand(4, 2, generator=g)}
    (plan,) = plan_recovery({0}, 4, "checkfree+")
    out = recovered_optimizer_state(plan, {"embed": {"embed.weight": st}})
    assert out.keys() == {"embed.weight"} and out["embed.weight"].keys() == st.keys()
    for k, v in st.items():
        assert torch.equal(out["embed.weight"][k], v) and out["embed.weight"][k].data_ptr() != v.data_ptr()
    with pytest.raises(ValueError, match="sent as part of the 'embed' replica"):
        recovered_optimizer_state(plan, {"embed": {"blocks.0.w": st}})
    (plain,) = plan_recovery({0}, 4, "random")  # no live replica: the component starts fresh
    assert plain.edges_reinit == ("embed",) and recovered_optimizer_state(plain, {}) == {}


def test_block_scope_omega_excludes_the_embedding_and_head():
    """StepStats carries the blocks' share of the main group's norm (before and after the group's clip);
    omega_scope picks it. Under CheckFree+ the main group is the blocks, so both scopes agree."""
    import torch

    from checkfree.config import RecoveryConfig, preset
    from checkfree.worker import StageWorker

    for strategy in ("checkfree", "checkfree+"):
        cfg = preset("tiny")
        cfg.recovery.strategy = strategy
        worker = StageWorker(cfg, 0)
        for p in worker.module.parameters():
            p.grad = torch.randn_like(p)
        expect = float(torch.linalg.vector_norm(torch.stack(
            [p.grad.norm() for n, p in worker.module.named_parameters() if n.startswith("blocks.")])))
        stats = worker.step(0)
        assert stats.block_grad_norm_pre == pytest.approx(expect, rel=1e-5)
        assert stats.block_grad_norm_post == pytest.approx(expect * stats.grad_norm_post / stats.grad_norm_pre, rel=1e-4)
        blocks, stage = RecoveryConfig(omega_scope="blocks"), RecoveryConfig()
        if strategy == "checkfree":
            assert stats.omega(stage) > stats.omega(blocks) > 0  # the embedding's gradient counts in the stage
        else:
            assert stats.omega(stage) == pytest.approx(stats.omega(blocks))
    with pytest.raises(ValueError, match="omega_scope must be 'stage' or 'blocks'"):
        RecoveryConfig(omega_scope="all")


def _identity_rebuilt(cfg: ModelConfig, spec: StageSpec, num_stages: int, strategy: str,
                      fallback: str = "abort") -> PipelineStage:
    """Stage `spec` trained-looking (seeded random), then rebuilt alone by `strategy` / `fallback`."""
    stage = PipelineStage(cfg, spec, has_embedding=spec.is_first, has_head=spec.is_last)
    init_stage(stage, seed=3)
    (plan,) = plan_recovery({spec.index}, num_stages, strategy, fallback)
    assert plan.method == "identity" and plan.sources == ()
    state, coeffs = rebuild_stage(plan, stage.state_dict(), {}, {}, {}, seed=11)
    assert coeffs == {}
    stage.load_state_dict(state)
    return stage


@pytest.mark.parametrize("kv_heads", [None, 2, 1])  # multi-head, grouped-query, multi-query attention
def test_identity_rebuilt_stage_passes_its_input_through_exactly(kv_heads):
    cfg = ModelConfig(vocab_size=64, d_model=32, num_heads=4, num_kv_heads=kv_heads, num_layers=6, context_length=16)
    specs = plan_stages(cfg.num_layers, 3)
    stage = _identity_rebuilt(cfg, specs[1], 3, "identity")
    x = torch.randn(2, 16, cfg.d_model, generator=torch.Generator().manual_seed(0)) * 5
    with torch.no_grad():
        assert torch.equal(stage(x), x)
    state = stage.state_dict()
    for j in range(specs[1].num_blocks):
        assert not state[f"blocks.{j}.attn.wo.weight"].any() and not state[f"blocks.{j}.mlp.w2.weight"].any()
        for norm in ("attn_norm", "mlp_norm"):
            assert torch.equal(state[f"blocks.{j}.{norm}.weight"], torch.ones(cfg.d_model))
        for k in ("attn.wq", "attn.wk", "attn.wv", "mlp.w1", "mlp.w3"):  # random: the stage can learn again
            assert state[f"blocks.{j}.{k}.weight"].std() == pytest.approx(cfg.init_std, rel=0.3), k
    # until it trains: the zero projections get gradients at once, the matrices behind them not yet
    stage(x).pow(2).sum().backward()
    grads = dict(stage.named_parameters())
    assert grads["blocks.0.attn.wo.weight"].grad.abs().sum() > 0 and grads["blocks.0.mlp.w2.weight"].grad.abs().sum() > 0
    assert not grads["blocks.0.attn.wq.weight"].grad.any() and not grads["blocks.0.mlp.w1.weight"].grad.any()


def test_identity_on_an_edge_stage_is_the_fallbacks_pass_through_blocks_and_fresh_embedding():
    """identity cannot rebuild an embedding or a head: it refuses the first / last stage like plain
    CheckFree; as a fallback it rebuilds the blocks as pass-throughs and re-initialises the component."""
    cfg = ModelConfig(vocab_size=64, d_model=16, num_heads=2, num_layers=4, context_length=8)
    specs = plan_stages(cfg.num_layers, 2)
    with pytest.raises(UnrecoverableFailure, match="strategy identity cannot recover the first stage"):
        plan_recovery({0}, 2, "identity")
    first = _identity_rebuilt(cfg, specs[0], 2, "identity", fallback="identity")
    (plan,) = plan_recovery({0}, 2, "identity", "identity")
    assert plan.fallback == "identity" and plan.edges_reinit == ("embed",)
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(first(tokens, embed=True), first.embed(tokens))
    last = _identity_rebuilt(cfg, specs[1], 2, "checkfree", fallback="identity")
    h = torch.randn(2, 8, 16)
    with torch.no_grad():
        assert torch.equal(last(h, head=True), last.head(h))


def test_identity_needs_no_neighbour_and_is_a_fallback_for_adjacent_losses():
    plans = plan_recovery({1, 2}, 5, "identity")  # no sources, so adjacent losses are no obstacle
    assert [(p.method, p.sources, p.fallback) for p in plans] == [("identity", (), None)] * 2
    plans = plan_recovery({1, 2}, 5, "checkfree", fallback="identity")
    assert [(p.method, p.sources, p.fallback) for p in plans] == [("identity", (), "identity")] * 2
    assert all("adjacent" in p.reason for p in plans)
    first, second = plan_recovery({0, 1}, 6, "checkfree+", fallback="identity")  # both embedding holders lost
    assert (first.method, first.edges_reinit, second.method, second.edges_reinit) == (
        "identity", ("embed",), "identity", ("embed",))
    (alone,) = plan_recovery({5}, 6, "checkfree+", fallback="identity")  # the strategy itself recovers it
    assert alone.method == "copy" and alone.fallback is None


def test_identity_init_is_deterministic_and_leaves_other_keys_alone():
    t = {"blocks.0.attn.wo.weight": torch.zeros(4, 4), "blocks.0.attn.wq.weight": torch.zeros(4, 4),
         "blocks.0.mlp.w2.weight": torch.zeros(4, 8), "blocks.0.attn_norm.weight": torch.zeros(4),
         "head.out.weight": torch.zeros(9, 4)}
    x, y = identity_init(t, seed=5), identity_init(t, seed=5)
    assert x.keys() == t.keys() and all(torch.equal(x[k], y[k]) for k in t)
    rnd = random_init(t, seed=5)
    for k in ("blocks.0.attn.wq.weight", "head.out.weight", "blocks.0.attn_norm.weight"):
        assert torch.equal(x[k], rnd[k]), k
    assert not x["blocks.0.attn.wo.weight"].any() and not x["blocks.0.mlp.w2.weight"].any()
