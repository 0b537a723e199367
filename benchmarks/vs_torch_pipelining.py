"""The swarm against torch.distributed.pipelining on the same stages, batches and optimizer.

Both sides train the same LLaMA stages: this project's `StageWorker`s (`plan_stages`, `PipelineStage`,
`init_stage`, per-stage clipping, Adam), the same preset, microbatches, sequence length and batches
(`checkfree.data`, step by step), one torch thread per process.

* torch: 4 gloo processes (one per stage; a TCPStore hosted by this process), each stage's module wrapped as a
  `torch.distributed.pipelining.PipelineStage` and driven by `ScheduleGPipe` or `Schedule1F1B`; the loss is
  the swarm's (cross-entropy / M on the last stage, `scale_grads=False`), and after each schedule step every
  rank runs its StageWorker's own `step` (clip, Adam, zero_grad).
* swarm: `checkfree local --no-churn --spares 0` with `--schedule gpipe|1f1b`, over `--transport tcp` and the
  default transport (hivemind, with the default schedule): coordinator, DHT heartbeats, failure detection and
  the all-or-nothing commit all on, as in any run.

Every path runs once per round, the paths interleaved round by round (this 2-core machine's background load
moves single runs by +-30 %). A path's time is the median wall time per step (the time between consecutive
steps' ends: the throughput a user sees) after `--warmup` steps; the tables give the median over rounds and
its spread (min-max), and ratios are medians of per-round ratios. Also measured: CPU seconds per step of every
process (from /proc; torch: its 4 ranks, swarm: everything the launcher started), and the losses of every
path step by step against torch GPipe's (the largest difference is printed; the schedules accumulate the
microbatches' gradients in different orders, so they may differ by float round-off).

    python -m benchmarks.vs_torch_pipelining            # 5 rounds of 30 steps (about 15 minutes)
    python -m benchmarks.vs_torch_pipelining --quick    # 2 rounds of 8 steps (about 3 minutes)

The last line is `swarm/torch-pipelining: X`: the median over rounds of the best torch schedule's time over
the best `--transport tcp` swarm schedule's time (above 1: the swarm is faster).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

from benchmarks.swarmmon import SwarmMonitor
from benchmarks.throughput import swarm_command
from checkfree.net.lifeline import held_socket_files, outliving

HOST = "127.0.0.1"
STORE_TIMEOUT_S = 120.0  # gloo rendezvous and every gloo operation of a torch run
RUN_TIMEOUT_S = 900.0  # no path may hang the benchmark for longer

TORCH_SCHEDULES = ("gpipe", "1f1b")
SWARM_PATHS = {  # name -> (schedule, transport)
    "swarm tcp gpipe": ("gpipe", "tcp"),
    "swarm tcp 1f1b": ("1f1b", "tcp"),
    "swarm hivemind gpipe": ("gpipe", "hivemind"),
}


def bench_config(args):
    from checkfree.config import preset

    cfg = preset(args.preset)
    cfg.num_stages, cfg.train.num_microbatches = args.stages, args.microbatches
    cfg.train.num_steps, cfg.train.eval_every = args.steps, 0
    return cfg


# ---------------------------------------------------------------- torch.distributed.pipelining (spawned ranks)

def torch_rank(rank: int, world: int, port: int, cfg_dict: dict, schedules: tuple[str, ...], threads: int,
               res_q) -> None:
    """One stage of the torch pipeline, trained afresh under each of `schedules` in turn; puts {"rank", "runs":
    {schedule: {"times", "cpu", "losses"}}, "threads"} (or "error")."""
    try:
        res_q.put({"rank": rank, **_torch_rank(rank, world, port, cfg_dict, schedules, threads)})
    except BaseException:  # noqa: BLE001 - the parent reports it
        res_q.put({"rank": rank, "error": traceback.format_exc()})


def _torch_rank(rank: int, world: int, port: int, cfg_dict: dict, schedules: tuple[str, ...], threads: int) -> dict:
    import torch
    import torch.distributed as dist

    from checkfree.config import config_from_dict
    from checkfree.data import build_data

    torch.set_num_threads(threads)
    cfg = config_from_dict(cfg_dict)
    store = dist.TCPStore(HOST, port, world, False, timeout=timedelta(seconds=STORE_TIMEOUT_S))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=STORE_TIMEOUT_S))
    try:
        data = build_data(cfg.data, vocab_size=cfg.model.vocab_size, context_length=cfg.model.context_length,
                          seed=cfg.train.seed, microbatch_size=cfg.train.microbatch_size, progress=False) \
            if rank in (0, world - 1) else None
        runs = {schedule: _torch_run(rank, world, cfg, schedule, data) for schedule in schedules}
        return {"runs": runs, "threads": [torch.get_num_threads(), torch.get_num_interop_threads()]}
    finally:
        dist.destroy_process_group()


def _torch_run(rank: int, world: int, cfg, schedule: str, data) -> dict:
    """One rank's training under one schedule, from the stage's initial weights: step end times, CPU, losses."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from checkfree.worker import StageWorker, resolve_device

    m = cfg.train.num_microbatches
    # the swarm's stage (same init, groups, clip, Adam) on the swarm's device: `--device` as the peers take it
    device = resolve_device(cfg.train.device)
    worker = StageWorker(cfg, rank, device)
    first, last = rank == 0, rank == world - 1

    class Stage(torch.nn.Module):
        """The project's PipelineStage with its embed/head flags fixed (torch passes one tensor). On a GPU, gloo
        carries host tensors (NCCL refuses two ranks on one GPU, gloo's send/recv takes CPU tensors): the stage
        computes on the device and hands its output back in host memory, as a peer hands it to its transport;
        the last stage's logits stay on the device for the loss, as on the swarm's last hop."""

        def __init__(self) -> None:
            super().__init__()
            self.inner = worker.module

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with worker._autocast():  # the swarm's --bf16 (logits in bf16 then: float32 as the metadata says)
                out = self.inner(x.to(device), embed=first, head=last).float()
            return out if last else out.to("cpu")

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:  # StageWorker.forward's loss
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.to(logits.device).flatten()) / m

    # shapes given (static metadata): no shape inference over the wire at the first step
    b, t, c = cfg.train.microbatch_size, cfg.model.context_length, cfg.model.d_model
    # (requires_grad is part of the metadata: without it the received activations get no gradient)
    example_in = torch.zeros(b, t, dtype=torch.long) if first else torch.zeros(b, t, c, requires_grad=True)
    example_out = torch.zeros(b, t, cfg.model.vocab_size if last else c, requires_grad=True)
    stage = PipelineStage(Stage(), rank, world, torch.device("cpu"), input_args=example_in, output_args=example_out)
    kind = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
    sched = kind(stage, n_microbatches=m, loss_fn=loss_fn, scale_grads=False)  # (every rank: it also means "train")
    dist.barrier()
    times, cpu, losses = [], [], []
    for step in range(cfg.train.num_steps):
        batches = [data.batch(step, mb) for mb in range(m)] if data is not None else []
        if first:
            sched.step(torch.cat([x for x, _ in batches]))
        elif last:
            out: list = []
            sched.step(target=torch.cat([y for _, y in batches]), losses=out)
            losses.append(sum(float(v.detach()) for v in out))  # as the swarm's: the microbatches' loss / M, summed
        else:
            sched.step()
        worker.step(step)
        times.append(time.time())
        cpu.append(time.process_time())
    dist.barrier()
    return {"times": times, "cpu": cpu, "losses": losses}


