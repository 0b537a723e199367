"""Summing one stage's gradient across N replica processes: the candidate collectives for stage groups.

A stage group is several data-parallel peers serving one pipeline stage; after each step they must add up
their gradients of that stage. Measured side by side in one run, for N = 2, 3, 4 replica processes and the
parameter count of one middle stage of the `tiny` test config, the `small` preset and the `wide` config of
benchmarks.wan (`small` with d_model 512, 8 heads) as the gradient size (one flat float32 buffer):

(a) torch.distributed gloo as the runtime would use it: a coordinator process hosts a `TCPStore`
    (is_master, port 0, wait_for_workers=False); each replica builds
    `ProcessGroupGloo(PrefixStore(f"g{gen}/", TCPStore(host, port, None, False, timeout=...)), rank, N, timeout)`
    and calls `pg.allreduce([flat]).wait()` (SUM). Group formation (store client + process group, a new
    prefix each time, as when membership changes) is timed too.
(b) hivemind `DecentralizedAverager.step()` (target_group_size = min_group_size = N, one DHT per process
    bootstrapped from the first): matchmaking is inside every step; it computes a mean, so the timed step
    includes the `mul_(N)` that turns it into the sum.
(c) hivemind `AllReduceRunner` driven with a fixed group (peer ids exchanged once, a new runner and group
    id each round, its handlers registered before a barrier): the all-reduce part alone, also a mean
    scaled by N.

Every replica process is started with the spawn context (`--quick`: forked from one server process that has
imported torch and hivemind once, a check that it runs that does not import them in each of its 17 processes); the
processes of one (library, N) are released
together by a barrier before each round; a round's time is its slowest replica's, and the table gives the
median over `--reps` rounds after one warm-up round. Also checked for gloo: whether all ranks' results are
bit-identical (sha256 of the result bytes sent back to the parent), how far they are from a float64
reference sum, and what the survivors of a group see when one member is SIGKILLed before its allreduce.

    python -m benchmarks.collectives            # N = 2, 3, 4; three sizes; 7 reps (about 2-4 minutes)
    python -m benchmarks.collectives --quick    # N = 2, 3; the small preset's stage only; 3 reps; forkserver

The last line is `collectives: gloo/hivemind ratio X.XX`: the hivemind averager's median over gloo's at the
largest size measured, N = 2 (how many times slower the averager is).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import multiprocessing as mp
import os
import queue
import signal
import statistics
import sys
import time
import traceback
from dataclasses import replace
from datetime import timedelta

from checkfree.net.lifeline import (
    held_socket_files,
    outliving,
    process_tree,
    sweep_stale_sockets,
)

HOST = "127.0.0.1"
BARRIER_S = 120.0  # no barrier wait may hang a run for longer
STORE_TIMEOUT_S = 30.0  # gloo groups and store clients of the timed runs
KILL_TIMEOUT_S = 5.0  # the gloo group of the SIGKILL check: its survivors must raise within this


def stage_sizes() -> dict[str, int]:
    """Parameters of one middle stage (stage 1 of 4) of tiny, small and wide."""
    from checkfree.config import preset
    from checkfree.costmodel import stage_params

    small = preset("small")
    # benchmarks.wan's "wide": --preset small --d-model 512 --heads 8 --microbatch-size 8
    wide = replace(small, model=replace(small.model, d_model=512, num_heads=8),
                   train=replace(small.train, microbatch_size=8))
    return {name: stage_params(cfg)[1] for name, cfg in (("tiny", preset("tiny")), ("small", small), ("wide", wide))}


def gradient(rank: int, n: int):
    """Replica `rank`'s gradient of `n` elements: the same on every call, so any process can rebuild the others'."""
    import torch

    return torch.randn(n, generator=torch.Generator().manual_seed(1000 + rank))


def checks(flat, world: int, n: int, *, reference: bool) -> dict:
    """A replica's result (numpy, for the parent to compare across ranks) and its digest; on one replica also its
    distance from the float64 sum, beside that of the float32 sum added up in rank order."""
    import torch

    out = {"sha256": hashlib.sha256(flat.numpy().tobytes()).hexdigest(), "result": flat.numpy().copy()}
    if reference:
        grads = [gradient(r, n) for r in range(world)]
        exact = torch.stack([g.double() for g in grads]).sum(0)
        in_order = grads[0].clone()
        for g in grads[1:]:
            in_order += g
        out["max_abs_err"] = (flat.double() - exact).abs().max().item()
        out["rank_order_err"] = (in_order.double() - exact).abs().max().item()
        out["equals_rank_order_sum"] = bool(torch.equal(flat, in_order))
    return out


class Footprint:
    """What a replica started (processes, hivemind socket files), for the parent to check that none is left."""

    def __init__(self) -> None:
        self.pids: set[int] = set()
        self.sockets: set[str] = set()

    def note(self) -> None:
        """Record this process's descendants and the socket files they (and it) hold now."""
        pids = process_tree(os.getpid())
        self.sockets |= held_socket_files(pids)
        self.pids |= pids - {os.getpid()}


