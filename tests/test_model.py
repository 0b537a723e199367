from __future__ import annotations

import pytest
import torch

from checkfree.config import ModelConfig, preset
from checkfree.model import (LlamaModel, PipelineStage, global_to_stage, init_stage, plan_stages,
                             stage_to_global)


def test_plan_stages_even_and_uneven():
    specs = plan_stages(10, 4)
    assert [s.num_blocks for s in specs] == [3, 3, 2, 2]
    assert specs[0].layer_start == 0 and specs[-1].layer_end == 10
    assert all(a.layer_end == b.layer_start for a, b in zip(specs, specs[1:]))


def test_plan_stages_errors_spell_out_arithmetic():
    with pytest.raises(ValueError, match="num_layers=3 < num_stages=4"):
        plan_stages(3, 4)
    with pytest.raises(ValueError, match="at least 2 stages"):
        plan_stages(8, 1)


@pytest.mark.parametrize("num_stages", [2, 3, 4, 8])
def test_chained_stages_equal_unsplit_model(num_stages):
    cfg = ModelConfig(vocab_size=97, d_model=32, num_heads=4, num_layers=8, context_length=16)
    torch.manual_seed(0)
    full = LlamaModel(cfg).eval()
    tokens = torch.randint(0, 97, (3, 16))
    specs = plan_stages(cfg.num_layers, num_stages)
    x = tokens
    for spec in specs:
        stage = PipelineStage(cfg, spec, has_embedding=spec.is_first, has_head=spec.is_last)
        stage.load_state_dict(global_to_stage(spec, full.state_dict(), embed=spec.is_first, head=spec.is_last))
        x = stage(x, embed=spec.is_first, head=spec.is_last)
    torch.testing.assert_close(x, full(tokens), rtol=0, atol=0)


def test_stage_names_are_local_and_round_trip():
    cfg = preset("tiny").model
    spec = plan_stages(cfg.num_layers, 4)[2]
    stage = PipelineStage(cfg, spec, has_embedding=False, has_head=False)
    keys = list(stage.state_dict())
    assert all(k.startswith("blocks.0.") or k.startswith("blocks.1.") for k in keys)
    glob = stage_to_global(spec, stage.state_dict())
    assert all(k.startswith("layers.4.") or k.startswith("layers.5.") for k in glob)
    back = global_to_stage(spec, glob, embed=False, head=False)
    assert back.keys() == stage.state_dict().keys()


def test_init_depends_on_global_layer_not_split():
    cfg = preset("tiny").model
    a = PipelineStage(cfg, plan_stages(8, 2)[1], has_embedding=False, has_head=True)  # layers 4..7
    b = PipelineStage(cfg, plan_stages(8, 4)[2], has_embedding=False, has_head=False)  # layers 4..5
    init_stage(a, 7)
    init_stage(b, 7)
    torch.testing.assert_close(a.blocks[0].attn.wq.weight, b.blocks[0].attn.wq.weight, rtol=0, atol=0)
    assert float(a.blocks[0].attn_norm.weight.detach().min()) == 1.0
    std = float(a.blocks[0].mlp.w1.weight.detach().std())
    assert 0.015 < std < 0.025


def test_stage_refuses_components_it_does_not_hold():
    cfg = preset("tiny").model
    stage = PipelineStage(cfg, plan_stages(8, 4)[1], has_embedding=False, has_head=False)
    with pytest.raises(ValueError, match="holds no embedding"):
        stage(torch.zeros(1, 4, dtype=torch.long), embed=True)
