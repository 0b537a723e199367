"""Every number in the prose of the experiment and benchmark pages is rendered from its result file or checked
against it (issue 39).

The pages (`PAGES`: the README, experiments/README.md, benchmarks/README.md and every page of the manual, docs/)
state measured numbers in sentences around their tables. In them, a number outside a code span
or a code block is either

* **rendered**: inside a region a renderer writes (`<!-- BEGIN rendered: X -->` ... `<!-- END rendered: X -->`,
  `<!-- rendered by M from FILE -->` ... `<!-- end ... -->`, `<!-- NAME: rendered from FILE ... -->` ...
  `<!-- end NAME -->`), or a `<!-- result FILE ... -->` directive that docs/hooks.py replaces with the file's text
  when the site is built; or
* **checked**: in the text that a marker `<!-- from FILE [FILE ...] -->` ends (from the previous marker, or the
  start of its paragraph, list item or table row, up to the marker), every number standing in one of the named
  files as written or rounded (a thousands separator aside; `1.39` stands as `1.391`; `0.9 %` also as `0.0090`);
  a table with a marker alone on the line right before or right after it is checked the same way, row by row
  (in benchmarks/README.md a marker right before a table also says the table is the file's, line for line:
  tests/test_docs.py); or in the text a `<!-- claim: NAME -->` marker ends, NAME being a claim of
  experiments/prose.py whose check (a function over its files) tests/test_claims.py runs.

`unchecked(root)` lists every sentence that holds a number neither rendered nor checked, or a number its marker's
files do not hold, with the number and why; tests/test_claims.py fails naming them. What is not a measured
number and is not looked at: code spans and code blocks (commands, settings, and result lines quoted verbatim),
numbers inside a word (`int8`, `H200`, `SmolLM2`, `1F1B`), a commit id, a date, a time of day, an address or a
port, numbers in a link's target, the numerals of a numbered list or section, a version after a program's name
(`Python 3.11`), the number of an issue, an item, a figure, a table or a section (`issue 39`, `Fig. 2`), a seed
(`seed 41`: which run, not what it measured), and a numbered thing written `#N` (`#974`: the index of a dst run's
schedule that diverged).

What a check proves is that the number stands in the file named, not that it is the right one of the file's
numbers: a small integer stands in almost any file. The marker names the file the sentence is about (the result
file, or for a default or a setup the code that sets it); the check then catches a number retyped wrong, a
result file re-run without its prose, and a number with no file at all.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

__all__ = ["PAGES", "Unchecked", "unchecked", "numbers", "segments"]

PAGES = ["README.md", "experiments/README.md", "docs/pretrained.md", "docs/identity.md", "benchmarks/README.md",
         "docs/performance.md", "docs/control-plane.md", "docs/benchmarks.md", "docs/dashboard.md", "docs/recovery.md",
         "docs/wan.md", "docs/stage-groups.md", "docs/transports.md", "docs/architecture.md",
         "docs/getting-started.md", "docs/reliability.md", "docs/huggingface.md", "docs/index.md", "docs/deploy.md",
         "docs/dst.md", "docs/testing.md", "docs/api.md", "docs/configuration.md", "docs/glossary.md",
         "docs/run-directory.md"]  # every page of the manual (tests/test_claims.py checks that none is missing)

FROM = re.compile(r"<!-- from ((?:[^\s>]+ ?)+) -->")
CLAIM = re.compile(r"<!-- claim: ([\w.-]+) -->")
_REGIONS = [
    re.compile(r"<!-- BEGIN rendered: ([\w.-]+) -->.*?<!-- END rendered: \1 -->", re.S),
    re.compile(r"<!-- rendered by [^\n]*?-->.*?<!-- end [^\n]*?-->", re.S),
    re.compile(r"<!-- ([\w -]+): rendered from [^\n]*?-->.*?<!-- end \1 -->", re.S),
]
_DIRECTIVE = re.compile(r"<!--\s*(?:result|include)\s+.+?-->")
_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
_LINK_TARGET = re.compile(r"\]\([^)\s]*\)")
_OTHER_COMMENT = re.compile(r"<!--(?! from | claim: ).*?-->", re.S)
# what is not a measured number: a commit id, a date, a time of day, a version, an issue / figure / table / section,
# a seed (`seed 41`: which run), a numbered finding or schedule (`#974`: the schedule of a dst run that diverged)
_NOT_MEASURED = re.compile(
    r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b"
    r"|\b\d+(?:\.\d+){3}(?::\d+)?\b|:\d{2,5}\b"
    r"|\b\d{4}-\d\d-\d\d\b|\b\d\d:\d\d(?::\d\d)?\b"
    r"|\b(?:[Ii]ssues?|[Ii]tems?|PR|RFC|Fig\.|Figs\.|Figure|Table|[Ss]ection|§|Python|torch|hivemind|CUDA|Ubuntu|v"
    r"|[Ss]eeds?)\s*#?\d[\d.]*"
    r"(?:(?:,| and| or|-|–) ?#?\d[\d.]*)*"
    r"|(?<![\w&])#\d+\b")
# a number: not inside a word (int8, H200, 1F1B: a letter or digit right before, or a letter / digit right after
# when it ends in a letter that starts a word, is part of that word)
NUMBER = re.compile(r"(?:(?<![\w.\-/])|(?<=\d-))(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:e[-+]?\d+)?(?![\w/]|[.,]\d)"
                    r"|(?:(?<![\w.\-/])|(?<=\d-))(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?![.,]\d)(?=(?:%|x|×|s|ms|µs|us|h|min|MB|MiB|GB|GiB|"
                    r"KiB|kB|B|k|M|Mbit|Gbit|Mbps|Gbps)\b)")


@dataclass(frozen=True)
class Unchecked:
    page: str
    sentence: str
    number: str
    why: str

    def __str__(self) -> str:
        return f'{self.page}: {self.number} ({self.why}) in "{self.sentence}"'


def _blank(match: re.Match) -> str:
    """The match replaced by as many newlines as it held (line numbers and paragraph breaks kept), else by a word
    (a rendered number alone on its line stays inside its paragraph)."""
    return "\n" * match.group(0).count("\n") or " (rendered) "


def numbers(text: str) -> list[str]:
    """The measured-looking numbers of a stretch of prose, as written."""
    text = _NOT_MEASURED.sub(" ", text)
    percent = re.compile(r"(?:[-–]\d[\d.,]*)? ?%")  # `14%`, `14 %`, and the low end of `0.15-0.17%`
    return [m.group(0) + ("%" if percent.match(text, m.end()) else "") for m in NUMBER.finditer(text)]


def _prose(text: str) -> str:
    """The page with everything that is not checked prose blanked: rendered regions, directives, code."""
    for pattern in _REGIONS:
        text = pattern.sub(_blank, text)
    text = _DIRECTIVE.sub(" ", text)
    text = _FENCE.sub(_blank, text)
    text = _CODE.sub(lambda m: " " if "\n" not in m.group(0) else _blank(m), text)
    text = _LINK_TARGET.sub("]", text)
    text = re.sub(r"^(\s*)\d+\. ", r"\1- ", text, flags=re.M)  # a numbered list's numerals
    text = re.sub(r"^(#+ )\d+\. ", r"\1", text, flags=re.M)  # a numbered section's
    return _OTHER_COMMENT.sub(_blank, text)


_BLOCK_START = re.compile(r"^\s*(?:[*+-] |\d+\. |#+ |\|)")


def _blocks(text: str) -> list[tuple[int, str]]:
    """(index of its last line, text) of each paragraph, list item, heading and table row. A marker alone on the
    line right before a table, or right after it, belongs to each of its rows."""
    out: list[tuple[int, str]] = []
    cur: list[str] = []
    table_from: str | None = None
    rows: list[int] = []  # the rows (indices into out) of the table just read, while it has no marker
    for i, line in enumerate(text.split("\n")):
        if line.lstrip().startswith("|"):
            if cur and FROM.fullmatch(" ".join(cur).strip()):
                table_from = " ".join(cur).strip()
            elif cur:
                out.append((i - 1, " ".join(cur)))
            cur = []
            if table_from is None:
                rows.append(len(out))
            out.append((i, line if table_from is None else f"{line} {table_from}"))
            continue
        if rows and FROM.fullmatch(line.strip()):
            out[rows[0]:] = [(j, f"{row} {line.strip()}") for j, row in out[rows[0]:]]
            rows, table_from = [], None
            continue
        rows, table_from = [], None
        if not line.strip():
            if cur:
                out.append((i - 1, " ".join(cur)))
            cur = []
            continue
        if _BLOCK_START.match(line) and cur:
            out.append((i - 1, " ".join(cur)))
            cur = []
        cur.append(line.strip())
    if cur:
        out.append((len(text.split("\n")) - 1, " ".join(cur)))
    return out


def segments(text: str) -> list[tuple[str, str | None, str | None]]:
    """(text, files or None, claim or None) of each stretch of a page's prose that a marker ends (None: no marker)."""
    out: list[tuple[str, str | None, str | None]] = []
    for _, block in _blocks(_prose(text)):
        pos = 0
        for m in re.finditer(rf"{FROM.pattern}|{CLAIM.pattern}", block):
            out.append((block[pos:m.start()], m.group(1), m.group(2)))
            pos = m.end()
        out.append((block[pos:], None, None))
    return [(t, f, c) for t, f, c in out if t.strip()]


