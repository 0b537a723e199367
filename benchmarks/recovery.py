"""Recovery latency in the local swarm: SIGKILL of a stage's peer until the next completed step.

Split into: detection (SIGKILL -> the coordinator's `failure` event: the launcher kills the
peer, the coordinator notices its calls/pings fail), weight transfer (the replacement pulling
both neighbours' blocks at once, while it builds its stage), averaging (the library's rebuild and
the load, on the replacement's compute thread), and resume (from the recovery to
the end of the next completed step, which includes that step's own compute). Run for the
`small` preset and for a model whose stages hold about 100M parameters each.

    python -m benchmarks.recovery

Latest results: see the README's "Benchmarks" section (recorded with the exact command).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from checkfree.rundir import read_jsonl

CONFIGS = {
    "small": ["--preset", "small", "--stages", "4"],
    # 4 stages x 6 blocks of d_model 1024 (16.8M parameters a block: 4d^2 attention + 12d^2 SwiGLU):
    # 100.7M parameters in each middle stage (stage 1 is the one killed); CPU steps take seconds to
    # minutes on a shared 2-core machine, hence the longer timeouts
    "100M-per-stage": ["--preset", "tiny", "--stages", "4", "--layers", "24", "--d-model", "1024", "--heads", "16",
                       "--microbatch-size", "1", "--rpc-timeout", "300", "--step-timeout", "1200",
                       "--join-timeout", "2400", "--ready-timeout", "600"],
}


def measure(name: str, args: list[str], kill_step: int, steps: int, tmp: Path) -> dict:
    trace = tmp / f"{name}.csv"
    trace.write_text(f"step,stage\n{kill_step},1\n")
    out = tmp / name
    cmd = [sys.executable, "-m", "checkfree", "local", *args, "--steps", str(steps), "--trace", str(trace),
           "--eval-every", "0", "--spares", "1", "--out", str(out), "--no-progress"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=4 * 3600)
    if done.returncode != 0:
        raise SystemExit(f"{name}: the swarm exited with {done.returncode}; its output ends with:\n"
                         f"{done.stdout[-3000:]}\n(logs: {out / 'logs'}, kept with --keep)")
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
    p.add_argument("--keep", type=Path, help="keep the run directories here (default: a temporary directory)")
    p.add_argument("--wan", help="run the swarms on this emulated network (checkfree.wan), e.g. paper-geo")
    args = p.parse_args()
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        where = args.keep or Path(tmp)
        where.mkdir(parents=True, exist_ok=True)
        rows = [measure(n, CONFIGS[n] + (["--wan", args.wan] if args.wan else []), args.kill_step, args.steps, where)
                for n in args.configs]
    load1 = os.getloadavg()
    print(f"load average {load0[0]:.2f} / {load0[1]:.2f} before, {load1[0]:.2f} / {load1[1]:.2f} after (1 / 5 min); "
          f"cores {os.cpu_count()}; SIGKILL of stage 1 at step {args.kill_step}"
          + (f"; emulated WAN {args.wan}" if args.wan else ""))
    print(f"{'config':<16} {'stage params':>12} {'detect s':>8} {'MB moved':>9} {'transfer s':>10} {'average s':>10} "
          f"{'failure->recovered s':>21} {'resumed step s':>15} {'normal step s':>14}")
    for r in rows:
        print(f"{r['config']:<16} {r['bytes'] / 2 / 4 / 1e6:11.1f}M {r['detection_s']:8.3f} {r['bytes'] / 2**20:9.1f} "
              f"{r['transfer_s']:10.3f} {r['averaging_s']:10.3f} {r['recovery_total_s']:21.3f} "
              f"{r['resume_step_s']:15.3f} {r['normal_step_s']:14.3f}")
    print("stage params = bytes moved / 2 neighbours / 4 bytes (float32). Targets: detection within two heartbeat "
          "intervals (2 x ttl/3 = 2.7 s at the default ttl 4 s); SIGKILL -> recovered within 5 s for small.")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
