"""The real-process leg: a schedule run by `checkfree local` (real processes, hivemind, SIGKILLs and SIGTERMs from the
launcher, network-namespace partitions where root allows), checked against the simulator like the in-process
tier, and for what real processes leave behind: processes, socket files, temporary directories.

Faults reach real processes through the launcher's chaos flags, so only the kinds those express run here
(`REAL_KINDS`): kills at the start of a step (a stage group's replica: after its first forward), whole groups and
adjacent stages, a peer at its (mb+1)-th forward or backward pass or as it takes the COMMIT (--chaos-peer-kill),
a replica half-way through the gradient all-reduce, a replacement in the middle of its rebuild, the coordinator
(failover to a standby, or a restart) between steps or half-way through a commit, a SIGTERM, a partition of one
iteration (--netns: root), a slowed stage, a peer joining as an iteration starts (--chaos-joins). The kills inside
a peer's work (a pass, the all-reduce, the COMMIT, a rebuild's pulls) are its own: the coordinator's injector arms
the peer's fault hook (checkfree.peer_faults), through the control channel a peer started with --fault-hook
serves, as the request that reaches it leaves.
Partitions of more than one iteration, and a mid-rebuild kill after a second pull or of a restore's pulls, are the
in-process tier's.

`soak(...)` is the long leg: one `checkfree local` run for a given time under a generated fault sequence, its
process tree's memory sampled.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from checkfree.failures import write_trace
from checkfree.net.lifeline import held_socket_files, living, process_tree
from checkfree.rundir import read_jsonl
from dst import check
from dst.inject import Fired
from dst.run import Outcome, _simulate, build_config
from dst.schedule import Fault, Kind, Schedule

__all__ = ["REAL_KINDS", "local_args", "expected_lines", "run_real", "Watch", "netns_available"]

REAL_KINDS = (Kind.KILL_BEFORE_STEP, Kind.KILL_GROUP, Kind.KILL_ADJACENT, Kind.KILL_MID_FORWARD, Kind.KILL_MID_BACKWARD,
              Kind.KILL_MID_COMMIT, Kind.KILL_MID_REDUCE, Kind.KILL_MID_REBUILD, Kind.COORDINATOR_FAILOVER,
              Kind.COORDINATOR_RESTART, Kind.SIGTERM, Kind.SLOW, Kind.PARTITION, Kind.JOIN)
PEER_KILLS = {Kind.KILL_MID_FORWARD: "forward", Kind.KILL_MID_BACKWARD: "backward", Kind.KILL_MID_COMMIT: "commit"}
TIMEOUTS = ["--heartbeat-ttl", "2", "--rpc-timeout", "10", "--step-timeout", "60", "--join-timeout", "180"]
MARK = "CHECKFREE_DST_RUN"  # in the environment of every process of one real run (and nobody else's)
SHORT_TMP = "/tmp" if os.path.isdir("/tmp") else None  # where a real run's temporary directory goes (see run_real)


@contextlib.contextmanager
def _swarm(cmd: list[str], log, env: dict):
    """`checkfree local` in a session of its own (its SIGKILLs of process groups stay inside it). If this process is
    interrupted (Ctrl-C, or SIGTERM, made an exit here) the swarm is stopped too, as `checkfree local` stops on
    SIGTERM, rather than left running without its parent; and its temporary directory (`env["TMPDIR"]`) goes."""
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm) if main else None
    try:
        yield proc
    except BaseException:
        if proc.poll() is None:
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=120)
        if env.get("TMPDIR"):
            shutil.rmtree(env["TMPDIR"], ignore_errors=True)
        raise
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def netns_available() -> bool:
    from swarm.netlab import NetLab

    return NetLab.unavailable() is None


def local_args(schedule: Schedule, out: Path, netns: bool) -> list[str]:
    """`checkfree local` flags for `schedule` (its trace files are written into `out`)."""
    s = schedule.setup
    args = ["--preset", "tiny", "--stages", str(s.stages), "--steps", str(s.steps), "--strategy", s.strategy,
            "--fallback", s.fallback, "--replicas", str(s.replicas), "--schedule", s.schedule,
            "--wire-dtype", s.wire_dtype, "--snapshot-every", str(s.every), "--checkpoint-every", str(s.every),
            "--eval-every", "0", "--no-progress", "--out", str(out / "swarm"), "--dump-recovery", str(out / "dump"),
            *TIMEOUTS]
    if s.soft_errors:
        args += ["--abft", "--inject-soft-errors", str(s.soft_errors)]
    kills, whole, reduce, preempt, cut, rebuild, joins = [], set(), [], [], [], [], []
    for f in schedule.faults:
        if f.kind is Kind.KILL_BEFORE_STEP:
            kills.append((f.iteration, f.stage))
        elif f.kind in (Kind.KILL_GROUP, Kind.KILL_ADJACENT):
            for st in [f.stage] + ([f.stage + 1] if f.kind is Kind.KILL_ADJACENT else []):
                kills.append((f.iteration, st))
                whole.add((f.iteration, st))
        elif f.kind is Kind.KILL_MID_REDUCE:
            reduce.append((f.iteration, f.stage))
        elif f.kind is Kind.SIGTERM:
            preempt.append((f.iteration, f.stage))
        elif f.kind is Kind.PARTITION and netns:
            cut.append((f.iteration, f.stage))
        elif f.kind is Kind.KILL_MID_REBUILD:
            rebuild.append(f.iteration)
        elif f.kind is Kind.SLOW:
            args += ["--chaos-slow", f"{f.stage}:{f.delay_ms / 1000:g}@{f.iteration}"]
        elif f.kind in PEER_KILLS:
            args += ["--chaos-peer-kill", f"{PEER_KILLS[f.kind]}:{f.iteration}:{f.stage}:{f.replica}:{f.mb}"]
        elif f.kind is Kind.JOIN:
            joins.append(f.iteration)
    for flag, lines in (("--trace", kills), ("--reduce-kill-trace", reduce), ("--preempt-trace", preempt),
                        ("--partition-trace", cut)):
        if lines:
            path = out / f"{flag.strip('-')}.csv"
            write_trace(path, lines, whole if flag == "--trace" else frozenset())
            args += [flag, str(path)]
    if not kills:
        args.append("--no-churn")
    if rebuild:
        args += ["--chaos-rebuild-kills", ",".join(map(str, sorted(set(rebuild))))]
    if joins:
        args += ["--chaos-joins", ",".join(map(str, sorted(joins)))]
    if cut:
        args.append("--netns")
    coordinator = next((f for f in schedule.faults if f.kind in (Kind.COORDINATOR_FAILOVER, Kind.COORDINATOR_RESTART)),
                       None)
    if coordinator is not None:
        args += ["--kill-coordinator-at", str(max(1, min(coordinator.iteration, s.steps - 1))),
                 "--kill-coordinator-in", coordinator.where, "--coordinator-failover",
                 "standby" if coordinator.kind is Kind.COORDINATOR_FAILOVER else "restart"]
    return args


def expected_lines(schedule: Schedule, netns: bool) -> list[tuple[int, int, bool]]:
    """The simulator's failures for the kills the launcher makes (full stage groups assumed)."""
    r = schedule.setup.replicas
    lines = []
    for f in schedule.faults:
        if f.kind is Kind.KILL_BEFORE_STEP or (f.kind is Kind.PARTITION and netns) or f.kind is Kind.KILL_MID_REDUCE:
            lines.append((f.iteration, f.stage, False))
        elif f.kind in (Kind.KILL_GROUP, Kind.KILL_ADJACENT):
            lines += [(f.iteration, st, r > 1) for st in [f.stage] + ([f.stage + 1] if f.kind is Kind.KILL_ADJACENT
                                                                       else [])]
        elif f.kind in PEER_KILLS:  # (a death at the COMMIT: the others committed, the stage is lost for the next)
            lines.append((f.iteration + (f.kind is Kind.KILL_MID_COMMIT), f.stage, False))
    return sorted(lines)


