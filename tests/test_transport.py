"""Tests for checkfree.net.wire (pure) and checkfree.net.transport (two real p2pd daemons on loopback)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import time
import tracemalloc
from collections.abc import AsyncIterator

import msgpack
import pytest
import torch
from hivemind.p2p import P2P

from checkfree.auth import record_ok, sign_record
from checkfree.protocol import Kind, ProtocolError
from checkfree.net.transport import (
    RemoteError,
    HivemindTransport,
    TransportError,
    TransportTimeout,
    announce,
    live_members,
    live_members_async,
    start_transport,
    stop_transport,
    stream_pool_default,
)
from checkfree.net.wire import (
    WireError,
    body_length,
    check_finite,
    decode_body,
    decode_message,
    encode_message,
)

_OUR_SOCKETS: list[str] = []  # daemon control sockets created by this module, to find leaked p2pd


def _p2pd_pids() -> set[int]:
    out = subprocess.run(["pgrep", "-x", "p2pd"], capture_output=True, text=True).stdout
    return {int(pid) for pid in out.split()}


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _descends_from_us(pid: int) -> bool:
    me = os.getpid()
    for _ in range(16):
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return False
        if pid == me:
            return True
        if pid <= 1:
            return False
    return False


@pytest.fixture(autouse=True)
def no_leaked_p2pd():
    """Fail a test that leaves behind a p2pd it started: a new p2pd (per `pgrep -x p2pd`) that descends
    from this process or uses a daemon socket created here. Other jobs' daemons on the machine are ignored."""
    before = _p2pd_pids()
    yield
    deadline = time.monotonic() + 10
    while True:
        new = _p2pd_pids() - before
        ours = {pid for pid in new if _descends_from_us(pid) or any(s in _cmdline(pid) for s in _OUR_SOCKETS)}
        if not ours or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not ours, f"leaked p2pd processes: {[_cmdline(p) for p in ours]} (pgrep count {len(before)} before)"


def _track(p2p: P2P) -> P2P:
    _OUR_SOCKETS.append(str(p2p.daemon_listen_maddr).removeprefix("/unix"))
    return p2p


@contextlib.asynccontextmanager
async def _pair() -> AsyncIterator[tuple[HivemindTransport, HivemindTransport]]:
    """Two P2P daemons on 127.0.0.1 (port 0), b bootstrapped from a; yields (server, client) transports."""
    a = _track(await P2P.create())
    b = None
    try:
        b = _track(await P2P.create(initial_peers=[str(m) for m in await a.get_visible_maddrs()]))
        yield HivemindTransport(a, owns_p2p=True), HivemindTransport(b, owns_p2p=True)
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


# ---------------------------------------------------------------- wire: pure unit tests


@pytest.mark.timeout(60)
def test_wire_roundtrip_all_dtypes_and_layouts() -> None:
    tensors = [
        torch.randn(3, 5),
        torch.randn(7, dtype=torch.bfloat16),
        torch.arange(-5, 5, dtype=torch.int64),
        torch.tensor([True, False]),
        torch.randn(4, dtype=torch.float16),
        torch.zeros(0, 3),
        torch.tensor(2.5, dtype=torch.float64),
        torch.randn(4, 6).t(),  # non-contiguous
        torch.randn(3, requires_grad=True),
        torch.randint(0, 255, (9,), dtype=torch.uint8),
    ]
    frames = encode_message({"step": 3, "names": ["x"]}, tensors)
    joined = b"".join(frames)
    for data in (joined, bytearray(joined), frames):
        header, out = decode_message(data)
        assert header == {"step": 3, "names": ["x"]}
        assert len(out) == len(tensors)
        for ref, got in zip(tensors, out):
            assert _same(ref.detach(), got)
    header, out = decode_message(joined)  # read-only input is copied: result must be safely writable
    out[0].add_(1)
    assert joined == b"".join(frames)
    # body-only decoding, as the transport does it
    assert body_length(joined[:8]) == len(joined) - 8
    assert decode_body(bytearray(joined[8:]))[0]["step"] == 3


