"""The serving side of a ``Libp2pTransport`` (`checkfree.net.libp2p_transport`): ``register``/``unregister``
a handler under protocol ``/checkfree/<name>/1.0.0`` and answer each incoming stream with one reply.

- any failure while reading, decoding or handling a request is answered with
  ``{"error": "<ExceptionType>: <message>"}`` and the server keeps serving;
- handlers have the ``Transport`` signature ``async handler(header, tensors, peer)`` and run on the asyncio
  loop that started the transport; ``peer`` is the caller's peer id as a base58 string;
- an incoming request's body is read in the trio thread (`checkfree.net.libp2p_bridge`), its handler runs on
  the asyncio loop and the reply frames go back to the trio thread; after replying the server half-closes
  (yamux FIN) and drains the stream until the caller closes it, for at most ``linger_timeout``.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from checkfree.net.base import Handler
from checkfree.net.errors import TransportError, failed_request
from checkfree.net.libp2p_bridge import TrioThread, error_text
from checkfree.net.libp2p_support import (
    READ_CHUNK_BYTES,
    IncompleteRead,
    protocol_id,
    t_close,
    t_read_body,
    t_read_some,
    t_reset,
    t_write_frames,
    trio,
)
from checkfree.net.wire import WireError, decode_body, encode_message

__all__ = ["Libp2pServer"]

logger = logging.getLogger(__name__)


class Libp2pServer:
    """The serving part of a `Libp2pTransport`: it owns the handlers, installs them on the libp2p host (``attach``,
    once the host runs in the trio thread) and answers each incoming stream, running the handler on the asyncio
    loop through the transport's `TrioThread`."""

    def __init__(self, trio_thread: TrioThread, *, max_message_bytes: int, read_timeout: float,
                 linger_timeout: float) -> None:
        self.trio_thread = trio_thread
        self.max_message_bytes = max_message_bytes
        self.read_timeout = read_timeout
        self.linger_timeout = linger_timeout
        self._handlers: dict[str, Handler] = {}
        self._host: Any = None  # the libp2p host, from `attach` on (trio thread)

    def attach(self, host: Any) -> None:  # trio thread, as the host starts
        self._host = host

    def names(self) -> list[str]:
        """The names served."""
        return list(self._handlers)

    async def register(self, name: str, handler: Handler) -> None:
        """Serve ``handler`` under protocol ``/checkfree/<name>/1.0.0``; each incoming stream is its own task."""
        self._handlers[name] = handler

        async def install() -> None:
            self._host.set_stream_handler(protocol_id(name), functools.partial(self._t_on_stream, name))

        await self.trio_thread.submit(install)

    async def unregister(self, name: str) -> None:
        self._handlers.pop(name, None)

        async def remove() -> None:
            self._host.remove_stream_handler(protocol_id(name))

        await self.trio_thread.submit(remove)

    async def _t_on_stream(self, name: str, stream: Any) -> None:
        try:
            peer = str(stream.muxed_conn.peer_id)
        except Exception:
            peer = "?"
        try:
            try:
                with trio.fail_after(self.read_timeout):
                    body = await t_read_body(stream, self.max_message_bytes)
            except IncompleteRead as e:
                logger.debug("%s: peer %s closed the stream mid-request: %s", name, peer, e)
                await t_reset(stream)
                return
            except (WireError, trio.TooSlowError) as e:
                bad: Exception = e if not isinstance(e, trio.TooSlowError) else TimeoutError(
                    f"request body not received within read_timeout={self.read_timeout:g} s")
                logger.warning("%s: bad request from %s: %s: %s", name, peer, type(bad).__name__, bad)
                frames = encode_message({"error": f"{type(bad).__name__}: {bad}"})
            else:
                try:
                    frames = await self.trio_thread.run_on_loop(self._handle(name, body, peer))
                except Exception as e:  # the asyncio loop is gone
                    frames = encode_message({"error": f"{type(e).__name__}: {e}"})
            await t_write_frames(stream, frames)
            await stream.close()  # yamux half-close: FIN after the reply, the read side stays open
            with trio.move_on_after(self.linger_timeout):  # drain until the caller closes its side
                while True:
                    await t_read_some(stream, READ_CHUNK_BYTES)
            await t_reset(stream)  # the caller never closed: drop the stream
        except IncompleteRead:  # the caller closed its side (normal end) or reset the stream
            await t_close(stream)
        except trio.Cancelled:
            await t_reset(stream)
            raise
        except Exception as e:
            logger.debug("%s: stream to %s broke while replying: %s", name, peer, error_text(e))
            await t_reset(stream)

    async def _handle(self, name: str, body: memoryview, peer: str) -> list[bytes | memoryview]:
        """asyncio side of an incoming request: decode, run the handler, encode the reply (or the error)."""
        try:
            handler = self._handlers.get(name)
            if handler is None:
                raise TransportError(f"no handler registered for '{name}'")
            header, tensors = decode_body(body)
            reply_header, reply_tensors = await handler(header, tensors, peer)
            return encode_message(reply_header, reply_tensors)
        except Exception as e:  # decoding, handler and reply-encoding errors all go back to the caller
            return encode_message(failed_request(e, name, peer, (WireError,)))
