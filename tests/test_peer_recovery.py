"""The replacement peer's side of a recovery, in process: a stage built without weights, the
weight pulls, and where the rebuild runs.

Three `PeerDaemon`s (stages 1 and 3 serving, a standby told to rebuild stage 2) talk through an
in-memory transport that calls the real handlers and copies every tensor (as the wire does), so no
p2pd or DHT is started. The transport holds each weight pull until every pull of the recovery is in
flight, and the rebuild waits until the event loop has answered a ping: a recovery that pulls one
source after the other, or averages on the event loop, fails with a timeout instead of passing.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from checkfree.pipeline import Hop
from checkfree.messages import AssignRecover, request
from checkfree.protocol import RPC
from checkfree.recovery import checkfree_average, plan_recovery, rebuild_stage
from checkfree.worker import StageWorker
from peers import rebuild as rebuild_mod
from peers.daemon import PeerDaemon, PeerOptions
from peers.stage import PeerState

pytestmark = pytest.mark.timeout(120)

RUN = "rec"
WAIT_S = 30.0  # bound of every wait below; only reached when the behaviour under test is missing


class MemoryNet:
    """Peers by id, their handlers called directly; GET_WEIGHTS calls are held until `expect_pulls`
    of them are in flight at once."""

    def __init__(self, expect_pulls: int) -> None:
        self.daemons: dict[str, PeerDaemon] = {}
        self.expect_pulls = expect_pulls
        self.inflight = 0
        self.most_inflight = 0
        self.all_in_flight = asyncio.Event()

    def transport(self, me: str) -> "MemoryTransport":
        return MemoryTransport(self, me)


class MemoryTransport:
    def __init__(self, net: MemoryNet, me: str) -> None:
        self.net, self.peer_id = net, me

    async def call(self, peer_id: str, name: str, header: dict, tensors=(), *, timeout: float):
        assert name in (RPC.GET_WEIGHTS, RPC.PING), name
        handler = self.net.daemons[peer_id].handlers()[name]
        if name == RPC.GET_WEIGHTS:
            self.net.inflight += 1
            self.net.most_inflight = max(self.net.most_inflight, self.net.inflight)
            if self.net.inflight == self.net.expect_pulls:
                self.net.all_in_flight.set()
            try:
                await asyncio.wait_for(self.net.all_in_flight.wait(), WAIT_S)
            except asyncio.TimeoutError:
                raise AssertionError(f"only {self.net.most_inflight} of {self.net.expect_pulls} weight pulls "
                                     "were ever in flight together") from None
            finally:
                self.net.inflight -= 1
        reply, out = await asyncio.wait_for(handler(header, [t.clone() for t in tensors], self.peer_id), timeout)
        return reply, [t.clone() for t in out]


def _daemon(net: MemoryNet, me: str, cfg) -> PeerDaemon:
    d = PeerDaemon(PeerOptions(run_id=RUN))
    d.hosted.configure(cfg, None)  # as a JOIN reply does (an ASSIGN waits for it, up to the join timeout)
    d.membership.coordinator, d.membership.transport = "coordinator", net.transport(me)
    net.daemons[me] = d
    return d


@pytest.fixture
def cfg(tiny_cfg):
    tiny_cfg.model.num_layers = 12  # 3 blocks a stage: a rebuild with some work in it
    return tiny_cfg


def test_stage_built_without_weights_trains_exactly_like_a_loaded_one(cfg) -> None:
    """StageWorker(init=False) takes the recovered tensors as its weights (no random init first):
    same forward, backward, Adam step and RoPE tables as a normally built worker loading them."""
    state = {k: v + 0.01 for k, v in StageWorker(cfg, 1).state_dict().items()}  # stage 1 and 2 keys line up
    loaded, bare = StageWorker(cfg, 2), StageWorker(cfg, 2, init=False)
    assert loaded.has_weights and not bare.has_weights
    loaded.load_recovered({k: v.clone() for k, v in state.items()}, 1.1)
    bare.load_recovered({k: v.clone() for k, v in state.items()}, 1.1)
    assert bare.has_weights
    for (ka, a), (kb, b) in zip(loaded.module.named_buffers(), bare.module.named_buffers(), strict=True):
        assert ka == kb and torch.equal(a, b), ka
    gen = torch.Generator().manual_seed(0)
    m = cfg.model
    x = torch.randn(cfg.train.microbatch_size, m.context_length, m.d_model, generator=gen)
    grad = torch.randn(x.shape, generator=gen)
    (out_a, grad_a, stats_a), (out_b, grad_b, stats_b) = [
        (w.forward("mb", x, Hop(2, False, False)), w.backward("mb", grad), w.step(0)) for w in (loaded, bare)]
    assert torch.equal(out_a, out_b) and torch.equal(grad_a, grad_b) and stats_a == stats_b
    after = bare.state_dict()
    assert all(torch.equal(v, after[k]) for k, v in loaded.state_dict().items())


def test_replacement_pulls_concurrently_and_rebuilds_off_the_event_loop(cfg, monkeypatch) -> None:
    net = MemoryNet(expect_pulls=2)
    sources = {1: _daemon(net, "peer-1", cfg), 3: _daemon(net, "peer-3", cfg)}
    for s, d in sources.items():
        d.hosted.worker = StageWorker(d.hosted.worker_cfg, s)
        with torch.no_grad():  # neighbours that trained apart: different weights and norms
            for p in d.hosted.worker.module.parameters():
                p.add_(0.01 * s)
        d.hosted.omega = 0.5 * s
    standby = _daemon(net, "standby", cfg)
    standby.hosted.state = PeerState.STANDBY
    loop_thread = threading.current_thread()
    rebuilding, answered = asyncio.Event(), threading.Event()

    def held_rebuild(*args, **kwargs):
        assert threading.current_thread() is not loop_thread, "the rebuild runs on the event loop"
        loop.call_soon_threadsafe(rebuilding.set)
        assert answered.wait(WAIT_S), "no ping was answered while the rebuild ran: it blocks the event loop"
        return rebuild_stage(*args, **kwargs)

    loop: asyncio.AbstractEventLoop | None = None
    monkeypatch.setattr(rebuild_mod, "rebuild_stage", held_rebuild)
    (plan,) = plan_recovery({2}, cfg.num_stages, "checkfree")
    header = request(RUN, AssignRecover(stage=2, plan=plan, step=5, sources={1: "peer-1", 3: "peer-3"}))

    async def ping_while_rebuilding() -> dict:
        await rebuilding.wait()
        reply, _ = await net.transport("coordinator").call("standby", RPC.PING, {"run": RUN}, timeout=WAIT_S)
        answered.set()
        return reply

    async def main():
        nonlocal loop
        loop = asyncio.get_running_loop()
        try:
            return await asyncio.wait_for(asyncio.gather(standby.handlers()[RPC.ASSIGN](header, [], "coordinator"),
                                                         ping_while_rebuilding()), 2 * WAIT_S)
        finally:
            for d in net.daemons.values():
                d.compute.pool.shutdown(wait=True)

    (reply, _), ping = asyncio.run(main())
    assert net.most_inflight == 2
    assert ping == {"stage": -1, "state": "standby"}  # answered mid-rebuild, before the stage was taken
    assert standby.hosted.index == 2 and standby.hosted.worker.has_weights
    expect = checkfree_average(*(sources[s].hosted.worker.state_dict() for s in (1, 3)), prev_norm=0.5,
                               next_norm=1.5)
    got = standby.hosted.worker.state_dict()
    assert got.keys() == expect.keys()
    for k in expect:
        assert torch.equal(got[k], expect[k]), k
    assert reply["norms"] == [0.5, 1.5] and reply["bytes"] > 0
