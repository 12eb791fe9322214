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

import numpy as np

from invariants import BlockPool, InvariantChecker
from hmacore.demo.paged_memory import _write_pages, allocate_paged_kv, expected_pages, verify_pattern
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


def soak_case(name):
    """(layout, page bytes, pool blocks, max prompt tokens) of a soak/fault configuration:
    ``fsm`` (FULL + SW + 2-part MAMBA, above), ``gpt-oss`` (full + sliding), ``deepseek-v4``
    (five groups, block sizes 256/64/64/4/8) and ``qwen3-next`` (three Mamba groups + FULL
    with 544-token blocks of 34 kernel blocks each)."""
    from hmacore.presets import get_preset
    if name == "fsm":
        return LAYOUT, PAGE, NB, 1200
    if name == "gpt-oss":
        return get_preset("gpt-oss"), 64, 2048, 600
    if name == "deepseek-v4":
        return get_preset("deepseek-v4"), 64, 8192, 1200
    if name == "qwen3-next":
        return get_preset("qwen3-next"), 544, 1024, 1200
    raise ValueError(f"unknown soak case {name!r}")


def remote_ids(g, nb=NB, num_groups=None):
    """The peer's block ids of group g, in block-index order."""
    G = LAYOUT.num_groups if num_groups is None else num_groups
    return np.arange(1 + g, nb, G, dtype=np.int32)


def remote_positions(g, ids, num_groups=None):
    G = LAYOUT.num_groups if num_groups is None else num_groups
    return (np.asarray(ids, dtype=np.int64) - 1 - g) // G


