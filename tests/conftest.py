"""Shared fixtures (a per-test temporary cache, a guard that no test leaves processes behind) and the test tiers.

Tiers (README "Test"; docs/testing.md): `make test-all` (CI) runs every test but the `slow` ones; `make test` is
`pytest --quick`, the same minus the real-process tier, except the `smoke` run; `pytest --real` is the rest: the
real-process tier but the smoke run (`make test-all` is `--quick` on two workers, then `--real` serially). A test is in the real-process tier
(marker `processes`, added at collection) when it is marked so in its own file, or when its code, a fixture it
uses or a helper of its own module it calls names something that starts OS processes (PROCESS_STARTERS). A
`--quick` run lists any other test that started OS processes all the same, so the rule's misses show.
"""

from __future__ import annotations

import inspect
import os
import sys
import uuid
from pathlib import Path
from types import CodeType, ModuleType

import pytest

# One torch thread per test process (and its children): on 2 busy cores, two intra-op threads
# per process thrash (seen: 15 tiny steps 142 s at 2 threads, 1.4 s at 1), and one thread keeps
# float results independent of the machine's core count.
os.environ.setdefault("OMP_NUM_THREADS", "1")


# Every process this test session starts inherits this marker, so the leftover check below
# sees our own daemons (orphans included, whose parent is gone) and nobody else's.
SESSION_MARK = f"CHECKFREE_TEST_SESSION={uuid.uuid4().hex}"
os.environ["CHECKFREE_TEST_SESSION"] = SESSION_MARK.split("=", 1)[1]


def _ours(pid: int) -> bool:
    try:
        return SESSION_MARK.encode() in open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    except OSError:
        return False


