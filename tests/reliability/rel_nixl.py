"""Two-process NIXL helpers for the soak and fault tests: a bounded peer process (the
tests/nixl/peer.py script, started with subprocess and killed by PID) and the decode-side
request pipeline tracker -> clip -> plan -> NIXL READ -> byte verification -> finish."""
from __future__ import annotations

import gc
import json
import os
import resource
import selectors
import subprocess
import sys
import time

import numpy as np

from hmacore.invariants import BlockPool, InvariantChecker
from hmacore.paged import allocate_paged_kv, verify_pattern
from hmacore.plan import TransferPlan
from hmacore.spec import GroupKind, GroupSpec, KVLayout
from hmacore.tables import TrackerSet
from hmacore.transport import configure_ucx_env
from hmacore.windows import clip_tracked

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
configure_ucx_env()

PEER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "nixl", "peer.py")

# FULL + SLIDING_WINDOW + MAMBA (two state parts): every kind of clipping on the path.
LAYOUT = KVLayout(groups=(GroupSpec(GroupKind.FULL, 16, ("f.0", "f.1")),
                          GroupSpec(GroupKind.SLIDING_WINDOW, 16, ("s.0", "s.1"), sliding_window=64),
                          GroupSpec(GroupKind.MAMBA, 16, ("m.0",))))
PAGE = 64
NB = 2048


def remote_ids(g, nb=NB):
    """The peer's block ids of group g, in block-index order."""
    return np.arange(1 + g, nb, LAYOUT.num_groups, dtype=np.int32)


def remote_positions(g, ids):
    return (np.asarray(ids, dtype=np.int64) - 1 - g) // LAYOUT.num_groups


class PeerProc:
    """A prefill peer process; group g owns the block ids ``1 + g + k*G`` (groups alias one
    storage per layer slot in HMA, so one id holds one group's data) and block index k of
    group g holds the pattern; killed by PID in :meth:`kill`; life bounded by serve_s."""

    def __init__(self, name, *, nb=NB, serve_s=120, env=None, layout=LAYOUT, page=PAGE):
        cfg = {"name": name, "layout": layout.to_dict(), "num_blocks": nb, "page_bytes": page,
               "fill_table": [remote_ids(g, nb).tolist() for g in range(layout.num_groups)]}
        env = dict(os.environ, **(env or {}))
        self.proc = subprocess.Popen([sys.executable, PEER, json.dumps({"agents": [cfg],
                                                                          "serve_s": serve_s})],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout=60):
            self.kill()
            raise RuntimeError("peer did not start within 60 s")
        line = self.proc.stdout.readline()
        if not line:
            self.kill()
            raise RuntimeError("peer exited early")
        self.port = json.loads(line)["ports"][name]

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def object_count() -> int:
    gc.collect()
    return len(gc.get_objects())


class Decoder:
    """Decode side: paged memory, a TrackerSet, a block-pool model + invariant checker, and
    one NixlAgent. :meth:`submit` posts one request's READ, :meth:`complete` verifies it."""

    def __init__(self, agent_cls, name, *, nb=NB, seed=0):
        self.nb = nb
        self.paged = allocate_paged_kv(LAYOUT, nb, page_bytes=PAGE)
        self.plan = TransferPlan.from_kv_caches(LAYOUT, self.paged.kv_caches, num_blocks=nb)
        self.agent = agent_cls(name, self.plan)
        self.ts = TrackerSet(LAYOUT)
        self.pool = BlockPool(nb, seed)
        self.chk = InvariantChecker(LAYOUT.num_groups, nb)
        self.rng = np.random.default_rng(seed)
        self.pending = {}
        self.verified = self.failed = self.bytes_checked = self.released = 0

    def new_request(self, req, tokens):
        """Allocate the request's full table (blocks per group; Mamba: 1 state block)."""
        n = -(-tokens // 16)
        table = [self.pool.allocate(0, n), self.pool.allocate(1, n), self.pool.allocate(2, 1)]
        self.ts.add(req, table, num_prompt_tokens=tokens)
        self.ts.set_scheduled_tokens(req, tokens)

    def submit(self, req, peer, *, expires_at=None):
        (clipped,) = clip_tracked(self.ts, [req])
        local = [np.ascontiguousarray(c[c != 0]) for c in clipped]
        self.chk.check_transfer(local, f"request {req}")
        # the remote side's blocks for the same positions: random real ids of the peer pool
        remote = [self.rng.choice(remote_ids(g, self.nb), size=len(x), replace=False)
                  for g, x in enumerate(local)]
        t = self.agent.read(req, peer, local, remote, expires_at=expires_at)
        self.pending[req] = (t, local, remote)
        return t

    def complete(self, req, timeout=20.0):
        """Wait, verify every byte, zero the pages, finish and release. Returns True if the
        request was verified; a failed request is released too (and never marked valid)."""
        t, local, remote = self.pending.pop(req)
        try:
            self.agent.wait(t, timeout=timeout)
        except Exception:   # TransferError: named, nothing valid
            assert self.agent.valid_blocks(req) is None
            assert self.agent.failure(req) is not None and self.agent.failure(req).request_id == req
            self.failed += 1
            self._finish(req)
            return False
        valid = self.agent.valid_blocks(req)
        assert valid is not None and all(np.array_equal(a, b) for a, b in zip(valid, local))
        bad = verify_pattern(self.paged, [x.tolist() for x in local],
                             [remote_positions(g, r).tolist() for g, r in enumerate(remote)])
        assert bad == [], f"request {req}: {len(bad)} pages differ, first {bad[:3]}"
        for g, ids in enumerate(local):
            for lname in LAYOUT.groups[g].layer_names:
                arr = self.paged.kv_caches[lname]
                for part in (arr if isinstance(arr, tuple) else (arr,)):
                    self.bytes_checked += part[ids].nbytes
                    part[ids] = 0
        self.verified += 1
        self._finish(req)
        return True

    def abort(self, req):
        """A request whose READ could not be posted: it is named, nothing is valid, and its
        blocks are released."""
        assert self.agent.valid_blocks(req) is None
        err = self.agent.failure(req)
        assert err is not None and err.request_id == req
        self.pending.pop(req, None)
        self.failed += 1
        self._finish(req)

    def _finish(self, req):
        self.agent._valid.pop(req, None)     # the connector forgets finished requests
        self.agent._failed.pop(req, None)
        tables = self.ts.finish(req)
        self.released += self.chk.release(req, tables, self.pool)
        self.chk.forget(req)
