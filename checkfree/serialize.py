"""A stage's state as bytes: one serialization for snapshots, saves, handovers and REFT's parity blocks."""

from __future__ import annotations

import io
from typing import Any

import torch

__all__ = ["state_to_bytes", "state_from_bytes"]


def _compact(obj: Any) -> Any:
    """Clone tensors that view a larger storage, so only their own bytes get serialised."""
    if isinstance(obj, torch.Tensor):
        own = obj.numel() * obj.element_size()
        return obj.clone() if obj.untyped_storage().nbytes() > own else obj
    if isinstance(obj, dict):
        return type(obj)((k, _compact(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(_compact(v) for v in obj)
    return obj


def state_to_bytes(state: dict) -> bytes:
    """Serialise a state dict (tensors, python scalars/str/None, nested dict/list/tuple) to bytes.

    Deterministic for equal inputs; :func:`state_from_bytes` returns an exactly equal state
    (same dtypes, shapes, bit patterns, key types incl. int keys, OrderedDict kept).
    """
    if not isinstance(state, dict):
        raise ValueError(f"state must be a dict, got {type(state).__name__}")
    buf = io.BytesIO()
    torch.save(_compact(state), buf)
    return buf.getvalue()


def state_from_bytes(b: bytes) -> dict:
    """Inverse of :func:`state_to_bytes`; loads with ``weights_only=True`` (no arbitrary code)."""
    try:
        state = torch.load(io.BytesIO(bytes(b)), map_location="cpu", weights_only=True)
    except Exception as exc:  # corrupted or foreign bytes
        raise ValueError(f"bytes are not a serialised state: {exc}") from exc
    if not isinstance(state, dict):
        raise ValueError(f"serialised object is a {type(state).__name__}, not a dict")
    return state
