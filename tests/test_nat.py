"""Peers behind NAT and machines that vanish whole, on emulated hosts (`checkfree local --hosts`): every process in
a network namespace of its own, NAT'd ones behind a router namespace that masquerades their connections and lets
nothing in. The coordinator probes each joining peer and relays requests for those it cannot reach
(checkfree/net/relay.py). Each real run must end with the simulator's losses given the failure the run recorded;
with relays off, a NAT'd peer is told why in one line, within the join timeout, and nothing is left behind."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from checkfree.net.lifeline import socket_files
from checkfree.net.relay import probe_addresses, unreachable_message
from checkfree.rundir import read_jsonl
from swarm.netlab import NetLab
from swarmrun import events, simulate, trace

TIMEOUTS = ["--heartbeat-ttl", "2", "--rpc-timeout", "5", "--step-timeout", "15"]
NAT_MISSING = NetLab.nat_unavailable()


@pytest.fixture(scope="module")
def cache(session_cache):
    return session_cache


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


# --- the probe (no processes) ------------------------------------------------------------------------------------

def test_probe_tells_an_open_port_from_a_closed_one():
    async def run() -> dict:
        server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
        open_port = server.sockets[0].getsockname()[1]
        closed = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
        closed_port = closed.sockets[0].getsockname()[1]
        closed.close()
        await closed.wait_closed()
        try:
            return await probe_addresses([f"/ip4/127.0.0.1/tcp/{open_port}/p2p/Qm1",
                                          f"/ip4/127.0.0.1/tcp/{closed_port}/p2p/Qm2", "/unix/tmp/x.sock"], timeout=2)
        finally:
            server.close()
            await server.wait_closed()

    result = asyncio.run(run())
    assert len(result["tried"]) == 2 and result["reachable"] == [result["tried"][0]]
    assert result["rtt_ms"][result["tried"][0]] >= 0
    assert "ConnectionRefusedError" in result["errors"][result["tried"][1]]


def test_probe_tries_loopback_only_when_there_is_nothing_else():
    async def run() -> dict:  # 192.0.2.0/24 is TEST-NET-1: nothing answers there (no route from here, or a timeout)
        return await probe_addresses(["/ip4/127.0.0.1/tcp/9/p2p/Qm1", "/ip4/192.0.2.1/tcp/9/p2p/Qm1"], timeout=0.5)

    result = asyncio.run(run())
    assert result["tried"] == ["/ip4/192.0.2.1/tcp/9/p2p/Qm1"] and not result["reachable"]


def test_the_unreachable_line_names_nat_and_the_flag():
    line = unreachable_message(["/ip4/10.0.0.2/tcp/1"], {"/ip4/10.0.0.2/tcp/1": "OSError Network is unreachable"},
                               "12D3Koo")
    assert "\n" not in line and "NAT" in line and "--no-relay" in line and "Network is unreachable" in line


def test_a_relayed_call_reaches_the_peer_as_the_callers_and_nothing_else_gets_through():
    """Three processes on the in-process network: B registers with relay R and publishes its route (signed with the
    run secret); A's call to B goes through R, B's handler sees A as the caller, B's error comes back to A as it
    was. A relayed request from anyone but B's relay is refused, R forwards only to peers registered with it, and
    a route record not signed with the secret is ignored (A then calls B directly)."""
    from checkfree.auth import sign_record
    from checkfree.net.errors import RemoteError
    from checkfree.net.in_memory import MemoryDHT, MemoryNetwork, MemoryTransport
    from checkfree.net.relay import RELAY, RELAYED, RelayTransport, route_key

    secret = b"0123456789abcdef-secret"

    async def run() -> None:
        net = MemoryNetwork()
        a, r, b, c = [await RelayTransport(MemoryTransport(net), serve_relay=serve).start()
                      for serve in (False, True, False, False)]
        dht = MemoryDHT(net, b.peer_id)
        for t in (a, r, b, c):
            t.route(dht, "run", secret)

        async def who(header, tensors, peer):
            if header.get("fail"):
                raise ValueError("bad input")
            return {"caller": str(peer)}, [x * 2 for x in tensors]

        await b.register("who", who)
        await b.use_relay(r.peer_id, dht, "run", secret, timeout=5)
        import torch

        reply, out = await a.call(b.peer_id, "who", {}, [torch.ones(3)], timeout=5)
        assert reply["caller"] == a.peer_id and out[0].tolist() == [2.0, 2.0, 2.0]
        assert (a.relayed_calls, r.forwarded) == (1, 1)
        reply, _ = await r.call(b.peer_id, "who", {}, timeout=5)  # the relay itself calls direct
        assert reply["caller"] == r.peer_id and r.forwarded == 1
        with pytest.raises(RemoteError) as e:
            await a.call(b.peer_id, "who", {"fail": True}, timeout=5)
        assert e.value.kind == "bad_request" and "bad input" in e.value.remote_message
        with pytest.raises(RemoteError, match="not a relay this peer registered with"):  # A poses as a relay
            await a.inner.call(b.peer_id, RELAYED, {"from": r.peer_id, "name": "who", "header": {}}, timeout=5)
        with pytest.raises(RemoteError, match="not registered with this relay"):
            await a.inner.call(r.peer_id, RELAY, {"to": c.peer_id, "name": "who", "header": {}, "timeout": 5},
                               timeout=5)
        # a route written without the secret (a stranger's) is not followed
        await c.register("who", who)
        dht.store(route_key("run"), sign_record(b"another-secret-0123456", "run", "route", c.peer_id,
                                                {"via": r.peer_id}, 30), expiration_time=time.time() + 30,
                  subkey=c.peer_id)
        reply, _ = await a.call(c.peer_id, "who", {}, timeout=5)
        assert reply["caller"] == a.peer_id and a.relayed_calls == 2  # the error's call was relayed; this one not
        # a relay that admits members only refuses a stranger's registration
        def members_only(header, peer):
            if header.get("token") != "member":
                raise ValueError(f"peer {peer} is not authorized")

        r.admit = members_only
        with pytest.raises(RemoteError, match="not authorized"):
            await c.use_relay(r.peer_id, dht, "run", secret, timeout=5)
        await b.shutdown()

    asyncio.run(run())


# --- real swarms on emulated hosts ---------------------------------------------------------------------------------

class Run:
    """`checkfree local` in the background, its output lines followed as they come."""

    def __init__(self, out: Path, cache: str, *args: str) -> None:
        self.out, self.lines, self.started = out, [], time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "checkfree", "local", "--out", str(out), "--no-progress", "--no-dashboard",
             "--no-churn", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "CHECKFREE_CACHE": cache})
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic() - self.started, line.rstrip("\n")))

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:  # the launcher tears its swarm down on SIGTERM
                self.proc.terminate()
                self.proc.wait(30)
            self.reader.join(10)

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def hosts(self) -> dict[str, tuple[str, bool]]:
        """peerN -> (its host namespace, behind NAT)."""
        found = {}
        for _, line in self.lines:
            if m := re.match(r"swarm: (peer\d+) on emulated host (\S+), (behind NAT|public)", line):
                found[m.group(1)] = (m.group(2), m.group(3) == "behind NAT")
        return found

    def serving(self) -> dict[str, int]:
        return {m.group(1): int(m.group(2)) for _, line in self.lines
                if (m := re.match(r"swarm: (peer\d+) serving \(stage (\d+)\)", line))}

    def steps_done(self) -> int:
        path = self.out / "metrics.jsonl"
        return len(read_jsonl(path)) if path.exists() else 0


def _kill_host(ns: str) -> int:
    """SIGKILL every process on the emulated host `ns` at once."""
    pids = [int(x) for x in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True,
                                           timeout=30).stdout.split()]
    for pid in pids:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
    return len(pids)


def _run_and_lose_a_host(tmp_path: Path, cache: str, shape: list[str], spares: int, nat: int, kill_nat: bool,
                         at_step: int) -> tuple[Run, dict]:
    """A run on emulated hosts; once `at_step` steps are recorded, every process of one host serving an intermediate
    stage (behind NAT if `kill_nat`) is SIGKILLed at once. Returns the run and the host lost."""
    spaces, sockets = _namespaces(), socket_files()
    run = Run(tmp_path / "swarm", cache, *shape, *TIMEOUTS, "--join-timeout", "120", "--spares", str(spares),
              "--hosts", "--nat-peers", str(nat), "--chaos-slow", "0:0.15@0")
    lost = {}
    try:
        deadline = time.monotonic() + 240
        while run.steps_done() < at_step:
            assert run.proc.poll() is None, run.text()[-3000:]
            assert time.monotonic() < deadline, "the run did not reach the step of the host loss\n" + run.text()[-3000:]
            time.sleep(0.2)
        hosts, serving = run.hosts(), run.serving()
        last = max(serving.values())
        name = next((p for p, stage in sorted(serving.items(), key=lambda x: x[1])
                     if 0 < stage < last and hosts[p][1] is kill_nat), None)
        assert name is not None, f"no {'NAT' if kill_nat else 'public'}'d host serves an intermediate stage: {serving}"
        lost = {"peer": name, "stage": serving[name], "host": hosts[name][0], "nat": hosts[name][1],
                "processes": _kill_host(hosts[name][0])}
        assert run.wait(300) == 0, run.text()[-4000:]
    finally:
        if run.proc.poll() is None:
            run.wait(1)
    assert not {n for n in _namespaces() - spaces if n.startswith("cf")}, "the launcher left namespaces behind"
    left = {s for s in socket_files() - sockets if os.path.exists(s)}
    assert not left, f"socket files left behind: {left}"
    return run, lost


def _same_as_simulator(tmp_path: Path, cache: str, run: Run, shape: list[str], lost: dict) -> None:
    out = run.out
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["failures"] == 1 and summary["recoveries"] == 1
    (fail,) = events(out, "failure")
    assert fail["stage"] == lost["stage"]
    ref = simulate(tmp_path, "sim", *shape, "--trace", trace(tmp_path, [(fail["step"], fail["stage"])]), cache=cache)
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [m["step"] for m in ref]
    assert [m["loss"] for m in metrics] == pytest.approx([m["loss"] for m in ref], rel=1e-5, abs=1e-5)


@pytest.mark.timeout(480)
@pytest.mark.skipif(NAT_MISSING is not None, reason=f"no emulated NAT: {NAT_MISSING}")
def test_eight_hosts_two_behind_nat_train_and_lose_a_natd_host_whole(tmp_path, cache):
    """Eight emulated hosts: the coordinator and S = 4 + 3 spare peers, two of them behind MASQUERADE NAT, default
    relay settings, every link shaped to the paper-geo profile's slowest (tc tbf) with its delays per stage pair.
    The coordinator cannot connect to the NAT'd peers and relays their requests; the run trains 20 steps, loses a
    whole NAT'd host serving a stage (peer, DHT process and p2pd SIGKILLed at once) mid-run, recovers, and its
    losses are the simulator's for that failure."""
    shape = ["--stages", "4", "--steps", "20", "--eval-every", "0"]
    run, lost = _run_and_lose_a_host(tmp_path, cache, [*shape, "--wan", "paper-geo"], spares=3, nat=2,
                                     kill_nat=True, at_step=6)
    text = run.text()
    assert len(run.hosts()) == 7 and sum(nat for _, nat in run.hosts().values()) == 2  # + the coordinator's: 8
    assert "every host's link shaped to" in text
    assert lost["nat"] and lost["processes"] >= 3, lost  # the peer, its DHT process, its p2pd
    assert len(re.findall(r"status: peer \S+ is behind NAT or a firewall \(could not connect to .*\): it is "
                          r"reached through this coordinator's relay", text)) == 2
    _same_as_simulator(tmp_path, cache, run, shape, lost)


