"""The golden check of recovery: the simulator and the swarm (in-process tier, harness/inprocess.py) emit the same
recovery events on a fixed trace of every strategy, stage groups included.

Each event is compared on what a recovery decides: the event (a recovery or a fallback), the failed step and
stage, the method, where the stage's state came from (`sources` for a rebuild from neighbours, `source` for a copy:
a stage index, "storage", "init", "parity"), the coefficients of an average, the step restored (`rollback_to`,
`snapshot_step`), the steps lost and the fallback. Per-runtime fields (peer ids, timings, bytes) are not compared.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from checkfree.failures import FailureSchedule, write_trace
from checkfree.rundir import read_jsonl
from checkfree.simulator import Simulator
from harness.inprocess import run_swarm

pytestmark = pytest.mark.timeout(240)

DECIDED = ("event", "step", "stage", "method", "sources", "source", "rollback_to", "snapshot_step", "lost_steps",
           "fallback", "edge_sources", "edges_reinit")

# strategy -> (trace: (step, stage, whole group?), config changes); every kill lands on a stage that has a peer
CASES: dict[str, tuple[list[tuple[int, int, bool]], dict]] = {
    "checkfree": ([(2, 1, True), (4, 1, True), (4, 2, True)], {"fallback": "copy"}),  # adjacent: the copy fallback
    "checkfree+": ([(2, 0, True), (3, 3, True), (4, 1, True)], {}),
    "uniform": ([(2, 2, True)], {}),
    "copy": ([(2, 1, True)], {}),
    "random": ([(2, 2, True), (3, 0, True)], {}),
    "identity": ([(2, 1, True), (2, 2, True)], {}),  # adjacent losses: identity reads no neighbour
    "checkpoint": ([(3, 1, True), (5, 2, True)], {"checkpoint_every": 2}),
    "redundant": ([(2, 1, True), (4, 2, True), (4, 3, True)], {"fallback": "copy"}),  # 3's holder 2 lost too
    "gemini": ([(3, 1, True), (5, 2, True)], {"snapshot_every": 2}),
    "reft": ([(3, 1, True), (4, 2, True)], {"snapshot_every": 2}),
    "baft": ([(3, 1, True), (5, 3, True)], {}),
    "checkfree+snap": ([(3, 1, True), (4, 2, True), (5, 1, True)], {"snapshot_every": 2}),
    # every holder of stage 0's snapshot lost (gemini's pairs {0, 1}, {2, 3}): the storage fallback
    "gemini/storage": ([(3, 1, True), (5, 0, True), (5, 1, True)], {"snapshot_every": 2, "checkpoint_every": 2,
                                                                    "storage_fallback": True}),
    "reft/storage": ([(3, 0, True), (3, 1, True)], {"snapshot_every": 2, "checkpoint_every": 2,
                                                     "storage_fallback": True, "reft_group": 2}),
    # ...or the declared fallback once the others rolled back (the swarm refused it before the plans)
    "gemini/copy": ([(3, 0, True), (3, 1, True)], {"snapshot_every": 2, "fallback": "copy"}),
    "redundant/storage": ([(3, 1, True), (3, 2, True)], {"checkpoint_every": 2, "storage_fallback": True}),
    # stage groups (two replicas per stage): a replica lost (no recovery), then a whole group (CheckFree)
    "groups": ([(2, 1, False), (3, 2, True)], {"replicas": 2}),
}


def _cfg(tiny_cfg, name: str, changes: dict):
    cfg = copy.deepcopy(tiny_cfg)
    cfg.recovery.strategy = "checkfree" if name == "groups" else name.split("/")[0]
    cfg.recovery.fallback = changes.get("fallback", cfg.recovery.fallback)
    cfg.train.num_steps, cfg.train.eval_every = 6, 0
    cfg.train.replicas = changes.get("replicas", 1)
    for key in ("checkpoint_every", "snapshot_every", "storage_fallback", "reft_group"):
        if key in changes:
            setattr(cfg.strategy, key, changes[key])
    return cfg


def decided(out: Path) -> list[dict]:
    """What each recovery and fallback event of a run directory decided (the fields both runtimes share)."""
    events = [e for e in read_jsonl(out / "events.jsonl") if e["event"] in ("recovery", "fallback")]
    return [{k: (round(v, 5) if isinstance(v, float) else v) for k, v in e.items() if k in DECIDED} | (
        {"coefficients": [round(c, 5) for c in e["coefficients"]]} if e.get("coefficients") else {})
        for e in events]


# ReFT runs its companion processes for real (peers/companion.py: start_companion): the real-process tier
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.processes) if n.startswith("reft") else n
                                  for n in CASES])
def test_the_simulator_and_the_swarm_decide_every_recovery_alike(tiny_cfg, tmp_path, name):
    trace, changes = CASES[name]
    cfg = _cfg(tiny_cfg, name, changes)
    events = [(t, s) for t, s, _ in trace]
    whole = {(t, s) for t, s, w in trace if w}
    replicas = cfg.train.replicas
    swarm = run_swarm(cfg, tmp_path / "swarm", peers=replicas * cfg.num_stages + len(trace) + 1,
                      kills=FailureSchedule(events, whole if replicas > 1 else set()), save_final=False)
    sim_cfg = copy.deepcopy(cfg)
    write_trace(tmp_path / "trace.csv", events, whole)
    sim_cfg.failures.trace = str(tmp_path / "trace.csv")
    Simulator(sim_cfg, tmp_path / "sim", progress=False).run()
    assert swarm.summary["status"] == "completed"
    got, want = decided(tmp_path / "swarm"), decided(tmp_path / "sim")
    assert len(got) >= len([s for _, s, w in trace if w or replicas == 1])
    assert got == want