def _raw_message(envelope: object, payload: bytes = b"") -> bytes:
    packed = msgpack.packb(envelope, use_bin_type=True)
    body = len(packed).to_bytes(4, "big") + packed
    body += bytes(-len(body) % 64) + payload if payload else b""
    return len(body).to_bytes(8, "big") + body


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"\x00\x00\x00\x00\x00\x00\x00\x05\x00\x00\x00\x01\xc1", "malformed msgpack"),  # 0xc1 is never used
        (_raw_message([1, 2, 3]), "envelope must be a dict"),
        (_raw_message({"v": 1, "h": [1], "t": []}), "header must be a dict"),
        (_raw_message({"v": 99, "h": {}, "t": []}), "unsupported wire version"),
        (_raw_message({"v": 1, "h": {}, "t": [["complex64", [1]]]}, bytes(8)), "unknown or forbidden dtype"),
        (_raw_message({"v": 1, "h": {}, "t": [["pickle", [1]]]}, bytes(8)), "unknown or forbidden dtype"),
        (_raw_message({"v": 1, "h": {}, "t": [["float32", [-1]]]}, bytes(8)), "non-negative ints"),
        (_raw_message({"v": 1, "h": {}, "t": [["float32", [1.5]]]}, bytes(8)), "non-negative ints"),
        (_raw_message({"v": 1, "h": {}, "t": [["float32", [True]]]}, bytes(8)), "non-negative ints"),
        (_raw_message({"v": 1, "h": {}, "t": [["float32", [3]]]}, bytes(8)), "shape mismatch"),
        (_raw_message({"v": 1, "h": {}, "t": [["float32", [1]]]}, bytes(8)), "byte count mismatch"),
        (_raw_message({"v": 1, "h": {}, "t": [["float32", [2**40, 2**40]]]}, bytes(8)), "shape mismatch"),
        (_raw_message({"v": 1, "h": {}, "t": ["float32"]}), "spec must be"),
        (b"\x00\x00\x00", "truncated frame"),
        (b"\x00\x00\x00\x00\x00\x00\x00\x10\x00\x00", "truncated frame"),
        (b"\x00\x00\x00\x00\x00\x00\x00\x06\x00\x00\x00\x09\x80\x80", "truncated frame"),
        (b"\x00\x00\x00\x00\x00\x00\x00\x02\x00\x00", "too small"),
    ],
)
def test_wire_rejects_malformed(data: bytes, match: str) -> None:
    with pytest.raises(WireError, match=match):
        decode_message(data)


@pytest.mark.timeout(60)
def test_wire_trailing_bytes_and_encode_errors() -> None:
    good = b"".join(encode_message({"a": 1}, [torch.ones(2)]))
    with pytest.raises(WireError, match="byte count mismatch"):
        decode_message(good + b"\x00")
    with pytest.raises(WireError, match="not allowed on the wire"):
        encode_message({}, [torch.zeros(2, dtype=torch.complex64)])
    with pytest.raises(WireError, match="expected torch.Tensor"):
        encode_message({}, [[1.0, 2.0]])  # type: ignore[list-item]
    with pytest.raises(WireError, match="header must be a dict"):
        encode_message([1, 2])  # type: ignore[arg-type]
    with pytest.raises(WireError, match="not msgpack-serialisable"):
        encode_message({"x": object()})
    with pytest.raises(WireError, match="dense"):
        encode_message({}, [torch.eye(3).to_sparse()])
    assert isinstance(WireError("x"), ValueError)


@pytest.mark.timeout(60)
def test_huge_declared_length_is_rejected_before_allocating() -> None:
    tracemalloc.start()
    try:
        for declared in (2**62, (1 << 30) + 1):
            with pytest.raises(WireError, match="exceeds max_message_bytes"):
                decode_message(declared.to_bytes(8, "big") + b"\x00" * 16)
        with pytest.raises(WireError, match="exceeds max_message_bytes=1000"):
            body_length((5000).to_bytes(8, "big"), max_message_bytes=1000)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"validation allocated {peak} bytes"


