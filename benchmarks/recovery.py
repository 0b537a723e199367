"""Recovery latency in the local swarm: SIGKILL of a stage's peer until the next completed step.

Split into: detection (SIGKILL -> the coordinator's `failure` event: the launcher kills the
peer, the coordinator notices its calls/pings fail), weight transfer (the replacement pulling
both neighbours' blocks), averaging (the library's rebuild), and resume (from the recovery to
the end of the next completed step, which includes that step's own compute). Run for the
`small` preset and for a model whose stages hold about 100M parameters each.

    python -m benchmarks.recovery

Latest results: see the README's "Benchmarks" section (recorded with the exact command).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from checkfree.rundir import read_jsonl

CONFIGS = {
    "small": ["--preset", "small", "--stages", "4"],
    # 2 stages x 8 blocks of d_model 1024 (12.6M parameters a block): ~100M parameters per stage
    "100M-per-stage": ["--preset", "tiny", "--stages", "4", "--layers", "32", "--d-model", "1024", "--heads", "16",
                       "--microbatch-size", "1"],
}


def measure(name: str, args: list[str], kill_step: int, steps: int, tmp: Path) -> dict:
    trace = tmp / f"{name}.csv"
    trace.write_text(f"step,stage\n{kill_step},1\n")
    out = tmp / name
    cmd = [sys.executable, "-m", "checkfree.cli", "local", *args, "--steps", str(steps), "--trace", str(trace),
           "--eval-every", "0", "--spares", "1", "--out", str(out), "--no-progress"]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=3600)
    events = read_jsonl(out / "events.jsonl")
    kill = next(e for e in events if e["event"] == "chaos_kill")
    fail = next(e for e in events if e["event"] == "failure")
    rec = next(e for e in events if e["event"] == "recovery")
    metrics = read_jsonl(out / "metrics.jsonl")
    normal = sorted(m["step_time_s"] for m in metrics if m["step"] not in (0, kill_step))[len(metrics) // 2 - 1]
    resumed = next(m for m in metrics if m["step"] == kill_step)
    return {"config": name, "detection_s": fail["time"] - kill["time"], "transfer_s": rec["transfer_s"],
            "averaging_s": rec["rebuild_s"], "recovery_total_s": rec["since_detection_s"],
            "bytes": rec["bytes"], "resume_step_s": resumed["step_time_s"], "normal_step_s": normal,
            "failure_time": fail["time"], "recovery_time": rec["time"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="*", default=list(CONFIGS))
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--kill-step", type=int, default=4)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [measure(n, CONFIGS[n], args.kill_step, args.steps, Path(tmp)) for n in args.configs]
    print(f"{'config':<16} {'detect s':>8} {'MB moved':>9} {'transfer s':>10} {'average s':>10} {'failure->recovered s':>21} "
          f"{'resumed step s':>15} {'normal step s':>14}")
    for r in rows:
        print(f"{r['config']:<16} {r['detection_s']:8.3f} {r['bytes'] / 2**20:9.1f} {r['transfer_s']:10.3f} {r['averaging_s']:10.3f} "
              f"{r['recovery_total_s']:21.3f} {r['resume_step_s']:15.3f} {r['normal_step_s']:14.3f}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
