"""Two simulated hosts on one machine: two network namespaces joined by a veth pair
(test-only helper; needs root, as CI has).

Each namespace has only ``lo`` and its end of the pair, with one address of a private /30 of
its own, so a process inside can reach the other host only across the link. The namespaces
(and with them the veth pair) are deleted on exit, whatever happened.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class Host:
    netns: str
    dev: str
    addr: str

    def wrapper(self) -> list[str]:
        """argv prefix that runs a command on this host."""
        return ["ip", "netns", "exec", self.netns]

    def link_bytes(self) -> tuple[int, int]:
        """(rx, tx) bytes of this host's end of the link so far."""
        out = subprocess.run(["ip", "-n", self.netns, "-j", "-s", "link", "show", "dev",
                              self.dev], check=True, capture_output=True, text=True,
                             timeout=30).stdout
        stats = json.loads(out)[0]["stats64"]
        return int(stats["rx"]["bytes"]), int(stats["tx"]["bytes"])

    def ucx_env(self) -> dict:
        """UCX over TCP on this host's link only: without it UCX moves the bytes through
        shared memory (one kernel), which would prove nothing about the network."""
        return {"UCX_TLS": "tcp", "UCX_NET_DEVICES": self.dev}


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed ({r.returncode}): {r.stderr.strip()} "
                           "(the two-host tests need root and iproute2)")


@contextmanager
def two_hosts():
    """Yield (host A, host B), each in its own namespace, joined by a veth pair."""
    tag = f"{os.getpid() % 100000}{random.randrange(100):02d}"
    net = f"10.{random.randrange(64, 250)}.{random.randrange(256)}"
    a = Host(f"hmcore-{tag}-a", f"hv{tag}a", f"{net}.1")
    b = Host(f"hmcore-{tag}-b", f"hv{tag}b", f"{net}.2")
    made: list[str] = []
    try:
        for h in (a, b):
            _ip("netns", "add", h.netns)
            made.append(h.netns)
        _ip("link", "add", a.dev, "type", "veth", "peer", "name", b.dev)
        for h in (a, b):
            _ip("link", "set", h.dev, "netns", h.netns)
            _ip("-n", h.netns, "addr", "add", f"{h.addr}/30", "dev", h.dev)
            _ip("-n", h.netns, "link", "set", h.dev, "up")
            _ip("-n", h.netns, "link", "set", "lo", "up")
        yield a, b
    finally:
        for ns in made:      # deleting a namespace deletes its end of the pair, and the pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
