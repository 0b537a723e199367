"""Why a peer's copy thread runs at normal priority, not the OS's idle priority: the GIL inverts it.

A thread at Linux's SCHED_IDLE that runs Python code holds the GIL between switch intervals; on a machine whose
cores are busy it is not scheduled for long stretches, and the event loop's thread, which needs the GIL to run,
waits with it. This runs one asyncio loop (sleeps of 10 ms, the latency of each wake-up measured) beside a thread
of pure Python work, once with the thread at SCHED_IDLE and once at normal priority, while 2 x cores busy
processes load the machine, and prints the loop's wake-ups and its worst extra latency for each:

    python -m benchmarks.gil_priority            # about 20 s; its last line: the ratio of the worst latencies
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import sys
import threading
import time

SECONDS = 8.0


def _busy(stop) -> None:
    while not stop.is_set():
        pass


def _work(idle: bool, seconds: float) -> None:
    if idle:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    end, x = time.time() + seconds, 0
    while time.time() < end:
        for i in range(1000):  # pure Python: the GIL is held between switch intervals
            x += i


async def _loop(idle: bool, seconds: float) -> tuple[int, float]:
    t = threading.Thread(target=_work, args=(idle, seconds))
    t.start()
    worst, wakeups, end = 0.0, 0, time.time() + seconds
    while time.time() < end:
        t0 = time.perf_counter()
        await asyncio.sleep(0.01)
        worst, wakeups = max(worst, time.perf_counter() - t0 - 0.01), wakeups + 1
    t.join()
    return wakeups, worst


def main() -> None:
    if not hasattr(os, "SCHED_IDLE"):
        sys.exit("no SCHED_IDLE on this OS: nothing to measure")
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    hogs = [ctx.Process(target=_busy, args=(stop,)) for _ in range(2 * (os.cpu_count() or 1))]
    for p in hogs:
        p.start()
    try:
        time.sleep(1.0)
        rows = {name: asyncio.run(_loop(name == "SCHED_IDLE", SECONDS)) for name in ("SCHED_IDLE", "normal")}
    finally:
        stop.set()
        for p in hogs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
    print(f"{len(hogs)} busy processes, {os.cpu_count()} cores, {SECONDS:g} s each, load average "
          f"{os.getloadavg()[0]:.2f}")
    for name, (wakeups, worst) in rows.items():
        print(f"python thread at {name}: the event loop woke {wakeups} times, worst extra latency {worst:.3f} s")
    print(f"worst latency, SCHED_IDLE/normal: {rows['SCHED_IDLE'][1] / max(rows['normal'][1], 1e-6):.1f}")


if __name__ == "__main__":
    main()
