"""Recovery of lost stages: pure functions over state dicts, chosen from a registry by name.

The simulator and the distributed runtime both call `plan_recovery` (who is rebuilt from
whom) and `rebuild_stage` (the arithmetic); nothing here knows about processes or networks.

CheckFree (intermediate stage i, neighbours i-1 and i+1, their gradient norms omega):

    W_i = (a * W_{i+1} + b * W_{i-1}) / (a + b),   a = omega_{i+1} + eps,  b = omega_{i-1} + eps

CheckFree+ additionally recovers stage 0 by copying stage 1's blocks and stage S-1 by
copying stage S-2's, and restores the embedding / head exactly from their replicas —
weights (`rebuild_stage`) and Adam state (`recovered_optimizer_state`), so the replacement
continues the replica's steps exactly. The recovery LR scale is for the rebuilt blocks only.

Two inits read no live stage: `random` (fresh N(0, std) weights) and `identity` (the same with every
block's residual output projection zero, so the stage is a pass-through until it trains: layer drop).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from checkfree.model import RESIDUAL_OUTPUTS, derive_seed
from checkfree.pipeline import edge_holders

__all__ = [
    "StateDict",
    "UnrecoverableFailure",
    "checkfree_average",
    "uniform_average",
    "copy_neighbour",
    "random_init",
    "identity_init",
    "omega",
    "OmegaWindow",
    "RecoveryRule",
    "RECOVERY_RULES",
    "get_rule",
    "FALLBACKS",
    "SOURCELESS",
    "Neighbours",
    "plan_recovery",
    "rebuild_stage",
    "recovered_optimizer_state",
    "is_finite_state",
]

StateDict = dict[str, Tensor]
FALLBACKS = ("abort", "random", "copy", "identity")


class UnrecoverableFailure(RuntimeError):
    """A failure the strategy cannot recover while the fallback is `abort`."""


def checkfree_average(prev: StateDict, next: StateDict, *, prev_norm: float, next_norm: float,
                      eps: float = 1e-4) -> StateDict:
    """Gradient-norm weighted average; each neighbour is weighted by its OWN norm."""
    a, b = next_norm + eps, prev_norm + eps
    return {k: (a * next[k].float() + b * prev[k].float()).div(a + b).to(prev[k].dtype) for k in prev}


def uniform_average(prev: StateDict, next: StateDict) -> StateDict:
    return {k: ((prev[k].float() + next[k].float()) / 2).to(prev[k].dtype) for k in prev}


def copy_neighbour(src: StateDict) -> StateDict:
    return {k: v.detach().clone() for k, v in src.items()}


def random_init(template: Mapping[str, Tensor], *, seed: int, std: float = 0.02) -> StateDict:
    """Fresh N(0, std) weights shaped like `template`; vectors (RMSNorm weights) are ones."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for k in sorted(template):
        t = template[k]
        w = torch.ones(t.shape) if t.ndim == 1 else torch.randn(t.shape, generator=gen) * std
        out[k] = w.to(t.dtype)
    return out


def identity_init(template: Mapping[str, Tensor], *, seed: int, std: float = 0.02) -> StateDict:
    """A pass-through stage: `random_init`'s weights with each block's residual output projections
    (attention `wo`, MLP `w2`) zero, so every block is exactly x -> x. Its other matrices stay random:
    the zero projections get gradients at the first step, the rest from the second on."""
    out = random_init(template, seed=seed, std=std)
    for k, v in out.items():
        if k.endswith(RESIDUAL_OUTPUTS):
            v.zero_()
    return out


# The inits that read no live stage (a plan of these has no sources), by method name.
_SOURCELESS_INITS = {"random": random_init, "identity": identity_init}
SOURCELESS = tuple(_SOURCELESS_INITS)


