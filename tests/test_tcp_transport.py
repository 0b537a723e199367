"""Tests for checkfree.net.tcp_transport: the Transport interface over direct TCP (two transports on loopback,
port 0, one event loop; no p2pd, no DHT). The runtime wiring is covered by one swarm run in test_swarm.py."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import time
import tracemalloc
from collections.abc import AsyncIterator

import pytest
import torch

from checkfree.net.tcp_transport import (
    TcpTransport,
    parse_tcp_maddr,
    start_tcp_transport,
)
from checkfree.net.streams import read_message, write_frames
from checkfree.net.transport import RemoteError, TransportError, TransportTimeout
from checkfree.net.wire import WireError, encode_message

pytestmark = pytest.mark.timeout(60)

SECRET = b"0123456789abcdef-run-secret"
SERVER, CLIENT = "QmServer", "QmClient"


@contextlib.asynccontextmanager
async def _pair(server_secret: bytes | None = SECRET, client_secret: bytes | None = SECRET,
                **kwargs: object) -> AsyncIterator[tuple[TcpTransport, TcpTransport]]:
    """(server, client) on 127.0.0.1 port 0; the client knows the server's address."""
    a = await start_tcp_transport(SERVER, secret=server_secret, **kwargs)
    b = None
    try:
        b = await start_tcp_transport(CLIENT, secret=client_secret, **kwargs)
        b.add_peer_address(a.get_visible_maddrs()[0])
        yield a, b
    finally:
        if b is not None:
            await b.shutdown()
        await a.shutdown()


async def _echo(header: dict, tensors: list[torch.Tensor], peer: str) -> tuple[dict, list[torch.Tensor]]:
    return {**header, "from": peer, "n": len(tensors)}, tensors


async def _fail(header: dict, tensors: list[torch.Tensor], peer: str) -> tuple[dict, list[torch.Tensor]]:
    raise ValueError("handler exploded on purpose")


async def _hang(header: dict, tensors: list[torch.Tensor], peer: str) -> tuple[dict, list[torch.Tensor]]:
    await asyncio.Event().wait()  # never answers
    return {}, []


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


async def _raw(server: TcpTransport) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port, _ = parse_tcp_maddr(server.get_visible_maddrs()[0])
    return await asyncio.open_connection(host, port)


def test_exchanges_tensors_concurrently_and_reuses_connections() -> None:
    async def main() -> None:
        async with _pair() as (server, client):
            await server.register("echo", _echo)
            payloads = {"f32_16MB": [torch.randn(4 << 20)], "bf16": [torch.randn(5, 7).to(torch.bfloat16)],
                        "i64": [torch.arange(-3, 1000), torch.tensor([2**62])], "none": []}
            for key, tensors in payloads.items():
                header, out = await client.call(SERVER, "echo", {"key": key}, tensors, timeout=30)
                assert header == {"key": key, "from": CLIENT, "n": len(tensors)}  # the id the handshake proved
                assert len(out) == len(tensors) and all(_same(a, b) for a, b in zip(tensors, out))
            assert client.connections_opened == 1  # sequential calls share one connection

            arrived, release = [], asyncio.Event()

            async def gate(header: dict, tensors: list[torch.Tensor], peer: str) -> tuple[dict, list[torch.Tensor]]:
                arrived.append(header["i"])
                if len(arrived) == 3:
                    release.set()
                await release.wait()  # all three in flight at once: three connections
                return {"i": header["i"]}, [tensors[0] * 2]

            await server.register("gate", gate)
            results = await asyncio.gather(*(client.call(SERVER, "gate", {"i": i}, [torch.full((3,), i)], timeout=30)
                                             for i in range(3)))
            assert [h["i"] for h, _ in results] == [0, 1, 2]
            assert all(torch.equal(t[0], torch.full((3,), 2 * i)) for i, (_, t) in enumerate(results))
            assert client.connections_opened == 3  # the idle one was reused, two more opened
            await client.call(SERVER, "echo", {}, timeout=30)  # another protocol, same pooled connections
            assert client.connections_opened == 3

    asyncio.run(main())


