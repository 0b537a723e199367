"""What an experiment runs: settings, the paper-to-CPU mapping, failure traces and run specs.

The paper's failure model is per-iteration Bernoulli failures per stage (Table 2: 500M model,
10,000 iterations to the target without failures). A CPU run is ~100x shorter, so with the
paper's per-iteration probabilities almost nothing would fail. The experiments compress time
by a factor ``k`` (``--rate-scale``): one CPU step stands for k of the paper's iterations,
and every quantity the paper states per iteration is scaled accordingly:

* per-step failure probability      p = k * p_paper(h)
* checkpoint interval               C = round(C_paper / k)          (C_paper = 100 for 500M, 50 for 124M)
* in-memory snapshot interval       K = max(1, round(10 / k))       (the project's default 10)
* recovery (detection) time         (30 s / 91.3 s) * step_s / k    (the paper's ~30 s recovery is
                                                                     1/3 of an iteration; ``--detection-time auto``)

so that the expected failures per step, the work lost per checkpoint rollback relative to the
interval, and the share of wall-clock spent recovering match the paper's regime.
`p_paper(h)` is the per-iteration probability the authors configured for an hourly rate h in the
config of the model the runs stand for (`Settings.paper_model`, `PAPER_MODELS`: 500M by default, whose
Table 2 the CPU runs emulate); for the 500M model any other h uses the paper's conversion
p = 1 - (1 - h)^(91.3 / 3600). The checkpoint interval C_paper is that model's too.

Failure traces. For every (rate, seed) one trace is drawn with failures on *all* stages
(`bernoulli_schedule`, seed = failure seed), over the iteration budget (rolled-back
recomputations meet failures too). Strategies that cannot recover the first / last stage
(`Strategy.fails_edges` is False: checkfree, uniform, copy, random, identity -- the paper never fails the
edge stages under plain CheckFree) replay the *inner* trace: the same draws with stages 0 and
S-1 removed (exactly `bernoulli_schedule(..., protect={0, S-1})`). Every other strategy replays
the full trace. Because the draws depend only on (seed, iteration), the traces of one seed are
nested across rates: every failure at 5% also happens at 10% and 16%.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from checkfree.config import RunConfig, preset
from checkfree.failures import bernoulli_schedule, per_step_probability

__all__ = ["PAPER_MODELS", "PaperModel", "PAPER_P", "PAPER_ITERATION_S", "PAPER_REDUNDANT_ITERATION_S", "PAPER_RECOVERY_S",
           "PAPER_CHECKPOINT_EVERY", "ALL_STRATEGIES", "IN_MEMORY", "ROLLBACK", "Settings", "RunSpec",
           "paper_p", "rate_label", "build_config", "make_spec", "write_traces", "spec_for", "reference_spec",
           "LOCAL_STRATEGIES", "OMEGA_STRATEGIES", "default_jobs"]

PAPER_ITERATION_S = 91.3  # the paper's 500M iteration time (all but redundant computation)
PAPER_REDUNDANT_ITERATION_S = 151.04  # the paper's redundant-computation iteration time
PAPER_RECOVERY_S = 30.0  # "recovery of a stage takes about 30 s"
PAPER_SNAPSHOT_EVERY = 10  # the project's default snapshot interval (gemini, reft, checkfree+snap)


@dataclass(frozen=True)
class PaperModel:
    """What the authors configured for one model size: per-iteration failure probabilities by hourly rate (their
    `simulate_training/<model>_config.json`, gensyn-ai/CheckFree) and the checkpoint interval of the paper's
    checkpointing baseline."""

    name: str
    p: dict[float, float]  # hourly rate, percent -> per-iteration stage-failure probability
    checkpoint_every: int  # iterations between checkpoints (paper: small 50, medium 100)
    convert_other_rates: bool  # rates not in `p` by the paper's conversion (its 91.3 s iteration, 500M only)


PAPER_MODELS = {
    # 500M_config.json: "5": 0.0009, "10": 0.002, "16": 0.004, "33": 0.01
    "500m": PaperModel("500m", {5.0: 0.0009, 10.0: 0.002, 16.0: 0.004, 33.0: 0.01}, 100, True),
    # 124M_config.json: "10": 0.0006, "16": 0.001; no 5 % (or 33 %) figure, and no iteration time to convert with
    "124m": PaperModel("124m", {10.0: 0.0006, 16.0: 0.001}, 50, False),
}
PAPER_P = PAPER_MODELS["500m"].p  # the CPU-scale runs emulate the 500M model's Table 2
PAPER_CHECKPOINT_EVERY = PAPER_MODELS["500m"].checkpoint_every  # Table 2; the ablation uses 10 / 50 / 100

# Display order: the paper's Table 2 columns first, then the seed papers' baselines, the
# hybrid, and the recovery-initialisation ablations.
ALL_STRATEGIES = ["checkpoint", "redundant", "checkfree", "checkfree+", "gemini", "reft", "baft",
                  "checkfree+snap", "uniform", "copy", "random"]
IN_MEMORY = ("redundant", "gemini", "reft", "baft")  # fall back to a persistent checkpoint when copies are lost
ROLLBACK = ("checkpoint", "gemini", "reft", "baft")  # roll every stage back: need an iteration budget
# Strategies whose recoveries weigh neighbours by omega: only their runs with failures depend on --omega-scope
# (the others' runs are shared by both scopes).
OMEGA_STRATEGIES = ("checkfree", "checkfree+", "checkfree+snap")
LOCAL_STRATEGIES = ("checkfree", "checkfree+", "uniform", "copy", "random", "identity", "checkpoint", "gemini")


def default_jobs() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def paper_p(hourly_pct: float, model: str = "500m") -> float:
    """The authors' per-iteration probability for an hourly failure rate in percent, for one of their models."""
    if hourly_pct == 0:
        return 0.0
    pm = PAPER_MODELS[model]
    if float(hourly_pct) in pm.p:
        return pm.p[float(hourly_pct)]
    if not pm.convert_other_rates:
        raise ValueError(f"the authors' {model} config gives failure probabilities for "
                         f"{', '.join(f'{r:g} %' for r in pm.p)} only, not {hourly_pct:g} %")
    return per_step_probability(hourly_pct / 100.0, PAPER_ITERATION_S)


