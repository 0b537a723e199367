"""The strategies the swarm runs (checkfree+, checkpoint, gemini, checkfree+snap, redundant, baft, reft), measured in the swarm beside what the simulator charges for the same trace.

For each strategy, `checkfree local` (real processes, SIGKILLs from the trace) and `checkfree simulate` run the
same config and failure trace; their summary.json files carry the same five figures: `stall_s` (swarm: seconds
the steps waited for snapshots / checkpoints and for the slowest stage's redundant forwards; simulator: the cost
model's), `bytes_moved` (swarm: the bytes of the snapshots, replicas, replica gradients and recovery pulls it
ordered; the simulator also counts CheckFree+'s per-step embedding/head gradient exchange, which the swarm
counts in wire_bytes), `extra_memory_bytes` (the most one peer holds for fault tolerance), `lost_steps`, and
`recovery_s` (swarm: from the failure's detection to the repaired pipeline, measured; the simulator adds the
profile's detection time). Then redundant computation's extra compute per step: failure-free runs of
`checkfree+` and `redundant`, alternating, median step time, against the cost model's charge.

    python -m benchmarks.strategies            # tiny, 12 steps, two failures; a few minutes
    python -m benchmarks.strategies --preset small

The last line is `redundant step time ratio: X.XX` (measured, redundant / without).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from checkfree.config import config_from_dict
from checkfree.costmodel import CostModel
from checkfree.rundir import read_jsonl

STRATEGIES = {  # strategy -> its own flags
    "checkfree+": [],
    "checkpoint": ["--checkpoint-every", "4"],
    "gemini": ["--snapshot-every", "4"],
    "checkfree+snap": ["--snapshot-every", "4"],
    "redundant": [],
    "baft": [],
    "reft": ["--snapshot-every", "4"],
}
FIGURES = ("stall_s", "bytes_moved", "extra_memory_bytes", "lost_steps", "recovery_s")
PAPER_REDUNDANT = 151.04 / 91.3  # seconds per iteration with / without redundant computation (paper, 500M)


def checkfree(command: str, args: list[str], out: Path) -> dict:
    cmd = [sys.executable, "-m", "checkfree", command, *args, "--out", str(out), "--no-progress"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)}\nexited with {done.returncode}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return json.loads((out / "summary.json").read_text())


def fmt(key: str, v: float) -> str:
    if key in ("bytes_moved", "extra_memory_bytes"):
        return f"{v / 2**20:.2f} MiB"
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--pairs", type=int, default=2, help="failure-free checkfree+ / redundant pairs for the step time")
    args = p.parse_args()
    base = ["--preset", args.preset, "--steps", str(args.steps), "--eval-every", "0", "--seed", "0",
            "--cost-profile", "local"]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        trace = root / "trace.csv"
        fails = [(args.steps // 3 + 1, 1), (2 * args.steps // 3 + 2, 2)]  # off the snapshot steps: some are lost
        trace.write_text("step,stage\n" + "".join(f"{a},{b}\n" for a, b in fails))
        print(f"trace: {fails} (step, stage); {args.preset}, {args.steps} steps, simulator profile `local`\n")
        print("| strategy | " + " | ".join(f"{k} swarm / sim" for k in FIGURES) + " |")
        print("|---|" + "---|" * len(FIGURES))
        for name, flags in STRATEGIES.items():
            run = [*base, "--strategy", name, *flags, "--trace", str(trace)]
            swarm = checkfree("local", [*run, "--spares", "3"], root / f"{name}-swarm")
            sim = checkfree("simulate", run, root / f"{name}-sim")
            print(f"| {name} | " + " | ".join(f"{fmt(k, swarm[k])} / {fmt(k, sim[k])}" for k in FIGURES) + " |",
                  flush=True)
        steps: dict[str, list[float]] = {"checkfree+": [], "redundant": []}
        for i in range(args.pairs):
            for name in steps:
                out = root / f"clean-{name}-{i}"
                checkfree("local", [*base, "--strategy", name, "--no-churn", "--spares", "0"], out)
                steps[name] += [m["step_time_s"] for m in read_jsonl(out / "metrics.jsonl")[2:]]
        cfg = config_from_dict(json.loads((root / "clean-redundant-0" / "config.json").read_text()))
        cm = CostModel(cfg, "local")
        charged = (cm.step_s() + cm.redundant_extra_s()) / cm.step_s()
        with_, without = statistics.median(steps["redundant"]), statistics.median(steps["checkfree+"])
        print(f"\nfailure-free median step: checkfree+ {without:.3f} s, redundant {with_:.3f} s "
              f"({args.pairs} alternating pairs); cost model `local` charges x{charged:.2f}, the paper x{PAPER_REDUNDANT:.2f}")
        print(f"redundant step time ratio: {with_ / without:.2f}")


if __name__ == "__main__":
    main()
