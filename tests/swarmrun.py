"""Helpers of the swarm integration tests: `checkfree local` / `checkfree simulate` as subprocesses (real processes,
real network on loopback; forked from a fork server per env and test module), failure traces, and run-directory
readers."""

from __future__ import annotations

import os
import queue
import subprocess
import time
from pathlib import Path

from checkfree.rundir import read_jsonl
from swarm.processes import Proc, await_line, kill_group
from swarm.processes import spawn as _spawn
from swarm.zygote import Zygote, enabled

__all__ = ["run", "local", "simulate", "trace", "events", "Proc", "spawn", "await_line", "kill_group",
           "close_fork_servers"]

_FORK_SERVERS: dict[frozenset, Zygote] = {}  # env -> the fork server of the spawns with that env


def spawn(args: list[str], env: dict) -> Proc:
    """Start `python -m checkfree ARGS` in a session of its own; its output lines are queued (swarm.processes, the
    launcher's own helper). Forked, as the launcher's, from a fork server (swarm/zygote.py) that the first spawn
    with this exact env starts; conftest.py closes them at the end of each test module (`close_fork_servers`)."""
    return _spawn(args, env, zygote=_fork_server(env))


def _fork_server(env: dict) -> Zygote | None:
    if not enabled(env):
        return None
    key = frozenset(env.items())
    server = _FORK_SERVERS.get(key)
    if server is None or server.dead:
        if server is not None:
            server.close()
        server = _FORK_SERVERS[key] = Zygote(env)
    return server


def close_fork_servers() -> None:
    """Stop the fork servers `spawn` started (their children, if any still run, are not signalled)."""
    while _FORK_SERVERS:
        _FORK_SERVERS.popitem()[1].close()


def run(args: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    """`python -m checkfree ARGS` to its end, as `subprocess.run(..., capture_output=True, text=True)` would, but
    forked from the module's fork server (`spawn`): a fresh interpreter spends 4-6 s of CPU importing torch and the
    runtime first. Its stdout and stderr come in one pipe: `stdout` holds both, in order, and `stderr` is empty.
    Past `timeout` s its process group is killed and subprocess.TimeoutExpired raised, as subprocess.run does."""
    proc = spawn(args, env)
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        while (line := proc.lines.get(timeout=max(0.01, deadline - time.monotonic()))) is not None:
            lines.append(line + "\n")
        code = proc.popen.wait(timeout=max(0.01, deadline - time.monotonic()))
    except (queue.Empty, subprocess.TimeoutExpired):
        kill_group(proc)
        raise subprocess.TimeoutExpired(args, timeout, "".join(lines)) from None
    return subprocess.CompletedProcess(args, code, "".join(lines), "")


def local(tmp_path: Path, name: str, *args: str, cache: str, spares: int = 2,
          timeout: float = 360) -> tuple[subprocess.CompletedProcess, Path]:
    """Run `checkfree local` into tmp_path/name (forked: `run`); returns the finished process (stdout and stderr
    in its stdout) and the run directory."""
    out = tmp_path / name
    env = {**os.environ, "CHECKFREE_CACHE": cache}
    failures = {"--trace", "--failure-rate", "--hourly-failure-rate", "--config", "--resume"}
    churn = [] if failures & set(args) else ["--no-churn"]  # no failures asked for: none (not the demo churn)
    proc = run(["local", "--out", str(out), "--no-progress", "--spares", str(spares), *churn, *args], env, timeout)
    return proc, out


def simulate(tmp_path: Path, name: str, *args: str, cache: str, timeout: float = 300) -> list[dict]:
    """Run `checkfree simulate` into tmp_path/name (forked: `run`); returns its metrics lines."""
    out = tmp_path / name
    sim = run(["simulate", "--out", str(out), "--no-progress", *args], {**os.environ, "CHECKFREE_CACHE": cache},
              timeout)
    assert sim.returncode == 0, sim.stdout[-2000:]
    return read_jsonl(out / "metrics.jsonl")


def trace(tmp_path: Path, lines: list[tuple[int, int]]) -> str:
    """A `step,stage` trace file of these failures."""
    p = tmp_path / f"trace-{len(lines)}-{lines[0][0]}-{lines[0][1]}.csv"
    p.write_text("step,stage\n" + "".join(f"{a},{b}\n" for a, b in lines))
    return str(p)


def events(out: Path, *kinds: str) -> list[dict]:
    """The run's events of these kinds, in order."""
    return [e for e in read_jsonl(out / "events.jsonl") if e["event"] in kinds]
