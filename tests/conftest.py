"""Shared fixtures: a per-test temporary cache, and a guard that no test leaves processes behind."""

from __future__ import annotations

import os
import subprocess
import uuid

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


def _p2pd_pids() -> set[int]:
    out = subprocess.run(["pgrep", "-x", "p2pd"], capture_output=True, text=True).stdout
    return {int(x) for x in out.split() if _ours(int(x))}


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread():
    import torch

    torch.set_num_threads(1)


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


@pytest.fixture
def tiny_cfg(tmp_path_factory):
    """The tiny preset with a shared token cache (the BPE is trained once per session)."""
    from checkfree.config import preset

    cfg = preset("tiny")
    cfg.data.cache_dir = str(tmp_path_factory.getbasetemp() / "cache")
    return cfg


@pytest.fixture(autouse=True)
def fresh_refusal_log():
    """Each test starts with an empty refusal-log window (the limit is per process and per minute)."""
    import sys

    transport = sys.modules.get("checkfree.net.errors")
    if transport is not None:
        transport.REFUSALS.__init__(transport.REFUSALS.per_window, transport.REFUSALS.window_s)
    yield
