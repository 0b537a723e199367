"""One step of the run: RUN_STEP to every stage peer (one attempt; the route table of its microbatches), the
soft-error rule (checkfree.steprules), the attempts of a step until one succeeds, and COMMIT once every stage is ready."""

from __future__ import annotations

import asyncio
import functools
import logging

from checkfree.net.transport import RemoteError
from checkfree.pipeline import route
from checkfree.protocol import RPC, Kind
from scheduler.common import EVAL_ATTEMPT

__all__ = ["StepsMixin"]

log = logging.getLogger("scheduler.coordinator")


class StepsMixin:
    """Part of `scheduler.coordinator.Coordinator` (see the module docstring); state lives on the coordinator."""

    # ---- steps ------------------------------------------------------------------------
    async def _all(self, name: str, header: dict, timeout: float) -> dict[int, dict | Exception]:
        """`name` on every stage's peer (every replica of a stage group); by stage, its primary's reply (a failed
        replica is reported)."""
        calls = [(s, p) for s in sorted(self.stage_peer) for p in self._group(s)]
        results = await asyncio.gather(*(self._call(p, name, header, timeout) for _, p in calls),
                                       return_exceptions=True)
        out = {}
        for (s, p), r in zip(calls, results):
            if p != self.stage_peer[s]:
                if isinstance(r, Exception) and not isinstance(r, RemoteError):
                    self.reported.add(p)
                continue
            out[s] = r if isinstance(r, Exception) else r[0]
        return out

    def _route_table(self, step: int, evaluate: bool) -> list[list[int]]:
        """Stage order of every microbatch of the step, CheckFree+ swaps included (announced so
        that peers can check they agree; evaluation runs the plain route)."""
        s, m = self.cfg.num_stages, self.cfg.train.num_microbatches
        if evaluate:
            return [list(range(s))] * self.cfg.train.eval_batches
        return [[h.stage for h in route(s, self.plus, step, mb, m)] for mb in range(m)]

    async def _attempt(self, step: int, attempt: int, evaluate: bool) -> dict[int, dict] | None:
        """One attempt: RUN_STEP on every stage; the first error aborts the attempt everywhere."""
        header = {"step": step, "attempt": attempt, "evaluate": evaluate,
                  "peers": {str(s): p for s, p in self.stage_peer.items()}, "routes": self._route_table(step, evaluate),
                  **({} if evaluate else self._backup_header(step))}
        if not evaluate and self._grouped():  # several replicas of some stage (an evaluation runs on the primaries)
            return await self._attempt_group(step, attempt, header)
        tasks = {s: asyncio.create_task(self._call(p, RPC.RUN_STEP, header, self.t.step_timeout + self.t.rpc_timeout))
                 for s, p in self.stage_peer.items()}
        done, pending = await asyncio.wait(tasks.values(), return_when=asyncio.FIRST_EXCEPTION)
        errors = {s: t.exception() for s, t in tasks.items() if t in done and t.exception() is not None}
        if not errors:
            results = {s: t.result()[0] for s, t in tasks.items()}
            if not evaluate:
                self._measure({self.stage_peer[s]: r for s, r in results.items()})
            return results
        if pending and any(getattr(e, "kind", None) in (Kind.STEP_TIMEOUT, Kind.STRAGGLER) for e in errors.values()):
            # every peer's step deadline passes at about the same time: hear them all before aborting,
            # since only the straggler itself can tell that its own computing filled the step
            _, pending = await asyncio.wait(pending, timeout=self.t.rpc_timeout)
            errors = {s: t.exception() for s, t in tasks.items() if t.done() and t.exception() is not None}
        await self._all(RPC.ABORT, {}, self.t.rpc_timeout)  # makes the others' RUN_STEP return at once
        if pending:  # (asyncio.wait refuses an empty set: every call may have failed at once)
            await asyncio.wait(pending, timeout=self.t.rpc_timeout)
        for t in pending:
            t.cancel()
        log.warning("step %d attempt %d failed: %s", step, attempt,
                    "; ".join(f"stage {s}: {str(e)[:200]}" for s, e in errors.items()))
        for s, e in errors.items():
            if not isinstance(e, RemoteError):  # the peer itself did not answer
                self.reported.add(self.stage_peer[s])
            elif e.kind == Kind.SOFT_ERROR:
                self.soft_counts[self.stage_peer[s]] = e.detail.get("soft_errors", {})
                self._soft_error(step, s)
            elif e.kind == Kind.STRAGGLER:  # slower than step_timeout: treated as failed, recovered before the retry
                pid = self.stage_peer[s]
                self._event("straggler", step=step, stage=s, peer_id=pid, reason=e.remote_message[:300])
                self.members[pid].leaving = True
        return None

    def _soft_error(self, step: int, stage: int, pid: str | None = None) -> None:
        """An uncorrectable soft error survived the peer's recompute: the attempt is redone;
        a stage that keeps producing them is treated as failed and recovered (checkfree.steprules); in a stage
        group the replica `pid` that produced them leaves its group."""
        event = functools.partial(self._event, step=step, strategy=self.cfg.recovery.strategy)
        if self.soft_rule.lost(stage, event):
            self.members[pid or self.stage_peer[stage]].leaving = True

    async def _run_step(self, step: int, evaluate: bool = False) -> dict[int, dict]:
        """Run a step (or an evaluation) to completion: recover failed stages, abort and retry
        an interrupted attempt. Evaluation attempts are numbered from EVAL_ATTEMPT so their
        messages never mix with the training step's."""
        base = EVAL_ATTEMPT if evaluate else self._attempt_floor.get(step, 0)
        for attempt in range(base, base + self.opts.max_attempts):
            failed = await self._detect()
            if failed:
                await self._recover(step, failed)
            if not evaluate:
                await self._fill_groups()
            results = await self._attempt(step, attempt, evaluate)
            if results is not None:
                self._last_attempt = attempt
                return results
            self._event("aborted_step", step=step, attempt=attempt, evaluate=evaluate)
        raise RuntimeError(f"step {step} failed {self.opts.max_attempts} times without a detectable peer failure; "
                           "check the peers' logs (slow peers: raise --step-timeout)")

    async def _commit(self, step: int) -> dict[int, dict]:
        await self._chaos_commit(step)  # no-op unless the local swarm asked this coordinator to die here
        results = await self._all(RPC.COMMIT, {"step": step, "attempt": self._last_attempt}, self.t.rpc_timeout)
        for s, r in results.items():
            if isinstance(r, Exception):  # dies between ready and commit: its replacement rebuilds next step
                self.reported.add(self.stage_peer[s])
        return results
