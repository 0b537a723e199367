"""Reading a stream with ``recv_into``: a message body goes from the socket straight into its own buffer.

asyncio's ``StreamReader`` copies every received byte twice in user space: ``recv()`` makes a bytes object, the
reader appends it to its buffer, and ``read(n)`` slices a new bytes object out of that buffer (which a caller
then copies a third time into the message body). A ``FramedReader`` is an ``asyncio.BufferedProtocol``: the event
loop calls ``sock.recv_into`` on the buffer it hands out. Small reads (a length prefix, a protocol name, a
handshake) go through a small scratch buffer; ``readinto(view)`` first moves what the scratch buffer already holds
(at most ``SCRATCH_BYTES``) and then lets the kernel write the rest of the body into ``view`` itself.

`adopt(reader, writer)` takes a connection over from the ``StreamReader`` asyncio or hivemind's p2pd client
created (``transport.set_protocol``; the bytes the reader already buffered are moved over). The
``StreamWriter`` keeps working: flow control (``drain``) and the connection's end are passed on to the
protocol it waits on.
"""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["SCRATCH_BYTES", "FramedReader", "adopt"]

SCRATCH_BYTES = 64 << 10  # small reads; also the most a message body can be copied in user space


class FramedReader(asyncio.BufferedProtocol):
    """The reading end of one connection: ``read``, ``readexactly`` (small reads through the scratch buffer),
    ``readinto`` (a body, received in place), and ``at_eof`` / ``exception`` as a ``StreamReader`` has them."""

    def __init__(self, transport: asyncio.BaseTransport, previous: Any, scratch_bytes: int = SCRATCH_BYTES) -> None:
        self._transport = transport
        self._previous = previous  # the protocol the StreamWriter waits on (drain, wait_closed)
        self._scratch = memoryview(bytearray(scratch_bytes))
        self._start = self._end = 0  # unread bytes: _scratch[_start:_end]
        self._target: memoryview | None = None  # a readinto in progress, filled up to _filled
        self._filled = 0
        self._into_target = False  # which buffer the last get_buffer handed out
        self._eof = False
        self._exc: BaseException | None = None
        self._waiter: asyncio.Future | None = None
        self._paused = False

    # ---- the protocol side (called by the event loop) ----------------------------------------
    def get_buffer(self, sizehint: int) -> memoryview:
        if self._target is not None:
            self._into_target = True
            return self._target[self._filled:]
        self._into_target = False
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._scratch):  # unread bytes moved to the front (at most SCRATCH_BYTES)
            n = self._end - self._start
            self._scratch[:n] = self._scratch[self._start:self._end]
            self._start, self._end = 0, n
        return self._scratch[self._end:]

    def buffer_updated(self, nbytes: int) -> None:
        if self._into_target:
            self._filled += nbytes
            if self._filled == len(self._target):  # type: ignore[arg-type]
                self._target = None  # the next bytes go to the scratch buffer
                self._wake()
            return
        self._end += nbytes
        if self._start == 0 and self._end == len(self._scratch):
            self._pause()  # full: nothing more until the reader takes some
        self._wake()

    def eof_received(self) -> bool:
        self._eof = True
        self._wake()
        return True  # the writing side stays open (an error reply may still be sent); the writer closes it

    def connection_lost(self, exc: Exception | None) -> None:
        self._eof = True
        if exc is not None:
            self._exc = exc
        self._wake()
        self._previous.connection_lost(exc)

    def pause_writing(self) -> None:
        self._previous.pause_writing()

    def resume_writing(self) -> None:
        self._previous.resume_writing()

    def feed(self, data: bytes) -> None:
        """Bytes received before this reader took the connection over (at most one scratch buffer's worth)."""
        self._scratch[self._end:self._end + len(data)] = data
        self._end += len(data)

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _pause(self) -> None:
        if not self._paused and not self._transport.is_closing():
            self._paused = True
            self._transport.pause_reading()  # type: ignore[attr-defined]

    def _resume(self) -> None:
        if self._paused:
            self._paused = False
            self._transport.resume_reading()  # type: ignore[attr-defined]

    async def _wait(self) -> None:
        """Until the event loop delivers something (bytes, the end of the stream or an error)."""
        if self._exc is not None:
            raise self._exc
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    # ---- the reading side ---------------------------------------------------------------------
    def at_eof(self) -> bool:
        return self._eof and self._start == self._end

    def exception(self) -> BaseException | None:
        return self._exc

    async def read(self, n: int = -1) -> bytes:
        """At most ``n`` buffered bytes once some are there; b"" at the end of the stream (``n`` = -1: every byte
        up to the end of the stream)."""
        if n < 0:
            out = b""
            while chunk := await self.read(len(self._scratch)):
                out += chunk
            return out
        while self._start == self._end:
            if self._exc is not None:
                raise self._exc
            if self._eof:
                return b""
            await self._wait()
        k = min(n, self._end - self._start)
        out = bytes(self._scratch[self._start:self._start + k])
        self._start += k
        self._resume()
        return out

    async def readexactly(self, n: int) -> bytes:
        """Exactly ``n`` bytes; ``asyncio.IncompleteReadError`` if the stream ends first."""
        out = b""
        while len(out) < n:
            chunk = await self.read(n - len(out))
            if not chunk:
                raise asyncio.IncompleteReadError(out, n)
            out += chunk
        return out

    async def readinto(self, view: memoryview) -> None:
        """Fill ``view`` (a writable byte view): what is buffered, then straight from the socket. Raises
        ``asyncio.IncompleteReadError`` (with no partial bytes) if the stream ends first; a failed or cancelled
        read drops its reference to ``view`` at once."""
        k = min(len(view), self._end - self._start)
        view[:k] = self._scratch[self._start:self._start + k]
        self._start += k
        if k == len(view):
            return
        self._target, self._filled = view, k
        self._resume()
        try:
            while self._target is not None:
                if self._eof or self._exc is not None:
                    if self._exc is not None:
                        raise self._exc
                    raise asyncio.IncompleteReadError(b"", len(view))
                await self._wait()
        finally:
            self._target = None


def adopt(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> FramedReader:
    """Take the reading of ``writer``'s connection over from ``reader``: from now on the socket's bytes go to the
    returned ``FramedReader`` (the bytes ``reader`` had already buffered are moved into it; at most a few
    ``StreamReader`` chunks, read before the caller's first request or reply)."""
    transport = writer.transport
    framed = FramedReader(transport, transport.get_protocol())
    transport.set_protocol(framed)
    # asyncio's StreamReader has no public "take what you hold without waiting": its buffer and end-of-stream
    # flag are read directly (the same attributes since Python 3.4)
    raw: Any = reader  # (its private attributes)
    held = bytes(raw._buffer)  # noqa: SLF001
    raw._buffer.clear()  # noqa: SLF001
    if len(held) >= len(framed._scratch):  # room after them: a full scratch buffer would go to the socket empty
        framed._scratch = memoryview(bytearray(len(held) + SCRATCH_BYTES))  # ("get_buffer() returned an empty buffer")
    framed.feed(held)
    framed._eof = raw._eof  # noqa: SLF001
    framed._exc = reader.exception()
    socket: Any = transport  # a selector transport: it reads and can be paused
    if not socket.is_closing() and not socket.is_reading():
        socket.resume_reading()  # (the StreamReader had paused it, full)
    return framed
