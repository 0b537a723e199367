"""snap's streamed copies on a peer (`--strategy snap`, checkfree.strategies.streamed; the formats and updates:
checkfree.snapcodec).

The owner's side. RUN_STEP names the part of this stage's copy the step carries (`CopyWork`). It is sent on its
own task while the step computes: for part 0 the update is first encoded on the compute thread at background
priority (behind the step's passes, in its bubbles), in slices of ENCODE_SLICE values so that a pass queued
meanwhile waits for one slice only, from the stage's state as it enters the step, against the owner's mirror of
the holder's copy; then the part's bytes go to the holder (COPY_PART). COMMIT waits for that task before the
optimizer step (the encoding must read the weights the step started from), and reports the part the holder
acknowledged: the coordinator counts an update complete once every part was acknowledged in a committed step. The
encoding also makes the holder's copy after the update (`snapcodec.encode_steps`); the mirror becomes it once the
holder has the update: when the next update names it as its base (no decoding of the owner's own update).

The holder's side. COPY_PART's bytes are assembled per owner; a complete update is checked, and applied to the
held copy (on the compute thread) only when it is asked for: by the next update of the same owner (whose base it
is) or by a FETCH_SNAPSHOT of its step, so that until the coordinator knows an update complete the copy it knows
is the one served; in slices too, and the held copy changes once the whole update is applied. A replacement
restored from a copy keeps it as its mirror.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any

from checkfree.messages import CopyChunk, CopyWork, Ok
from checkfree.net.transport import TransportError
from checkfree.protocol import ProtocolError
from checkfree.serialize import blob_tensor, state_from_bytes, state_to_bytes
from checkfree.snapcodec import HeldCopy, apply_steps, copy_from_tree, copy_to_tree, encode_steps
from checkfree.strategies.state import capture_worker
from peers.checks import check_blob
from peers.compute import BACKGROUND, ComputeQueue
from peers.membership import Membership
from peers.stage import HostedStage

__all__ = ["Streams", "is_copy_blob"]

log = logging.getLogger(__name__)

ENCODE_SLICE = 1 << 22  # values encoded per compute job (a few tens of ms): passes queued meanwhile wait no longer
MAX_COPY_BYTES = 1 << 36  # a declared update larger than this (64 GiB) is refused before anything is allocated


def _advance(steps: Generator[int, None, Any], values: int = ENCODE_SLICE) -> Any:
    """On the compute thread: run an encoding (`Streams._encode`) on for about `values` values; its result once it
    is done, else None."""
    done = 0
    try:
        while done < values:
            done += next(steps)
    except StopIteration as stop:
        return stop.value
    return None


def is_copy_blob(state: dict) -> bool:
    """Whether a served snapshot is a compressed copy (a held copy's tree) rather than a full state."""
    return isinstance(state, dict) and state.get("kind") == "full" and "format" in state


@dataclass
class _Incoming:
    """An update being received: its key (step, kind, base), its bytes, the ranges that arrived."""

    key: tuple
    buf: bytearray
    got: dict[int, int] = field(default_factory=dict)  # offset -> length
    complete: bool = False


class Streams:
    """This peer's stage's copy stream (owner) and the copies it holds for others (holder)."""

    def __init__(self, membership: Membership, hosted: HostedStage, compute: ComputeQueue) -> None:
        self.membership, self.hosted, self.compute = membership, hosted, compute
        # the owner's side
        self.mirror: HeldCopy | None = None  # the holder's copy of this stage, as the holder has it
        self.update: tuple[tuple, bytearray, HeldCopy] | None = None  # in flight: key, bytes, the copy after it
        self._task: asyncio.Task | None = None  # the part this step sends
        self._work: CopyWork | None = None  # ...which
        self._sent: tuple[int, int] | None = None  # (copy step, part) acknowledged by the holder in this step
        self._sent_bytes = 0
        # the holder's side
        self.held: dict[int, HeldCopy] = {}  # owner stage -> its copy
        self.incoming: dict[int, _Incoming] = {}  # owner stage -> the update being received
        self._locks: dict[int, asyncio.Lock] = {}

    # ---- the owner's side ----------------------------------------------------------------
    def step_started(self, work: CopyWork | None, step: int) -> None:
        """RUN_STEP: send this step's part of the copy (on its own task; COMMIT waits for it)."""
        if work is None or self.hosted.worker is None:
            return
        if self._task is not None and not self._task.done():
            if self._work == work:
                return  # a retry of the attempt while the part is still under way: the same part
            self._task.cancel()  # a part the coordinator gave up on (a failure voided its update)
        self._sent, self._work = None, work
        self._task = asyncio.create_task(self._send(work, step))

    async def _send(self, work: CopyWork, step: int) -> None:
        key = (work.step, work.kind, work.base)
        if self.update is None or self.update[0] != key:
            if work.part != 0 or work.step != step:
                raise ProtocolError(f"part {work.part} of the copy update as of step {work.step}, which this peer "
                                    "has not encoded")
            blob, after = await self._in_slices(self._encode(work))
            self.update = (key, blob, after)
        blob = self.update[1]
        total = len(blob)
        lo, hi = total * work.part // work.parts, total * (work.part + 1) // work.parts
        chunk = CopyChunk(owner=self.hosted.index, step=work.step, kind=work.kind, base=work.base, part=work.part,
                          parts=work.parts, offset=lo, total=total)
        await self.membership.call(work.holder, chunk, self.membership.timeouts.rpc_timeout, [blob_tensor(memoryview(blob)[lo:hi])],
                            link=(self.hosted.index, work.holder_stage))
        self._sent, self._sent_bytes = (work.step, work.part), hi - lo

    async def _in_slices(self, steps: Generator[int, None, Any]) -> Any:
        """Run `steps` on the compute thread at background priority, a slice (`_advance`) per job, to its result."""
        while (done := await self.compute.run(_advance, steps, priority=BACKGROUND)) is None:
            pass
        return done

    def _encode(self, work: CopyWork) -> Generator[int, None, tuple[bytearray, HeldCopy]]:
        """On the compute thread, in steps of a few million values (`_advance`; the stage's passes go between
        them): the update as of `work.step` (the stage's state now, which no step changes before COMMIT, and COMMIT
        waits for this), against the mirror; serialised, with the holder's copy after it (the next mirror)."""
        base = None
        if work.kind == "delta":
            self._catch_up(work.base)
            base = self.mirror
            if base is None or base.step != work.base:
                raise ProtocolError(f"a delta on the copy of step {work.base}, but this peer mirrors "
                                    f"{'none' if base is None else f'step {base.step}'}")
        fmt = self.hosted.copy_format
        if fmt is None:
            raise ProtocolError("a COPY_PART's work on a peer whose strategy keeps no copies")
        state = capture_worker(self.hosted.serving(), work.step, self.hosted.omega, clone=False)
        update, after = yield from encode_steps(state, work.step, fmt, base)
        return state_to_bytes(update), after

    def _catch_up(self, base: int | None) -> None:
        """The mirror takes the update in flight when the holder has it (it is the next update's base)."""
        if self.update is not None and self.update[0][0] == base and (self.mirror is None or
                                                                       self.mirror.step != base):
            self.mirror, self.update = self.update[2], None  # made while encoding (snapcodec.encode_and_mirror)

    async def before_commit(self) -> tuple[tuple[int, int] | None, int | None]:
        """COMMIT: the part this step sent has been encoded and acknowledged (or failed: reported as not sent);
        (copy step, part) and its bytes."""
        task, self._task = self._task, None
        if task is None:
            return None, None
        try:
            await asyncio.wait_for(task, self.membership.timeouts.rpc_timeout)
        except (TransportError, ProtocolError, TimeoutError, asyncio.CancelledError) as e:
            log.warning("copy part not delivered: %s", str(e) or type(e).__name__)
            return None, None
        sent, self._sent = self._sent, None
        return sent, self._sent_bytes if sent else None

    def adopt_mirror(self, held: HeldCopy) -> None:
        """A replacement restored from `held`: it mirrors it."""
        self.mirror, self.update = held, None

    def reset(self) -> None:
        """The stage changed hands (a new stage served here, or none): no mirror, nothing in flight."""
        if self._task is not None:
            self._task.cancel()
        self.mirror, self.update, self._task, self._sent, self._work = None, None, None, None, None

    # ---- the holder's side ---------------------------------------------------------------
    async def on_copy_part(self, chunk: CopyChunk, tensors: list, peer) -> tuple[Ok, list]:
        """A part of stage `owner`'s update: kept until the update is asked for (see the module)."""
        cfg = self.hosted.joined()
        data = check_blob(tensors, "a copy part")
        owner, key = chunk.owner, (chunk.step, chunk.kind, chunk.base)
        if not 0 <= owner < cfg.num_stages:
            raise ProtocolError(f"copy of stage {owner} out of range for {cfg.num_stages} stages")
        if chunk.kind not in ("full", "delta") or not 0 <= chunk.part < chunk.parts:
            raise ProtocolError(f"copy part {chunk.part} of {chunk.parts} of kind {chunk.kind!r}")
        if not 0 < chunk.total <= MAX_COPY_BYTES or not 0 <= chunk.offset <= chunk.total - len(data):
            raise ProtocolError(f"copy part at {chunk.offset} of {len(data)} bytes does not fit an update of "
                                f"{chunk.total} bytes")
        async with self._lock(owner):
            inc = self.incoming.get(owner)
            if inc is None or inc.key != key or len(inc.buf) != chunk.total:
                if inc is not None and inc.complete and chunk.base == inc.key[0]:
                    await self._promote(owner)  # the update this one is based on: the holder has it
                self.incoming.pop(owner, None)  # (an update the coordinator gave up on)
                inc = self.incoming[owner] = _Incoming(key, bytearray(chunk.total))
            inc.buf[chunk.offset:chunk.offset + len(data)] = data
            inc.got[chunk.offset] = len(data)
            if sum(inc.got.values()) == len(inc.buf):
                try:  # checked now: a bad update is refused to its sender (its stream starts over)
                    state_from_bytes(inc.buf)
                except ValueError as e:
                    self.incoming.pop(owner, None)
                    raise ProtocolError(f"the copy update of stage {owner} as of step {chunk.step} is not one: "
                                        f"{e}") from None
                inc.complete = True
        return Ok(), []

    def _lock(self, owner: int) -> asyncio.Lock:
        return self._locks.setdefault(owner, asyncio.Lock())

    async def _promote(self, owner: int) -> None:
        """Apply `owner`'s complete update to its held copy (compute thread)."""
        inc = self.incoming.pop(owner)
        (step, kind, base) = inc.key
        held = self.held.get(owner)
        if kind == "delta" and (held is None or held.step != base):
            log.warning("copy update of stage %d as of step %d is based on step %s, but this peer holds %s: "
                        "dropped", owner, step, base, None if held is None else held.step)
            return
        t0 = time.perf_counter()
        self.held[owner] = await self._in_slices(apply_steps(held if kind == "delta" else None,
                                                             state_from_bytes(inc.buf)))
        log.info("copy of stage %d now as of step %d (%s, applied in %.3f s)", owner, step, kind,
                 time.perf_counter() - t0)

    def holds(self, owner: int, step: int) -> bool:
        held, inc = self.held.get(owner), self.incoming.get(owner)
        return (held is not None and held.step == step) or (inc is not None and inc.complete and inc.key[0] == step)

    async def fetch(self, owner: int, step: int) -> bytearray:
        """The copy of `owner` as of `step` (the held copy, or the complete update of that step applied first),
        serialised as a held copy's tree."""
        async with self._lock(owner):
            inc = self.incoming.get(owner)
            if inc is not None and inc.complete and inc.key[0] == step:
                await self._promote(owner)
            held = self.held.get(owner)
            if held is None or held.step != step:
                raise ProtocolError(f"no copy of stage {owner} as of step {step} here "
                                    f"(have: {None if held is None else held.step})")
            return await self.compute.run(lambda: state_to_bytes(copy_to_tree(held)))

    def drop_held(self) -> None:
        """Copies held for others are gone (this peer takes another role)."""
        self.held.clear()
        self.incoming.clear()

    @staticmethod
    def decode(blob) -> HeldCopy:
        return copy_from_tree(state_from_bytes(blob))
