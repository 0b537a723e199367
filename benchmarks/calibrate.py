"""Calibrate and measure the cost model (checkfree.costmodel) on this machine.

`--calibrate` prints paper-500m's step times under the paper-geo profile; `--measure` runs
short simulator runs of the tiny and small presets (one intra-op thread, fastest step), measures
storage and memory throughput, and solves the local profile's constants from them (the numbers
recorded as `LOCAL_MEASUREMENT` in checkfree/costmodel.py). Here, not in the library, because
it runs the simulator: the cost model itself must not depend on it.
"""

from __future__ import annotations

import argparse
import json
import math

from checkfree.config import preset
from checkfree.costmodel import GIB, calibration, solve_local


def _fastest_step_s(preset_name: str, steps: int) -> float:
    """The fastest step of a short simulator run at one intra-op thread: on a shared machine
    the minimum is the least disturbed estimate."""
    import tempfile

    import torch

    from checkfree.rundir import read_jsonl
    from checkfree.simulator import Simulator

    cfg = preset(preset_name)
    cfg.train.num_steps, cfg.train.eval_every, cfg.train.device = steps, 0, "cpu"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with tempfile.TemporaryDirectory() as out:
            Simulator(cfg, out, progress=False).run()
            times = [m["step_time_s"] for m in read_jsonl(f"{out}/metrics.jsonl")][2:]  # skip warm-up
    finally:
        torch.set_num_threads(threads)
    return min(times)


def _throughput_gib_s(nbytes: int, repeats: int = 3) -> tuple[float, float]:
    """(torch.save to disk, memcpy) throughput in GiB/s; best of `repeats`."""
    import tempfile
    import time

    import torch

    x = torch.randn(nbytes // 4)
    best_disk = best_mem = math.inf
    with tempfile.TemporaryDirectory() as d:
        for _ in range(repeats):
            t0 = time.perf_counter()
            torch.save({"x": x}, f"{d}/x.pt")
            best_disk = min(best_disk, time.perf_counter() - t0)
            t0 = time.perf_counter()
            x.clone()
            best_mem = min(best_mem, time.perf_counter() - t0)
    return nbytes / GIB / best_disk, nbytes / GIB / best_mem


def measure_local(steps: int = 20) -> dict[str, float]:
    """Measure this machine: step times of the tiny and small presets, storage and memory
    throughput, and the local profile's constants solved from them."""
    tiny, small = _fastest_step_s("tiny", steps), _fastest_step_s("small", steps)
    disk, mem = _throughput_gib_s(256 * 2**20)
    out = {"tiny_step_s": tiny, "small_step_s": small, "storage_GiB_s": disk, "memcpy_GiB_s": mem}
    try:
        out["flops_per_s"], out["hop_overhead_s"] = solve_local(tiny, small)
    except ValueError as e:
        out["error"] = str(e)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.calibrate", description=__doc__.split("\n")[0])
    p.add_argument("--calibrate", action="store_true", help="print paper-500m's step times under paper-geo")
    p.add_argument("--measure", action="store_true", help="measure this machine for the local profile")
    args = p.parse_args(argv)
    if args.measure:
        print(json.dumps(measure_local(), indent=2))
    if args.calibrate or not args.measure:
        print(json.dumps({k: round(v, 3) for k, v in calibration().items()}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
