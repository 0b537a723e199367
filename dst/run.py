"""One schedule end to end: the in-process swarm under its faults, the simulator given the same faults, the
invariants (dst.check), and what the run left behind (tasks, threads, file descriptors, temporary files)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from checkfree.config import RunConfig, preset
from checkfree.net.faulty import Injector
from checkfree.net.lifeline import living, process_tree
from checkfree.rundir import read_jsonl
from dst import check
from dst.inject import Fired
from dst.schedule import AVERAGING, Schedule, Setup
from dst.swarm import SimSwarm

__all__ = ["Outcome", "build_config", "setup_problem", "run_schedule", "by_record_only", "Resources"]


def build_config(setup: Setup, cache_dir: str | None = None) -> RunConfig:
    """The tiny model's run for `setup` (evaluation at the end only)."""
    cfg = preset("tiny")
    cfg.num_stages = setup.stages
    cfg.recovery.strategy, cfg.recovery.fallback = setup.strategy, setup.fallback
    t = cfg.train
    t.num_steps, t.eval_every, t.replicas = setup.steps, 0, setup.replicas
    t.schedule, t.wire_dtype = setup.schedule, setup.wire_dtype
    cfg.strategy.snapshot_every = cfg.strategy.checkpoint_every = setup.every
    st = cfg.strategy
    st.snapshot_format, st.snapshot_moments = setup.snap_format, setup.snap_moments
    st.snapshot_budget, st.snapshot_rebuild = setup.snap_budget, setup.snap_rebuild
    cfg.guard.abft, cfg.guard.inject_soft_errors = setup.soft_errors > 0, setup.soft_errors
    cfg.data.cache_dir = cache_dir
    return cfg


def setup_problem(setup: Setup) -> str | None:
    """Why the swarm (or the simulator) refuses `setup`, or None."""
    from checkfree.stage_groups import check_swarm_groups
    from checkfree.strategies import build_strategy

    if setup.replicas > 1 and setup.strategy not in AVERAGING:
        return f"stage groups run with the averaging strategies only, not {setup.strategy}"
    if setup.strategy == "baft" and setup.stages < 3:
        return "baft needs pipeline bubbles shared with a holder: three stages or more"
    try:
        cfg = build_config(setup)
        check_swarm_groups(cfg)
        build_strategy(cfg)
    except ValueError as e:
        return str(e)
    return None


@dataclass
class Resources:
    """What this process holds: open file descriptors, threads, entries of the temporary directory."""

    fds: list[str]  # what each open descriptor is (a file's path, socket:[inode], pipe:[inode], ...)
    threads: list[str]
    temp: set[str]
    children: set[int]  # processes this one started that still run (e.g. reft's snapshot companions)

    @staticmethod
    def now() -> Resources:
        gc.collect()
        fds = []
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                fds.append(os.readlink(f"/proc/self/fd/{fd}"))
        tree = process_tree(os.getpid()) - {os.getpid()}
        return Resources(fds, sorted(t.name for t in threading.enumerate()), set(os.listdir(tempfile.gettempdir())),
                         living(tree))

    def leaks_since(self, before: Resources) -> list[str]:
        out = []
        if len(self.fds) > len(before.fds):
            kinds = Counter(f.split(":")[0] if ":" in f else f for f in self.fds)
            kinds.subtract(Counter(f.split(":")[0] if ":" in f else f for f in before.fds))
            out.append(f"file descriptors: {len(before.fds)} before, {len(self.fds)} after (more: "
                       f"{sorted(k for k, n in kinds.items() if n > 0)})")
        extra = sorted((Counter(self.threads) - Counter(before.threads)).elements())
        if extra:
            out.append(f"threads left running: {extra}")
        left = self.temp - before.temp
        if left:
            out.append(f"temporary files left: {sorted(left)}")
        if self.children - before.children:
            out.append(f"processes left running: {sorted(self.children - before.children)}")
        return out


_WARM: list[bool] = []


