"""Tests for checkfree.net.libp2p_transport: the Transport interface on py-libp2p (two real hosts on loopback).

Same behaviours as the transport tests in test_transport.py (hivemind/p2pd), plus address handling,
shutdown of the trio thread and coexistence of hivemind and libp2p in one process.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator

import msgpack
import pytest
import torch

# Imported before libp2p on purpose: it gives libp2p's protobufs their own descriptor pool, without
# which libp2p and hivemind cannot both be imported in this process (duplicate crypto.pb symbols).
from checkfree.net import libp2p_transport as lt

pytest.importorskip("libp2p", reason="py-libp2p is not installed (optional): pip install 'checkfree[libp2p]'")

from checkfree.net.libp2p_transport import (  # noqa: E402
    Libp2pTransport,
    RemoteError,
    TransportError,
    TransportTimeout,
    start_libp2p_transport,
)
from checkfree.net.libp2p_support import t_read_body  # noqa: E402
from checkfree.net.wire import WireError, decode_body, encode_message  # noqa: E402


def _trio_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("libp2p-trio")]


@pytest.fixture(autouse=True)
def no_leaked_trio_thread():
    before = set(_trio_threads())
    yield
    deadline = time.monotonic() + 10
    while (left := set(_trio_threads()) - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"libp2p trio threads still running: {[t.name for t in left]}"


@contextlib.asynccontextmanager
async def _pair() -> AsyncIterator[tuple[Libp2pTransport, Libp2pTransport]]:
    """Two libp2p hosts on 127.0.0.1 (port 0), b dialed into a; yields (server, client)."""
    a = await start_libp2p_transport()
    b = None
    try:
        b = await start_libp2p_transport(initial_peers=a.get_visible_maddrs())
        yield a, b
    finally:
        if b is not None:
            await b.shutdown()
        await a.shutdown()


async def _echo(header: dict, tensors: list[torch.Tensor], peer) -> tuple[dict, list[torch.Tensor]]:
    return {**header, "from": str(peer), "n": len(tensors)}, tensors


async def _fail(header: dict, tensors: list[torch.Tensor], peer) -> tuple[dict, list[torch.Tensor]]:
    raise ValueError("handler exploded on purpose")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def _raw_message(envelope: object, payload: bytes = b"") -> bytes:
    packed = msgpack.packb(envelope, use_bin_type=True)
    body = len(packed).to_bytes(4, "big") + packed
    body += bytes(-len(body) % 64) + payload if payload else b""
    return len(body).to_bytes(8, "big") + body


@pytest.mark.timeout(180)
def test_libp2p_exchanges_tensors_and_serves_concurrently() -> None:
    async def main() -> None:
        async with _pair() as (server, client):
            assert isinstance(server.peer_id, str) and server.peer_id.startswith("12D3")
            (maddr,) = server.get_visible_maddrs()
            assert maddr.startswith("/ip4/127.0.0.1/tcp/") and maddr.endswith(f"/p2p/{server.peer_id}")
            await server.register("echo", _echo)

            active = [0, 0]  # [now, max]

            async def double(header: dict, tensors: list[torch.Tensor], peer) -> tuple[dict, list[torch.Tensor]]:
                active[0] += 1
                active[1] = max(active)
                try:
                    await asyncio.sleep(0.2)
                finally:
                    active[0] -= 1
                return {"k": header["k"]}, [t * 2 for t in tensors]

            await server.register("double", double)
            payloads = {
                "f32": [torch.randn(3, 4)],
                "f32_16MB": [torch.randn(4 << 20)],
                "bf16": [torch.randn(5, 7).to(torch.bfloat16)],
                "i64": [torch.arange(-3, 1000, dtype=torch.int64), torch.tensor([2**62])],
                "mixed": [torch.randn(2, 3), torch.tensor([True, False]), torch.zeros(0, 3)],
                "none": [],
            }
            for key, tensors in payloads.items():
                header, out = await client.call(server.peer_id, "echo", {"key": key}, tensors, timeout=120)
                assert header == {"key": key, "from": client.peer_id, "n": len(tensors)}
                assert len(out) == len(tensors) and all(_same(a, b) for a, b in zip(tensors, out))
            header, out = await client.call(server.peer_id, "echo", {}, [torch.ones(4)], timeout=60)
            out[0].add_(1)  # results are ordinary, writable tensors

            calls = [client.call(server.peer_id, "echo", {"i": i}, [torch.full((1000,), i)], timeout=60) for i in range(8)]
            calls += [client.call(server.peer_id, "double", {"k": i}, [torch.full((10,), i)], timeout=60) for i in range(8)]
            results = await asyncio.gather(*calls)
            assert active[1] > 1  # handlers of concurrent calls overlap
            for i, (header, out) in enumerate(results[:8]):
                assert header["i"] == i and torch.equal(out[0], torch.full((1000,), i))
            for i, (header, out) in enumerate(results[8:]):
                assert header == {"k": i} and torch.equal(out[0], torch.full((10,), 2 * i))

            # the server can call back the client over the client's inbound connection (no address needed)
            await client.register("echo", _echo)
            header, _ = await server.call(client.peer_id, "echo", {"back": 1}, timeout=30)
            assert header == {"back": 1, "from": server.peer_id, "n": 0}

    asyncio.run(main())


@pytest.mark.timeout(180)
def test_libp2p_errors_timeouts_and_dead_peer() -> None:
    async def main() -> None:
        async with _pair() as (server, client):
            await server.register("echo", _echo)
            await server.register("fail", _fail)

            async def slow(header: dict, tensors: list[torch.Tensor], peer) -> tuple[dict, list[torch.Tensor]]:
                await asyncio.sleep(5)
                return {}, []

            await server.register("slow", slow)
            with pytest.raises(RemoteError, match="ValueError: handler exploded on purpose") as info:
                await client.call(server.peer_id, "fail", {}, [torch.ones(2)], timeout=30)
            assert info.value.remote_message == "ValueError: handler exploded on purpose"
            assert info.value.kind == "bad_request"  # what happened travels as a word, not only as text
            header, _ = await client.call(server.peer_id, "echo", {"after": "error"}, timeout=30)
            assert header["after"] == "error"

            with pytest.raises(TransportError, match="protocols not supported"):
                await client.call(server.peer_id, "no-such-handler", {}, timeout=30)

            start = time.monotonic()
            with pytest.raises(asyncio.TimeoutError):  # TransportTimeout is also a TimeoutError
                await client.call(server.peer_id, "slow", {}, timeout=0.5)
            assert time.monotonic() - start < 3
            with pytest.raises(TransportTimeout, match="timed out after 0.5 s"):
                await client.call(server.peer_id, "slow", {}, timeout=0.5)
            header, _ = await client.call(server.peer_id, "echo", {"after": "timeout"}, timeout=30)
            assert header["after"] == "timeout"

            with pytest.raises(WireError):  # encoding errors are raised locally, before anything is sent
                await client.call(server.peer_id, "echo", {}, [torch.zeros(1, dtype=torch.complex64)], timeout=30)

            await server.unregister("echo")
            with pytest.raises(TransportError, match="protocols not supported"):
                await client.call(server.peer_id, "echo", {}, timeout=30)
            await server.register("echo", _echo)
            header, _ = await client.call(server.peer_id, "echo", {"again": True}, timeout=30)
            assert header["again"] is True

            await server.shutdown()  # unregisters, closes connections, stops the trio thread
            start = time.monotonic()
            with pytest.raises(TransportError):
                await client.call(server.peer_id, "echo", {}, timeout=10)
            assert time.monotonic() - start < 10
            with pytest.raises(TransportError, match="not running"):
                await server.call(client.peer_id, "echo", {}, timeout=10)

    asyncio.run(main())


@pytest.mark.timeout(120)
def test_libp2p_malformed_raw_bytes_get_error_reply_and_service_continues() -> None:
    async def raw(client: Libp2pTransport, server: Libp2pTransport, data: bytes) -> dict:
        header, tensors = decode_body(await client.raw_exchange(server.peer_id, "echo", data, timeout=30))
        assert tensors == []
        return header

    async def main() -> None:
        async with _pair() as (server, client):
            await server.register("echo", _echo)
            garbage = b"\xc1\xff garbage"
            header = await raw(client, server, len(garbage).to_bytes(8, "big") + garbage)
            assert header["error"].startswith("WireError: ")
            bad_shape = _raw_message({"v": 1, "h": {}, "t": [["float32", [100]]]}, bytes(8))
            assert "shape mismatch" in (await raw(client, server, bad_shape))["error"]
            huge = (2**60).to_bytes(8, "big")  # declared, never sent: must be refused without reading
            assert "exceeds max_message_bytes" in (await raw(client, server, huge))["error"]
            # a request split over many small writes is reassembled (reads never assumed whole)
            frames = encode_message({"pieces": True}, [torch.arange(5000, dtype=torch.int32)])
            data = b"".join(frames)
            header, out = decode_body(
                await client.trio_thread.submit(_write_in_pieces, client, server.peer_id, data)
            )
            assert header["pieces"] is True and torch.equal(out[0], torch.arange(5000, dtype=torch.int32))
            header, out = await client.call(server.peer_id, "echo", {"ok": True}, [torch.ones(3)], timeout=30)
            assert header["ok"] is True and torch.equal(out[0], torch.ones(3))

    asyncio.run(main())


async def _write_in_pieces(client: Libp2pTransport, peer: str, data: bytes) -> bytearray:
    """Trio side: send ``data`` in 7-byte writes with pauses, then read the one reply body."""
    import trio

    stream = await client._t_open(peer, [], "echo")  # noqa: SLF001
    try:
        pos = 0
        while pos < len(data):
            step = 7 if pos < 64 else 4096  # the prefix and header arrive in tiny pieces
            await stream.write(data[pos : pos + step])
            if pos < 64:
                await trio.sleep(0.01)
            pos += step
        return await t_read_body(stream, 1 << 30)
    finally:
        await stream.close()


@pytest.mark.timeout(120)
def test_libp2p_addresses_connect_and_startup_errors() -> None:
    async def main() -> None:
        a = await start_libp2p_transport()
        b = await start_libp2p_transport()  # not connected to a
        try:
            await a.register("echo", _echo)
            stranger = Libp2pTransport()  # never started: a valid peer id nobody listens for
            with pytest.raises(TransportError, match="address is unknown"):
                await b.call(stranger.peer_id, "echo", {}, timeout=10)
            with pytest.raises(TransportError, match="no /p2p/"):
                await b.call("/ip4/127.0.0.1/tcp/1", "echo", {}, timeout=10)

            maddr = a.get_visible_maddrs()[0]
            header, _ = await b.call(maddr, "echo", {"via": "maddr"}, timeout=30)  # full multiaddr as peer id
            assert header["via"] == "maddr"
            header, _ = await b.call(a.peer_id, "echo", {"via": "id"}, timeout=30)  # its address is remembered
            assert header["via"] == "id"

            c = await start_libp2p_transport()
            try:
                transport_addr = maddr.rsplit("/p2p/", 1)[0]
                assert c.add_peer_address(transport_addr, peer_id=a.peer_id) == a.peer_id
                header, _ = await c.call(a.peer_id, "echo", {"via": "address book"}, timeout=30)
                assert header["via"] == "address book"
                with pytest.raises(TransportError, match="names peer"):
                    c.add_peer_address(maddr, peer_id=b.peer_id)
                assert await c.connect(b.get_visible_maddrs()[0]) == b.peer_id
            finally:
                await c.shutdown()

            dead = f"/ip4/127.0.0.1/tcp/1/p2p/{stranger.peer_id}"  # nothing listening there
            start = time.monotonic()
            with pytest.raises(TransportError, match="cannot connect"):
                await start_libp2p_transport(initial_peers=[dead])
            assert time.monotonic() - start < 20

            # a port held by an ordinary socket (another libp2p host would share it: SO_REUSEPORT)
            with socket.socket() as busy:
                busy.bind(("127.0.0.1", 0))
                busy.listen()
                port = busy.getsockname()[1]
                with pytest.raises(TransportError, match="failed to listen"):
                    await start_libp2p_transport([f"/ip4/127.0.0.1/tcp/{port}"])
        finally:
            await b.shutdown()
            await a.shutdown()
            await a.shutdown()  # idempotent

    asyncio.run(main())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("first", ["hivemind", "libp2p"])
def test_hivemind_and_libp2p_coexist_in_one_process(first: str) -> None:
    """Both import orders work in a fresh interpreter, and a bare ``import libp2p`` first is the known trap."""
    imports = {
        "hivemind": "import hivemind; from hivemind.p2p import P2P; from hivemind.proto import crypto_pb2",
        "libp2p": "import checkfree.net.libp2p_transport as lt; assert lt.LIBP2P_IMPORT_ERROR is None",
    }
    second = "libp2p" if first == "hivemind" else "hivemind"
    code = (
        f"{imports[first]}\n{imports[second]}\n"
        "import libp2p.crypto.pb.crypto_pb2 as l, hivemind.proto.crypto_pb2 as h\n"
        "assert l.PublicKey.DESCRIPTOR.file.pool is not h.PublicKey.DESCRIPTOR.file.pool\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]

    trap = "import libp2p\nimport hivemind.p2p\n"
    out = subprocess.run([sys.executable, "-c", trap], capture_output=True, text=True, timeout=100)
    assert out.returncode != 0 and "crypto.pb" in out.stderr, "the protobuf clash is gone: the isolation can go"


@pytest.mark.timeout(180)
def test_start_transport_libp2p_finds_peers_through_the_dht(tmp_path) -> None:
    """`start_transport(transport="libp2p")`: RPC over py-libp2p beside the hivemind DHT, which carries each
    process's libp2p addresses, so a peer is called by its bare peer id; announce addresses are published."""
    from checkfree.net.transport import dht_maddrs, live_members_async, rpc_addrs_key, start_transport, stop_transport

    key = tmp_path / "coordinator.key"
    stable = Libp2pTransport(key_pair=lt.identity_key_pair(f"{key}.libp2p")).peer_id  # made and kept
    (tmp_path / "bad.libp2p").write_bytes(b"not a key")
    with pytest.raises(TransportError, match="cannot read the libp2p identity"):
        lt.identity_key_pair(str(tmp_path / "bad.libp2p"))

    async def main() -> None:
        dht_a, a = await start_transport(startup_timeout=30, transport="libp2p", identity_path=str(key))
        dht_b = b = None
        try:
            assert a.kind == "libp2p" and a.peer_id == stable  # its own identity, not the DHT's
            assert a.peer_id != str(dht_a.peer_id)
            dht_b, b = await start_transport(await dht_maddrs(dht_a), ["/ip4/0.0.0.0/tcp/0"], ["/ip4/127.0.0.1/tcp/9"],
                                             startup_timeout=30, transport="libp2p")
            (visible,) = b.get_visible_maddrs()  # the announced IP at the port actually bound
            assert visible.startswith("/ip4/127.0.0.1/tcp/") and visible.endswith(f"/p2p/{b.peer_id}")
            assert "/tcp/9/" not in visible and "/tcp/0/" not in visible
            assert await live_members_async(dht_a, rpc_addrs_key(b.peer_id)) == {"addrs": [visible]}
            await a.register("echo", _echo)
            await b.register("echo", _echo)
            b.extra_header = {"token": "t0k"}
            header, out = await b.call(a.peer_id, "echo", {"via": "dht"}, [torch.ones(2)], timeout=30)
            assert header == {"token": "t0k", "via": "dht", "from": b.peer_id, "n": 1}
            assert torch.equal(out[0], torch.ones(2))
            header, _ = await a.call(b.peer_id, "echo", {}, timeout=30)
            assert header["from"] == a.peer_id
            nobody = Libp2pTransport().peer_id  # a valid id that never published an address
            with pytest.raises(TransportError, match="No known addresses"):
                await a.call(nobody, "echo", {}, timeout=30)
        finally:
            if b is not None:
                await stop_transport(dht_b, b)
            await stop_transport(dht_a, a)

    asyncio.run(main())


