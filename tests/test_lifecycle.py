"""How processes really stop: a coordinator SIGKILLed with nobody to take over, SIGTERM to
`checkfree local` and `--resume`, `kill -9` of a standalone peer, and the run directory's
summary on every exit path. Real processes, real signals; nothing may be left behind."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import signal
import subprocess
import sys
import time

import pytest
from swarmrun import await_line, kill_group, simulate, spawn, trace

from checkfree.config import preset
from checkfree.net.lifeline import held_socket_files, outliving, process_tree
from checkfree.protocol import (
    EXIT_COORDINATOR_GONE,
    READY_COORDINATOR,
    READY_PEER,
    ProtocolError,
)
from checkfree.rundir import RunWriter, read_jsonl

FAST = ["--heartbeat-ttl", "2", "--rpc-timeout", "5", "--step-timeout", "30", "--join-timeout", "120"]


@pytest.fixture(scope="module")
def cache(session_cache):
    return session_cache


def _env(cache: str) -> dict:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "CHECKFREE_CACHE": cache}


def _wait_gone(pids: set[int], timeout: float) -> float:
    """Seconds until every one of `pids` is gone (fails after `timeout`)."""
    t0 = time.monotonic()
    left = outliving(pids, timeout)
    assert not left, f"still alive after {timeout:g} s: {sorted(left)}"
    return time.monotonic() - t0


@pytest.mark.timeout(240)
def test_peers_leave_when_their_coordinator_is_gone_and_leave_nothing_behind(tmp_path, cache):
    """Coordinator SIGKILLed (with its DHT process and p2pd) and no standby: every peer, its DHT
    process and its p2pd are gone within --coordinator-timeout + 30 s, with exit code 4 and a
    one-line reason; none of their socket files remains."""
    env = _env(cache)
    coord = spawn(["scheduler", "--run-id", "orphans", "--steps", "100000", "--eval-every", "0", "--out",
                   str(tmp_path / "run"), *FAST], env)
    peers, coord_sockets = [], set()
    try:
        addr = await_line(coord, READY_COORDINATOR, 120).split("addrs=")[1].split(",")[0].split()[0]
        peers = [spawn(["peer", "--run-id", "orphans", "--initial-peers", addr, "--coordinator-timeout", "10",
                        "--threads", "1", *FAST], env) for _ in range(4)]
        for p in peers:
            await_line(p, READY_PEER, 120)
        await_line(coord, "step 2:", 180)
        family = set().union(*(process_tree(p.popen.pid) for p in peers))
        assert len(family) >= 4 * 3  # each peer with its DHT process and p2pd at least
        peer_sockets = held_socket_files(family)
        assert peer_sockets
        coord_sockets = held_socket_files(process_tree(coord.popen.pid))
        kill_group(coord)
        t0 = time.monotonic()
        gone_s = _wait_gone(family, 10 + 30)
        for p in peers:
            assert p.popen.wait(timeout=10) == EXIT_COORDINATOR_GONE, p.tail()
            assert any("no coordinator of run 'orphans' has answered" in line for line in p.out), p.tail()
        assert not [s for s in peer_sockets if os.path.exists(s)]
        print(f"peers and their children gone {gone_s:.1f} s ({time.monotonic() - t0:.1f} s) after the kill")
    finally:
        for p in peers:
            kill_group(p)
        kill_group(coord)
        for s in coord_sockets:  # the SIGKILLed coordinator's own (the next start-up would sweep them)
            if os.path.exists(s):
                os.remove(s)


@pytest.mark.timeout(300)
def test_sigterm_stops_local_swarm_and_resume_continues_the_same_losses(tmp_path, cache):
    """SIGTERM to `checkfree local` mid-run: the coordinator saves the step it was at, writes
    summary.json (`interrupted`, the true step count) and tells its peers; every process is gone
    within 15 s. `--resume` then completes the run with the losses of an uninterrupted one. One spare in each run:
    the one replacement the run needs (the failure at step 18, after the resume)."""
    out = tmp_path / "run"
    env = _env(cache)
    args = ["--steps", "24", "--eval-every", "0", "--save-every", "5", "--trace", trace(tmp_path, [(18, 2)]), *FAST]
    launcher = spawn(["local", "--out", str(out), "--no-progress", "--spares", "1", *args], env)
    try:
        await_line(launcher, "swarm:", 120)
        deadline = time.monotonic() + 180
        while not (out / "metrics.jsonl").exists() or len(read_jsonl(out / "metrics.jsonl")) < 12:
            assert time.monotonic() < deadline and launcher.popen.poll() is None, launcher.tail()
            time.sleep(0.1)
        family = process_tree(launcher.popen.pid)
        launcher.popen.send_signal(signal.SIGTERM)
        assert _wait_gone(family, 15) < 15
        assert launcher.popen.wait(timeout=5) == 130
    finally:
        kill_group(launcher)
    summary = json.loads((out / "summary.json").read_text())
    recorded = read_jsonl(out / "metrics.jsonl")
    assert summary["status"] == "interrupted" and summary["steps"] == recorded[-1]["step"] + 1 >= 12
    assert "interrupted" in summary["error"] and math.isfinite(summary["final_loss"])
    assert summary["final_val_loss"] is None  # never evaluated: null, not "nan"
    saved = sorted(p.name for p in (out / "saves").iterdir())
    assert saved[-1] == f"step-{summary['steps']:08d}"  # the graceful stop saved the step it stopped at

    resumed = spawn(["local", "--resume", str(out), "--no-progress", "--spares", "1"], env)
    try:
        assert resumed.popen.wait(timeout=240) == 0, resumed.tail()
    finally:
        kill_group(resumed)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 24 and summary["failures"] == 1
    assert summary["wall_s"] > 0 and (out / "final_weights.safetensors").exists()
    last = {m["step"]: m["loss"] for m in read_jsonl(out / "metrics.jsonl")}
    reference = simulate(tmp_path, "sim", "--steps", "24", "--eval-every", "0", "--trace",
                         trace(tmp_path, [(18, 2)]), cache=cache)
    assert sorted(last) == list(range(24))
    assert [last[m["step"]] for m in reference] == pytest.approx([m["loss"] for m in reference], rel=1e-5)


@pytest.mark.timeout(120)
def test_kill_9_of_a_standalone_peer_takes_its_dht_process_and_p2pd_along(cache):
    peer = spawn(["peer", "--run-id", "alone", "--join-timeout", "300", "--step-timeout", "200"], _env(cache))
    try:
        await_line(peer, READY_PEER, 120)
        family = process_tree(peer.popen.pid)
        assert len(family) >= 3, family  # the peer, its DHT process, its p2pd
        os.kill(peer.popen.pid, signal.SIGKILL)  # the peer alone, not its process group
        assert _wait_gone(family, 10) < 10
    finally:
        kill_group(peer)


def test_kill_group_removes_the_socket_files_of_a_group_whose_leader_has_exited():
    """A teardown SIGTERMs a peer's group, and the peer may exit before its p2pd; kill_group then SIGKILLs what is
    left of the group, and the socket files the rest held must go with it. It looked for them only under a live
    leader, whose process tree no longer holds its reparented children (a p2pd socket file left by each
    `checkfree chaos` test run)."""
    import uuid

    from checkfree.net.lifeline import process_group
    from swarm.processes import Proc

    path = f"/tmp/hivemind-p2pd-test-{uuid.uuid4().hex[:12]}.sock"
    child = ("import socket, sys, threading; s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); s.listen(); "
             "print('listening', flush=True); threading.Event().wait()")
    leader = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys; c = subprocess.Popen([sys.executable, '-c', sys.argv[1], "
         "sys.argv[2]], stdout=subprocess.PIPE, text=True); print(c.stdout.readline(), end='', flush=True)",
         child, path], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert leader.stdout.readline() == "listening\n"
        leader.wait(timeout=30)
        orphans = process_group(leader.pid) - {leader.pid}
        assert orphans and not orphans & process_tree(leader.pid), "the child lives on, outside its leader's tree"
        kill_group(Proc(leader), gone_within=10)
        assert not os.path.exists(path) and not process_group(leader.pid)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(leader.pid, signal.SIGKILL)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        leader.stdout.close()


def test_simulate_stop_and_resume_is_bitwise_equal(tmp_path):
    """The simulator's --save-every/--resume: a run stopped after a save and resumed has the losses
    of the uninterrupted run, bit for bit (batches are a pure function of the step)."""
    from checkfree.simulator import Simulator

    cfg = preset("tiny")
    cfg.train.num_steps, cfg.train.eval_every = 12, 6
    full = Simulator(cfg, tmp_path / "full", progress=False).run()
    stopped = Simulator(cfg, tmp_path / "part", progress=False, save_every=4)
    real = stopped.train_step

    def stop_at_7(step):  # a signal arriving during step 7: the run stops after it, saving step 8
        if step == 7:
            stopped.stop_signal = "SIGTERM"
        return real(step)

    stopped.train_step = stop_at_7
    with pytest.raises(KeyboardInterrupt):
        stopped.run()
    part = json.loads((tmp_path / "part" / "summary.json").read_text())
    assert part["status"] == "interrupted" and part["steps"] == 8 and "SIGTERM" in part["error"]
    assert sorted(p.name for p in (tmp_path / "part" / "saves").iterdir()) == ["step-00000004", "step-00000008"]
    resumed = Simulator(cfg, tmp_path / "part", progress=False, save_every=4, resume=True).run()
    assert resumed["status"] == "completed" and resumed["steps"] == 12
    a = [m["loss"] for m in read_jsonl(tmp_path / "full" / "metrics.jsonl")]
    b = [m["loss"] for m in read_jsonl(tmp_path / "part" / "metrics.jsonl")]
    assert a == b and resumed["final_val_loss"] == full["final_val_loss"]
    assert (tmp_path / "part" / "final_weights.safetensors").exists()
    with pytest.raises(FileNotFoundError, match="no complete save"):
        Simulator(cfg, tmp_path / "empty", progress=False, resume=True)


def test_summary_tells_the_truth_when_a_run_aborts_or_fails(tmp_path, cache):
    """Aborted (adjacent failure, --fallback abort) and failed (a bug mid-run) runs report the
    steps they completed, the last finite losses (null, never "nan"), an error and the counts."""
    from checkfree.recovery import UnrecoverableFailure
    from checkfree.simulator import Simulator

    cfg = preset("tiny")
    cfg.train.num_steps, cfg.train.eval_every = 10, 3
    cfg.failures.trace = trace(tmp_path, [(5, 1), (5, 2)])
    with pytest.raises(UnrecoverableFailure):
        Simulator(cfg, tmp_path / "abort", progress=False).run()
    s = json.loads((tmp_path / "abort" / "summary.json").read_text())
    assert s["status"] == "aborted" and s["steps"] == 5 and "adjacent" in s["error"]
    assert math.isfinite(s["final_loss"]) and math.isfinite(s["final_val_loss"]) and s["failures"] == 2

    cfg.failures.trace = None
    sim = Simulator(cfg, tmp_path / "failed", progress=False)
    real = sim.train_step

    def broken(step):
        if step == 4:
            raise RuntimeError("disk on fire")
        return real(step)

    sim.train_step = broken
    with pytest.raises(RuntimeError):
        sim.run()
    s = json.loads((tmp_path / "failed" / "summary.json").read_text())
    assert s["status"] == "failed" and s["steps"] == 4 and s["error"] == "RuntimeError: disk on fire"
    assert math.isfinite(s["final_loss"])
    metrics = read_jsonl(tmp_path / "failed" / "metrics.jsonl")
    assert all(isinstance(m["time"], float) and m["tokens_per_s"] > 0 for m in metrics)


def test_run_writer_summary_nulls_and_resume_clock(tmp_path):
    w = RunWriter(tmp_path, "{}", tokens_per_step=1000)
    w.metric({"step": 0, "loss": float("nan"), "step_time_s": 0.5})
    s = w.summary("interrupted")
    assert s["final_loss"] is None and s["steps"] == 1 and s["error"] == "run interrupted"
    assert json.loads((tmp_path / "summary.json").read_text())["final_loss"] is None
    w.close()
    w.event("join", peer_id="late")  # a late event after the run ended is dropped, not a crash
    started = w.started
    again = RunWriter(tmp_path, "{}", resume=True)  # a coordinator taking over keeps the run's clock
    assert again.started == started and again.steps == 1
    again.close()


def test_late_join_is_refused_with_a_clear_reason(tmp_path):
    """A JOIN after the run ended gets a `run over` refusal; the handler does not touch the closed
    run directory (it used to crash with `I/O operation on closed file`)."""
    from coordinator.coordinator import Coordinator, CoordinatorOptions

    cfg = preset("tiny")
    coord = Coordinator(cfg, CoordinatorOptions(run_id="r", out=str(tmp_path)))
    coord.out.open(cfg, resume=False)
    coord.out.close("completed", None)
    coord.members.end("completed")
    with pytest.raises(ProtocolError, match="run over: run 'r' has ended"):
        asyncio.run(coord.members.on_join({"run": "r", "peer_id": "p"}, [], "p"))


def test_refusal_log_is_rate_limited(caplog):
    from checkfree.net.transport import RefusalLog

    log = RefusalLog(per_window=3, window_s=60)
    with caplog.at_level(logging.WARNING):
        for i in range(1000):
            log.warn("refused %d", i)
    assert [r.getMessage() for r in caplog.records] == ["refused 0", "refused 1", "refused 2"]
    log._start -= 61  # the next window says how many were dropped
    with caplog.at_level(logging.WARNING):
        log.warn("refused again")
    assert "997 similar refusal line(s) suppressed" in caplog.records[-2].getMessage()


def test_a_process_gone_mid_fd_handoff_is_a_debug_line_not_a_traceback(monkeypatch, capsys):
    """hivemind passes shared-memory futures to its DHT process; their descriptors go through
    multiprocessing's resource sharer. A DHT child killed mid-handshake (a signalled group) made the
    sharer's thread print a traceback: now a debug line. Other exceptions still reach the old hook."""
    import socket
    import threading
    from multiprocessing import resource_sharer

    from checkfree.net import lifeline

    seen = []
    monkeypatch.setattr(lifeline.sys, "excepthook", lambda *exc: seen.append(exc[0]))
    lifeline.quiet_fd_handoffs()
    handled = threading.Event()
    monkeypatch.setattr(lifeline.log, "debug", lambda *a: handled.set())
    r, w = os.pipe()
    try:
        handoff = resource_sharer.DupFd(r)  # starts the sharer's listener, as hivemind's futures do
        with socket.socket(socket.AF_UNIX) as s:  # a receiver that connects, then dies
            s.connect(resource_sharer._resource_sharer._address)
        assert handled.wait(10), "the sharer never reported the disconnect"
        assert seen == []
        try:
            raise ValueError("a real bug")
        except ValueError:
            lifeline.sys.excepthook(*lifeline.sys.exc_info())
        assert seen == [ValueError]
        del handoff
    finally:
        os.close(r)
        os.close(w)