def _warm_up(cfg: RunConfig) -> None:
    """Prepare the tokens once (as `checkfree local` does before its peers start: each would tokenize the corpus
    itself), and allocate what torch allocates once per process, so that a schedule is not charged with it: the
    pipe of libuv's loop behind a TCPStore (the stage groups' gloo rendezvous) and torch's compile cache
    directory."""
    if _WARM:
        return
    import datetime

    from checkfree.data import build_data

    build_data(cfg.data, vocab_size=cfg.model.vocab_size, context_length=cfg.model.context_length,
               seed=cfg.train.seed, microbatch_size=cfg.train.microbatch_size)

    import torch._dynamo  # noqa: F401 - makes its cache directory in the temporary directory
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
    del store
    _WARM.append(True)


def _settle(before: Resources, seconds: float = 5.0) -> Resources:
    """Resources once threads that are ending have ended (compute threads finish their last job), bounded."""
    deadline = time.monotonic() + seconds
    while True:
        now = Resources.now()
        if not now.leaks_since(before) or time.monotonic() > deadline:
            return now
        time.sleep(0.05)


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


@dataclass
class Outcome:
    """What one schedule did and which invariants it broke (`divergences`, empty when all hold)."""

    schedule: Schedule
    divergences: list[str] = field(default_factory=list)
    fired: list[Fired] = field(default_factory=list)
    swarm: dict | None = None
    sim: dict | None = None
    trace: list[tuple[int, int, bool]] = field(default_factory=list)
    seconds: float = 0.0
    rss_mb: float = 0.0
    losses: list[float] = field(default_factory=list)

    def signature(self) -> str:
        """A digest of the outcome (status, losses to 6 digits, failures, recoveries, divergences): the same
        schedule run again must give the same one."""
        doc = {"status": (self.swarm or {}).get("status"), "error": (self.swarm or {}).get("error"),
               "losses": [f"{x:.6g}" for x in self.losses], "trace": self.trace,
               "fired": [(f.fault.kind.value, f.iteration) for f in self.fired],
               "divergences": sorted(d.split(":")[0] for d in self.divergences)}
        return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


def _simulate(cfg: RunConfig, out: Path, trace: list[tuple[int, int, bool]]) -> dict | None:
    from checkfree.failures import write_trace
    from checkfree.simulator import Simulator

    if trace:
        path = out.parent / "sim-trace.csv"
        write_trace(path, [(i, s) for i, s, _ in trace], {(i, s) for i, s, w in trace if w})
        cfg.failures.trace = str(path)
    try:
        return Simulator(cfg, out, progress=False).run()
    except Exception:  # noqa: BLE001 - an abort (or a failure) is an outcome, written into the summary
        path = out / "summary.json"
        return json.loads(path.read_text()) if path.exists() else None


@contextlib.contextmanager
def _logged(path: Path):
    """The run's prints and log lines go to `path` (a schedule's own log), not to the terminal."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f, contextlib.redirect_stdout(f):
        handler = logging.StreamHandler(f)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root = logging.getLogger()
        quiet = [(h, h.level) for h in root.handlers]
        for h, _ in quiet:
            h.setLevel(logging.CRITICAL + 1)
        root.addHandler(handler)
        try:
            yield
        finally:
            root.removeHandler(handler)
            handler.close()
            for h, level in quiet:
                h.setLevel(level)


def _left_by(f: Fired, iteration: int, stage: int, pid: str) -> bool:
    """Whether a failure the swarm recorded is what fault `f` came to when only the record can tell (a SIGTERM: a
    leave without a handover). A stage a new coordinator finds unserved has no peer in its record: it counts if it
    is the leaving peer's stage, then or an iteration later."""
    if f.expect is not None:
        return False
    return pid in f.victims or (not pid and stage == f.fault.stage and f.iteration <= iteration <= f.iteration + 1)


