"""A stage's full training state as a plain dict, portable across processes and files.

    {"model": {name: tensor}, "optim": {"state": {param name: {...}}, "groups": [{...}]},
     "lr_scale": float, "step": int, "rng": uint8 tensor, "norm": float}

`step` is the next step the stage will run (the data position: batches are a pure function
of the step). Optimizer state is keyed by parameter name, not index, so that the state of
a replicated component (CheckFree+'s embedding / head) can move between holders.
Everything is a copy: later training never changes a captured state, and restoring never
aliases it.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from checkfree.worker import StageWorker

__all__ = ["StageState", "capture_worker", "restore_worker", "state_nbytes", "unit_of", "unit_nbytes"]

StageState = dict[str, Any]


def capture_worker(worker: StageWorker, step: int, norm: float) -> StageState:
    """A deep copy of everything `worker` needs to resume at `step`."""
    names = [n for n, _ in worker.module.named_parameters()]
    sd = worker.optimizer.state_dict()
    assert len(sd["param_groups"]) == 1, "stage optimizers have one parameter group"
    return {
        "model": {k: v.detach().clone() for k, v in worker.module.state_dict().items()},
        "optim": {"state": {names[i]: copy.deepcopy(st) for i, st in sd["state"].items()},
                  "groups": [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]]},
        "lr_scale": float(worker.lr_scale),
        "step": int(step),
        "rng": torch.get_rng_state(),
        "norm": float(norm),
    }


def restore_worker(worker: StageWorker, state: StageState) -> None:
    """Load a captured state into `worker` (weights, Adam state, LR scale, RNG)."""
    worker.module.load_state_dict(state["model"])
    names = [n for n, _ in worker.module.named_parameters()]
    optim = state["optim"]
    worker.optimizer.load_state_dict({
        # deepcopy: Optimizer.load_state_dict keeps same-dtype tensors as they are, and Adam
        # updates them in place, which would corrupt the captured state
        "state": {i: copy.deepcopy(optim["state"][n]) for i, n in enumerate(names) if n in optim["state"]},
        "param_groups": [{**optim["groups"][0], "params": list(range(len(names)))}],
    })
    worker.lr_scale = state["lr_scale"]
    worker.drop_inflight()
    torch.set_rng_state(state["rng"])


def _nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v) for v in obj)
    return 0


def state_nbytes(state: StageState) -> int:
    """Tensor bytes of a state (weights + optimizer moments + RNG)."""
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
