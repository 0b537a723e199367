"""Coordinator failover, the peer's side: ADOPT, a new coordinator taking over the run.

The admission check (peers.checks) has verified the new coordinator's proof of the run
secret. The takeover is refused while this peer's current coordinator still answers (no split
brain: a live coordinator keeps its peers). An unfinished step is dropped; a finished one is
kept so that the new coordinator can commit it if other stages already did. The reply is
everything the new coordinator needs to rebuild its state.
"""

from __future__ import annotations

import logging

from checkfree.net.transport import RemoteError, TransportError
from checkfree.messages import Adopt, Adopted, Ready, Status
from checkfree.protocol import Kind, ProtocolError
from peers.membership import Membership
from peers.snapshots import Snapshots
from peers.stage import HostedStage
from peers.step import StepTracker

__all__ = ["Failover"]

log = logging.getLogger(__name__)


class Failover:
    """Hands this peer over to a new coordinator."""

    def __init__(self, membership: Membership, hosted: HostedStage, steps: StepTracker, snapshots: Snapshots) -> None:
        self.membership, self.hosted, self.steps, self.snapshots = membership, hosted, steps, snapshots

    async def on_adopt(self, adopt: Adopt, tensors: list, peer) -> tuple[Adopted, list]:
        new, old = str(peer), self.membership.coordinator
        if old is not None and old != new:
            await self._refuse_if_alive(old, new)
        await self.steps.settled()  # a commit the old coordinator sent, still being applied: after it
        run = self.steps.run
        if run is not None and not run.ready():
            await self.steps.drop("dropped: the coordinator changed")
            run = None
        self.membership.adopted_by(new)
        log.info("coordinator %s took over run %s (previous: %s)", new, self.membership.run_id, old)
        hosted = self.hosted
        return Adopted(stage=hosted.index, state=hosted.state.value, next_step=hosted.next_step, omega=hosted.omega,
                       token=self.membership.token(), config=hosted.cfg.to_json() if hosted.cfg is not None else None,
                       ready=None if run is None else Ready(step=run.step, attempt=run.attempt, losses=dict(run.losses),
                                                           **run.figures()),
                       finished=self.steps.finished, last_commit=hosted.last_commit,
                       snapshots=self.snapshots.steps_held(), members=dict(self.steps.members),
                       epoch=hosted.epoch), []

    async def _refuse_if_alive(self, old: str, new: str) -> None:
        """Refuse the takeover by `new` if the current coordinator `old` answers at all."""
        try:
            await self.membership.call(old, Status(), self.membership.timeouts.rpc_timeout)
        except (TimeoutError, TransportError, OSError):
            return  # gone: the takeover may proceed
        except RemoteError:  # it answers, if only with an error: alive
            pass
        raise ProtocolError(f"coordinator {old} of run {self.membership.run_id!r} is alive; takeover by {new} refused",
                            Kind.COORDINATOR_ALIVE)
