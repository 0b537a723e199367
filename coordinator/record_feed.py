"""What a standby coordinator needs to take over, over the network (FOLLOW): no disk is shared.

The standby keeps its own copy of the run in its own run directory: the run's config (config.json), its record
(metrics.jsonl and events.jsonl, the coordinator's bytes appended as they grow), and, in memory, the step the run
is at, its membership (peer -> stage) and where its checkpoints are (the storage every peer writes them to: by
default inside the coordinator's run directory, which a standby elsewhere must be told; it must reach it too). It pulls them from the live coordinator (`RecordCopy`, a long poll: the
coordinator answers once its record has grown past the copy, or after the poll's wait) and the coordinator serves
them (`RecordFeed`). At the end of every step the coordinator waits (bounded by rpc_timeout) until each standby
copying its record has that step's line: a standby's copy is never behind the newest recorded step when the next
step starts. Once the coordinator is gone, the takeover (coordinator/failover.py) reads the copy as it would the
run directory, ADOPTs the members it names, and gets what its copy lacks (a commit the old coordinator made after
its last answer) from the peers' ADOPT replies, as before.

A standby started with the coordinator's own run directory (`checkfree local`'s, a shared disk) copies nothing: the
coordinator finds the probe file the standby made there (`.standby-<probe>`) and says so.

Like torchft's lighthouse and hivemind's state averager, the newest state of the training itself (the weights)
is never copied to the standby: the peers hold it; the coordinator's own state is small (config, record,
membership) and is all that is copied.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import secrets
import time
from pathlib import Path

from checkfree.messages import BadReply, Envelope, Follow, Following
from checkfree.auth import join_token, verify
from checkfree.protocol import ProtocolError
from coordinator.common import CoordinatorOptions, RunClock
from coordinator.members import Membership
from coordinator.outputs import Outputs
from coordinator.protection import storage_dir
from coordinator.rpc import Rpc
from coordinator.stage_table import StageTable

__all__ = ["RecordFeed", "RecordCopy", "RECORD_FILES", "FEED_CHUNK", "MAX_WAIT_S"]

log = logging.getLogger("coordinator.coordinator")

RECORD_FILES = ("metrics", "events")  # <name>.jsonl: the run's record, copied line by line
FEED_CHUNK = 4 << 20  # bytes of one file that one reply carries at most
MAX_WAIT_S = 60.0  # the longest a FOLLOW may ask the coordinator to hold it
_PROBE = re.compile(r"[0-9a-f]{16,64}")


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _lines(path: Path, offset: int, limit: int = FEED_CHUNK) -> tuple[str, bool]:
    """The whole lines of `path` from byte `offset`, at most `limit` bytes; and whether more follow them."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read(limit + 1)
    except FileNotFoundError:
        return "", False
    more = len(data) > limit
    data = data[:limit]
    return data[: data.rfind(b"\n") + 1].decode("utf-8"), more


class RecordFeed:
    """The coordinator's side of FOLLOW: the run's config, record, step and membership for its standbys."""

    def __init__(self, opts: CoordinatorOptions, rpc: Rpc, members: Membership, table: StageTable,
                 clock: RunClock, outputs: Outputs) -> None:
        self.opts, self.rpc, self.members, self.table, self.clock = opts, rpc, members, table, clock
        self.outputs = outputs
        self.timeouts, self.run_id, self.secret = rpc.timeouts, rpc.run_id, rpc.secret
        self.out = Path(opts.out)
        self._copies: dict[str, tuple[int, ...]] = {}  # standby copying the record -> the bytes it holds
        self._acked = asyncio.Event()  # set (and replaced) whenever a copying standby asks again

    def sizes(self) -> tuple[int, ...]:
        """The bytes of each record file (RECORD_FILES) now."""
        return tuple(_size(self.out / f"{name}.jsonl") for name in RECORD_FILES)

    async def on_follow(self, follow: Follow, env: Envelope, peer) -> Following:
        pid = str(peer)
        if self.secret is not None and pid not in self.members.members and not verify(
                join_token(self.secret, self.run_id, pid), env.token):
            raise ProtocolError(f"unknown peer {pid}: the run's record is for its members and standbys only")
        if not _PROBE.fullmatch(follow.probe):
            raise ProtocolError(f"FOLLOW: probe {follow.probe[:80]!r} is not 16-64 lowercase hex digits")
        if follow.metrics < 0 or follow.events < 0:
            raise ProtocolError(f"FOLLOW: offsets must be >= 0, got metrics={follow.metrics} events={follow.events}")
        if not 0.0 <= follow.wait <= MAX_WAIT_S:
            raise ProtocolError(f"FOLLOW: wait must be within 0..{MAX_WAIT_S:g} s, got {follow.wait!r}")
        cfg = self.members.cfg
        if cfg is None:
            raise ProtocolError("this coordinator is not running the run (standby or taking over)")
        if (self.out / f".standby-{follow.probe}").exists():  # the standby's directory is this one: nothing to copy
            self._copies.pop(pid, None)
            await asyncio.sleep(follow.wait)
            return self._following(cfg.to_json(), shared=True)
        held = (follow.metrics, follow.events)
        self._copies[pid] = held
        self._acked.set()
        self._acked = asyncio.Event()
        grew = self.outputs.growth()
        sizes = self.sizes()
        if sizes == held and follow.wait > 0:
            try:
                await asyncio.wait_for(grew.wait(), follow.wait)
            except TimeoutError:
                pass
            sizes = self.sizes()
        restart = any(h > s for h, s in zip(held, sizes))  # rewritten (a partial line dropped): from its start
        chunks = [_lines(self.out / f"{name}.jsonl", 0 if restart else h) for name, h in zip(RECORD_FILES, held)]
        return self._following(cfg.to_json(), metrics=chunks[0][0], events=chunks[1][0], restart=restart,
                               more=any(more for _, more in chunks))

    def _following(self, config: str, **fields) -> Following:
        view = self.members.view()
        members = {p: self.table.stage_of(p) for p in sorted(view.known - view.leaving)}
        cfg = self.members.cfg
        storage = storage_dir(cfg, self.opts) if cfg is not None else ""
        return Following(config=config, step=self.clock.step, members=members, storage=storage, **fields)

    async def synced(self) -> None:
        """Until every standby copying the record holds all of it (a step's line was just written), bounded by
        rpc_timeout: a standby that does not ask in time is not waited for again until it asks again."""
        if not self._copies:
            return
        target = self.sizes()
        deadline = time.monotonic() + self.timeouts.rpc_timeout
        while behind := [p for p, held in self._copies.items() if any(h < t for h, t in zip(held, target))]:
            acked, left = self._acked, deadline - time.monotonic()
            if left <= 0:
                for p in behind:
                    del self._copies[p]
                log.warning("standby %s did not copy the run's record within rpc_timeout=%g s; going on without "
                            "waiting for it", ", ".join(behind), self.timeouts.rpc_timeout)
                return
            try:
                await asyncio.wait_for(acked.wait(), left)
            except TimeoutError:
                pass


