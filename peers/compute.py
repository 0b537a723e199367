"""The compute queue: all of a peer's torch work runs on one thread, in priority then arrival order.

The event loop stays free to answer pings, heartbeats and weight requests while a stage
computes. Backward passes go before forward passes waiting with them (the 1F1B order within a
stage), and the queue counts the seconds it spent computing so a timed-out peer can tell
whether it was the straggler.

Work that no step should wait for (snap's copy updates: encoding one on its owner, applying one on its holder)
runs on a second thread, `IdleThread`, at the operating system's idle priority: it computes only on a core that
no other thread of the machine wants, in the bubbles of the whole swarm rather than in this stage's own (a
stage's bubble is another stage's pass, and on a machine the peers share both want the same cores). Who needs its
result now raises it to normal priority for as long as it waits (`IdleThread.urgent`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
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


class IdleThread:
    """One thread for work no step waits for, at the OS's idle priority (Linux's SCHED_IDLE; where there is none,
    or it is refused, at normal priority: then it still runs beside the compute thread, torch's ops releasing the
    GIL). `urgent()` raises it to normal priority while a caller waits for it, so that work somebody waits on is
    never starved by a busy machine."""

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="idle", initializer=self._started)
        self._tid: int | None = None  # the thread's native id, once it runs
        self._waiting = 0  # callers in `urgent` now
        self._lock = threading.Lock()  # (the thread's priority is set from the loop and the thread itself)

    def _started(self) -> None:
        with self._lock:
            self._tid = threading.get_native_id()
            self._apply()

    def _apply(self) -> None:
        """The thread's priority as `_waiting` says (under `_lock`)."""
        if self._tid is None or not hasattr(os, "SCHED_IDLE"):
            return
        policy = os.SCHED_OTHER if self._waiting else os.SCHED_IDLE
        try:
            os.sched_setscheduler(self._tid, policy, os.sched_param(0))
        except OSError as e:  # (a sandbox may refuse it: the work runs at normal priority)
            log.debug("idle thread's priority not changed: %s", e)

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` on the idle thread (after whatever runs there before it)."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    @contextlib.asynccontextmanager
    async def urgent(self) -> AsyncIterator[None]:
        """Within this block the thread runs at normal priority (a caller waits for its work)."""
        with self._lock:
            self._waiting += 1
            if self._waiting == 1:
                self._apply()
        try:
            yield
        finally:
            with self._lock:
                self._waiting -= 1
                if self._waiting == 0:
                    self._apply()

    def shutdown(self) -> None:
        """Stop the thread; work still queued is cancelled."""
        self.pool.shutdown(wait=False, cancel_futures=True)
