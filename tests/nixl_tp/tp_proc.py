"""TpPeer: a bounded peer_tp.py subprocess (spawned, never forked; killed by PID), and the
UCX environment of these tests (loopback only). Not a conftest.py on purpose: tests/nixl's
modules import their helpers as ``conftest`` and a second conftest module would shadow it."""
import json
import os
import selectors
import subprocess
import sys

from hmacore.transport import configure_ucx_env

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
configure_ucx_env()

PEER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peer_tp.py")


class TpPeer:
    """A peer_tp.py process; :meth:`line` reads one JSON line from it (bounded wait)."""

    def __init__(self, args):
        env = dict(os.environ)
        self.proc = subprocess.Popen([sys.executable, PEER, json.dumps(args)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
                                     text=True)

    def line(self, timeout=30.0):
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout=timeout):
            self.kill()
            raise RuntimeError(f"peer sent nothing within {timeout} s")
        text = self.proc.stdout.readline()
        if not text:
            self.kill()
            raise RuntimeError(f"peer exited early with {self.proc.wait(5)}")
        return json.loads(text)

    def send(self, obj):
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
