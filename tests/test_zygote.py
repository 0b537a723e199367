"""The local swarm's fork server (swarm/zygote.py): a forked child looks from outside like one Popen starts (its
own session, stdout and stderr in one pipe, a stdin pipe, its cwd, its exit status, its command line in /proc,
its group killed whole), a child behind netlab's `ip netns exec NAME` prefix in that network namespace, spawns it
cannot take go to Popen (another env, another prefix), its preload starts no thread, and a dead server means Popen
with one warning, never a hang. Real processes, a few seconds each."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from checkfree.net.lifeline import living, outliving, process_group
from swarm.processes import Proc, await_line, kill_group, spawn
from swarm.zygote import NETNS_DIR, ORPHANED, Zygote, ZygoteProcess, netns_name

pytestmark = [pytest.mark.processes, pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parent.parent
CHILD = '''
import atexit, os, subprocess, sys, time
what = sys.argv[1]
if what == "report":
    atexit.register(lambda: print("atexit ran", flush=True))
    print("cwd", os.getcwd())
    print("env", os.environ.get("ZYGOTE_TEST"))
    print("own session", os.getsid(0) == os.getpid() == os.getpgid(0))
    print("argv", sys.argv[1:])
    print("on stderr", file=sys.stderr)
    sys.exit(int(sys.argv[2]))
elif what == "echo":
    print("got", sys.stdin.readline().strip(), flush=True)
elif what == "family":  # a child in its process group, then wait
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print("child", child.pid, flush=True)
    time.sleep(600)
elif what == "raise":
    raise ValueError("boom")
elif what == "netns":  # what this process sees of the network, then wait for a line
    import socket
    print("interfaces", sorted(name for _, name in socket.if_nameindex()))
    print("proc net", sorted(line.split(":")[0].strip() for line in open("/proc/self/net/dev").readlines()[2:]))
    print("netns inode", os.stat("/proc/self/ns/net").st_ino, flush=True)
    sys.stdin.readline()
'''


@pytest.fixture
def env(tmp_path) -> dict:
    (tmp_path / "zygote_child.py").write_text(CHILD)
    return {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}", "ZYGOTE_TEST": "yes",
            "PYTHONUNBUFFERED": "1"}


def test_a_forked_child_looks_like_a_popen_one(tmp_path, env):
    with Zygote(env, preload=("json",)) as z:
        assert z.popen(["report", "0"], {**env, "ZYGOTE_TEST": "no"}, module="zygote_child") is None  # another env
        assert z.popen(["report", "0"], env, prefix=["env"], module="zygote_child") is None  # a prefix
        work = tmp_path / "work"
        work.mkdir()
        p = z.popen(["report", "3"], env, cwd=str(work), module="zygote_child")
        assert p is not None and p.stdout is not None
        out = p.stdout.read().splitlines()
        assert p.wait(timeout=30) == 3 and p.poll() == 3
        assert out == [f"cwd {work}", "env yes", "own session True", "argv ['report', '3']", "on stderr", "atexit ran"]

        p = z.popen(["echo"], env, stdin=subprocess.PIPE, module="zygote_child")
        assert p is not None and p.stdin is not None and p.stdout is not None
        p.stdin.write("hello\n")
        p.stdin.flush()
        assert p.stdout.readline() == "got hello\n"
        assert p.wait(timeout=30) == 0

        p = z.popen(["raise"], env, module="zygote_child")
        assert p is not None and p.stdout is not None
        assert "ValueError: boom" in p.stdout.read() and p.wait(timeout=30) == 1

        p = z.popen(["family"], env, module="zygote_child")
        assert p is not None
        proc = Proc(p)
        threading.Thread(target=proc.read, daemon=True).start()
        grandchild = int(await_line(proc, "child", 30).split()[1])
        cmdline = Path(f"/proc/{p.pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
        assert cmdline == [sys.executable.encode(), b"-m", b"zygote_child", b"family"]
        assert process_group(p.pid) == {p.pid, grandchild} and p.poll() is None
        kill_group(proc)  # SIGKILL of the group: the child's own child goes too
        assert p.returncode == -signal.SIGKILL and not living({p.pid, grandchild})
    assert z.process.poll() is not None  # closed with its owner


def test_the_swarm_preload_starts_no_thread_and_runs_checkfree(tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    with Zygote(env) as z:
        version = spawn(["--version"], env, zygote=z)
        assert isinstance(version.popen, ZygoteProcess)  # forked, not started with Popen
        assert await_line(version, "checkfree", 60) and version.popen.wait(timeout=30) == 0
        assert len(os.listdir(f"/proc/{z.process.pid}/task")) == 1  # imported torch & co, started no thread
        bad = spawn(["no-such-command"], env, zygote=z)
        lines = list(iter(lambda: bad.lines.get(timeout=30), None))
        assert bad.popen.wait(timeout=30) == 2 and any("invalid choice" in line for line in lines), lines


def test_a_dead_fork_server_means_popen_with_one_warning_not_a_hang(tmp_path, env, capfd):
    z = Zygote(env, preload=("json",))
    try:
        p = z.popen(["family"], env, module="zygote_child")
        assert p is not None and p.stdout is not None
        grandchild = int(p.stdout.readline().split()[1])
        z.process.kill()
        z.process.wait(timeout=10)
        assert z.popen(["report", "0"], env, module="zygote_child") is None
        assert z.popen(["report", "0"], env, module="zygote_child") is None
        assert capfd.readouterr().err.count("fork server unavailable") == 1
        assert p.poll() is None  # still running, now an orphan
        os.killpg(p.pid, signal.SIGKILL)
        assert p.wait(timeout=10) == ORPHANED  # gone; its status died with the server
        assert not outliving({p.pid, grandchild}, 10)
    finally:
        z.close()


def test_only_netlabs_prefix_is_parsed_as_a_namespace():
    assert netns_name(["ip", "netns", "exec", "cf12x0a1b-3"]) == "cf12x0a1b-3"
    for prefix in ([], ["env"], ["ip", "netns", "exec"], ["ip", "netns", "exec", "a", "b"], ["ip", "-n", "exec", "a"],
                   ["ip", "netns", "exec", "../a"], ["ip", "netns", "exec", ".."], ["ip", "netns", "exec", "-a"],
                   ["sudo", "netns", "exec", "a"]):
        assert netns_name(prefix) is None, prefix


@pytest.mark.skipif(os.name != "posix" or os.geteuid() != 0 or shutil.which("ip") is None,
                    reason="network namespaces need root and iproute2")
def test_a_child_behind_ip_netns_exec_is_forked_into_that_namespace(env):
    ns = f"zyg{os.getpid()}x{secrets.token_hex(2)}"
    subprocess.run(["ip", "netns", "add", ns], check=True, timeout=30)
    try:
        subprocess.run(["ip", "-n", ns, "link", "add", "zyg0", "type", "veth", "peer", "name", "zyg1"], check=True,
                       timeout=30)  # (a veth pair, as netlab's: no dummy module in some containers)
        prefix = ["ip", "netns", "exec", ns]
        with Zygote(env, preload=("json",)) as z:
            assert z.popen(["netns"], env, prefix=["ip", "netns", "exec", "no-such-ns-here"],
                           module="zygote_child") is None  # (Popen's `ip` then says why)
            forked = z.popen(["netns"], env, prefix=prefix, stdin=subprocess.PIPE, module="zygote_child")
            assert forked is not None and forked.stdin is not None and forked.stdout is not None
            assert forked.args == [*prefix, sys.executable, "-m", "zygote_child", "netns"]
            seen = [forked.stdout.readline() for _ in range(3)]
            assert seen[:2] == ["interfaces ['lo', 'zyg0', 'zyg1']\n", "proc net ['lo', 'zyg0', 'zyg1']\n"]
            assert int(seen[2].split()[2]) == os.stat(f"{NETNS_DIR}/{ns}").st_ino != os.stat("/proc/self/ns/net").st_ino
            listed = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30).stdout
            assert str(forked.pid) in listed.split()  # (what NetLab.kill_host signals)
            cmdline = Path(f"/proc/{forked.pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
            # what `ip netns exec` shows once it has exec'd the command
            assert cmdline == [sys.executable.encode(), b"-m", b"zygote_child", b"netns"]
            popen = subprocess.Popen([*prefix, sys.executable, "-m", "zygote_child", "netns"], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            assert popen.stdout is not None and popen.stdin is not None
            assert [popen.stdout.readline() for _ in range(3)] == seen  # the same view as `ip netns exec` gives
            for p in (forked, popen):
                p.stdin.write("\n")  # type: ignore[union-attr]
                p.stdin.flush()  # type: ignore[union-attr]
                assert p.wait(timeout=30) == 0
                p.stdin.close()  # type: ignore[union-attr]
                p.stdout.close()  # type: ignore[union-attr]
    finally:
        subprocess.run(["ip", "netns", "delete", ns], capture_output=True, timeout=30)