# ---------------------------------------------------------------- worker processes (spawned)

def _worker(body, rank: int, res_q, *args) -> None:
    """Run `body` and send its result (or its traceback) to the parent as the process's last message."""
    try:
        import torch

        torch.set_num_threads(1)
        res_q.put({"rank": rank, "result": body(rank, res_q, *args)})
    except BaseException:  # noqa: BLE001 - the parent reports it
        res_q.put({"rank": rank, "error": traceback.format_exc()})


def store_host(port_q, stop) -> None:
    """The coordinator's side of gloo: it hosts the TCPStore every group of the run rendezvouses through."""
    import torch.distributed as dist

    store = dist.TCPStore(HOST, 0, None, True, timeout=timedelta(seconds=STORE_TIMEOUT_S), wait_for_workers=False)
    port_q.put(store.port)
    stop.wait(600)


def gloo_body(rank, res_q, world, port, sizes, reps, victim_ready, barrier, inbox):
    import torch
    import torch.distributed as dist

    gen = [0]

    def form(timeout_s: float):
        gen[0] += 1
        barrier.wait(BARRIER_S)
        t0 = time.perf_counter()
        client = dist.TCPStore(HOST, port, None, False, timeout=timedelta(seconds=timeout_s))
        pg = dist.ProcessGroupGloo(dist.PrefixStore(f"g{gen[0]}/", client), rank, world, timedelta(seconds=timeout_s))
        return pg, time.perf_counter() - t0

    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    out = {}
    for n in sizes:
        pg, formation = None, []
        for _ in range(1 + reps):  # the first formation is the warm-up
            # the previous group is destroyed before the next one forms, but only once every rank is done with it:
            # a rank that closed its connections while another still ran connectFullMesh on that group made the
            # other fail with "Connection closed by peer" (seen in CI)
            barrier.wait(BARRIER_S)
            pg = None
            pg, dt = form(STORE_TIMEOUT_S)
            formation.append(dt)
        src, flat, times = gradient(rank, n), torch.empty(n), []
        for _ in range(1 + reps):
            flat.copy_(src)
            barrier.wait(BARRIER_S)
            t0 = time.perf_counter()
            pg.allreduce([flat], opts).wait()
            times.append(time.perf_counter() - t0)
        out[n] = {"times": times[1:], "formation": formation[1:], **checks(flat, world, n, reference=rank == 0)}
        barrier.wait(BARRIER_S)  # every rank's allreduce is over before any closes the group
        del pg
    out["kill"] = gloo_kill(rank, res_q, world, form, opts, inbox, victim_ready)
    return out


def gloo_kill(rank, res_q, world, form, opts, inbox, victim_ready) -> dict:
    """One allreduce that works, then the last rank waits to be SIGKILLed by the parent; the others start their
    next allreduce once it is dead and report what it did and how long it took. The victim says it is ready
    with an Event, not on the shared result queue: a process killed while its queue's feeder thread still
    holds the queue's write lock would block every other writer for good."""
    import torch

    pg, _ = form(KILL_TIMEOUT_S)
    x = torch.ones(1024)
    pg.allreduce([x], opts).wait()
    if rank == world - 1:
        victim_ready.set()
        time.sleep(600)  # the parent kills this process here
    res_q.put({"rank": rank, "ready": True})
    inbox.get(timeout=BARRIER_S)  # the victim is dead
    t0 = time.perf_counter()
    try:
        pg.allreduce([x], opts).wait()
        raised = None
    except Exception as e:  # noqa: BLE001 - what the survivors see is the measurement
        first = (str(e).splitlines() or [""])[0].split(". This is typically")[0]
        raised = f"{type(e).__name__}: {first[:200]}"
    return {"raised": raised, "after_s": time.perf_counter() - t0}


