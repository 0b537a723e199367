"""Fig. 2's question on a trained network: paired branches from one warm checkpoint (issue 27).

A study fine-tunes (or trains) one trunk in the simulator and saves its full state (weights, Adam, omega)
at each branch point. Every branch resumes from that save (`checkfree.saves`, `Simulator(resume=True)`)
with its own data order (`train.seed`), fails one stage at the branch point through a one-line failure
trace, rebuilds it with one initialisation, evaluates right after the rebuild (`train.eval_after_recovery`:
the immediate damage) and trains on, evaluated every `eval_every` steps. The failure-free branch of the
same seed is the reference. Branches whose rebuild is the same arithmetic are run once (`signature`).

omega variants. A branch's save is the trunk's with each stage's omega rewritten for the branch's
(norm kind, scope), from the trunk's metrics line of the step before the branch point (post- and pre-clip
norms of the stage and of its blocks; `StepStats.omega`): the trunk has no failure, so its training does
not depend on omega, and every variant's value is exactly what that variant would have recorded.

Paired evaluation (issue 39). A study with `heldout` set evaluates every branch on the same held-out sequences of
two corpora (`experiments.heldout`: the run's own held-out split and the King James Bible), each sequence's loss
kept (`heldout.jsonl` in the run directory), so that two inits pair up sequence by sequence and trunk by trunk;
`trunk_seeds` trains several trunks (one per seed: the data order of the fine-tuning before the branch point), and
every branch of a trunk uses that trunk's seed as its own data order. The immediate damage is measured on `tokens`
per corpus; the curves' evaluations on `curve_tokens` of the same sequences (a subset, for time).

The init apart from the optimizer (issue 39): an `Init` may set the recovered stage's LR scale and keep the lost
stage's own Adam moments (`optimizer="own"`: the branch's save holds them, as a replica or a snapshot would;
`SimExecutor.own_optimizer`), and take omega over a window of the trunk's last steps (`omega_window`, the
`recovery.omega_window` setting). The `snapshot` init names the strategy issue 42 adds; until this build has one,
the report lists it as not run.

Layout: run directories under `work/<study>/runs/<name>` (not committed; a branch's copy of the save is
deleted when it finishes; the trunk keeps, beside its saves, every stage's input in its evaluation before each branch
point, `eval-inputs/`: a branch's evaluation right after its rebuild runs only the stages from the rebuilt one on,
`checkfree.evalinputs`), results under `results/<study>/results.json` (rendered by
`experiments.pretrained_report`). A run is finished when its summary.json says "completed"; an interrupted
study, started again, reuses every finished run and redoes the others.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

__all__ = ["Init", "INITS", "SNAP_INITS", "ALL_INITS", "snap_init", "copy_steps", "PLUS", "Study", "Run", "STUDIES",
           "make_study", "trunk_config", "branch_config",
           "branch_norms", "signature", "plan_runs", "run_study", "available_inits", "add_arguments", "main"]


@dataclass(frozen=True)
class Init:
    """A recovery initialisation compared: a strategy and, for CheckFree, how omega is taken; for snap, the
    stage's own copy: its format, whether the Adam moments travel, and its age (`copy_age` steps older than the
    failure, the snapshot period: the copy is made from the trunk's save at the branch point minus the age, and
    the branch trains on with that period)."""

    label: str
    strategy: str
    norm_kind: str = "post-clip"
    omega_scope: str = "stage"
    lr_scale: float | None = None  # the recovered stage's LR scale (None: the study's, recovery.lr_scale)
    optimizer: str = "fresh"  # fresh Adam (the paper), or own: the lost stage's moments (from the branch's save)
    omega_window: int = 1  # omega: the mean over the trunk's last N steps before the branch point
    copy_format: str | None = None
    copy_age: int = 0
    copy_moments: bool = False

    @property
    def slug(self) -> str:
        return self.label.replace(" ", "-").replace("/", "-").replace("+", "plus")


INITS = [
    Init("uniform", "uniform"),
    Init("checkfree post/stage", "checkfree", "post-clip", "stage"),
    Init("checkfree post/blocks", "checkfree", "post-clip", "blocks"),
    Init("checkfree pre/stage", "checkfree", "pre-clip", "stage"),
    Init("checkfree pre/blocks", "checkfree", "pre-clip", "blocks"),
    Init("copy", "copy"),
    Init("random", "random"),
    Init("identity", "identity"),
]
# not in a study unless named (Study.inits): the window, the optimizer apart from the init, the compressed snapshot
EXTRA_INITS = [
    Init("checkfree post/stage w10", "checkfree", "post-clip", "stage", omega_window=10),
    Init("random lr1.0", "random", lr_scale=1.0),
    Init("identity lr1.0", "identity", lr_scale=1.0),
    Init("random own-adam", "random", lr_scale=1.0, optimizer="own"),
    Init("identity own-adam", "identity", lr_scale=1.0, optimizer="own"),
    Init("copy lr1.0", "copy", lr_scale=1.0),
]
PLUS = Init("checkfree+", "checkfree+")
SOURCELESS = ("random", "identity")  # rebuilt from a seed, not from live stages


def snap_init(fmt: str, age: int, moments: bool = False) -> Init:
    """The init of a stage restored from its snap copy of format `fmt`, `age` steps old."""
    return Init(f"snap {fmt}{' +moments' if moments else ''} age {age}", "snap", copy_format=fmt, copy_age=age,
                copy_moments=moments)


# the copies compared (benchmarks.snapshots): 8 and 4 bits at snapshot periods of 1, 10 and 50 steps, the
# full-precision snapshot (float32 with the Adam moments) at the same periods, what keeping the moments is worth,
# and 8 and 4 bits of the current step (the quantization's damage alone)
SNAP_INITS = [snap_init(f, age, m) for age in (1, 10, 50) for f, m in (("int8", False), ("int4", False),
                                                                         ("float32", True))] + [
    snap_init("int8", 10, True), snap_init("int8", 0), snap_init("int4", 0)]  # age 0: the quantization alone
ALL_INITS = INITS + EXTRA_INITS + SNAP_INITS  # a study compares INITS unless it names others


def available_inits(labels: list[str] | None = None) -> tuple[list[Init], list[str]]:
    """The inits (all, or those named) whose strategy this build has, and the labels of the others."""
    from checkfree.strategies import STRATEGIES

    unknown = sorted(set(labels or []) - {i.label for i in ALL_INITS})
    if unknown:
        raise ValueError(f"unknown inits {unknown}; choose from {[i.label for i in ALL_INITS]}")
    wanted = INITS if labels is None else [i for i in ALL_INITS if i.label in labels]
    return [i for i in wanted if i.strategy in STRATEGIES], [i.label for i in wanted if i.strategy not in STRATEGIES]


@dataclass(kw_only=True)
class Study:
    """One trunk and its branches."""

    name: str  # results subdirectory
    base: dict[str, Any]  # the trunk's RunConfig (as a dict): model, data, optimiser, strategy checkfree
    branch_at: list[int]  # trunk steps at which branches start (each a multiple of eval_every)
    recover_steps: int  # steps a curve trains after the failure
    eval_every: int
    seeds: list[int]  # data orders of the branches (the trunk trains with seed trunk_seed)
    stages: list[int]  # stages failed (immediate damage for every init)
    curve_stages: list[int]  # stages whose branches also get a recovery curve
    plus_steps: int = 0  # > 0: a CheckFree+ trunk too, whose edge stages fail (curves of this many steps)
    inits: list[str] | None = None  # Init labels compared (None: all of INITS)
    trunk_seed: int = 0
    # several trunks, one per seed, each branch with its trunk's seed as data order (None: one trunk, trunk_seed,
    # and `seeds` as the branches' data orders: the studies run before issue 39)
    trunk_seeds: list[int] | None = None
    # paired held-out evaluation: {"corpora": [...], "tokens": per corpus, "curve_tokens": per corpus at a curve's
    # evaluations} (experiments.heldout); None: the run's own validation loss only
    heldout: dict[str, Any] | None = None
    jobs: int = 1
    threads: int = 1
    note: str = ""  # what was cut, for the report

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Run:
    """One simulator run of a study: a trunk (stage None, at None) or a branch."""

    study: str
    kind: str  # trunk | reference | curve | damage
    trunk: str  # plain | plus
    at: int | None = None
    seed: int = 0
    init: str | None = None  # Init.label
    stage: int | None = None
    steps: int = 0  # steps after the branch point
    trunk_seed: int | None = None  # the trunk's seed when the study has several (Study.trunk_seeds)

    @property
    def name(self) -> str:
        t = "" if self.trunk_seed is None else f"-t{self.trunk_seed}"
        if self.kind == "trunk":
            return f"trunk-{self.trunk}{t}"
        init = next((i.slug for i in [*ALL_INITS, PLUS] if i.label == self.init), "none")
        where = f"k{self.stage}" if self.stage is not None else "nofail"
        return f"{self.trunk}{t}-at{self.at}-s{self.seed}-{init}-{where}-r{self.steps}"


def _init(label: str) -> Init:
    return next(i for i in [*ALL_INITS, PLUS] if i.label == label)


def copy_steps(study: Study) -> list[int]:
    """The trunk steps whose saves the snap inits make their copies from (branch point minus copy age)."""
    return sorted({at - i.copy_age for at in study.branch_at for i in available_inits(study.inits)[0]
                   if i.copy_format is not None and at - i.copy_age >= 0})


def trunks(study: Study) -> list[int | None]:
    """The study's trunk seeds (None: its one trunk, of the studies before issue 39)."""
    return list(study.trunk_seeds) if study.trunk_seeds else [None]


