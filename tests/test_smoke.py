"""The quick tier's one real-process run: the README's main command (`make run`: `checkfree local --preset tiny
--strategy checkfree+`, its demo churn SIGKILLing two stages) as separate OS processes over hivemind, then
`checkfree plot` of its run directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from checkfree.rundir import read_jsonl

pytestmark = [pytest.mark.smoke, pytest.mark.timeout(300)]


def test_the_main_command_recovers_two_sigkilled_stages_and_plots(tmp_path, session_cache):
    out = tmp_path / "run"
    # the session's token cache (tests/conftest.py): the quick tier starts with this test, so its run prepares the
    # tokens on a fresh cache (as the README's command on a fresh machine) unless a test on the other worker got
    # there first, and the tests after it reuse them
    env = {**os.environ, "CHECKFREE_CACHE": session_cache}
    proc = subprocess.run([sys.executable, "-m", "checkfree", "local", "--preset", "tiny", "--strategy", "checkfree+",
                           "--steps", "12", "--no-progress", "--out", str(out)],
                          capture_output=True, text=True, timeout=280, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "swarm: 2 peers SIGKILLed" in proc.stdout, proc.stdout[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["status"], summary["steps"], summary["failures"], summary["recoveries"]) == ("completed", 12, 2, 2)
    recovered = [e["stage"] for e in read_jsonl(out / "events.jsonl") if e["event"] == "recovery"]
    killed = [e["stage"] for e in read_jsonl(out / "events.jsonl") if e["event"] == "chaos_kill"]
    assert recovered == killed and len(killed) == 2

    plot = subprocess.run([sys.executable, "-m", "checkfree", "plot", str(out)], capture_output=True, text=True,
                          timeout=120, env=env)
    assert plot.returncode == 0, plot.stderr
    for name in ("loss.png", "step_time.png", "wire_bytes.png"):
        assert (out / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
