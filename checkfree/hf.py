"""Hugging Face Llama checkpoints in and out, with no dependency on `transformers`.

Out: the unsplit model's state dict (checkfree.export) becomes a directory that
`transformers.AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained` load
as they are: `model.safetensors` under Llama key names, `config.json` (model_type llama),
`tokenizer.json` and `tokenizer_config.json`.

In: an HF Llama directory (or hub name) gives a ModelConfig (`--model-config`) and every
stage's starting weights (`--init-from`), read tensor by tensor, so a peer only reads its
own stage.

RoPE: this model rotates interleaved pairs (x[2i], x[2i+1]) of each head, HF's Llama the
halves (x[i], x[i + hs/2]), both with frequency i. Permuting the rows of W_q and W_k inside
each head maps one onto the other; q·k is unchanged because q and k move together. Without
it the logits still look close (~3e-3 apart on a short run): it is a silent error.

Tied embeddings: a tied HF model comes in untied (the head starts as a copy of the
embedding) because a pipeline keeps the embedding and the head on different stages
(checkfree.model.check_pipelinable); it goes out tied only if its ModelConfig says so.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from checkfree.config import ModelConfig, RunConfig
from checkfree.model import StageSpec, stage_to_global

__all__ = [
    "HF_BLOCK_NAMES",
    "HF_TOP_NAMES",
    "HFCheckpoint",
    "check_init_from",
    "configure_from_hf",
    "from_hf_tensor",
    "hf_config",
    "hf_name",
    "load_stage_state",
    "model_config_from_hf",
    "resolve_source",
    "rope_to_halves",
    "rope_to_pairs",
    "save_hf",
    "save_tokenizer",
    "to_hf_state",
]

log = logging.getLogger(__name__)

# ours, inside layers.{i}. -> HF, inside model.layers.{i}.
HF_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.wq.weight": "self_attn.q_proj.weight",
    "attn.wk.weight": "self_attn.k_proj.weight",
    "attn.wv.weight": "self_attn.v_proj.weight",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.w1.weight": "mlp.gate_proj.weight",
    "mlp.w3.weight": "mlp.up_proj.weight",
    "mlp.w2.weight": "mlp.down_proj.weight",
}
HF_TOP_NAMES = {"embed.weight": "model.embed_tokens.weight", "head.norm.weight": "model.norm.weight",
                "head.out.weight": "lm_head.weight"}


def hf_name(key: str) -> str:
    """The HF Llama name of a global checkfree key (`layers.3.attn.wq.weight` -> `model.layers.3.self_attn...`)."""
    if key in HF_TOP_NAMES:
        return HF_TOP_NAMES[key]
    _, idx, rest = key.split(".", 2)
    return f"model.layers.{idx}.{HF_BLOCK_NAMES[rest]}"


def _rope_heads(cfg: ModelConfig, key: str) -> int | None:
    """Heads of a W_q / W_k matrix (whose rows RoPE rotates), None for any other key."""
    if key.endswith("attn.wq.weight"):
        return cfg.num_heads
    if key.endswith("attn.wk.weight"):
        return cfg.kv_heads
    return None


def rope_to_halves(w: Tensor, heads: int) -> Tensor:
    """Rows of each head from interleaved pairs (0,1),(2,3).. to halves (0..hs/2-1 | hs/2..hs-1)."""
    hs = w.shape[0] // heads
    return w.reshape(heads, hs // 2, 2, -1).transpose(1, 2).reshape(w.shape)  # (h, 2, hs/2, C) -> rows


def rope_to_pairs(w: Tensor, heads: int) -> Tensor:
    """Inverse of `rope_to_halves`."""
    hs = w.shape[0] // heads
    return w.reshape(heads, 2, hs // 2, -1).transpose(1, 2).reshape(w.shape)  # (h, hs/2, 2, C) -> rows


def to_hf_state(cfg: ModelConfig, full: dict[str, Tensor]) -> dict[str, Tensor]:
    """The unsplit model's state dict (global names) under HF Llama names, W_q/W_k permuted."""
    out = {}
    for key, value in full.items():
        if key == "head.out.weight" and cfg.tie_embeddings:
            continue  # HF re-ties lm_head to embed_tokens
        heads = _rope_heads(cfg, key)
        value = value.detach().cpu()
        out[hf_name(key)] = (rope_to_halves(value, heads) if heads else value).contiguous()
    return out


def from_hf_tensor(cfg: ModelConfig, key: str, value: Tensor) -> Tensor:
    """An HF tensor as the checkfree tensor `key` (a global name): float32, W_q/W_k permuted back."""
    heads = _rope_heads(cfg, key)
    value = value.to(torch.float32)
    return (rope_to_pairs(value, heads) if heads else value).contiguous()


