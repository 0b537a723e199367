"""The peer's one hook: the points of its work that an observer outside it may see, as events.

A peer daemon takes an optional hook (`PeerDaemon(opts, hook=None)`; none in production, where no part of the
peer calls one). With a hook, each part hands it one event at each of these points, and goes on:

    StepStarted    a training or evaluation attempt is taken (RUN_STEP), with the passes this peer computes in it
    PassStarting   a forward or backward pass is about to compute (on the compute thread)
    PassComputed   a forward or backward pass has computed, before its result is sent on
    WeightPulled   a stage's weights have been pulled for a rebuild
    BucketReduced  a bucket of a stage group's gradient all-reduce is done (on the compute thread)
    CommitTaken    a COMMIT is taken, before the optimizer step

The hook may act there (a fault injector kills the process or sleeps: checkfree.peer_faults); the events carry
no instruction, and no wire message carries a field for the hook. `started` is called once the peer's transport
is up, before it joins: a hook that is armed from outside opens its channel there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol, Union

from checkfree.net.base import Transport

__all__ = ["PeerHook", "PeerEvent", "StepStarted", "PassStarting", "PassComputed", "WeightPulled", "BucketReduced",
           "CommitTaken"]

PassKind = Literal["forward", "backward"]


@dataclass(frozen=True)
class StepStarted:
    step: int
    attempt: int
    evaluate: bool
    passes: int  # the microbatches this peer computes in the attempt (a forward and a backward pass each)


@dataclass(frozen=True)
class PassStarting:
    kind: PassKind
    step: int
    attempt: int
    mb: int


@dataclass(frozen=True)
class PassComputed:
    kind: PassKind
    step: int
    attempt: int
    mb: int


@dataclass(frozen=True)
class WeightPulled:
    part: str  # blocks | embed | head
    stage: int  # the stage pulled from


@dataclass(frozen=True)
class BucketReduced:
    step: int
    attempt: int
    bucket: int  # 0-based
    buckets: int


@dataclass(frozen=True)
class CommitTaken:
    step: int
    attempt: int


PeerEvent = Union[StepStarted, PassStarting, PassComputed, WeightPulled, BucketReduced, CommitTaken]


class PeerHook(Protocol):
    """What a peer calls, when it was given one."""

    async def started(self, transport: Transport) -> None:
        """The peer's transport is up (its peer id known); the peer has not joined yet."""
        ...

    def __call__(self, event: PeerEvent) -> None:
        """One event (see the module docstring); called from the event loop or the compute thread."""
        ...
