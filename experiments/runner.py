"""Run the specs of a matrix: in parallel processes, resumable, with one progress bar.

A run's directory is `<out>/runs/<spec.name>` and holds the usual run-directory files
(config.json, metrics.jsonl, events.jsonl, summary.json) plus `spec.json` and `provenance.json`
(the code version that ran it, the step time and the cost model's figures it was priced with, the
detection time it used: experiments.provenance, experiments.clock). `summary.json` is
written last, so its presence marks a finished run: an interrupted matrix, started again,
skips every run that has one (unless its status is "error") and redoes the others from
scratch.

Simulator runs are capped at `spec.max_iterations` executed iterations (recomputations after
a rollback included): a strategy that keeps rolling back stops there with status
"budget-exhausted" (its target, if not reached by then, is "not reached"). Unrecoverable
failures end a run with status "aborted" (the simulator's own summary).

`runtime == "local"` runs the same configuration as a real swarm (`checkfree local`:
coordinator and peer processes, SIGKILLs from the same trace); those runs go one at a time
after the simulator runs, since a swarm needs every core it can get.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from experiments.clock import fingerprint
from experiments.provenance import code_version
from experiments.spec import ROLLBACK, RunSpec

__all__ = ["run_dir", "is_done", "run_one", "run_specs", "pending_specs", "provenance", "LOCAL_TIMEOUT_S"]

LOCAL_TIMEOUT_S = 3600.0


def run_dir(out: Path, spec: RunSpec | dict) -> Path:
    name = spec.name if isinstance(spec, RunSpec) else spec["name"]
    return Path(out) / "runs" / name


def is_done(directory: Path) -> bool:
    summary = directory / "summary.json"
    if not summary.is_file():
        return False
    try:
        return json.loads(summary.read_text()).get("status") != "error"
    except json.JSONDecodeError:
        return False


def _config(spec: dict, out: Path):
    from checkfree.config import config_from_dict

    d = json.loads(json.dumps(spec["config"]))
    if d["failures"].get("trace"):
        d["failures"]["trace"] = str((out / d["failures"]["trace"]).resolve())
    return config_from_dict(d)


def _run_sim(spec: dict, out: Path, directory: Path) -> dict[str, Any]:
    from checkfree.recovery import UnrecoverableFailure
    from checkfree.simulator import Simulator

    class BudgetExhausted(Exception):
        pass

    class CappedSimulator(Simulator):
        """The simulator, stopped after `max_iterations` executed iterations."""

        max_iterations = spec["max_iterations"]
        last_step = 0

        def _iteration(self, step: int) -> dict:
            if self.iterations >= self.max_iterations:
                raise BudgetExhausted(step)
            self.last_step = step
            return super()._iteration(step)

    cfg = _config(spec, out)
    sim = CappedSimulator(cfg, directory, progress=False)
    try:
        return sim.run()
    except UnrecoverableFailure:
        return json.loads((directory / "summary.json").read_text())
    except BudgetExhausted:
        return sim._summary("budget-exhausted",
                            f"iteration budget of {spec['max_iterations']} exhausted at step {sim.last_step}")


def _run_local(spec: dict, out: Path, directory: Path) -> dict[str, Any]:
    cfg = _config(spec, out)
    directory.mkdir(parents=True, exist_ok=True)
    cfg_path = directory / "experiment_config.json"
    cfg_path.write_text(cfg.to_json())
    cmd = [sys.executable, "-m", "checkfree", "local", "--config", str(cfg_path), "--out", str(directory),
           "--no-progress"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the swarm's peers run one torch thread each (--threads-per-peer 1)
    with open(directory / "local.log", "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=LOCAL_TIMEOUT_S, env=env)
    summary = directory / "summary.json"
    if not summary.is_file():
        raise RuntimeError(f"checkfree local exited with {proc.returncode} and no summary.json (see {directory}/local.log)")
    return json.loads(summary.read_text())


def stop_pool(ex: ProcessPoolExecutor) -> None:
    """An interrupted pool: drop its queue and end the runs in flight (a worker left alone runs to its end,
    orphaned)."""
    workers = list(getattr(ex, "_processes", {}).values())
    ex.shutdown(wait=False, cancel_futures=True)
    for proc in workers:
        proc.terminate()


def provenance(spec: dict, out: Path) -> dict[str, Any]:
    """What `provenance.json` records for a run about to start."""
    cost = fingerprint(_config(spec, out))
    return {"code": code_version(), "step_s": cost["step_s"], "detection_s": cost["detection_s"],
            "cost_model": cost}


def run_one(spec: dict, out: str, threads: int = 1) -> dict[str, Any]:
    """Run one spec (in a worker process); returns {name, status, wall_s}. Never raises:
    an unexpected error is recorded as a summary with status "error" (redone on resume)."""
    out_p = Path(out)
    directory = run_dir(out_p, spec)
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    (directory / "spec.json").write_text(json.dumps(spec, indent=2, sort_keys=True))
    t0 = time.time()
    try:
        (directory / "provenance.json").write_text(json.dumps(provenance(spec, out_p), indent=2, sort_keys=True))
        import torch

        torch.set_num_threads(threads)
        summary = _run_local(spec, out_p, directory) if spec["runtime"] == "local" else _run_sim(spec, out_p, directory)
    except Exception as e:  # noqa: BLE001 - recorded, the matrix goes on
        summary = {"status": "error", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        (directory / "summary.json").write_text(json.dumps(summary, indent=2))
    finally:
        shutil.rmtree(directory / "checkpoints", ignore_errors=True)  # storage of the checkpoint strategies
    return {"name": spec["name"], "status": summary.get("status"), "wall_s": round(time.time() - t0, 1),
            "error": summary.get("error")}


def _prepare_data(spec: RunSpec) -> None:
    """Build the tokenizer / token cache once, before workers race to build it."""
    from checkfree.config import config_from_dict
    from checkfree.data import build_data

    cfg = config_from_dict({**spec.config, "failures": {**spec.config["failures"], "trace": None}})
    build_data(cfg.data, vocab_size=cfg.model.vocab_size, context_length=cfg.seq_len,
               seed=cfg.train.seed, microbatch_size=cfg.train.microbatch_size)


def _order(spec: RunSpec) -> tuple:
    """Failure-free references first (every target depends on them), then the highest failure
    rate first (an interrupted matrix has whole columns of the table), within a rate the
    longest runs (rollbacks) first."""
    rollback = spec.strategy in ROLLBACK or spec.strategy == "redundant"
    return (spec.rate != 0, -spec.rate, not rollback, spec.name)


def pending_specs(specs: list[RunSpec], out: Path) -> list[RunSpec]:
    """The distinct specs whose run is not finished yet."""
    return [s for s in {s.name: s for s in specs}.values() if not is_done(run_dir(out, s))]


def run_specs(specs: list[RunSpec], out: Path, *, jobs: int, threads: int = 1, progress: bool = True,
              log=print, on_finished=None) -> list[dict[str, Any]]:
    """Run every spec not yet done; returns the results of the runs done now. `on_finished(result)` is
    called as each run ends."""
    from tqdm import tqdm

    unique = list({s.name: s for s in specs}.values())
    pending = pending_specs(unique, out)
    done_before = len(unique) - len(pending)
    if done_before:
        log(f"resuming: {done_before} of {len(unique)} runs already finished, {len(pending)} to run")
    results: list[dict[str, Any]] = []
    if not pending:
        return results
    _prepare_data(pending[0])
    sims = sorted((s for s in pending if s.runtime == "sim"), key=_order)
    locals_ = [s for s in pending if s.runtime == "local"]
    bar = tqdm(total=len(unique), initial=done_before, desc="experiment runs", unit="run", disable=not progress,
               dynamic_ncols=True)
    t0 = time.time()

    def finished(res: dict[str, Any]) -> None:
        results.append(res)
        if on_finished is not None:
            on_finished(res)
        bar.update(1)
        bar.set_postfix_str(f"last {res['name'][:40]} ({res['status']}, {res['wall_s']:.0f}s)")
        if res["status"] == "error":
            tqdm.write(f"run {res['name']} failed: {res['error']}")

    try:
        if sims:
            with ProcessPoolExecutor(max_workers=max(1, min(jobs, len(sims))), mp_context=get_context("spawn")) as ex:
                futures = {ex.submit(run_one, s.to_dict(), str(out), threads) for s in sims}
                try:
                    while futures:
                        done, futures = wait(futures, timeout=5.0, return_when=FIRST_COMPLETED)
                        for f in done:
                            finished(f.result())
                        bar.set_description(f"experiment runs ({len(futures)} left in queue/running, "
                                            f"{time.time() - t0:.0f}s)")
                except BaseException:
                    stop_pool(ex)  # interrupted: the runs in flight are redone on resume
                    raise
        for s in locals_:
            bar.set_description(f"experiment runs (swarm {s.name[:30]})")
            finished(run_one(s.to_dict(), str(out), threads))
    finally:
        bar.close()
    return results
