"""The address book of a ``Libp2pTransport`` (`checkfree.net.libp2p_transport`): the addresses of the peers
it calls, learnt from full multiaddrs, ``add_peer_address``, ``connect`` or its ``address_resolver`` (a DHT
lookup), and handed to the libp2p host's peerstore before a dial.

Addresses: a peer is reachable once its multiaddr is known. ``t.maddrs`` lists this transport's full
listen multiaddrs (``/ip4/127.0.0.1/tcp/PORT/p2p/<peer id>``) to hand to others. A caller can
(a) pass such a full multiaddr string as ``peer_id`` to ``call`` (its address is remembered), (b)
``t.add_peer_address(maddr)`` once and then call by bare peer id, (c) ``await t.connect(maddr)`` to dial
eagerly (also done for ``initial_peers`` at start), (d) call back a peer that dialed us: an existing
connection needs no address, or (e) set ``address_resolver``, asked once per peer called by bare id whose
address is unknown (the runtime looks the address up in the hivemind DHT: see
``checkfree.net.factory.start_transport``).

Fixed ports: py-libp2p listens with SO_REUSEPORT (for hole punching), so a second libp2p host on the
same fixed port does not fail to start; the kernel then splits incoming connections between both.
A port held by an ordinary socket does fail (``TransportError``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from checkfree.net.addresses import learn_addresses
from checkfree.net.errors import TransportError, TransportTimeout
from checkfree.net.libp2p_bridge import TrioThread, error_text
from checkfree.net.libp2p_support import ID, PERMANENT_ADDR_TTL, multiaddr

__all__ = ["Libp2pAddressBook"]


class Libp2pAddressBook:
    """The address book of a `Libp2pTransport`: it owns the addresses known (peer id -> transport addresses without
    /p2p) and the ``address_resolver``, and hands them to the libp2p host's peerstore (``attach``, once the host
    runs in the trio thread) before a dial, through the transport's `TrioThread`."""

    def __init__(self, trio_thread: TrioThread) -> None:
        self.trio_thread = trio_thread
        self._addresses: dict[str, list[str]] = {}
        self._host: Any = None  # the libp2p host, from `attach` on (trio thread)
        # asked for the addresses of a peer called by bare id when none are known (e.g. a DHT lookup)
        self.address_resolver: Callable[[str], Awaitable[Sequence[str]]] | None = None

    def attach(self, host: Any) -> None:  # trio thread, as the host starts
        self._host = host

    def use_resolver(self, resolver: Callable[[str], Awaitable[Sequence[str]]] | None) -> None:
        self.address_resolver = resolver

    def known(self, peer: str) -> list[str]:
        """The addresses known for ``peer`` (none: an empty list)."""
        return list(self._addresses.get(peer, ()))

    def forget(self, peer: str) -> None:
        """Forget ``peer``'s addresses (they are looked up again on the next call: moved, or a bad record)."""
        self._addresses.pop(peer, None)

    def add_peer_address(self, maddr: str, peer_id: str | None = None) -> str:
        """Remember an address of a peer; returns its peer id.

        ``maddr`` is a full multiaddr with ``/p2p/<id>``, or a transport address plus ``peer_id``.
        """
        addr = multiaddr.Multiaddr(str(maddr))
        try:
            embedded = addr.value_for_protocol("p2p")
        except Exception:
            embedded = None
        if embedded:
            if peer_id is not None and str(peer_id) != embedded:
                raise TransportError(f"multiaddr {maddr} names peer {embedded}, not {peer_id}")
            peer_id = embedded
            addr = addr.decapsulate(multiaddr.Multiaddr(f"/p2p/{embedded}"))
        if not peer_id:
            raise TransportError(f"multiaddr {maddr!r} has no /p2p/<peer id> and no peer_id was given")
        try:
            ID.from_base58(str(peer_id))
        except Exception as e:
            raise TransportError(f"invalid peer id {peer_id!r}: {e}") from e
        known = self._addresses.setdefault(str(peer_id), [])
        if str(addr) not in known:
            known.append(str(addr))
        return str(peer_id)

    def target(self, peer: Any) -> tuple[str, list[str]]:
        """``peer`` (a bare peer id, or a full multiaddr, remembered) as its id and the addresses known."""
        text = str(peer)
        if text.startswith("/"):
            text = self.add_peer_address(text)
        return text, list(self._addresses.get(text, ()))

    async def connect(self, maddr: str, *, timeout: float = 30.0) -> str:
        """Dial a peer at a full multiaddr now (and remember its address); returns its peer id."""
        peer, addrs = self.target(maddr)
        try:
            await asyncio.wait_for(self.trio_thread.submit(self._t_connect, peer, addrs), timeout)
        except asyncio.TimeoutError:
            raise TransportTimeout(f"connecting to {maddr} timed out after {timeout:g} s") from None
        return peer

    def t_remember(self, peer: str, addrs: Sequence[str]) -> Any:
        """The peer's ID; its dialable addresses become exactly ``addrs`` (if any are given): py-libp2p dials
        only the first TCP address it holds for a peer, so a stale one must not stay in front."""
        pid = ID.from_base58(peer)
        if addrs:
            store = self._host.get_peerstore()
            store.clear_addrs(pid)
            store.add_addrs(pid, [multiaddr.Multiaddr(a) for a in addrs], PERMANENT_ADDR_TTL)
        return pid

    async def _t_connect(self, peer: str, addrs: Sequence[str]) -> None:
        from libp2p.peer.peerinfo import PeerInfo

        pid = self.t_remember(peer, addrs)
        try:
            await self._host.connect(PeerInfo(pid, [multiaddr.Multiaddr(a) for a in addrs]))
        except Exception as e:
            raise TransportError(f"cannot connect to peer {peer} at {addrs}: {error_text(e)}") from e

    async def resolve(self, peer: str, addrs: list[str]) -> list[str]:
        """``addrs``, or, when no address of ``peer`` is known, what ``address_resolver`` finds (remembered).

        A failed or empty lookup is not an error here: an existing connection (the peer dialed us) needs no
        address, and without one the call fails with the usual "No known addresses" ``TransportError``.
        """
        if addrs or self.address_resolver is None:
            return addrs
        await learn_addresses(self, peer)
        return list(self._addresses.get(peer, ()))
