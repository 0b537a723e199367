"""ReFT's snapshot rounds on the peers, in process (three `PeerDaemon`s over the memory network, no coordinator, no
companion process): what a peer keeps when a round is not known complete, and a round of the same step after a
rollback. The real-process form, under load: tests/test_swarm.py's reft crash test."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from checkfree.messages import KeepParity, OwnCopy, ParityCopy, Restore, Snapshot
from checkfree.net.in_memory import MemoryNetwork, MemoryTransport
from checkfree.protocol import ProtocolError
from checkfree.serialize import state_from_bytes
from peers.daemon import PeerDaemon, PeerOptions
from peers.reft_parity import Parity

pytestmark = pytest.mark.timeout(120)


async def _no_companion(self, step: int, blob) -> bool:
    """(The companion's keeping is test_inprocess's companion test; here the peers keep their copies alone.)"""
    return False


def _daemons(tiny_cfg, n: int) -> list[PeerDaemon]:
    cfg = copy.deepcopy(tiny_cfg)
    cfg.recovery.strategy = "reft"
    net = MemoryNetwork()
    daemons = [PeerDaemon(PeerOptions(run_id="r", transport="memory")) for _ in range(n)]
    for stage, d in enumerate(daemons):
        d.membership.transport = MemoryTransport(net)
        d.hosted.configure(cfg, None)
        d.hosted.serve(d.hosted.build(stage), 0.0, 0)
    return daemons


async def _round(daemons: list[PeerDaemon], step: int, first_alone: bool = False) -> None:
    """SNAPSHOT of `step` on every peer; `first_alone`: the first peer's chunks reach the others before their own
    SNAPSHOT does (it then waits for their chunks)."""
    group = [d.membership.me for d in daemons]
    calls = [d.snapshots.on_snapshot(Snapshot(step=step, keep=KeepParity(group=group, index=i)), [], None)
             for i, d in enumerate(daemons)]
    first = asyncio.ensure_future(calls[0]) if first_alone else None
    while first is not None and not first.done() and not all(0 in d.snapshots.parity.chunks.get(step, {})
                                                              for d in daemons[1:]):
        await asyncio.sleep(0.01)
    await asyncio.gather(*([first] if first is not None else []), *calls[1 if first_alone else 0:])


def _weights(d: PeerDaemon) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in d.hosted.serving().module.state_dict().items()}


def _nudge(daemons: list[PeerDaemon]) -> None:
    """Every stage's weights change (as a step would)."""
    with torch.no_grad():
        for d in daemons:
            for p in d.hosted.serving().module.parameters():
                p.add_(0.01)


def test_a_round_not_named_complete_leaves_the_last_complete_snapshot_to_roll_back_to(tiny_cfg, monkeypatch):
    """Round 2 completes; round 4 replaces every peer's own snapshot but the coordinator never names it complete
    (a member's reply lost or late: its ledger stays at step 2, as in the real-process reft test under load, which
    failed with 'no own snapshot of stage 0 at step 2'). A rollback to step 2 restores each stage's own copy of
    step 2, a lost member of step 2 decodes from parity, and RUN_STEP's settle drops the copies of step 4. Then
    round 4 again, after the rollback: its parity blocks are built from its own chunks, not from those the
    abandoned round 4 left behind."""
    monkeypatch.setattr(Parity, "_keep", _no_companion)
    daemons = _daemons(tiny_cfg, 3)

    async def main():
        for d in daemons:
            await d._register()
        await _round(daemons, 2)
        at2 = [_weights(d) for d in daemons]
        _nudge(daemons)
        await _round(daemons, 4)  # every peer completed it; the coordinator's ledger still says step 2
        for d in daemons:
            await d.snapshots.on_restore(Restore(step=2, origin=OwnCopy()), [], None)
        for d, want in zip(daemons, at2):
            assert all(torch.equal(v, want[k]) for k, v in _weights(d).items())
        assert all(d.snapshots.steps_held() == {d.hosted.index: 2} for d in daemons)
        assert all(set(d.snapshots.parity.blocks) == {2} for d in daemons)
        group = [d.membership.me for d in daemons]
        blob, source, _ = await daemons[0].snapshots.parity.decode(2, ParityCopy(group=group, index=1))
        assert source == "parity"
        decoded = state_from_bytes(blob)
        assert all(torch.equal(decoded["model"][k], v) for k, v in at2[1].items())

        _nudge(daemons)  # round 4 of the run after the rollback: other weights than the abandoned round's
        at4 = [_weights(d) for d in daemons]
        await _round(daemons, 4, first_alone=True)
        for d in daemons:
            d.snapshots.settle(4)  # (the next RUN_STEP's `snapshot_step`)
        assert all(d.snapshots.steps_held() == {d.hosted.index: 4} and set(d.snapshots.parity.blocks) == {4}
                   for d in daemons)
        blob, _, _ = await daemons[2].snapshots.parity.decode(4, ParityCopy(group=group, index=1))
        decoded = state_from_bytes(blob)
        assert all(torch.equal(decoded["model"][k], v) for k, v in at4[1].items())
        with pytest.raises(ProtocolError, match="no own snapshot of stage 0 at step 2"):  # step 2's copies went
            await daemons[0].snapshots.on_restore(Restore(step=2, origin=OwnCopy()), [], None)

    try:
        asyncio.run(main())
    finally:
        for d in daemons:
            d.compute.shutdown(wait=True)


