"""Checked by mypy in tests/test_layers.py (not collected by pytest): each RPC transport conforms to the
`checkfree.net.base.Transport` protocol, signatures included."""

from checkfree.net.base import Transport
from checkfree.net.hivemind_transport import HivemindTransport
from checkfree.net.libp2p_transport import Libp2pTransport
from checkfree.net.in_memory import MemoryTransport
from checkfree.net.relay import RelayTransport
from checkfree.net.tcp_transport import TcpTransport


def conforms(h: HivemindTransport, t: TcpTransport, lp: Libp2pTransport, m: MemoryTransport,
             r: RelayTransport) -> list[Transport]:
    return [h, t, lp, m, r]
