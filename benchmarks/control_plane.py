"""The control plane at scale: the coordinator's CPU, messages and bytes per step against the number of peers.

In-process tier (the real `Coordinator` and `PeerDaemon`s in one event loop over the memory transport,
`harness.inprocess`), N = S x R peers in stage groups (S = 8 stages, R = 1, 2, 4, 8 replicas each: N = 8, 16,
32, 64) on a model small enough that compute is not the bottleneck (the tiny preset's shapes, one block per
stage). Per step, from the second step on:

* coordinator CPU seconds: the coordinator's own share of the one process. Each would-be process runs in its own
  `contextvars` context (`harness.inprocess.ROLE`, inherited by every task it spawns; the memory transport runs
  a request's handler in the serving transport's context), and every callback the event loop runs
  (`asyncio.Handle._run`: each step of each task) is timed with `time.thread_time()` and charged to the role of
  its context. The coordinator's share is thus exactly the event-loop time of its coroutines: its handlers, its
  loops, encoding its requests and decoding their replies (work it would do in its own process; the peers'
  compute threads are not in it);
* messages the coordinator sent and received (requests and replies) and their bytes (the encoded wire frames,
  counted where the memory transport decodes them), by RPC;
* DHT records stored (heartbeats; the memory DHT's `store` calls, by role);
* the runtime's default timeouts (`checkfree.protocol.Timeouts`: heartbeat TTL 4 s), as a real run has them;
* the step's wall time and the coordinator's CPU share of it.

The coordinator's CPU per step is fitted against N on log-log axes (least squares): the growth exponent. With
`--profile`, cProfile runs over the smallest and the largest N and the coordinator's functions (coordinator/) are
ranked by how their time per step grew (over N's growth): what grows faster than the peers.

Real processes (`--real`, N = 8 and 16 by default): `checkfree local` (coordinator, peers, their DHT processes and
p2pd daemons), watched through /proc (`benchmarks.swarmmon`): coordinator CPU per step and the DHT processes'
CPU; a hivemind DHT client joined to the swarm polls the run's member records and counts, per peer, how often
its heartbeat record was refreshed (records per second per peer).

    python -m benchmarks.control_plane                  # N = 8, 16, 32, 64; table, plot, fit
    python -m benchmarks.control_plane --real           # also N = 8, 16 as real processes with the DHT
    python -m benchmarks.control_plane --quick          # N = 8, 16 (S = 4 x R = 2, 4); last line: the exponent
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import cProfile
import json
import math
import os
import pstats
import statistics
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from harness.inprocess import ROLE, InProcessSwarm
from checkfree.config import RunConfig, preset
from checkfree.net.in_memory import MemoryDHT, MemoryTransport
from checkfree.protocol import Timeouts
from checkfree.rundir import read_jsonl
from coordinator.coordinator import Coordinator

RESULTS = Path(__file__).parent / "results"
SERVING: contextvars.ContextVar[str] = contextvars.ContextVar("control_plane_serving", default="")  # the RPC a task answers


@dataclass
class Tally:
    """What one role did: event-loop CPU seconds, messages and bytes, DHT stores; by RPC for the coordinator."""

    cpu_s: float = 0.0
    sent: int = 0
    received: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    dht_stores: int = 0
    by_rpc: Counter = field(default_factory=Counter)
    cpu_answering: Counter = field(default_factory=Counter)  # CPU seconds spent answering each RPC

    def minus(self, other: Tally) -> Tally:
        return Tally(self.cpu_s - other.cpu_s, self.sent - other.sent, self.received - other.received,
                     self.bytes_sent - other.bytes_sent, self.bytes_received - other.bytes_received,
                     self.dht_stores - other.dht_stores, self.by_rpc - other.by_rpc,
                     Counter({k: v - other.cpu_answering[k] for k, v in self.cpu_answering.items()}))


class Meter:
    """Instruments the event loop, the memory transport and the memory DHT of this process (while installed):
    CPU, messages and DHT stores by `ROLE`, and a snapshot at the end of every coordinator step."""

    def __init__(self, profile: cProfile.Profile | None = None, steps: int = 0) -> None:
        # the profile runs from the second step's end to the second-to-last's (the last one evaluates after it)
        self.profile, self.num_steps = profile, steps
        self.tally: dict[str, Tally] = defaultdict(Tally)
        self.roles: dict[str, str] = {}  # memory transport peer id -> role
        self.steps: list[tuple[float, Tally, Tally]] = []  # (time, coordinator's, peers') at each step's end
        self.stores: dict[str, list[float]] = defaultdict(list)  # DHT store times by storing peer

    def store_rate(self, peers: set[str]) -> float:
        """DHT records stored per second per peer (each peer over the span of its own stores, whole run)."""
        rates = [(len(t) - 1) / (t[-1] - t[0]) for p, t in self.stores.items() if p in peers and len(t) > 1]
        return statistics.fmean(rates) if rates else math.nan

    def _copy(self, role: str) -> Tally:
        t = self.tally[role]
        return Tally(t.cpu_s, t.sent, t.received, t.bytes_sent, t.bytes_received, t.dht_stores, Counter(t.by_rpc),
                     Counter(t.cpu_answering))

    @contextmanager
    def installed(self) -> Iterator[Meter]:
        meter = self
        originals = (asyncio.events.Handle._run, MemoryTransport.__init__, MemoryTransport._serve, MemoryDHT.store,
                     Coordinator._step_done)
        handle_run, transport_init, serve, store, step_done = originals

        def timed_run(handle: asyncio.events.Handle) -> None:
            ctx = handle._context  # noqa: SLF001
            role = ctx.get(ROLE, "other") if ctx is not None else "other"
            t0 = time.thread_time()
            try:
                handle_run(handle)
            finally:
                t = meter.tally[role]
                dt = time.thread_time() - t0
                t.cpu_s += dt
                if ctx is not None and (rpc := ctx.get(SERVING, "")):
                    t.cpu_answering[rpc] += dt

        def init(transport: MemoryTransport, *args, **kwargs) -> None:
            transport_init(transport, *args, **kwargs)
            meter.roles[transport.peer_id] = ROLE.get()

        async def counted_serve(transport: MemoryTransport, name: str, frames: list, caller: str) -> list:
            SERVING.set(name)  # in this request's task only: its CPU is charged to answering `name`
            reply = await serve(transport, name, frames, caller)
            request_bytes = sum(memoryview(f).nbytes for f in frames)
            reply_bytes = sum(memoryview(f).nbytes for f in reply)
            for role, out, n_in, n_out in ((meter.roles.get(caller, "other"), name, reply_bytes, request_bytes),
                                           (meter.roles.get(transport.peer_id, "other"), None, request_bytes,
                                            reply_bytes)):
                t = meter.tally[role]
                t.sent, t.received = t.sent + 1, t.received + 1
                t.bytes_sent, t.bytes_received = t.bytes_sent + n_out, t.bytes_received + n_in
                t.by_rpc[f"{'calls' if out else 'answers'} {name}"] += 1
            return reply

        def counted_store(dht: MemoryDHT, *args, **kwargs):
            meter.tally[ROLE.get()].dht_stores += 1
            meter.stores[dht.peer_id].append(time.perf_counter())
            return store(dht, *args, **kwargs)

        def marked_step_done(coordinator: Coordinator, next_step: int) -> None:
            meter.steps.append((time.perf_counter(), meter._copy("coordinator"), meter._copy("peer")))
            if meter.profile is not None and len(meter.steps) in (2, meter.num_steps - 1):
                (meter.profile.enable if len(meter.steps) == 2 else meter.profile.disable)()
            step_done(coordinator, next_step)

        asyncio.events.Handle._run = timed_run
        MemoryTransport.__init__, MemoryTransport._serve, MemoryDHT.store = init, counted_serve, counted_store
        Coordinator._step_done = marked_step_done
        try:
            yield self
        finally:
            asyncio.events.Handle._run = handle_run
            MemoryTransport.__init__, MemoryTransport._serve, MemoryDHT.store = transport_init, serve, store
            Coordinator._step_done = step_done


def swarm_config(stages: int, replicas: int, steps: int, microbatches: int) -> RunConfig:
    """The tiny preset's shapes, one block per stage, `replicas` per stage (no reserve), no evaluation."""
    cfg = preset("tiny")
    cfg.num_stages, cfg.model.num_layers = stages, stages
    cfg.train.replicas, cfg.train.reserve = replicas, 0
    cfg.train.num_steps, cfg.train.eval_every = steps, 0
    cfg.train.num_microbatches = microbatches
    cfg.train.device = "cpu"
    return cfg


