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


@pytest.mark.processes  # HF datasets starts OS processes here (the quick tier's process check saw them)
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


def _token_file(tmp_path, d):
    import numpy as np

    (meta,) = (tmp_path / "cache").glob("tokens-*.json")
    info = json.loads(meta.read_text())
    return np.fromfile(meta.with_suffix(".bin"), dtype=info["dtype"]), info


def test_token_file_equals_the_in_memory_tokenization_of_the_documents(tmp_path):
    (tmp_path / "docs").mkdir()
    for i in range(5):
        (tmp_path / "docs" / f"{i}.txt").write_text(f"Document {i}: to be, or not to be. " * (50 + 20 * i))
    (tmp_path / "docs" / "empty.txt").write_text("  \n")
    (tmp_path / "docs" / "dir.txt").mkdir()  # a directory named like a text file is not a document
    d = _data(tmp_path, tmp_path / "docs")
    tokens, info = _token_file(tmp_path, d)
    eos = d.tokenizer.token_to_id("<|endoftext|>")
    expect = [t for enc in d.tokenizer.encode_batch(load_documents(DataConfig(source=str(tmp_path / "docs"))))
              for t in enc.ids + [eos]]
    assert tokens.tolist() == expect and info["tokens"] == len(expect) and info["dtype"] == "uint16"
    assert (tokens == eos).sum() == 5


def test_a_large_file_is_tokenized_in_pieces_to_the_same_tokens(tmp_path, monkeypatch):
    import checkfree.data as data

    text = "".join(f"line {i} of a long corpus with words\n" for i in range(2000))
    (tmp_path / "big.txt").write_text(text)
    monkeypatch.setattr(data, "LARGE_FILE_BYTES", 10_000)
    monkeypatch.setattr(data, "CHUNK_BYTES", 3_000)
    monkeypatch.setattr(data, "BATCH_TEXT_BYTES", 5_000)
    pieces = list(data.iter_pieces(DataConfig(source=str(tmp_path / "big.txt"))))
    assert len(pieces) > 20 and [end for _, end in pieces].count(True) == 1 and "".join(p for p, _ in pieces) == text
    d = _data(tmp_path, tmp_path / "big.txt")
    tokens, _ = _token_file(tmp_path, d)
    eos = d.tokenizer.token_to_id("<|endoftext|>")
    assert tokens.tolist() == d.tokenizer.encode(text).ids + [eos]


def test_a_prepared_corpus_is_mapped_not_read_again(tmp_path, monkeypatch):
    import checkfree.data as data

    (tmp_path / "a.txt").write_text("the quick brown fox jumps over the lazy dog. " * 300)
    first = _data(tmp_path, tmp_path / "a.txt")

    def no_reading(cfg):
        raise AssertionError("the corpus was read again")

    monkeypatch.setattr(data, "iter_pieces", no_reading)
    again = _data(tmp_path, tmp_path / "a.txt")
    assert type(again.train).__name__ == "memmap" or isinstance(again.train.base, __import__("numpy").memmap)
    assert torch.equal(again.batch(3, 1)[0], first.batch(3, 1)[0])
    (tmp_path / "a.txt").write_text("a different corpus now, with other words in it. " * 300)  # size/mtime change
    monkeypatch.undo()
    assert not torch.equal(_data(tmp_path, tmp_path / "a.txt").batch(3, 1)[0], first.batch(3, 1)[0])