def _trunk_dir(work: Path, trunk: str, ts: int | None) -> Path:
    return work / "runs" / Run("", "trunk", trunk, trunk_seed=ts).name


def trunk_config(study: Study, trunk: str, trunk_seed: int | None = None) -> dict[str, Any]:
    """The trunk's config: no failures, saves at every branch point, evaluated at each."""
    c = json.loads(json.dumps(study.base))
    seed = study.trunk_seed if trunk_seed is None else trunk_seed
    c["train"].update(num_steps=max(study.branch_at) + 1, seed=seed, eval_every=study.eval_every)
    c["recovery"]["strategy"] = "checkfree+" if trunk == "plus" else "checkfree"
    c["failures"].update(rate=0.0, trace=None)
    return c


def branch_config(study: Study, run: Run, trace: Path | None) -> dict[str, Any]:
    c = trunk_config(study, run.trunk, run.trunk_seed)
    c["train"].update(num_steps=run.at + run.steps, seed=run.seed, eval_after_recovery=True)
    if run.init is not None:
        i = _init(run.init)
        c["recovery"].update(strategy=i.strategy, norm_kind=i.norm_kind, omega_scope=i.omega_scope, fallback="abort",
                             optimizer=i.optimizer, omega_window=i.omega_window)
        if i.lr_scale is not None:
            c["recovery"]["lr_scale"] = i.lr_scale
        if i.copy_format is not None:
            c["strategy"].update(snapshot_format=i.copy_format, snapshot_moments=i.copy_moments,
                                 snapshot_every=max(1, i.copy_age))
    c["failures"]["trace"] = str(trace) if trace else None
    return c


