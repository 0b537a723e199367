"""The asyncio <-> trio bridge of `checkfree.net.libp2p_transport`: py-libp2p is trio-based and cannot share
hivemind's asyncio loop, so the libp2p host runs ``trio.run`` in a dedicated daemon thread.

asyncio -> trio (`TrioThread.submit`): a job starts in the trio thread with ``TrioToken.run_sync_soon`` and its
result comes back through ``loop.call_soon_threadsafe`` into an asyncio future; cancelling that future (e.g. a
timeout) cancels the trio job. trio -> asyncio (`TrioThread.run_on_loop`): a coroutine runs on the asyncio loop
via ``run_coroutine_threadsafe`` while the trio task waits for it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from checkfree.net.errors import TransportError
from checkfree.net.libp2p_support import trio

__all__ = ["TrioThread", "error_text"]

logger = logging.getLogger(__name__)


def error_text(e: BaseException) -> str:
    if isinstance(e, BaseExceptionGroup):
        return "; ".join(error_text(x) for x in e.exceptions)
    cause = e.__cause__ or e.__context__
    text = f"{type(e).__name__}: {e}"
    if cause is not None and str(cause) and str(cause) not in text:
        text += f" ({type(cause).__name__}: {cause})"
    return text


class _Job:
    """Cancellation handle shared by an asyncio future and the trio task computing it (trio-thread state)."""

    __slots__ = ("cancelled", "scope")

    def __init__(self) -> None:
        self.cancelled = False
        self.scope: Any = None

    def cancel(self) -> None:  # runs in the trio thread
        self.cancelled = True
        if self.scope is not None:
            self.scope.cancel()


def _settle(fut: asyncio.Future, result: Any = None, exc: BaseException | None = None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


class TrioThread:
    """A trio event loop in a daemon thread of its own, started from an asyncio loop, and the bridges between the
    two. It owns the thread, the trio token and the nursery submitted jobs run in: ``start(main, ready)`` runs
    ``await main(ready)`` under trio, and ``main`` holds ``serve(on_ready)`` open for as long as jobs may run;
    ``stop()`` ends both."""

    def __init__(self, name: str, shutdown_timeout: float) -> None:
        self.name = name
        self.shutdown_timeout = shutdown_timeout
        self._loop: asyncio.AbstractEventLoop | None = None  # the asyncio loop that started the thread
        self._thread: threading.Thread | None = None
        self._token: Any = None  # the trio loop's token, once it runs
        self._nursery: Any = None  # where submitted jobs run, while `serve` holds it open
        self._stop: Any = None  # a trio.Event: `serve` returns once it is set
        self._closed = False

    @property
    def started(self) -> bool:
        return self._thread is not None

    @property
    def closed(self) -> bool:
        return self._closed

    def start(self, main: Callable[[concurrent.futures.Future], Awaitable[None]],
              ready: concurrent.futures.Future) -> None:
        """(asyncio side) Start the thread: ``await main(ready)`` under trio; ``main`` sets ``ready`` once up, and
        an exception that ends the thread before that is set on ``ready``."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._thread_main, args=(main, ready), name=self.name, daemon=True)
        self._thread.start()

    def _thread_main(self, main: Callable[[concurrent.futures.Future], Awaitable[None]],
                     ready: concurrent.futures.Future) -> None:
        try:
            trio.run(self._t_main, main, ready)
        except BaseException as e:  # noqa: BLE001 - reported to the starter or logged, never lost
            if not ready.done():
                ready.set_exception(e if isinstance(e, Exception) else RuntimeError(repr(e)))
            else:
                logger.warning("libp2p trio thread ended with %s", error_text(e))

    async def _t_main(self, main: Callable[[concurrent.futures.Future], Awaitable[None]],
                      ready: concurrent.futures.Future) -> None:
        self._stop = trio.Event()
        self._token = trio.lowlevel.current_trio_token()
        await main(ready)

    async def serve(self, on_ready: Callable[[], None]) -> None:
        """(trio side) Hold the nursery submitted jobs run in: ``on_ready()`` once it is open, then wait for
        ``stop()`` and cancel what still runs."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            on_ready()
            await self._stop.wait()
            nursery.cancel_scope.cancel()
        self._nursery = None

    def _request_stop(self) -> None:  # trio thread
        if self._stop is not None:
            self._stop.set()

    async def stop(self) -> None:
        """(asyncio side) Refuse new jobs, stop the trio loop and wait for the thread (at most
        ``shutdown_timeout``); idempotent."""
        self._closed = True
        if self._token is not None:
            with contextlib.suppress(Exception):  # trio.RunFinishedError: already stopped
                self._token.run_sync_soon(self._request_stop)
        thread = self._thread
        if thread is not None and thread.is_alive():
            await asyncio.get_running_loop().run_in_executor(None, thread.join, self.shutdown_timeout)
            if thread.is_alive():
                logger.warning("libp2p trio thread did not stop within %.1f s", self.shutdown_timeout)

    # ------------------------------------------------------------ asyncio -> trio bridge

    def submit(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> asyncio.Future:
        """Run ``await fn(*args)`` as a task in the trio thread; the returned asyncio future gets its result.

        Cancelling the future cancels the trio task.
        """
        if self._closed or self._token is None:
            raise TransportError("libp2p transport is not running (shut down or not started)")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        job = _Job()

        def resolve(result: Any = None, exc: BaseException | None = None) -> None:  # trio thread
            with contextlib.suppress(RuntimeError):  # the asyncio loop is closed: nobody is waiting
                loop.call_soon_threadsafe(_settle, fut, result, exc)

        async def run() -> None:
            with trio.CancelScope() as scope:
                job.scope = scope
                if job.cancelled:
                    scope.cancel()
                try:
                    result = await fn(*args)
                except trio.Cancelled:
                    resolve(exc=TransportError("libp2p transport is shutting down"))
                    raise
                except BaseException as e:  # noqa: BLE001 - handed over to the asyncio side
                    resolve(exc=e)
                else:
                    resolve(result)
                    return
            if scope.cancelled_caught:
                resolve(exc=TransportError("cancelled"))

        def start() -> None:  # trio thread
            if self._nursery is None:
                resolve(exc=TransportError("libp2p transport is shutting down"))
            else:
                self._nursery.start_soon(run)

        def on_done(f: asyncio.Future) -> None:
            if f.cancelled():
                with contextlib.suppress(Exception):
                    self._token.run_sync_soon(job.cancel)

        try:
            self._token.run_sync_soon(start)
        except Exception as e:  # trio.RunFinishedError
            raise TransportError("libp2p transport is not running") from e
        fut.add_done_callback(on_done)
        return fut

    # ------------------------------------------------------------ trio -> asyncio bridge

    async def run_on_loop(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """From the trio thread: run ``coro`` on the asyncio loop and wait for its result."""
        assert self._loop is not None
        # RuntimeError if the loop is closed
        cfut: concurrent.futures.Future[Any] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        done = trio.Event()
        token = trio.lowlevel.current_trio_token()

        def wake(_: concurrent.futures.Future) -> None:
            with contextlib.suppress(Exception):  # trio.RunFinishedError
                token.run_sync_soon(done.set)

        cfut.add_done_callback(wake)
        try:
            await done.wait()
        except trio.Cancelled:
            cfut.cancel()
            raise
        return cfut.result()
