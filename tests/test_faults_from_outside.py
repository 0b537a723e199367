"""Faults come from outside, checked on the source of every production module under `checkfree/`,
`peers/` and the coordinator's packages (`coordinator/`, `swarm/`, `faults/`, `ops/`) with `ast`:

* a fault hook is called only where one was installed: a call through the coordinator's hook (`Hook`,
  coordinator/common.py) or the peer's (`PeerHook`, checkfree/peer_hook.py), whatever the attribute, parameter
  or local it travels in is named, sits in the body of an `if <it> is not None:` or after an
  `if <it> is None: return` of its function (or of a function around it);
* no production module imports a fault tool, or names "chaos";
* no wire message type has a field only an injector sets (the fields the peer's hook replaced are gone).

The fault tools, and the command-line front-ends that build them from their testing flags, are listed with why.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("checkfree", "peers", "coordinator", "swarm", "ops")
HOOK_TYPES = {"Hook", "PeerHook"}  # the coordinator's and the peer's one hook
TOOL_MODULES = {
    "checkfree.net.faulty": "the transport wrapper of the fault injectors",
    "checkfree.peer_faults": "the peer hook that acts out armed faults, and its control channel",
    "faults.injector": "the local swarm's and the in-process tier's injector (FaultSchedule)",
}
FRONT_ENDS = {  # modules that may name the tools: they build them from their testing flags, or act on their requests
    "peers/peer_cli.py": "`checkfree peer --fault-hook` builds the peer's hook",
    "coordinator/scheduler_cli.py": "`checkfree scheduler --chaos-*` builds the coordinator's injector",
    "swarm/local_cli.py": "`checkfree local` passes its chaos flags on",
    "swarm/launcher.py": "the local swarm's launcher acts on the injector's CHAOS lines",
    "faults/chaos.py": "`checkfree chaos`: a long run under churn",
}


def _module(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def production_modules() -> list[Path]:
    paths = [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]
    return [p for p in paths if _module(p) not in TOOL_MODULES and str(p.relative_to(ROOT)) not in FRONT_ENDS]


def _expr(node: ast.AST) -> str:
    return ast.unparse(node)


def _hook_params(func: ast.AST) -> set[str]:
    """The parameters of `func` annotated with a hook type (`PeerHook | None`, `Hook`, ...)."""
    args = func.args.posonlyargs + func.args.args + func.args.kwonlyargs
    return {a.arg for a in args if a.annotation is not None
            and HOOK_TYPES & set(re.findall(r"\w+", _expr(a.annotation)))}


def _hook_names(tree: ast.AST) -> set[str]:
    """Every expression that holds a hook in the module: hook-typed parameters, the attributes and locals they are
    assigned to (`self.x = hook`, `self.a, self.x = ..., hook`), and locals copied from those (`h = self.x`)."""
    names: set[str] = set()
    for func in ast.walk(tree):
        if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names |= _hook_params(func)
    changed = True
    while changed:
        changed = False
        for node in ast.walk(tree):
            if not isinstance(node, ast.Assign):
                continue
            pairs = [(t, node.value) for t in node.targets]
            if isinstance(node.targets[0], ast.Tuple) and isinstance(node.value, ast.Tuple):
                pairs = list(zip(node.targets[0].elts, node.value.elts))
            for target, value in pairs:
                if _expr(value) in names and _expr(target) not in names:
                    names.add(_expr(target))
                    changed = True
    return names


def _guards(test: ast.expr, negated: bool) -> set[str]:
    """The expressions `test` proves are not None: `x is not None` (or, `negated`, the `x is None` of an early
    return), joined by `and`."""
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And) and not negated:
        return set().union(*(_guards(v, False) for v in test.values))
    op = ast.IsNot if not negated else ast.Is
    if (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], op)
            and isinstance(test.comparators[0], ast.Constant) and test.comparators[0].value is None):
        return {_expr(test.left)}
    return set()


def _early_returns(func: ast.AST) -> set[str]:
    """What a function's top-level `if x is None: return ...` statements prove for the rest of it."""
    out: set[str] = set()
    for stmt in func.body:
        if isinstance(stmt, ast.If) and stmt.body and isinstance(stmt.body[-1], (ast.Return, ast.Raise)):
            out |= _guards(stmt.test, True)
    return out