def _trunk_lines(work: Path, trunk: str, at: int, window: int = 1, trunk_seed: int | None = None
                 ) -> list[dict[str, Any]]:
    """The trunk's metrics lines of the `window` steps before branch point `at`, oldest first."""
    from checkfree.rundir import read_jsonl

    by_step = {m["step"]: m for m in read_jsonl(_trunk_dir(work, trunk, trunk_seed) / "metrics.jsonl")}
    missing = [s for s in range(at - window, at) if s not in by_step]
    if missing:
        raise ValueError(f"the {trunk} trunk has no metrics line for step(s) {missing} (branch at {at}, omega "
                         f"window {window})")
    return [by_step[s] for s in range(at - window, at)]


def _trunk_line(work: Path, trunk: str, at: int, trunk_seed: int | None = None) -> dict[str, Any]:
    return _trunk_lines(work, trunk, at, 1, trunk_seed)[-1]


def branch_norms(line: dict[str, Any] | list[dict[str, Any]], init: Init) -> list[float]:
    """Every stage's omega under `init`'s (kind, scope), from the trunk's metrics line (`StepStats.omega`), or the
    mean over several lines (the window before the branch point: `recovery.omega_window`, through `OmegaWindow`)."""
    from checkfree.config import RecoveryConfig
    from checkfree.recovery import OmegaWindow
    from checkfree.worker import StepStats

    lines = line if isinstance(line, list) else [line]
    rc = RecoveryConfig(norm_kind=init.norm_kind, omega_scope=init.omega_scope)
    windows = [OmegaWindow(len(lines)) for _ in lines[0]["grad_norms"]]
    for m in lines:
        for w, pre, post, bpre, bpost in zip(windows, m["grad_norms_pre"], m["grad_norms"], m["block_grad_norms_pre"],
                                             m["block_grad_norms"]):
            w.add(StepStats(pre, post, 0.0, block_grad_norm_pre=bpre, block_grad_norm_post=bpost).omega(rc))
    return [w.value for w in windows]


def signature(init: Init, stage: int, norms: list[float], num_stages: int, seed: int, eps: float = 1e-4,
              *, trains: bool = False) -> tuple:
    """What decides the rebuilt stage: the plan's method and each source's coefficient (`rebuild_stage`'s
    arithmetic, coefficients to 6 decimals), and the seed for the inits drawn from one. Two inits with one signature
    rebuild the same weights up to rounding: the uniform mean and a weighted mean of equal weights round
    differently, and two stages that clipped have post-clip norms equal to ~1e-7 (`clip_grad_norm_` scales by
    max_norm / (norm + 1e-6)). `trains`: the branch trains on after the rebuild, so the optimizer it starts with
    (LR scale, fresh or own moments) is part of what decides it."""
    from checkfree.recovery import plan_recovery

    if init.copy_format is not None:
        return ("snap", init.copy_format, init.copy_moments, init.copy_age)
    plan = plan_recovery({stage}, num_stages, init.strategy, "abort")[0]
    extra = (("lr", init.lr_scale), ("optimizer", init.optimizer)) if trains else ()
    if plan.method in SOURCELESS:
        return (plan.method, seed) + extra
    if plan.method == "average":
        prev, nxt = plan.sources
        a, b = norms[nxt] + eps, norms[prev] + eps
        return ("weighted", round(b / (a + b), 6), round(a / (a + b), 6)) + extra
    if plan.method == "uniform":
        return ("weighted", 0.5, 0.5) + extra
    return (plan.method, plan.sources, tuple(sorted(plan.edge_sources.items()))) + extra


