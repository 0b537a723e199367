"""What the parts that should be idle cost: a standby peer waiting for a stage, and the DHT and p2pd beside
the tcp transport.

Runs a failure-free `checkfree local` (the swarm of `benchmarks.throughput`, `--transport tcp`, `--spares 1`)
and, once it trains, reads /proc (benchmarks.swarmmon) at the start and the end of a `--seconds` window:
CPU seconds per second of wall time (1.0 = one core busy) of every process, by role. The standby is the peer
that computes nothing: the one of least CPU (the benchmark checks it used under a tenth of the least busy stage
peer's). Then the swarm is stopped (SIGTERM to the launcher) and nothing may be left behind.

    python -m benchmarks.idle                 # a 60 s window
    python -m benchmarks.idle --seconds 10    # a quick look
    python -m benchmarks.idle --dht-floor     # the DHT alone: what each heartbeat and each read costs

`--dht-floor` measures hivemind's DHT without the runtime: 6 DHT processes (each with its p2pd) on loopback,
first with no traffic at all, then with 5 of them storing a heartbeat (a sub-key with a 4 s expiry, as the
peers do) at each period of `--periods` (seconds), then with one reading the members every 0.4 s (as a
coordinator that reads once per step would): CPU per second of each node (its DHT process and p2pd).

The swarm trains while it is measured, as a real standby waits: the coordinator reads the membership records
every step and every process refreshes its own, so the DHT processes and their p2pd daemons serve one another.
The last line is `idle standby: X% of a core` (its python process, its DHT process and its p2pd together).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from benchmarks.swarmmon import Sample, SwarmMonitor
from benchmarks.throughput import swarm_command
from checkfree.net.lifeline import held_socket_files, living, outliving, process_tree

ROLES_SHOWN = ("coordinator", "coordinator-dht", "coordinator-p2pd", "peer", "peer-dht", "peer-p2pd", "launcher")


def _wait(mon: SwarmMonitor, proc: subprocess.Popen, until, timeout: float) -> Sample:
    """The first sample for which `until(sample)` holds (the swarm must still run)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the swarm exited ({proc.returncode}) before the measurement")
        if mon.samples and until(mon.samples[-1]):
            return mon.samples[-1]
        time.sleep(0.2)
    raise SystemExit(f"timed out after {timeout:g} s waiting for the swarm")


def _peers_seen(s: Sample, peers: int) -> bool:
    """Whether the sample holds `peers` peer processes, each with its DHT process and its p2pd."""
    counts = Counter(p.role for p in s.procs.values())
    return all(counts[role] >= peers for role in ("peer", "peer-dht", "peer-p2pd"))


def usage(a: Sample, b: Sample) -> dict[int, float]:
    """CPU seconds per wall second of every process alive in both samples."""
    wall = b.time - a.time
    return {pid: (b.procs[pid].cpu_main_s + b.procs[pid].cpu_other_s - pa.cpu_main_s - pa.cpu_other_s) / wall
            for pid, pa in a.procs.items() if pid in b.procs}


async def _dht_floor_case(period: float | None, read: float | None, seconds: float, ttl: float = 4.0) -> list[float]:
    """CPU-s/s of 6 DHT nodes (process + p2pd each): node 0 reads the members every `read` s, nodes 1-5 store
    their heartbeat every `period` s (None: not at all)."""
    import asyncio
    import random

    from checkfree.net.lifeline import TiedDHT
    from checkfree.net.heartbeats import announce, live_members_async

    boot = TiedDHT(start=True)
    maddrs = [str(m) for m in boot.get_visible_maddrs()]
    dhts = [boot] + [TiedDHT(start=True, initial_peers=maddrs) for _ in range(5)]
    try:
        trees = [process_tree(d.pid) for d in dhts]

        async def beat(d, i: int) -> None:
            while True:
                await announce(d, "members", f"peer{i}", {"stage": i}, ttl)
                await asyncio.sleep(period * random.uniform(0.8, 1.0))

        async def reader(d) -> None:
            while True:
                await live_members_async(d, "members")
                await asyncio.sleep(read)

        tasks = [asyncio.create_task(beat(d, i)) for i, d in enumerate(dhts[1:], 1) if period] + \
            ([asyncio.create_task(reader(boot))] if read else [])
        await asyncio.sleep(3.0)  # past the first stores
        t0, c0 = time.monotonic(), [_cpu(t) for t in trees]
        await asyncio.sleep(seconds)
        t1, c1 = time.monotonic(), [_cpu(t) for t in trees]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return [(b - a) / (t1 - t0) for a, b in zip(c0, c1)]
    finally:
        for d in dhts:
            d.shutdown()


