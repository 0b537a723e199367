"""Coordinator failover: a standby coordinator watches the run's coordinator, keeping its own copy of the run (its
config, record, step and membership: coordinator/record_feed.py, over FOLLOW; no disk is shared), and takes over
when it stops answering; the run's state (config, step, stage table, protection) is adopted from its peers (ADOPT),
what they cannot say (a run none of whose stages is served any more) from the copy."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec

from checkfree.auth import join_token, verify
from checkfree.config import config_from_dict
from checkfree.net.heartbeats import heartbeat_stall
from checkfree.net.transport import RemoteError, TransportError, live_members_async
from checkfree.messages import Adopted, Commit, LastCommit, Ready, as_record
from checkfree.protocol import Kind, coordinator_from_records, coordinator_key
from checkfree.config import RunConfig
from checkfree.rundir import read_jsonl
from coordinator.common import (CALL_ERRORS, EVAL_ATTEMPT, STEP_FIGURES, CoordinatorAlive, CoordinatorOptions,
                              heartbeat_stage, settle, step_figures)
from coordinator.members import Membership
from coordinator.outputs import Outputs
from coordinator.protection import Protection
from coordinator.record_feed import RecordCopy
from coordinator.retirement import Retirement
from coordinator.rpc import Rpc
from coordinator.stage_table import StageTable
from coordinator.step_driver import StepDriver

__all__ = ["Failover", "Resumed"]

log = logging.getLogger("coordinator.coordinator")

LEAVING = "leaving"  # an ADOPT reply's `state` of a peer leaving gracefully (peers.stage.PeerState.LEAVING)
OUT_OF_THE_RUN = ("failure", "replica_lost", "leave", "retired")  # events that take a peer out of the run


def _progress(reply: Adopted) -> int:
    """How far an ADOPT reply's stage has come: the step its weights are ready for, one more if it holds that step
    finished and ready to commit."""
    ready = reply.ready
    return reply.next_step + (1 if ready is not None and ready.step == reply.next_step else 0)


def _recorded(step: int, metrics: Path) -> bool:
    """Whether the run's record holds the newest run of `step`: a line of it written after the newest rollback to it
    or before it (a rollback runs the steps from its target again: an older line is of an earlier run)."""
    events = metrics.parent / "events.jsonl"
    since = max((e.get("time", 0.0) for e in read_jsonl(events) if e.get("rollback_to") is not None
                 and e["rollback_to"] <= step), default=0.0) if events.exists() else 0.0
    return any(m.get("step") == step and m.get("time", 0.0) > since for m in read_jsonl(metrics))


def _next_recorded(metrics: Path) -> int:
    """The step after the last one the run's record holds (0: none)."""
    return max((m["step"] + 1 for m in read_jsonl(metrics)[-1:] if "step" in m), default=0)


def _rank(claimants: list[tuple[str, Adopted]], groups: bool) -> None:
    """The peers that claim one stage, the one that keeps it first (`Failover._serve`)."""
    if groups:
        claimants.sort(key=lambda x: (-_progress(x[1]), x[1].state == LEAVING, -x[1].epoch))
    else:
        claimants.sort(key=lambda x: (-x[1].epoch, -_progress(x[1]), x[1].state == LEAVING))


@dataclass
class Resumed:
    """Where a takeover found the run."""

    step: int  # the step the run goes on from
    whole: bool  # every stage served, none behind: the step before `step` is committed everywhere
    record: dict | None  # that step's metrics line rebuilt from the peers (the old coordinator died before writing it)