def test_errors_and_timeouts_are_not_reused_and_dead_peer_fails_fast() -> None:
    async def main() -> None:
        async with _pair() as (server, client):
            for name, h in (("echo", _echo), ("fail", _fail), ("hang", _hang)):
                await server.register(name, h)
            await client.call(SERVER, "echo", {}, timeout=30)
            with pytest.raises(RemoteError, match="ValueError: handler exploded on purpose") as info:
                await client.call(SERVER, "fail", {}, [torch.ones(2)], timeout=30)
            assert info.value.remote_message == "ValueError: handler exploded on purpose"
            assert info.value.kind == "bad_request"  # what happened travels as a word, not only as text
            with pytest.raises(RemoteError, match="no handler registered for 'nope'"):
                await client.call(SERVER, "nope", {}, timeout=30)
            assert client.connections_opened == 2  # the connection that carried an error reply was closed
            header, _ = await client.call(SERVER, "echo", {"after": "error"}, timeout=30)
            assert header["after"] == "error" and client.connections_opened == 3

            start = time.monotonic()
            with pytest.raises(TransportTimeout, match="timed out after 0.3 s"):
                await client.call(SERVER, "hang", {}, timeout=0.3)
            assert time.monotonic() - start < 3 and isinstance(TransportTimeout("x"), asyncio.TimeoutError)
            header, _ = await client.call(SERVER, "echo", {"after": "timeout"}, timeout=30)
            assert header["after"] == "timeout" and client.connections_opened == 4  # not the timed-out one

            with pytest.raises(WireError):  # encoding errors are raised locally, before anything is sent
                await client.call(SERVER, "echo", {}, [torch.zeros(1, dtype=torch.complex64)], timeout=30)
            with pytest.raises(TransportError, match="no known address of peer QmElse"):
                await client.call("QmElse", "echo", {}, timeout=30)

            await server.shutdown()  # closes its listener and every connection, the pooled one included
            for _ in range(2):
                start = time.monotonic()
                with pytest.raises(TransportError):
                    await client.call(SERVER, "echo", {}, timeout=10)
                assert time.monotonic() - start < 5

    asyncio.run(main())


def test_oversized_messages_are_refused_before_allocating() -> None:
    async def main() -> None:
        async with _pair(max_message_bytes=1 << 20) as (server, client):
            await server.register("echo", _echo)
            with pytest.raises(RemoteError, match="exceeds max_message_bytes"):
                await client.call(SERVER, "echo", {}, [torch.zeros(1 << 19)], timeout=30)  # 2 MiB request
            server.max_message_bytes = 1 << 30  # now the 1.6 MB reply is too big for the client
            with pytest.raises(TransportError, match="invalid reply.*exceeds max_message_bytes"):
                await client.call(SERVER, "echo", {}, [torch.zeros(400_000)], timeout=30)  # reply > 1 MiB
            client.max_message_bytes = 1 << 30
            reader, writer = await _raw(server)  # a declared 2**62-byte handshake: error reply, no allocation
            tracemalloc.start()
            try:
                writer.write((2**62).to_bytes(8, "big") + b"\x00" * 16)
                reply, _ = await read_message(reader, 1 << 16)
                _, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
            writer.close()
            assert "exceeds max_message_bytes" in reply["error"] and peak < 1 << 20
            header, _ = await client.call(SERVER, "echo", {"still": "serving"}, timeout=30)
            assert header["still"] == "serving"

    asyncio.run(main())


