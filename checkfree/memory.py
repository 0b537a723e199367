"""The memory a configuration needs, estimated before anything starts, and the check that refuses one that
cannot fit on this machine.

Per stage, float32 throughout:

* weights, gradients, Adam's two moments: 4 + 4 + 8 bytes per parameter (the stage's own modules: a
  CheckFree+ replica of the embedding or head counts where it is held);
* activations: what autograd keeps for each microbatch in flight, per token: 11 d + 4 h + n_heads + 2 floats
  per block (d the width, h the MLP width), the embedding's output and token ids on an embedding stage, the
  received input elsewhere, and the final norm (3 d + 3) plus the log-softmax (V floats) on the head stage; measured with the
  worker's saved-tensor hook (`StageWorker.take_inflight_peak`, tests/test_memory.py holds them to it);
* logits: on the head stage, 2 more (B, T, V) float32 tensors while a microbatch's loss and its gradient
  are computed (logits, their gradient), and 2 at an evaluation;
* saves (`--save-every`): a stage's state is copied, then serialized, while the serialized states of all
  stages are held: 2 x 16 bytes per parameter of the largest stage plus 16 per parameter of the model;
* the process: Python, torch and the libraries, `PROCESS_BYTES` (measured: ~230 MB imported, ~350 MB
  after a first step).

Microbatches in flight: the simulator runs one microbatch forward and backward at a time through every stage
(one process holds all stages: the estimate is their sum). A swarm peer (one process per stage) holds all M
under GPipe and at most S under 1F1B (`peers.passes`).

Available memory: the kernel's MemAvailable, or less where a cgroup limit says so; a CUDA device's free memory
for what lives on the device (everything but the process's own).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

import torch

from checkfree.config import RunConfig

__all__ = ["StageMemory", "stage_memory", "simulator_memory", "swarm_memory", "available_bytes", "check_fits",
           "PROCESS_BYTES", "GIB"]

GIB = 1 << 30
PROCESS_BYTES = 400 << 20  # interpreter, torch, numpy, tokenizers and allocator slack of one process
BLOCK_FLOATS_PER_TOKEN = (11, 4, 1, 2)  # (x d, x mlp width, x heads, + constant), measured: module docstring


@dataclass(frozen=True)
class StageMemory:
    """Bytes one stage needs, by kind."""

    weights: int = 0
    gradients: int = 0
    adam: int = 0
    activations: int = 0
    logits: int = 0
    saves: int = 0
    process: int = 0

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))

    def __add__(self, other: StageMemory) -> StageMemory:
        return StageMemory(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def describe(self) -> str:
        """'weights 0.6, gradients 0.6, ... GiB' of the nonzero parts."""
        parts = [f"{f.name} {getattr(self, f.name) / GIB:.1f}" for f in fields(self) if getattr(self, f.name)]
        return ", ".join(parts) + " GiB"


def _holds(cfg: RunConfig, stage: int) -> tuple[bool, bool]:
    """(embedding, head): what the stage holds under the run's strategy (CheckFree+ replicas included)."""
    from checkfree.pipeline import edge_holders
    from checkfree.recovery import RECOVERY_RULES

    rule = RECOVERY_RULES.get(cfg.recovery.strategy)
    holders = edge_holders(cfg.num_stages, bool(rule and rule.plus))
    return stage in holders["embed"], stage in holders["head"]


class _SkipInit(torch.overrides.TorchFunctionMode):
    """Initialisations skipped (torch.nn.init's functions and the in-place random fills return their tensor as it
    is): on the meta device they compute nothing, but the first one loads torch's Python reference kernels and
    torch._dynamo with them, 1.9 to 2.9 s of CPU in every `checkfree simulate` and `checkfree local` start."""

    RANDOM = {torch.Tensor.normal_, torch.Tensor.uniform_, torch.Tensor.random_, torch.Tensor.bernoulli_,
              torch.Tensor.exponential_}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.RANDOM or getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else next(iter((kwargs or {}).values()))
        return func(*args, **(kwargs or {}))


def _stage_params(cfg: RunConfig, stage: int) -> int:
    """Parameters of the stage's module (built on the meta device, uninitialised: no memory, no time)."""
    from checkfree.model import PipelineStage, plan_stages

    embed, head = _holds(cfg, stage)
    with torch.device("meta"), _SkipInit():
        module = PipelineStage(cfg.model, plan_stages(cfg.model.num_layers, cfg.num_stages)[stage],
                               has_embedding=embed, has_head=head)
    return sum(p.numel() for p in module.parameters())