def rate_label(hourly_pct: float) -> str:
    return f"{hourly_pct:g}%"


@dataclass(kw_only=True)
class Settings:
    """Everything an experiment's runs depend on (plus how to run them)."""

    preset: str = "small"
    steps: int = 100
    seeds: list[int] = field(default_factory=lambda: [0])
    rates: list[float] = field(default_factory=lambda: [5.0, 10.0, 16.0])  # the paper's hourly rates, percent
    rate_scale: float = 20.0  # k: paper iterations per CPU step
    paper_model: str = "500m"  # whose failure probabilities and checkpoint interval (PAPER_MODELS)
    strategies: list[str] = field(default_factory=lambda: list(ALL_STRATEGIES))
    cost_profile: str = "paper-geo"
    detection: str | float = "auto"  # seconds, or "auto" (the paper's 30 s recovery, time-compressed)
    target: float | None = None  # fixed validation-loss target; None: from the failure-free run
    target_fraction: float = 0.5  # target = failure-free val loss after this fraction of the steps
    fallback: str = "copy"  # recovery.fallback for unrecoverable (adjacent) failures
    omega_scope: str = "stage"  # recovery.omega_scope: omega over the whole stage or its blocks only
    lr_scale: float = 1.1  # recovery.lr_scale: the paper's 1.1; the authors' 500M config 1.2 (recipes paper-500m-*)
    data: str | None = None  # data.source (None: the preset's corpus)
    storage_fallback: bool = True  # redundant/gemini/reft/baft also checkpoint and roll back when copies are lost
    max_iter_factor: float = 3.0  # iteration budget (recomputations included) = factor * steps
    eval_every: int = 5
    eval_batches: int | None = None
    microbatches: int | None = None  # override the preset's M (quick mode)
    microbatch_size: int | None = None  # override the preset's sequences per microbatch (a paper preset cut to a GPU's minutes)
    device: str = "cpu"  # train.device of every run (benchmarks.accelerator runs the recipes on cuda)
    autocast_bf16: bool = False  # train.autocast_bf16 of every run
    checkpoint_every: int | None = None  # None: the paper model's checkpoint interval / k
    snapshot_every: int | None = None  # None: PAPER_SNAPSHOT_EVERY / k
    failure_seed: int = 1234  # failure draws use failure_seed + seed
    # ablations
    init_rate: float = 16.0  # ablation-init (paper Fig. 2: 16%)
    ckpt_rate: float = 10.0  # ablation-ckpt (paper Fig. 4b)
    ckpt_intervals: list[int] = field(default_factory=lambda: [10, 50, 100])  # in the paper's iterations
    plus_rates: list[float] = field(default_factory=lambda: [0.0, 5.0, 10.0, 16.0, 33.0])  # ablation-rate
    # execution
    jobs: int = field(default_factory=default_jobs)
    threads: int = 1  # torch threads per run process
    runtime: str = "sim"  # sim | local (also run the matrix on the distributed runtime)
    quick: bool = False
    out: str = "experiments/results/small"

    @classmethod
    def quick_settings(cls, **overrides: Any) -> Settings:
        """`--quick`: tiny preset, few steps, 2 rates, 1 seed, every strategy."""
        base = dict(preset="tiny", steps=12, seeds=[0], rates=[10.0, 16.0], rate_scale=50.0, eval_every=2,
                    microbatches=2, eval_batches=1, max_iter_factor=2.0, init_rate=16.0, ckpt_rate=16.0,
                    plus_rates=[0.0, 10.0, 16.0], quick=True, out="experiments/results/quick")
        base.update(overrides)
        return cls(**base)

    # --- derived --------------------------------------------------------------------
    def p(self, hourly_pct: float) -> float:
        """Per-step failure probability of a CPU run for the paper's hourly rate."""
        return min(1.0, self.rate_scale * self.paper_p(hourly_pct))

    def paper_p(self, hourly_pct: float) -> float:
        """The authors' per-iteration probability for the hourly rate (their config for `paper_model`)."""
        return paper_p(hourly_pct, self.paper_model)

    @property
    def paper_checkpoint_every(self) -> int:
        return PAPER_MODELS[self.paper_model].checkpoint_every

    def scaled_interval(self, paper_iterations: float) -> int:
        return max(1, round(paper_iterations / self.rate_scale))

    @property
    def ckpt_every(self) -> int:
        return self.checkpoint_every or self.scaled_interval(self.paper_checkpoint_every)

    @property
    def snap_every(self) -> int:
        return self.snapshot_every or self.scaled_interval(PAPER_SNAPSHOT_EVERY)

    @property
    def max_iterations(self) -> int:
        return max(self.steps, math.ceil(self.max_iter_factor * self.steps))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(kw_only=True)
