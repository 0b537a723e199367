"""snap's streamed copies on a peer (`--strategy snap`, checkfree.strategies.streamed; the formats and updates:
checkfree.snapcodec).

The owner's side. RUN_STEP names the part of this stage's copy the step carries (`CopyWork`). It is sent on its
own task while the step computes: for part 0 the update is first encoded, from the stage's state as it enters
the step (captured as RUN_STEP arrives: the weights themselves, no copy) against the owner's mirror of the
holder's copy, on the peer's side thread (`peers.compute.SideThread`, beside the compute thread, at normal
priority); then the part's bytes go to the holder (COPY_PART). COMMIT waits for that task before the optimizer
step (the encoding reads the weights the step started from) and reports the part the holder acknowledged: the
coordinator counts an update complete once every part was acknowledged in a committed step.
The encoding also makes the holder's copy after the update (`snapcodec.encode_and_mirror`); the mirror becomes it
once the holder has the update: when the next update names it as its base (no decoding of the owner's own update).

The holder's side. COPY_PART's bytes are assembled per owner and a complete update is checked; every part is
acknowledged as soon as it is stored. A complete update is applied to the held copy only once it is known
complete at the coordinator: when the next update of the same owner names it as its base (then on the side thread,
in its own task: the part that named it is acknowledged at once), or when a FETCH_SNAPSHOT asks for its step (at
once); until then the copy the coordinator knows is the one served. The held copy changes once the whole update
is applied. A replacement restored from a copy keeps it as its mirror.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from checkfree.messages import CopyChunk, CopyWork, Ok
from checkfree.net.transport import TransportError
from checkfree.protocol import ProtocolError
from checkfree.serialize import blob_tensor, state_from_bytes, state_to_bytes
from checkfree.snapcodec import (CopyFormat, HeldCopy, apply_update, copy_from_tree, copy_to_tree,
                                 encode_and_mirror)
from checkfree.strategies.state import StageState, capture_worker
from peers.checks import check_blob
from peers.compute import ComputeQueue, SideThread
from peers.membership import Membership
from peers.stage import HostedStage

__all__ = ["Streams", "is_copy_blob"]

log = logging.getLogger(__name__)

MAX_COPY_BYTES = 1 << 36  # a declared update larger than this (64 GiB) is refused before anything is allocated


def is_copy_blob(state: dict) -> bool:
    """Whether a served snapshot is a compressed copy (a held copy's tree) rather than a full state."""
    return isinstance(state, dict) and state.get("kind") == "full" and "format" in state


def _encode(state: StageState, step: int, fmt: CopyFormat, base: HeldCopy | None) -> tuple[bytearray, HeldCopy,
                                                                                            float]:
    """On the side thread: the update of `base` to `state` as of `step`, serialised; the holder's copy after it
    (the next mirror); the thread's CPU seconds."""
    t0 = time.thread_time()
    update, after = encode_and_mirror(state, step, fmt, base)
    return state_to_bytes(update), after, time.thread_time() - t0


def _apply(held: HeldCopy | None, blob: bytearray) -> tuple[HeldCopy, float]:
    """On the side thread: the copy after the update in `blob` (`held` itself is not changed: a delta applies to
    a shallow copy of it, whose changed entries are new tensors); the thread's CPU seconds."""
    t0 = time.thread_time()
    base = None if held is None else HeldCopy(held.step, held.fmt, dict(held.weights), held.moments,
                                              dict(held.meta))
    return apply_update(base, state_from_bytes(blob)), time.thread_time() - t0


@dataclass
class _Incoming:
    """An update being received: its key (step, kind, base), its bytes, the ranges that arrived."""

    key: tuple
    buf: bytearray
    got: dict[int, int] = field(default_factory=dict)  # offset -> length
    complete: bool = False


def _seen(task: asyncio.Task) -> None:
    """A part's task that failed where no COMMIT came for it (its attempt aborted, or the next step's part replaced
    it): an expected end (a holder gone, a voided update), said on one debug line, not left to asyncio's "Task
    exception was never retrieved" traceback."""
    if not task.cancelled() and (e := task.exception()) is not None:
        log.debug("copy part not delivered (no COMMIT waited for it): %s", str(e) or type(e).__name__)


class Streams:
    """This peer's stage's copy stream (owner) and the copies it holds for others (holder)."""

    def __init__(self, membership: Membership, hosted: HostedStage, compute: ComputeQueue) -> None:
        self.membership, self.hosted, self.compute = membership, hosted, compute
        self.side = SideThread()  # encodings (owner) and applications (holder) of updates
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
        self.applying: dict[int, tuple[int, asyncio.Task]] = {}  # owner stage -> (step, its complete update applied)
        self._locks: dict[int, asyncio.Lock] = {}

    # ---- the owner's side ----------------------------------------------------------------
    def step_started(self, work: CopyWork | None, step: int) -> None:
        """RUN_STEP: send this step's part of the copy (on its own task; COMMIT waits for it). A part 0 captures
        the stage's state now, as it enters the step (its passes do not change it; COMMIT waits for the encoding
        before the optimizer step does)."""
        if work is None or self.hosted.worker is None:
            return
        if self._task is not None and not self._task.done():
            if self._work == work:
                return  # a retry of the attempt while the part is still under way: the same part
            self._task.cancel()  # a part the coordinator gave up on (a failure voided its update)
        key = (work.step, work.kind, work.base)
        state = None
        if (self.update is None or self.update[0] != key) and work.part == 0 and work.step == step:
            state = capture_worker(self.hosted.serving(), work.step, self.hosted.omega, clone=False)
        self._sent, self._work = None, work
        self._task = asyncio.create_task(self._send(work, step, state))
        self._task.add_done_callback(_seen)

    async def _send(self, work: CopyWork, step: int, state: StageState | None) -> None:
        """Encode (part 0) and send this step's part; its failure is COMMIT's to report (`before_commit`)."""
        key = (work.step, work.kind, work.base)
        if self.update is None or self.update[0] != key:
            if state is None:
                raise ProtocolError(f"part {work.part} of the copy update as of step {work.step}, which this peer "
                                    "has not encoded")
            base, fmt = self._base(work)
            t0 = time.perf_counter()
            blob, after, cpu = await self.side.run(_encode, state, work.step, fmt, base)
            log.info("copy update of stage %d as of step %d (%s) encoded in %.3f s (%.3f s CPU on the side thread)",
                      self.hosted.index, work.step, work.kind, time.perf_counter() - t0, cpu)
            self.update = (key, blob, after)
        blob = self.update[1]
        total = len(blob)
        lo, hi = total * work.part // work.parts, total * (work.part + 1) // work.parts
        chunk = CopyChunk(owner=self.hosted.index, step=work.step, kind=work.kind, base=work.base, part=work.part,
                          parts=work.parts, offset=lo, total=total)
        await self.membership.call(work.holder, chunk, self.membership.timeouts.rpc_timeout, [blob_tensor(memoryview(blob)[lo:hi])],
                            link=(self.hosted.index, work.holder_stage))
        self._sent, self._sent_bytes = (work.step, work.part), hi - lo

    def _base(self, work: CopyWork) -> tuple[HeldCopy | None, CopyFormat]:
        """The copy `work`'s update is encoded against (None: a full update), and the format."""
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
        return base, fmt

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
        t0 = time.perf_counter()
        try:
            await asyncio.wait_for(task, self.membership.timeouts.rpc_timeout)
            if (waited := time.perf_counter() - t0) > 0.01:
                log.info("COMMIT waited %.3f s for the copy part", waited)
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
        """A part of stage `owner`'s update: stored and acknowledged at once (see the module)."""
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
                    self._promote(owner)  # the update this one is based on: the holder has it (applied meanwhile)
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

    def _promote(self, owner: int) -> None:
        """`owner`'s complete update is the holder's: a full one is the held copy at once (its tensors are the
        received bytes'), a delta is applied to it in a task of its own, on the side thread, after the update
        before it (`_settled` waits for it)."""
        inc = self.incoming.pop(owner)
        if inc.key[1] == "full":
            self.held[owner] = apply_update(None, state_from_bytes(inc.buf))
            log.info("copy of stage %d now as of step %d (full)", owner, inc.key[0])
            return
        before = self.applying.get(owner)
        task = asyncio.create_task(self._apply(owner, inc, None if before is None else before[1]))
        self.applying[owner] = (inc.key[0], task)

    async def _apply(self, owner: int, inc: _Incoming, before: asyncio.Task | None) -> None:
        if before is not None:
            await asyncio.shield(before)
        try:
            (step, kind, base) = inc.key
            held = self.held.get(owner)
            if kind == "delta" and (held is None or held.step != base):
                log.warning("copy update of stage %d as of step %d is based on step %s, but this peer holds %s: "
                            "dropped", owner, step, base, None if held is None else held.step)
                return
            t0 = time.perf_counter()
            try:
                after, cpu = await self.side.run(_apply, held if kind == "delta" else None, inc.buf)
            except ValueError as e:
                log.warning("copy update of stage %d as of step %d does not apply: %s", owner, step, e)
                return
            if self.held.get(owner) is held:  # (not dropped meanwhile)
                self.held[owner] = after
            log.info("copy of stage %d now as of step %d (%s, applied in %.3f s, %.3f s CPU on the side thread)",
                     owner, step, kind, time.perf_counter() - t0, cpu)
        finally:
            if self.applying.get(owner, (None, None))[1] is asyncio.current_task():
                del self.applying[owner]

    async def _settled(self, owner: int) -> None:
        """Until `owner`'s updates being applied are."""
        while (applying := self.applying.get(owner)) is not None:
            await asyncio.shield(applying[1])

    def holds(self, owner: int, step: int) -> bool:
        held, inc, applying = self.held.get(owner), self.incoming.get(owner), self.applying.get(owner)
        return ((held is not None and held.step == step) or (inc is not None and inc.complete and inc.key[0] == step)
                or (applying is not None and applying[0] == step))

    async def fetch(self, owner: int, step: int) -> bytearray:
        """The copy of `owner` as of `step` (the held copy, or the complete update of that step applied first),
        serialised as a held copy's tree."""
        async with self._lock(owner):
            inc = self.incoming.get(owner)
            if inc is not None and inc.complete and inc.key[0] == step:
                self._promote(owner)
            await self._settled(owner)
            held = self.held.get(owner)
            if held is None or held.step != step:
                raise ProtocolError(f"no copy of stage {owner} as of step {step} here "
                                    f"(have: {None if held is None else held.step})")
            return await self.compute.run(lambda: state_to_bytes(copy_to_tree(held)))

    def drop_held(self) -> None:
        """Copies held for others are gone (this peer takes another role)."""
        for _, task in self.applying.values():
            task.cancel()
        self.held.clear()
        self.incoming.clear()
        self.applying.clear()

    def shutdown(self) -> None:
        """The peer stops: the side thread with it."""
        self.side.shutdown()

    @staticmethod
    def decode(blob) -> HeldCopy:
        return copy_from_tree(state_from_bytes(blob))
