"""The phases of `python -m benchmarks.accelerator`, each run in its own process (main.run_phase) with a deadline.

A phase saves its results after every item (`Ctx.save`), so a phase stopped at its cap still reports what it
finished. Runs go through the project's own commands (`checkfree local`, `checkfree simulate`,
`checkfree export`) and its benchmark and experiment code (benchmarks.vs_torch_pipelining, benchmarks.recovery,
experiments.suite, experiments.pretrained); nothing here trains a model by itself.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from benchmarks.accelerator import BF16_TOL, FP32_TOL, ONLY, call_key

MiB = 1 << 20


@dataclass
class Ctx:
    """What a phase knows: the mode, where it writes, how long it has."""

    phase: str
    call: int | str  # 1, 2 or "hf"
    dry: bool
    work: Path
    device: str  # "cuda" or "cpu"
    data: str
    transport: str  # the flag: auto | hivemind | tcp
    inits: list[str]
    jobs: int
    deadline: float  # time.time() at the phase's cap
    pack: Path | None = None
    full: bool = False  # a dry run with the GPU's whole lists (of cases, paths, inits) at toy sizes
    forks: bool = False  # `checkfree` runs forked from a fork server of this process (`dry_fork`: the dry run's)
    results: dict[str, Any] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)  # saves from the phase's threads

    @property
    def short(self) -> bool:
        """The dry run's shorter lists (the test's): fewer cases, paths and inits."""
        return self.dry and not self.full

    @property
    def path(self) -> Path:
        return self.work / f"call{self.call}-{self.phase}.json"

    def save(self, key: str, value: Any) -> None:
        with self.lock:
            self.results[key] = value
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.results, indent=1, default=str))
            os.replace(tmp, self.path)

    def left(self) -> float:
        return self.deadline - time.time()

    def env(self) -> dict[str, str]:
        return {**os.environ, "CHECKFREE_CACHE": str(self.work / "cache"), "PYTHONUNBUFFERED": "1"}

    def chosen_transport(self) -> str:
        """The transport the env phase found working (hivemind, else tcp), or the one asked for."""
        if self.transport != "auto":
            return self.transport
        try:
            probe = json.loads((self.work / f"call{self.call}-env.json").read_text())["transport"]
            return probe["chosen"] or "hivemind"
        except (OSError, KeyError, json.JSONDecodeError):
            return "hivemind"


def log(msg: str) -> None:
    print(msg, flush=True)


def run_in_process(args) -> int:
    """Entry of a phase (or science item) process."""
    import torch

    dev = "cpu" if args.dry_run else ("cuda" if args.device == "auto" and torch.cuda.is_available() else args.device)
    if dev == "auto":
        dev = "cpu"
    work = args.work
    data = args.data or _default_data(work, args.from_pack)
    jobs = args.jobs or min(14, os.cpu_count() or 1)
    name = args.run_phase or args.run_item
    ctx = Ctx(name, call_key(args.call if args.call != "all" else 1), args.dry_run, work, dev, data, args.transport,
              [i.strip() for i in args.inits.split(",") if i.strip()], jobs, args.deadline or time.time() + 3600,
              args.from_pack, args.full, forks=args.dry_run)
    if ctx.forks:
        import signal

        import cli.main  # noqa: F401 - (its environment, set at its import, in every env a fork is asked with)

        signal.signal(signal.SIGTERM, _pass_sigterm)
    try:
        if args.run_item:
            from benchmarks.accelerator.science import run_item

            return run_item(ctx)
        from benchmarks.accelerator.science import phase_science

        fn = {"env": phase_env, "correctness": phase_correctness, "speed": phase_speed, "science": phase_science}[name]
        ctx.save("device", dev)
        ctx.save("data", data)
        try:
            fn(ctx)
        except Exception:  # noqa: BLE001 - recorded for the report, and printed
            ctx.save("error", traceback.format_exc()[-4000:])
            traceback.print_exc()
            return 1
        return 0
    finally:
        close_forks()


# ------------------------------------------------------------------------------------------ the dry run's forks

# what the dry run's fork servers import before they fork: the swarm processes' own modules (cli.main.PRELOAD:
# torch, hivemind, the runtime's) and this package's phases
DRY_PRELOAD = ("benchmarks.accelerator.phases", "benchmarks.accelerator.science")
_FORKS: dict[frozenset, Any] = {}  # env -> this process's fork server for the spawns with that env
_FORKS_LOCK = threading.Lock()
_FORKED: list[Any] = []  # the children forked (each a session of its own: a SIGTERM to our group misses them)


def dry_fork(args: list[str], env: dict[str, str], module: str = "checkfree", cwd: str | None = None):
    """The dry run's `python -m MODULE ARGS`, forked from a fork server (swarm/zygote.py) of this process with this
    env, started by the first such call: each Python process the dry run starts (its phases, science items and
    `checkfree` runs) otherwise spends seconds of CPU importing torch and the runtime, on a test machine's 2 cores.
    Only with OMP_NUM_THREADS=1 (the test's: else torch's import leaves an OpenMP thread in the server, which a fork
    must not inherit) and CHECKFREE_ZYGOTE not off; import cli.main before the first env is made (its import sets a
    variable in os.environ). A `swarm.zygote.ZygoteProcess` (stdout and stderr in one pipe), or None where there can
    be none (a server that died): start it with Popen then. On the device every process starts with Popen."""
    from cli.main import PRELOAD
    from swarm.zygote import Zygote, enabled

    if not enabled(env) or env.get("OMP_NUM_THREADS") != "1":  # (torch's OpenMP pool: no thread before a fork)
        return None
    with _FORKS_LOCK:
        key = frozenset(env.items())
        server = _FORKS.get(key)
        if server is None or server.dead:
            if server is not None:
                server.close()
            server = _FORKS[key] = Zygote(env, preload=(*PRELOAD, *DRY_PRELOAD))
    child = server.popen(args, env, module=module, cwd=cwd)
    if child is not None:
        _FORKED.append(child)
    return child


def _pass_sigterm(signum, frame) -> None:
    """A phase stopped at its cap (SIGTERM to its group): its forked runs, each a session of its own, get it too
    (as the runs it started with Popen, in its group, would), then it ends as SIGTERM ends it."""
    import signal

    for child in _FORKED:
        if child.returncode is None:  # (not poll(): it may take a lock the interrupted thread holds)
            try:
                os.killpg(child.pid, signal.SIGTERM)
            except OSError:
                pass
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def close_forks() -> None:
    """Stop this process's fork servers (`dry_fork`'s; the children they started have ended by then)."""
    with _FORKS_LOCK:
        while _FORKS:
            _FORKS.popitem()[1].close()


def _default_data(work: Path, pack: Path | None) -> str:
    """The pack's plays (unpacked once under work/), else the built-in corpus."""
    plays = work / "data" / "plays"
    if plays.is_dir():
        return str(plays)
    if pack is not None and (pack / "plays.tar.xz").is_file():
        (work / "data").mkdir(parents=True, exist_ok=True)
        with tarfile.open(pack / "plays.tar.xz") as tar:
            tar.extractall(work / "data", filter="data")
        return str(plays)
    return "shakespeare"


