"""REFT RAIM5: XOR parity over raw bytes, its rotating layout across pipeline stages,
survival probabilities, and bit-exact state (de)serialisation.

Contracts
---------
* :func:`encode_parity` / :func:`decode_missing`: plain RAID-5 parity over members of any
  (possibly unequal) lengths; any single erased member is rebuilt bit-exactly.
* :func:`raim5_encode` / :func:`raim5_recover`: one stage per peer, a group of ``n >= 2``
  peers. Peer ``i``'s state ``x_i`` is cut into ``n-1`` chunks (zero padded to a common
  chunk size) and peer ``p`` stores ``P_p = XOR_{i != p} x_i[(p-i-1) mod n]``. Every chunk of
  peer ``i`` lands on a different other peer, so a lost peer's state is rebuilt from the
  survivors' states and parity blocks. Each peer sends ~L bytes and stores ~L/(n-1).
* Survival: groups ``C(N/n, k) n^k / C(N, k)`` and REFT Eq. 2, each with a brute force.
* :func:`state_to_bytes` / :func:`state_from_bytes`: exact round trip via ``torch.save``
  (tensors, python scalars, nested dicts with int keys as in Adam state dicts).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from checkfree.serialize import state_from_bytes, state_to_bytes  # re-exported (REFT's blocks)

__all__ = [
    "BytesLike",
    "ParityBlock",
    "Raim5Block",
    "xor_bytes",
    "encode_parity",
    "decode_missing",
    "raim5_encode",
    "raim5_chunk",
    "raim5_block",
    "raim5_recover",
    "reft_survival_groups",
    "reft_survival_groups_bruteforce",
    "reft_survival_eq2",
    "reft_survival_eq2_bruteforce",
    "state_to_bytes",
    "state_from_bytes",
]

BytesLike = bytes | bytearray | memoryview  # a state or parity block: received in place, or built


def xor_bytes(members: Sequence[BytesLike]) -> np.ndarray:
    """XOR of byte strings, each zero padded to the longest; returns a uint8 array."""
    size = max((len(m) for m in members), default=0)
    acc: np.ndarray = np.zeros(size, dtype=np.uint8)
    for m in members:
        if not isinstance(m, (bytes, bytearray, memoryview)):
            raise ValueError(f"members must be bytes-like, got {type(m).__name__}")
        view = np.frombuffer(m, dtype=np.uint8)
        np.bitwise_xor(acc[: view.size], view, out=acc[: view.size])
    return acc


@dataclass(frozen=True)
class ParityBlock:
    """XOR parity of a list of members, with each member's length (for exact unpadding)."""

    parity: bytes
    lengths: tuple[int, ...]


def encode_parity(members: Sequence[bytes]) -> ParityBlock:
    """Parity of ``members`` (at least one); lengths may differ (zero padding is implied)."""
    if len(members) == 0:
        raise ValueError("encode_parity needs at least one member")
    return ParityBlock(xor_bytes(members).tobytes(), tuple(len(m) for m in members))


def decode_missing(block: ParityBlock, members: Sequence[bytes | None]) -> bytes:
    """Rebuild the single member given as ``None`` from the others and ``block``, bit-exactly."""
    if len(members) != len(block.lengths):
        raise ValueError(f"expected {len(block.lengths)} members, got {len(members)}")
    missing = [i for i, m in enumerate(members) if m is None]
    if len(missing) != 1:
        raise ValueError(f"exactly one member must be None (erased), got {len(missing)}")
    for i, m in enumerate(members):
        if m is not None and len(m) != block.lengths[i]:
            raise ValueError(f"member {i} has {len(m)} bytes, parity recorded {block.lengths[i]}")
    survivors = [m for m in members if m is not None]
    rebuilt = xor_bytes([block.parity, *survivors])
    return rebuilt[: block.lengths[missing[0]]].tobytes()


@dataclass(frozen=True)
class Raim5Block:
    """Parity held by peer ``holder`` of a RAIM5 group of ``n`` peers.

    ``state_lengths[i]`` is the byte length of peer ``i``'s state at encode time; it fixes the
    chunking of every peer, so any surviving block suffices to unpad a rebuilt state.
    """

    holder: int
    n: int
    parity: BytesLike
    state_lengths: tuple[int, ...]


