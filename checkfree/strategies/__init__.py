"""Fault-tolerance strategies behind one interface (see `base.Strategy`), by CLI name.

* averaging (checkfree, checkfree+, uniform, copy, random, identity): rebuild from live neighbours (random and
  identity from no one: fresh weights, or a pass-through stage);
* checkpoint: persistent checkpoints every K steps, global rollback;
* redundant: Bamboo-style replica of the successor, promoted on failure;
* gemini: snapshots in m peers' CPU memory, global rollback;
* reft: snapshots + XOR parity across groups of stages, global rollback;
* baft: neighbour backups in pipeline bubbles, global rollback;
* checkfree+snap: CheckFree+ that restores a stage alone from a neighbour's snapshot;
* snap: the plain pipeline that restores a stage alone from a neighbour's compressed copy, streamed inside the
  steps (checkfree.snapcodec), and rebuilds it by a recovery rule when that copy is lost too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial

from checkfree.config import RunConfig
from checkfree.recovery import RECOVERY_RULES
from checkfree.strategies.averaging import AveragingStrategy
from checkfree.strategies.baft import BaftStrategy
from checkfree.strategies.base import FailureOutcome, Figures, Strategy, StrategyContext
from checkfree.strategies.checkpoint import CheckpointStrategy
from checkfree.strategies.gemini import GeminiStrategy
from checkfree.strategies.hybrid import SnapshotAveragingStrategy
from checkfree.strategies.redundant import RedundantStrategy
from checkfree.strategies.reft import ReftStrategy
from checkfree.strategies.streamed import StreamedSnapshotStrategy

__all__ = ["STRATEGIES", "build_strategy", "worker_config", "Strategy", "StrategyContext", "Figures",
           "FailureOutcome"]

STRATEGIES: dict[str, Callable[[RunConfig], Strategy]] = {
    **{name: partial(AveragingStrategy, rule=name) for name in RECOVERY_RULES},
    "checkpoint": CheckpointStrategy,
    "redundant": RedundantStrategy,
    "gemini": GeminiStrategy,
    "reft": ReftStrategy,
    "baft": BaftStrategy,
    "checkfree+snap": SnapshotAveragingStrategy,
    "snap": StreamedSnapshotStrategy,
}


def build_strategy(cfg: RunConfig) -> Strategy:
    name = cfg.recovery.strategy
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; choose one of {sorted(STRATEGIES)}")
    return STRATEGIES[name](cfg)


def worker_config(cfg: RunConfig, strategy: Strategy) -> RunConfig:
    """The config StageWorkers are built from: StageWorker looks its routes up in the
    recovery rules, which know only the averaging strategies, so other strategies train
    with the plain pipeline (or CheckFree+'s, for checkfree+snap)."""
    if cfg.recovery.strategy in RECOVERY_RULES:
        return cfg
    rule = "checkfree+" if strategy.plus else "checkfree"
    return dataclasses.replace(cfg, recovery=dataclasses.replace(cfg.recovery, strategy=rule))
