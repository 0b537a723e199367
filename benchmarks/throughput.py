"""Throughput of the local swarm against single-process training of the same model and batch.

Measured side by side in one run:

* single: a plain training loop of the unsplit LlamaModel (gradient accumulation over M
  microbatches, clip, Adam) in this process, with `--threads` torch threads;
* simulator: the single-process simulator (all StageWorkers chained in one process);
* swarm: `checkfree local` (coordinator + S peer processes over hivemind P2P on loopback,
  `--threads-per-peer` threads each), step times read from its metrics.jsonl.

Ratios printed: swarm/single (target >= 0.9 for `small`), simulator/single (overhead
target: simulator >= 0.9 of single, i.e. <= 10%), and plain CheckFree vs CheckFree+
swarm throughput with no failures (target <= 3% apart).

    python -m benchmarks.throughput --preset small --stages 4 --microbatches 8 --steps 30 --rounds 5 \
        --baseline-rev 953dbea

Every path runs once per round, the paths interleaved round by round (in reverse order every other round;
this 2-core machine's background load moves single runs by +-30 %): each row gives the median over rounds and
its spread (min-max), and every ratio is the median of the per-round ratios, with their spread.
``--baseline-rev REV`` adds the checkfree swarm of another commit (run from a temporary ``git worktree`` of
it) to every round, so that a change is measured against its baseline in the same minutes;
``--no-pool-row`` adds the CheckFree swarm with stream reuse turned off (one p2pd stream per call, as
before reuse existed). The last line is `swarm/single throughput: X (min-max)`.

Latest results: see the README's "Benchmarks" section (recorded with the exact command).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
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


def swarm(args, strategy: str, steps: int, warmup: int, out: Path, pool: bool = True,
          tree: Path | None = None) -> tuple[float, float]:
    """Median step seconds of a failure-free swarm run, and the bytes its last step moved (``pool=False``:
    the same run with stream reuse off, ``CHECKFREE_STREAM_POOL=0``; ``tree``: the code of another checkout,
    run from there)."""
    env = {**os.environ, "CHECKFREE_STREAM_POOL": "1" if pool else "0"}
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
    subprocess.run(swarm_command(args, strategy, steps + warmup, out), check=True, capture_output=True, text=True,
                   timeout=3600, env=env, cwd=tree)
    metrics = read_jsonl(out / "metrics.jsonl")
    times = [m["step_time_s"] for m in metrics[warmup:-1]]
    return statistics.median(times), float(metrics[-1].get("wire_bytes", float("nan")))


@contextlib.contextmanager
def checkout(rev: str | None):
    """A detached `git worktree` of `rev` in a temporary directory (removed afterwards); None: no checkout."""
    if rev is None:
        yield None
        return
    root = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(root), "worktree", "add", "--detach", str(tree), rev], check=True,
                       capture_output=True, text=True)
        try:
            yield tree
        finally:
            subprocess.run(["git", "-C", str(root), "worktree", "remove", "--force", str(tree)], check=False,
                           capture_output=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small")
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=5,
                   help="run every path this many times, interleaved; report medians, their spread, and the median "
                        "per-round ratio")
    p.add_argument("--no-pool-row", action="store_true",
                   help="also run the checkfree swarm with stream reuse off (CHECKFREE_STREAM_POOL=0) in every round")
    p.add_argument("--no-plus", action="store_true", help="leave out the CheckFree+ swarm")
    p.add_argument("--baseline-rev", help="also run the checkfree swarm of this commit (a temporary git worktree of "
                                          "it) in every round, e.g. 953dbea, the commit before the stage groups")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads of the in-process loops")
    p.add_argument("--threads-per-peer", type=int, default=1)
    args = p.parse_args()
    if args.rounds < 1 or args.steps < 2:
        p.error("--rounds must be >= 1 and --steps >= 2")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # cleanups run (the baseline's git worktree)
    torch.set_num_threads(args.threads)
    cfg = preset(args.preset)
    cfg.num_stages, cfg.train.num_microbatches = args.stages, args.microbatches
    tokens = cfg.train.num_microbatches * cfg.train.microbatch_size * cfg.seq_len
    load0 = os.getloadavg()
    with checkout(args.baseline_rev) as tree, tempfile.TemporaryDirectory() as tmp:
        base = f"swarm @{args.baseline_rev}"
        paths = {  # name -> one measurement (seconds per step); run in this order, reversed every other round
            "single process": lambda r: single_process(cfg, args.steps, args.warmup),
            "simulator": lambda r: simulator(preset_like(cfg), args.steps, args.warmup, Path(tmp) / f"sim{r}"),
            "swarm checkfree": lambda r: swarm(args, "checkfree", args.steps, args.warmup, Path(tmp) / f"cf{r}")[0],
        }
        if not args.no_plus:
            paths["swarm checkfree+"] = lambda r: swarm(args, "checkfree+", args.steps, args.warmup,
                                                        Path(tmp) / f"plus{r}")[0]
        if args.no_pool_row:
            paths["swarm, no reuse"] = lambda r: swarm(args, "checkfree", args.steps, args.warmup,
                                                       Path(tmp) / f"nopool{r}", pool=False)[0]
        if tree is not None:
            paths[base] = lambda r: swarm(args, "checkfree", args.steps, args.warmup, Path(tmp) / f"base{r}",
                                          tree=tree)[0]
        names = list(paths)
        times: dict[str, list[float]] = {n: [] for n in names}
        for r in range(args.rounds):
            for name in (names if r % 2 == 0 else names[::-1]):
                times[name].append(paths[name](r))
            print(f"round {r + 1}/{args.rounds} (load {os.getloadavg()[0]:.2f}): "
                  + ", ".join(f"{n} {v[-1]:.4f} s" for n, v in times.items()), file=sys.stderr, flush=True)

    def ratios(a: str, b: str) -> list[float]:
        """times[a] / times[b] in each round (each round's paths ran minutes apart, not hours)."""
        return [x / y for x, y in zip(times[a], times[b])]

    def summary(values: list[float], fmt: str = ".3f") -> str:
        return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"

    med = {n: statistics.median(v) for n, v in times.items()}
    print(f"preset={args.preset} S={args.stages} M={args.microbatches} tokens/step={tokens} cores={os.cpu_count()} "
          f"threads(in-process)={args.threads} threads/peer={args.threads_per_peer} steps={args.steps} "
          f"rounds={args.rounds} load average {load0[0]:.2f} -> {os.getloadavg()[0]:.2f}")
    print("| path | s/step: median (min-max over rounds) | tokens/s | ÷ single: median of per-round ratios (min-max) |")
    print("|---|---|---|---|")
    for name in names:
        print(f"| {name} | {summary(times[name], '.4f')} | {tokens / med[name]:,.0f} | "
              f"{summary(ratios('single process', name))} |")
    sim = [100 * (x - 1) for x in ratios("simulator", "single process")]
    print(f"simulator overhead vs plain loop: {statistics.median(sim):+.1f}% ({min(sim):+.1f} to {max(sim):+.1f}) "
          "(target <= 10%)")
    if not args.no_plus:
        plus = [100 * (x - 1) for x in ratios("swarm checkfree", "swarm checkfree+")]
        print(f"checkfree+ vs checkfree throughput: {statistics.median(plus):+.1f}% ({min(plus):+.1f} to "
              f"{max(plus):+.1f}) (target >= -3%)")
    if args.no_pool_row:
        print(f"stream reuse: swarm throughput x{summary(ratios('swarm, no reuse', 'swarm checkfree'))} "
              "against one stream per call")
    if tree is not None:
        print(f"swarm/single @{args.baseline_rev}: {summary(ratios('single process', base))}; current against "
              f"@{args.baseline_rev}: x{summary(ratios(base, 'swarm checkfree'))}")
    print(json.dumps({"per_round_s": times, "tokens_per_step": tokens}))
    print(f"swarm/single throughput: {summary(ratios('single process', 'swarm checkfree'))} (target >= 0.9)")


def preset_like(cfg):
    from checkfree.config import config_from_dict

    return config_from_dict(cfg.to_dict())


if __name__ == "__main__":
    main()