@pytest.mark.timeout(60)
def test_check_finite_names_offender() -> None:
    check_finite([torch.ones(3), torch.arange(3), torch.zeros(0)])
    with pytest.raises(WireError, match=r"tensor #1 \(float32, shape \[2\]\) contains 1 NaN and 0 Inf"):
        check_finite([torch.ones(3), torch.tensor([1.0, float("nan")])])
    with pytest.raises(WireError, match=r"'grad'.*0 NaN and 2 Inf"):
        check_finite({"act": torch.ones(2), "grad": torch.tensor([float("inf"), -float("inf")], dtype=torch.bfloat16)})


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64])
def test_check_finite_is_exact_at_any_position_and_ignores_an_overflowing_sum(dtype) -> None:
    """The sum test never accepts a NaN or Inf wherever it sits (first, last, a chunk boundary, one chunk's end),
    and finite values whose sum overflows are still accepted (the chunked count settles it)."""
    from checkfree.net.wire import FINITE_CHUNK

    n = 2 * FINITE_CHUNK + 17
    gen = torch.Generator().manual_seed(0)
    for pos in (0, n - 1, FINITE_CHUNK, FINITE_CHUNK - 1, int(torch.randint(n, (1,), generator=gen))):
        for bad in (float("nan"), float("inf"), -float("inf")):
            t = torch.randn(n, generator=gen).to(dtype)
            t[pos] = bad
            with pytest.raises(WireError, match=r"contains (1 NaN and 0|0 NaN and 1) Inf"):
                check_finite([t])
            with pytest.raises(WireError):
                check_finite([t.view(-1, 1).expand(n, 2).t()])  # not contiguous: counted on a copy
    big = torch.finfo(torch.float32 if dtype.is_complex else dtype).max
    huge = torch.full((n,), big / 2, dtype=dtype)
    assert not bool(torch.isfinite(huge.sum()))  # the sum overflows ...
    check_finite([huge])  # ... yet every value is finite

# ---------------------------------------------------------------- transport over real p2pd daemons


@pytest.mark.timeout(120)
def test_transport_exchanges_tensors_and_serves_concurrently() -> None:
    async def main() -> None:
        async with _pair() as (server, client):
            await server.register("echo", _echo)

            async def double(header: dict, tensors: list[torch.Tensor], peer) -> tuple[dict, list[torch.Tensor]]:
                await asyncio.sleep(0.05)
                return {"k": header["k"]}, [t * 2 for t in tensors]

            await server.register("double", double)
            payloads = {
                "f32": [torch.randn(3, 4)],
                "f32_16MB": [torch.randn(4 << 20)],
                "bf16": [torch.randn(5, 7).to(torch.bfloat16)],
                "i64": [torch.arange(-3, 1000, dtype=torch.int64), torch.tensor([2**62])],
                "none": [],
            }
            for key, tensors in payloads.items():
                header, out = await client.call(str(server.peer_id), "echo", {"key": key}, tensors, timeout=60)
                assert header == {"key": key, "from": str(client.peer_id), "n": len(tensors)}
                assert len(out) == len(tensors) and all(_same(a, b) for a, b in zip(tensors, out))

            calls = [client.call(server.peer_id, "echo", {"i": i}, [torch.full((1000,), i)], timeout=60) for i in range(8)]
            calls += [client.call(server.peer_id, "double", {"k": i}, [torch.full((10,), i)], timeout=60) for i in range(8)]
            results = await asyncio.gather(*calls)
            for i, (header, out) in enumerate(results[:8]):
                assert header["i"] == i and torch.equal(out[0], torch.full((1000,), i))
            for i, (header, out) in enumerate(results[8:]):
                assert header == {"k": i} and torch.equal(out[0], torch.full((10,), 2 * i))

    asyncio.run(main())


