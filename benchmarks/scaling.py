"""Scaling of the local swarm: tokens/s, bytes per step, CPU per step and memory per peer, for a
growing number of stages S at a fixed model and for a growing model at a fixed S.

For every configuration, side by side in one run:

* single: the unsplit model's plain training loop (`benchmarks.throughput.single_process`) in a
  child process with `--threads` torch threads (default 1): seconds and CPU seconds per step, and its
  peak resident memory (ru_maxrss);
* swarm: a failure-free `checkfree local` (coordinator + S peers, 1 torch thread each, no spares),
  watched from the outside through /proc by `benchmarks.swarmmon`: median step time, the tensor
  payload the peers report per step (`wire_bytes` in metrics.jsonl), CPU seconds per step of the
  peers' compute threads (the work), of everything else (event loops, p2pd daemons, DHT
  processes, coordinator: the overhead), the bytes the p2pd daemons wrote per step, and each peer
  process's peak resident memory (VmHWM, last read before it exited).

Ratios printed: swarm/single tokens/s (the swarm uses every core, the single process `--threads`);
the swarm's CPU per step / the single process's (the cost of the same work); wire bytes / the analytic activation bytes
2 (S-1) M B T d x 4 (forward activations and backward gradients across S-1 boundaries, float32);
overhead CPU / compute CPU; and, against the first configuration of each sweep, how much each
cost grew divided by how much the work grew (> 1: the cost grows faster than the work).

    python -m benchmarks.scaling                 # S = 2,3,4,6,8 at small x 24 layers; d = 64..512 at S = 4
    python -m benchmarks.scaling --quick         # tiny shapes, 1-3 min with load: checks the harness

Latest results: see the README's "Benchmarks" section (recorded with the exact command).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from benchmarks.swarmmon import SwarmMonitor
from benchmarks.throughput import swarm_command
from checkfree.rundir import read_jsonl

OVERHEAD_ROLES = ("coordinator", "coordinator-dht", "coordinator-p2pd", "peer-dht", "peer-p2pd")


def model_shape(preset_name: str, layers: int, d_model: int, heads: int) -> dict:
    from checkfree.config import preset

    cfg = preset(preset_name)
    m, t = cfg.model, cfg.train
    tokens = t.microbatch_size * m.context_length
    matmul = layers * 16 * d_model**2 + d_model * m.vocab_size  # blocks (4d^2 attention + 12d^2 SwiGLU) + head
    params = matmul + d_model * m.vocab_size + (2 * layers + 1) * d_model  # + embedding + norms
    return {"layers": layers, "d_model": d_model, "heads": heads, "params": params, "vocab": m.vocab_size,
            "context": m.context_length, "microbatch_size": t.microbatch_size, "tokens_per_microbatch": tokens,
            "flops_per_token": 6 * matmul + 12 * layers * m.context_length * d_model}


def single(preset_name: str, shape: dict, microbatches: int, steps: int, warmup: int, threads: int) -> dict:
    """The plain loop in a child process (so that its peak memory is its own)."""
    return singles(preset_name, [(shape, steps)], microbatches, warmup, threads)[0]


def singles(preset_name: str, runs: list[tuple[dict, int]], microbatches: int, warmup: int, threads: int) -> list[dict]:
    """The plain loop of each (shape, steps) of `runs`, one after the other in one child process; the peak memory
    of each after the first is the peak since the one before it ended (VmHWM reset), not of a process of its own
    (--quick: one process start instead of one per configuration)."""
    spec = json.dumps({"preset": preset_name, "runs": runs, "microbatches": microbatches, "warmup": warmup,
                       "threads": threads})
    done = subprocess.run([sys.executable, "-m", "benchmarks.scaling", "--single-child", spec], capture_output=True,
                          text=True, timeout=3600, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    if done.returncode != 0:
        raise RuntimeError(f"single-process run failed:\n{done.stderr[-3000:]}")
    return [json.loads(line) for line in done.stdout.strip().splitlines()[-len(runs):]]


def _single_child(spec: str) -> None:
    import torch

    from checkfree.config import preset
    from benchmarks.throughput import single_process

    s = json.loads(spec)
    torch.set_num_threads(s["threads"])
    for i, (sh, steps) in enumerate(s["runs"]):
        cfg = preset(s["preset"])
        cfg.model.num_layers, cfg.model.d_model, cfg.model.num_heads = sh["layers"], sh["d_model"], sh["heads"]
        cfg.train.num_microbatches = s["microbatches"]
        if i > 0:  # the peak from here on (the process's own, ru_maxrss, for the first run)
            Path("/proc/self/clear_refs").write_text("5")
        stats: dict = {}
        t = single_process(cfg, steps, s["warmup"], stats)
        peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss if i == 0 else _vm_hwm_kib()
        print(json.dumps({"s_per_step": t, "cpu_s_per_step": stats["cpu_s"], "peak_mib": peak_kib / 1024}),
              flush=True)


def _vm_hwm_kib() -> int:
    """This process's peak resident memory since it started or since the last VmHWM reset, in KiB."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmHWM:"))
    return int(line.split()[1])


