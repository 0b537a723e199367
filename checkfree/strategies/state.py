"""A stage's full training state as a plain dict, portable across processes and files.

    {"model": {name: tensor}, "optim": {"state": {param name: {...}}, "groups": [{"name": ..., ...}]},
     "lr_scale": float, "step": int, "rng": uint8 tensor, "norm": float}

`step` is the next step the stage will run (the data position: batches are a pure function
of the step). Optimizer state is keyed by parameter name, not index, so that the state of
a replicated component (CheckFree+'s embedding / head) can move between holders; the
groups are the worker's named parameter groups (`StageWorker.named_groups`).
Everything is a copy: later training never changes a captured state, and restoring never
aliases it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from checkfree.snapcodec import tree_nbytes
from checkfree.worker import StageWorker

__all__ = ["StageState", "capture_worker", "restore_worker", "with_components", "optim_to_wire", "optim_from_wire",
           "state_nbytes", "unit_of", "unit_nbytes"]

StageState = dict[str, Any]


def capture_worker(worker: StageWorker, step: int, norm: float, *, clone: bool = True) -> StageState:
    """A deep copy of everything `worker` needs to resume at `step`. ``clone=False``: the weights and Adam state
    are the worker's own tensors (for a caller that serialises them at once, on the thread that trains: the
    serialisation is then the only copy)."""
    return {
        "model": {k: v.detach().clone() if clone else v.detach() for k, v in worker.module.state_dict().items()},
        "optim": {"state": worker.optimizer_state(clone=clone),
                  "groups": [{k: v for k, v in g.items() if k != "params"} for g in worker.optimizer.param_groups]},
        "lr_scale": float(worker.lr_scale),
        "step": int(step),
        "rng": torch.get_rng_state(),
        "norm": float(norm),
    }


def restore_worker(worker: StageWorker, state: StageState) -> None:
    """Load a captured state into `worker` (weights, Adam state and groups, LR scale, RNG)."""
    worker.module.load_state_dict(state["model"])
    worker.load_optimizer_state(state["optim"]["state"], state["optim"]["groups"])
    worker.lr_scale = state["lr_scale"]
    worker.drop_inflight()
    torch.set_rng_state(state["rng"])


def with_components(state: StageState, donors: dict[str, tuple[dict[str, torch.Tensor],
                                                                dict[str, dict[str, torch.Tensor]]]]) -> StageState:
    """``state`` with each replicated component ``comp`` ("embed" / "head") taken from its donor, a live
    co-holder: ``donors[comp] = (weights by name, Adam state by name)`` (entries of other parts are ignored).
    A shallow copy: ``state`` itself is not changed."""
    out = dict(state)
    out["model"], out["optim"] = dict(state["model"]), {**state["optim"], "state": dict(state["optim"]["state"])}
    for comp, (weights, optim) in donors.items():
        out["model"].update({k: v for k, v in weights.items() if k.startswith(comp + ".")})
        out["optim"]["state"].update({k: v for k, v in optim.items() if k.startswith(comp + ".")})
    return out


def optim_to_wire(state: dict[str, dict[str, torch.Tensor]]) -> tuple[list[list[str]], list[torch.Tensor]]:
    """Per-parameter optimizer state as ([parameter, field] keys, tensors) for one message."""
    keys, tensors = [], []
    for name in sorted(state):
        for field_name in sorted(state[name]):
            keys.append([name, field_name])
            tensors.append(state[name][field_name].detach().cpu().contiguous())
    return keys, tensors


def optim_from_wire(keys: Any, tensors: list[torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """Inverse of `optim_to_wire`; malformed keys raise ValueError."""
    if not isinstance(keys, list) or len(keys) != len(tensors):
        raise ValueError(f"optimizer state has {len(keys) if isinstance(keys, list) else keys!r} keys "
                         f"for {len(tensors)} tensors")
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in zip(keys, tensors):
        if not (isinstance(key, list) and len(key) == 2 and all(isinstance(x, str) for x in key)):
            raise ValueError(f"optimizer state key {key!r} is not [parameter, field]")
        if key[1] in out.setdefault(key[0], {}):
            raise ValueError(f"optimizer state key {key!r} appears twice")
        out[key[0]][key[1]] = t
    return out


_nbytes = tree_nbytes


def state_nbytes(state: StageState | Sequence[Any]) -> int:
    """Tensor bytes of a state (weights + optimizer moments + RNG), or of any nest of dicts and lists of tensors."""
    return _nbytes(state)


def unit_of(name: str) -> str:
    """The transfer unit a parameter belongs to: "embed", "head" or "blocks.<k>"."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "blocks" else parts[0]


def unit_nbytes(state: StageState) -> dict[str, int]:
    """Bytes of each unit (weights + optimizer state), in the stage's order."""
    out: dict[str, int] = {}
    for name, t in state["model"].items():
        out[unit_of(name)] = out.get(unit_of(name), 0) + _nbytes(t)
    for name, st in state["optim"]["state"].items():
        out[unit_of(name)] = out.get(unit_of(name), 0) + _nbytes(st)
    return out