@pytest.mark.timeout(120)
def test_transport_errors_timeouts_and_dead_peer() -> None:
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

            async def refuse(header: dict, tensors: list, peer):
                raise ProtocolError("not a member", Kind.UNAUTHORIZED)

            async def bug(header: dict, tensors: list, peer):
                raise KeyError("oops")

            await server.register("refuse", refuse)
            await server.register("bug", bug)
            for name, kind in (("refuse", "unauthorized"), ("bug", "internal")):
                with pytest.raises(RemoteError) as info:
                    await client.call(server.peer_id, name, {}, timeout=30)
                assert info.value.kind == kind

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

            async def eof(*_):  # this process's own daemon closing its control stream as a stream opens
                raise asyncio.IncompleteReadError(b"", 1)

            real, client.p2p.call_binary_stream_handler = client.p2p.call_binary_stream_handler, eof
            with pytest.raises(TransportError, match="cannot open stream 'never-called'"):  # (no pooled stream)
                await client.call(server.peer_id, "never-called", {}, timeout=10)
            client.p2p.call_binary_stream_handler = real

            await server.shutdown()  # unregisters and stops the server daemon
            start = time.monotonic()
            with pytest.raises(TransportError):
                await client.call(server.peer_id, "echo", {}, timeout=10)
            assert time.monotonic() - start < 10

    asyncio.run(main())


@pytest.mark.timeout(120)
def test_streams_are_reused_one_call_at_a_time_and_dropped_after_failures() -> None:
    async def main() -> None:
        async with _pair() as (server, client):
            assert client.pool_streams  # the default
            await server.register("echo", _echo)
            await server.register("fail", _fail)
            for i in range(5):  # sequential calls share one stream
                header, out = await client.call(server.peer_id, "echo", {"i": i}, [torch.full((4,), i)], timeout=30)
                assert header["i"] == i and torch.equal(out[0], torch.full((4,), i))
            assert client.streams_opened == 1

            arrived, release = [], asyncio.Event()

            async def gate(header: dict, tensors: list[torch.Tensor], peer) -> tuple[dict, list[torch.Tensor]]:
                arrived.append(header["i"])
                if len(arrived) == 3:
                    release.set()
                await release.wait()  # all three must be in flight at once: three streams
                return {"i": header["i"]}, []

            await server.register("gate", gate)
            before = client.streams_opened
            results = await asyncio.gather(*(client.call(server.peer_id, "gate", {"i": i}, timeout=30) for i in range(3)))
            assert [h["i"] for h, _ in results] == [0, 1, 2] and client.streams_opened - before == 3
            before = client.streams_opened
            await client.call(server.peer_id, "echo", {}, timeout=30)
            assert client.streams_opened == before  # the idle "echo" stream again

            with pytest.raises(RemoteError, match="exploded"):  # an error reply: the server closes that stream
                await client.call(server.peer_id, "fail", {}, timeout=30)
            with pytest.raises(RemoteError, match="exploded"):
                await client.call(server.peer_id, "fail", {}, timeout=30)
            assert client.streams_opened == before + 2

            late = asyncio.Event()

            async def slow(header: dict, tensors: list[torch.Tensor], peer) -> tuple[dict, list[torch.Tensor]]:
                if header["i"] == 0:
                    await late.wait()
                return {"i": header["i"]}, [torch.full((3,), header["i"])]

            await server.register("slow", slow)
            await client.call(server.peer_id, "slow", {"i": -1}, timeout=30)  # leaves one idle "slow" stream
            with pytest.raises(TransportTimeout):
                await client.call(server.peer_id, "slow", {"i": 0}, timeout=0.5)  # takes it; its reply comes late
            late.set()
            before = client.streams_opened
            for i in (1, 2):  # never the timed-out stream with the late reply still in it
                header, out = await client.call(server.peer_id, "slow", {"i": i}, timeout=30)
                assert header == {"i": i} and torch.equal(out[0], torch.full((3,), i))
            assert client.streams_opened == before + 1

    asyncio.run(main())


