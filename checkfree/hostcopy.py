"""Activations and gradients between a CUDA device and the wire: pinned host buffers, `non_blocking` copies on
side streams, and no thread blocked on the device while it computes.

* **To the host** (`to_host`, a peer's event loop before a send): each CUDA tensor is copied into a pinned buffer
  on a copy stream of its own, after the work queued so far on the current stream (the stage's forward or
  backward, which the compute thread queued on the device's default stream); the caller awaits the copy's event
  in a helper thread, so neither the event loop (pings, heartbeats, other passes) nor the compute thread (the
  next microbatch's kernels) waits for it, and the copy overlaps the next microbatch's compute.
* **To the device** (`to_device`, the compute thread before a forward or backward): the received tensor is
  staged in a pinned buffer and copied on the upload stream with `non_blocking=True`; the compute stream waits
  for that copy on the device (an event, not the host), so the upload overlaps kernels still running.

Pinned buffers come from torch's caching host allocator, which keeps a buffer until the copies recorded on it
have finished, so a buffer is never reused under a copy in flight. The device tensors cross streams with
`record_stream`, so the caching device allocator does not hand their memory out while another stream still
reads it. On a CPU (and for tensors already where they are going) both functions return their input: the CPU
path and its numbers are unchanged.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import Tensor

__all__ = ["to_host", "start_to_host", "to_device"]

_STREAMS: dict[tuple[str, int | None], torch.cuda.Stream] = {}
_LOCK = threading.Lock()
_WAITER: ThreadPoolExecutor | None = None


def _stream(kind: str, device: torch.device) -> torch.cuda.Stream:
    """One side stream per direction and device, per process (created on first use)."""
    key = (kind, device.index)
    with _LOCK:
        if key not in _STREAMS:
            _STREAMS[key] = torch.cuda.Stream(device=device)
        return _STREAMS[key]


def start_to_host(tensors: Sequence[Tensor]) -> tuple[list[Tensor], torch.cuda.Event | None]:
    """Start copying `tensors` to pinned host memory; returns the host tensors (valid once the event has completed)
    and the event (None when nothing was on a CUDA device: the tensors are returned as they are)."""
    if not any(t.is_cuda for t in tensors):
        return [t if t.device.type == "cpu" else t.cpu() for t in tensors], None
    out, event = [], None
    for t in tensors:
        if not t.is_cuda:
            out.append(t.cpu())
            continue
        t = t.detach().contiguous()
        stream = _stream("d2h", t.device)
        stream.wait_stream(torch.cuda.current_stream(t.device))  # after the kernels that produced t
        with torch.cuda.stream(stream):
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
        t.record_stream(stream)  # t's memory is not reused before the copy has read it
        event = torch.cuda.Event()
        event.record(stream)
        out.append(host)
    return out, event


async def to_host(tensors: Sequence[Tensor]) -> list[Tensor]:
    """`tensors` in host memory, awaited without blocking the event loop (the device is waited for in a helper
    thread: the one host sync a send needs, since the socket reads the bytes)."""
    host, event = start_to_host(tensors)
    if event is not None and not event.query():
        await asyncio.get_running_loop().run_in_executor(_waiter(), event.synchronize)
    return host


def _waiter() -> ThreadPoolExecutor:
    global _WAITER
    with _LOCK:
        if _WAITER is None:
            _WAITER = ThreadPoolExecutor(max_workers=2, thread_name_prefix="d2h-wait")
        return _WAITER


def to_device(x: Tensor, device: torch.device, dtype: torch.dtype | None = None) -> Tensor:
    """`x` on `device` (and in `dtype`, when given). A host tensor bound for a CUDA device goes through a pinned
    buffer and the upload stream; the current stream waits for it on the device. Anything else: `Tensor.to`."""
    if device.type != "cuda" or x.is_cuda or x.device.type != "cpu":
        return x.to(device=device, dtype=dtype) if dtype is not None else x.to(device)
    pinned = x if x.is_pinned() else torch.empty(x.shape, dtype=x.dtype, pin_memory=True).copy_(x)
    stream, current = _stream("h2d", device), torch.cuda.current_stream(device)
    with torch.cuda.stream(stream):  # (not after `current`'s queued kernels: the upload overlaps them)
        out = pinned.to(device, non_blocking=True)
    current.wait_stream(stream)
    out.record_stream(current)
    return out if dtype is None else out.to(dtype)
