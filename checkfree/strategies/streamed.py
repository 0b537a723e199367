"""snap: each stage's compressed copy at its neighbour, streamed in small parts inside the steps.

Every stage keeps a copy of its state at the peer of the next stage (the last stage's at stage 0's: a ring, so
every peer holds one copy), in the format `strategy.snapshot_format` (checkfree.snapcodec: int8, int4, bf16 or
float32; the Adam moments too with `strategy.snapshot_moments`). A copy is refreshed every
`strategy.snapshot_every` steps by an update: the first one full, the later ones (int8, int4) the difference on
the holder's grid, computed against the owner's mirror of the holder's copy (error feedback). An update is
encoded from the stage's state as it enters a step, and travels in parts of at most `strategy.snapshot_budget`
bytes (0: a delta's bytes, so that a delta travels in one step and the first whole copy in two or three), one
part inside each step, sent while the step
computes (`StreamStep`, from `in_step`); it is complete at the holder once the step carrying its last part is
committed (`StreamSent`). No step waits for a copy to be taken or to travel.

On a failure a lost stage whose holder lives is restored alone from the newest complete copy at its holder (its
step in the recovery event), and nobody rolls back. A stage whose holder was lost too (or that has no complete
copy yet) is rebuilt by `strategy.snapshot_rebuild` (a plain recovery rule: checkfree, identity, ...), the
plan's fallback; where that rule cannot rebuild it (an edge stage under checkfree), `recovery.fallback` applies.
The copies the lost peers held are gone, and updates in flight to or from them with them. A holder that lost its
copy gets a full one at once, and so does a stage whose owner cannot mirror its holder's copy (a rebuilt stage;
a restored one mirrors the copy it was restored from). The strategy trains the plain pipeline (no CheckFree+
routes).

The strategy keeps each stage's stream (`Stream`); the runtimes report back which parts arrived
(`copy_part_done`) or that a stream broke (`copy_stream_broken`), and record complete copies in their `Copies`
ledger (`Copies.sealed`), from which plans restore.
"""

from __future__ import annotations

from dataclasses import dataclass

from checkfree.config import RunConfig
from checkfree.plans import (CopyPart, Failure, Fallback, Holder, Protect, RecoveryPlan, Source, StreamSent,
                             StreamStep)
from checkfree.recovery import get_rule
from checkfree.snapcodec import CopyFormat, full_precision_nbytes, held_nbytes, stage_shapes, update_nbytes
from checkfree.strategies.averaging import average_plan
from checkfree.strategies.base import Strategy

__all__ = ["StreamedSnapshotStrategy", "Stream", "Update"]


@dataclass
class Update:
    """An update of a stage's copy in flight: as of `step`, `kind` full or delta (on the copy of `base`), in
    `parts` parts, `sent` of them in committed steps."""

    step: int
    kind: str
    base: int | None
    parts: int
    sent: int = 0


@dataclass
class Stream:
    """One stage's copy at its holder, as the strategy tracks it: the step of the complete copy there (None:
    none), whether the owner mirrors it (a delta can be sent), and the update in flight."""

    complete: int | None = None
    mirrored: bool = False
    update: Update | None = None


