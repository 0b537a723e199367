"""Watch a running `checkfree local` swarm from the outside, through /proc only (no change to the runtime).

`SwarmMonitor(launcher_pid, metrics_path)` samples the launcher's process tree every `interval`
seconds in a background thread: for every process its role (coordinator, peer, their DHT child
processes, their p2pd daemons, the launcher, with its fork server: swarm/zygote.py, whose children are the
coordinators and peers), CPU seconds (the main thread, which runs the asyncio
event loop, separately from the other threads, which run torch compute), bytes written and read
through system calls (/proc/<pid>/io wchar/rchar: write()/read()-family calls, so they count
the Go p2pd daemons' socket traffic but not Python's socket.send/recv) and memory (VmHWM, the peak resident set, and
VmRSS; /proc is walked for new processes every 2 s, the known ones are read every sample). Each
sample also records how many steps the coordinator has written to metrics.jsonl, so
`per_step()` turns two samples into costs per step. Peak memory is the last VmHWM read while the
process was alive (VmHWM never decreases; the last read is at most `interval` before shutdown).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["ProcSample", "Sample", "SwarmMonitor", "ROLES"]

TICK = os.sysconf("SC_CLK_TCK")
ROLES = ("launcher", "coordinator", "coordinator-dht", "coordinator-p2pd", "peer", "peer-dht", "peer-p2pd", "other")


@dataclass
class ProcSample:
    pid: int
    role: str
    group: int  # pid of the coordinator/peer process this one belongs to (itself for those)
    cpu_main_s: float  # CPU of the main thread (the asyncio event loop in Python processes)
    cpu_other_s: float  # CPU of all other threads (the compute thread and torch's threads in a peer)
    wchar: int
    rchar: int
    vm_hwm_kb: int
    vm_rss_kb: int


@dataclass
class Sample:
    time: float
    steps: int  # lines in metrics.jsonl when sampled
    procs: dict[int, ProcSample] = field(default_factory=dict)


def _stat(path: str) -> tuple[str, int, float] | None:
    """(comm, ppid, cpu seconds) from a /proc stat file."""
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    comm = text[text.index("(") + 1 : text.rindex(")")]
    rest = text[text.rindex(")") + 2 :].split()
    return comm, int(rest[1]), (int(rest[11]) + int(rest[12])) / TICK


def _status_kb(pid: int) -> dict[str, int]:
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(("VmHWM:", "VmRSS:")):
                out[line.split(":")[0]] = int(line.split()[1])
    except OSError:
        pass
    return out


def _io(pid: int) -> dict[str, int]:
    try:
        return {k: int(v) for k, v in (line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())}
    except (OSError, ValueError):
        return {}


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _tree(root: int) -> dict[int, int]:
    """pid -> ppid of `root` and all its descendants."""
    parent = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            st = _stat(f"/proc/{entry.name}/stat")
            if st is not None:
                parent[int(entry.name)] = st[1]
    children: dict[int, list[int]] = {}
    for pid, ppid in parent.items():
        children.setdefault(ppid, []).append(pid)
    tree, todo = {}, [root]
    while todo:
        pid = todo.pop()
        tree[pid] = parent.get(pid, 0)
        todo.extend(children.get(pid, []))
    return tree


class SwarmMonitor:
    """Background sampler of a swarm's process tree; use as a context manager."""

    def __init__(self, launcher_pid: int, metrics_path: Path, interval: float = 0.5) -> None:
        self.root, self.metrics_path, self.interval = launcher_pid, Path(metrics_path), interval
        self.samples: list[Sample] = []
        self.roles: dict[int, tuple[str, int]] = {}  # pid -> (role, group), fixed at first sight
        self.peak_kb: dict[int, int] = {}  # pid -> last VmHWM seen
        self.rescan = 2.0  # seconds between walks of /proc for new processes
        self._tree: dict[int, int] = {}
        self._scanned = -1e9
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> "SwarmMonitor":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _role(self, pid: int, tree: dict[int, int]) -> tuple[str, int]:
        if pid == self.root:
            return "launcher", pid
        args = _cmdline(pid)
        ppid = tree.get(pid, 0)
        if ppid == self.root and "swarm.zygote" in args:  # the launcher's fork server (swarm/zygote.py): its part
            return "launcher", self.root
        if "swarm.zygote" in args:  # a child of the fork server not yet past its fork (its command line is still
            return "starting", pid  # the server's): no role yet, asked again at the next sample
        if ppid == self.root or (tree.get(ppid) == self.root and self._role(ppid, tree)[0] == "launcher"):
            if "scheduler" in args:
                return "coordinator", pid
            if "peer" in args:
                return "peer", pid
            return "other", pid
        owner = self.roles.get(ppid) or self._role(ppid, tree)
        base = owner[0].split("-")[0]
        if base not in ("coordinator", "peer"):
            return "other", pid
        if any(a.endswith("p2pd") for a in args[:1]):
            return f"{base}-p2pd", owner[1]
        if args and "python" in Path(args[0]).name and not any("resource_tracker" in a for a in args):
            return f"{base}-dht", owner[1]  # (multiprocessing's resource tracker, a python child too, is not)
        return "other", owner[1]

    def sample(self) -> Sample:
        if time.monotonic() - self._scanned > self.rescan:  # walking all of /proc is the costly part
            self._tree, self._scanned = _tree(self.root), time.monotonic()
        tree = self._tree
        s = Sample(time.monotonic(), self._steps())
        for pid in tree:
            if pid not in self.roles:
                role, group = self._role(pid, tree)
                if role == "starting":
                    continue
                self.roles[pid] = (role, group)
            role, group = self.roles[pid]
            main = _stat(f"/proc/{pid}/stat")
            if main is None:
                continue
            try:
                tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
            except OSError:
                continue
            cpu_main = cpu_total = 0.0
            for tid in tids:
                st = _stat(f"/proc/{pid}/task/{tid}/stat")
                if st is not None:
                    cpu_total += st[2]
                    if tid == pid:
                        cpu_main = st[2]
            mem, io = _status_kb(pid), _io(pid)
            if mem.get("VmHWM"):
                self.peak_kb[pid] = mem["VmHWM"]
            s.procs[pid] = ProcSample(pid, role, group, cpu_main, cpu_total - cpu_main, io.get("wchar", 0),
                                      io.get("rchar", 0), mem.get("VmHWM", 0), mem.get("VmRSS", 0))
        return s

    def _steps(self) -> int:
        try:
            return self.metrics_path.read_bytes().count(b"\n")
        except OSError:
            return 0

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.samples.append(self.sample())
            self._stop.wait(self.interval)

    def window(self, warmup: int) -> tuple[Sample, Sample] | None:
        """The first sample with at least `warmup` steps done and the last sample before the run
        finished (one with every process of the first still alive and more steps done)."""
        first = next((s for s in self.samples if s.steps >= warmup), None)
        if first is None:
            return None
        last = None
        for s in self.samples:
            if s.steps > first.steps and all(p in s.procs for p in first.procs):
                last = s
        return None if last is None else (first, last)

    def per_step(self, warmup: int) -> dict | None:
        """Costs per step between `window(warmup)`'s two samples, summed by role:
        `cpu_s` {role: {"main": s, "other": s}}, `wchar` {role: bytes}, `rchar` {role: bytes},
        plus `steps`, `wall_s` (seconds per step between the samples)."""
        w = self.window(warmup)
        if w is None:
            return None
        a, b = w
        steps = b.steps - a.steps
        cpu: dict[str, dict[str, float]] = {}
        wchar: dict[str, float] = {}
        rchar: dict[str, float] = {}
        for pid, pa in a.procs.items():
            pb = b.procs[pid]
            c = cpu.setdefault(pa.role, {"main": 0.0, "other": 0.0})
            c["main"] += (pb.cpu_main_s - pa.cpu_main_s) / steps
            c["other"] += (pb.cpu_other_s - pa.cpu_other_s) / steps
            wchar[pa.role] = wchar.get(pa.role, 0) + (pb.wchar - pa.wchar) / steps
            rchar[pa.role] = rchar.get(pa.role, 0) + (pb.rchar - pa.rchar) / steps
        return {"steps": steps, "wall_s": (b.time - a.time) / steps, "cpu_s": cpu, "wchar": wchar, "rchar": rchar}

    def peer_memory(self) -> list[dict]:
        """Per peer (one entry per peer process seen): peak resident memory of the peer process and
        the sum of the peaks of its process group (peer + its DHT process + its p2pd), in MiB. The
        group sum counts pages shared between the peer and its forked DHT process twice."""
        groups: dict[int, dict] = {}
        for pid, (role, group) in self.roles.items():
            if not role.startswith("peer"):
                continue
            g = groups.setdefault(group, {"peer_mib": 0.0, "group_mib": 0.0})
            mib = self.peak_kb.get(pid, 0) / 1024
            g["group_mib"] += mib
            if role == "peer":
                g["peer_mib"] = mib
        return list(groups.values())
