"""The layering rule, checked on the source: `checkfree/` (the library) imports none of the layers
above it — `peers/`, `coordinator/`, `swarm/`, `faults/`, `ops/`, `experiments/`, `benchmarks/`, `cli/` — not even by name
(an importlib string); `peers/` and the coordinator's packages (`coordinator/`, `swarm/`, `faults/`, `ops/`) do not
import each other, nor the in-process harness; `peers/` imports no command (`cli/`)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ABOVE = ("peers", "coordinator", "swarm", "faults", "ops", "harness", "experiments", "benchmarks", "cli", "dst")


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


@pytest.mark.parametrize("layer, forbidden", [("checkfree", ABOVE),
                                              ("peers", ("coordinator", "swarm", "faults", "ops", "harness", "dst", "cli")),
                                              *((pkg, ("peers", "harness", "dst")) for pkg in ("coordinator", "swarm", "faults", "ops"))])
def test_no_upward_imports(layer, forbidden):
    bad = []
    for path in sorted((ROOT / layer).rglob("*.py")):
        if path == ROOT / "checkfree" / "__main__.py":  # `python -m checkfree` forwards to cli.main, by design
            continue
        hits = _imports(path) & set(forbidden)
        if hits:
            bad.append(f"{path.relative_to(ROOT)} imports {sorted(hits)}")
    assert not bad, "\n".join(bad)


def test_the_three_transports_type_check_against_the_transport_protocol(tmp_path):
    """mypy (configured in pyproject.toml) checks that HivemindTransport, TcpTransport and Libp2pTransport are
    each a checkfree.net.base.Transport, signatures included (a changed signature fails here)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache"),
                           "tests/transport_protocol_check.py"], cwd=root, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0 and "Success" in done.stdout, done.stdout[-3000:] + done.stderr[-2000:]


def test_the_type_checker_holds_over_the_three_packages(tmp_path):
    """mypy, at the strictness pyproject.toml states, over checkfree/, peers/ and the coordinator's packages
    (coordinator/, swarm/, faults/, ops/): no errors."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache")], cwd=ROOT,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0 and "Success" in done.stdout, done.stdout[-4000:] + done.stderr[-2000:]


def test_a_call_returns_the_reply_type_of_its_request_statically(tmp_path):
    """`Rpc.call` and the peer's `Membership.call` return the reply type of their request for the type checker
    (a `Request[R]` is answered with an `R`): the check file's one wrong use is mypy's one error."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache"),
                           "tests/reply_types_check.py"], cwd=ROOT, capture_output=True, text=True, timeout=240)
    errors = [line for line in done.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 1 and "reply_types_check.py:18:" in errors[0] and '"Joined"' in errors[0] \
        and '"Pong"' in errors[0], done.stdout[-3000:] + done.stderr[-2000:]


def test_every_request_names_its_reply_type_and_the_wire_check_uses_it():
    """Each request type is a `Request[ReplyType]`; the replies a caller checks at run time (REPLIES) are those."""
    from checkfree import messages

    requests = [t for t in vars(messages).values() if isinstance(t, type) and issubclass(t, messages.Request)
                and t is not messages.Request and "rpc" in vars(t)]
    assert len(requests) >= 30
    for kind in requests:
        assert messages.REPLIES[kind.rpc] is messages.reply_type(kind), kind.__name__


def test_no_private_names_cross_modules_in_the_net_package():
    """checkfree/net modules import each other's public names only."""
    import ast
    from pathlib import Path

    net = Path(__file__).resolve().parent.parent / "checkfree" / "net"
    for path in net.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("checkfree"):
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, f"{path.name} imports private {private} from {node.module}"


def _import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports (statements anywhere in the file, and "module:function" names
    such as the CLI's subcommand table); a submodule's import of its own package is not an edge."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    mods = {}
    for pkg in ("checkfree", "peers", "coordinator", "swarm", "faults", "ops", "harness", "cli", "dst"):
        for p in (root / pkg).rglob("*.py"):
            name = ".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
            mods[name] = p

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, p in mods.items():
        for node in ast.walk(ast.parse(p.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and ":" in node.value \
                    and node.value.split(":")[0] in mods:
                targets = [node.value.split(":")[0]]
            for t in targets:
                r = resolve(t)
                if r and r != m and not m.startswith(r + "."):
                    graph[m].add(r)
    return graph


def test_no_import_circles():
    graph = _import_graph()
    assert len(graph) > 80 and graph["coordinator.coordinator"] >= {"coordinator.members", "checkfree.config"}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            assert state.get(n) != 1, f"import circle: {' -> '.join(path[path.index(n):] + [n]) if n in path else n}"
            if n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
