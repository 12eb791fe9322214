"""Fewest descriptors: one descriptor per maximal run contiguous on both sides of a transfer.

A transfer plan (:mod:`hmacore.plan`) gives one descriptor per block per region (layer slot,
K or V, kernel sub-block); the i-th local descriptor moves into the i-th remote one. Wherever
consecutive pairs abut on both sides with the same offset -- consecutive block ids going up
or down, a block's layer slots that sit next to each other (block-major / packed pages), K
next to V -- one descriptor moves the same bytes. :func:`find_runs` returns exactly those
maximal runs, in any order of the pairs; a run never spans a gap, a device or a
registration range, and the runs partition the per-block descriptors' bytes exactly.

Units: descriptor ids index a dlist; rows are ``(addr, bytes, dev)`` uint64; ``ranges`` are
the registered ``(addr, bytes, dev)`` memory ranges (``TransferPlan.registration_ranges``).

Cost: :class:`DescTable` is built once per dlist (O(descriptors), stored as O(regions)
segments); :func:`find_runs` is two linear passes over the pairs (Cython, no Python object
per pair), plus an O(runs) hash of piece starts.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from ._fast import _runs
from ._fast._runs import DescTable
from .errors import BlockTableError, LayoutError
from .plan import TransferPlan

__all__ = ["DescTable", "Runs", "RunPlanner", "desc_table", "plan_table", "find_runs",
           "buffer_runs", "span_ranges"]


@dataclasses.dataclass(frozen=True)
class Runs:
    """The runs of one transfer.

    Attributes:
        local, remote: M x 3 uint64 ``(addr, bytes, dev)``, row i of each side pairs up.
        order: int64[N] (when asked for): the per-descriptor pairs in run order, each run's
            pairs by ascending address (posting prepped ids in this order lets NIXL merge
            them into the same runs).
        block_descriptors: N, the per-descriptor pairs the runs replace.
        nbytes: bytes moved (equal to the pairs' bytes).
        index_breaks: steps inside the runs between descriptors whose ids are not
            consecutive on both sides (a run across layer slots, a region boundary): NIXL's
            merge of prepped ids (consecutive ids only) stops there, so posting ``order``
            reaches the backend as ``num_runs + index_breaks`` descriptors.
    """

    local: np.ndarray
    remote: np.ndarray
    order: np.ndarray | None
    block_descriptors: int
    nbytes: int
    index_breaks: int = 0

    @property
    def num_runs(self) -> int:
        return int(self.local.shape[0])


def desc_table(rows: Any, ranges: Sequence[tuple[int, int, int]] | None = None) -> DescTable:
    """The :class:`DescTable` of a dlist's N x 3 rows. With ``ranges`` (the registered
    memory), every row must lie inside one range, and runs never cross from one range into
    another (NIXL needs each descriptor inside one registration). Raises LayoutError."""
    a = _runs.int_array("rows", rows, np.uint64, 0, 2**64, LayoutError)
    if a.ndim == 1 and a.size == 0:
        a = a.reshape(0, 3)                      # an empty dlist: no rows
    if a.ndim != 2 or a.shape[1] != 3:
        raise LayoutError(f"rows must be N x 3 (addr, len, dev), got shape {a.shape}")
    if ranges is None:
        return DescTable(a)
    # uint64 fields (a range may end at 2**64 itself: checked below); a bytes value of 2**64
    # was an OverflowError further down
    r = _runs.int_array("ranges", ranges, np.uint64, 0, 2**64, LayoutError)
    if r.size == 0:
        r = r.reshape(0, 3)
    if r.ndim != 2 or r.shape[1] != 3:
        raise LayoutError(f"ranges must be (addr, bytes, dev) triples, got shape {r.shape}")
    rg = sorted((int(x), int(n), int(d)) for x, n, d in r.tolist())
    for k in range(1, len(rg)):
        if rg[k][0] < rg[k - 1][0] + rg[k - 1][1]:
            raise LayoutError(f"ranges {rg[k - 1]} and {rg[k]} overlap")
    if not rg:
        if a.shape[0]:
            raise LayoutError("rows given but no registered range")
        return DescTable(a)
    if any(x < 0 or n <= 0 or x + n > 2**64 or not 0 <= d <= 0xFFFFFFFF for x, n, d in rg):
        raise LayoutError("ranges must be (addr >= 0, bytes > 0, uint32 dev) below 2**64")
    starts = np.array([x for x, _, _ in rg], dtype=np.uint64)
    # the end of the last range may be 2**64 itself: compare len against room instead
    room = np.array([n for _, n, _ in rg], dtype=np.uint64)
    devs = np.array([d for _, _, d in rg], dtype=np.uint64)
    dom = np.searchsorted(starts, a[:, 0], side="right").astype(np.int64) - 1
    idx = np.maximum(dom, 0)
    off = a[:, 0] - starts[idx]                    # meaningful where dom >= 0
    fits = (dom >= 0) & (off < room[idx]) & (a[:, 1] <= room[idx] - np.minimum(off, room[idx]))
    bad = np.flatnonzero(~(fits & (devs[idx] == a[:, 2])))
    if bad.size:
        i = int(bad[0])
        raise LayoutError(f"descriptor {i} {tuple(int(v) for v in a[i])} lies outside every "
                          "registered range")
    return DescTable(a, dom)


def span_ranges(rows: Any) -> list[tuple[int, int, int]]:
    """The memory a dlist's rows cover, as disjoint ``(addr, bytes, dev)`` ranges (touching
    spans merged, as :meth:`TransferPlan.registration_ranges` registers them): the run
    barriers of a peer's dlist when only its rows are known."""
    a = np.asarray(rows, dtype=np.uint64).reshape(-1, 3)
    out: list[tuple[int, int, int]] = []
    for dev in np.unique(a[:, 2]).tolist():
        sel = a[a[:, 2] == dev]
        sel = sel[np.argsort(sel[:, 0], kind="stable")]
        start, end = sel[:, 0], sel[:, 0] + sel[:, 1]
        reach = np.maximum.accumulate(end)
        # a new range wherever a row starts past everything before it
        first = np.flatnonzero(np.r_[True, start[1:] > reach[:-1]])
        last = np.r_[first[1:], len(sel)] - 1
        out += [(int(start[f]), int(reach[k]) - int(start[f]), int(dev))
                for f, k in zip(first.tolist(), last.tolist())]
    return out


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def plan_table(plan: TransferPlan) -> DescTable:
    """The table of a plan's dlist (``plan.descriptors()``), domains from its registration."""
    return desc_table(plan.descriptors(), plan.registration_ranges())


