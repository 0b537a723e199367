"""A run's simulated clock, priced by the cost model of the code reading it.

How the simulator's clock is made (checkfree/simulator.py): every executed iteration adds
`CostModel.step_s()` (a pure function of the run's config and cost profile: the pipeline term) plus
the stall its strategy reports for that step, and every failure adds the recovery time its strategy
reports (detection plus the transfers it waits for). The metrics carry the running total `sim_time_s`.

So a recorded clock splits into two parts, per evaluation after executed iteration n:

    sim_time_s(n) = (n + 1) * step_s  +  strategy_s(n)

The run records the `step_s` it was priced with (`provenance.json`). `repriced_s` recomputes the
step term with the current `checkfree/costmodel.py` and keeps `strategy_s(n)` as recorded: the
strategies' stalls and recoveries are prices of transfers, checkpoint writes and detection delays that
only the strategy code knows how to combine. Whether those prices still hold is checked, not assumed:
the run also records the cost model's `fingerprint` for its config (detection time, link and storage
times, idle link time, redundant computation's extra); `stale_terms` names every figure the current
model prices differently, and a report marks the run's hours as priced by an older model when it
names any.
"""

from __future__ import annotations

import math
from typing import Any

from checkfree.config import RunConfig, config_from_dict
from checkfree.costmodel import GIB, CostModel

__all__ = ["fingerprint", "stale_terms", "repriced_s", "run_config"]

_DIGITS = 9


def _r(x: float) -> float:
    return float(f"{x:.{_DIGITS}g}")


def run_config(spec_config: dict[str, Any]) -> RunConfig:
    """The RunConfig of a run from its spec's config (the trace path is not needed to price it)."""
    return config_from_dict({**spec_config, "failures": {**spec_config["failures"], "trace": None}})


def fingerprint(cfg: RunConfig) -> dict[str, Any]:
    """The cost model's figures for `cfg` that a run's clock is made of (seconds, 9 significant digits)."""
    cm = CostModel(cfg)
    S = cm.S
    return {
        "profile": cm.profile.name,
        "step_s": _r(cm.step_s()),
        "detection_s": _r(cm.profile.detection_s),
        "storage_s_per_gib": _r(cm.storage_s(GIB)),
        "transfer_s_per_gib": [[_r(cm.transfer_s(GIB, i, j)) for j in range(S)] for i in range(S)],
        "network_idle_s": _r(cm.network_idle_s()),
        "redundant_extra_s": _r(cm.redundant_extra_s()),
        "t_f_s": _r(cm.t_f()),
        "t_b_s": _r(cm.t_b()),
    }


def stale_terms(recorded: dict[str, Any] | None, cfg: RunConfig) -> list[str]:
    """The figures (other than the re-priced step term) the current cost model prices differently from the
    model a run was priced with; ["unrecorded"] when the run recorded none."""
    if not recorded:
        return ["unrecorded"]
    now = fingerprint(cfg)
    return [k for k in now if k != "step_s" and recorded.get(k) != now[k]]


def repriced_s(sim_time_s: float, iteration: int, recorded_step_s: float, step_s: float) -> float:
    """The clock after executed iteration `iteration` (0-based) with the step term priced at `step_s` (the
    current cost model's `CostModel(cfg).step_s()`); NaN when the recorded clock is."""
    if not math.isfinite(sim_time_s):
        return math.nan
    n = iteration + 1
    return n * step_s + (sim_time_s - n * recorded_step_s)
