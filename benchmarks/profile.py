"""Where a swarm step's time goes: CPU per step of every process of a local swarm, then py-spy.

Runs one failure-free `checkfree local` (the swarm of `benchmarks.throughput`) and watches it from
the outside (benchmarks.swarmmon, /proc only):

1. CPU accounting, over steps [warmup, warmup + cpu_steps): CPU seconds per step of the coordinator,
   the peers' event-loop threads, the peers' compute threads, their DHT processes and their p2pd
   daemons, against the machine's CPU budget (cores x seconds per step), plus the bytes the peers'
   p2pd daemons wrote per step against the tensor payload the peers reported.
2. py-spy (`record --nonblocking`, so the targets are never paused) on the coordinator and every
   peer for `--seconds`, after the accounting window: top frames by thread (event loop, compute),
   as self time (the innermost Python frame; time in C called from it is counted there).

    python -m benchmarks.profile --preset small --stages 4 --microbatches 8

`--save DIR` keeps the raw py-spy stacks (flamegraph.pl input) and the JSON of the tables.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from benchmarks.swarmmon import SwarmMonitor
from benchmarks.throughput import swarm_command

# Innermost frame's file -> what it is (first match wins).
CATEGORIES = [
    ("checkfree/net/wire.py", "wire format"),
    ("checkfree/net/streams.py", "transport"),
    ("checkfree/net/hivemind_transport.py", "transport"),
    ("checkfree/net/tcp_transport.py", "transport"),
    ("hivemind/p2p/", "hivemind p2p client"),
    ("hivemind/", "hivemind (DHT, mpfuture)"),
    ("msgpack", "msgpack"),
    ("google/protobuf", "protobuf"),
    ("asyncio/", "asyncio"),
    ("selectors.py", "asyncio"),
    ("peers/", "peer daemon"),
    ("coordinator/", "coordinator"), ("faults/", "coordinator"), ("/ops/", "coordinator"),
    ("checkfree/worker.py", "torch compute"),
    ("checkfree/model.py", "torch compute"),
    ("torch/", "torch compute"),
    ("checkfree/", "checkfree (other)"),
    ("concurrent/futures", "thread pool"),
    ("threading.py", "threading"),
]


# py-spy from PATH, else beside this interpreter (a virtualenv's bin/ that is not on PATH)
PY_SPY = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")


def category(frame: str) -> str:
    path = frame[frame.rfind("(") + 1 :]
    return next((name for key, name in CATEGORIES if key in path), "other")


def thread_kind(name: str) -> str:
    if name == "MainThread":
        return "event loop"
    if name.startswith("compute"):
        return "compute"
    return "other threads"


def parse_raw(path: Path) -> dict[str, Counter]:
    """py-spy raw (collapsed) stacks recorded with --threads -> {thread kind: Counter of innermost frames}."""
    out: dict[str, Counter] = {}
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        name = frames[0].split(": ", 1)[1] if ": " in frames[0] else frames[0]
        leaf = frames[-1] if len(frames) > 1 else "(no Python frame)"
        out.setdefault(thread_kind(name), Counter())[leaf] += int(count)
    return out


def report_profile(label: str, stacks: dict[str, Counter], seconds: float, rate: int, top: int) -> dict:
    """Print and return {thread kind: {"cpu_share": ..., "categories": ..., "top": ...}}."""
    total_possible = seconds * rate
    result = {}
    for kind, frames in sorted(stacks.items(), key=lambda kv: -sum(kv[1].values())):
        n = sum(frames.values())
        cats = Counter()
        for frame, c in frames.items():
            cats[category(frame)] += c
        print(f"\n{label}: {kind}: {n} samples ({n / total_possible:.0%} of one core while sampled)")
        print("  by category: " + ", ".join(f"{c} {100 * v / n:.0f}%" for c, v in cats.most_common()))
        for frame, c in frames.most_common(top):
            print(f"  {100 * c / n:5.1f}%  {frame}")
        result[kind] = {"samples": n, "busy_fraction": n / total_possible,
                        "categories": {c: v / n for c, v in cats.most_common()},
                        "top": [[f, c / n] for f, c in frames.most_common(top)]}
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small")
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--strategy", default="checkfree")
    p.add_argument("--transport", default="hivemind", help="the swarm's --transport (hivemind, tcp, libp2p)")
    p.add_argument("--schedule", default="gpipe", help="the swarm's --schedule (gpipe, 1f1b)")
    p.add_argument("--threads-per-peer", type=int, default=1)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--cpu-steps", type=int, default=20, help="steps of the CPU accounting window")
    p.add_argument("--seconds", type=float, default=15.0, help="py-spy recording time (0: no py-spy)")
    p.add_argument("--rate", type=int, default=50, help="py-spy samples per second")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--save", type=Path, help="directory for the raw py-spy stacks and a JSON of the results")
    args = p.parse_args()

    cores = os.cpu_count()
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        # enough steps for the accounting window and the py-spy recording at a pessimistic 1.5 s/step
        steps = args.warmup + args.cpu_steps + int(args.seconds / 0.2) + 5
        cmd = swarm_command(args, args.strategy, steps, out,
                            ["--transport", args.transport, "--schedule", args.schedule])
        log = open(Path(tmp) / "swarm.log", "w")
        swarm = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        spies, raws = [], {}
        try:
            with SwarmMonitor(swarm.pid, out / "metrics.jsonl", interval=0.25) as mon:
                start_spy = args.warmup + args.cpu_steps
                while swarm.poll() is None and (not mon.samples or mon.samples[-1].steps < start_spy):
                    time.sleep(0.2)
                if args.seconds > 0 and swarm.poll() is None:
                    last = mon.samples[-1]
                    targets = [(pp.role, pid) for pid, pp in last.procs.items() if pp.role in ("coordinator", "peer")]
                    for role, pid in targets:
                        raw = Path(tmp) / f"{role}-{pid}.txt"
                        raws[raw] = role
                        spies.append(subprocess.Popen(
                            [PY_SPY, "record", "--nonblocking", "--threads", "-r", str(args.rate), "-d",
                             str(int(args.seconds)), "-f", "raw", "-o", str(raw), "--pid", str(pid)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
                    for spy in spies:
                        _, err = spy.communicate(timeout=args.seconds + 60)
                        if spy.returncode != 0:
                            print(f"py-spy failed ({spy.returncode}): {err.strip()[-500:]}", file=sys.stderr)
                code = swarm.wait(timeout=3600)
        finally:
            if swarm.poll() is None:
                swarm.terminate()
                swarm.wait()
            log.close()
        if code != 0:
            sys.exit(f"swarm exited with {code}:\n" + (Path(tmp) / "swarm.log").read_text()[-3000:])
        load1 = os.getloadavg()
        acct = per_step_window(mon, args.warmup, args.warmup + args.cpu_steps)
        payload = payload_bytes(out / "metrics.jsonl", args.warmup, args.warmup + args.cpu_steps)
        results = {"command": " ".join(["python -m benchmarks.profile", *sys.argv[1:]]), "cores": cores,
                   "loadavg_before": load0, "loadavg_after": load1, "cpu": acct, "payload_bytes_per_step": payload}
        print_accounting(acct, cores, payload, load0, load1)
        profiles = {}
        for role in ("peer", "coordinator"):
            merged: dict[str, Counter] = {}
            files = [raw for raw, r in raws.items() if r == role and raw.exists()]
            for raw in files:
                for kind, c in parse_raw(raw).items():
                    merged.setdefault(kind, Counter()).update(c)
            if merged:
                label = f"{role}s (all {len(files)}, summed)" if role == "peer" else role
                profiles[role] = report_profile(label, merged, args.seconds * len(files), args.rate, args.top)
        results["profiles"] = profiles
        if args.save:
            args.save.mkdir(parents=True, exist_ok=True)
            for raw in raws:
                if raw.exists():
                    shutil.copy(raw, args.save / raw.name)
            (args.save / "profile.json").write_text(json.dumps(results, indent=1))
            print(f"\nsaved to {args.save}")


def per_step_window(mon: SwarmMonitor, first_step: int, last_step: int) -> dict:
    """CPU/bytes per step between the first sample at >= first_step and the last at <= last_step steps."""
    keep = [s for s in mon.samples if s.steps <= last_step]
    saved, mon.samples = mon.samples, keep
    try:
        acct = mon.per_step(first_step)
    finally:
        mon.samples = saved
    if acct is None:
        raise SystemExit("the accounting window holds no complete step: raise --cpu-steps")
    return acct


def payload_bytes(metrics: Path, first: int, last: int) -> float:
    rows = [json.loads(line) for line in metrics.read_text().splitlines()[first:last]]
    return sum(r.get("wire_bytes", 0) for r in rows) / max(1, len(rows))


def print_accounting(acct: dict, cores: int, payload: float, load0, load1) -> None:
    wall = acct["wall_s"]
    budget = cores * wall
    print(f"CPU per step over {acct['steps']} steps: {wall:.3f} s/step wall, budget {cores} cores x wall = "
          f"{budget:.3f} CPU-s; load average {load0[0]:.2f} before, {load1[0]:.2f} after")
    rows = []
    for role, c in acct["cpu_s"].items():
        if role in ("peer", "coordinator"):
            rows.append((f"{role}: event-loop thread", c["main"]))
            rows.append((f"{role}: other threads{' (compute)' if role == 'peer' else ''}", c["other"]))
        else:
            rows.append((role, c["main"] + c["other"]))
    total = sum(v for _, v in rows)
    print(f"{'process / thread':<36} {'CPU s/step':>10} {'% of swarm':>10} {'% of budget':>11}")
    for name, v in sorted(rows, key=lambda r: -r[1]):
        print(f"{name:<36} {v:10.4f} {100 * v / total:9.1f}% {100 * v / budget:10.1f}%")
    print(f"{'total':<36} {total:10.4f} {100.0:9.1f}% {100 * total / budget:10.1f}%")
    w = acct["wchar"].get("peer-p2pd", 0)
    print(f"bytes the peers' p2pd daemons wrote per step (unix socket to their peer + TCP to the other daemons): "
          f"{w:,.0f} = {w / max(payload, 1):.2f} x the tensor payload the peers sent ({payload:,.0f})")

if __name__ == "__main__":
    main()