def find_runs(local: DescTable, local_ids: Any, remote: DescTable, remote_ids: Any, *,
              order: bool = False) -> Runs:
    """Maximal runs of the paired descriptor ids ``local_ids[i] -> remote_ids[i]``.

    Raises BlockTableError (nothing computed) for ids out of range, unequal lengths, or a
    pair whose two descriptors differ in length."""
    lrows, rrows, ordr, nbytes, breaks = _runs.coalesce(local, local_ids, remote, remote_ids,
                                                        order=order)
    return Runs(lrows, rrows, ordr, len(local_ids), nbytes, breaks)


class RunPlanner:
    """Runs between two plans (the local one and a peer's), from per-group block lists.

    Args:
        local, remote: the two sides' TransferPlans (equal shapes, as for a NIXL READ/WRITE),
            or a :class:`~hmacore.tp.TpPairPlan`'s ``local`` / ``remote`` (TP-sliced reads).
        local_ranges, remote_ranges: registered memory of each side (default: each plan's
            ``registration_ranges()``; a TpPairPlan's virtual regions lie inside their real
            plan's registration, so pass the real plan's ranges there).

    Built once per peer; :meth:`runs` per request. Immutable.
    """

    def __init__(self, local: TransferPlan, remote: TransferPlan, *,
                 local_ranges: Sequence[tuple[int, int, int]] | None = None,
                 remote_ranges: Sequence[tuple[int, int, int]] | None = None):
        self.local = local
        self.remote = remote
        self.local_table = desc_table(local.descriptors(), local.registration_ranges()
                                      if local_ranges is None else local_ranges)
        self.remote_table = desc_table(remote.descriptors(), remote.registration_ranges()
                                       if remote_ranges is None else remote_ranges)

    @classmethod
    def for_pair(cls, pair: Any, local_plan: TransferPlan,
                 remote_plan: TransferPlan) -> RunPlanner:
        """The planner of a :class:`~hmacore.tp.TpPairPlan` (head slices) whose real plans
        are ``local_plan`` / ``remote_plan``."""
        return cls(pair.local, pair.remote, local_ranges=local_plan.registration_ranges(),
                   remote_ranges=remote_plan.registration_ranges())

    def runs(self, local_block_ids: Sequence[Any], remote_block_ids: Sequence[Any], *,
             order: bool = False) -> Runs:
        """Runs moving group g's ``remote_block_ids[g]`` into ``local_block_ids[g]`` (window
        clipped, prefix trimmed, null ids stripped; paired by position, equal counts per
        group). Raises BlockTableError."""
        lids = self.local.desc_ids(local_block_ids)
        rids = self.remote.desc_ids(remote_block_ids)
        lens = [len(g) for g in local_block_ids]
        rlens = [len(g) for g in remote_block_ids]
        if lens != rlens or lids.size != rids.size:
            raise BlockTableError(f"per-group block counts differ: local {lens}, remote {rlens}")
        return find_runs(self.local_table, lids, self.remote_table, rids, order=order)


