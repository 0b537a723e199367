"""What a run costs in real compute: FLOPs from the model config, hours on a named GPU at an assumed utilisation.

FLOPs of one training step (forward + backward = 3 forwards) over its M microbatches of B sequences of
T tokens (the training sequence length, `cfg.seq_len`): 6 N tokens for the matmuls, N the parameters a token multiplies (every block's weights but
its norms, and the LM head; the embedding is a lookup), plus the attention scores and their weighted
sum, 12 L T d per token (4 T d per block in the forward). The same figures as the cost model's
(`checkfree.costmodel.stage_forward_flops`). Redundant computation adds each stage's successor's
forward (one more forward of the whole model per step). An evaluation is one forward of `eval_batches`
microbatches. Strategies that roll back recompute steps: their estimate is a lower bound.

Hours = FLOPs / (peak x utilisation). The peak is the vendor's dense BF16 tensor-core figure; the
utilisation (model FLOPs utilisation, MFU) is an assumption, stated wherever the estimate is printed.
"""

from __future__ import annotations

from dataclasses import dataclass

from checkfree.config import RunConfig
from checkfree.costmodel import stage_forward_flops

__all__ = ["GPUS", "DEFAULT_GPU", "DEFAULT_MFU", "Compute", "matmul_params", "estimate"]

# Dense BF16 tensor-core peak, FLOP/s (NVIDIA datasheets).
GPUS = {"A100": 312e12, "H100": 989e12, "L4": 121e12}
DEFAULT_GPU = "A100"
DEFAULT_MFU = 0.4  # an assumption, not a measurement


@dataclass(frozen=True)
class Compute:
    """A run's compute: FLOPs per training step (its parts), per run, and GPU-hours."""

    tokens_per_step: int
    six_n_flops: float  # 6 N x tokens per step
    attention_flops: float  # 12 L T d x tokens per step
    step_flops: float  # a training step of this strategy (redundant: + one forward)
    run_flops: float  # steps x step_flops + evaluations
    gpu: str
    mfu: float
    gpu_hours: float


def matmul_params(cfg: RunConfig) -> int:
    """N: the parameters a token multiplies in the forward (blocks without their norms, and the LM head)."""
    m = cfg.model
    attention = 4 * cfg.seq_len * m.d_model * m.num_layers  # per token, forward
    return round((sum(stage_forward_flops(cfg)) / (cfg.train.microbatch_size * cfg.seq_len) - attention) / 2)


def estimate(cfg: RunConfig, gpu: str = DEFAULT_GPU, mfu: float = DEFAULT_MFU) -> Compute:
    """The compute of one run of `cfg` (its steps, strategy and evaluations) on `gpu` at utilisation `mfu`."""
    if gpu not in GPUS:
        raise ValueError(f"unknown GPU {gpu!r}; choose one of {sorted(GPUS)}")
    if not 0 < mfu <= 1:
        raise ValueError(f"--mfu must be in (0, 1], got {mfu}")
    m, t = cfg.model, cfg.train
    tokens = t.num_microbatches * t.microbatch_size * cfg.seq_len
    six_n = 6.0 * matmul_params(cfg) * tokens
    attention = 12.0 * m.num_layers * cfg.seq_len * m.d_model * tokens
    forward = (six_n + attention) / 3
    step = six_n + attention + (forward if cfg.recovery.strategy == "redundant" else 0.0)
    evals = t.num_steps // t.eval_every if t.eval_every else 0  # evaluates_after: every eval_every steps ...
    evals += 0 if evals and t.num_steps % t.eval_every == 0 else 1  # ... and after the last
    eval_flops = evals * t.eval_batches * sum(stage_forward_flops(cfg))
    run = t.num_steps * step + eval_flops
    return Compute(tokens, six_n, attention, step, run, gpu, mfu, run / (GPUS[gpu] * mfu) / 3600.0)
