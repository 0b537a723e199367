"""Echo throughput of the runtime's RPC paths (--transport hivemind, tcp, libp2p) vs a raw TCP socket on loopback.

Each round sends one float32 tensor and gets it echoed back; the paths are interleaved per round:
``Transport.call`` (the ``--transport hivemind`` runtime path: wire format, a reused p2pd stream; and the
same with one new stream per call, as before stream reuse),
hivemind's bare ``send_raw_data`` / ``receive_raw_data`` on a stream (the floor of anything that goes
through p2pd), a persistent length-prefixed asyncio TCP connection (the baseline: it reads into a
preallocated buffer and writes with the transports' chunked ``write_frames``, i.e. the same socket I/O
without any protocol), ``TcpTransport.call`` (the
``--transport tcp`` runtime path, checkfree.net.tcp_transport: direct TCP, same wire format, pooled
connections, handshake with a run secret as ``checkfree local`` has; the handshake happens in the
untimed warm-up), and, when py-libp2p is installed
(``pip install 'checkfree[libp2p]'``; ``--no-libp2p`` skips it), ``Libp2pTransport.call`` (the
``--transport libp2p`` runtime path, checkfree.net.libp2p_transport: py-libp2p TCP + noise + yamux in a
trio thread, same wire format, one yamux stream per call; the runtime looks a peer's address up in the
DHT once, before its first call, which is not timed here). Both p2pd daemons, both libp2p hosts and all
ends run on this one machine.

Latest results (quiet machine, load average 1.4 -> 0.3; fair raw baseline):

    python -m benchmarks.transport        # --sizes 1 4 16 64 --reps 7

    | payload MiB | hivemind transport MiB/s | same, one stream per call | hivemind raw stream MiB/s | raw TCP MiB/s | ratio hivemind/raw | tcp transport MiB/s | ratio tcp/raw | libp2p transport MiB/s | ratio libp2p/raw |
    |---|---|---|---|---|---|---|---|---|---|
    | 1 | 394 | 326 | 325 | 1260 | 0.31 | 1021 | 0.81 | 49 | 0.04 |
    | 4 | 516 | 469 | 339 | 1536 | 0.34 | 1300 | 0.85 | 64 | 0.04 |
    | 16 | 538 | 493 | 342 | 1169 | 0.46 | 1313 | 1.12 | 65 | 0.06 |
    | 64 | 520 | 447 | 227 | 983 | 0.53 | 1161 | 1.18 | 62 | 0.06 |

Runs below used a weaker raw baseline (``readexactly`` and one big ``write``: 113-460 MiB/s at 64 MiB),
so their ratios above 1 meant a slow baseline, not a fast transport.

With the tcp column (three runs back to back; load average 9.3 -> 8.5, 9.0 -> 9.1,
9.1 -> 10.3, other jobs running); the first run's table as printed, the other two below it:

    python -m benchmarks.transport --no-libp2p        # --sizes 1 4 16 64 --reps 7

    | payload MiB | hivemind transport MiB/s | same, one stream per call | hivemind raw stream MiB/s | raw TCP MiB/s | ratio hivemind/raw | tcp transport MiB/s | ratio tcp/raw |
    |---|---|---|---|---|---|---|---|
    | 1 | 191 | 215 | 195 | 1134 | 0.17 | 702 | 0.62 |
    | 4 | 320 | 329 | 252 | 531 | 0.60 | 1215 | 2.29 |
    | 16 | 303 | 290 | 206 | 378 | 0.80 | 447 | 1.18 |
    | 64 | 284 | 263 | 121 | 115 | 2.47 | 384 | 3.33 |
    second run:
    | 1 | 334 | 265 | 272 | 1589 | 0.21 | 1102 | 0.69 |
    | 4 | 331 | 305 | 237 | 913 | 0.36 | 1422 | 1.56 |
    | 16 | 248 | 276 | 205 | 244 | 1.02 | 470 | 1.93 |
    | 64 | 271 | 239 | 102 | 131 | 2.06 | 318 | 2.42 |
    third run:
    | 1 | 317 | 237 | 236 | 1196 | 0.27 | 1055 | 0.88 |
    | 4 | 346 | 299 | 230 | 664 | 0.52 | 1351 | 2.04 |
    | 16 | 343 | 335 | 203 | 480 | 0.71 | 1223 | 2.55 |
    | 64 | 290 | 246 | 92 | 83 | 3.47 | 244 | 2.92 |

The raw TCP baseline reads with ``StreamReader.readexactly`` (a growing bytearray, copied out): at 4-64 MiB
it is slower than the runtime paths, whose reader fills a preallocated buffer, so ratios above 1 there
mean a weak baseline, not a transport faster than a socket. At 1 MiB (the baseline's best) tcp/raw was
0.62-0.88.

Earlier results (2-core VM, torch 2.13 CPU, hivemind 1.1.12, libp2p 0.8.1 with protobuf 6.33.6; load
average 9.7 at the start, 9.1 at the end, from other jobs):

    python -m benchmarks.transport        # --sizes 1 4 16 64 --reps 7

    | payload MiB | hivemind transport MiB/s | hivemind raw stream MiB/s | raw TCP MiB/s | ratio hivemind/raw | libp2p transport MiB/s | ratio libp2p/raw |
    |---|---|---|---|---|---|---|
    | 1 | 179 | 209 | 1173 | 0.15 | 20 | 0.02 |
    | 4 | 253 | 209 | 623 | 0.41 | 45 | 0.07 |
    | 16 | 273 | 225 | 408 | 0.67 | 46 | 0.11 |
    | 64 | 213 | 90 | 113 | 1.88 | 32 | 0.28 |

Earlier runs (load average 5-7.5 during both, columns named "transport" / "libp2p" then):

    cd /work/main && python -m benchmarks.transport        # --sizes 1 4 16 64 --reps 7

    MiB/s = 2 x payload MiB / median round-trip time (payload sent and echoed back)
    | payload MiB | transport MiB/s | hivemind raw stream MiB/s | raw TCP MiB/s | ratio transport/raw | libp2p MiB/s | ratio libp2p/raw |
    |---|---|---|---|---|---|---|
    | 1 | 188 | 200 | 1158 | 0.16 | 50 | 0.04 |
    | 4 | 231 | 197 | 526 | 0.44 | 43 | 0.08 |
    | 16 | 165 | 129 | 295 | 0.56 | 28 | 0.09 |
    | 64 | 93 | 89 | 109 | 0.85 | 22 | 0.21 |

    previous run of the same command, 3 minutes earlier:
    | 1 | 84 | 106 | 1059 | 0.08 | 26 | 0.02 |
    | 4 | 111 | 93 | 415 | 0.27 | 27 | 0.07 |
    | 16 | 120 | 97 | 349 | 0.35 | 30 | 0.09 |
    | 64 | 145 | 104 | 130 | 1.12 | 33 | 0.25 |

Earlier run without libp2p (load average 3.4-4.4): transport 227/239/281/229, hivemind raw
220/212/193/148, raw TCP 1506/641/659/280 MiB/s at 1/4/16/64 MiB.
Runs vary by +-30 % with background load; the raw TCP column varies most (570-1500 MiB/s at 1-4 MiB).

Profile (ratio < 0.5): the transport matches or beats hivemind's own raw stream, so the gap is p2pd.
CPU during 10 x 4 MiB echoes: python 0.77 s, each p2pd 0.50 s, for 1.8 s wall, i.e. ~57 % of the CPU
goes to the two Go daemons (encryption, yamux, two extra unix-socket hops per direction), which share
2 cores with Python here. Tried: raising SO_SNDBUF on the unix socket to p2pd to 4 MiB (kept:
+15-40 % at 1-16 MiB); 1 MiB write chunks with a 4 MiB write high-water mark (kept); a larger
StreamReader limit (within noise, private attribute: dropped); reusing pooled streams (+10-20 %, but a
stale pooled stream makes retries ambiguous: dropped); zero-copy reads/writes through a dup()ed socket fd
(+10-30 %, relies on asyncio internals and broke a 64 MiB transfer once: dropped). First calls on a
fresh libp2p connection are 2-5x slower (window/RTT warm-up), hence the untimed warm-up rounds.

libp2p (3-5x slower than the hivemind transport here): the cost is py-libp2p itself, in pure Python.
The asyncio<->trio bridge costs ~5 %: a trio-native echo of 16 MiB over the same hosts (same framing,
no thread hop) gave 31-32 MiB/s against 30 MiB/s through ``Libp2pTransport.call``, measured
back to back. A cProfile of a trio-native transfer is dominated by trio scheduling and yamux/noise
per-frame work: py-libp2p sends 64 KiB yamux frames (``yamux.MAX_MESSAGE_SIZE``), each through
Python-level locks, a noise ChaCha20-Poly1305 frame and a socket send. An experiment that raised
``libp2p.stream_muxer.yamux.yamux.MAX_MESSAGE_SIZE`` to 1 MiB (a process-wide monkeypatch of a
library constant) gave 62-96 MiB/s for the same 16 MiB echo; not adopted, since it patches
py-libp2p's internals for every user in the process.
"""