def omega(pre_clip: float, post_clip: float, *, kind: str = "post-clip", power: int = 1) -> float:
    """The gradient norm CheckFree weights a stage by (paper default: post-clip, plain)."""
    if kind not in ("post-clip", "pre-clip"):
        raise ValueError(f"norm kind must be 'post-clip' or 'pre-clip', got {kind!r}")
    if power not in (1, 2):
        raise ValueError(f"norm power must be 1 (plain) or 2 (squared), got {power}")
    value = post_clip if kind == "post-clip" else pre_clip
    return value**power


class OmegaWindow:
    """A stage's omega as recovery reads it: the mean of its last `size` committed omegas (`recovery.omega_window`;
    1, the paper's: the last step's alone). The simulator keeps one per stage and every peer one for its stage,
    both through `add`, so the two runtimes weigh a rebuild alike. A stage restored from a copy (a resume, a
    rollback, a handover) starts a new window at the omega it was restored with."""

    def __init__(self, size: int = 1, start: float | None = None) -> None:
        if size < 1:
            raise ValueError(f"recovery.omega_window must be >= 1, got {size}")
        self.size = size
        self._last: list[float] = [] if start is None else [float(start)]

    def add(self, value: float) -> float:
        """Record a committed step's omega; returns the window's mean (the omega a recovery now reads)."""
        self._last = (self._last + [float(value)])[-self.size:]
        return self.value

    @property
    def value(self) -> float:
        return sum(self._last) / len(self._last) if self._last else 0.0


@dataclass(frozen=True)
class RecoveryRule:
    """How a strategy rebuilds blocks: `inner` for stages with two neighbours, `edge` for
    the first/last stage (None: the strategy cannot), and whether it runs CheckFree+
    (swapped routes and embedding/head replicas)."""

    name: str
    inner: str  # "average" | "uniform" | "copy" | "random" | "identity"
    edge: str | None
    plus: bool = False


RECOVERY_RULES: dict[str, RecoveryRule] = {
    "checkfree": RecoveryRule("checkfree", inner="average", edge=None),
    "checkfree+": RecoveryRule("checkfree+", inner="average", edge="copy", plus=True),
    "uniform": RecoveryRule("uniform", inner="uniform", edge=None),
    "copy": RecoveryRule("copy", inner="copy", edge=None),
    "random": RecoveryRule("random", inner="random", edge="random"),
    # identity cannot rebuild an embedding or LM head: an edge stage is refused (the declared fallback)
    "identity": RecoveryRule("identity", inner="identity", edge=None),
}


def get_rule(name: str) -> RecoveryRule:
    if name not in RECOVERY_RULES:
        raise ValueError(f"unknown recovery strategy {name!r}; choose one of {sorted(RECOVERY_RULES)}")
    return RECOVERY_RULES[name]


@dataclass
class Neighbours:
    """Who rebuilds stage `stage`, from which live stages, and how.

    `method` is how its blocks are made; `sources` the stages whose blocks are read (in the
    order prev, next for averages); `edge_sources` maps "embed"/"head" to the live stage
    holding a replica (a component with no live replica is re-initialised: listed in
    `edges_reinit`). `fallback` names the declared fallback when the strategy itself could
    not recover the stage, with `reason` saying why.
    """

    stage: int
    method: str
    sources: tuple[int, ...]
    edge_sources: dict[str, int] = field(default_factory=dict)
    edges_reinit: tuple[str, ...] = ()
    fallback: str | None = None
    reason: str = ""


def _edge_plan(stage: int, failed: set[int], num_stages: int, plus: bool) -> tuple[dict[str, int], tuple[str, ...]]:
    sources, reinit = {}, []
    for comp, holders in edge_holders(num_stages, plus).items():
        if stage not in holders:
            continue
        alive = [h for h in holders if h not in failed]
        if alive:
            sources[comp] = alive[0]
        else:
            reinit.append(comp)
    return sources, tuple(reinit)


def _nearest_alive(stage: int, failed: set[int], num_stages: int) -> int | None:
    for d in range(1, num_stages):
        for s in (stage - d, stage + d):
            if 0 <= s < num_stages and s not in failed:
                return s
    return None


