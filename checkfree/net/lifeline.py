"""Children that die with their parent, and socket files that do not outlive their owner.

A peer's hivemind DHT runs in a forked process, which starts the p2p daemon (p2pd). If the
peer is SIGKILLed (`kill -9`, the OOM killer), nothing tells them: they used to run on,
holding memory and ports, and every such death left `hivemind-p2pd-*` / `hivemind-p2pclient-*`
socket files in /tmp. On Linux `prctl(PR_SET_PDEATHSIG)` makes the kernel signal a child
when the thread that created it dies:

* `TiedDHT`: the DHT process gets SIGKILL when its parent dies, and starts p2pd with
  SIGTERM as its parent-death signal (p2pd then closes, and removes, its own socket).
* `sweep_stale_sockets()`: at start-up, remove hivemind socket files in /tmp that nothing
  listens on any more (the client sockets of processes that were SIGKILLed).
* `sweep_stale_mp_dirs()`: the same for multiprocessing's `pymp-*` directories. Those futures' file
  descriptors travel through multiprocessing's resource sharer, whose listener socket lives in a `pymp-*`
  directory of the temporary directory that only an exit handler removes: every SIGKILLed peer, coordinator
  or DHT process left one (75 after one test round). Removed when every socket in it refuses connections.
* `quiet_fd_handoffs()`: hivemind hands the DHT process shared-memory futures, whose file
  descriptors travel through multiprocessing's resource sharer; a DHT child killed in the middle
  of that handshake (the whole group signalled) made the sharer thread print a traceback.
  That disconnect is expected: it becomes a debug line.

Limits: the death signal follows the *thread* that forked, so the DHT must be started from
a thread that lives as long as the process (the event loop's main thread here); on other
systems than Linux none of this is available and the process groups of `checkfree local`
(and the peers' --coordinator-timeout) are the only safety net.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import glob
import logging
import os
import shutil
import signal
import socket
import stat
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator

from hivemind import DHT

__all__ = ["TiedDHT", "held_socket_files", "living", "process_group", "process_tree", "quiet_fd_handoffs", "socket_files",
           "sweep_stale_mp_dirs", "sweep_stale_sockets", "tie_to_parent"]

log = logging.getLogger(__name__)
PR_SET_PDEATHSIG = 1
SOCKET_GLOB = "/tmp/hivemind-p2p*.sock"


def tie_to_parent(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send `sig` to this process when its parent (thread) dies (Linux only;
    elsewhere a no-op). Call it first thing in a child; it exits at once if the parent is gone already."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        log.debug("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
        return
    if os.getppid() == 1:  # the parent died before the prctl: no signal will come
        os.kill(os.getpid(), sig)


class TiedDHT(DHT):
    """A hivemind DHT whose process, and the p2pd it starts, die with the process that started it."""

    def run(self) -> None:
        tie_to_parent(signal.SIGKILL)
        original = asyncio.subprocess.create_subprocess_exec

        async def exec_tied(*args, **kwargs):  # p2pd: SIGTERM, so that it removes its own socket file
            kwargs.setdefault("preexec_fn", lambda: tie_to_parent(signal.SIGTERM))
            return await original(*args, **kwargs)

        asyncio.subprocess.create_subprocess_exec = exec_tied  # this forked process only
        super().run()


def socket_files(pattern: str = SOCKET_GLOB) -> set[str]:
    """The hivemind socket files in the temporary directory now."""
    return set(glob.glob(pattern))


def process_tree(pid: int) -> set[int]:
    """`pid` and all its descendants now (from /proc; Linux)."""
    children: dict[int, list[int]] = {}
    for p, ppid, _ in _stats():
        children.setdefault(ppid, []).append(p)
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        out.add(p)
        todo.extend(children.get(p, []))
    return out


def process_group(pgid: int) -> set[int]:
    """The processes of process group `pgid` now (from /proc; Linux): also those whose leader has exited, which
    `process_tree` of the leader no longer finds (they were reparented)."""
    return {p for p, _, group in _stats() if group == pgid}


def _stats() -> Iterator[tuple[int, int, int]]:
    """(pid, parent pid, process group) of every process now (from /proc; Linux)."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                yield int(entry), int(fields[1]), int(fields[2])
            except (OSError, IndexError, ValueError):
                continue


def living(pids: set[int]) -> set[int]:
    """Those of `pids` that still run (gone and zombie processes are not)."""
    alive = set()
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.add(p)
    return alive