class RunSpec:
    """One run of the matrix: a full RunConfig plus where and how it runs."""

    name: str  # run directory name under <out>/runs
    strategy: str
    label: str  # display name (e.g. "checkpoint/5")
    rate: float  # the paper's hourly rate, percent
    p: float  # per-step failure probability actually used
    seed: int
    trace_kind: str  # full | inner | none
    trace: str | None  # trace file, relative to the results directory
    runtime: str  # sim | local
    max_iterations: int
    config: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def detection_s(settings: Settings, cfg: RunConfig) -> float | None:
    """The failure-detection delay given to the cost model (see the module docstring)."""
    if settings.detection == "auto":
        from checkfree.costmodel import CostModel

        step = CostModel(cfg, settings.cost_profile).step_s()
        return PAPER_RECOVERY_S / PAPER_ITERATION_S * step / settings.rate_scale
    if settings.detection in (None, "profile"):
        return None
    return float(settings.detection)


def build_config(settings: Settings, strategy: str, seed: int, trace_path: str | None,
                 checkpoint_every: int | None = None) -> RunConfig:
    cfg = preset(settings.preset)
    t = cfg.train
    t.num_steps, t.seed, t.eval_every, t.device = settings.steps, seed, settings.eval_every, settings.device
    t.autocast_bf16 = settings.autocast_bf16
    if settings.microbatches:
        t.num_microbatches = settings.microbatches
    if settings.microbatch_size:
        t.microbatch_size = settings.microbatch_size
    if settings.eval_batches:
        t.eval_batches = settings.eval_batches
    cfg.recovery.strategy = strategy
    cfg.recovery.fallback = settings.fallback
    cfg.recovery.omega_scope = settings.omega_scope
    cfg.recovery.lr_scale = settings.lr_scale
    if settings.data is not None:
        cfg.data.source = settings.data
    st = cfg.strategy
    st.cost_profile = settings.cost_profile
    st.checkpoint_every = checkpoint_every or settings.ckpt_every
    st.snapshot_every = settings.snap_every
    st.storage_fallback = settings.storage_fallback and strategy in IN_MEMORY
    st.detection_s = detection_s(settings, cfg)
    cfg.failures.rate = 0.0
    cfg.failures.trace = trace_path
    cfg.failures.seed = settings.failure_seed + seed
    return cfg