def plan_runs(study: Study, work: Path, inits: list[Init]) -> tuple[list[Run], list[dict[str, Any]]]:
    """The branch runs to do (priority order: damage, the cheapest and complete; then the references; then the
    curves, seed by seed) and every reported cell
    (at, stage, init, seed, trunk) with the run that measures it (a run of a coinciding init, or of another seed
    for an init whose rebuild does not depend on the seed)."""
    S = study.base["num_stages"]
    runs: list[Run] = []
    cells: list[dict[str, Any]] = []
    for at in study.branch_at:
        for ts in trunks(study):
            seeds = study.seeds if ts is None else [ts]
            damage, curves = [], []
            for stage in study.stages:
                curve = stage in study.curve_stages
                for seed in seeds:
                    seen: dict[tuple, Init] = {}
                    for init in inits:
                        if init.copy_format is not None and at - init.copy_age < 0:
                            continue  # no trunk state that old
                        lines = _trunk_lines(work, "plain", at, init.omega_window, ts)
                        sig = signature(init, stage, branch_norms(lines, init), S, seed, trains=curve)
                        rep = seen.setdefault(sig, init)
                        # a rebuild that does not depend on the seed is measured once (first seed) unless it trains on
                        run_seed = seed if curve or sig[0] in SOURCELESS else seeds[0]
                        run = Run(study.name, "curve" if curve else "damage", "plain", at, run_seed, rep.label, stage,
                                  study.recover_steps if curve else 0, ts)
                        (curves if curve else damage).append(run)
                        cells.append({"at": at, "stage": stage, "init": init.label, "seed": seed, "run": run.name,
                                      "coincides_with": rep.label if rep is not init else None,
                                      "signature": [str(x) for x in sig], "trunk_seed": ts})
            runs += damage
            if study.curve_stages:  # the failure-free branches the curves are compared with
                runs += [Run(study.name, "reference", "plain", at, s, steps=study.recover_steps, trunk_seed=ts)
                         for s in seeds]
            runs += sorted(curves, key=lambda r: (r.seed, study.curve_stages.index(r.stage)))
    if study.plus_steps:
        at = study.branch_at[-1]
        for ts in trunks(study):
            seeds = study.seeds if ts is None else [ts]
            runs += [Run(study.name, "reference", "plus", at, s, steps=study.plus_steps, trunk_seed=ts) for s in seeds]
            for seed in seeds:
                for stage in (0, S - 1):
                    run = Run(study.name, "curve", "plus", at, seed, PLUS.label, stage, study.plus_steps, ts)
                    runs.append(run)
                    cells.append({"at": at, "stage": stage, "init": PLUS.label, "seed": seed, "run": run.name,
                                  "coincides_with": None, "signature": [], "trunk_seed": ts})
    unique = list(dict.fromkeys(runs))
    return unique, cells


def _done(directory: Path) -> bool:
    try:
        return json.loads((directory / "summary.json").read_text()).get("status") == "completed"
    except (OSError, json.JSONDecodeError):
        return False


def _check_memory(study: Study) -> None:
    """Refuse a study whose trunk (with its saves) or whose `jobs` branch processes cannot fit (checkfree.memory)."""
    from checkfree.config import config_from_dict
    from checkfree.memory import StageMemory, check_fits, simulator_memory

    from checkfree.worker import resolve_device

    cfg = config_from_dict(trunk_config(study, "plain"))
    device = resolve_device(cfg.train.device)  # on a GPU: its free memory for the tensors, the host's for the processes
    trunk = simulator_memory(cfg, save_every=math.gcd(*study.branch_at))
    branches = sum([simulator_memory(cfg)] * study.jobs, StageMemory())
    for need, what in ((trunk, f"the {study.name} study's trunk"), (branches, f"{study.jobs} {study.name} branch processes")):
        check_fits(need, what, device)
        if device.type == "cuda":
            check_fits(StageMemory(process=need.process), what)


