"""Helpers of the swarm integration tests: `checkfree local` / `checkfree simulate` as subprocesses
(real processes, real network on loopback), failure traces, and run-directory readers."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from checkfree.rundir import read_jsonl


def local(tmp_path: Path, name: str, *args: str, cache: str, spares: int = 2,
          timeout: float = 360) -> tuple[subprocess.CompletedProcess, Path]:
    """Run `checkfree local` into tmp_path/name; returns the finished process and the run directory."""
    out = tmp_path / name
    env = {**os.environ, "CHECKFREE_CACHE": cache}
    failures = {"--trace", "--failure-rate", "--hourly-failure-rate", "--config", "--resume"}
    churn = [] if failures & set(args) else ["--no-churn"]  # no failures asked for: none (not the demo churn)
    proc = subprocess.run([sys.executable, "-m", "checkfree", "local", "--out", str(out), "--no-progress",
                           "--spares", str(spares), *churn, *args], capture_output=True, text=True, timeout=timeout, env=env)
    return proc, out


def simulate(tmp_path: Path, name: str, *args: str, cache: str, timeout: float = 300) -> list[dict]:
    """Run `checkfree simulate` into tmp_path/name; returns its metrics lines."""
    out = tmp_path / name
    sim = subprocess.run([sys.executable, "-m", "checkfree", "simulate", "--out", str(out), "--no-progress", *args],
                         capture_output=True, text=True, timeout=timeout, env={**os.environ, "CHECKFREE_CACHE": cache})
    assert sim.returncode == 0, sim.stderr[-2000:]
    return read_jsonl(out / "metrics.jsonl")


def trace(tmp_path: Path, lines: list[tuple[int, int]]) -> str:
    """A `step,stage` trace file of these failures."""
    p = tmp_path / f"trace-{len(lines)}-{lines[0][0]}-{lines[0][1]}.csv"
    p.write_text("step,stage\n" + "".join(f"{a},{b}\n" for a, b in lines))
    return str(p)


def events(out: Path, *kinds: str) -> list[dict]:
    """The run's events of these kinds, in order."""
    return [e for e in read_jsonl(out / "events.jsonl") if e["event"] in kinds]


@dataclass
class Proc:
    popen: subprocess.Popen
    lines: queue.Queue = field(default_factory=queue.Queue)
    out: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    exited: float | None = None  # time.monotonic() when the process exited

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.out[-n:])


def spawn(args: list[str], env: dict) -> Proc:
    """Start `python -m checkfree ARGS` in a session of its own; its output lines are queued."""
    popen = subprocess.Popen([sys.executable, "-m", "checkfree", *args], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    proc = Proc(popen)

    def read() -> None:
        for line in popen.stdout:
            proc.out.append(line.rstrip("\n"))
            proc.lines.put(line.rstrip("\n"))
        proc.lines.put(None)

    def wait() -> None:
        popen.wait()
        proc.exited = time.monotonic()

    threading.Thread(target=read, daemon=True).start()
    threading.Thread(target=wait, daemon=True).start()
    return proc


def await_line(proc: Proc, prefix: str, timeout: float) -> str:
    """The first output line starting with `prefix` (an error if the process exits or time runs out)."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = proc.lines.get(timeout=left)
        except queue.Empty:
            break
        if line is None:
            raise RuntimeError(f"process exited ({proc.popen.wait()}) before printing {prefix!r}:\n{proc.tail()}")
        if line.startswith(prefix):
            return line
    raise TimeoutError(f"no {prefix!r} line within {timeout:g} s:\n{proc.tail()}")


def kill_group(proc: Proc) -> None:
    """SIGKILL the process group (the process, its DHT child and its p2pd) and wait until it is gone."""
    try:
        os.killpg(proc.popen.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.popen.wait(timeout=30)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.popen.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
