from __future__ import annotations

import pytest

from checkfree.pipeline import Hop, edge_holders, route, stage_order


@pytest.mark.parametrize("S", [4, 6, 8])
def test_swap_order_documented(S):
    plain = list(range(S))
    assert stage_order(S, True, 0) == plain
    swapped = stage_order(S, True, 1)
    assert swapped == [1, 0, *range(2, S - 2), S - 1, S - 2]
    assert stage_order(S, False, 1) == plain


def test_small_pipelines_defined():
    assert stage_order(2, True, 1) == [1, 0]
    assert stage_order(3, True, 1) == [1, 0, 2]
    assert stage_order(3, True, 3) == [0, 2, 1]
    assert stage_order(3, True, 5) == [1, 0, 2]


def test_route_flags_first_and_last_hop():
    hops = route(4, True, step=0, microbatch=1, num_microbatches=4)
    assert [h.stage for h in hops] == [1, 0, 3, 2]
    assert hops[0].embed and not any(h.embed for h in hops[1:])
    assert hops[-1].head and not any(h.head for h in hops[:-1])
    assert [h.stage for h in route(4, True, 0, 2, 4)] == [0, 1, 2, 3]


def test_edge_holders():
    assert edge_holders(4, False) == {"embed": (0,), "head": (3,)}
    assert edge_holders(6, True) == {"embed": (0, 1), "head": (4, 5)}
    assert edge_holders(2, True) == {"embed": (0, 1), "head": (0, 1)}
    assert edge_holders(3, True) == {"embed": (0, 1), "head": (1, 2)}


def test_every_swapped_route_starts_and_ends_at_a_holder():
    for S in range(2, 9):
        holders = edge_holders(S, True)
        for k in range(8):
            order = stage_order(S, True, k)
            assert sorted(order) == list(range(S))
            assert order[0] in holders["embed"] and order[-1] in holders["head"]


def test_plain_route_and_the_evaluation_rule_shared_by_simulator_and_swarm():
    from checkfree.pipeline import evaluates_after, plain_route

    assert plain_route(3) == route(3, False, 7, 1, 4) == [Hop(0, True, False), Hop(1, False, False), Hop(2, False, True)]
    assert plain_route(1) == [Hop(0, True, True)]
    # every eval_every steps and after the last one; eval_every 0: only after the last
    assert [s for s in range(10) if evaluates_after(s, 4, 10)] == [3, 7, 9]
    assert [s for s in range(10) if evaluates_after(s, 0, 10)] == [9]
