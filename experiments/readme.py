"""Regions of a Markdown file rendered from result files: `checkfree experiment report --readme`.

A region is delimited by two HTML comments (invisible once rendered) and named by its renderer:

    <!-- BEGIN rendered: small.convergence -->
    ...whatever the renderer returns; rewritten on every render...
    <!-- END rendered: small.convergence -->

A region whose body starts on a new line is a block (tables, lists); one written inside a sentence is
inline (a number in prose). A marker written right after a backtick (quoted in documentation, as here) is
text, not a marker.

A renderer is a function `(results: Path) -> str` that reads committed result files under `results`
(experiments/results) and returns Markdown; it is registered by name with `@renderer("name")` in a module
listed in `SECTION_MODULES` (imported when a file is rendered). Adding a section to the README:

1. write the renderers in your module (e.g. experiments/pretrained.py), each decorated with
   `@renderer("pretrained.<what>")`, reading only files under `results` (e.g. results/pretrained/...);
2. append the module's name to `SECTION_MODULES`;
3. put the regions in the README and run `checkfree experiment report --readme`;
   tests/test_experiments.py then fails whenever the README and its files disagree.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import Callable

__all__ = ["renderer", "RENDERERS", "SECTION_MODULES", "DOCUMENTS", "regions", "render", "stale_regions", "render_file"]

Renderer = Callable[[Path], str]
RENDERERS: dict[str, Renderer] = {}
SECTION_MODULES = ["experiments.sections", "experiments.claims", "experiments.pretrained_section"]
# every file with rendered regions (`checkfree experiment report --readme all` renders them all; a test holds them)
DOCUMENTS = ["experiments/README.md", "README.md", "docs/pretrained.md", "docs/identity.md"]

# A marker right after a backtick is text (documentation quoting one), not a marker.
_REGION = re.compile(r"(?<!`)<!-- BEGIN rendered: (?P<name>[\w.+-]+) -->(?P<body>.*?)(?<!`)<!-- END rendered: (?P=name) -->",
                     re.S)
_BEGIN = re.compile(r"(?<!`)<!-- BEGIN rendered: ([\w.+-]+) -->")


def renderer(name: str) -> Callable[[Renderer], Renderer]:
    """Register `fn(results) -> markdown` as the renderer of regions named `name`."""
    def register(fn: Renderer) -> Renderer:
        if name in RENDERERS and RENDERERS[name] is not fn:
            raise ValueError(f"renderer {name!r} registered twice ({RENDERERS[name].__module__}, {fn.__module__})")
        RENDERERS[name] = fn
        return fn
    return register


def _load_sections() -> None:
    for module in SECTION_MODULES:
        importlib.import_module(module)


def regions(text: str) -> list[tuple[str, str]]:
    """(name, body) of every region in `text`; a BEGIN without its END is an error."""
    found = [(m["name"], m["body"]) for m in _REGION.finditer(text)]
    begun = _BEGIN.findall(text)
    if len(begun) != len(found):
        closed = [n for n, _ in found]
        raise ValueError(f"rendered region(s) without a matching END marker: "
                         f"{sorted(set(begun) - set(closed)) or begun}")
    return found


def _body(name: str, old: str, results: Path, cache: dict[str, str]) -> str:
    if name not in RENDERERS:
        raise ValueError(f"region {name!r} has no renderer; registered: {', '.join(sorted(RENDERERS))}")
    if name not in cache:
        cache[name] = RENDERERS[name](results).strip("\n")
    return f"\n{cache[name]}\n" if old.startswith("\n") else cache[name]


def render(text: str, results: Path) -> str:
    """`text` with every region's body rendered anew from the files under `results`."""
    _load_sections()
    regions(text)  # unmatched markers: one clear error before anything is rendered
    cache: dict[str, str] = {}

    def sub(m: re.Match) -> str:
        body = _body(m["name"], m["body"], results, cache)
        return f"<!-- BEGIN rendered: {m['name']} -->{body}<!-- END rendered: {m['name']} -->"

    return _REGION.sub(sub, text)


def _changed(old: str, new: str) -> list[str]:
    rendered = dict(regions(new))
    return [name for name, body in regions(old) if rendered[name] != body]


def stale_regions(text: str, results: Path) -> list[str]:
    """The names of the regions whose body differs from what their renderer makes of `results` now."""
    return _changed(text, render(text, results))


def render_file(path: Path, results: Path, *, check: bool = False) -> list[str]:
    """Render the regions of the file at `path` (in place unless `check`); returns the names that changed."""
    text = Path(path).read_text()
    new = render(text, results)
    changed = _changed(text, new)
    if changed and not check:
        Path(path).write_text(new)
    return changed
