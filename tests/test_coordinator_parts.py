"""The coordinator's parts, each built alone with what it needs (coordinator/coordinator.py wires them), over the
in-process memory network (checkfree.net.in_memory). Peers here are a handful of request handlers that answer
what a part asks and record what it sent: the real peers meet the real coordinator in tests/test_inprocess.py.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest

from checkfree.net.in_memory import MEMORY, MemoryTransport
from checkfree.plans import Copies, Failure, Holder, Own, RecoveryPlan, Snapshot
from checkfree.messages import Envelope, Join, Leave, Left, Report
from checkfree.protocol import RPC, ProtocolError, Timeouts
from checkfree.strategies import build_strategy
from coordinator.common import CoordinatorOptions, Rollback, RunClock
from coordinator.detection import Detector
from coordinator.members import Membership
from coordinator.outputs import Outputs
from coordinator.placement import Placement
from coordinator.protection import Protection
from coordinator.recovery_driver import Recovery
from coordinator.retirement import Retirement
from coordinator.rpc import Rpc
from coordinator.stage_table import StageTable
from coordinator.step_driver import StepDriver

pytestmark = pytest.mark.timeout(60)

TIMEOUTS = Timeouts(heartbeat_ttl=0.5, rpc_timeout=2.0, step_timeout=4.0, join_timeout=8.0)


class Peers:
    """Peers on the memory network that answer each request with `answer(name, header)` and record it."""

    def __init__(self, n: int, answer: Callable[[str, str, dict], dict] | None = None) -> None:
        self.answer = answer or (lambda pid, name, header: {"ok": True})
        self.got: list[tuple[str, str, dict]] = []
        self.ids = []
        for _ in range(n):
            t = MemoryTransport(MEMORY)
            self.ids.append(t.peer_id)
            for name in (RPC.PING, RPC.ASSIGN, RPC.RESTORE, RPC.SNAPSHOT, RPC.RUN_STEP, RPC.COMMIT, RPC.ABORT,
                         RPC.SHUTDOWN, RPC.TAKE_REPLICA, RPC.ADOPT, RPC.BACKUP_START, RPC.BACKUP_COMMIT):
                asyncio.get_running_loop().create_task(t.register(name, self._handler(t.peer_id, name)))

    def _handler(self, pid: str, name: str):
        async def handle(header: dict, tensors: list, caller) -> tuple[dict, list]:
            self.got.append((pid, name, header))
            if name == RPC.PING:
                return {"stage": -1, "state": "standby"}, []
            return self.answer(pid, name, header), []
        return handle

    def sent(self, name: str) -> list[tuple[str, dict]]:
        return [(p, h) for p, n, h in self.got if n == name]


async def _parts(tmp_path, cfg=None):
    """A started Rpc and the parts every other needs: the stage table, outputs (a run directory) and membership."""
    MEMORY.reset()
    opts = CoordinatorOptions(run_id="parts", out=str(tmp_path), transport="memory", timeouts=TIMEOUTS)
    rpc = Rpc(opts)
    await rpc.start()
    table = StageTable()
    out = Outputs(opts, rpc, table)
    members = Membership(rpc, table, out, RunClock())
    if cfg is not None:
        out.open(cfg, resume=False)
        members.configure(cfg)
    return opts, rpc, table, out, members


def _retirement(rpc, table, members, out) -> Retirement:
    return Retirement(rpc, table, members, out, members.clock)


def _detector(cfg, opts, rpc, table, members, out, retirement=None) -> Detector:
    protection = Protection(cfg, opts, build_strategy(cfg), rpc, table, out)
    return Detector(cfg, rpc, table, members, retirement or _retirement(rpc, table, members, out), protection, out,
                    members.clock)


def _cfg(tiny_cfg, strategy="checkfree"):
    cfg = copy.deepcopy(tiny_cfg)
    cfg.recovery.strategy = strategy
    return cfg


def test_the_stage_table_is_the_one_record_of_who_serves_which_stage():
    table = StageTable()
    table.assign(0, "a")
    table.assign(1, "b")
    table.add_replica(1, "c")
    assert table.group(1) == ["b", "c"] and table.stage_of("c") == 1 and table.stage_of("z") == -1
    assert table.grouped() and table.replica_counts(3) == [1, 2, 0]
    gen = table.generation(1)
    assert table.leave(1, "b", lost=True) == ["c"] and table.peer(1) == "c"  # the sibling is the primary now
    assert table.generation(1) == gen + 1 and table.counts == {"replicas_joined": 1, "replicas_lost": 1}
    assert table.lose(1) == ["c"] and table.served() == [0] and table.stage_of("c") == -1


def test_a_peer_adopted_before_its_join_was_answered_gets_the_config_when_it_joins(tiny_cfg, tmp_path):
    """Found by dst (seed 41, 2 replays in 3): a spare whose JOIN to the old coordinator was under way when it died
    was adopted by the standby's takeover (a member, without the run's config); its JOIN to the new coordinator was
    then refused as a duplicate, it never learnt the config, and every ASSIGN to it failed: "no standby peer joined".
    Such a JOIN is answered with the config; a second one, or one from a member that had it, is still refused."""
    cfg = _cfg(tiny_cfg)

    async def main():
        _, rpc, table, out, members = await _parts(tmp_path, cfg)
        env = Envelope(run="parts")
        members.admit("spare", 0.0, configured=False)  # what a takeover does with an ADOPT reply without config
        members.admit("joined", 0.0)
        reply = await members.on_join(Join(peer_id="spare"), env, "spare")
        assert reply.config == cfg.to_json() and members.standbys() == ["spare", "joined"]
        for pid in ("spare", "joined"):
            with pytest.raises(ProtocolError, match="duplicate join"):
                await members.on_join(Join(peer_id=pid), env, pid)
        await rpc.stop()
    asyncio.run(main())


def test_membership_admits_suspects_and_detects_alone(tiny_cfg, tmp_path):
    """JOIN, a duplicate JOIN refused, a REPORT making a suspect, detection: a suspect that answers a ping is
    cleared, one that does not is a failed stage, a stage nobody serves is failed too; LEAVE asks for a handover
    when a standby can take it."""
    cfg = _cfg(tiny_cfg)

    async def main():
        opts, rpc, table, out, members = await _parts(tmp_path, cfg)
        peers = Peers(3)
        env = Envelope(run="parts")
        for pid in peers.ids:
            await members.on_join(Join(peer_id=pid), env, pid)
        with pytest.raises(ProtocolError, match="duplicate join"):
            await members.on_join(Join(peer_id=peers.ids[0]), env, peers.ids[0])
        assert members.standbys() == peers.ids
        table.assign(0, peers.ids[0])
        table.assign(1, peers.ids[1])
        assert members.standbys() == [peers.ids[2]]
        for pid in peers.ids[:2]:
            await members.on_report(Report(stage=table.stage_of(pid), peer_id=pid, reason="unreachable"), env,
                                    peers.ids[2])
        MEMORY.kill(peers.ids[1])
        found = await _detector(cfg, opts, rpc, table, members, out).detect()
        assert found.failed == {1} | set(range(2, cfg.num_stages)) and not found.handed_over
        assert members.view().suspects == {peers.ids[1]}  # the false report about peer 0 is cleared
        reply = await members.on_leave(Leave(), env, peers.ids[0])
        assert reply == Left(handover=True) and members.leaving(peers.ids[0])
        await rpc.stop()
    asyncio.run(main())


def test_a_peer_serving_a_stage_it_was_never_given_is_adopted_then_retired(tiny_cfg, tmp_path):
    """A peer whose heartbeat names a stage but which is not a member (cut off while a new coordinator took the run
    over, back after it): it answers to a coordinator that is gone and would refuse this one's SHUTDOWN, so it is
    ADOPTed, then retired; while it does not answer it is tried again. A peer still joining (no stage) is left be."""
    import time

    from checkfree.messages import Adopted, to_wire
    from checkfree.net.heartbeats import announce
    from checkfree.protocol import members_key
    from checkfree.rundir import read_jsonl

    cfg = _cfg(tiny_cfg)

    async def main():
        opts, rpc, table, out, members = await _parts(tmp_path, cfg)
        retirement = _retirement(rpc, table, members, out)
        detector = _detector(cfg, opts, rpc, table, members, out, retirement)
        down = set()

        def answer(pid, name, header):
            if pid in down:
                raise ConnectionError(f"{pid} is cut off")
            return to_wire(Adopted(stage=1, state="serving", next_step=3, omega=1.0)) if name == RPC.ADOPT \
                else {"ok": True}

        peers = Peers(3, answer)
        member, stray, joining = peers.ids
        await members.on_join(Join(peer_id=member), Envelope(run="parts"), member)
        table.assign(0, member)
        for pid, stage in ((member, 0), (stray, 1), (joining, -1)):
            await announce(rpc.dht, members_key("parts"), pid, {"stage": stage, "state": "serving"}, 60)
        down.add(stray)
        await detector.detect()
        await retirement._task
        assert members.known(stray) and members.leaving(stray) and not members.known(joining)
        assert not peers.sent(RPC.SHUTDOWN) and [p for p, _ in peers.sent(RPC.ADOPT)] == [stray]
        down.clear()  # back: adopted, then told to shut down
        detector._live_seen = (time.monotonic() - 1.0, detector._live_seen[1])  # (the next read is a new one)
        await detector.detect()
        await retirement._task
        assert [p for p, _ in peers.sent(RPC.ADOPT)] == [stray, stray]
        assert [p for p, _ in peers.sent(RPC.SHUTDOWN)] == [stray]
        assert [e["peer_id"] for e in read_jsonl(tmp_path / "events.jsonl") if e["event"] == "retired"] == [stray]
        await rpc.stop()
    asyncio.run(main())


def test_a_takeover_adopts_the_peers_whose_heartbeats_it_does_not_read(tiny_cfg, tmp_path):
    """A peer's DHT heartbeat can be missing when a coordinator takes over: its refresh stalls while the DHT still
    routes to the dead coordinator's node (measured 9 s on a vanished machine), and its entry expires. The takeover
    ADOPTs the peers an adopted peer names as members of its newest step (a replica it has no heartbeat of too);
    and, with no stage served yet, waits out two heartbeat TTLs and that stall before it takes every stage for
    lost."""
    import time

    from checkfree.messages import Adopted, to_wire
    from checkfree.net.heartbeats import announce
    from checkfree.protocol import members_key
    from coordinator.failover import Failover

    cfg = _cfg(tiny_cfg)
    stages = cfg.num_stages

    async def main():
        opts, rpc, table, out, members = await _parts(tmp_path, cfg)
        failover = Failover(opts, rpc, members, _retirement(rpc, table, members, out), table, out)
        peers = Peers(stages + 2, lambda pid, name, header: to_wire(Adopted(
            stage=serving.get(pid, -1), state="serving" if pid in serving else "standby", next_step=3, omega=1.0,
            config=cfg.to_json(), members=serving if pid in serving else {})))
        standby, replica, *primaries = peers.ids
        serving = {p: stage for stage, p in enumerate(primaries)} | {replica: 1}

        async def beat(pids):
            for pid in pids:
                await announce(rpc.dht, members_key("parts"), pid, {"stage": serving.get(pid, -1)}, 60)

        await beat([standby, *primaries])  # the replica's heartbeat is missing
        replies = await failover._adopt_peers()
        assert set(replies) == set(peers.ids) and replies[replica].stage == 1
        assert [p for p, _ in peers.sent(RPC.ADOPT)].count(replica) == 1

        MEMORY.reset()  # the same run taken over again: only the standby's heartbeat is read at first
        opts, rpc, table, out, members = await _parts(tmp_path, cfg)
        failover = Failover(opts, rpc, members, _retirement(rpc, table, members, out), table, out)
        rpc.dht.heartbeat_stall = stall = 3 * TIMEOUTS.heartbeat_ttl
        peers = Peers(stages + 2, peers.answer)
        standby, replica, *primaries = peers.ids
        serving = {p: stage for stage, p in enumerate(primaries)} | {replica: 1}
        await beat([standby])
        start = time.monotonic()
        late = asyncio.get_running_loop().call_later(2 * TIMEOUTS.heartbeat_ttl + stall / 2,
                                                     lambda: asyncio.ensure_future(beat(primaries[:1])))
        replies = await failover._adopt_peers()
        late.cancel()
        assert set(replies) == set(peers.ids), "the takeover gave up before the stalled heartbeats came back"
        assert time.monotonic() - start < 2 * TIMEOUTS.heartbeat_ttl + stall
        await rpc.stop()
    asyncio.run(main())


def test_placement_fills_every_stage_and_passes_over_a_peer_that_refuses(tiny_cfg, tmp_path):
    cfg = _cfg(tiny_cfg)

    async def main():
        _, rpc, table, out, members = await _parts(tmp_path, cfg)
        refuse = set()
        peers = Peers(cfg.num_stages + 1, lambda pid, name, h: (_ for _ in ()).throw(ProtocolError("no"))
                      if name == RPC.ASSIGN and pid in refuse else {"stage": h.get("stage")})
        refuse.add(peers.ids[1])
        for pid in peers.ids:
            members.admit(pid, 0.0)
        placement = Placement(cfg, rpc, table, members, out, SimpleNamespace(speeds=dict))
        await placement.fill(None, 0)
        assert table.served() == list(range(cfg.num_stages)) and peers.ids[1] not in table.primaries().values()
        assert members.leaving(peers.ids[1])  # it is retired, in case it goes on to host the stage anyway
        assert {h["mode"] for _, h in peers.sent(RPC.ASSIGN)} == {"fresh"}
        await rpc.stop()
    asyncio.run(main())


def test_the_step_driver_runs_an_attempt_and_reads_what_its_failure_says(tiny_cfg, tmp_path):
    """RUN_STEP names every stage's peer and the route table; an uncorrectable soft error of one stage fails the
    attempt, and the second one in a row retires that stage's peer."""
    from checkfree.protocol import Kind, StepFailed

    cfg = _cfg(tiny_cfg)

    async def main():
        opts, rpc, table, out, members = await _parts(tmp_path, cfg)
        soft = {"on": False}

        def answer(pid, name, h):
            if name == RPC.RUN_STEP and soft["on"] and pid == peers.ids[2]:
                raise StepFailed("soft error", Kind.SOFT_ERROR, {"soft_errors": {"escalated": 1}})
            return {"losses": {"0": 1.0}, "stage": table.stage_of(pid)} if name == RPC.RUN_STEP else {"ok": True}

        peers = Peers(cfg.num_stages, answer)
        for s, pid in enumerate(peers.ids):
            members.admit(pid, 0.0)
            table.assign(s, pid)
        driver = StepDriver(cfg, opts, rpc, table, members, out, lambda step: {}, plus=False)
        results = await driver.attempt(3, 0, evaluate=False)
        assert sorted(results) == list(range(cfg.num_stages))
        (_, header), *_ = peers.sent(RPC.RUN_STEP)
        assert header["routes"] == driver.route_table(3, False) and header["peers"]["2"] == peers.ids[2]
        soft["on"] = True
        assert await driver.attempt(3, 1, evaluate=False) is None and not members.leaving(peers.ids[2])
        assert await driver.attempt(3, 2, evaluate=False) is None and members.leaving(peers.ids[2])
        assert driver.soft_counts[peers.ids[2]] == {"escalated": 1} and peers.sent(RPC.ABORT)
        await rpc.stop()
    asyncio.run(main())