def _four_at_once(monkeypatch, name: str, call) -> tuple[list, int]:
    """`call()` in four threads released together; what each returned, and how many times they ran
    checkfree.data's function `name` among them."""
    import threading

    import checkfree.data as data

    runs, gate = [], threading.Barrier(4)
    real = getattr(data, name)

    def counted(*args, **kw):
        runs.append(threading.get_ident())
        return real(*args, **kw)

    monkeypatch.setattr(data, name, counted)
    got: list = []

    def one():
        gate.wait(timeout=30)
        got.append(call())

    threads = [threading.Thread(target=one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return got, len(runs)


def test_peers_preparing_one_corpus_together_tokenize_it_once(tmp_path, monkeypatch):
    """Peers started together on a fresh cache (a local swarm's processes, the in-process swarm's compute
    threads) tokenize the corpus once: the others wait on the cache entry's lock and map its file."""
    import checkfree.data as data

    (tmp_path / "a.txt").write_text("now is the winter of our discontent made glorious summer. " * 300)
    cfg = DataConfig(source=str(tmp_path / "a.txt"), cache_dir=str(tmp_path / "cache"))
    corpus = data.corpus_id(cfg)
    tok = data.load_tokenizer(cfg, None, 300, corpus)
    got, writes = _four_at_once(monkeypatch, "_write_tokens", lambda: data.prepare_tokens(cfg, tok, corpus,
                                                                                          progress=False))
    assert len(got) == 4 and writes == 1
    assert all(g == got[0] for g in got) and got[0][1]["tokens"] > 0


def test_peers_starting_together_on_a_fresh_cache_train_the_bpe_once(tmp_path, monkeypatch):
    """As the token file: processes (or threads) that need the same BPE on a fresh cache train it once, under the
    cache entry's lock; the others read its file (the test session's workers share one cache, tests/conftest.py)."""
    import checkfree.data as data

    (tmp_path / "a.txt").write_text("if music be the food of love, play on; give me excess of it. " * 300)
    cfg = DataConfig(source=str(tmp_path / "a.txt"), cache_dir=str(tmp_path / "cache"))
    corpus = data.corpus_id(cfg)
    got, trained = _four_at_once(monkeypatch, "_train_bpe",
                                 lambda: data.load_tokenizer(cfg, None, 300, corpus).to_str())
    assert len(got) == 4 and trained == 1 and len(set(got)) == 1


def test_stale_and_partial_preparations_are_never_used(tmp_path):
    (tmp_path / "a.txt").write_text("all the world's a stage, and all the men and women merely players. " * 200)
    cache = tmp_path / "cache"
    cache.mkdir()
    stale = cache / "tokens-deadbeef.tmp999999999.bin"  # a preparation whose process is gone
    stale.write_bytes(b"\0" * 100)
    d = _data(tmp_path, tmp_path / "a.txt")
    assert not stale.exists()
    expect = d.batch(0, 0)[0]
    del d  # it maps the token file, which is truncated in place below (the code itself only ever renames)
    (meta,) = cache.glob("tokens-*.json")
    good = meta.with_suffix(".bin").read_bytes()
    meta.unlink()  # killed between the two renames: the token file is not trusted
    meta.with_suffix(".bin").write_bytes(good[: len(good) // 2])
    again = _data(tmp_path, tmp_path / "a.txt")
    assert meta.with_suffix(".bin").read_bytes() == good and torch.equal(again.batch(0, 0)[0], expect)


def test_preparation_memory_does_not_grow_with_the_corpus(tmp_path, monkeypatch):
    """tracemalloc peak while preparing a corpus 4x larger stays about the same (pieces of BATCH_TEXT_BYTES)."""
    import tracemalloc

    import checkfree.data as data
    from checkfree.data import corpus_id, load_tokenizer, prepare_tokens

    monkeypatch.setattr(data, "BATCH_TEXT_BYTES", 64_000)
    monkeypatch.setattr(data, "ENCODE_PIECE_BYTES", 8_000)
    words = "stage player world men women exit entrance part time acts ages".split()
    peaks = []
    for n_files in (4, 16):
        src = tmp_path / f"c{n_files}"
        src.mkdir()
        for i in range(n_files):
            (src / f"{i}.txt").write_text(" ".join(words[(i * j) % len(words)] for j in range(50_000)))
        cfg = DataConfig(source=str(src), cache_dir=str(tmp_path / "cache"))
        tok = load_tokenizer(cfg, None, 300, corpus_id(cfg))
        tracemalloc.start()
        prepare_tokens(cfg, tok, corpus_id(cfg), progress=False)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    assert peaks[1] < 1.5 * peaks[0], peaks


def test_encoding_in_pieces_gives_the_tokens_of_the_whole_text(session_cache):
    """Text cut into pieces after newlines between two non-space characters tokenizes exactly as the whole;
    newlines next to spaces or blank lines are never cut (a byte-level pre-tokenizer joins those runs)."""
    import random

    from checkfree.data import _encode_pieces, build_tokenizer

    tok = build_tokenizer(DataConfig(cache_dir=session_cache), 512)  # the tiny preset's, trained once a session
    rng = random.Random(0)
    words = "all the world's a stage and all the men and women merely players".split()
    text = "".join(" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) + rng.choice(
        [".\n", ".\n\n", ".  \n", "\n", "!\n \n"]) for _ in range(3000))
    pieces = list(_encode_pieces(text, 2_000))
    assert len(pieces) > 20 and "".join(pieces) == text
    assert [t for p in pieces for t in tok.encode(p).ids] == tok.encode(text).ids
    for play in load_documents(DataConfig())[:2]:  # markdown: few safe cuts, still exact
        assert [t for p in _encode_pieces(play, 2_000) for t in tok.encode(p).ids] == tok.encode(play).ids
    assert list(_encode_pieces("no newline " * 1000, 100)) == ["no newline " * 1000]