def test_garbage_gets_an_error_reply_and_other_connections_keep_working(caplog) -> None:
    async def main() -> None:
        async with _pair() as (server, client):
            await server.register("echo", _echo)
            await client.call(SERVER, "echo", {}, timeout=30)  # an established pooled connection
            reader, writer = await _raw(server)
            writer.write(b"\x00\x00\x00\x00\x00\x00\x00\x05\x00\x00\x00\x01\xc1")  # malformed msgpack
            reply, _ = await read_message(reader, 1 << 16)
            assert reply["error"].startswith("WireError: handshake refused: ")
            writer.write_eof()
            assert await reader.read() == b""  # the server closes that connection once the caller is done
            writer.close()
            reader, writer = await _raw(server)
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            reply, _ = await read_message(reader, 1 << 16)
            assert "handshake refused" in reply["error"]
            writer.close()
            # garbage after a valid handshake, on a connection of the pool: error reply, connection closed
            conn = await client._open(SERVER)
            conn[1].write(b"\x04echo" + b"\x00\x00\x00\x00\x00\x00\x00\x05\x00\x00\x00\x01\xc1")
            reply, _ = await read_message(conn[0], 1 << 16)
            conn[1].write_eof()
            assert reply["error"].startswith("WireError: ") and await conn[0].read() == b""
            conn[1].close()
            header, _ = await client.call(SERVER, "echo", {"ok": 1}, timeout=30)
            assert header["ok"] == 1 and client.connections_opened == 2  # the first pooled one still served it

    with caplog.at_level(logging.WARNING, logger="checkfree.net.tcp_transport"):
        asyncio.run(main())
    assert "refused connection from" in caplog.text


@pytest.mark.parametrize(("server_secret", "client_secret", "match"), [
    (SECRET, b"another-secret-0123456789", "does not prove the run secret"),
    (SECRET, None, "this side has a run secret, peer QmClient has no run secret"),
    (None, SECRET, "this side has no run secret, peer QmClient has a run secret"),
])
def test_handshake_with_a_wrong_or_missing_secret_is_refused(server_secret, client_secret, match, caplog) -> None:
    async def main() -> None:
        async with _pair(server_secret, client_secret) as (server, client):
            called = []

            async def record(header: dict, tensors: list[torch.Tensor], peer: str) -> tuple[dict, list]:
                called.append(peer)
                return {}, []

            await server.register("echo", record)
            with pytest.raises(TransportError, match="refused the connection|does not prove|run secret"):
                await client.call(SERVER, "echo", {}, timeout=30)
            assert called == [] and client.connections_opened == 0
            good = await start_tcp_transport("QmGood", secret=server_secret)
            try:  # the server keeps serving callers that hold its secret
                good.add_peer_address(server.get_visible_maddrs()[0])
                header, _ = await good.call(SERVER, "echo", {}, timeout=30)
                assert called == ["QmGood"]
            finally:
                await good.shutdown()

    with caplog.at_level(logging.WARNING, logger="checkfree.net.tcp_transport"):
        asyncio.run(main())
    assert match in caplog.text


def test_caller_refuses_a_server_answering_as_another_peer(caplog) -> None:
    async def main() -> None:
        async with _pair() as (server, client):
            await server.register("echo", _echo)
            host, port, _ = parse_tcp_maddr(server.get_visible_maddrs()[0])
            client.add_peer_address(f"/ip4/{host}/tcp/{port}/p2p/QmExpected")
            with pytest.raises(TransportError, match="answered as peer QmServer"):
                await client.call("QmExpected", "echo", {}, timeout=30)
            assert client.connections_opened == 0
            with pytest.raises(TransportError, match="names peer QmServer, not QmOther"):
                client.add_peer_address(server.get_visible_maddrs()[0], "QmOther")

    with caplog.at_level(logging.WARNING, logger="checkfree.net.tcp_transport"):
        asyncio.run(main())
    assert "answered as peer QmServer" in caplog.text


def test_without_a_secret_ids_are_unauthenticated_and_a_warning_says_so_once(caplog, monkeypatch) -> None:
    """Said once per process, however many transports it starts (a dst run printed it dozens of times)."""
    import checkfree.net.errors

    monkeypatch.setattr(checkfree.net.errors, "_WARNED", set())

    async def main() -> None:
        async with _pair(None, None) as (server, client):
            await server.register("echo", _echo)
            header, _ = await client.call(SERVER, "echo", {}, timeout=30)
            assert header["from"] == CLIENT
        async with _pair(None, None):
            pass

    with caplog.at_level(logging.WARNING, logger="checkfree.net.tcp_transport"):
        asyncio.run(main())
    assert caplog.text.count("peer ids are NOT authenticated") == 1


