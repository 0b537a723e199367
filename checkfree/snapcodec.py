"""A stage's compressed copy (the `snap` strategy): its formats, its full and differential updates, and what the
holder keeps.

Formats (`CopyFormat.weights`), for every matrix of the stage (1-D tensors, the RMSNorm weights, always travel and
stay in float32: a few KB a stage):

    int8     one int8 code per value and one float32 scale per row (the last dimension): absmax / 127
    int4     one 4-bit code per value (two a byte) and one float32 scale per group of `group` values (row-major,
             the last group zero-padded): absmax / 7
    bf16     the values cast to bfloat16
    float32  the values as they are

The Adam moments travel too (`moments=True`: the first moment as a matrix, the second as its square root, both in
the weights' format, re-encoded whole at every update; restored as m and max(v, m^2) so that a moment that
quantized to zero cannot blow a step up) or not at all (a fresh optimizer on restore, as the rebuilds have).

Updates. The first update a holder gets is `full`: every tensor encoded. After it, in the int8 and int4 formats,
an update is a `delta` on the holder's own grid: for every row (group) the scale stays unless the row's absmax
outgrew it or fell below half of it (then the scale is the new absmax's and the held codes are re-expressed on it),
and the update carries the new scales and, per value, the difference between the value's code on that grid and
the held code, clipped to 4 bits (int8) or 2 bits (int4). The owner keeps a mirror of the holder's copy: the
codes the holder will compute (base + difference, on the grid) are computed while encoding (`encode_and_mirror`;
integer-valued arithmetic, exact whatever the order), so the two are equal bit for bit without the owner decoding
its own update; every delta is computed against it, so a difference clipped now is sent by the next update (error feedback) and the error never accumulates: an
unclipped update leaves every value within half a step of its grid, as a fresh copy would. bf16 and float32 updates
are always full (a cast has no grid to move on).

The holder keeps the copy as encoded (`HeldCopy`: codes, scales), never as float32: its memory is the full update's
size (`update_nbytes(..., "full")`), plus the update being received. Quantization is written here with torch's
elementwise ops (see the module's section in benchmarks/README.md for the libraries measured against it).
Everything runs on the CPU, on both sides, so that the owner's mirror and the holder's copy are equal bit for bit
whatever device trains the stage.
"""

from __future__ import annotations

import math
from collections.abc import Generator, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from checkfree.config import SNAPSHOT_FORMATS as FORMATS

__all__ = ["FORMATS", "CopyFormat", "HeldCopy", "encode_update", "encode_and_mirror", "encode_steps", "apply_steps",
           "apply_update", "restore_state", "update_nbytes",
           "held_nbytes", "stage_shapes", "tree_nbytes", "copy_to_tree", "copy_from_tree", "pack", "unpack",
           "full_precision_nbytes"]

_QMAX = {"int8": 127, "int4": 7}
_DELTA_BITS = {"int8": 4, "int4": 2}  # a delta's bits per value
_TINY = 1e-30  # the smallest scale (an all-zero row)


@dataclass(frozen=True)
class CopyFormat:
    """How a stage's copy is encoded: `weights` one of FORMATS, `group` the int4 group size, `moments` whether the
    Adam moments travel."""

    weights: str = "int8"
    group: int = 64
    moments: bool = False

    def __post_init__(self) -> None:
        if self.weights not in FORMATS:
            raise ValueError(f"unknown snapshot format {self.weights!r}; choose one of {', '.join(FORMATS)}")
        if self.group < 4 or self.group % 4:
            raise ValueError(f"snapshot group size must be a multiple of 4 and >= 4, got {self.group}")

    @property
    def differential(self) -> bool:
        """Whether updates after the first are deltas on the holder's grid (int8, int4)."""
        return self.weights in _QMAX

    def describe(self) -> str:
        g = f" (groups of {self.group})" if self.weights == "int4" else ""
        return f"{self.weights}{g}, Adam moments {'kept' if self.moments else 'not kept'}"


