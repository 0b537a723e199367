"""The compute queue: all of a peer's torch work runs on one thread, in priority then arrival order.

The event loop stays free to answer pings, heartbeats and weight requests while a stage
computes. Backward passes go before forward passes waiting with them (the 1F1B order within a
stage), and the queue counts the seconds it spent computing so a timed-out peer can tell
whether it was the straggler.

Work that no step should wait for (snap's copy updates: encoding one on its owner, applying one on its holder)
runs on a second thread, `SideThread`, beside the compute thread, at normal priority (its docstring says why not
the OS's idle priority).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

__all__ = ["BACKWARD_FIRST", "ComputeQueue", "IdleThread"]

log = logging.getLogger(__name__)

BACKWARD_FIRST = 0  # priority of backward passes: gradients drain before new activations pile up
DEFAULT_PRIORITY = 1  # everything else


class ComputeQueue:
    """One compute thread fed by a priority queue that a single pump task drains."""

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")
        self._queue: asyncio.PriorityQueue = asyncio.PriorityQueue()
        self._seq = 0  # arrival order among work of equal priority
        self._pump: asyncio.Task | None = None
        self._busy_s = 0.0  # time the compute thread has spent on finished work
        self._busy_since: float | None = None  # start of the computation running now
        self._idle: asyncio.Event | None = None  # set while nothing is queued or running

    async def run(self, fn: Callable[..., Any], *args: Any, priority: int = DEFAULT_PRIORITY) -> Any:
        """Run `fn(*args)` on the compute thread and return its result. Lower `priority` runs
        first among waiting work (BACKWARD_FIRST for backward passes)."""
        fut = asyncio.get_running_loop().create_future()
        self._idle_event().clear()
        self._seq += 1
        self._queue.put_nowait((priority, self._seq, fn, args, fut))
        if self._pump is None or self._pump.done():
            self._pump = asyncio.create_task(self._drain())
        return await fut

    def _idle_event(self) -> asyncio.Event:
        if self._idle is None:
            self._idle = asyncio.Event()
            self._idle.set()
        return self._idle

    async def idle(self) -> None:
        """Until the compute thread has nothing queued or running: the stage's bubble in the running schedule."""
        await self._idle_event().wait()

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            await self._drain_queue(loop)
        finally:
            if self._queue.empty():
                self._idle_event().set()

    async def _drain_queue(self, loop: asyncio.AbstractEventLoop) -> None:
        while not self._queue.empty():
            _, _, fn, args, fut = self._queue.get_nowait()
            if fut.cancelled():
                continue
            self._busy_since = time.monotonic()
            try:
                result = await loop.run_in_executor(self.pool, fn, *args)
            except BaseException as e:  # noqa: BLE001 - handed to the awaiting caller
                if not fut.done():
                    fut.set_exception(e)
            else:
                if not fut.done():
                    fut.set_result(result)
            finally:
                self._busy_s += time.monotonic() - self._busy_since
                self._busy_since = None

    def busy(self) -> float:
        """Seconds the compute thread has spent computing so far (the running computation included)."""
        return self._busy_s + (time.monotonic() - self._busy_since if self._busy_since is not None else 0.0)

    def shutdown(self, wait: bool = False) -> None:
        """Stop the compute thread; work still queued is cancelled."""
        self.pool.shutdown(wait=wait, cancel_futures=True)


class SideThread:
    """One thread beside the compute thread for work no step waits for (a snap copy's encoding and application), at
    normal priority. Not at the OS's idle priority: a thread at Linux's SCHED_IDLE that runs Python code holds the
    GIL between its torch ops, and on a busy machine it is not scheduled for long stretches while the peer's event
    loop waits for the GIL (benchmarks/gil_priority.py: the loop's worst wake-up 15 times later than with the
    thread at normal priority); a peer answers pings and heartbeats from that loop."""

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="side")

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` on the side thread (after whatever runs there before it)."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def shutdown(self) -> None:
        """Stop the thread; work still queued is cancelled."""
        self.pool.shutdown(wait=False, cancel_futures=True)
