"""The single-process simulator: every stage in one process, failures injected by schedule.

It drives the same StageWorker, route and recovery functions as the distributed runtime,
so its per-step losses are the reference the runtime is tested against.

The fault-tolerance strategy (checkfree.strategies) is called after every step and on
every failure, through `SimContext`. A strategy may roll training back: the loop then
recomputes the lost steps (batches are a pure function of the step, so exactly). Failures
are scheduled by iteration (every executed step, recomputations included), which equals
the step as long as nothing rolls back. The cost model (checkfree.costmodel) turns each
iteration and each recovery into simulated seconds: metrics carry `sim_time_s`, events
carry each failure's figures, the summary their totals and `simulated_hours`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

from checkfree.config import RunConfig
from checkfree.costmodel import CostModel
from checkfree.data import TokenData, build_data, save_run_tokenizer
from checkfree.failures import FailureSchedule, schedule_from_config
from checkfree.stage_groups import spread
from checkfree.pipeline import Hop, edge_holders, evaluates_after, route
from checkfree.recovery import OmegaWindow, StateDict, UnrecoverableFailure
from checkfree.softerrors import UncorrectableSoftError, guard_counts, make_guard
from checkfree.serialize import state_from_bytes, state_to_bytes
from checkfree.evalinputs import StageInputs, route_loss
from checkfree.export import save_export
from checkfree.progress import Progress
from checkfree.rundir import RunWriter
from checkfree.saves import newest_save, read_save, write_save
from checkfree.steprules import SoftErrorRule, StageUpdate, apply_commits
from checkfree.strategies import Figures, build_strategy, worker_config
from checkfree.strategies.execute import SimExecutor
from checkfree.strategies.state import StageState, capture_worker, restore_worker
from checkfree.wirecodec import roundtrip
from checkfree.worker import StageWorker, StepStats, resolve_device

__all__ = ["Simulator", "SimContext", "run_microbatches", "sync_components", "evaluate"]

# Failures are drawn for this many times the configured steps, so that a strategy that
# rolls back meets failures while it recomputes too.
FAILURE_HORIZON = 4

log = logging.getLogger(__name__)


class SoftErrorEscalation(RuntimeError):
    """A soft error the guard could not correct, twice in a row in one microbatch."""

    def __init__(self, stage: int, message: str) -> None:
        super().__init__(message)
        self.stage = stage


def _forward_chain(workers: list[StageWorker], mb: int, hops: list[Hop], inputs, targets) -> torch.Tensor:
    """The microbatch's forward along its route; one recompute if a soft error escalates."""
    wire = workers[0].cfg.train.wire_dtype
    for attempt in range(2):
        x = inputs
        try:
            for i, hop in enumerate(hops):
                if i:  # a stage boundary: what the next peer receives (checkfree.wirecodec)
                    x = roundtrip(x, wire)
                x = workers[hop.stage].forward(mb, x, hop, targets if hop.head else None)
            return x
        except UncorrectableSoftError as e:
            for w in workers:
                w.drop_microbatch(mb)
            if attempt == 1:
                raise SoftErrorEscalation(hop.stage, f"stage {hop.stage}: {e}") from e
            log.warning("uncorrectable soft error on stage %d, recomputing microbatch %d: %s", hop.stage, mb, e)
    raise AssertionError("unreachable")


def run_microbatches(workers: list[StageWorker], data: TokenData, step: int, plus: bool) -> float:
    """Forward and backward of every microbatch of `step`; returns the summed loss."""
    num_mb = workers[0].cfg.train.num_microbatches
    total = 0.0
    for mb in range(num_mb):
        inputs, targets = data.batch(step, mb)
        hops = route(len(workers), plus, step, mb, num_mb)
        x = _forward_chain(workers, mb, hops, inputs, targets)
        total += float(x)
        grad = None
        for hop in reversed(hops):
            grad = workers[hop.stage].backward(mb, None if grad is None else roundtrip(grad, workers[0].cfg.train.wire_dtype))
    return total


def sync_components(workers: list[StageWorker], plus: bool) -> None:
    """CheckFree+: both holders of the embedding / head apply the same summed gradient."""
    if not plus:
        return
    for comp, holders in edge_holders(len(workers), plus).items():
        total = sum(workers[h].component_grad(comp) for h in holders)
        for h in holders:
            workers[h].set_component_grad(comp, total)


