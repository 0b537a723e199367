"""The strategy interface: hooks at step boundaries that return comparable figures.

A strategy sees the run only through a `StrategyContext` (the simulator implements it over
in-process workers; the distributed coordinator can implement it over RPCs), and reports
what its work costs as `Figures` in the cost model's currency:

* ``after_step(ctx, step)``: after every stage's optimizer step of `step` (take snapshots,
  refresh replicas, write checkpoints);
* ``on_failure(ctx, step, failed)``: at the start of `step`, the stages in `failed` lost
  their peers; recover them in place, or roll every stage back to an earlier step, or apply
  the declared fallback (``recovery.fallback``; ``abort`` raises UnrecoverableFailure).

The state at step 0 is a pure function of the seed, so every strategy can always roll back
to it without having stored anything (``ctx.reset``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from torch import Tensor

from checkfree.config import RunConfig
from checkfree.costmodel import CostModel
from checkfree.recovery import StateDict
from checkfree.strategies.state import StageState

__all__ = ["Figures", "FailureOutcome", "StrategyContext", "Strategy"]


@dataclass
class Figures:
    """What fault tolerance cost in one step or one failure (simulated seconds, bytes)."""

    stall_s: float = 0.0  # seconds the step was held up by the strategy (extra compute included)
    bytes_moved: int = 0  # bytes sent between peers or to / from storage
    extra_memory_bytes: int = 0  # the most any one peer holds for fault tolerance (a level, not a flow)
    lost_steps: int = 0  # steps rolled back that must be recomputed
    recovery_s: float = 0.0  # detection + transfers until training resumes

    def __add__(self, other: Figures) -> Figures:
        return Figures(self.stall_s + other.stall_s, self.bytes_moved + other.bytes_moved,
                       max(self.extra_memory_bytes, other.extra_memory_bytes),
                       self.lost_steps + other.lost_steps, self.recovery_s + other.recovery_s)

    def as_dict(self) -> dict[str, float]:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in asdict(self).items()}


@dataclass
class FailureOutcome:
    """How a failure was handled: `rollback_to` is the step every stage now resumes from
    (None: training continues with the failed step). `fallback` names the declared fallback
    when some stage could not be recovered by the strategy itself (success is then False)."""

    figures: Figures = field(default_factory=Figures)
    rollback_to: int | None = None
    success: bool = True
    fallback: str | None = None
    method: str = ""

    def fields(self) -> dict[str, Any]:
        return {"method": self.method, "success": self.success, "fallback": self.fallback,
                "rollback_to": self.rollback_to, **self.figures.as_dict()}


class StrategyContext(Protocol):
    """What a strategy may do to the run. Stage states are copies (see strategies.state)."""

    cfg: RunConfig
    cost: CostModel
    storage_dir: Path  # where persistent checkpoints go

    @property
    def num_stages(self) -> int: ...

    def event(self, name: str, **fields: Any) -> None:
        """One line in events.jsonl ("recovery" / "fallback" lines are counted in the summary)."""

    def capture(self, stage: int, step: int) -> StageState:
        """A copy of the stage's full state; `step` is the next step it will run."""

    def restore(self, stage: int, state: StageState, *, replace: bool) -> None:
        """Load a full state; `replace`: on a new peer (the old one is gone)."""

    def weights(self, stage: int) -> StateDict:
        """The stage's current weights (read only)."""

    def norm(self, stage: int) -> float:
        """The stage's last gradient norm (omega)."""

    def optimizer_state(self, stage: int, comp: str) -> dict[str, dict[str, Tensor]]:
        """A copy of the stage's Adam state of component `comp` ("embed" / "head"), by name."""

    def template(self, stage: int) -> StateDict:
        """A new peer's freshly initialised state dict for `stage` (keys and shapes)."""

    def load_recovered(self, stage: int, state: StateDict, lr_scale: float,
                       optim: dict[str, dict[str, Tensor]] | None = None) -> None:
        """Put rebuilt weights on the new peer of `stage`, with a fresh optimizer holding
        only `optim` (replicated components' Adam state)."""

    def reset(self, stage: int) -> None:
        """Put `stage` back at its initial state (step 0), on a new peer."""


class Strategy:
    """Base class: no protection, no recovery. Subclasses set the class attributes."""

    name: str = ""
    plus: bool = False  # trains with CheckFree+ routes and embedding / head replicas
    fails_edges: bool = True  # the failure model may fail the first / last stage by default
    lossless: bool = False  # recovery reproduces the failure-free run exactly

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg

    swarm_rollback: bool = False  # the distributed runtime runs it as a rollback strategy (checkpoint, gemini, ...)
    snapshots_in_memory: bool = False  # keeps snapshots of every stage in peers' memory (gemini, baft, reft)
    swarm_replicas: bool = False  # the swarm keeps each stage's replica on its predecessor (redundant)
    restores_alone: bool = False  # the swarm restores a lone lost stage from a snapshot, no rollback (checkfree+snap)
    snapshot_companion: bool = False  # the swarm keeps each peer's snapshot in a companion process too (reft)

    def after_step(self, ctx: StrategyContext, step: int) -> Figures:
        return Figures()

    def snapshot_due(self, next_step: int) -> bool:
        """Take the in-memory snapshot of every stage before `next_step` (simulator and swarm alike)."""
        return False

    def checkpoint_due(self, next_step: int) -> bool:
        """Write the persistent checkpoint of every stage before `next_step`: the strategy's own, or its storage
        fallback's (`strategy.storage_fallback`)."""
        storage = getattr(self, "storage", None)
        return storage is not None and next_step % storage.every == 0

    def on_failure(self, ctx: StrategyContext, step: int, failed: set[int]) -> FailureOutcome:
        raise NotImplementedError

    def _event(self, ctx: StrategyContext, name: str, step: int, stage: int, **fields: Any) -> None:
        ctx.event(name, step=step, stage=stage, strategy=self.name, **fields)