def run_torch(args, cfg, schedule: str) -> dict:
    """One torch.distributed.pipelining run: per-step end times (rank 0), CPU per step (all ranks), losses."""
    return run_torch_schedules(args, cfg, (schedule,))[schedule]


def run_torch_schedules(args, cfg, schedules: tuple[str, ...]) -> dict[str, dict]:
    """`run_torch` of each of `schedules`, one after the other in one set of rank processes (each schedule trains
    from the stages' initial weights): {schedule: its run}."""
    import torch.distributed as dist

    ctx = mp.get_context("spawn")
    store = dist.TCPStore(HOST, 0, None, True, timeout=timedelta(seconds=STORE_TIMEOUT_S), wait_for_workers=False)
    res_q = ctx.Queue()
    procs = [ctx.Process(target=torch_rank, args=(r, args.stages, store.port, cfg.to_dict(), schedules,
                                                    args.threads_per_peer, res_q), daemon=True)
             for r in range(args.stages)]
    for p in procs:
        p.start()
    STARTED.update(p.pid for p in procs)
    results, deadline = {}, time.monotonic() + RUN_TIMEOUT_S * len(schedules)
    try:
        while len(results) < len(procs):
            r = res_q.get(timeout=max(1.0, deadline - time.monotonic()))
            if "error" in r:
                raise RuntimeError(f"torch rank {r['rank']} ({', '.join(schedules)}) failed:\n{r['error']}")
            results[r["rank"]] = r
        for p in procs:
            p.join(timeout=60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        del store
    w = args.warmup
    return {s: {"period_s": _period(results[0]["runs"][s]["times"][w:]),
                "cpu_s": sum(_per_step(results[r]["runs"][s]["cpu"][w:]) for r in results),
                "losses": results[args.stages - 1]["runs"][s]["losses"], "threads": results[0]["threads"]}
            for s in schedules}


# ---------------------------------------------------------------- the swarm (checkfree local)

def run_swarm(args, out: Path, schedule: str, transport: str, extra: list[str] = ()) -> dict:
    """One failure-free `checkfree local` run, watched from /proc: wall time and CPU per step, losses. `extra`:
    more flags of `checkfree local` (benchmarks.accelerator: the device, --bf16, the microbatch size)."""
    cmd = swarm_command(args, "checkfree", args.steps, out, ["--schedule", schedule, "--transport", transport, *extra])
    log_path = out.with_suffix(".log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        STARTED.add(proc.pid)
        try:
            with SwarmMonitor(proc.pid, out / "metrics.jsonl", interval=0.25) as mon:
                deadline = time.monotonic() + RUN_TIMEOUT_S
                while (code := proc.poll()) is None and time.monotonic() < deadline:
                    SOCKETS.update(held_socket_files(set(mon.roles)))
                    time.sleep(1.0)
        finally:
            if proc.poll() is None:  # the launcher takes its swarm down on SIGTERM
                proc.terminate()
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    DESCENDANTS.update(mon.roles)
    if code is None:
        raise RuntimeError(f"swarm ({schedule}, {transport}) still running after {RUN_TIMEOUT_S:g} s")
    if code != 0:
        raise RuntimeError(f"swarm ({schedule}, {transport}) exited with {code}:\n{log_path.read_text()[-3000:]}")
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    acct = mon.per_step(args.warmup)
    cpu = sum(c["main"] + c["other"] for c in acct["cpu_s"].values()) if acct else float("nan")
    outside = sum(c["main"] + c["other"] for role, c in acct["cpu_s"].items() if role != "peer") + \
        acct["cpu_s"].get("peer", {}).get("main", 0.0) if acct else float("nan")
    return {"period_s": _period([m["time"] for m in metrics[args.warmup:]]), "cpu_s": cpu, "cpu_outside_s": outside,
            "losses": [m["loss"] for m in metrics]}


# ---------------------------------------------------------------- helpers

STARTED: set[int] = set()  # processes this benchmark started (torch ranks, swarm launchers)
DESCENDANTS: set[int] = set()  # every process seen in a swarm's tree (coordinator, peers, DHTs, p2pd)
SOCKETS: set[str] = set()  # hivemind socket files the swarms' processes held


def _period(ends: list[float]) -> float:
    """Median time between consecutive step ends."""
    return statistics.median(b - a for a, b in zip(ends, ends[1:]))


def _per_step(cpu: list[float]) -> float:
    return (cpu[-1] - cpu[0]) / max(1, len(cpu) - 1)


def _spread(values: list[float]) -> str:
    return f"{min(values):.3f}-{max(values):.3f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small")
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--steps", type=int, help="steps per run (default 30; --quick 8)")
    p.add_argument("--warmup", type=int, help="steps left out of every path's times (default 3; --quick 2)")
    p.add_argument("--rounds", type=int, help="rounds (default 5; --quick 2)")
    p.add_argument("--threads-per-peer", type=int, default=1, help="torch threads of every rank and peer")
    p.add_argument("--no-hivemind", action="store_true", help="leave out the swarm over the default transport")
    p.add_argument("--one-torch-launch", action="store_true",
                   help="run the torch schedules one after the other in one set of rank processes (each from the "
                        "initial weights), not each in its own: one start-up less per round, for a check that it "
                        "runs (the second schedule's ranks are warm: not a comparison)")
    p.add_argument("--json", type=Path, help="also write every round's figures here")
    p.add_argument("--quick", action="store_true", help="2 rounds of 8 steps (a check that it runs)")
    args = p.parse_args()
    for key, full, quick in (("rounds", 5, 2), ("steps", 30, 8), ("warmup", 3, 2)):
        if getattr(args, key) is None:
            setattr(args, key, quick if args.quick else full)
    if args.rounds < 1 or args.steps < args.warmup + 3:
        p.error("--rounds must be >= 1 and --steps >= --warmup + 3")
    cfg = bench_config(args)
    from checkfree.data import build_data

    build_data(cfg.data, vocab_size=cfg.model.vocab_size, context_length=cfg.model.context_length,
               seed=cfg.train.seed, microbatch_size=cfg.train.microbatch_size)  # tokenizer and cache, once
    swarm_paths = {k: v for k, v in SWARM_PATHS.items() if not (args.no_hivemind and v[1] == "hivemind")}
    names = [f"torch {s}" for s in TORCH_SCHEDULES] + list(swarm_paths)
    rounds: list[dict[str, dict]] = []
    load0 = os.getloadavg()
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            res: dict[str, dict] = {}
            for name in (names if r % 2 == 0 else names[::-1]):  # (no path always runs after the same one)
                if name in res:  # (a torch schedule run with the other: --one-torch-launch)
                    continue
                if name.startswith("torch "):
                    schedules = TORCH_SCHEDULES if args.one_torch_launch else (name.split()[1],)
                    res.update((f"torch {s}", v) for s, v in run_torch_schedules(args, cfg, schedules).items())
                else:
                    schedule, transport = swarm_paths[name]
                    res[name] = run_swarm(args, Path(tmp) / f"{name.replace(' ', '-')}-{r}", schedule, transport)
            rounds.append(res)
            print(f"round {r + 1}/{args.rounds} (load {os.getloadavg()[0]:.2f}): "
                  + ", ".join(f"{n} {res[n]['period_s']:.4f} s" for n in names), file=sys.stderr, flush=True)
    report(args, names, rounds, load0, os.getloadavg(), time.monotonic() - t_start)


def report(args, names: list[str], rounds: list[dict[str, dict]], load0, load1, took_s: float) -> None:
    threads = rounds[0]["torch gpipe"]["threads"]
    print(f"preset={args.preset} S={args.stages} M={args.microbatches} steps={args.steps} warmup={args.warmup} "
          f"rounds={args.rounds} cores={os.cpu_count()}; torch threads per process: intra-op {threads[0]}, "
          f"inter-op {threads[1]} (torch ranks), intra-op {args.threads_per_peer} (swarm peers, "
          f"--threads-per-peer); load average {load0[0]:.2f} -> {load1[0]:.2f}; {took_s / 60:.1f} min")
    base = "torch gpipe"

    def per_round(a: str, b: str) -> list[float]:
        return [x[a]["period_s"] / x[b]["period_s"] for x in rounds]

    print(f"\n| path | s/step (median) | spread over rounds | CPU-s/step | {base} ÷ path (median, spread; above 1: "
          "faster) | max loss difference to torch gpipe |")
    print("|---|---|---|---|---|---|")
    for name in names:
        periods = [x[name]["period_s"] for x in rounds]
        ratio = per_round(base, name)
        diff = max(max(abs(a - b) for a, b in zip(x[name]["losses"], x[base]["losses"])) for x in rounds)
        print(f"| {name} | {statistics.median(periods):.4f} | {_spread(periods)} | "
              f"{statistics.median(x[name]['cpu_s'] for x in rounds):.3f} | {statistics.median(ratio):.3f} "
              f"({_spread(ratio)}) | {diff:.2e} |")
    swarm_names = [n for n in names if n.startswith("swarm")]
    outside = {n: statistics.median(x[n]["cpu_outside_s"] for x in rounds) for n in swarm_names}
    print("\nswarm CPU-s per step outside the peers' compute threads (coordinator, event loops, DHT, p2pd): "
          + ", ".join(f"{n} {v:.3f}" for n, v in outside.items()))
    steps_ok = all(len(x[n]["losses"]) == args.steps for x in rounds for n in names)
    print(f"losses: every path trained {args.steps} steps: {'yes' if steps_ok else 'NO'}")
    left = sorted(outliving(STARTED | DESCENDANTS))
    files = [f for f in SOCKETS if os.path.exists(f)]
    print(f"left behind: {len(left)} processes, {len(files)} socket files (of {len(STARTED | DESCENDANTS)} started)")
    if args.json:
        args.json.write_text(json.dumps({"rounds": rounds, "load": [load0, load1]}, indent=1))
    best_torch = [min(x[f"torch {s}"]["period_s"] for s in TORCH_SCHEDULES) for x in rounds]
    best_tcp = [min(x[n]["period_s"] for n in swarm_names if " tcp " in n) for x in rounds]
    print(f"swarm/torch-pipelining: {statistics.median(t / s for t, s in zip(best_torch, best_tcp)):.3f}")


if __name__ == "__main__":
    main()
