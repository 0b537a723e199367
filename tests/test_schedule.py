"""The pipeline schedules bound what a stage holds: a peer daemon hosting stage 0, driven in-process.

The neighbours are a fake transport that records the activations the peer sends; the test sends the
gradients back only once nothing else can happen (every task of the peer has finished), so each
schedule shows the most it admits: GPipe all M microbatches of the step, 1F1B at most S, admitting the
next one as a backward pass finishes.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from checkfree.config import preset
from checkfree.protocol import RPC
from checkfree.worker import StageWorker
from peers.daemon import PeerDaemon, PeerOptions

pytestmark = pytest.mark.timeout(60)

RUN = "schedule-test"
COORDINATOR = "coordinator"


class _Neighbours:
    """The transport of the peer under test: keeps its handlers and records the activations it sends."""

    peer_id = "peer0"

    def __init__(self) -> None:
        self.handlers: dict[str, object] = {}
        self.forwards: list[int] = []  # microbatches whose activations went to stage 1, in order

    async def register(self, name: str, handler) -> None:
        self.handlers[name] = handler

    async def call(self, peer: str, name: str, header: dict, tensors=(), timeout: float | None = None):
        assert name == RPC.FORWARD, f"unexpected {name} to {peer}: {header}"
        self.forwards.append(header["mb"])
        return {"ok": True}, []


class _Tokens:
    """Random token microbatches in place of the corpus (the schedule does not depend on the data)."""

    def __init__(self, vocab: int, batch: int, length: int) -> None:
        self.vocab, self.batch_size, self.length = vocab, batch, length

    def batch(self, step: int, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 * step + mb)
        seqs = torch.randint(0, self.vocab, (self.batch_size, self.length + 1), generator=g)
        return seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()  # (B, T) each


async def _settle(daemon: PeerDaemon) -> None:
    """Until the peer's step tasks have finished and its compute queue is empty: nothing more happens
    without a message from outside."""
    await asyncio.sleep(0)  # a turn for tasks just created (the step's handler)
    assert daemon.steps.run is not None
    while busy := [t for t in (*daemon.steps.run.tasks, daemon.compute._pump) if t is not None and not t.done()]:
        await asyncio.wait(busy)


async def _drive(schedule: str, stages: int, microbatches: int) -> tuple[int, dict]:
    """One training step on stage 0; returns the most microbatches whose activations were out at once
    (sent, gradient not yet back) and the peer's RUN_STEP reply."""
    cfg = preset("tiny")
    cfg.num_stages, cfg.train.num_microbatches, cfg.train.schedule = stages, microbatches, schedule
    m, t = cfg.model, cfg.train
    daemon = PeerDaemon(PeerOptions(run_id=RUN))
    daemon.membership.transport = wire = _Neighbours()
    daemon.hosted.cfg, daemon.membership.coordinator = cfg, COORDINATOR
    daemon.hosted.data = _Tokens(m.vocab_size, t.microbatch_size, m.context_length)
    try:
        daemon.hosted.worker = StageWorker(cfg, 0)
        await daemon._register()
        header = {"run": RUN, "step": 0, "attempt": 0, "evaluate": False,
                  "peers": {str(s): f"peer{s}" for s in range(stages)}}
        step = asyncio.create_task(wire.handlers[RPC.RUN_STEP](header, [], COORDINATOR))
        grad = torch.ones(t.microbatch_size, m.context_length, m.d_model)  # (B, T, d)
        returned: list[int] = []
        most = 0
        await _settle(daemon)
        while out := [mb for mb in wire.forwards if mb not in returned]:
            most = max(most, len(out))
            returned.append(out[0])
            await wire.handlers[RPC.BACKWARD]({"run": RUN, "step": 0, "attempt": 0, "mb": out[0], "hop": 0},
                                              [grad], "peer1")
            await _settle(daemon)
        reply, _ = await asyncio.wait_for(step, 30)
        assert sorted(returned) == list(range(microbatches))
        return most, reply
    finally:
        daemon.compute.pool.shutdown(wait=True)


def test_1f1b_bounds_the_first_stage_to_s_microbatches_where_gpipe_holds_all_m() -> None:
    s, m = 4, 8
    most_g, gpipe = asyncio.run(_drive("gpipe", s, m))
    most_1, one_f_one_b = asyncio.run(_drive("1f1b", s, m))
    assert (most_g, gpipe["inflight_peak"]) == (m, m)
    assert (most_1, one_f_one_b["inflight_peak"]) == (s, s)
    # every microbatch keeps the same tensors, so the activation memory scales with the count held
    assert gpipe["activation_peak_bytes"] > 0
    assert one_f_one_b["activation_peak_bytes"] * m == gpipe["activation_peak_bytes"] * s