def trace_name(rate: float, seed: int, kind: str) -> str:
    return f"traces/{kind}-{rate:g}pct-s{seed}.csv"


def write_traces(settings: Settings, out: Path, rates: list[float]) -> dict[tuple[float, int, str], str]:
    """Draw (and write) the full and inner trace of every (rate, seed); returns relative paths.

    A trace that already exists is kept only if identical (a resumed matrix replays the same
    failures); otherwise it is rewritten, and the runs that used it get new names (the run
    name hashes the trace's content)."""
    cfg = preset(settings.preset)
    S = cfg.num_stages
    paths = {}
    for rate in rates:
        if rate == 0:
            continue
        for seed in settings.seeds:
            p = settings.p(rate)
            fseed = settings.failure_seed + seed
            full = bernoulli_schedule(S, settings.max_iterations, p, fseed)
            inner = bernoulli_schedule(S, settings.max_iterations, p, fseed, protect=frozenset({0, S - 1}))
            assert inner == [(t, s) for t, s in full if s not in (0, S - 1)]
            for kind, events in (("full", full), ("inner", inner)):
                rel = trace_name(rate, seed, kind)
                path = out / rel
                path.parent.mkdir(parents=True, exist_ok=True)
                header = (f"# {kind} trace: paper hourly rate {rate:g}% -> p_paper {settings.paper_p(rate):.6g} per iteration, "
                          f"x rate-scale {settings.rate_scale:g} = p {p:.6g} per step per stage; {S} stages; "
                          f"failure seed {fseed}; iterations 0..{settings.max_iterations - 1}"
                          + ("; stages 0 and S-1 removed" if kind == "inner" else "") + "\n")
                text = header + "step,stage\n" + "".join(f"{t},{s}\n" for t, s in events)
                if not path.exists() or path.read_text() != text:
                    path.write_text(text)
                paths[(rate, seed, kind)] = rel
    return paths


def _trace_kind(strategy: str, cfg: RunConfig) -> str:
    from checkfree.strategies import build_strategy

    return "full" if build_strategy(cfg).fails_edges else "inner"


