"""The step driver: one attempt of a step (RUN_STEP to every stage peer, with the route table of its microbatches;
a group step's to every replica: coordinator/group_steps.py), what a failed attempt's errors mean (the soft-error
rule, checkfree.steprules; a straggler), and COMMIT once every stage is ready."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Mapping
from typing import TypeVar

from checkfree.config import RunConfig
from checkfree.net.transport import RemoteError
from checkfree.pipeline import route
from checkfree.messages import Abort, Commit, Committed, Request, RunStep, SoftErrors, StepDone, from_wire
from checkfree.protocol import Kind, ProtocolError
from checkfree.steprules import SoftErrorRule
from coordinator.common import CoordinatorOptions
from coordinator.members import Membership
from coordinator.outputs import Outputs
from coordinator.rpc import Rpc
from coordinator.group_steps import GroupSteps
from coordinator.stage_table import StageTable

__all__ = ["StepDriver"]

R = TypeVar("R")

log = logging.getLogger("coordinator.coordinator")


class StepDriver:
    """Step attempts and commits, and what their failures say about the peers."""

    def __init__(self, cfg: RunConfig, opts: CoordinatorOptions, rpc: Rpc, table: StageTable, membership: Membership,
                 outputs: Outputs, in_step: Callable[[int], dict], *, plus: bool) -> None:
        self.cfg, self.rpc, self.table, self.members, self.out = cfg, rpc, table, membership, outputs
        self.timeouts = rpc.timeouts
        self.plus = plus  # CheckFree+ routes
        self.in_step = in_step  # RUN_STEP fields of protection that travels inside the step (BAFT's backup parts)
        self.group_steps = GroupSteps(cfg, rpc, table, membership, outputs, self.replica_error, self.abort,
                                 opts.host_maddrs)
        self.soft_rule = SoftErrorRule()  # attempts lost in a row to each stage's soft errors
        self.soft_counts: dict[str, dict] = {}  # peer -> its guard's counters (dead peers' kept)
        self.last_attempt = 0  # the attempt number that completed the newest step
        self._first_attempt: dict[int, int] = {}  # step -> first attempt number (after a takeover)

    def speeds(self) -> Mapping[str, float]:
        """Each peer's measured speed (a group step's measure), read-only."""
        return self.group_steps.speeds()

    def first_attempt(self, step: int) -> int:
        return self._first_attempt.get(step, 0)

    def attempts_from(self, step: int, attempt: int) -> None:
        """A takeover: `step` runs again from `attempt` on (its peers refuse attempt numbers they saw)."""
        self._first_attempt[step] = attempt

    def succeeded(self, attempt: int) -> None:
        """`attempt` completed its step (the one COMMIT names)."""
        self.last_attempt = attempt

    async def all(self, message: Request[R], timeout: float) -> dict[int, R | Exception]:
        """`message` to every stage's peer (every replica of a stage group); by stage, its primary's reply (a failed
        replica is reported)."""
        calls = [(s, p) for s, g in self.table.groups().items() for p in g]
        results = await self.rpc.gather([p for _, p in calls], message, timeout)
        out: dict[int, R | Exception] = {}
        for (s, p), r in zip(calls, results):
            if p != self.table.peer(s):
                if isinstance(r, Exception) and not isinstance(r, RemoteError):
                    self.members.suspect(p)
                continue
            out[s] = r if isinstance(r, Exception) else r[0]
        return out

    async def abort(self) -> None:
        """ABORT on every peer of the run's stages: an attempt in flight ends there at once. A peer that does not
        answer is a suspect (the detection pings it), a stage's primary as well as its replicas: one cut off as its
        neighbour's group died, whose failed RUN_STEP came after the attempt had stopped, was otherwise left serving
        its stage and the rebuild of the neighbour pulled from it (issue 37, divergence #2)."""
        for s, r in (await self.all(Abort(), self.timeouts.rpc_timeout)).items():
            if isinstance(r, Exception) and not isinstance(r, RemoteError):
                self.members.suspect(self.table.peer(s))

    def route_table(self, step: int, evaluate: bool) -> list[list[int]]:
        """Stage order of every microbatch of the step, CheckFree+ swaps included (announced so
        that peers can check they agree; evaluation runs the plain route)."""
        s, m = self.cfg.num_stages, self.cfg.train.num_microbatches
        if evaluate:
            return [list(range(s))] * self.cfg.train.eval_batches
        return [[h.stage for h in route(s, self.plus, step, mb, m)] for mb in range(m)]

    async def attempt(self, step: int, attempt: int, evaluate: bool) -> dict[int, StepDone] | None:
        """One attempt: RUN_STEP on every stage; the first error aborts the attempt everywhere."""
        request = RunStep(step=step, attempt=attempt, evaluate=evaluate, peers=self.table.primaries(),
                          routes=self.route_table(step, evaluate), **({} if evaluate else self.in_step(step)))
        if not evaluate and self.table.grouped():  # several replicas of some stage (evaluations: the primaries)
            return await self.group_steps.attempt(step, attempt, request)
        peers = self.table.primaries()
        tasks = {s: asyncio.create_task(self.rpc.call(p, request, self.timeouts.step_timeout + self.timeouts.rpc_timeout))
                 for s, p in peers.items()}
        done, pending = await asyncio.wait(tasks.values(), return_when=asyncio.FIRST_EXCEPTION)
        errors = {s: t.exception() for s, t in tasks.items() if t in done and t.exception() is not None}
        if not errors:
            results = {s: t.result()[0] for s, t in tasks.items()}
            if not evaluate:
                self.group_steps.measure({peers[s]: r for s, r in results.items()})
            return results
        if pending and any(getattr(e, "kind", None) in (Kind.STEP_TIMEOUT, Kind.STRAGGLER) for e in errors.values()):
            # every peer's step deadline passes at about the same time: hear them all before aborting,
            # since only the straggler itself can tell that its own computing filled the step
            _, pending = await asyncio.wait(pending, timeout=self.timeouts.rpc_timeout)
            errors = {s: t.exception() for s, t in tasks.items() if t.done() and t.exception() is not None}
        await self.abort()  # makes the others' RUN_STEP return at once
        if pending:  # (asyncio.wait refuses an empty set: every call may have failed at once)
            await asyncio.wait(pending, timeout=self.timeouts.rpc_timeout)
        for t in pending:
            t.cancel()
        log.warning("step %d attempt %d failed: %s", step, attempt,
                    "; ".join(f"stage {s}: {str(e)[:200]}" for s, e in errors.items()))
        for s, e in errors.items():
            if not isinstance(e, RemoteError):  # the peer itself did not answer
                self.members.suspect(peers[s])
            else:
                self.replica_error(step, peers[s], e)
        return None

    def replica_error(self, step: int, pid: str, e: BaseException) -> None:
        """What a peer's failed RUN_STEP says about it: an uncorrectable soft error (the attempt is redone; a peer
        that keeps producing them is retired: its stage recovered, or in a stage group it leaves its group), or a
        straggler (slower than step_timeout: treated as failed)."""
        if not isinstance(e, RemoteError):  # (only a peer's own error reply says what it was)
            return
        stage, kind = self.table.stage_of(pid), e.kind
        if kind == Kind.SOFT_ERROR:
            self.soft_counts[pid] = soft_errors(e)
            event = functools.partial(self.out.event, step=step, strategy=self.cfg.recovery.strategy)
            if self.soft_rule.lost(stage, event):
                self.members.drop(pid)
        elif kind == Kind.STRAGGLER:
            self.out.event("straggler", step=step, stage=stage, peer_id=pid, reason=e.remote_message[:300])
            self.members.drop(pid)

    async def commit(self, step: int) -> dict[int, Committed | Exception]:
        """COMMIT of the finished attempt on every stage; a stage that dies between ready and commit is reported
        (its replacement rebuilds it before the next step)."""
        results = await self.all(Commit(step=step, attempt=self.last_attempt), self.timeouts.rpc_timeout)
        for s, r in results.items():
            if isinstance(r, Exception):
                self.members.suspect(self.table.peer(s))
        return results

    def committed(self, commits: dict[int, Committed | Exception]) -> None:
        """A step is committed: the soft-error rule starts over, each peer's guard counters are kept."""
        self.soft_rule.clear()
        for s, r in commits.items():
            if isinstance(r, Committed):
                self.soft_counts[self.table.peer(s)] = r.soft_errors


def soft_errors(e: RemoteError) -> dict[str, int]:
    """The soft-error guard's counters a SOFT_ERROR step failure carries (none when its detail is malformed)."""
    try:
        return from_wire(e.detail, SoftErrors, "error detail").soft_errors
    except ProtocolError:
        return {}