class PeerProc:
    """A prefill peer process; group g owns the block ids ``1 + g + k*G`` (groups alias one
    storage per layer slot in HMA, so one id holds one group's data) and block index k of
    group g holds the pattern; killed by PID in :meth:`kill`; life bounded by serve_s."""

    def __init__(self, name, *, nb=NB, serve_s=120, env=None, layout=LAYOUT, page=PAGE):
        G = layout.num_groups
        cfg = {"name": name, "layout": layout.to_dict(), "num_blocks": nb, "page_bytes": page,
               "fill_table": [remote_ids(g, nb, G).tolist() for g in range(G)]}
        env = dict(os.environ, **(env or {}))
        self.proc = subprocess.Popen([sys.executable, PEER, json.dumps({"agents": [cfg],
                                                                          "serve_s": serve_s})],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        limit = 180 if os.environ.get("HMACORE_SANITIZED") == "1" else 60   # ASan starts slowly
        if not sel.select(timeout=limit):
            self.kill()
            raise RuntimeError(f"peer did not start within {limit} s")
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
    one NixlAgent. :meth:`submit` posts one request's READ or WRITE, :meth:`complete`
    verifies it.

    Peer ids: per group, READs use the first half of the peer's ids (which hold the fill
    pattern), WRITEs the second half. A WRITE pushes pages holding the pattern of fresh
    positions (never written before, so stale peer bytes cannot pass) and is verified by
    reading the peer's blocks back into scratch blocks and comparing every byte."""

    def __init__(self, agent_cls, name, *, nb=NB, seed=0, layout=LAYOUT, page=PAGE):
        self.nb = nb
        self.layout = layout
        G = layout.num_groups
        self.paged = allocate_paged_kv(layout, nb, page_bytes=page)
        self.plan = TransferPlan.from_kv_caches(layout, self.paged.kv_caches, num_blocks=nb)
        self.agent = agent_cls(name, self.plan)
        self.ts = TrackerSet(layout)
        self.pool = BlockPool(nb, seed)
        self.chk = InvariantChecker(G, nb)
        self.rng = np.random.default_rng(seed)
        ids = [remote_ids(g, nb, G) for g in range(G)]
        self._remote = {"READ": [x[:x.size // 2] for x in ids], "WRITE": [x[x.size // 2:] for x in ids]}
        self._wpos = 1
        self._wfirst = [int(x.size // 2) for x in ids]     # block index of the first WRITE id
        self._wfree = [np.ones(x.size, bool) for x in self._remote["WRITE"]]
        self.pending = {}
        self.verified = self.failed = self.bytes_checked = self.released = 0
        self.ops = {"READ": 0, "WRITE": 0}

    def new_request(self, req, tokens):
        """Allocate the request's full table (blocks per group; Mamba: 1 state block)."""
        table = [self.pool.allocate(g, 1 if s.kind == GroupKind.MAMBA else -(-tokens // s.block_size))
                 for g, s in enumerate(self.layout.groups)]
        self.ts.add(req, table, num_prompt_tokens=tokens)
        self.ts.set_scheduled_tokens(req, tokens)

    def _pattern(self, local, positions, *, zero=False):
        """Write (or zero) the pattern of ``positions[g]`` into the local pages ``local[g]``."""
        n = 0
        for g, ids in enumerate(local):
            if len(ids) == 0:
                continue
            for lname in self.layout.groups[g].layer_names:
                arr = self.paged.kv_caches[lname]
                if zero:
                    for part in (arr if isinstance(arr, tuple) else (arr,)):
                        n += part[ids].nbytes
                        part[ids] = 0
                else:
                    _write_pages(arr, ids, expected_pages(self.layout, lname, positions[g],
                                                          self.paged.page_bytes[g]))
        return n

    def submit(self, req, peer, *, op="READ", expires_at=None):
        (clipped,) = clip_tracked(self.ts, [req])
        local = [np.ascontiguousarray(c[c != 0]) for c in clipped]
        self.chk.check_transfer(local, f"request {req}")
        # the remote side's blocks for the same positions: random real ids of the peer pool
        if op == "READ":
            remote = [self.rng.choice(self._remote[op][g], size=len(x), replace=False)
                      for g, x in enumerate(local)]
        else:   # WRITE targets are exclusive among in-flight writes (no lost update)
            remote = []
            for g, x in enumerate(local):
                free = self._remote[op][g][self._wfree[g]]
                pick = self.rng.choice(free, size=len(x), replace=False)
                self._wfree[g][(pick - 1 - g) // self.layout.num_groups - self._wfirst[g]] = False
                remote.append(pick)
        if op == "READ":
            positions = [remote_positions(g, r, self.layout.num_groups) for g, r in enumerate(remote)]
            t = self.agent.read(req, peer, local, remote, expires_at=expires_at)
        else:
            positions = []
            for x in local:
                positions.append(np.arange(self._wpos, self._wpos + len(x), dtype=np.int64))
                self._wpos += len(x)
            self._pattern(local, positions)
            try:
                t = self.agent.write(req, peer, local, remote, expires_at=expires_at)
            except Exception:
                self._pattern(local, None, zero=True)
                for g, r in enumerate(remote):
                    self._wfree[g][(r - 1 - g) // self.layout.num_groups - self._wfirst[g]] = True
                raise
        self.pending[req] = (t, local, remote, positions, op)
        return t

    def complete(self, req, timeout=20.0):
        """Wait, verify every byte, zero the pages, finish and release. Returns True if the
        request was verified; a failed request is released too (and never marked valid)."""
        t, local, remote, positions, op = self.pending.pop(req)
        try:
            return self._complete(req, t, local, remote, positions, op, timeout)
        finally:
            if op == "WRITE":
                for g, r in enumerate(remote):
                    self._wfree[g][(np.asarray(r) - 1 - g) // self.layout.num_groups
                                   - self._wfirst[g]] = True

    def _complete(self, req, t, local, remote, positions, op, timeout):
        try:
            self.agent.wait(t, timeout=timeout)
        except Exception:   # TransferError: named, nothing valid
            assert self.agent.valid_blocks(req) is None
            assert self.agent.failure(req) is not None and self.agent.failure(req).request_id == req
            self.failed += 1
            self._pattern(local, None, zero=True)
            self._finish(req)
            return False
        valid = self.agent.valid_blocks(req)
        assert valid is not None and all(np.array_equal(a, b) for a, b in zip(valid, local))
        if op == "READ":
            where = local
        else:   # read the peer's blocks back into scratch blocks of the same groups
            self._pattern(local, None, zero=True)
            where = [self.pool.allocate(g, len(x)) if len(x) else np.zeros(0, np.int32)
                     for g, x in enumerate(local)]
            back = self.agent.read(f"{req}#readback", t.peer, where, remote)
            self.agent.wait(back, timeout=timeout)
            self.agent._valid.pop(f"{req}#readback", None)
        bad = verify_pattern(self.paged, [x.tolist() for x in where],
                             [np.asarray(p).tolist() for p in positions])
        assert bad == [], f"request {req} ({op}): {len(bad)} pages differ, first {bad[:3]}"
        self.bytes_checked += self._pattern(where, None, zero=True)
        if op == "WRITE":
            for g, x in enumerate(where):
                self.pool.free(g, x)
        self.verified += 1
        self.ops[op] += 1
        self._finish(req)
        return True

    def abort(self, req):
        """A request whose transfer could not be posted: it is named, nothing is valid, and
        its blocks are released."""
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
