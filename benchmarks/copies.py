"""Bytes copied per message, per finiteness check and per snapshot, before and after issue 31's copy reductions.

How it is measured: memray's `Tracker` records every allocation the process makes while an operation runs
(Python objects, numpy and torch buffers: malloc, calloc, realloc, posix_memalign, mmap, caught at the library
boundary, in every thread). A user-space copy of a payload lands in a buffer allocated for it (recv's bytes
objects, the StreamReader's growing buffer, ``read()``'s slices, ``bytearray(blob)``, ``tobytes()``,
``torch.save``'s output, cloned tensors, ``isfinite``'s boolean temporary), so the bytes allocated in blocks of
at least 64 KiB, divided by the payload, count the payload's copies plus its one destination buffer (the
message body a receiver must own, the blob a snapshot is). Not counted: copies into memory that already exists
(a ``load_state_dict`` into the parameters, the kernel's own socket copies). The old paths are kept here, as they
were, beside the new ones, and each operation runs both ways side by side in one run:

* receive: one message of one float32 tensor over loopback TCP, sent by a thread (its allocations are reported
  apart); before: an asyncio ``StreamReader`` read chunk by chunk into the body (recv -> reader buffer -> read()
  -> body); after: `checkfree.net.framed.FramedReader` (``recv_into`` the body);
* check_finite of that tensor; before: ``torch.isfinite(t).all()``; after: `checkfree.net.wire.check_finite`;
* snapshot: a stage's full state (weights, Adam, RNG) captured, serialised, sent over loopback TCP, received and
  loaded into another worker of the same stage; before: ``capture_worker`` (clones) + ``torch.save`` +
  ``bytearray(blob)``, ``.numpy().tobytes()`` and ``torch.load``; after: ``capture_worker(clone=False)`` +
  `checkfree.serialize.state_to_bytes` (one copy), the received bytes loaded in place.

Per step: a middle stage of the preset receives 2 x microbatches messages (activations forward, gradients back),
each checked for finiteness; the table's last rows multiply the measured per-message figures by that count.

    python -m benchmarks.copies                  # preset small, payloads = one activation, 16 and 64 MiB
    python -m benchmarks.copies --quick          # preset tiny, one activation and 4 MiB
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import queue
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import memray
import torch

from checkfree.config import preset
from checkfree.net.framed import adopt
from checkfree.net.streams import read_message, write_frames
from checkfree.net.wire import check_finite, encode_message
from checkfree.serialize import blob_tensor, state_from_bytes, state_to_bytes
from checkfree.strategies.state import capture_worker, restore_worker
from checkfree.worker import StageWorker

MIN_BLOCK = 4 << 10  # smaller blocks are Python's own object churn, not payload copies
OLD_READER_LIMIT = 4 << 20  # the tcp transport's StreamReader limit before FramedReader
MIB = float(1 << 20)


@dataclass
class Measured:
    """Bytes allocated in blocks of at least MIN_BLOCK during one operation, by the receiving/working thread and
    by the sending thread."""

    work: int = 0
    sender: int = 0


_ALLOCATING = {memray.AllocatorType.MALLOC, memray.AllocatorType.CALLOC, memray.AllocatorType.POSIX_MEMALIGN,
               memray.AllocatorType.ALIGNED_ALLOC, memray.AllocatorType.MEMALIGN, memray.AllocatorType.VALLOC,
               memray.AllocatorType.PVALLOC}


def _allocated(path: Path) -> Measured:
    """The bytes a recording allocated, by thread. A realloc counts as its change in size (recv's 256 KiB
    buffer shrunk to the bytes received counts as those bytes). Python's arenas (mmap) are left out."""
    out, sizes, freed = Measured(), {}, {}
    senders = _sender_tids(path)
    for rec in memray.FileReader(path).get_allocation_records():
        sender = rec.tid in senders
        if rec.allocator == memray.AllocatorType.FREE:
            freed[sender] = sizes.pop(rec.address, 0)
            continue
        if rec.allocator == memray.AllocatorType.REALLOC:
            old = freed.pop(sender, 0)
        elif rec.allocator in _ALLOCATING:
            old = freed[sender] = 0
        else:
            continue
        sizes[rec.address] = rec.size
        if max(rec.size, old) >= MIN_BLOCK:
            if sender:
                out.sender += rec.size - old
            else:
                out.work += rec.size - old
    return out


def _sender_tids(path: Path) -> set[int]:
    """memray's ids of the threads that ran `_Link._sender` (it names only threads started while it tracks)."""
    return {rec.tid for rec in memray.FileReader(path).get_allocation_records()
            if rec.allocator in _ALLOCATING | {memray.AllocatorType.REALLOC}
            and any(frame[0] == "_sender" for frame in rec.stack_trace())}


