"""A standby coordinator's copy of the run, over the network (FOLLOW; coordinator/record_feed.py): the coordinator
and the standby in-process on the memory network, each with a run directory of its own (no shared disk). The
real-process takeover of a run whose every stage died, by a standby in its own network namespace and directory, is
tests/test_failover.py's."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import pytest

from checkfree.messages import Adopted, BadReply, Follow, Following, check_request, to_wire
from checkfree.net.in_memory import MEMORY
from checkfree.net.transport import RemoteError
from checkfree.protocol import RPC, ProtocolError, Timeouts
from checkfree.rundir import read_jsonl
from coordinator.common import CoordinatorOptions, RunClock
from coordinator.members import Membership
from coordinator.outputs import Outputs
from coordinator.record_feed import RecordCopy, RecordFeed
from coordinator.rpc import Rpc
from coordinator.stage_table import StageTable

pytestmark = pytest.mark.timeout(60)

TIMEOUTS = Timeouts(heartbeat_ttl=0.5, rpc_timeout=1.0, step_timeout=4.0, join_timeout=8.0)


async def _coordinator(tmp_path, cfg):
    """A coordinator's parts that FOLLOW needs, serving it, with its run directory open (tmp_path/"run")."""
    MEMORY.reset()
    opts = CoordinatorOptions(run_id="feed", out=str(tmp_path / "run"), transport="memory", timeouts=TIMEOUTS)
    rpc = Rpc(opts)
    await rpc.start()
    table, clock = StageTable(), RunClock()
    out = Outputs(opts, rpc, table)
    members = Membership(rpc, table, out, clock)
    feed = RecordFeed(opts, rpc, members, table, clock, out)
    await members.serve(Follow, feed.on_follow)
    out.open(cfg, resume=False)
    members.configure(cfg)
    return rpc, table, clock, out, members, feed


async def _standby(tmp_path, name="standby"):
    opts = CoordinatorOptions(run_id="feed", out=str(tmp_path / name), transport="memory", timeouts=TIMEOUTS)
    rpc = Rpc(opts)
    await rpc.start()
    copy = RecordCopy(opts.out)
    copy.start()
    return rpc, copy


def _files(d) -> dict[str, str]:
    return {n: (d / n).read_text() for n in ("config.json", "metrics.jsonl", "events.jsonl")}


def test_a_standby_copies_the_run_into_its_own_directory_and_holds_each_step_before_the_next(tiny_cfg, tmp_path):
    """The first FOLLOW copies the config, the record and the membership; a long poll is answered as soon as the
    record grows (not at the end of its wait); the coordinator's `synced` after a step's line returns once the
    standby asked again with that line copied, and gives up on a standby that does not ask (rpc_timeout)."""
    async def main():
        rpc, table, clock, out, members, feed = await _coordinator(tmp_path, tiny_cfg)
        members.admit("p0", 0.0)
        members.admit("p1", 1.0)
        table.assign(0, "p0")
        clock.at(3)
        out.metric({"step": 0, "loss": 1.5})
        srpc, copy = await _standby(tmp_path)

        async def follow(wait):
            reply, _ = await srpc.call(rpc.me, copy.request(wait), timeout=wait + 5)
            return copy.apply(reply)

        assert await follow(0.0)
        assert copy.shared is False and copy.step == 3 and copy.members == {"p0": 0, "p1": -1}
        assert _files(tmp_path / "standby") == _files(tmp_path / "run")
        assert json.loads(copy.config or "")["num_stages"] == tiny_cfg.num_stages

        t0 = time.monotonic()
        poll = asyncio.ensure_future(follow(30.0))  # nothing new: held ...
        await asyncio.sleep(0.1)
        assert not poll.done()
        out.metric({"step": 1, "loss": 1.25})  # ... until the record grows
        assert await poll and time.monotonic() - t0 < 5
        assert _files(tmp_path / "standby") == _files(tmp_path / "run")

        poll = asyncio.ensure_future(follow(30.0))
        await asyncio.sleep(0.1)
        out.metric({"step": 2, "loss": 1.0})
        await poll  # the line is copied: the standby's next request says so
        again = asyncio.ensure_future(follow(30.0))
        await asyncio.wait_for(feed.synced(), 5)
        assert [m["step"] for m in read_jsonl(tmp_path / "standby" / "metrics.jsonl")] == [0, 1, 2]
        out.event("failure", step=3, stage=0)
        await again

        await srpc.stop()  # a standby that asks no more: not waited for beyond rpc_timeout, then not at all
        out.metric({"step": 3, "loss": 0.9})
        t0 = time.monotonic()
        await feed.synced()
        assert TIMEOUTS.rpc_timeout <= time.monotonic() - t0 < TIMEOUTS.rpc_timeout + 2
        t0 = time.monotonic()
        await feed.synced()
        assert time.monotonic() - t0 < 0.5
        copy.close()
        assert not list((tmp_path / "standby").glob(".standby-*"))
        await rpc.stop()
    asyncio.run(main())


def test_a_standby_that_shares_the_run_directory_copies_nothing(tiny_cfg, tmp_path):
    async def main():
        rpc, _, _, out, _, _ = await _coordinator(tmp_path, tiny_cfg)
        out.metric({"step": 0, "loss": 1.5})
        before = _files(tmp_path / "run")
        srpc, copy = await _standby(tmp_path, "run")  # the coordinator's own directory
        for _ in range(2):
            reply, _ = await srpc.call(rpc.me, copy.request(0.0), timeout=5)
            copy.apply(reply)
        assert copy.shared is True and not reply.metrics and not reply.events
        assert _files(tmp_path / "run") == before  # no line written twice
        copy.close()
        assert not list((tmp_path / "run").glob(".standby-*"))
        await srpc.stop()
        await rpc.stop()
    asyncio.run(main())


