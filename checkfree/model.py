"""LLaMA-style decoder cut into pipeline stages.

A stage owns a contiguous run of blocks named by local index (`blocks.0..k-1`), so
neighbouring stages' state dicts line up key by key (CheckFree averages them). It owns
the embedding only if it is an embedding holder and the final norm + LM head only if it
is a head holder; whether a given forward call applies them is chosen per call, because
under CheckFree+ a stage may be first in one microbatch's route and second in the next.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from checkfree.config import ModelConfig

__all__ = [
    "StageSpec",
    "plan_stages",
    "RMSNorm",
    "Attention",
    "Block",
    "RESIDUAL_OUTPUTS",
    "Head",
    "PipelineStage",
    "LlamaModel",
    "check_pipelinable",
    "derive_seed",
    "init_stage",
    "stage_to_global",
    "global_to_stage",
    "count_parameters",
]


@dataclass(frozen=True)
class StageSpec:
    """Stage `index` of `num_stages` holds global layers [layer_start, layer_end)."""

    index: int
    num_stages: int
    layer_start: int
    layer_end: int

    @property
    def num_blocks(self) -> int:
        return self.layer_end - self.layer_start

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1


def plan_stages(num_layers: int, num_stages: int) -> list[StageSpec]:
    """Split `num_layers` blocks into `num_stages` contiguous stages, as evenly as possible.

    The first `num_layers % num_stages` stages get one block more than the others.
    """
    if num_stages < 2:
        raise ValueError(f"a pipeline needs at least 2 stages, got num_stages={num_stages}")
    if num_layers < num_stages:
        raise ValueError(
            f"cannot split {num_layers} layers into {num_stages} stages: every stage needs at least "
            f"one block (num_layers={num_layers} < num_stages={num_stages}); use fewer stages or more layers"
        )
    base, extra = divmod(num_layers, num_stages)
    specs, start = [], 0
    for i in range(num_stages):
        n = base + (1 if i < extra else 0)
        specs.append(StageSpec(i, num_stages, start, start + n))
        start += n
    return specs


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


def rope_tables(head_dim: int, length: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos/sin tables of shape (length, head_dim/2), on the CPU even inside a meta-device
    context: a stage built without weights (`StageWorker(init=False)`) still needs them."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim)
    angles = torch.outer(torch.arange(length, dtype=torch.float32, device="cpu"), inv)  # (T, hs/2)
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs (x[..., 2i], x[..., 2i+1]); x is (B, nh, T, hs)."""
    x1, x2 = x[..., 0::2], x[..., 1::2]  # (B, nh, T, hs/2)
    c, s = cos[: x.size(-2)].to(x.dtype), sin[: x.size(-2)].to(x.dtype)
    out = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)  # (B, nh, T, hs/2, 2)
    return out.flatten(-2)


