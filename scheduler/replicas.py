"""Redundant computation in the swarm (`--strategy redundant`, Bamboo): every stage's ring predecessor holds a
current replica of it (peers/replicas.py). The coordinator orders the replicas taken (TAKE_REPLICA, once the
stages are served and after every recovery) and, when a stage is lost while its predecessor lives, promotes the
replica: a standby takes it over exactly (assign mode `promote`), and no step is lost. Which lost stages are
promotable is the strategy object's decision (checkfree.strategies.redundant), as in the simulator."""

from __future__ import annotations

import asyncio
import time

from checkfree.protocol import RPC

__all__ = ["ReplicasMixin"]


class ReplicasMixin:
    """Part of `scheduler.coordinator.Coordinator` (see the module docstring); state lives on the coordinator."""

    async def _replicate(self, stages: set[int], step: int) -> int:
        """Each of `stages` takes a replica of its successor from the successor's peer; returns the bytes moved."""
        s_count = self.cfg.num_stages
        calls = [self._call(self.stage_peer[s], RPC.TAKE_REPLICA,
                            {"source": self.stage_peer[(s + 1) % s_count], "step": step}, self.t.step_timeout)
                 for s in sorted(stages)]
        replies = await asyncio.gather(*calls)
        moved = sum(int(r[0].get("bytes", 0)) for r in replies)
        self._event("replicas", step=step, stages=sorted(stages), bytes=moved)
        self._charge(bytes_moved=moved, extra_memory_bytes=max(int(r[0].get("bytes", 0)) for r in replies))
        return moved

    async def _promote(self, step: int, failed: set[int]) -> set[int]:
        """Every lost stage whose predecessor lives gets its replica promoted onto a standby; returns those."""
        promoted = self.strategy.promotable(failed)
        for s in sorted(promoted):
            holder = self.strategy.holder(s)
            t0 = time.perf_counter()
            pid, reply, _ = await self._assign_replacement(
                step, s, {"mode": "promote", "source": self.stage_peer[holder], "step": step, "stage": s}, chaos=True)
            self.norms[s] = float(reply.get("omega", 0.0))
            self._charge(bytes_moved=int(reply.get("bytes") or 0))
            self._event("recovery", step=step, stage=s, strategy=self.cfg.recovery.strategy, method="promote-replica",
                        source=holder, lost_steps=0, peer_id=pid, bytes=reply.get("bytes", 0),
                        recovery_time_s=round(time.perf_counter() - t0, 6))
            self._status(f"stage {s} recovery: replica promoted from stage {holder} on peer {pid[-8:]}, "
                         f"{time.perf_counter() - t0:.2f} s")
        return promoted
