"""`checkfree chaos`: a seeded long local-swarm run under heavy churn, and its tally.

The trace kills (SIGKILL) at least `--kills` peers: first and last stages, adjacent pairs in
the same step, single intermediate stages; spares join late (replacements are started only
after kills); at `--recovery-kills` iterations the peer chosen as a replacement is killed
while it recovers. The run uses CheckFree+ with a declared fallback for what it cannot
recover. At the end every failure must be accounted for as a recovery or a fallback, the
losses must be finite, and a summary counts each kind.

    checkfree chaos --stages 6 --steps 160 --kills 30 --seed 0 --out runs/chaos
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np

from checkfree.flags import add_transport_arguments
from checkfree.failures import write_trace
from checkfree.recovery import FALLBACKS
from checkfree.rundir import read_jsonl

__all__ = ["add_parser", "chaos_trace", "tally"]


def add_parser(sub: argparse._SubParsersAction) -> argparse._SubParsersAction:
    """`checkfree chaos`; returns its modes (`checkfree chaos MODE ...`: the CLI adds them, e.g. `dst`)."""
    p = sub.add_parser("chaos", help="a long local swarm under seeded heavy churn, with a tally of what happened")
    p.add_argument("--preset", default="tiny", help="model/training preset")
    p.add_argument("--stages", type=int, default=6, help="pipeline stages")
    p.add_argument("--layers", type=int, default=12, help="transformer layers")
    p.add_argument("--steps", type=int, default=160, help="optimizer steps")
    p.add_argument("--kills", type=int, default=30, help="SIGKILLs by trace (recovery kills come on top)")
    p.add_argument("--recovery-kills", type=int, default=2, help="replacements killed during their recovery")
    p.add_argument("--spares", type=int, default=2, help="standby peers kept running")
    p.add_argument("--fallback", default="copy", choices=FALLBACKS,
                   help="what an unrecoverable (adjacent) failure does; abort ends the chaos run at the first one")
    p.add_argument("--seed", type=int, default=0, help="seed of the failure schedule")
    p.add_argument("--out", default="runs/chaos", help="run directory")
    add_transport_arguments(p, port=False)
    p.set_defaults(func=run_chaos)
    return p.add_subparsers(dest="chaos_mode", metavar="MODE", title="other chaos modes")


def chaos_trace(num_stages: int, num_steps: int, kills: int, seed: int) -> list[tuple[int, int]]:
    """Failures spread over the run: a quarter on the edge stages, a quarter as adjacent pairs."""
    rng = np.random.default_rng(seed)
    steps = np.linspace(2, num_steps - 3, num=kills, dtype=int)
    events: list[tuple[int, int]] = []
    i = 0
    while len(events) < kills and i < len(steps):
        t, kind = int(steps[i]), i % 4
        if kind == 0:
            events.append((t, int(rng.choice([0, num_stages - 1]))))
        elif kind == 1 and len(events) + 2 <= kills:
            s = int(rng.integers(0, num_stages - 1))
            events += [(t, s), (t, s + 1)]
        else:
            events.append((t, int(rng.integers(1, num_stages - 1))))
        i += 1
    return sorted(set(events))


def tally(out: Path) -> dict:
    events = read_jsonl(out / "events.jsonl")
    kinds = Counter(e["event"] for e in events)
    metrics = read_jsonl(out / "metrics.jsonl")
    failures = [(e["step"], e["stage"]) for e in events if e["event"] == "failure"]
    handled = [(e["step"], e["stage"]) for e in events if e["event"] in ("recovery", "fallback")
               and e.get("fallback") != "abort"]
    return {"failures": len(failures), "recoveries": kinds["recovery"], "fallbacks": kinds["fallback"],
            "recovery_retries": kinds["recovery_retry"], "aborted_attempts": kinds["aborted_step"],
            "edge_failures": sum(1 for _, s in failures if s in (0, max(s for _, s in failures))),
            "unaccounted": sorted(set(failures) - set(handled)),
            "finite_losses": all(isinstance(m["loss"], float) and math.isfinite(m["loss"]) for m in metrics),
            "steps": len({m["step"] for m in metrics})}


def run_chaos(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    trace = chaos_trace(args.stages, args.steps, args.kills, args.seed)
    write_trace(out / "chaos_input.csv", trace)
    rec = sorted({int(x) for x in np.linspace(args.steps // 4, args.steps // 2, args.recovery_kills, dtype=int)})
    rec = [t for t in rec if t in {s for s, _ in trace}] or [trace[len(trace) // 2][0]]
    cmd = [sys.executable, "-m", "checkfree", "local", "--preset", args.preset, "--stages", str(args.stages),
           "--layers", str(args.layers), "--steps", str(args.steps), "--strategy", "checkfree+", "--fallback",
           args.fallback, "--trace", str(out / "chaos_input.csv"), "--spares", str(args.spares),
           "--chaos-recovery-kills", ",".join(map(str, rec)), "--out", str(out / "run"), "--eval-every", "0",
           "--transport", args.transport]
    print(f"chaos: {len(trace)} SIGKILLs by trace + replacements killed during recovery at iterations {rec}")
    code = subprocess.run(cmd).returncode
    summary = tally(out / "run")
    (out / "chaos_summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    ok = code == 0 and not summary["unaccounted"] and summary["finite_losses"] and summary["steps"] == args.steps
    print("chaos: PASS" if ok else "chaos: FAIL")
    return 0 if ok else 1