def _processes() -> list[tuple[int, int, bytes]]:
    """Every process as (pid, parent pid, name), read from /proc/PID/stat: what `pgrep` reads, without starting one
    (a fork and exec of a process with torch loaded, twice per test, cost the quick tier more than its /proc reads)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # the process is gone
        name, rest = stat.split(b" (", 1)[1].rsplit(b") ", 1)
        found.append((int(entry), int(rest.split(None, 2)[1]), name))
    return found


def _p2pd_pids() -> set[int]:
    """Our p2pd daemons (as `pgrep -x p2pd`, then this session's mark)."""
    return {pid for pid, _, name in _processes() if name == b"p2pd" and _ours(pid)}


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread():
    import torch

    torch.set_num_threads(1)


@pytest.fixture(autouse=True, scope="module")
def fork_servers_closed():
    """The fork servers tests/swarmrun.py's `spawn` started for a module's tests, stopped at its end (one per env
    its spawns used: they outlive a test, as a session-scoped fixture's processes, but not its module)."""
    yield
    if (swarmrun := sys.modules.get("swarmrun")) is not None:
        swarmrun.close_fork_servers()


@pytest.fixture(autouse=True)
def no_leftover_p2pd():
    """Fail a test that leaves a p2pd daemon running (orphaned daemons are a known hivemind pitfall)."""
    before = _p2pd_pids()
    yield
    import time

    deadline = time.monotonic() + 10
    while (left := _p2pd_pids() - before) and time.monotonic() < deadline:
        time.sleep(0.1)  # daemons exit asynchronously after shutdown; bounded wait
    for pid in left:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
    assert not left, f"test left p2pd processes behind: {sorted(left)}"


def _libp2p_missing() -> str | None:
    """Why py-libp2p cannot be used here (None if it can)."""
    from checkfree.net import libp2p_transport  # before any bare `import libp2p` (see its module docstring)

    err = libp2p_transport.LIBP2P_IMPORT_ERROR
    return None if err is None else f"py-libp2p is not installed (optional: pip install 'checkfree[libp2p]'): {err}"


@pytest.fixture(params=["hivemind", "libp2p"])
def rpc_transport(request) -> str:
    """A test that takes this fixture runs once per RPC transport (`--transport hivemind | libp2p`); the
    libp2p run is skipped, with the reason, where py-libp2p cannot be imported."""
    if request.param == "libp2p" and (why := _libp2p_missing()) is not None:
        pytest.skip(why)
    return request.param


@pytest.fixture(scope="session")
def session_cache(tmp_path_factory) -> str:
    """The session's token cache ($CHECKFREE_CACHE of a test's runs): the BPE is trained and the tokens are written
    once per session (about 15 s on 2 busy cores), not once per module or test that only reads them. Under
    pytest-xdist the workers share it (each worker's temporary directory is its own, in the session's): the first
    to need an entry makes it, under the entry's lock (checkfree.data), and the others wait for it."""
    base = tmp_path_factory.getbasetemp()
    return str((base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "cache")


@pytest.fixture
def tiny_cfg(session_cache):
    """The tiny preset with the session's token cache."""
    from checkfree.config import preset

    cfg = preset("tiny")
    cfg.data.cache_dir = session_cache
    return cfg


@pytest.fixture(autouse=True)
def fresh_refusal_log():
    """Each test starts with an empty refusal-log window (the limit is per process and per minute)."""
    import sys

    transport = sys.modules.get("checkfree.net.errors")
    if transport is not None:
        transport.REFUSALS.__init__(transport.REFUSALS.per_window, transport.REFUSALS.window_s)
    yield


# --- test tiers ---------------------------------------------------------------------------------------------------

# Names whose use starts OS processes: process modules, hivemind's daemon-backed P2P and DHT (each runs a p2pd
# process), the runtime's own spawners, and the subprocess tier's helper module (tests/swarmrun.py).
PROCESS_STARTERS = {"subprocess", "multiprocessing", "Popen", "P2P", "DHT", "start_transport", "start_companion"}
PROCESS_MODULES = {"subprocess", "multiprocessing", "swarmrun", "swarm.processes", "swarm.launcher"}
TESTS_DIR = Path(__file__).resolve().parent
# autouse fixtures that look for processes or stop them, start none
WATCHERS = {"no_leftover_p2pd", "_process_tier_check", "fork_servers_closed"}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--quick", action="store_true",
                     help="the quick tier (make test): leave out the real-process tier except the smoke run")
    parser.addoption("--real", action="store_true",
                     help="the rest of the suite after --quick: the real-process tier but the smoke run")


def _names(code: CodeType) -> set[str]:
    """Every global or attribute name a code object (and the functions, lambdas and comprehensions in it) uses,
    imports included."""
    names = set(code.co_names)
    for inner in code.co_consts:
        if isinstance(inner, CodeType):
            names |= _names(inner)
    return names


def _is_ours(obj: object) -> bool:
    """A function defined in a file under tests/ (a test module, conftest, swarmrun.py, ...)."""
    try:
        return inspect.isfunction(obj) and Path(inspect.getfile(obj)).resolve().parent == TESTS_DIR
    except TypeError:
        return False


def _starts_processes(func: object, seen: set[CodeType]) -> bool:
    """Whether `func`, or a tests/ function it names (followed transitively), names a process starter."""
    func = inspect.unwrap(getattr(func, "__func__", func))
    code = getattr(func, "__code__", None)
    if code is None or code in seen:
        return False
    seen.add(code)
    module_globals = getattr(func, "__globals__", {})
    for name in _names(code):
        value = module_globals.get(name)
        if name in PROCESS_STARTERS or (isinstance(value, ModuleType) and value.__name__ in PROCESS_MODULES) \
                or getattr(value, "__module__", None) in PROCESS_MODULES:
            return True
        if _is_ours(inspect.unwrap(value) if callable(value) else value) and _starts_processes(value, seen):
            return True
    return False


def _in_process_tier(item: pytest.Item) -> bool:
    if item.get_closest_marker("processes"):
        return True
    seen: set[CodeType] = set()
    fixtures = getattr(item, "_fixtureinfo", None)
    defs = [d for ds in (fixtures.name2fixturedefs.values() if fixtures else ()) for d in ds]
    funcs = [getattr(item, "obj", None)] + [d.func for d in defs if d.argname not in WATCHERS]
    return any(_starts_processes(f, seen) for f in funcs if f is not None)


def pytest_collection_finish(session: pytest.Session) -> None:
    """What collection made and still holds (the modules of the tests, torch, transformers: some 360,000 objects) is
    frozen (gc.freeze): a full collection, automatic or asked for (dst.run's resource counts ask for one before and
    after each schedule), then walks only what the tests make, not all of that again each time."""
    import gc

    if "trio" in sys.modules and "hypothesis" not in sys.modules:
        # a later `import hypothesis` runs trio's plugin, whose register_random looks for the referrers of trio's
        # random with gc.get_referrers, which sees no frozen object, and warns: a run of a few files only, where
        # little is to be saved
        return
    gc.collect()  # its garbage is freed, not frozen
    gc.freeze()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _in_process_tier(item) and not item.get_closest_marker("processes"):
            item.add_marker("processes")
    if config.getoption("--quick") and config.getoption("--real"):
        raise pytest.UsageError("--quick and --real are the two halves of the suite: give one")
    if config.getoption("--real"):
        keep = [i for i in items if i.get_closest_marker("processes") and not i.get_closest_marker("smoke")]
        if dropped := [i for i in items if i not in keep]:
            config.hook.pytest_deselected(items=dropped)
        items[:] = keep
        return
    if not config.getoption("--quick"):
        return
    keep = [i for i in items if not i.get_closest_marker("processes") or i.get_closest_marker("smoke")]
    dropped = [i for i in items if i not in keep]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    # the smoke run (the tier's longest test) first: on two workers (make test) it then runs beside the others
    # rather than alone at the end
    items[:] = sorted(keep, key=lambda i: i.get_closest_marker("smoke") is None)
    whole_suite = config.args_source == pytest.Config.ArgsSource.TESTPATHS and not config.getoption("keyword")
    if whole_suite and not any(i.get_closest_marker("smoke") for i in items):
        raise pytest.UsageError("--quick: no test marked `smoke` was collected: the quick tier would have no "
                                "real-process run (tests/test_smoke.py)")


def _child_ticks() -> int:
    """CPU clock ticks of this process's children that have exited and been waited for (/proc/self/stat)."""
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[13]) + int(fields[14])  # cutime, cstime (fields 16 and 17 of proc(5))


