"""The control plane as real processes with the DHT (part of benchmarks.control_plane, `--real`).

`checkfree local` runs S x R peers in stage groups (coordinator, peers, their DHT processes, p2pd daemons) on the
tiny shapes; `benchmarks.swarmmon` reads every process's CPU through /proc, so the coordinator's CPU per step is its
own process's; a hivemind DHT client joined to the swarm polls the run's member records (`members_key`) every
`POLL_S` seconds and counts, per peer, how many different expiration times its record had: the heartbeat records
that reached the DHT, per second per peer.
"""

from __future__ import annotations

import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.swarmmon import SwarmMonitor
from checkfree.protocol import READY_COORDINATOR, members_key
from checkfree.rundir import read_jsonl

__all__ = ["measure_real", "HeartbeatWatch"]

POLL_S = 0.25


class HeartbeatWatch:
    """Polls the run's member records from a DHT client until `stop`; `rates()` gives refreshes per second per peer."""

    def __init__(self, coordinator_log: Path, run_id: str) -> None:
        self.log, self.key = coordinator_log, members_key(run_id)
        self.seen: dict[str, dict] = {}  # peer -> {"expiry": set, "first": t, "last": t}
        self.stop = threading.Event()
        self.error: str | None = None
        self.thread = threading.Thread(target=self._run, name="heartbeat-watch", daemon=True)

    def _address(self) -> str | None:
        while not self.stop.is_set():
            text = self.log.read_text() if self.log.exists() else ""
            if (m := re.search(rf"{READY_COORDINATOR}.* addrs=([^,\s]+)", text)) is not None:
                return m.group(1)
            self.stop.wait(0.5)
        return None

    def _run(self) -> None:
        from hivemind.dht import DHT

        addr = self._address()
        if addr is None:
            return
        dht = DHT(initial_peers=[addr], start=True, client_mode=True)
        try:
            while not self.stop.is_set():
                found = dht.get(self.key, latest=True)
                now = time.monotonic()
                if found is not None and isinstance(found.value, dict):
                    for sub, item in found.value.items():
                        s = self.seen.setdefault(str(sub), {"expiry": set(), "first": now, "last": now})
                        s["expiry"].add(item.expiration_time)
                        s["last"] = now
                self.stop.wait(POLL_S)
        except Exception as e:  # noqa: BLE001 - reported with the results, the run itself goes on
            self.error = repr(e)
        finally:
            dht.shutdown()

    def rates(self) -> list[float]:
        """Per peer seen for at least 5 s: distinct records seen, per second of watching."""
        return [(len(s["expiry"]) - 1) / (s["last"] - s["first"]) for s in self.seen.values()
                if s["last"] - s["first"] >= 5.0]


def measure_real(stages: int, replicas: int, microbatches: int, steps: int = 14, warmup: int = 3) -> dict:
    """One failure-free `checkfree local` run of S x R peers: coordinator CPU per step, DHT processes' CPU, heartbeat
    records per second per peer, step wall time."""
    n = stages * replicas
    with tempfile.TemporaryDirectory() as tmp:
        out, run_id = Path(tmp) / "run", f"control-plane-{n}"
        cmd = [sys.executable, "-m", "checkfree", "local", "--preset", "tiny", "--stages", str(stages), "--layers",
               str(stages), "--replicas", str(replicas), "--reserve", "0", "--microbatches", str(microbatches),
               "--steps", str(steps), "--eval-every", "0", "--spares", "0", "--no-churn", "--no-progress",
               "--threads-per-peer", "1", "--out", str(out), "--run-id", run_id]
        watch = HeartbeatWatch(out / "logs" / "coordinator.log", run_id)
        with open(Path(tmp) / "launcher.log", "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
            watch.thread.start()
            try:
                with SwarmMonitor(proc.pid, out / "metrics.jsonl", interval=0.5) as mon:
                    code = proc.wait(timeout=3600)
            finally:
                watch.stop.set()
                if proc.poll() is None:
                    proc.terminate()
                    proc.wait()
                watch.thread.join(timeout=30)
        if code != 0:
            raise RuntimeError(f"real swarm N={n} exited with {code}:\n{(Path(tmp) / 'launcher.log').read_text()[-3000:]}")
        acct = mon.per_step(warmup)
        metrics = read_jsonl(out / "metrics.jsonl")[warmup:]
    if acct is None:
        raise RuntimeError(f"real swarm N={n}: no measurement window (too few steps?)")
    cpu = acct["cpu_s"]
    both = {role: c["main"] + c["other"] for role, c in cpu.items()}
    rates = watch.rates()
    return {"peers": n, "stages": stages, "replicas": replicas, "steps": acct["steps"],
            "coordinator_cpu_s": both.get("coordinator", 0.0), "coordinator_loop_cpu_s": cpu.get("coordinator",
                                                                                                 {}).get("main", 0.0),
            "wall_s": statistics.median(m["step_time_s"] for m in metrics), "window_wall_s": acct["wall_s"],
            "coordinator_dht_cpu_s": both.get("coordinator-dht", 0.0), "peer_dht_cpu_s": both.get("peer-dht", 0.0),
            "p2pd_cpu_s": both.get("peer-p2pd", 0.0) + both.get("coordinator-p2pd", 0.0),
            "peer_dht_wchar_per_s": acct["wchar"].get("peer-dht", 0.0) / acct["wall_s"],
            "heartbeats_per_s_per_peer": statistics.fmean(rates) if rates else float("nan"),
            "peers_watched": len(rates), "watch_error": watch.error}
