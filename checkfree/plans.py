"""Recovery and protection as data: a strategy decides, each runtime carries the decision out.

A failure: at the start of `step` the stages in `failed` lost their peers. A strategy's `recovery_plan(failure)`
says, as a `RecoveryPlan`, where each stage that changes gets its state from:

    Own          a live stage keeps its state; with a rollback it loads its own copy of the target step
    Neighbours   rebuilt from live stages' weights (checkfree.recovery: CheckFree's average, a copy, ...)
    Holder       the copy (snapshot, backup) the peer of another stage keeps in memory
    Storage      the checkpoint files of a step
    Parity       decoded from its parity group's snapshots and parity blocks (reft)
    Replica      the current replica its ring predecessor's peer keeps (redundant computation)
    Init         its initial state (step 0)

with, for a rollback, the step every stage resumes from. Stages the strategy could not recover itself get the
declared fallback (`Fallback`): the checkpoint in storage, a rebuild (random, copy), or abort.

After a committed step a strategy's `protection_due(step)` says what protection work is due (`Protect`: a
snapshot, a checkpoint, a backup started or sealed, replicas taken, the parts of streamed copies that step
carried). Before a step, `in_step(step)` says what protection travels inside it (BAFT's backup part, the parts
of the `snap` strategy's streamed copies: `StreamStep`). The simulator carries plans and protection
out on its stage workers (checkfree.strategies.execute); the coordinator by telling peers where to pull from
(coordinator/recovery_driver.py, coordinator/protection.py). Both record what copies exist in a `Copies` ledger, by stage
index, and write the events `plan_events` gives.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from checkfree.recovery import Neighbours, UnrecoverableFailure, plan_recovery

__all__ = ["Own", "Neighbours", "Holder", "Storage", "Parity", "Replica", "Init", "Source", "Fallback",
           "RecoveryPlan", "Failure", "Copies", "Snapshot", "ParitySnapshot", "Checkpoint", "BackupStart",
           "BackupPart", "BackupSeal", "RefreshReplicas", "TakeReplicas", "CopyPart", "StreamStep", "StreamSent",
           "Protect", "rollback_plan",
           "fallback_rebuilds", "plan_events", "rebuild_fields", "abort_if_unrecoverable"]


@dataclass(frozen=True)
class Own:
    """A live stage keeps its state; with a rollback, it loads its own in-memory copy of the target step."""


@dataclass(frozen=True)
class Holder:
    """The copy of the stage as of `step` that stage `holder`'s peer keeps in memory; `edges`: replicated
    components (CheckFree+'s embedding / head) taken instead from these live co-holders, by component; `form`: a
    compressed copy's format (checkfree.snapcodec; "": the full state)."""

    holder: int
    step: int
    edges: dict[str, int] = field(default_factory=dict)
    form: str = ""


@dataclass(frozen=True)
class Storage:
    """The stage's file of the checkpoint of `step` (checkfree.strategies.storage)."""

    step: int


@dataclass(frozen=True)
class Parity:
    """Decoded bit for bit from the snapshots and parity blocks of `step` of the other members of `group`."""

    group: tuple[int, ...]
    step: int


@dataclass(frozen=True)
class Replica:
    """The current replica (weights and Adam state) that stage `holder`'s peer keeps of this stage."""

    holder: int


@dataclass(frozen=True)
class Init:
    """The stage's initial state, a pure function of the seed (step 0)."""


Source = Own | Neighbours | Holder | Storage | Parity | Replica | Init


@dataclass(frozen=True)
class Fallback:
    """The declared fallback for the stages the strategy could not recover itself: `name` is "checkpoint" (every
    stage rolls back to storage), "random", "copy" or "identity" (a rebuild, in the plan's `Neighbours`), a
    strategy's own configured rebuild (snap's: a recovery rule, e.g. "checkfree", also in `Neighbours`) or
    "abort"; `reasons` says why, by stage."""

    name: str
    reasons: dict[int, str]

    @property
    def stages(self) -> list[int]:
        return sorted(self.reasons)

    @property
    def reason(self) -> str:
        return ", ".join(dict.fromkeys(self.reasons.values()))


@dataclass(frozen=True)
class Snapshot:
    """Every stage's full state as of `step`, kept in memory by the peers of the stages `holders[stage]` names
    (its own among them or not)."""

    step: int
    holders: dict[int, tuple[int, ...]]


@dataclass(frozen=True)
class ParitySnapshot:
    """Every stage keeps its own full state as of `step`; each member of a parity group holds one XOR parity block
    over the group's states (reft)."""

    step: int
    parity_groups: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class Checkpoint:
    """Every stage's full state as of `step` written to storage; complete once every file is (then sealed)."""

    step: int


@dataclass(frozen=True)
class BackupStart:
    """Every stage takes its backup as of `step`; its parts travel to the holders in the next steps' bubbles."""

    step: int


@dataclass(frozen=True)
class BackupPart:
    """Part `part` of the backup as of `step` travels inside a step, in its bubbles: each stage sends the share
    `bounds[stage]` ([lo, hi) of its bytes) to the peer of stage `holders[stage]`."""

    step: int
    part: int
    bounds: dict[int, tuple[float, float]]
    holders: dict[int, int]


@dataclass(frozen=True)
class BackupSeal:
    """The backup as of `step` has travelled: it counts where every part arrived (owner and holder alike)."""

    step: int
    holders: dict[int, tuple[int, ...]]


@dataclass(frozen=True)
class RefreshReplicas:
    """Every replica takes the step just committed (the swarm does it in the COMMIT: peers/replicas.py)."""


@dataclass(frozen=True)
class TakeReplicas:
    """Each of `stages` takes (or refreshes) a replica of its ring successor."""

    stages: tuple[int, ...]


@dataclass(frozen=True)
class CopyPart:
    """Stage `stage` sends part `part` (of `parts`) of the update of its copy as of `step` to the peer of stage
    `holder`, inside a step: `kind` "full", or "delta" on the holder's copy of step `base`
    (checkfree.snapcodec). Part 0 is encoded first, from the stage's state as it enters the step (before the
    step's own commit changes it); part p is the bytes [p/parts, (p+1)/parts) of the encoded update."""

    stage: int
    holder: int
    step: int
    kind: str
    base: int | None
    part: int
    parts: int

    @property
    def last(self) -> bool:
        return self.part == self.parts - 1


@dataclass(frozen=True)
class StreamStep:
    """The parts of streamed copies that step `step` carries, by sending stage (the `snap` strategy)."""

    step: int
    parts: dict[int, CopyPart]


@dataclass(frozen=True)
class StreamSent:
    """After committing `step`: its parts travelled (the runtime checks each arrived, then tells the strategy:
    `copy_part_done` / `copy_stream_broken`); an update whose last part it was is complete at its holder."""

    step: int
    parts: dict[int, CopyPart]


Protect = (Snapshot | ParitySnapshot | Checkpoint | BackupStart | BackupSeal | RefreshReplicas | TakeReplicas
           | StreamSent)


@dataclass
class Copies:
    """The protection that exists now, by stage index, as both runtimes record it: the in-memory copies of one step
    (`step`, 0: none yet) and the stages whose peers hold each (`held`), and the newest complete checkpoint in
    storage (`storage_step`, 0: none). Streamed copies (`snap`) complete one stage at a time: each stage's step
    is in `steps` (a copy as of step 0 counts)."""

    step: int = 0
    held: dict[int, frozenset[int]] = field(default_factory=dict)
    storage_step: int = 0
    steps: dict[int, int] = field(default_factory=dict)

    def taken(self, step: int, holders: Mapping[int, Iterable[int]]) -> None:
        """Complete in-memory copies of every stage as of `step`, held by the peers of `holders[stage]`."""
        self.step, self.held = step, {s: frozenset(hs) for s, hs in holders.items()}

    def sealed(self, stage: int, step: int, holders: Iterable[int]) -> None:
        """A streamed copy of `stage` as of `step` is complete at the peers of `holders`."""
        self.steps = {**self.steps, stage: step}
        self.held = {**self.held, stage: frozenset(holders)}

    def copy_step(self, stage: int) -> int:
        """The step of `stage`'s in-memory copy."""
        return self.steps.get(stage, self.step)

    def checkpointed(self, step: int) -> None:
        """Every stage's checkpoint of `step` is complete in storage."""
        self.storage_step = step

    def lose(self, failed: Iterable[int]) -> None:
        """The peers of `failed` are gone, and the copies they held with them."""
        gone = set(failed)
        self.held = {s: hs - gone for s, hs in self.held.items() if hs - gone}
        self.steps = {s: st for s, st in self.steps.items() if s in self.held}

    def recovered(self, plan: RecoveryPlan) -> None:
        """After `plan` was carried out: a stage decoded from parity holds its snapshot and parity block again."""
        for s, src in plan.sources.items():
            if isinstance(src, Parity):
                self.held[s] = frozenset({s})

    def holders(self, stage: int) -> list[int]:
        """The stages whose (live) peers hold `stage`'s copy of `step`, in order."""
        return sorted(self.held.get(stage, ())) if self.step or stage in self.steps else []


@dataclass(frozen=True)
class Failure:
    """At the start of `step` the stages in `failed` lost their peers; `copies` is what protection is left (the
    failed peers' copies already gone)."""

    step: int
    failed: frozenset[int]
    copies: Copies


@dataclass(frozen=True)
class RecoveryPlan:
    """What a strategy decided for one failure: where each stage that changes gets its state (`sources`: every
    failed stage, and with a rollback every stage), the step every stage resumes from (`rollback_to`; None: the
    failed step runs next), and the fallback for what the strategy could not recover itself. Copies are loaded
    first, then the `Neighbours` rebuilt (from live stages, rolled back already). `then`: protection due once it is
    done (copies the lost peers held, refilled; replicas the new peers take)."""

    step: int
    failed: frozenset[int]
    sources: dict[int, Source]
    rollback_to: int | None = None
    fallback: Fallback | None = None
    then: tuple[Protect, ...] = ()

    @property
    def copied(self) -> dict[int, Source]:
        """The stages that load a copy (or their initial state), before any rebuild."""
        return {s: src for s, src in sorted(self.sources.items()) if not isinstance(src, Neighbours)}

    @property
    def rebuilt(self) -> dict[int, Neighbours]:
        """The stages rebuilt from their neighbours, once the copies are loaded."""
        return {s: src for s, src in sorted(self.sources.items()) if isinstance(src, Neighbours)}


def fallback_rebuilds(lost: set[int], num_stages: int, fallback: str, reasons: dict[int, str]
                      ) -> tuple[dict[int, Neighbours], Fallback]:
    """The declared fallback `fallback` (random | copy | abort) for `lost`, every other stage live: the rebuilds
    (none for abort) and the Fallback."""
    if fallback == "abort":
        return {}, Fallback("abort", reasons)
    rebuilds = plan_recovery(set(lost), num_stages, fallback, fallback=fallback)
    return {p.stage: p for p in rebuilds}, Fallback(fallback, reasons)


def rollback_plan(failure: Failure, copy_of: dict[int, Source], reasons: dict[int, str], *, own: Source,
                  storage: bool, fallback: str, num_stages: int) -> RecoveryPlan:
    """A rollback strategy's plan: every stage rolls back to the in-memory copies of `failure.copies.step` (a live
    stage from `own`, a failed one from `copy_of[stage]`), or to the initial state when there are none yet. The
    failed stages with no copy left (`reasons`: why, by stage) roll everything back to storage when `storage`,
    else get the declared `fallback` after the others rolled back."""
    step, failed, copies = failure.step, failure.failed, failure.copies
    n = num_stages
    if not copies.step:  # nothing in memory yet: back to the initial state
        return RecoveryPlan(step, failed, {s: Init() for s in range(n)}, rollback_to=0)
    if reasons and storage:
        target = copies.storage_step
        sources: dict[int, Source] = {s: Storage(target) if target else Init() for s in range(n)}
        return RecoveryPlan(step, failed, sources, rollback_to=target, fallback=Fallback("checkpoint", reasons))
    sources = {s: copy_of[s] if s in failed else own for s in range(n) if s not in reasons}
    rebuilds, fb = fallback_rebuilds(set(reasons), n, fallback, reasons) if reasons else ({}, None)
    return RecoveryPlan(step, failed, {**sources, **rebuilds}, rollback_to=copies.step, fallback=fb)


def abort_if_unrecoverable(plan: RecoveryPlan, strategy: str, event) -> None:
    """A plan whose fallback is abort: its one event, then UnrecoverableFailure (both runtimes, at the same point)."""
    fb = plan.fallback
    if fb is None or fb.name != "abort":
        return
    event("fallback", step=plan.step, stage=fb.stages[0], strategy=strategy, fallback="abort", reason=fb.reason)
    raise UnrecoverableFailure(f"{strategy} cannot recover stage(s) {fb.stages}: {fb.reason} (fallback=abort)")


def rebuild_fields(plan: Neighbours, coeffs: dict[int, float], omega_scope: str) -> dict[str, Any]:
    """The events.jsonl fields of a stage rebuilt from its neighbours."""
    return {"method": plan.method, "sources": list(plan.sources), "omega_scope": omega_scope,
            "coefficients": [coeffs[s] for s in plan.sources] if coeffs else [],
            "edge_sources": plan.edge_sources, "edges_reinit": list(plan.edges_reinit)}


def _copy_fields(plan: RecoveryPlan, src: Source) -> dict[str, Any]:
    """The events.jsonl fields of a failed stage that loaded a copy (or its initial state)."""
    step = plan.step
    if isinstance(src, Replica):
        return {"method": "promote-replica", "source": src.holder, "lost_steps": 0}
    if isinstance(src, Holder) and plan.rollback_to is None:  # restored alone, nobody rolls back
        return {"method": "snapshot", "source": src.holder, "snapshot_step": src.step, "staleness": step - src.step,
                "lost_steps": 0, "edge_sources": dict(src.edges), **({"copy_format": src.form} if src.form else {})}
    assert plan.rollback_to is not None, plan  # any other copy is loaded by a rollback
    source = src.holder if isinstance(src, Holder) else \
        {Storage: "storage", Parity: "parity", Init: "init", Own: "own"}[type(src)]
    return {"method": "rollback", "source": source, "rollback_to": plan.rollback_to,
            "lost_steps": step - plan.rollback_to}


def plan_events(plan: RecoveryPlan, strategy: str, omega_scope: str,
                coefficients: dict[int, dict[int, float]]) -> list[tuple[str, dict[str, Any]]]:
    """The events a carried-out plan writes, in the order it was carried out, as (name, fields): a storage
    fallback's one event, then a "recovery" line per failed stage that loaded a copy, then per rebuilt stage a
    "recovery" (or, for the declared fallback, a "fallback") line. `coefficients`: by rebuilt stage, the
    coefficient each source got. Each runtime adds its own fields (peer ids, timings, bytes)."""
    out: list[tuple[str, dict[str, Any]]] = []
    fb = plan.fallback
    base = {"step": plan.step, "strategy": strategy}
    if fb is not None and fb.name == "checkpoint":
        out.append(("fallback", {**base, "stage": fb.stages[0], "fallback": "checkpoint", "reason": fb.reason}))
    for s, src in plan.copied.items():
        if s in plan.failed:
            out.append(("recovery", {**base, "stage": s, **_copy_fields(plan, src)}))
    for s, src in plan.rebuilt.items():
        fields = rebuild_fields(src, coefficients.get(s, {}), omega_scope)
        if fb is not None and s in fb.reasons:
            out.append(("fallback", {**base, "stage": s, "fallback": fb.name, "reason": fb.reasons[s], **fields}))
        else:
            out.append(("recovery", {**base, "stage": s, **fields}))
    return out