class RecordCopy:
    """The standby's side: its copy of the run in its own run directory (`out`), brought up to date by each FOLLOW
    reply (`apply`)."""

    def __init__(self, out: str) -> None:
        self.out = Path(out)
        self.probe = secrets.token_hex(16)
        self.shared: bool | None = None  # the directory is the coordinator's (None: not known yet)
        self.held = [0] * len(RECORD_FILES)  # bytes of each record file copied
        self.config: str | None = None
        self.step: int | None = None  # the step the run was at, as last heard
        self.members: dict[str, int] = {}  # the run's live members as last heard: peer -> stage (-1: none)
        self.storage = ""  # where the run's checkpoints are, as the coordinator names them

    @property
    def _probe_file(self) -> Path:
        return self.out / f".standby-{self.probe}"

    def start(self) -> None:
        """The run directory, with the probe file that tells the coordinator whether it shares it (kept while the
        standby watches: `close`)."""
        self.out.mkdir(parents=True, exist_ok=True)
        self._probe_file.touch()

    def close(self) -> None:
        self._probe_file.unlink(missing_ok=True)

    def request(self, wait: float) -> Follow:
        return Follow(probe=self.probe, metrics=self.held[0], events=self.held[1], wait=wait)

    def apply(self, reply: Following) -> bool:
        """Bring the copy up to date with `reply`; whether it carried anything new. A reply this copy cannot take
        (a config that is not JSON, a cut line) is a BadReply, the answer of a coordinator that did not answer."""
        try:
            cfg = json.loads(reply.config)
        except ValueError as e:
            raise BadReply(f"malformed FOLLOW reply: its config is not JSON ({e})") from None
        if not isinstance(cfg, dict) or not isinstance(cfg.get("num_stages"), int):
            raise BadReply("malformed FOLLOW reply: its config names no num_stages")
        chunks = (reply.metrics, reply.events)
        if any(c and not c.endswith("\n") for c in chunks):
            raise BadReply("malformed FOLLOW reply: a record chunk ends in a cut line")
        fresh = self.shared is not False and not reply.shared  # copying from now on: the copy starts empty
        self.shared = reply.shared
        self.step, self.members, self.storage = reply.step, dict(reply.members), reply.storage
        new = reply.config != self.config or any(chunks)
        if not reply.shared:
            if reply.config != self.config or fresh:
                tmp = self.out / "config.json.tmp"
                tmp.write_text(reply.config)
                tmp.replace(self.out / "config.json")
            for i, (name, chunk) in enumerate(zip(RECORD_FILES, chunks)):
                if fresh or reply.restart:  # (whatever an earlier run left here, or a record since rewritten)
                    self.held[i] = 0
                if chunk or fresh or reply.restart:
                    with open(self.out / f"{name}.jsonl", "w" if fresh or reply.restart else "a",
                              encoding="utf-8") as f:
                        f.write(chunk)
                        f.flush()
                        os.fsync(f.fileno())
                    self.held[i] += len(chunk.encode("utf-8"))
        self.config = reply.config
        return new or reply.more
