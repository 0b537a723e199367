"""Echo throughput: checkfree.net.transport (hivemind P2P binary streams) vs a raw asyncio TCP socket on loopback.

Each round sends one float32 tensor and gets it echoed back; three paths are interleaved per round:
``Transport.call`` (wire format, one libp2p stream per call), hivemind's bare ``send_raw_data`` /
``receive_raw_data`` on a stream (the floor of anything that goes through p2pd), and a persistent
length-prefixed asyncio TCP connection. Both p2pd daemons and both ends run on this one machine.

Latest results (2-core VM, torch 2.13 CPU, hivemind 1.1.12; load average 3.4-4.4 from other jobs):

    cd /work/main && python -m benchmarks.transport        # --sizes 1 4 16 64 --reps 7

    MiB/s = 2 x payload MiB / median round-trip time (payload sent and echoed back)
    | payload MiB | transport MiB/s | hivemind raw stream MiB/s | raw TCP MiB/s | ratio transport/raw |
    |---|---|---|---|---|
    | 1 | 227 | 220 | 1506 | 0.15 |
    | 4 | 239 | 212 | 641 | 0.37 |
    | 16 | 281 | 193 | 659 | 0.43 |
    | 64 | 229 | 148 | 280 | 0.82 |

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
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import time

import torch
from hivemind.p2p import P2P, PeerID

from checkfree.net.transport import Transport

__all__ = ["RawClient", "main", "run", "transport_roundtrip"]

WARMUP = 5  # untimed 4 MiB rounds before measuring
RAW_READER_LIMIT = 8 << 20  # the default 64 KiB StreamReader limit makes the baseline itself slow at 64 MiB


async def _raw_echo_server(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            prefix = await reader.readexactly(8)
            body = await reader.readexactly(int.from_bytes(prefix, "big"))
            writer.write(prefix)
            writer.write(body)
            await writer.drain()
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
        self.writer.write(len(data).to_bytes(8, "big"))
        self.writer.write(data)
        await self.writer.drain()
        reply = await self.reader.readexactly(int.from_bytes(await self.reader.readexactly(8), "big"))
        elapsed = time.perf_counter() - start
        assert len(reply) == data.nbytes
        return elapsed

    async def stop(self) -> None:
        self.writer.close()
        self.server.close()
        await self.server.wait_closed()


async def transport_roundtrip(client: Transport, server_id: PeerID, payload: torch.Tensor) -> float:
    """One Transport.call to an echo handler (one stream per call, as in production)."""
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


async def run(sizes_mb: list[int], reps: int) -> list[tuple[int, float, float, float]]:
    """Median MB/s per size; transport and raw rounds are interleaved so background load hits both alike."""
    p2p_a = await P2P.create()
    p2p_b = await P2P.create(initial_peers=[str(m) for m in await p2p_a.get_visible_maddrs()])
    server, client = Transport(p2p_a), Transport(p2p_b)
    raw = RawClient()
    await raw.start()

    async def echo(header: dict, tensors: list[torch.Tensor], peer: PeerID) -> tuple[dict, list[torch.Tensor]]:
        return header, tensors

    await server.register("echo", echo)
    await p2p_a.add_binary_stream_handler("raw-echo", _hivemind_raw_echo)
    rows = []
    try:
        warm = torch.randn(1 << 20)
        for _ in range(WARMUP):  # the first calls on a fresh libp2p connection are 2-5x slower
            await transport_roundtrip(client, p2p_a.peer_id, warm)
            await hivemind_raw_roundtrip(p2p_b, p2p_a.peer_id, warm)
            await raw.roundtrip(warm)
        for mb in sizes_mb:
            payload = torch.randn(mb * (1 << 20) // 4)
            t_rt, t_hm, t_raw = [], [], []
            for _ in range(reps):
                t_rt.append(await transport_roundtrip(client, p2p_a.peer_id, payload))
                t_hm.append(await hivemind_raw_roundtrip(p2p_b, p2p_a.peer_id, payload))
                t_raw.append(await raw.roundtrip(payload))
            rows.append((mb, *(2 * mb / statistics.median(t) for t in (t_rt, t_hm, t_raw))))
    finally:
        await raw.stop()
        await server.shutdown()
        await p2p_b.shutdown()
        await p2p_a.shutdown()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 16, 64], help="payload sizes in MiB")
    parser.add_argument("--reps", type=int, default=7, help="timed repetitions per size (median reported)")
    args = parser.parse_args()
    rows = asyncio.run(run(args.sizes, args.reps))
    print("MiB/s = 2 x payload MiB / median round-trip time (payload sent and echoed back)")
    print("| payload MiB | transport MiB/s | hivemind raw stream MiB/s | raw TCP MiB/s | ratio transport/raw |")
    print("|---|---|---|---|---|")
    for mb, rt, hm, raw in rows:
        print(f"| {mb} | {rt:.0f} | {hm:.0f} | {raw:.0f} | {rt / raw:.2f} |")


if __name__ == "__main__":
    main()
