"""A stage's state as bytes: one serialization for snapshots, saves, handovers and REFT's parity blocks.

A blob is ``MAGIC`` followed by one `checkfree.net.wire` message: its header is the state's tree (dicts, lists,
tuples and scalars, every tensor replaced by its index) and its tensors are the state's tensors, each at an
aligned offset. Writing copies each tensor once, straight into its place in one buffer; reading copies nothing
when the blob is writable (the tensors alias it; a read-only blob, e.g. ``bytes``, is copied once), so a state
moves from one stage's weights into another's in one copy each way. Blobs written by ``torch.save`` (saves and
checkpoints from before this format) still load.
"""

from __future__ import annotations

import io
from collections import OrderedDict
from typing import Any

import torch

from checkfree.net.wire import WireError, decode_message, encode_message

__all__ = ["MAGIC", "blob_tensor", "state_from_bytes", "state_to_bytes", "tensor_blob"]

MAGIC = b"CFSTATE1"
_ZIP = b"PK\x03\x04"  # torch.save's format
_SCALARS = (type(None), bool, int, float, str, bytes)

# a node of the tree: a scalar as itself, a container as [tag, items] (tags: t tensor, d dict, o OrderedDict,
# l list, u tuple; a dict's items are [key node, value node] pairs, so keys keep their types)


def _encode(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        tensors.append(obj.detach())
        return ["t", len(tensors) - 1]
    if isinstance(obj, dict):
        tag = "o" if isinstance(obj, OrderedDict) else "d"
        return [tag, [[_encode(k, tensors), _encode(v, tensors)] for k, v in obj.items()]]
    if isinstance(obj, (list, tuple)):
        return ["u" if isinstance(obj, tuple) else "l", [_encode(v, tensors) for v in obj]]
    if isinstance(obj, _SCALARS):
        return obj
    raise ValueError(f"cannot serialise a {type(obj).__name__} in a state (tensors, dict/list/tuple, "
                     f"None/bool/int/float/str/bytes)")


def _decode(node: Any, tensors: list[torch.Tensor]) -> Any:
    if not isinstance(node, list):
        return node
    if len(node) != 2 or node[0] not in ("t", "d", "o", "l", "u"):
        raise ValueError(f"bad node {node!r:.80} in a serialised state")
    tag, items = node
    if tag == "t":
        return tensors[items]
    if tag in ("d", "o"):
        pairs = ((_decode(k, tensors), _decode(v, tensors)) for k, v in items)
        return OrderedDict(pairs) if tag == "o" else dict(pairs)
    values = [_decode(v, tensors) for v in items]
    return tuple(values) if tag == "u" else values


def state_to_bytes(state: dict) -> bytearray:
    """Serialise a state dict (tensors, python scalars/str/bytes/None, nested dict/list/tuple) into one buffer.

    Deterministic for equal inputs; :func:`state_from_bytes` returns an exactly equal state (same dtypes, shapes,
    bit patterns, key types incl. int keys, OrderedDict kept). A view is written without the rest of its storage.
    """
    if not isinstance(state, dict):
        raise ValueError(f"state must be a dict, got {type(state).__name__}")
    tensors: list[torch.Tensor] = []
    tree = _encode(state, tensors)
    try:
        frames = encode_message({"state": tree}, tensors)
    except WireError as e:
        raise ValueError(f"cannot serialise this state: {e}") from e
    out = bytearray(len(MAGIC) + sum(memoryview(f).nbytes for f in frames))
    view, pos = memoryview(out), len(MAGIC)
    view[:pos] = MAGIC
    for frame in frames:  # the one copy: each tensor's bytes into their place
        n = memoryview(frame).nbytes
        view[pos:pos + n] = frame
        pos += n
    return out


def state_from_bytes(blob: Any) -> dict:
    """Inverse of :func:`state_to_bytes` (any bytes-like object). The tensors alias ``blob`` when it is writable
    (no copy): loading them into a worker (`checkfree.strategies.state.restore_worker`) copies them, but whoever
    keeps them must not change ``blob``. Blobs of ``torch.save`` load with ``weights_only=True`` (no code)."""
    try:
        view = memoryview(blob).cast("B")
    except TypeError as e:
        raise ValueError(f"a serialised state is a bytes-like object, not a {type(blob).__name__}") from e
    if view[:len(_ZIP)] == _ZIP:
        return _legacy(view)
    if view[:len(MAGIC)] != MAGIC:
        raise ValueError(f"bytes are not a serialised state (they start with {bytes(view[:8])!r})")
    try:
        header, tensors = decode_message(view[len(MAGIC):], max_message_bytes=view.nbytes)
        state = _decode(header["state"], tensors)
    except (WireError, KeyError, IndexError, TypeError) as e:
        raise ValueError(f"bytes are not a serialised state: {type(e).__name__}: {e}") from e
    if not isinstance(state, dict):
        raise ValueError(f"serialised object is a {type(state).__name__}, not a dict")
    return state


def _legacy(view: memoryview) -> dict:
    """A state written by ``torch.save`` (before this format)."""
    try:
        state = torch.load(io.BytesIO(view), map_location="cpu", weights_only=True)
    except Exception as exc:  # corrupted or foreign bytes
        raise ValueError(f"bytes are not a serialised state: {exc}") from exc
    if not isinstance(state, dict):
        raise ValueError(f"serialised object is a {type(state).__name__}, not a dict")
    return state


def tensor_blob(t: torch.Tensor) -> memoryview:
    """The bytes of a received 1-D uint8 CPU tensor (a serialised state in a message), without a copy."""
    return memoryview(t.numpy())


def blob_tensor(blob: Any) -> torch.Tensor:
    """A serialised state as the 1-D uint8 tensor a message carries: a view of ``blob`` (no copy) when it is
    writable, else a copy."""
    view = memoryview(blob).cast("B")
    if not view.nbytes:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(view) if view.readonly else view, dtype=torch.uint8)

