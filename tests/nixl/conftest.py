"""Helpers for the real-NIXL tests: start a bounded peer subprocess, always kill it by PID."""
import json
import os
import selectors
import subprocess
import sys

import pytest

from hmacore.transport import configure_ucx_env

# under scripts/sanitize.sh (ASan preload) processes start and exit several times slower
SLOW = 4 if os.environ.get("HMACORE_SANITIZED") == "1" else 1

# Keep UCX's TCP traffic (wireup, notifications) on loopback, for this process and its peers;
# configure_ucx_env() keeps UCX's ib module out (NIXL 1.5.1 exit-time SIGSEGV otherwise).
os.environ.setdefault("UCX_NET_DEVICES", "lo")
configure_ucx_env()

PEER = os.path.join(os.path.dirname(__file__), "peer.py")


class Peer:
    """A peer process hosting one agent per cfg; ``ports[name]`` is each handshake port."""

    def __init__(self, agents, serve_s=40, env=None):
        args = {"agents": agents, "serve_s": serve_s}
        env = dict(os.environ, NIXL_LOG_LEVEL=os.environ.get("NIXL_LOG_LEVEL", "WARN"), **(env or {}))
        self.proc = subprocess.Popen([sys.executable, PEER, json.dumps(args)], stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, env=env)
        self._ports = None

    @property
    def ports(self):
        """Handshake port per hosted agent; waits (bounded) for the peer to come up, so
        several peers can start concurrently."""
        if self._ports is None:
            sel = selectors.DefaultSelector()
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            limit = 30 * SLOW
            if not sel.select(timeout=limit):
                self.kill()
                raise RuntimeError(f"peer did not start within {limit} s")
            line = self.proc.stdout.readline()
            if not line:
                self.kill()
                raise RuntimeError(f"peer exited early with {self.proc.wait(5)}")
            self._ports = json.loads(line)["ports"]
        return self._ports

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10 * SLOW)


@pytest.fixture
def start_peer():
    peers = []

    def start(agents, **kw):
        p = Peer(agents, **kw)
        peers.append(p)
        return p

    yield start
    for p in peers:
        p.kill()

