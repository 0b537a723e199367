"""The local swarm's teardown ends when its processes are gone, not after fixed budgets: the launcher stops
following the coordinator once it has exited (not once a child of its lets its output end), waits for peers the
coordinator told to exit instead of SIGTERMing them, and SIGTERMs the others at once. Stand-in processes (sh)
play the coordinator and peers: the same pipes, sessions and signals, a second instead of a swarm's minute."""

from __future__ import annotations

import atexit
import gc
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import cli.main
from swarm.launcher import PEER_EXIT_S, LocalSwarm, SwarmOptions
from swarm.processes import Proc


def _proc(script: str, name: str) -> Proc:
    """`sh -c SCRIPT` in a session of its own, its output read like a swarm process's (swarm.processes)."""
    popen = subprocess.Popen(["sh", "-c", script], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
    proc = Proc(popen, name=name)
    threading.Thread(target=proc.read, daemon=True).start()
    threading.Thread(target=proc.wait_exit, daemon=True).start()
    return proc


def _swarm(tmp_path: Path) -> LocalSwarm:
    return LocalSwarm(tmp_path / "swarm_config.json", tmp_path / "chaos_trace.csv",
                      SwarmOptions(out=tmp_path / "run", run_id="teardown", progress=False))


def _gone(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_teardown_ends_when_the_processes_are_gone_not_after_fixed_budgets(tmp_path):
    swarm = _swarm(tmp_path)
    # the coordinator: its last lines, then it exits while a child of its (as torch's shared-memory manager
    # does) holds its output open for 30 s more
    swarm.coordinator = _proc("echo 'step 0: loss 1'; echo summary; sleep 30 & exit 0", "coordinator")
    # a peer told to exit (its line), gone 0.5 s later by itself; it must not be SIGTERMed (rc 143 if it were)
    told = _proc("trap 'exit 143' TERM; echo 'run finished (run completed); exiting'; sleep 0.5; exit 0", "peer1")
    spare = _proc("sleep 30", "peer2")  # a peer nobody told (one still starting): SIGTERMed at once
    swarm.peers = [told, spare]
    deadline = time.monotonic() + 10
    while not any("exiting" in line for line in list(told.out)) and time.monotonic() < deadline:
        time.sleep(0.01)  # (its line read: what the teardown goes by)
    t0 = time.monotonic()
    lines = []
    while (line := swarm._next_line()) is not None:
        lines.append(line)
    followed = time.monotonic() - t0
    assert lines == ["step 0: loss 1", "summary"]
    assert followed < 3.0, f"following the coordinator took {followed:.1f} s after it exited (not its output's end)"
    t0 = time.monotonic()
    swarm.teardown()
    took = time.monotonic() - t0
    assert told.popen.returncode == 0, "the peer told to exit was SIGTERMed instead of waited for"
    assert spare.popen.returncode == -signal.SIGTERM
    assert took < PEER_EXIT_S, f"teardown took {took:.1f} s with every process gone within 1 s"
    assert all(_gone(p.popen.pid) for p in [swarm.coordinator, told, spare]), "a process group outlived teardown"
    assert not swarm.tmp.exists()


def test_processes_run_from_the_command_line_skip_the_final_garbage_collections(monkeypatch):
    registered = []
    monkeypatch.setattr(cli.main, "_EXIT_HOOKED", False)
    monkeypatch.setattr(atexit, "register", registered.append)
    cli.main._freeze_at_exit()
    cli.main._freeze_at_exit()  # (main() run again in the same process: registered once)
    assert registered == [gc.freeze]