def _cpu(pids: set[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def dht_floor(args) -> None:
    import asyncio
    import statistics

    print(f"hivemind DHT alone: 6 nodes on loopback, {args.seconds:g} s per case; load average "
          f"{os.getloadavg()[0]:.2f}")
    print("| case | reader node (0) CPU-s/s | heartbeating nodes (1-5) CPU-s/s, median | per store, all nodes, ms |")
    print("|---|---|---|---|")
    cases = [("no traffic", None, None)] + [(f"heartbeats every {p:g} s", p, None) for p in args.periods] + \
        [("reads every 0.4 s, no heartbeats", None, 0.4)]
    for name, period, read in cases:
        cpu = asyncio.run(_dht_floor_case(period, read, args.seconds))
        stores = 5 / (0.9 * period) if period else 0.0  # jittered 0.8-1.0x
        per_store = f"{1e3 * sum(cpu) / stores:.1f}" if stores else "-"
        print(f"| {name} | {cpu[0]:.4f} | {statistics.median(cpu[1:]):.4f} | {per_store} |")
    # (torch's shared-memory manager, started by torch for this process, exits with it)
    left = [p for p in living(process_tree(os.getpid()) - {os.getpid()}) if _comm(p) != "torch_shm_manager"]
    print(f"left behind: {len(left)} processes")


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small")
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--threads-per-peer", type=int, default=1)
    p.add_argument("--transport", default="tcp")
    p.add_argument("--seconds", type=float, default=60.0, help="the measurement window")
    p.add_argument("--warmup-steps", type=int, default=3, help="steps trained before the window opens")
    p.add_argument("--dht-floor", action="store_true", help="measure hivemind's DHT alone (see above)")
    p.add_argument("--periods", type=float, nargs="+", default=[4 / 3, 2.0],
                   help="--dht-floor: heartbeat periods in seconds (the old ttl/3 and the current ttl/2 of a 4 s ttl)")
    args = p.parse_args()
    if args.dht_floor:
        return dht_floor(args)
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        cmd = swarm_command(args, "checkfree", 100000, out, ["--transport", args.transport, "--spares", "1"])
        log = open(Path(tmp) / "swarm.log", "w")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        sockets: set[str] = set()
        try:
            with SwarmMonitor(proc.pid, out / "metrics.jsonl", interval=1.0) as mon:
                # trained the warm-up steps, and every peer (the standby too) seen with its DHT process and p2pd
                a = _wait(mon, proc, lambda s: s.steps >= args.warmup_steps and _peers_seen(s, args.stages + 1), 600)
                b = _wait(mon, proc, lambda s: s.time - a.time >= args.seconds, args.seconds + 120)
                sockets |= held_socket_files(set(mon.roles))
                roles = dict(mon.roles)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)  # the launcher stops its swarm
                try:
                    proc.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            log.close()
        cpu = usage(a, b)
        standby = report(args, a, b, cpu, roles, load0)
        left = outliving(set(roles))
        files = [f for f in sockets if os.path.exists(f)]
        print(f"left behind: {len(left)} processes, {len(files)} socket files (of {len(roles)} started)")
        for pid in sorted(left):
            print(f"  still running: pid {pid} ({roles[pid][0]}, {_comm(pid)})")
        print(f"idle standby: {100 * standby:.2f}% of a core")


def report(args, a: Sample, b: Sample, cpu: dict[int, float], roles: dict[int, tuple[str, int]], load0) -> float:
    """Print the table; returns the standby's CPU-s/s (its python, DHT and p2pd processes)."""
    peers = sorted((pid for pid, (role, _) in roles.items() if role == "peer" and pid in cpu), key=cpu.get)
    if len(peers) != args.stages + 1:
        raise SystemExit(f"expected {args.stages + 1} peers (one a standby), found {len(peers)}")
    standby, stage_peers = peers[0], peers[1:]
    if cpu[standby] >= 0.1 * cpu[stage_peers[0]]:
        raise SystemExit(f"no idle standby found: the least busy peer used {cpu[standby]:.3f} CPU-s/s, the next "
                         f"{cpu[stage_peers[0]]:.3f}")
    group = {pid: g for pid, (_, g) in roles.items()}
    steps = b.steps - a.steps
    wall = b.time - a.time
    print(f"preset={args.preset} S={args.stages} M={args.microbatches} transport={args.transport}; window "
          f"{wall:.1f} s, {steps} steps trained meanwhile ({wall / max(steps, 1):.3f} s/step); load average "
          f"{load0[0]:.2f} -> {os.getloadavg()[0]:.2f}")
    print("\nCPU per second of wall time (1.0 = one core), summed over the processes of each kind:")
    print("| process | count | CPU-s/s | per process |")
    print("|---|---|---|---|")
    rows = [("standby peer (python: event loop, compute thread idle)", [standby]),
            ("standby's DHT process", [p for p in cpu if group.get(p) == standby and roles[p][0] == "peer-dht"]),
            ("standby's p2pd", [p for p in cpu if group.get(p) == standby and roles[p][0] == "peer-p2pd"])]
    others = set(stage_peers)
    for role in ROLES_SHOWN:
        pids = [p for p in cpu if roles[p][0] == role and (role == "peer" and p in others or
                                                           role != "peer" and group.get(p) != standby)]
        name = {"peer": "stage peers (python: event loop + compute)", "peer-dht": "stage peers' DHT processes",
                "peer-p2pd": "stage peers' p2pd"}.get(role, role)
        rows.append((name, pids))
    for name, pids in rows:
        total = sum(cpu[p] for p in pids)
        print(f"| {name} | {len(pids)} | {total:.4f} | {total / max(len(pids), 1):.4f} |")
    return sum(cpu[p] for p in cpu if p == standby or group.get(p) == standby)


if __name__ == "__main__":
    sys.exit(main())
