"""The local swarm's processes: `LocalSwarm` starts the coordinator and S + spares peers as separate OS processes
(each in its own process group, so a kill takes its DHT process and p2p daemon with it, like a machine
vanishing), acts on the coordinator's chaos requests (SIGKILL, SIGTERM, partitions, a killed coordinator and its
failover), starts a replacement process after every kill, follows the coordinator's step lines for the progress
bar, and tears everything down. `checkfree local` (swarm/local_cli.py) builds it from the command line.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from checkfree.auth import SECRET_ENV
from checkfree.progress import Progress
from checkfree.protocol import READY_COORDINATOR, READY_STANDBY
from ops.dashboard import DASHBOARD_LINE
from faults.injector import parse_chaos_line
from swarm.netlab import NetLab
from swarm.processes import Proc, await_line, kill_group, spawn
from swarm.zygote import Zygote, enabled

__all__ = ["LocalSwarm", "SwarmOptions", "STEP_LINE"]

# a peer's line once the coordinator has told it the run is over (peers/daemon.py `_on_shutdown`): it is exiting
PEER_EXITING = re.compile(r"^run finished \(.*\); exiting$")
# how long the coordinator's output is still read after it exited (what it wrote before is read at once; the
# end of its output is not awaited: torch's shared-memory manager, its child, holds the pipe open up to 2 s
# after it exits), in all and between two lines
DRAIN_S, DRAIN_QUIET_S = 1.0, 0.2
# how long the teardown waits for peers the coordinator told to exit to go by themselves before SIGTERM
PEER_EXIT_S = 3.0
# how long the teardown waits for torch's shared-memory managers to exit by themselves (2 s after their last client)
SHM_MANAGER_S = 3.0

STEP_LINE = re.compile(r"^step (\d+): loss ([-+\w.]+)(?:, val ([-+\w.]+))?.*peers (\d+)\+(\d+), failures (\d+), "
                       r"recoveries (\d+), fallbacks (\d+)")


@dataclass(kw_only=True)
class SwarmOptions:
    out: Path
    run_id: str
    spares: int = 2
    threads_per_peer: int = 1
    ready_timeout: float = 120.0
    progress: bool = True
    shared_flags: list[str] = field(default_factory=list)
    peer_flags: list[str] = field(default_factory=list)
    coordinator_flags: list[str] = field(default_factory=list)
    kill_coordinator_at: int | None = None
    failover: str = "standby"  # standby | restart
    kill_coordinator_in: str = "step"  # step | commit | faults
    # the standby coordinator's own run directory (None: --out, shared with the coordinator); it reads nothing of
    # --out: the run's config and record reach it over the network (coordinator/record_feed.py)
    standby_out: Path | None = None
    netns: bool = False  # every process in its own network namespace (NetLab)
    hosts: bool = False  # every process on an emulated host of its own (NetLab; implies netns)
    nat_peers: int = 0  # with hosts: the first N peers started sit behind a NAT router each
    host_rate_Bps: float | None = None  # with hosts: every host's link shaped to this rate (tc tbf), both ways
    progress_lines: bool = True  # print each peer's start-up milestones



def _first_addr(ready_line: str) -> str:
    """The first address a ready line gives (`... addrs=A,B`)."""
    m = re.search(r"addrs=([^,\s]+)", ready_line)
    if m is None:
        raise RuntimeError(f"a ready line without addresses: {ready_line!r}")
    return m.group(1)


def _dashboard_note(line: str) -> str:
    """`swarm: dashboard URL (...)` from a coordinator's `dashboard: URL (...)` line."""
    return f"swarm: dashboard {line.removeprefix(DASHBOARD_LINE).strip()}"


