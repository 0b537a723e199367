"""What a peer hosts: the run's config once joined, and the one stage it serves (if any).

`HostedStage` is the state the other parts of a peer read and change: the stage's worker
(weights, Adam), its omega (the gradient-norm weight a CheckFree recovery averages with), the
step its weights are ready for, and the newest commit's figures. Building a stage and
capturing or loading its full state happen here, on the compute thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from enum import Enum
from typing import Any

from checkfree.config import RunConfig
from checkfree.data import TokenData, build_data
from checkfree.pipeline import edge_holders
from checkfree.messages import LastCommit
from checkfree.protocol import ProtocolError
from checkfree.recovery import OmegaWindow
from checkfree.serialize import state_from_bytes, state_to_bytes
from checkfree.snapcodec import CopyFormat
from checkfree.softerrors import make_guard
from checkfree.strategies.state import capture_worker, restore_worker, with_components
from checkfree.worker import StageWorker, resolve_device

__all__ = ["HostedStage", "PeerState"]

log = logging.getLogger(__name__)


class PeerState(Enum):
    JOINING = "joining"
    STANDBY = "standby"
    SERVING = "serving"
    LEAVING = "leaving"


class HostedStage:
    """The run config and the stage of one peer."""

    def __init__(self) -> None:
        self.changed = asyncio.Event()  # set when the stage or state changes (the heartbeat announces it at once)
        self.state = PeerState.JOINING
        self.cfg: RunConfig | None = None
        self.worker_cfg: RunConfig | None = None  # the config with the strategy's routes and replicas
        self.plus = False  # CheckFree+: swapped routes, replicated embedding and head
        self.redundant = False  # redundant computation: this peer also holds its successor's replica
        self.companion = False  # reft: a companion process keeps this peer's snapshots (peers/companion.py)
        self.copy_format: CopyFormat | None = None  # snap: the format of the streamed copies
        self.worker: StageWorker | None = None
        self.omega = 0.0  # as a recovery reads it: the mean of the stage's last recovery.omega_window steps' norms
        self._window = OmegaWindow()
        self.data: TokenData | None = None
        self.next_step = 0  # the step this stage's weights are ready for (steps committed so far)
        self.epoch = 0  # the epoch of the assignment this peer serves its stage under (`Assign.epoch`)
        self.last_commit: LastCommit | None = None  # the newest committed step's losses/lr/norm (for a new coordinator)
        self._configured = asyncio.Event()  # set once the run's config is known

    @property
    def state(self) -> PeerState:
        return self._state

    @state.setter
    def state(self, state: PeerState) -> None:
        """Every change of state (a stage served, let go, left) is announced by the heartbeat at once (`changed`)."""
        self._state = state
        self.changed.set()

    async def changes(self, timeout: float) -> None:
        """Until the stage or state changes, or `timeout` seconds pass (the change seen is consumed)."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.changed.wait(), timeout)
        self.changed.clear()

    @property
    def index(self) -> int:
        """The hosted stage, -1 while standing by."""
        return self.worker.index if self.worker is not None else -1

    def configure(self, cfg: RunConfig, device: str | None) -> None:
        """Take the run's config (from the coordinator's JOIN reply); `device` overrides the run's."""
        from checkfree.strategies import build_strategy, worker_config

        if device:
            cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, device=device))
        self.cfg = cfg
        resolve_device(cfg.train.device)
        strategy = build_strategy(cfg)
        self.plus = strategy.plus
        self.redundant = strategy.peer_service == "replicas"
        self.companion = strategy.peer_service == "companion"
        self.copy_format = strategy.copy_format
        self.worker_cfg = worker_config(cfg, strategy)
        self.state = PeerState.STANDBY
        self._configured.set()

    def joined(self) -> RunConfig:
        """The run's config; refuses a request that needs it before this peer has joined."""
        if self.cfg is None:
            raise ProtocolError("this peer has not joined a run yet")
        return self.cfg

    async def joining(self, timeout: float) -> RunConfig:
        """The run's config, waiting up to `timeout` s for it: the coordinator may assign a stage as soon as it
        has admitted this peer, before its JOIN reply has arrived here."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._configured.wait(), timeout)
        return self.joined()

    def serving(self) -> StageWorker:
        """The hosted stage's worker; refuses a request that needs one while standing by."""
        if self.worker is None:
            raise ProtocolError("this peer hosts no stage")
        return self.worker

    # ---- changes (every part changes the hosted stage through these) -----------------------
    def serve(self, worker: StageWorker, omega: float, next_step: int, epoch: int = 0) -> None:
        """Serve `worker`'s stage from now on, its weights ready for `next_step`, under the assignment of `epoch`
        (`Assign.epoch`)."""
        self.worker, self.next_step, self.epoch = worker, next_step, epoch
        self._restart_window(omega)
        self.state = PeerState.SERVING

    def rolled_back(self, omega: float, next_step: int, worker: StageWorker | None = None) -> None:
        """The stage's weights are a copy's now (or, `worker`, its initial state), ready for `next_step`."""
        if worker is not None:
            self.worker = worker
        self.next_step = next_step
        self._restart_window(omega)

    def committed(self, omega: float | None, next_step: int, figures: LastCommit) -> None:
        """A step was committed (`omega` None: its update was skipped, the norm stays); `figures` what a new
        coordinator may need of it."""
        if omega is not None:
            self.omega = self._window.add(omega)
        self.next_step, self.last_commit = next_step, figures

    def _restart_window(self, omega: float) -> None:
        """The stage's omega is `omega` now (a copy's, or 0 for a new stage): its window starts again from it."""
        self.omega = omega
        self._window = OmegaWindow(self.cfg.recovery.omega_window if self.cfg else 1, omega or None)

    def release(self) -> None:
        """Let the stage go and stand by again (a stage group's replica moved elsewhere)."""
        self.worker, self.omega, self.next_step = None, 0.0, 0
        self.state = PeerState.STANDBY

    def leave(self) -> None:
        self.state = PeerState.LEAVING

    # ---- on the compute thread --------------------------------------------------------
    def build(self, stage: int, init: bool = True, guard: bool = True) -> StageWorker:
        """The stage's worker; init=False leaves its weights unallocated (a recovery loads them); guard=False:
        no soft-error guard (a redundant replica)."""
        c, worker_cfg = self.joined(), self.worker_cfg
        assert worker_cfg is not None  # (set with the config: `configure`)
        worker = StageWorker(worker_cfg, stage, init=init)
        if guard:
            worker.attach_guard(make_guard(c, stage))
        if self._needs_data(stage) and self.data is None:
            self.data = build_data(c.data, vocab_size=c.model.vocab_size, context_length=c.seq_len,
                                   seed=c.train.seed, microbatch_size=c.train.microbatch_size)
        return worker

    def _needs_data(self, stage: int) -> bool:
        holders = edge_holders(self.joined().num_stages, self.plus)
        return stage in holders["embed"] or stage in holders["head"]

    def capture_bytes(self, step: int) -> bytearray:
        """The hosted stage's full state as of `step` (weights, Adam, LR scale, RNG, omega), serialised straight
        from the live tensors (one copy)."""
        return state_to_bytes(capture_worker(self.serving(), step, self.omega, clone=False))

    @staticmethod
    def load_bytes(worker: StageWorker, blob: Any, donors: dict | None = None) -> float:
        """Load a full state captured by `capture_bytes` (any bytes-like object; not copied before the load's own
        copy into the worker) into `worker` (its replicated components from `donors`, component -> (weights, Adam
        state), when given); returns its omega."""
        return HostedStage.load_state(worker, state_from_bytes(blob), donors)

    @staticmethod
    def load_state(worker: StageWorker, state: dict, donors: dict | None = None) -> float:
        """`load_bytes` for a state already decoded."""
        restore_worker(worker, with_components(state, donors) if donors else state)
        return float(state["norm"])
