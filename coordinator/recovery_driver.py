"""Where a failed stage comes back: the coordinator carries out the strategy's `RecoveryPlan` (checkfree.plans,
the same plan the simulator carries out) by telling peers where to pull from.

A failure: the failed stages' peers are retired, the copies they held are gone from the `Copies` ledger, and the
strategy plans. With a rollback every live stage restores its own copy (RESTORE) first; then each failed stage
gets a standby that loads its copy (ASSIGN restore / promote), then the stages rebuilt from their neighbours
(ASSIGN recover). The events are the plan's (`checkfree.plans.plan_events`) with what the peers measured; the
protection due after it (`plan.then`) is taken; a rollback ends in `Rollback`, which re-runs the lost steps.
"""

from __future__ import annotations

import asyncio
import logging
import time
from msgspec.structs import replace

from checkfree.config import RunConfig
from checkfree.plans import (Failure, Holder, Init, Own, Parity, RecoveryPlan, Replica, Source, Storage,
                             abort_if_unrecoverable, plan_events)
from checkfree.messages import (AssignPromote, AssignRecover, AssignRequest, AssignRestore, Assigned, InitialState,
                                Origin, OwnCopy, ParityCopy, PeerCopy, Restore, StorageCopy)
from checkfree.net.transport import RemoteError
from checkfree.recovery import Neighbours
from checkfree.strategies import Strategy
from coordinator.common import CALL_ERRORS, Rollback
from coordinator.members import Membership
from coordinator.outputs import Outputs
from coordinator.placement import Placement
from coordinator.protection import Protection
from coordinator.retirement import Retirement
from coordinator.rpc import Rpc
from coordinator.stage_table import StageTable

__all__ = ["Recovery"]

log = logging.getLogger("coordinator.coordinator")


class LostInRecovery(Exception):
    """Stages whose peers died while a recovery restored them (`stages`): failed too."""

    def __init__(self, stages: set[int]) -> None:
        super().__init__(f"stage(s) {sorted(stages)} failed during the recovery")
        self.stages = stages


