"""The benchmark harnesses run and report what they claim to (structure, not timings)."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest

from benchmarks.profile import category, parse_raw, thread_kind

pytestmark = pytest.mark.timeout(600)


def test_scaling_quick_reports_every_configuration(tmp_path, session_cache):
    out = tmp_path / "scaling.json"
    env = {**os.environ, "CHECKFREE_CACHE": session_cache}
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


def test_collectives_quick_reports_the_table_and_the_gloo_checks():
    proc = subprocess.run([sys.executable, "-m", "benchmarks.collectives", "--quick"],
                          check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "| library | N | size (elements) | median ms | group formation ms |" in out
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in out.splitlines()
            if line.startswith("| ") and "library" not in line]
    measured = {(" ".join(r[0].split()[:2]), int(r[1])) for r in rows}
    for world in (2, 3):  # gloo, the averager and the runner, each for N = 2 and 3
        assert {("gloo allreduce", world), ("hivemind DecentralizedAverager.step,", world),
                ("hivemind AllReduceRunner,", world)} <= measured
    assert all(r[2] == "295,296" and float(r[3]) > 0 for r in rows)  # the small preset's middle stage
    assert all(float(r[4]) > 0 for r in rows if r[0].startswith("gloo"))  # group formation is measured
    assert "gloo bit-identity: N=2 identical, N=3 identical" in out
    for world in (2, 3):  # the survivors of a SIGKILLed member raise, within the group's timeout
        assert re.search(rf"gloo kill check N={world}: .* the survivors raised after [\d, ]+ ms \(within the 5 s "
                         r"timeout\): RuntimeError", out), out
    assert "left behind: 0 processes, 0 socket files" in out
    assert re.fullmatch(r"collectives: gloo/hivemind ratio \d+\.\d\d", out.strip().splitlines()[-1])


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


def test_vs_torch_pipelining_quick_compares_every_path_and_leaves_nothing(tmp_path, session_cache):
    """Both sides train the same stages on the same batches (losses agree step by step), every path has a row,
    nothing is left running, and the last line is the ratio (its value is not checked: a speed). Three stages (a
    first, a middle and a last: every kind of rank and peer), the fewest steps the benchmark takes (2 warm-up + 3),
    both torch schedules in one set of rank processes."""
    out = tmp_path / "vs.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.vs_torch_pipelining", "--quick", "--preset", "tiny",
                           "--rounds", "1", "--stages", "3", "--steps", "5", "--one-torch-launch", "--no-hivemind",
                           "--json", str(out)], capture_output=True, text=True, timeout=540,
                          env={**os.environ, "CHECKFREE_CACHE": session_cache})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert re.fullmatch(r"swarm/torch-pipelining: \d+\.\d{3}", lines[-1]), lines[-1]
    assert "torch threads per process: intra-op 1" in proc.stdout
    rows = {r[0].strip(): r for r in (line.strip("|").split("|") for line in lines if line.startswith("| ")
                                      and not line.startswith("| path") and not line.startswith("|---"))}
    assert set(rows) == {"torch gpipe", "torch 1f1b", "swarm tcp gpipe", "swarm tcp 1f1b"}
    for name, r in rows.items():
        assert float(r[1]) > 0 and float(r[3]) > 0  # s/step, CPU-s/step
        assert float(r[5]) < 1e-4, (name, r[5])  # the same training: losses agree to float round-off
    assert "losses: every path trained 5 steps: yes" in proc.stdout
    assert re.search(r"left behind: 0 processes, 0 socket files \(of \d+ started\)", proc.stdout), proc.stdout
    result = json.loads(out.read_text())
    assert len(result["rounds"]) == 1 and len(result["rounds"][0]["torch gpipe"]["losses"]) == 5


def test_idle_reports_the_standby_and_every_process_kind(session_cache):
    """The standby is found (a peer that computes nothing), every kind of process has a row, the swarm is stopped
    and nothing is left behind; the last line is the standby's share (its value is not checked: a speed). Two
    stages: every kind of process, fewer of each to start."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.idle", "--preset", "tiny", "--stages", "2",
                           "--seconds", "3", "--warmup-steps", "2"], capture_output=True, text=True, timeout=540,
                          env={**os.environ, "CHECKFREE_CACHE": session_cache})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r[0].strip(): r for r in (line.strip("|").split("|") for line in proc.stdout.splitlines()
                                      if line.startswith("| ") and not line.startswith("| process"))}
    for name, count in (("standby peer (python: event loop, compute thread idle)", 1), ("standby's DHT process", 1),
                        ("standby's p2pd", 1), ("stage peers (python: event loop + compute)", 2),
                        ("stage peers' DHT processes", 2), ("stage peers' p2pd", 2), ("coordinator", 1)):
        assert int(rows[name][1]) == count, (name, rows.get(name))
    assert float(rows["stage peers (python: event loop + compute)"][2]) > 0
    assert re.search(r"left behind: 0 processes, 0 socket files \(of \d+ started\)", proc.stdout), proc.stdout
    assert re.fullmatch(r"idle standby: \d+\.\d\d% of a core", proc.stdout.strip().splitlines()[-1])


