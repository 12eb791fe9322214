"""Test-side invariant checker for block bookkeeping (NumPy only; never on the hot path).

It checks a :class:`~hmacore.tables.TrackerSet` against a :class:`BlockPool` model of the
shared block pool (vLLM's HMA pool: ONE id namespace ``[1, num_blocks)`` shared by every
KV cache group; id 0 is the null block) and the transfer / store inputs derived from it:

1. every non-null id in a request's table of group g is allocated to group g in the pool
   and appears at most once in that table; the pool's reference count of each id equals the
   number of live tables holding it (prefix-cache sharing within one group is allowed);
2. no non-null id is in two live requests' tables of *different* groups;
3. a finished request releases each of its non-null ids exactly once (a second release, or
   a release of an id it does not hold, is a violation);
4. watermarks (scheduled / saved / loaded tokens, in tokens) never run backwards, except the
   reset to 0 of a preemption;
5. null blocks are never transferred (desc-id inputs) or stored (store puts touching a
   group's block-0 bytes).

The reliability tests call the checker directly. Every violation raises :class:`InvariantError`
naming the request,
group and block id.
"""
from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from hmacore.errors import HmacoreError

__all__ = ["InvariantError", "BlockPool", "InvariantChecker", "CheckedStore"]


class InvariantError(HmacoreError, AssertionError):
    """A bookkeeping invariant is broken (a bug in hmacore or in its caller)."""


