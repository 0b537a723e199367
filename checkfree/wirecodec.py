"""How activations and gradients travel between stages (`train.wire_dtype`): float32 as computed,
bfloat16 / float16 casts, or int8 with one float32 scale per row (the last dimension, d_model):
q = round(x / s) with s = max|row| / 127, so every element is off by at most s / 2 = max|row| / 254
and a step moves about a quarter of float32's bytes (SWARM trains with 8-bit activations).

One implementation for both sides of the comparison: the swarm encodes before a send and decodes on
arrival (`encode`/`decode`), the simulator applies `roundtrip` at each stage boundary, so a swarm and
a simulator run with the same wire dtype compute the same numbers.

Why not hivemind.compression: on this machine its Uniform8Bit and Quantile8Bit quantizers raise
`TypeError: only 0-dimensional arrays can be converted to Python scalars` (numpy 2), and its blockwise
8-bit one needs bitsandbytes (CUDA); it also serializes to protobuf, which the wire format here does
not use. Per-row absmax is a few lines of torch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["WIRE_DTYPES", "WIRE_BYTES", "encode", "decode", "roundtrip", "quantize_int8", "dequantize_int8"]

WIRE_DTYPES = ("float32", "bfloat16", "float16", "int8")
WIRE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}  # per value (int8's row scales aside)
_CASTS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def quantize_int8(x: Tensor) -> tuple[Tensor, Tensor]:
    """(int8 values, float32 scale per row of the last dimension)."""
    rows = x.detach().float().reshape(-1, x.shape[-1])
    scale = rows.abs().amax(dim=1, keepdim=True).clamp_min(1e-30) / 127.0
    q = torch.round(rows / scale).clamp_(-127, 127).to(torch.int8)
    return q.reshape(x.shape), scale.reshape(x.shape[:-1])


def dequantize_int8(q: Tensor, scale: Tensor) -> Tensor:
    return q.float() * scale.unsqueeze(-1).float()


def encode(x: Tensor, wire_dtype: str) -> list[Tensor]:
    """The tensors that carry `x` on the wire."""
    if wire_dtype == "int8":
        return list(quantize_int8(x))
    if wire_dtype not in _CASTS:
        raise ValueError(f"unknown wire dtype {wire_dtype!r}; choose one of {', '.join(WIRE_DTYPES)}")
    return [x.detach().to(_CASTS[wire_dtype])]


def decode(tensors: Sequence[Tensor], wire_dtype: str, shape: tuple[int, ...], what: str = "tensor") -> Tensor:
    """The float32 tensor of shape `shape` that `tensors` carry; ValueError (saying what is wrong with
    `what`) for a count, dtype or shape that `encode(..., wire_dtype)` would not have produced."""
    if wire_dtype == "int8":
        if len(tensors) != 2:
            raise ValueError(f"{what} carries {len(tensors)} tensors, expected 2 (int8 values and row scales)")
        q, scale = tensors
        if q.dtype != torch.int8 or scale.dtype != torch.float32:
            raise ValueError(f"{what} has dtypes {q.dtype}/{scale.dtype}, expected int8/float32 (wire dtype int8)")
        if tuple(q.shape) != tuple(shape) or tuple(scale.shape) != tuple(shape[:-1]):
            raise ValueError(f"{what} has shapes {tuple(q.shape)}/{tuple(scale.shape)}, expected {tuple(shape)}/"
                             f"{tuple(shape[:-1])}")
        return dequantize_int8(q, scale)
    if len(tensors) != 1:
        raise ValueError(f"{what} carries {len(tensors)} tensors, expected 1")
    (x,) = tensors
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{what} has shape {tuple(x.shape)}, expected {tuple(shape)}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{what} has dtype {x.dtype}, expected a float tensor")
    return x.float()


def roundtrip(x: Tensor, wire_dtype: str) -> Tensor:
    """What the receiving stage gets for `x` (float32; `x` itself for a float32 wire)."""
    if wire_dtype == "float32":
        return x
    return decode(encode(x, wire_dtype), wire_dtype, tuple(x.shape)).to(x.device)
