"""Stage groups: what a second replica of the slowest stage buys, and what a lost replica costs, in the swarm.

A 4-stage swarm (`checkfree local`, real processes) in which one stage is made slow on purpose with
`--chaos-slow` (each of its peers sleeps before every forward and backward: a slow GPU, so that this 2-core
machine's CPU is not what limits the step), run side by side in one invocation:

* `1 replica`: one peer per stage, one spare standing by (`--spares 1`);
* `2 replicas`: the same, with `--reserve 0`: the spare joins the group of the slowest stage by measured speed
  (after step 0) and the two replicas split its microbatches;
* `2 replicas, one lost`: as the previous, with one replica of the slow stage SIGKILLed mid-step: its
  microbatches are redone by its sibling in the same step (no aborted attempt).

Each configuration runs `--rounds` times, alternating; tokens/s is the median over the steps after the join
(from step 2 on) of tokens per step / step time. Printed: tokens/s, the median step time, the gradient
all-reduce's seconds per step (the largest over the stages) against the step time, and for the lost replica the
seconds from the loss's detection to the completion of its redone microbatches (the `reroute_done` event) against
that step's time.

    python -m benchmarks.replicas                # ~3 minutes
    python -m benchmarks.replicas --rounds 1 --steps 6   # quicker

The last line is `replicas speedup: X.XX` (tokens/s with 2 replicas / with 1).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from checkfree.rundir import read_jsonl


def run(out: Path, args: list[str]) -> tuple[list[dict], list[dict], dict]:
    cmd = [sys.executable, "-m", "checkfree", "local", *args, "--out", str(out), "--no-progress"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)}\nexited with {done.returncode}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return (read_jsonl(out / "metrics.jsonl"), read_jsonl(out / "events.jsonl"),
            json.loads((out / "summary.json").read_text()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=2, help="runs of each configuration, alternating")
    p.add_argument("--slow-stage", type=int, default=2)
    p.add_argument("--delay", type=float, default=0.1, help="seconds the slow stage sleeps per forward/backward")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--transport", default="hivemind")
    a = p.parse_args()
    kill_step = a.steps - 3
    base = ["--steps", str(a.steps), "--microbatches", str(a.microbatches), "--eval-every", "0",
            "--chaos-slow", f"{a.slow_stage}:{a.delay}", "--transport", a.transport, "--spares", "1"]
    configs = {"1 replica": base + ["--no-churn"], "2 replicas": base + ["--no-churn", "--reserve", "0"]}
    with tempfile.TemporaryDirectory(prefix="bench-replicas-") as tmp:
        trace = Path(tmp) / "trace.csv"
        trace.write_text(f"step,stage\n{kill_step},{a.slow_stage}\n")
        configs["2 replicas, one lost"] = base + ["--reserve", "0", "--trace", str(trace)]
        results: dict[str, list] = {k: [] for k in configs}
        for r in range(a.rounds):
            for name, args in configs.items():
                print(f"round {r + 1}/{a.rounds}: {name} ...", flush=True)
                results[name].append(run(Path(tmp) / f"{name.replace(' ', '-').replace(',', '')}-{r}", args))
    tps, rows = {}, []
    for name, runs in results.items():
        steps = [m for metrics, _, s in runs for m in metrics if m["step"] >= 2]
        clean = [m for m in steps if name != "2 replicas, one lost" or m["step"] != kill_step]
        step_s = statistics.median(m["step_time_s"] for m in clean)
        tps[name] = statistics.median(m["tokens_per_s"] for m in clean)
        reduce = [max(x for x in m["reduce_s"] if x is not None) for m in clean if m.get("reduce_s")]
        row = {"config": name, "tokens_s": tps[name], "step_s": step_s,
               "reduce_s": statistics.median(reduce) if reduce else 0.0,
               "replicas": clean[-1].get("replicas") or [1] * 4}
        if name == "2 replicas, one lost":
            done = [e for _, events, _ in runs for e in events if e["event"] == "reroute_done"]
            lost_steps = [m["step_time_s"] for m in steps if m["step"] == kill_step]
            row["since_lost_s"] = statistics.median(e["since_lost_s"] for e in done) if done else float("nan")
            row["lost_step_s"] = statistics.median(lost_steps)
            row["aborted"] = sum(1 for _, events, _ in runs for e in events if e["event"] == "aborted_step")
        rows.append(row)
    print("| config | replicas per stage | tokens/s | median step s | all-reduce s per step (share of step) |")
    print("|---|---|---|---|---|")
    for r in rows:
        reduce = f"{r['reduce_s']:.4f} ({r['reduce_s'] / r['step_s']:.1%})" if r["reduce_s"] else "none (no group)"
        print(f"| {r['config']} | {r['replicas']} | {r['tokens_s']:.0f} | {r['step_s']:.3f} | {reduce} |")
    lost = rows[-1]
    print(f"lost replica: redone microbatches complete {lost['since_lost_s']:.3f} s after the loss was detected; "
          f"that step took {lost['lost_step_s']:.3f} s (others {lost['step_s']:.3f} s); aborted attempts: "
          f"{lost['aborted']}")
    print(f"replicas speedup: {tps['2 replicas'] / tps['1 replica']:.2f}")


if __name__ == "__main__":
    main()
