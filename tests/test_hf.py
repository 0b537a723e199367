"""Hugging Face models out (`export --format hf`) and in (`--init-from`, `--model-config`).

The runs go through the command line (`cli.main.main`, in process), so the flags are
what is tested; `transformers` loads the export with no extra code.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the HF tests need the 'hf' extra (in 'dev')")

from safetensors.torch import load_file

from checkfree.flags import config_from_args
from checkfree.config import ModelConfig
from checkfree.export import load_export
from checkfree.hf import hf_config, load_stage_state, rope_to_pairs, save_hf
from checkfree.model import LlamaModel, PipelineStage, plan_stages, stage_to_global
from checkfree.rundir import read_jsonl
from checkfree.strategies import build_workers
from cli.main import build_parser, main

TEXTS = ["To be, or not to be: that is the question.",
         "  Whether 'tis nobler\n\tin the mind to suffer   the slings  ",
         "Ünïcödé — “quotes”, emoji 🎭 and 日本語<|endoftext|>next document",
         ""]

# A Llama config with grouped-query attention (4 query heads share 2 key/value heads) and an
# MLP width that is no multiple of d_model, as Llama-2's 11008 is not of 4096.
GQA = {"vocab_size": 512, "d_model": 32, "num_heads": 4, "num_kv_heads": 2, "num_layers": 4, "context_length": 32,
       "mlp_hidden": 88}


@contextlib.contextmanager
def _cache_env(path: str) -> Iterator[None]:
    """$CHECKFREE_CACHE set to `path` (where the CLI finds its token/tokenizer cache), then as it was."""
    old = os.environ.get("CHECKFREE_CACHE")
    os.environ["CHECKFREE_CACHE"] = path
    try:
        yield
    finally:
        if old is None:
            del os.environ["CHECKFREE_CACHE"]
        else:
            os.environ["CHECKFREE_CACHE"] = old


@pytest.fixture(autouse=True)
def cache(session_cache):
    """The session's token/tokenizer cache (tests/conftest.py) for this module's CLI runs: the tiny preset's corpus
    is not tokenized again for them."""
    with _cache_env(session_cache):
        yield


def _cli(*argv: str) -> None:
    assert main([str(a) for a in argv]) == 0


def _train_and_export(root: Path, cache: str, *flags: str, steps: int = 40) -> tuple[Path, Path]:
    run, out = root / "run", root / "hf"
    with _cache_env(cache):
        _cli("simulate", "--preset", "tiny", "--steps", steps, "--eval-every", 0, "--no-progress", "--out", run, *flags)
        _cli("export", "--run", run, "--format", "hf", "--output", out)
    return run, out


# The two trained runs are the session's (read only by the tests): pytest-xdist's worksteal can hand a worker this
# module's tests in more than one stretch, and a module-scoped run was trained again for each.
@pytest.fixture(scope="session")
def mha_run(session_cache, tmp_path_factory):
    return _train_and_export(tmp_path_factory.mktemp("mha"), session_cache)


@pytest.fixture(scope="session")
def gqa_run(session_cache, tmp_path_factory):
    root = tmp_path_factory.mktemp("gqa")
    (root / "config.json").write_text(json.dumps(hf_config(ModelConfig(**GQA))))
    return _train_and_export(root, session_cache, "--model-config", root / "config.json")


def _logits_both(run: Path, out: Path) -> tuple[torch.Tensor, torch.Tensor, torch.nn.Module]:
    ours = load_export(run / "final_weights.safetensors").eval()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokens = torch.randint(0, ours.cfg.vocab_size, (4, ours.cfg.context_length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return ours(tokens), theirs(tokens).logits, theirs


@pytest.mark.parametrize("name", ["mha_run", "gqa_run"])
def test_export_loads_in_transformers_with_equal_logits(name, request):
    run, out = request.getfixturevalue(name)
    ours, theirs, model = _logits_both(run, out)
    assert type(model).__name__ == "LlamaForCausalLM"
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["tie_word_embeddings"] is False
    expected = ModelConfig(**GQA) if name == "gqa_run" else load_export(run / "final_weights.safetensors").cfg
    assert (model.config.num_key_value_heads, model.config.intermediate_size, model.config.num_hidden_layers) == \
        (expected.kv_heads, expected.mlp_width, expected.num_layers)
    delta = float((ours - theirs).abs().max())
    assert delta < 1e-5, f"{name}: max |logits difference| {delta:.3g}"
    # the RoPE row permutation is what makes them equal: without it they are close, and wrong
    for layer in model.model.layers:
        for proj, heads in ((layer.self_attn.q_proj, expected.num_heads), (layer.self_attn.k_proj, expected.kv_heads)):
            proj.weight.data = rope_to_pairs(proj.weight.data, heads)
    tokens = torch.randint(0, expected.vocab_size, (4, expected.context_length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        unpermuted = float((ours - model(tokens).logits).abs().max())
    print(f"{name}: max |dlogits| {delta:.3g} exported, {unpermuted:.3g} without the RoPE permutation")
    assert unpermuted > 100 * max(delta, 1e-7), (unpermuted, delta)


def test_tokenizer_round_trips(mha_run):
    from tokenizers import Tokenizer

    run, out = mha_run
    ours = Tokenizer.from_file(str(run / "tokenizer.json"))  # the run directory keeps its tokenizer
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    for text in TEXTS:
        ids = theirs(text)["input_ids"]
        assert ids == ours.encode(text).ids
        assert theirs.decode(ids) == text
    assert theirs.eos_token == "<|endoftext|>"
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == ours.token_to_id("<|endoftext|>")


def test_init_from_continues_training(mha_run, tmp_path):
    run, out = mha_run
    _cli("simulate", "--init-from", out, "--steps", 2, "--eval-every", 0, "--no-progress", "--out", tmp_path / "next")
    before = read_jsonl(run / "metrics.jsonl")
    first = read_jsonl(tmp_path / "next" / "metrics.jsonl")[0]["loss"]
    final, fresh = before[-1]["loss"], before[0]["loss"]
    print(f"first loss from the export {first:.4f}, the run's final {final:.4f}, its fresh start {fresh:.4f}")
    assert abs(first - final) / final < 0.05, (first, final)
    assert fresh - first > 0.5, (fresh, first)  # far below a fresh initialisation's loss
    cfg = json.loads((tmp_path / "next" / "config.json").read_text())
    assert cfg["train"]["init_from"] == str(out) and cfg["data"]["tokenizer"] == str(out / "tokenizer.json")


def test_init_from_gqa_export_equals_its_weights(gqa_run):
    """--init-from takes the weights back exactly (inverse permutation), every stage of them."""
    run, out = gqa_run
    cfg = config_from_args(build_parser().parse_args(["simulate", "--init-from", str(out), "--steps", "1"]))
    assert (cfg.model.num_kv_heads, cfg.model.mlp_hidden, cfg.model.num_layers) == (2, 88, 4)
    want = load_export(run / "final_weights.safetensors").state_dict()
    for spec, worker in zip(plan_stages(cfg.model.num_layers, cfg.num_stages), build_workers(cfg)):
        for key, value in stage_to_global(spec, worker.state_dict()).items():
            assert torch.equal(value, want[key]), key


def test_tied_model_is_untied_for_the_pipeline(cache, tmp_path):
    cfg = ModelConfig(vocab_size=64, d_model=16, num_heads=2, num_layers=2, context_length=8, tie_embeddings=True)
    with pytest.raises(ValueError, match="cannot be trained as a pipeline"):
        PipelineStage(cfg, plan_stages(2, 2)[0], has_embedding=True, has_head=False)
    torch.manual_seed(0)
    tied = LlamaModel(cfg).eval()
    save_hf(cfg, tied.state_dict(), tmp_path / "tied")
    assert "lm_head.weight" not in load_file(str(tmp_path / "tied" / "model.safetensors"))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "tied").eval()
    tokens = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        assert float((tied(tokens) - theirs(tokens).logits).abs().max()) < 1e-5
    # coming in, the head becomes a copy of the embedding on its own stage

    args = build_parser().parse_args(["simulate", "--init-from", str(tmp_path / "tied"), "--stages", "2"])
    run_cfg = config_from_args(args)
    assert run_cfg.model.tie_embeddings is False
    last = plan_stages(2, 2)[1]
    state = load_stage_state(run_cfg.model, last, ["blocks.0.attn_norm.weight", "head.out.weight"], str(tmp_path / "tied"))
    assert torch.equal(state["head.out.weight"], tied.embed.weight.detach())


def _error(capsys, *argv: str) -> str:
    assert main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_bad_hf_input_is_a_one_line_error(mha_run, tmp_path, capsys):
    _, out = mha_run
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 32}))
    assert "model_type is 'gpt2', not 'llama'" in _error(capsys, "simulate", "--init-from", gpt2, "--out", tmp_path / "a")
    assert "model_type is 'gpt2'" in _error(capsys, "simulate", "--model-config", gpt2 / "config.json", "--out", tmp_path / "b")
    err = _error(capsys, "simulate", "--init-from", out, "--d-model", 64, "--out", tmp_path / "c")
    assert "has shape (512, 32), the configured model expects (512, 64)" in err
    assert "checkpoint has no tensor" in _error(capsys, "simulate", "--init-from", out, "--layers", 12,
                                                "--out", tmp_path / "d")
    assert "not a directory" in _error(capsys, "simulate", "--init-from", out / "config.json", "--out", tmp_path / "e")
    assert "no config.json" in _error(capsys, "simulate", "--init-from", tmp_path, "--out", tmp_path / "f")
    assert "could not be fetched from the Hugging Face hub" in _error(
        capsys, "simulate", "--init-from", "checkfree-tests/no-such-model", "--out", tmp_path / "g")
    scaled = json.loads((out / "config.json").read_text()) | {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    (tmp_path / "scaled.json").write_text(json.dumps(scaled))
    assert "RoPE scaling" in _error(capsys, "simulate", "--model-config", tmp_path / "scaled.json", "--out", tmp_path / "h")


def test_gqa_guarded_attention_equals_fused():
    """The ABFT guard's explicit attention handles grouped-query attention like the fused path."""
    from checkfree.abft import AttentionGuard, install_guard

    cfg = ModelConfig(**GQA)
    torch.manual_seed(0)
    model = LlamaModel(cfg).eval()
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.context_length))
    with torch.no_grad():
        plain = model(tokens)
        install_guard(model, AttentionGuard(mode="full"))
        guarded = model(tokens)
    torch.testing.assert_close(guarded, plain, rtol=1e-5, atol=1e-5)
