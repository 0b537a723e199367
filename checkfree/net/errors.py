"""What goes wrong in an RPC, as values: the exceptions every transport raises, and the server side's
one way of turning a failed request into an error reply (a rate-limited warning for expected refusals,
a traceback only for a bug in a handler)."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any

from checkfree.net.wire import WireError

__all__ = ["TransportError", "TransportTimeout", "RemoteError", "remote_error", "RefusalLog", "REFUSALS", "warn_once", "expected",
           "failed_request"]

logger = logging.getLogger("checkfree.net.transport")


class TransportError(Exception):
    """A call could not be completed: peer unreachable, stream broken, invalid reply, startup failure."""


class TransportTimeout(TransportError, TimeoutError):
    """A call did not complete within its timeout (also an ``asyncio.TimeoutError``)."""


class RemoteError(TransportError):
    """The remote handler (or the remote decoder) failed; ``remote_message`` is its error string and
    ``kind`` what happened, as a word callers branch on (the error's own ``kind``, e.g. a step's
    ``straggler``; ``bad_request`` for malformed input; ``internal`` for a bug), never the text; ``detail``
    the error's own figures, if it carried any (a dict, else empty)."""

    def __init__(self, message: str, remote_message: str, kind: str = "internal", detail: dict | None = None) -> None:
        super().__init__(message)
        self.remote_message = remote_message
        self.kind = kind
        self.detail = detail or {}


def remote_error(peer: Any, name: str, reply_header: dict) -> RemoteError:
    """The RemoteError of an error reply ``{"error": text, "kind": kind[, "detail": {...}]}``."""
    kind, detail = reply_header.get("kind"), reply_header.get("detail")
    return RemoteError(f"peer {peer} failed '{name}': {reply_header['error']}", str(reply_header["error"]),
                       kind if isinstance(kind, str) else "internal", detail if isinstance(detail, dict) else None)


class RefusalLog:
    """One-line warnings for expected refusals (bad or unauthorized requests, aborted attempts), at
    most `per_window` per `window_s` seconds; the rest are counted and summed up in the next line
    that gets through, so hostile traffic cannot grow a log without bound."""

    def __init__(self, per_window: int = 10, window_s: float = 60.0) -> None:
        self.per_window, self.window_s = per_window, window_s
        self._start, self._shown, self._dropped = -math.inf, 0, 0

    def warn(self, text: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._start > self.window_s:
            if self._dropped:
                logger.warning("(%d similar refusal line(s) suppressed in the last %.0f s)", self._dropped,
                               now - self._start)
            self._start, self._shown, self._dropped = now, 0, 0
        if self._shown >= self.per_window:
            self._dropped += 1
            return
        self._shown += 1
        logger.warning(text, *args)


REFUSALS = RefusalLog()

_WARNED: set[str] = set()  # the warnings this process has printed (`warn_once`)


def warn_once(log: logging.Logger, text: str) -> None:
    """`text` as a warning, the first time this process gives it: a warning of how a process runs (a transport
    without a run secret) is said once, not for every transport it starts (a generated-schedule test run starts
    hundreds)."""
    if text not in _WARNED:
        _WARNED.add(text)
        log.warning(text)


def expected(e: BaseException) -> bool:
    """An error that normal operation produces (a bad or refused request, an aborted step): a
    one-line warning, not a traceback. Malformed input raises ValueError subclasses (WireError,
    ProtocolError); other expected conditions carry ``expected = True``."""
    return isinstance(e, (ValueError, asyncio.TimeoutError)) or getattr(e, "expected", False)


def failed_request(e: Exception, what: str, peer: Any, bad: tuple[type, ...] = (asyncio.TimeoutError, WireError)) -> dict:
    """Log a request that failed on a server (a rate-limited one-line warning for a ``bad`` request or
    an expected condition, the traceback for a bug in a handler) and return its error reply
    ``{"error": text, "kind": kind}`` (and the error's ``detail`` dict, if it has one); ``what`` names the
    protocol in the log."""
    if isinstance(e, bad) or expected(e):
        REFUSALS.warn("%s: refused request from %s: %s: %s", what, peer, type(e).__name__, str(e)[:300])
        kind = getattr(e, "kind", None) or ("timeout" if isinstance(e, asyncio.TimeoutError) else "bad_request")
    else:
        logger.exception("%s: handler failed for request from %s", what, peer)
        kind = "internal"
    detail = getattr(e, "detail", None)
    return {"error": f"{type(e).__name__}: {e}", "kind": kind, **({"detail": detail} if detail else {})}