def averager_body(rank, res_q, world, sizes, reps, barrier, inbox):
    os.environ.setdefault("HIVEMIND_LOGLEVEL", "ERROR")  # not its advice on group sizes in every process
    import torch
    from hivemind.averaging import DecentralizedAverager
    from hivemind.dht import DHT

    # hivemind's DHT and averager are child processes that it builds to be forked (a spawned replica would
    # otherwise spawn them too, and they do not pickle)
    mp.set_start_method("fork", force=True)
    t0 = time.perf_counter()
    if rank == 0:
        dht = DHT(start=True)
        res_q.put({"rank": rank, "boot": [str(a) for a in dht.get_visible_maddrs()]})
    else:
        dht = DHT(start=True, initial_peers=inbox.get(timeout=BARRIER_S))
    out, footprint = {"start_s": time.perf_counter() - t0}, Footprint()
    try:
        for n in sizes:
            barrier.wait(BARRIER_S)
            t0 = time.perf_counter()
            avg = DecentralizedAverager([torch.zeros(n)], dht, start=True, prefix=f"cb{n}",
                                        target_group_size=world, min_group_size=world, min_matchmaking_time=2.0,
                                        request_timeout=1.0)
            averager_start = time.perf_counter() - t0
            footprint.note()
            try:
                src, times, failed = gradient(rank, n), [], 0
                for _ in range(1 + reps):
                    with avg.get_tensors() as (t,):
                        t.copy_(src)
                    barrier.wait(BARRIER_S)
                    t0 = time.perf_counter()
                    ok = avg.step(timeout=30) is not None
                    with avg.get_tensors() as (t,):
                        t.mul_(world)  # the averager's mean -> the sum
                    times.append(time.perf_counter() - t0)
                    failed += not ok
                with avg.get_tensors() as (t,):
                    result = t.clone()
                out[n] = {"times": times[1:], "failed": failed, "averager_start_s": averager_start,
                          **checks(result, world, n, reference=rank == 0)}
            finally:
                # hivemind's averager never closes the P2P client it opens on the DHT's daemon, so its socket
                # file would stay in /tmp: remove the files it held that nothing listens on once it is gone
                held = held_socket_files({avg.pid})
                avg.shutdown()
                sweep_stale_sockets(min_age_s=0, among=held)
    finally:
        dht.shutdown()
    return {**out, "pids": footprint.pids, "sockets": footprint.sockets}


def runner_body(rank, res_q, world, sizes, reps, barrier, inbox):
    return asyncio.run(_runner(rank, res_q, world, sizes, reps, barrier, inbox))


async def _runner(rank, res_q, world, sizes, reps, barrier, inbox):
    os.environ.setdefault("HIVEMIND_LOGLEVEL", "ERROR")
    import torch
    from hivemind.averaging.allreduce import AllReduceRunner
    from hivemind.p2p import P2P, PeerID
    from multiaddr import Multiaddr

    loop = asyncio.get_running_loop()

    async def wait() -> None:
        await loop.run_in_executor(None, barrier.wait, BARRIER_S)

    t0 = time.perf_counter()
    p2p = await P2P.create()
    footprint = Footprint()
    try:
        footprint.note()
        res_q.put({"rank": rank, "boot": (p2p.peer_id.to_base58(), [str(a) for a in await p2p.get_visible_maddrs()])})
        peers = await loop.run_in_executor(None, inbox.get, True, BARRIER_S)  # every rank's (peer id, maddrs)
        ids = [PeerID.from_base58(pid) for pid, _ in peers]
        for r, (_, maddrs) in enumerate(peers):
            if r != rank:
                await p2p._client.connect(ids[r], [Multiaddr(a) for a in maddrs])
        out = {"start_s": time.perf_counter() - t0}
        for n in sizes:
            src, buf, times = gradient(rank, n), torch.empty(n), []
            for i in range(1 + reps):
                buf.copy_(src)
                prefix = f"cb{n}r{i}"
                runner = AllReduceRunner(p2p=p2p, servicer_type=AllReduceRunner, prefix=prefix,
                                         group_id=prefix.encode(), tensors=[buf], ordered_peer_ids=ids,
                                         peer_fractions=(1.0 / world,) * world)
                await runner.add_p2p_handlers(p2p, namespace=prefix)
                await wait()  # every member's handlers are up
                t0 = time.perf_counter()
                async for delta in runner:
                    buf.add_(delta)
                buf.mul_(world)  # mean -> sum
                times.append(time.perf_counter() - t0)
                await wait()  # every member has its result: nobody calls these handlers any more
                await runner.remove_p2p_handlers(p2p, namespace=prefix)
            out[n] = {"times": times[1:], **checks(buf, world, n, reference=rank == 0)}
        return {**out, "pids": footprint.pids, "sockets": footprint.sockets}
    finally:
        await p2p.shutdown()