# ---- bit packing -----------------------------------------------------------------------------
def pack(codes: Tensor, bits: int) -> Tensor:
    """Signed codes in [-2^(bits-1), 2^(bits-1)-1] packed 8/bits to a byte (uint8, little end first)."""
    per = 8 // bits
    flat = codes.reshape(-1)
    u = torch.add(flat if flat.dtype == torch.int8 else flat.to(torch.int8), 1 << (bits - 1)).view(torch.uint8)
    pad = (-u.numel()) % per
    if pad:
        u = torch.cat([u, torch.zeros(pad, dtype=torch.uint8)])
    u = u.view(-1, per)
    out = u[:, 0].clone()
    for i in range(1, per):
        out |= u[:, i] << (bits * i)
    return out


def unpack(packed: Tensor, bits: int, n: int) -> Tensor:
    """Inverse of `pack`: the first `n` codes, as int8."""
    per, mask = 8 // bits, (1 << bits) - 1
    u = torch.empty(packed.numel(), per, dtype=torch.uint8)
    for i in range(per):
        torch.bitwise_and(packed >> (bits * i) if i else packed, mask, out=u[:, i])
    return u.view(-1)[:n].view(torch.int8).sub(1 << (bits - 1))


# ---- grids -------------------------------------------------------------------------------------
def _matrix(t: Tensor) -> bool:
    return t.ndim >= 2


