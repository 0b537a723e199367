"""A fork server ("zygote") for the processes a local swarm starts: one process imports torch, hivemind and the
runtime's peer and coordinator modules once (cli.main.PRELOAD), then forks every `python -m checkfree ARGS` child
from that state. A child so started skips the ~3-5 s of CPU each fresh interpreter spends importing them (6-9
processes starting at once on 2 cores waited 14-19 s before a peer listened).

From outside a forked child looks like one `spawn` starts with Popen: a session (process group) of its own, its
stdin from /dev/null or a pipe, stdout and stderr into one pipe, its command line in /proc/PID/cmdline (written over
the zygote's argv memory, which the zygote pads for it; trailing NULs follow it), its exit status through a
Popen-like object (`ZygoteProcess`: pid, poll, wait, returncode, send_signal, terminate, kill, stdin, stdout).

Limits, by design:
* The zygote starts with the environment its children need (libgomp reads OMP_NUM_THREADS when torch loads, and
  /proc/PID/environ shows the zygote's): `Zygote.popen` forks only for a spawn whose env equals the zygote's, and
  returns None otherwise (the caller then starts the process with Popen).
* A spawn with a prefix: only swarm/netlab.py's `ip netns exec NAME` is forked (anything else goes to Popen). The
  client opens /var/run/netns/NAME and passes the descriptor; the child enters that network namespace (setns) before
  its command line is written or its pid reported, so nothing of it runs in the zygote's. What `ip netns exec` does
  besides, it leaves out, on purpose: it execs the command (its /proc/PID/cmdline is `python -m checkfree ARGS`
  either way, which the child's is), bind-mounts /etc/netns/NAME/* over /etc (netlab writes none), and, in a mount
  namespace of its own, mounts a fresh sysfs over /sys, whose /sys/class/net then lists the namespace's interfaces.
  Nothing of the swarm reads /sys/class/net (sockets, netlink and /proc/self/net follow the network namespace); the
  one /sys reader, checkfree/memory.py's cgroup limit, finds no /sys/fs/cgroup in that fresh sysfs, and the forked
  child's own cgroup's limit.
* The zygote does no torch op and starts no thread before it forks (no thread pool a fork could break); a child
  reseeds what the imports seeded (numpy's global generator, multiprocessing's authkey; Python's `random` reseeds
  itself at fork) and runs `python -m checkfree` as runpy would, then exits with its code after the interpreter's
  exit steps (threads joined, atexit handlers, streams flushed).
* The zygote is the children's parent: it reaps them and reports each exit status over its socket. It leaves when
  its owner closes that socket, or dies (EOF); children still running then are orphaned like those of a killed
  launcher. A zygote that dies first: `Zygote.popen` returns None from then on (with one warning line), and the
  children it had started report returncode `ORPHANED` once they are gone.
* `CHECKFREE_ZYGOTE=0` turns it off (`enabled()`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["Zygote", "ZygoteProcess", "enabled", "netns_name", "ENV_SWITCH", "ORPHANED"]

ENV_SWITCH = "CHECKFREE_ZYGOTE"  # "0" / "off" / "no" / "false": every spawn uses Popen
ROOM = 16384  # bytes of argv memory the zygote's padding leaves for a child's command line
ORPHANED = 255  # returncode of a child whose fork server died before it: its true status is unknown
NETNS_DIR = "/var/run/netns"  # where `ip netns add NAME` keeps the namespace (iproute2's NETNS_RUN_DIR)
CLONE_NEWNET = 0x40000000  # (os.CLONE_NEWNET from Python 3.12)
_MSG = 1 << 16


def enabled(env: Mapping[str, str] | None = None) -> bool:
    """Whether spawns may use a fork server (`CHECKFREE_ZYGOTE`, default on; Linux only)."""
    value = (os.environ if env is None else env).get(ENV_SWITCH, "1").strip().lower()
    return sys.platform.startswith("linux") and value not in ("0", "off", "no", "false")


class ZygoteProcess:
    """The parts of `subprocess.Popen` the swarm uses, for a child of the fork server."""

    def __init__(self, args: list[str], pid: int, stdin, stdout, owner: "Zygote") -> None:
        self.args, self.pid, self.stdin, self.stdout, self.stderr = args, pid, stdin, stdout, None
        self.returncode: int | None = None
        self._owner = owner
        self._done = threading.Event()

    def _exited(self, returncode: int) -> None:
        self.returncode = returncode
        self._done.set()

    def poll(self) -> int | None:
        if not self._done.is_set() and self._owner.dead:
            self._owner._orphan_check(self)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._done.is_set():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            if self._owner.dead:
                self._owner._orphan_check(self)
                self._done.wait(0.05 if left is None else min(0.05, left))
            else:
                self._done.wait(left)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The client side: starts the fork server (`python -m swarm.zygote`) with `env`, in the background (it imports
    for some seconds; the first `popen` waits for it), and forks children from it. `preload`: the modules it
    imports (None: cli.main.PRELOAD); `log`: where its own output goes (what its imports print, a traceback if it
    fails; None: this process's stderr)."""

    def __init__(self, env: Mapping[str, str], ready_timeout: float = 120.0,
                 preload: Sequence[str] | None = None, log: Path | None = None) -> None:
        self.env = dict(env)
        self.ready_timeout = ready_timeout
        self.dead = False
        self._warned = False
        self._lock = threading.Lock()  # one request at a time
        self._ready = threading.Event()
        self._replies: dict[int, dict] = {}
        self._replied = threading.Condition()
        self._children: dict[int, ZygoteProcess] = {}
        self._early: dict[int, int] = {}  # exit statuses of pids not registered yet
        self._next = 0
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock = ours
        pad = "-" * ROOM  # argv room the children's command lines are written into
        errors = open(log, "a") if log is not None else None
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "swarm.zygote", str(theirs.fileno()),
                 "-" if preload is None else ",".join(preload), pad], env=self.env,
                stdin=subprocess.DEVNULL, stdout=errors or subprocess.DEVNULL, stderr=errors,
                pass_fds=[theirs.fileno()],
                start_new_session=True)  # (not in the owner's group: a terminal's Ctrl-C is the owner's to handle)
        finally:
            theirs.close()
            if errors is not None:
                errors.close()
        self._reader = threading.Thread(target=self._read, name="zygote-reader", daemon=True)
        self._reader.start()

    # --- client side -----------------------------------------------------------------------------------------

    def _read(self) -> None:
        try:
            while True:
                data = self._sock.recv(_MSG)
                if not data:
                    break
                msg = json.loads(data)
                if "ready" in msg:
                    self._ready.set()
                elif "exit" in msg:
                    pid, code = msg["exit"], os.waitstatus_to_exitcode(msg["status"])
                    with self._replied:
                        child = self._children.pop(pid, None)
                        if child is None:
                            self._early[pid] = code
                    if child is not None:
                        child._exited(code)
                else:
                    with self._replied:
                        self._replies[msg["id"]] = msg
                        self._replied.notify_all()
        except (OSError, ValueError):
            pass
        self._died()

    def _died(self) -> None:
        with self._replied:
            self.dead = True
            self._replied.notify_all()
        self._ready.set()

    def _warn(self, why: str) -> None:
        if not self._warned:
            self._warned = True
            print(f"swarm: fork server unavailable ({why}); starting processes with Popen", file=sys.stderr,
                  flush=True)

    def _orphan_check(self, child: ZygoteProcess) -> None:
        """A child of a dead fork server: gone (reaped by its new parent, or a zombie) means exited, status
        unknown."""
        try:
            with open(f"/proc/{child.pid}/stat") as f:
                gone = f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
        except OSError:
            gone = True
        if gone:
            with self._replied:
                self._children.pop(child.pid, None)
            child._exited(ORPHANED)

    def popen(self, args: list[str], env: Mapping[str, str], *, stdin=subprocess.DEVNULL,
              cwd: str | None = None, prefix: Sequence[str] = (), module: str = "checkfree") -> ZygoteProcess | None:
        """Fork `[prefix...] python -m MODULE ARGS` from the server; None where it cannot be (a prefix other than
        `ip netns exec NAME` or a namespace it cannot open, another env, a server that is gone or never got ready):
        start it with Popen then."""
        netns = netns_name(prefix)
        if (prefix and netns is None) or dict(env) != self.env or stdin not in (subprocess.DEVNULL, subprocess.PIPE):
            return None
        if not self._ready.wait(self.ready_timeout) or self.dead:
            self._warn("it exited" if self.dead else f"not ready within {self.ready_timeout:g} s")
            return None
        try:
            ns_fd = os.open(os.path.join(NETNS_DIR, netns), os.O_RDONLY | os.O_CLOEXEC) if netns else -1
        except OSError:
            return None  # (Popen's `ip netns exec` then says why, in the process's output)
        out_r, out_w = os.pipe()
        in_r, in_w = os.pipe() if stdin == subprocess.PIPE else (-1, -1)
        fds = [out_w] + ([in_r] if in_r >= 0 else []) + ([ns_fd] if ns_fd >= 0 else [])
        try:
            with self._lock:
                self._next += 1
                ident = self._next
                request = {"id": ident, "args": list(args), "cwd": cwd or os.getcwd(), "stdin": in_r >= 0,
                           "netns": ns_fd >= 0, "argv0": sys.executable, "module": module}
                try:
                    socket.send_fds(self._sock, [json.dumps(request).encode()], fds)
                except OSError as e:
                    self._died()
                    self._warn(f"{e}")
                    return None
                with self._replied:
                    while ident not in self._replies and not self.dead:
                        self._replied.wait()
                    answer = self._replies.pop(ident, None)  # (the server's JSON, not a checkfree.messages reply)
                    if answer is None or "pid" not in answer:
                        self._warn("it exited" if answer is None else answer.get("error", "?"))
                        return None
                    pid = answer["pid"]
                    child = ZygoteProcess([*prefix, sys.executable, "-m", module, *args], pid,
                                          open(in_w, "w") if in_w >= 0 else None, open(out_r, "r"), self)
                    in_w = out_r = -1  # (the files own them now)
                    self._children[pid] = child
                    early = self._early.pop(pid, None)
            if early is not None:
                child._exited(early)
            return child
        finally:
            for fd in (out_w, in_r, out_r, in_w, ns_fd):
                if fd >= 0:
                    os.close(fd)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the server (its children, if any still run, are not signalled) and wait for it to exit."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._reader.join(timeout=timeout)

    def __enter__(self) -> "Zygote":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def netns_name(prefix: Sequence[str]) -> str | None:
    """NAME of a prefix `ip netns exec NAME` (swarm/netlab.py's), a plain name of /var/run/netns; None for any other
    prefix."""
    if (len(prefix) == 4 and list(prefix[:3]) == ["ip", "netns", "exec"]
            and re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", prefix[3]) and prefix[3] not in (".", "..")):
        return prefix[3]
    return None


# --- server side ---------------------------------------------------------------------------------------------


def _setns(fd: int) -> None:
    """Enter the network namespace `fd` refers to (this thread's; a forked child has no other)."""
    if hasattr(os, "setns"):  # (Python 3.12+)
        os.setns(fd, CLONE_NEWNET)
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"setns: {os.strerror(errno)}")


