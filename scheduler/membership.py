"""The coordinator's membership: peers join (JOIN), report a failed neighbour (REPORT), leave (LEAVE) or ask
for the run's status (STATUS); failures are detected (expired DHT heartbeats, reports, failed pings), lost
replicas of a stage group leave it, failed peers that may still run are retired, a peer leaving gracefully
hands its exact state to a standby, and the run's end is announced to every peer. Membership decides who is
in the run only; which stage a peer serves is the stage table's (scheduler/stage_table.py)."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

from checkfree.auth import coordinator_proof, join_token, verify
from checkfree.config import RunConfig
from checkfree.net.transport import Handler, announce
from checkfree.messages import (REQUESTS, AssignHandover, Envelope, Join, Joined, Leave, Left, Message, Ok,
                                Report, RunStatus, Shutdown, Status, check_request, envelope, to_wire)
from checkfree.protocol import RUN_OVER, Kind, ProtocolError, coordinator_key, coordinator_record
from scheduler.common import CALL_ERRORS, Member, heartbeat_stage
from scheduler.outputs import Outputs
from scheduler.rpc import Rpc
from scheduler.stage_table import StageTable

__all__ = ["Membership", "Detection"]

log = logging.getLogger("scheduler.coordinator")


class Detection:
    """What one round of failure detection found: the stages whose every peer is gone (`failed`), and those whose
    leaving peer handed its state over to a standby (`handed_over`)."""

    def __init__(self, failed: set[int], handed_over: set[int]) -> None:
        self.failed, self.handed_over = failed, handed_over


class Membership:
    """The peers of the run, the suspects among them, and the retired ones."""

    def __init__(self, rpc: Rpc, table: StageTable, outputs: Outputs, step: Callable[[], int],
                 held: Callable[[int], dict[int, int]] = lambda stage: {}) -> None:
        self.rpc, self.table, self.out, self.step = rpc, table, outputs, step
        self.held = held  # the snapshots a stage's peer holds (owner stage -> step): a handover takes them along
        self.t, self.run_id, self.secret = rpc.t, rpc.run_id, rpc.secret
        self.cfg: RunConfig | None = None  # the run's, once known (a takeover adopts it from the peers)
        self.members: dict[str, Member] = {}
        self.reported: set[str] = set()  # suspects: reported unreachable or failing, not yet confirmed
        self._retired: set[str] = set()  # failed peers already told to shut down
        # peers that serve a stage but answer to a coordinator that is gone (cut off while this one took over the
        # run, or back after it): retiring one ADOPTs it first, or it would refuse this coordinator's SHUTDOWN
        self._strays: set[str] = set()
        self._retire_task: asyncio.Task | None = None
        self.joined = asyncio.Event()  # set when a peer joins
        self.reports = asyncio.Event()  # set when a peer reports another unreachable
        self.over: str | None = None  # the run's final status once it has ended (late joins are refused)
        self._live_seen: tuple[float, dict[str, dict]] | None = None  # (when, peers) of the newest heartbeat read

    def configure(self, cfg: RunConfig) -> None:
        self.cfg = cfg

    def end(self, status: str) -> None:
        self.over = status

    # ---- the peers' requests ---------------------------------------------------------------
    async def register(self) -> None:
        for kind, handler in ((Join, self.on_join), (Report, self.on_report), (Leave, self.on_leave),
                              (Status, self.on_status)):
            await self.rpc.register(kind.rpc, self._admitted(kind.rpc, handler))

    def _admitted(self, name: str, handler: Callable[[Any, Envelope, Any], Awaitable[Message]]) -> Handler:
        """`handler` behind the check of its request (checkfree.messages: its type, then the run it names): it gets
        the typed request and its envelope, and its typed reply goes on the wire."""
        assert name in REQUESTS

        async def admitted(header: dict, tensors: list, peer) -> tuple[dict, list]:
            request, env = check_request(name, header), envelope(header)
            if env.run != self.run_id:
                raise ProtocolError(f"request for run {env.run!r}; this coordinator runs {self.run_id!r}")
            reply = await handler(request, env, peer)
            return to_wire(reply), []

        return admitted

    async def on_join(self, join: Join, env: Envelope, peer) -> Joined:
        if self.over is not None:
            raise ProtocolError(f"{RUN_OVER}: run {self.run_id!r} has ended ({self.over}); nothing to join",
                                Kind.RUN_OVER)
        if self.cfg is None:
            raise ProtocolError("this coordinator is taking over the run; retry in a moment", Kind.TAKING_OVER)
        pid = str(peer)
        if join.peer_id != pid:
            raise ProtocolError(f"peer {pid} tried to join as {join.peer_id}")
        if self.secret is not None and not verify(join_token(self.secret, self.run_id, pid), env.token):
            self.out.event("join_refused", peer_id=pid, reason="bad or missing token")
            raise ProtocolError(f"peer {pid} is not authorized: missing or wrong run token (start it with the run's "
                                "secret: --secret-file or $CHECKFREE_SECRET)", Kind.UNAUTHORIZED)
        member = self.members.get(pid)
        if member is not None and (member.configured or member.leaving):
            raise ProtocolError(f"peer {pid} has already joined run {self.run_id!r} (duplicate join refused)")
        observer = join.role == "observer"
        if member is not None:  # adopted by this coordinator's takeover while its JOIN to the old one was under way
            member.configured = True  # (a member already: its JOIN is answered, with the config it lacks)
        else:
            self.admit(pid, time.time(), observer=observer)
        self.out.event("join", peer_id=pid, observer=observer)
        proof = coordinator_proof(self.secret, self.run_id, self.rpc.me, pid) if self.secret is not None else None
        return Joined(config=self.cfg.to_json(), status="standby", proof=proof)

    def admit(self, pid: str, joined: float, *, observer: bool = False, configured: bool = True) -> None:
        """`pid` is a member now (a JOIN, or a peer a takeover adopted; `configured`: it has the run's config)."""
        self.members[pid] = Member(pid, joined, observer=observer, configured=configured)
        self.joined.set()

    async def on_report(self, report: Report, env: Envelope, peer) -> Ok:
        reporter = self.members.get(str(peer))
        if reporter is None:
            raise ProtocolError(f"unknown peer {peer}: reports are accepted from members only")
        if reporter.leaving and self.table.stage_of(str(peer)) < 0:  # e.g. a partitioned peer's late report
            raise ProtocolError(f"peer {peer} was retired from the run: its report is ignored")
        if report.peer_id in self.table.group(report.stage):
            self.suspect(report.peer_id)
            self.reports.set()
            log.info("peer %s reports stage %d unreachable: %s", peer, report.stage, report.reason[:200])
        return Ok()

    async def on_leave(self, leave: Leave, env: Envelope, peer) -> Left:
        m = self.members.get(str(peer))
        if m is None:
            raise ProtocolError(f"unknown peer {peer}")
        stage = self.table.stage_of(m.peer_id)
        m.leaving = m.left = True
        # a replica with live siblings leaves at once: they hold the same state
        m.handover = stage >= 0 and bool(self.standbys()) and len(self.table.group(stage)) < 2
        self.out.event("leave", peer_id=m.peer_id, stage=stage, handover=m.handover)
        return Left(handover=m.handover)

    async def on_status(self, status: Status, env: Envelope, peer) -> RunStatus:
        if self.secret is not None and str(peer) not in self.members and not verify(
                join_token(self.secret, self.run_id, str(peer)), env.token):
            raise ProtocolError(f"unknown peer {peer}: status is for members only")
        if self.cfg is None:
            raise ProtocolError("this coordinator is not running the run (standby or taking over)")
        return RunStatus(step=self.step(), stages=self.table.primaries(), groups=self.table.groups(),
                         standby=self.standbys(), config=self.cfg.to_json())

    # ---- who is in the run -----------------------------------------------------------------
    def standbys(self) -> list[str]:
        """Live members serving no stage, oldest first."""
        return [m.peer_id for m in sorted(self.members.values(), key=lambda m: m.joined)
                if not m.leaving and not m.observer and m.peer_id not in self.reported
                and self.table.stage_of(m.peer_id) < 0]

    def suspect(self, pid: str) -> None:
        """`pid` did not answer (or was reported): a failure if a ping confirms it."""
        self.reported.add(pid)

    def clear(self, pid: str) -> None:
        """`pid` answered after all (a false report)."""
        self.reported.discard(pid)

    def drop(self, pid: str) -> None:
        """`pid` leaves the run: failed, lost, a straggler, broken weights, soft errors (retired if it still runs)."""
        self.members[pid].leaving = True

    def leaving_gracefully(self, pid: str) -> None:
        """`pid`'s leave (a SIGTERM) was under way when a takeover found it: handed over if a standby is free."""
        m = self.members[pid]
        m.leaving = m.left = m.handover = True

    def stray(self, pid: str) -> None:
        """`pid` serves a stage of this run but was never this coordinator's (a takeover could not ADOPT it): a
        failed peer, retired once it answers."""
        self.admit(pid, time.time())
        self.drop(pid)
        self._strays.add(pid)

    def leaving(self, pid: str) -> bool:
        return self.members[pid].leaving

    def live(self) -> list[str]:
        """The members still in the run (observers apart)."""
        return [m.peer_id for m in self.members.values() if not m.leaving and not m.observer]

    async def take_standby(self, why: str) -> str:
        """The oldest live standby; waits (visibly, bounded by join_timeout) if there is none."""
        start = time.monotonic()
        deadline = start + self.t.join_timeout
        while True:
            for pid in self.standbys():
                if await self.rpc.alive(pid):
                    return pid
                self.suspect(pid)
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no standby peer joined within join_timeout={self.t.join_timeout:g} s ({why}); "
                                   "start more peers with `checkfree peer --initial-peers ...`")
            if time.monotonic() - start > 2.0:
                self.out.status(f"waiting for a peer to {why} ({len(self.table.served())}/{self.cfg.num_stages} "
                                f"stages served, {left:.0f} s left)")
            self.joined.clear()
            try:
                await asyncio.wait_for(self.joined.wait(), min(left, 2.0 if time.monotonic() - start < 2 else 10.0))
            except asyncio.TimeoutError:
                pass

    # ---- failure detection -----------------------------------------------------------------
    async def detect(self) -> Detection:
        """Stages whose peer is gone (an expired heartbeat, a report confirmed by a failed ping, a leave), after the
        lost replicas of stage groups left them; a leaving peer's stage is handed over to a standby when it can."""
        try:
            live = await self.heartbeats()
        except Exception as e:  # the DHT read is advisory: pings decide
            log.warning("reading heartbeats failed: %r", e)
            live = None
        await self._prune(live)
        for pid, value in (live or {}).items():
            if pid not in self.members and pid != self.rpc.me and heartbeat_stage(value) >= 0:
                log.warning("peer %s serves stage %d but is not in run %r (cut off while its coordinator was "
                            "replaced): retiring it", pid, heartbeat_stage(value), self.run_id)
                self.stray(pid)
        failed, handed = set(), set()
        for stage, pid in self.table.primaries().items():
            m = self.members[pid]
            if m.handover and await self._handover(stage, pid):
                handed.add(stage)
                continue
            if await self._gone(pid, live):
                failed.add(stage)
        back = live is not None and any(p in live for p in self._unretired())
        if back and (self._retire_task is None or self._retire_task.done()):
            self._retire_task = asyncio.create_task(self.retire())  # a retired peer is back: tell it again
        # a stage nobody serves (its peer died while no coordinator was there to see it)
        return Detection(failed | (set(range(self.cfg.num_stages)) - set(self.table.served())), handed)

    async def heartbeats(self) -> dict[str, dict]:
        """Peers with a live DHT heartbeat (with a run secret: only records a member signed): the newest read if it
        is younger than a third of a heartbeat TTL (`watch_heartbeats` keeps it so while the coordinator runs),
        else a read now."""
        seen = self._live_seen
        if seen is not None and time.monotonic() - seen[0] < self.t.heartbeat_ttl / 3:
            return seen[1]
        return await self._read_heartbeats()

    async def _read_heartbeats(self) -> dict[str, dict]:
        live = await self.rpc.heartbeats()
        self._live_seen = (time.monotonic(), live)
        return live

    async def watch_heartbeats(self) -> None:
        """Read the heartbeats every ttl/4 (jittered) in the background: a step's failure detection then finds a
        fresh read instead of waiting for one between two steps (a DHT read is ~10 ms on a quiet machine, more on
        a busy one), and the DHT is read about once a second (ttl 4 s), not once per step. A heartbeat that
        expired is seen at most ttl/3 later than by a read of its own."""
        while True:
            try:
                await self._read_heartbeats()
            except Exception as e:  # the DHT read is advisory: `detect` reads again itself, pings decide
                log.debug("reading heartbeats failed: %r", e)
            await asyncio.sleep(self.t.heartbeat_ttl / 4 * random.uniform(0.8, 1.0))

    async def _gone(self, pid: str, live: dict | None) -> bool:
        """A suspect (leaving, reported, no heartbeat) that is leaving or does not answer a ping; a suspect that
        answers is cleared."""
        m = self.members[pid]
        if not (m.leaving or pid in self.reported or (live is not None and pid not in live)):
            return False
        if m.leaving or not await self.rpc.alive(pid):
            return True
        self.clear(pid)  # a false report (e.g. from a partitioned neighbour): it answers
        return False

    async def _prune(self, live: dict | None) -> None:
        """Between steps: replicas that are gone leave their group; a stage keeps at least one peer here (when all
        are gone it is a failed stage, recovered by the strategy)."""
        for stage in [s for s in self.table.served() if len(self.table.group(s)) > 1]:
            gone = [pid for pid in self.table.group(stage) if await self._gone(pid, live)]
            rest = [p for p in self.table.group(stage) if p not in gone]
            if gone and not [p for p in rest if await self.rpc.alive(p)]:  # (a group lost at once: not one by one)
                for p in rest:
                    self.suspect(p)
                continue  # the whole group: a failed stage (`detect`), recovered by the strategy
            for pid in gone:
                m = self.members[pid]
                self.lose_replica(stage, pid, "left" if m.left else "retired" if m.leaving else "gone")
                self.clear(pid)
                m.handover = False
            if gone:
                await self.retire()

    def lose_replica(self, stage: int, pid: str, reason: str) -> None:
        """`pid` no longer serves `stage` (lost, left or retired); a sibling goes on."""
        rest = self.table.leave(stage, pid, lost=True)
        self.drop(pid)
        self.out.event("replica_lost", step=self.step(), stage=stage, peer_id=pid, reason=reason, replicas=len(rest))

    def _unretired(self) -> list[str]:
        return [p for p, m in self.members.items()
                if m.leaving and self.table.stage_of(p) < 0 and p not in self._retired]

    async def retire(self) -> None:
        """Tell failed peers to shut down: a failed peer may still be running (broken weights, soft
        errors, a straggler, a partition). One that cannot be reached now is told again when its
        heartbeat reappears (a healed partition: see `detect`) and when the run ends."""
        pids = await self._adopt_strays(self._unretired())
        results = await self.rpc.gather(pids, Shutdown(), 2.0)
        for pid, r in zip(pids, results):
            if not isinstance(r, Exception) and pid not in self._retired:
                self._retired.add(pid)
                self.out.event("retired", step=self.step(), peer_id=pid)

    async def _adopt_strays(self, pids: list[str]) -> list[str]:
        """`pids` with the strays among them ADOPTed first (left out while they do not answer: next time)."""
        strays = [p for p in pids if p in self._strays]
        if not strays:
            return pids
        results = await asyncio.gather(*(self.rpc.adopt(p, min(10.0, self.t.rpc_timeout)) for p in strays),
                                       return_exceptions=True)
        for pid, r in zip(strays, results):
            if isinstance(r, Exception):
                log.info("stray peer %s could not be adopted to retire it: %s", pid, r)
            else:
                self._strays.discard(pid)
        return [p for p in pids if p not in self._strays]

    async def _handover(self, stage: int, pid: str) -> bool:
        """A peer leaving gracefully hands its exact state (weights and optimizer) to a standby:
        no recovery, nothing lost. False: it could not be done; the stage is then recovered."""
        self.members[pid].handover = False
        standbys = self.standbys()
        if not standbys:
            return False
        new = standbys[0]
        t0 = time.perf_counter()
        try:
            reply, _ = await self.rpc.call(new, AssignHandover(stage=stage, source=pid, step=self.step(),
                                                                   held=self.held(stage)),
                                           timeout=self.t.step_timeout)
        except CALL_ERRORS as e:
            log.warning("handover of stage %d from %s to %s failed: %s", stage, pid, new, e)
            self.suspect(new)
            return False
        self.table.assign(stage, new)
        self.out.event("handover", step=self.step(), stage=stage, strategy=self.cfg.recovery.strategy,
                       source_peer=pid, peer_id=new, bytes=reply.bytes,
                       handover_s=round(time.perf_counter() - t0, 6))
        (done,) = await self.rpc.gather([pid], Shutdown(), 5.0)
        if not isinstance(done, Exception):
            self._retired.add(pid)
        return True

    # ---- the run's presence ----------------------------------------------------------------
    async def announce(self) -> None:
        """The coordinator's record in the DHT, refreshed every heartbeat_ttl until cancelled."""
        while True:
            try:
                await announce(self.rpc.dht, coordinator_key(self.run_id), "main",
                               coordinator_record(self.secret, self.run_id, self.rpc.me, self.rpc.kind,
                                                  ttl=self.t.heartbeat_ttl * 3),
                               ttl=self.t.heartbeat_ttl * 3)
            except Exception as e:
                log.warning("announcing the coordinator failed: %r", e)
            await asyncio.sleep(self.t.heartbeat_ttl)

    async def shutdown_peers(self, reason: str) -> None:
        """The run is over: every live member is told (it exits unless started with --stay)."""
        await self.rpc.gather(self.live(), Shutdown(reason=reason), 5.0)