def _activation_floats(cfg: RunConfig, blocks: int, embed: bool, head: bool) -> int:
    """Floats autograd keeps per token of one microbatch on this stage."""
    m = cfg.model
    a, b, c, k = BLOCK_FLOATS_PER_TOKEN
    per_block = a * m.d_model + b * m.mlp_width + c * m.num_heads + k
    if cfg.guard.abft or cfg.guard.explicit_attention:
        per_block += 2 * m.num_heads * cfg.seq_len  # explicit attention keeps its (T, T) scores and weights
    if head:  # the final norm's tensors and the log-softmax (the input received is the norm's)
        return blocks * per_block + 3 * m.d_model + 3 + m.vocab_size
    # the embedding's output and its int64 token ids (2 floats), or the input received
    return blocks * per_block + m.d_model + (2 if embed else 0)


def stage_memory(cfg: RunConfig, stage: int, in_flight: int) -> StageMemory:
    """One stage's weights, gradients, Adam state and the activations of `in_flight` microbatches (no process,
    no saves)."""
    from checkfree.model import plan_stages

    spec = plan_stages(cfg.model.num_layers, cfg.num_stages)[stage]
    embed, head = _holds(cfg, stage)
    params = _stage_params(cfg, stage)
    tokens = cfg.train.microbatch_size * cfg.seq_len
    act = 4 * tokens * _activation_floats(cfg, spec.num_blocks, embed, head)
    logits = 4 * 2 * tokens * cfg.model.vocab_size if head else 0
    return StageMemory(weights=4 * params, gradients=4 * params, adam=8 * params, activations=in_flight * act,
                       logits=logits)


def _saves(cfg: RunConfig, save_every: int) -> int:
    if not save_every:
        return 0
    params = [_stage_params(cfg, s) for s in range(cfg.num_stages)]
    return 16 * sum(params) + 2 * 16 * max(params)


def simulator_memory(cfg: RunConfig, *, save_every: int = 0) -> StageMemory:
    """The simulator's one process: every stage, one microbatch in flight."""
    total = StageMemory(process=PROCESS_BYTES, saves=_saves(cfg, save_every))
    for s in range(cfg.num_stages):
        total = total + stage_memory(cfg, s, in_flight=1)
    return total


def swarm_memory(cfg: RunConfig, stage: int) -> StageMemory:
    """One swarm peer hosting `stage`: its microbatches in flight under the run's schedule."""
    m = cfg.train.num_microbatches
    in_flight = min(m, cfg.num_stages) if cfg.train.schedule == "1f1b" else m
    return stage_memory(cfg, stage, in_flight) + StageMemory(process=PROCESS_BYTES)


def _cgroup_free() -> int | None:
    """What the cgroup (v2, else v1) still allows, if it sets a limit."""
    for limit, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                         ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            lim, use = Path(limit).read_text().strip(), Path(usage).read_text().strip()
        except OSError:
            continue
        if lim.isdigit() and int(lim) < 1 << 60:
            return max(0, int(lim) - int(use))
    return None


def available_bytes(device: torch.device | None = None) -> int:
    """Memory a new run can use now: a CUDA device's free memory, else MemAvailable (within the cgroup's)."""
    if device is not None and device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
    free = int(info["MemAvailable"].split()[0]) * 1024
    cg = _cgroup_free()
    return min(free, cg) if cg is not None else free


def check_fits(need: StageMemory, what: str, device: torch.device | None = None) -> None:
    """Refuse, in one line, a configuration that needs more memory than there is."""
    on_device = device is not None and device.type == "cuda"
    bytes_needed = need.total - (need.process if on_device else 0)
    have = available_bytes(device)
    if bytes_needed > have:
        where = f"free on {device}" if on_device else "available"
        raise ValueError(f"{what} needs about {bytes_needed / GIB:.1f} GiB ({need.describe()}) but {have / GIB:.1f} "
                         f"GiB is {where}; lower --seq-len, --microbatch-size, or use more stages/peers "
                         f"(--skip-memory-check runs it anyway)")
