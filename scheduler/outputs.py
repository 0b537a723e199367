"""What a run leaves: saves of every stage's state (--save-every, and where --resume starts), the run's
tokenizer, and the final weights gathered from the stage peers."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from checkfree.data import DataError, build_tokenizer, save_run_tokenizer
from checkfree.export import save_export
from checkfree.protocol import RPC
from checkfree.saves import newest_save, read_save, write_save

__all__ = ["OutputsMixin"]

log = logging.getLogger("scheduler.coordinator")


class OutputsMixin:
    """Part of `scheduler.coordinator.Coordinator` (see the module docstring); state lives on the coordinator."""

    async def _save(self, step: int) -> bool:
        """Gather every stage's full state, ready to run `step`, and write it to <out>/saves in a
        thread (training goes on meanwhile; the previous save is awaited first). False: a stage
        could not give its state at that step (nothing is written)."""
        replies = await asyncio.gather(*(self._call(self.stage_peer[s], RPC.GET_STATE, {"step": step},
                                                    timeout=self.t.step_timeout)
                                         for s in range(self.cfg.num_stages)), return_exceptions=True)
        bad = [s for s, r in enumerate(replies) if isinstance(r, BaseException) or r[0].get("next_step") != step]
        if bad:
            log.warning("save at step %d skipped: stage(s) %s not at that step or unreachable", step, bad)
            return False
        blobs = {s: r[1][0].numpy().tobytes() for s, r in enumerate(replies)}
        if self._saving is not None:
            await self._saving
        meta = {"iteration": self.iteration, "run_id": self.opts.run_id}
        self._saving = asyncio.create_task(asyncio.to_thread(write_save, self.opts.out, step, blobs, meta,
                                                             self.opts.keep_saves))
        self._event("save", step=step, bytes=sum(len(b) for b in blobs.values()))
        return True

    def _resume_point(self) -> dict[int, bytes]:
        """--resume: the newest save's states; training continues at its step."""
        path = newest_save(self.opts.out)
        if path is None:
            raise FileNotFoundError(f"--resume: {self.opts.out} has no complete save (run with --save-every N)")
        meta, blobs = read_save(path, self.cfg.num_stages)
        self.step = self.iteration = int(meta["step"])
        return blobs

    def _keep_tokenizer(self) -> None:
        """The run directory keeps its tokenizer (tokenizer.json) when this machine can build it."""
        try:
            tok = build_tokenizer(self.cfg.data, self.cfg.model.vocab_size)
        except DataError as e:
            log.warning("the run directory gets no tokenizer.json: %s", e)
            return
        save_run_tokenizer(tok, self.opts.out)

    async def _gather_final(self) -> None:
        states = {}
        for s in range(self.cfg.num_stages):
            reply, tensors = await self._call(self.stage_peer[s], RPC.GET_WEIGHTS, {"part": "all"},
                                              timeout=self.t.step_timeout)
            states[s] = dict(zip(reply["keys"], tensors))
        save_export(self.cfg, states, Path(self.opts.out) / "final_weights.safetensors")