def _run_trunk(study: Study, work: Path, trunk: str, trunk_seed: int | None = None) -> None:
    from checkfree.config import config_from_dict
    from checkfree.saves import SAVES, newest_save
    from checkfree.simulator import Simulator

    d = _trunk_dir(work, trunk, trunk_seed)
    copies = copy_steps(study) if trunk == "plain" else []
    if all((d / SAVES / f"step-{at:08d}" / "meta.json").is_file() for at in [*study.branch_at, *copies]):
        return  # the saves the branches need (the trunk may be further on: a study run with fewer branch points)
    cfg = config_from_dict(trunk_config(study, trunk, trunk_seed))
    every = math.gcd(*study.branch_at)
    resume = newest_save(d) is not None
    # every save kept: the branch points' and those an interruption adds (pruning by age could drop a branch point's)
    # the steps before the last branch point only (its save is the state ready for it): the config's one step more
    # keeps the schedule the trunks have had, and the step itself, its evaluation, were never read
    Simulator(cfg, d, progress=False, save_every=every, keep_saves=1 << 20, resume=resume,
              save_steps=tuple(copies), eval_inputs=_eval_inputs(d, study.branch_at)).run(until=max(study.branch_at))


def _eval_inputs(trunk: Path, record: list[int] | tuple[int, ...] = ()):
    """The trunk's recorded stage inputs at its branch points (the evaluation before each save a branch resumes
    from), so that a branch's evaluation right after its rebuild runs the stages from the rebuilt one on only."""
    from checkfree.evalinputs import StageInputs

    return StageInputs(trunk / "eval-inputs", frozenset(record))


def _branch_save(study: Study, work: Path, run: Run, d: Path) -> dict[str, dict]:
    """The trunk's save at the branch point, with each stage's omega as the branch's init takes it; returns the
    failed stage's own Adam state of its blocks (what `optimizer="own"` restores), empty without a failure."""
    from checkfree.saves import SAVES, read_save, write_save
    from checkfree.serialize import state_from_bytes, state_to_bytes

    trunk = _trunk_dir(work, run.trunk, run.trunk_seed)
    meta, blobs = read_save(trunk / SAVES / f"step-{run.at:08d}", study.base["num_stages"])
    own: dict[str, dict] = {}
    if run.stage is not None:
        own = {k: v for k, v in state_from_bytes(blobs[run.stage])["optim"]["state"].items() if k.startswith("blocks.")}
    if run.init is not None and run.trunk == "plain":
        init = _init(run.init)
        norms = branch_norms(_trunk_lines(work, "plain", run.at, init.omega_window, run.trunk_seed), init)
        for s, blob in blobs.items():
            state = state_from_bytes(blob)
            state["norm"] = norms[s]
            blobs[s] = state_to_bytes(state)
    write_save(d, run.at, blobs, {k: v for k, v in meta.items() if k not in ("step", "stages")}, keep=1)
    return own


_HELDOUT: dict[str, Any] = {}  # per process: the held-out sequences of a config (built once, reused by its runs)