def _strategy_plan(rule: RecoveryRule, stage: int, failed: set[int], num_stages: int) -> tuple[str, tuple[int, ...]] | str:
    """(method, sources) if the rule recovers the stage, else the reason it cannot."""
    prev, nxt = stage - 1, stage + 1
    is_edge = stage == 0 or stage == num_stages - 1
    if rule.inner in SOURCELESS and (not is_edge or rule.edge == rule.inner):
        return (rule.inner, ())
    if is_edge:
        if rule.edge is None:
            return f"strategy {rule.name} cannot recover the {'first' if stage == 0 else 'last'} stage"
        partner = nxt if stage == 0 else prev
        if partner in failed:
            return f"its partner stage {partner} failed in the same step"
        return ("copy", (partner,))
    dead = [s for s in (prev, nxt) if s in failed]
    if dead:
        return f"adjacent stage(s) {dead} failed in the same step"
    if rule.inner == "copy":
        return ("copy", (prev,))
    return (rule.inner, (prev, nxt))


def plan_recovery(failed: set[int], num_stages: int, strategy: str, fallback: str = "abort") -> list[Neighbours]:
    """Plan the recovery of every failed stage; sources are always live stages.

    Raises UnrecoverableFailure when a stage cannot be recovered and `fallback` is "abort".
    """
    rule = get_rule(strategy)
    if fallback not in FALLBACKS:
        raise ValueError(f"unknown fallback {fallback!r}; choose one of {FALLBACKS}")
    bad = [s for s in failed if not 0 <= s < num_stages]
    if bad:
        raise ValueError(f"failed stages {bad} out of range for {num_stages} stages")
    if len(failed) == num_stages:
        raise UnrecoverableFailure(f"all {num_stages} stages failed at once; nothing to recover from")
    plans = []
    for stage in sorted(failed):
        edge_sources, reinit = _edge_plan(stage, failed, num_stages, rule.plus)
        outcome = _strategy_plan(rule, stage, failed, num_stages)
        if isinstance(outcome, tuple):
            plans.append(Neighbours(stage, outcome[0], outcome[1], edge_sources, reinit))
            continue
        if fallback == "abort":
            raise UnrecoverableFailure(f"stage {stage} cannot be recovered: {outcome} (fallback=abort)")
        sources: tuple[int, ...] = ()
        if fallback == "copy":
            near = _nearest_alive(stage, failed, num_stages)
            sources = (near,) if near is not None else ()
        plans.append(Neighbours(stage, fallback if sources or fallback in SOURCELESS else "random", sources,
                                  edge_sources, reinit, fallback=fallback, reason=outcome))
    return plans


def _combine(keys: list[str], srcs: list[StateDict], coeffs: list[float], template: Mapping[str, Tensor],
             seed: int, std: float) -> StateDict:
    """Weighted sum of the sources key by key; a key only some sources have is averaged over
    those (renormalised); a key none has is re-initialised (stages of unequal depth)."""
    out: StateDict = {}
    missing = [k for k in keys if not any(k in s for s in srcs)]
    fresh = random_init({k: template[k] for k in missing}, seed=seed, std=std) if missing else {}
    for k in keys:
        have = [(c, s[k]) for c, s in zip(coeffs, srcs) if k in s]
        if not have:
            out[k] = fresh[k]
            continue
        total = sum(c for c, _ in have)
        acc = sum(c * t.float() for c, t in have) / total
        out[k] = acc.to(template[k].dtype)
    return out


