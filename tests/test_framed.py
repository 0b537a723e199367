"""checkfree.net.framed: a connection taken over from a StreamReader, bodies received in place."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from checkfree.net.framed import SCRATCH_BYTES, adopt
from checkfree.net.streams import read_message, write_frames
from checkfree.net.wire import encode_message

pytestmark = pytest.mark.timeout(60)


async def _pair() -> tuple:
    """(server reader, server writer, client reader, client writer, server) over loopback TCP."""
    accepted: asyncio.Queue = asyncio.Queue()
    server = await asyncio.start_server(lambda r, w: accepted.put_nowait((r, w)), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    creader, cwriter = await asyncio.open_connection("127.0.0.1", port)
    sreader, swriter = await accepted.get()
    return sreader, swriter, creader, cwriter, server


def test_adopt_keeps_buffered_bytes_and_an_end_of_stream_already_seen() -> None:
    async def main() -> None:
        sreader, swriter, _, cwriter, server = await _pair()
        cwriter.write(b"abcdef")
        cwriter.close()
        assert await sreader.readexactly(2) == b"ab"
        while not sreader.at_eof() and not sreader._eof:  # the end of the stream reached the StreamReader
            await asyncio.sleep(0.01)
        framed = adopt(sreader, swriter)
        assert await framed.readexactly(4) == b"cdef"
        assert await framed.read() == b"" and framed.at_eof()
        swriter.close()
        server.close()
        await server.wait_closed()

    asyncio.run(main())


def test_adopt_after_a_scratch_buffer_s_worth_or_more_was_buffered_reads_on() -> None:
    """Under load the StreamReader may hold a scratch buffer's worth or more before `adopt` (a request's body
    arriving before its handler ran): the bytes after them are read too. (The scratch buffer was made exactly as
    large as what was held, and handed to the socket full: 'get_buffer() returned an empty buffer', the request
    lost; found as a REFT_CHUNK lost under load, tests/test_swarm.py's reft crash test.)"""
    async def main() -> None:
        for size in (SCRATCH_BYTES, 3 * SCRATCH_BYTES):
            sreader, swriter, _, cwriter, server = await _pair()
            first = bytes(range(256)) * (size // 256)
            cwriter.write(first)
            while len(sreader._buffer) < size:  # (its private buffer: what adopt takes over)
                await asyncio.sleep(0.01)
            framed = adopt(sreader, swriter)
            cwriter.write(b"after")
            while framed._end == size and framed.exception() is None:  # the bytes after reached the reader
                await asyncio.sleep(0.01)
            assert await framed.readexactly(size) == first
            assert await framed.readexactly(5) == b"after"
            for w in (cwriter, swriter):
                w.close()
            server.close()
            await server.wait_closed()

    asyncio.run(main())


def test_a_large_body_is_received_in_place_and_the_writer_still_drains() -> None:
    async def main() -> None:
        sreader, swriter, creader, cwriter, server = await _pair()
        framed, cframed = adopt(sreader, swriter), adopt(creader, cwriter)
        payload = np.arange(3 << 20, dtype=np.float32)  # 12 MiB: far more than the scratch buffer
        import torch

        t = torch.from_numpy(payload)
        send = asyncio.create_task(write_frames(cwriter, encode_message({"k": 1}, [t])))
        received: list[tuple[bool, int]] = []  # (into the body, bytes) of every recv_into
        orig = framed.buffer_updated

        def spy(nbytes: int) -> None:
            received.append((framed._into_target, nbytes))
            orig(nbytes)

        framed.buffer_updated = spy  # type: ignore[method-assign]
        header, (got,) = await read_message(framed, 1 << 30)
        await send
        assert header == {"k": 1} and torch.equal(got, t)
        via_scratch = sum(n for into, n in received if not into)
        assert sum(n for into, n in received if into) > (12 << 20) - SCRATCH_BYTES and via_scratch <= SCRATCH_BYTES
        # replies flow the other way on the same connections (the writer's flow control still works)
        back = asyncio.create_task(write_frames(swriter, encode_message({"back": True}, [t])))
        header, (echo,) = await read_message(cframed, 1 << 30)
        await back
        assert header == {"back": True} and torch.equal(echo, t)
        cwriter.close()
        assert await framed.read() == b""
        swriter.close()
        server.close()
        await server.wait_closed()

    asyncio.run(main())


def test_a_stream_that_ends_mid_body_raises_incomplete_read() -> None:
    async def main() -> None:
        sreader, swriter, _, cwriter, server = await _pair()
        framed = adopt(sreader, swriter)
        cwriter.write((1 << 20).to_bytes(8, "big") + b"\x00" * 1000)
        cwriter.close()
        with pytest.raises(asyncio.IncompleteReadError):
            await read_message(framed, 1 << 30)
        swriter.close()
        server.close()
        await server.wait_closed()

    asyncio.run(main())
