"""The coordinator's membership: peers join (JOIN), report a failed neighbour (REPORT), leave (LEAVE) or ask
for the run's status (STATUS); who is in the run, the suspects among them and the standbys; a lost replica of a
stage group leaves it; the run's end is announced to every peer. Membership decides who is in the run only: which
stage a peer serves is the stage table's (coordinator/stage_table.py), failure detection the detector's
(coordinator/detection.py), telling failed peers to go the retirement's (coordinator/retirement.py)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from checkfree.auth import coordinator_proof, join_token, verify
from checkfree.config import RunConfig
from checkfree.net.transport import Handler
from checkfree.messages import (REQUESTS, Envelope, Join, Joined, Leave, Left, Message, Ok, Report, RunStatus,
                                Shutdown, Status, check_request, envelope, to_wire)
from checkfree.protocol import RUN_OVER, Kind, ProtocolError
from coordinator.common import Member, RunClock
from coordinator.outputs import Outputs
from coordinator.rpc import Rpc
from coordinator.stage_table import StageTable

__all__ = ["Membership", "MembersView"]

log = logging.getLogger("coordinator.coordinator")


@dataclass(frozen=True)
class MembersView:
    """Who is in the run, read at one moment (the dashboard's, a fault injector's)."""

    known: frozenset[str]  # every member, observers and the leaving included
    leaving: frozenset[str]  # failed, lost, retiring or left
    suspects: frozenset[str]  # reported or unanswering, not yet confirmed
    standbys: tuple[str, ...]  # live members serving no stage, oldest first
    over: str | None  # the run's final status once it has ended


class Membership:
    """The peers of the run and the suspects among them."""

    def __init__(self, rpc: Rpc, table: StageTable, outputs: Outputs, clock: RunClock) -> None:
        self.rpc, self.table, self.out, self.clock = rpc, table, outputs, clock
        self.timeouts, self.run_id, self.secret = rpc.timeouts, rpc.run_id, rpc.secret
        self.cfg: RunConfig | None = None  # the run's, once known (a takeover adopts it from the peers)
        self.members: dict[str, Member] = {}
        self.reported: set[str] = set()  # suspects: reported unreachable or failing, not yet confirmed
        self.joined = asyncio.Event()  # set when a peer joins
        self._reports = asyncio.Event()  # set when a peer is reported unreachable (`report`), until `take_reports`
        self.over: str | None = None  # the run's final status once it has ended (late joins are refused)

    def configure(self, cfg: RunConfig) -> None:
        self.cfg = cfg

    def end(self, status: str) -> None:
        self.over = status

    def view(self) -> MembersView:
        return MembersView(known=frozenset(self.members), leaving=frozenset(self.dropped()),
                           suspects=frozenset(self.reported), standbys=tuple(self.standbys()), over=self.over)

    # ---- the peers' requests ---------------------------------------------------------------
    async def register(self) -> None:
        for kind, handler in ((Join, self.on_join), (Report, self.on_report), (Leave, self.on_leave),
                              (Status, self.on_status)):
            await self.serve(kind, handler)

    async def serve(self, kind: Any, handler: Callable[[Any, Envelope, Any], Awaitable[Message]]) -> None:
        """Serve `kind`'s RPC with `handler`, behind the check of its request (`_admitted`)."""
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
            self.report(report.peer_id)
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
        return RunStatus(step=self.clock.step, stages=self.table.primaries(), groups=self.table.groups(),
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

    def report(self, pid: str) -> None:
        """`pid` was reported unreachable: a suspect, and whoever waits for reports (`wait_report`) is woken."""
        self.suspect(pid)
        self._reports.set()

    def take_reports(self) -> set[str]:
        """The suspects now; reports so far are seen (`wait_report` waits for the next one)."""
        self._reports.clear()
        return set(self.reported)

    async def wait_report(self) -> None:
        """Until a peer is reported unreachable after the last `take_reports`."""
        await self._reports.wait()

    def suspected(self, pid: str) -> bool:
        return pid in self.reported

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

    def leaving(self, pid: str) -> bool:
        return self.members[pid].leaving

    def known(self, pid: str) -> bool:
        return pid in self.members

    def why_gone(self, pid: str) -> str:
        """Why a member that is gone went: "left" (it said so), "retired" (dropped) or "gone"."""
        m = self.members[pid]
        return "left" if m.left else "retired" if m.leaving else "gone"

    def handing_over(self, pid: str) -> bool:
        """Whether `pid` is leaving gracefully and waits to hand its exact state to a standby."""
        return self.members[pid].handover

    def handover_done(self, pid: str) -> None:
        """`pid`'s handover was tried (done, or it could not be)."""
        self.members[pid].handover = False

    def dropped(self) -> list[str]:
        """Members that left the run (failed, lost, retiring or left), observers included."""
        return [p for p, m in self.members.items() if m.leaving]

    def live(self) -> list[str]:
        """The members still in the run (observers apart)."""
        return [m.peer_id for m in self.members.values() if not m.leaving and not m.observer]

    async def take_standby(self, why: str) -> str:
        """The oldest live standby; waits (visibly, bounded by join_timeout) if there is none."""
        start = time.monotonic()
        deadline = start + self.timeouts.join_timeout
        while True:
            for pid in self.standbys():
                if await self.rpc.alive(pid):
                    return pid
                self.suspect(pid)
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no standby peer joined within join_timeout={self.timeouts.join_timeout:g} s ({why}); "
                                   "start more peers with `checkfree peer --initial-peers ...`")
            if time.monotonic() - start > 2.0:
                stages = self.cfg.num_stages if self.cfg is not None else "?"
                self.out.status(f"waiting for a peer to {why} ({len(self.table.served())}/{stages} "
                                f"stages served, {left:.0f} s left)")
            self.joined.clear()
            try:
                await asyncio.wait_for(self.joined.wait(), min(left, 2.0 if time.monotonic() - start < 2 else 10.0))
            except asyncio.TimeoutError:
                pass

    def lose_replica(self, stage: int, pid: str, reason: str) -> None:
        """`pid` no longer serves `stage` (lost, left or retired); a sibling goes on."""
        rest = self.table.leave(stage, pid, lost=True)
        self.drop(pid)
        self.out.event("replica_lost", step=self.clock.step, stage=stage, peer_id=pid, reason=reason,
                       replicas=len(rest))

    async def shutdown_peers(self, reason: str) -> None:
        """The run is over: every live member is told (it exits unless started with --stay)."""
        await self.rpc.gather(self.live(), Shutdown(reason=reason), 5.0)