def test_protection_counts_a_snapshot_only_once_every_stage_took_it(tiny_cfg, tmp_path):
    cfg = _cfg(tiny_cfg, "gemini")

    async def main():
        opts, rpc, table, out, members = await _parts(tmp_path, cfg)
        fail = {"on": True}

        def answer(pid, name, h):
            if name == RPC.SNAPSHOT and fail["on"] and pid == peers.ids[3]:
                raise ProtocolError("disk full")
            return {"bytes": 100, "sent": 100}

        peers = Peers(cfg.num_stages, answer)
        for s, pid in enumerate(peers.ids):
            table.assign(s, pid)
        protection = Protection(cfg, opts, build_strategy(cfg), rpc, table, out)
        item = Snapshot(2, {0: (0, 1), 1: (0, 1), 2: (2, 3), 3: (2, 3)})
        await protection.protect_item(item, 2)
        assert protection.lost(set()).step == 0  # one stage failed it: no snapshot counts
        fail["on"] = False
        await protection.protect_item(item, 2)
        assert protection.lost(set()).holders(0) == [0, 1]
        assert [h["keep"]["peers"] for p, h in peers.sent(RPC.SNAPSHOT) if p == peers.ids[2]][-1] == peers.ids[2:]
        assert protection.lost({1}).holders(0) == [0]  # the copies a lost peer held are gone with it
        await rpc.stop()
    asyncio.run(main())