@contextlib.contextmanager
def _tracking(into: list[Measured]) -> Iterator[None]:
    """Record the allocations of the block; append what they were to `into`."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "allocations.bin"
        with memray.Tracker(path):
            yield
        into.append(_allocated(path))


# ---- the paths as they were before (kept verbatim for the side-by-side measurement) -----------------------
def _old_state_to_bytes(state: dict) -> bytes:
    def compact(obj: object) -> object:
        if isinstance(obj, torch.Tensor):
            own = obj.numel() * obj.element_size()
            return obj.clone() if obj.untyped_storage().nbytes() > own else obj
        if isinstance(obj, dict):
            return type(obj)((k, compact(v)) for k, v in obj.items())
        if isinstance(obj, (list, tuple)):
            return type(obj)(compact(v) for v in obj)
        return obj

    buf = io.BytesIO()
    torch.save(compact(state), buf)
    return buf.getvalue()


def _old_state_from_bytes(b: bytes) -> dict:
    return torch.load(io.BytesIO(bytes(b)), map_location="cpu", weights_only=True)


def _old_check_finite(t: torch.Tensor) -> None:
    finite = torch.isfinite(t)
    if not bool(finite.all()):
        raise ValueError("not finite")


# ---- messages over one loopback TCP connection -------------------------------------------------------------
class _Link:
    """A loopback TCP connection kept for several messages (as the transports pool theirs): a thread named
    "sender" writes what `send` is given, this thread receives; `framed`: the receiver is a FramedReader."""

    def __init__(self, framed: bool) -> None:
        self.framed = framed
        self.outbox: queue.Queue = queue.Queue()

    async def __aenter__(self) -> _Link:
        accepted: asyncio.Queue = asyncio.Queue()
        self.server = await asyncio.start_server(lambda r, w: accepted.put_nowait((r, w)), "127.0.0.1", 0,
                                                 limit=OLD_READER_LIMIT)
        port = self.server.sockets[0].getsockname()[1]
        self.thread = threading.Thread(target=lambda: asyncio.run(self._sender(port)), name="sender")
        self.thread.start()
        reader, self.writer = await accepted.get()
        self.reader = adopt(reader, self.writer) if self.framed else reader
        return self

    async def _sender(self, port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        while (tensors := await asyncio.to_thread(self.outbox.get)) is not None:
            await write_frames(writer, encode_message({"k": 1}, tensors))
        writer.close()

    def send(self, tensors: list[torch.Tensor]) -> None:
        self.outbox.put(tensors)

    async def receive(self) -> list[torch.Tensor]:
        return (await read_message(self.reader, 1 << 31))[1]

    async def __aexit__(self, *exc: object) -> None:
        self.outbox.put(None)
        await asyncio.to_thread(self.thread.join)
        self.writer.close()
        self.server.close()
        await self.server.wait_closed()


def _receive(nbytes: int, framed: bool) -> Measured:
    """One message of one float32 tensor of `nbytes`, received on a connection that has carried one already."""
    tensor, out = torch.randn(nbytes // 4), []

    async def main() -> None:
        async with _Link(framed) as link:
            link.send([tensor])
            await link.receive()
            with _tracking(out):
                link.send([tensor])
                await link.receive()

    asyncio.run(main())
    return out[0]


def _finite(nbytes: int, new: bool) -> Measured:
    tensor, out = torch.randn(nbytes // 4), []
    with _tracking(out):
        check_finite([tensor]) if new else _old_check_finite(tensor)
    return out[0]


def _stage_workers(name: str) -> tuple[StageWorker, StageWorker]:
    """A middle stage with Adam state, and a second worker of the same stage to load into."""
    cfg = preset(name)
    cfg.train.device = "cpu"
    stage = cfg.num_stages // 2
    source, target = StageWorker(cfg, stage), StageWorker(cfg, stage)
    for p in source.module.parameters():
        p.grad = torch.zeros_like(p)
    source.optimizer.step()
    return source, target


PHASES = ("capture + serialise", "send + receive", "load")


def _snapshot(source: StageWorker, target: StageWorker, new: bool) -> list[Measured]:
    """Capture `source`'s state, send it, receive it and load it into `target`, the old way or the new: what each
    phase (PHASES) allocated."""
    out: list[Measured] = []

    async def main() -> None:
        async with _Link(framed=new) as link:
            link.send([torch.zeros(state_bytes_of(source), dtype=torch.uint8)])  # the connection carried one
            await link.receive()
            with _tracking(out):
                if new:
                    payload = blob_tensor(state_to_bytes(capture_worker(source, 1, 0.5, clone=False)))
                else:
                    blob = _old_state_to_bytes(capture_worker(source, 1, 0.5))
                    payload = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
                    del blob
            with _tracking(out):
                link.send([payload])
                (got,) = await link.receive()
            with _tracking(out):
                if new:
                    restore_worker(target, state_from_bytes(got.numpy()))
                else:
                    restore_worker(target, _old_state_from_bytes(got.numpy().tobytes()))

    asyncio.run(main())
    for a, b in zip(source.module.state_dict().values(), target.module.state_dict().values()):
        assert torch.equal(a, b), "the snapshot did not arrive intact"
    return out


def state_bytes_of(worker: StageWorker) -> int:
    return len(state_to_bytes(capture_worker(worker, 1, 0.5, clone=False)))


def _row(what: str, payload: int, before: Measured, after: Measured, sender: bool = False) -> dict:
    return {"operation": what, "payload": payload, "before": vars(before), "after": vars(after), "sender": sender}


def render(result: dict) -> list[str]:
    """The table (and the closing ratios line) of a result, as printed and as the docs carry it."""
    lines = [f"preset {result['preset']}: one activation {result['activation'] / MIB:.3f} MiB, {result['per_step']} "
             f"messages per step per middle stage; load average {result['load']:.1f}", "",
             "| operation | payload MiB | before: MiB allocated (x payload) | after | before/after | "
             "sender MiB before / after |", "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        b, a, payload = r["before"], r["after"], r["payload"]
        cells = [f"{m['work'] / MIB:.2f} ({m['work'] / payload:.2f}x)" for m in (b, a)]
        ratio = f"{b['work'] / a['work']:.2f}" if a["work"] else "inf"
        extra = f"{b['sender'] / MIB:.2f} / {a['sender'] / MIB:.2f}" if r["sender"] else ""
        lines.append(f"| {r['operation']} | {payload / MIB:.2f} | {cells[0]} | {cells[1]} | {ratio} | {extra} |")
    ratios = {r["operation"]: r for r in result["rows"]}
    picks = [ratios[k] for k in ("receive one message", "check_finite (one activation)", "snapshot: all three")]
    text = [f"{r['before']['work'] / r['after']['work']:.2f}" if r["after"]["work"] else "inf" for r in picks]
    lines += ["", f"copies before/after: receive {text[0]}, check_finite {text[1]}, snapshot {text[2]}"]
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--sizes", type=float, nargs="*", default=[16, 64], help="extra message sizes, MiB")
    ap.add_argument("--quick", action="store_true", help="preset tiny, one extra size of 4 MiB")
    ap.add_argument("--json", type=Path, default=None, help="write the result here too")
    ap.add_argument("--render", type=Path, default=None, help="print the table of a --json result file and exit")
    args = ap.parse_args(argv)
    if args.render is not None:
        print("\n".join(render(json.loads(args.render.read_text()))))
        return
    if args.quick:
        args.preset, args.sizes = "tiny", [4]
    torch.set_num_threads(1)
    cfg = preset(args.preset)
    activation = cfg.train.microbatch_size * cfg.model.context_length * cfg.model.d_model * 4
    per_step = 2 * cfg.train.num_microbatches  # messages a middle stage receives per step
    result = {"preset": args.preset, "activation": activation, "per_step": per_step, "load": os.getloadavg()[0],
              "rows": []}
    rows = result["rows"]
    for nbytes in [int(s * MIB) for s in args.sizes] + [activation]:  # the activation's row last (the dict below)
        rows.append(_row("receive one message", nbytes, _receive(nbytes, framed=False), _receive(nbytes, framed=True),
                         sender=True))
    receive = (Measured(**rows[-1]["before"]), Measured(**rows[-1]["after"]))
    finite = _finite(activation, new=False), _finite(activation, new=True)
    rows.append(_row("check_finite (one activation)", activation, *finite))
    source, target = _stage_workers(args.preset)
    state_bytes = state_bytes_of(source)
    phases = list(zip(_snapshot(source, target, new=False), _snapshot(source, target, new=True)))
    for name, (before, after) in zip(PHASES, phases):
        rows.append(_row(f"snapshot: {name}", state_bytes, before, after, sender=name == PHASES[1]))
    snap = [Measured(sum(p[i].work for p in phases), sum(p[i].sender for p in phases)) for i in (0, 1)]
    rows.append(_row("snapshot: all three", state_bytes, *snap, sender=True))
    step = [Measured(per_step * (r.work + f.work), per_step * r.sender) for r, f in zip(receive, finite)]
    rows.append(_row(f"per step, one middle stage ({per_step} messages received and checked)",
                     per_step * activation, *step, sender=True))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    print("\n".join(render(result)))


if __name__ == "__main__":
    main()
