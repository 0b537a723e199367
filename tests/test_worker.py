"""StageWorker's optimizer step: the arithmetic of torch's own Adam.step, without the torch._dynamo import that its
wrappers make at the first call (seconds of CPU in every peer process)."""

from __future__ import annotations

import subprocess
import sys

import torch

from checkfree.config import preset
from checkfree.pipeline import route
from checkfree.worker import StageWorker


def _train(steps: int = 3) -> list[torch.Tensor]:
    """A tiny four-stage CheckFree+ pipeline (its groups: main, embed, head, each with its LR and clipping)
    trained `steps` steps through StageWorker.step: its weights and Adam state at the end."""
    cfg = preset("tiny")
    cfg.num_stages, cfg.model.num_layers, cfg.recovery.strategy, cfg.train.num_microbatches = 4, 4, "checkfree+", 2
    torch.manual_seed(0)
    workers = [StageWorker(cfg, s, torch.device("cpu")) for s in range(cfg.num_stages)]
    gen = torch.Generator().manual_seed(0)
    for step in range(steps):
        for mb in range(2):
            x = tokens = torch.randint(0, cfg.model.vocab_size, (cfg.train.microbatch_size, cfg.seq_len), generator=gen)
            hops = route(cfg.num_stages, True, step, mb, 2)
            for hop in hops:
                x = workers[hop.stage].forward(mb, x, hop, tokens if hop.head else None)
            grad = None
            for hop in reversed(hops):
                grad = workers[hop.stage].backward(mb, grad)
        for w in workers:
            assert not w.step(step).skipped
    return [t.clone() for w in workers for t in w.module.state_dict().values()] + [
        v.clone() for w in workers for st in w.optimizer.state_dict()["state"].values() for v in st.values()]


def test_the_step_is_adams_own_arithmetic_bit_for_bit(monkeypatch):
    """StageWorker.step with its Adam update against the same with torch's Adam.step (hooks, profiler and
    graph-break wrappers and all): equal to the bit, parameters and Adam state, after three steps."""
    import checkfree.worker as worker

    ours = _train()
    monkeypatch.setattr(worker, "_adam_step", lambda opt: opt.step())
    theirs = _train()
    assert len(ours) == len(theirs)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


def test_building_stepping_and_moving_a_stages_state_never_imports_torch_dynamo():
    """A fresh process builds a stage, trains it a step, and takes and loads its optimizer state: torch._dynamo
    (2.3 to 2.9 s of CPU to import) is never imported."""
    code = """
import sys, torch
from checkfree.config import preset
from checkfree.pipeline import route
from checkfree.worker import StageWorker
cfg = preset("tiny")
w = StageWorker(cfg, 0, torch.device("cpu"))
tokens = torch.randint(0, cfg.model.vocab_size, (cfg.train.microbatch_size, cfg.seq_len))
hop = route(cfg.num_stages, False, 0, 0, 1)[0]
out = w.forward(0, tokens, hop, None)
w.backward(0, torch.ones_like(out))
assert not w.step(0).skipped
w.load_optimizer_state(w.optimizer_state())
w.drop_inflight()
print("dynamo imported:", "torch._dynamo" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "dynamo imported: False" in out.stdout, out.stdout + out.stderr[-2000:]
