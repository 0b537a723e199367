"""The asyncio <-> trio bridge of `checkfree.net.libp2p_transport`: py-libp2p is trio-based and cannot share
hivemind's asyncio loop, so the libp2p host runs ``trio.run`` in a dedicated daemon thread.

asyncio -> trio (`TrioThread._submit`): a job starts in the trio thread with ``TrioToken.run_sync_soon`` and its
result comes back through ``loop.call_soon_threadsafe`` into an asyncio future; cancelling that future (e.g. a
timeout) cancels the trio job. trio -> asyncio (`TrioThread._t_run_on_loop`): a coroutine runs on the asyncio loop
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
    """The trio thread a `Libp2pTransport` runs its host in (the subclass provides ``_trio_main``)."""

    _loop: asyncio.AbstractEventLoop | None
    _thread: threading.Thread | None
    _token: Any
    _nursery: Any
    _stop: Any
    _closed: bool
    shutdown_timeout: float

    async def _trio_main(self, ready: concurrent.futures.Future) -> None:
        raise NotImplementedError

    def _thread_main(self, ready: concurrent.futures.Future) -> None:
        try:
            trio.run(self._trio_main, ready)
        except BaseException as e:  # noqa: BLE001 - reported to the starter or logged, never lost
            if not ready.done():
                ready.set_exception(e if isinstance(e, Exception) else RuntimeError(repr(e)))
            else:
                logger.warning("libp2p trio thread ended with %s", error_text(e))

    def _request_stop(self) -> None:  # trio thread
        if self._stop is not None:
            self._stop.set()

    async def _join_thread(self) -> None:
        thread = self._thread
        if thread is not None and thread.is_alive():
            await asyncio.get_running_loop().run_in_executor(None, thread.join, self.shutdown_timeout)
            if thread.is_alive():
                logger.warning("libp2p trio thread did not stop within %.1f s", self.shutdown_timeout)

    # ------------------------------------------------------------ asyncio -> trio bridge

    def _submit(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> asyncio.Future:
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

    async def _t_run_on_loop(self, coro: Coroutine[Any, Any, Any]) -> Any:
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
