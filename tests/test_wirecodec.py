"""checkfree.wirecodec: what activations and gradients look like on the wire."""

from __future__ import annotations

import pytest
import torch

from checkfree.wirecodec import decode, encode, quantize_int8, roundtrip


def test_int8_error_is_bounded_by_half_a_step_per_row_and_bytes_shrink():
    torch.manual_seed(0)
    x = torch.randn(4, 32, 64) * torch.logspace(-3, 2, 64)  # rows mixing tiny and large values
    x[0, 0] = 0.0  # an all-zero row survives
    q, scale = quantize_int8(x)
    assert q.dtype == torch.int8 and scale.shape == (4, 32)
    back = decode([q, scale], "int8", tuple(x.shape))
    err = (back - x).abs()
    bound = x.abs().amax(dim=-1, keepdim=True) / 254 * (1 + 1e-6)
    assert bool((err <= bound).all()), float((err - bound).max())
    assert torch.equal(back[0, 0], torch.zeros(64))
    sent = sum(t.numel() * t.element_size() for t in encode(x, "int8"))
    assert sent / (x.numel() * 4) < 0.27  # int8 values + one float32 scale per 64-wide row


@pytest.mark.parametrize("wire", ["float32", "bfloat16", "float16"])
def test_float_wires_are_casts(wire):
    x = torch.randn(2, 8, 16)
    (t,) = encode(x, wire)
    assert t.dtype == getattr(torch, wire) and torch.equal(decode([t], wire, (2, 8, 16)), t.float())
    assert torch.equal(roundtrip(x, wire), t.float())
    assert roundtrip(x, "float32") is x


def test_decode_refuses_what_encode_would_not_send():
    x = torch.randn(2, 8, 16)
    q, s = encode(x, "int8")
    for tensors, wire, match in (([q], "int8", "expected 2"), ([q.float(), s], "int8", "expected int8/float32"),
                                 ([q, s[:1]], "int8", "expected \\(2, 8, 16\\)/\\(2, 8\\)"),
                                 ([x, x], "float32", "expected 1"), ([x[:1]], "float32", "expected \\(2, 8, 16\\)"),
                                 ([q], "float32", "expected a float tensor")):
        with pytest.raises(ValueError, match=match):
            decode(tensors, wire, (2, 8, 16), "FORWARD")
    with pytest.raises(ValueError, match="unknown wire dtype 'int4'"):
        encode(x, "int4")


def test_simulator_applies_the_wire_at_every_stage_boundary(tmp_path):
    """An int8 wire changes the trajectory (the roundtrip is applied) but stays close to float32's."""
    from checkfree.config import preset
    from checkfree.rundir import read_jsonl
    from checkfree.simulator import Simulator

    losses = {}
    for wire in ("float32", "int8"):
        cfg = preset("tiny")
        cfg.train.num_steps, cfg.train.eval_every, cfg.train.wire_dtype = 8, 0, wire
        Simulator(cfg, tmp_path / wire, progress=False).run()
        losses[wire] = [m["loss"] for m in read_jsonl(tmp_path / wire / "metrics.jsonl")]
    assert losses["int8"] != losses["float32"]
    assert losses["int8"] == pytest.approx(losses["float32"], rel=0.02)
