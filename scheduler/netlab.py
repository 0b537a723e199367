"""`--netns`: every process of a local swarm in a network namespace of its own (real partitions)."""

from __future__ import annotations

import os
import secrets
import subprocess

__all__ = ["NetLab"]


class NetLab:
    """`--netns`: every process of a swarm in a network namespace of its own, all wired by veth pairs to
    one bridge in a hub namespace. A partition is a real cut of one peer's link: the process keeps
    running, but nothing gets in or out until the link is back up (connections stall, as on a real
    network, rather than being refused). Needs root and iproute2. The addresses live only inside
    this lab's own namespaces: nothing reaches, or comes from, any other network."""

    def __init__(self) -> None:
        self.tag = f"cf{os.getpid()}x{secrets.token_hex(2)}"
        self.hub = f"{self.tag}-hub"
        self.spaces: list[str] = []
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
        return n, ["ip", "netns", "exec", ns], addr

    def cut(self, n: int) -> None:
        self._ip("-n", self.hub, "link", "set", f"p{n}", "down")

    def heal(self, n: int) -> None:
        self._ip("-n", self.hub, "link", "set", f"p{n}", "up")

    def close(self) -> None:
        for ns in [*self.spaces, self.hub]:
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True, timeout=30)
        self.spaces.clear()