def rebuild_stage(plan: Neighbours, template: Mapping[str, Tensor], blocks: Mapping[int, StateDict],
                  norms: Mapping[int, float], edges: Mapping[str, StateDict], *, eps: float = 1e-4,
                  seed: int = 0, std: float = 0.02) -> tuple[StateDict, dict[int, float]]:
    """Build the lost stage's full state dict.

    template: the lost stage's state dict shapes (all keys it must end with);
    blocks: per source stage, its `blocks.*` entries; norms: per source stage, its omega;
    edges: per component ("embed"/"head"), the replica's entries (`embed.*`/`head.*`).
    Returns the state and the coefficient given to each source stage.
    """
    block_keys = sorted(k for k in template if k.startswith("blocks."))
    srcs = [blocks[s] for s in plan.sources]
    for s, sd in zip(plan.sources, srcs):
        bad = [k for k, v in sd.items() if not torch.isfinite(v).all()]
        if bad:
            raise ValueError(f"source stage {s} has non-finite weights in {bad[:3]}; refusing to average them")
    block_seed = derive_seed(seed, "recovery", plan.stage)
    if plan.method in SOURCELESS:
        init = _SOURCELESS_INITS[plan.method]
        return _with_edges(plan, template, init({k: template[k] for k in block_keys}, seed=block_seed, std=std),
                           edges, seed, std), {}
    if plan.method == "average":
        prev, nxt = plan.sources
        a, b = norms[nxt] + eps, norms[prev] + eps
        coeffs = {prev: b / (a + b), nxt: a / (a + b)}
    elif plan.method == "uniform":
        coeffs = {s: 1.0 / len(plan.sources) for s in plan.sources}
    elif plan.method == "copy":
        coeffs = {plan.sources[0]: 1.0}
    else:
        raise ValueError(f"unknown recovery method {plan.method!r}")
    common = [k for k in block_keys if all(k in sd for sd in srcs)]
    pick = [{k: sd[k] for k in common} for sd in srcs]
    if plan.method == "average":
        state = checkfree_average(pick[0], pick[1], prev_norm=norms[plan.sources[0]],
                                  next_norm=norms[plan.sources[1]], eps=eps)
    elif plan.method == "uniform":
        state = uniform_average(pick[0], pick[1])
    else:
        state = copy_neighbour(pick[0])
    rest = [k for k in block_keys if k not in state]
    if rest:  # stages of unequal depth: blocks only one source has, or none
        state.update(_combine(rest, srcs, [coeffs[s] for s in plan.sources], template, block_seed, std))
    return _with_edges(plan, template, state, edges, seed, std), coeffs


def _with_edges(plan: Neighbours, template: Mapping[str, Tensor], state: StateDict,
                edges: Mapping[str, StateDict], seed: int, std: float) -> StateDict:
    """Add the embedding / head: exactly from a live replica, else freshly initialised."""
    for comp in ("embed", "head"):
        keys = sorted(k for k in template if k.startswith(comp + "."))
        if not keys:
            continue
        if comp in plan.edge_sources:
            state.update({k: edges[comp][k].detach().clone() for k in keys})
        else:
            state.update(random_init({k: template[k] for k in keys}, seed=derive_seed(seed, "recovery", comp), std=std))
    return state


def recovered_optimizer_state(plan: Neighbours, edge_optim: Mapping[str, Mapping[str, Mapping[str, Tensor]]],
                              own: Mapping[str, Mapping[str, Tensor]] | None = None) -> dict[str, dict[str, Tensor]]:
    """The optimizer state the rebuilt stage starts with, by parameter name: each component
    copied from a live replica takes that replica's Adam state exactly (moments and step
    count); everything else starts fresh (no entry). edge_optim: per component of
    `plan.edge_sources`, the holder's state of that component's parameters. `own`: the lost stage's own Adam
    state of its blocks, from a copy of it (`recovery.optimizer` own): the rebuilt blocks take it, so a rebuild's
    new weights can be told apart from its fresh optimizer."""
    out: dict[str, dict[str, Tensor]] = {}
    for name, st in (own or {}).items():
        if not name.startswith("blocks."):
            raise ValueError(f"the lost stage's own optimizer state names {name!r}, not a block parameter")
        out[name] = {k: v.detach().clone() for k, v in st.items()}
    for comp in plan.edge_sources:
        for name, st in edge_optim[comp].items():
            if not name.startswith(comp + "."):
                raise ValueError(f"optimizer state of {name!r} sent as part of the {comp!r} replica")
            out[name] = {k: v.detach().clone() for k, v in st.items()}
    return out


def is_finite_state(state: Mapping[str, Tensor]) -> bool:
    return all(bool(torch.isfinite(v).all()) for v in state.values())

