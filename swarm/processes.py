"""Child processes of the local swarm and of the tests: `python -m checkfree ...` in a session of its own (a
kill takes its DHT process and p2pd with it, like a machine vanishing), its output copied to a log and a
queue by a thread, ready lines awaited with a deadline, whole groups killed and reaped."""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from checkfree.protocol import READY_PEER
from swarm.zygote import Zygote, ZygoteProcess

__all__ = ["Proc", "spawn", "await_line", "kill_group", "MILESTONES"]

MILESTONES = ((READY_PEER, "listening"), ("joined run", "joined"), ("serving stage", "serving"))


@dataclass
class Proc:
    popen: subprocess.Popen | ZygoteProcess
    lines: queue.Queue = field(default_factory=queue.Queue)  # output lines, then None at the end
    log: Path | None = None  # every output line is also written here
    peer_id: str = ""  # from a peer's ready line
    addrs: str = ""
    ready: threading.Event = field(default_factory=threading.Event)
    joined: threading.Event = field(default_factory=threading.Event)  # a peer's "joined run" line
    link: int = 0  # NetLab link number (0: no lab)
    name: str = ""
    started: float = field(default_factory=time.monotonic)
    exited: float | None = None  # time.monotonic() when the process exited
    announce: bool = False  # print its start-up milestones (ready, joined, first stage) as they happen
    out: deque = field(default_factory=lambda: deque(maxlen=2000))  # the last output lines

    def tail(self, n: int = 40) -> str:
        return "\n".join(list(self.out)[-n:])

    def read(self) -> None:
        """Copy the process's output to its log and queue; note its peer id from the ready line, and report a
        peer's start-up milestones as they happen (where a slow start-up spends its time). Runs in a thread."""
        log = open(self.log, "a", buffering=1) if self.log is not None else None
        assert self.popen.stdout is not None  # (a pipe)
        try:
            for line in self.popen.stdout:
                if log is not None:
                    log.write(line)
                if self.announce and (hit := next((m for m in MILESTONES if m[0] in line), None)):
                    what = hit[1] + (f" (stage {m.group(1)})" if (m := re.search(r"serving stage (\d+)", line)) else "")
                    print(f"swarm: {self.name} {what} {time.monotonic() - self.started:.1f} s after its start",
                          flush=True)
                    if hit[1] == "serving":
                        self.announce = False
                if self.name.startswith("peer") and line.startswith(("checkfree: error:", "checkfree: network error:")):
                    print(f"swarm: {self.name} gave up {time.monotonic() - self.started:.1f} s after its start: "
                          f"{line.strip()}", flush=True)  # (its one line; the rest is in its log)
                if "joined run" in line:
                    self.joined.set()
                if line.startswith(READY_PEER) and (m := re.search(r"peer_id=(\S+).*addrs=([^,\s]+)", line)):
                    self.peer_id, self.addrs = m.group(1), m.group(2)
                    self.ready.set()
                self.out.append(line.rstrip("\n"))
                self.lines.put(line.rstrip("\n"))
        finally:
            if log is not None:
                log.close()
        self.lines.put(None)
        self.ready.set()

    def wait_exit(self) -> None:
        """Until the process exits; notes when (runs in a thread)."""
        self.popen.wait()
        self.exited = time.monotonic()


def spawn(args: list[str], env: dict, *, log: Path | None = None, prefix: Sequence[str] = (), stdin=subprocess.DEVNULL,
          name: str = "", link: int = 0, announce: bool = False, zygote: Zygote | None = None) -> Proc:
    """Start `[prefix...] python -m checkfree ARGS` in a session of its own; its output lines are queued (and
    written to `log`). With `zygote`, forked from that fork server where it can be (the server's env, no prefix
    or netlab's `ip netns exec NAME`: swarm/zygote.py), else with Popen."""
    popen: subprocess.Popen | ZygoteProcess | None = None
    if zygote is not None:
        popen = zygote.popen(args, env, stdin=stdin, prefix=prefix)
    if popen is None:
        popen = subprocess.Popen([*prefix, sys.executable, "-m", "checkfree", *args], stdin=stdin,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                 start_new_session=True)
    proc = Proc(popen, log=log, name=name, link=link, announce=announce)
    threading.Thread(target=proc.read, daemon=True).start()
    threading.Thread(target=proc.wait_exit, daemon=True).start()
    return proc


def await_line(proc: Proc, prefix: str, timeout: float) -> str:
    """The first output line starting with `prefix`: RuntimeError if the process exits first, TimeoutError
    after `timeout` s."""
    where = f"; see {proc.log}" if proc.log else f":\n{proc.tail()}"
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = proc.lines.get(timeout=max(0.01, left))
        except queue.Empty:
            break
        if line is None:
            raise RuntimeError(f"process exited ({proc.popen.wait()}) before printing {prefix!r}{where}")
        if line.startswith(prefix):
            return line
    raise TimeoutError(f"no {prefix!r} line within {timeout:g} s{where}")


def kill_group(proc: Proc, gone_within: float = 10.0) -> None:
    """SIGKILL the process group (the process, its DHT child and its p2pd) and wait until it is gone; then remove
    the hivemind socket files it held, which a SIGKILLed p2pd and client cannot remove themselves (4 were left in
    /tmp by each module of tests/test_hostile_input.py)."""
    from checkfree.net.lifeline import held_socket_files, process_group, process_tree

    # the group's processes, also when its leader has exited already (a SIGTERMed peer whose p2pd lives on)
    family = process_group(proc.popen.pid) | (process_tree(proc.popen.pid) if proc.popen.poll() is None else set())
    sockets = held_socket_files(family)
    try:
        os.killpg(proc.popen.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.popen.wait(timeout=30)
    deadline = time.monotonic() + gone_within
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.popen.pid, 0)
        except (ProcessLookupError, PermissionError):
            break
        time.sleep(0.05)
    for path in sockets:
        with contextlib.suppress(OSError):
            os.unlink(path)
