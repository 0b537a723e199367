"""The layout shows the architecture (issue 38), checked on the source:

* no two runtime modules share a file name (apart from `__init__.py`, `__main__.py` and `base.py`), so a name
  says which part it is: `coordinator/members.py` and `peers/membership.py`, not two `membership.py`;
* no part names an attribute with one letter (`self.t`, `self.c`): the cost model's `S` and `M` are the paper's
  notation (stages, microbatches) and stay;
* the layering (tests/test_layers.py holds the rule): the library (`checkfree/`) imports none of the packages above it, not even by name; the peer
  (`peers/`) and the coordinator's packages (`coordinator/`, `swarm/`, `faults/`, `ops/`) do not import each
  other; the coordinator's parts import neither the launcher, the fault injector nor the operator's tools
  (only its command, `coordinator/scheduler_cli.py`, builds those); no production package imports the harness;
* docs/architecture.md's code tree lists every package.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

from test_layers import _imports  # the layering rule itself is test_layers.test_no_upward_imports

ROOT = Path(__file__).resolve().parent.parent
RUNTIME = ("checkfree", "peers", "coordinator", "swarm", "faults", "ops", "harness", "cli")
COORDINATION = ("coordinator", "swarm", "faults", "ops")
SHARED_NAMES = {"__init__.py", "__main__.py", "base.py"}  # conventional roles
PAPER_NOTATION = {("checkfree/costmodel.py", "S"), ("checkfree/costmodel.py", "M")}
COMMANDS = {"coordinator/scheduler_cli.py"}  # a package's command front-end may build the tools it serves


def _modules(*packages: str) -> list[Path]:
    return [p for pkg in packages for p in sorted((ROOT / pkg).rglob("*.py")) if "__pycache__" not in p.parts]


def test_every_runtime_package_exists_and_the_scheduler_package_is_gone():
    for pkg in RUNTIME:
        assert (ROOT / pkg / "__init__.py").is_file(), pkg
    assert not list((ROOT / "scheduler").rglob("*.py"))
    assert not (ROOT / "benchmarks" / "inprocess.py").exists()  # the harness is not under benchmarks/


def test_no_two_runtime_modules_share_a_file_name():
    where = defaultdict(list)
    for path in _modules(*RUNTIME):
        if path.name not in SHARED_NAMES:
            where[path.name].append(str(path.relative_to(ROOT)))
    shared = {name: paths for name, paths in where.items() if len(paths) > 1}
    assert not shared, shared


def test_no_part_has_a_one_letter_attribute():
    bad = set()
    for path in _modules(*RUNTIME):
        rel = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text(), filename=rel)):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self" \
                    and len(node.attr) == 1 and (rel, node.attr) not in PAPER_NOTATION:
                bad.add(f"{rel}:{node.lineno}: self.{node.attr}")
    assert not bad, "\n".join(sorted(bad))


def test_the_coordinators_parts_import_neither_the_launcher_nor_the_fault_tools_nor_the_operators_tools():
    bad = []
    for path in _modules("coordinator"):
        rel = str(path.relative_to(ROOT))
        hits = _imports(path) & {"swarm", "faults", "ops"}
        if hits and rel not in COMMANDS:
            bad.append(f"{rel} imports {sorted(hits)}")
    assert not bad, "\n".join(bad)


def test_the_layering_check_sees_an_import_by_name(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("import importlib\nMOD = importlib.import_module('coordinator.members')\n"
                      "SPEC = 'peers.peer_cli:add_parser'\n")
    assert _imports(sample) == {"importlib", "coordinator", "peers"}


def test_the_architecture_page_lists_every_package():
    text = (ROOT / "docs" / "architecture.md").read_text()
    tree = re.search(r"## The code\n+```\n(.*?)```", text, re.S)
    assert tree, "docs/architecture.md has no code tree under '## The code'"
    listed = set(re.findall(r"^([a-z_]+)/\s", tree.group(1), re.M))
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    assert packages <= listed, f"not in the code tree: {sorted(packages - listed)}"
    for path in _modules("coordinator", "swarm", "faults", "ops", "harness"):
        if path.name != "__init__.py":
            assert re.search(rf"\b{re.escape(path.name)}\b", tree.group(1)), f"{path.relative_to(ROOT)} not in the tree"
