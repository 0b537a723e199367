"""The layering rule, checked on the source: `checkfree/` (the library) imports none of the layers
above it — `peers/`, `scheduler/`, `experiments/`, `benchmarks/`, `cli/` — not even by name
(an importlib string); `peers/` and `scheduler/` do not import each other."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ABOVE = ("peers", "scheduler", "experiments", "benchmarks", "cli")


def _imports(path: Path) -> set[str]:
    """Top-level package names `path` imports, by statement or by a dotted module-name string."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            m = re.fullmatch(r"([a-z_]+)\.[a-z_.]+(:[a-z_]+)?", node.value)
            if m:
                names.add(m.group(1))
    return names


@pytest.mark.parametrize("layer, forbidden", [("checkfree", ABOVE), ("peers", ("scheduler",)),
                                              ("scheduler", ("peers",))])
def test_no_upward_imports(layer, forbidden):
    bad = []
    for path in sorted((ROOT / layer).rglob("*.py")):
        if path == ROOT / "checkfree" / "__main__.py":  # `python -m checkfree` forwards to cli.main, by design
            continue
        hits = _imports(path) & set(forbidden)
        if hits:
            bad.append(f"{path.relative_to(ROOT)} imports {sorted(hits)}")
    assert not bad, "\n".join(bad)