from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import time

import numpy as np
import torch
from hivemind.p2p import P2P, PeerID

from checkfree.net.tcp_transport import start_tcp_transport
from checkfree.net.hivemind_transport import HivemindTransport
from checkfree.net.streams import write_frames

try:  # optional: the py-libp2p transport (pip install 'checkfree[libp2p]')
    from checkfree.net import libp2p_transport as _libp2p

    HAVE_LIBP2P = _libp2p.LIBP2P_IMPORT_ERROR is None
except ImportError:
    HAVE_LIBP2P = False

__all__ = ["HAVE_LIBP2P", "RawClient", "main", "run", "transport_roundtrip"]

WARMUP = 5  # untimed 4 MiB rounds before measuring
RAW_READER_LIMIT = 8 << 20  # the default 64 KiB StreamReader limit makes the baseline itself slow at 64 MiB


async def _read_raw(reader: asyncio.StreamReader, length: int) -> np.ndarray:
    """``length`` bytes into one preallocated buffer, in chunks as they arrive. The raw baseline reads this way
    and writes with the transports' ``write_frames`` (1 MiB chunks, 4 MiB send buffer): ``readexactly`` and
    one big ``write`` grow a bytearray and copy it, which made an earlier baseline slower than the
    transports at 16-64 MiB."""
    body = np.empty(length, dtype=np.uint8)
    view, pos = memoryview(body), 0
    while pos < length:
        chunk = await reader.read(min(length - pos, 4 << 20))
        if not chunk:
            raise asyncio.IncompleteReadError(b"", length - pos)
        view[pos : pos + len(chunk)] = chunk
        pos += len(chunk)
    return body


