"""Loopback ports for the engines and connectors a test starts (test-only helper).

A port that is merely free now may be taken before the engine that is handed it binds it
(engines start in parallel and bind late), and outgoing connections (UCX, gloo, NIXL's
listeners) take ports from the kernel's ephemeral range. So ports are drawn BELOW that
range, each handed out once per process, and checked bindable at hand-out time.
"""
from __future__ import annotations

import random
import socket

_HANDED_OUT: set[int] = set()


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(n: int = 1) -> int:
    """A base port with ``n`` consecutive free loopback ports never handed out before by
    this process, all below the ephemeral range."""
    lo, hi = 10000, max(10000 + 1000, _ephemeral_start())
    for _ in range(200):
        base = random.randrange(lo, hi - n)
        if _HANDED_OUT & set(range(base, base + n)):
            continue
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            _HANDED_OUT.update(range(base, base + n))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports")


def free_port() -> int:
    """One port (see :func:`free_ports`)."""
    return free_ports(1)