def test_a_baft_handover_puts_the_new_peer_in_the_leaving_ones_place_in_the_backup_in_flight(tiny_cfg, tmp_path):
    """BAFT, stage 1's peer handed over while a backup is in flight (the class of dst's
    baft-handover-backup-in-flight): the handover names the backup's step (the new peer takes the leaving peer's
    parts, peers/backups.py), the next steps' bubbles send stage 1's share from the new peer and stage 0's to it,
    and the seal counts the new peer's copies: the backup seals, as if nobody had left."""
    from checkfree.plans import BackupSeal

    cfg = _cfg(tiny_cfg, "baft")
    n = cfg.num_stages

    async def main():
        opts, rpc, table, out, members = await _parts(tmp_path, cfg)
        strategy = build_strategy(cfg)
        peers = Peers(n + 1, lambda pid, name, h: {"bytes": 1000, "units": [400, 600]} if name == RPC.BACKUP_START
                      else {"held": holds[pid]} if name == RPC.BACKUP_COMMIT else {"ok": True})
        for s in range(n):
            table.assign(s, peers.ids[s])
        protection = Protection(cfg, opts, strategy, rpc, table, out)
        for item in strategy.protection_due(0):  # the backup as of step 1 starts
            await protection.protect_item(item, 1)
        assert protection.backup_in_flight(1) == 1
        new = peers.ids[n]
        table.assign(1, new)  # (coordinator/detection.py: the handover to `new` went through)
        await protection.handed_over({1}, 1)
        # each peer holds its own stage's backup and those it is the holder of
        holds = {table.peer(h): sorted({h} | {s for s in range(n) if strategy.holder(s) == h}) for h in range(n)}
        holds[peers.ids[1]] = []  # the peer that left holds nothing any more
        step, sealed = 1, []
        while not sealed:
            share = protection.in_step(step)["backup"]
            assert share.holders == {s: table.peer(strategy.holder(s)) for s in range(n)}
            items = strategy.protection_due(step)
            sealed = [i for i in items if isinstance(i, BackupSeal)]
            for item in sealed:
                await protection.protect_item(item, step + 1)
            step += 1
        assert protection.lost(set()).step == 1
        assert {p for p, _ in peers.sent(RPC.BACKUP_COMMIT)} == set(table.primaries().values())
        await rpc.stop()
    asyncio.run(main())