def _sentence(text: str, number: str) -> str:
    parts = re.split(r"(?<=[.;:!?])\s+(?=[A-Z*(`])", " ".join(text.split()))
    return next((p for p in parts if number in p), " ".join(text.split()))


_FILE_NUMBER = re.compile(r"(?<![\w.])\d+(?:,\d{3})*(?:\.\d+)?(?:e[-+]?\d+)?")


class _Held:
    """The numbers a set of files holds, as written and rounded: `1.39` stands in a file that says `1.391` (half
    up, or as Python formats the float: both `3.2` and `3.1` for `3.15`)."""

    def __init__(self, text: str) -> None:
        text = re.sub(r"(?<=\d)_(?=\d{3})", "", text)  # a Python literal's separators: 50_000
        self.text = text
        self.rounded: set[str] = set()
        for m in _FILE_NUMBER.finditer(text):
            written = m.group(0).replace(",", "")
            self.rounded.add(written)
            if "." in written and "e" not in written:
                for d in range(len(written.split(".")[1])):  # rounded half up, as written in decimal
                    self.rounded.add(str(Decimal(written).quantize(Decimal(1).scaleb(-d), ROUND_HALF_UP)))
                    self.rounded.add(f"{float(written):.{d}f}")  # or as a float is formatted (3.15: 3.1)

    def holds(self, number: str) -> bool:
        """`number` stands in the files as written or rounded; a percentage also as a fraction (`0.9%`: 0.0090)."""
        if number.endswith("%"):
            number = number[:-1]
            digits = len(number.split(".")[1]) if "." in number else 0
            if f"{float(number.replace(',', '')) / 100:.{digits + 2}f}" in self.rounded:
                return True
        plain = number.replace(",", "")
        if plain in self.rounded:
            return True
        return bool(re.search(rf"(?<![\d.]){re.escape(number)}(?!\d|\.\d)", self.text))


