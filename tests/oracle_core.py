"""Plain-Python oracle for hmacore.tables / hmacore.windows: lists of ints, no NumPy, no
cleverness. Written from vllm-hma.md §3.1, §3.4, §4.2, §4.6, §11.2-§11.4, §11.8.

A layout is given as a list of simple dicts so the oracle does not share code with the
library: {"kind": "full"|"sw"|"chunked"|"mamba", "bs": int, "sw": int, "extra": int,
"spec": int, "kr": int}.
"""
from __future__ import annotations


class OracleError(Exception):
    """The operation is invalid (the library must raise too)."""


def layout_to_dicts(layout):
    """Describe an hmacore KVLayout in oracle terms (reads attributes only)."""
    kinds = {0: "full", 1: "sw", 2: "chunked", 3: "mamba"}
    out = []
    for s in layout.groups:
        out.append({"kind": kinds[int(s.kind)], "bs": s.block_size,
                    "sw": s.sliding_window or 0, "extra": s.extra_retained_tokens,
                    "spec": s.num_speculative_blocks,
                    "kr": 1 if (s.kernel_block_size is None or int(s.kind) == 3)
                    else s.block_size // s.kernel_block_size})
    return out


def ceil_div(a, b):
    q = a // b
    if q * b < a:
        q += 1
    return q


def window_blocks(g, exact=False):
    if g["kind"] != "sw":
        return 0
    if exact:
        return ceil_div(g["sw"] - 1 + g["extra"], g["bs"]) + 1
    return ceil_div(g["sw"], g["bs"]) + 1


# -- tables -------------------------------------------------------------------------------
def fill_blocks(table, hashed):
    out = []
    for ids, mask in zip(table, hashed):
        i = 0
        while i < len(ids) and ids[i] == 0:
            i += 1
        out.append([ids[j] for j in range(i, len(ids)) if ids[j] != 0 and not mask[j]])
    return out


def count_hashed(table, hashed):
    return [sum(1 for b, m in zip(ids, mask) if b != 0 and m) for ids, mask in zip(table, hashed)]


# -- windows ------------------------------------------------------------------------------
def clip_state(blocks, n_spec):
    if not blocks:
        return []
    drop = min(n_spec, len(blocks) - 1)
    kept = blocks[:len(blocks) - drop]
    return [kept[-1]]


def clip(table, groups, exact=False, clip_state_groups=True):
    if len(table) == 0:
        return []
    out = []
    for ids, g in zip(table, groups):
        if g["kind"] == "sw":
            n = window_blocks(g, exact)
            out.append(list(ids) if len(ids) <= n else list(ids[len(ids) - n:]))
        elif g["kind"] == "mamba" and clip_state_groups:
            out.append(clip_state(list(ids), g["spec"]))
        else:
            out.append(ids)  # untouched (no copy, like vLLM's clipper)
    return out


def trim(local, remote, groups, lr=None, rr=None):
    if len(local) == 0:
        return [], []
    lr = lr or [1] * len(groups)
    rr = rr or [1] * len(groups)
    out_l, out_r = [], []
    for g, (l, r) in enumerate(zip(local, remote)):
        l, r = list(l), list(r)
        if groups[g]["kind"] == "mamba":
            if abs(len(l) - len(r)) > 1:
                raise OracleError("mamba lengths differ by more than 1")
            n = min(len(l), len(r))
            out_l.append(l[:n])
            out_r.append(r[:n])
        elif lr[g] == rr[g]:
            if len(l) > len(r):
                raise OracleError("remote too short")
            tail = r[len(r) - len(l):] if len(l) > 0 else []
            if 0 in tail:
                raise OracleError("a local block would pair with the null block")
            out_r.append(tail)
            out_l.append(l)
        else:
            if abs(len(l) - len(r)) > lr[g] + rr[g]:
                raise OracleError("too much padding")
            n = min(len(l), len(r))
            out_l.append(l[:n])
            out_r.append(r[:n])
    return out_l, out_r


def expand(ids, ratio, stride=None):
    stride = ratio if stride is None else stride
    out = []
    for b in ids:
        for k in range(ratio):
            out.append(b * stride + k)
    if out and max(out) > 2**31 - 1:
        raise OracleError("int32 overflow")
    return out


def map_block_size(table, ratio, remote_lengths, groups):
    if len(table) == 0:
        return []
    out = []
    for g, ids in enumerate(table):
        if groups[g]["kind"] == "mamba":
            out.append(list(ids))
        else:
            out.append(expand(ids, ratio)[:remote_lengths[g]])
    if all(len(x) == 0 for x in out):
        return []
    return out


# -- trackers -----------------------------------------------------------------------------
NEW, WAITING, RUNNING, PREEMPTED = 0, 1, 2, 3


class Trackers:
    """dict of req_id -> {"t": list of per-group lists, marks, state}."""

    def __init__(self, num_groups):
        self.G = num_groups
        self.reqs = {}

    def snapshot(self):
        return {r: ([list(x) for x in v["t"]], v["state"], v["s"], v["v"], v["l"])
                for r, v in self.reqs.items()}

    def _need(self, r):
        if r not in self.reqs:
            raise OracleError(f"unknown {r}")
        return self.reqs[r]

    def add(self, r, table):
        if r in self.reqs:
            raise OracleError("duplicate")
        self.reqs[r] = {"t": [list(x) for x in table], "state": NEW, "s": 0, "v": 0, "l": 0}

    def append(self, r, new):
        v = self._need(r)
        if v["state"] == PREEMPTED:
            raise OracleError("preempted")
        if new is not None:
            for g in range(self.G):
                if new[g] is not None:
                    v["t"][g].extend(new[g])
        if v["state"] == NEW:
            v["state"] = RUNNING

    def update_after_alloc(self, r, full):
        v = self._need(r)
        for g in range(self.G):
            cur, f = v["t"][g], full[g]
            if len(f) < len(cur):
                raise OracleError("shrunk")
            for i in range(len(cur)):
                if f[i] != cur[i] and f[i] != 0:
                    raise OracleError("changed")
        added = []
        for g in range(self.G):
            cur, f = v["t"][g], full[g]
            for i in range(len(cur)):
                if f[i] == 0:
                    cur[i] = 0
            added.append(len(f) - len(cur))
            cur.extend(f[len(cur):])
        return added

    def replace(self, r, full):
        v = self._need(r)
        v["t"] = [list(x) for x in full]
        v["state"] = RUNNING

    def preempt(self, r):
        v = self._need(r)
        v["t"] = [[] for _ in range(self.G)]
        v["s"] = v["v"] = v["l"] = 0
        v["state"] = PREEMPTED

    def finish(self, r):
        v = self._need(r)
        del self.reqs[r]
        return v["t"]

    def set_mark(self, r, key, n):
        v = self._need(r)
        if n < v[key]:
            raise OracleError("backwards")
        v[key] = n

    def apply_step(self, new, cached, finished, preempted=()):
        """All or nothing: run on a copy, commit only if everything succeeded."""
        import copy
        trial = copy.deepcopy(self)
        out = {}
        for r in finished:
            out[r] = trial.finish(r)
        for r in preempted:
            trial.preempt(r)
        for r, t in new:
            trial.add(r, t)
        for r, ids, resumed in cached:
            if resumed:
                if ids is None:
                    raise OracleError("resumed without table")
                trial.replace(r, ids)
            else:
                trial.append(r, ids)
        self.reqs = trial.reqs
        return out
