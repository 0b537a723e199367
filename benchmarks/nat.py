"""What a relay costs: the same failure-free swarm on emulated hosts (`checkfree local --hosts`), every peer public
(each call between stages direct) against every peer behind NAT (each call between stages relayed by the
coordinator: two links and the coordinator's process instead of one link), side by side in rounds, in one run.

    python -m benchmarks.nat                      # small, S 4, 12 measured steps, 2 rounds
    python -m benchmarks.nat --wan paper-geo      # every host's link shaped (tc tbf) and the WAN's delays

Prints a table (median step time over the measured steps, per path: median and spread over rounds) and
`relayed/direct step time: X.XX (min-max over rounds)`; `--out FILE` appends the whole report to FILE.
Needs root, iproute2 and iptables (the emulated NAT).
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

from checkfree.rundir import read_jsonl

WARMUP = 2  # steps left out of the measure (stream set-up, first relay route lookups)


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip() or "?"
    except OSError:
        return "?"


def run_swarm(out: Path, args: argparse.Namespace, nat: int) -> list[float]:
    """One failure-free local swarm on emulated hosts, `nat` peers behind NAT; its step times after the warm-up."""
    peers = args.stages
    cmd = [sys.executable, "-m", "checkfree", "local", "--preset", args.preset, "--stages", str(args.stages),
           "--steps", str(args.steps + WARMUP), "--eval-every", "0", "--out", str(out), "--no-progress",
           "--no-dashboard", "--no-churn", "--spares", "0", "--hosts", "--nat-peers", str(nat),
           "--microbatches", str(args.microbatches), "--join-timeout", "120"]
    if args.wan:
        cmd += ["--wan", args.wan]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "CHECKFREE_CACHE": args.cache})
    if proc.returncode != 0:
        raise RuntimeError(f"swarm ({nat} of {peers} peers behind NAT) failed:\n{proc.stdout[-3000:]}")
    relayed = proc.stdout.count("reached through this coordinator's relay")
    if relayed != nat:
        raise RuntimeError(f"{relayed} peers were relayed, {nat} expected")
    return [m["step_time_s"] for m in read_jsonl(out / "metrics.jsonl")][WARMUP:]


def check_lines(cache: str) -> list[str]:
    """`checkfree peer --check` on a host behind NAT against a coordinator on a public host (emulated): its lines
    and the coordinator's about it."""
    import secrets
    import signal

    from swarm.netlab import NetLab
    from swarm.processes import await_line, kill_group, spawn

    lab = NetLab()
    env = {**os.environ, "CHECKFREE_CACHE": cache, "CHECKFREE_SECRET": secrets.token_hex(16), "PYTHONUNBUFFERED": "1"}
    coordinator = None
    try:
        with tempfile.TemporaryDirectory(prefix="bench-nat-check-") as tmp:
            _, prefix, addr = lab.add()
            coordinator = spawn(["scheduler", "--preset", "tiny", "--steps", "1", "--out", tmp, "--run-id", "check",
                                 "--host-maddrs", f"/ip4/{addr}/tcp/0"], env, prefix=prefix)
            ready = await_line(coordinator, "coordinator ready", 120)
            maddr = ready.split("addrs=")[1].split(",")[0].split()[0]
            _, prefix, _ = lab.add_nat()
            peer = subprocess.run([*prefix, sys.executable, "-m", "checkfree", "peer", "--run-id", "check",
                                   "--initial-peers", maddr, "--host-maddrs", "/ip4/0.0.0.0/tcp/0", "--check"],
                                  capture_output=True, text=True, timeout=180, env=env)
            if peer.returncode != 0:
                raise RuntimeError(f"checkfree peer --check failed:\n{peer.stdout[-2000:]}{peer.stderr[-2000:]}")
            mine = [line for line in peer.stdout.splitlines() if line.startswith(("check:", "peer:"))]
            coordinator.popen.send_signal(signal.SIGTERM)
            coordinator.popen.wait(30)
            theirs = [line for line in coordinator.out if "behind NAT" in line]
            return [*mine, *theirs]
    finally:
        if coordinator is not None:
            kill_group(coordinator)
        lab.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=12, help="measured steps per swarm (after 2 warm-up steps)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--wan", help="a WAN profile (paper-geo): shaped host links and per-stage delays")
    p.add_argument("--cache", default=os.environ.get("CHECKFREE_CACHE", str(Path.home() / ".cache" / "checkfree")))
    p.add_argument("--out", help="append the report to this file")
    p.add_argument("--no-check", action="store_true", help="leave out the `checkfree peer --check` behind NAT")
    args = p.parse_args(argv)
    load = os.getloadavg()[0]
    lines = [f"# python -m benchmarks.nat {' '.join(argv if argv is not None else sys.argv[1:])}",
             f"commit {_commit()}, {time.strftime('%Y-%m-%d %H:%M')}, load average {load:.1f} at the start; "
             f"{args.preset}, S {args.stages}, M {args.microbatches}, {args.steps} measured steps after {WARMUP}, "
             f"{args.rounds} rounds, {'WAN ' + args.wan if args.wan else 'unshaped links'}", ""]
    direct, relayed, ratios = [], [], []
    with tempfile.TemporaryDirectory(prefix="bench-nat-") as tmp:
        for r in range(args.rounds):  # the two paths alternate, so a busy moment hits both
            d = statistics.median(run_swarm(Path(tmp) / f"direct-{r}", args, nat=0))
            n = statistics.median(run_swarm(Path(tmp) / f"relayed-{r}", args, nat=args.stages))
            direct.append(d)
            relayed.append(n)
            ratios.append(n / d)
            print(f"round {r + 1}: direct {d:.4f} s/step, relayed {n:.4f} s/step", flush=True)
    lines += ["| path | s/step: median of rounds (min-max) | ÷ direct |", "|---|---|---|",
              f"| direct (every peer public) | {statistics.median(direct):.4f} ({min(direct):.4f}-{max(direct):.4f}) "
              f"| 1.00 |",
              f"| relayed (every peer behind NAT) | {statistics.median(relayed):.4f} ({min(relayed):.4f}-"
              f"{max(relayed):.4f}) | {statistics.median(ratios):.2f} |", "",
              f"relayed/direct step time: {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f} over "
              f"rounds)", f"direct s/step: {statistics.median(direct):.4f}",
              f"relayed s/step: {statistics.median(relayed):.4f}",
              json.dumps({"direct_s": direct, "relayed_s": relayed, "ratios": ratios}), ""]
    if not args.no_check:
        lines += ["## checkfree peer --check behind NAT (the coordinator on a public host)", "",
                  *check_lines(args.cache), ""]
    report = "\n".join(lines)
    print(report, flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(report + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