def measure(stages: int, replicas: int, steps: int, microbatches: int, out: Path,
            profile: cProfile.Profile | None = None) -> dict:
    """One in-process run of `steps` steps; per-step figures from the second step's end to the second-to-last's
    (the first step carries the start, the last the final evaluation)."""
    cfg = swarm_config(stages, replicas, steps, microbatches)
    meter = Meter(profile, steps)
    with meter.installed():
        # the runtime's own timeouts (the tests' are shorter): a peer not contacted for a heartbeat TTL asks the
        # coordinator for its STATUS, so a TTL shorter than a step adds polls
        swarm = InProcessSwarm(cfg, out, stages * replicas, {"save_final": False}, timeouts=Timeouts())
        summary = asyncio.run(swarm.run())
    if summary is None or summary.get("status") != "completed":
        raise RuntimeError(f"N={stages * replicas}: the run did not complete: {summary}")
    (t0, c0, p0), (t1, c1, p1) = meter.steps[1], meter.steps[-2]
    n = len(meter.steps) - 3
    coord, peers = c1.minus(c0), p1.minus(p0)
    wall = (t1 - t0) / n
    live = read_jsonl(out / "metrics.jsonl")[-2]["live_peers"]  # a peer refused at the start is not replaced
    return {"peers": stages * replicas, "stages": stages, "replicas": replicas, "steps": n, "live_peers": live,
            "coordinator_setup_cpu_s": meter.steps[0][1].cpu_s, "coordinator_cpu_s": coord.cpu_s / n,
            "coordinator_cpu_answering_s": {k: v / n for k, v in sorted(coord.cpu_answering.items()) if v > 0},
            "peers_loop_cpu_s": peers.cpu_s / n, "wall_s": wall,
            "coordinator_share": coord.cpu_s / n / wall,
            "messages_sent": coord.sent / n, "messages_received": coord.received / n,
            "bytes_sent": coord.bytes_sent / n, "bytes_received": coord.bytes_received / n,
            "peer_dht_stores_per_s": meter.store_rate({p for p, role in meter.roles.items() if role == "peer"}),
            "by_rpc": {k: v / n for k, v in sorted(coord.by_rpc.items())}}


