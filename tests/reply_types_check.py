"""Checked by mypy in tests/test_layers.py (not collected by pytest): a call returns the reply type of its request,
statically. `joined` type-checks; `wrong` must be the one error (a JOIN is answered with a Joined, not a Pong)."""

from checkfree.messages import AssignFresh, Assigned, Join, Joined, Pong
from peers.membership import Membership
from coordinator.rpc import Rpc


async def joined(rpc: Rpc, peer: Membership) -> list[Joined | Assigned]:
    a, _ = await rpc.call("p", Join(peer_id="p"), 1.0)
    b, _ = await peer.call("p", Join(peer_id="p"), 1.0)
    c, _ = await rpc.call("p", AssignFresh(stage=1), 1.0)  # (an ASSIGN variant: the reply of every ASSIGN)
    return [a, b, c]


async def wrong(rpc: Rpc) -> Pong:
    reply, _ = await rpc.call("p", Join(peer_id="p"), 1.0)
    return reply  # the error