def _checkfree(ctx: Ctx, *argv: str, timeout: float | None = None, margin: float = 0.0) -> subprocess.CompletedProcess:
    """`python -m checkfree ARGV` with the run's cache, stopped `margin` seconds before the phase's deadline (read as
    the run goes: a test moves it) or after `timeout` seconds, whichever comes first, but given 5 s at least.
    `ctx.forks`: forked (`dry_fork`; its output, stdout and stderr in one, is the result's stderr)."""
    t0 = time.time()
    forked = dry_fork(list(argv), ctx.env()) if ctx.forks else None
    if forked is not None:
        return _wait_forked(ctx, forked, t0, timeout, margin)
    with subprocess.Popen([sys.executable, "-m", "checkfree", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, env=ctx.env()) as proc:
        while True:
            end = max(t0 + 5.0, min(t0 + (1e9 if timeout is None else timeout), ctx.deadline - margin))
            try:  # (in slices of a second: a TimeoutExpired of communicate() loses no output)
                out, err = proc.communicate(timeout=max(0.0, min(1.0, end - time.time())))
                break
            except subprocess.TimeoutExpired:
                if time.time() < end:
                    continue
            # SIGTERM first: `checkfree local` then stops its peers and writes what it has (SIGKILL would orphan them)
            proc.terminate()
            try:
                out, err = proc.communicate(timeout=8)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
            raise subprocess.TimeoutExpired(proc.args, end - t0, output=out, stderr=err) from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _wait_forked(ctx: Ctx, proc, t0: float, timeout: float | None, margin: float) -> subprocess.CompletedProcess:
    """`_checkfree`'s wait, for a forked run (a swarm.zygote.ZygoteProcess): its output read by a thread."""
    chunks: list[str] = []
    reader = threading.Thread(target=lambda: chunks.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()

    def output() -> str:
        reader.join(timeout=10)
        proc.stdout.close()
        return "".join(chunks)

    while True:
        end = max(t0 + 5.0, min(t0 + (1e9 if timeout is None else timeout), ctx.deadline - margin))
        try:  # (in slices of a second: the deadline is read as the run goes)
            proc.wait(timeout=max(0.0, min(1.0, end - time.time())))
            return subprocess.CompletedProcess(proc.args, proc.returncode, "", output())
        except subprocess.TimeoutExpired:
            if time.time() < end:
                continue
        proc.terminate()  # (as _checkfree: SIGTERM first)
        try:
            proc.wait(timeout=8)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        raise subprocess.TimeoutExpired(proc.args, end - t0, output="", stderr=output()) from None


def _read_jsonl(path: Path) -> list[dict]:
    from checkfree.rundir import read_jsonl

    return read_jsonl(path) if path.is_file() else []


# ------------------------------------------------------------------------------------------------------ env

PROBE = """
import asyncio, sys
from checkfree.net.factory import start_transport, stop_transport
async def main(kind):
    dht, t = await start_transport(transport=kind, startup_timeout=30)
    await stop_transport(dht, t)
asyncio.run(main(sys.argv[1]))
print("started and stopped")
"""


def phase_env(ctx: Ctx) -> None:
    import platform

    import torch

    ctx.save("versions", _versions())
    info: dict[str, Any] = {"device": ctx.device, "torch_threads": torch.get_num_threads(), "cores": os.cpu_count(),
                            "platform": platform.platform()}
    if ctx.device.startswith("cuda"):
        p = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info(0)
        info.update(name=p.name, capability=f"{p.major}.{p.minor}", multiprocessors=p.multi_processor_count,
                    memory_total=total, memory_free=free, tf32_matmul=torch.backends.cuda.matmul.allow_tf32)
    ctx.save("device_info", info)
    ctx.save("memory", _memory_check(ctx))
    if ctx.pack is not None and (ctx.pack / "manifest.json").is_file():
        manifest = json.loads((ctx.pack / "manifest.json").read_text())
        ctx.save("pack", {"code": manifest.get("code"), "plan": manifest.get("plan")})
        if ctx.call == 1:
            _keep_gguf_part(ctx)
    if ctx.call == 2:  # call 1 left SmolLM2's first part here if the machine stayed warm between the calls
        ctx.save("warm", (ctx.work / "smollm2.part-1").is_file())
    if ctx.call != 1:  # only call 1 measures the peak (its speed phase's MFU) and starts swarms
        return

    def start(kind: str) -> dict[str, Any]:
        t0 = time.time()
        try:
            done = subprocess.run([sys.executable, "-c", PROBE, kind], capture_output=True, text=True,
                                  timeout=max(5.0, min(60.0, ctx.left() - 2)), env=ctx.env())
            ok = done.returncode == 0
            return {"ok": ok, "s": round(time.time() - t0, 2), "error": None if ok else (done.stderr or done.stdout)[-1500:]}
        except subprocess.TimeoutExpired:
            return {"ok": False, "s": round(time.time() - t0, 2), "error": "no answer within the time left"}

    # the probes (a DHT and its p2pd each, in processes of their own: 8.7 s on the H200) while the peak is measured
    # here (the GPU's matmuls do not wait on them; the first run took 22.1 s doing one after the other)
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {kind: pool.submit(start, kind) for kind in ("hivemind", "tcp")}
        ctx.save("peak", measure_peak(ctx.device, ctx.dry))
        probe: dict[str, Any] = {kind: f.result() for kind, f in futures.items()}
    chosen = "hivemind" if probe["hivemind"]["ok"] else ("tcp" if probe["tcp"]["ok"] else None)
    probe["chosen"] = ctx.transport if ctx.transport != "auto" else chosen
    probe["note"] = ("every transport needs the DHT, whose p2pd must start: with neither, no swarm can run here"
                     if chosen is None else None)
    ctx.save("transport", probe)
    log(f"env: transport {probe['chosen']}, peak bf16 {ctx.results['peak'].get('bf16_tflops')} TFLOP/s")


def _memory_check(ctx: Ctx) -> dict[str, Any]:
    """checkfree.memory on this machine: the device's free memory and the host's, and the speed phase's swarm
    checked as `checkfree local` checks it (its tensors against the device, its processes against the host)."""
    import torch

    from checkfree.memory import StageMemory, available_bytes, check_fits, swarm_memory

    dev = torch.device(ctx.device)
    setup = speed_setup(ctx.dry)
    from checkfree.config import preset

    cfg = preset(setup["preset"])
    cfg.num_stages, cfg.train.microbatch_size = setup["stages"], setup["microbatch_size"]
    total = sum((swarm_memory(cfg, s) for s in range(cfg.num_stages)), StageMemory())
    res: dict[str, Any] = {"device_free": available_bytes(dev), "host_available": available_bytes(None),
                           "speed_swarm_tensors": total.total - total.process, "speed_swarm_processes": total.process}
    try:
        check_fits(total, "the speed phase's swarm", dev)
        res["check"] = "fits"
    except ValueError as e:
        res["check"] = str(e)
    return res


def _keep_gguf_part(ctx: Ctx) -> None:
    """Call 1: store the GGUF's first part where call 2 finds it on a machine that stayed warm."""
    src = ctx.pack / "smollm2.part-1" if ctx.pack is not None else None
    if src is not None and src.is_file():
        dest = ctx.work / "smollm2.part-1"
        shutil.copyfile(src, dest)
        ctx.save("gguf_part1", {"stored": str(dest), "bytes": dest.stat().st_size})


def _versions() -> dict[str, str]:
    """Installed versions (from the distributions' metadata: importing transformers alone takes seconds; whether
    hivemind imports and starts is the transport probe's question)."""
    from importlib import metadata

    out = {"python": sys.version.split()[0]}
    for dist in ("torch", "transformers", "accelerate", "safetensors", "tokenizers", "numpy", "hivemind", "msgspec",
                 "omegaconf", "gguf", "msgpack", "protobuf", "pydantic", "cryptography", "cffi", "typing-extensions"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "missing"
    import torch

    out["cuda"] = str(torch.version.cuda)
    return out


def measure_peak(device: str, dry: bool) -> dict[str, Any]:
    """Dense matmul rate with torch.matmul: bf16 (the MFU's denominator) and float32 (TF32 off, torch's default),
    the mean of 10 timed products after 3 warm-ups (CUDA events), random data."""
    import torch

    n = 256 if dry else 8192
    res: dict[str, Any] = {"n": n, "device": device}
    for name, dtype, size in (("bf16", torch.bfloat16, n), ("fp32", torch.float32, n // 2)):
        a = torch.randn(size, size, device=device, dtype=dtype)
        b = torch.randn(size, size, device=device, dtype=dtype)
        for _ in range(3):
            a @ b
        if device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(10):
                a @ b
            end.record()
            end.synchronize()
            secs = start.elapsed_time(end) / 1e3 / 10
        else:
            t0 = time.perf_counter()
            for _ in range(10):
                a @ b
            secs = (time.perf_counter() - t0) / 10
        # 4 significant figures, not 3 decimals: a loaded CPU's bf16 rate (under 0.0005 TFLOP/s) rounded to 0.0
        res[f"{name}_tflops"] = float(f"{2 * size**3 / secs / 1e12:.4g}")
        res[f"{name}_n"] = size
    return res


# ---------------------------------------------------------------------------------------------- correctness

@dataclass(frozen=True)
class Case:
    """One swarm-vs-simulator comparison: same flags on both sides."""

    name: str
    flags: tuple[str, ...]
    trace: tuple[tuple[int, int], ...]
    bf16: bool = False
    spares: int = 0
    swarm: bool = True  # False: the simulator alone (the dry run's bf16 case: its comparisons, without a third swarm)


def correctness_cases(dry: bool, full: bool = False) -> tuple[list[Case], dict[str, Any]]:
    """The cases and the common flags: `small` for 12 steps on the GPU, `tiny` for 8 in the dry run (two cases:
    CheckFree+ covers an averaged intermediate stage and an edge copy in one run; `full`: the GPU's cases, tiny)."""
    if dry and not full:
        common = {"preset": "tiny", "steps": 8, "eval_every": 4}
        plus: tuple[tuple[int, int], ...] = ((2, 2), (5, 0))
        cases = [Case("fp32 checkfree+", ("--strategy", "checkfree+"), plus, spares=2),
                 Case("bf16 checkfree+", ("--strategy", "checkfree+", "--bf16"), plus, bf16=True, swarm=False)]
        return cases, common
    common = {"preset": "tiny" if dry else "small", "steps": 12, "eval_every": 6}
    plus = ((3, 2), (6, 0), (9, 3))
    cases = [Case("fp32 checkfree", ("--strategy", "checkfree"), ((4, 2),), spares=1),
             # a rebuild drawn from a seed (on the CPU's own generator: the same on the peer and in the simulator)
             Case("fp32 random", ("--strategy", "random"), ((4, 1),), spares=1),
             Case("fp32 checkfree+", ("--strategy", "checkfree+"), plus, spares=3),
             Case("bf16 checkfree+", ("--strategy", "checkfree+", "--bf16"), plus, bf16=True, spares=3)]
    return cases, common


def _case_flags(ctx: Ctx, case: Case, common: dict, trace: Path | None) -> list[str]:
    flags = ["--preset", common["preset"], "--steps", str(common["steps"]), "--eval-every", str(common["eval_every"]),
             "--seed", "3", "--device", ctx.device, "--data", ctx.data, *case.flags]
    return flags + (["--trace", str(trace)] if trace else [])


def _trace_file(ctx: Ctx, case: Case) -> Path | None:
    if not case.trace:
        return None
    p = ctx.work / "correctness" / f"trace-{case.name.replace(' ', '-')}.csv"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text("step,stage\n" + "".join(f"{a},{b}\n" for a, b in case.trace))
    return p


# seconds a run started by a phase ends before the phase's deadline: a run not finished by then is stopped and
# recorded (how far it got, its last output) before the phase itself is stopped at its cap (_checkfree gives it 8 s
# to end after SIGTERM): call hf's first two tries lost every trace of the run that did not finish
RECORD_S = 12.0


def _not_finished(e: subprocess.TimeoutExpired, out: Path, t0: float) -> dict[str, Any]:
    """A run stopped at its time limit: how many steps it had written, its output's and its peers' logs' last lines."""
    def tail(x, n: int = 1200) -> str:
        return (x.decode(errors="replace") if isinstance(x, bytes) else (x or ""))[-n:]

    logs = {p.name: tail(p.read_bytes(), 600) for p in sorted((out / "logs").glob("*"))[:8] if p.is_file()} \
        if (out / "logs").is_dir() else {}
    return {"ok": False, "wall_s": round(time.time() - t0, 1), "finished": False,
            "error": f"not finished within {e.timeout:.0f} s (stopped: the phase's time ran out)",
            "steps_done": len(_read_jsonl(out / "metrics.jsonl")), "stdout_tail": tail(e.stdout),
            "stderr_tail": tail(e.stderr), "logs_tail": logs}


def _swarm(ctx: Ctx, flags: list[str], out: Path, spares: int, transport: str) -> dict[str, Any]:
    shutil.rmtree(out, ignore_errors=True)
    churn = [] if "--trace" in flags else ["--no-churn"]
    t0 = time.time()
    argv = ["local", "--out", str(out), "--no-progress", "--spares", str(spares), *churn, "--transport", transport, *flags]
    try:
        done = _checkfree(ctx, *argv, margin=RECORD_S)
        refused = None
        if done.returncode != 0 and "--skip-memory-check runs it anyway" in done.stderr + done.stdout:
            # a host whose memory grows as it is used can read low at first: say so, and run it anyway
            refused = (done.stderr + done.stdout).strip().splitlines()[-1][-500:]
            shutil.rmtree(out, ignore_errors=True)
            done = _checkfree(ctx, *argv, "--skip-memory-check", margin=RECORD_S)
    except subprocess.TimeoutExpired as e:
        return {**_not_finished(e, out, t0), "transport": transport}
    return {"ok": done.returncode == 0, "wall_s": round(time.time() - t0, 1), "transport": transport,
            "memory_check_refused": refused,
            "error": None if done.returncode == 0 else (done.stdout[-1500:] + done.stderr[-1500:])}


def _simulate(ctx: Ctx, flags: list[str], out: Path) -> dict[str, Any]:
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.time()
    try:
        done = _checkfree(ctx, "simulate", "--out", str(out), "--no-progress", *flags, margin=RECORD_S)
    except subprocess.TimeoutExpired as e:
        return _not_finished(e, out, t0)
    return {"ok": done.returncode == 0, "wall_s": round(time.time() - t0, 1),
            "error": None if done.returncode == 0 else done.stderr[-2000:]}


def compare_runs(a: Path, b: Path, tol: float) -> dict[str, Any]:
    """Step by step: losses, validation losses, recoveries (step, stage, method, sources) and their coefficients;
    `ok` when every difference is within `tol` (relative, or absolute near zero) and the recoveries are the same."""
    ma, mb = _read_jsonl(a / "metrics.jsonl"), _read_jsonl(b / "metrics.jsonl")
    steps_same = [m["step"] for m in ma] == [m["step"] for m in mb] and len(ma) > 0

    def diff(x: float | None, y: float | None) -> float:
        if x is None or y is None:
            return math.inf if (x is None) != (y is None) else 0.0
        return abs(x - y) / max(1.0, abs(y))

    loss = max((diff(x["loss"], y["loss"]) for x, y in zip(ma, mb)), default=math.inf)
    val = max((diff(x.get("val_loss"), y.get("val_loss")) for x, y in zip(ma, mb)), default=0.0)
    ra = [e for e in _read_jsonl(a / "events.jsonl") if e["event"] in ("recovery", "fallback")]
    rb = [e for e in _read_jsonl(b / "events.jsonl") if e["event"] in ("recovery", "fallback")]
    key = ("step", "stage", "method", "sources")
    same_recoveries = [tuple(str(e.get(k)) for k in key) for e in ra] == [tuple(str(e.get(k)) for k in key) for e in rb]
    coeff = max((abs(x - y) for ea, eb in zip(ra, rb)
                 for x, y in zip(ea.get("coefficients") or [], eb.get("coefficients") or [])), default=0.0)
    ok = steps_same and same_recoveries and loss <= tol and val <= tol and coeff <= tol
    return {"ok": ok, "tol": tol, "steps": len(ma), "steps_same": steps_same, "max_loss_diff": loss,
            "max_val_loss_diff": val, "recoveries": [{k: e.get(k) for k in (*key, "coefficients")} for e in ra],
            "recoveries_same": same_recoveries, "max_coefficient_diff": coeff}


def phase_correctness(ctx: Ctx) -> None:
    if ONLY.get(ctx.call, {}).get("correctness") == "hf":
        phase_hf_only(ctx)
        return
    cases, common = correctness_cases(ctx.dry, ctx.full)
    transport = ctx.chosen_transport()
    root = ctx.work / "correctness"
    root.mkdir(parents=True, exist_ok=True)
    ctx.save("setup", {**common, "cases": [c.name for c in cases], "transport": transport,
                       "tolerances": {"fp32": FP32_TOL, "bf16": BF16_TOL}})
    jobs: dict[str, Any] = {}

    def swarm_job(case: Case) -> dict[str, Any]:
        flags = _case_flags(ctx, case, common, _trace_file(ctx, case))
        return _swarm_or_tcp(ctx, flags, root / f"{_slug(case.name)}-swarm", case.spares, transport)

    def sim_job(case: Case, suffix: str = "sim") -> dict[str, Any]:
        return _simulate(ctx, _case_flags(ctx, case, common, _trace_file(ctx, case)), root / f"{_slug(case.name)}-{suffix}")

    plus = next((c for c in cases if c.name == "fp32 checkfree+"), None)

    def hf_job(sim_future) -> None:
        """The HF check from the fp32 CheckFree+ simulator run (= its swarm's, checked beside), as soon as that run
        ends: its export, swarm and simulator run beside the cases' swarms (the first run reached the HF check only
        after all of them, and ran out of its cap there)."""
        if not _result(sim_future).get("ok"):
            ctx.save("hf", {"ok": False, "error": "its source run (fp32 checkfree+, the simulator) failed"})
            return
        hf_in_and_out(ctx, root / f"{_slug(plus.name)}-sim", transport, save=lambda res: ctx.save("hf", res))

    # the floor (the same simulation twice: run-to-run nondeterminism) for the bf16 cases: float32's was 0 in every
    # case of the first run (benchmarks/results/accelerator/call1.json)
    # (the short dry run's four runs at once: two after two left its swarm waiting on the simulator runs' start-ups)
    workers = 4 if ctx.dry else 3 * len(cases) + 2
    hf = None
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for case in cases:
            if case.swarm:
                jobs[f"{case.name}/swarm"] = pool.submit(swarm_job, case)
            jobs[f"{case.name}/sim"] = pool.submit(sim_job, case)
            if case.bf16:
                jobs[f"{case.name}/sim-again"] = pool.submit(sim_job, case, "sim-again")
        if plus is not None and not ctx.short:  # (the short dry run: the HF check is call hf's, tested on its own)
            hf = pool.submit(hf_job, jobs[f"{plus.name}/sim"])
        runs = {k: _result(f) for k, f in jobs.items()}
        ctx.save("runs", runs)
        checks: dict[str, Any] = {}
        for case in cases:
            s = _slug(case.name)
            if not case.swarm and runs[f"{case.name}/sim"].get("ok"):  # the floor is the check
                checks[case.name] = {**compare_runs(root / f"{s}-sim-again", root / f"{s}-sim", BF16_TOL),
                                     "swarm": "not run (dry run)"}
            if case.swarm and runs[f"{case.name}/swarm"].get("ok") and runs[f"{case.name}/sim"].get("ok"):
                checks[case.name] = compare_runs(root / f"{s}-swarm", root / f"{s}-sim",
                                                 BF16_TOL if case.bf16 else FP32_TOL)
            if case.name in checks:
                if runs.get(f"{case.name}/sim-again", {}).get("ok"):
                    tol = BF16_TOL if case.bf16 else FP32_TOL
                    checks[case.name]["floor"] = compare_runs(root / f"{s}-sim-again", root / f"{s}-sim", tol)
                if case.bf16:
                    fp32 = next((c for c in cases if not c.bf16 and c.trace == case.trace), None)
                    if fp32 is not None and runs[f"{fp32.name}/sim"].get("ok"):
                        checks[case.name]["vs_fp32"] = compare_runs(root / f"{s}-sim",
                                                                    root / f"{_slug(fp32.name)}-sim", 1.0)
            else:
                checks[case.name] = {"ok": False, "error": "a run failed (see runs)"}
            ctx.save("checks", checks)
        if hf is not None:
            _result(hf)
    ok = all(c.get("ok") for c in checks.values()) and (hf is None or ctx.results.get("hf", {}).get("ok", False))
    ctx.save("ok", ok)


def _slug(name: str) -> str:
    return name.replace(" ", "-").replace("+", "plus")


def _result_of(fn, *args) -> dict[str, Any]:
    """fn(*args), or the exception as a failed run."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - a broken run is a finding
        return {"ok": False, "error": f"{type(e).__name__}: {e}"[:1500]}


def _result(future) -> dict[str, Any]:
    try:
        return future.result()
    except Exception as e:  # noqa: BLE001 - a timed-out or broken run is a finding
        return {"ok": False, "error": f"{type(e).__name__}: {e}"[:1500]}


def _swarm_or_tcp(ctx: Ctx, flags: list[str], out: Path, spares: int, transport: str) -> dict[str, Any]:
    """A swarm run; over hivemind failing (the daemon's data path), again over tcp while there is time."""
    rec = _swarm(ctx, flags, out, spares, transport)
    if not rec["ok"] and transport == "hivemind" and ctx.left() > (20 if ctx.dry else 45):
        log(f"correctness: {out.name} over hivemind failed; again over tcp")
        rec = {**_swarm(ctx, flags, out, spares, "tcp"), "hivemind_error": rec["error"]}
    return rec


def _attempt(res: dict[str, Any], key: str, fn, save) -> dict[str, Any]:
    """res[key] = fn(), or the exception as a failed part; saved either way (the next part still runs)."""
    try:
        res[key] = fn()
    except Exception as e:  # noqa: BLE001 - a failed part is a finding, recorded with its traceback
        res[key] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:1000], "traceback": traceback.format_exc()[-3000:]}
        traceback.print_exc()
    save(dict(res))  # a copy: the other parts' threads write into res (a dict copies in one step under the GIL)
    return res[key]


def hf_in_and_out(ctx: Ctx, run: Path, transport: str, save=lambda res: None, swarm: bool = True) -> dict[str, Any]:
    """Out: `run`'s final weights exported as an HF Llama (`checkfree export --format hf`), loaded by transformers
    on the device, logits against the project's model on the device. In: `--init-from` that directory, every
    stage's weights equal to the export's; and a run from it, the swarm against the simulator (`swarm=False`: the
    simulator alone), started as soon as the export exists, beside the two checks. Each part is recorded as it
    ends (`save(res)`), and a part that fails is recorded as such while the others still run."""
    hf = ctx.work / "correctness" / "hf"
    res: dict[str, Any] = {"source_run": str(run)}

    def export() -> dict[str, Any]:
        shutil.rmtree(hf, ignore_errors=True)
        t0 = time.time()
        done = _checkfree(ctx, "export", "--run", str(run), "--format", "hf", "--output", str(hf))
        return {"ok": done.returncode == 0, "wall_s": round(time.time() - t0, 1),
                "error": None if done.returncode == 0 else (done.stdout[-1000:] + done.stderr[-2000:])}

    if not _attempt(res, "export", export, save)["ok"]:
        res["ok"] = False
        save(dict(res))
        return res
    # --strategy checkfree: the check is HF in and out, swarm = simulator from the export. Without it --init-from
    # defaults to snap (checkfree.advice), whose streamed copies are issue 42's and tested there; calls hf at 1543f55
    # (snap) never saw these runs end on the H200 (the CPU's figures: benchmarks/results/accelerator/README.md,
    # "Call hf"), and this check must not wait on another strategy's machinery
    flags = ["--init-from", str(hf), "--strategy", "checkfree", "--steps", "4", "--eval-every", "0", "--seed", "5",
             "--device", ctx.device, "--data", ctx.data]
    root = ctx.work / "correctness"

    def runs() -> dict[str, Any]:
        done: dict[str, Any] = {}

        def one(name: str, fn, *args) -> dict[str, Any]:
            done[name] = _result_of(fn, *args)
            res["in_runs_so_far"] = dict(done)  # each run as it ends, before the two are compared
            save(dict(res))
            return done[name]

        with ThreadPoolExecutor(max_workers=2) as pool:  # both at once
            sim_f = pool.submit(one, "sim", _simulate, ctx, flags, root / "hf-in-sim")
            swarm_f = pool.submit(one, "swarm", _swarm_or_tcp, ctx, flags, root / "hf-in-swarm", 0, transport) \
                if swarm else None
            sim = sim_f.result()
            if swarm_f is None:
                return {"ok": sim["ok"], "sim": sim, "swarm": "not run (the dry run's short list)"}
            sw = swarm_f.result()
        cmp = compare_runs(root / "hf-in-swarm", root / "hf-in-sim", FP32_TOL) if sw["ok"] and sim["ok"] else {"ok": False}
        return {"ok": cmp["ok"], "sim": sim, "swarm": sw, "compare": cmp}

    with ThreadPoolExecutor(max_workers=1) as pool:
        in_runs = pool.submit(_attempt, res, "in_runs", runs, save)  # its processes start while the checks run here
        _attempt(res, "out", lambda: _hf_out(ctx, run, hf), save)
        _attempt(res, "in_weights", lambda: _hf_in_weights(ctx, run, hf), save)
        in_runs.result()
    res["ok"] = all(bool((res.get(k) or {}).get("ok")) for k in ("export", "out", "in_weights", "in_runs"))
    save(dict(res))
    return res


def _hf_out(ctx: Ctx, run: Path, hf: Path) -> dict[str, Any]:
    import torch
    import transformers

    from checkfree.export import load_export

    t0 = time.time()
    dev = torch.device(ctx.device)
    ours = load_export(run / "final_weights.safetensors").to(dev).eval()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32).to(dev).eval()
    tokens = torch.randint(0, ours.cfg.vocab_size, (4, ours.cfg.context_length),
                           generator=torch.Generator().manual_seed(0)).to(dev)
    with torch.no_grad():
        delta = float((ours(tokens) - theirs(tokens).logits).abs().max())
    return {"max_logit_diff": delta, "tol": 1e-4, "ok": delta < 1e-4, "class": type(theirs).__name__,
            "device": str(next(theirs.parameters()).device), "wall_s": round(time.time() - t0, 1)}


def _hf_in_weights(ctx: Ctx, run: Path, hf: Path) -> dict[str, Any]:
    """`--init-from` the export: every stage's weights, built on the device, equal to the run's final weights."""
    import torch

    from checkfree.flags import config_from_args
    from checkfree.export import load_export
    from checkfree.model import plan_stages, stage_to_global
    from checkfree.strategies import build_workers
    from cli.main import build_parser

    t0 = time.time()
    want = {k: v.cpu() for k, v in load_export(run / "final_weights.safetensors").state_dict().items()}
    cfg = config_from_args(build_parser().parse_args(["simulate", "--init-from", str(hf), "--steps", "1",
                                                      "--device", ctx.device]))
    equal, keys, devices = True, 0, set()
    for spec, worker in zip(plan_stages(cfg.model.num_layers, cfg.num_stages), build_workers(cfg)):
        devices.add(worker.device.type)
        for k, v in stage_to_global(spec, worker.state_dict()).items():
            keys += 1
            equal &= k in want and torch.equal(v.cpu(), want[k])
    on_device = devices == {torch.device(ctx.device).type}
    return {"ok": equal and on_device and keys == len(want), "tensors": keys, "export_tensors": len(want),
            "devices": sorted(devices), "wall_s": round(time.time() - t0, 1)}


def hf_source_flags(ctx: Ctx) -> list[str]:
    """The focused call's own short run, whose final weights go out and come back in: 4 steps of `small` (tiny
    in a dry run), float32, on the device."""
    return ["--preset", "tiny" if ctx.dry else "small", "--steps", "4", "--eval-every", "0", "--seed", "3",
            "--device", ctx.device, "--data", ctx.data]


def phase_hf_only(ctx: Ctx) -> None:
    """The correctness phase of call hf: the HF in/out check alone, from a short simulator run of its own."""
    transport = ctx.chosen_transport()
    root = ctx.work / "correctness"
    root.mkdir(parents=True, exist_ok=True)
    ctx.save("setup", {"only": "hf", "source": hf_source_flags(ctx), "transport": transport,
                       "tolerances": {"fp32": FP32_TOL, "logits": 1e-4}})
    source = root / "hf-source-sim"
    sim = _simulate(ctx, hf_source_flags(ctx), source)
    ctx.save("source_run", sim)
    if not sim["ok"]:
        ctx.save("hf", {"ok": False, "error": "the source run failed (see source_run)"})
    else:
        hf_in_and_out(ctx, source, transport, save=lambda res: ctx.save("hf", res))
    ctx.save("ok", bool(ctx.results["hf"].get("ok")))


# -------------------------------------------------------------------------------------------------- speed

def speed_setup(dry: bool) -> dict[str, Any]:
    """paper-124m's shape (4 stages of 3 blocks, d 512, context 512, 32k vocabulary) at 8 sequences a microbatch,
    8 microbatches, bf16 autocast: 32,768 tokens a step. Dry run: tiny in 3 stages (a first, a middle and a last
    one, as the GPU's 4 have: one process fewer in each of its swarms and torch pipelines than 4 stages)."""
    if dry:
        return {"preset": "tiny", "stages": 3, "microbatches": 4, "microbatch_size": 8, "bf16": False, "steps": 6,
                "warmup": 2, "recovery": ("tiny", 2, 4)}
    return {"preset": "paper-124m", "stages": 4, "microbatches": 8, "microbatch_size": 8, "bf16": True, "steps": 13,
            "warmup": 3, "recovery": ("100M-per-stage", 3, 5)}


RECOVERY = ("recovery", "recovery", "")  # the 100M-parameter stage's recovery: after the GPipe paths, before 1F1B


def speed_paths(dry: bool, hivemind_ok: bool, transport: str) -> list[tuple[str, str, str]]:
    """(name, kind, schedule) in priority order: what is cut when time runs out comes last."""
    if dry:
        return [("simulator", "sim", "gpipe"), (f"swarm {transport} gpipe", f"swarm:{transport}", "gpipe"),
                ("torch gpipe", "torch", "gpipe"), RECOVERY]
    # every path before the 100M-stage recovery, which the first run measured (2.29 s detected -> rebuilt): it runs
    # last, when time is left; 1F1B's torch path before its swarm's (16.4 s against 34.1 s in the first run)
    paths = [("simulator", "sim", "gpipe"), ("swarm tcp gpipe", "swarm:tcp", "gpipe"), ("torch gpipe", "torch", "gpipe"),
             ("torch 1f1b", "torch", "1f1b"), ("swarm tcp 1f1b", "swarm:tcp", "1f1b")]
    if hivemind_ok:
        paths.append(("swarm hivemind gpipe", "swarm:hivemind", "gpipe"))
    return paths + [RECOVERY]


# what a path takes on the H200 (start-up included), by kind: the first run's walls (simulator 17.8 s, swarm tcp
# gpipe 34.1 s, torch gpipe 16.4 s); raised to what a path of the kind took in this run
PATH_S = {"sim": 18.0, "swarm": 35.0, "torch": 17.0}


def phase_speed(ctx: Ctx) -> None:
    from benchmarks import vs_torch_pipelining as vtp
    from checkfree.costmodel import stage_forward_flops
    from checkfree.data import build_data

    setup = speed_setup(ctx.dry)
    cfg = vtp.bench_config(SimpleNamespace(preset=setup["preset"], stages=setup["stages"],
                                           microbatches=setup["microbatches"], steps=setup["steps"]))
    t = cfg.train
    t.microbatch_size, t.autocast_bf16, t.device, cfg.data.source = setup["microbatch_size"], setup["bf16"], ctx.device, ctx.data
    tokens = t.num_microbatches * t.microbatch_size * cfg.seq_len
    flops = 3 * t.num_microbatches * sum(stage_forward_flops(cfg))
    env = _env_results(ctx)
    peak = (env.get("peak") or {}).get("bf16_tflops") or measure_peak(ctx.device, ctx.dry)["bf16_tflops"]
    hivemind_ok = bool((env.get("transport") or {}).get("hivemind", {}).get("ok"))
    transport = ctx.chosen_transport()
    ctx.save("setup", {**setup, "tokens_per_step": tokens, "flops_per_step": flops, "peak_bf16_tflops": peak,
                       "comparison": "torch.distributed.pipelining with 4 gloo ranks on the one GPU (NCCL refuses two "
                                     "ranks on one device; gloo's send/recv carries host tensors): every stage computes "
                                     "on the GPU and hands activations and gradients over loopback TCP in host memory, "
                                     "as the swarm's peers do; same stages, init, microbatches, schedule, clip and Adam"})
    os.environ["CHECKFREE_CACHE"] = str(ctx.work / "cache")
    build_data(cfg.data, vocab_size=cfg.model.vocab_size, context_length=cfg.model.context_length, seed=t.seed,
               microbatch_size=t.microbatch_size, progress=False)  # the tokenizer and tokens, once
    args = SimpleNamespace(preset=setup["preset"], stages=setup["stages"], microbatches=setup["microbatches"],
                           steps=setup["steps"], warmup=setup["warmup"], threads_per_peer=1)
    # (--skip-memory-check: the env phase ran the check on this machine and recorded it; a host whose memory grows
    # as it is used may read low, which must not cost a measurement)
    extra = ["--device", ctx.device, "--microbatch-size", str(t.microbatch_size), "--data", ctx.data,
             "--skip-memory-check"] + (["--bf16"] if setup["bf16"] else [])
    results: dict[str, Any] = {}
    root = ctx.work / "speed"
    root.mkdir(parents=True, exist_ok=True)
    needed = {k: (20.0 if ctx.dry else v) for k, v in PATH_S.items()}  # updated as they run
    lock = threading.Lock()  # (the dry run's paths run at once)

    def run_path(name: str, kind: str, schedule: str) -> None:
        if kind == "recovery":
            ctx.save("recovery", _recovery(ctx, setup, transport))
            return
        what = kind.split(":")[0]
        if ctx.left() < needed[what]:
            r: dict[str, Any] = {"ok": False, "cut": f"{ctx.left():.0f} s left, a path of its kind needs "
                                                     f"~{needed[what]:.0f} s"}
        else:
            t0 = time.time()
            try:
                if kind == "sim":
                    r = _sim_speed(ctx, setup, extra, root / "sim")
                elif kind == "torch":
                    r = vtp.run_torch(args, cfg, schedule)
                else:
                    r = vtp.run_swarm(args, root / name.replace(" ", "-"), schedule, kind.split(":")[1], extra)
                r = {"ok": True, "period_s": r["period_s"], "tokens_per_s": tokens / r["period_s"],
                     "mfu": tokens / r["period_s"] * flops / tokens / (peak * 1e12) if peak else None,
                     "cpu_s": r.get("cpu_s"), "losses": r.get("losses"), "wall_s": round(time.time() - t0, 1)}
            except Exception as e:  # noqa: BLE001 - the next path still runs
                r = {"ok": False, "error": f"{type(e).__name__}: {e}"[-2000:], "wall_s": round(time.time() - t0, 1)}
            needed[what] = max(needed[what], r["wall_s"])
            said = f"{r['period_s']:.4f} s/step, {r['tokens_per_s']:,.0f} tokens/s, MFU {r['mfu']:.3%}" \
                if r["ok"] and r["mfu"] is not None else str(r.get("error"))[:300]
            log(f"speed: {name}: {said}")
        with lock:
            results[name] = r
            ctx.save("paths", dict(results))

    paths = speed_paths(ctx.short, hivemind_ok, transport)
    if ctx.dry:
        # the dry run's paths at once, 4 at a time: its figures are not measurements (toy sizes on a CPU), and each
        # path is mostly its processes starting (one after the other: 122 s of a 301 s dry run at 093acaa); on the
        # device they run one after the other, each on the GPU alone, in priority order
        with ThreadPoolExecutor(max_workers=min(4, len(paths))) as pool:
            for future in [pool.submit(run_path, *path) for path in paths]:
                future.result()
        results = {name: results[name] for name, _, _ in paths if name in results}  # in the paths' order
    else:
        for path in paths:
            run_path(*path)
    base = results.get("torch gpipe", {})
    for name, r in results.items():
        if r.get("ok") and base.get("ok"):
            r["torch_gpipe_over_path"] = base["period_s"] / r["period_s"]
            if r.get("losses") and base.get("losses"):
                r["max_loss_diff_to_torch_gpipe"] = max(abs(a - b) for a, b in zip(r["losses"], base["losses"]))
    ctx.save("paths", results)


def _env_results(ctx: Ctx) -> dict[str, Any]:
    try:
        return json.loads((ctx.work / f"call{ctx.call}-env.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _sim_speed(ctx: Ctx, setup: dict, extra: list[str], out: Path) -> dict[str, Any]:
    """Every stage in one process (checkfree simulate): the same step without any wire."""
    done = _simulate(ctx, ["--preset", setup["preset"], "--stages", str(setup["stages"]), "--microbatches",
                           str(setup["microbatches"]), "--steps", str(setup["steps"]), "--eval-every", "0", *extra], out)
    if not done["ok"]:
        raise RuntimeError(done["error"])
    metrics = _read_jsonl(out / "metrics.jsonl")
    return {"period_s": statistics.median(m["step_time_s"] for m in metrics[setup["warmup"]:]),
            "losses": [m["loss"] for m in metrics]}


def _recovery(ctx: Ctx, setup: dict, transport: str) -> dict[str, Any]:
    """benchmarks.recovery's measurement (SIGKILL of stage 1, one spare) on the device."""
    from benchmarks.recovery import CONFIGS, measure

    name, kill, steps = setup["recovery"]
    if ctx.left() < (20 if ctx.dry else 45):
        return {"ok": False, "cut": f"{ctx.left():.0f} s left (the first run measured it)"}
    t0 = time.time()
    flags = (CONFIGS[name] if name in CONFIGS else ["--preset", name, "--stages", str(setup["stages"])]) + \
        ["--device", ctx.device, "--transport", transport, "--data", ctx.data, "--skip-memory-check"]
    root = ctx.work / "speed" / "recovery"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    os.environ["CHECKFREE_CACHE"] = str(ctx.work / "cache")
    try:
        row = measure(name, flags, kill, steps, root)
    except (Exception, SystemExit) as e:  # noqa: BLE001 - measure() exits on a failed swarm
        return {"ok": False, "config": name, "error": str(e)[-2000:], "wall_s": round(time.time() - t0, 1)}
    return {"ok": True, **row, "stage_params": row["bytes"] / 2 / 4, "wall_s": round(time.time() - t0, 1)}