class StreamedSnapshotStrategy(Strategy):
    name = "snap"
    fails_edges = True  # a copy restores an edge stage as well as any other

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__(cfg)
        st = cfg.strategy
        self.every = st.snapshot_every
        self.fmt = CopyFormat(st.snapshot_format, st.snapshot_group, st.snapshot_moments)
        self.copy_format = self.fmt  # (the base class's, read by the peers)
        rule = get_rule(st.snapshot_rebuild)
        if rule.plus:
            raise ValueError(f"snap trains the plain pipeline: --snapshot-rebuild must be a plain rule "
                             f"(checkfree, uniform, copy, random, identity), not {rule.name}")
        self.rebuild = rule.name
        n = cfg.num_stages
        self.shapes = {s: stage_shapes(cfg, s) for s in range(n)}
        self.sizes = {s: {k: update_nbytes(self.shapes[s], self.fmt, k) for k in ("full", "delta")}
                      for s in range(n)}
        # default: a delta's bytes per step (a delta in one step, the first whole copy in two or three)
        self.budget = {s: st.snapshot_budget or self.sizes[s]["delta"] for s in range(n)}
        self.streams = {s: Stream() for s in range(n)}

    # ---- placement and sizes ---------------------------------------------------------------
    def holder(self, stage: int) -> int:
        """The stage whose peer holds `stage`'s copy: the next one (the last stage's: stage 0's)."""
        return (stage + 1) % self.cfg.num_stages

    def parts(self, stage: int, kind: str) -> int:
        return max(1, -(-self.sizes[stage][kind] // self.budget[stage]))

    def held_bytes(self, holder: int) -> int:
        """The most a holder's peer keeps for copies: the copy it holds and an update of it being received."""
        owners = [s for s in self.streams if self.holder(s) == holder]
        return sum(held_nbytes(self.shapes[s], self.fmt) + self.sizes[s]["full"] for s in owners)

    def full_precision_bytes(self, stage: int) -> int:
        """What the full-precision snapshot of the stage (weights and Adam moments in float32) weighs."""
        return full_precision_nbytes(self.shapes[stage])

    # ---- the streams (both runtimes) ----------------------------------------------------------
    def in_step(self, step: int) -> StreamStep:
        """The parts step `step` carries: an update begins (part 0) where none is in flight and one is due (every
        `every` steps, or at once when the holder has no copy the owner mirrors); every update in flight sends its
        next part. The same answer for every attempt of the step."""
        parts = {}
        for s, stream in self.streams.items():
            if stream.update is None and self._due(stream, step):
                delta = self.fmt.differential and stream.mirrored and stream.complete is not None
                kind = "delta" if delta else "full"
                stream.update = Update(step, kind, stream.complete if delta else None, self.parts(s, kind))
            u = stream.update
            if u is not None and u.sent < u.parts:
                parts[s] = CopyPart(s, self.holder(s), u.step, u.kind, u.base, u.sent, u.parts)
        return StreamStep(step, parts)

    def _due(self, stream: Stream, step: int) -> bool:
        return step % self.every == 0 or stream.complete is None or not stream.mirrored

    def protection_due(self, step: int) -> list[Protect]:
        """After committing `step`: the parts it carried travelled (the runtime checks and reports each)."""
        sent = {s: p for s, p in self.in_step_parts(step).items()}
        return [StreamSent(step, sent)] if sent else []

    def in_step_parts(self, step: int) -> dict[int, CopyPart]:
        """The parts step `step` carried (without beginning anything)."""
        out = {}
        for s, stream in self.streams.items():
            u = stream.update
            if u is not None and u.sent < u.parts and u.step + u.sent == step:
                out[s] = CopyPart(s, self.holder(s), u.step, u.kind, u.base, u.sent, u.parts)
        return out

    def copy_part_done(self, part: CopyPart) -> bool:
        """`part` arrived at its holder in a committed step; returns whether it completed its update (the copy of
        `part.step` is then the holder's, and the owner's mirror)."""
        stream = self.streams[part.stage]
        u = stream.update
        if u is None or (u.step, u.kind, u.sent) != (part.step, part.kind, part.part):
            return False  # voided meanwhile (a failure)
        u.sent += 1
        if u.sent < u.parts:
            return False
        stream.complete, stream.mirrored, stream.update = u.step, True, None
        return True

    def copy_assumed(self, stage: int, step: int) -> None:
        self.streams[stage] = Stream(complete=step, mirrored=True)

    def copy_stream_broken(self, stage: int) -> None:
        """An update of `stage`'s copy did not arrive: it is void, and the next one is full."""
        stream = self.streams[stage]
        stream.update, stream.mirrored = None, False

    # ---- recovery (both runtimes) -------------------------------------------------------------
    def recovery_plan(self, failure: Failure) -> RecoveryPlan:
        """Every lost stage whose copy's holder lives is restored alone from it; the others are rebuilt by the
        configured rule (the plan's fallback), the restored stages counting as live."""
        copies, failed = failure.copies, failure.failed
        for s in failed:  # updates from and to the lost peers are void; the copies they held are gone
            self.streams[s].update, self.streams[s].mirrored = None, False
        for s, stream in self.streams.items():
            if self.holder(s) in failed:
                stream.complete, stream.mirrored, stream.update = None, False, None
        fmt = self.fmt.weights
        restored: dict[int, Source] = {s: Holder(self.holder(s), copies.copy_step(s), form=fmt) for s in sorted(failed)
                    if self.holder(s) in copies.holders(s)}
        for s in restored:  # the replacement mirrors the copy it is restored from
            self.streams[s].mirrored = self.streams[s].complete is not None
        rest = failed - set(restored)
        if not rest:
            return RecoveryPlan(failure.step, failed, restored)
        rebuilt = average_plan(Failure(failure.step, frozenset(rest), copies), self.cfg.num_stages, self.rebuild,
                               self.cfg.recovery.fallback)
        if rebuilt.fallback is not None and rebuilt.fallback.name == "abort":
            return RecoveryPlan(failure.step, failed, restored, fallback=rebuilt.fallback)
        reasons = {s: (f"stage {s}'s copy at stage {self.holder(s)} was lost too" if s in self.streams and
                       self.holder(s) in failed else f"stage {s} has no complete copy yet") for s in sorted(rest)}
        if rebuilt.fallback is not None:  # the rule could not rebuild some (an edge): recovery.fallback's name
            reasons.update({s: f"{reasons[s]}; {r}" for s, r in rebuilt.fallback.reasons.items()})
        return RecoveryPlan(failure.step, failed, {**restored, **rebuilt.sources},
                            fallback=Fallback(self.rebuild, reasons))

    def protection_after_handover(self, stages: tuple[int, ...]) -> list[Protect]:
        """A handover: the new peers neither mirror their stage's copy nor hold the copies the leaving peers held
        (they are streamed again, from a full update)."""
        for s in stages:
            self.copy_stream_broken(s)
        for s, stream in self.streams.items():
            if self.holder(s) in stages:
                stream.complete, stream.mirrored, stream.update = None, False, None
        return []

    def adopt(self, complete: dict[int, int]) -> None:
        """A new coordinator: the copies its peers report complete (owner stage -> step) are kept; no owner is
        known to mirror them, so every stream starts over with a full update."""
        for s, stream in self.streams.items():
            stream.complete, stream.mirrored, stream.update = complete.get(s), False, None
