"""Debugging, off by default: `--dump-recovery DIR` saves the weights served and rebuilt in recoveries, and the
final state, as safetensors files with a JSON of metadata each. (Faults: the peer's hook, checkfree.peer_hook.)
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from checkfree.strategies.state import optim_to_wire
from checkfree.worker import StageWorker

__all__ = ["Dumps"]


class Dumps:
    """The dump directory of one peer (None: nothing is saved)."""

    def __init__(self, dump_dir: str | None) -> None:
        self.dump_dir = dump_dir

    def dump(self, name: str, state: dict[str, torch.Tensor], meta: dict) -> None:
        """Save a state dict and its metadata under the dump directory (if there is one)."""
        if not self.dump_dir:
            return
        from safetensors.torch import save_file

        path = Path(self.dump_dir)
        path.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().cpu().contiguous() for k, v in state.items()}, str(path / f"{name}.safetensors"))
        (path / f"{name}.json").write_text(json.dumps(meta))

    def dump_final(self, worker: StageWorker, omega: float, tag: str = "") -> None:
        """The weights and Adam state the stage ends the run with (on the compute thread); `tag` ends the names
        (a stage group's replicas: the peer's id)."""
        keys, tensors = optim_to_wire(worker.optimizer_state())
        self.dump(f"final-stage{worker.index}{tag}", worker.state_dict(), {"omega": omega})
        self.dump(f"final-stage{worker.index}{tag}-optim", {"/".join(k): t for k, t in zip(keys, tensors)},
                  {"lr_scale": worker.lr_scale})