def evaluate(workers: list[StageWorker], batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean validation loss over `batches` along the plain route."""
    return route_loss(workers, batches)


class SimContext:
    """The simulator's side of `checkfree.strategies.StrategyContext`: in-process workers."""

    def __init__(self, sim: Simulator) -> None:
        self.sim, self.cfg, self.cost = sim, sim.cfg, sim.cost
        self.storage_dir = Path(sim.cfg.strategy.storage_dir or Path(sim.writer.out) / "checkpoints")
        self._fresh: dict[int, StageWorker] = {}

    @property
    def num_stages(self) -> int:
        return self.cfg.num_stages

    def event(self, name: str, **fields: Any) -> None:
        self.sim.writer.event(name, **fields)

    def capture(self, stage: int, step: int) -> StageState:
        return capture_worker(self.sim.workers[stage], step, self.sim.norms[stage])

    def restore(self, stage: int, state: StageState, *, replace: bool) -> None:
        if replace:
            self.sim.workers[stage] = self.sim.new_worker(stage)
        restore_worker(self.sim.workers[stage], state)
        self.sim.set_norm(stage, state["norm"])

    def weights(self, stage: int) -> StateDict:
        return self.sim.workers[stage].state_dict()

    def norm(self, stage: int) -> float:
        return self.sim.norms[stage]

    def optimizer_state(self, stage: int, comp: str) -> dict[str, dict[str, torch.Tensor]]:
        return self.sim.workers[stage].optimizer_state(comp + ".")

    def template(self, stage: int) -> StateDict:
        self._fresh[stage] = self.sim.new_worker(stage)
        return self._fresh[stage].state_dict()

    def load_recovered(self, stage: int, state: StateDict, lr_scale: float,
                       optim: dict[str, dict[str, torch.Tensor]] | None = None) -> None:
        fresh = self._fresh.pop(stage, None) or self.sim.new_worker(stage)
        fresh.load_recovered(state, lr_scale, optim)
        self.sim.workers[stage] = fresh
        self.sim.set_norm(stage, 0.0)

    def reset(self, stage: int) -> None:
        self.sim.workers[stage] = self.sim.new_worker(stage)
        self.sim.set_norm(stage, 0.0)


class Simulator:
    """Trains the configured pipeline in one process, writing the run directory."""

    def __init__(self, cfg: RunConfig, out: str | Path, *, progress: bool = True, save_every: int = 0,
                 keep_saves: int = 2, resume: bool = False, tensorboard: bool = False,
                 probe: Callable[[str, int, list[StageWorker]], None] | None = None,
                 save_steps: tuple[int, ...] = (), eval_inputs: StageInputs | None = None) -> None:
        """`save_every` N > 0: save every stage's state every N steps into <out>/saves (and at a
        graceful stop); `save_steps`: also at these steps (0: before the first); `resume`: continue the run in
        `out` from its newest save. `probe(kind, step, workers)`: called with the stages as they are right after a
        resume ("start"), right after a rebuild evaluated with `train.eval_after_recovery` ("recovered") and at every
        validation evaluation ("eval"): an experiment's own evaluation beside the run's (experiments.heldout).
        `eval_inputs`: the evaluations before the steps it records keep every stage's input there, and the
        evaluation right after a rebuild starts at the rebuilt stage from those inputs (checkfree.evalinputs)."""
        if save_every < 0 or keep_saves < 1:
            raise ValueError(f"--save-every must be >= 0 and --keep-saves >= 1 (got {save_every}, {keep_saves})")
        self.cfg = cfg
        self.strategy = build_strategy(cfg)
        self.plus = self.strategy.plus
        self.worker_cfg = worker_config(cfg, self.strategy)
        self.device = resolve_device(cfg.train.device)
        self.data = build_data(cfg.data, vocab_size=cfg.model.vocab_size, context_length=cfg.seq_len,
                               seed=cfg.train.seed, microbatch_size=cfg.train.microbatch_size)
        self.val = self.data.val_batches(cfg.train.eval_batches)
        self.failures: FailureSchedule = schedule_from_config(cfg.failures, cfg.num_stages,
                                                              FAILURE_HORIZON * cfg.train.num_steps,
                                                              self.strategy.fails_edges)
        self.guards = [make_guard(cfg, s) for s in range(cfg.num_stages)]
        self.soft_rule = SoftErrorRule()  # steps lost in a row to each stage's soft errors
        self.resume_at: int | None = None  # a rollback requested from inside a step
        self.pending_failed: set[int] = set()  # stages found broken (non-finite weights) in the last step
        self.workers = [self.new_worker(s) for s in range(cfg.num_stages)]
        self.norms = [0.0] * cfg.num_stages  # each stage's omega as a recovery reads it (its window's mean)
        self.windows = [OmegaWindow(cfg.recovery.omega_window) for _ in range(cfg.num_stages)]
        self.save_every, self.keep_saves, self.save_steps = save_every, keep_saves, frozenset(save_steps)
        self._primed: tuple[dict[int, StageState], int] | None = None  # snap: copies to start from (prime_copies)
        self.start_step = 0
        self.stop_signal: str | None = None  # a SIGINT/SIGTERM/SIGHUP arrived: stop at the next step boundary
        self.resume_from = newest_save(out) if resume else None
        if resume and self.resume_from is None:
            raise FileNotFoundError(f"--resume: {out} has no complete save (run with --save-every N)")
        self.writer = RunWriter(out, cfg.to_json(), tokens_per_step=cfg.tokens_per_step, resume=resume,
                                tensorboard=tensorboard)
        save_run_tokenizer(self.data.tokenizer, self.writer.out)
        self.cost = CostModel(cfg)
        self.ctx = SimContext(self)
        self.executor = SimExecutor(self.ctx, self.strategy)  # the strategy's plans and protection, carried out
        self.progress = progress
        self.probe = probe
        self.eval_inputs = eval_inputs
        self.group_counts = {"replicas_lost": 0, "rerouted_microbatches": 0}  # stage groups (train.replicas > 1)
        self.last_val = math.nan
        self.sim_time_s = 0.0
        self.totals = Figures()
        self.iterations = 0

    def set_norm(self, stage: int, value: float) -> None:
        """`stage`'s omega is `value` now (restored from a copy, or 0 for a new stage): a new window from it."""
        self.norms[stage] = value
        self.windows[stage] = OmegaWindow(self.cfg.recovery.omega_window, value or None)

    def new_worker(self, stage: int) -> StageWorker:
        """A new peer for `stage`, freshly initialised (with the stage's soft-error guard)."""
        worker = StageWorker(self.worker_cfg, stage, self.device)
        worker.attach_guard(self.guards[stage])
        return worker

    def recover(self, step: int, failed: set[int], iteration: int | None = None) -> int:
        """Hand the failed stages to the strategy; returns the step training resumes from."""
        it = step if iteration is None else iteration
        for s in sorted(failed):
            self.writer.event("failure", step=step, stage=s, strategy=self.cfg.recovery.strategy, iteration=it)
        outcome = self.executor.recover(step, failed)
        self.totals = self.totals + outcome.figures
        self.sim_time_s += outcome.figures.recovery_s
        self.writer.event("failure_outcome", step=step, stages=sorted(failed), strategy=self.cfg.recovery.strategy,
                          iteration=it, **outcome.fields())
        return step if outcome.rollback_to is None else outcome.rollback_to

    def _event(self, event: str, **fields) -> None:
        self.writer.event(event, strategy=self.cfg.recovery.strategy, **fields)

    def _soft_error_skip(self, step: int, err: SoftErrorEscalation) -> tuple[float, list[StepStats]]:
        """An uncorrectable soft error survived a recompute: skip the step; if the same
        stage keeps causing skips, treat it as failed and recover it with the strategy."""
        for w in self.workers:
            w.drop_inflight()
        if self.soft_rule.lost(err.stage, functools.partial(self._event, step=step), reason=str(err)[:300]):
            resume = self.recover(step, {err.stage})
            if resume != step:
                self.resume_at = resume
        lr = self.workers[0].optimizer.param_groups[0]["lr"]
        return math.nan, [StepStats(math.nan, math.nan, lr, skipped=True) for _ in self.workers]

    def train_step(self, step: int) -> tuple[float, list[StepStats]]:
        try:
            loss = run_microbatches(self.workers, self.data, step, self.plus)
        except SoftErrorEscalation as e:
            return self._soft_error_skip(step, e)
        self.soft_rule.clear()
        sync_components(self.workers, self.plus)
        stats = [w.step(step) for w in self.workers]
        commits = [StageUpdate(i, self.norms[i] if st.skipped else self.windows[i].add(st.omega(self.cfg.recovery)),
                               st.skipped, st.weights_finite) for i, st in enumerate(stats)]
        # a stage whose weights broke is treated as failed: recovered before the next step
        self.pending_failed |= apply_commits(commits, self.norms, functools.partial(self._event, step=step))
        return loss, stats

    def save(self, step: int) -> None:
        """Save every stage's state, ready to run `step` (checkfree.saves)."""
        blobs = {i: state_to_bytes(capture_worker(w, step, self.norms[i], clone=False))
                 for i, w in enumerate(self.workers)}
        path = write_save(self.writer.out, step, blobs, {"iterations": self.iterations, "sim_time_s": self.sim_time_s,
                                                         "totals": self.totals.as_dict()}, keep=self.keep_saves)
        self.writer.event("save", step=step, path=str(path))

    def _resume(self) -> int:
        assert self.resume_from is not None
        meta, blobs = read_save(self.resume_from, self.cfg.num_stages)
        for i, w in enumerate(self.workers):
            state = state_from_bytes(blobs[i])
            restore_worker(w, state)
            self.set_norm(i, float(state["norm"]))
        self.iterations, self.sim_time_s = int(meta["iterations"]), float(meta["sim_time_s"])
        self.totals = Figures(**meta["totals"])
        self.writer.event("resume", step=meta["step"], path=str(self.resume_from))
        log.info("resuming at step %d from %s", meta["step"], self.resume_from)
        return int(meta["step"])

    def _probe(self, kind: str, step: int) -> None:
        if self.probe is not None:
            self.probe(kind, step, self.workers)

    def prime_copies(self, states: dict[int, StageState], step: int) -> None:
        """snap (experiments): start with every stage's copy complete at its holder, made from `states` (each
        stage's full state as of `step`) by a full update, as if streamed before the run (re)starts."""
        self._primed = (states, step)

    def _prime(self) -> None:
        if self._primed is not None:
            self.executor.prime(*self._primed)
            self._primed = None

    def _recovered_eval(self, step: int, stages: set[int]) -> float:
        self._probe("recovered", step)
        val = evaluate(self.workers, self.val) if self.eval_inputs is None else \
            self.eval_inputs.evaluate_after(step, self.workers, self.val, stages)
        self.writer.event("recovered_eval", step=step, stages=sorted(stages), val_loss=val)
        return val

    def rebuild_and_evaluate(self, stages: set[int]) -> float:
        """Without training: restore the newest save (`resume=True`), let the strategy rebuild `stages` as at a
        failure there, and return the validation loss right after (event recovered_eval: the rebuild's immediate
        damage). The run ends 'completed' with no step trained."""
        if self.resume_from is None:
            raise ValueError("rebuild_and_evaluate restores a save: build the simulator with resume=True")
        try:
            step = self._resume()
            self._prime()
            self.recover(step, set(stages), self.iterations)
            val = self._recovered_eval(step, set(stages))
            self._summary("completed")
            return val
        finally:
            self.writer.close()

    @contextlib.contextmanager
    def _deferred_signals(self):
        """SIGINT/SIGTERM/SIGHUP stop training at the next step boundary (a step half-applied
        cannot be saved); a second signal interrupts at once."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def stop(signum, frame):
            if self.stop_signal is not None:
                raise KeyboardInterrupt
            self.stop_signal = signal.Signals(signum).name
            log.warning("%s: stopping after this step (again to stop now)", self.stop_signal)

        sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        old = {sig: signal.signal(sig, stop) for sig in sigs}
        try:
            yield
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)

    def run(self, until: int | None = None) -> dict:
        """Train until the configured number of steps is done, or only the steps before `until` (the schedule, the
        evaluations and the saves those steps have in the whole run: a trunk that needs the state ready for step
        `until`, saved there, and no more); returns the summary."""
        t = self.cfg.train
        if until is not None and not 0 < until <= t.num_steps:
            raise ValueError(f"until must be within 1..{t.num_steps} (the run's steps), got {until}")
        with self._deferred_signals():
            return self._run(t.num_steps if until is None else until)

    def _run(self, end: int) -> dict:
        t = self.cfg.train
        step = self._resume() if self.resume_from is not None else 0
        if self.resume_from is not None:
            self._probe("start", step)
        self.executor.start(step)
        self._prime()
        if step == 0 and 0 in self.save_steps:
            self.save(0)
        bar = Progress(t.num_steps, "train", enabled=self.progress)
        bar.position = step
        try:
            while step < end:
                if self.stop_signal is not None:
                    if self.save_every:
                        self.save(step)
                    raise KeyboardInterrupt(self.stop_signal)
                failed = self.failures.at(self.iterations) | self.pending_failed
                self.pending_failed = set()
                lost = self._replicas_lost(step, failed) if t.replicas > 1 else set()
                failed -= lost
                if failed:
                    step = self.recover(step, failed, self.iterations)
                    if t.eval_after_recovery:  # the damage of the rebuild itself, before any step
                        self._recovered_eval(step, failed)
                record = self._iteration(step)
                if t.replicas > 1:  # stage groups: the replicas that served each stage in this step
                    record["replicas"] = [t.replicas - (s in lost) for s in range(self.cfg.num_stages)]
                self.writer.metric(record)
                shown = {"val": f"{self.last_val:.4f}"} if math.isfinite(self.last_val) else {}
                bar.update(step + 1, loss=f"{record['loss']:.4f}", **shown,  # a rollback moves it back
                           failures=self.writer.counts["failures"])
                step += 1
                if self.resume_at is not None:
                    step, self.resume_at = self.resume_at, None
                elif (self.save_every and step % self.save_every == 0 or step in self.save_steps) \
                        and step < t.num_steps:
                    self.save(step)
            self._write_final_weights()
            return self._summary("completed")
        except UnrecoverableFailure as e:
            self._summary("aborted", str(e))
            raise
        except KeyboardInterrupt:
            self._summary("interrupted", f"interrupted by {self.stop_signal or 'SIGINT'} before step {step}")
            raise
        except BaseException as e:
            self._summary("failed", f"{type(e).__name__}: {e}")
            raise
        finally:
            bar.close()
            self.writer.close()

    def _replicas_lost(self, step: int, failed: set[int]) -> set[int]:
        """Stage groups (train.replicas > 1): the scheduled failures that take one replica of a stage (a trace line
        without `all`) cost nothing but the replica: its microbatches go to a sibling in the same step (the same
        global batch, so the same update) and a standby takes its place for the next step. The swarm's events,
        with replicas named r0..r{R-1} and the last one lost. Returns those stages."""
        t = self.cfg.train
        lost = {s for s in failed - self.pending_failed if not self.failures.all_of(self.iterations, s)}
        names = [f"r{i}" for i in range(t.replicas)]
        share = spread(t.num_microbatches, names)
        for s in sorted(lost):
            moved = [mb for mb, r in enumerate(share) if r == names[-1]]
            self.writer.event("replica_lost", step=step, stage=s, peer_id=names[-1], reason="lost mid-step",
                              replicas=t.replicas - 1, iteration=self.iterations)
            self.writer.event("rerouted", step=step, stage=s, microbatches=moved, **{"from": names[-1], "to": names[0]})
            self.group_counts["replicas_lost"] += 1
            self.group_counts["rerouted_microbatches"] += len(moved)
        return lost

    def _iteration(self, step: int) -> dict:
        """Train `step`, let the strategy protect it, and price it; returns the metrics line."""
        t = self.cfg.train
        t0 = time.perf_counter()
        self.executor.before_step(step)
        loss, stats = self.train_step(step)
        record = {"step": step, "loss": loss, "lr": stats[0].lr, "grad_norms": [s.grad_norm_post for s in stats],
                  "block_grad_norms": [s.block_grad_norm_post for s in stats],
                  "grad_norms_pre": [s.grad_norm_pre for s in stats],
                  "block_grad_norms_pre": [s.block_grad_norm_pre for s in stats],
                  "step_time_s": round(time.perf_counter() - t0, 6)}
        # a rollback from inside the step (soft-error escalation) left nothing to protect
        figs = self.executor.after_step(step) if self.resume_at is None else Figures()
        self.totals = self.totals + figs
        self.sim_time_s += self.cost.step_s() + figs.stall_s
        self.iterations += 1
        record.update(iteration=self.iterations - 1, sim_time_s=round(self.sim_time_s, 6))
        if evaluates_after(step, t.eval_every, t.num_steps):
            if self.eval_inputs is not None and self.eval_inputs.records(step + 1):  # the state ready for step + 1
                record["val_loss"] = self.last_val = self.eval_inputs.record(step + 1, self.workers, self.val)
            else:
                record["val_loss"] = self.last_val = evaluate(self.workers, self.val)
            self._probe("eval", step)
        return record

    def _write_final_weights(self) -> None:
        """final_weights.safetensors, as the swarm writes it (loadable by `checkfree export`)."""
        save_export(self.cfg, {i: w.state_dict() for i, w in enumerate(self.workers)},
                    self.writer.out / "final_weights.safetensors")

    def _summary(self, status: str, error: str | None = None) -> dict:
        groups = ({**self.group_counts, "stage_recoveries": self.writer.counts["recoveries"]}
                  if self.cfg.train.replicas > 1 else {})
        return self.writer.summary(status, error, strategy=self.cfg.recovery.strategy, cost_profile=self.cost.profile.name,
                                   **groups,
                                   iterations=self.iterations, sim_time_s=round(self.sim_time_s, 6),
                                   simulated_hours=self.sim_time_s / 3600.0, **self.totals.as_dict(),
                                   soft_errors=guard_counts(self.guards))
