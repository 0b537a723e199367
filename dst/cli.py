"""`checkfree chaos dst`: deterministic simulation tests of the swarm against the simulator.

    checkfree chaos dst --schedules 200 --seed 0            # generated schedules, in-process swarm
    checkfree chaos dst --replay runs/dst/shrunk-0.json     # one schedule again (e.g. a shrunk divergence)
    checkfree chaos dst --replay FILE --repeat 20           # ...20 times: how often is the outcome the same?

Every schedule's line goes to the terminal, its details to <out>/report.jsonl; the last line is
`dst: N schedules, K divergences, F faults injected`. Exit code 0 when nothing diverged, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

__all__ = ["add_parser", "run_dst"]


def add_parser(modes: argparse._SubParsersAction) -> None:
    p = modes.add_parser("dst", help="generated fault schedules: the in-process swarm against the simulator",
                         description="Deterministic simulation tests: seeded fault schedules (hypothesis), each run in "
                                     "the in-process swarm and in the simulator, invariants checked, a divergence "
                                     "shrunk to a minimal schedule that replays with one command.")
    p.add_argument("--schedules", type=int, default=200, help="schedules to run")
    p.add_argument("--seed", type=int, default=0, help="hypothesis seed of the schedules")
    p.add_argument("--out", default="runs/dst", help="where divergent schedules' runs and report.jsonl go")
    p.add_argument("--shrink-seconds", type=float, default=600.0,
                   help="time spent shrinking a divergent schedule (0: no shrinking)")
    p.add_argument("--stop-at-first", action="store_true", help="stop at the first divergence")
    p.add_argument("--max-faults", type=int, default=4, help="faults per schedule, at most")
    p.add_argument("--replay", metavar="FILE", help="run this schedule (JSON, as printed) instead of generating")
    p.add_argument("--repeat", type=int, default=1, help="with --replay: run it this many times")
    p.add_argument("--tier", choices=("inprocess", "real"), default="inprocess",
                   help="inprocess: the real coordinator and peers over the memory network (fast, every fault kind); "
                        "real: `checkfree local` with real processes (the launcher's fault kinds)")
    s = p.add_argument_group("the real-process soak (instead of schedules)")
    s.add_argument("--soak-minutes", type=float, help="one `checkfree local` run of CheckFree+ with stage groups "
                   "under generated faults and a coordinator failover, stopped after this many minutes")
    s.add_argument("--soak-steps", type=int, default=20000, help="its steps (it stops at whichever comes first)")
    s.add_argument("--no-netns", action="store_true", help="no partitions: without it, the soak runs every process in a "
                   "network namespace of its own and partitions peers (where root allows)")
    p.set_defaults(func=run_dst)


def _line(i: int | str, o) -> str:
    s = o.schedule.setup
    faults = ", ".join(f"{f.kind.value}@{f.iteration}" for f in o.schedule.faults) or "no faults"
    verdict = f"DIVERGED: {o.divergences[0][:160]}" if o.divergences else "ok"
    return (f"dst: #{i} {s.strategy} S={s.stages} R={s.replicas} {s.schedule} {s.wire_dtype}: {faults} "
            f"({len(o.fired)} fired) -> {verdict} [{o.seconds:.1f} s]")


def _record(path: Path, i: int | str, o) -> None:
    with open(path, "a") as f:
        f.write(json.dumps({"index": i, "schedule": json.loads(o.schedule.to_json()),
                            "fired": [x.describe() for x in o.fired], "trace": o.trace,
                            "divergences": o.divergences, "seconds": round(o.seconds, 3), "rss_mb": round(o.rss_mb, 1),
                            "status": (o.swarm or {}).get("status"), "signature": o.signature()}) + "\n")


def _result(out: Path, started: float, load: str, commit: str, **fields) -> None:
    """<out>/result.json: how this run was made (command, commit, load average at the start, wall time) and what it
    found; dst/report.py renders the copies kept in dst/results/ into docs/dst.md."""
    (out / "result.json").write_text(json.dumps({
        "command": " ".join(["checkfree", "chaos", "dst", *sys.argv[sys.argv.index("dst") + 1:]])
        if "dst" in sys.argv else "checkfree chaos dst", "commit": commit, "load": load,
        "wall_s": round(time.monotonic() - started, 1), **fields}, indent=1) + "\n")


def _private_tmp(out: Path) -> Path:
    """This process's temporary directory (and its children's): what a schedule leaves there is its own."""
    tmp = out / "tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tempfile.tempdir = str(tmp)
    os.environ["TMPDIR"] = str(tmp)
    return tmp


def run_dst(args: argparse.Namespace) -> int:
    try:
        import hypothesis  # noqa: F401 - the generator and shrinker
    except ImportError:
        raise ValueError("checkfree chaos dst needs hypothesis: pip install 'checkfree[dst]'") from None
    if args.schedules < 1 or args.repeat < 1:
        raise ValueError("--schedules and --repeat must be >= 1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    _private_tmp(out)
    report_path = out / "report.jsonl"
    report_path.write_text("")
    from dst.report import code_commit

    started, load = time.monotonic(), " ".join(f"{x:.2f}" for x in os.getloadavg())
    at = (started, load, code_commit())  # the code this run runs: taken before it starts
    if args.replay:
        return _replay(args, out, report_path, at)
    if args.soak_minutes is not None:
        return _soak(args, out)
    from dst.search import explore

    def show(i: int, o) -> None:
        print(_line(i, o), flush=True)
        _record(report_path, i, o)

    report = explore(args.schedules, args.seed, out, shrink_s=args.shrink_seconds, stop_at_first=args.stop_at_first,
                     on_outcome=show, max_faults=args.max_faults, tier=args.tier)
    for k, found in enumerate(report.found):
        print(f"dst: divergence in schedule #{found.index} (hypothesis seed {found.seed}):", flush=True)
        for d in found.first.divergences[:6]:
            print(f"dst:   {d[:400]}")
        if found.shrunk is not None:
            path = out / f"shrunk-{k}.json"
            path.write_text(found.shrunk.schedule.to_json() + "\n")
            again = "diverges again" if found.replayed and found.replayed.divergences else "DID NOT diverge again"
            tier = f" --tier {args.tier}" if args.tier != "inprocess" else ""
            print(f"dst: shrunk to ({again} when replayed; replay: checkfree chaos dst{tier} --replay {path}):")
            for line in found.shrunk.schedule.describe().splitlines():
                print(f"dst:   {line}")
            for d in (found.replayed.divergences if found.replayed else [])[:4]:
                print(f"dst:   replayed: {d[:400]}")
    rss = report.rss_mb
    if rss:
        print(f"dst: resident memory {rss[0]:.0f} MB after the first schedule, {max(rss):.0f} MB at most, "
              f"{rss[-1]:.0f} MB after the last; {report.seconds:.0f} s, {report.shrink_runs} shrinking runs")
    from dst.report import summarize

    _result(out, *at, summary=summarize(report_path))
    print(f"dst: {report.schedules} schedules, {len(report.found)} divergences, {report.faults} faults injected",
          flush=True)
    return 1 if report.found else 0


def _replay(args: argparse.Namespace, out: Path, report_path: Path, at: tuple[float, str, str]) -> int:
    from dst.schedule import Schedule
    from dst.search import replay

    path = Path(args.replay)
    if not path.is_file():
        raise ValueError(f"--replay: {path} does not exist")
    schedule = Schedule.from_json(path.read_text())
    print("dst: replaying\n" + "\n".join(f"dst:   {line}" for line in schedule.describe().splitlines()), flush=True)
    signatures, diverged, faults = Counter(), 0, 0
    for i in range(args.repeat):
        o = replay(schedule, out / f"replay{i}", tier=args.tier)
        print(_line(f"replay{i}", o), flush=True)
        for d in o.divergences[:6]:
            print(f"dst:   {d[:400]}")
        _record(report_path, f"replay{i}", o)
        signatures[o.signature()] += 1
        diverged += bool(o.divergences)
        faults += len(o.fired)
        if not o.divergences:
            shutil.rmtree(out / f"replay{i}", ignore_errors=True)
    if args.repeat > 1:
        common, n = signatures.most_common(1)[0]
        print(f"dst: the same outcome in {n} of {args.repeat} runs ({len(signatures)} distinct outcomes)")
        _result(out, *at, schedule=schedule.describe(), repeats=args.repeat, same=n,
                distinct=len(signatures), diverged=diverged)
    print(f"dst: {args.repeat} schedules, {diverged} divergences, {faults} faults injected", flush=True)
    return 1 if diverged else 0


def _soak(args: argparse.Namespace, out: Path) -> int:
    from dst.real import soak

    if args.soak_minutes <= 0 or args.soak_steps < 10:
        raise ValueError("--soak-minutes must be > 0 and --soak-steps >= 10")
    print(f"dst: soak: checkfree local, CheckFree+ with stage groups, {args.soak_steps} steps or "
          f"{args.soak_minutes:g} minutes, faults seeded by {args.seed}; logs in {out}", flush=True)
    r = soak(args.soak_steps, args.soak_minutes, args.seed, out, netns=not args.no_netns)
    rss = r["rss_mb"]
    settled = [m for t, _, m in rss if t >= rss[-1][0] * 0.2] if rss else []
    print(f"dst: soak: {r['status']} after {r['steps']} steps in {r['minutes']} min; {r['kills']} faults injected, "
          f"{r['failures']} stage failures, {r['replicas_lost']} replicas lost, {r['recoveries']} recoveries, "
          f"{r['fallbacks']} fallbacks, {r['recovery_retries']} recovery retries, {r['handovers']} handovers, "
          f"{r['takeovers']} coordinator takeovers; lost steps {r['lost_steps']}")
    if settled:
        print(f"dst: soak: resident memory of the swarm's processes {settled[0]:.0f} MB at 20% of the run, "
              f"{max(settled):.0f} MB at most after that, {settled[-1]:.0f} MB at the end")
    print(f"dst: soak: left behind: {'; '.join(r['leftovers']) or 'nothing'}; {out / 'soak.json'}")
    return 1 if r["leftovers"] or r["status"] not in ("completed", "interrupted") else 0
