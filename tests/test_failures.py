from __future__ import annotations

import pytest

from checkfree.config import FailureConfig
from checkfree.failures import (bernoulli_schedule, per_step_probability, read_trace, schedule_from_config,
                                write_trace)


def test_hourly_conversion():
    # p = 1 - (1 - h)^(T/3600)
    assert per_step_probability(0.16, 3600) == pytest.approx(0.16)
    assert per_step_probability(0.10, 91.3) == pytest.approx(1 - 0.9 ** (91.3 / 3600))


def test_bernoulli_is_seeded_and_protects():
    a = bernoulli_schedule(6, 500, 0.05, seed=3, protect=frozenset({0, 5}))
    assert a == bernoulli_schedule(6, 500, 0.05, seed=3, protect=frozenset({0, 5}))
    assert a and all(s not in (0, 5) for _, s in a)
    assert 0.03 < len(a) / (500 * 4) < 0.07
    dense = [t for t, _ in bernoulli_schedule(6, 50, 0.5, seed=1)]
    assert len(dense) > len(set(dense))  # several failures in one step are allowed


def test_trace_round_trip_and_errors(tmp_path):
    path = tmp_path / "t.csv"
    write_trace(path, [(5, 2), (1, 1)])
    assert read_trace(path, 4) == [(1, 1), (5, 2)]
    path.write_text("step,stage\n3,9\n")
    with pytest.raises(ValueError, match=r"t.csv:2"):
        read_trace(path, 4)
    path.write_text("3;1\n")
    with pytest.raises(ValueError, match="two integers"):
        read_trace(path, 4)
    with pytest.raises(ValueError, match="does not exist"):
        read_trace(tmp_path / "missing.csv")


def test_schedule_from_config_defaults_protect_edges_only_for_plain():
    cfg = FailureConfig(rate=0.2, seed=1)
    plain = schedule_from_config(cfg, 4, 200, plus=False).events
    plus = schedule_from_config(cfg, 4, 200, plus=True).events
    assert {s for _, s in plain} == {1, 2}
    assert {0, 3} <= {s for _, s in plus}
