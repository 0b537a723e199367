"""What an owner's copy update costs on the CPU (issue 42's swarm overhead): one SmolLM2-sized stage, its int8 (or
int4) delta encoded, serialised, and the owner's mirror brought to the holder's copy, before and after the
codec's rewrite, side by side in one run.

Before (the codec as it was, kept here): `_delta` made whole-matrix float32 temporaries (|x|, x/scale, the
rounded codes, the held codes as float32, their difference), `pack` went through int16, and the owner's mirror was
made by deserialising its own update and applying it as the holder does (`apply_update`), a second pass over the
whole stage. After (checkfree.snapcodec): one `aminmax` pass for the row maxima, the rest row block by row block
with in-place ops (the temporaries stay in cache), `pack` in int8, and the mirror made while encoding
(`encode_and_mirror`). Both make the same update, byte for byte (checked here), and the mirror equals the
holder's copy bit for bit (tests/test_snap.py).

    python -m benchmarks.snapcost                 # the edge stage (embedding + 5 layers, 46 M values), int8
    python -m benchmarks.snapcost --stage middle  # 5 layers (17.7 M values)
    python -m benchmarks.snapcost --format int4

Each run's figures go into benchmarks/results/snapcost.json (one entry per stage, format and thread count;
`--out` elsewhere), and the table in benchmarks/README.md is rendered from that file (`render`).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from checkfree import snapcodec
from checkfree.serialize import state_from_bytes, state_to_bytes
from checkfree.snapcodec import CopyFormat, apply_update, encode_and_mirror, encode_update

ROOT = Path(__file__).resolve().parent.parent
RESULT = ROOT / "benchmarks" / "results" / "snapcost.json"
BEGIN = "<!-- rendered by benchmarks.snapcost.render from benchmarks/results/snapcost.json -->"
END = "<!-- end of the snapcost table -->"
H, F, V, KV, LAYERS = 576, 1536, 49152, 192, 5  # SmolLM2-135M in 6 stages: 5 layers a stage


def stage_weights(edge: bool, seed: int = 0) -> dict[str, Tensor]:
    """A SmolLM2 stage's weights (random, at the model's scale): 5 layers, and the embedding on an edge stage."""
    g = torch.Generator().manual_seed(seed)
    w = {"embed.weight": torch.randn(V, H, generator=g) * 0.05} if edge else {}
    for i in range(LAYERS):
        for n, shape in [("wq", (H, H)), ("wk", (KV, H)), ("wv", (KV, H)), ("wo", (H, H)), ("w1", (F, H)),
                         ("w2", (H, F)), ("w3", (F, H))]:
            w[f"blocks.{i}.{n}.weight"] = torch.randn(*shape, generator=g) * 0.05
        w[f"blocks.{i}.attn_norm.weight"] = torch.ones(H)
        w[f"blocks.{i}.mlp_norm.weight"] = torch.ones(H)
    return w


def _state(w: dict[str, Tensor]) -> dict:
    return {"model": w, "optim": {"state": {}, "groups": []}, "lr_scale": 1.0, "step": 0,
            "rng": torch.get_rng_state(), "norm": 0.1}


# ---- the codec as it was (before) --------------------------------------------------------------
def _old_pack(codes: Tensor, bits: int) -> Tensor:
    per = 8 // bits
    u = (codes.reshape(-1).to(torch.int16) + (1 << (bits - 1))).to(torch.uint8)
    pad = (-u.numel()) % per
    if pad:
        u = torch.cat([u, torch.zeros(pad, dtype=torch.uint8)])
    u = u.view(-1, per)
    out = u[:, 0].clone()
    for i in range(1, per):
        out |= u[:, i] << (bits * i)
    return out


def _old_unpack(packed: Tensor, bits: int, n: int) -> Tensor:
    per, mask = 8 // bits, (1 << bits) - 1
    parts = [(packed >> (bits * i)) & mask for i in range(per)]
    u = torch.stack(parts, dim=1).reshape(-1)[:n]
    return (u.to(torch.int16) - (1 << (bits - 1))).to(torch.int8)


def _old_codes(entry: dict, fmt: CopyFormat) -> Tensor:
    rows, cols = snapcodec._grid_shape(tuple(entry["shape"]), fmt)
    return entry["codes"] if fmt.weights == "int8" else _old_unpack(entry["codes"], 4, rows * cols).view(rows, cols)


def _old_rebased(codes: Tensor, scale: Tensor, new_scale: Tensor, qmax: int) -> Tensor:
    q = codes.to(torch.float32)
    changed = new_scale != scale
    if bool(changed.any()):
        q[changed] = torch.round(q[changed] * (scale[changed] / new_scale[changed]).unsqueeze(1)).clamp_(-qmax, qmax)
    return q


def _old_delta(x: Tensor, held: dict, fmt: CopyFormat) -> dict:
    qmax, bits = snapcodec._QMAX[fmt.weights], snapcodec._DELTA_BITS[fmt.weights]
    x2 = snapcodec._as_grid(x, fmt)
    scale = held["scale"]
    amax = x2.abs().amax(dim=1)
    moved = (amax > qmax * scale) | (amax < qmax * scale / 2)
    new_scale = torch.where(moved, (amax / qmax).clamp(min=snapcodec._TINY), scale)
    base = _old_rebased(_old_codes(held, fmt), scale, new_scale, qmax)
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    diff = (torch.round(x2 / new_scale.unsqueeze(1)).clamp_(-qmax, qmax) - base).clamp_(lo, hi).to(torch.int8)
    return {"shape": list(x.shape), "scale": new_scale, "delta": _old_pack(diff, bits)}


def _old_apply_delta(held: dict, upd: dict, fmt: CopyFormat) -> dict:
    qmax, bits = snapcodec._QMAX[fmt.weights], snapcodec._DELTA_BITS[fmt.weights]
    rows, cols = snapcodec._grid_shape(tuple(held["shape"]), fmt)
    base = _old_rebased(_old_codes(held, fmt), held["scale"], upd["scale"], qmax)
    diff = _old_unpack(upd["delta"], bits, rows * cols).view(rows, cols).to(torch.float32)
    codes = (base + diff).clamp_(-qmax, qmax).to(torch.int8)
    return {"shape": list(held["shape"]), "scale": upd["scale"].clone(),
            "codes": codes if fmt.weights == "int8" else _old_pack(codes, 4)}


def old_update(w: dict[str, Tensor], step: int, fmt: CopyFormat, mirror: snapcodec.HeldCopy) -> tuple[bytearray,
                                                                                                       dict]:
    """Before: the delta encoded and serialised; the mirror's entries by decoding it again and applying it."""
    weights = {k: (_old_delta(x, mirror.weights[k], fmt) if x.ndim >= 2 else snapcodec._encode(x, fmt))
               for k, x in w.items()}
    upd = {**encode_update(_state({k: v for k, v in w.items() if v.ndim < 2}), step, fmt, None), "kind": "delta",
           "base": mirror.step, "weights": weights}
    blob = state_to_bytes(upd)
    rec = state_from_bytes(blob)
    after = {k: dict(u) if "value" in u else _old_apply_delta(mirror.weights[k], u, fmt)
             for k, u in rec["weights"].items()}
    return blob, after


