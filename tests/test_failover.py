"""Coordinator failover: the coordinator is SIGKILLed (with its DHT process and p2p daemon)
and a hot standby, or a coordinator restarted with --takeover, rebuilds the run's state from
the DHT and the peers and continues from the current step. Nothing is lost: the losses equal
the simulator's, step for step, also when the coordinator dies half-way through a commit."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from checkfree.rundir import read_jsonl
from swarm.netlab import NetLab
from swarmrun import events, local as _local, simulate, trace as _trace

pytestmark = pytest.mark.timeout(400)
FAST = ["--heartbeat-ttl", "2", "--rpc-timeout", "10", "--step-timeout", "60", "--join-timeout", "120"]


@pytest.fixture(scope="module")
def cache(session_cache):
    return session_cache


def _simulated(tmp_path, cache, *args):
    return simulate(tmp_path, "sim", *args, cache=cache)


def _check_lossless(out, sim, steps):
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(steps))  # every step recorded exactly once
    for x, y in zip(metrics, sim):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5, abs=1e-5), x["step"]
    (takeover,) = events(out, "coordinator_takeover")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and math.isfinite(summary["final_loss"])
    assert (out / "final_weights.safetensors").exists()
    start = read_jsonl(out / "events.jsonl")[0]  # wall_s spans the whole run, not the new coordinator's part
    assert start["event"] == "run_start" and summary["wall_s"] >= metrics[-1]["time"] - start["time"]
    return metrics, takeover, summary


def test_standby_coordinator_takes_over_after_sigkill(tmp_path, cache):
    args = ["--steps", "10", "--seed", "3", "--strategy", "checkfree+"]
    proc, out = _local(tmp_path, "standby", *args, *FAST, "--kill-coordinator-at", "4", cache=cache)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "coordinator SIGKILLed; standby coordinator takes over" in proc.stdout
    _, takeover, summary = _check_lossless(out, _simulated(tmp_path, cache, *args), 10)
    assert takeover["step"] >= 4 and takeover["stages"] == 4 and takeover["missing_stages"] == []
    assert summary["failures"] == 0


# slow (CI time): dst's in-process schedules kill the coordinator mid-commit and check that the new one commits the
# rest, records the step from the peers and recovers like the simulator (tests/test_dst.py: a new coordinator sees a
# commit under way, a takeover records the step committed as a stage died mid-commit), and the standby test above
# takes over a real swarm after a SIGKILL
@pytest.mark.slow
def test_restarted_coordinator_completes_a_half_done_commit_then_recovers(tmp_path, cache):
    """The coordinator dies after committing stages 0-1 of step 4: the new one commits stages
    2-3 (no stage is a step behind), records step 4 from the peers, and then handles a SIGKILL
    of stage 2 at step 7 as usual."""
    args = ["--steps", "10", "--seed", "3", "--trace", _trace(tmp_path, [(7, 2)])]
    proc, out = _local(tmp_path, "restart", *args, *FAST, "--kill-coordinator-at", "4", "--kill-coordinator-in",
                       "commit", "--coordinator-failover", "restart", cache=cache)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics, takeover, summary = _check_lossless(out, _simulated(tmp_path, cache, *args), 10)
    assert takeover["step"] == 5 and takeover["committed_stages"] == [2, 3] and takeover["recorded_step"]
    assert metrics[4]["recorded_by"] == "takeover"
    assert all(1 <= n <= 4 for n in metrics[4]["inflight_peak"])  # the peers' own figures of the step
    assert summary["failures"] == 1 and summary["recoveries"] == 1
    (rec,) = events(out, "recovery")
    assert rec["step"] == 7 and rec["sources"] == [1, 3]


@pytest.mark.skipif(NetLab.unavailable() is not None, reason=f"no network namespaces: {NetLab.unavailable()}")
def test_a_standby_with_no_shared_directory_takes_over_a_run_whose_every_stage_died(tmp_path, cache):
    """The standby runs in a network namespace of its own with a run directory of its own, and is given no file of
    the run (not its config): what it needs reaches it over FOLLOW. At step 2 both stages' peers are SIGKILLed, then
    the coordinator, before it sees them die: no peer that served a stage is left, and the spares know no step. The
    standby takes over from its copy (the config, the record of steps 0-1, the members, where the checkpoints are),
    every stage is restored from the checkpoint of step 2, and the run completes in the standby's directory with
    the simulator's losses and counts."""
    args = ["--stages", "2", "--steps", "4", "--strategy", "checkpoint", "--checkpoint-every", "1",
            "--trace", _trace(tmp_path, [(2, 0), (2, 1)])]
    standby = tmp_path / "standby"
    proc, out = _local(tmp_path, "swarm", *args, *FAST, "--netns", "--kill-coordinator-at", "2",
                       "--kill-coordinator-in", "faults", "--standby-out", str(standby), cache=cache)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    _, takeover, summary = _check_lossless(standby, _simulated(tmp_path, cache, *args), 4)
    assert (takeover["step"], takeover["stages"], takeover["missing_stages"]) == (2, 0, [0, 1])
    sim = json.loads((tmp_path / "sim" / "summary.json").read_text())
    assert [summary[k] for k in ("failures", "recoveries", "lost_steps")] == \
        [sim[k] for k in ("failures", "recoveries", "lost_steps")] == [2, 2, 0]
    assert [(e["stage"], e["source"]) for e in events(standby, "recovery")] == [(0, "storage"), (1, "storage")]
    # the old coordinator's directory has its own part only, the standby's the whole run
    assert [m["step"] for m in read_jsonl(out / "metrics.jsonl")] == [0, 1] and not events(out, "coordinator_takeover")
    assert not list(standby.glob(".standby-*")) and not list(out.glob(".standby-*"))


def test_takeover_needs_an_address():
    proc = subprocess.run([sys.executable, "-m", "checkfree", "scheduler", "--takeover"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "--initial-peers" in proc.stderr


def test_new_peers_bootstrap_from_the_running_coordinator_and_live_peers(tmp_path):
    """Found by the one-hour real-process soak: after the failover the launcher gave every new peer one live
    peer's address; that peer was killed next, and every peer started after it failed ("could not reach any
    initial peer"): no replacement ever joined, and the run failed after join_timeout. New peers now get the
    running coordinator's address (the standby's, once it took over) and the two newest live peers'."""
    import shutil

    from swarm.launcher import LocalSwarm, SwarmOptions
    from swarm.processes import Proc

    def sleeper() -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)

    swarm = LocalSwarm(tmp_path / "config.json", tmp_path / "chaos.json", SwarmOptions(out=tmp_path / "out", run_id="r"))
    procs = [sleeper() for _ in range(5)]
    dead = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    dead.wait()
    try:
        swarm.coordinator, swarm.addr = Proc(procs[0]), "/coordinator"
        swarm.standby, swarm.standby_addr = Proc(procs[1]), "/standby"
        swarm.peers = [Proc(procs[2], addrs="/a"), Proc(dead, addrs="/dead"), Proc(procs[3], addrs="/b"),
                       Proc(procs[4], addrs="/c")]
        assert swarm._bootstrap() == ["/coordinator", "/c", "/b"]
        swarm.kill_coordinator()  # the standby takes over
        assert procs[0].poll() is not None and swarm._bootstrap() == ["/standby", "/c", "/b"]
        swarm.coordinator = Proc(dead)  # gone too: live peers only
        assert swarm._bootstrap() == ["/c", "/b"]
    finally:
        for p in procs:
            p.kill()
            p.wait()
        shutil.rmtree(swarm.tmp, ignore_errors=True)
