"""Saved training state in a run directory, for stop and resume.

    <out>/saves/step-00000040/stage-0.bin ... stage-{S-1}.bin, meta.json

A save at step N holds every stage's full state (weights, Adam state, LR scale, gradient norm;
`checkfree.strategies.state`) ready to run step N, serialized by `state_to_bytes`; meta.json is
written last, and the directory is renamed into place from a temporary name, so a save is either
complete or absent. The newest `keep` saves are kept. Written by the simulator and by the
coordinator (from its peers' states); read by `--resume`.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["write_save", "newest_save", "read_save", "SAVES"]

SAVES = "saves"


def _name(step: int) -> str:
    return f"step-{step:08d}"


def write_save(out: str | Path, step: int, blobs: Mapping[int, bytes | bytearray], meta: dict[str, Any],
               keep: int = 2) -> Path:
    """Write the states of every stage at `step` (atomically) and prune older saves beyond `keep`."""
    root = Path(out) / SAVES
    final = root / _name(step)
    tmp = root / f".{_name(step)}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for stage, blob in blobs.items():
        (tmp / f"stage-{stage}.bin").write_bytes(blob)
    (tmp / "meta.json").write_text(json.dumps({**meta, "step": step, "stages": sorted(blobs)}, indent=2))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    for old in _complete(root)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _complete(root: Path) -> list[Path]:
    """Complete saves under `root`, oldest first."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.name.startswith("step-") and (p / "meta.json").exists())


def newest_save(out: str | Path) -> Path | None:
    saves = _complete(Path(out) / SAVES)
    return saves[-1] if saves else None


def read_save(path: str | Path, num_stages: int) -> tuple[dict[str, Any], dict[int, bytes]]:
    """(meta, {stage: state bytes}) of one save; a save of another pipeline width is refused."""
    path = Path(path)
    meta = json.loads((path / "meta.json").read_text())
    if meta.get("stages") != list(range(num_stages)):
        raise ValueError(f"save {path} holds stages {meta.get('stages')}, the run has {num_stages}")
    return meta, {s: (path / f"stage-{s}.bin").read_bytes() for s in range(num_stages)}