def _set_cmdline(argv: list[str]) -> None:
    """Write `argv` over this process's argv memory (what /proc/PID/cmdline shows), NUL-padded to its end; longer
    command lines are cut (Linux: the memory's bounds are fields 48 and 49 of /proc/self/stat)."""
    import ctypes

    fields = open("/proc/self/stat").read().rsplit(")", 1)[1].split()
    start, end = int(fields[45]), int(fields[46])
    room = end - start
    data = b"\0".join(a.encode(errors="surrogateescape") for a in argv)[:room - 1]
    ctypes.memmove(start, data + b"\0" * (room - len(data)), room)


def _child(request: dict, fds: list[int], closing: list[int], started: int) -> None:
    """In the forked child: become `python -m MODULE ARGS` (never returns). One byte on `started` once it has its
    own session, its network namespace (if asked) and its command line (the server reports its pid only then, as
    Popen returns only then)."""
    code = 1
    try:
        os.setsid()
        signal.set_wakeup_fd(-1)
        for fd in closing:
            os.close(fd)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        out = fds[0]
        stdin = fds[1] if request["stdin"] else os.open(os.devnull, os.O_RDONLY)
        os.dup2(stdin, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        for fd in {out, stdin}:
            os.close(fd)
        if request.get("netns"):  # (before anything of the command runs; an error goes to its output, as ip's)
            try:
                _setns(fds[-1])
            except OSError as e:
                print(f"setting the network namespace failed: {e}", file=sys.stderr, flush=True)
                raise
            os.close(fds[-1])
        os.chdir(request["cwd"])
        _set_cmdline([request["argv0"], "-m", request["module"], *request["args"]])
        os.write(started, b"+")
        os.close(started)
        _reseed()
        code = _run_module(request["module"], request["args"])
    finally:
        os._exit(code)


def _reseed() -> None:
    """What the imports seeded in the zygote, reseeded (Python's `random` reseeds itself at fork)."""
    import multiprocessing

    multiprocessing.current_process().authkey = os.urandom(32)
    if (numpy := sys.modules.get("numpy")) is not None:
        numpy.random.seed()


def _run_module(module: str, args: list[str]) -> int:
    """`python -m MODULE ARGS` in this process, with the interpreter's exit steps; its exit code."""
    import atexit
    import runpy

    sys.argv = [module, *args]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = _exit_code(e.code)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    with contextlib.suppress(BaseException):
        threading._shutdown()  # type: ignore[attr-defined]  # (non-daemon threads joined, as at exit)
    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()
    return code


def _exit_code(code: object) -> int:
    """The exit status `sys.exit(code)` gives."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    with contextlib.suppress(BaseException):
        print(code, file=sys.stderr)
    return 1


def _preload(names: str) -> None:
    """Import these modules (comma-separated; "-": cli.main.PRELOAD, the swarm's processes' own)."""
    import importlib

    modules: Sequence[str] = names.split(",") if names != "-" else importlib.import_module("cli.main").PRELOAD
    for name in filter(None, modules):
        with contextlib.suppress(ImportError):
            importlib.import_module(name)


def serve(fd: int, preload: str = "-") -> None:
    """The server's loop: fork a child per request, report each child's exit; leave at EOF."""
    sock = socket.socket(fileno=fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (its owner handles a Ctrl-C)
    _preload(preload)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    if len(os.listdir("/proc/self/task")) > 1:  # a fork from a threaded process could inherit a held lock
        print(f"swarm.zygote: {len(os.listdir('/proc/self/task'))} threads after the imports", file=sys.stderr)
    sock.send(json.dumps({"ready": True}).encode())
    sys.stdout.flush()
    sys.stderr.flush()
    while True:
        for key, _ in sel.select():
            if key.fileobj is sock:
                try:
                    data, fds, _flags, _addr = socket.recv_fds(sock, _MSG, 4)
                except OSError:
                    data, fds = b"", []
                if not data:
                    return
                request = json.loads(data)
                started_r, started_w = os.pipe()
                try:
                    pid = os.fork()
                except OSError as e:
                    sock.send(json.dumps({"id": request["id"], "error": f"fork: {e}"}).encode())
                    pid = -1
                if pid == 0:
                    _child(request, fds, [sock.fileno(), sel.fileno(), wake_r, wake_w, started_r], started_w)
                for f in [*fds, started_w]:
                    os.close(f)
                if pid > 0:
                    with contextlib.suppress(InterruptedError):
                        os.read(started_r, 1)  # (EOF: it died before; its exit is reported as usual)
                    sock.send(json.dumps({"id": request["id"], "pid": pid}).encode())
                os.close(started_r)
            else:
                with contextlib.suppress(OSError):
                    while os.read(wake_r, 512):
                        pass
        while True:  # reap every child that has exited
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            try:
                sock.send(json.dumps({"exit": pid, "status": status}).encode())
            except OSError:
                return


if __name__ == "__main__":
    serve(int(sys.argv[1]), sys.argv[2])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # (no interpreter teardown of what it imported: a second or more of CPU, for nothing to save)