def unguarded_hook_calls(path: Path, root: Path = ROOT) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    hooks = _hook_names(tree)
    found: list[str] = []

    def visit(node: ast.AST, guarded: frozenset[str]) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            guarded = guarded | _early_returns(node)
        if isinstance(node, ast.If):
            visit(node.test, guarded)
            for stmt in node.body:
                visit(stmt, guarded | _guards(node.test, False))
            for stmt in node.orelse:
                visit(stmt, guarded)
            return
        if isinstance(node, ast.Call):
            callees = {_expr(node.func)} | ({_expr(node.func.value)} if isinstance(node.func, ast.Attribute) else set())
            if callees & hooks and not callees & hooks <= guarded:
                found.append(f"{path.relative_to(root)}:{node.lineno}: {_expr(node)[:80]}")
        for child in ast.iter_child_nodes(node):
            visit(child, guarded)

    visit(tree, frozenset())
    return found


def test_no_production_module_calls_a_fault_hook_unless_one_was_installed():
    modules = production_modules()
    assert len(modules) > 80 and ROOT / "peers" / "passes.py" in modules  # every module, not a chosen few
    bad = [v for path in modules for v in unguarded_hook_calls(path)]
    assert not bad, "hook calls without a check that a hook was installed:\n" + "\n".join(bad)


def test_the_hook_check_finds_what_it_should(tmp_path):
    """On a sample: calls through a hook however named, unguarded, are found; guarded ones are not."""
    sample = tmp_path / "sample.py"
    sample.write_text(
        "class Part:\n"
        "    def __init__(self, a, watcher: PeerHook | None = None, *, other: Hook | None = None):\n"
        "        self.a, self.seen = a, watcher\n"
        "        self.other = other\n"
        "    def f(self):\n"
        "        self.seen(1)\n"  # 6
        "        if self.seen is not None:\n"
        "            self.seen(2)\n"
        "        if self.a is not None:\n"
        "            self.seen.started(3)\n"  # 10
        "        w = self.seen\n"
        "        w(4)\n"  # 12
        "    async def g(self):\n"
        "        if self.other is None:\n"
        "            return\n"
        "        await self.other('iteration', self)\n"
        "        def inner():\n"
        "            self.other(5)\n"
        "        if self.a is not None and self.seen is not None:\n"
        "            self.seen(6)\n")
    assert [int(v.split(":")[1]) for v in unguarded_hook_calls(sample, tmp_path)] == [6, 10, 12]


def test_no_production_module_names_chaos_or_imports_a_fault_tool():
    bad = []
    for path in production_modules():
        text = path.read_text()
        if re.search("chaos", text, re.IGNORECASE):
            bad.append(f"{path.relative_to(ROOT)} names chaos")
        for node in ast.walk(ast.parse(text)):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [
                a.name for a in node.names] if isinstance(node, ast.Import) else []
            bad += [f"{path.relative_to(ROOT)} imports {n}" for n in names if n in TOOL_MODULES]
    assert not bad, "\n".join(bad)


def test_no_wire_message_has_a_field_only_an_injector_sets():
    """The peer's hook is armed through its own channel (checkfree.peer_faults), not by fields of requests; the
    options of a coordinator carry no fault schedule either."""
    from checkfree import messages
    from coordinator.common import CoordinatorOptions
    from faults.injector import FaultSchedule

    fields = {f for name in dir(messages) if isinstance(t := getattr(messages, name), type)
              and issubclass(t, messages.Message) for f in t.__struct_fields__}
    assert not {f for f in fields if re.search("chaos|inject|die_|buckets", f)}, sorted(fields)
    options = {f.name for f in dataclasses.fields(CoordinatorOptions)}
    assert not options & {f.name for f in dataclasses.fields(FaultSchedule)} and not any("chaos" in o for o in options)
