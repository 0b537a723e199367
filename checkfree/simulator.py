"""The single-process simulator: every stage in one process, failures injected by schedule.

It drives the same StageWorker, route and recovery functions as the distributed runtime,
so its per-step losses are the reference the runtime is tested against.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import torch

from checkfree.config import RunConfig
from checkfree.data import TokenData, build_data
from checkfree.failures import FailureSchedule, schedule_from_config
from checkfree.pipeline import Hop, edge_holders, route
from checkfree.recovery import UnrecoverableFailure, get_rule, omega, plan_recovery, rebuild_stage
from checkfree.rundir import RunWriter
from checkfree.worker import StageWorker, StepStats, build_workers, resolve_device

__all__ = ["Simulator", "run_microbatches", "sync_components", "evaluate", "recovery_fields"]

log = logging.getLogger(__name__)


def run_microbatches(workers: list[StageWorker], data: TokenData, step: int, plus: bool) -> float:
    """Forward and backward of every microbatch of `step`; returns the summed loss."""
    num_mb = workers[0].cfg.train.num_microbatches
    total = 0.0
    for mb in range(num_mb):
        inputs, targets = data.batch(step, mb)
        hops = route(len(workers), plus, step, mb, num_mb)
        x = inputs
        for hop in hops:
            x = workers[hop.stage].forward(mb, x, hop, targets if hop.head else None)
        total += float(x)
        grad = None
        for hop in reversed(hops):
            grad = workers[hop.stage].backward(mb, grad)
    return total


def sync_components(workers: list[StageWorker], plus: bool) -> None:
    """CheckFree+: both holders of the embedding / head apply the same summed gradient."""
    if not plus:
        return
    for comp, holders in edge_holders(len(workers), plus).items():
        total = sum(workers[h].component_grad(comp) for h in holders)
        for h in holders:
            workers[h].set_component_grad(comp, total)


@torch.no_grad()
def evaluate(workers: list[StageWorker], batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean validation loss over `batches` along the plain route."""
    last = len(workers) - 1
    losses = []
    for inputs, targets in batches:
        x = inputs
        for i, w in enumerate(workers):
            x = w.infer(x, Hop(i, embed=i == 0, head=i == last))
        losses.append(float(torch.nn.functional.cross_entropy(x.flatten(0, 1), targets.to(x.device).flatten())))
    return sum(losses) / len(losses)


def recovery_fields(plan, coeffs: dict[int, float]) -> dict:
    """The events.jsonl fields describing one recovery (shared with the coordinator)."""
    return {"method": plan.method, "sources": list(plan.sources),
            "coefficients": [coeffs[s] for s in plan.sources] if coeffs else [],
            "edge_sources": plan.edge_sources, "edges_reinit": list(plan.edges_reinit)}


class Simulator:
    """Trains the configured pipeline in one process, writing the run directory."""

    def __init__(self, cfg: RunConfig, out: str | Path, *, progress: bool = True) -> None:
        self.cfg = cfg
        self.rule = get_rule(cfg.recovery.strategy)
        self.device = resolve_device(cfg.train.device)
        self.data = build_data(cfg.data, vocab_size=cfg.model.vocab_size, context_length=cfg.model.context_length,
                               seed=cfg.train.seed, microbatch_size=cfg.train.microbatch_size)
        self.val = self.data.val_batches(cfg.train.eval_batches)
        self.failures: FailureSchedule = schedule_from_config(cfg.failures, cfg.num_stages, cfg.train.num_steps,
                                                              self.rule.plus)
        self.workers = build_workers(cfg, self.device)
        self.norms = [0.0] * cfg.num_stages
        self.writer = RunWriter(out, cfg.to_json())
        self.progress = progress
        self.last_loss = math.nan
        self.last_val = math.nan

    def recover(self, step: int, failed: set[int]) -> None:
        """Replace the failed stages' workers and rebuild them from live neighbours."""
        rc, strategy = self.cfg.recovery, self.cfg.recovery.strategy
        for s in sorted(failed):
            self.writer.event("failure", step=step, stage=s, strategy=strategy)
        try:
            plans = plan_recovery(failed, self.cfg.num_stages, strategy, rc.fallback)
        except UnrecoverableFailure as e:
            self.writer.event("fallback", step=step, stage=min(failed), strategy=strategy, fallback="abort",
                              reason=str(e))
            raise
        live = {i: w for i, w in enumerate(self.workers) if i not in failed}
        for plan in plans:
            t0 = time.perf_counter()
            fresh = StageWorker(self.cfg, plan.stage, self.device)
            blocks = {s: {k: v for k, v in live[s].state_dict().items() if k.startswith("blocks.")}
                      for s in plan.sources}
            edges = {c: {k: v for k, v in live[h].state_dict().items() if k.startswith(c + ".")}
                     for c, h in plan.edge_sources.items()}
            state, coeffs = rebuild_stage(plan, fresh.state_dict(), blocks, {s: self.norms[s] for s in plan.sources},
                                          edges, eps=rc.eps, seed=self.cfg.train.seed + step, std=self.cfg.model.init_std)
            fresh.load_recovered(state, rc.lr_scale)
            self.workers[plan.stage] = fresh
            self.norms[plan.stage] = 0.0
            fields = recovery_fields(plan, coeffs)
            if plan.fallback:
                self.writer.event("fallback", step=step, stage=plan.stage, strategy=strategy,
                                  fallback=plan.fallback, reason=plan.reason, **fields)
            else:
                self.writer.event("recovery", step=step, stage=plan.stage, strategy=strategy,
                                  recovery_time_s=round(time.perf_counter() - t0, 6), **fields)

    def train_step(self, step: int) -> tuple[float, list[StepStats]]:
        loss = run_microbatches(self.workers, self.data, step, self.rule.plus)
        sync_components(self.workers, self.rule.plus)
        stats = [w.step(step) for w in self.workers]
        for i, st in enumerate(stats):
            if st.skipped:
                self.writer.event("skipped_step", step=step, stage=i, strategy=self.cfg.recovery.strategy,
                                  reason="non-finite gradient")
            else:
                self.norms[i] = omega(st.grad_norm_pre, st.grad_norm_post, kind=self.cfg.recovery.norm_kind,
                                      power=self.cfg.recovery.norm_power)
        return loss, stats

    def run(self) -> dict:
        """Train for the configured number of steps; returns the summary."""
        t = self.cfg.train
        bar = _progress(t.num_steps, self.progress)
        try:
            for step in range(t.num_steps):
                failed = self.failures.at(step)
                if failed:
                    self.recover(step, failed)
                t0 = time.perf_counter()
                loss, stats = self.train_step(step)
                record = {"step": step, "loss": loss, "lr": stats[0].lr,
                          "grad_norms": [s.grad_norm_post for s in stats],
                          "step_time_s": round(time.perf_counter() - t0, 6)}
                if (t.eval_every and (step + 1) % t.eval_every == 0) or step == t.num_steps - 1:
                    record["val_loss"] = self.last_val = evaluate(self.workers, self.val)
                self.writer.metric(record)
                self.last_loss = loss
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.4f}", val=f"{self.last_val:.4f}", failures=self.writer.counts["failures"])
            return self.writer.summary(steps=t.num_steps, final_loss=self.last_loss, final_val_loss=self.last_val,
                                       status="completed")
        except UnrecoverableFailure as e:
            self.writer.summary(steps=step, final_loss=self.last_loss, final_val_loss=self.last_val,
                                status="aborted", error=str(e))
            raise
        finally:
            bar.close()
            self.writer.close()


def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc="train", unit="step", disable=not enabled, dynamic_ncols=True)
