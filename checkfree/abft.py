"""Checksum-protected attention (ABFT, after ATTNChecker); the soft-error injector it drives: `checkfree.bitflips`.

`AttentionGuard` replaces the arithmetic of `checkfree.model.Attention` (through its
`guard` hook) with explicit attention math in which the six matmuls are protected:

    section "scores":  q = X W_Q (+b),  k = X W_K (+b),  S = Q K^T      (RoPE between)
    section "context": v = X W_V (+b),  C = P V                         (P = softmax, unprotected)
    section "output":  o = C W_O (+b)

Each protected product C = A B is checked right after it is computed, before any other
op reads it. Checking it immediately (rather than carrying checksums through the section
as the paper does) is what makes RoPE harmless: q and k are checked before the rotation,
S after it. The checks come in two tiers:

* range trigger (mode "range", the default): one `aminmax` pass over C; it
  trips iff C holds a NaN, an INF or a value with |x| > threshold. Only then is the full
  check run. Faults that stay below the threshold are not seen in this mode.
* full check (mode "full" always; mode "range" once tripped): column checksums
  [e; w]^T A B and row checksums A B [e w] (w = 1..n weights, plus the bias term) are
  compared with the sums of C within a round-off bound built from |A| |B|. A mismatched
  line is repaired when it holds exactly one bad element: located as its single extreme
  (non-finite or > threshold) element, or, when it has none, by the weighted/unweighted
  difference ratio (confirmed by the crossing line also mismatching); the element is
  rebuilt as checksum minus the sum of the others (the bad one excluded, so an INF/NaN
  does not poison the sum). Lines are peeled column-wise then row-wise until C is
  consistent; otherwise `UncorrectableSoftError` is raised.

Corrections are written in place, under `no_grad`, into the matmul output before the next
op consumes it. None of the producing ops saves its own output for backward, so autograd
saves only repaired values (P, the rotated Q/K, V, C) and gradients equal those of a
fault-free run up to the round-off of the rebuilt elements.

Section budget: like the paper, one corrected element per section and forward call by
default (`max_faults_per_section=1`). Two independent bit flips within one attention
forward are far more likely to mean a failing device than bad luck, so a second fault in
the same section escalates (the runtime then recomputes the microbatch, skips the step or
treats the stage as lost). `None` lifts the budget: everything the peeling can fix is fixed.

Exactness of the fault-free path: the guard always computes attention with explicit math
(Q K^T, then one fused scale + additive causal mask, softmax, P V) because SDPA fuses and
hides P. (With the additive mask a NaN/INF above the diagonal of an unchecked Q K^T also
poisons its row; checked modes repair such entries like any other.) Checks only read C,
so a guarded fault-free forward (modes "range" and "full") is bitwise identical, output
and gradients, to the guard's own unchecked path (mode "off") and to the same explicit
math written out by hand.
Against the module's unguarded `F.scaled_dot_product_attention` forward it agrees to float
round-off only (typically max |diff| ~1e-7 on unit-scale fp32 outputs), because the fused
CPU kernel accumulates in a different order; bitwise equality with SDPA is not possible
without reimplementing its kernel.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from checkfree.bitflips import (
    FAULT_KINDS,
    SITES,
    Fault,
    FaultInjector,
    Injection,
    default_threshold,
    flip_bit,
    near_inf,
)
from checkfree.model import Attention, apply_rope

__all__ = [
    "SITES",
    "SECTIONS",
    "FAULT_KINDS",
    "UncorrectableSoftError",
    "default_threshold",
    "flip_bit",
    "near_inf",
    "CheckResult",
    "check_and_correct",
    "causal_bias",
    "Fault",
    "Injection",
    "FaultInjector",
    "AttentionGuard",
    "install_guard",
    "remove_guard",
]

SECTIONS: dict[str, str] = {
    "q": "scores", "k": "scores", "scores": "scores", "v": "context", "context": "context", "out": "output"
}
"""Protection section of each site (the paper's S_AS, S_CL, S_O)."""

Mode = Literal["off", "range", "full"]


class UncorrectableSoftError(RuntimeError):
    """A protected matmul output holds errors the checksums cannot repair (or more errors
    than the section budget allows). `site` and `call` say where."""

    def __init__(self, message: str, *, site: str = "", call: int = -1) -> None:
        super().__init__(message)
        self.site = site
        self.call = call


# ---------------------------------------------------------------------------------------
# checksum check and correction of one product C = A B (+ bias)


@dataclass
class CheckResult:
    """Outcome of `check_and_correct`: `detected` is True when the checksums disagreed,
    `corrected` the number of elements rebuilt."""

    detected: bool = False
    corrected: int = 0


@dataclass
class _Refs:
    col: Tensor  # (nb, 2, n): [e; w]^T (A B + bias)
    col_tol: Tensor  # (nb, n)
    row: Tensor  # (nb, m, 2): (A B + bias) [e w]
    row_tol: Tensor  # (nb, m)
    w_m: Tensor  # (m,) weights 1..m
    w_n: Tensor  # (n,) weights 1..n


def _checksums(a: Tensor, b: Tensor, bias: Tensor | None, acc: torch.dtype, slack: float) -> _Refs:
    """Checksums of C = a @ b (+ bias) computed from the operands only. a: (nb, m, k),
    b: (nb|1, k, n). The tolerance is `slack` * eps * (m + k) * (e^T|A|)|B| (resp. |A||B|e),
    a worst-case bound on the round-off of both sides of the comparison."""
    a, b = a.to(acc), b.to(acc)
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    w_m = torch.arange(1, m + 1, dtype=acc)
    w_n = torch.arange(1, n + 1, dtype=acc)
    abs_a, abs_b = a.abs(), b.abs()
    enc_m = torch.stack((torch.ones(m, dtype=acc), w_m))  # (2, m)
    col = (enc_m @ a) @ b  # (nb, 2, n)
    col_tol = (abs_a.sum(-2, keepdim=True) @ abs_b).squeeze(-2)  # (nb, n)
    enc_n = torch.stack((torch.ones(n, dtype=acc), w_n), dim=1)  # (n, 2)
    row = a @ (b @ enc_n)  # (nb, m, 2)
    row_tol = (abs_a @ abs_b.sum(-1, keepdim=True)).squeeze(-1)  # (nb, m)
    if bias is not None:
        bias = bias.to(acc)
        col = col + torch.stack((bias * m, bias * w_m.sum()))
        col_tol = col_tol + bias.abs() * m
        row = row + torch.stack((bias.sum(), (bias * w_n).sum()))
        row_tol = row_tol + bias.abs().sum()
    eps = torch.finfo(acc).eps * slack * (m + k)
    return _Refs(col, col_tol * eps + torch.finfo(acc).tiny, row, row_tol * eps + torch.finfo(acc).tiny, w_m, w_n)


def _mismatch(c: Tensor, refs: _Refs) -> tuple[Tensor, Tensor]:
    """Boolean masks (nb, n) of columns and (nb, m) of rows whose sums disagree with the
    checksums (a NaN difference counts as disagreement)."""
    cf = c.to(refs.col.dtype)
    bad_cols = ~((cf.sum(-2) - refs.col[:, 0]).abs() <= refs.col_tol)
    bad_rows = ~((cf.sum(-1) - refs.row[..., 0]).abs() <= refs.row_tol)
    return bad_cols, bad_rows


def _fix_line(v: Tensor, ref: Tensor, ref_w: Tensor, w: Tensor, threshold: float, crossing_bad: Tensor) -> bool:
    """Repair the single bad element of the 1-D view `v` whose sum should be `ref` (and
    weighted sum `ref_w`). Returns False, leaving `v` untouched, when the bad element
    cannot be located (several extreme values, or an unconfirmed ratio)."""
    vf = v.to(ref.dtype)
    extreme = ~torch.isfinite(vf) | (vf.abs() > threshold)
    n_extreme = int(extreme.sum())
    if n_extreme == 1:
        i = int(extreme.nonzero()[0, 0])
    elif n_extreme == 0:
        d = float(vf.sum() - ref)
        dw = float((vf * w).sum() - ref_w)
        if d == 0.0 or not math.isfinite(dw / d):
            return False
        r = dw / d
        i = round(r) - 1
        if abs(r - (i + 1)) > 0.25 or not 0 <= i < v.numel() or not bool(crossing_bad[i]):
            return False
    else:
        return False
    others = vf.clone()
    others[i] = 0
    v[i] = (ref - others.sum()).to(v.dtype)
    return True


def check_and_correct(
    c: Tensor,
    a: Tensor,
    b: Tensor,
    bias: Tensor | None = None,
    *,
    threshold: float | None = None,
    slack: float = 4.0,
    max_rounds: int = 4,
) -> CheckResult:
    """Full ABFT check of c = a @ b (+ bias), repairing c IN PLACE.

    Contract: a (nb, m, k) and b (nb or 1, k, n) are trusted fault-free; c is a (nb, m, n)
    view of the product (writes land in the caller's tensor); bias is (n,) or None. Errors
    are repaired line by line (the shorter lines first, then the others, repeated up to
    `max_rounds`) wherever a
    line holds one bad element. Returns what was found and fixed; raises
    `UncorrectableSoftError` if c is still inconsistent or non-finite afterwards, or if
    the checksums themselves are not finite (corrupted operands).
    """
    with torch.no_grad():
        acc = torch.promote_types(c.dtype, torch.float32)
        thr = default_threshold(c.dtype) if threshold is None else threshold
        refs = _checksums(a, b, bias, acc, slack)
        if not (torch.isfinite(refs.col).all() and torch.isfinite(refs.row).all()):
            raise UncorrectableSoftError("checksums are not finite: the operands of the product are corrupted")
        bad_cols, bad_rows = _mismatch(c, refs)
        if not (bad_cols.any() or bad_rows.any()):
            return CheckResult()
        fixed = 0
        # Shorter lines first: a value rebuilt from a short line carries less round-off.
        passes = ("cols", "rows") if c.shape[-2] <= c.shape[-1] else ("rows", "cols")
        for _ in range(max_rounds):
            progress = 0
            for axis in passes:
                if axis == "cols":
                    for bi, j in bad_cols.nonzero().tolist():
                        ref, ref_w = refs.col[bi, 0, j], refs.col[bi, 1, j]
                        progress += _fix_line(c[bi, :, j], ref, ref_w, refs.w_m, thr, bad_rows[bi])
                else:
                    for bi, i in bad_rows.nonzero().tolist():
                        ref, ref_w = refs.row[bi, i, 0], refs.row[bi, i, 1]
                        progress += _fix_line(c[bi, i, :], ref, ref_w, refs.w_n, thr, bad_cols[bi])
                bad_cols, bad_rows = _mismatch(c, refs)
            fixed += progress
            if not (bad_cols.any() or bad_rows.any()) or progress == 0:
                break
        if bad_cols.any() or bad_rows.any():  # consistent sums also rule out a leftover INF/NaN
            raise UncorrectableSoftError(
                f"{int(bad_cols.sum())} column(s) and {int(bad_rows.sum())} row(s) still disagree with their "
                f"checksums after {fixed} correction(s): more than one bad value per row and per column"
            )
        return CheckResult(detected=True, corrected=fixed)


_CAUSAL_BIAS: dict[tuple[int, torch.dtype, torch.device], Tensor] = {}


def causal_bias(t: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Additive causal mask (t, t): 0 on and below the diagonal, -inf above (cached)."""
    key = (t, dtype, torch.device(device))
    if key not in _CAUSAL_BIAS:
        upper = torch.ones(t, t, dtype=torch.bool, device=device).triu(1)
        _CAUSAL_BIAS[key] = torch.zeros(t, t, dtype=dtype, device=device).masked_fill(upper, float("-inf"))
    return _CAUSAL_BIAS[key]


def _range_trips(c: Tensor, threshold: float) -> bool:
    """The cheap trigger, one `aminmax` pass: True iff c holds a NaN (which propagates into
    both extremes), an INF or a value beyond +-threshold."""
    lo, hi = torch.aminmax(c)
    return not (float(hi) <= threshold and float(lo) >= -threshold)


# ---------------------------------------------------------------------------------------
# fault injection


# ---------------------------------------------------------------------------------------
# the guard


@dataclass
class AttentionGuard:
    """Checksum-protected attention, callable as `guard(attn_module, x) -> output`.

    mode: "range" (cheap trigger, full check when it trips), "full" (checksums on every
    matmul) or "off" (no checks: explicit attention math, faults still injected).
    threshold: near-INF threshold; None follows the dtype (`default_threshold`).
    max_faults_per_section: corrected elements allowed per section and call (None: no cap).
    Counters: detected (checks that found a mismatch), corrected (elements rebuilt),
    escalated (UncorrectableSoftError raised), triggered (range trips), checks (full
    checks run); `injected` is read from the injector.
    """

    mode: Mode = "range"
    injector: FaultInjector | None = None
    threshold: float | None = None
    max_faults_per_section: int | None = 1
    detected: int = 0
    corrected: int = 0
    escalated: int = 0
    triggered: int = 0
    checks: int = 0

    def __post_init__(self) -> None:
        if self.mode not in ("off", "range", "full"):
            raise ValueError(f"mode must be 'off', 'range' or 'full', got {self.mode!r}")
        self._call = -1
        self._section_faults: dict[str, int] = {}

    @property
    def injected(self) -> int:
        return 0 if self.injector is None else self.injector.injected

    def __call__(self, attn: Attention, x: Tensor) -> Tensor:
        """Attention forward of `attn` on x (B, T, C) with protected matmuls."""
        self._call = self.injector.begin_call() if self.injector is not None else self._call + 1
        self._section_faults = {}
        b, t, c = x.shape
        q = self._linear("q", attn.wq, x)
        k = self._linear("k", attn.wk, x)
        q = apply_rope(attn.split_heads(q), attn.rope_cos, attn.rope_sin)
        k = attn.expand_kv(apply_rope(attn.split_heads(k, attn.num_kv_heads), attn.rope_cos, attn.rope_sin))
        kt = k.transpose(-2, -1)
        scores = q @ kt  # (B, nh, T, T)
        hs = attn.head_dim
        self._protect("scores", scores, lambda: (q.reshape(-1, t, hs), kt.reshape(-1, hs, t), None))
        # scale and causal mask in one op: -inf + s/sqrt(hs) above the diagonal, 0 + s/sqrt(hs) on and below
        p = torch.softmax(torch.add(causal_bias(t, scores.dtype, x.device), scores, alpha=1.0 / math.sqrt(hs)), dim=-1)
        v = attn.expand_kv(attn.split_heads(self._linear("v", attn.wv, x), attn.num_kv_heads))
        ctx = p @ v  # (B, nh, T, hs)
        self._protect("context", ctx, lambda: (p.reshape(-1, t, t), v.reshape(-1, t, hs), None))
        return self._linear("out", attn.wo, ctx.transpose(1, 2).reshape(b, t, c))

    def _linear(self, site: str, lin: nn.Linear, x: Tensor) -> Tensor:
        out = F.linear(x, lin.weight, lin.bias)
        self._protect(site, out, lambda: (x.reshape(1, -1, x.shape[-1]), lin.weight.t().unsqueeze(0), lin.bias))
        return out

    def _protect(self, site: str, out: Tensor, operands: Callable[[], tuple[Tensor, Tensor, Tensor | None]]) -> None:
        """Inject (if scheduled), then check/repair `out` in place according to the mode.
        `operands` lazily returns (a, b, bias) with out == a @ b + bias as (nb, m, n)."""
        if self.injector is not None:
            self.injector.inject(site, out)
        if self.mode == "off":
            return
        with torch.no_grad():
            thr = default_threshold(out.dtype) if self.threshold is None else self.threshold
            if self.mode == "range":
                if not _range_trips(out, thr):
                    return
                self.triggered += 1
            self.checks += 1
            a, b, bias = operands()
            view = out.view(-1, a.shape[-2], out.shape[-1])
            try:
                bias = None if bias is None else bias.detach()
                result = check_and_correct(view, a.detach(), b.detach(), bias, threshold=thr)
            except UncorrectableSoftError as err:
                self.escalated += 1
                raise UncorrectableSoftError(f"{site} (call {self._call}): {err}", site=site, call=self._call) from err
        if not result.detected:
            return
        self.detected += 1
        self.corrected += result.corrected
        section = SECTIONS[site]
        self._section_faults[section] = self._section_faults.get(section, 0) + result.corrected
        cap = self.max_faults_per_section
        if cap is not None and self._section_faults[section] > cap:
            self.escalated += 1
            raise UncorrectableSoftError(
                f"{site} (call {self._call}): {self._section_faults[section]} faults in section {section!r}, "
                f"budget {cap} per forward",
                site=site,
                call=self._call,
            )


def install_guard(module: nn.Module, guard: AttentionGuard | None) -> int:
    """Set `.guard = guard` on every `Attention` in `module`'s tree; returns how many."""
    count = 0
    for sub in module.modules():
        if isinstance(sub, Attention):
            sub.guard = guard
            count += 1
    return count


def remove_guard(module: nn.Module) -> int:
    """Clear the guard of every `Attention` in `module`'s tree; returns how many."""
    return install_guard(module, None)
