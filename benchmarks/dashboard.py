"""Does serving the dashboard slow the steps? Side by side in one `checkfree local` run (real processes).

The coordinator serves its dashboard from its own event loop, the one that drives the steps. One run of
`checkfree local --no-churn` is watched by a client that alternates windows of `--window` seconds: in a
*polled* window it requests /status and /metrics `--hz` times a second each (a browser tab polls /status once a
second, a Prometheus server scrapes /metrics every 15 s or so: the default 10 Hz is far beyond both); in an
*idle* window it requests nothing (an unpolled dashboard runs no code: nothing is read or built until a request
comes). Every step is then classed by the window its whole duration fell in (steps that straddle two windows
are dropped) and the two classes' step times are compared: the ratio polled / idle of the median step time.
Also printed: the client-side latency of each endpoint, and what building one /status and one /metrics answer
costs from the finished run's files (CPU time in this process; in the coordinator, that is the time the event
loop spends on a request).

    python -m benchmarks.dashboard            # 120 steps of the tiny preset
    python -m benchmarks.dashboard --quick    # 16 steps (checks that it runs)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from checkfree.rundir import read_jsonl
from ops.dashboard import metrics_text
from swarm.processes import await_line, kill_group, spawn
from ops.status import from_run_dir

__all__ = ["main", "classify"]


TICK = os.sysconf("SC_CLK_TCK")


def coordinator_cpu(out: Path) -> float | None:
    """CPU seconds (user + system, all its threads) of the coordinator process writing into `out`; None if gone."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"scheduler" in argv and str(out).encode() in argv:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                return (int(fields[11]) + int(fields[12])) / TICK
        except OSError:
            continue
    return None


class Poller(threading.Thread):
    """Alternates polled and idle windows of `window` s until the run ends; records each window (with the
    coordinator's CPU seconds at its start and end) and each request's latency."""

    def __init__(self, url: str, hz: float, window: float, out: Path) -> None:
        super().__init__(daemon=True)
        self.url, self.hz, self.window, self.out = url, hz, window, out
        self.windows: list[tuple[float, float, bool]] = []  # (start, end, polled), wall clock
        self.cpu: list[tuple[float, float, bool, int]] = []  # (seconds, coordinator CPU seconds, polled, requests)
        self.latency: dict[str, list[float]] = {"status": [], "metrics": []}
        self.stop = threading.Event()

    def _get(self, path: str) -> None:
        t0 = time.perf_counter()
        with urllib.request.urlopen(self.url + path, timeout=10) as r:
            r.read()
        self.latency[path].append(time.perf_counter() - t0)

    def run(self) -> None:
        polled = True
        while not self.stop.is_set():
            start, cpu0, n0 = time.time(), coordinator_cpu(self.out), len(self.latency["status"])
            while time.time() - start < self.window and not self.stop.is_set():
                if polled:
                    try:
                        self._get("status")
                        self._get("metrics")
                    except OSError:  # the coordinator has ended
                        self.stop.set()
                self.stop.wait(1 / self.hz)
            self.windows.append((start, time.time(), polled))
            if cpu0 is not None and (cpu1 := coordinator_cpu(self.out)) is not None:
                self.cpu.append((time.time() - start, cpu1 - cpu0, polled, len(self.latency["status"]) - n0))
            polled = not polled

    def cpu_cost(self) -> tuple[float, float, float]:
        """The coordinator's CPU share in polled and in idle windows, and its extra CPU ms per request."""
        def share(polled: bool) -> float:
            ws = [w for w in self.cpu if w[2] == polled]
            return sum(w[1] for w in ws) / sum(w[0] for w in ws) if ws else float("nan")

        requests = 2 * sum(w[3] for w in self.cpu if w[2]) / sum(w[0] for w in self.cpu if w[2])  # per second
        return share(True), share(False), 1000 * (share(True) - share(False)) / requests


def classify(records: list[dict], windows: list[tuple[float, float, bool]]) -> dict[bool, list[float]]:
    """Step times by window kind (True: polled): a step counts where its whole duration (its record's time
    minus its step time, to its record's time) lies inside one window."""
    out: dict[bool, list[float]] = {True: [], False: []}
    for r in records:
        end, took = r["time"], r["step_time_s"]
        for a, b, polled in windows:
            if a <= end - took and end <= b:
                out[polled].append(took)
    return out