def test_address_resolver_is_asked_once_and_a_stalled_handshake_times_out() -> None:
    async def main() -> None:
        async with _pair(handshake_timeout=0.5) as (server, client):
            await server.register("echo", _echo)
            asked = []

            async def resolve(peer: str) -> list[str]:
                asked.append(peer)
                return ["not-a-maddr", *server.get_visible_maddrs()]

            other = await start_tcp_transport("QmOther", secret=SECRET)
            try:
                other.address_resolver = resolve
                for _ in range(3):
                    await other.call(SERVER, "echo", {}, timeout=30)
                assert asked == [SERVER]
            finally:
                await other.shutdown()
            reader, writer = await _raw(server)  # says nothing: closed after handshake_timeout with an error reply
            reply, _ = await asyncio.wait_for(read_message(reader, 1 << 16), 10)
            assert "no handshake within handshake_timeout=0.5 s" in reply["error"]
            writer.close()

    asyncio.run(main())


def test_bad_maddrs_and_ports() -> None:
    for bad in ("/ip4/1.2.3.4/udp/5", "1.2.3.4:5", "/ip4/1.2.3.4/tcp/x/p2p/Qm", "/ip4/1.2.3.4/tcp/5/p2p/"):
        with pytest.raises(TransportError, match="not a TCP multiaddr"):
            parse_tcp_maddr(bad)
    assert parse_tcp_maddr("/ip4/10.0.0.2/tcp/31340/p2p/QmX") == ("10.0.0.2", 31340, "QmX")

    async def main() -> None:
        a = await start_tcp_transport("QmA", secret=SECRET)
        try:
            port = parse_tcp_maddr(a.get_visible_maddrs()[0])[1]
            with pytest.raises(TransportError, match="cannot listen"):
                await start_tcp_transport("QmB", secret=SECRET, port=port)
        finally:
            await a.shutdown()

    asyncio.run(main())


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.parametrize("ending", ["caller closes", "caller stalls"])
def test_abandoned_large_requests_release_their_buffers_without_gc(ending) -> None:
    """Six callers each declare a 256 MiB request, send 32 MiB of it, then hang up (or stall until the
    server's read_timeout). The 192 MiB received must be freed as each read fails, not at the next garbage
    collection: the failed read's exception sits in a reference cycle (traceback -> asyncio.wait_for's frame
    -> its task -> the exception), which used to keep every buffer alive."""
    mib, sent = 2**20, 32

    async def abandon(server: TcpTransport, client: TcpTransport) -> None:
        reader, writer = await client._open(SERVER)
        writer.write(bytes([4]) + b"echo" + (256 * mib).to_bytes(8, "big"))
        for _ in range(sent):
            writer.write(b"x" * mib)
        await writer.drain()
        if ending == "caller stalls":
            reply, _ = await read_message(reader, 1 << 16)  # the server gives up after its read_timeout
            assert "no complete request within read_timeout" in reply["error"], reply
        else:
            writer.close()
            while server._serving:  # the server's handler has finished with this connection
                await asyncio.sleep(0.01)
        writer.close()

    async def main() -> tuple[float, float]:
        async with _pair(server_secret=None, client_secret=None, read_timeout=1.0, linger_timeout=0.2,
                         max_message_bytes=1 << 30) as (server, client):
            await server.register("echo", _echo)
            await abandon(server, client)  # warm-up: allocator arenas, reader buffers
            base = _rss_mib()
            for _ in range(6):
                await abandon(server, client)
            return base, _rss_mib()

    gc.disable()
    try:
        base, after = asyncio.run(main())
    finally:
        gc.enable()
    assert after - base < sent * 1.5, f"RSS grew {after - base:.0f} MiB over 6 abandoned requests (baseline {base:.0f})"
