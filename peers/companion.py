"""REFT's crash-surviving snapshot holder: a small companion process per peer (`--strategy reft`) that keeps the
peer's newest snapshot and parity block in its own memory, so that a crash of the peer's training process alone
(not of its machine, which takes the whole process group) loses no snapshot.

The peer starts it when it joins a reft run (`python -m peers.companion`, in the peer's process group: a
machine's death kills both) and stores each snapshot in it over a direct TCP connection authenticated with the
run secret (`checkfree.net.tcp_transport`, on the peer's host). A replacement for a crashed peer fetches the
snapshot from it (assign mode `restore` whose `parity` names the `companion`), and falls back to decoding the
snapshot from the group's parity when the companion does not answer. The companion stores only what its own
peer sends, serves it to run members, and exits when told (its peer leaving), or `linger` seconds after its peer
died (time for a replacement to fetch).

    python -m peers.companion --peer-id ID --host 127.0.0.1 --linger 120      # the secret: $CHECKFREE_SECRET
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import subprocess
import sys
import time

import torch

from checkfree.auth import SECRET_ENV
from checkfree.net.errors import TransportError, warn_once
from checkfree.net.tcp_transport import UNAUTHENTICATED, TcpTransport, start_tcp_transport
from checkfree.messages import CompanionFetch, CompanionStop, CompanionStore, Ok, from_wire, reply_of, to_wire
from checkfree.protocol import ProtocolError

__all__ = ["READY", "start_companion", "fetch_snapshot", "companion_id"]

log = logging.getLogger(__name__)

# its RPCs (checkfree.messages): CompanionStore, the peer's newest snapshot (only from the peer itself);
# CompanionFetch, the snapshot of `step` for a replacement; CompanionStop, the peer leaves: so does its companion
READY = "companion ready"


def companion_id(peer_id: str) -> str:
    return f"companion-{peer_id}"


class Companion:
    def __init__(self, peer_id: str, parent: int, linger: float) -> None:
        self.peer_id, self.parent, self.linger = peer_id, parent, linger
        self.snapshot: tuple[CompanionStore, bytes, bytes] | None = None  # (step, stage, parity meta; state; parity)
        self.done = asyncio.Event()

    async def on_store(self, header: dict, tensors: list, caller) -> tuple[dict, list]:
        """The peer's snapshot and its parity block (`holder`, `n`, `lengths`: checkfree.baselines.Raim5Block)."""
        meta: CompanionStore = from_wire(header, CompanionStore)
        if str(caller) != self.peer_id:
            raise ProtocolError(f"only peer {self.peer_id} stores snapshots here, not {caller}")
        if len(tensors) != 2 or any(t.dtype != torch.uint8 or t.dim() != 1 for t in tensors):
            raise ProtocolError("a snapshot and its parity block are two 1-D uint8 tensors")
        self.snapshot = (meta, tensors[0].numpy().tobytes(), tensors[1].numpy().tobytes())
        return to_wire(Ok()), []

    async def on_fetch(self, header: dict, tensors: list, caller) -> tuple[dict, list]:
        fetch: CompanionFetch = from_wire(header, CompanionFetch)
        step = fetch.step
        if self.snapshot is None or self.snapshot[0].step != step:
            raise ProtocolError(f"no snapshot of step {step} here "
                                f"(have: {None if self.snapshot is None else self.snapshot[0].step})")
        meta, blob, parity = self.snapshot
        return to_wire(meta), [torch.frombuffer(bytearray(blob), dtype=torch.uint8),
                               torch.frombuffer(bytearray(parity), dtype=torch.uint8)]

    async def on_stop(self, header: dict, tensors: list, caller) -> tuple[dict, list]:
        if str(caller) != self.peer_id:
            raise ProtocolError(f"only peer {self.peer_id} stops its companion, not {caller}")
        asyncio.get_running_loop().call_later(0.05, self.done.set)
        return to_wire(Ok()), []

    async def watch_parent(self) -> None:
        """After the peer died: `linger` seconds for a replacement to fetch the snapshot, then exit."""
        while _alive(self.parent):
            await asyncio.sleep(0.5)
        log.info("companion: peer %s is gone; serving its snapshot for %.0f s", self.peer_id, self.linger)
        await asyncio.sleep(self.linger)
        self.done.set()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return os.getppid() == pid  # reparented: the peer is gone even if its pid was reused


async def _serve(args: argparse.Namespace) -> None:
    secret = os.environ.get(SECRET_ENV)
    companion = Companion(args.peer_id, os.getppid(), args.linger)
    t = await start_tcp_transport(companion_id(args.peer_id), (args.host,), 0,  # (its peer warned for it)
                                  secret=secret.encode() if secret else None, warn_unauthenticated=False)
    for name, handler in ((CompanionStore.rpc, companion.on_store), (CompanionFetch.rpc, companion.on_fetch),
                          (CompanionStop.rpc, companion.on_stop)):
        await t.register(name, handler)
    print(f"{READY} addr={t.get_visible_maddrs()[0]}", flush=True)
    watcher = asyncio.create_task(companion.watch_parent())
    try:
        await companion.done.wait()
    finally:
        watcher.cancel()
        await t.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description="REFT's crash-surviving snapshot holder of one peer")
    p.add_argument("--peer-id", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--linger", type=float, default=120.0, help="seconds to serve the snapshot after the peer died")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    asyncio.run(_serve(args))


# ---- the peer's and the replacement's side ------------------------------------------------------------------
def start_companion(peer_id: str, host: str, linger: float, secret: bytes | None,
                    timeout: float = 30.0) -> tuple[subprocess.Popen, str]:
    """Start a peer's companion (blocking until its ready line, bounded by `timeout`); (process, its address). Without
    a run secret the peer warns, once per process, for every companion it starts (each its own process)."""
    if secret is None:
        warn_once(log, UNAUTHENTICATED.replace("--transport tcp", "reft's snapshot companion (tcp)"))
    env = {**os.environ, **({SECRET_ENV: secret.decode()} if secret else {})}
    proc = subprocess.Popen([sys.executable, "-m", "peers.companion", "--peer-id", peer_id, "--host", host,
                             "--linger", str(linger)], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env,
                            text=True)
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None  # (a pipe)
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith(READY):
            proc.stdout.close()
            return proc, line.split("addr=", 1)[1].strip()
        if not line and proc.poll() is not None:
            break
    proc.kill()
    proc.wait()
    raise TransportError(f"the snapshot companion did not start within {timeout:g} s")


async def fetch_snapshot(me: str, address: str, step: int, secret: bytes | None,
                         timeout: float) -> tuple[CompanionStore, bytes, bytes]:
    """A replacement: (the snapshot's description, the snapshot, the parity block) of `step` from a crashed peer's
    companion."""
    client = TcpTransport(f"{me}-fetch", secret=secret)
    try:
        peer = client.add_peer_address(address)
        reply, tensors = await client.call(peer, CompanionFetch.rpc, to_wire(CompanionFetch(step=step)),
                                           timeout=timeout)
        if len(tensors) != 2:
            raise ProtocolError(f"the companion answered {len(tensors)} tensors, not a snapshot and a parity block")
        return reply_of(CompanionFetch.rpc, reply), tensors[0].numpy().tobytes(), tensors[1].numpy().tobytes()
    finally:
        await client.shutdown()


if __name__ == "__main__":
    main()