def _heldout_probe(study: Study, run: Run, cfg, d: Path):
    """The probe (`Simulator(probe=...)`) that writes each evaluation's per-sequence losses into `heldout.jsonl`:
    `tokens` per corpus right after a resume (reference: v0) and right after the rebuild (the damage), the first
    `curve_tokens` of them at a curve's evaluations; None when the study has no held-out evaluation."""
    from experiments.heldout import CORPORA, DEFAULT_TOKENS, build_heldout, curve_rows, sequence_losses

    h = study.heldout
    if not h:
        return None
    key = json.dumps([cfg.data.__dict__, cfg.model.__dict__, cfg.seq_len, h], sort_keys=True, default=str)
    if key not in _HELDOUT:  # built once per study (tokenizing the KJV takes seconds), kept beside its runs
        import hashlib

        import torch

        from experiments.heldout import HeldOut

        cache = d.parent.parent / f"heldout-{hashlib.sha256(key.encode()).hexdigest()[:16]}.pt"
        _HELDOUT.clear()
        if cache.is_file():
            _HELDOUT[key] = HeldOut(torch.load(cache), cfg.seq_len)
        else:
            _HELDOUT[key] = build_heldout(cfg, h.get("corpora", CORPORA), h.get("tokens", DEFAULT_TOKENS),
                                          kjv_path=h.get("kjv_path"))
            tmp = cache.with_suffix(f".tmp{os.getpid()}")
            torch.save(_HELDOUT[key].sequences, tmp)
            os.replace(tmp, cache)
    held = _HELDOUT[key]
    curve_n = max(2, h.get("curve_tokens", h.get("tokens", DEFAULT_TOKENS)) // held.seq_len)
    path = d / "heldout.jsonl"

    def probe(kind: str, step: int, workers) -> None:
        if kind == "start" and run.kind != "reference":
            return
        line: dict[str, Any] = {"kind": kind, "step": step}
        for corpus, seqs in held.sequences.items():
            part = seqs if kind in ("start", "recovered") else seqs[curve_rows(len(seqs), curve_n)]
            line[corpus] = [round(x, 5) for x in sequence_losses(workers, part)]
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")

    return probe


def _trunk_states(work: Path, trunk: str, step: int, num_stages: int, trunk_seed: int | None = None
                  ) -> dict[int, dict]:
    """Every stage's full state in the trunk's save at `step`."""
    from checkfree.saves import SAVES, read_save
    from checkfree.serialize import state_from_bytes

    _, blobs = read_save(_trunk_dir(work, trunk, trunk_seed) / SAVES / f"step-{step:08d}", num_stages)
    return {s: state_from_bytes(b) for s, b in blobs.items()}


def run_branch(study_d: dict[str, Any], run_d: dict[str, Any], work: str, threads: int, commit: str) -> dict[str, Any]:
    """One branch, in a worker process: its save, its trace, the simulator resumed; the save deleted after.
    `commit`: the code the study's invocation started on (recorded in run.json)."""
    import torch

    from checkfree.config import config_from_dict
    from checkfree.saves import SAVES
    from checkfree.simulator import Simulator

    torch.set_num_threads(threads)
    study, run, work_p = Study(**study_d), Run(**run_d), Path(work)
    d = work_p / "runs" / run.name
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    trace = None
    if run.stage is not None:
        trace = d / "trace.csv"
        trace.write_text(f"{run.at},{run.stage}\n")
    t0 = time.time()
    try:
        own = _branch_save(study, work_p, run, d)
        (d / "run.json").write_text(json.dumps({**asdict(run), "name": run.name, "commit": commit}, indent=2))
        cfg = config_from_dict(branch_config(study, run, trace))
        sim = Simulator(cfg, d, progress=False, resume=True, probe=_heldout_probe(study, run, cfg, d),
                        eval_inputs=_eval_inputs(_trunk_dir(work_p, run.trunk, run.trunk_seed)))
        if run.stage is not None and cfg.recovery.optimizer == "own":
            sim.executor.own_optimizer[run.stage] = own  # the lost stage's moments, as a copy of them would give
        init = _init(run.init) if run.init is not None else None
        if init is not None and init.copy_format is not None:  # the copy: the trunk's state copy_age steps before
            sim.prime_copies(_trunk_states(work_p, run.trunk, run.at - init.copy_age, study.base["num_stages"],
                                           run.trunk_seed), run.at - init.copy_age)
        sim.rebuild_and_evaluate({run.stage}) if run.kind == "damage" else sim.run()
        status = "completed"
    except Exception as e:  # noqa: BLE001 - recorded; the study goes on and redoes it when restarted
        status = f"error: {type(e).__name__}: {e}"
    finally:
        shutil.rmtree(d / SAVES, ignore_errors=True)
    return {"name": run.name, "status": status, "wall_s": round(time.time() - t0, 1)}


def _execute(study: Study, work: Path, runs: list[Run], commit: str):
    """Each run's result as it finishes: one after the other in this process (jobs 1), or in `jobs` spawned
    processes, one per run."""
    args = [(study.to_dict(), asdict(r), str(work), study.threads, commit) for r in runs]
    if study.jobs == 1:
        yield from (run_branch(*a) for a in args)
        return
    from experiments.runner import stop_pool

    with ProcessPoolExecutor(max_workers=study.jobs, mp_context=get_context("spawn"), max_tasks_per_child=1) as ex:
        futures = [ex.submit(run_branch, *a) for a in args]
        try:
            for f in futures:
                yield f.result()
        except BaseException:  # interrupted (Ctrl-C, SIGTERM): the runs in flight are redone when restarted
            stop_pool(ex)
            raise


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parent, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=Path(__file__).resolve().parent, timeout=10).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def run_study(study: Study, work: Path, results: Path, *, command: str = "", log=print,
              report_only: bool = False) -> Path:
    """Run (or resume) the study and write its results JSON; returns the results directory."""
    from experiments.pretrained_report import collect, write_report

    inits, missing = available_inits(study.inits)
    short = [i.label for i in inits if i.omega_window > min(study.branch_at)]
    if short:
        raise ValueError(f"inits {short} average omega over more steps than the trunk has before branch point "
                         f"{min(study.branch_at)}")
    work.mkdir(parents=True, exist_ok=True)
    t0, commit = time.time(), _commit()  # the code this invocation runs
    if not report_only:
        _check_memory(study)
        log(f"{study.name}: trunk(s)")
        for ts in trunks(study):
            _run_trunk(study, work, "plain", ts)
            if study.plus_steps:
                _run_trunk(study, work, "plus", ts)
    runs, cells = plan_runs(study, work, inits)
    pending = [r for r in runs if not _done(work / "runs" / r.name)]
    log(f"{study.name}: {len(runs)} branch runs, {len(runs) - len(pending)} already finished, {len(pending)} to run")
    if pending and not report_only:
        for i, res in enumerate(_execute(study, work, pending, commit), 1):
            log(f"  [{i}/{len(pending)}] {res['name']}: {res['status']} ({res['wall_s']:.0f} s)")
    data = collect(study, work, runs, cells, missing_inits=missing, commit=commit, command=command,
                   wall_s=time.time() - t0)
    return write_report(data, results / study.name)