@dataclass
class Watch:
    """Samples a process and its descendants every `every` s until it exits: resident memory and the socket files
    they hold (what a SIGKILLed member would leave)."""

    pid: int
    every: float = 2.0
    rss: list[tuple[float, int, int]] = field(default_factory=list)  # (seconds since start, processes, RSS bytes)
    sockets: set[str] = field(default_factory=set)
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> Watch:
        threading.Thread(target=self._run, daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        t0 = time.monotonic()
        while not self._stop.is_set():
            tree = living(process_tree(self.pid))
            if not tree:
                return
            self.rss.append((round(time.monotonic() - t0, 1), len(tree), sum(_rss(p) for p in tree)))
            self.sockets |= held_socket_files(tree)
            self._stop.wait(self.every)


def identical_dumped_replicas(dump: Path) -> list[str]:
    """Every stage group's replicas that lived to the end dumped the same weights and Adam state (--dump-recovery
    writes final-stage<S>-<peer>.safetensors and its -optim file when the run has stage groups)."""
    import torch
    from safetensors.torch import load_file

    groups: dict[str, list[tuple[str, dict]]] = {}
    for f in sorted(dump.glob("final-stage*-*.safetensors")):
        if f.name.endswith("-optim.safetensors"):
            continue
        stage, _, peer = f.name[len("final-stage"):-len(".safetensors")].partition("-")
        state = {**load_file(str(f)), **{"optim/" + k: v for k, v in
                                         load_file(str(f.with_name(f.name[:-12] + "-optim.safetensors"))).items()}}
        groups.setdefault(stage, []).append((peer, state))
    out = []
    for stage, members in sorted(groups.items()):
        (p0, first), *rest = members
        for peer, state in rest:
            bad = [k for k in first if k not in state or not torch.equal(first[k], state[k])]
            if bad or state.keys() != first.keys():
                out.append(f"stage {stage}: replicas {p0} and {peer} differ in {bad[:4]}")
    return out


def _rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def marked(mark: str) -> set[int]:
    """Living processes whose environment carries `MARK=mark`."""
    out = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if f"{MARK}={mark}".encode() in open(f"/proc/{entry}/environ", "rb").read().split(b"\0"):
                    out.add(int(entry))
    return living(out)


def leftovers(mark: str, watch: Watch, tmp: Path) -> list[str]:
    """What a finished real run left: processes, socket files its processes held, anything in the temporary
    directory it was given (its launcher's own, with its processes' multiprocessing and torch directories)."""
    out = []
    deadline = time.monotonic() + 10
    while (procs := marked(mark)) and time.monotonic() < deadline:
        time.sleep(0.2)
    if procs:
        out.append(f"processes left running: {sorted(procs)}")
    if left := sorted(s for s in watch.sockets if os.path.exists(s)):
        out.append(f"socket files left: {left}")
    # torch's compile cache directory (torchinductor_<user>) is made by the launcher's own imports and kept by torch
    # for every later process by design, as the in-process tier takes it (dst.run._warm_up): not a leftover
    if left := sorted(n for n in os.listdir(tmp) if not n.startswith("torchinductor_")):
        out.append(f"temporary files left: {left}")
    return out


def run_real(schedule: Schedule, workdir: Path, cache_dir: str | None = None, *, timeout: float = 1800) -> Outcome:
    """Run `schedule` with `checkfree local` and check it (see the module docstring)."""
    t0 = time.perf_counter()
    workdir.mkdir(parents=True, exist_ok=True)
    netns = schedule.needs(Kind.PARTITION) and netns_available()
    mark = uuid.uuid4().hex
    spares = 2 + sum(1 for f in schedule.faults if f.kind is not Kind.SLOW)
    cmd = [sys.executable, "-m", "checkfree", "local", *local_args(schedule, workdir, netns), "--spares", str(spares)]
    # the run's own temporary directory, short: its processes' unix sockets (torch's shared-memory manager, p2pd,
    # multiprocessing) live there, and a socket's path has at most 107 bytes (under a test's temporary directory the
    # coordinator failed at start: torch_shm_manager "Invalid argument")
    tmp = Path(tempfile.mkdtemp(prefix="dst-real-", dir=SHORT_TMP))
    env = {**os.environ, MARK: mark, "TMPDIR": str(tmp), **({"CHECKFREE_CACHE": cache_dir} if cache_dir else {})}
    outcome = Outcome(schedule)
    with open(workdir / "log.txt", "w") as log, _swarm(cmd, log, env) as proc:
        watch = Watch(proc.pid).start()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            outcome.divergences.append(f"checkfree local did not finish within {timeout:g} s")
            proc.terminate()
            proc.wait(timeout=60)
        watch.stop()
    out = workdir / "swarm"
    problems = outcome.divergences
    summary_path = out / "summary.json"
    outcome.swarm = json.loads(summary_path.read_text()) if summary_path.exists() else None
    metrics = read_jsonl(out / "metrics.jsonl") if (out / "metrics.jsonl").exists() else []
    times = sorted(m["time"] for m in metrics)
    iteration_at = lambda t: sum(1 for x in times if x < t)  # noqa: E731
    recorded = check.recorded_lines(out, iteration_at, schedule.setup.replicas)
    expected = expected_lines(schedule, netns)
    terminated = {(f.iteration, f.stage) for f in schedule.faults if f.kind is Kind.SIGTERM}
    by_record = [(it, s, w) for it, s, w, _ in recorded if (it, s) in terminated or (it - 1, s) in terminated]
    outcome.trace = sorted(expected + by_record)
    outcome.sim = _simulate(build_config(schedule.setup, cache_dir), workdir / "sim", outcome.trace)
    problems += check.same_end(outcome.swarm, outcome.sim)
    if outcome.swarm is not None and outcome.sim is not None:
        problems += check.same_losses(out, workdir / "sim")
        problems += check.same_recoveries(out, workdir / "sim")
        problems += check.same_failures(out, workdir / "sim")
        outcome.losses = [float(m["loss"]) for m in metrics]
    if schedule.setup.replicas > 1:
        problems += identical_dumped_replicas(workdir / "dump")
    problems += leftovers(mark, watch, tmp)
    shutil.rmtree(tmp, ignore_errors=True)
    steps_done = (outcome.swarm or {}).get("steps", 0)
    outcome.fired = [Fired(f, f.iteration, f.iteration, [], None) for f in schedule.faults  # (as scheduled)
                     if f.iteration <= steps_done and (f.kind is not Kind.PARTITION or netns)]
    outcome.seconds = time.perf_counter() - t0
    outcome.rss_mb = max((r for _, _, r in watch.rss), default=0) / 2**20
    (workdir / "rss.json").write_text(json.dumps(watch.rss))
    return outcome


FAILOVER_BY = 150  # the soak's coordinator failover: a third of the way in, or at this step if sooner


def soak_faults(steps: int, seed: int, stages: int, netns: bool) -> list[Fault]:
    """The long leg's faults: one every 3 to 8 steps from step 2 on, of kinds in turn (a replica killed mid-step,
    a whole group, a replica mid-reduce, a replacement mid-rebuild, a SIGTERM, a partition with --netns), each at a
    seeded stage; and one coordinator failover a third of the way in, by step FAILOVER_BY at the latest: a soak is
    stopped by its deadline, usually long before its last step, and the failover must happen in it."""
    import random

    rng = random.Random(seed)
    kinds = [Kind.KILL_BEFORE_STEP, Kind.KILL_GROUP, Kind.KILL_MID_REDUCE, Kind.KILL_MID_REBUILD, Kind.SIGTERM]
    kinds += [Kind.PARTITION] if netns else []
    faults, step, i = [], 2, 0
    while step < steps - 2:
        kind, stage = kinds[i % len(kinds)], rng.randrange(stages)
        if kind is Kind.KILL_MID_REBUILD:  # the stage a whole group's loss needs rebuilt, and its rebuilder killed
            faults.append(Fault(Kind.KILL_GROUP, step, stage=stage))
        faults.append(Fault(kind, step, stage=0 if kind is Kind.KILL_MID_REBUILD else stage))
        step += rng.randint(3, 8)
        i += 1
    faults.append(Fault(Kind.COORDINATOR_FAILOVER, max(1, min(steps // 3, FAILOVER_BY)), where="step"))
    return faults


def soak(steps: int, minutes: float, seed: int, workdir: Path, cache_dir: str | None = None, *,
         stages: int = 4, replicas: int = 2, netns: bool = True) -> dict:
    """One `checkfree local` run of CheckFree+ with stage groups for `steps` steps (stopped by SIGTERM after
    `minutes`) under `soak_faults`; returns its figures: faults, recoveries, lost steps, the memory of its process
    tree over time, what it left behind. Written to <workdir>/soak.json."""
    from dst.report import code_commit as commit
    from dst.schedule import Setup

    workdir.mkdir(parents=True, exist_ok=True)
    netns = netns and netns_available()
    schedule = Schedule(Setup(strategy="checkfree+", stages=stages, replicas=replicas, steps=steps, fallback="copy"),
                        tuple(soak_faults(steps, seed, stages, netns)))
    (workdir / "schedule.json").write_text(schedule.to_json() + "\n")
    # the run's own temporary directory, checked for leftovers: not `checkfree chaos dst`'s (<out>/tmp), where the
    # soak's own process puts what it makes (torch's compile cache directory: reported as the run's leftover)
    mark, tmp = uuid.uuid4().hex, workdir / "swarm-tmp"
    tmp.mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "checkfree", "local", *local_args(schedule, workdir, netns), "--spares", "2"]
    env = {**os.environ, MARK: mark, "TMPDIR": str(tmp), **({"CHECKFREE_CACHE": cache_dir} if cache_dir else {})}
    t0, load, code = time.monotonic(), " ".join(f"{x:.2f}" for x in os.getloadavg()), commit()
    with open(workdir / "log.txt", "w") as log, _swarm(cmd, log, env) as proc:
        watch = Watch(proc.pid, every=5.0).start()
        try:
            proc.wait(timeout=minutes * 60)
            stopped = False
        except subprocess.TimeoutExpired:  # time is up: a graceful stop (the coordinator records the run's end)
            proc.terminate()
            proc.wait(timeout=120)
            stopped = True
        watch.stop()
    out = workdir / "swarm"
    events = read_jsonl(out / "events.jsonl") if (out / "events.jsonl").exists() else []
    kinds = [e["event"] for e in events]
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    steps_done = summary.get("steps", 0)
    report = {
        "command": " ".join(["checkfree", "local", *cmd[4:]]), "seed": seed, "load": load, "commit": code,
        "minutes": round((time.monotonic() - t0) / 60, 2),
        "stopped_at_deadline": stopped, "status": summary.get("status"), "steps": steps_done,
        "faults_scheduled": sum(1 for f in schedule.faults if f.iteration < steps_done),
        "kills": sum(1 for k in kinds if k.startswith("chaos_") and k != "chaos_heal"),
        "partitions": kinds.count("chaos_partition"), "failures": kinds.count("failure"),
        "replicas_lost": kinds.count("replica_lost"), "recoveries": kinds.count("recovery"),
        "fallbacks": kinds.count("fallback"), "recovery_retries": kinds.count("recovery_retry"),
        "handovers": kinds.count("handover"), "takeovers": kinds.count("coordinator_takeover"),
        "lost_steps": summary.get("lost_steps"), "netns": netns,
        "rss_mb": [(t, n, round(r / 2**20, 1)) for t, n, r in watch.rss],
        "leftovers": leftovers(mark, watch, tmp),
    }
    (workdir / "soak.json").write_text(json.dumps(report, indent=1))
    return report
