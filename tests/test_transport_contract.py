"""One contract, four transports: hivemind (p2pd), py-libp2p, direct TCP and the in-process test tier's memory
network each behave the same through the
`checkfree.net.base.Transport` interface (round trips of every dtype, concurrency, errors with their kind,
timeouts, unknown names, the extra header, unregister, a dead peer). The transport-specific details (stream
reuse, handshakes, daemons) stay in test_transport.py, test_libp2p_transport.py and test_tcp_transport.py."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest
import torch

from checkfree.net.base import Transport
from checkfree.net.transport import RemoteError, TransportError, TransportTimeout
from checkfree.protocol import Kind, ProtocolError, StepFailed

pytestmark = pytest.mark.timeout(120)


@contextlib.asynccontextmanager
async def _pair(kind: str) -> AsyncIterator[tuple[Transport, Transport]]:
    """(server, client) of one transport on loopback, the client able to reach the server."""
    if kind == "hivemind":
        from hivemind.p2p import P2P

        from checkfree.net.hivemind_transport import HivemindTransport

        a = await P2P.create()
        b = await P2P.create(initial_peers=[str(m) for m in await a.get_visible_maddrs()])
        server, client = HivemindTransport(a, owns_p2p=True), HivemindTransport(b, owns_p2p=True)
    elif kind == "libp2p":
        from checkfree.net.libp2p_transport import start_libp2p_transport

        server = await start_libp2p_transport()
        client = await start_libp2p_transport(initial_peers=server.get_visible_maddrs())
    elif kind == "memory":
        from checkfree.net.in_memory import MemoryNetwork, MemoryTransport

        net = MemoryNetwork()
        server, client = MemoryTransport(net), MemoryTransport(net)
    else:
        from checkfree.net.tcp_transport import start_tcp_transport

        server = await start_tcp_transport("QmServer", secret=b"0123456789abcdef-secret")
        client = await start_tcp_transport("QmClient", secret=b"0123456789abcdef-secret")
        client.add_peer_address(server.get_visible_maddrs()[0])
    try:
        yield server, client
    finally:
        await client.shutdown()
        await server.shutdown()


@pytest.fixture(params=["hivemind", "libp2p", "tcp", "memory"])
def kind(request) -> str:
    if request.param == "libp2p":
        from checkfree.net import libp2p_transport  # before anything imports libp2p bare (see that module)

        if libp2p_transport.LIBP2P_IMPORT_ERROR is not None:
            pytest.skip(f"the libp2p extra is not installed ({libp2p_transport.LIBP2P_IMPORT_ERROR})")
    return request.param


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_contract(kind: str) -> None:
    seen: list[str] = []

    async def echo(header: dict, tensors: list[torch.Tensor], peer) -> tuple[dict, list[torch.Tensor]]:
        seen.append(str(peer))
        await asyncio.sleep(header.get("delay", 0))
        return {**header, "n": len(tensors)}, tensors

    async def fail(header: dict, tensors: list[torch.Tensor], peer) -> tuple[dict, list[torch.Tensor]]:
        if header["how"] == "bad":
            raise ProtocolError("step 3 is not running", Kind.STRAGGLER)
        if header["how"] == "value":
            raise ValueError("shape mismatch")
        if header["how"] == "detail":
            raise StepFailed("an uncorrectable soft error", Kind.SOFT_ERROR, {"soft_errors": {"escalated": 2}})
        raise RuntimeError("a bug")

    async def hang(header: dict, tensors: list[torch.Tensor], peer) -> tuple[dict, list[torch.Tensor]]:
        await asyncio.Event().wait()
        return {}, []

    async def main() -> None:
        async with _pair(kind) as (server, client):
            assert isinstance(server, Transport) and server.kind == kind
            for name, handler in (("echo", echo), ("fail", fail), ("hang", hang)):
                await server.register(name, handler)
            tensors = [torch.randn(3, 5), torch.randn(4).to(torch.bfloat16), torch.arange(7), torch.zeros(0, 2),
                       torch.tensor(2.5, dtype=torch.float16), torch.tensor([True, False])]
            header, back = await client.call(server.peer_id, "echo", {"x": [1, "a"], "y": None}, tensors, timeout=30)
            assert header == {"x": [1, "a"], "y": None, "n": len(tensors)}
            assert len(back) == len(tensors) and all(_same(a, b) for a, b in zip(back, tensors))
            assert seen == [str(client.peer_id)]  # the handler learns who called

            replies = await asyncio.gather(*(client.call(server.peer_id, "echo", {"i": i, "delay": 0.05 * (i % 3)},
                                                         [torch.full((1000,), float(i))], timeout=30)
                                             for i in range(8)))
            assert [h["i"] for h, _ in replies] == list(range(8))
            assert all(torch.equal(t[0], torch.full((1000,), float(i))) for i, (_, t) in enumerate(replies))

            for how, kind_, text in (("bad", "straggler", "step 3 is not running"),
                                     ("value", "bad_request", "shape mismatch"), ("bug", "internal", "a bug")):
                with pytest.raises(RemoteError) as err:
                    await client.call(server.peer_id, "fail", {"how": how}, timeout=30)
                assert err.value.kind == kind_ and text in err.value.remote_message, (how, err.value)
                assert err.value.detail == {}
            with pytest.raises(RemoteError) as err:  # an error's figures travel with it, as a value
                await client.call(server.peer_id, "fail", {"how": "detail"}, timeout=30)
            assert err.value.kind == Kind.SOFT_ERROR and err.value.detail == {"soft_errors": {"escalated": 2}}

            started = time.monotonic()
            with pytest.raises(TransportTimeout):
                await client.call(server.peer_id, "hang", {}, timeout=1.0)
            assert time.monotonic() - started < 10
            with pytest.raises(TransportError):
                await client.call(server.peer_id, "no-such-handler", {}, timeout=10)

            client.extra_header = {"token": "t0k"}
            header, _ = await client.call(server.peer_id, "echo", {"x": 1}, timeout=30)
            assert header["token"] == "t0k" and header["x"] == 1
            client.extra_header = {}

            await server.unregister("echo")
            with pytest.raises(TransportError):
                await client.call(server.peer_id, "echo", {}, timeout=10)

            peer = server.peer_id
            await server.shutdown()
            started = time.monotonic()
            with pytest.raises(TransportError):
                await client.call(peer, "fail", {"how": "bad"}, timeout=20)
            assert time.monotonic() - started < 20

    asyncio.run(main())
