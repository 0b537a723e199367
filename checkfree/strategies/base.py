"""The strategy interface: decisions as data (checkfree.plans), the same for the simulator and the swarm.

A strategy decides and never moves anything itself:

* ``recovery_plan(failure)``: where every stage that changes after a failure gets its state (a
  `checkfree.plans.RecoveryPlan`), given the copies left (`failure.copies`);
* ``protection_due(step)``: after `step` is committed, the protection work due now (snapshots,
  checkpoints, backups, replicas: `checkfree.plans.Protect` items);
* ``interrupted()``: a failure happened; protection in flight is void.

Two executors carry the decisions out: the simulator's (checkfree.strategies.execute), which prices them with the
cost model through the ``*_figures`` / ``refill_bytes`` hooks here, in the cost model's currency (`Figures`), and
the coordinator's (coordinator/recovery_driver.py, coordinator/protection.py), which measures what they cost. Everything an
executor reads from a strategy is declared on `Strategy`, with the default of a strategy that has none of it; an
executor never writes a strategy's fields: it reports what happened through the report methods
(`interrupted`, `backup_taken`, `copy_part_done`, ...), and the strategy updates its own state.

The state at step 0 is a pure function of the seed, so every strategy can always roll back to it without having
stored anything (`checkfree.plans.Init`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from torch import Tensor

from checkfree.config import RunConfig
from checkfree.costmodel import CostModel
from checkfree.plans import BackupPart, Checkpoint, CopyPart, Failure, Protect, RecoveryPlan, StreamStep
from checkfree.recovery import StateDict
from checkfree.snapcodec import CopyFormat
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
    """How the simulator handled a failure: `rollback_to` is the step every stage now resumes from (None: training
    continues with the failed step). `fallback` names the declared fallback when some stage could not be
    recovered by the strategy itself (success is then False)."""

    figures: Figures = field(default_factory=Figures)
    rollback_to: int | None = None
    success: bool = True
    fallback: str | None = None
    method: str = ""

    def fields(self) -> dict[str, Any]:
        return {"method": self.method, "success": self.success, "fallback": self.fallback,
                "rollback_to": self.rollback_to, **self.figures.as_dict()}


class StrategyContext(Protocol):
    """The simulator's stage workers, as its executor of plans moves state between them (copies throughout)."""

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
    """Base class and contract of every strategy: no protection. A subclass sets the class attributes and decides
    recoveries (`recovery_plan`); it overrides a method below only where it has the thing the method is about.

    The executors read only what is declared here: the class attributes, `cfg`, `checkpoint_every`, `every`, and
    the methods, in four groups: decisions (`recovery_plan`, `protection_*`, `in_step`, `holder`), reports from
    the runtime (`interrupted`, `backup_taken`, `copy_*`), sizes (`held_bytes`, `backup_memory`) and the
    simulator's prices (`step_figures`, `refill_bytes`). A method about a kind of copy the strategy never asks for
    (a streamed copy, a backup, a copy at one holder) raises NotImplementedError: an executor calls it only when
    the strategy's own plans or protection name such a copy."""

    name: str = ""
    plus: bool = False  # trains with CheckFree+ routes and embedding / head replicas
    fails_edges: bool = True  # the failure model may fail the first / last stage by default
    lossless: bool = False  # recovery reproduces the failure-free run exactly
    # the one peer service the swarm runs for this strategy beyond the common ones (None: none): "replicas"
    # (each peer keeps its successor's replica, peers/replicas.py) or "companion" (a process keeps each peer's
    # snapshot, peers/companion.py)
    peer_service: str | None = None
    restores_in_parallel: bool = False  # the simulator's price: copies and rebuilds travel at once (else in turn)
    # streamed compressed copies (snap): their format (None: the strategy streams none); the runtimes encode, send,
    # hold and restore them (checkfree.snapcodec), and report each part that arrived (`copy_part_done`)
    copy_format: CopyFormat | None = None
    # in-memory snapshot rounds the peers replace only once the coordinator names the new round complete
    # (RUN_STEP's `snapshot_step`): until then they keep the last complete one, which a rollback restores (reft)
    names_complete_rounds: bool = False

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        # the steps between persistent checkpoints: the strategy's own, or its storage fallback's (None: none)
        self.checkpoint_every: int | None = None
        # the steps between in-memory copies (`strategy.snapshot_every`); the simulator prices a copy as sent in the
        # links' idle time of that many steps (a strategy that keeps none never has one priced)
        self.every: int = cfg.strategy.snapshot_every

    # ---- decisions (both runtimes) --------------------------------------------------------
    def recovery_plan(self, failure: Failure) -> RecoveryPlan:
        """Where every stage that changes after `failure` gets its state, given the copies left."""
        raise NotImplementedError

    def protection_at_start(self) -> list[Protect]:
        """The protection a run starts with, before its first step (redundant computation: the replicas)."""
        return []

    def protection_due(self, step: int) -> list[Protect]:
        """After committing `step`: the protection work due now (this base: the checkpoint, if one is due)."""
        every = self.checkpoint_every
        return [Checkpoint(step + 1)] if every is not None and (step + 1) % every == 0 else []

    def protection_after_handover(self, stages: tuple[int, ...]) -> list[Protect]:
        """The peers of `stages` handed their exact state over to new peers and left: the protection those must take
        (the copies the leaving peers held for others left with them)."""
        return []

    def in_step(self, step: int) -> BackupPart | StreamStep | None:
        """Protection that travels inside step `step` itself (BAFT: a part of the backup, in the bubbles; snap: the
        parts of its streamed copies). Asked once per attempt of the step: the same answer each time."""
        return None

    def holder(self, stage: int) -> int:
        """The stage whose peer holds `stage`'s copy (the strategies that keep one copy per stage at one holder:
        BAFT's backups, snap's streamed copies, checkfree+snap's snapshots, redundant computation's replicas)."""
        raise NotImplementedError(f"{self.name} keeps no copy at one holder")

    # ---- reports from the runtime: the strategy updates its own state ----------------------
    def interrupted(self) -> None:
        """A failure: protection in flight is void (BAFT's backup being sent)."""

    def backup_taken(self, units: dict[int, list[int]]) -> None:
        """Every stage took the backup a `BackupStart` asked for; `units[stage]`: its bytes by transfer unit, in the
        stage's order (embedding, each block, head: weights with their Adam state), as the runtime measured them."""
        raise NotImplementedError(f"{self.name} takes no backups")

    def copy_part_done(self, part: CopyPart) -> bool:
        """A streamed copy's part (`StreamSent`) arrived at its holder in a committed step; whether it completed
        its update (the runtime then records the copy of `part.step` as complete at `part.holder`)."""
        raise NotImplementedError(f"{self.name} streams no copies")

    def copy_assumed(self, stage: int, step: int) -> None:
        """Experiments: `stage`'s copy as of `step` is complete at its holder and mirrored by its owner."""
        raise NotImplementedError(f"{self.name} streams no copies")

    def copy_stream_broken(self, stage: int) -> None:
        """A part of `stage`'s streamed copy did not arrive: its update is void."""
        raise NotImplementedError(f"{self.name} streams no copies")

    # ---- sizes (both runtimes charge them as memory) ----------------------------------------
    def held_bytes(self, holder: int) -> int:
        """Streamed copies: the most the peer of stage `holder` keeps of others' copies (bytes)."""
        return 0

    def backup_memory(self, sizes: dict[int, int]) -> int:
        """Backups: the most one peer holds for them (bytes), given each stage's backup size `sizes[stage]`."""
        raise NotImplementedError(f"{self.name} takes no backups")

    # ---- the simulator's prices (cost-model figures) ---------------------------------------
    def step_figures(self, ctx: StrategyContext, step: int) -> Figures:
        """What training `step` itself cost beyond the plain pipeline (CheckFree+'s replica exchange, BAFT's
        bubbles, redundant forwards): priced before the step's protection."""
        return Figures()

    def refill_bytes(self, plan: RecoveryPlan, sizes: dict[int, int]) -> int:
        """Bytes the protection due after `plan` (its `then`) moves, given each stage's copy size."""
        return 0
