"""Routes through the pipeline, CheckFree+ swaps and edge replicas: pure functions.

A route is the ordered list of hops one microbatch takes. Plain pipelines visit stages
0..S-1. Under CheckFree+ every odd microbatch (global index k = step * M + mb, which for
even M is the paper's "odd microbatch index") takes a swapped route:

* S >= 4: stage 1 before stage 0 and stage S-1 before stage S-2
  (E, S1, S0, S2, ..., S_{S-3}, S_{S-1}, S_{S-2}, head);
* S = 3: alternately the first pair (1, 0, 2) and the last pair (0, 2, 1): odd k with
  (k // 2) even swaps the first pair, otherwise the last pair;
* S = 2: the whole route reversed (1, 0).

The backward pass follows the reversed route. The embedding is applied by whichever stage
is first in the route, the final norm + head by whichever is last; under CheckFree+ the
embedding is therefore held by stages 0 and 1 and the head by stages S-2 and S-1.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Hop", "stage_order", "route", "plain_route", "evaluates_after", "edge_holders", "COMPONENTS"]

COMPONENTS = ("embed", "head")


@dataclass(frozen=True)
class Hop:
    """One stage visit: run `stage`, applying the embedding first and/or the head last."""

    stage: int
    embed: bool
    head: bool


def stage_order(num_stages: int, plus: bool, k: int) -> list[int]:
    """Order of stages for the microbatch with global index k."""
    order = list(range(num_stages))
    if not plus or k % 2 == 0:
        return order
    if num_stages == 2:
        return [1, 0]
    if num_stages == 3:
        return [1, 0, 2] if (k // 2) % 2 == 0 else [0, 2, 1]
    order[0], order[1] = 1, 0
    order[-1], order[-2] = num_stages - 2, num_stages - 1
    return order


def route(num_stages: int, plus: bool, step: int, microbatch: int, num_microbatches: int) -> list[Hop]:
    """The hops of microbatch `microbatch` of step `step`."""
    if not 0 <= microbatch < num_microbatches:
        raise ValueError(f"microbatch {microbatch} out of range [0, {num_microbatches})")
    order = stage_order(num_stages, plus, step * num_microbatches + microbatch)
    last = len(order) - 1
    return [Hop(stage=s, embed=i == 0, head=i == last) for i, s in enumerate(order)]


def plain_route(num_stages: int) -> list[Hop]:
    """Stages 0..S-1 in order, the embedding on the first and the head on the last: the route of every
    evaluation microbatch (and of every training microbatch without CheckFree+)."""
    return [Hop(stage=i, embed=i == 0, head=i == num_stages - 1) for i in range(num_stages)]


def evaluates_after(step: int, eval_every: int, num_steps: int) -> bool:
    """Whether a validation evaluation follows step `step`: every `eval_every` steps (0: never) and after the last."""
    return bool(eval_every and (step + 1) % eval_every == 0) or step == num_steps - 1


def edge_holders(num_stages: int, plus: bool) -> dict[str, tuple[int, ...]]:
    """Which stages hold the embedding and the head (the first holder is the primary)."""
    if num_stages < 2:
        raise ValueError(f"num_stages must be >= 2, got {num_stages}")
    last = num_stages - 1
    if not plus:
        return {"embed": (0,), "head": (last,)}
    return {"embed": (0, 1), "head": (last - 1, last)}