# ---------------------------------------------------------------- the parent

STARTED: list = []  # every process the parent starts: all must have ended when it reports


class Group:
    """N spawned replica processes running `body`; their messages, and their end (always, in `close`)."""

    def __init__(self, ctx, body, world: int, *args) -> None:
        self.world, self.res_q, self.killed = world, ctx.Queue(), None
        self.barrier = ctx.Barrier(world)
        self.inboxes = [ctx.Queue() for _ in range(world)]
        self.procs = [ctx.Process(target=_worker, name=f"replica-{r}",
                                  args=(body, r, self.res_q, world, *args, self.barrier, self.inboxes[r]))
                      for r in range(world)]
        for p in self.procs:
            p.start()
        STARTED.extend(self.procs)

    def next(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            try:
                msg = self.res_q.get(timeout=1.0)
            except queue.Empty:
                dead = [p for p in self.procs if p.exitcode not in (None, 0, -signal.SIGKILL)]
                if dead:
                    raise RuntimeError(f"replica process {dead[0].name} exited with {dead[0].exitcode}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no message from the replicas in {timeout:.0f} s")
                continue
            if "error" in msg:
                raise RuntimeError(f"replica {msg['rank']} failed:\n{msg['error']}")
            return msg

    def results(self, timeout: float, on_boot=None, on_ready=None) -> list:
        """Every replica's result, by rank; `boot` and `ready` messages go to the callbacks on the way."""
        out: dict[int, dict] = {}
        boots: dict[int, object] = {}
        ready: set[int] = set()
        while len(out) < self.world - (self.killed is not None):
            msg = self.next(timeout)
            if "boot" in msg:
                boots[msg["rank"]] = msg["boot"]
                on_boot(self, boots)
            elif "ready" in msg:
                ready.add(msg["rank"])
                on_ready(self, ready)
            else:
                out[msg["rank"]] = msg["result"]
        return [out.get(r) for r in range(self.world)]

    def kill(self, rank: int) -> None:
        self.procs[rank].kill()
        self.procs[rank].join(10)
        self.killed = rank

    def close(self) -> None:
        for p in self.procs:
            p.join(15)
        for p in self.procs:
            if p.is_alive():  # a failed run: the replica, and whatever it started (hivemind's DHT, p2pd)
                family = process_tree(p.pid) - {p.pid}
                p.terminate()
                p.join(5)
                if p.is_alive():
                    p.kill()
                    p.join(5)
                for pid in family:
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)
        for q in (self.res_q, *self.inboxes):
            q.close()
            q.join_thread()


def run_gloo(ctx, world: int, sizes: list[int], reps: int) -> list:
    port_q, stop, victim_ready = ctx.Queue(), ctx.Event(), ctx.Event()
    host = ctx.Process(target=store_host, args=(port_q, stop), name="store-host")
    host.start()
    STARTED.append(host)
    group = None
    try:
        port = port_q.get(timeout=60)
        group = Group(ctx, gloo_body, world, port, sizes, reps, victim_ready)
        return group.results(300, on_ready=lambda g, ready: _kill_last(g, ready, victim_ready))
    finally:
        if group is not None:
            group.close()
        stop.set()
        host.join(10)
        if host.is_alive():
            host.kill()
            host.join(5)
        port_q.close()
        port_q.join_thread()