def _live_children() -> list[int]:
    """This process's children still running (read from /proc: starting pgrep would itself be a child)."""
    me = os.getpid()
    return [pid for pid, parent, _ in _processes() if parent == me]


_UNDECLARED: list[str] = []


@pytest.fixture(autouse=True)
def _process_tier_check(request, no_leftover_p2pd):
    """In a --quick run, note a test that started OS processes without being in the real-process tier (set up
    after no_leftover_p2pd: its window holds the test alone)."""
    quick = request.config.getoption("--quick")
    if not quick or request.node.get_closest_marker("processes"):
        yield
        return
    ticks, children = _child_ticks(), set(_live_children())
    yield
    now = set(_live_children())
    # A child still running from an earlier test (torch_shm_manager, a pool's resource tracker) is not this test's,
    # nor is the CPU time it brings when it is reaped during this test: count ticks only when none such ended.
    if now - children or (_child_ticks() > ticks and not children - now):
        _UNDECLARED.append(request.node.nodeid)


def pytest_sessionfinish(session) -> None:
    """An xdist worker (make test runs the quick tier in two) hands its notes to the controller, which prints them."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["undeclared"] = list(_UNDECLARED)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    _UNDECLARED.extend(getattr(node, "workeroutput", {}).get("undeclared", []))


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    if _UNDECLARED:
        terminalreporter.section("quick tier: tests that started OS processes", sep="-")
        terminalreporter.line("These ran in the quick tier although they start real processes; mark them "
                              "`@pytest.mark.processes` (docs/testing.md):")
        for nodeid in _UNDECLARED:
            terminalreporter.line(f"  {nodeid}")
