"""An emulated wide-area network between a swarm's stages (`train.wan`, `checkfree local --wan paper-geo`).

Each stage sits in a region of the cost profile (stage i in region ``i mod R``, a replacement in the
region of the stage it replaces, as `checkfree.costmodel` charges it), and every transfer between two
stages' peers is held back, in the sending process, by what that link would cost: the sender's side of
the link serializes its messages at the link's bandwidth (a message waits for the one before it on the
same link), and each arrives one latency after its last byte left. Replies travel the reverse link the
same way. The numbers are the cost model's own (`costmodel.swarm_profile`): one table, read from one
place, for the simulated clock and for the emulated network.

Why here and not in the kernel: this kernel has no `netem` (no delay qdisc); `tc ... tbf` shapes
bandwidth but only per interface, and a relay per link would have to sit inside every transport's
addressing (hivemind's multiaddrs, libp2p, tcp). Holding messages back at the one place every
peer-to-peer request passes (`peers.membership.Membership.call`) works for every transport alike.

Limits, stated: the real bytes still cross loopback after the emulated delay, so a hop costs the
emulated time plus the loopback transport's own (measured by `python -m benchmarks.wan`); there is no
packet loss, jitter, TCP slow start or congestion between links; the coordinator's control messages
(RUN_STEP, COMMIT, heartbeats) and in-memory snapshot copies travel unshaped, as the cost model does
not charge them either; a reply's reverse link is accounted in the caller's process, so a reply and
the callee's own sends on that link do not queue behind each other.
"""

from __future__ import annotations

import asyncio
import time

from checkfree.config import RunConfig
from checkfree.costmodel import CostModel, swarm_profile
from checkfree.wirecodec import WIRE_BYTES

__all__ = ["WanEmulator"]


class WanEmulator:
    """The links between the stages of one run under its `train.wan` profile, as seen by one process."""

    def __init__(self, cfg: RunConfig) -> None:
        if not cfg.train.wan:
            raise ValueError("train.wan is not set: there is no network to emulate")
        self.model = CostModel(cfg, swarm_profile(cfg.train.wan, wire_bytes=WIRE_BYTES[cfg.train.wire_dtype]))
        self.name = cfg.train.wan
        self._free: dict[tuple[int, int], float] = {}  # (src, dst) -> when the sender's side of the link is free

    def link(self, src: int, dst: int) -> tuple[float, float]:
        """(latency s, bandwidth bytes/s) from stage `src`'s peer to stage `dst`'s (a stage to itself: the
        region's own network)."""
        return self.model.latency_s(src, dst), self.model.bandwidth_Bps(src, dst)

    def describe(self) -> list[str]:
        """One line per stage-to-stage link of the pipeline, for the start-up banner."""
        lines = []
        regions = self.model.profile.regions
        for i in range(self.model.S - 1):
            lat, bw = self.link(i, i + 1)
            lines.append(f"stage {i} ({regions[self.model.region(i)]}) <-> stage {i + 1} "
                         f"({regions[self.model.region(i + 1)]}): {lat * 1e3:g} ms, {bw / 2**30:g} GiB/s")
        return lines

    def hold(self, src: int, dst: int, nbytes: int) -> float:
        """Book `nbytes` on the link `src` -> `dst` now; the seconds until they have arrived."""
        latency, bandwidth = self.link(src, dst)
        now = time.monotonic()
        start = max(now, self._free.get((src, dst), now))
        self._free[(src, dst)] = end = start + nbytes / bandwidth
        return end + latency - now

    async def carry(self, src: int, dst: int, nbytes: int) -> float:
        """Wait until `nbytes` sent now from stage `src` would have arrived at stage `dst`; the seconds waited."""
        delay = self.hold(src, dst, nbytes)
        await asyncio.sleep(delay)
        return delay
