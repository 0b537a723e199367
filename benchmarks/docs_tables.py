"""The tables docs/control-plane.md carries, rendered from the result files by the benchmarks' own `render`.

    python -m benchmarks.docs_tables          # rewrite the blocks between the page's markers
    (tests/test_benchmarks.py checks that the page holds exactly what the result files render)
"""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

__all__ = ["BLOCKS", "PAGE", "rendered", "update"]

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "control-plane.md"
# (marker, the module whose render() draws it, the result file)
BLOCKS = [("copies table", "benchmarks.copies", "benchmarks/results/copies.json"),
          ("control-plane table", "benchmarks.control_plane", "benchmarks/results/control-plane.json")]


def rendered(module: str, result: str) -> str:
    return "\n".join(importlib.import_module(module).render(json.loads((ROOT / result).read_text())))


def _pattern(marker: str) -> re.Pattern:
    return re.compile(rf"(<!-- {re.escape(marker)}: [^\n]*-->\n)(.*?)(<!-- end {re.escape(marker)} -->)", re.S)


def blocks(text: str) -> dict[str, str]:
    """What the page holds between each pair of markers."""
    return {marker: m.group(2).strip("\n") for marker, _, _ in BLOCKS if (m := _pattern(marker).search(text))}


def update(page: Path = PAGE) -> None:
    text = page.read_text()
    for marker, module, result in BLOCKS:
        body = rendered(module, result)
        text, n = _pattern(marker).subn(lambda m: f"{m.group(1)}\n{body}\n\n{m.group(3)}", text)
        if n != 1:
            raise ValueError(f"{page} has {n} '{marker}' blocks, expected 1")
    page.write_text(text)


if __name__ == "__main__":
    update()
