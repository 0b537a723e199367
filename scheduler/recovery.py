"""Where a failed stage comes back: the recovery order (which standby rebuilds which stage from which live
neighbours, by the strategy's plan), the snapshots taken after a commit (gemini, checkfree+snap) or
checkpoints (checkpoint), the rollback of every stage to the last complete one (gemini, checkpoint), and
checkfree+snap's restore of a lone lost stage from its neighbour's snapshot."""

from __future__ import annotations

import asyncio
import logging
import time

from checkfree.protocol import RPC, plan_to_wire
from checkfree.recovery import UnrecoverableFailure, plan_recovery
from checkfree.strategies import storage
from checkfree.strategies.averaging import recovery_fields, unrecoverable
from scheduler.common import CALL_ERRORS, Rollback

__all__ = ["RecoveryMixin"]

log = logging.getLogger("scheduler.coordinator")


class RecoveryMixin:
    """Part of `scheduler.coordinator.Coordinator` (see the module docstring); state lives on the coordinator."""

    # ---- recovery ---------------------------------------------------------------------
    async def _recover(self, step: int, failed: set[int]) -> None:
        t0 = time.perf_counter()
        try:
            await self._recover_stages(step, failed)
        finally:  # from detection to the recovered (or rolled back) pipeline, measured
            self._charge(recovery_s=time.perf_counter() - t0)

    async def _recover_stages(self, step: int, failed: set[int]) -> None:
        strategy = self.cfg.recovery.strategy
        detected = time.time()
        for s in sorted(failed):
            pid = self.stage_peer.pop(s, None)
            for p in [pid, *self.extra.pop(s, [])]:  # (a stage group is lost when every replica is)
                if p is not None:
                    self.members[p].stage = -1
                    self.members[p].leaving = True
            self.group_gen[s] += 1
            self._event("failure", step=step, stage=s, strategy=strategy, peer_id=pid)
        await self._retire()
        if self.strategy.swarm_rollback:
            await self._rollback(step, failed)
        if self.strategy.restores_alone:
            failed = failed - await self._restore_alone(step, failed)
            if not failed:
                return
        if self.strategy.swarm_replicas:
            await self._recover_replicated(step, failed, detected)
            return
        await self._rebuild(step, failed, self.strategy.rule.name, detected)

    async def _recover_replicated(self, step: int, failed: set[int], detected: float) -> None:
        """Redundant computation: promote every replica that survives; a stage lost together with its replica's
        holder gets the declared fallback; then the new peers (and the holders of rebuilt stages, whose replica
        is stale) take their successors' replicas."""
        lost = failed - self.strategy.promotable(failed)
        fb = self.cfg.recovery.fallback
        reason = ", ".join(f"stage {s}'s replica holder {self.strategy.holder(s)} failed too" for s in sorted(lost))
        if lost and fb == "abort":  # the run ends here: nothing is promoted first
            self._event("fallback", step=step, stage=min(lost), strategy=self.cfg.recovery.strategy,
                        fallback="abort", reason=reason)
            raise unrecoverable(self.cfg.recovery.strategy, lost, reason)
        await self._promote(step, failed)
        if lost:
            await self._rebuild(step, lost, fb, detected, reason)
        await self._replicate(failed, step)  # the new peers; a rebuilt stage's holder is among them (it was lost)

    async def _rebuild(self, step: int, failed: set[int], rule: str, detected: float, reason: str | None = None) -> None:
        """Rebuild `failed` from live neighbours by recovery rule `rule` (the strategy's, or a fallback's)."""
        strategy = self.cfg.recovery.strategy
        try:
            plans = plan_recovery(failed, self.cfg.num_stages, rule, self.cfg.recovery.fallback)
        except UnrecoverableFailure as e:
            self._event("fallback", step=step, stage=min(failed), strategy=strategy, fallback="abort", reason=str(e))
            raise
        for plan in plans:
            if reason is not None:  # a strategy's declared fallback (recorded as one, like in the simulator)
                plan.fallback, plan.reason = rule, reason
            sources = {str(s): self.stage_peer[s] for s in (*plan.sources, *plan.edge_sources.values())}
            pid, reply, t0 = await self._assign_replacement(
                step, plan.stage, {"mode": "recover", "plan": plan_to_wire(plan), "sources": sources, "step": step},
                chaos=True)
            self.norms[plan.stage] = 0.0
            fields = recovery_fields(plan, dict(zip(plan.sources, reply.get("coefficients", []))),
                                     self.cfg.recovery.omega_scope)
            fields.update(peer_id=pid, norms=reply.get("norms", []), transfer_s=reply.get("transfer_s"),
                          rebuild_s=reply.get("rebuild_s"), bytes=reply.get("bytes"),
                          recovery_time_s=round(time.perf_counter() - t0, 6),
                          since_detection_s=round(time.time() - detected, 6))
            self._charge(bytes_moved=int(reply.get("bytes") or 0))
            kind = "fallback" if plan.fallback else "recovery"
            extra = {"fallback": plan.fallback, "reason": plan.reason} if plan.fallback else {}
            self._event(kind, step=step, stage=plan.stage, strategy=strategy, **extra, **fields)
            coeffs = "/".join(f"{c:.2f}" for c in fields["coefficients"])
            edges = "".join(f", {c} copied from stage {h}" for c, h in plan.edge_sources.items())
            self._status(f"stage {plan.stage} {kind}: {plan.method} of stage(s) "
                         f"{', '.join(map(str, plan.sources)) or '-'}" + (f" (coefficients {coeffs})" if coeffs else "")
                         + f"{edges} on peer {pid[-8:]}, {fields['recovery_time_s']:.2f} s")

    async def _restore_alone(self, step: int, failed: set[int]) -> set[int]:
        """checkfree+snap: every lost stage whose snapshot a live neighbour still holds is restored from it alone
        (up to snapshot_every - 1 steps stale; nobody rolls back, no step is lost), its embedding / head taken
        from the live co-holder; the strategy object decides which (checkfree.strategies.hybrid), as in the
        simulator. Returns the restored stages; the others are averaged, the restored ones among their sources."""
        live = set(self.stage_peer.values())
        held = {s for s, hs in self.snap_holders.items() if hs and all(p in live for p in hs.values())}
        restored = self.strategy.restorable(failed, held if self.snap_step else set())
        for s in sorted(restored):
            (holder, source), = self.snap_holders[s].items()
            edges = {comp: [d, self.stage_peer[d]] for comp, d in self.strategy.component_donors(s, failed).items()}
            t0 = time.perf_counter()
            pid, reply, _ = await self._assign_replacement(step, s, {"mode": "restore", "step": self.snap_step,
                                                                     "source": source, "serve_step": step,
                                                                     "edges": edges})
            self.norms[s] = float(reply.get("omega", 0.0))
            self._charge(bytes_moved=int(reply.get("bytes") or 0))
            self._event("recovery", step=step, stage=s, strategy=self.cfg.recovery.strategy, method="snapshot",
                        source=holder, snapshot_step=self.snap_step, staleness=step - self.snap_step, lost_steps=0,
                        edge_sources={c: d for c, (d, _) in edges.items()}, peer_id=pid, bytes=reply.get("bytes", 0),
                        recovery_time_s=round(time.perf_counter() - t0, 6))
            self._status(f"stage {s} recovery: snapshot of step {self.snap_step} from stage {holder}"
                         + "".join(f", {c} copied from stage {d}" for c, (d, _) in edges.items())
                         + f" on peer {pid[-8:]}, {time.perf_counter() - t0:.2f} s")
        return restored

    async def _assign_replacement(self, step: int, stage: int, header: dict,
                                  chaos: bool = False) -> tuple[str, dict, float]:
        """Give `stage` to a standby; a standby that dies while taking it over is reported and the
        next one is tried. Returns (peer, reply, time the successful assignment started)."""
        while True:
            # no standby: a stage group's spare replica rebuilds the lost stage (a stage loss costs more than a
            # group running one replica short)
            pid = (None if self._standbys() else self._borrow_replica(step, stage)) or \
                await self._take_standby(f"replace stage {stage}")
            extra = {}
            if chaos:
                await self._chaos_replacement(pid, stage)
                extra = self._chaos_rebuild(pid, stage)
            t0 = time.perf_counter()
            try:
                return pid, await self._assign(stage, pid, {**header, **extra}), t0
            except CALL_ERRORS as e:
                log.warning("replacement %s died while taking over stage %d: %s", pid, stage, e)
                self._event("recovery_retry", step=step, stage=stage, peer_id=pid, reason=str(e)[:300])

    # ---- rollback strategies (checkpoint, gemini): real snapshots in peers' memory / files
    async def _protect(self, step: int) -> None:
        """After committing `step`: take the strategy's snapshot / checkpoint when it says one is due (the same
        rule as in the simulator). A snapshot counts only once every stage has completed it; a checkpoint is
        sealed (checkfree.strategies.storage) only then; the previous one is kept until then."""
        strategy, nxt = self.strategy, step + 1
        if getattr(strategy, "clock", None) is not None:  # baft: backups in the bubbles (scheduler/backups.py)
            await self._backup(step)
        if strategy.snapshot_due(nxt) and getattr(strategy, "groups", None) is not None:  # reft: own copy + parity
            members = {s: [self.stage_peer[m] for m in strategy.group_of(s)] for s in self.stage_peer}
            if await self._snapshot_all(nxt, lambda s: {"parity": {"group": members[s],
                                                                    "index": strategy.group_of(s).index(s)}}):
                self.snap_step, self.snap_holders = nxt, {s: {s: p} for s, p in self.stage_peer.items()}
        elif strategy.snapshot_due(nxt):
            holders = {s: {h: self.stage_peer[h] for h in hs} for s, hs in enumerate(strategy.holders)}
            if await self._snapshot_all(nxt, lambda s: {"holders": list(holders[s].values())}):
                self.snap_step, self.snap_holders = nxt, holders
        if strategy.checkpoint_due(nxt):
            if await self._snapshot_all(nxt, lambda s: {"storage": self.storage_dir}):
                storage.seal(self.storage_dir, nxt, self.cfg.num_stages)
                self.ckpt_step = nxt

    async def _snapshot_all(self, step: int, extra) -> bool:
        t0 = time.perf_counter()
        calls = [self._call(p, RPC.SNAPSHOT, {"step": step, **extra(s)}, self.t.step_timeout)
                 for s, p in sorted(self.stage_peer.items())]
        results = await asyncio.gather(*calls, return_exceptions=True)
        errors = [r for r in results if isinstance(r, Exception)]
        kind = "storage" if "storage" in extra(0) else "memory"
        seconds = time.perf_counter() - t0
        sizes = {s: r[0]["bytes"] for s, r in zip(sorted(self.stage_peer), results) if not isinstance(r, Exception)}
        sent = sum(r[0].get("sent", 0) for r in results if not isinstance(r, Exception))
        self._event("snapshot", step=step, kind=kind, complete=not errors, seconds=round(seconds, 6),
                    bytes=sum(sizes.values()), sent=sent)
        if not errors:  # reft: where each stage's snapshot companion listens (it survives a crash of its peer)
            self.companions = {s: r[0]["companion"] for s, r in zip(sorted(self.stage_peer), results)
                               if r[0].get("companion")}
        held: dict[str, int] = {}  # memory: the snapshots each peer holds (gemini: its own among them)
        for s, n in sizes.items():
            if "holders" in extra(s):
                for pid in extra(s)["holders"]:
                    held[pid] = held.get(pid, 0) + n
            elif "parity" in extra(s):  # reft: its own snapshot and a parity block of ~1/(n-1) of the largest
                group = self.strategy.group_of(s)
                held[self.stage_peer[s]] = n - (-max(sizes.get(m, 0) for m in group) // (len(group) - 1))
        # the next step waited for the snapshot; the bytes went over the network (memory) or to storage
        self._charge(stall_s=seconds, bytes_moved=sent if kind == "memory" else sum(sizes.values()),
                     extra_memory_bytes=max(held.values(), default=0))
        return not errors

    async def _rollback(self, step: int, failed: set[int]) -> None:
        """Roll every stage back to the last complete snapshot; replacements fetch the lost stages' copies from
        the live holder the strategy picks (gemini: the cheapest link, as in the simulator) or from storage
        (checkpoint, or gemini's storage fallback when every holder of a stage is gone)."""
        strategy, name = self.strategy, self.cfg.recovery.strategy
        if getattr(strategy, "clock", None) is not None:
            strategy.clock.abandon()  # baft: the backup in flight is worthless now (as in the simulator)
        live = set(self.stage_peer.values())
        from_storage = not strategy.snapshots_in_memory
        target = self.ckpt_step if from_storage else self.snap_step
        parity = getattr(strategy, "groups", None) is not None  # reft: a lost member is decoded from its group
        holders = {s: [h for h, pid in self.snap_holders.get(s, {}).items() if pid in live] for s in failed}
        lost = sorted(s for s in failed if self.snap_step and not holders[s]) if not from_storage else []
        if parity and not from_storage:
            lost = sorted(failed - strategy.decodable(failed)) if self.snap_step else []
        if lost:
            action = strategy.when_all_copies_lost()
            reason = strategy.lost_reason(set(lost))
            self._event("fallback", step=step, stage=min(lost), strategy=name, fallback=action, reason=reason)
            if action != "checkpoint":  # _configure admits only abort here (see there)
                raise unrecoverable(name, lost, reason)
            from_storage, target = True, self.ckpt_step
        source: dict[int, dict] = {}
        holder: dict[int, int] = {}  # a failed stage -> the stage whose peer holds the copy it restores
        for s in range(self.cfg.num_stages):
            if target == 0:
                source[s] = {"source": "init"}
            elif from_storage:
                source[s] = {"storage": self.storage_dir}
            elif s in failed and parity:
                group = strategy.group_of(s)
                source[s] = {"parity": {"group": [self.snap_holders[m][m] for m in group], "index": group.index(s),
                                        **({"companion": self.companions[s]} if s in self.companions else {})}}
            elif s in failed:
                holder[s] = strategy.restore_source(s, holders[s], self.cost)
                source[s] = {"source": self.snap_holders[s][holder[s]]}
            else:
                source[s] = {"source": self.stage_peer[s]}
        t0 = time.perf_counter()
        await asyncio.gather(*(self._call(p, RPC.RESTORE, {"step": target, **source[s]}, self.t.step_timeout)
                               for s, p in self.stage_peer.items()))
        self._charge(lost_steps=step - target)
        for s in sorted(failed):
            pid, reply, _ = await self._assign_replacement(step, s, {"mode": "restore", "step": target, **source[s]})
            self.norms[s] = float(reply.get("omega", 0.0))
            self._charge(bytes_moved=int(reply.get("bytes") or 0))
            if "parity" in source[s]:  # the replacement holds the lost member's snapshot and parity block now
                self.snap_holders[s] = {s: pid}
                self.companions.pop(s, None)  # (its own companion starts at the next snapshot)
            self._event("recovery", step=step, stage=s, strategy=name, method="rollback", rollback_to=target,
                        lost_steps=step - target, peer_id=pid,
                        source=holder.get(s, source[s].get("source", reply.get("restored_from", "storage"))),
                        bytes=reply.get("bytes", 0), recovery_time_s=round(time.perf_counter() - t0, 6))
        raise Rollback(target)