def new_update(w: dict[str, Tensor], step: int, fmt: CopyFormat, mirror: snapcodec.HeldCopy) -> tuple[bytearray,
                                                                                                       dict]:
    """After: `encode_and_mirror` (the mirror made while encoding), serialised."""
    upd, after = encode_and_mirror(_state(w), step, fmt, mirror)
    return state_to_bytes(upd), after.weights


def _best(fn: Callable[[], tuple[bytearray, dict]], repeats: int) -> tuple[float, float, tuple[bytearray, dict]]:
    """Best wall and CPU seconds of `repeats` calls (the machine is shared), and the last result."""
    wall = cpu = float("inf")
    out: tuple[bytearray, dict] | None = None
    for _ in range(repeats):
        t, c = time.perf_counter(), time.process_time()
        out = fn()
        wall, cpu = min(wall, time.perf_counter() - t), min(cpu, time.process_time() - c)
    assert out is not None, "at least one repeat"
    return wall, cpu, out


def render(result: dict[str, Any]) -> str:
    """benchmarks/README.md's table of the runs in `result` (every number from it)."""
    rows = [f"| {r['stage']} ({r['values'] / 1e6:.1f} M) | {r['format']} | {r['threads']} | "
            f"{r['before']['cpu_s']:.3f} | {r['after']['cpu_s']:.3f} | "
            f"{r['after']['cpu_s'] / r['before']['cpu_s']:.3f} | "
            f"{r['before']['wall_s']:.3f} | {r['after']['wall_s']:.3f} | {r['load']:.1f} | "
            f"{'yes' if r['same_update'] and r['same_mirror'] else 'NO'} |" for r in result["runs"]]
    return "\n".join([
        "| stage (values) | format | threads | before CPU s | after CPU s | after ÷ before | before wall s | "
        "after wall s | load average | same update and mirror |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *rows,
    ])