def _holds(text: str, number: str) -> bool:
    return _Held(text).holds(number)


_CACHE: dict[str, _Held] = {}


def _held(text: str) -> _Held:
    if text not in _CACHE:
        _CACHE[text] = _Held(text)
    return _CACHE[text]


def unchecked(root: Path, pages: list[str] | None = None) -> list[Unchecked]:
    from experiments.prose import CLAIMS

    root = Path(root)
    out = []
    for page in pages or PAGES:
        for text, files, claim in segments((root / page).read_text()):
            found = numbers(text)
            if not found:
                continue
            if claim is not None:
                if claim not in CLAIMS:
                    out += [Unchecked(page, _sentence(text, n), n, f"claim {claim} is in no experiments/prose.py")
                            for n in found[:1]]
                continue
            if files is None:
                out += [Unchecked(page, _sentence(text, n), n, "neither rendered nor followed by <!-- from FILE -->")
                        for n in found]
                continue
            held_text = ""
            for f in files.split():
                path = root / f
                if not path.is_file():
                    out.append(Unchecked(page, _sentence(text, found[0]), found[0], f"no file {f}"))
                    break
                held_text += path.read_text(errors="replace") + "\n"
            else:
                held = _held(held_text)
                out += [Unchecked(page, _sentence(text, n), n, f"not in {files}") for n in found if not held.holds(n)]
    return out


if __name__ == "__main__":
    import sys
    from collections import Counter

    found = unchecked(Path(__file__).resolve().parent.parent, sys.argv[1:] or None)
    for u in found:
        print(u)
    print(Counter(u.page for u in found), len(found))