def _kill_last(g: Group, ready: set, victim_ready) -> None:
    """The kill check: once the others are ready, SIGKILL the last rank (it waits for it), then let the
    survivors run their allreduce."""
    if len(ready) < g.world - 1:
        return
    if not victim_ready.wait(BARRIER_S):
        raise TimeoutError("the last rank never got ready for the kill check")
    g.kill(g.world - 1)
    for r in range(g.world - 1):
        g.inboxes[r].put(True)


def _broadcast_boot(g: Group, boots: dict) -> None:
    if len(boots) == 1 and 0 in boots and g.world > 1 and not isinstance(boots[0], tuple):
        for r in range(1, g.world):  # the averagers' DHTs bootstrap from the first
            g.inboxes[r].put(boots[0])
    elif len(boots) == g.world and isinstance(boots[0], tuple):
        for r in range(g.world):  # the runners connect to everyone
            g.inboxes[r].put([boots[i] for i in range(g.world)])


def run_hivemind(ctx, body, world: int, sizes: list[int], reps: int) -> list:
    group = Group(ctx, body, world, sizes, reps)
    try:
        return group.results(300, on_boot=_broadcast_boot)
    finally:
        group.close()


def round_ms(per_rank: list, n: int, key: str = "times") -> float:
    """Median over rounds of the slowest replica's time, in ms."""
    rows = [r[n][key] for r in per_rank if r is not None]
    return statistics.median(max(ts) for ts in zip(*rows)) * 1e3


def agreement(per_rank: list, n: int) -> tuple[bool, str]:
    """Whether the replicas' results are bit-identical, and if not, by how much they differ."""
    per_rank = [r for r in per_rank if r is not None]
    results = [r[n].pop("result") for r in per_rank]
    if len({r[n]["sha256"] for r in per_rank}) == 1:
        return True, "bit-identical across ranks"
    differ = max(float((x != results[0]).mean()) for x in results[1:])
    spread = max(float(abs(x - results[0]).max()) for x in results[1:])
    return False, f"NOT bit-identical across ranks ({differ:.1%} of elements differ, by up to {spread:.3g})"


