"""The replacement peer's side of a recovery, in process: a stage built without weights."""

from __future__ import annotations

import pytest
import torch

from checkfree.pipeline import Hop
from checkfree.worker import StageWorker

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def cfg(tiny_cfg):
    tiny_cfg.model.num_layers = 12  # 3 blocks a stage: a rebuild with some work in it
    return tiny_cfg


def test_stage_built_without_weights_trains_exactly_like_a_loaded_one(cfg) -> None:
    """StageWorker(init=False) takes the recovered tensors as its weights (no random init first):
    same forward, backward, Adam step and RoPE tables as a normally built worker loading them."""
    state = {k: v + 0.01 for k, v in StageWorker(cfg, 1).state_dict().items()}  # stage 1 and 2 keys line up
    loaded, bare = StageWorker(cfg, 2), StageWorker(cfg, 2, init=False)
    assert loaded.has_weights and not bare.has_weights
    loaded.load_recovered({k: v.clone() for k, v in state.items()}, 1.1)
    bare.load_recovered({k: v.clone() for k, v in state.items()}, 1.1)
    assert bare.has_weights
    for (ka, a), (kb, b) in zip(loaded.module.named_buffers(), bare.module.named_buffers(), strict=True):
        assert ka == kb and torch.equal(a, b), ka
    gen = torch.Generator().manual_seed(0)
    m = cfg.model
    x = torch.randn(cfg.train.microbatch_size, m.context_length, m.d_model, generator=gen)
    grad = torch.randn(x.shape, generator=gen)
    (out_a, grad_a, stats_a), (out_b, grad_b, stats_b) = [
        (w.forward("mb", x, Hop(2, False, False)), w.backward("mb", grad), w.step(0)) for w in (loaded, bare)]
    assert torch.equal(out_a, out_b) and torch.equal(grad_a, grad_b) and stats_a == stats_b
    after = bare.state_dict()
    assert all(torch.equal(v, after[k]) for k, v in loaded.state_dict().items())
