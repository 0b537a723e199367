"""Objects own their state (style.md 13): no module under `scheduler/` or `peers/` writes an attribute of an
object it did not create. Checked on the source with `ast`, as tests/test_layers.py checks imports.

Within a function an attribute may be written on `self` (its own object), on an element of one of its own
containers (`self.members[pid].leaving = ...`) and on a local variable bound in that function to an object made
there (`run = StepRun(...)`); containers may be written when they are the object's own or local. Anything else
is a write into another object: `self.part.field = ...`, `other.field = ...` (a parameter),
`self.part.table[k] = ...`, `self.part.members[p].leaving = ...`, `setattr(...)`; a part that needs it changed
asks through a method.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _self_attr(node: ast.expr) -> bool:
    """`self.x`: one of the object's own attributes."""
    return isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"


def _own_element(node: ast.expr) -> bool:
    """An element of one of the object's own containers: `self.x[k]`, `self.x.get(k)`."""
    if isinstance(node, ast.Subscript):
        return _self_attr(node.value)
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
            and _self_attr(node.func.value))


def _made_here(func: ast.AST) -> set[str]:
    """Local names a function binds to an object made in it (`x = Foo(...)`, a call of a bare name) or to an
    element of its object's own containers (`m = self.members[pid]`)."""
    made = set()
    for node in ast.walk(func):
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        if value is None or not ((isinstance(value, ast.Call) and isinstance(value.func, ast.Name))
                                 or _own_element(value)):
            continue
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        made.update(t.id for t in targets if isinstance(t, ast.Name))
    return made


def _root(node: ast.expr) -> ast.expr:
    """What a container expression hangs from: `a.b[k].get(j)[i]` -> `a.b`."""
    while True:
        if isinstance(node, ast.Subscript):
            node = node.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            node = node.func.value
        else:
            return node


def _allowed(target: ast.expr, made: set[str]) -> bool:
    """A write into a container is allowed when the container is a local (or a parameter's plain dict) or one of
    the object's own (`self.x[k] = v`); an attribute write when it is the object's own attribute, one of an
    object made in the function, or one of an element of the object's own containers (`self.members[p].x`)."""
    if isinstance(target, ast.Subscript):
        root = _root(target)
        return isinstance(root, ast.Name) or _self_attr(root) or (
            isinstance(root, ast.Attribute) and isinstance(root.value, ast.Name) and root.value.id in made)
    owner = target.value
    if isinstance(owner, ast.Name):
        return owner.id == "self" or owner.id in made
    return _own_element(owner)


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        out = []
        for t in node.targets:
            out += list(t.elts) if isinstance(t, (ast.Tuple, ast.List)) else [t]
        return out
    if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        return [node.target]
    return []


def violations(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    funcs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for func in funcs:
        made = _made_here(func)
        for node in ast.walk(func):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: setattr")
            for t in _targets(node):
                if isinstance(t, (ast.Attribute, ast.Subscript)) and not _allowed(t, made):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(t)}")
    return sorted(set(found), key=lambda s: (s.split(":")[0], int(s.split(":")[1])))


@pytest.mark.parametrize("layer", ["scheduler", "peers"])
def test_no_module_writes_another_objects_attributes(layer):
    bad = [v for path in sorted((ROOT / layer).rglob("*.py")) for v in violations(path)]
    assert not bad, f"{len(bad)} writes into objects the module did not create:\n" + "\n".join(bad)


def test_the_check_finds_what_it_should():
    """The rule on a sample: the writes into other objects are found, the own ones are not."""
    sample = ROOT / "tests" / "_ownership_sample.py"
    sample.write_text(
        "class A:\n"
        "    def f(self, other, xs):\n"
        "        self.a = 1\n"
        "        self.d[1] = 2\n"
        "        run = Run()\n"
        "        run.x = 3\n"
        "        xs[0] = 1\n"
        "        self.part.field = 4\n"  # 8
        "        other.field = 5\n"  # 9
        "        self.part.members[1].leaving = True\n"  # 10
        "        self.part.table[2] = 6\n"  # 11
        "        self.b, other.c = 1, 2\n"  # 12
        "        setattr(other, 'x', 1)\n"  # 13
        "        self.part.n += 1\n"  # 14
        "        self.members[1].leaving = True\n"  # an element of its own container
        "        m = self.members.get(2)\n"
        "        m.left = True\n"
        "        out.setdefault(1, {})[2] = 3\n"
        "        run.losses[1] = 0.5\n")  # a container of an object made here
    try:
        got = [int(v.split(":")[1]) for v in violations(sample)]
    finally:
        sample.unlink()
    assert got == [8, 9, 10, 11, 12, 13, 14]