async def _raw_echo_server(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            prefix = await reader.readexactly(8)
            body = await _read_raw(reader, int.from_bytes(prefix, "big"))
            await write_frames(writer, [prefix, body])
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


class RawClient:
    """Length-prefixed echo over one persistent loopback TCP connection (the baseline)."""

    async def start(self) -> None:
        self.server = await asyncio.start_server(_raw_echo_server, "127.0.0.1", 0, limit=RAW_READER_LIMIT)
        port = self.server.sockets[0].getsockname()[1]
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", port, limit=RAW_READER_LIMIT)

    async def roundtrip(self, payload: torch.Tensor) -> float:
        data = memoryview(payload.numpy()).cast("B")
        start = time.perf_counter()
        await write_frames(self.writer, [len(data).to_bytes(8, "big"), data])
        reply = await _read_raw(self.reader, int.from_bytes(await self.reader.readexactly(8), "big"))
        elapsed = time.perf_counter() - start
        assert reply.nbytes == data.nbytes
        return elapsed

    async def stop(self) -> None:
        self.writer.close()
        self.server.close()
        await self.server.wait_closed()


async def transport_roundtrip(client: Transport, server_id: PeerID, payload: torch.Tensor) -> float:
    """One Transport.call to an echo handler (on a reused stream unless the client's pool is off)."""
    start = time.perf_counter()
    _, tensors = await client.call(server_id, "echo", {"op": "echo"}, [payload], timeout=120)
    elapsed = time.perf_counter() - start
    assert tensors[0].shape == payload.shape
    return elapsed


async def _hivemind_raw_echo(info: object, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        data = await P2P.receive_raw_data(reader)
        await P2P.send_raw_data(data, writer, chunk_size=4 << 20)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(reader.read(1), 10)  # linger until the caller closes (no half-close)
    finally:
        writer.close()


async def hivemind_raw_roundtrip(p2p: P2P, server_id: PeerID, payload: torch.Tensor) -> float:
    """hivemind's own floor: one stream, P2P.send_raw_data / receive_raw_data, no wire format."""
    data = memoryview(payload.numpy()).cast("B")
    start = time.perf_counter()
    _, reader, writer = await p2p.call_binary_stream_handler(server_id, "raw-echo")
    try:
        await P2P.send_raw_data(data, writer, chunk_size=4 << 20)
        reply = await P2P.receive_raw_data(reader)
    finally:
        writer.close()
    elapsed = time.perf_counter() - start
    assert len(reply) == data.nbytes
    return elapsed


async def run(
    sizes_mb: list[int], reps: int, *, libp2p: bool = HAVE_LIBP2P
) -> list[tuple[int, float, float, float, float, float, float | None]]:
    """Median MB/s per size: (MiB, transport, transport with one stream per call, hivemind raw, raw TCP,
    tcp transport, libp2p transport or None).

    All paths' rounds are interleaved so background load hits them alike. ``libp2p``: also measure
    ``Libp2pTransport.call`` (py-libp2p, TCP + noise + yamux, trio thread) when it is installed.
    """
    p2p_a = await P2P.create()
    p2p_b = await P2P.create(initial_peers=[str(m) for m in await p2p_a.get_visible_maddrs()])
    server, client = HivemindTransport(p2p_a), HivemindTransport(p2p_b, pool_streams=True)
    fresh = HivemindTransport(p2p_b, pool_streams=False)  # the runtime before stream reuse: one p2pd stream per call
    raw = RawClient()
    await raw.start()
    secret = b"benchmark-run-secret-0123456789"
    tcp_server = await start_tcp_transport("QmTcpServer", secret=secret)
    tcp_client = await start_tcp_transport("QmTcpClient", secret=secret)
    tcp_client.add_peer_address(tcp_server.get_visible_maddrs()[0])
    lp_server = lp_client = None

    async def echo(header: dict, tensors: list[torch.Tensor], peer: PeerID) -> tuple[dict, list[torch.Tensor]]:
        return header, tensors

    await server.register("echo", echo)
    await tcp_server.register("echo", echo)
    await p2p_a.add_binary_stream_handler("raw-echo", _hivemind_raw_echo)
    rows = []
    try:
        if libp2p:
            lp_server = await _libp2p.start_libp2p_transport()
            lp_client = await _libp2p.start_libp2p_transport(initial_peers=lp_server.get_visible_maddrs())
            await lp_server.register("echo", echo)
        warm = torch.randn(1 << 20)
        for _ in range(WARMUP):  # the first calls on a fresh libp2p connection are 2-5x slower
            await transport_roundtrip(client, p2p_a.peer_id, warm)
            await transport_roundtrip(fresh, p2p_a.peer_id, warm)
            await hivemind_raw_roundtrip(p2p_b, p2p_a.peer_id, warm)
            await raw.roundtrip(warm)
            await transport_roundtrip(tcp_client, tcp_server.peer_id, warm)
            if lp_client is not None:
                await transport_roundtrip(lp_client, lp_server.peer_id, warm)  # yamux window warm-up
        for mb in sizes_mb:
            payload = torch.randn(mb * (1 << 20) // 4)
            t_rt, t_fresh, t_hm, t_raw, t_tcp, t_lp = [], [], [], [], [], []
            for _ in range(reps):
                t_rt.append(await transport_roundtrip(client, p2p_a.peer_id, payload))
                t_fresh.append(await transport_roundtrip(fresh, p2p_a.peer_id, payload))
                t_hm.append(await hivemind_raw_roundtrip(p2p_b, p2p_a.peer_id, payload))
                t_raw.append(await raw.roundtrip(payload))
                t_tcp.append(await transport_roundtrip(tcp_client, tcp_server.peer_id, payload))
                if lp_client is not None:
                    t_lp.append(await transport_roundtrip(lp_client, lp_server.peer_id, payload))
            lp = 2 * mb / statistics.median(t_lp) if t_lp else None
            rows.append((mb, *(2 * mb / statistics.median(t) for t in (t_rt, t_fresh, t_hm, t_raw, t_tcp)), lp))
    finally:
        await raw.stop()
        await tcp_client.shutdown()
        await tcp_server.shutdown()
        client.close_idle_streams()
        await server.shutdown()
        if lp_client is not None:
            await lp_client.shutdown()
        if lp_server is not None:
            await lp_server.shutdown()
        await p2p_b.shutdown()
        await p2p_a.shutdown()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 16, 64], help="payload sizes in MiB")
    parser.add_argument("--reps", type=int, default=7, help="timed repetitions per size (median reported)")
    parser.add_argument(
        "--no-libp2p", action="store_true", help="skip the py-libp2p column even if libp2p is installed"
    )
    args = parser.parse_args()
    libp2p = HAVE_LIBP2P and not args.no_libp2p
    rows = asyncio.run(run(args.sizes, args.reps, libp2p=libp2p))
    print("MiB/s = 2 x payload MiB / median round-trip time (payload sent and echoed back)")
    extra = " libp2p transport MiB/s | ratio libp2p/raw |" if libp2p else ""
    print(f"| payload MiB | hivemind transport MiB/s | same, one stream per call | hivemind raw stream MiB/s | "
          f"raw TCP MiB/s | ratio hivemind/raw | tcp transport MiB/s | ratio tcp/raw |{extra}")
    print("|---|---|---|---|---|---|---|---|" + ("---|---|" if libp2p else ""))
    for mb, rt, fr, hm, raw, tcp, lp in rows:
        tail = f" {lp:.0f} | {lp / raw:.2f} |" if lp is not None else ""
        print(f"| {mb} | {rt:.0f} | {fr:.0f} | {hm:.0f} | {raw:.0f} | {rt / raw:.2f} | {tcp:.0f} | {tcp / raw:.2f} |{tail}")


if __name__ == "__main__":
    main()