def make_study(name: str, *, init_from: str | None = None, **overrides: Any) -> Study:
    """A named study (`STUDIES`) with any of its fields overridden."""
    if name not in STUDIES:
        raise ValueError(f"unknown study {name!r}; choose one of {sorted(STUDIES)}")
    study = STUDIES[name](init_from)
    for k, v in overrides.items():
        if v is not None:
            setattr(study, k, v)
    return study


def _smollm2_config(init_from: str | None, seq_len: int = 128):
    """SmolLM2-135M on the built-in Shakespeare corpus with its own tokenizer, 6 stages of 5 layers, 2 x 2
    sequences of `seq_len` tokens a step, Adam at 1e-4."""
    from checkfree.config import preset
    from checkfree.hf import configure_from_hf

    if init_from is None:
        raise ValueError("the smollm2 studies need --init-from DIR (checkfree pretrained smollm2 --output DIR)")
    cfg = preset("tiny")
    configure_from_hf(cfg, model_config=None, init_from=init_from)
    cfg.num_stages = 6
    t = cfg.train
    t.seq_len, t.num_microbatches, t.microbatch_size, t.eval_batches = seq_len, 2, 2, 4
    t.lr = 1e-4  # fine-tuning: the tiny preset's 3e-3 is for training from scratch
    return cfg


def _smollm2(init_from: str | None) -> Study:
    """SmolLM2-135M fine-tuned on the built-in Shakespeare corpus with its own tokenizer, 6 stages of 5 layers."""
    cfg = _smollm2_config(init_from)
    # sized to a shared 2-core machine (a step of 512 tokens: ~65 s at load 16-22): curves for the middle stage
    # only, no CheckFree+ trunk; more with --curve-stages 2,1 --plus-steps 15 (finished runs are reused)
    return Study(name="smollm2", base=cfg.to_dict(), branch_at=[10], recover_steps=15, eval_every=5, seeds=[0, 1, 2],
                 stages=[1, 2, 3, 4], curve_stages=[2], plus_steps=0, jobs=2, threads=1)


def _small(init_from: str | None) -> Study:
    """The `small` preset from scratch: one failure at 25 % and at 100 % of a 1,000-step run."""
    from checkfree.config import preset

    cfg = preset("small")
    cfg.train.eval_batches = 4
    return Study(name="small", base=cfg.to_dict(), branch_at=[250, 1000], recover_steps=30, eval_every=10,
                 seeds=[0, 1, 2], stages=[1, 2], curve_stages=[1, 2], jobs=1, threads=1)


def _tiny(init_from: str | None) -> Study:
    """Seconds: the whole path on the tiny preset (tests)."""
    from checkfree.config import preset

    cfg = preset("tiny")
    return Study(name="tiny", base=cfg.to_dict(), branch_at=[4], recover_steps=4, eval_every=2, seeds=[0, 1],
                 stages=[1, 2], curve_stages=[1], plus_steps=2, jobs=1, threads=1)


# The studies of issue 39. Paired: every branch on the same held-out sequences of two corpora (51,200 tokens for the
# immediate damage, `curve_tokens` at a curve's evaluations), three trunks, each branch on with its trunk's data order.
HELDOUT = {"corpora": ["val", "kjv"], "tokens": 25_600, "curve_tokens": 2_560}
CURVE_INITS = ["checkfree post/stage", "identity", "random", "copy", "snap int8 age 1"]
OPTIMIZER_INITS = ["random", "random lr1.0", "random own-adam", "identity", "identity lr1.0", "identity own-adam"]
STUDY_SEQ_LEN = 64  # the curve studies' training length on this machine (sized in docs/pretrained.md)


def _smollm2_paired(init_from: str | None) -> Study:
    """Immediate damage of every init at stages 1-4, two branch points, three trunks, paired held-out evaluation."""
    cfg = _smollm2_config(init_from)
    return Study(name="smollm2-paired", base=cfg.to_dict(), branch_at=[10, 20], recover_steps=1, eval_every=10,
                 seeds=[0], trunk_seeds=[0, 1, 2], stages=[1, 2, 3, 4], curve_stages=[],
                 inits=[i.label for i in INITS] + ["checkfree post/stage w10"], heldout=dict(HELDOUT), jobs=2)


def _small_paired(init_from: str | None) -> Study:
    """The same on the `small` preset from scratch: failures at 25 % and 100 % of 1,000 steps, three trunks."""
    from checkfree.config import preset

    cfg = preset("small")
    cfg.train.eval_batches = 4
    return Study(name="small-paired", base=cfg.to_dict(), branch_at=[250, 1000], recover_steps=1, eval_every=10,
                 seeds=[0], trunk_seeds=[0, 1, 2], stages=[1, 2], curve_stages=[],
                 inits=[i.label for i in INITS] + ["checkfree post/stage w10"], heldout=dict(HELDOUT), jobs=2)