def error_note(c: dict) -> str:
    return (f"max |result - float64 sum| {c['max_abs_err']:.3g} (the float32 sum in rank order: "
            f"{c['rank_order_err']:.3g}; equal to it: {'yes' if c['equals_rank_order_sum'] else 'no'})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="N = 2, 3; the small preset's stage only; 3 reps; replicas forked from a server that has "
                        "imported torch and hivemind")
    p.add_argument("--reps", type=int, default=None, help="timed rounds per measurement (default 7, --quick 3)")
    p.add_argument("--replicas", type=int, nargs="+", default=None, help="N values (default 2 3 4, --quick 2 3)")
    p.add_argument("--configs", nargs="+", choices=("tiny", "small", "wide"), default=None,
                   help="whose middle stage sizes the gradient (default all three, --quick small)")
    p.add_argument("--no-runner", action="store_true", help="skip (c), hivemind's AllReduceRunner")
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the finally blocks end the children

    named = stage_sizes()
    sizes = sorted(named[c] for c in (args.configs or (["small"] if args.quick else named)))
    worlds = args.replicas or ([2, 3] if args.quick else [2, 3, 4])
    reps = args.reps or (3 if args.quick else 7)
    names = {v: k for k, v in named.items()}
    print("gradient sizes (one middle stage): " + ", ".join(f"{names[n]} {n:,}" for n in sizes)
          + f"; N = {', '.join(map(str, worlds))}; 1 warm-up + {reps} timed rounds each", flush=True)
    ctx = mp.get_context("forkserver" if args.quick else "spawn")
    if args.quick:
        ctx.set_forkserver_preload(["torch", "torch.distributed", "hivemind", "benchmarks.collectives"])
    started = time.perf_counter()

    def progress(what: str) -> None:
        print(f"[{time.perf_counter() - started:5.0f} s] {what}", file=sys.stderr, flush=True)

    rows, notes, medians, identical, kills = [], [], {}, {}, {}
    grandchildren, sockets = set(), set()  # what the hivemind replicas started

    def hivemind(body, world: int, what: str, start: str) -> list:
        res = run_hivemind(ctx, body, world, sizes, reps)
        grandchildren.update(*(r["pids"] for r in res))
        sockets.update(*(r["sockets"] for r in res))
        progress(f"N={world}: {what} done")
        notes.append(f"{what} N={world}: {start} took "
                     f"{statistics.median(r['start_s'] for r in res) * 1e3:.0f} ms (median of the ranks)")
        return res

    for world in worlds:
        res = run_gloo(ctx, world, sizes, reps)
        progress(f"N={world}: gloo done")
        for n in sizes:
            medians["gloo", world, n] = ms = round_ms(res, n)
            rows.append(("gloo allreduce (SUM)", world, n, ms, f"{round_ms(res, n, 'formation'):.1f}"))
            same, text = agreement(res, n)
            identical.setdefault(world, []).append(same)
            notes.append(f"gloo N={world} size {n:,}: {text}; {error_note(res[0][n])}")
        kills[world] = [r["kill"] for r in res[:-1]]

        res = hivemind(averager_body, world, "hivemind averager", "a process's DHT start")
        for n in sizes:
            medians["averager", world, n] = ms = round_ms(res, n)
            rows.append(("hivemind DecentralizedAverager.step, x N", world, n, ms, "n/a: matchmaking in every step"))
            notes.append(f"averager N={world} size {n:,}: {agreement(res, n)[1]}; {error_note(res[0][n])}; "
                         f"failed steps {max(r[n]['failed'] for r in res)}; averager start "
                         f"{statistics.median(r[n]['averager_start_s'] for r in res) * 1e3:.0f} ms")
        if args.no_runner:
            continue
        res = hivemind(runner_body, world, "hivemind AllReduceRunner", "P2P start + connecting to the group")
        for n in sizes:
            medians["runner", world, n] = ms = round_ms(res, n)
            rows.append(("hivemind AllReduceRunner, fixed group, x N", world, n, ms, "n/a: fixed peer list"))
            notes.append(f"runner N={world} size {n:,}: {agreement(res, n)[1]}; {error_note(res[0][n])}")
    if args.no_runner:
        notes.append("(c) hivemind AllReduceRunner: skipped (--no-runner)")

    print("\n| library | N | size (elements) | median ms | group formation ms |")
    print("|---|---|---|---|---|")
    for lib, world, n, ms, form in rows:
        print(f"| {lib} | {world} | {n:,} | {ms:.1f} | {form} |")
    print()
    for line in notes:
        print(line)
    print("gloo bit-identity: "
          + ", ".join(f"N={w} {'identical' if all(v) else 'DIFFERENT'}" for w, v in identical.items()))
    for world, ks in kills.items():
        raised = all(k["raised"] for k in ks)
        within = raised and max(k["after_s"] for k in ks) <= KILL_TIMEOUT_S + 1.0
        print(f"gloo kill check N={world}: last rank SIGKILLed before its allreduce; the survivors "
              + ("raised" if raised else "DID NOT ALL RAISE") + " after "
              + ", ".join("%.0f" % (k["after_s"] * 1e3) for k in ks) + " ms ("
              + ("within" if within else "NOT within") + f" the {KILL_TIMEOUT_S:.0f} s timeout): {ks[0]['raised']}")
    left = sorted(outliving({p.pid for p in STARTED} | grandchildren))
    files = [f for f in sockets if os.path.exists(f)]
    print(f"left behind: {len(left)} processes, {len(files)} socket files (of {len(STARTED) + len(grandchildren)} "
          f"processes and {len(sockets)} hivemind socket files this run started){': ' if left or files else ''}"
          + " ".join(map(str, left + files)))
    print(f"total {time.perf_counter() - started:.0f} s")
    largest, w = max(sizes), min(worlds)  # N = 2 unless --replicas leaves it out
    ratio = medians["averager", w, largest] / medians["gloo", w, largest]
    print(f"collectives: gloo/hivemind ratio {ratio:.2f}")


if __name__ == "__main__":
    main()