@pytest.mark.timeout(120)
def test_address_resolver_is_asked_once_and_again_after_a_failed_dial() -> None:
    async def main() -> None:
        server = await start_libp2p_transport()
        client = await start_libp2p_transport()  # not connected: it needs an address
        try:
            await server.register("echo", _echo)
            asked = []
            stale = f"/ip4/127.0.0.1/tcp/1/p2p/{server.peer_id}"
            answers = [server.get_visible_maddrs(), [stale], server.get_visible_maddrs()]

            async def resolve(peer_id: str) -> list[str]:
                asked.append(peer_id)
                return answers[len(asked) - 1]

            client.address_resolver = resolve
            for k in range(2):
                header, _ = await client.call(server.peer_id, "echo", {"k": k}, timeout=30)
                assert header["k"] == k
            assert asked == [server.peer_id]  # asked once, then remembered
            client.addresses.forget(server.peer_id)  # as if never known: the next lookup finds a stale address
            await client.call(server.peer_id, "echo", {}, timeout=30)  # the open connection still serves
            assert client.addresses.known(server.peer_id) == ["/ip4/127.0.0.1/tcp/1"]

            async def stored() -> list[str]:
                return [str(a) for a in client._host.get_peerstore().addrs(lt.ID.from_base58(server.peer_id))]

            assert await client.trio_thread.submit(stored) == ["/ip4/127.0.0.1/tcp/1"]  # the stale address replaced the good one
            await client.trio_thread.submit(lambda: client._host.disconnect(lt.ID.from_base58(server.peer_id)))
            with pytest.raises(TransportError):  # dialing the stale address fails ...
                await client.call(server.peer_id, "echo", {}, timeout=30)
            assert not client.addresses.known(server.peer_id)  # ... so it is forgotten and looked up again
            with pytest.raises(TransportError, match="negative cache"):  # (py-libp2p refuses redials for 60 s)
                await client.call(server.peer_id, "echo", {}, timeout=30)
            assert len(asked) == 3 and await client.trio_thread.submit(stored) == [server.get_visible_maddrs()[0].rsplit("/p2p/")[0]]
        finally:
            await client.shutdown()
            await server.shutdown()

    asyncio.run(main())
