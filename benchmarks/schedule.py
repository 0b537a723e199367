"""GPipe against 1F1B in the local swarm: step time and the activation memory each stage holds.

For every M given, `checkfree local --schedule gpipe` and `--schedule 1f1b` run one after the other
(same preset, seed and data, no failures, no spares). Read from the runs' metrics.jsonl, per stage:

* in flight: the most microbatches whose activations the stage held at once (forward done, backward
  not yet), the maximum over the run's steps;
* activations: the most bytes those microbatches kept alive at once (the distinct storages of the
  tensors autograd saved for their backward passes, plus each microbatch's input and output; the
  stage's parameters and buffers excluded), the maximum over the steps;
* peak RSS: the peer process's peak resident memory at the end of the run (its DHT process and p2pd
  not included): Python, torch and hivemind (~400 MiB) plus everything the run ever held at once.

Printed: s/step (median over the steps after `--warmup`), those figures, their ratios 1f1b/gpipe, and
the largest difference between the two schedules' per-step losses (they differ only in the order in
which microbatch gradients are accumulated, so by float round-off; above `--loss-tol` is an error).

    python -m benchmarks.schedule --preset small --stages 4 --microbatches 8 16 --steps 6

Latest results: see the README's "Benchmarks" section and benchmarks/results/schedule-*.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from benchmarks.throughput import swarm_command
from checkfree.rundir import read_jsonl

SCHEDULES = ("gpipe", "1f1b")
MIB = 2**20


def run_swarm(args, schedule: str, microbatches: int, out: Path) -> dict:
    """One failure-free swarm run; its figures, per stage where they are per stage."""
    spec = SimpleNamespace(preset=args.preset, stages=args.stages, microbatches=microbatches,
                           threads_per_peer=args.threads_per_peer)
    cmd = swarm_command(spec, "checkfree", args.steps + args.warmup, out,
                        ["--schedule", schedule, "--seed", str(args.seed)])
    load = os.getloadavg()[0]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"{schedule} M={microbatches} exited with {proc.returncode}:\n{proc.stdout[-3000:]}"
                           f"{proc.stderr[-3000:]}")
    metrics = read_jsonl(out / "metrics.jsonl")
    stages = range(args.stages)
    return {"schedule": schedule, "microbatches": microbatches, "loadavg_before": load,
            "loadavg_after": os.getloadavg()[0],
            "s_per_step": statistics.median(m["step_time_s"] for m in metrics[args.warmup:]),
            "losses": [m["loss"] for m in metrics],
            "inflight_peak": [max(m["inflight_peak"][s] for m in metrics) for s in stages],
            "activation_peak_bytes": [max(m["activation_peak_bytes"][s] for m in metrics) for s in stages],
            "peak_rss_bytes": metrics[-1]["peak_rss_bytes"]}


def _cells(values: list[float], fmt: str) -> str:
    return " ".join(format(v, fmt) for v in values)


def report(g: dict, f: dict) -> dict:
    """Print one M's pair of runs side by side; returns the ratios and the loss difference."""
    m = g["microbatches"]
    dloss = max(abs(a - b) for a, b in zip(g["losses"], f["losses"]))
    ratio = {k: [b / a for a, b in zip(g[k], f[k])]
             for k in ("inflight_peak", "activation_peak_bytes", "peak_rss_bytes")}
    ratio["s_per_step"] = f["s_per_step"] / g["s_per_step"]
    print(f"\nM={m} (per stage 0..{len(g['inflight_peak']) - 1})")
    print(f"{'':<22} {'gpipe':>30} {'1f1b':>30} {'1f1b/gpipe':>30}")
    print(f"{'s/step':<22} {g['s_per_step']:30.3f} {f['s_per_step']:30.3f} {ratio['s_per_step']:30.2f}")
    print(f"{'peak in flight':<22} {_cells(g['inflight_peak'], '7d'):>30} {_cells(f['inflight_peak'], '7d'):>30} "
          f"{_cells(ratio['inflight_peak'], '7.2f'):>30}")
    act_g, act_f = [b / MIB for b in g["activation_peak_bytes"]], [b / MIB for b in f["activation_peak_bytes"]]
    print(f"{'activations MiB':<22} {_cells(act_g, '7.1f'):>30} {_cells(act_f, '7.1f'):>30} "
          f"{_cells(ratio['activation_peak_bytes'], '7.2f'):>30}")
    rss_g, rss_f = [b / MIB for b in g["peak_rss_bytes"]], [b / MIB for b in f["peak_rss_bytes"]]
    print(f"{'peer peak RSS MiB':<22} {_cells(rss_g, '7.0f'):>30} {_cells(rss_f, '7.0f'):>30} "
          f"{_cells(ratio['peak_rss_bytes'], '7.2f'):>30}")
    print(f"{'RSS 1f1b-gpipe MiB':<22} {_cells([b - a for a, b in zip(rss_g, rss_f)], '7.0f'):>30}   "
          f"(activations 1f1b-gpipe: {_cells([b - a for a, b in zip(act_g, act_f)], '.1f')})")
    print(f"max |loss 1f1b - gpipe| over {len(g['losses'])} steps: {dloss:.2e}; load average "
          f"{g['loadavg_before']:.1f}->{g['loadavg_after']:.1f} (gpipe), "
          f"{f['loadavg_before']:.1f}->{f['loadavg_after']:.1f} (1f1b)")
    return {"microbatches": m, "max_loss_diff": dloss, "ratio": ratio}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small")
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--microbatches", type=int, nargs="+", default=[8, 16])
    p.add_argument("--steps", type=int, default=6, help="measured steps per run")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads-per-peer", type=int, default=1)
    p.add_argument("--loss-tol", type=float, default=1e-5, help="largest loss difference accepted between schedules")
    p.add_argument("--json", type=Path, help="also write every run's figures here")
    args = p.parse_args()
    load0, t0 = os.getloadavg(), time.monotonic()
    print(f"preset={args.preset} S={args.stages} M={args.microbatches} steps={args.steps} + {args.warmup} warm-up, "
          f"seed {args.seed}, {args.threads_per_peer} thread(s) per peer, cores={os.cpu_count()}, "
          f"load average {load0[0]:.2f}", flush=True)
    runs, pairs = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for m in args.microbatches:
            pair = [run_swarm(args, s, m, Path(tmp) / f"{s}-M{m}") for s in SCHEDULES]
            runs += pair
            pairs.append(report(*pair))
    load1 = os.getloadavg()
    print(f"\nload average {load0[0]:.2f} / {load0[1]:.2f} before, {load1[0]:.2f} / {load1[1]:.2f} after "
          f"(1 / 5 min); {time.monotonic() - t0:.0f} s")
    result = {"command": " ".join(["python -m benchmarks.schedule", *sys.argv[1:]]), "cores": os.cpu_count(),
              "loadavg_before": load0, "loadavg_after": load1, "runs": runs, "pairs": pairs}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    worst = max(pr["max_loss_diff"] for pr in pairs)
    if worst > args.loss_tol:
        sys.exit(f"the schedules' losses differ by {worst:.2e} > --loss-tol {args.loss_tol:g}")


if __name__ == "__main__":
    main()
