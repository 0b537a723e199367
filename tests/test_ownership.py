"""Objects own their state: no module under `peers/` or the coordinator's packages (`coordinator/`, `swarm/`, `faults/`,
`ops/`) writes or mutates an attribute of an object
it did not create. Checked on the source with `ast`, as tests/test_layers.py checks imports.

Within a function an attribute may be written on `self` (its own object), on an element of one of its own
containers (`self.members[pid].leaving = ...`) and on a local variable bound in that function to an object made
there (`run = StepRun(...)`); containers may be written when they are the object's own or local. Anything else
is a write into another object: `self.part.field = ...`, `other.field = ...` (a parameter),
`self.part.table[k] = ...`, `del self.part.table[k]`, `self.part.members[p].leaving = ...`, `setattr(...)`, and a
mutating call on another object's container or event: `self.part.reports.clear()`, `self.part.seen.add(p)`,
`run.tasks.add(t)` (`run` a parameter), `other.items.append(x)`; a part that needs it changed asks through a
method (`self.part.report(p)`, `run.track(t)`). A call of a part's own method (`self.part.clear(p)`) is asking.
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


# methods that change the container or event they are called on
MUTATORS = {"append", "extend", "insert", "remove", "pop", "popitem", "clear", "update", "setdefault", "add",
            "discard", "difference_update", "intersection_update", "symmetric_difference_update", "sort", "reverse",
            "appendleft", "popleft", "set", "put_nowait"}


def _mutated(node: ast.AST) -> ast.expr | None:
    """The receiver of a mutating call (`x.append(...)`, `x.set()`), as the container written (None: not one)."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
        return node.func.value
    return None


def _mutation_allowed(receiver: ast.expr, made: set[str]) -> bool:
    """A mutating call is allowed on a local (or a parameter's plain container), on one of the object's own
    attributes or what hangs from them through subscripts and calls (`self.x`, `self.x[k]`, `self.x.get(k)`,
    `self._event(k)`), and on an attribute of an object made in the function."""
    root = receiver
    while isinstance(root, (ast.Subscript, ast.Call)):
        if isinstance(root, ast.Subscript):
            root = root.value
        elif not isinstance(root.func, ast.Attribute):
            return True  # what a plain function returned
        elif root.func.attr in ("get", "setdefault") or (isinstance(root.func.value, ast.Name)
                                                         and root.func.value.id in {"self", *made}):
            root = root.func.value  # an element of a container, or what its own method (or a local's) returned
        else:
            return False  # what another object's method returned (`self.part.event(k).set()`, `run.event(k).set()`)
    return isinstance(root, ast.Name) or _self_attr(root) or (
        isinstance(root, ast.Attribute) and isinstance(root.value, ast.Name) and root.value.id in made)


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        out = []
        for t in node.targets:
            out += list(t.elts) if isinstance(t, (ast.Tuple, ast.List)) else [t]
        return out
    if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        return [node.target]
    if isinstance(node, ast.Delete):
        return list(node.targets)
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
            receiver = _mutated(node)
            if receiver is not None and not _mutation_allowed(receiver, made):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node.func)}()")
    return sorted(set(found), key=lambda s: (s.split(":")[0], int(s.split(":")[1])))


# the process's own state, written where a forked child becomes `python -m checkfree ARGS` (swarm/zygote.py `_child`):
# what a fresh interpreter would have set itself (its arguments, a new multiprocessing key), not another object's
PROCESS_STATE = {"swarm/zygote.py": ("sys.argv", "multiprocessing.current_process().authkey")}


def _process_state(violation: str) -> bool:
    path, _, what = violation.split(":", 2)
    return what.strip() in PROCESS_STATE.get(path, ())


@pytest.mark.parametrize("layer", ["coordinator", "swarm", "faults", "ops", "peers"])
def test_no_module_writes_another_objects_attributes(layer):
    bad = [v for path in sorted((ROOT / layer).rglob("*.py")) for v in violations(path) if not _process_state(v)]
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
        "        run.losses[1] = 0.5\n"  # a container of an object made here
        "        self.part.reports.clear()\n"  # 20
        "        other.seen.add(1)\n"  # 21
        "        del self.part.table[2]\n"  # 22
        "        self.part.members[1].tasks.append(3)\n"  # 23
        "        self.part.event('x').set()\n"  # 24
        "        other.event('x').set()\n"  # 25
        "        run.event('x').set()\n"
        "        self.part.clear(1)\n"  # asking: a method of the part's own
        "        self.seen.add(1)\n"
        "        self._event(1).set()\n"
        "        run.tasks.add(2)\n"
        "        xs.append(1)\n"
        "        out.setdefault(1, []).append(2)\n")
    try:
        got = [int(v.split(":")[1]) for v in violations(sample)]
    finally:
        sample.unlink()
    assert got == [8, 9, 10, 11, 12, 13, 14, 20, 21, 22, 23, 24, 25]