def test_a_companion_that_does_not_start_fails_no_snapshot_and_is_started_again(tiny_cfg, monkeypatch):
    """The companion is only a second home of the snapshot (a crash of the training process alone): one that does
    not start makes no round incomplete (the peers hold their snapshots and parity blocks; a replacement decodes
    from parity: the reply names no companion), and it is started again at the next snapshot."""
    from checkfree.net.errors import TransportError
    from peers import reft_parity

    starts = []

    def no_start(peer_id, host, linger, secret, timeout=30.0):
        starts.append(peer_id)
        raise TransportError("the snapshot companion did not start within 0 s")

    monkeypatch.setattr(reft_parity, "start_companion", no_start)
    daemons = _daemons(tiny_cfg, 2)
    group = [d.membership.me for d in daemons]

    async def main():
        for d in daemons:
            await d._register()
        for step in (2, 4):
            replies = await asyncio.gather(*(d.snapshots.on_snapshot(
                Snapshot(step=step, keep=KeepParity(group=group, index=i)), [], None) for i, d in enumerate(daemons)))
            assert all(r.companion is None for r, _ in replies)
            assert all(d.snapshots.steps_held() == {d.hosted.index: step} and step in d.snapshots.parity.blocks
                       for d in daemons)

    try:
        asyncio.run(main())
    finally:
        for d in daemons:
            d.compute.shutdown(wait=True)
    assert sorted(starts) == sorted(group * 2)


def test_a_swarm_rolls_back_to_the_last_complete_round_when_a_later_one_was_left_incomplete(tiny_cfg, tmp_path,
                                                                                           monkeypatch):
    """The whole run in one process (harness/inprocess.py), the companions left out: stage 3's reply to the
    SNAPSHOT of step 4 is lost after its round went through (every peer holds step 4; the coordinator's ledger
    stays at step 2), then stage 2 is killed at step 5. The run rolls back to step 2 (stage 2
    decoded from parity at step 2) and ends with the failure-free simulator's losses. Before the fix this rollback
    failed: 'no own snapshot of stage 0 at step 2'."""
    from checkfree.failures import FailureSchedule
    from checkfree.rundir import read_jsonl
    from checkfree.simulator import Simulator
    from harness.inprocess import run_swarm
    from peers.snapshots import Snapshots

    monkeypatch.setattr(Parity, "_keep", _no_companion)
    monkeypatch.setattr(Parity, "prepare", lambda self: None)
    on_snapshot = Snapshots.on_snapshot

    async def reply_lost(self, snapshot, tensors, peer):
        reply = await on_snapshot(self, snapshot, tensors, peer)
        if snapshot.step == 4 and self.hosted.index == 3:
            raise ProtocolError("(test) the reply to the snapshot of step 4 is lost")
        return reply

    monkeypatch.setattr(Snapshots, "on_snapshot", reply_lost)
    cfg = copy.deepcopy(tiny_cfg)
    cfg.recovery.strategy, cfg.strategy.reft_group, cfg.strategy.snapshot_every = "reft", 4, 2
    cfg.train.num_steps, cfg.train.eval_every = 8, 0
    swarm = run_swarm(cfg, tmp_path / "swarm", peers=cfg.num_stages + 1, kills=FailureSchedule([(5, 2)]),
                      save_final=False)
    Simulator(cfg, tmp_path / "clean", progress=False).run()
    assert swarm.summary["status"] == "completed"
    events = read_jsonl(tmp_path / "swarm" / "events.jsonl")
    assert [(e["step"], e["complete"]) for e in events if e["event"] == "snapshot"][:2] == [(2, True), (4, False)]
    (rec,) = [e for e in events if e["event"] == "recovery"]
    assert (rec["step"], rec["stage"], rec["source"], rec["rollback_to"]) == (5, 2, "parity", 2)
    final = {m["step"]: m["loss"] for m in read_jsonl(tmp_path / "swarm" / "metrics.jsonl")}
    clean = [m["loss"] for m in read_jsonl(tmp_path / "clean" / "metrics.jsonl")]
    assert [final[s] for s in range(8)] == pytest.approx(clean, rel=1e-5)