def hf_config(cfg: ModelConfig, *, eos_token_id: int | None = None) -> dict[str, Any]:
    """config.json of an HF `LlamaForCausalLM` with this shape (rope_theta both at the top, as
    transformers 4 reads it, and in rope_parameters, as transformers 5 does)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.mlp_width,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.context_length,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "bos_token_id": None,
        "eos_token_id": eos_token_id,
        "pad_token_id": None,
        "torch_dtype": "float32",
        "use_cache": True,
    }


def _refuse(source: str, what: str) -> None:
    raise ValueError(f"{source}: {what}; only plain Llama checkpoints can be trained here")


def model_config_from_hf(hf: dict[str, Any], *, source: str = "config.json") -> ModelConfig:
    """The ModelConfig of an HF Llama config.json; anything this model cannot reproduce is an error.

    A tied model comes back untied (module docstring); the caller copies the embedding into the head."""
    if hf.get("model_type") != "llama":
        _refuse(source, f"model_type is {hf.get('model_type')!r}, not 'llama'")
    if hf.get("hidden_act", "silu") != "silu":
        _refuse(source, f"hidden_act is {hf['hidden_act']!r}, not 'silu'")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        _refuse(source, "it has attention or MLP biases")
    rope = hf.get("rope_parameters") or {}
    if (hf.get("rope_scaling") or {}).get("rope_type", "default") != "default" or \
            rope.get("rope_type", "default") != "default":
        _refuse(source, "it uses RoPE scaling")
    d, heads = hf["hidden_size"], hf["num_attention_heads"]
    if hf.get("head_dim") not in (None, d // heads):
        _refuse(source, f"head_dim={hf['head_dim']} is not hidden_size / num_attention_heads = {d // heads}")
    if hf.get("tie_word_embeddings", False):
        log.warning("%s: tied embeddings are untied for the pipeline: the LM head starts as a copy of the "
                    "embedding and trains on its own stage", source)
    return ModelConfig(vocab_size=hf["vocab_size"], d_model=d, num_heads=heads,
                       num_kv_heads=hf.get("num_key_value_heads") or heads, num_layers=hf["num_hidden_layers"],
                       context_length=hf.get("max_position_embeddings", 2048), mlp_hidden=hf["intermediate_size"],
                       norm_eps=hf.get("rms_norm_eps", 1e-6),
                       rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 1e4))),
                       init_std=hf.get("initializer_range", 0.02))


def save_tokenizer(tok, out_dir: str | Path, *, context_length: int) -> None:
    """`tokenizer.json` and a `tokenizer_config.json` that makes AutoTokenizer load it as a fast
    tokenizer with the same ids and the same decoding (no extra tokens, no space clean-up)."""
    from checkfree.data import eos_token

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    eos = eos_token(tok)
    meta = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": context_length,
            "eos_token": eos, "clean_up_tokenization_spaces": False, "add_bos_token": False,
            "add_eos_token": False}
    (out / "tokenizer_config.json").write_text(json.dumps(meta, indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps({"eos_token": eos}, indent=2))


def save_hf(cfg: ModelConfig, full: dict[str, Tensor], out_dir: str | Path, tokenizer=None) -> Path:
    """Write an HF Llama directory from the unsplit model's state dict (and the tokenizer)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--output {str(out)!r} is a file; --format hf writes a directory")
    out.mkdir(exist_ok=True)
    save_file(to_hf_state(cfg, full), str(out / "model.safetensors"), metadata={"format": "pt"})
    eos = None
    if tokenizer is not None:
        from checkfree.data import eos_token

        save_tokenizer(tokenizer, out, context_length=cfg.context_length)
        eos = tokenizer.token_to_id(eos_token(tokenizer))
    (out / "config.json").write_text(json.dumps(hf_config(cfg, eos_token_id=eos), indent=2))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}, indent=2))
    return out