def _digest(cfg: RunConfig, out: Path, extra: dict[str, Any]) -> str:
    """A run's identity: the knobs the experiment sets (not the whole config, so that a new
    config field with a default does not orphan finished runs), the preset's name, and the
    content of the trace it replays. Nothing the cost model computes: the detection time enters as
    its setting (`extra`), so a change of the cost model keeps every run's name (the report prices
    the clock anew, experiments.clock)."""
    t, r, st = cfg.train, cfg.recovery, cfg.strategy
    ident = {
        "preset": cfg.preset, "stages": cfg.num_stages, "steps": t.num_steps, "seed": t.seed,
        "microbatches": t.num_microbatches, "eval_every": t.eval_every, "eval_batches": t.eval_batches,
        "strategy": r.strategy, "fallback": r.fallback, "checkpoint_every": st.checkpoint_every,
        "snapshot_every": st.snapshot_every, "storage_fallback": st.storage_fallback,
        "cost_profile": st.cost_profile,
        "trace": hashlib.sha256((out / cfg.failures.trace).read_bytes()).hexdigest() if cfg.failures.trace else None,
        **({"data": cfg.data.source} if cfg.data.source != "shakespeare" else {}),
        # (named only when set: the runs of the CPU matrices keep their names)
        **({"microbatch_size": t.microbatch_size} if t.microbatch_size != preset(cfg.preset).train.microbatch_size
           else {}),
        **({"device": t.device} if t.device != "cpu" else {}),
        **({"bf16": True} if t.autocast_bf16 else {}),
        **extra,
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:8]


def make_spec(settings: Settings, out: Path, traces: dict, strategy: str, rate: float, seed: int,
              *, checkpoint_every: int | None = None, runtime: str = "sim", trace_kind: str | None = None) -> RunSpec:
    """The spec of one run; `traces` from `write_traces`. The name hashes everything the run
    depends on, so a finished run is reused only for exactly the same configuration."""
    if checkpoint_every == settings.ckpt_every:
        checkpoint_every = None  # the matrix's own checkpoint run
    cfg = build_config(settings, strategy, seed, None, checkpoint_every)
    kind = "none" if rate == 0 else (trace_kind or _trace_kind(strategy, cfg))
    rel = traces[(rate, seed, kind)] if kind != "none" else None
    cfg.failures.trace = rel
    max_it = settings.max_iterations  # only strategies that roll back (incl. storage fallbacks) can need more than steps
    weighs = strategy in OMEGA_STRATEGIES and rel is not None and settings.omega_scope != "stage"
    digest = _digest(cfg, out, {"runtime": runtime, "max_iterations": max_it, "detection": settings.detection,
                                **({"omega_scope": settings.omega_scope} if weighs else {}),
                                # a run at the default LR scale keeps the name it had before the setting existed
                                **({"lr_scale": settings.lr_scale} if settings.lr_scale != 1.1 else {})})
    label = strategy if checkpoint_every is None else f"{strategy}/{checkpoint_every}"
    if strategy == "checkfree" and rate == 0:
        label = "no failures"  # = every plain averaging strategy without failures
    slug = strategy + (f"-every{checkpoint_every}" if checkpoint_every else "")
    name = f"{slug}-{rate:g}pct-s{seed}-{runtime}-{digest}"
    return RunSpec(name=name, strategy=strategy, label=label, rate=rate, p=settings.p(rate), seed=seed,
                   trace_kind=kind, trace=rel, runtime=runtime, max_iterations=max_it, config=cfg.to_dict())


def reference_spec(settings: Settings, out: Path, traces: dict, seed: int) -> RunSpec:
    """The failure-free run of a seed (plain pipeline; sets the target)."""
    return make_spec(settings, out, traces, "checkfree", 0.0, seed)


def spec_for(specs: list[RunSpec], strategy: str, rate: float, seed: int, runtime: str = "sim",
             label: str | None = None) -> RunSpec | None:
    for s in specs:
        if (s.strategy, s.rate, s.seed, s.runtime) == (strategy, rate, seed, runtime) and (label is None or s.label == label):
            return s
    return None