class Failover:
    """A standby coordinator's watch, and the takeover of a run from its peers."""

    def __init__(self, opts: CoordinatorOptions, rpc: Rpc, membership: Membership, retirement: Retirement,
                 table: StageTable, outputs: Outputs) -> None:
        self.opts, self.rpc, self.members, self.table, self.out = opts, rpc, membership, table, outputs
        self.retirement = retirement
        self.timeouts, self.run_id, self.secret = rpc.timeouts, rpc.run_id, rpc.secret
        self.cut_off: dict[str, int] = {}  # peer -> stage its heartbeat named, which never answered the ADOPT
        # a standby's copy of the run in its own run directory (None: a --takeover, which has none)
        self.copy = RecordCopy(opts.out) if opts.standby else None

    async def watch(self) -> None:
        """Standby: follow the run's coordinator (found in the DHT), bringing this standby's copy of the run up to date
        (a long poll of heartbeat_ttl/2: FOLLOW); return once it has failed to answer twice in a row."""
        assert self.copy is not None, "only a standby watches"
        self.copy.start()
        try:
            await self._watch(self.copy)
        finally:
            self.copy.close()

    async def _watch(self, copy: RecordCopy) -> None:
        key, watched, misses = coordinator_key(self.run_id), None, 0
        deadline = time.monotonic() + self.timeouts.join_timeout
        wait = self.timeouts.heartbeat_ttl / 2
        looked = -math.inf  # when the DHT was last read (every `wait` at most: an answer may come at once)
        while True:
            if time.monotonic() - looked >= wait:
                looked = time.monotonic()
                try:
                    found = await live_members_async(self.rpc.dht, key) or {}
                except Exception as e:  # the DHT read is advisory: the FOLLOW call decides
                    log.debug("DHT lookup of the coordinator failed: %r", e)
                    found = {}
                current = coordinator_from_records(found, self.secret, self.run_id, self.rpc.kind,
                                                   exclude=self.rpc.me)
                if current is not None and current != watched:
                    watched, misses = current, 0
                    print(f"standby: watching coordinator {watched}", flush=True)
            if watched is None:
                if time.monotonic() > deadline:
                    raise TransportError(f"no coordinator of run {self.run_id!r} found in the DHT within "
                                         f"join_timeout={self.timeouts.join_timeout:g} s: nothing to stand by for")
            else:
                try:
                    reply, _ = await self.rpc.call(watched, copy.request(wait),
                                                   timeout=wait + min(5.0, self.timeouts.rpc_timeout))
                    copy.apply(reply)
                    misses = 0
                    continue  # (the coordinator held the request until its record grew, or for `wait`)
                except CALL_ERRORS as e:
                    misses += 1
                    log.info("coordinator %s did not answer (%d): %s", watched, misses, e)
                if misses >= 2:
                    print(f"standby: coordinator {watched} stopped answering; taking over", flush=True)
                    return
            await asyncio.sleep(wait)

    async def adopt(self) -> tuple[RunConfig, dict[str, Adopted]]:
        """The run's peers (found by their DHT heartbeats) adopted by this coordinator: the run's config and each
        peer's report (its stage, the step its weights are ready for, its norm, a finished but uncommitted step,
        the snapshots it holds). A standby whose takeover is refused (the coordinator answers its peers after all)
        stands by again."""
        while True:
            try:
                replies = await self._adopt_peers()
                break
            except CoordinatorAlive as e:
                if not self.opts.standby:
                    raise
                print(f"standby: {e}; standing by again", flush=True)
                await self.watch()
        configs = {r.config for r in replies.values() if r.config}
        if not configs and (recorded := self._recorded()):
            configs = {recorded}
        if len(configs) != 1:
            raise RuntimeError(f"cannot take over run {self.run_id!r}: its peers report "
                               f"{'no' if not configs else 'different'} run configs")
        cfg = config_from_dict(json.loads(configs.pop()))
        if self.copy is not None and self.copy.storage and not cfg.strategy.storage_dir:
            # the checkpoints are where the old coordinator had them written, not in this standby's run directory
            cfg = dataclasses.replace(cfg, strategy=dataclasses.replace(cfg.strategy, storage_dir=self.copy.storage))
        return cfg, replies

    async def resume(self, cfg: RunConfig, replies: dict[str, Adopted], driver: StepDriver,
                     protection: Protection) -> Resumed:
        """Continue the run from the step its peers are at. If the old coordinator died half-way through a commit,
        the stages it did not reach (every replica of a stage group as far as the first) commit now, so every stage
        is at the same step; an unfinished step is dropped and run again. A stage nobody serves is recovered by the
        run's strategy like any failure."""
        t0 = time.perf_counter()
        metrics = Path(self.opts.out) / "metrics.jsonl"
        resume = metrics.exists()
        self.out.open(cfg, resume=resume)  # the same run directory: keep counting where the old one stopped
        holders: dict[int, list[tuple[str, Adopted]]] = {}
        for i, (pid, r) in enumerate(replies.items()):
            self.members.admit(pid, time.time() + i * 1e-6, configured=r.config is not None)
            if r.stage >= 0:
                holders.setdefault(r.stage, []).append((pid, r))
        self.table.epochs_seen(max((r.epoch for r in replies.values()), default=0))
        for hs in holders.values():
            _rank(hs, cfg.train.stage_groups)
        # (how far the run came: a stage's superseded claimant does not count)
        step = max((r.next_step for hs in holders.values() for _, r in (hs if cfg.train.stage_groups else hs[:1])),
                   default=None)
        if step is None:  # no peer serves a stage: the run's record says how far it came
            step = _next_recorded(metrics) if resume else 0
        to_commit, lagging = self._serve(cfg, holders, step)
        commits = await settle(self.rpc.call(pid, Commit(step=ready.step, attempt=ready.attempt), self.timeouts.rpc_timeout)
                               for pid, (_, ready) in to_commit.items())
        last_commits: dict[str, LastCommit] = {}  # peer -> the commit completed now (its last_commit)
        for (pid, (stage, ready)), c in zip(to_commit.items(), commits):
            if isinstance(c, Exception) and pid == self.table.peer(stage):
                lagging.append(stage)
                self.members.drop(pid)
            elif isinstance(c, Exception):  # a stage group's replica: the others go on without it
                self.table.leave(stage, pid)
                self.members.drop(pid)
            else:
                figures = {k: v for k, v in as_record(ready).items() if k in STEP_FIGURES}
                last_commits[pid] = LastCommit(step=step - 1, losses=ready.losses, lr=c[0].lr, post=c[0].post,
                                               **figures)
        await driver.abort()  # drop finished-but-uncommitted work of `step`
        seen = [r.finished for r in replies.values() if r.finished is not None]  # (step, attempt)
        seen += [(r.ready.step, r.ready.attempt) for r in replies.values() if r.ready is not None]
        # the re-run of `step` must not reuse an attempt number its peers saw (they refuse stale attempts)
        driver.attempts_from(step, max((a for st, a in seen if st == step and a < EVAL_ATTEMPT), default=-1) + 1)
        self._protection(replies, protection, step)
        record = self._missing_step(cfg, step - 1, replies, last_commits, metrics if resume else None)
        self._strays(cfg, step, metrics.parent / "events.jsonl" if resume else None)
        committed = sorted({stage for stage, _ in to_commit.values()})
        self.out.event("coordinator_takeover", step=step, peers=len(replies), stages=len(self.table.served()),
                       committed_stages=committed, lagging_stages=sorted(lagging),
                       missing_stages=sorted(set(range(cfg.num_stages)) - set(self.table.served())),
                       recorded_step=record is not None, takeover_s=round(time.perf_counter() - t0, 6))
        print(f"status: took over run {self.run_id!r} at step {step}: {len(self.table.served())}/{cfg.num_stages} "
              f"stages served, {len(self.members.standbys())} standby, {len(committed)} commits completed, "
              f"{len(lagging)} lagging stage(s)", flush=True)
        whole = not lagging and len(self.table.served()) == cfg.num_stages
        return Resumed(step, whole, record)

    def _strays(self, cfg: RunConfig, step: int, events: Path | None) -> None:
        """The peers whose heartbeat named a stage but which never answered the ADOPT (cut off as the coordinator
        changed) are failed peers, retired once they answer. One of a stage group that goes on without it is a lost
        replica, recorded here unless the old coordinator recorded it (`events`: its record, when shared)."""
        named = set()  # the peers the old coordinator's record already has out of the run
        if events is not None and events.exists():
            named = {e.get("peer_id") for e in read_jsonl(events) if e.get("event") in OUT_OF_THE_RUN}
        for pid, stage in sorted(self.cut_off.items()):
            self.retirement.stray(pid)
            log.warning("peer %s of stage %d did not answer the takeover: it is out of the run", pid, stage)
            if cfg.train.stage_groups and stage in self.table.served() and pid not in named:
                self.out.event("replica_lost", step=step, stage=stage, peer_id=pid, reason="cut off at the takeover",
                               replicas=len(self.table.group(stage)))

    def _serve(self, cfg: RunConfig, holders: dict[int, list[tuple[str, Adopted]]],
               step: int) -> tuple[dict[str, tuple[int, Ready]], list[int]]:
        """The stage table from the peers' reports: the newest peer of each stage serves it (a stage group's
        replicas as far as it beside it); the peers that finished the last step but did not commit it (peer ->
        (stage, the step it holds ready)), and the stages whose weights lag behind (failed).

        Two peers claim one stage when a handover was cut short, when one was done as the old coordinator died
        (the peer that handed its stage over is leaving), or when a partitioned peer is back after it was
        replaced. A stage's only peer is the one assigned last (`Adopted.epoch`: a stage is given to another peer
        only once its peer failed or left); a stage group keeps the replicas that came furthest (a step finished
        and ready to commit counts), a peer not leaving first, the one assigned last first. (By progress alone, a
        ReFT peer partitioned after its commit of a step and its replacement, rolled back and ready with that step
        again, tied: the stale one was kept and the healthy one retired, the seed-7 divergence #3.)"""
        to_commit: dict[str, tuple[int, Ready]] = {}
        lagging = []
        for stage, hs in sorted(holders.items()):
            pid, r = hs[0]  # (ranked: `_rank`)
            self.table.assign(stage, pid)
            if r.state == LEAVING:  # its leave (SIGTERM) is under way: handed over if a standby is free
                self.members.leaving_gracefully(pid)
            for other, o in hs[1:]:
                if cfg.train.stage_groups and _progress(o) == _progress(r) and o.state != LEAVING:
                    self.table.add_replica(stage, other)  # a stage group's replica
                else:
                    self.members.drop(other)
            if r.next_step < step - 1 or _progress(r) < step:  # its weights are behind the others: a failed stage
                lagging.append(stage)
                self.members.drop(pid)
                continue
            for p, o in hs:  # those a step behind with it finished (the old coordinator died mid-commit)
                if p in self.table.group(stage) and o.next_step == step - 1 and o.ready is not None:
                    to_commit[p] = (stage, o.ready)
        return to_commit, lagging

    async def _adopt_peers(self) -> dict[str, Adopted]:
        """ADOPT every peer with a live heartbeat, and every peer an adopted one names as a member of the newest
        step it took part in (`Adopted.members`), until every stage is served and every named peer answered or
        failed to; bounded by join_timeout. The heartbeats alone are not enough: while the DHT still routes to the
        dead coordinator's node, a peer's refresh stalls (`heartbeat_stall`) and its entry expires. With no stage
        served, the takeover waits two heartbeat TTLs and that stall (the run's config known, from some peer or
        else from the run directory) before it takes every stage for lost."""
        start = time.monotonic()
        replies: dict[str, Adopted] = {}
        refused: dict[str, str] = {}
        asked: set[str] = set()  # named peers ADOPTed once (those with a heartbeat are asked again while it lives)
        self.cut_off = {}
        me = self.rpc.me
        patience = 2 * self.timeouts.heartbeat_ttl + heartbeat_stall(self.rpc.dht)
        while True:
            try:
                live = await self.rpc.heartbeats()
            except Exception as e:
                log.warning("reading heartbeats failed: %r", e)
                live = {}
            named = self._unasked(replies, live, asked)
            asked.update(named)
            new = [p for p in live if p not in replies and p != me] + named
            adopted = await settle(self.rpc.adopt(p, self.timeouts.rpc_timeout) for p in new)
            for p, r in zip(new, adopted):
                if isinstance(r, RemoteError) and r.kind == Kind.COORDINATOR_ALIVE:
                    refused[p] = str(r)
                elif isinstance(r, Exception):  # (a stage's peer that never answers: `cut_off`)
                    if (stage := heartbeat_stage(live.get(p))) >= 0:
                        self.cut_off[p] = stage
                    continue
                elif self.secret is None or verify(join_token(self.secret, self.run_id, p), r.token):
                    replies[p] = r
                else:  # a stranger answering for a forged heartbeat must not hand us a stage
                    self.out.event("join_refused", peer_id=p, reason="ADOPT reply without a valid run token")
            if refused and not replies:
                raise CoordinatorAlive(next(iter(refused.values())))
            served = {r.stage for r in replies.values() if r.stage >= 0}
            waited = time.monotonic() - start
            cfg = next((r.config for r in replies.values() if r.config), None)
            if cfg is None and self.copy is not None:
                cfg = self.copy.config  # a standby's copy of it
            if cfg is None and waited > 2 * self.timeouts.heartbeat_ttl:
                cfg = self._recorded()  # no peer that knows it is left: the run directory's, if it is shared
            stages = json.loads(cfg)["num_stages"] if cfg else None
            unasked = self._unasked(replies, live, asked)  # named by the replies of this round
            # (none served in that time: every stage's peers died while no coordinator was there to see it, a
            # failure of every stage that the strategy plans for like any other)
            if stages is not None and not unasked and (len(served) >= stages or waited > patience):
                self.cut_off = {p: stage for p, stage in self.cut_off.items() if p not in replies}
                return replies
            if waited > self.timeouts.join_timeout:
                raise TransportError(f"no peer of run {self.run_id!r} answered within join_timeout="
                                     f"{self.timeouts.join_timeout:g} s: nothing to take over")
            await asyncio.sleep(0.2)

    def _unasked(self, replies: dict[str, Adopted], live: dict, asked: set[str]) -> list[str]:
        """The peers the adopted ones name as members of their newest step, and the members a standby's copy of the
        run names, that no ADOPT has reached through a heartbeat (`live`) or a name (`asked`), this one aside."""
        known = self.copy.members if self.copy is not None else {}
        named = dict.fromkeys([*known, *(p for r in replies.values() for p in r.members)])
        return [p for p in named if p not in replies and p not in live and p not in asked and p != self.rpc.me]

    def _recorded(self) -> str | None:
        """The run's config as its coordinator wrote it into the run directory (a standby's copy of it, or the
        directory it shares with the coordinator), for a takeover that finds no peer which knows it: every peer
        that had joined died with the coordinator, the spares never joined. None without one."""
        path = Path(self.opts.out) / "config.json"
        try:
            return path.read_text() if path.is_file() else None
        except OSError:
            return None

    def _protection(self, replies: dict[str, Adopted], protection: Protection, step: int) -> None:
        """Rollback strategies after a takeover: the newest in-memory copies the live peers hold (the copies the
        dead peers held are gone, as they are from the simulator's ledger: with every holder of a stage dead, that
        stage has none), and the newest complete checkpoint in storage."""
        by_step: dict[int, dict[int, set[int]]] = {}  # step -> stage -> holder stages
        for r in replies.values():
            if r.stage < 0:
                continue  # a standby holds no snapshot
            for stage, st in r.snapshots.items():
                by_step.setdefault(st, {}).setdefault(stage, set()).add(r.stage)
        newest = max(by_step, default=0)
        protection.adopted(newest, by_step.get(newest, {}), step)

    def _missing_step(self, cfg: RunConfig, step: int, replies: dict[str, Adopted], commits: dict[str, LastCommit],
                      metrics: Path | None) -> dict | None:
        """The record of the step the old coordinator committed but did not record (it died in between), rebuilt
        from the peers' last commits (and those completed now), the losses of every replica of a stage group
        merged, when they hold the loss of every microbatch: a stage whose peer died as well (killed mid-commit)
        has no figures in it (NaN, as in a record of the old coordinator's), and is recovered at the next step.
        None if there is none to rebuild."""
        if step < 0 or (metrics is not None and _recorded(step, metrics)):
            return None
        last: dict[int, LastCommit] = {}  # stage -> its last commit (its first replica's), every replica's losses
        for pid, r in replies.items():
            c = commits.get(pid) or r.last_commit
            if c is not None and pid in self.table.group(r.stage) and c.step == step:
                prev = last.get(r.stage)
                last[r.stage] = c if prev is None else msgspec.structs.replace(prev, losses={**prev.losses, **c.losses})
        if not last or set().union(*(c.losses for c in last.values())) != set(range(cfg.train.num_microbatches)):
            return None
        nan = LastCommit(step=step, post=math.nan, block_post=math.nan)
        return {"step": step, "loss": sum(v for c in last.values() for v in c.losses.values()),
                "lr": next(iter(last.values())).lr, "attempts": None,
                "grad_norms": [last.get(s, nan).post for s in range(cfg.num_stages)],
                "block_grad_norms": [last.get(s, nan).block_post for s in range(cfg.num_stages)],
                "live_peers": len(self.table.served()), "recorded_by": "takeover", **step_figures(last, cfg.num_stages)}
