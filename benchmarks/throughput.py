"""Throughput of the local swarm against single-process training of the same model and batch.

Measured side by side in one run:

* single: a plain training loop of the unsplit LlamaModel (gradient accumulation over M
  microbatches, clip, Adam) in this process, with `--threads` torch threads;
* simulator: the single-process simulator (all StageWorkers chained in one process);
* swarm: `checkfree local` (coordinator + S peer processes over hivemind P2P on loopback,
  `--threads-per-peer` threads each), step times read from its metrics.jsonl.

Ratios printed: swarm/single (target >= 0.8 for `small`), simulator/single (overhead
target: simulator >= 0.9 of single, i.e. <= 10%), and plain CheckFree vs CheckFree+
swarm throughput with no failures (target <= 3% apart) plus the bytes per step on the wire.

    python -m benchmarks.throughput --preset small --stages 4 --microbatches 8 --steps 30 --rounds 3 --no-pool-row

``--rounds R`` runs every path R times, interleaved round by round, and reports median times and the median
of the per-round ratios (this 2-core machine's background load moves single runs by +-30 %);
``--no-pool-row`` adds the CheckFree swarm with stream reuse turned off (one p2pd stream per call, as
before reuse existed) to every round.

Latest results: see the README's "Benchmarks" section (recorded with the exact command).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from checkfree.config import preset
from checkfree.data import build_data
from checkfree.model import LlamaModel
from checkfree.rundir import read_jsonl
from checkfree.simulator import Simulator


def single_process(cfg, steps: int, warmup: int, stats: dict | None = None) -> float:
    """Median seconds per step of a plain unsplit training loop (and, into `stats`, the median
    CPU seconds per step of this process, all threads, as "cpu_s")."""
    torch.manual_seed(cfg.train.seed)
    model = LlamaModel(cfg.model)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.train.lr)
    data = build_data(cfg.data, vocab_size=cfg.model.vocab_size, context_length=cfg.seq_len,
                      seed=cfg.train.seed, microbatch_size=cfg.train.microbatch_size)
    times, cpu = [], []
    for step in range(steps + warmup):
        t0, c0 = time.perf_counter(), time.process_time()
        for mb in range(cfg.train.num_microbatches):
            x, y = data.batch(step, mb)
            logits = model(x)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()) / cfg.train.num_microbatches
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step >= warmup:
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    if stats is not None:
        stats["cpu_s"] = statistics.median(cpu)
    return statistics.median(times)


def simulator(cfg, steps: int, warmup: int, out: Path) -> float:
    cfg.train.num_steps, cfg.train.eval_every = steps + warmup, 0
    Simulator(cfg, out, progress=False).run()
    return statistics.median(m["step_time_s"] for m in read_jsonl(out / "metrics.jsonl")[warmup:-1])


def swarm_command(args, strategy: str, steps: int, out: Path, extra: list[str] = ()) -> list[str]:
    """`checkfree local` for a failure-free run of `args.preset` (no spares, no evaluation)."""
    return [sys.executable, "-m", "checkfree", "local", "--preset", args.preset, "--stages", str(args.stages),
            "--microbatches", str(args.microbatches), "--steps", str(steps), "--eval-every", "0",
            "--strategy", strategy, "--spares", "0", "--threads-per-peer", str(args.threads_per_peer),
            "--out", str(out), "--no-progress", "--no-churn", *extra]


def swarm(args, strategy: str, steps: int, warmup: int, out: Path, pool: bool = True) -> tuple[float, float]:
    """Median step seconds of a failure-free swarm run, and the bytes its last step moved (``pool=False``:
    the same run with stream reuse off, ``CHECKFREE_STREAM_POOL=0``)."""
    env = {**os.environ, "CHECKFREE_STREAM_POOL": "1" if pool else "0"}
    subprocess.run(swarm_command(args, strategy, steps + warmup, out), check=True, capture_output=True, text=True,
                   timeout=3600, env=env)
    metrics = read_jsonl(out / "metrics.jsonl")
    times = [m["step_time_s"] for m in metrics[warmup:-1]]
    return statistics.median(times), float(metrics[-1].get("wire_bytes", float("nan")))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small")
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1,
                   help="run every path this many times, interleaved; report medians and the median per-round ratio")
    p.add_argument("--no-pool-row", action="store_true",
                   help="also run the checkfree swarm with stream reuse off (CHECKFREE_STREAM_POOL=0) in every round")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads of the in-process loops")
    p.add_argument("--threads-per-peer", type=int, default=1)
    args = p.parse_args()
    if args.rounds < 1 or args.steps < 2:
        p.error("--rounds must be >= 1 and --steps >= 2")
    torch.set_num_threads(args.threads)
    cfg = preset(args.preset)
    cfg.num_stages, cfg.train.num_microbatches = args.stages, args.microbatches
    tokens = cfg.train.num_microbatches * cfg.train.microbatch_size * cfg.seq_len
    names = ["single process", "simulator", "swarm checkfree", "swarm checkfree+"]
    if args.no_pool_row:
        names.append("swarm, no reuse")
    times: dict[str, list[float]] = {n: [] for n in names}
    wire: dict[str, float] = {}
    for r in range(args.rounds):
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            times["single process"].append(single_process(cfg, args.steps, args.warmup))
            times["simulator"].append(simulator(preset_like(cfg), args.steps, args.warmup, tmp / "sim"))
            t, wire["swarm checkfree"] = swarm(args, "checkfree", args.steps, args.warmup, tmp / "cf")
            times["swarm checkfree"].append(t)
            t, wire["swarm checkfree+"] = swarm(args, "checkfree+", args.steps, args.warmup, tmp / "plus")
            times["swarm checkfree+"].append(t)
            if args.no_pool_row:
                t, _ = swarm(args, "checkfree", args.steps, args.warmup, tmp / "nopool", pool=False)
                times["swarm, no reuse"].append(t)
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{n} {v[-1]:.4f} s" for n, v in times.items()),
              file=sys.stderr, flush=True)

    def ratio(a: str, b: str) -> float:
        """Median over rounds of times[a] / times[b] (each round's paths ran minutes apart, not hours)."""
        return statistics.median(x / y for x, y in zip(times[a], times[b]))

    med = {n: statistics.median(v) for n, v in times.items()}
    print(f"preset={args.preset} S={args.stages} M={args.microbatches} tokens/step={tokens} cores={os.cpu_count()} "
          f"threads(in-process)={args.threads} threads/peer={args.threads_per_peer} steps={args.steps} "
          f"rounds={args.rounds}")
    print(f"{'path':<18} {'s/step':>8} {'tokens/s':>10} {'/single':>8}   (medians; /single = median per-round ratio)")
    for name in names:
        print(f"{name:<18} {med[name]:8.4f} {tokens / med[name]:10.0f} {ratio('single process', name):8.3f}")
    print(f"simulator overhead vs plain loop: {100 * (ratio('simulator', 'single process') - 1):+.1f}% (target <= 10%)")
    print(f"swarm/single throughput: {ratio('single process', 'swarm checkfree'):.3f} (target >= 0.8)")
    print(f"checkfree+ vs checkfree throughput: {100 * (ratio('swarm checkfree', 'swarm checkfree+') - 1):+.1f}% "
          f"(target >= -3%); wire bytes/step {wire['swarm checkfree']:,.0f} vs {wire['swarm checkfree+']:,.0f}")
    if args.no_pool_row:
        print(f"stream reuse: swarm throughput x{ratio('swarm, no reuse', 'swarm checkfree'):.3f} "
              "against one stream per call")
    print(json.dumps({"per_round_s": times, "tokens_per_step": tokens}))


def preset_like(cfg):
    from checkfree.config import config_from_dict

    return config_from_dict(cfg.to_dict())


if __name__ == "__main__":
    main()
