"""Debugging, and the peer's one fault hook, all off by default.

* `--dump-recovery DIR`: the weights served and rebuilt in recoveries, and the final state,
  saved as safetensors files with a JSON of metadata each.
* The fault hook: fields of a request that a fault injector added on its way (scheduler/injector.py wraps the
  coordinator's transport; production requests never carry them), acted on at named points of this peer:
  `inject_delay` (ASSIGN, --chaos-slow): a delay before every forward and backward pass from a given step on,
  a slow GPU or an overloaded host; `chaos_die_after_pulls` (ASSIGN, --chaos-rebuild-kills): the replacement
  SIGKILLs itself after a number of weight pulls, a death in the middle of a rebuild; `chaos_die_after_forwards`
  (RUN_STEP) and `chaos_die_in_reduce` (REDUCE), stage groups: a replica SIGKILLs itself after its first
  forward of a step, or half-way through the gradient all-reduce (which runs in gloo, out of the transport's
  reach). `die` is the kill; the in-process test tier replaces it by its own (benchmarks/inprocess.py).
"""
from __future__ import annotations

import json
import logging
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from checkfree.messages import Assign, RunStep
from checkfree.strategies.state import optim_to_wire
from checkfree.worker import StageWorker

__all__ = ["DebugHooks"]

log = logging.getLogger(__name__)


class DebugHooks:
    """The dump directory and the fault hook's settings of one peer."""

    def __init__(self, dump_dir: str | None) -> None:
        self.dump_dir = dump_dir
        self.inject_delay: tuple[float, int] | None = None  # diagnostic slowness: (s per compute, from step)
        self.die_after_pulls: int | None = None  # SIGKILL self after this many weight pulls
        self.die_after_forwards: int | None = None  # SIGKILL self after this many forwards of the armed step
        self.die: Callable[[str], None] = self._sigkill  # the kill: this process, now

    @staticmethod
    def _sigkill(why: str) -> None:
        print(f"CHAOS: SIGKILL of this {why}", flush=True)
        if os.getpgrp() == os.getpid():  # a process group of its own (as the local swarm starts peers): the
            os.killpg(os.getpid(), signal.SIGKILL)  # machine dies, its DHT process and p2pd with it
        os.kill(os.getpid(), signal.SIGKILL)

    def arm_step_kill(self, run_step: RunStep) -> None:
        """Take a RUN_STEP message's `chaos_die_after_forwards` (a replica dies in the middle of the step)."""
        if run_step.chaos_die_after_forwards is not None:
            self.die_after_forwards = run_step.chaos_die_after_forwards

    def computed(self, run: Any) -> None:
        """Count one forward of the step; the last one allowed kills this peer."""
        if self.die_after_forwards is None:
            return
        self.die_after_forwards -= 1
        if self.die_after_forwards <= 0:
            self.die_after_forwards = None
            self.die(f"replica after a forward of step {run.step} (a replica lost mid-step)")

    def arm_rebuild_kill(self, assign: Assign) -> None:
        """Take an ASSIGN message's `chaos_die_after_pulls` (before the rebuild's pulls start)."""
        if assign.chaos_die_after_pulls is not None:
            self.die_after_pulls = assign.chaos_die_after_pulls

    def arm_delay(self, assign: Assign) -> None:
        """Take an ASSIGN message's `inject_delay` (once the stage is ready)."""
        if assign.inject_delay is not None:  # (seconds, from step)
            self.inject_delay = assign.inject_delay
            log.warning("diagnostic: %.3g s delay per forward/backward from step %d", *self.inject_delay)

    def slowed(self, fn: Callable[..., Any], step: int) -> Callable[..., Any]:
        """`fn`, preceded on the compute thread by the diagnostic delay from its step on, while the
        event loop keeps answering pings and heartbeats."""
        if self.inject_delay is None or step < self.inject_delay[1]:
            return fn
        delay = self.inject_delay[0]

        def slow(*args: Any) -> Any:
            time.sleep(delay)
            return fn(*args)

        return slow

    def pulled(self, part: str, stage: Any) -> None:
        """Count one weight pull of a rebuild; the last one allowed kills this process."""
        if self.die_after_pulls is None:
            return
        self.die_after_pulls -= 1
        if self.die_after_pulls <= 0:
            self.die(f"replacement after pulling {part} of stage {stage}")

    def dump(self, name: str, state: dict[str, torch.Tensor], meta: dict) -> None:
        """Save a state dict and its metadata under the dump directory (if there is one)."""
        if not self.dump_dir:
            return
        from safetensors.torch import save_file

        path = Path(self.dump_dir)
        path.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().cpu().contiguous() for k, v in state.items()}, str(path / f"{name}.safetensors"))
        (path / f"{name}.json").write_text(json.dumps(meta))

    def dump_final(self, worker: StageWorker, omega: float, tag: str = "") -> None:
        """The weights and Adam state the stage ends the run with (on the compute thread); `tag` ends the names
        (a stage group's replicas: the peer's id)."""
        keys, tensors = optim_to_wire(worker.optimizer_state())
        self.dump(f"final-stage{worker.index}{tag}", worker.state_dict(), {"omega": omega})
        self.dump(f"final-stage{worker.index}{tag}-optim", {"/".join(k): t for k, t in zip(keys, tensors)},
                  {"lr_scale": worker.lr_scale})
