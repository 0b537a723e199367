"""Stage groups on the coordinator: several replicas serve one stage (`train.replicas`, `train.reserve`).

Placement: standbys fill empty stages first (membership), then groups below `train.replicas` (the fewest
replicas first, then the slowest): all of them at the start, later (a group that lost a replica) only while
more than the reserve of standbys remain (`train.reserve`, default 1: a wholly lost stage needs a standby at
once); with `train.reserve` set, every standby beyond it joins the group of the slowest stage by measured speed
(checkfree.groups.slowest), once every stage has been measured. A new replica copies a live sibling's exact
state (weights, Adam, step), as a handover does.

A group step: RUN_STEP names, for every microbatch, the replica of each stage that computes it
(checkfree.groups.hop_table, balanced by the replicas' measured speed). A replica lost in the middle of the step
(its RUN_STEP call fails, or a neighbour reports it, and it does not answer a ping) costs no abort while a
sibling lives: REROUTE moves its microbatches to the sibling, which redoes them (peers/groups.py). Once every
microbatch is done, REDUCE sums each group's gradients (gloo, over this coordinator's TCPStore); a replica lost
in the reduce is handled the same way and the reduce runs again in the smaller group. Only when every replica
of a stage is gone is the attempt aborted and the stage recovered by the run's strategy, as with one peer per
stage.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import math
import time
from collections import Counter

from checkfree.groups import hop_table, move, slowest, stage_load
from checkfree.net.addresses import listen_ips
from checkfree.protocol import RPC, Kind
from scheduler.common import CALL_ERRORS

__all__ = ["GroupsMixin"]

log = logging.getLogger("scheduler.coordinator")

MAX_REDUCE_ROUNDS = 4  # reduces of one step attempt (each after a replica lost in the previous one)


class GroupsMixin:
    """Part of `scheduler.coordinator.Coordinator` (see the module docstring); state lives on the coordinator."""

    def _init_groups(self) -> None:
        self.extra: dict[int, list[str]] = {}  # stage -> its replicas beyond the primary (stage_peer)
        self.speeds: dict[str, float] = {}  # peer -> microbatches per second of computing, last measured
        self.group_gen: Counter[int] = Counter()  # stage -> generation of its membership (a new gloo group each)
        self.group_counts = {"replicas_lost": 0, "rerouted_microbatches": 0, "replicas_joined": 0}
        self._store = None  # the TCPStore the groups' gloo collectives meet at (made on first use)
        self._store_addr = ""
        self._report_event = asyncio.Event()
        self._rerouting: dict[str, tuple[int, float]] = {}  # sibling -> (stage, when it was given a lost replica's work)
        self._die_mid_step: dict[str, int] = {}  # chaos: replica -> step it dies in (after its first forward)
        self._die_in_reduce: dict[str, int] = {}  # chaos: replica -> step it dies in (half-way through the reduce)

    # ---- membership --------------------------------------------------------------------
    def _group(self, stage: int) -> list[str]:
        return [self.stage_peer[stage], *self.extra.get(stage, [])] if stage in self.stage_peer else []

    def _grouped(self) -> bool:
        """Whether a step runs as a group step now (some stage has more than one replica)."""
        return any(self.extra.values())

    def _groups_on(self) -> bool:
        """Whether the run uses stage groups at all (its metrics and summary carry their figures)."""
        return self.cfg.train.stage_groups or self._grouped()

    def _replica_counts(self) -> list[int]:
        return [len(self._group(s)) for s in range(self.cfg.num_stages)]

    def _stage_of(self, pid: str) -> int:
        m = self.members.get(pid)
        return m.stage if m is not None else -1

    def _leave_group(self, stage: int, pid: str) -> list[str]:
        """Take `pid` out of `stage`'s group (a sibling remains: the primary if `pid` was); the replicas left."""
        rest = [p for p in self._group(stage) if p != pid]
        self.stage_peer[stage], self.extra[stage] = rest[0], rest[1:]
        self.group_gen[stage] += 1
        return rest

    def _drop_replica(self, stage: int, pid: str, reason: str) -> None:
        """`pid` no longer serves `stage`: it is lost, left or retired."""
        rest = self._leave_group(stage, pid)
        self.members[pid].stage = -1
        self.members[pid].leaving = True
        self.group_counts["replicas_lost"] += 1
        self._event("replica_lost", step=self.step, stage=stage, peer_id=pid, reason=reason, replicas=len(rest))

    def _borrow_replica(self, step: int, lost: int) -> str | None:
        """No standby is left and `lost` must be rebuilt: take a replica from the group with the most replicas
        (the fastest of those groups, by measured load), which keeps the others. None: every group has one."""
        groups = {s: self._group(s) for s in self.stage_peer if s != lost}
        big = [s for s, g in groups.items() if len(g) >= 2]
        if not big:
            return None
        m = self.cfg.train.num_microbatches
        stage = max(big, key=lambda s: (len(groups[s]), -stage_load(m, groups[s], self.speeds), -s))
        pid = groups[stage][-1]
        rest = self._leave_group(stage, pid)
        self._event("replica_moved", step=step, stage=stage, peer_id=pid, to_stage=lost, replicas=len(rest))
        self._status(f"no standby: replica {pid[:12]} of stage {stage} leaves its group to rebuild stage {lost}")
        return pid

    async def _prune_groups(self, live: dict | None) -> None:
        """Between steps: replicas that are gone (no heartbeat and no answer, reported, leaving) leave their group;
        a stage keeps at least one peer here (when all are gone, membership's detection makes it a failed stage)."""
        for stage in [s for s, e in self.extra.items() if e]:
            gone = []
            for pid in self._group(stage):
                m = self.members[pid]
                suspect = m.leaving or pid in self.reported or (live is not None and pid not in live)
                if suspect and (m.leaving or not await self._alive(pid)):
                    gone.append(pid)
                elif suspect:
                    self.reported.discard(pid)
            rest = [p for p in self._group(stage) if p not in gone]
            if gone and not [p for p in rest if await self._alive(p)]:  # (a group lost at once: not one by one)
                self.reported.update(rest)
                continue  # the whole group: a failed stage (membership's detection), recovered by the strategy
            for pid in gone:
                m = self.members[pid]
                why = "left" if m.left else "retired" if m.leaving else "gone"  # (retired: soft errors, straggler)
                self._drop_replica(stage, pid, why)
                self.reported.discard(pid)
                m.handover = False
            if gone:
                await self._retire()

    async def _fill_groups(self) -> None:
        """Standbys join groups: below `train.replicas` first, then (with `train.reserve`) beyond it into the
        slowest measured stage."""
        cfg = self.cfg
        target, reserve, m = cfg.train.replicas, cfg.train.reserve, cfg.train.num_microbatches
        keep = 0 if self.iteration == 0 else 1 if reserve is None else reserve  # standbys kept for stage recoveries
        while len(self.stage_peer) == cfg.num_stages and (standbys := self._standbys()):
            groups = {s: self._group(s) for s in range(cfg.num_stages)}
            below = [s for s in groups if len(groups[s]) < target]
            if below and len(standbys) > keep:
                stage = min(below, key=lambda s: (len(groups[s]), -stage_load(m, groups[s], self.speeds), s))
            elif reserve is not None and len(standbys) > reserve and all(
                    p in self.speeds for g in groups.values() for p in g):
                stage = slowest(groups, m, self.speeds)
            else:
                return
            await self._add_replica(stage, standbys[0])  # (one that fails to join is no standby any more)

    async def _add_replica(self, stage: int, pid: str) -> None:
        """`pid` joins `stage`'s group with a copy of the primary's exact state."""
        source = self.stage_peer[stage]
        t0 = time.perf_counter()
        try:
            reply, _ = await self._call(pid, RPC.ASSIGN, {"stage": stage, "mode": "replica", "source": source,
                                                       "step": self.step, **self._slow_header(stage)},
                                        timeout=self.t.step_timeout)
        except CALL_ERRORS as e:
            log.warning("stage %d's new replica %s failed to join: %s", stage, pid, e)
            self.reported.add(pid)
            self.members[pid].leaving = True
            return
        self.members[pid].stage = stage
        self.extra.setdefault(stage, []).append(pid)
        self.group_gen[stage] += 1
        self.group_counts["replicas_joined"] += 1
        self._event("replica_joined", step=self.step, stage=stage, peer_id=pid, source=source,
                    bytes=reply.get("bytes", 0), join_s=round(time.perf_counter() - t0, 6),
                    replicas=len(self._group(stage)))
        self._status(f"peer {pid[:12]} joined stage {stage}'s group ({len(self._group(stage))} replicas), "
                     f"copied from {source[:12]}")

    # ---- a group step --------------------------------------------------------------------
    def _store_address(self) -> str:
        """host:port of the TCPStore every group's gloo collective meets at (started on first use)."""
        if self._store is None:
            import torch.distributed as dist

            ips = listen_ips(self.opts.host_maddrs)
            host = ips[0][1] if ips and ips[0][1] not in ("0.0.0.0", "::") else "127.0.0.1"
            self._store = dist.TCPStore(host, 0, None, True, timeout=datetime.timedelta(seconds=self.t.rpc_timeout),
                                        wait_for_workers=False)
            self._store_addr = f"{host}:{self._store.port}"
        return self._store_addr

    async def _attempt_group(self, step: int, attempt: int, header: dict) -> dict[int, dict] | None:
        """One attempt of a group step: RUN_STEP on every replica, lost replicas' microbatches moved to siblings
        on the way, then REDUCE in every group. None: the attempt was aborted (a whole stage lost, or an error
        that is not a lost replica); its failures are noted for `_detect`."""
        groups = {s: self._group(s) for s in range(self.cfg.num_stages)}
        hops = hop_table(header["routes"], groups, self.speeds)
        base = {**header, "hops": hops, "groups": {str(s): g for s, g in groups.items()}}
        replies: dict[str, dict] = {}
        tasks: dict[asyncio.Task, str] = {}
        for pid in (p for g in groups.values() for p in g):
            extra = {"chaos_die_after_forwards": 1} if self._die_mid_step.pop(pid, None) == step else {}
            tasks[asyncio.create_task(self._call(pid, RPC.RUN_STEP, {**base, **extra},
                                                 self.t.step_timeout + self.t.rpc_timeout))] = pid
        self._report_event.clear()
        ok = await self._drive(step, attempt, tasks, replies, groups, hops)
        rounds = 0
        while ok:
            reduced, dead = await self._reduce(step, attempt, groups, replies)
            if reduced:
                return self._merge(replies, groups, hops)
            rounds += 1
            if rounds >= MAX_REDUCE_ROUNDS:
                ok = False
                break
            tasks = {}
            for pid in dead:  # their siblings redo their microbatches, then every group reduces again
                if not await self._reroute(step, attempt, pid, groups, hops, tasks):
                    ok = False
                    break
            if ok:
                ok = await self._drive(step, attempt, tasks, replies, groups, hops)
        await self._abort_group(tasks)
        return None

    async def _drive(self, step: int, attempt: int, tasks: dict[asyncio.Task, str], replies: dict[str, dict],
                     groups: dict[int, list[str]], hops: list[list[str]]) -> bool:
        """Wait for `tasks` (RUN_STEP or REROUTE calls); a replica found dead on the way has its microbatches moved
        to a sibling. False: the attempt cannot complete (aborted by the caller)."""
        while tasks:
            waiter = asyncio.create_task(self._report_event.wait())
            done, _ = await asyncio.wait([*tasks, waiter], return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            self._report_event.clear()
            suspects = {p for p in self.reported if any(p in g for g in groups.values())}
            for t in [t for t in done if t in tasks]:
                pid = tasks.pop(t)
                if t.exception() is None:
                    reply = t.result()[0]
                    prev = replies.get(pid)
                    if "redone" in reply:  # a REROUTE's answer: the lost replica's microbatches are done
                        stage, t0 = self._rerouting.pop(pid, (self._stage_of(pid), time.perf_counter()))
                        since = time.perf_counter() - t0
                        self._event("reroute_done", step=step, stage=stage, peer_id=pid, microbatches=reply["redone"],
                                    redo_s=reply.get("redo_s"), since_lost_s=round(since, 6))
                        self._status(f"stage {stage}: {reply['redone']} microbatch(es) of the lost replica redone by "
                                     f"{pid[:12]}, {since:.2f} s after the loss; step {step} goes on")
                    if prev is not None:  # a RUN_STEP's and a REROUTE's answers, in either order: one
                        reply = {**prev, **reply, "losses": {**prev.get("losses", {}), **reply.get("losses", {})},
                                 "bytes_sent": max(int(prev.get("bytes_sent", 0)), int(reply.get("bytes_sent", 0)))}
                    replies[pid] = reply
                    continue
                e = t.exception()
                if any(pid in g for g in groups.values()):
                    suspects.add(pid)
                log.info("step %d: replica %s: %s", step, pid[:12], str(e)[:200])  # (a lost one: a status line)
                self._replica_error(step, pid, e)
            for pid in sorted(suspects):
                if not any(pid in g for g in groups.values()):
                    continue
                if await self._alive(pid):  # its step failed, or a pass to it was lost: the attempt is redone
                    self.reported.discard(pid)
                    return False
                if not await self._reroute(step, attempt, pid, groups, hops, tasks):
                    return False
        return True

    def _replica_error(self, step: int, pid: str, e: BaseException) -> None:
        """What a replica's failed RUN_STEP says, as for a stage's (a straggler or a soft-error source leaves its
        group before the attempt runs again)."""
        stage = self._stage_of(pid)
        if getattr(e, "kind", None) == Kind.SOFT_ERROR:
            self.soft_counts[pid] = e.detail.get("soft_errors", {})
            self._soft_error(step, stage, pid)
        elif getattr(e, "kind", None) == Kind.STRAGGLER:
            self._event("straggler", step=step, stage=stage, peer_id=pid, reason=e.remote_message[:300])
            self.members[pid].leaving = True

    async def _reroute(self, step: int, attempt: int, dead: str, groups: dict[int, list[str]],
                       hops: list[list[str]], tasks: dict[asyncio.Task, str]) -> bool:
        """Move the dead replica's microbatches to its least loaded live sibling: every other peer learns first,
        then the sibling redoes them (its call joins `tasks`). False: no sibling lives (a stage loss)."""
        stage = next(s for s, g in groups.items() if dead in g)
        self.reported.add(dead)
        siblings = [p for p in groups[stage] if p != dead]
        gone = [p for p in siblings if not await self._alive(p)]  # (each found in its turn, as `dead` is)
        self.reported.update(gone)
        if len(gone) == len(siblings):  # the whole group is lost: a stage failure (recovered by the strategy), not
            return False  # replicas lost one by one with their work moved to dead siblings
        live = [p for p in siblings if p not in gone]
        load = {p: sum(1 for row in hops if p in row) / max(self.speeds.get(p, 1.0), 1e-9) for p in live}
        to = min(live, key=lambda p: (load[p], live.index(p)))
        moved = move(hops, dead, to)
        self._drop_replica(stage, dead, "lost mid-step")
        groups[stage] = siblings
        self.reported.discard(dead)
        self.group_counts["rerouted_microbatches"] += len(moved)
        self._rerouting[to] = (stage, time.perf_counter())
        self._event("rerouted", step=step, stage=stage, microbatches=moved, **{"from": dead, "to": to})
        self._status(f"stage {stage}: replica {dead[:12]} lost in step {step}; microbatches {moved} go to {to[:12]} "
                     f"({len(siblings)} replica(s) left, no recovery)")
        for t in [t for t, p in tasks.items() if p == dead]:
            t.cancel()
            tasks.pop(t)
        header = {"step": step, "attempt": attempt, "dead": dead, "to": to, "mbs": moved}
        others = [p for g in groups.values() for p in g if p != to]
        results = await asyncio.gather(*(self._call(p, RPC.REROUTE, header, self.t.rpc_timeout) for p in others),
                                       return_exceptions=True)
        for p, r in zip(others, results):
            if isinstance(r, Exception):
                self.reported.add(p)
                self._report_event.set()
        tasks[asyncio.create_task(self._call(to, RPC.REROUTE, header, self.t.step_timeout + self.t.rpc_timeout))] = to
        return True

    async def _reduce(self, step: int, attempt: int, groups: dict[int, list[str]],
                      replies: dict[str, dict]) -> tuple[bool, list[str]]:
        """REDUCE on every replica (each group's gloo all-reduce, then the component exchange under CheckFree+):
        whether every one succeeded, and the replicas found dead in it (the survivors of their groups restored
        their own gradients; another round reduces again)."""
        store = self._store_address() if any(len(g) > 1 for g in groups.values()) else ""
        calls = {}
        for s, g in groups.items():
            gen = self.group_gen[s]
            victim = next((p for p in g if self._die_in_reduce.get(p) == step), None)
            for rank, pid in enumerate(g):
                h = {"step": step, "attempt": attempt, "store": store, "prefix": f"{self.opts.run_id}/s{s}/g{gen}/",
                     "rank": rank, "size": len(g), "buckets": 2 if victim else 1}
                if pid == victim:
                    h["chaos_die_in_reduce"] = True
                    del self._die_in_reduce[pid]
                calls[pid] = self._call(pid, RPC.REDUCE, h, self.t.step_timeout)
        pids = list(calls)
        results = await asyncio.gather(*calls.values(), return_exceptions=True)
        failed = [p for p, r in zip(pids, results) if isinstance(r, Exception)]
        for p, r in zip(pids, results):
            if not isinstance(r, Exception):
                replies.setdefault(p, {})["reduce_s"] = r[0].get("reduce_s")
        if not failed:
            return True, []
        log.warning("step %d: the gradient reduce failed on %s", step, ", ".join(p[:12] for p in failed))
        for s in {s for s, g in groups.items() if set(g) & set(failed)}:  # a new gloo group: the old one is broken
            self.group_gen[s] += 1
        return False, [p for p in failed if not await self._alive(p)]

    def _merge(self, replies: dict[str, dict], groups: dict[int, list[str]],
               hops: list[list[str]]) -> dict[int, dict]:
        """The replicas' replies as one per stage (what `_train` records): losses of every microbatch once, bytes
        summed, peaks the largest, the replicas' microbatch counts; measured speeds kept for the next step."""
        by_stage = {}
        for s, g in groups.items():
            rs = [replies.get(p, {}) for p in g]
            losses = {}
            for r in rs:
                losses.update(r.get("losses", {}))
            merged = {"losses": losses, "stage": s,
                      "bytes_sent": sum(int(r.get("bytes_sent", 0)) for r in rs),
                      "replica_microbatches": [sum(1 for row in hops if p in row) for p in g]}
            for k in ("inflight_peak", "activation_peak_bytes", "peak_rss_bytes", "reduce_s"):
                vals = [r[k] for r in rs if r.get(k) is not None]
                if vals:
                    merged[k] = max(vals)
            if any("hop_delay_s" in r for r in rs):
                merged["hop_delay_s"] = next(r["hop_delay_s"] for r in rs if "hop_delay_s" in r)
            by_stage[s] = merged
        self._measure(replies)
        return by_stage

    def _measure(self, replies: dict[str, dict]) -> None:
        """Each peer's speed (microbatches per second of its compute thread's busy time), averaged over its steps
        (half the weight on the newest: one noisy step on a shared machine does not starve a replica)."""
        for p, r in replies.items():
            n, busy = r.get("microbatches"), r.get("computing_s")
            if isinstance(n, int) and n > 0 and isinstance(busy, float) and busy > 0 and math.isfinite(busy):
                self.speeds[p] = n / busy if p not in self.speeds else 0.5 * (self.speeds[p] + n / busy)

    async def _abort_group(self, tasks: dict[asyncio.Task, str]) -> None:
        await self._all(RPC.ABORT, {}, self.t.rpc_timeout)
        if tasks:
            await asyncio.wait(list(tasks), timeout=self.t.rpc_timeout)
        for t in tasks:
            t.cancel()