def test_a_copy_longer_than_the_record_starts_again_and_a_stale_directory_is_overwritten(tiny_cfg, tmp_path):
    """A record rewritten shorter (a takeover dropped a cut last line) is copied again from its start; whatever an
    earlier run left in the standby's directory is replaced by the copy at the first answer."""
    async def main():
        rpc, _, _, out, _, _ = await _coordinator(tmp_path, tiny_cfg)
        out.metric({"step": 0, "loss": 1.5})
        (tmp_path / "standby").mkdir()
        (tmp_path / "standby" / "metrics.jsonl").write_text('{"step": 7, "loss": 9.0}\n')
        srpc, copy = await _standby(tmp_path)
        reply, _ = await srpc.call(rpc.me, copy.request(0.0), timeout=5)
        copy.apply(reply)
        assert _files(tmp_path / "standby") == _files(tmp_path / "run")
        copy.held[0] += 1000  # ahead of the record
        reply, _ = await srpc.call(rpc.me, copy.request(0.0), timeout=5)
        assert reply.restart
        copy.apply(reply)
        assert _files(tmp_path / "standby") == _files(tmp_path / "run")
        copy.close()
        await srpc.stop()
        await rpc.stop()
    asyncio.run(main())


def test_malformed_follow_requests_and_replies_are_refused_with_what_is_wrong(tiny_cfg, tmp_path):
    with pytest.raises(ProtocolError, match="missing field 'probe'"):
        check_request(RPC.FOLLOW, {"run": "feed"})
    with pytest.raises(ProtocolError, match="field 'metrics' must be int"):
        check_request(RPC.FOLLOW, {"run": "feed", "probe": "ab" * 8, "metrics": "0"})

    async def main():
        rpc, _, _, _, members, _ = await _coordinator(tmp_path, tiny_cfg)
        srpc, copy = await _standby(tmp_path)
        for bad, said in ((Follow(probe="../../etc/passwd"), "is not 16-64 lowercase hex digits"),
                          (Follow(probe=copy.probe, events=-1), "offsets must be >= 0"),
                          (Follow(probe=copy.probe, wait=3600.0), "wait must be within")):
            with pytest.raises(RemoteError, match=said):
                await srpc.call(rpc.me, bad, timeout=5)
        members.cfg = None  # a coordinator that is taking over itself has no run to give
        with pytest.raises(RemoteError, match="not running the run"):
            await srpc.call(rpc.me, copy.request(0.0), timeout=5)
        copy.close()
        await srpc.stop()
        await rpc.stop()
    asyncio.run(main())
    copy = RecordCopy(str(tmp_path / "x"))
    good = Following(config=tiny_cfg.to_json(), step=0)
    for reply, said in ((Following(config="{not json", step=0), "config is not JSON"),
                        (Following(config="[]", step=0), "names no num_stages"),
                        (Following(config=good.config, step=0, events='{"event": "x"'), "cut line")):
        with pytest.raises(BadReply, match=said):
            copy.apply(reply)
    assert copy.shared is None and not (tmp_path / "x").exists()  # nothing taken from a malformed reply


def test_a_standby_takes_over_a_run_none_of_whose_stages_is_served_from_its_copy(tiny_cfg, tmp_path):
    """Every stage's peer died with the coordinator and the spares never joined: no peer knows the run's config or
    how far it came. The standby's copy does: the takeover ADOPTs the members the copy names (a spare with no
    heartbeat among them) and reads the config from the copy, with the checkpoints' storage the coordinator used."""
    from checkfree.net.in_memory import MemoryTransport
    from coordinator.failover import Failover
    from coordinator.retirement import Retirement

    async def main():
        rpc, table, clock, out, members, _ = await _coordinator(tmp_path, tiny_cfg)
        spare = MemoryTransport(MEMORY)
        asked = []

        async def adopt(header, tensors, caller):
            asked.append(str(caller))
            return to_wire(Adopted(stage=-1, state="standby", next_step=0, omega=1.0)), []

        await spare.register(RPC.ADOPT, adopt)
        members.admit(spare.peer_id, 0.0)
        members.admit("dead", 0.0)
        table.assign(0, "dead")
        for step in range(3):
            out.metric({"step": step, "loss": 2.0 - step})
        clock.at(3)
        opts = CoordinatorOptions(run_id="feed", out=str(tmp_path / "standby"), transport="memory",
                                  timeouts=TIMEOUTS, standby=True)
        srpc = Rpc(opts)
        await srpc.start()
        stable, sclock = StageTable(), RunClock()
        sout = Outputs(opts, srpc, stable)
        smembers = Membership(srpc, stable, sout, sclock)
        failover = Failover(opts, srpc, smembers, Retirement(srpc, stable, smembers, sout, sclock), stable, sout)
        assert failover.copy is not None
        failover.copy.start()
        reply, _ = await srpc.call(rpc.me, failover.copy.request(0.0), timeout=5)
        failover.copy.apply(reply)
        failover.copy.close()
        await rpc.stop()  # the coordinator is gone (its stage's peer with it)
        cfg, replies = await failover.adopt()
        assert set(replies) == {spare.peer_id} and asked
        # the run's config, its checkpoints where the old coordinator had them written (not in the standby's directory)
        assert cfg.strategy.storage_dir == str((tmp_path / "run" / "checkpoints").resolve())
        assert dataclasses.replace(cfg, strategy=tiny_cfg.strategy).to_json() == tiny_cfg.to_json()
        await srpc.stop()
    asyncio.run(main())