def _grid_shape(shape: tuple[int, ...], fmt: CopyFormat) -> tuple[int, int]:
    """(rows, values per row) of a matrix's grid: its rows (int8) or its groups (int4)."""
    n = math.prod(shape)
    if fmt.weights == "int8":
        return n // shape[-1], shape[-1]
    return -(-n // fmt.group), fmt.group


def _as_grid(x: Tensor, fmt: CopyFormat) -> Tensor:
    rows, cols = _grid_shape(tuple(x.shape), fmt)
    flat = x.detach().to("cpu", torch.float32).reshape(-1)
    pad = rows * cols - flat.numel()
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(rows, cols)


def _codes(entry: dict, fmt: CopyFormat) -> Tensor:
    """A quantized entry's codes as int8 [rows, cols]."""
    rows, cols = _grid_shape(tuple(entry["shape"]), fmt)
    if fmt.weights == "int8":
        return entry["codes"]
    return unpack(entry["codes"], 4, rows * cols).view(rows, cols)


def _store(codes: Tensor, fmt: CopyFormat) -> Tensor:
    return codes if fmt.weights == "int8" else pack(codes, 4)


def _quantize(x2: Tensor, scale: Tensor, qmax: int) -> Tensor:
    return torch.round(x2 / scale.unsqueeze(1)).clamp_(-qmax, qmax)


def _encode(x: Tensor, fmt: CopyFormat) -> dict:
    """One tensor, encoded whole."""
    if not _matrix(x):
        return {"shape": list(x.shape), "value": x.detach().to("cpu", torch.float32).clone()}
    if fmt.weights in ("bf16", "float32"):
        dtype = torch.bfloat16 if fmt.weights == "bf16" else torch.float32
        return {"shape": list(x.shape), "value": x.detach().to("cpu", dtype).clone()}
    qmax = _QMAX[fmt.weights]
    x2 = _as_grid(x, fmt)
    scale = (x2.abs().amax(dim=1) / qmax).clamp_(min=_TINY)
    return {"shape": list(x.shape), "scale": scale, "codes": _store(_quantize(x2, scale, qmax).to(torch.int8), fmt)}


def _decode(entry: dict, fmt: CopyFormat) -> Tensor:
    """A tensor back in float32."""
    shape = tuple(entry["shape"])
    if "value" in entry:
        return entry["value"].to(torch.float32).reshape(shape)
    q = _codes(entry, fmt)
    return (q.to(torch.float32) * entry["scale"].unsqueeze(1)).reshape(-1)[:math.prod(shape)].reshape(shape)


_BLOCK = 1 << 18  # values per block of the delta's row loop (its float32 temporaries, 1 MiB, stay in cache)


def _on_new_grid(codes: Tensor, scale: Tensor, new_scale: Tensor, qmax: int) -> Tensor:
    """The held codes (int8) re-expressed on the new scales: the codes themselves where no row's scale changed,
    else as float32 with the changed rows rounded onto their new scale (exact integers either way). The whole
    block is multiplied by the rows' ratios (1 exactly where a scale stayed, which leaves those codes as they
    are): cheaper than picking the changed rows out and back."""
    if torch.equal(new_scale, scale):
        return codes
    q = codes.to(torch.float32)
    return q.mul_(torch.div(scale, new_scale).unsqueeze(1)).round_().clamp_(-qmax, qmax)


def _row_blocks(rows: int, cols: int) -> Iterable[tuple[int, int]]:
    step = max(1, _BLOCK // max(cols, 1))
    for r0 in range(0, rows, step):
        yield r0, min(rows, r0 + step)


def _delta(x: Tensor, held: dict, fmt: CopyFormat) -> tuple[dict, dict]:
    """The update of one held matrix to `x` (`_delta_steps`, run through)."""
    return _run(_delta_steps(x, held, fmt))


def _delta_steps(x: Tensor, held: dict, fmt: CopyFormat) -> Generator[int, None, tuple[dict, dict]]:
    """The update of one held matrix to `x`: new scales and the clipped code differences (see the module); and the
    held entry after it, as `_apply_delta` makes it from the update (the owner's mirror, without decoding it).
    Row block by row block (the float32 temporaries are a block's, not the matrix's), yielding the values done
    after each block (a caller may pause there: `encode_steps`)."""
    qmax, bits = _QMAX[fmt.weights], _DELTA_BITS[fmt.weights]
    x2 = _as_grid(x, fmt)
    scale = held["scale"]
    # = x2.abs().amax(dim=1) with no |x| temporary (two reductions: torch's aminmax over rows is ten times slower)
    amax = torch.maximum(x2.amax(dim=1), x2.amin(dim=1).neg())
    moved = (amax > qmax * scale) | (amax < qmax * scale / 2)
    new_scale = torch.where(moved, (amax / qmax).clamp(min=_TINY), scale)
    codes = _codes(held, fmt)
    rows, cols = x2.shape
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    per = 8 // bits
    # the differences packed block by block where a row holds whole bytes (every SmolLM2 matrix): `pack`'s bytes,
    # sum_i (d_i - lo) << (bits * i), made from the block's float32 differences in two ops, no int8 matrix
    packed = torch.empty(rows * cols // per, dtype=torch.uint8) if cols % per == 0 else None
    diff = torch.empty(rows, cols, dtype=torch.int8) if packed is None else None
    offset = sum(-lo << (bits * i) for i in range(per))
    after = torch.empty(rows, cols, dtype=torch.int8)
    for r0, r1 in _row_blocks(rows, cols):
        ns = new_scale[r0:r1]
        base = _on_new_grid(codes[r0:r1], scale[r0:r1], ns, qmax)
        q = torch.div(x2[r0:r1], ns.unsqueeze(1))
        q.round_().clamp_(-qmax, qmax).sub_(base).clamp_(lo, hi)
        if packed is not None:
            by = q.view(-1, per)
            acc = torch.add(by[:, 0], offset)
            for i in range(1, per):
                acc.add_(by[:, i], alpha=1 << (bits * i))
            packed[r0 * cols // per:r1 * cols // per] = acc
        else:
            assert diff is not None
            diff[r0:r1] = q
        after[r0:r1] = q.add_(base).clamp_(-qmax, qmax)  # as the holder applies it: base + diff, on the grid
        yield (r1 - r0) * cols
    return ({"shape": list(x.shape), "scale": new_scale, "delta": pack(diff, bits) if packed is None else packed},
            {"shape": list(x.shape), "scale": new_scale.clone(), "codes": _store(after, fmt)})


def _run(gen: Generator[int, None, Any]) -> Any:
    """A generator's return value, once it ran through."""
    while True:
        try:
            next(gen)
        except StopIteration as stop:
            return stop.value


def _apply_delta_steps(held: dict, upd: dict, fmt: CopyFormat) -> Generator[int, None, dict]:
    """One held matrix after a delta: its codes re-expressed on the new scales plus the differences, on the grid;
    row block by row block, yielding the values done (as `_delta_steps`)."""
    qmax, bits = _QMAX[fmt.weights], _DELTA_BITS[fmt.weights]
    rows, cols = _grid_shape(tuple(held["shape"]), fmt)
    codes, scale, new_scale = _codes(held, fmt), held["scale"], upd["scale"]
    diff = unpack(upd["delta"], bits, rows * cols).view(rows, cols)
    after = torch.empty(rows, cols, dtype=torch.int8)
    for r0, r1 in _row_blocks(rows, cols):
        base = _on_new_grid(codes[r0:r1], scale[r0:r1], new_scale[r0:r1], qmax)
        if base.dtype == torch.int8:
            base = base.to(torch.int16)
        after[r0:r1] = base.add_(diff[r0:r1]).clamp_(-qmax, qmax)
        yield (r1 - r0) * cols
    return {"shape": list(held["shape"]), "scale": new_scale.clone(), "codes": _store(after, fmt)}


# ---- a stage's copy --------------------------------------------------------------------------
@dataclass
class HeldCopy:
    """What a holder keeps of one stage, as of `step` (and what the owner mirrors): every weight's entry, the
    moments' (or None), and the stage's scalars (LR scale, omega, RNG, optimizer groups)."""

    step: int
    fmt: CopyFormat
    weights: dict[str, dict]
    moments: dict[str, dict] | None
    meta: dict[str, Any]

    def nbytes(self) -> int:
        return tree_nbytes(copy_to_tree(self))


def _moments_of(optim_state: dict[str, dict[str, Tensor]], fmt: CopyFormat) -> dict[str, dict]:
    out = {}
    for name in sorted(optim_state):
        st = optim_state[name]
        out[name] = {"exp_avg": _encode(st["exp_avg"], fmt), "exp_avg_sq": _encode(st["exp_avg_sq"].sqrt(), fmt),
                     "step": st["step"].detach().to("cpu", torch.float32).clone()}
    return out


def _meta_of(state: dict) -> dict[str, Any]:
    return {"lr_scale": float(state["lr_scale"]), "norm": float(state["norm"]), "rng": state["rng"].clone(),
            "groups": state["optim"]["groups"]}


def encode_update(state: dict, step: int, fmt: CopyFormat, base: HeldCopy | None) -> dict:
    """The update that brings the holder's copy `base` (None: none, a full update) to `state` (a captured
    `checkfree.strategies.state.StageState`, read only), as a tree of tensors and scalars (`checkfree.serialize`)."""
    return encode_and_mirror(state, step, fmt, base)[0]


def encode_and_mirror(state: dict, step: int, fmt: CopyFormat, base: HeldCopy | None) -> tuple[dict, HeldCopy]:
    """`encode_update`'s update, and the copy the holder will have once it applied it (equal bit for bit to
    `apply_update(base, update)`, made while encoding: the owner's next mirror without decoding the update; `base`
    itself is not changed)."""
    return _run(encode_steps(state, step, fmt, base))


def encode_steps(state: dict, step: int, fmt: CopyFormat,
                 base: HeldCopy | None) -> Generator[int, None, tuple[dict, HeldCopy]]:
    """`encode_and_mirror` in small steps: a generator that yields the values encoded since its last yield (a
    block of rows, or one small tensor) and returns (update, the holder's copy after it). Whoever drives it may do
    other work between two steps, as long as `state` does not change."""
    full = base is None or not fmt.differential
    if base is not None and base.fmt != fmt:
        raise ValueError(f"a delta on a copy of format {base.fmt} cannot be of format {fmt}")
    weights, after = {}, {}
    for name, x in state["model"].items():
        if full or base is None or not _matrix(x):
            weights[name] = after[name] = _encode(x, fmt)
            yield x.numel()
        else:
            if name not in base.weights:
                raise ValueError(f"the held copy has no {name!r}")
            weights[name], after[name] = yield from _delta_steps(x, base.weights[name], fmt)
    if not full and base is not None and set(weights) != set(base.weights):
        raise ValueError("a delta names other tensors than the held copy's")
    moments = _moments_of(state["optim"]["state"], fmt) if fmt.moments else None
    meta = _meta_of(state)
    update = {"kind": "full" if full else "delta", "step": int(step),
              "base": None if full or base is None else base.step, "format": [fmt.weights, fmt.group, fmt.moments],
              "weights": weights, "moments": moments, "meta": meta}
    return update, HeldCopy(int(step), fmt, after, moments, dict(meta))


def _format_of(tree: dict) -> CopyFormat:
    try:
        weights, group, moments = tree["format"]
        return CopyFormat(str(weights), int(group), bool(moments))
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"not a copy update or held copy: bad format ({e})") from None


def apply_update(held: HeldCopy | None, update: dict) -> HeldCopy:
    """The copy after `update` (see `encode_update`): a full update replaces `held`, a delta changes it in place
    (and returns it). Malformed updates, and a delta on a copy of another step, raise ValueError."""
    return _run(apply_steps(held, update))


def apply_steps(held: HeldCopy | None, update: dict) -> Generator[int, None, HeldCopy]:
    """`apply_update` in small steps (as `encode_steps`): `held` changes only once the last step is done."""
    fmt = _format_of(update)
    kind = update.get("kind")
    if kind == "full":
        return HeldCopy(int(update["step"]), fmt, dict(update["weights"]), update["moments"], dict(update["meta"]))
    if kind != "delta":
        raise ValueError(f"unknown copy update kind {kind!r}")
    if held is None or held.step != update.get("base") or held.fmt != fmt:
        raise ValueError(f"a delta on the copy of step {update.get('base')} ({fmt.weights}) cannot apply to "
                         f"{'no copy' if held is None else f'the copy of step {held.step} ({held.fmt.weights})'}")
    if set(update["weights"]) != set(held.weights):
        raise ValueError("a delta names other tensors than the held copy's")
    for name, upd in update["weights"].items():
        if list(upd["shape"]) != list(held.weights[name]["shape"]):
            raise ValueError(f"a delta of {name!r} has shape {upd['shape']}, the held copy "
                             f"{held.weights[name]['shape']}")
    weights = {}
    for name, upd in update["weights"].items():
        if "value" in upd:
            weights[name] = dict(upd)
            yield upd["value"].numel()
        else:
            weights[name] = yield from _apply_delta_steps(held.weights[name], upd, fmt)
    held.weights.update(weights)
    held.step, held.moments, held.meta = int(update["step"]), update["moments"], dict(update["meta"])
    return held


def restore_state(held: HeldCopy) -> dict:
    """The stage's full state from its copy (`checkfree.strategies.state.StageState`): the weights in float32,
    the Adam moments if they travelled (else none: a fresh optimizer), the scalars as captured."""
    fmt = held.fmt
    optim = {}
    for name, st in (held.moments or {}).items():
        m, root = _decode(st["exp_avg"], fmt), _decode(st["exp_avg_sq"], fmt)
        v = root * root
        if fmt.differential:  # a second moment quantized to (near) zero under a first that is not
            v = torch.maximum(v, m * m)
        optim[name] = {"step": st["step"].clone(), "exp_avg": m, "exp_avg_sq": v}
    meta = held.meta
    return {"model": {k: _decode(e, fmt) for k, e in held.weights.items()},
            "optim": {"state": optim, "groups": meta["groups"]}, "lr_scale": float(meta["lr_scale"]),
            "step": int(held.step), "rng": meta["rng"].clone(), "norm": float(meta["norm"])}


def copy_to_tree(held: HeldCopy) -> dict:
    """A held copy as a tree (`checkfree.serialize.state_to_bytes`): a full update of its step."""
    f = held.fmt
    return {"kind": "full", "step": held.step, "base": None, "format": [f.weights, f.group, f.moments],
            "weights": held.weights, "moments": held.moments, "meta": held.meta}


def copy_from_tree(tree: dict) -> HeldCopy:
    """Inverse of `copy_to_tree` (ValueError for anything else)."""
    if not isinstance(tree, dict) or tree.get("kind") != "full":
        raise ValueError("not a held copy")
    return apply_update(None, tree)


# ---- sizes -----------------------------------------------------------------------------------
def tree_nbytes(obj: Any) -> int:
    """Tensor bytes in a tree."""
    if isinstance(obj, Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tree_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tree_nbytes(v) for v in obj)
    return 0


def _entry_nbytes(shape: tuple[int, ...], fmt: CopyFormat, kind: str) -> int:
    n = math.prod(shape)
    if len(shape) < 2:
        return 4 * n
    if fmt.weights == "float32":
        return 4 * n
    if fmt.weights == "bf16":
        return 2 * n
    rows, cols = _grid_shape(shape, fmt)
    bits = (8 if fmt.weights == "int8" else 4) if kind == "full" else _DELTA_BITS[fmt.weights]
    per = 8 // bits
    return 4 * rows + -(-rows * cols // per)


_RNG_BYTES = torch.get_rng_state().numel()


def update_nbytes(shapes: dict[str, tuple[int, ...]], fmt: CopyFormat, kind: str,
                  trainable: Iterable[str] | None = None) -> int:
    """The tensor bytes of an update of `kind` ("full" / "delta") of a stage with these weights' shapes (by name),
    as `encode_update` makes it (`trainable`: the names with Adam state; None: all). A held copy's size is the full
    update's."""
    if kind not in ("full", "delta"):
        raise ValueError(f"unknown update kind {kind!r}")
    kind = kind if fmt.differential else "full"
    total = sum(_entry_nbytes(s, fmt, kind) for s in shapes.values()) + _RNG_BYTES
    if fmt.moments:
        names = shapes if trainable is None else list(trainable)
        total += sum(2 * _entry_nbytes(shapes[n], fmt, "full") + 4 for n in names)
    return total


def held_nbytes(shapes: dict[str, tuple[int, ...]], fmt: CopyFormat) -> int:
    """A holder's memory for one copy (its full update's tensor bytes)."""
    return update_nbytes(shapes, fmt, "full")


def full_precision_nbytes(shapes: dict[str, tuple[int, ...]]) -> int:
    """The full-precision snapshot of the same stage: weights and both Adam moments in float32 (12 B/parameter)."""
    return 12 * sum(math.prod(s) for s in shapes.values())


def stage_shapes(cfg, stage: int, plus: bool = False) -> dict[str, tuple[int, ...]]:
    """The shapes of `stage`'s weights, by name (built on the meta device: nothing allocated); `plus`: CheckFree+'s
    replicated embedding and head."""
    from checkfree.model import PipelineStage, plan_stages
    from checkfree.pipeline import edge_holders

    spec = plan_stages(cfg.model.num_layers, cfg.num_stages)[stage]
    holders = edge_holders(cfg.num_stages, plus)
    with torch.device("meta"):
        module = PipelineStage(cfg.model, spec, has_embedding=stage in holders["embed"],
                               has_head=stage in holders["head"])
    return {k: tuple(v.shape) for k, v in module.state_dict().items()}