@pytest.mark.timeout(120)
def test_idle_streams_closed_by_the_server_are_not_reused(monkeypatch) -> None:
    async def main() -> None:
        async with _pair() as (server, client):
            server.idle_timeout = 0.3  # the server drops streams idle this long; the client would keep them 30 s
            await server.register("echo", _echo)
            await client.call(server.peer_id, "echo", {}, timeout=30)
            ((reader, writer, _),) = client._pool.idle[(server.peer_id, "echo")]
            deadline = time.monotonic() + 20
            while not reader.at_eof():  # the server's close arrives as EOF on the idle stream
                assert time.monotonic() < deadline, "the server never closed the idle stream"
                await asyncio.sleep(0.05)
            header, _ = await client.call(server.peer_id, "echo", {"after": "idle"}, timeout=30)
            assert header["after"] == "idle" and client.streams_opened == 2

            fresh = HivemindTransport(client.p2p, pool_streams=False)
            for _ in range(3):
                await fresh.call(server.peer_id, "echo", {}, timeout=30)
            assert fresh.streams_opened == 3 and not fresh._pool.idle

    asyncio.run(main())
    monkeypatch.setenv("CHECKFREE_STREAM_POOL", "0")
    assert not stream_pool_default()
    monkeypatch.setenv("CHECKFREE_STREAM_POOL", "1")
    assert stream_pool_default()


@pytest.mark.timeout(120)
def test_malformed_raw_bytes_get_error_reply_and_service_continues() -> None:
    async def raw_exchange(client: HivemindTransport, server: HivemindTransport, data: bytes) -> dict:
        _, reader, writer = await client.p2p.call_binary_stream_handler(server.peer_id, "echo")
        try:
            writer.write(data)
            await writer.drain()
            reply = await asyncio.wait_for(P2P.receive_raw_data(reader), 30)
        finally:
            writer.close()
        header, tensors = decode_message(len(reply).to_bytes(8, "big") + reply)
        assert tensors == []
        return header

    async def main() -> None:
        async with _pair() as (server, client):
            await server.register("echo", _echo)
            garbage = b"\xc1\xff garbage"
            header = await raw_exchange(client, server, len(garbage).to_bytes(8, "big") + garbage)
            assert header["error"].startswith("WireError: ")
            bad_shape = _raw_message({"v": 1, "h": {}, "t": [["float32", [100]]]}, bytes(8))
            assert "shape mismatch" in (await raw_exchange(client, server, bad_shape))["error"]
            huge = (2**60).to_bytes(8, "big")  # declared, never sent: must be refused without reading
            assert "exceeds max_message_bytes" in (await raw_exchange(client, server, huge))["error"]
            header, out = await client.call(server.peer_id, "echo", {"ok": True}, [torch.ones(3)], timeout=30)
            assert header["ok"] is True and torch.equal(out[0], torch.ones(3))

    asyncio.run(main())


@pytest.mark.timeout(120)
def test_start_transport_dht_heartbeats_and_bad_bootstrap() -> None:
    """Also: a start that fails (unreachable bootstrap peer) leaves no socket file of its p2pd behind."""
    from checkfree.net.lifeline import socket_files

    before = socket_files()

    async def main() -> None:
        with pytest.raises(TransportError, match="invalid initial peer"):
            await start_transport(["/ip4/127.0.0.1/tcp/1"])

        dht_a, t_a = await start_transport(startup_timeout=30)
        _track(t_a.p2p)
        dht_b = t_b = None
        try:
            maddrs = [str(m) for m in dht_a.get_visible_maddrs()]
            dht_b, t_b = await start_transport(maddrs, startup_timeout=30)
            _track(t_b.p2p)
            await t_a.register("echo", _echo)
            header, out = await t_b.call(t_a.peer_id, "echo", {"via": "dht"}, [torch.ones(2, 2)], timeout=30)
            assert header["via"] == "dht" and torch.equal(out[0], torch.ones(2, 2))

            assert await announce(dht_a, "members", str(t_a.peer_id), {"stage": 0}, ttl=30)
            assert await announce(dht_b, "members", str(t_b.peer_id), {"stage": 1}, ttl=1.0)
            members = await live_members_async(dht_b, "members")
            assert members == {str(t_a.peer_id): {"stage": 0}, str(t_b.peer_id): {"stage": 1}}
            await asyncio.sleep(1.5)  # b stopped refreshing: its entry expires
            assert live_members(dht_a, "members") == {str(t_a.peer_id): {"stage": 0}}
            assert await live_members_async(dht_a, "nobody-here") == {}

            # a signed record survives the DHT's encoding: its MAC (over the content and expiry) still verifies
            secret = b"a-run-secret-of-16+chars"
            signed = sign_record(secret, "r", "member", "peerS", {"stage": 2, "state": "serving"}, ttl=30)
            assert await announce(dht_a, "signed", "peerS", signed, ttl=30)
            back = (await live_members_async(dht_b, "signed"))["peerS"]
            assert back == signed and record_ok(secret, "r", "member", "peerS", back)

            dead = f"/ip4/127.0.0.1/tcp/1/p2p/{t_a.peer_id}"  # right peer id, nothing listening
            start = time.monotonic()
            with pytest.raises(TransportError, match="could not reach any initial peer"):
                await start_transport([dead], startup_timeout=10)
            assert time.monotonic() - start < 20
        finally:
            if t_b is not None:
                await stop_transport(dht_b, t_b)
            await stop_transport(dht_a, t_a)

    asyncio.run(main())
    assert not socket_files() - before, "socket files left in the temporary directory"


