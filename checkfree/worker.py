"""A stage's training state and its forward / backward / step: the unit a peer hosts.

The simulator chains StageWorkers in one process; a peer daemon wraps exactly one and
moves its inputs and outputs over the network. Activations cross stage boundaries
detached in both cases, so the arithmetic is the same.

Clipping: each stage clips its own gradient to `max_grad_norm` (per stage, not global).
Under CheckFree+ the embedding and head are shared by two holders; they are clipped as
their own groups so that both holders, applying the same summed gradient, take
bit-identical steps. omega (the norm CheckFree weights by) is the norm of the stage's
main group: its blocks, plus in plain mode its own embedding / head.

The same groups are the optimizer's parameter groups. Only "main" takes a recovered
stage's LR scale: a replicated component is recovered exactly, with its partner's Adam
state (`load_recovered(..., optim=...)`), and must keep taking the partner's steps.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from checkfree.config import RecoveryConfig, RunConfig
from checkfree.hostcopy import to_device
from checkfree.model import PipelineStage, StageSpec, init_stage, plan_stages
from checkfree.net.wire import all_finite
from checkfree.pipeline import COMPONENTS, Hop, edge_holders
from checkfree.recovery import get_rule, omega

__all__ = ["StepStats", "InFlightPeak", "StageWorker", "lr_at", "resolve_device"]


def _no_dynamo_at_first_use() -> None:
    """torch.optim's Optimizer marks add_param_group, zero_grad, state_dict and load_state_dict as not to be
    compiled with torch._disable_dynamo, which imports torch._dynamo at their first call to make the mark: 2.3 to
    2.9 s of CPU (torch 2.13, measured here) in every process that builds an optimizer, every peer and every
    simulation, for nothing, since nothing here runs under torch.compile. Each is marked as its own disabled
    form, which is what the first call would have cached had nothing compiled. Idempotent; where a torch has
    other names or wrappers, nothing changes (the first call imports torch._dynamo as before)."""
    for name in ("add_param_group", "zero_grad", "state_dict", "load_state_dict"):
        fn = inspect.unwrap(getattr(torch.optim.Optimizer, name))
        if getattr(fn, "__dynamo_disable", None) is None:
            fn.__dynamo_disable = fn  # type: ignore[attr-defined]


def _adam_step(optimizer: torch.optim.Optimizer) -> None:
    """One optimizer step through the step's own body under no_grad, as its wrappers run it: they add the
    optimizer's step hooks (none here: nor an LR scheduler, checkfree computes the LR) and profiler ranges, and
    import torch._dynamo at the first step to mark a graph break for torch.compile (2.3 to 2.9 s of CPU per
    process, for nothing here). The same arithmetic (tests/test_worker.py compares both, bit for bit)."""
    if optimizer.defaults.get("differentiable") or "step" in vars(optimizer):  # (a step set on the instance runs)
        optimizer.step()
        return
    with torch.no_grad():
        inspect.unwrap(type(optimizer).step)(optimizer)


def resolve_device(name: str) -> torch.device:
    """'auto' picks CUDA when present, else CPU; an unavailable CUDA request is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available on this machine")
    return dev


def lr_at(cfg: RunConfig, step: int) -> float:
    """Learning rate of the run's schedule at `step` (before any recovery scale)."""
    t = cfg.train
    if t.lr_schedule == "constant":
        return t.lr * (min(1.0, (step + 1) / t.warmup_steps) if t.warmup_steps else 1.0)
    if t.lr_schedule == "warmup-cosine":
        if step < t.warmup_steps:
            return t.lr * (step + 1) / t.warmup_steps
        frac = (step - t.warmup_steps) / max(1, t.num_steps - t.warmup_steps)
        return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))
    raise ValueError(f"unknown lr_schedule {t.lr_schedule!r}; choose constant or warmup-cosine")