def buffer_runs(parts: Sequence[Sequence[tuple[int, int]]],
                ranges: Sequence[tuple[int, int]] | None = None) -> list[list[tuple[int, int]]]:
    """Per key, its ``(addr, size)`` buffers with adjacent ones merged (a store batch:
    ``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers``). The value's bytes
    and their order are unchanged; buffers of different keys never merge. ``ranges``: the
    registered ``(addr, size)`` buffers; a merged buffer never spans two of them (a buffer
    outside every range is left as it is)."""
    try:
        counts = [len(p) for p in parts]
    except TypeError:
        raise BlockTableError("parts must be a sequence of per-key sequences of (address, "
                              "size) pairs") from None
    offs = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=offs[1:])
    n = int(offs[-1])
    addrs = np.empty(n, dtype=np.uint64)
    sizes = np.empty(n, dtype=np.int64)
    k = 0
    for p in parts:
        for item in p:
            if not isinstance(item, (tuple, list)) or len(item) != 2:
                raise BlockTableError(f"buffer {k}: must be an (address, size) pair, got "
                                      f"{item!r}")
            a, s = item
            if not (_is_int(a) and _is_int(s)) or not (0 <= a < 2**64 and 0 <= s < 2**63) \
                    or a + s >= 2**64:
                raise BlockTableError(f"buffer {k}: address and size must be ints >= 0 "
                                      f"(size < 2**63, ending below 2**64), got ({a!r}, {s!r})")
            addrs[k] = int(a)
            sizes[k] = int(s)
            k += 1
    if k != n:
        raise BlockTableError("parts changed while being read")
    dom = None
    if ranges is not None:
        r = _runs.int_array("ranges", ranges, np.uint64, 0, 2**64, BlockTableError)
        if r.size == 0:
            r = r.reshape(0, 2)
        if r.ndim != 2 or r.shape[1] != 2:
            raise BlockTableError(f"ranges must be (addr, size) pairs, got shape {r.shape}")
        rg = sorted((int(x), int(n)) for x, n in r.tolist())
        if any(x + n >= 2**64 for x, n in rg):
            raise BlockTableError("ranges: a registered buffer must end below 2**64")
        starts = np.array([x for x, _ in rg] or [0], dtype=np.uint64)
        ends = np.array([x + n for x, n in rg] or [0], dtype=np.uint64)
        idx = np.searchsorted(starts, addrs, side="right").astype(np.int64) - 1
        inside = (idx >= 0) & (addrs + sizes.astype(np.uint64)
                               <= ends[np.maximum(idx, 0)]) if rg else np.zeros(n, bool)
        # outside every range: a domain of its own (never merged)
        dom = np.where(inside, idx, -1 - np.arange(n, dtype=np.int64))
    ma, ms, mo = _runs.coalesce_buffers(addrs, sizes, offs, dom)
    al, sl, ol = ma.tolist(), ms.tolist(), mo.tolist()
    return [list(zip(al[ol[i]:ol[i + 1]], sl[ol[i]:ol[i + 1]])) for i in range(len(counts))]