def test_coordinator_record_names_its_transport() -> None:
    """A process of another --transport than the coordinator's gets a clear error instead of a hang; with a
    run secret the transport is signed with the record, so only a genuine record can cause that error."""
    from checkfree.protocol import ProtocolError, coordinator_from_records, coordinator_record

    secret = b"a-run-secret-of-16+chars"
    for key in (None, secret):
        found = {"main": coordinator_record(key, "r", "12D3KooWcoord", "libp2p")}
        assert coordinator_from_records(found, key, "r", "libp2p") == "12D3KooWcoord"
        assert coordinator_from_records(found, key, "r", "libp2p", exclude="12D3KooWcoord") is None
        assert coordinator_from_records({}, key, "r", "libp2p") is None
        with pytest.raises(ProtocolError, match="run 'r' uses --transport libp2p, this process --transport hivemind"):
            coordinator_from_records(found, key, "r", "hivemind")
    assert coordinator_from_records({"main": {"peer_id": "Qm"}}, None, "r", "hivemind") == "Qm"  # no transport field
    flipped = {"main": {**coordinator_record(secret, "r", "12D3KooWcoord", "libp2p"), "transport": "hivemind"}}
    assert coordinator_from_records(flipped, secret, "r", "hivemind") is None  # fails the MAC: ignored, no error
    assert coordinator_from_records(flipped, secret, "r", "hivemind", unsigned_ok=True) == "12D3KooWcoord"
    unsigned = {"x": {"peer_id": "stranger", "transport": "libp2p"},
                "main": coordinator_record(secret, "r", "12D3KooWcoord", "libp2p")}
    assert coordinator_from_records(unsigned, secret, "r", "libp2p", unsigned_ok=True) == "12D3KooWcoord"
    assert coordinator_from_records(unsigned, b"wrong-secret-of-16+chars", "r", "libp2p") is None


def test_bad_transport_flag_is_a_clear_cli_error(capsys) -> None:
    from cli.main import main

    for command in ("peer", "scheduler", "local", "export", "chaos"):
        with pytest.raises(SystemExit) as exit_:
            main([command, "--transport", "udp"])
        assert exit_.value.code == 2
        assert ("argument --transport: invalid choice: 'udp' (choose from 'hivemind', 'libp2p', 'tcp')"
                in capsys.readouterr().err)


def test_transport_check_says_what_to_install(monkeypatch) -> None:
    from checkfree.net import libp2p_transport
    from checkfree.net.transport import check_transport

    check_transport("hivemind")
    monkeypatch.setattr(libp2p_transport, "LIBP2P_IMPORT_ERROR", ImportError("No module named 'libp2p'"))
    with pytest.raises(TransportError, match=r"needs py-libp2p.*No module named 'libp2p'.*checkfree\[libp2p\]"):
        check_transport("libp2p")
    check_transport("tcp")  # nothing to install
    with pytest.raises(TransportError, match="unknown transport 'udp'; choose one of hivemind, libp2p, tcp"):
        check_transport("udp")