class Attention(nn.Module):
    """Causal multi-head attention with RoPE and no biases.

    `guard`, when set, is a callable replacing the attention arithmetic (the ABFT guard of
    checkfree.abft); it receives this module and the input and returns the output.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.kv_heads
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wk = nn.Linear(cfg.d_model, self.num_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, self.num_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        cos, sin = rope_tables(self.head_dim, cfg.context_length, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.guard: Callable[[Attention, Tensor], Tensor] | None = None  # the ABFT guard (checkfree.abft)

    def split_heads(self, x: Tensor, heads: int | None = None) -> Tensor:
        """(B, T, h*hs) -> (B, h, T, hs); h is num_heads unless given (num_kv_heads for k and v)."""
        b, t, _ = x.shape
        return x.view(b, t, heads or self.num_heads, self.head_dim).transpose(1, 2)  # (B, h, T, hs)

    def expand_kv(self, x: Tensor) -> Tensor:
        """Grouped-query attention: each of the num_kv_heads heads serves num_heads / num_kv_heads
        consecutive query heads (as HF's repeat_kv). (B, nkv, T, hs) -> (B, nh, T, hs)."""
        rep = self.num_heads // self.num_kv_heads
        return x if rep == 1 else x.repeat_interleave(rep, dim=1)

    def forward(self, x: Tensor) -> Tensor:
        if self.guard is not None:
            return self.guard(self, x)
        b, t, c = x.shape
        q = apply_rope(self.split_heads(self.wq(x)), self.rope_cos, self.rope_sin)
        k = apply_rope(self.split_heads(self.wk(x), self.num_kv_heads), self.rope_cos, self.rope_sin)
        v = self.split_heads(self.wv(x), self.num_kv_heads)
        k, v = self.expand_kv(k), self.expand_kv(v)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        return self.wo(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hidden = cfg.mlp_width
        self.w1 = nn.Linear(cfg.d_model, hidden, bias=False)
        self.w3 = nn.Linear(cfg.d_model, hidden, bias=False)
        self.w2 = nn.Linear(hidden, cfg.d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


# The projections each residual branch of a Block ends in (keys relative to the block): with both zero the
# block is exactly x -> x (checkfree.recovery.identity_init).
RESIDUAL_OUTPUTS = ("attn.wo.weight", "mlp.w2.weight")


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Head(nn.Module):
    """Final RMSNorm and the LM head (its own matrix; LlamaModel ties it to the embedding if configured)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.out = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.norm(x))


class PipelineStage(nn.Module):
    """One pipeline stage: optional embedding, `spec.num_blocks` blocks, optional head."""

    def __init__(self, cfg: ModelConfig, spec: StageSpec, *, has_embedding: bool, has_head: bool) -> None:
        super().__init__()
        check_pipelinable(cfg)
        self.cfg, self.spec = cfg, spec
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model) if has_embedding else None
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(spec.num_blocks))
        self.head = Head(cfg) if has_head else None

    def forward(self, x: Tensor, *, embed: bool = False, head: bool = False) -> Tensor:
        """x: token ids (B, T) if `embed`, else hidden states (B, T, C).

        Returns hidden states (B, T, C), or logits (B, T, V) if `head`.
        """
        if embed:
            if self.embed is None:
                raise ValueError(f"stage {self.spec.index} holds no embedding but was asked to embed")
            x = self.embed(x)  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        if head:
            if self.head is None:
                raise ValueError(f"stage {self.spec.index} holds no head but was asked to apply it")
            x = self.head(x)  # (B, T, V)
        return x


def check_pipelinable(cfg: ModelConfig) -> None:
    """Tied embeddings cannot be cut into stages: the embedding lives on the first stage(s) and
    the head on the last, so one matrix would have to be one parameter in two processes."""
    if cfg.tie_embeddings:
        raise ValueError("tie_embeddings=True cannot be trained as a pipeline: the embedding and the LM head live "
                         "on different stages. Untie them (the head starts as a copy of the embedding; "
                         "--init-from and --model-config do this for a tied HF model)")


def derive_seed(*parts: object) -> int:
    """A 63-bit seed derived from any tuple of values, identical in every process."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _init_module(module: nn.Module, std: float, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, p in module.named_parameters():
        with torch.no_grad():
            if p.ndim == 1:  # RMSNorm weights are the only vectors
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std)


def init_stage(stage: PipelineStage, seed: int) -> None:
    """Initialise a stage deterministically: each global layer, the embedding and the head
    get their own seed, so the same layer has the same weights whatever the stage split,
    and an embedding/head replica starts bit-identical to its primary."""
    std = stage.cfg.init_std
    if stage.embed is not None:
        _init_module(stage.embed, std, derive_seed(seed, "embed"))
    for j, block in enumerate(stage.blocks):
        _init_module(block, std, derive_seed(seed, "layer", stage.spec.layer_start + j))
    if stage.head is not None:
        _init_module(stage.head, std, derive_seed(seed, "head"))


class LlamaModel(nn.Module):
    """The unsplit model, with global layer names (`layers.{i}`): export target and test oracle.

    With `tie_embeddings` the head's matrix is the embedding's (one parameter, both names)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.head = Head(cfg)
        if cfg.tie_embeddings:
            self.head.out.weight = self.embed.weight

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens)  # (B, T, C)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)  # (B, T, V)


def stage_to_global(spec: StageSpec, state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Rename a stage's state dict to the unsplit model's global names."""
    out = {}
    for key, value in state.items():
        if key.startswith("blocks."):
            local, rest = key[len("blocks."):].split(".", 1)
            out[f"layers.{spec.layer_start + int(local)}.{rest}"] = value
        else:
            out[key] = value
    return out


def global_to_stage(spec: StageSpec, full: dict[str, Tensor], *, embed: bool, head: bool) -> dict[str, Tensor]:
    """Cut a stage's state dict (local block names) out of the unsplit model's state dict."""
    out = {}
    for key, value in full.items():
        if key.startswith("layers."):
            idx, rest = key[len("layers."):].split(".", 1)
            if spec.layer_start <= int(idx) < spec.layer_end:
                out[f"blocks.{int(idx) - spec.layer_start}.{rest}"] = value
        elif (key.startswith("embed.") and embed) or (key.startswith("head.") and head):
            out[key] = value
    return out


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())