def test_copies_quick_reports_before_and_after_for_every_operation():
    """benchmarks.copies runs both paths side by side; the allocation counts (not timings) show the receive path
    keeping one buffer per message and the snapshot path fewer copies than before."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.copies", "--quick"], check=False, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r[0]: r for r in ([c.strip() for c in line.strip("|").split("|")] for line in proc.stdout.splitlines()
                              if line.startswith("| ") and "operation" not in line)}
    for op in ("receive one message", "check_finite (one activation)", "snapshot: capture + serialise",
               "snapshot: send + receive", "snapshot: load", "snapshot: all three"):
        assert op in rows, proc.stdout
    after_receive = [r for k, r in rows.items() if k == "receive one message"][0][3]
    assert after_receive.endswith("(1.00x)"), rows  # the body is the only buffer a received message takes
    last = proc.stdout.strip().splitlines()[-1]
    m = re.fullmatch(r"copies before/after: receive (\S+), check_finite (\S+), snapshot (\S+)", last)
    assert m and float(m[1]) > 2 and float(m[3]) > 2, last


def test_control_plane_quick_prints_the_table_and_the_growth_exponent(tmp_path):
    """benchmarks.control_plane --quick: two in-process swarms (N = 8, 16), their table, the plot, and the growth
    exponent as the last line (its value is not checked: it is a measurement)."""
    result, png = tmp_path / "cp.json", tmp_path / "cp.png"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.control_plane", "--quick", "--json", str(result),
                           "--plot", str(png)], check=False, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert re.fullmatch(r"coordinator cpu growth exponent: -?\d+\.\d\d", lines[-1]), lines[-1]
    rows = [line for line in lines if re.match(r"\| \d+ \| 4 x \d \|", line)]
    assert [int(r.split("|")[1]) for r in rows] == [8, 16], proc.stdout[-3000:]
    data = json.loads(result.read_text())
    for r in data["inprocess"]:  # every step's RUN_STEP and COMMIT went out and came back, and were counted
        assert r["messages_sent"] >= 2 * r["peers"] and r["bytes_sent"] > 0 and r["coordinator_cpu_s"] > 0
        assert r["by_rpc"]["calls cf.run_step"] == r["by_rpc"]["calls cf.commit"] == r["live_peers"]
    assert png.stat().st_size > 0


def test_the_control_plane_page_carries_what_the_result_files_render():
    """docs/control-plane.md's tables are the benchmarks' own rendering of benchmarks/results/*.json (rewrite them
    with `python -m benchmarks.docs_tables`), never typed by hand."""
    from benchmarks.docs_tables import BLOCKS, PAGE, blocks, rendered

    held = blocks(PAGE.read_text())
    for marker, module, result in BLOCKS:
        assert held.get(marker) == rendered(module, result), f"{marker}: run python -m benchmarks.docs_tables"


def test_messages_reports_every_way_for_every_message(capsys):
    """benchmarks.messages: each message, each way (dict, msgspec, pydantic, the two codecs) and its ratio to the
    dict path, measured side by side (timings are printed, never asserted)."""
    from benchmarks.messages import main

    main(["--rounds", "1", "--n", "20"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("load average") and lines[1].split()[1:3] == ["dict", "msgspec"]
    rows = {line.split()[0]: line for line in lines[2:]}
    assert set(rows) == {"forward", "run_step", "assign_recover"}
    assert all(len(re.findall(r"\d+\.\d\d \(\s*\d+\.\dx\)", r)) == 5 for r in rows.values()), rows
