"""`checkfree experiment ... --dry-run`: check a matrix before paying for it.

For every distinct configuration of the experiments' runs: the config resolves, the data loads and one
training step runs (in the simulator, on this machine's device). Then, per configuration and for the
whole matrix, two different clocks side by side: the real compute (FLOPs from the model config, hours
on a named GPU class at a stated, assumed utilisation: experiments.compute) and the cost model's
simulated wall-clock of the paper's decentralised setting (`strategy.cost_profile`). Nothing is kept.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from experiments.compute import DEFAULT_GPU, DEFAULT_MFU, GPUS, estimate
from experiments.spec import RunSpec, Settings
from experiments.tables import markdown_table

__all__ = ["dry_run"]


def _flops(x: float) -> str:
    return f"{x:.3g}"


def _sim_hours(cfg) -> float:
    """The cost model's clock of a failure-free run of `cfg`: its steps at the pipeline step time, plus
    redundant computation's per-step extra (the other strategies' stalls depend on state the run builds)."""
    from checkfree.costmodel import CostModel

    cm = CostModel(cfg)
    step = cm.step_s() + (cm.redundant_extra_s() if cfg.recovery.strategy == "redundant" else 0.0)
    return step * cfg.train.num_steps / 3600


def dry_run(experiments: list[str], settings: Settings, *, gpu: str = DEFAULT_GPU, mfu: float = DEFAULT_MFU,
            log=print) -> int:
    from checkfree.config import config_from_dict
    from checkfree.simulator import Simulator
    from experiments.suite import specs_for

    with tempfile.TemporaryDirectory(prefix="checkfree-dry-run-") as tmp:
        out = Path(tmp)
        specs = list({s.name: s for e in experiments for s in specs_for(e, settings, out)}.values())
        distinct: dict[str, RunSpec] = {}
        for spec in specs:
            distinct.setdefault(spec.label, spec)
        log(f"dry run: {len(specs)} runs, {len(distinct)} distinct configurations ({settings.preset}, "
            f"{settings.steps} steps, data {settings.data or 'the preset corpus'})")
        cfgs = [config_from_dict(s.config) for s in specs]
        total_sim_h = sum(_sim_hours(c) for c in cfgs)
        total_gpu_h = sum(estimate(c, gpu, mfu).gpu_hours for c in cfgs)
        rows = []
        for label, spec in distinct.items():
            cfg = config_from_dict(spec.config)
            sim_h = _sim_hours(cfg)
            comp = estimate(cfg, gpu, mfu)
            cfg.train.num_steps, cfg.train.eval_every, cfg.failures.trace = 1, 0, None
            t0 = time.perf_counter()
            Simulator(cfg, out / f"dry-{len(rows)}", progress=False).run()
            step_s = time.perf_counter() - t0
            rows.append([label, spec.strategy, f"{step_s:.1f} s", _flops(comp.step_flops), f"{comp.gpu_hours:.3g} h",
                         f"{sim_h:.3g} h"])
            log(f"  {label}: config, data and one step OK ({step_s:.1f} s here, set-up included)")
    c = estimate(config_from_dict(specs[0].config), gpu, mfu)
    log(f"\ncompute per training step: {c.tokens_per_step} tokens; 6·N·tokens = {_flops(c.six_n_flops)} FLOPs "
        f"+ attention 12·L·T·d·tokens = {_flops(c.attention_flops)} FLOPs; GPU-hours on one {gpu} "
        f"({GPUS[gpu] / 1e12:g} TFLOP/s dense BF16 peak) at an assumed {mfu:.0%} utilisation (evaluations included; "
        f"runs that roll back recompute steps and need more)")
    log("\n" + markdown_table(["configuration", "strategy", "one step here (with set-up)", "FLOPs per step",
                                f"compute per run (1 {gpu}, {mfu:.0%} MFU)",
                                f"simulated clock per run without failures ({settings.cost_profile})"], rows))
    log(f"whole matrix ({len(specs)} runs): {total_gpu_h:.3g} GPU-hours of compute on {gpu} at {mfu:.0%} MFU; "
        f"{total_sim_h:.3g} h of simulated wall-clock by the cost model")
    return 0