class LocalSwarm:
    """Processes of one local run; `run()` returns the coordinator's exit code."""

    def __init__(self, config_path: Path, chaos_path: Path, opts: SwarmOptions) -> None:
        self.config_path, self.chaos_path, self.opts = config_path, chaos_path, opts
        self.coordinator: Proc | None = None
        self.standby: Proc | None = None
        self.old_coordinators: list[Proc] = []
        self.peers: list[Proc] = []
        self.crashed: list[Proc] = []  # peers whose training process alone was SIGKILLed (their group lives on)
        self.addr = ""  # the running coordinator's address (empty: not known, a restarted one)
        self.standby_addr = ""
        self.secret = os.environ.get(SECRET_ENV) or secrets.token_hex(16)  # every local swarm is authenticated
        self.kills = 0
        self.preempted = 0
        self.partitioned = 0
        self.lab = NetLab(opts.host_rate_Bps if opts.hosts else None) if opts.netns or opts.hosts else None
        (opts.out / "logs").mkdir(parents=True, exist_ok=True)
        # the processes' temporary directory, removed at teardown: what a SIGKILLed process cannot remove itself
        # (multiprocessing's pymp-* listener directories, torch's shared-memory manager socket) goes with it
        self.tmp = Path(tempfile.mkdtemp(prefix="checkfree-swarm-"))
        self._n = 0
        self.zygote: Zygote | None = None  # the fork server of this swarm's processes (started by the first spawn)
        self._read: list[Proc] = []  # coordinators whose output has been read to its end

    def _running(self) -> Proc:
        """The coordinator running the run now (once started)."""
        assert self.coordinator is not None, "the coordinator has not been started"
        return self.coordinator

    def _spawn(self, name: str, args: list[str], stdin=subprocess.DEVNULL) -> Proc:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(self.opts.threads_per_peer),
               SECRET_ENV: self.secret, "TMPDIR": str(self.tmp)}
        if self.zygote is None and enabled(env):  # (the env every process of it gets; with a NetLab, every spawn's
            # prefix `ip netns exec NAME` too: the child enters that namespace itself, swarm/zygote.py)
            self.zygote = Zygote(env, ready_timeout=self.opts.ready_timeout, log=self.opts.out / "logs" / "zygote.log")
        link, prefix = 0, list[str]()  # (no namespace: no prefix)
        if self.lab is not None:  # its own namespace, listening on its address there (the last flag wins)
            behind_nat = self.opts.hosts and name.startswith("peer") and self._n <= self.opts.nat_peers
            link, prefix, addr = self.lab.add_nat() if behind_nat else self.lab.add()
            args = [*args, "--host-maddrs", f"/ip4/{addr}/tcp/0"]
            if self.opts.hosts:
                host = self.lab.hosts[link]
                where = (f"behind NAT (private {addr}, router {host['public']})" if behind_nat
                         else f"public {addr}")
                print(f"swarm: {name} on emulated host {host['ns']}, {where}", flush=True)
        return spawn(args, env, log=self.opts.out / "logs" / f"{name}.log", prefix=prefix, stdin=stdin, name=name,
                     link=link, announce=name.startswith("peer") and self.opts.progress_lines, zygote=self.zygote)

    def _await_ready(self, proc: Proc, prefix: str) -> str:
        return await_line(proc, prefix, self.opts.ready_timeout)

    def start_peer(self) -> Proc:
        """Start a peer process; it becomes a standby once it has joined (no waiting here)."""
        self._n += 1
        proc = self._spawn(f"peer{self._n}", ["peer", "--run-id", self.opts.run_id, "--initial-peers", *self._bootstrap(),
                                              "--threads", str(self.opts.threads_per_peer), *self.opts.shared_flags,
                                              *self.opts.peer_flags])
        self.peers.append(proc)
        return proc

    def _bootstrap(self) -> list[str]:
        """Where a new peer enters the swarm: the coordinator (while the one it was started with, or the standby
        that took over, runs) and two live peers. One address was not enough: after a failover the peer chosen
        then could die next, and every peer started after it failed to start ("could not reach any initial
        peer"), so no replacement ever joined."""
        coordinator = [self.addr] if self.coordinator is not None and self.coordinator.popen.poll() is None and \
            self.addr else []
        live = [p.addrs for p in reversed(self.peers) if p.addrs and p.popen.poll() is None]
        return list(dict.fromkeys([*coordinator, *live[:2]]))

    def kill_peer(self, peer_id: str, group: bool = True) -> None:
        """SIGKILL the peer's whole process group (its DHT process and p2pd too; group=False: its training process
        alone, the crash of a process, not of a machine: its DHT child dies with it, a reft companion lives on
        until the teardown), then replace it."""
        proc = next((p for p in self.peers if p.peer_id == peer_id), None)
        if proc is None:
            print(f"swarm: asked to kill unknown peer {peer_id}", flush=True)
            return
        if group and self.opts.hosts and proc.link and self.lab is not None:  # the whole machine: all its processes
            pids = self.lab.kill_host(proc.link)
            print(f"swarm: host {self.lab.hosts[proc.link]['ns']} of {proc.name} lost: {len(pids)} processes "
                  f"SIGKILLed at once", flush=True)
            kill_group(proc, gone_within=0)
        elif group:
            kill_group(proc, gone_within=0)
        else:
            with contextlib.suppress(ProcessLookupError):
                proc.popen.send_signal(signal.SIGKILL)
            self.crashed.append(proc)  # its group (the companion) is torn down with the others
        self.peers.remove(proc)
        self.kills += 1
        self.start_peer()

    def preempt_peer(self, peer_id: str) -> None:
        """SIGTERM a peer (a spot preemption notice): it leaves by itself, handing its stage
        over if it can. A fresh spare is started in its place."""
        proc = next((p for p in self.peers if p.peer_id == peer_id), None)
        if proc is None:
            print(f"swarm: asked to preempt unknown peer {peer_id}", flush=True)
            return
        proc.popen.send_signal(signal.SIGTERM)
        self.preempted += 1
        self.start_peer()

    def _coordinator_args(self, *extra: str) -> list[str]:
        o = self.opts
        return ["scheduler", "--config", str(self.config_path), "--out", str(o.out), "--run-id", o.run_id,
                "--chaos-trace", str(self.chaos_path), "--shutdown-peers", *o.shared_flags, *o.coordinator_flags,
                *extra]

    def _spawn_coordinator(self, name: str, *extra: str) -> Proc:
        return self._spawn(name, self._coordinator_args(*extra),
                           stdin=subprocess.PIPE)  # the launcher acknowledges partitions on it

    def _spawn_standby(self) -> Proc:
        """The hot standby coordinator: in --out, or (`standby_out`) in a directory of its own, given no file of
        --out: not the run's config (it gets it from the coordinator), only the fault schedule, copied there (the
        test's faults, which the standby fires once it runs the run)."""
        o = self.opts
        args = ["--standby", "--initial-peers", self.addr]
        if o.standby_out is None:
            return self._spawn_coordinator("coordinator-standby", *args)
        o.standby_out.mkdir(parents=True, exist_ok=True)
        chaos = shutil.copy(self.chaos_path, o.standby_out / "chaos_trace.csv")
        stages = json.loads(self.config_path.read_text())["num_stages"]  # (the fault schedule's stages are checked)
        return self._spawn("coordinator-standby", [
            "scheduler", "--out", str(o.standby_out), "--run-id", o.run_id, "--stages", str(stages), "--chaos-trace",
            str(chaos), "--shutdown-peers", *o.shared_flags, *o.coordinator_flags, *args], stdin=subprocess.PIPE)

    def partition_peer(self, peer_id: str, heal: bool = False) -> None:
        """Cut a peer's link (it stays alive but unreachable) and start a spare in its place, then tell the
        coordinator (on its stdin) that the cut is in effect; or heal the link."""
        proc = next((p for p in self.peers if p.peer_id == peer_id), None)
        if proc is None or self.lab is None:
            print(f"swarm: cannot partition peer {peer_id} (unknown, or no --netns)", flush=True)
        elif heal:
            self.lab.heal(proc.link)
            state = "alive" if proc.popen.poll() is None else f"exited {proc.popen.returncode}"
            print(f"swarm: partition of peer {peer_id} healed (process {state})", flush=True)
        else:
            self.lab.cut(proc.link)
            self.partitioned += 1
            self.start_peer()
        if not heal:
            stdin = self._running().popen.stdin
            with contextlib.suppress(OSError):  # the coordinator waits for this line
                assert stdin is not None  # (a pipe: `_spawn_coordinator`)
                stdin.write("partitioned\n")
                stdin.flush()

    def run(self) -> int:
        o = self.opts
        extra = []
        if o.kill_coordinator_at is not None:  # it asks for its SIGKILL (a CHAOS line) where it is to die
            where = {"commit": "--chaos-die-in-commit", "faults": "--chaos-die-after-faults"}.get(
                o.kill_coordinator_in, "--chaos-die-at")
            extra = [where, str(o.kill_coordinator_at)]
        coordinator = self.coordinator = self._spawn_coordinator("coordinator", *extra)
        self.addr = _first_addr(self._await_ready(coordinator, READY_COORDINATOR))
        self._show_dashboard(coordinator)
        if o.kill_coordinator_at is not None and o.failover == "standby":
            self.standby = self._spawn_standby()
            self.standby_addr = _first_addr(self._await_ready(self.standby, READY_STANDBY))
        cfg = json.loads(self.config_path.read_text())
        count = cfg["num_stages"] * cfg["train"].get("replicas", 1) + o.spares
        first = [self.start_peer() for _ in range(min(o.nat_peers, count) if o.hosts else 0)]
        for proc in first:  # the peers behind NAT join first, so that they serve stages (not only stand by)
            deadline = time.monotonic() + o.ready_timeout
            while not proc.joined.wait(0.2) and proc.popen.poll() is None and time.monotonic() < deadline:
                pass
        first += [self.start_peer() for _ in range(count - len(first))]
        for proc in first:  # all start in parallel; a peer that cannot start is an error (while the run is on)
            if (not proc.ready.wait(o.ready_timeout) or not proc.peer_id) and coordinator.popen.poll() is None:
                raise RuntimeError(f"a peer did not start within {o.ready_timeout:g} s; see {proc.log}")
        return self._follow(cfg["train"]["num_steps"])

    def _follow(self, num_steps: int) -> int:
        bar = Progress(num_steps, "swarm", enabled=self.opts.progress)
        try:
            while True:
                if (line := self._next_line()) is None:
                    break
                if (chaos := parse_chaos_line(line)) is not None:
                    action, fields = chaos
                    if action in ("kill", "crash"):
                        self.kill_peer(fields["peer"], group=action == "kill")
                    elif action in ("rebuild-kill", "replica-kill", "self-kill"):  # it kills itself (its hook)
                        self.kills += 1
                        self.start_peer()
                    elif action == "term":
                        self.preempt_peer(fields["peer"])
                    elif action == "join":  # a standby joining mid-run
                        self.start_peer()
                    elif action in ("partition", "heal"):
                        self.partition_peer(fields["peer"], heal=action == "heal")
                    elif action == "coordinator-dies":  # where it was to die, as asked (--kill-coordinator-at/-in)
                        self.kill_coordinator()
                elif (m := STEP_LINE.match(line)) is not None:
                    bar.update(int(m.group(1)) + 1, loss=m.group(2), live=m.group(4), spare=m.group(5),
                               failures=m.group(6), recoveries=m.group(7))
                elif line.startswith(DASHBOARD_LINE):  # a coordinator started by a failover: its own dashboard
                    bar.write(_dashboard_note(line))
                elif line.startswith("status:") or "Error" in line or "error" in line:
                    bar.write(line)
            return self._running().popen.wait()
        finally:
            bar.close()

    def _next_line(self) -> str | None:
        """The running coordinator's next output line; None at its end, or once it has exited and what it wrote
        before is read: lines that come at once (DRAIN_QUIET_S apart, DRAIN_S in all), not the end of its output,
        which a child of its may hold open."""
        running = self._running()
        drain_until = None
        while True:
            wait = 0.1 if drain_until is None else min(DRAIN_QUIET_S, drain_until - time.monotonic())
            try:
                if (line := running.lines.get(timeout=max(0.0, wait))) is None:
                    self._read.append(running)
                return line
            except queue.Empty:
                if drain_until is not None:
                    return None
                if running.popen.poll() is not None:
                    drain_until = time.monotonic() + DRAIN_S

    @staticmethod
    def _show_dashboard(proc: Proc) -> None:
        """Print the address of a coordinator's dashboard (its line comes before the coordinator's ready line)."""
        if (line := next((x for x in proc.out if x.startswith(DASHBOARD_LINE)), None)) is not None:
            print(_dashboard_note(line), flush=True)

    def kill_coordinator(self) -> None:
        """SIGKILL the coordinator's process group; the standby takes over, or a new coordinator
        is started with --takeover, bootstrapping from live peers."""
        old = self._running()
        kill_group(old, gone_within=0)
        self.old_coordinators.append(old)
        live = [p.addrs for p in self.peers if p.addrs and p.popen.poll() is None]
        self.addr = ""  # later peers bootstrap from live peers (`_bootstrap`), and from the standby that takes over
        print(f"swarm: coordinator SIGKILLed; {self.opts.failover} coordinator takes over", flush=True)
        if self.standby is not None:
            self.coordinator, self.standby, self.addr = self.standby, None, self.standby_addr
            self._show_dashboard(self.coordinator)
        else:
            self.coordinator = self._spawn_coordinator("coordinator-takeover", "--takeover", "--initial-peers",
                                                       *live[:2])

    def teardown(self) -> None:
        """Stop the coordinator first (SIGTERM: it records the run's end, saves if asked and tells the
        peers to exit), let the peers it told exit by themselves, then SIGTERM whatever still runs, then SIGKILL
        whole process groups. Each phase ends as soon as its processes are gone; every group is gone within
        about 15 s whatever state the run was in (torch's shared-memory managers, outside them, 3 s later)."""
        coordinators = [p for p in [self.coordinator, self.standby, *self.old_coordinators] if p is not None]
        self._stop(coordinators, wait_s=8, group=False)  # its DHT and p2pd must outlive its goodbyes
        start = time.monotonic()
        _wait_exit([p for p in self.peers if _exiting(p)], PEER_EXIT_S)  # their final state and logs written
        procs = [*coordinators, *self.peers]
        self._stop(procs, wait_s=max(1.0, 4.0 - (time.monotonic() - start)))  # (4 s for the peers to go, in all)
        deadline = time.monotonic() + 3.0
        for p in [*procs, *self.crashed]:  # a group may outlive its leader (DHT child, p2pd, companion): gone in 3 s
            kill_group(p, gone_within=max(0.0, deadline - time.monotonic()))
        if self.zygote is not None:  # (after the kills: it reports its children's exits)
            self.zygote.close()
        if self.lab is not None:
            self.lab.close()
        # the p2pd of a SIGKILLed peer cannot remove its socket file: remove those nothing listens on any more
        from checkfree.net.lifeline import sweep_stale_sockets

        sweep_stale_sockets(min_age_s=1.0)
        self._await_shm_managers()
        shutil.rmtree(self.tmp, ignore_errors=True)
        deadline = time.monotonic() + DRAIN_S
        for p in [p for p in coordinators if p not in self._read]:  # its group is gone, so its output ends now:
            with contextlib.suppress(queue.Empty):  # its log is complete when this returns
                while p.lines.get(timeout=max(0.0, deadline - time.monotonic())) is not None:
                    pass

    def _await_shm_managers(self) -> None:
        """Until torch's shared-memory managers of the swarm's processes have exited (SHM_MANAGER_S at most, then
        SIGKILL). Each runs in a session of its own (no group kill reaches it) with its socket in our temporary
        directory (its TMPDIR, inherited); it unlinks its clients' /dev/shm segments and exits 2 s after the last
        client is gone: with its directory removed before that it aborts and leaves the segments behind."""
        from checkfree.net.lifeline import outliving

        managers = set()
        for entry in Path("/proc").iterdir():
            with contextlib.suppress(OSError):
                if entry.name.isdigit() and (entry / "comm").read_text().startswith("torch_shm_manag") and \
                        f"TMPDIR={self.tmp}\0".encode() in (entry / "environ").read_bytes():  # (comm: 15 bytes)
                    managers.add(int(entry.name))
        for pid in outliving(managers, timeout=SHM_MANAGER_S, poll=0.05):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    @staticmethod
    def _stop(procs: list[Proc], wait_s: float, group: bool = True) -> None:
        """SIGTERM each process (or its whole group) and wait up to `wait_s` for all to exit."""
        for p in procs:
            if p.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    if group:
                        os.killpg(p.popen.pid, signal.SIGTERM)
                    else:
                        p.popen.terminate()
        _wait_exit(procs, wait_s)


def _exiting(proc: Proc) -> bool:
    """Whether a peer said it is exiting because the run is over (and has not exited yet)."""
    return proc.popen.poll() is None and any(PEER_EXITING.match(line) for line in list(proc.out))


def _wait_exit(procs: list[Proc], wait_s: float) -> None:
    """Until every process has exited, or `wait_s` has passed: returns as soon as the last is gone."""
    deadline = time.monotonic() + wait_s
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