def by_record_only(recorded: list[tuple[int, int, bool, str]], fired: list[Fired]) -> list[tuple[int, int, bool]]:
    """The failures the swarm recorded (`check.recorded_lines`) that only its record explains (`_left_by`): not one
    whose peer a fault that expects failures took (a SIGTERMed peer then killed before it left is that fault's
    failure, counted once)."""
    expected_victims = {v for f in fired if f.expect for v in f.victims}
    return [(it, s, w) for it, s, w, pid in recorded
            if any(_left_by(f, it, s, pid) for f in fired) and pid not in expected_victims]


def run_schedule(schedule: Schedule, workdir: Path, cache_dir: str | None = None, *, keep: bool = False,
                 rules: Callable[[SimSwarm], Injector] | None = None, standby_apart: bool = False) -> Outcome:
    """Run `schedule` in the swarm and in the simulator under `workdir` (removed afterwards unless `keep` or a
    divergence) and check every invariant. `rules(swarm)`: more faults at protocol points, tried before the
    schedule's (a test's `checkfree.net.faulty.FaultRules`; they must not lose a peer the simulator would not).
    `standby_apart`: the hot standby keeps its copy of the run in a directory of its own (workdir/"standby", no
    shared disk); the run's record is checked there once it took over."""
    t0 = time.perf_counter()
    workdir.mkdir(parents=True, exist_ok=True)
    cfg = build_config(schedule.setup, cache_dir)
    outcome = Outcome(schedule)
    _warm_up(cfg)
    before = Resources.now()
    swarm = SimSwarm(cfg, workdir / "swarm", schedule, standby_out=workdir / "standby" if standby_apart else None)
    if rules is not None:
        swarm.rules = rules(swarm)
    with _logged(workdir / "log.txt"):
        summary = asyncio.run(swarm.run())
    outcome.fired, outcome.swarm = list(swarm.injector.fired), summary
    problems = outcome.divergences
    out = workdir / "swarm"  # the run's record: the standby's own directory once it took over there
    if standby_apart and check.events(workdir / "standby", "coordinator_takeover"):
        out = workdir / "standby"
    if swarm.error and not (out / "summary.json").exists():
        problems.append(f"swarm failed without a summary: {swarm.error}")
    problems += swarm.leaks
    problems += [f"the fault injector failed (a harness bug): {e}" for e in swarm.injector.errors]
    gone = {e.get("peer_id") for e in check.events(out, "replica_lost", "leave", "retired")}
    live = {p for g in swarm.injector.round.table.values() for p in g} - swarm.killed - gone  # the last step's
    problems += check.identical_replicas(swarm.daemons, live, schedule.setup.strategy)
    recorded = check.recorded_lines(out, swarm.injector.iteration_at, schedule.setup.replicas)
    trail = swarm.injector.trail
    del swarm
    expected = [line for f in outcome.fired if f.expect is not None for line in f.expect]
    by_record = by_record_only(recorded, outcome.fired)
    outcome.trace = sorted(expected + by_record)
    with _logged(workdir / "sim-log.txt"):
        outcome.sim = _simulate(build_config(schedule.setup, cache_dir), workdir / "sim", outcome.trace)
    if summary is None and (out / "summary.json").exists():
        outcome.swarm = summary = json.loads((out / "summary.json").read_text())
    problems += check.same_end(summary, outcome.sim)
    if summary is not None and outcome.sim is not None:
        problems += check.same_losses(out, workdir / "sim")
        problems += check.same_recoveries(out, workdir / "sim")
        problems += check.same_failures(out, workdir / "sim")
        problems += check.accounted(out, outcome.fired, recorded, expected + by_record)
        outcome.losses = [float(m["loss"]) for m in read_jsonl(out / "metrics.jsonl")]
    problems += _settle(before).leaks_since(before)
    outcome.seconds, outcome.rss_mb = time.perf_counter() - t0, _rss_mb()
    if problems:
        (workdir / "crossings.txt").write_text("\n".join(trail) + "\n")
        (workdir / "schedule.json").write_text(schedule.to_json() + "\n")
    elif not keep:
        shutil.rmtree(workdir, ignore_errors=True)
    return outcome