class Recovery:
    """Carries out the strategy's recovery plans on the peers."""

    def __init__(self, cfg: RunConfig, strategy: Strategy, rpc: Rpc, table: StageTable, membership: Membership,
                 retirement: Retirement, placement: Placement, protection: Protection, outputs: Outputs) -> None:
        self.cfg, self.strategy, self.rpc, self.table = cfg, strategy, rpc, table
        self.members, self.retirement, self.placement, self.protection, self.out = (membership, retirement, placement,
                                                                                    protection, outputs)
        self.timeouts = rpc.timeouts

    async def recover(self, step: int, failed: set[int]) -> None:
        """Recover `failed` at the start of `step` by the strategy's plan; raises Rollback after a rollback."""
        t0 = time.perf_counter()
        try:
            await self._recover(step, failed)
        finally:  # from detection to the recovered (or rolled back) pipeline, measured
            self.out.charge(recovery_s=time.perf_counter() - t0)

    async def _recover(self, step: int, failed: set[int]) -> None:
        strategy = self.cfg.recovery.strategy
        detected = time.time()
        failed, new = set(failed), set(failed)
        new |= await self._sweep(failed)  # every peer this recovery may lean on, dead ones found now
        failed |= new
        while True:
            for s in sorted(new):
                gone = self.table.lose(s)  # (a stage group is lost when every replica is)
                for p in gone:
                    self.members.drop(p)
                self.out.event("failure", step=step, stage=s, strategy=strategy, peer_id=gone[0] if gone else None)
            await self.retirement.retire()
            self.strategy.interrupted()
            copies = self.protection.lost(failed)
            plan = self.strategy.recovery_plan(Failure(step, frozenset(failed), copies))
            abort_if_unrecoverable(plan, strategy, self.out.event)
            try:
                measured = await self._carry_out(plan, detected)
                break
            except LostInRecovery as e:  # a peer the plan leans on died too (lost with the others): plan again
                log.warning("stage(s) %s failed during the recovery of %s: planning again", sorted(e.stages),
                            sorted(failed))
                new = (e.stages | await self._sweep(failed | e.stages)) - failed
                failed |= new
        coefficients = {s: dict(zip(src.sources, measured[s].pop("coefficients", [])))
                        for s, src in plan.rebuilt.items()}
        for name, fields in plan_events(plan, strategy, self.cfg.recovery.omega_scope, coefficients):
            self.out.event(name, **fields, **(measured.get(fields["stage"], {}) if "method" in fields else {}))
        target = plan.rollback_to
        await self.protection.recovered(plan, step if target is None else target)
        if target is not None:
            self.out.charge(lost_steps=step - target)
            raise Rollback(target)

    async def _sweep(self, failed: set[int]) -> set[int]:
        """The failures of one iteration are planned together: every peer of the stages left is pinged, so that a
        plan never leans on one that died (or was cut off) with the failed stages but was not seen yet (a source of
        a rebuild, a holder of a copy or replica). A stage group's dead replicas leave it (lost replicas); the
        stages whose every peer is dead are returned, failed too. (A rebuild from a cut-off replica of a neighbour
        stage failed on every standby in turn: the seed-7 divergence #2; a handover's replica taken from a dead
        stage: #1.)"""
        groups = {s: g for s, g in self.table.groups().items() if s not in failed}
        pids = [p for g in groups.values() for p in g]
        alive = dict(zip(pids, await asyncio.gather(*(self.rpc.alive(p) for p in pids))))
        lost = {s for s, g in groups.items() if not any(alive[p] for p in g)}
        for s, g in groups.items():
            for p in g if s not in lost else ():
                if not alive[p]:
                    self.members.lose_replica(s, p, "lost with a failed stage")
                    self.members.clear(p)
        if any(not a for a in alive.values()):
            await self.retirement.retire()
        return lost

    async def _any_dead(self) -> bool:
        """Whether a peer serving a stage does not answer a ping."""
        pids = [p for g in self.table.groups().values() for p in g]
        return not all(await asyncio.gather(*(self.rpc.alive(p) for p in pids)))

    async def _carry_out(self, plan: RecoveryPlan, detected: float) -> dict[int, dict]:
        """The plan on the peers: live stages restore their copies (a rollback), failed stages load theirs, then
        the rebuilds. What each failed stage's peer measured, by stage."""
        if plan.rollback_to is not None:
            live = {s: src for s, src in plan.copied.items() if s not in plan.failed}
            done = await asyncio.gather(*(self.rpc.call(self.table.peer(s), Restore(step=step, origin=origin),
                                                        self.timeouts.step_timeout)
                                          for s, src in live.items() for step, origin, _ in [self._copy(plan, s, src)]),
                                        return_exceptions=True)
            lost = {s for s, r in zip(live, done) if isinstance(r, CALL_ERRORS) and not await self.rpc.alive(
                self.table.peer(s))}
            if lost:
                raise LostInRecovery(lost)
            for r in done:
                if isinstance(r, BaseException):
                    raise r
        measured = {}
        for s, src in plan.copied.items():
            if s in plan.failed:
                measured[s] = await self._load(plan, s, src)
        for s, src in plan.rebuilt.items():
            measured[s] = await self._rebuild(plan, s, src, detected)
        return measured

    def _copy(self, plan: RecoveryPlan, stage: int, src: Source) -> tuple[int, Origin, dict]:
        """Where `stage`'s copy comes from, as its peer is told (RESTORE, ASSIGN restore): the copy's step, its
        origin, and what a stage restored alone takes besides (the step it serves from, its components' holders)."""
        target = plan.rollback_to
        if isinstance(src, Init):
            return 0, InitialState(), {}
        if isinstance(src, Storage):
            return src.step, StorageCopy(storage=self.protection.storage_dir), {}
        if isinstance(src, Own):
            assert target is not None  # (a stage keeps its own copy only in a rollback)
            return target, OwnCopy(), {}
        if isinstance(src, Parity):  # (the lost member's companion may have survived its crash)
            return src.step, ParityCopy(group=[self._peer(m) for m in src.group], index=src.group.index(stage),
                                        companion=self.protection.companion(stage)), {}
        assert isinstance(src, Holder), f"stage {stage} has no copy to take: {src}"
        alone = {} if target is not None else {  # serves from the failed step on, its components from co-holders
            "serve_step": plan.step, "edges": {c: (d, self.table.peer(d)) for c, d in src.edges.items()}}
        return src.step, PeerCopy(peer=self.table.peer(src.holder)), alone

    def _peer(self, stage: int) -> str:
        return self.table.peer(stage) if stage in self.table.served() else ""

    async def _load(self, plan: RecoveryPlan, stage: int, src: Source) -> dict:
        """A standby takes failed `stage` with its copy: what it measured (the event's fields)."""
        if isinstance(src, Replica):
            assign: AssignRequest = AssignPromote(stage=stage, source=self.table.peer(src.holder), step=plan.step)
        else:
            step, origin, alone = self._copy(plan, stage, src)
            assign = AssignRestore(stage=stage, step=step, origin=origin, **alone)
        pid, reply, t0 = await self._assign_replacement(plan.step, assign)
        self.protection.replaced(stage)
        self.out.charge(bytes_moved=reply.bytes)
        via = {"restored_from": reply.restored_from} if reply.restored_from == "companion" else {}
        self.out.status(f"stage {stage} recovery: {_describe(plan, src)} on peer {pid[-8:]}, "
                        f"{time.perf_counter() - t0:.2f} s")
        return {"peer_id": pid, "bytes": reply.bytes, "recovery_time_s": round(time.perf_counter() - t0, 6), **via}

    async def _rebuild(self, plan: RecoveryPlan, stage: int, src: Neighbours, detected: float) -> dict:
        """A standby rebuilds `stage` from its live neighbours' weights: what it measured (the event's fields)."""
        sources = {s: self.table.peer(s) for s in (*src.sources, *src.edge_sources.values())}
        pid, reply, t0 = await self._assign_replacement(
            plan.step, AssignRecover(stage=stage, plan=src, sources=sources, step=plan.step))
        self.out.charge(bytes_moved=reply.bytes)
        took = time.perf_counter() - t0
        coeffs = "/".join(f"{c:.2f}" for c in reply.coefficients)
        edges = "".join(f", {c} copied from stage {h}" for c, h in src.edge_sources.items())
        kind = "fallback" if plan.fallback and stage in plan.fallback.reasons else "recovery"
        self.out.status(f"stage {stage} {kind}: {src.method} of stage(s) {', '.join(map(str, src.sources)) or '-'}"
                        + (f" (coefficients {coeffs})" if coeffs else "") + f"{edges} on peer {pid[-8:]}, {took:.2f} s")
        return {"coefficients": reply.coefficients, "peer_id": pid, "norms": reply.norms,
                "transfer_s": reply.transfer_s, "rebuild_s": reply.rebuild_s, "bytes": reply.bytes,
                "recovery_time_s": round(took, 6), "since_detection_s": round(time.time() - detected, 6)}

    async def _assign_replacement(self, step: int, assign: AssignRequest) -> tuple[str, Assigned, float]:
        """Give `assign.stage` to a standby; a standby that dies while taking it over is reported and the
        next one is tried. Returns (peer, reply, time the successful assignment started)."""
        stage = assign.stage
        while True:
            # no standby: a stage group's spare replica rebuilds the lost stage (a stage loss costs more than a
            # group running one replica short)
            borrowed = None if self.members.standbys() else self.placement.borrow_replica(step, stage)
            pid = borrowed or await self.members.take_standby(f"replace stage {stage}")
            t0 = time.perf_counter()
            try:  # (a borrowed replica lets its old stage go first)
                return pid, await self.placement.assign(pid, replace(assign, release=bool(borrowed))), t0
            except CALL_ERRORS as e:
                if isinstance(e, RemoteError) and await self._any_dead():  # it failed at a source that died: the
                    raise LostInRecovery(set()) from e  # standby is not to blame (the plan is made again)
                log.warning("replacement %s died while taking over stage %d: %s", pid, stage, e)
                self.out.event("recovery_retry", step=step, stage=stage, peer_id=pid, reason=str(e)[:300])


def _describe(plan: RecoveryPlan, src: Source) -> str:
    """Where a failed stage's copy came from, for its status line."""
    if isinstance(src, Replica):
        return f"replica promoted from stage {src.holder}"
    if isinstance(src, Holder) and plan.rollback_to is None:
        return f"snapshot of step {src.step} from stage {src.holder}" + "".join(
            f", {c} copied from stage {d}" for c, d in src.edges.items())
    if isinstance(src, Holder):
        where = f"stage {src.holder}'s copy"
    elif isinstance(src, Parity):
        where = f"parity group {list(src.group)}"
    else:
        where = {Storage: "storage", Init: "the initial state"}[type(src)]
    return f"rollback to step {plan.rollback_to} from {where}"
