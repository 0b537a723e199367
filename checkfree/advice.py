"""What the measurements say about a run that starts from a trained model (`--init-from`): its default strategy,
and a one-line warning for a strategy known to damage a trained network, with the measured figure read from the
committed result file of `python -m benchmarks.snapshots --quick` (never typed here).

The figures: SmolLM2-135M in 6 stages fine-tuned 10 steps; each of stages 1-4 fails at step 10 and is rebuilt
by CheckFree or restored from its int8 copy of step 0 (immediate damage: validation loss right after, minus
before); and the loss of the first step with the plain routes and with CheckFree+'s swapped ones.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from checkfree.recovery import RECOVERY_RULES

__all__ = ["PRETRAINED_DEFAULT", "RESULT_FILE", "measured", "default_note", "warnings_for"]

PRETRAINED_DEFAULT = "snap"  # the strategy a run with --init-from gets unless it names one
RESULT_FILE = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "snapshots-quick.json"
SWAPPED = ("checkfree+", "checkfree+snap")  # train half of the microbatches through swapped stages
AVERAGING = tuple(r for r, rule in RECOVERY_RULES.items() if rule.inner in ("average", "uniform", "copy"))


def measured(path: Path = RESULT_FILE) -> dict[str, Any] | None:
    """The quick benchmark's result file, or None where this installation has none (a wheel without the repo)."""
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _damage_range(m: dict[str, Any]) -> str:
    vals = [float(v) for v in m["checkfree_damage"].values()]
    return f"{min(vals):.2f} to {max(vals):.2f} nats"


def default_note(m: dict[str, Any] | None) -> str:
    """The line that says a run with --init-from got the snap strategy by default."""
    why = ""
    if m is not None:
        why = (f" (on SmolLM2 a stage restored from its int8 copy lost at most {m['worst_ratio']:.4f} of what "
               f"CheckFree's rebuild lost, {_damage_range(m)}: {RESULT_FILE.name})")
    return (f"--init-from: strategy {PRETRAINED_DEFAULT} by default, each stage's int8 copy at its neighbour{why}; "
            "--strategy to choose another")


def warnings_for(strategy: str, m: dict[str, Any] | None) -> list[str]:
    """One line for a strategy known to damage a trained model (none for the others)."""
    src = f" ({RESULT_FILE.name})" if m is not None else ""
    if strategy in SWAPPED:
        fig = ""
        if m is not None and "first_step_loss" in m:
            fl = m["first_step_loss"]
            fig = f": on SmolLM2 the first step's loss was {fl['checkfree+']:.2f}, against {fl['checkfree']:.2f} " \
                  f"with the plain routes{src}"
        return [f"warning: {strategy} runs half of the microbatches through swapped stages, which a trained model "
                f"has never seen{fig}; --strategy snap keeps the plain routes"]
    if strategy in AVERAGING:
        fig = f": on SmolLM2 CheckFree's rebuild cost {_damage_range(m)} of validation loss right away{src}" \
            if m is not None else ""
        return [f"warning: {strategy} rebuilds a lost stage from its neighbours' weights, far from a trained "
                f"stage's own{fig}; --strategy snap restores it from its own copy"]
    return []
