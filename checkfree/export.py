"""Export: every stage gathered into one safetensors file that loads into the full model.

The file holds the unsplit model's state dict under global names (`embed.*`, `layers.{i}.*`,
`head.*`); a `<name>.json` beside it holds the ModelConfig. Under CheckFree+ the embedding
and head replicas are bit-identical to their primaries; the primary's copy is written.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from checkfree.config import ModelConfig, RunConfig
from checkfree.model import LlamaModel, plan_stages, stage_to_global

__all__ = ["save_export", "load_export", "merge_stages"]


def merge_stages(cfg: RunConfig, states: dict[int, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Global-name state dict of the whole model from per-stage state dicts."""
    specs = plan_stages(cfg.model.num_layers, cfg.num_stages)
    missing = [s for s in range(cfg.num_stages) if s not in states]
    if missing:
        raise ValueError(f"cannot export: no weights for stages {missing}")
    full: dict[str, torch.Tensor] = {}
    for spec in specs:  # in stage order, so the embedding comes from stage 0 (its primary)
        for key, value in stage_to_global(spec, states[spec.index]).items():
            full.setdefault(key, value.detach().cpu().contiguous())
    head_primary = stage_to_global(specs[-1], states[cfg.num_stages - 1])
    full.update({k: v.detach().cpu().contiguous() for k, v in head_primary.items() if k.startswith("head.")})
    expected = set(LlamaModel(cfg.model).state_dict())
    if set(full) != expected:
        raise ValueError(f"stage weights do not make a whole model: missing {sorted(expected - set(full))[:5]}, "
                         f"extra {sorted(set(full) - expected)[:5]}")
    return full


def save_export(cfg: RunConfig, states: dict[int, dict[str, torch.Tensor]], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(merge_stages(cfg, states), str(path))
    path.with_suffix(".json").write_text(json.dumps(dataclasses.asdict(cfg.model), indent=2))
    return path


def load_export(path: str | Path) -> LlamaModel:
    """The full model from an exported file (and its config JSON beside it)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"export {str(path)!r} does not exist")
    meta = path.with_suffix(".json")
    if not meta.is_file():
        raise ValueError(f"export config {str(meta)!r} is missing (written beside the .safetensors file)")
    model = LlamaModel(ModelConfig(**json.loads(meta.read_text())))
    model.load_state_dict(load_file(str(path)))
    return model
