from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from checkfree.config import DataConfig
from checkfree.data import DataError, build_data, load_documents


def _data(tmp_path, source, **kw):
    cfg = DataConfig(source=str(source), cache_dir=str(tmp_path / "cache"), **kw)
    return build_data(cfg, vocab_size=300, context_length=16, seed=0, microbatch_size=4)


def test_shakespeare_default_corpus():
    docs = load_documents(DataConfig())
    assert len(docs) >= 30 and sum(map(len, docs)) > 4_000_000


def test_batches_pure_function_and_shift(tmp_path):
    (tmp_path / "a.txt").write_text("To be, or not to be, that is the question. " * 200)
    d = _data(tmp_path, tmp_path / "a.txt")
    x1, y1 = d.batch(7, 2)
    x2, y2 = d.batch(7, 2)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert torch.equal(x1[:, 1:], y1[:, :-1])
    assert not torch.equal(d.batch(7, 3)[0], x1)
    assert x1.shape == (4, 16) and x1.dtype == torch.int64
    assert len(d.val) >= 1 and int(d.train.max()) < 300


def test_two_processes_same_batch(tiny_cfg):
    code = ("import sys,json; from checkfree.config import config_from_dict; from checkfree.data import build_data;"
            "c=config_from_dict(json.loads(sys.argv[1]));"
            "d=build_data(c.data, vocab_size=c.model.vocab_size, context_length=c.model.context_length, seed=3,"
            " microbatch_size=2); print(d.batch(11, 1)[0].tolist())")
    outs = [subprocess.run([sys.executable, "-c", code, tiny_cfg.to_json()], capture_output=True, text=True,
                           timeout=120, check=True).stdout for _ in range(2)]
    assert outs[0] == outs[1] and len(json.loads(outs[0])) == 2


def test_directory_source(tmp_path):
    (tmp_path / "docs").mkdir()
    for i in range(3):
        (tmp_path / "docs" / f"{i}.md").write_text(f"document {i} " * 300)
    assert len(load_documents(DataConfig(source=str(tmp_path / "docs")))) == 3


def test_clear_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        _data(tmp_path, tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_text("   \n")
    with pytest.raises(DataError, match="empty"):
        _data(tmp_path, tmp_path / "empty.txt")
    (tmp_path / "short.txt").write_text("too short")
    with pytest.raises(DataError, match="too short"):
        _data(tmp_path, tmp_path / "short.txt")
    (tmp_path / "d").mkdir()
    with pytest.raises(DataError, match="no text files"):
        _data(tmp_path, tmp_path / "d")


def test_tokenizer_json_path(tmp_path):
    (tmp_path / "a.txt").write_text("the quick brown fox jumps over the lazy dog. " * 300)
    _data(tmp_path, tmp_path / "a.txt")
    tok = next((tmp_path / "cache").glob("bpe-*.json"))
    d = _data(tmp_path, tmp_path / "a.txt", tokenizer=str(tok))
    assert d.train.shape[1] == 17
    with pytest.raises(DataError, match="does not exist"):
        _data(tmp_path, tmp_path / "a.txt", tokenizer=str(tmp_path / "nope.json"))


def test_hf_datasets_path_with_local_file(tmp_path):
    pytest.importorskip("datasets", reason="the hf extra is part of the dev install")
    rows = [{"text": f"row {i}: all the world's a stage, and all the men and women merely players. "}
            for i in range(200)]
    f = tmp_path / "train.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows))
    docs = load_documents(DataConfig(source=f"hf:json:{f}", hf_max_documents=50))
    assert len(docs) == 50 and docs[0].startswith("row 0")
    with pytest.raises(DataError, match="no field"):
        load_documents(DataConfig(source=f"hf:json:{f}", hf_text_field="body"))
