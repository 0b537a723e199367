"""The benchmark harnesses run and report what they claim to (structure, not timings)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from benchmarks.profile import category, parse_raw, thread_kind

pytestmark = pytest.mark.timeout(600)


def test_scaling_quick_reports_every_configuration(tmp_path):
    out = tmp_path / "scaling.json"
    env = {**os.environ, "CHECKFREE_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.scaling", "--quick", "--json", str(out)],
                          capture_output=True, text=True, timeout=540, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "stages sweep" in proc.stdout and "model-size sweep" in proc.stdout
    result = json.loads(out.read_text())
    assert [r["stages"] for r in result["stages_sweep"]] == [2, 3]
    assert [r["d_model"] for r in result["size_sweep"]] == [32, 64]
    for r in result["stages_sweep"] + result["size_sweep"]:
        assert len(r["swarm_peer_peak_mib"]) == r["stages"]  # one peak per peer process
        assert all(m > 50 for m in r["swarm_peer_peak_mib"])  # python + torch are resident: a real reading
        assert r["swarm_tokens_s"] > 0 and r["single_tokens_s"] > 0
        assert r["swarm_cpu_compute_s"] > 0 and r["swarm_cpu_overhead_s"] > 0
        # the peers report exactly the activations and gradients that cross the S-1 boundaries
        assert r["wire_over_analytic"] == pytest.approx(1.0)
        assert r["swarm_p2pd_written_bytes"] >= r["swarm_wire_bytes"]
        for key in ("swarm_over_single", "overhead_over_compute", "peers_peak_mib_sum_over_single",
                    "swarm_cpu_over_single_cpu", "single_cpu_s"):
            assert math.isfinite(r[key]) and r[key] > 0


def test_profile_parses_py_spy_raw_stacks(tmp_path):
    raw = tmp_path / "peer.txt"
    raw.write_text(
        "thread (11): MainThread;run_forever (asyncio/base_events.py:607);decode_body (checkfree/net/wire.py:210) 5\n"
        "thread (12): compute_0;_worker (concurrent/futures/thread.py:83);backward (torch/autograd/__init__.py:395) 7\n"
        "thread (11): MainThread 2\n")
    stacks = parse_raw(raw)
    assert stacks["event loop"]["decode_body (checkfree/net/wire.py:210)"] == 5
    assert stacks["event loop"]["(no Python frame)"] == 2
    assert stacks["compute"]["backward (torch/autograd/__init__.py:395)"] == 7
    assert category("decode_body (checkfree/net/wire.py:210)") == "wire format"
    assert category("backward (torch/autograd/__init__.py:395)") == "torch compute"
    assert thread_kind("asyncio_0") == "other threads"
