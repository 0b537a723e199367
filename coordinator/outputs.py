"""What a run leaves: its run directory (events, metrics, summary: checkfree.rundir), the measured cost of fault
tolerance (`Figures`, as the simulator reports them), saves of every stage's state (--save-every, and where
--resume starts), the run's tokenizer, and the final weights gathered from the stage peers. Every part of the
coordinator writes its events and charges its costs here."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from checkfree.config import RunConfig
from checkfree.data import DataError, build_tokenizer, save_run_tokenizer
from checkfree.export import save_export
from checkfree.messages import GetState, GetWeights
from checkfree.rundir import RunWriter
from checkfree.saves import newest_save, read_save, write_save
from checkfree.strategies.base import Figures
from coordinator.common import CoordinatorOptions
from coordinator.rpc import Rpc
from coordinator.stage_table import StageTable

__all__ = ["Outputs"]

log = logging.getLogger("coordinator.coordinator")


class Outputs:
    """The run directory (open once the run's config is known) and the run's measured figures."""

    def __init__(self, opts: CoordinatorOptions, rpc: Rpc, table: StageTable) -> None:
        self.opts, self.rpc, self.table, self.timeouts = opts, rpc, table, opts.timeouts
        self.writer: RunWriter | None = None
        self.figures = Figures()  # what fault tolerance cost this run, measured: summary.json, as the simulator's
        self._saving: asyncio.Task | None = None  # the save being written in the background
        self._tokenizer: asyncio.Task | None = None
        self._grew = asyncio.Event()  # set, and replaced, whenever the record grows (`growth`)

    def open(self, cfg: RunConfig, *, resume: bool) -> None:
        """The run directory; `resume`: go on counting in an existing one (a resumed run, a takeover)."""
        self.writer = RunWriter(self.opts.out, cfg.to_json(), tokens_per_step=cfg.tokens_per_step, resume=resume,
                                tensorboard=self.opts.tensorboard)

    @property
    def opened(self) -> bool:
        """Whether the run directory is open (the run's config is known and the run has started)."""
        return self.writer is not None

    def metric(self, record: dict) -> None:
        """One step's line in metrics.jsonl."""
        assert self.writer is not None, "the run directory is not open"
        self.writer.metric(record)
        self._grown()

    def event(self, event: str, **fields) -> None:
        """One line in events.jsonl (none before the run directory is open)."""
        if self.writer is not None:
            self.writer.event(event, **fields)
            self._grown()

    def growth(self) -> asyncio.Event:
        """An event set once the record (metrics.jsonl, events.jsonl) grows past what it holds now (a standby's
        long poll waits on it: coordinator/record_feed.py)."""
        return self._grew

    def _grown(self) -> None:
        self._grew.set()
        self._grew = asyncio.Event()

    def refused(self, peer: str) -> None:
        """A peer refused before its JOIN (its reachability probe carried no valid run token): recorded as a refused
        join, as one refused at its JOIN is."""
        self.event("join_refused", peer_id=peer, reason="bad or missing token (at its reachability probe)")

    def charge(self, **figures) -> None:
        """Add measured costs of fault tolerance (checkfree.strategies.base.Figures fields) to the run's."""
        self.figures = self.figures + Figures(**figures)

    @staticmethod
    def status(text: str) -> None:
        print(f"status: {text}", flush=True)

    def counts(self) -> dict[str, int]:
        assert self.writer is not None, "the run directory is not open"
        return self.writer.counts

    # ---- saves -----------------------------------------------------------------------------
    async def save(self, cfg: RunConfig, step: int, iteration: int) -> bool:
        """Gather every stage's full state, ready to run `step`, and write it to <out>/saves in a
        thread (training goes on meanwhile; the previous save is awaited first). False: a stage
        could not give its state at that step (nothing is written)."""
        replies = await asyncio.gather(*(self.rpc.call(self.table.peer(s), GetState(step=step),
                                                       timeout=self.timeouts.step_timeout)
                                         for s in range(cfg.num_stages)), return_exceptions=True)
        got = {s: r for s, r in enumerate(replies) if not isinstance(r, BaseException) and r[0].next_step == step}
        bad = [s for s in range(len(replies)) if s not in got]
        if bad:
            log.warning("save at step %d skipped: stage(s) %s not at that step or unreachable", step, bad)
            return False
        blobs = {s: r[1][0].numpy().tobytes() for s, r in got.items()}
        await self.saved()
        meta = {"iteration": iteration, "run_id": self.opts.run_id}
        self._saving = asyncio.create_task(asyncio.to_thread(write_save, self.opts.out, step, blobs, meta,
                                                             self.opts.keep_saves))
        self.event("save", step=step, bytes=sum(len(b) for b in blobs.values()))
        return True

    async def saved(self) -> None:
        """Until the save being written (if any) is on disk."""
        if self._saving is not None:
            await self._saving

    def resume_point(self, cfg: RunConfig) -> tuple[int, dict[int, bytes]]:
        """--resume: the newest save's step and states; training continues at that step."""
        path = newest_save(self.opts.out)
        if path is None:
            raise FileNotFoundError(f"--resume: {self.opts.out} has no complete save (run with --save-every N)")
        meta, blobs = read_save(path, cfg.num_stages)
        return int(meta["step"]), blobs

    def keep_tokenizer(self, cfg: RunConfig) -> None:
        """The run directory keeps its tokenizer (tokenizer.json), built in a thread when this machine can."""
        self._tokenizer = asyncio.create_task(asyncio.to_thread(self._build_tokenizer, cfg))

    def _build_tokenizer(self, cfg: RunConfig) -> None:
        try:
            tok = build_tokenizer(cfg.data, cfg.model.vocab_size)
        except DataError as e:
            log.warning("the run directory gets no tokenizer.json: %s", e)
            return
        save_run_tokenizer(tok, self.opts.out)

    async def gather_final(self, cfg: RunConfig) -> None:
        """Every stage's weights into final_weights.safetensors."""
        states = {}
        for s in range(cfg.num_stages):
            weights, tensors = await self.rpc.call(self.table.peer(s), GetWeights(part="all"),
                                                   timeout=self.timeouts.step_timeout)
            states[s] = dict(zip(weights.keys, tensors))
        save_export(cfg, states, Path(self.opts.out) / "final_weights.safetensors")

    def close(self, status: str, error: str | None, **fields) -> dict | None:
        """The run's summary.json (its figures included) and the end of the run directory."""
        if self.writer is None:
            return None
        summary = self.writer.summary(status, error, run_id=self.opts.run_id, **fields, **self.figures.as_dict())
        self.writer.close()
        return summary