class BlockPool:
    """Model of vLLM's shared block pool: ids ``[1, num_blocks)``, each free or owned by one
    group with a reference count (number of live request tables holding it)."""

    def __init__(self, num_blocks: int, seed: int = 0) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 2:
            raise ValueError(f"num_blocks must be an int >= 2, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.owner = np.full(num_blocks, -1, dtype=np.int64)   # group id, -1 free
        self.refs = np.zeros(num_blocks, dtype=np.int64)
        self._rng = np.random.default_rng(seed)

    @property
    def num_free(self) -> int:
        return int((self.owner[1:] < 0).sum())

    def allocate(self, group: int, n: int) -> np.ndarray:
        """n fresh ids (random order, int32) owned by ``group`` with one reference each;
        raises ValueError when fewer than n are free (nothing allocated then)."""
        free = np.flatnonzero(self.owner[1:] < 0) + 1
        if free.size < n:
            raise ValueError(f"pool exhausted: {n} blocks asked, {free.size} free")
        ids = self._rng.choice(free, size=n, replace=False).astype(np.int32)
        self.owner[ids] = group
        self.refs[ids] = 1
        return ids

    def share(self, group: int, ids: np.ndarray) -> None:
        """One more reference to each non-null id (prefix-cache hit of the same group)."""
        ids = np.asarray(ids, dtype=np.int64)
        ids = ids[ids != 0]
        if ids.size and (self.owner[ids] != group).any():
            raise InvariantError(f"share: ids {ids[self.owner[ids] != group][:5].tolist()} are "
                                 f"not owned by group {group}")
        np.add.at(self.refs, ids, 1)

    def free(self, group: int, ids: np.ndarray) -> None:
        """Drop one reference per non-null id; an id reaching 0 references becomes free."""
        ids = np.asarray(ids, dtype=np.int64)
        ids = ids[ids != 0]
        if ids.size == 0:
            return
        bad = (self.owner[ids] != group) | (self.refs[ids] <= 0)
        if bad.any():
            raise InvariantError(f"free: group {group} releases ids "
                                 f"{ids[bad][:5].tolist()} it does not hold (double release?)")
        uniq, cnt = np.unique(ids, return_counts=True)
        if (self.refs[uniq] < cnt).any():
            raise InvariantError(f"free: group {group} releases an id more often than held")
        np.subtract.at(self.refs, ids, 1)
        gone = uniq[self.refs[uniq] == 0]
        self.owner[gone] = -1


class InvariantChecker:
    """Checks a TrackerSet (+ optional BlockPool) after each operation.

    Args:
        num_groups: groups of the layout.
        num_blocks: pool size (ids are checked to be in ``[0, num_blocks)``).
    """

    def __init__(self, num_groups: int, num_blocks: int) -> None:
        self.num_groups = int(num_groups)
        self.num_blocks = int(num_blocks)
        self._marks: dict[Hashable, tuple[int, int, int]] = {}
        self._released: set[Hashable] = set()
        self.checks = 0

    # -- tables and pool --------------------------------------------------------------------
    def check_tables(self, tables: Mapping[Hashable, Sequence[np.ndarray]],
                     pool: BlockPool | None = None) -> None:
        """Invariants 1 and 2 over ``{req_id: per-group table}`` (the live requests)."""
        self.checks += 1
        owner = np.full(self.num_blocks, -1, dtype=np.int64)
        counts = np.zeros(self.num_blocks, dtype=np.int64)
        for r, table in tables.items():
            if len(table) != self.num_groups:
                raise InvariantError(f"request {r!r}: {len(table)} groups, layout has "
                                     f"{self.num_groups}")
            for g, ids in enumerate(table):
                a = np.asarray(ids)
                if a.ndim != 1 or a.dtype.kind not in "iu":
                    raise InvariantError(f"request {r!r} group {g}: not a 1-D integer table")
                if a.size and (a.min() < 0 or a.max() >= self.num_blocks):
                    raise InvariantError(f"request {r!r} group {g}: id outside "
                                         f"[0, {self.num_blocks})")
                real = a[a != 0].astype(np.int64)
                uniq, cnt = np.unique(real, return_counts=True)
                if (cnt > 1).any():
                    raise InvariantError(f"request {r!r} group {g}: block "
                                         f"{int(uniq[cnt > 1][0])} appears {int(cnt.max())} times")
                clash = uniq[(owner[uniq] >= 0) & (owner[uniq] != g)]
                if clash.size:
                    b = int(clash[0])
                    raise InvariantError(f"block {b} is in request {r!r}'s group {g} and in "
                                         f"another live request's group {int(owner[b])}")
                owner[uniq] = g
                counts[uniq] += 1
        if pool is None:
            return
        held = np.flatnonzero(counts)
        wrong = held[pool.owner[held] != owner[held]]
        if wrong.size:
            b = int(wrong[0])
            raise InvariantError(f"block {b} is tracked in group {int(owner[b])} but the pool "
                                 f"says group {int(pool.owner[b])}")
        diff = np.flatnonzero(pool.refs != counts)
        if diff.size:
            b = int(diff[0])
            raise InvariantError(f"block {b}: pool holds {int(pool.refs[b])} references, live "
                                 f"tables hold {int(counts[b])} (leak or double count)")

    def check_tracker(self, trackers: Any, pool: BlockPool | None = None) -> None:
        """Invariants 1, 2 and 4 on a TrackerSet's current state."""
        tables = {r: trackers.block_ids(r, copy=False) for r in trackers}
        self.check_tables(tables, pool)
        for r in tables:
            cur = (trackers.scheduled_tokens(r), trackers.saved_tokens(r),
                   trackers.loaded_tokens(r))
            self.check_marks(r, cur)

    # -- watermarks ------------------------------------------------------------------------
    def check_marks(self, req_id: Hashable, marks: tuple[int, int, int]) -> None:
        """Invariant 4: (scheduled, saved, loaded) tokens never decrease for ``req_id``."""
        old = self._marks.get(req_id)
        if old is not None:
            for name, a, b in zip(("scheduled", "saved", "loaded"), old, marks):
                if b < a:
                    raise InvariantError(f"request {req_id!r}: {name} tokens ran backwards "
                                         f"{a} -> {b}")
        self._marks[req_id] = tuple(int(x) for x in marks)

    def note_preempted(self, req_id: Hashable) -> None:
        """A preemption resets the watermarks to 0 legitimately."""
        self._marks.pop(req_id, None)

    # -- release --------------------------------------------------------------------------
    def release(self, req_id: Hashable, tables: Sequence[np.ndarray],
                pool: BlockPool | None = None) -> int:
        """Invariant 3: ``req_id`` finished and hands ``tables`` back exactly once.

        Returns how many non-null ids were released (freed in ``pool`` when given)."""
        if req_id in self._released:
            raise InvariantError(f"request {req_id!r} finished twice")
        self._released.add(req_id)
        self._marks.pop(req_id, None)
        n = 0
        for g, ids in enumerate(tables):
            a = np.asarray(ids)
            n += int((a != 0).sum())
            if pool is not None:
                pool.free(g, a)
        return n

    def forget(self, req_id: Hashable) -> None:
        """Allow ``req_id`` to be reused as a new request's id."""
        self._released.discard(req_id)

    # -- transfers and stores -------------------------------------------------------------
    @staticmethod
    def check_transfer(block_ids: Sequence[Any], what: str = "transfer") -> None:
        """Invariant 5: no null id among the per-group ids handed to ``desc_ids``."""
        for g, ids in enumerate(block_ids):
            a = np.asarray(ids)
            if a.size and (a == 0).any():
                i = int(np.flatnonzero(a == 0)[0])
                raise InvariantError(f"{what}: group {g}, index {i} is the null block 0")


class CheckedStore:
    """A KVStore wrapper that raises InvariantError on a put touching a null block's bytes.

    ``null_ranges``: (addr, size) byte ranges of block 0 in every registered segment, e.g.
    from :func:`null_ranges`. Every other call is passed through unchanged; ``puts`` counts
    the keys put and ``checked_bytes`` the bytes of their parts."""

    def __init__(self, store: Any, null_ranges: Iterable[tuple[int, int]]) -> None:
        self.store = store
        self._null = sorted((int(a), int(s)) for a, s in null_ranges)
        self.puts = 0
        self.checked_bytes = 0

    def _check(self, keys, parts) -> None:
        for k, p in zip(keys, parts):
            for a, s in p:
                a, s = int(a), int(s)
                self.checked_bytes += s
                for na, ns in self._null:
                    if a < na + ns and na < a + s:
                        raise InvariantError(f"store put of {k!r} touches a null block's bytes "
                                             f"[{na:#x}, {na + ns:#x})")
            self.puts += 1

    def batch_put(self, keys, parts):
        keys, parts = list(keys), [list(p) for p in parts]
        self._check(keys, parts)
        return self.store.batch_put(keys, parts)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


def null_ranges(segments: Iterable[Any]) -> list[tuple[int, int]]:
    """Block 0's (addr, size) in every segment of every GroupSegments (None entries skipped)."""
    out = []
    for seg in segments:
        if seg is None:
            continue
        out.extend((int(b), int(s)) for b, s in zip(seg.bases, seg.block_bytes))
    return out