def growth_exponent(ns: list[int], values: list[float]) -> float:
    """Least-squares slope of log(value) against log(N)."""
    xs, ys = [math.log(n) for n in ns], [math.log(v) for v in values]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def scheduler_functions(prof: cProfile.Profile, steps: int) -> dict[str, tuple[float, float]]:
    """(own seconds, calls) per step of every function in coordinator/ (cProfile's tottime, ncalls) over the
    profiled steps, by 'file:line function'."""
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    return {f"{Path(f).name}:{line} {fn}": (row[2] / steps, row[1] / steps) for (f, line, fn), row in stats.items()
            if f"{os.sep}coordinator{os.sep}" in f}


def plot(rows: list[dict], exponent: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    ns = [r["peers"] for r in rows]
    fig, ax = plt.subplots(figsize=(5.5, 4))
    ax.loglog(ns, [r["coordinator_cpu_s"] * 1e3 for r in rows], "o-", label="coordinator CPU per step")
    ax.loglog(ns, [r["wall_s"] * 1e3 for r in rows], "s--", label="step wall time")
    cpu0 = rows[0]["coordinator_cpu_s"] * 1e3
    ax.loglog(ns, [cpu0 * n / ns[0] for n in ns], ":", color="grey", label="linear in N (from the first point)")
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.set_xlabel("peers N (8 stages x R replicas)")
    ax.set_ylabel("ms per step")
    ax.set_title(f"coordinator CPU per step ~ N^{exponent:.2f}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _polls(row: dict) -> float:
    """Coordinator CPU seconds per step spent answering STATUS (peers not contacted for a heartbeat TTL ask)."""
    return sum(v for k, v in row["coordinator_cpu_answering_s"].items() if k.endswith("status"))


def table(rows: list[dict]) -> list[str]:
    lines = ["| N | S x R | live peers | coordinator CPU ms/step | of it answering STATUS polls | step wall ms | "
             "coordinator share | msgs sent/step | "
             "msgs received/step | KiB sent/step | KiB received/step | peer DHT stores/s/peer | coordinator CPU ms "
             "until step 0 ends |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['peers']} | {r['stages']} x {r['replicas']} | {r['live_peers']} | "
                     f"{r['coordinator_cpu_s'] * 1e3:.1f} | {_polls(r) * 1e3:.1f} | {r['wall_s'] * 1e3:.0f} | {r['coordinator_share']:.2f} | {r['messages_sent']:.0f} | "
                     f"{r['messages_received']:.0f} | {r['bytes_sent'] / 1024:.1f} | "
                     f"{r['bytes_received'] / 1024:.1f} | {r['peer_dht_stores_per_s']:.2f} | "
                     f"{r['coordinator_setup_cpu_s'] * 1e3:.0f} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", type=int, default=8)
    ap.add_argument("--replicas", type=int, nargs="*", default=[1, 2, 4, 8])
    ap.add_argument("--steps", type=int, default=8,
                    help="steps per run (the first and the last, which evaluates after it, are not measured)")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--profile", action="store_true", help="cProfile the smallest and largest N: what grows")
    ap.add_argument("--real", action="store_true", help="also N = S x R in --real-replicas as real processes")
    ap.add_argument("--real-replicas", type=int, nargs="*", default=[1, 2])
    ap.add_argument("--json", type=Path, default=None, help="write the results here too")
    ap.add_argument("--render", type=Path, default=None, help="print the tables of a --json result file and exit")
    ap.add_argument("--plot", type=Path, default=None,
                    help="the PNG of CPU per step against N (default benchmarks/results/control-plane.png; none with "
                         "--quick)")
    ap.add_argument("--quick", action="store_true",
                    help="S = 4, R = 2, 4, 5 steps (both with stage groups: R = 1 against 2 would measure turning "
                         "stage groups on, not growth with N)")
    args = ap.parse_args(argv)
    if args.render is not None:
        print("\n".join(render(json.loads(args.render.read_text()))))
        return
    if args.quick:
        args.stages, args.replicas, args.steps, args.microbatches = 4, [2, 4], 5, 4
    elif args.plot is None:
        args.plot = RESULTS / "control-plane.png"
    import torch

    torch.set_num_threads(1)
    load_start = os.getloadavg()[0]
    rows, profiles = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in args.replicas:
            rows.append(measure(args.stages, r, args.steps, args.microbatches, Path(tmp) / f"R{r}"))
            print(f"N={rows[-1]['peers']}: coordinator {rows[-1]['coordinator_cpu_s'] * 1e3:.1f} ms CPU/step, "
                  f"step {rows[-1]['wall_s'] * 1e3:.0f} ms (load {os.getloadavg()[0]:.1f})", flush=True)
        # separate runs under cProfile (its overhead stays out of the table): the smallest grouped N and the largest
        for r in sorted({args.replicas[min(1, len(args.replicas) - 1)], args.replicas[-1]}) if args.profile else ():
            prof = cProfile.Profile(time.thread_time)  # CPU time: a preemption is not charged to a function
            measure(args.stages, r, args.steps, args.microbatches, Path(tmp) / f"profile-R{r}", prof)
            profiles[args.stages * r] = scheduler_functions(prof, args.steps - 3)
    ns = [r["peers"] for r in rows]
    result = {"inprocess": rows, "exponent": growth_exponent(ns, [r["coordinator_cpu_s"] for r in rows]),
              "exponent_without_polls": growth_exponent(ns, [r["coordinator_cpu_s"] - _polls(r) for r in rows]),
              "growth": report_growth(profiles), "load_start": load_start, "real": [], "load_end": 0.0}
    if args.real:
        result["real"] = run_real(args)
    result["load_end"] = os.getloadavg()[0]
    if args.plot is not None:
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        plot(rows, result["exponent"], args.plot)
        print(f"plot: {args.plot}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    print("\n".join(render(result)))


def render(result: dict) -> list[str]:
    """Everything the run measured as printed and as docs/control-plane.md carries it; the last line is the
    coordinator's CPU growth exponent."""
    rows = result["inprocess"]
    lines = [f"load average {result['load_start']:.1f} at the start, {result['load_end']:.1f} at the end", "",
             *table(rows), "", "coordinator messages per step by RPC, smallest and largest N:"]
    lines += [f"- N={r['peers']}: " + ", ".join(f"{k} {v:.1f}" for k, v in r["by_rpc"].items())
              for r in (rows[0], rows[-1])]
    if result["growth"]:  # (markdown: a list after a blank line)
        lines += ["", result["growth"][0], *(f"- {g.strip()}" for g in result["growth"][1:])]
    if result["real"]:
        lines += ["", *real_table(result["real"])]
    return [*lines, "", "coordinator cpu growth exponent without answering STATUS polls (their number per step "
                        f"grows with the step's wall time): {result['exponent_without_polls']:.2f}",
            f"coordinator cpu growth exponent: {result['exponent']:.2f}"]


def report_growth(profiles: dict[int, dict[str, tuple[float, float]]]) -> list[str]:
    """The coordinator's functions whose own time per step grew fastest with N (cProfile, steady-state steps of
    two sizes): exponent = log(time growth) / log(N growth), and the calls per step of each."""
    if len(profiles) < 2:
        return []
    (n0, a), (n1, b) = sorted(profiles.items())
    lines = [f"coordinator functions (coordinator/) by growth of their own time per step, N={n0} -> N={n1} "
             f"(cProfile over the steps after the second; N grew x{n1 / n0:.0f}):"]
    rows = []
    for name, (t1, c1) in b.items():
        t0, c0 = a.get(name, (0.0, 0.0))
        if t1 > 2e-5 and t0 > 0:
            rows.append((math.log(t1 / t0) / math.log(n1 / n0), t1, t0, c1, c0, name))
    for e, t1, t0, c1, c0, name in sorted(rows, reverse=True)[:10]:
        lines.append(f"  {name}: {t0 * 1e3:.3f} -> {t1 * 1e3:.3f} ms/step, {c0:.0f} -> {c1:.0f} calls/step "
                     f"(exponent {e:.2f})")
    return lines


def run_real(args: argparse.Namespace) -> list[dict]:
    """N = S x R for R in --real-replicas as real processes with the hivemind DHT; prints their table."""
    from benchmarks.control_plane_real import measure_real

    rows = []
    for r in args.real_replicas:
        rows.append(measure_real(args.stages, r, args.microbatches))
        print(f"real N={rows[-1]['peers']}: done (load {os.getloadavg()[0]:.1f})", flush=True)
    return rows


def real_table(rows: list[dict]) -> list[str]:
    lines = ["| N (real processes) | coordinator CPU ms/step | its DHT process ms/step | peers' DHT processes "
             "ms/step | p2pd daemons ms/step | step wall ms | heartbeat records/s/peer | peers' DHT KiB written/s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['peers']} | {r['coordinator_cpu_s'] * 1e3:.1f} | {r['coordinator_dht_cpu_s'] * 1e3:.1f} | "
                     f"{r['peer_dht_cpu_s'] * 1e3:.1f} | {r['p2pd_cpu_s'] * 1e3:.1f} | {r['wall_s'] * 1e3:.0f} | "
                     f"{r['heartbeats_per_s_per_peer']:.2f} ({r['peers_watched']} peers) | "
                     f"{r['peer_dht_wchar_per_s'] / 1024:.1f} |")
    return lines


if __name__ == "__main__":
    main()