def test_a_stream_handler_cancelled_at_shutdown_is_a_debug_line_not_a_traceback(caplog):
    """A peer told to shut down while a RUN_STEP handler waits for its step cancels the handler; asyncio's stream
    callback then asks the cancelled task for its exception and logged `Exception in callback` with a traceback
    (a healed partitioned replica's log, at the end of every such run). Now a debug line; other callbacks'
    errors, a cancellation among them, are still logged."""
    from checkfree.net.streams import quiet_disconnects

    loop = asyncio.new_event_loop()
    try:
        quiet_disconnects(loop)
        with caplog.at_level(logging.DEBUG, logger="asyncio"):
            loop.call_exception_handler({"message": "Exception in callback StreamReaderProtocol.connection_made."
                                                    "<locals>.callback(<Task cancelled>)",
                                         "exception": asyncio.CancelledError()})
            assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
            loop.call_exception_handler({"message": "Exception in callback something_else()",
                                         "exception": asyncio.CancelledError()})
            assert [r for r in caplog.records if r.levelno >= logging.ERROR]
    finally:
        loop.close()


@pytest.mark.timeout(240)
def test_a_sigkilled_process_leaves_a_pymp_directory_that_the_next_start_removes(tmp_path, cache):
    """What left 75 `pymp-*` directories in the temporary directory after a test round: every process with a
    hivemind DHT hands file descriptors through multiprocessing's resource sharer, whose listener socket lives in
    a `pymp-*` directory only an exit handler removes, so each SIGKILLed peer, coordinator or DHT process left
    one. The sweep (run by every start_transport, and by `checkfree local`'s teardown through its own temporary
    directory) removes a dead process's directory and leaves a live one's alone."""
    from checkfree.net.lifeline import sweep_stale_mp_dirs

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**_env(cache), "TMPDIR": str(tmp)}
    script = ("import asyncio, time\nfrom checkfree.net.transport import start_transport\n"
              "async def main():\n    await start_transport(transport='hivemind')\n    print('READY', flush=True)\n"
              "    time.sleep(600)\nasyncio.run(main())\n")
    procs, sockets = [], set()
    try:
        for _ in range(2):
            p = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True,
                                 start_new_session=True)
            procs.append(p)
            assert p.stdout.readline().strip() == "READY"
        # hivemind's socket files (in /tmp whatever TMPDIR says), which the SIGKILLs below leave: removed at the end
        sockets = held_socket_files({q for p in procs for q in process_tree(p.pid)})
        dirs = {d.name for d in tmp.glob("pymp-*")}
        assert len(dirs) == 2, sorted(os.listdir(tmp))
        os.killpg(procs[0].pid, signal.SIGKILL)
        procs[0].wait(timeout=30)
        _wait_gone(process_tree(procs[0].pid), 30)
        assert {d.name for d in tmp.glob("pymp-*")} == dirs  # nothing removed it
        assert sweep_stale_mp_dirs(str(tmp), min_age_s=0) == 1
        left = {d.name for d in tmp.glob("pymp-*")}
        assert len(left) == 1 and left < dirs  # the live process keeps its own
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
        for path in sockets:
            with contextlib.suppress(OSError):
                os.unlink(path)