def update_readme(result: dict[str, Any], root: Path = ROOT) -> Path:
    """Rewrite benchmarks/README.md's region between BEGIN and END from `result`."""
    path = root / "benchmarks" / "README.md"
    text = path.read_text()
    i, j = text.index(BEGIN) + len(BEGIN), text.index(END)
    path.write_text(text[:i] + "\n" + render(result) + "\n" + text[j:])
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stage", choices=["edge", "middle"], default="edge")
    p.add_argument("--format", choices=["int8", "int4"], default="int8")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads (a peer's compute thread: 1)")
    p.add_argument("--out", help="also write the figures to this JSON file")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    fmt = CopyFormat(args.format)
    w0 = stage_weights(args.stage == "edge")
    mirror = apply_update(None, encode_update(_state(w0), 0, fmt, None))
    g = torch.Generator().manual_seed(1)
    w1 = {k: v + torch.randn(v.shape, generator=g) * 1e-4 for k, v in w0.items()}  # one Adam step's size
    n = sum(v.numel() for v in w0.values())
    old_w, old_c, (old_blob, old_after) = _best(lambda: old_update(w1, 1, fmt, mirror), args.repeats)
    new_w, new_c, (new_blob, new_after) = _best(lambda: new_update(w1, 1, fmt, mirror), args.repeats)
    same_update = old_blob == new_blob
    same_mirror = state_to_bytes({"c": old_after}) == state_to_bytes({"c": new_after})
    print(f"{args.stage} stage, {n / 1e6:.1f} M values, {fmt.describe()}, {args.threads} thread(s), "
          f"best of {args.repeats}")
    print(f"{'':28s} {'wall s':>8s} {'CPU s':>8s}")
    print(f"{'before (encode + re-decode)':28s} {old_w:8.3f} {old_c:8.3f}")
    print(f"{'after (encode_and_mirror)':28s} {new_w:8.3f} {new_c:8.3f}")
    print(f"same update bytes: {same_update}, same mirror: {same_mirror}")
    print(f"after/before: wall {new_w / old_w:.3f}, CPU {new_c / old_c:.3f}")
    entry = {"stage": args.stage, "format": args.format, "values": n, "threads": args.threads,
             "repeats": args.repeats, "load": round(os.getloadavg()[0], 2),
             "before": {"wall_s": round(old_w, 4), "cpu_s": round(old_c, 4)},
             "after": {"wall_s": round(new_w, 4), "cpu_s": round(new_c, 4)},
             "same_update": same_update, "same_mirror": same_mirror}
    out = Path(args.out) if args.out else RESULT
    result = json.loads(out.read_text()) if out.exists() else {"runs": []}
    key = (args.stage, args.format, args.threads)
    result["runs"] = sorted([r for r in result["runs"] if (r["stage"], r["format"], r["threads"]) != key] + [entry],
                            key=lambda r: (r["stage"], r["format"], r["threads"]))
    out.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    if out.resolve() == RESULT.resolve():
        update_readme(result)
    print(f"results in {out}")
    return 0 if same_update and same_mirror else 1


if __name__ == "__main__":
    raise SystemExit(main())