def test_recovery_tells_each_peer_where_the_plan_says_to_pull_from(tiny_cfg, tmp_path):
    """A gemini rollback plan carried out alone: every live stage restores its own copy, the standby taking the lost
    stage pulls the copy from its holder's peer, the event names the holder's stage, and Rollback says where
    training resumes."""
    cfg = _cfg(tiny_cfg, "gemini")
    cfg.strategy.snapshot_every = 2

    async def main():
        opts, rpc, table, out, members = await _parts(tmp_path, cfg)
        peers = Peers(cfg.num_stages + 1, lambda pid, name, h: {"stage": h["stage"], "bytes": 10} if name == RPC.ASSIGN
                      else {"bytes": 10, "sent": 10} if name == RPC.SNAPSHOT else {"ok": True})
        for s, pid in enumerate(peers.ids):
            members.admit(pid, float(s))
            if s < cfg.num_stages:
                table.assign(s, pid)
        strategy = build_strategy(cfg)
        protection = Protection(cfg, opts, strategy, rpc, table, out)
        await protection.protect_item(strategy.protection_due(1)[0], 2)  # the snapshot of step 2
        placement = Placement(cfg, rpc, table, members, out, SimpleNamespace(speeds=dict))
        recovery = Recovery(cfg, strategy, rpc, table, members, _retirement(rpc, table, members, out), placement,
                            protection, out)
        lost = peers.ids[2]
        MEMORY.kill(lost)
        with pytest.raises(Rollback) as r:
            await recovery.recover(3, {2})
        assert r.value.step == 2
        restores = {p: h for p, h in peers.sent(RPC.RESTORE)}
        assert set(restores) == {peers.ids[s] for s in (0, 1, 3)}
        assert all(h == {"run": "parts", "step": 2, "origin": {"kind": "own"}} for h in restores.values())
        (new, assign), = [(p, h) for p, h in peers.sent(RPC.ASSIGN)]
        holder = strategy.restore_source(2, [3])
        assert new == peers.ids[-1] and assign["mode"] == "restore" and assign["origin"] == {
            "kind": "peer", "peer": peers.ids[holder]}
        assert table.peer(2) == new and members.leaving(lost)
        out.close("completed", None)
        from checkfree.rundir import read_jsonl

        (rec,) = [e for e in read_jsonl(tmp_path / "events.jsonl") if e["event"] == "recovery"]
        assert (rec["source"], rec["rollback_to"], rec["peer_id"]) == (holder, 2, new)
        await rpc.stop()
    asyncio.run(main())


def test_a_plan_is_a_value_the_strategy_returns(tiny_cfg):
    """The same call the simulator makes: gemini's plan for a lost stage whose partner lives."""
    cfg = _cfg(tiny_cfg, "gemini")
    copies = Copies()
    copies.taken(4, {s: hs for s, hs in enumerate(build_strategy(cfg).holders)})
    copies.lose({1})
    plan = build_strategy(cfg).recovery_plan(Failure(5, frozenset({1}), copies))
    assert plan == RecoveryPlan(5, frozenset({1}), {0: Own(), 1: Holder(0, 4), 2: Own(), 3: Own()}, rollback_to=4,
                                then=plan.then)
    assert [type(p).__name__ for p in plan.then] == ["Snapshot"]


ROOT = Path(__file__).resolve().parents[1]


def test_messages_are_read_as_types():
    """Peers and coordinator read typed messages (checkfree.messages): no header or reply is read as a dict."""
    found = [f"{p.relative_to(ROOT)}:{i}" for d in ("peers", "coordinator", "swarm", "faults", "ops") for p in sorted((ROOT / d).glob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if "header.get(" in line or "reply.get(" in line]
    assert not found, found
