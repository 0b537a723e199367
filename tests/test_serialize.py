"""checkfree.serialize: one copy out, none in, old torch.save blobs still load, bad bytes a clear ValueError."""

from __future__ import annotations

import io
from collections import OrderedDict

import numpy as np
import pytest
import torch

from checkfree.serialize import MAGIC, blob_tensor, state_from_bytes, state_to_bytes

pytestmark = pytest.mark.timeout(60)


def _state() -> dict:
    return {"model": OrderedDict(w=torch.randn(4, 3), b=torch.zeros(3, dtype=torch.bfloat16)),
            "optim": {"state": {0: {"step": torch.tensor(2.0), "exp_avg": torch.ones(4, 3)}},
                      "groups": [{"name": "main", "betas": (0.9, 0.95), "foreach": None, "amsgrad": False}]},
            "lr_scale": 1.0, "step": 7, "rng": torch.get_rng_state(), "norm": float("nan"), "tag": b"\x00\x01"}


def test_tensors_alias_a_writable_blob_and_a_read_only_one_is_copied() -> None:
    blob = state_to_bytes(_state())
    assert isinstance(blob, bytearray) and blob[:len(MAGIC)] == MAGIC
    state = state_from_bytes(blob)
    w = state["model"]["w"]
    w.fill_(5.0)  # the tensor is a view of the blob: no copy was made
    assert state_from_bytes(blob)["model"]["w"].eq(5.0).all()
    frozen = bytes(blob)
    state_from_bytes(frozen)["model"]["w"].fill_(6.0)  # a copy: the bytes object is untouched
    assert state_from_bytes(frozen)["model"]["w"].eq(5.0).all()
    t = blob_tensor(blob)
    assert t.dtype == torch.uint8 and t.numel() == len(blob)
    assert t.data_ptr() == np.frombuffer(blob, dtype=np.uint8).ctypes.data  # a view, not a copy
    assert torch.equal(blob_tensor(frozen), t) and blob_tensor(b"").numel() == 0


def test_a_blob_written_by_torch_save_still_loads() -> None:
    state = _state()
    buf = io.BytesIO()
    torch.save(state, buf)
    back = state_from_bytes(buf.getvalue())
    assert torch.equal(back["model"]["w"], state["model"]["w"]) and back["optim"]["state"][0]["step"] == 2


@pytest.mark.parametrize("cut", [3, 8, 20, 100, -1])
def test_truncated_or_foreign_bytes_are_a_clear_value_error(cut: int) -> None:
    blob = bytes(state_to_bytes(_state()))
    with pytest.raises(ValueError, match="not a serialised state"):
        state_from_bytes(blob[:cut])
    with pytest.raises(ValueError, match="not a serialised state"):
        state_from_bytes(b"garbage!" + blob[8:])
    with pytest.raises(ValueError, match="cannot serialise a set"):
        state_to_bytes({"s": {1, 2}})
