"""The coordinator's membership: peers join (JOIN), report a failed neighbour (REPORT), leave (LEAVE) or
ask for the run's status (STATUS); standbys are assigned stages (ASSIGN); failures are detected (expired
DHT heartbeats, reports, failed pings); failed peers that may still run are retired; a peer leaving
gracefully hands its exact state to a standby; the run's end is announced to every peer."""

from __future__ import annotations

import asyncio
import logging
import time

import torch

from checkfree.auth import coordinator_proof, join_token, record_ok, verify
from checkfree.net.transport import announce, live_members_async
from checkfree.protocol import (
    RPC,
    RUN_OVER,
    Kind,
    ProtocolError,
    check_request,
    coordinator_key,
    coordinator_record,
    members_key,
)
from scheduler.common import CALL_ERRORS, Member

__all__ = ["MembershipMixin"]

log = logging.getLogger("scheduler.coordinator")


class MembershipMixin:
    """Part of `scheduler.coordinator.Coordinator` (see the module docstring); state lives on the coordinator."""

    # ---- peer-facing handlers ----------------------------------------------------------
    def _check_run(self, name: str, header: dict) -> None:
        """The request against its definition (checkfree.protocol.REQUEST_FIELDS), then the run it names."""
        check_request(name, header)
        if header["run"] != self.opts.run_id:
            raise ProtocolError(f"request for run {header['run']!r}; this coordinator runs {self.opts.run_id!r}")

    async def _on_join(self, header: dict, tensors: list, peer) -> tuple[dict, list]:
        self._check_run(RPC.JOIN, header)
        if self.over is not None:
            raise ProtocolError(f"{RUN_OVER}: run {self.opts.run_id!r} has ended ({self.over}); nothing to join",
                                Kind.RUN_OVER)
        if self.cfg is None:
            raise ProtocolError("this coordinator is taking over the run; retry in a moment", Kind.TAKING_OVER)
        pid = str(peer)
        if header["peer_id"] != pid:
            raise ProtocolError(f"peer {pid} tried to join as {header['peer_id']}")
        if self.secret is not None and not verify(join_token(self.secret, self.opts.run_id, pid), header.get("token")):
            self._event("join_refused", peer_id=pid, reason="bad or missing token")
            raise ProtocolError(f"peer {pid} is not authorized: missing or wrong run token (start it with the run's "
                                "secret: --secret-file or $CHECKFREE_SECRET)", Kind.UNAUTHORIZED)
        if pid in self.members:
            raise ProtocolError(f"peer {pid} has already joined run {self.opts.run_id!r} (duplicate join refused)")
        observer = header.get("role") == "observer"
        self.members[pid] = Member(pid, time.time(), observer=observer)
        self.member_event.set()
        self._event("join", peer_id=pid, observer=observer)
        reply = {"config": self.cfg.to_json(), "status": "standby"}
        if self.secret is not None:
            reply["proof"] = coordinator_proof(self.secret, self.opts.run_id, str(self.transport.peer_id), pid)
        return reply, []

    async def _on_report(self, header: dict, tensors: list, peer) -> tuple[dict, list]:
        self._check_run(RPC.REPORT, header)
        reporter = self.members.get(str(peer))
        if reporter is None:
            raise ProtocolError(f"unknown peer {peer}: reports are accepted from members only")
        if reporter.leaving and reporter.stage < 0:  # e.g. a partitioned peer's report arriving after it was replaced
            raise ProtocolError(f"peer {peer} was retired from the run: its report is ignored")
        if header["peer_id"] in self._group(header["stage"]):
            self.reported.add(header["peer_id"])
            self._report_event.set()
            log.info("peer %s reports stage %d unreachable: %s", peer, header["stage"], header["reason"][:200])
        return {"ok": True}, []

    async def _on_leave(self, header: dict, tensors: list, peer) -> tuple[dict, list]:
        self._check_run(RPC.LEAVE, header)
        m = self.members.get(str(peer))
        if m is None:
            raise ProtocolError(f"unknown peer {peer}")
        m.leaving = m.left = True
        # a replica with live siblings leaves at once: they hold the same state
        m.handover = m.stage >= 0 and bool(self._standbys()) and len(self._group(m.stage)) < 2
        self._event("leave", peer_id=m.peer_id, stage=m.stage, handover=m.handover)
        return {"ok": True, "handover": m.handover}, []

    async def _on_status(self, header: dict, tensors: list, peer) -> tuple[dict, list]:
        self._check_run(RPC.STATUS, header)
        if self.secret is not None and str(peer) not in self.members and not verify(
                join_token(self.secret, self.opts.run_id, str(peer)), header.get("token")):
            raise ProtocolError(f"unknown peer {peer}: status is for members only")
        if self.cfg is None:
            raise ProtocolError("this coordinator is not running the run (standby or taking over)")
        return {"step": self.step, "stages": {str(s): p for s, p in self.stage_peer.items()},
                "groups": {str(s): self._group(s) for s in self.stage_peer},
                "standby": self._standbys(), "config": self.cfg.to_json()}, []

    def _standbys(self) -> list[str]:
        return [m.peer_id for m in sorted(self.members.values(), key=lambda m: m.joined)
                if m.stage < 0 and not m.leaving and not m.observer and m.peer_id not in self.reported]

    async def _alive(self, pid: str) -> bool:
        try:
            await self._call(pid, RPC.PING, {}, timeout=min(5.0, self.t.rpc_timeout))
            return True
        except CALL_ERRORS:
            return False

    # ---- membership and assignment -----------------------------------------------------
    async def _take_standby(self, why: str) -> str:
        """The oldest live standby; waits (visibly, bounded by join_timeout) if there is none."""
        start = time.monotonic()
        deadline = start + self.t.join_timeout
        while True:
            for pid in self._standbys():
                if await self._alive(pid):
                    return pid
                self.reported.add(pid)
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no standby peer joined within join_timeout={self.t.join_timeout:g} s ({why}); "
                                   "start more peers with `checkfree peer --initial-peers ...`")
            if time.monotonic() - start > 2.0:
                self._status(f"waiting for a peer to {why} ({len(self.stage_peer)}/{self.cfg.num_stages} stages "
                             f"served, {left:.0f} s left)")
            self.member_event.clear()
            try:
                await asyncio.wait_for(self.member_event.wait(), min(left, 2.0 if time.monotonic() - start < 2 else 10.0))
            except asyncio.TimeoutError:
                pass

    async def _assign(self, stage: int, pid: str, header: dict, timeout: float | None = None, tensors=()) -> dict:
        """Give `stage` to `pid` (bounded by step_timeout unless told otherwise). A peer whose
        assignment fails is passed over and, in case it is merely slow and goes on to host the stage
        anyway, retired."""
        if self.members[pid].stage >= 0:  # a replica moved from its stage group: it lets its stage go first
            header = {**header, "release": True}
        try:
            reply, _ = await self._call(pid, RPC.ASSIGN, {"stage": stage, **header},
                                        timeout=timeout or self.t.step_timeout, tensors=tensors)
        except CALL_ERRORS:
            self.reported.add(pid)
            self.members[pid].leaving = True
            raise
        self.members[pid].stage = stage
        self.stage_peer[stage] = pid
        return reply

    async def _fill_initial(self, saved: dict[int, bytes] | None = None) -> None:
        """Give every stage to a standby, all at once (each peer builds its stage in parallel):
        fresh, or (resuming) loaded from the saved states. A failed assignment is retried with
        another standby."""
        while missing := [s for s in range(self.cfg.num_stages) if s not in self.stage_peer]:
            first = await self._take_standby(f"serve stage {missing[0]}")
            pids = [first, *[p for p in self._standbys() if p != first][:len(missing) - 1]]
            await asyncio.gather(*(self._assign_initial(s, pid, saved) for s, pid in zip(missing, pids)))

    async def _assign_initial(self, stage: int, pid: str, saved: dict[int, bytes] | None) -> None:
        mode, step = ("fresh", 0) if saved is None else ("load", self.step)
        tensors = () if saved is None else [torch.frombuffer(bytearray(saved[stage]), dtype=torch.uint8)]
        try:  # a peer starting up may take long to build its first stage: part of joining
            reply = await self._assign(stage, pid, {"mode": mode, "step": step, **self._slow_header(stage)},
                                       timeout=self.t.join_timeout, tensors=tensors)
        except CALL_ERRORS as e:
            log.warning("assigning stage %d to %s failed: %s", stage, pid, e)
            return
        self.norms[stage] = float(reply.get("omega", 0.0))
        self._event("assign", step=step, stage=stage, peer_id=pid, mode=mode)

    async def _detect(self) -> set[int]:
        """Stages whose peer is gone: expired heartbeat, a report confirmed by a failed ping, or a leave."""
        try:
            live = await self._heartbeats()
        except Exception as e:  # the DHT read is advisory: pings decide
            log.warning("reading heartbeats failed: %r", e)
            live = None
        await self._prune_groups(live)  # lost replicas of a group leave it (no recovery)
        failed = set()
        for stage, pid in list(self.stage_peer.items()):
            m = self.members[pid]
            if m.handover and await self._handover(stage, pid):
                continue
            suspect = m.leaving or pid in self.reported or (live is not None and pid not in live)
            if suspect and (m.leaving or not await self._alive(pid)):
                failed.add(stage)
            elif suspect:
                self.reported.discard(pid)  # a false report (e.g. from a partitioned neighbour): it answers
        back = live is not None and any(p in live for p in self._unretired())
        if back and (self._retire_task is None or self._retire_task.done()):
            self._retire_task = asyncio.create_task(self._retire())  # a retired peer is back: tell it again
        # a stage nobody serves (its peer died while no coordinator was there to see it)
        return failed | (set(range(self.cfg.num_stages)) - set(self.stage_peer))

    async def _heartbeats(self) -> dict[str, dict]:
        """Peers with a live DHT heartbeat (with a run secret: only records a member signed)."""
        found = await live_members_async(self.dht, members_key(self.opts.run_id)) or {}
        return {p: v for p, v in found.items() if record_ok(self.secret, self.opts.run_id, "member", p, v)}

    def _unretired(self) -> list[str]:
        return [p for p, m in self.members.items() if m.leaving and m.stage < 0 and p not in self._retired]

    async def _retire(self) -> None:
        """Tell failed peers to shut down: a failed peer may still be running (broken weights, soft
        errors, a straggler, a partition). One that cannot be reached now is told again when its
        heartbeat reappears (a healed partition: see _detect) and when the run ends."""
        pids = self._unretired()
        results = await asyncio.gather(*(self._call(p, RPC.SHUTDOWN, {}, timeout=2.0) for p in pids),
                                       return_exceptions=True)
        for pid, r in zip(pids, results):
            if not isinstance(r, Exception) and pid not in self._retired:
                self._retired.add(pid)
                self._event("retired", step=self.step, peer_id=pid)

    async def _handover(self, stage: int, pid: str) -> bool:
        """A peer leaving gracefully hands its exact state (weights and optimizer) to a standby:
        no recovery, nothing lost. False: it could not be done; the stage is then recovered."""
        self.members[pid].handover = False
        standbys = self._standbys()
        if not standbys:
            return False
        new = standbys[0]
        t0 = time.perf_counter()
        try:
            reply, _ = await self._call(new, RPC.ASSIGN, {"stage": stage, "mode": "handover", "source": pid,
                                                       "step": self.step}, timeout=self.t.step_timeout)
        except CALL_ERRORS as e:
            log.warning("handover of stage %d from %s to %s failed: %s", stage, pid, new, e)
            self.reported.add(new)
            return False
        self.members[new].stage, self.stage_peer[stage] = stage, new
        self.members[pid].stage = -1
        self.norms[stage] = float(reply.get("omega", self.norms[stage]))
        self._event("handover", step=self.step, stage=stage, strategy=self.cfg.recovery.strategy, source_peer=pid,
                    peer_id=new, bytes=reply.get("bytes", 0), handover_s=round(time.perf_counter() - t0, 6))
        if self.strategy.swarm_replicas:  # redundant computation: the leaving peer also held its successor's replica
            await self._replicate({stage}, self.step)
        (done,) = await asyncio.gather(self._call(pid, RPC.SHUTDOWN, {}, timeout=5.0), return_exceptions=True)
        if not isinstance(done, Exception):
            self._retired.add(pid)
        return True

    async def _announce(self, pid: str) -> None:
        while True:
            try:
                await announce(self.dht, coordinator_key(self.opts.run_id), "main",
                               coordinator_record(self.secret, self.opts.run_id, pid, self.transport.kind,
                                                  ttl=self.t.heartbeat_ttl * 3),
                               ttl=self.t.heartbeat_ttl * 3)
            except Exception as e:
                log.warning("announcing the coordinator failed: %r", e)
            await asyncio.sleep(self.t.heartbeat_ttl)

    async def _shutdown_peers(self, reason: str) -> None:
        live = [m.peer_id for m in self.members.values() if not m.leaving and not m.observer]
        await asyncio.gather(*(self._call(p, RPC.SHUTDOWN, {"reason": reason}, timeout=5.0) for p in live),
                             return_exceptions=True)
