"""A fault schedule as data: the swarm's setup and its faults, each tied to a protocol point, not to a clock.

A `Schedule` is what the deterministic simulation tests generate, shrink, print and replay: `Setup` (strategy,
stages, replicas, pipeline schedule, wire dtype, steps, fallback, soft errors) and a tuple of `Fault`s. A fault
names the iteration it belongs to (every executed step, re-runs after a rollback included: the simulator's
failure clock), a stage and a replica of its group, and where in the protocol it lands (`Kind`). Every field is
a plain value: `to_json` / `from_json` round-trip it exactly, and `describe` prints it as a short trace.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from dataclasses import dataclass, field

__all__ = ["Kind", "Fault", "Setup", "Schedule", "KILLS", "SWARM_STRATEGIES", "AVERAGING", "ROLLBACK"]

AVERAGING = ("checkfree", "checkfree+", "uniform", "copy", "random")
ROLLBACK = ("checkpoint", "gemini", "reft", "baft")
SWARM_STRATEGIES = (*AVERAGING, "redundant", *ROLLBACK, "checkfree+snap", "snap")  # every strategy the swarm runs


class Kind(str, enum.Enum):
    """Where a fault lands. Kills are of the replica `replica` (modulo its group's size) of stage `stage`."""

    KILL_BEFORE_STEP = "kill-before-step"  # SIGKILL as the coordinator sends it RUN_STEP
    KILL_MID_FORWARD = "kill-mid-forward"  # ...at its (mb+1)-th forward pass of the step
    KILL_MID_BACKWARD = "kill-mid-backward"  # ...at its (mb+1)-th backward pass of the step
    KILL_MID_REDUCE = "kill-mid-reduce"  # ...half-way through its group's gradient all-reduce (stage groups)
    KILL_MID_COMMIT = "kill-mid-commit"  # ...as the coordinator sends it COMMIT (the others commit)
    KILL_MID_REBUILD = "kill-mid-rebuild"  # the next peer rebuilding a stage, after `pulls` weight pulls
    KILL_GROUP = "kill-group"  # every replica of the stage, before RUN_STEP
    KILL_ADJACENT = "kill-adjacent"  # every replica of the stage and of the next one, before RUN_STEP
    COORDINATOR_FAILOVER = "coordinator-failover"  # the coordinator SIGKILLed (`where`); a hot standby takes over
    COORDINATOR_RESTART = "coordinator-restart"  # ...and a new coordinator is started with --takeover
    PARTITION = "partition"  # the peer cut off the network for `span` iterations, then healed
    SLOW = "slow"  # every message to or from the peer held back `delay_ms` for `span` iterations
    SIGTERM = "sigterm"  # a preemption notice: the peer leaves gracefully (a handover if a standby is free)
    JOIN = "join"  # a new peer starts as the coordinator sends RUN_STEP (a standby joining mid-step)


KILLS = (Kind.KILL_BEFORE_STEP, Kind.KILL_MID_FORWARD, Kind.KILL_MID_BACKWARD, Kind.KILL_MID_REDUCE,
         Kind.KILL_MID_COMMIT, Kind.KILL_GROUP, Kind.KILL_ADJACENT)


@dataclass(frozen=True)
class Fault:
    """One fault (see `Kind`); fields a kind does not use stay at their defaults."""

    kind: Kind
    iteration: int
    stage: int = 0
    replica: int = 0
    mb: int = 0  # mid-forward / mid-backward: which of the victim's passes of the step
    pulls: int = 1  # mid-rebuild: weight pulls before the death
    span: int = 1  # partition / slow: iterations until healed
    delay_ms: int = 0  # slow: per message
    where: str = "step"  # coordinator faults: "step" (before RUN_STEP) or "commit" (half the stages committed)

    def describe(self) -> str:
        """One trace line, e.g. `it 3 kill-mid-forward stage 1 replica 0 mb 2`."""
        default = Fault(self.kind, self.iteration)
        fields = [f"{f.name} {getattr(self, f.name)}" for f in dataclasses.fields(self)
                  if f.name == "stage" or (f.name not in ("kind", "iteration")
                                           and getattr(self, f.name) != getattr(default, f.name))]
        return " ".join([f"it {self.iteration}", self.kind.value, *fields])


@dataclass(frozen=True)
class Setup:
    """The swarm a schedule runs on (the tiny model)."""

    strategy: str = "checkfree"
    stages: int = 4
    replicas: int = 1  # peers per stage (stage groups: averaging strategies only)
    schedule: str = "gpipe"  # gpipe | 1f1b
    wire_dtype: str = "float32"
    steps: int = 5
    fallback: str = "abort"
    every: int = 2  # snapshot_every / checkpoint_every of the rollback and snapshot strategies
    soft_errors: int = 0  # corrected soft errors injected (guard on) over the run
    # snap: its copies' format, whether the Adam moments travel, the bytes a stage sends per step (0: a delta's),
    # and how a stage whose copy is lost too is rebuilt
    snap_format: str = "int8"
    snap_moments: bool = False
    snap_budget: int = 0
    snap_rebuild: str = "checkfree"

    def describe(self) -> str:
        snap = (f" format={self.snap_format} moments={self.snap_moments} budget={self.snap_budget} "
                f"rebuild={self.snap_rebuild}" if self.strategy == "snap" else "")
        return (f"{self.strategy} S={self.stages} R={self.replicas} {self.schedule} {self.wire_dtype} "
                f"steps={self.steps} fallback={self.fallback} every={self.every} soft_errors={self.soft_errors}"
                + snap)


@dataclass(frozen=True)
class Schedule:
    setup: Setup = field(default_factory=Setup)
    faults: tuple[Fault, ...] = ()

    def to_json(self) -> str:
        return json.dumps({"setup": dataclasses.asdict(self.setup),
                           "faults": [{**dataclasses.asdict(f), "kind": f.kind.value} for f in self.faults]},
                          sort_keys=True)

    @staticmethod
    def from_json(text: str) -> Schedule:
        """Inverse of `to_json`; a bad schedule is a ValueError naming what is wrong."""
        try:
            d = json.loads(text)
            setup = Setup(**d["setup"])
            faults = tuple(Fault(**{**f, "kind": Kind(f["kind"])}) for f in d["faults"])
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"not a dst schedule: {e}") from None
        return Schedule(setup, faults)

    def describe(self) -> str:
        return "\n".join([self.setup.describe(), *(f"  {f.describe()}" for f in self.faults)] or ["  (no faults)"])

    def needs(self, *kinds: Kind) -> bool:
        return any(f.kind in kinds for f in self.faults)