def _chunk(state: BytesLike, n: int, c: int) -> bytes:
    """Chunk ``c`` of ``n-1`` equal (ceil) chunks of ``state``; the last ones may be short/empty."""
    size = -(-len(state) // (n - 1))
    return bytes(state[c * size : (c + 1) * size])


def _chunk_index(p: int, i: int, n: int) -> int:
    """Which chunk of peer ``i`` goes into peer ``p``'s parity (``i != p``)."""
    return (p - i - 1) % n


def raim5_chunk(state: BytesLike, owner: int, holder: int, n: int) -> bytes:
    """The chunk of peer ``owner``'s state that goes into peer ``holder``'s parity (a distributed encode: each
    peer sends one chunk to every other member, which XORs what it receives with `raim5_block`)."""
    if owner == holder or not (0 <= owner < n and 0 <= holder < n):
        raise ValueError(f"owner {owner} and holder {holder} must be different peers of a group of {n}")
    return _chunk(state, n, _chunk_index(holder, owner, n))


def raim5_block(holder: int, chunks: Sequence[bytes], lengths: Sequence[int]) -> Raim5Block:
    """Peer ``holder``'s parity block from the ``n-1`` chunks the other members sent it (`raim5_chunk`)."""
    n = len(lengths)
    if len(chunks) != n - 1:
        raise ValueError(f"a parity block of a group of {n} XORs {n - 1} chunks, got {len(chunks)}")
    return Raim5Block(holder, n, xor_bytes(list(chunks)).tobytes(), tuple(lengths))


def raim5_encode(states: Sequence[bytes]) -> list[Raim5Block]:
    """Per-peer parity blocks for a group of ``n = len(states) >= 2`` peers (one stage each)."""
    n = len(states)
    if n < 2:
        raise ValueError(f"RAIM5 needs a group of at least 2 peers, got {n}")
    lengths = tuple(len(s) for s in states)
    return [raim5_block(p, [raim5_chunk(states[i], i, p, n) for i in range(n) if i != p], lengths) for p in range(n)]


def _as_peer_map(items: Mapping[int, Any] | Sequence[Any], lost: int, n: int, what: str) -> dict[int, Any]:
    """Normalise survivors given as {peer: item} or as a length-n list (entry ``lost`` ignored)."""
    if isinstance(items, Mapping):
        got = {int(p): v for p, v in items.items() if p != lost}
    else:
        if len(items) != n:
            raise ValueError(f"{what}: a list must have one entry per peer ({n}), got {len(items)}")
        got = {p: v for p, v in enumerate(items) if p != lost}
    missing = sorted(set(range(n)) - {lost} - set(got))
    if missing or any(v is None for v in got.values()):
        raise ValueError(f"{what}: every survivor is required, missing peers {missing or 'given as None'}")
    return got


def raim5_recover(
    lost: int,
    states_of_survivors: Mapping[int, BytesLike] | Sequence[BytesLike | None],
    parity_blocks_of_survivors: Mapping[int, Raim5Block] | Sequence[Raim5Block | None],
) -> bytes:
    """Rebuild peer ``lost``'s state bit-exactly from all other peers' states and parity blocks."""
    given = (parity_blocks_of_survivors.values() if isinstance(parity_blocks_of_survivors, Mapping)
             else parity_blocks_of_survivors)
    first = next((b for b in given if b is not None), None)
    if not isinstance(first, Raim5Block):
        raise ValueError("at least one surviving Raim5Block is required")
    n = first.n
    if not 0 <= lost < n:
        raise ValueError(f"lost peer must be in [0, {n}), got {lost}")
    states = _as_peer_map(states_of_survivors, lost, n, "states_of_survivors")
    blocks = _as_peer_map(parity_blocks_of_survivors, lost, n, "parity_blocks_of_survivors")
    for p, b in blocks.items():
        if b.holder != p or b.n != n or b.state_lengths != first.state_lengths:
            raise ValueError(f"parity block of peer {p} is inconsistent with the group")
        if len(states[p]) != b.state_lengths[p]:
            raise ValueError(f"state of peer {p} has {len(states[p])} bytes, parity recorded {b.state_lengths[p]}")
    size = -(-first.state_lengths[lost] // (n - 1))
    out = []
    for c in range(n - 1):
        p = (lost + c + 1) % n  # the survivor whose parity holds chunk c of the lost peer
        others = [_chunk(states[i], n, _chunk_index(p, i, n)) for i in range(n) if i not in (p, lost)]
        out.append(xor_bytes([blocks[p].parity, *others])[:size].tobytes())
    return b"".join(out)[: first.state_lengths[lost]]


def _check_nk(N: int, n: int, k: int) -> None:
    if n < 1 or N < 1 or N % n:
        raise ValueError(f"need group size n >= 1 dividing N >= 1, got N={N}, n={n}")
    if not 0 <= k <= N:
        raise ValueError(f"failure count k must be in [0, N={N}], got {k}")


def reft_survival_groups(N: int, n: int, k: int) -> float:
    """P(no group of n loses two peers) for k uniform losses among N: C(N/n, k) n^k / C(N, k)."""
    _check_nk(N, n, k)
    return math.comb(N // n, k) * n**k / math.comb(N, k)


def reft_survival_groups_bruteforce(N: int, n: int, k: int) -> float:
    """Same as :func:`reft_survival_groups` by enumerating all C(N, k) failure sets (groups = i // n)."""
    _check_nk(N, n, k)
    good = total = 0
    for failed in itertools.combinations(range(N), k):
        total += 1
        groups = [i // n for i in failed]
        good += len(set(groups)) == len(groups)
    return good / total


def _check_eq2(p_s: float, n: int, k: int) -> None:
    if not 0.0 <= p_s <= 1.0:
        raise ValueError(f"p_s must be a probability in [0, 1], got {p_s}")
    if n < 1 or k < 0:
        raise ValueError(f"need n >= 1 and k >= 0, got n={n}, k={k}")


def reft_survival_eq2(p_s: float, n: int, k: int) -> float:
    """REFT Eq. 2 (SMP term = 1): (p_s^n + n (1-p_s) p_s^(n-1))^(k/n), nodes failing independently."""
    _check_eq2(p_s, n, k)
    return (p_s**n + n * (1.0 - p_s) * p_s ** (n - 1)) ** (k / n)


def reft_survival_eq2_bruteforce(p_s: float, n: int, k: int) -> float:
    """Enumerates all 2^k up/down outcomes of k nodes in groups of n; needs n | k, small k."""
    _check_eq2(p_s, n, k)
    if k % n or k > 20:
        raise ValueError(f"brute force needs n | k and k <= 20, got n={n}, k={k}")
    total = 0.0
    for down in itertools.product((False, True), repeat=k):
        if all(sum(down[g : g + n]) <= 1 for g in range(0, k, n)):
            total += math.prod((1.0 - p_s) if d else p_s for d in down)
    return total
