"""`--netns` and `--hosts`: every process of a local swarm in a network namespace of its own (real partitions), and
emulated machines: each behind a NAT router of its own or on the public segment, each link shaped."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess

__all__ = ["NetLab"]


class NetLab:
    """`--netns`: every process of a swarm in a network namespace of its own, all wired by veth pairs to
    one bridge in a hub namespace. A partition is a real cut of one peer's link: the process keeps
    running, but nothing gets in or out until the link is back up (connections stall, as on a real
    network, rather than being refused). Needs root and iproute2. The addresses live only inside
    this lab's own namespaces: nothing reaches, or comes from, any other network."""

    def __init__(self, rate_Bps: float | None = None) -> None:
        self.tag = f"cf{os.getpid()}x{secrets.token_hex(2)}"
        self.hub = f"{self.tag}-hub"
        self.spaces: list[str] = []
        self.rate_Bps = rate_Bps  # every host's link, both directions (tc tbf); None: unshaped
        self.hosts: dict[int, dict] = {}  # link number -> {"ns", "addr", "nat", "router"}
        self._ip("netns", "add", self.hub)
        try:
            self._ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            self._ip("-n", self.hub, "link", "set", "br0", "up")
        except RuntimeError:
            self.close()
            raise

    @staticmethod
    def unavailable() -> str | None:
        """Why a lab cannot be built here (None: it can)."""
        if os.name != "posix" or os.geteuid() != 0:
            return "network namespaces need root"
        try:
            subprocess.run(["ip", "netns", "list"], check=True, capture_output=True, timeout=10)
        except (OSError, subprocess.SubprocessError) as e:
            return f"iproute2's `ip netns` does not work here ({e})"
        return None

    @staticmethod
    def nat_unavailable() -> str | None:
        """Why hosts behind NAT cannot be emulated here (None: they can): namespaces, and iptables (nft or legacy)."""
        if (why := NetLab.unavailable()) is not None:
            return why
        if shutil.which("iptables") is None:
            return ("iptables is not installed (Debian: apt-get install iptables; it brings the nft and the legacy "
                    "back ends)")
        return None

    @staticmethod
    def _run(*args: str) -> None:
        proc = subprocess.run(list(args), capture_output=True, text=True, timeout=30)
        if proc.returncode != 0:
            raise RuntimeError(f"`{' '.join(args)}` failed: {proc.stderr.strip()}")

    def _shape(self, ns: str, dev: str) -> None:
        """Egress of `dev` in namespace `ns` at the lab's rate (tc tbf); the burst holds a few full-size GSO
        packets, so that shaping drops nothing that TCP would not also see on a real link."""
        if self.rate_Bps is None:
            return
        rate = int(self.rate_Bps)
        burst = max(256 * 1024, rate // 50)
        self._run("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate",
                  f"{rate}bps", "burst", str(burst), "latency", "200ms")

    @staticmethod
    def _ip(*args: str) -> None:
        proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
        if proc.returncode != 0:
            raise RuntimeError(f"`ip {' '.join(args)}` failed: {proc.stderr.strip()}")

    def add(self) -> tuple[int, list[str], str]:
        """A new namespace linked to the bridge: (link number, command prefix, its address)."""
        n = len(self.spaces) + 1
        ns, addr = f"{self.tag}-{n}", f"10.213.{n // 200}.{n % 200 + 1}"
        self._ip("netns", "add", ns)
        self.spaces.append(ns)  # deleted by close() from here on
        self._ip("link", "add", "lab0", "netns", ns, "type", "veth", "peer", "name", f"p{n}", "netns", self.hub)
        self._ip("-n", ns, "addr", "add", f"{addr}/16", "dev", "lab0")
        for dev in ("lo", "lab0"):
            self._ip("-n", ns, "link", "set", dev, "up")
        self._ip("-n", self.hub, "link", "set", f"p{n}", "master", "br0", "up")
        self.hosts[n] = {"ns": ns, "addr": addr, "nat": False}
        self._shape(ns, "lab0")
        self._shape(self.hub, f"p{n}")
        return n, ["ip", "netns", "exec", ns], addr

    def add_nat(self) -> tuple[int, list[str], str]:
        """A new host behind a NAT router of its own, like a home router: the router's public side sits on the
        bridge; the host has a private address (10.214.N.2) and a default route through the router, which
        masquerades its connections (iptables MASQUERADE) and lets nothing in that the host did not start. The
        host can dial anyone; nobody can dial it. Returns (link number, command prefix, the host's address)."""
        n = len(self.spaces) + 1
        router, ns = f"{self.tag}-r{n}", f"{self.tag}-{n}"
        public, private, gateway = f"10.213.{n // 200}.{n % 200 + 1}", f"10.214.{n}.2", f"10.214.{n}.1"
        self._ip("netns", "add", router)
        self.spaces.append(router)
        self._ip("netns", "add", ns)
        self.spaces.append(ns)
        self._ip("link", "add", "wan0", "netns", router, "type", "veth", "peer", "name", f"p{n}", "netns", self.hub)
        self._ip("-n", router, "addr", "add", f"{public}/16", "dev", "wan0")
        self._ip("link", "add", "lan0", "netns", router, "type", "veth", "peer", "name", "lab0", "netns", ns)
        self._ip("-n", router, "addr", "add", f"{gateway}/24", "dev", "lan0")
        self._ip("-n", ns, "addr", "add", f"{private}/24", "dev", "lab0")
        for space, devs in ((router, ("lo", "wan0", "lan0")), (ns, ("lo", "lab0"))):
            for dev in devs:
                self._ip("-n", space, "link", "set", dev, "up")
        self._ip("-n", self.hub, "link", "set", f"p{n}", "master", "br0", "up")
        self._ip("-n", ns, "route", "add", "default", "via", gateway)
        nat = ["ip", "netns", "exec", router]
        self._run(*nat, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        self._run(*nat, "iptables", "-t", "nat", "-A", "POSTROUTING", "-o", "wan0", "-j", "MASQUERADE")
        self._run(*nat, "iptables", "-P", "FORWARD", "DROP")
        self._run(*nat, "iptables", "-A", "FORWARD", "-i", "lan0", "-o", "wan0", "-j", "ACCEPT")
        self._run(*nat, "iptables", "-A", "FORWARD", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED",
                  "-j", "ACCEPT")
        self.hosts[n] = {"ns": ns, "addr": private, "nat": True, "router": router, "public": public}
        self._shape(ns, "lab0")
        self._shape(router, "lan0")
        return n, ["ip", "netns", "exec", ns], private

    def pids(self, n: int) -> set[int]:
        """Every process running on host `n` now (`ip netns pids`)."""
        out = subprocess.run(["ip", "netns", "pids", self.hosts[n]["ns"]], capture_output=True, text=True,
                             timeout=30).stdout
        return {int(x) for x in out.split()}

    def kill_host(self, n: int) -> set[int]:
        """SIGKILL every process on host `n` at once (a machine that vanishes: peer, companion, DHT process, p2pd);
        the pids signalled."""
        pids = self.pids(n)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return pids

    def cut(self, n: int) -> None:
        self._ip("-n", self.hub, "link", "set", f"p{n}", "down")

    def heal(self, n: int) -> None:
        self._ip("-n", self.hub, "link", "set", f"p{n}", "up")

    def close(self) -> None:
        for ns in [*self.spaces, self.hub]:
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True, timeout=30)
        self.spaces.clear()

