"""Soft errors on purpose: bit flips and near-INF values in IEEE-754 floats, and `FaultInjector`, which writes
scheduled or seeded-random faults (INF, -INF, NaN, near-INF, a chosen value) into the outputs of the protected
attention matmuls. `checkfree.abft.AttentionGuard` drives the injector (one call per attention forward) and
checks what it wrote; the sites are the guard's."""

from __future__ import annotations

import math
import random as _random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = ["SITES", "FAULT_KINDS", "FaultKind", "default_threshold", "flip_bit", "near_inf", "Fault", "Injection",
           "FaultInjector"]

SITES: tuple[str, ...] = ("q", "k", "scores", "v", "context", "out")
"""Protected matmul outputs, in the order they are computed."""

FAULT_KINDS: tuple[str, ...] = ("inf", "-inf", "nan", "near_inf")
"""Named fault kinds; a float kind writes that value instead."""

FaultKind = str | float


def default_threshold(dtype: torch.dtype) -> float:
    """Near-INF threshold for `dtype`: 1e10 (the paper's fp32 value), capped at
    finfo.max / 4 so it stays meaningful for narrow types (fp16: 16376)."""
    return min(1e10, torch.finfo(dtype).max / 4)


# ---------------------------------------------------------------------------------------
# bit flips

_INT_VIEW = {
    torch.float32: torch.int32, torch.float64: torch.int64, torch.float16: torch.int16, torch.bfloat16: torch.int16
}
_EXP_BITS = {  # bit positions of the exponent field
    torch.float32: range(23, 31), torch.float64: range(52, 63),
    torch.float16: range(10, 15), torch.bfloat16: range(7, 15),
}


def flip_bit(value: Tensor, bit: int) -> Tensor:
    """Return a copy of the 0-d floating tensor `value` with bit `bit` of its IEEE-754
    representation flipped (bit 0 = lowest mantissa bit)."""
    ity = _INT_VIEW[value.dtype]
    nbits = torch.finfo(value.dtype).bits
    raw = value.detach().clone().reshape(1).view(ity)
    mask = 1 << bit
    if mask >= 1 << (nbits - 1):  # the sign bit does not fit a positive signed literal
        mask -= 1 << nbits
    return (raw ^ torch.tensor(mask, dtype=ity)).view(value.dtype).reshape(())


def near_inf(value: Tensor, threshold: float | None = None) -> Tensor:
    """A near-INF corruption of `value`: flip its highest zero exponent bit (one upset bit,
    multiplying it by 2**(2**b)). Where no such flip lands in (threshold, finfo.max] -- zero
    and denormals stay small, |x| in [1, 2) becomes INF/NaN -- return +-finfo.max / 2
    instead (several upset exponent bits)."""
    thr = default_threshold(value.dtype) if threshold is None else threshold
    ity = _INT_VIEW[value.dtype]
    raw = int(value.detach().reshape(1).view(ity).item())
    for bit in reversed(_EXP_BITS[value.dtype]):
        if not (raw >> bit) & 1:
            out = flip_bit(value, bit)
            if math.isfinite(out.item()) and abs(out.item()) > thr:
                return out
            break
    sign = -1.0 if raw < 0 else 1.0
    return torch.tensor(sign * torch.finfo(value.dtype).max / 2, dtype=value.dtype)


@dataclass(frozen=True)
class Fault:
    """One scheduled fault: at attention forward call `call` (0-based, counted by the
    injector over every module sharing it), write `kind` into the output of matmul `site`
    at (`row`, `col`) of its 2-D view `out.reshape(-1, out.shape[-1])`; None = seeded
    random position (for "scores", within the causal, unmasked part)."""

    call: int
    site: str
    kind: FaultKind
    row: int | None = None
    col: int | None = None

    def __post_init__(self) -> None:
        if self.site not in SITES:
            raise ValueError(f"unknown site {self.site!r}; expected one of {SITES}")
        if not isinstance(self.kind, float | int) and self.kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}; expected one of {FAULT_KINDS} or a float")


@dataclass(frozen=True)
class Injection:
    """Record of one performed injection."""

    call: int
    site: str
    row: int
    col: int
    kind: FaultKind
    old: float
    new: float


@dataclass
class FaultInjector:
    """Writes scheduled faults into matmul outputs; driven by `AttentionGuard`, which calls
    `begin_call()` at each attention forward and `inject(site, out)` after each protected
    matmul. `injected` counts performed injections; `log` records them."""

    schedule: list[Fault] = field(default_factory=list)
    seed: int = 0
    threshold: float | None = None
    calls: int = 0
    injected: int = 0
    log: list[Injection] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self.schedule = [f if isinstance(f, Fault) else Fault(*f) for f in self.schedule]
        self._rng = _random.Random(self.seed)
        self._call = -1

    @classmethod
    def from_schedule(cls, schedule: Iterable[Fault | Sequence], *, seed: int = 0) -> FaultInjector:
        """Build from (call, site, kind[, row, col]) tuples or `Fault`s."""
        return cls(schedule=[f if isinstance(f, Fault) else Fault(*f) for f in schedule], seed=seed)

    @classmethod
    def random(
        cls,
        n: int,
        seed: int,
        *,
        calls: Sequence[int] | None = None,
        sites: Sequence[str] = SITES,
        kinds: Sequence[FaultKind] = FAULT_KINDS,
    ) -> FaultInjector:
        """`n` faults at seeded-random sites, kinds and positions: one per call in
        `calls` drawn without replacement (default: calls 0..n-1)."""
        rng = _random.Random(seed)
        chosen = list(range(n)) if calls is None else sorted(rng.sample(list(calls), n))
        return cls(schedule=[Fault(c, rng.choice(list(sites)), rng.choice(list(kinds))) for c in chosen], seed=seed)

    def begin_call(self) -> int:
        """Start the next attention forward; returns its call index."""
        self._call = self.calls
        self.calls += 1
        return self._call

    def inject(self, site: str, out: Tensor) -> int:
        """Write this call's faults for `site` into `out` in place; returns how many."""
        count = 0
        for fault in self.schedule:
            if fault.call == self._call and fault.site == site:
                self._write(fault, out)
                count += 1
        return count

    def _position(self, fault: Fault, out: Tensor) -> tuple[int, int]:
        rows, cols = out.numel() // out.shape[-1], out.shape[-1]
        if fault.row is not None and fault.col is not None:
            return fault.row % rows, fault.col % cols
        row = self._rng.randrange(rows) if fault.row is None else fault.row % rows
        if fault.site == "scores" and fault.col is None:
            return row, self._rng.randrange(row % out.shape[-2] + 1)
        return row, self._rng.randrange(cols) if fault.col is None else fault.col % cols

    def _write(self, fault: Fault, out: Tensor) -> None:
        row, col = self._position(fault, out)
        flat = out.view(-1, out.shape[-1])
        with torch.no_grad():
            old = flat[row, col].clone()
            if fault.kind == "near_inf":
                new = near_inf(old, self.threshold)
            else:  # "inf", "-inf", "nan" or a chosen value
                new = torch.tensor(float(fault.kind), dtype=out.dtype)
            flat[row, col] = new
        self.injected += 1
        self.log.append(Injection(self._call, fault.site, row, col, fault.kind, float(old), float(new)))