def _render_costs(out: Path, reps: int = 200) -> tuple[float, float]:
    """Mean CPU seconds to build one /status body and one /metrics body from the finished run's state."""
    status = from_run_dir(out)
    t0 = time.process_time()
    for _ in range(reps):
        json.dumps(status.as_dict())
    t1 = time.process_time()
    for _ in range(reps):
        metrics_text(status)
    return (t1 - t0) / reps, (time.process_time() - t1) / reps


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--hz", type=float, default=10.0, help="requests of each endpoint per second in a polled window")
    p.add_argument("--window", type=float, default=3.0, help="seconds of each polled or idle window")
    p.add_argument("--quick", action="store_true", help="16 steps, 1 s windows")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    steps, window = (16, 1.0) if args.quick else (args.steps, args.window)
    load = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="checkfree-bench-dashboard-") as tmp:
        out = Path(tmp) / "run"
        env = {**os.environ, "CHECKFREE_CACHE": os.environ.get("CHECKFREE_CACHE", str(Path(tmp) / "cache"))}
        proc = spawn(["local", "--preset", "tiny", "--steps", str(steps), "--eval-every", str(10 * steps),
                      "--no-churn", "--no-progress", "--spares", "0", "--out", str(out)], env)
        try:
            poller = Poller(await_line(proc, "swarm: dashboard", 300).split()[2], args.hz, window, out)
            poller.start()  # (windows before the first step hold no step)
            code = proc.popen.wait(timeout=1800)
            poller.stop.set()
            poller.join()
        finally:
            kill_group(proc)
        if code != 0:
            raise SystemExit(f"checkfree local failed ({code}):\n{proc.tail()}")
        records = read_jsonl(out / "metrics.jsonl")[1:]  # (step 0 builds what later steps reuse)
        by_kind = classify(records, poller.windows)
        status_s, metrics_s = _render_costs(out)
        busy_polled, busy_idle, per_request_ms = poller.cpu_cost()
    med = {k: statistics.median(v) if v else float("nan") for k, v in by_kind.items()}
    result = {"steps": steps, "hz": args.hz, "window_s": window, "polled_steps": len(by_kind[True]),
              "idle_steps": len(by_kind[False]), "median_step_ms_polled": 1000 * med[True],
              "median_step_ms_idle": 1000 * med[False], "ratio_polled_over_idle": med[True] / med[False],
              "requests": {k: len(v) for k, v in poller.latency.items()},
              "latency_ms_median": {k: 1000 * statistics.median(v) for k, v in poller.latency.items() if v},
              "build_ms": {"status": 1000 * status_s, "metrics": 1000 * metrics_s},
              "coordinator_cpu_share": {"polled": busy_polled, "idle": busy_idle},
              "coordinator_cpu_ms_per_request": per_request_ms,
              "load_average": [round(load[0], 2), round(os.getloadavg()[0], 2)]}
    print(f"dashboard polled at {args.hz:g} Hz (/status and /metrics each) vs idle, {window:g} s windows, "
          f"load average {result['load_average'][0]} -> {result['load_average'][1]}")
    print("| steps polled | steps idle | median step ms polled | median step ms idle | ratio polled/idle |")
    print("|---|---|---|---|---|")
    print(f"| {result['polled_steps']} | {result['idle_steps']} | {result['median_step_ms_polled']:.1f} | "
          f"{result['median_step_ms_idle']:.1f} | {result['ratio_polled_over_idle']:.3f} |")
    lat = result["latency_ms_median"]
    print(f"requests: {result['requests']['status']} /status (median {lat.get('status', float('nan')):.1f} ms), "
          f"{result['requests']['metrics']} /metrics (median {lat.get('metrics', float('nan')):.1f} ms) over loopback")
    print(f"coordinator CPU: {busy_polled:.1%} of a core in polled windows, {busy_idle:.1%} in idle ones: "
          f"{per_request_ms:.2f} ms per request")
    print(f"building one answer from the finished run: /status {result['build_ms']['status']:.2f} ms, "
          f"/metrics {result['build_ms']['metrics']:.2f} ms of CPU")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