def _smollm2_curves(init_from: str | None) -> Study:
    """Recovery curves at stages 2 and 4, 100 steps, CheckFree (post-clip), identity, random, copy and the snapshot
    (once built), three trunks: steps until the gap is back inside the paired interval of zero, area under it."""
    cfg = _smollm2_config(init_from, STUDY_SEQ_LEN)
    return Study(name="smollm2-curves", base=cfg.to_dict(), branch_at=[10], recover_steps=100, eval_every=25,
                 seeds=[0], trunk_seeds=[0, 1, 2], stages=[2, 4], curve_stages=[2, 4], inits=list(CURVE_INITS),
                 heldout=dict(HELDOUT), jobs=2)


def _smollm2_optimizer(init_from: str | None) -> Study:
    """The init apart from the optimizer reset: random and identity at LR scale 1.1 and 1.0, and with the lost
    stage's own Adam moments, curves at stages 2 and 4 as `smollm2-curves`."""
    study = _smollm2_curves(init_from)
    study.name, study.inits = "smollm2-optimizer", list(OPTIMIZER_INITS)
    return study


def _tiny_paired(init_from: str | None) -> Study:
    """Seconds: the paired path on the tiny preset (tests)."""
    from checkfree.config import preset

    cfg = preset("tiny")
    return Study(name="tiny-paired", base=cfg.to_dict(), branch_at=[10], recover_steps=4, eval_every=2, seeds=[0],
                 trunk_seeds=[0, 1], stages=[1, 2], curve_stages=[2],
                 inits=["uniform", "copy", "random", "identity", "random own-adam", "checkfree post/stage w10"],
                 heldout={"corpora": ["val", "kjv"], "tokens": 640, "curve_tokens": 320}, jobs=1, threads=1)


STUDIES = {"smollm2": _smollm2, "small": _small, "tiny": _tiny, "smollm2-paired": _smollm2_paired,
           "small-paired": _small_paired, "smollm2-curves": _smollm2_curves, "smollm2-optimizer": _smollm2_optimizer,
           "tiny-paired": _tiny_paired}


def _ints(text: str) -> list[int]:
    import argparse

    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def add_arguments(p) -> None:
    """The flags of `checkfree experiment pretrained`."""
    p.add_argument("--study", required=True, choices=sorted(STUDIES),
                   help="smollm2: SmolLM2-135M fine-tuned (needs --init-from); small: the small preset from scratch, "
                        "failures at 25 %% and 100 %% of 1,000 steps; tiny: seconds, the whole path")
    p.add_argument("--init-from", metavar="DIR", help="the HF directory of SmolLM2 (checkfree pretrained smollm2 --output DIR)")
    p.add_argument("--seeds", type=_ints, help="data orders of the branches (default 0,1,2)")
    p.add_argument("--branch-at", type=_ints, help="trunk steps the branches start from (small: 250,1000; each a "
                                                   "multiple of the first: the trunk saves every gcd of them)")
    p.add_argument("--recover-steps", type=int, help="steps a recovery curve trains after the failure")
    p.add_argument("--curve-stages", type=_ints, help="stages whose branches get a recovery curve")
    p.add_argument("--plus-steps", type=int, help="CheckFree+ edge-stage curves' steps (0: no CheckFree+ trunk)")
    p.add_argument("--jobs", type=int, help="branch runs in parallel (one process each)")
    p.add_argument("--threads", type=int, help="torch threads per run process")
    p.add_argument("--work", default="runs/pretrained", help="run directories (large; not committed)")
    p.add_argument("--results", default="experiments/results/pretrained", help="results.json, table.md, plots")
    p.add_argument("--report-only", action="store_true", help="only collect and render what has finished")


def main(args) -> int:
    import shlex
    import sys

    study = make_study(args.study, init_from=args.init_from, seeds=args.seeds, branch_at=args.branch_at,
                       recover_steps=args.recover_steps,
                       curve_stages=args.curve_stages, plus_steps=args.plus_steps, jobs=args.jobs,
                       threads=args.threads)
    if study.recover_steps < 1 or study.jobs < 1 or study.threads < 1 or not study.seeds:
        raise ValueError("--recover-steps, --jobs and --threads must be >= 1 and --seeds name at least one seed")
    from checkfree.flags import interrupt_on_signals

    interrupt_on_signals()  # SIGTERM/SIGHUP end the study like Ctrl-C: its pool's workers with it
    argv = [a for a in sys.argv[1:] if a != "--report-only"]
    command = "checkfree " + " ".join(shlex.quote(a) for a in argv) if "pretrained" in argv else ""
    out = run_study(study, Path(args.work) / study.name, Path(args.results), command=command,
                    report_only=args.report_only)
    print(f"{study.name}: {out / 'table.md'}")
    return 0
