"""A validation evaluation that re-runs only the stages a rebuild changed.

An evaluation of the plain route feeds every validation batch through stages 0 .. S-1. After one stage `k` is
rebuilt, stages 0 .. k-1 still hold the weights they had, so the inputs they hand to stage `k` are the ones an
earlier evaluation of those weights already computed. `StageInputs` records them (the input each stage received,
batch by batch, as the wire delivered it) at chosen evaluations of a run (the trunk of a pretrained study, before a
save its branches resume from), with a digest of every stage's weights and of the batches; an evaluation after a
rebuild at `k` (`evaluate_after`) then starts at stage `k` from the recorded inputs, after checking that the
stages before `k` and the batches are still the recorded ones (the digests). Where they are not, or nothing was
recorded for that step, it evaluates the whole route and says why. The loss is the same sum over the same batches
either way: the skipped stages' outputs are the recorded tensors.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from checkfree.pipeline import plain_route
from checkfree.wirecodec import roundtrip

if TYPE_CHECKING:
    from checkfree.worker import StageWorker

__all__ = ["StageInputs", "route_loss", "weights_digest", "batches_digest"]

log = logging.getLogger(__name__)

Batches = list[tuple[torch.Tensor, torch.Tensor]]


def _tensor_bytes(t: torch.Tensor) -> bytes:
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def weights_digest(worker: StageWorker) -> str:
    """sha256 of a stage's weights and buffers (names, dtypes, shapes and bytes)."""
    h = hashlib.sha256()
    for name, t in sorted(worker.module.state_dict().items()):
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(_tensor_bytes(t))
    return h.hexdigest()


def batches_digest(batches: Batches) -> str:
    """sha256 of the validation batches (inputs and targets)."""
    h = hashlib.sha256()
    for inputs, targets in batches:
        for t in (inputs, targets):
            h.update(f"{t.dtype}:{tuple(t.shape)}".encode())
            h.update(_tensor_bytes(t))
    return h.hexdigest()


@torch.no_grad()
def route_loss(workers: list[StageWorker], batches: Batches, *, first: int = 0,
               inputs: list[torch.Tensor] | None = None, keep: dict[int, list[torch.Tensor]] | None = None) -> float:
    """Mean validation loss over `batches` along the plain route. `first`, `inputs`: start at stage `first` from
    the input it received for each batch (as `keep` recorded them); `keep`: append the input each stage named in it
    receives, batch by batch (what the wire delivered: after `train.wire_dtype`'s round trip)."""
    if first and (inputs is None or len(inputs) != len(batches)):
        raise ValueError(f"starting at stage {first} needs one recorded input per batch ({len(batches)})")
    hops = plain_route(len(workers))
    losses = []
    for b, (batch_inputs, targets) in enumerate(batches):
        x = batch_inputs if not first else inputs[b]  # type: ignore[index]
        for i in range(first, len(workers)):
            w = workers[i]
            if i > 0 and not (first and i == first):  # the recorded input already went over the wire
                x = roundtrip(x, w.cfg.train.wire_dtype)
            if keep is not None and i in keep:
                keep[i].append(x.detach().to("cpu").clone())
            x = w.infer(x, hops[i])
        losses.append(float(torch.nn.functional.cross_entropy(x.flatten(0, 1), targets.to(x.device).flatten())))
    return sum(losses) / len(losses)


class StageInputs:
    """Recorded stage inputs of a run's evaluations, in `directory` (one subdirectory per step, written whole or
    not at all). `record_steps`: the steps whose evaluation (the state ready to run that step) is recorded."""

    def __init__(self, directory: str | Path, record_steps: frozenset[int] | set[int] = frozenset()) -> None:
        self.directory = Path(directory)
        self.record_steps = frozenset(record_steps)

    def _dir(self, step: int) -> Path:
        return self.directory / f"step-{step:08d}"

    def records(self, step: int) -> bool:
        return step in self.record_steps

    def record(self, step: int, workers: list[StageWorker], batches: Batches) -> float:
        """Evaluate the whole route, keeping every stage's input but the first's; write them for `step`."""
        keep: dict[int, list[torch.Tensor]] = {i: [] for i in range(1, len(workers))}
        val = route_loss(workers, batches, keep=keep)
        final, tmp = self._dir(step), self._dir(step).with_name(f".tmp-{os.getpid()}-{step}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for i, xs in keep.items():
            torch.save(xs, tmp / f"stage-{i}.pt")
        meta = {"step": step, "val_loss": val, "batches": batches_digest(batches),
                "weights": [weights_digest(w) for w in workers]}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        return val

    def evaluate_after(self, step: int, workers: list[StageWorker], batches: Batches, changed: set[int]) -> float:
        """The validation loss after the stages `changed` were rebuilt at `step`: from the first changed stage on,
        from the inputs recorded for `step`, when the stages before it and the batches are the recorded ones;
        otherwise the whole route (saying why, in one line, unless stage 0 changed: nothing to skip)."""
        first = min(changed) if changed else len(workers)
        d = self._dir(step)
        why = None
        if first == 0:  # nothing before it to skip
            return route_loss(workers, batches)
        if not (d / "meta.json").is_file():
            why = f"no stage inputs recorded for step {step} in {self.directory}"
        else:
            meta = json.loads((d / "meta.json").read_text())
            if meta["batches"] != batches_digest(batches):
                why = f"the validation batches differ from those recorded for step {step}"
            elif len(meta["weights"]) != len(workers):
                why = f"{len(meta['weights'])} stages recorded for step {step}, {len(workers)} now"
            else:
                moved = [i for i in range(min(first, len(workers))) if weights_digest(workers[i]) != meta["weights"][i]]
                if moved:
                    why = f"stage(s) {moved} hold other weights than those recorded for step {step}"
        if why is not None:
            log.warning("evaluating the whole route: %s", why)
            return route_loss(workers, batches)
        if first >= len(workers):
            return float(json.loads((d / "meta.json").read_text())["val_loss"])
        inputs = torch.load(d / f"stage-{first}.pt")
        return route_loss(workers, batches, first=first, inputs=inputs)