def resolve_source(source: str) -> Path:
    """A local HF directory as it is; anything else a hub name, downloaded (config, safetensors
    weights, tokenizer) into the HF cache, so every peer resolves it the same way."""
    path = Path(source).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"--init-from {source!r}: the directory has no config.json (not an HF model directory)")
        return path
    if path.exists() or source.startswith((".", "/", "~")):
        raise ValueError(f"--init-from {source!r}: not a directory (give an HF model directory or a hub name)")
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:
        raise ValueError(f"--init-from {source!r} is a hub name: pip install 'checkfree[hf]'") from e
    patterns = ["config.json", "*.safetensors", "model.safetensors.index.json", "tokenizer.json",
                "tokenizer_config.json", "special_tokens_map.json"]
    try:
        return Path(snapshot_download(source, allow_patterns=patterns))
    except (OSError, ValueError) as e:  # offline, unknown repository, malformed name
        raise ValueError(f"--init-from {source!r} is not a local directory and could not be fetched from the "
                         f"Hugging Face hub ({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None


class HFCheckpoint:
    """The tensors of an HF model directory by HF name, read one at a time (safetensors, single
    or sharded, or pytorch_model.bin memory-mapped)."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.files: dict[str, Path] = {}
        for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
            if (directory / index_name).is_file():
                weight_map = json.loads((directory / index_name).read_text())["weight_map"]
                self.files = {k: directory / f for k, f in weight_map.items()}
                break
        else:
            for name in ("model.safetensors", "pytorch_model.bin"):
                if (directory / name).is_file():
                    self.files = {k: directory / name for k in self._keys(directory / name)}
                    break
        if not self.files:
            raise ValueError(f"{directory}: no model.safetensors, pytorch_model.bin or index of shards")
        self._bins: dict[Path, dict[str, Tensor]] = {}

    def _keys(self, path: Path) -> list[str]:
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as f:
                return list(f.keys())
        return list(self._bin(path))

    def _bin(self, path: Path) -> dict[str, Tensor]:
        if path not in self._bins:
            self._bins[path] = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        return self._bins[path]

    def __contains__(self, key: str) -> bool:
        return key in self.files

    def shape(self, key: str) -> tuple[int, ...]:
        path = self.files[key]
        if path.suffix != ".safetensors":
            return tuple(self._bin(path)[key].shape)
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            return tuple(f.get_slice(key).get_shape())

    def tensor(self, key: str) -> Tensor:
        path = self.files[key]
        if path.suffix != ".safetensors":
            return self._bin(path)[key]
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            return f.get_tensor(key)


def _hf_key(ckpt: HFCheckpoint, key: str) -> str:
    """The HF tensor holding checkfree's global `key`; a tied model's head is its embedding."""
    name = hf_name(key)
    if name == "lm_head.weight" and name not in ckpt:
        return HF_TOP_NAMES["embed.weight"]
    if name not in ckpt:
        raise ValueError(f"--init-from {ckpt.dir}: the checkpoint has no tensor {name!r}")
    return name


def load_stage_state(cfg: ModelConfig, spec: StageSpec, local_keys: list[str], source: str) -> dict[str, Tensor]:
    """A stage's state dict (its local names `local_keys`) read from the HF model `source`."""
    ckpt = HFCheckpoint(resolve_source(source))
    names = dict(zip(stage_to_global(spec, dict.fromkeys(local_keys)), local_keys))  # global -> local
    return {local: from_hf_tensor(cfg, key, ckpt.tensor(_hf_key(ckpt, key))) for key, local in names.items()}


def check_init_from(cfg: ModelConfig, source: str) -> None:
    """Every tensor of the configured model is in the checkpoint with the right shape (one-line errors)."""
    from checkfree.model import LlamaModel

    ckpt = HFCheckpoint(resolve_source(source))
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in LlamaModel(cfg).state_dict().items()}
    for key, shape in expected.items():
        got = ckpt.shape(_hf_key(ckpt, key))
        if got != shape:
            raise ValueError(f"--init-from {source!r}: {hf_name(key)} has shape {got}, the configured model "
                             f"expects {shape} (check --model-config / --layers / --d-model / --heads)")


# training sequence length of an HF model unless --seq-len is given: its max_position_embeddings (2k-128k) is the
# position limit, not a length a CPU step can afford (SmolLM2 at its 8192 was killed for memory at 24 GB with 2 x 2
# sequences per step)
HF_DEFAULT_SEQ_LEN = 256
# learning rate of a run that starts from pretrained weights unless --lr is given: the presets' are for training from
# scratch (SmolLM2 at the tiny preset's 3e-3: validation loss 3.6 -> 17.5 in two steps)
HF_FINETUNE_LR = 1e-4


def configure_from_hf(cfg: RunConfig, *, model_config: str | None, init_from: str | None) -> None:
    """--model-config FILE: the model's shape from an HF config.json. --init-from DIR|NAME: the
    shape from its config.json (unless --model-config is given), its weights at the start, and
    its tokenizer.json unless a tokenizer is configured. Either sets the training sequence length to
    `HF_DEFAULT_SEQ_LEN` (at most the model's context length) unless one is configured; --init-from lowers
    the learning rate to at most `HF_FINETUNE_LR` (flags given after, e.g. --lr, still apply)."""
    if model_config:
        path = Path(model_config)
        if not path.is_file():
            raise ValueError(f"--model-config {model_config!r} does not exist")
        cfg.model = model_config_from_hf(_read_json(path), source=f"--model-config {model_config}")
    if init_from:
        directory = resolve_source(init_from)
        if not model_config:
            cfg.model = model_config_from_hf(_read_json(directory / "config.json"), source=f"--init-from {init_from}")
        cfg.train.init_from = init_from
        if cfg.train.lr > HF_FINETUNE_LR:
            log.info("--init-from: learning rate %g (fine-tuning) instead of the preset's %g; --lr sets another",
                     HF_FINETUNE_LR, cfg.train.lr)
            cfg.train.lr = HF_FINETUNE_LR
        if cfg.data.tokenizer is None and (directory / "tokenizer.json").is_file():
            # a local directory every peer has; a hub name every peer fetches the same way
            local = Path(init_from).expanduser().is_dir()
            cfg.data.tokenizer = str(directory / "tokenizer.json") if local else init_from
    if (model_config or init_from) and cfg.train.seq_len is None:
        cfg.train.seq_len = min(cfg.model.context_length, HF_DEFAULT_SEQ_LEN)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
