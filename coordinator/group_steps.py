"""A step of stage groups (several replicas serve one stage: `train.replicas`, `train.reserve`).

RUN_STEP names, for every microbatch, the replica of each stage that computes it (checkfree.stage_groups.hop_table,
balanced by the replicas' measured speed). A replica lost in the middle of the step (its RUN_STEP call fails, or a
neighbour reports it, and it does not answer a ping) costs no abort while a sibling lives: REROUTE moves its
microbatches to the sibling, which redoes them (peers/replica_group.py). Once every microbatch is done, REDUCE sums
each group's gradients (gloo, over this coordinator's TCPStore); a replica lost in the reduce is handled the same
way and the reduce runs again in the smaller group. Only when every replica of a stage is gone is the attempt
aborted and the stage recovered by the run's strategy, as with one peer per stage.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from typing import Any
from types import MappingProxyType

from msgspec.structs import replace

from checkfree.config import RunConfig
from checkfree.stage_groups import hop_table, move
from checkfree.net.addresses import listen_ips
from checkfree.messages import Reduce, Reroute, Rerouted, RunStep, StepDone
from coordinator.common import settle
from coordinator.members import Membership
from coordinator.outputs import Outputs
from coordinator.rpc import Rpc
from coordinator.stage_table import StageTable

__all__ = ["GroupSteps"]

log = logging.getLogger("coordinator.coordinator")

MAX_REDUCE_ROUNDS = 4  # reduces of one step attempt (each after a replica lost in the previous one)


class GroupSteps:
    """The attempts of group steps, and each replica's measured speed."""

    def __init__(self, cfg: RunConfig, rpc: Rpc, table: StageTable, membership: Membership, outputs: Outputs,
                 on_error: Callable[[int, str, BaseException], None], abort: Callable[[], Awaitable[None]],
                 host_maddrs: list[str]) -> None:
        self.cfg, self.rpc, self.table, self.members, self.out = cfg, rpc, table, membership, outputs
        self.timeouts = rpc.timeouts
        self.on_error = on_error  # what a replica's failed RUN_STEP says (the step driver's rule, as for a stage)
        self.abort = abort  # ABORT on every peer of the step
        self.host_maddrs = host_maddrs
        self._speeds: dict[str, float] = {}  # peer -> microbatches per second of computing, last measured
        self.rerouted = 0  # microbatches moved to a sibling, this run
        self._rerouting: dict[str, tuple[int, float]] = {}  # sibling -> (stage, when it got a lost replica's work)
        self._store: Any = None  # the TCPStore the groups' gloo collectives meet at (made on first use)
        self._store_addr = ""

    def measure(self, replies: dict[str, StepDone]) -> None:
        """Each peer's speed (microbatches per second of its compute thread's busy time), averaged over its steps
        (half the weight on the newest: one noisy step on a shared machine does not starve a replica)."""
        for p, r in replies.items():
            n, busy = r.microbatches, r.computing_s
            if n > 0 and busy > 0 and math.isfinite(busy):
                self._speeds[p] = n / busy if p not in self._speeds else 0.5 * (self._speeds[p] + n / busy)

    def speeds(self) -> Mapping[str, float]:
        """Each replica's measured speed, microbatches per second (read-only)."""
        return MappingProxyType(self._speeds)

    def _store_address(self) -> str:
        """host:port of the TCPStore every group's gloo collective meets at (started on first use)."""
        if self._store is None:
            import torch.distributed as dist

            ips = listen_ips(self.host_maddrs)
            host = ips[0][1] if ips and ips[0][1] not in ("0.0.0.0", "::") else "127.0.0.1"
            store = self._store = dist.TCPStore(host, 0, None, True,
                                                timeout=datetime.timedelta(seconds=self.timeouts.rpc_timeout),
                                                wait_for_workers=False)
            self._store_addr = f"{host}:{store.port}"
        return self._store_addr

    async def attempt(self, step: int, attempt: int, request: RunStep) -> dict[int, StepDone] | None:
        """One attempt of a group step: RUN_STEP on every replica, lost
        replicas' microbatches moved to siblings on the way, then REDUCE in every group. None: the attempt was
        aborted (a whole stage lost, or an error that is not a lost replica); its failures are noted for detection."""
        groups = {s: self.table.group(s) for s in range(self.cfg.num_stages)}
        assert request.routes is not None  # (a training step's RUN_STEP names them)
        hops = hop_table(request.routes, groups, self._speeds)
        base = replace(request, hops=hops, groups=groups)
        replies: dict[str, StepDone] = {}
        timeout = self.timeouts.step_timeout + self.timeouts.rpc_timeout
        tasks = {asyncio.create_task(self.rpc.call(pid, base, timeout)): pid for g in groups.values() for pid in g}
        self.members.take_reports()  # (those before this attempt are seen)
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
        await self._abort(tasks)
        return None

    async def _drive(self, step: int, attempt: int, tasks: dict[asyncio.Task, str], replies: dict[str, StepDone],
                     groups: dict[int, list[str]], hops: list[list[str]]) -> bool:
        """Wait for `tasks` (RUN_STEP or REROUTE calls); a replica found dead on the way has its microbatches moved
        to a sibling. False: the attempt cannot complete (aborted by the caller)."""
        in_step = {p for g in groups.values() for p in g}
        finished: asyncio.Queue[asyncio.Task] = asyncio.Queue()  # each task once it is done (no wait over all)
        watched: set[asyncio.Task] = set()

        def watch() -> None:  # the calls not yet watched (the first ones, then a REROUTE's) report when done
            for t in tasks.keys() - watched:
                t.add_done_callback(finished.put_nowait)
                watched.add(t)

        watch()
        while tasks:
            done = await self._next_done(finished)
            suspects = {p for p in self.members.take_reports() if p in in_step}
            for t in [t for t in done if t in tasks]:
                pid = tasks.pop(t)
                error = t.exception()
                if error is None:
                    replies[pid] = self._answered(step, pid, replies.get(pid), t.result()[0])
                    continue
                suspects.add(pid)
                log.info("step %d: replica %s: %s", step, pid[:12], str(error)[:200])
                self.on_error(step, pid, error)
            for pid in suspects:  # every one is confirmed (a ping) by the detection after an abort too: the
                self.members.suspect(pid)  # failures of one attempt are planned together (seed-7 divergence #2)
            for pid in sorted(suspects):
                if not any(pid in g for g in groups.values()):
                    continue
                if await self.rpc.alive(pid):  # its step failed, or a pass to it was lost: the attempt is redone
                    self.members.clear(pid)
                    return False
                if not await self._reroute(step, attempt, pid, groups, hops, tasks):
                    return False
                watch()
        return True

    async def _next_done(self, finished: asyncio.Queue) -> set[asyncio.Task]:
        """The tasks done so far (at least one), or none once a failure is reported first. Waiting on the queue
        of done tasks keeps a step's waits linear in its calls (asyncio.wait over every pending call, each time
        one returns, made them quadratic)."""
        getter = asyncio.create_task(finished.get())
        waiter = asyncio.create_task(self.members.wait_report())
        await asyncio.wait([getter, waiter], return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        getter.cancel()
        done = {getter.result()} if getter.done() and not getter.cancelled() else set()
        while not finished.empty():
            done.add(finished.get_nowait())
        return done

    def _answered(self, step: int, pid: str, prev: StepDone | None, reply: StepDone | Rerouted) -> StepDone:
        """A replica's answer: a RUN_STEP's or a REROUTE's (its redone microbatches), merged in either order."""
        if isinstance(reply, Rerouted) and reply.redone is not None:
            stage, t0 = self._rerouting.pop(pid, (self.table.stage_of(pid), time.perf_counter()))
            since = time.perf_counter() - t0
            self.out.event("reroute_done", step=step, stage=stage, peer_id=pid, microbatches=reply.redone,
                           redo_s=reply.redo_s, since_lost_s=round(since, 6))
            self.out.status(f"stage {stage}: {reply.redone} microbatch(es) of the lost replica redone by "
                            f"{pid[:12]}, {since:.2f} s after the loss; step {step} goes on")
        done = reply if isinstance(reply, StepDone) else StepDone(losses=reply.losses, bytes_sent=reply.bytes_sent)
        if prev is None:
            return done
        return replace(done if isinstance(reply, StepDone) else prev, losses={**prev.losses, **reply.losses},
                       bytes_sent=max(prev.bytes_sent, reply.bytes_sent))

    async def _reroute(self, step: int, attempt: int, dead: str, groups: dict[int, list[str]],
                       hops: list[list[str]], tasks: dict[asyncio.Task, str]) -> bool:
        """Move the dead replica's microbatches to its least loaded live sibling: every other peer learns first,
        then the sibling redoes them (its call joins `tasks`). False: no sibling lives (a stage loss)."""
        stage = next(s for s, g in groups.items() if dead in g)
        self.members.suspect(dead)
        siblings = [p for p in groups[stage] if p != dead]
        gone = [p for p in siblings if not await self.rpc.alive(p)]  # (each found in its turn, as `dead` is)
        for p in gone:
            self.members.suspect(p)
        if len(gone) == len(siblings):  # the whole group is lost: a stage failure (recovered by the strategy), not
            return False  # replicas lost one by one with their work moved to dead siblings
        live = [p for p in siblings if p not in gone]
        load = {p: sum(1 for row in hops if p in row) / max(self._speeds.get(p, 1.0), 1e-9) for p in live}
        to = min(live, key=lambda p: (load[p], live.index(p)))
        moved = move(hops, dead, to)
        self.members.lose_replica(stage, dead, "lost mid-step")
        groups[stage] = siblings
        self.members.clear(dead)
        self.rerouted += len(moved)
        self._rerouting[to] = (stage, time.perf_counter())
        self.out.event("rerouted", step=step, stage=stage, microbatches=moved, **{"from": dead, "to": to})
        self.out.status(f"stage {stage}: replica {dead[:12]} lost in step {step}; microbatches {moved} go to "
                        f"{to[:12]} ({len(siblings)} replica(s) left, no recovery)")
        for t in [t for t, p in tasks.items() if p == dead]:
            t.cancel()
            tasks.pop(t)
        reroute = Reroute(step=step, attempt=attempt, dead=dead, to=to, mbs=moved)
        others = [p for g in groups.values() for p in g if p != to]
        for p, r in zip(others, await self.rpc.gather(others, reroute, self.timeouts.rpc_timeout)):
            if isinstance(r, Exception):
                self.members.report(p)
        tasks[asyncio.create_task(self.rpc.call(to, reroute, self.timeouts.step_timeout + self.timeouts.rpc_timeout))] = to
        return True

    async def _reduce(self, step: int, attempt: int, groups: dict[int, list[str]],
                      replies: dict[str, StepDone]) -> tuple[bool, list[str]]:
        """REDUCE on every replica (each group's gloo all-reduce, then the component exchange under CheckFree+):
        whether every one succeeded, and the replicas found dead in it (the survivors of their groups restored
        their own gradients; another round reduces again)."""
        store = self._store_address() if any(len(g) > 1 for g in groups.values()) else ""
        calls = {}
        for s, g in groups.items():
            for rank, pid in enumerate(g):
                reduce = Reduce(step=step, attempt=attempt, store=store, rank=rank, size=len(g),
                                prefix=f"{self.rpc.run_id}/s{s}/g{self.table.generation(s)}/")
                calls[pid] = self.rpc.call(pid, reduce, self.timeouts.step_timeout)
        pids = list(calls)
        results = await settle(calls.values())
        failed = [p for p, r in zip(pids, results) if isinstance(r, Exception)]
        for p, r in zip(pids, results):
            if not isinstance(r, Exception):
                replies[p] = replace(replies.get(p) or StepDone(), reduce_s=r[0].reduce_s)
        if not failed:
            return True, []
        log.warning("step %d: the gradient reduce failed on %s", step, ", ".join(p[:12] for p in failed))
        for s in {s for s, g in groups.items() if set(g) & set(failed)}:  # a new gloo group: the old one is broken
            self.table.renew(s)
        return False, [p for p in failed if not await self.rpc.alive(p)]

    def _merge(self, replies: dict[str, StepDone], groups: dict[int, list[str]],
               hops: list[list[str]]) -> dict[int, StepDone]:
        """The replicas' replies as one per stage (what the training loop records): losses of every microbatch
        once, bytes summed, peaks the largest, the replicas' microbatch counts; measured speeds kept."""
        by_stage = {}
        computed = Counter(p for row in hops for p in set(row))  # microbatches each replica computed, in one pass
        for s, g in groups.items():
            rs = [replies.get(p) or StepDone() for p in g]
            losses = {}
            for r in rs:
                losses.update(r.losses)

            def peak(name: str, rs: list[StepDone] = rs) -> Any:
                return max((v for r in rs if (v := getattr(r, name)) is not None), default=None)

            by_stage[s] = StepDone(
                losses=losses, stage=s, bytes_sent=sum(r.bytes_sent for r in rs),
                replica_microbatches=[computed[p] for p in g], inflight_peak=peak("inflight_peak"),
                activation_peak_bytes=peak("activation_peak_bytes"), peak_rss_bytes=peak("peak_rss_bytes"),
                reduce_s=peak("reduce_s"), hop_delay_s=next((r.hop_delay_s for r in rs if r.hop_delay_s), None))
        self.measure(replies)
        return by_stage

    async def _abort(self, tasks: dict[asyncio.Task, str]) -> None:
        await self.abort()
        if tasks:
            await asyncio.wait(list(tasks), timeout=self.timeouts.rpc_timeout)
        for t in tasks:
            t.cancel()
