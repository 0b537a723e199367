"""Coordinator failover: a standby coordinator watches the run's coordinator and takes over when it stops
answering; the run's state (config, step, stage table, protection) is adopted from its peers (ADOPT)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path

from checkfree.auth import coordinator_proof, join_token, verify
from checkfree.config import config_from_dict
from checkfree.net.transport import RemoteError, TransportError, live_members_async
from checkfree.pipeline import evaluates_after
from checkfree.protocol import RPC, Kind, coordinator_from_records, coordinator_key
from checkfree.rundir import RunWriter, read_jsonl
from checkfree.strategies import storage
from scheduler.common import (
    CALL_ERRORS,
    EVAL_ATTEMPT,
    STEP_FIGURES,
    CoordinatorAlive,
    Member,
    Rollback,
    step_figures,
)

__all__ = ["FailoverMixin"]

LEAVING = "leaving"  # an ADOPT reply's `state` of a peer leaving gracefully (peers.stage.PeerState.LEAVING)


def _progress(reply: dict) -> int:
    """How far an ADOPT reply's stage has come: the step its weights are ready for, one more if it holds that step
    finished and ready to commit."""
    ready = reply.get("ready")
    return reply["next_step"] + (1 if ready and ready.get("step") == reply["next_step"] else 0)

log = logging.getLogger("scheduler.coordinator")


class FailoverMixin:
    """Part of `scheduler.coordinator.Coordinator` (see the module docstring); state lives on the coordinator."""

    # ---- coordinator failover ---------------------------------------------------------
    async def _watch(self) -> None:
        """Standby: poll the run's coordinator (found in the DHT) every heartbeat_ttl/2;
        return once it has failed to answer twice in a row."""
        key, watched, misses = coordinator_key(self.opts.run_id), None, 0
        deadline = time.monotonic() + self.t.join_timeout
        while True:
            try:
                found = await live_members_async(self.dht, key) or {}
            except Exception as e:  # the DHT read is advisory: the STATUS call decides
                log.debug("DHT lookup of the coordinator failed: %r", e)
                found = {}
            current = coordinator_from_records(found, self.secret, self.opts.run_id, self.transport.kind,
                                               exclude=str(self.transport.peer_id))
            if current is not None and current != watched:
                watched, misses = current, 0
                print(f"standby: watching coordinator {watched}", flush=True)
            if watched is None:
                if time.monotonic() > deadline:
                    raise TransportError(f"no coordinator of run {self.opts.run_id!r} found in the DHT within "
                                         f"join_timeout={self.t.join_timeout:g} s: nothing to stand by for")
            else:
                try:
                    await self._call(watched, RPC.STATUS, {}, timeout=min(5.0, self.t.rpc_timeout))
                    misses = 0
                except CALL_ERRORS as e:
                    misses += 1
                    log.info("coordinator %s did not answer (%d): %s", watched, misses, e)
                if misses >= 2:
                    print(f"standby: coordinator {watched} stopped answering; taking over", flush=True)
                    return
            await asyncio.sleep(self.t.heartbeat_ttl / 2)

    async def _take_over(self) -> None:
        """Rebuild the run's state from its peers (found by their DHT heartbeats) and continue
        from the step they are at. Peers report their stage, the step their weights are ready
        for, their norm, and a finished but uncommitted step: if the old coordinator died
        half-way through a commit, the stages it did not reach commit now, so every stage
        is at the same step; an unfinished step is dropped and run again. A stage nobody
        serves is recovered by the run's strategy like any failure."""
        while True:
            t0 = time.perf_counter()
            try:
                replies = await self._adopt_peers()
                break
            except CoordinatorAlive as e:
                if not self.opts.standby:
                    raise
                print(f"standby: {e}; standing by again", flush=True)
                await self._watch()
        configs = {r["config"] for r in replies.values() if r.get("config")}
        if len(configs) != 1:
            raise RuntimeError(f"cannot take over run {self.opts.run_id!r}: its peers report "
                               f"{'no' if not configs else 'different'} run configs")
        cfg = config_from_dict(json.loads(configs.pop()))
        self._configure(cfg)
        metrics = Path(self.opts.out) / "metrics.jsonl"
        resume = metrics.exists()
        # the same run directory: keep counting (and the run's clock) where the old coordinator stopped
        self.writer = RunWriter(self.opts.out, cfg.to_json(), resume=resume, tokens_per_step=cfg.tokens_per_step,
                                tensorboard=self.opts.tensorboard)
        holders: dict[int, list[tuple[str, dict]]] = {}
        for i, (pid, r) in enumerate(replies.items()):
            self.members[pid] = Member(pid, time.time() + i * 1e-6)
            if r["stage"] >= 0:
                holders.setdefault(r["stage"], []).append((pid, r))
        step = max((r["next_step"] for hs in holders.values() for _, r in hs), default=0)
        to_commit: dict[str, tuple[int, dict]] = {}  # peer -> (its stage, the finished step it holds ready)
        lagging = []
        for stage, hs in sorted(holders.items()):
            # two peers claim one stage (a handover cut short; one done while the old coordinator died: the peer that
            # handed its stage over leaves; a partitioned peer back after it was replaced): keep the newest (a step
            # finished, ready to commit, counts), a peer that is not leaving first; a stage group keeps every
            # replica as far as that one
            hs.sort(key=lambda x: (-_progress(x[1]), x[1].get("state") == LEAVING))
            for pid, r in hs[1:]:
                if cfg.train.stage_groups and _progress(r) == _progress(hs[0][1]) and r.get("state") != LEAVING:
                    self.members[pid].stage = stage
                    self.extra.setdefault(stage, []).append(pid)
                else:
                    self.members[pid].leaving = True
            pid, r = hs[0]
            self.members[pid].stage, self.stage_peer[stage] = stage, pid
            if r.get("state") == LEAVING:  # its leave (SIGTERM) is under way: handed over to a standby if one is free
                m = self.members[pid]
                m.leaving = m.left = m.handover = True
            self.norms[stage] = float(r["omega"])
            if r["next_step"] < step - 1 or _progress(r) < step:  # its weights are behind the others: a failed stage
                lagging.append(stage)
                self.members[pid].leaving = True
                continue
            for p in self._group(stage):  # those a step behind, with it finished (the old coordinator died mid-commit)
                if replies[p]["next_step"] == step - 1:
                    to_commit[p] = (stage, replies[p]["ready"])
        commits = await asyncio.gather(*(self._call(pid, RPC.COMMIT, {"step": ready["step"], "attempt": ready["attempt"]},
                                                    self.t.rpc_timeout) for pid, (_, ready) in to_commit.items()),
                                       return_exceptions=True)
        for (pid, (stage, ready)), c in zip(to_commit.items(), commits):
            if isinstance(c, Exception) and pid == self.stage_peer[stage]:
                lagging.append(stage)
                self.members[pid].leaving = True
            elif isinstance(c, Exception):  # a stage group's replica: the others go on without it
                self.extra[stage].remove(pid)
                self.members[pid].stage, self.members[pid].leaving = -1, True
            else:
                self.norms[stage] = float(c[0]["omega"])
                replies[pid]["last_commit"] = {"step": step - 1, "losses": ready["losses"], "lr": c[0]["lr"],
                                               "post": c[0]["post"], **{k: v for k, v in ready.items()
                                                                         if k in STEP_FIGURES}}
        await self._all(RPC.ABORT, {}, self.t.rpc_timeout)  # drop finished-but-uncommitted work of `step`
        seen = [r["finished"] for r in replies.values() if r.get("finished")]  # [step, attempt]
        seen += [[r["ready"]["step"], r["ready"]["attempt"]] for r in replies.values() if r.get("ready")]
        # the re-run of `step` must not reuse an attempt number its peers saw (they refuse stale attempts)
        self._attempt_floor[step] = max((a for st, a in seen if st == step and a < EVAL_ATTEMPT), default=-1) + 1
        self.step = self.iteration = step
        self._rebuild_protection(replies)
        record = self._missing_step(step - 1, replies, metrics if resume else None)
        self._event("coordinator_takeover", step=step, peers=len(replies), stages=len(self.stage_peer),
                    committed_stages=sorted({stage for stage, _ in to_commit.values()}), lagging_stages=sorted(lagging),
                    missing_stages=sorted(set(range(cfg.num_stages)) - set(self.stage_peer)),
                    recorded_step=record is not None, takeover_s=round(time.perf_counter() - t0, 6))
        print(f"status: took over run {self.opts.run_id!r} at step {step}: {len(self.stage_peer)}/{cfg.num_stages} "
              f"stages served, {len(self._standbys())} standby, {len(to_commit)} commits completed, "
              f"{len(lagging)} lagging stage(s)", flush=True)
        if step > 0 and not lagging and len(self.stage_peer) == cfg.num_stages:
            # the old coordinator may have died between committing step-1 and protecting it (a snapshot or
            # checkpoint due then): taken again now, as the simulator took it (taking it twice changes nothing)
            await self._protect(step - 1)
            if record is not None and evaluates_after(step - 1, cfg.train.eval_every, cfg.train.num_steps):
                try:  # the evaluation due after the step it records never ran either
                    ev = await self._run_step(step - 1, evaluate=True)
                    losses = [float(v) for r in ev.values() for v in r["losses"].values()]
                    record["val_loss"] = sum(losses) / len(losses)
                except Rollback as r:
                    self.step = self.iteration = r.step
        if record is not None:
            self.writer.metric(record)

    async def _adopt_peers(self) -> dict[str, dict]:
        """ADOPT every peer with a live heartbeat until every stage is served (or two heartbeat
        TTLs pass with at least one stage served; bounded by join_timeout)."""
        start = time.monotonic()
        replies: dict[str, dict] = {}
        refused: dict[str, str] = {}
        me = str(self.transport.peer_id)
        while True:
            try:
                live = await self._heartbeats()
            except Exception as e:
                log.warning("reading heartbeats failed: %r", e)
                live = {}
            new = [p for p in live if p not in replies and p != me]

            async def adopt(p: str):
                header = {}
                if self.secret is not None:
                    header["proof"] = coordinator_proof(self.secret, self.opts.run_id, me, p)
                return await self._call(p, RPC.ADOPT, header, timeout=self.t.rpc_timeout)

            for p, r in zip(new, await asyncio.gather(*(adopt(p) for p in new), return_exceptions=True)):
                if isinstance(r, RemoteError) and r.kind == Kind.COORDINATOR_ALIVE:
                    refused[p] = str(r)
                elif isinstance(r, Exception):
                    continue
                elif self.secret is None or verify(join_token(self.secret, self.opts.run_id, p), r[0].get("token")):
                    replies[p] = r[0]
                else:  # a stranger answering for a forged heartbeat must not hand us a stage
                    self._event("join_refused", peer_id=p, reason="ADOPT reply without a valid run token")
            if refused and not replies:
                raise CoordinatorAlive(next(iter(refused.values())))
            served = {r["stage"] for r in replies.values() if r.get("stage", -1) >= 0}
            cfg = next((r["config"] for r in replies.values() if r.get("config")), None)
            stages = json.loads(cfg)["num_stages"] if cfg else None
            waited = time.monotonic() - start
            if stages is not None and (len(served) >= stages or (served and waited > 2 * self.t.heartbeat_ttl)):
                return replies
            if waited > self.t.join_timeout:
                raise TransportError(f"no peer of run {self.opts.run_id!r} answered within join_timeout="
                                     f"{self.t.join_timeout:g} s: nothing to take over")
            await asyncio.sleep(0.2)

    def _rebuild_protection(self, replies: dict[str, dict]) -> None:
        """Rollback strategies after a takeover: the newest snapshot every stage has a live
        holder of (gemini, in peers' memory; checkfree+snap, which restores a stage alone: the newest snapshots
        left, of whichever stages) and the newest complete checkpoint in storage."""
        by_step: dict[int, dict[int, dict[int, str]]] = {}  # step -> stage -> {holder stage: holder peer}
        for pid, r in replies.items():
            if int(r.get("stage", -1)) < 0:
                continue  # a standby holds no snapshot
            for stage, st in (r.get("snapshots") or {}).items():
                by_step.setdefault(int(st), {}).setdefault(int(stage), {})[int(r["stage"])] = pid
        full = [st for st, hs in by_step.items() if len(hs) == self.cfg.num_stages]
        if full:
            self.snap_step = max(full)
            self.snap_holders = by_step[self.snap_step]
        elif by_step and self.strategy.restores_alone:  # checkfree+snap restores each stage alone: what is left counts
            self.snap_step = max(by_step)
            self.snap_holders = by_step[self.snap_step]
        complete = [st for st in storage.complete_steps(self.storage_dir) if st <= self.step]
        self.ckpt_step = max(complete, default=0)

    def _missing_step(self, step: int, replies: dict[str, dict], metrics: Path | None) -> dict | None:
        """The record of the step the old coordinator committed but did not record (it died in between), rebuilt
        from the peers' last commits when every stage has one; None if there is none to rebuild."""
        if step < 0 or (metrics is not None and any(m.get("step") == step for m in read_jsonl(metrics))):
            return None
        last: dict[int, dict] = {}  # stage -> its last commit, the losses of every replica of a stage group merged
        for r in replies.values():
            c = r.get("last_commit") or {}
            if r.get("stage", -1) >= 0 and c.get("step") == step:
                last.setdefault(r["stage"], {**c, "losses": {}})["losses"].update(c["losses"])
        if len(last) != self.cfg.num_stages:
            return None
        return {"step": step, "loss": sum(float(v) for c in last.values() for v in c["losses"].values()),
                "lr": next(iter(last.values()))["lr"], "attempts": None,
                "grad_norms": [last[s]["post"] for s in range(self.cfg.num_stages)],
                "block_grad_norms": [last[s].get("block_post") for s in range(self.cfg.num_stages)],
                "live_peers": len(self.stage_peer), "recorded_by": "takeover", **step_figures(last, self.cfg.num_stages)}