def swarm(preset_name: str, shape: dict, stages: int, microbatches: int, steps: int, warmup: int,
          tmp: Path) -> dict:
    out = tmp / f"S{stages}-d{shape['d_model']}"
    args = SimpleNamespace(preset=preset_name, stages=stages, microbatches=microbatches, threads_per_peer=1)
    cmd = swarm_command(args, "checkfree", steps + warmup, out,
                        ["--layers", str(shape["layers"]), "--d-model", str(shape["d_model"]),
                         "--heads", str(shape["heads"])])
    with open(tmp / f"{out.name}.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            with SwarmMonitor(proc.pid, out / "metrics.jsonl", interval=0.25) as mon:
                code = proc.wait(timeout=3600)
        finally:
            if proc.poll() is None:
                proc.terminate()
                proc.wait()
    if code != 0:
        raise RuntimeError(f"swarm S={stages} d={shape['d_model']} exited with {code}:\n"
                           f"{(tmp / f'{out.name}.log').read_text()[-3000:]}")
    metrics = read_jsonl(out / "metrics.jsonl")[warmup:]
    acct = mon.per_step(warmup)
    mem = mon.peer_memory()
    if acct is None or len(mem) != stages:
        raise RuntimeError(f"swarm S={stages}: the monitor saw {len(mem)} peers and "
                           f"{'no' if acct is None else 'a'} measurement window (steps too short?)")
    cpu = acct["cpu_s"]
    compute = cpu.get("peer", {}).get("other", 0.0)
    loops = cpu.get("peer", {}).get("main", 0.0)
    overhead = loops + sum(c["main"] + c["other"] for r, c in cpu.items() if r in OVERHEAD_ROLES)
    return {"s_per_step": statistics.median(m["step_time_s"] for m in metrics),
            "wire_bytes": statistics.median(m["wire_bytes"] for m in metrics),
            "cpu_compute_s": compute, "cpu_event_loops_s": loops, "cpu_overhead_s": overhead,
            "cpu_p2pd_s": sum(cpu.get(r, {}).get("main", 0) + cpu.get(r, {}).get("other", 0)
                              for r in ("peer-p2pd", "coordinator-p2pd")),
            "p2pd_written_bytes": acct["wchar"].get("peer-p2pd", 0.0),
            "peer_peak_mib": [round(m["peer_mib"], 1) for m in mem],
            "peer_group_peak_mib": [round(m["group_mib"], 1) for m in mem]}


def measure(preset_name: str, shape: dict, stages: int, microbatches: int, steps: int, warmup: int, threads: int,
            tmp: Path, one: dict | None = None) -> dict:
    """One configuration: the single process (`one`: its result, measured already) and the swarm, side by side."""
    tokens = microbatches * shape["tokens_per_microbatch"]
    if one is None:
        one = single(preset_name, shape, microbatches, steps, warmup, threads)
    sw = swarm(preset_name, shape, stages, microbatches, steps, warmup, tmp)
    analytic = 2 * (stages - 1) * microbatches * shape["tokens_per_microbatch"] * shape["d_model"] * 4
    row = {"stages": stages, **shape, "microbatches": microbatches, "tokens_per_step": tokens,
           "work_flops_per_step": shape["flops_per_token"] * tokens,
           "single_tokens_s": tokens / one["s_per_step"], "single_cpu_s": one["cpu_s_per_step"],
           "single_peak_mib": one["peak_mib"],
           "swarm_tokens_s": tokens / sw["s_per_step"], **{f"swarm_{k}": v for k, v in sw.items()},
           "analytic_activation_bytes": analytic, "data_calls_per_step": 2 * (stages - 1) * microbatches,
           "loadavg": os.getloadavg()[0]}
    row["swarm_over_single"] = row["swarm_tokens_s"] / row["single_tokens_s"]
    row["wire_over_analytic"] = sw["wire_bytes"] / analytic
    row["overhead_over_compute"] = sw["cpu_overhead_s"] / max(sw["cpu_compute_s"], 1e-9)
    row["swarm_cpu_over_single_cpu"] = (sw["cpu_compute_s"] + sw["cpu_overhead_s"]) / one["cpu_s_per_step"]
    row["compute_cpu_over_single_cpu"] = sw["cpu_compute_s"] / one["cpu_s_per_step"]
    row["peer_peak_mib_mean"] = statistics.mean(sw["peer_peak_mib"])
    row["peers_peak_mib_sum_over_single"] = sum(sw["peer_peak_mib"]) / one["peak_mib"]
    print(f"  S={stages} d={shape['d_model']}: single {row['single_tokens_s']:.0f} tok/s, swarm "
          f"{row['swarm_tokens_s']:.0f} tok/s (load {row['loadavg']:.1f})", flush=True)
    return row


# costs of one step of the swarm, compared across a sweep against the work (FLOPs) of the step
GROWTH = [("s/step", lambda r: r["swarm_s_per_step"]),
          ("CPU/step", lambda r: r["swarm_cpu_compute_s"] + r["swarm_cpu_overhead_s"]),
          ("overhead CPU/step", lambda r: r["swarm_cpu_overhead_s"]),
          ("wire bytes/step", lambda r: r["swarm_wire_bytes"]),
          ("peer memory (sum)", lambda r: sum(r["swarm_peer_peak_mib"]))]


def print_tables(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    print("CPU-s: CPU seconds per step; compute = the peers' compute threads, overhead = everything else of the "
          "swarm; 'swarm CPU/single' = (compute + overhead) / the single process's CPU per step")
    print(f"{'S':>2} {'d':>4} {'params':>7} {'single tok/s':>12} {'swarm tok/s':>11} {'swarm/single':>12} "
          f"{'single CPU-s':>12} {'compute CPU-s':>13} {'overhead CPU-s':>14} {'ovh/compute':>11} {'p2pd CPU-s':>10} "
          f"{'swarm CPU/single':>16}")
    for r in rows:
        print(f"{r['stages']:>2} {r['d_model']:>4} {r['params'] / 1e6:6.2f}M {r['single_tokens_s']:12.0f} "
              f"{r['swarm_tokens_s']:11.0f} {r['swarm_over_single']:12.3f} {r['single_cpu_s']:12.3f} "
              f"{r['swarm_cpu_compute_s']:13.3f} {r['swarm_cpu_overhead_s']:14.3f} {r['overhead_over_compute']:11.2f} "
              f"{r['swarm_cpu_p2pd_s']:10.3f} {r['swarm_cpu_over_single_cpu']:16.2f}")
    print(f"{'S':>2} {'d':>4} {'wire MB/step':>12} {'analytic MB':>11} {'wire/analytic':>13} {'p2pd wrote MB':>13} "
          f"{'calls/step':>10} {'peer MiB mean':>13} {'peer MiB max':>12} {'group MiB':>9} {'single MiB':>10} "
          f"{'sum peers/single':>16}")
    for r in rows:
        print(f"{r['stages']:>2} {r['d_model']:>4} {r['swarm_wire_bytes'] / 1e6:12.2f} "
              f"{r['analytic_activation_bytes'] / 1e6:11.2f} {r['wire_over_analytic']:13.3f} "
              f"{r['swarm_p2pd_written_bytes'] / 1e6:13.2f} {r['data_calls_per_step']:10d} "
              f"{r['peer_peak_mib_mean']:13.0f} {max(r['swarm_peer_peak_mib']):12.0f} "
              f"{statistics.mean(r['swarm_peer_group_peak_mib']):9.0f} {r['single_peak_mib']:10.0f} "
              f"{r['peers_peak_mib_sum_over_single']:16.2f}")
    if len(rows) < 2:
        return
    base = rows[0]
    print("growth of each cost against the first row, divided by the growth of the work (FLOPs/step): "
          "> 1 where the cost grows faster than the work")
    print(f"{'S':>2} {'d':>4} {'work x':>7} " + " ".join(f"{name:>18}" for name, _ in GROWTH))
    for r in rows:
        work = r["work_flops_per_step"] / base["work_flops_per_step"]
        cells = [f"{f(r) / f(base) / work:18.2f}" for _, f in GROWTH]
        print(f"{r['stages']:>2} {r['d_model']:>4} {work:7.2f} " + " ".join(cells))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--single-child", help=argparse.SUPPRESS)
    p.add_argument("--quick", action="store_true",
                   help="tiny shapes and 12 steps, every single-process run in one child: checks the harness, "
                        "not a result")
    p.add_argument("--preset", default="small")
    p.add_argument("--layers", type=int, default=24, help="blocks of the model (default 24: divisible by 2,3,4,6,8)")
    p.add_argument("--d-model", type=int, default=96, help="width in the stage sweep")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--stages", type=int, nargs="*", default=[2, 3, 4, 6, 8])
    p.add_argument("--d-models", type=int, nargs="*", default=[64, 128, 256, 512])
    p.add_argument("--size-stages", type=int, default=4, help="S of the model-size sweep")
    p.add_argument("--size-layers", type=int, default=8, help="blocks in the model-size sweep")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--steps", type=int, default=6, help="measured steps per run of the stage sweep")
    p.add_argument("--size-steps", type=int, default=4, help="measured steps per run of the model-size sweep")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads of the single process (default 1: two OpenMP threads thrash on a busy "
                        "2-core machine; its CPU per step is the reference either way)")
    p.add_argument("--json", type=Path, help="also write the rows here")
    args = p.parse_args()
    if args.single_child:
        _single_child(args.single_child)
        return
    if args.quick:
        args.preset, args.layers, args.d_model, args.stages = "tiny", 6, 32, [2, 3]
        args.d_models, args.size_stages, args.size_layers, args.microbatches = [32, 64], 2, 6, 4
        args.steps, args.size_steps, args.warmup = 12, 12, 2
    load0, t0 = os.getloadavg(), time.monotonic()
    print(f"preset={args.preset} M={args.microbatches} steps={args.steps} (size sweep {args.size_steps}) + {args.warmup} "
          f"warm-up, single process at "
          f"{args.threads} threads, 1 thread per peer, cores={os.cpu_count()}, load average {load0[0]:.2f}", flush=True)
    done: dict[tuple, dict] = {}
    one: dict[tuple, dict] = {}  # --quick: every configuration's single process, measured in one child first
    if args.quick:
        todo = {(layers, d): steps for layers, d, steps in [(args.layers, args.d_model, args.steps)] * len(args.stages)
                + [(args.size_layers, d, args.size_steps) for d in args.d_models]}
        runs = [(model_shape(args.preset, layers, d, args.heads), steps) for (layers, d), steps in todo.items()]
        one = dict(zip(todo, singles(args.preset, runs, args.microbatches, args.warmup, args.threads)))
    with tempfile.TemporaryDirectory() as tmp:

        def row(stages: int, layers: int, d: int, steps: int) -> dict:
            key = (stages, layers, d)
            if key not in done:
                shape = model_shape(args.preset, layers, d, args.heads)
                done[key] = measure(args.preset, shape, stages, args.microbatches, steps, args.warmup,
                                    args.threads, Path(tmp), one.get((layers, d)))
            return done[key]

        by_stages = [row(s, args.layers, args.d_model, args.steps) for s in args.stages]
        by_size = [row(args.size_stages, args.size_layers, d, args.size_steps) for d in args.d_models]
    load1 = os.getloadavg()
    print_tables(f"stages sweep: {args.layers} layers, d_model {args.d_model}", by_stages)
    print_tables(f"model-size sweep: S={args.size_stages}, {args.size_layers} layers", by_size)
    print(f"\nload average {load0[0]:.2f} / {load0[1]:.2f} before, {load1[0]:.2f} / {load1[1]:.2f} after (1 / 5 min); "
          f"{time.monotonic() - t0:.0f} s")
    result = {"command": " ".join(["python -m benchmarks.scaling", *sys.argv[1:]]), "cores": os.cpu_count(),
              "loadavg_before": load0, "loadavg_after": load1, "stages_sweep": by_stages, "size_sweep": by_size}
    print(json.dumps(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
