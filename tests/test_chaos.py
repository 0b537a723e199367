"""A shorter version of the chaos run (`checkfree chaos`): real processes, real SIGKILLs,
edge stages, adjacent pairs and a replacement killed during its recovery. Four stages (two edge
stages, two intermediate ones: every kind of failure the trace draws), not the default six."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.timeout(600)
def test_short_chaos_run_accounts_for_every_failure(tmp_path):
    out = tmp_path / "chaos"
    proc = subprocess.run([sys.executable, "-m", "checkfree", "chaos", "--stages", "4", "--layers", "8", "--steps",
                           "24", "--kills", "6", "--recovery-kills", "1", "--out", str(out)], capture_output=True,
                          text=True, timeout=560)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "chaos: PASS" in proc.stdout
    summary = json.loads((out / "chaos_summary.json").read_text())
    assert summary["failures"] >= 6 and summary["unaccounted"] == [] and summary["finite_losses"]
    assert summary["edge_failures"] >= 1 and summary["fallbacks"] >= 1  # an adjacent pair went to the fallback
    assert summary["recovery_retries"] >= 1  # the replacement killed during its recovery was replaced