@pytest.mark.timeout(240)
@pytest.mark.skipif(NAT_MISSING is not None, reason=f"no emulated NAT: {NAT_MISSING}")
def test_relays_off_a_natd_peer_is_told_why_in_one_line_within_the_join_timeout(tmp_path, cache):
    """The same swarm with relays off: each NAT'd peer exits with one line naming NAT and --no-relay, well within
    the join timeout; the coordinator says the same of each and never counts them; the run ends (it cannot fill its
    stages) once the join timeout is over, and nothing is left behind (namespaces, processes, socket files)."""
    spaces, sockets = _namespaces(), socket_files()
    join_timeout = 25.0
    run = Run(tmp_path / "swarm", cache, "--stages", "4", "--steps", "20", "--eval-every", "0", *TIMEOUTS,
              "--join-timeout", str(join_timeout), "--spares", "1", "--hosts", "--nat-peers", "2", "--no-relay")
    code = run.wait(200)
    assert code != 0
    gave_up = [(t, line) for t, line in run.lines if re.match(r"swarm: peer\d+ gave up", line)]
    assert len(gave_up) == 2, run.text()[-3000:]
    for _, line in gave_up:
        assert "behind NAT" in line and "--no-relay" in line and "Traceback" not in line
        told = float(re.search(r"gave up ([\d.]+) s after its start", line).group(1))
        assert told < join_timeout, f"told {told:.1f} s after the peer's start"
    coordinator = [line for _, line in run.lines if "relays off (--no-relay): it cannot take part" in line]
    assert len(coordinator) == 2 and all("behind NAT" in line for line in coordinator)
    assert not (run.out / "metrics.jsonl").exists() or not read_jsonl(run.out / "metrics.jsonl")
    assert not {n for n in _namespaces() - spaces if n.startswith("cf")}, "the launcher left namespaces behind"
    assert not {s for s in socket_files() - sockets if os.path.exists(s)}


@pytest.mark.timeout(600)
@pytest.mark.slow  # (test_eight_hosts_two_behind_nat_... covers NAT, a lost host and the shaped WAN in CI)
@pytest.mark.skipif(NAT_MISSING is not None, reason=f"no emulated NAT: {NAT_MISSING}")
def test_nine_emulated_hosts_three_behind_nat_lose_a_public_host_whole(tmp_path, cache):
    """Nine hosts (the coordinator, 6 stages + 2 spares), three peers behind NAT, every link shaped to the
    paper-geo profile's slowest (tc tbf) with its delays per stage pair: a public host serving an intermediate stage
    vanishes whole mid-run; the run recovers and equals the simulator."""
    shape = ["--stages", "6", "--layers", "6", "--steps", "10", "--eval-every", "0", "--wan", "paper-geo"]
    run, lost = _run_and_lose_a_host(tmp_path, cache, shape, spares=2, nat=3, kill_nat=False, at_step=4)
    assert len(run.hosts()) >= 8 and sum(nat for _, nat in run.hosts().values()) == 3
    assert "every host's link shaped to" in run.text()
    _same_as_simulator(tmp_path, cache, run, [s for s in shape if s not in ("--wan", "paper-geo")], lost)