def outliving(pids: set[int], timeout: float = 15.0, poll: float = 0.1) -> set[int]:
    """Those of `pids` still running after up to `timeout` seconds. Processes that exit on their own once their
    clients are gone (torch's torch_shm_manager, a pool's resource tracker) do so shortly after a swarm stops,
    not at the instant its launcher returns; a check for leftovers waits for them, bounded."""
    deadline = time.monotonic() + timeout
    while (alive := living(pids)) and time.monotonic() < deadline:
        time.sleep(poll)
    return alive


def held_socket_files(pids: set[int], prefix: str = "/tmp/hivemind-") -> set[str]:
    """The unix socket files under `prefix` that these processes hold open (hivemind's p2pd / p2pclient
    sockets; from /proc, Linux)."""
    inodes = set()
    for p in pids:
        try:
            for fd in os.listdir(f"/proc/{p}/fd"):
                link = os.readlink(f"/proc/{p}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
        except OSError:
            continue
    paths = set()
    with open("/proc/net/unix") as f:
        for line in f.read().splitlines()[1:]:
            parts = line.split()
            if len(parts) >= 8 and parts[6] in inodes and parts[7].startswith(prefix):
                paths.add(parts[7])
    return paths


def sweep_stale_sockets(pattern: str = SOCKET_GLOB, min_age_s: float = 10.0, among: set[str] | None = None) -> int:
    """Remove hivemind socket files nothing listens on (left by SIGKILLed processes); returns how many.
    Files younger than `min_age_s` are left alone: a process starting now may not listen yet. `among`: only
    these files."""
    removed = 0
    now = time.time()
    for path in glob.glob(pattern):
        if among is not None and path not in among:
            continue
        try:
            if now - os.stat(path).st_mtime < min_age_s:
                continue
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(1.0)
                s.connect(path)
        except ConnectionRefusedError:
            try:
                os.remove(path)
                removed += 1
            except OSError:
                pass
        except OSError as e:
            if e.errno == errno.ENOENT:
                continue
            log.debug("could not probe %s: %r", path, e)
    if removed:
        log.info("removed %d stale hivemind socket file(s) from /tmp", removed)
    return removed


def _refuses(path: str) -> bool:
    """Whether the unix socket at `path` refuses connections (nothing listens on it any more)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(path)
        except ConnectionRefusedError:
            return True
        except OSError:
            return False
    return False


def sweep_stale_mp_dirs(tmp: str | None = None, min_age_s: float = 10.0) -> int:
    """Remove this user's `pymp-*` directories under `tmp` (default: the temporary directory) whose process is gone:
    each holds sockets only (multiprocessing's listeners), and every one refuses connections. Directories younger
    than `min_age_s`, or holding anything else, are left alone. Returns how many were removed."""
    removed, now = 0, time.time()
    for path in glob.glob(os.path.join(tmp or tempfile.gettempdir(), "pymp-*")):
        try:
            st = os.stat(path)
            entries = [os.path.join(path, e) for e in os.listdir(path)]
            sockets = [e for e in entries if stat.S_ISSOCK(os.lstat(e).st_mode)]
        except OSError:
            continue
        if st.st_uid != os.getuid() or now - st.st_mtime < min_age_s or not entries or len(sockets) < len(entries):
            continue
        if all(_refuses(e) for e in sockets):
            shutil.rmtree(path, ignore_errors=True)
            removed += not os.path.exists(path)
    if removed:
        log.info("removed %d stale multiprocessing director(ies) (pymp-*) from %s", removed, tmp or tempfile.gettempdir())
    return removed


_DISCONNECTS = (ConnectionResetError, BrokenPipeError, EOFError)


def quiet_fd_handoffs() -> None:
    """Make a disconnect inside multiprocessing's resource sharer (its thread reports errors through
    `sys.excepthook`) a debug line; every other exception still reaches the previous hook."""
    previous = sys.excepthook
    if getattr(previous, "_checkfree_quiet", False):
        return

    def hook(kind, value, tb):
        frames = [f.f_code.co_filename for f, _ in traceback.walk_tb(tb)]
        if issubclass(kind, _DISCONNECTS) and frames and frames[0].endswith("resource_sharer.py"):
            log.debug("a process went away while receiving a file descriptor: %s", value)
            return
        previous(kind, value, tb)

    setattr(hook, "_checkfree_quiet", True)  # (marks the hook installed: not twice)
    sys.excepthook = hook
