"""REFT's snapshots on a peer (`--strategy reft`): at a snapshot (SNAPSHOT with `parity`) this stage keeps its own
full state in memory and sends one chunk of it to every other member of its parity group (REFT_CHUNK); each
member XORs the chunks it receives into its parity block (checkfree.baselines.raim5_chunk / raim5_block), and
the snapshot is answered once this peer's block is complete. A replacement for a lost member fetches every
survivor's snapshot and parity block (REFT_FETCH), decodes the lost state bit for bit (raim5_recover) and builds
its own parity block from the survivors' snapshots, so the group is whole again. Each snapshot and parity block
also goes to the peer's companion process (peers/companion.py), which survives a crash of the training process
alone: a replacement fetches from it first (`restored_from: companion`) and decodes from parity when it is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import subprocess
from collections.abc import Callable
from typing import Any

import torch

from checkfree.baselines import Raim5Block, raim5_block, raim5_chunk, raim5_recover
from checkfree.net.tcp_transport import TcpTransport, TransportError
from checkfree.messages import (CompanionStop, CompanionStore, Ok, ParityCopy, ParityMeta, ReftChunk, ReftFetch,
                                reply_of, to_wire)
from checkfree.protocol import ProtocolError
from peers.checks import check_blob
from peers.companion import companion_id, fetch_snapshot, start_companion
from peers.membership import Membership
from peers.stage import HostedStage

__all__ = ["Parity"]

log = logging.getLogger(__name__)

KEEP_STEPS = 2  # chunks of older snapshots than the newest two are dropped (a bound on what strangers can pile up)
KEEP_BLOCKS = 2  # parity blocks kept: the newest, and the one before until the coordinator names a round complete


class Parity:
    """This peer's parity block of its group's newest snapshot, and chunks arriving for it."""

    def __init__(self, membership: Membership, hosted: HostedStage, held: dict[int, tuple[int, Any]],
                 own: Callable[[int, int], Any | None], companion_host: str = "127.0.0.1") -> None:
        self.membership, self.hosted, self.held = membership, hosted, held  # held: the snapshots (peers.snapshots)
        self.own = own  # (stage, step) -> this peer's own copy of that step, if it has it (Snapshots.own)
        self.companion_host = companion_host  # where this peer's snapshot companion listens (the daemon's host)
        self.companion: subprocess.Popen | None = None
        self.companion_addr: str | None = None
        self._client: TcpTransport | None = None
        self._starting: asyncio.Task | None = None
        # snapshot step -> this peer's parity block: the newest, and the one before it while the newest's round is
        # not known complete (Snapshots.settle)
        self.blocks: dict[int, Raim5Block] = {}
        self.chunks: dict[int, dict[int, tuple[bytes, int]]] = {}  # step -> owner index -> (chunk, owner's length)
        self._arrived: dict[int, asyncio.Event] = {}
        self.kept = False  # whether the companion took the newest snapshot

    def prepare(self) -> None:
        """Start the snapshot companion in the background now (joining a reft run), not at the first snapshot:
        it takes a second or two to import its libraries, which the first snapshot would otherwise wait for. One
        that failed to start, or died since, is started again."""
        starting = self._starting
        failed = starting is not None and starting.done() and (starting.cancelled() or starting.exception() is not None)
        if starting is None or failed or self.companion is not None and self.companion.poll() is not None:
            self.companion = self.companion_addr = None
            self._starting = asyncio.create_task(self._start_companion())

    async def _start_companion(self) -> None:
        if self._client is not None:  # (of a companion that died)
            with contextlib.suppress(Exception):
                await self._client.shutdown()
            self._client = None
        companion, addr = await asyncio.to_thread(
            start_companion, self.membership.me, self.companion_host, self.membership.timeouts.join_timeout, self.membership.secret)
        self.companion, self.companion_addr = companion, addr
        client = self._client = TcpTransport(self.membership.me, secret=self.membership.secret)
        client.add_peer_address(addr)

    def _event(self, step: int) -> asyncio.Event:
        return self._arrived.setdefault(step, asyncio.Event())

    async def snapshot(self, step: int, blob: bytes, group: list[str], index: int) -> int:
        """Send this stage's chunks to the other members, then wait for theirs and build the parity block;
        returns the bytes sent."""
        n = len(group)
        if n < 2 or not 0 <= index < n or group[index] != self.membership.me:
            raise ProtocolError(f"parity group {group} with this peer at {index} is not a group it belongs to")
        chunks = {p: raim5_chunk(blob, index, p, n) for p in range(n) if p != index}
        await asyncio.gather(*(self.membership.call(group[p], ReftChunk(step=step, owner=index, holder=p, n=n, length=len(blob)),
                                             self.membership.timeouts.step_timeout,
                                             [torch.frombuffer(bytearray(c), dtype=torch.uint8)] if c else
                                             [torch.empty(0, dtype=torch.uint8)])
                               for p, c in chunks.items()))
        await asyncio.wait_for(self._event(step).wait(), self.membership.timeouts.step_timeout)
        got = self.chunks.pop(step)
        self._arrived.pop(step, None)  # (a later round of the same step, after a rollback, waits for its own chunks)
        lengths = [len(blob) if i == index else got[i][1] for i in range(n)]
        self.blocks[step] = raim5_block(index, [got[i][0] for i in sorted(got)], lengths)
        for old in sorted(self.blocks)[:-KEEP_BLOCKS]:
            del self.blocks[old]
        self.kept = await self._keep(step, blob)
        return sum(len(c) for c in chunks.values())

    async def _keep(self, step: int, blob: bytes) -> bool:
        """Hand the snapshot and parity block to this peer's companion (started when the peer joined, or now), so
        that they survive a crash of this process alone; whether it took them. One that cannot (it did not start,
        or died: it is started again at the next snapshot) does not fail the snapshot, which this peer holds, nor
        does one still starting after half the coordinator's wait for the snapshot (step_timeout / 2; a start under
        load, on the first snapshot): a replacement then decodes from parity."""
        self.prepare()
        assert self._starting is not None
        timeout = self.membership.timeouts.rpc_timeout
        try:
            await asyncio.wait_for(asyncio.shield(self._starting), self.membership.timeouts.step_timeout / 2)
            assert self._client is not None  # (the companion started)
            block = self.blocks[step]
            store = CompanionStore(step=step, stage=self.hosted.index, holder=block.holder, n=block.n,
                                   lengths=list(block.state_lengths))
            reply, _ = await self._client.call(companion_id(self.membership.me), store.rpc, to_wire(store),
                                               [torch.frombuffer(bytearray(blob), dtype=torch.uint8),
                                                torch.frombuffer(bytearray(block.parity), dtype=torch.uint8)],
                                               timeout=timeout)
            reply_of(store.rpc, reply)
        except (TransportError, ProtocolError, OSError, asyncio.TimeoutError) as e:
            log.warning("the snapshot companion did not take the snapshot of step %d (%s): a crash of this process "
                        "will be decoded from parity", step, str(e)[:200] or type(e).__name__)
            return False
        return True

    def settle(self, step: int) -> None:
        """The newest complete snapshot is of `step` (Snapshots.settle): the parity block of any other is dropped."""
        if step in self.blocks:
            self.blocks = {step: self.blocks[step]}

    def rolled_back(self, step: int) -> None:
        """The run rolled back to `step`: the chunks of rounds from `step` on, taken before the rollback, are of a
        run abandoned now; so are the parity blocks of later snapshots. (A round of the same step comes again
        after the rollback, and must wait for its own chunks, not find those of the round before.)"""
        for s in [s for s in self.chunks if s >= step]:
            del self.chunks[s]
        for s in [s for s in self._arrived if s >= step]:
            del self._arrived[s]
        for s in [s for s in self.blocks if s > step]:
            del self.blocks[s]

    async def close(self) -> None:
        """This peer leaves: so does its companion (SIGKILL if it does not within 5 s)."""
        if self._starting is not None and not self._starting.done():
            with contextlib.suppress(Exception):
                await self._starting
        if self.companion is None or self._client is None:
            return
        with contextlib.suppress(Exception):
            await self._client.call(companion_id(self.membership.me), CompanionStop.rpc, to_wire(CompanionStop()), timeout=5.0)
        with contextlib.suppress(Exception):
            await self._client.shutdown()
        try:
            await asyncio.to_thread(self.companion.wait, 5.0)
        except subprocess.TimeoutExpired:
            self.companion.kill()
            await asyncio.to_thread(self.companion.wait)

    async def on_chunk(self, chunk: ReftChunk, tensors: list, peer) -> tuple[Ok, list]:
        """A chunk of another member's snapshot for this peer's parity block."""
        step, owner, holder, n, length = chunk.step, chunk.owner, chunk.holder, chunk.n, chunk.length
        if not (2 <= n and 0 <= owner < n and 0 <= holder < n and owner != holder and length >= 0):
            raise ProtocolError(f"parity chunk of member {owner} for member {holder} of a group of {n}")
        if len(tensors) != 1 or tensors[0].dtype != torch.uint8 or tensors[0].dim() != 1:
            raise ProtocolError("a parity chunk is one 1-D uint8 tensor")
        for old in [s for s in self.chunks if s < step - KEEP_STEPS]:
            self.chunks.pop(old, None)
            self._arrived.pop(old, None)
        got = self.chunks.setdefault(step, {})
        got[owner] = (tensors[0].numpy().tobytes(), length)
        if len(got) == n - 1:
            self._event(step).set()
        return Ok(), []

    async def on_fetch(self, fetch: ReftFetch, tensors: list, peer) -> tuple[ParityMeta, list]:
        """This peer's snapshot of `step` and its parity block, for a lost member's replacement."""
        step = fetch.step
        own, block = self.own(self.hosted.index, step), self.blocks.get(step)
        if own is None or block is None:
            raise ProtocolError(f"no snapshot and parity of step {step} here")
        return (ParityMeta(holder=block.holder, n=block.n, lengths=list(block.state_lengths)),
                [torch.frombuffer(bytearray(own), dtype=torch.uint8),
                 torch.frombuffer(bytearray(block.parity), dtype=torch.uint8)])

    async def take_over(self, source: str, stage: int, step: int) -> int:
        """A handover of `stage`: the leaving peer's (`source`) snapshot of `step` and its parity block, kept here
        in its place (this peer's companion gets them at the next snapshot, as a replacement's does); the bytes
        moved."""
        meta, ts = await self.membership.call(source, ReftFetch(step=step), self.membership.timeouts.step_timeout)
        if len(ts) != 2:
            raise ProtocolError(f"REFT_FETCH reply of the leaving peer carries {len(ts)} tensors, not 2")
        blob, parity = check_blob(ts[:1], "a snapshot"), check_blob(ts[1:], "a parity block")
        self.held[stage] = (step, blob)
        self.blocks = {step: Raim5Block(meta.holder, meta.n, parity, tuple(meta.lengths))}
        return len(blob) + len(parity)

    async def decode(self, step: int, spec: ParityCopy) -> tuple[bytes, str, int]:
        """A replacement: the lost member's snapshot of `step` from its companion if that survived, else decoded
        from the survivors (`spec`: the group's peers in order and the lost one's index), and this peer's parity
        block; (state, where it came from: "companion" or "parity", bytes fetched)."""
        group, lost = spec.group, spec.index
        if not 0 <= lost < len(group):
            raise ProtocolError(f"assign 'origin.index' {lost} is outside the parity group of {len(group)}")
        if spec.companion is not None:  # the lost peer's companion may have survived its crash
            try:
                meta, blob, parity = await fetch_snapshot(self.membership.me, spec.companion, step, self.membership.secret,
                                                          self.membership.timeouts.rpc_timeout)
                self.blocks = {step: Raim5Block(meta.holder, meta.n, parity, tuple(meta.lengths))}
                return blob, "companion", len(blob) + len(parity)
            except (TransportError, ProtocolError, ValueError) as e:
                log.warning("the lost peer's snapshot companion did not answer (%s): decoding from parity", e)
        members = [(i, p) for i, p in enumerate(group) if i != lost]
        replies = await asyncio.gather(*(self.membership.call(p, ReftFetch(step=step), self.membership.timeouts.step_timeout)
                                         for _, p in members))
        states, blocks, moved = {}, {}, 0
        for (i, _), (h, ts) in zip(members, replies):
            if len(ts) != 2:
                raise ProtocolError(f"REFT_FETCH reply of member {i} carries {len(ts)} tensors, not 2")
            states[i] = check_blob(ts[:1], "a snapshot")
            blocks[i] = Raim5Block(h.holder, h.n, check_blob(ts[1:], "a parity block"), tuple(h.lengths))
            moved += len(states[i]) + len(blocks[i].parity)
        blob = raim5_recover(lost, states, blocks)
        n, lengths = len(group), blocks[members[0][0]].state_lengths
        self.blocks = {step: raim5_block(lost, [raim5_chunk(states[i], i, lost, n) for i in sorted(states)], lengths)}
        return blob, "parity", moved
