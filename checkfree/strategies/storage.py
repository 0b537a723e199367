"""Persistent checkpoints of the rollback strategies: one file layout for the simulator and the swarm.

    <storage>/step-<N>.tmp/stage-<i>.bin   while checkpoint N is being written (each stage's file by whoever
                                           holds the stage: the simulator, or that stage's peer)
    <storage>/step-<N>/stage-<i>.bin       once every stage's file is there (`seal` renames the directory and
                                           deletes the previous complete checkpoint)

N (8 digits) is the step training resumes from; a file holds `checkfree.serialize` bytes of a
`checkfree.strategies.state` dict (weights, Adam state, LR scale, RNG, omega). A directory without the
`.tmp` suffix is complete: a checkpoint interrupted half-way is never read.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

__all__ = ["stage_path", "write_stage", "seal", "read_stage", "complete_steps"]


def _dir(root: str | Path, step: int, partial: bool) -> Path:
    return Path(root) / f"step-{step:08d}{'.tmp' if partial else ''}"


def stage_path(root: str | Path, step: int, stage: int, *, partial: bool = False) -> Path:
    return _dir(root, step, partial) / f"stage-{stage}.bin"


def write_stage(root: str | Path, step: int, stage: int, blob: bytes | bytearray) -> int:
    """Write one stage's file of checkpoint `step` (not yet complete); returns its size."""
    path = stage_path(root, step, stage, partial=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}")
    tmp.write_bytes(blob)
    os.replace(tmp, path)
    return len(blob)


def seal(root: str | Path, step: int, num_stages: int) -> Path:
    """Mark checkpoint `step` complete once all `num_stages` files are written; older ones are deleted."""
    partial, final = _dir(root, step, True), _dir(root, step, False)
    missing = [s for s in range(num_stages) if not stage_path(root, step, s, partial=True).is_file()]
    if missing:
        raise FileNotFoundError(f"checkpoint {step} in {root} lacks the files of stage(s) {missing}")
    shutil.rmtree(final, ignore_errors=True)
    partial.rename(final)
    for older in complete_steps(root):
        if older != step:
            shutil.rmtree(_dir(root, older, False), ignore_errors=True)
    return final


def read_stage(root: str | Path, step: int, stage: int) -> bytearray:
    """One stage's file, read into a writable buffer (its state loads from it without another copy)."""
    path = stage_path(root, step, stage)
    with open(path, "rb") as f:
        blob = bytearray(os.fstat(f.fileno()).st_size)
        if f.readinto(blob) != len(blob):
            raise OSError(f"{path} changed size while it was read")
    return blob


def complete_steps(root: str | Path) -> list[int]:
    """Steps of the complete checkpoints in `root`, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(int(p.name[5:]) for p in root.glob("step-*") if p.is_dir() and p.name[5:].isdigit())