@dataclass
class StepStats:
    """What a stage reports after its optimizer step."""

    grad_norm_pre: float  # main group, before clipping
    grad_norm_post: float  # main group, after clipping (<= max_grad_norm)
    lr: float
    skipped: bool = False  # a non-finite gradient: no update was applied
    weights_finite: bool = True  # False: the stage's weights hold NaN/Inf and it must be recovered
    block_grad_norm_pre: float = 0.0  # the transformer blocks' part of the main group, before clipping
    block_grad_norm_post: float = 0.0  # ... after the main group's clip

    def omega(self, rc: RecoveryConfig) -> float:
        """The norm CheckFree weights this stage by, under `rc`'s norm kind, power and scope."""
        if rc.omega_scope == "blocks":
            return omega(self.block_grad_norm_pre, self.block_grad_norm_post, kind=rc.norm_kind, power=rc.norm_power)
        return omega(self.grad_norm_pre, self.grad_norm_post, kind=rc.norm_kind, power=rc.norm_power)


@dataclass
class InFlightPeak:
    """The most a stage held at once for in-flight microbatches (forward done, backward not yet)."""

    microbatches: int = 0
    bytes: int = 0  # distinct storages kept for their backward passes; parameters and buffers excluded


class StageWorker:
    """Hosts one stage: module, optimizer, saved activations of in-flight microbatches."""

    def __init__(self, cfg: RunConfig, stage: int, device: torch.device | None = None, *,
                 init: bool = True) -> None:
        """init=False: the module's weights are left on the meta device, unallocated, for a
        stage whose weights `load_recovered` brings at once (a replacement): no random
        initialisation that is overwritten straight away (~4 s for 100M parameters on a CPU)."""
        self.cfg = cfg
        self.spec: StageSpec = plan_stages(cfg.model.num_layers, cfg.num_stages)[stage]
        self.plus = get_rule(cfg.recovery.strategy).plus
        holders = edge_holders(cfg.num_stages, self.plus)
        self.components = tuple(c for c in COMPONENTS if stage in holders[c])
        self.device = device or resolve_device(cfg.train.device)
        with contextlib.nullcontext() if init else torch.device("meta"):
            self.module = PipelineStage(cfg.model, self.spec, has_embedding="embed" in self.components,
                                        has_head="head" in self.components)
        if init:
            self._initialise()
            self.module.to(self.device)
        self.guard = None
        self.lr_scale = 1.0
        self.optimizer = self._new_optimizer()
        self._saved: dict[object, tuple[Tensor, Tensor]] = {}
        self._held: dict[object, int] = {}  # microbatch -> bytes of the storages it keeps alive
        # bytes one microbatch keeps alive, per kind of forward (hop kind, input shape and dtype, autocast): the
        # saved-tensor hook that finds them costs ~5% of a step, so it runs on a kind's first forward only
        self._mb_bytes: dict[tuple, int] = {}
        self._peak = InFlightPeak()

    def _initialise(self) -> None:
        """The run's starting weights: seeded, or the stage's slice of the --init-from checkpoint."""
        source = self.cfg.train.init_from
        if source is None:
            init_stage(self.module, self.cfg.train.seed)
            return
        from checkfree.hf import load_stage_state

        keys = list(self.module.state_dict())
        self.module.load_state_dict(load_stage_state(self.cfg.model, self.spec, keys, source))

    @property
    def index(self) -> int:
        return self.spec.index

    @property
    def has_weights(self) -> bool:
        """False until a stage built with init=False has loaded its recovered weights."""
        return not any(p.is_meta for p in self.module.parameters())

    def attach_guard(self, guard) -> None:
        """Route every attention block of this stage through `guard` (checkfree.abft)."""
        from checkfree.abft import install_guard

        self.guard = guard
        if guard is not None:
            install_guard(self.module, guard)

    def drop_microbatch(self, key: object) -> None:
        """Forget one microbatch's saved activations (it will be recomputed)."""
        self._saved.pop(key, None)
        self._held.pop(key, None)

    def named_groups(self) -> dict[str, list[tuple[str, torch.nn.Parameter]]]:
        """(name, parameter) per group: "main" (clipped for omega, LR x lr_scale after a
        recovery) and, under CheckFree+, each replicated component held here."""
        named = list(self.module.named_parameters())
        if not self.plus:
            return {"main": named}
        groups = {"main": [(n, p) for n, p in named if n.startswith("blocks.")]}
        for comp in self.components:
            groups[comp] = [(n, p) for n, p in named if n.startswith(comp + ".")]
        return groups

    @property
    def param_names(self) -> list[str]:
        """Parameter names in the optimizer's index order."""
        return [n for group in self.named_groups().values() for n, _ in group]

    def _new_optimizer(self) -> torch.optim.Optimizer:
        t = self.cfg.train
        groups = [{"params": [p for _, p in g], "name": name} for name, g in self.named_groups().items()]
        _no_dynamo_at_first_use()
        return torch.optim.Adam(groups, lr=t.lr, betas=t.betas, weight_decay=t.weight_decay)

    def clip_groups(self) -> dict[str, list[torch.nn.Parameter]]:
        """Parameter groups clipped separately; "main" gives omega."""
        return {name: [p for _, p in g] for name, g in self.named_groups().items()}

    def optimizer_state(self, prefix: str = "", *, clone: bool = True) -> dict[str, dict[str, Tensor]]:
        """A copy of the Adam state of the parameters whose names start with `prefix`, by name (``clone=False``:
        the optimizer's own tensors, which its next step changes)."""
        names = self.param_names
        return {names[i]: copy.deepcopy(st) if clone else dict(st)
                for i, st in self.optimizer.state_dict()["state"].items() if names[i].startswith(prefix)}

    def load_optimizer_state(self, state: dict[str, dict[str, Tensor]], groups: list[dict] | None = None) -> None:
        """Replace the Adam state by `state` (by parameter name; a parameter not named has
        none), and the groups' hyperparameters by `groups` (matched by name). Copies: the
        given tensors are never updated in place."""
        params = dict(self.module.named_parameters())
        for name, st in state.items():
            if name not in params:
                raise ValueError(f"optimizer state for {name!r}, which stage {self.index} does not have")
            for field_name, v in st.items():
                if not isinstance(v, Tensor):
                    raise ValueError(f"optimizer state {name}.{field_name} is a {type(v).__name__}, not a tensor")
                if v.ndim and v.shape != params[name].shape:
                    raise ValueError(f"optimizer state {name}.{field_name} has shape {tuple(v.shape)}, "
                                     f"expected {tuple(params[name].shape)}")
                if not all_finite(v):
                    raise ValueError(f"optimizer state {name}.{field_name} is not finite")
        sd = self.optimizer.state_dict()
        saved = {g.get("name", "main"): g for g in groups or []}
        for g in sd["param_groups"]:
            g.update({k: v for k, v in saved.get(g["name"], saved.get("main", {})).items() if k != "params"})
        # deepcopy: Optimizer.load_state_dict keeps same-dtype tensors as they are, and Adam
        # updates them in place, which would corrupt the caller's copy
        sd["state"] = {i: copy.deepcopy(state[n]) for i, n in enumerate(self.param_names) if n in state}
        self.optimizer.load_state_dict(sd)

    def _autocast(self):
        if self.cfg.train.autocast_bf16:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def forward(self, key: object, x: Tensor, hop: Hop, targets: Tensor | None = None) -> Tensor:
        """Run this stage for one microbatch. Returns detached hidden states, or the
        microbatch's loss (already divided by M) when the hop applies the head."""
        assert hop.stage == self.index, f"hop for stage {hop.stage} sent to stage {self.index}"
        if key in self._saved:
            raise ValueError(f"microbatch {key!r} is already in flight on stage {self.index}")
        x = to_device(x, self.device)  # a received activation: pinned, non_blocking, on the upload stream (hostcopy)
        inp = x if hop.embed else x.detach().requires_grad_(True)
        kind = (hop.embed, hop.head, tuple(x.shape), x.dtype, self.cfg.train.autocast_bf16, self.guard is not None)
        per_mb = self._mb_bytes.get(kind)
        held: dict[int, int] = {}
        count = torch.autograd.graph.saved_tensors_hooks(_recorder(held), _identity) if per_mb is None else \
            contextlib.nullcontext()
        with self._autocast(), count:
            out = self.module(inp, embed=hop.embed, head=hop.head)
            if hop.head:
                if targets is None:
                    raise ValueError("the last hop needs targets to compute the loss")
                loss = F.cross_entropy(out.float().flatten(0, 1), to_device(targets, self.device).flatten())
                out = loss / self.cfg.train.num_microbatches
        self._saved[key] = (inp, out)
        if per_mb is None:
            _note_storage(held, inp)
            _note_storage(held, out)
            for t in (*self.module.parameters(), *self.module.buffers()):  # the stage's own, not the microbatch's
                held.pop(t.untyped_storage().data_ptr(), None)
            per_mb = self._mb_bytes[kind] = sum(held.values())
        self._held[key] = per_mb
        self._note_peak()
        return out.detach()

    def _note_peak(self) -> None:
        # a microbatch's storages are its own (its batch and received activations are copies or fresh buffers;
        # the stage's parameters and buffers are excluded), so the in-flight bytes are the sum over microbatches
        self._peak.microbatches = max(self._peak.microbatches, len(self._saved))
        self._peak.bytes = max(self._peak.bytes, sum(self._held.values()))

    def take_inflight_peak(self) -> InFlightPeak:
        """The peak since the last call (or since in-flight work was dropped); starts the next one."""
        peak, self._peak = self._peak, InFlightPeak()
        self._note_peak()
        return peak

    def backward(self, key: object, grad_output: Tensor | None = None) -> Tensor | None:
        """Backpropagate one microbatch; returns the gradient w.r.t. this stage's input
        (None when the stage embedded token ids)."""
        if key not in self._saved:
            raise ValueError(f"microbatch {key!r} has no forward pass on stage {self.index}")
        inp, out = self._saved.pop(key)
        self._held.pop(key, None)
        if grad_output is None:
            out.backward()
        else:
            out.backward(to_device(grad_output, self.device, out.dtype))
        return inp.grad if inp.is_floating_point() else None

    @torch.no_grad()
    def infer(self, x: Tensor, hop: Hop) -> Tensor:
        """Forward without saving anything (evaluation); logits when the hop applies the head."""
        with self._autocast():
            return self.module(x.to(self.device), embed=hop.embed, head=hop.head).float()

    def drop_inflight(self) -> None:
        """Forget saved activations and accumulated gradients (an aborted step)."""
        self._saved.clear()
        self._held.clear()
        self._peak = InFlightPeak()
        self.optimizer.zero_grad(set_to_none=True)

    def component_grad(self, comp: str) -> Tensor:
        """This holder's accumulated gradient of a replicated component, flattened."""
        return _flat_grads(list(getattr(self.module, comp).parameters()))

    def set_component_grad(self, comp: str, flat: Tensor) -> None:
        _set_grads(list(getattr(self.module, comp).parameters()), flat)

    def set_grads(self, grads: dict[str, Tensor]) -> None:
        """Set the named parameters' gradients (moved to each parameter's device and dtype)."""
        params = dict(self.module.named_parameters())
        for n, g in grads.items():
            params[n].grad = g.to(params[n].device, params[n].dtype)

    def flat_grad(self) -> Tensor:
        """Every parameter's accumulated gradient (zeros where none), flattened into one float32 vector in
        parameter order, then one value per parameter, 1 where it has a gradient: what the replicas of a stage
        sum (peers/replica_group.py). A parameter no replica has a gradient for keeps none (Adam skips it)."""
        params = list(self.module.parameters())
        return torch.cat([_flat_grads(params).detach().float(),
                          torch.tensor([float(p.grad is not None) for p in params], device=self.device)])

    def set_flat_grad(self, flat: Tensor) -> None:
        """Replace every parameter's gradient by its slice of `flat` (the layout of `flat_grad`)."""
        params = list(self.module.parameters())
        total = sum(p.numel() for p in params)
        if flat.numel() != total + len(params):
            raise ValueError(f"a flat gradient of {flat.numel()} values for stage {self.index}'s "
                             f"{total} + {len(params)}")
        _set_grads(params, flat, [bool(h) for h in flat[total:].tolist()])

    def step(self, step: int) -> StepStats:
        """Clip each group, apply Adam, and report the main group's gradient norms."""
        lr = lr_at(self.cfg, step) * self.lr_scale
        for group in self.optimizer.param_groups:  # a replicated component keeps its partner's LR
            group["lr"] = lr if group["name"] == "main" else lr_at(self.cfg, step)
        block_grads = [p.grad for n, p in self.named_groups()["main"] if n.startswith("blocks.") and p.grad is not None]
        # the norms stay on the device until all are computed (blocks' before the clip, then each group's, which
        # clip_grad_norm_ returns without a host sync): one sync for all of them below
        norms: dict[str, Tensor] = {}
        if block_grads:
            norms["blocks"] = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in block_grads]))
        for name, params in self.clip_groups().items():
            if any(p.grad is not None for p in params):
                norms[name] = torch.nn.utils.clip_grad_norm_(params, self.cfg.train.max_grad_norm)
        # the host sync a step needs: omega and the norms are reported to the coordinator, and a non-finite norm
        # decides (on the host) that no update is applied
        values = dict(zip(norms, torch.stack([v.float() for v in norms.values()]).tolist())) if norms else {}
        block_pre = values.pop("blocks", 0.0)
        stats = {}
        for name in self.clip_groups():
            pre = values.get(name, 0.0)
            # clip_grad_norm_ scales by max_norm / (norm + 1e-6) when that is below 1
            post = pre * min(1.0, self.cfg.train.max_grad_norm / (pre + 1e-6))
            stats[name] = (pre, post)
        pre, post = stats["main"]
        block_post = block_pre * min(1.0, self.cfg.train.max_grad_norm / (pre + 1e-6))
        if not all(math.isfinite(v[0]) for v in stats.values()):
            self.optimizer.zero_grad(set_to_none=True)
            return StepStats(pre, post, lr, skipped=True, block_grad_norm_pre=block_pre,
                             block_grad_norm_post=block_post)
        _adam_step(self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        # one host sync (not one per parameter): a stage with non-finite weights is reported as failed
        finite = bool(torch.stack([torch.isfinite(p).all() for p in self.module.parameters()]).all())
        return StepStats(pre, post, lr, weights_finite=finite, block_grad_norm_pre=block_pre,
                         block_grad_norm_post=block_post)

    def state_dict(self) -> dict[str, Tensor]:
        return {k: v.detach() for k, v in self.module.state_dict().items()}

    def load_recovered(self, state: dict[str, Tensor], lr_scale: float,
                       optim: dict[str, dict[str, Tensor]] | None = None) -> None:
        """Take a rebuilt state, with a fresh optimizer at LR x lr_scale (not compounding)
        for the main group; `optim`: the Adam state copied with replicated components
        (`checkfree.recovery.recovered_optimizer_state`), whose groups keep the plain LR.
        A stage built with init=False takes the tensors of `state` themselves (no copy): the
        caller must not use them afterwards."""
        if self.has_weights:
            self.module.load_state_dict(state)
        else:
            self.module.load_state_dict(state, assign=True)
            self.module.to(self.device)
        self.optimizer = self._new_optimizer()
        if optim:
            self.load_optimizer_state(optim)
        self.lr_scale = lr_scale
        self._saved.clear()
        self._held.clear()
        self._peak = InFlightPeak()


def _flat_grads(params: list[torch.nn.Parameter]) -> Tensor:
    """The parameters' accumulated gradients (zeros where none), flattened into one vector in their order."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in params])


def _set_grads(params: list[torch.nn.Parameter], flat: Tensor, present: list[bool] | None = None) -> None:
    """Each parameter's gradient from its slice of `flat` (the layout of `_flat_grads`); none where `present`
    says so."""
    offset = 0
    for i, p in enumerate(params):
        n = p.numel()
        keep = present is None or present[i]
        p.grad = flat[offset: offset + n].view_as(p).to(p.device, p.dtype).clone() if keep else None
        offset += n


def _note_storage(held: dict[int, int], t: Tensor) -> None:
    storage = t.untyped_storage()
    held[storage.data_ptr()] = storage.nbytes()


def _recorder(held: dict[int, int]):
    """A saved-tensor pack hook that notes the storage (address, bytes) each saved tensor keeps alive."""

    def pack(t: Tensor) -> Tensor:
        _note_storage(held, t)
        return t.detach()  # the tensor itself would make a saved output and its grad_fn a reference cycle

    return pack


def _identity(t: Tensor) -> Tensor:
    return t
