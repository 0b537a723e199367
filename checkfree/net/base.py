"""The one interface every RPC transport implements (hivemind, libp2p, tcp), as a `typing.Protocol`.

A transport serves named request handlers and calls other peers' handlers: one request message (a header
dict and tensors, `checkfree.net.wire`) and one reply per call. Errors: `checkfree.net.errors`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["Handler", "Transport"]

# A request handler: (header, tensors, caller's peer id) -> (reply header, reply tensors).
Handler = Callable[[dict, list[torch.Tensor], Any], Awaitable[tuple[dict, Sequence[torch.Tensor]]]]


@runtime_checkable
class Transport(Protocol):
    """Request/reply RPC between peers. ``kind`` is its --transport name; ``extra_header`` is merged into every
    request it sends (e.g. the run's membership token)."""

    kind: str
    extra_header: dict

    @property
    def peer_id(self) -> Any:
        """This process's peer id (a hivemind ``PeerID`` or its base58 string)."""
        ...

    async def register(self, name: str, handler: Handler) -> None:
        """Serve ``name`` with ``handler``; a failing handler becomes an error reply (``RemoteError`` at the caller)."""
        ...

    async def unregister(self, name: str) -> None:
        ...

    async def call(self, peer_id: Any, name: str, header: dict, tensors: Sequence[torch.Tensor] = (), *,
                   timeout: float) -> tuple[dict, list[torch.Tensor]]:
        """One request to ``name`` on ``peer_id`` and its reply. Raises ``RemoteError`` (the remote side failed),
        ``TransportTimeout`` (no reply within ``timeout`` s) or ``TransportError`` (unreachable, broken stream)."""
        ...

    async def shutdown(self) -> None:
        ...
