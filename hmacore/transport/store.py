"""KV stores behind one small protocol, plus the lookup/save/load flows over a HitFinder.

Protocol (``KVStore``), all bulk and all answering per key with an int code:
``batch_exists(keys) -> [1 present | 0 absent | < 0 error]``,
``batch_put(keys, parts) -> [0 | < 0]`` where ``parts[i]`` is a list of ``(addr, size)``
buffers inside registered memory whose concatenation is key i's value,
``batch_get(keys, parts) -> [bytes read | < 0]`` (fills the same buffers),
``batch_remove(keys) -> [0 | < 0]``, ``register(addr, size)``, ``unregister(addr)``.
Codes follow Mooncake: NO_SPACE -200 (skip saving), INVALID -600, NOT_FOUND -704, RPC_FAIL -900.

``EmbeddedStore`` is an in-process DRAM store (capacity in bytes, LRU eviction, thread-safe).
``GroupSegments`` maps block ids of ONE group to addresses in that group's own layers only.
"""
from __future__ import annotations

import ctypes
import dataclasses
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from ..errors import BlockTableError, HashInputError, StoreError
from .._fast import _hits
from ..hits import HitFinder, HitResult
from ..keys import MAX_GROUP_ID, KeyBuilder
from ..spec import GroupKind
from ..tables import as_block_table

__all__ = ["OK", "PRESENT", "NO_SPACE", "INVALID", "NOT_FOUND", "RPC_FAIL", "KVStore",
           "EmbeddedStore", "GroupSegments", "split_key", "lookup_hit", "save_blocks", "save_state",
           "load_blocks", "load_blocks_failed", "SaveReport"]

OK = 0
PRESENT = 1      # save_state(if_absent=True): the key is there already, nothing written
NO_SPACE = -200
INVALID = -600
NOT_FOUND = -704
RPC_FAIL = -900

Parts = Sequence[Sequence[tuple[int, int]]]


class KVStore(Protocol):
    def batch_exists(self, keys: Sequence[str]) -> list[int]: ...
    def batch_put(self, keys: Sequence[str], parts: Parts) -> list[int]: ...
    def batch_get(self, keys: Sequence[str], parts: Parts) -> list[int]: ...
    def batch_remove(self, keys: Sequence[str]) -> list[int]: ...
    def register(self, addr: int, size: int) -> None: ...
    def unregister(self, addr: int) -> None: ...


def split_key(k: str) -> tuple[str, int, bytes] | None:
    """``(namespace, group, digest)`` of a key of :class:`~hmacore.keys.KeyBuilder`'s form
    (``<namespace>@group:<g>@<hex digest>``, a 16- or 32-byte digest), else None."""
    head, sep, hexd = k.rpartition("@")
    ns, gsep, g = head.rpartition("@group:")
    if not (sep and gsep and g.isdigit() and len(hexd) in (32, 64)):
        return None
    try:
        digest = bytes.fromhex(hexd)
    except ValueError:
        return None
    group = int(g)
    if group > MAX_GROUP_ID:
        return None
    return ns, group, digest


def _check_keys(keys) -> list[str]:
    if isinstance(keys, (str, bytes)):
        raise HashInputError("keys must be a sequence of str, not a single str")
    keys = list(keys)
    for i, k in enumerate(keys):
        if not isinstance(k, str) or not k:
            raise HashInputError(f"keys[{i}] must be a non-empty str")
    return keys


def _check_hashes(hashes) -> np.ndarray:
    if not isinstance(hashes, np.ndarray) or hashes.ndim != 2 or hashes.shape[1] not in (16, 32):
        raise HashInputError("hashes must be a uint8 array of shape (N, 16) or (N, 32)")
    return _hits._check_digests(hashes, hashes.shape[1], "hashes")


def _block_ids(x, name: str, num_blocks: int | None = None) -> np.ndarray:
    """One group's block ids through the package's id check (``as_block_table``): ints only
    (bools, floats, None refused), ``>= 0``, int32, ``< num_blocks`` when given."""
    if isinstance(x, np.ndarray) and x.ndim == 0:
        x = x.reshape(1)
    (ids,) = as_block_table((x,), 1, num_blocks=num_blocks, name=name)
    return ids.astype(np.int64)


def _check_parts(keys: list[str], parts) -> list[list[tuple[int, int]]]:
    parts = [list(p) for p in parts]
    if len(parts) != len(keys):
        raise HashInputError(f"parts has {len(parts)} entries for {len(keys)} keys")
    out = []
    for i, p in enumerate(parts):
        row = []
        for a, s in p:
            a, s = int(a), int(s)
            if a <= 0 or s < 0:
                raise HashInputError(f"parts[{i}]: addresses must be > 0 and sizes >= 0 bytes")
            row.append((a, s))
        out.append(row)
    return out


class EmbeddedStore:
    """In-process DRAM key/value store (capacity in bytes, LRU eviction, thread-safe).

    Values are copied from/to registered memory only: a buffer outside every registered
    region gets INVALID, never a wild read. ``batch_exists`` does not refresh recency; a
    successful get or put does.

    Digest index: every stored key of :class:`~hmacore.keys.KeyBuilder`'s form
    (``<namespace>@group:<g>@<hex digest>``) is also in the :class:`ExistenceSet` of its
    namespace as ``(g, digest)``, kept exactly in step with the keys (put, overwrite, LRU
    eviction, remove; under the store's lock). :meth:`digest_index` hands it out, so a
    lookup in this process runs the hit kernel on vLLM's ``list[bytes]`` hashes directly
    (:func:`lookup_hit_indexed`) with no key strings. A namespace whose digests differ in
    width has no index (lookups then use the keys).

    Change journals: :meth:`watch_changes` gives a list to which every later change of a
    key's presence is appended as ``(key, present)`` (a put of a new key: True; an eviction
    or a remove: False; an overwrite changes nothing); :meth:`take_changes` drains it under
    the store's lock. The store connector turns them into KV events (the store tier).
    """

    def __init__(self, capacity_bytes: int) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise HashInputError(f"capacity_bytes must be an int > 0, got {capacity_bytes!r}")
        self.capacity_bytes = capacity_bytes
        self._data: OrderedDict[str, bytes] = OrderedDict()
        self._used = 0
        self._regions: dict[int, int] = {}
        self._lock = threading.Lock()
        self.evictions = 0
        self._index: dict[str, _hits.ExistenceSet | None] = {}
        self._journals: list[list[tuple[str, bool]]] = []

    @property
    def used_bytes(self) -> int:
        return self._used

    def __len__(self) -> int:
        return len(self._data)

    def register(self, addr: int, size: int) -> None:
        if int(addr) <= 0 or int(size) <= 0:
            raise HashInputError("register: addr and size must be > 0")
        with self._lock:
            self._regions[int(addr)] = int(size)

    def unregister(self, addr: int) -> None:
        with self._lock:
            self._regions.pop(int(addr), None)

    def digest_index(self, namespace: str) -> _hits.ExistenceSet | None:
        """The existence set of ``namespace``'s stored keys (see the class docstring), live
        (it follows later puts and removals; thread-safe); None if it has none."""
        with self._lock:
            return self._index.get(namespace)

    def _indexed(self, k: str, present: bool) -> None:
        """Mirror one key's presence into its namespace's digest index (lock held)."""
        parts = split_key(k)
        if parts is None:
            return
        ns, group, digest = parts
        if ns not in self._index:
            if not present:
                return
            self._index[ns] = _hits.ExistenceSet(len(digest))
        es = self._index[ns]
        if es is None:
            return
        if len(digest) != es.digest_size:
            self._index[ns] = None       # mixed widths: this namespace is looked up by keys
            return
        if present:
            es.add(group, digest)
        else:
            es.discard(group, digest)

    def watch_changes(self) -> list[tuple[str, bool]]:
        """A new change journal (see the class docstring); drain it with take_changes."""
        journal: list[tuple[str, bool]] = []
        with self._lock:
            self._journals.append(journal)
        return journal

    def take_changes(self, journal: list[tuple[str, bool]]) -> list[tuple[str, bool]]:
        """The changes appended to ``journal`` since the last call, in order."""
        with self._lock:
            out = journal[:]
            del journal[:]
        return out

    def unwatch_changes(self, journal: list[tuple[str, bool]]) -> None:
        with self._lock:
            self._journals[:] = [j for j in self._journals if j is not journal]

    def _changed(self, k: str, present: bool) -> None:
        for journal in self._journals:
            journal.append((k, present))

    def _inside(self, addr: int, size: int) -> bool:
        for base, n in self._regions.items():
            if base <= addr and addr + size <= base + n:
                return True
        return False

    def batch_exists(self, keys) -> list[int]:
        keys = _check_keys(keys)
        with self._lock:
            return [1 if k in self._data else 0 for k in keys]

    def _each(self, keys, parts, one) -> list[int]:
        """``one(key, parts)`` for every key under the lock, after checking the arguments."""
        keys = _check_keys(keys)
        parts = _check_parts(keys, parts)
        with self._lock:
            return [one(k, p) for k, p in zip(keys, parts)]

    def batch_put(self, keys, parts) -> list[int]:
        return self._each(keys, parts, self._put)

    def _put(self, k: str, p) -> int:
        if not all(self._inside(a, s) for a, s in p):
            return INVALID
        value = b"".join(ctypes.string_at(a, s) for a, s in p)
        if len(value) > self.capacity_bytes:
            return NO_SPACE
        old = self._data.pop(k, None)
        if old is not None:
            self._used -= len(old)
        while self._used + len(value) > self.capacity_bytes:
            evicted, ev = self._data.popitem(last=False)
            self._used -= len(ev)
            self.evictions += 1
            self._indexed(evicted, False)
            self._changed(evicted, False)
        self._data[k] = value
        self._used += len(value)
        self._indexed(k, True)
        if old is None:
            self._changed(k, True)
        return OK

    def batch_get(self, keys, parts) -> list[int]:
        return self._each(keys, parts, self._get)

    def _get(self, k: str, p) -> int:
        value = self._data.get(k)
        if value is None:
            return NOT_FOUND
        if sum(s for _, s in p) != len(value) or not all(self._inside(a, s) for a, s in p):
            return INVALID
        off = 0
        for a, s in p:
            ctypes.memmove(a, value[off:off + s], s)
            off += s
        self._data.move_to_end(k)
        return len(value)

    def batch_remove(self, keys) -> list[int]:
        keys = _check_keys(keys)
        out = []
        with self._lock:
            for k in keys:
                v = self._data.pop(k, None)
                if v is None:
                    out.append(NOT_FOUND)
                else:
                    self._used -= len(v)
                    self._indexed(k, False)
                    self._changed(k, False)
                    out.append(OK)
        return out


@dataclasses.dataclass(frozen=True)
class GroupSegments:
    """Where one group's blocks live: for each of the group's OWN layer segments, a base
    address and the bytes of one block (block id b of segment r starts at
    ``bases[r] + b * block_bytes[r]``). Never list another group's layers here."""

    bases: tuple[int, ...]
    block_bytes: tuple[int, ...]
    num_blocks: int

    def __post_init__(self) -> None:
        if len(self.bases) == 0 or len(self.bases) != len(self.block_bytes):
            raise HashInputError("GroupSegments: bases and block_bytes must be equal, non-empty")
        if any(int(b) <= 0 for b in self.bases) or any(int(s) <= 0 for s in self.block_bytes):
            raise HashInputError("GroupSegments: bases and block_bytes must be > 0")
        if self.num_blocks <= 0:
            raise HashInputError("GroupSegments: num_blocks must be > 0")

    @classmethod
    def from_arrays(cls, arrays: Sequence[np.ndarray]) -> GroupSegments:
        """Segments of C-contiguous arrays shaped (num_blocks, ...) (one per layer)."""
        if not arrays:
            raise HashInputError("GroupSegments.from_arrays needs at least one array")
        nb = arrays[0].shape[0]
        for a in arrays:
            if not a.flags.c_contiguous or a.shape[0] != nb:
                raise HashInputError("every array must be C-contiguous with the same block count")
        return cls(tuple(a.ctypes.data for a in arrays),
                   tuple(a.nbytes // nb for a in arrays), nb)

    def nbytes_per_block(self) -> int:
        return sum(self.block_bytes)

    def parts(self, block_ids) -> list[list[tuple[int, int]]]:
        """Per block id: the (addr, size) buffers of that block in every segment."""
        ids = _block_ids(block_ids, "block_ids", self.num_blocks)
        if ids.size and ids.min() <= 0:
            raise HashInputError(f"block ids must be in [1, {self.num_blocks}) (0 is the null block)")
        return [[(base + int(b) * sz, sz) for base, sz in zip(self.bases, self.block_bytes)]
                for b in ids]


def lookup_hit(finder: HitFinder, keys: KeyBuilder, store: KVStore, hashes: np.ndarray,
               num_tokens: int) -> HitResult:
    """The external hit of a request of ``num_tokens`` tokens (Mooncake's ``lookup``).

    One ``batch_exists`` over the keys of ``finder.lookup_rows`` in every required namespace;
    a (group, row) is present only if all namespaces answered 1; then the longest hit at
    ``align_length(num_tokens)``, re-run at ``align_length(num_tokens - 1)`` when it covers
    the whole request (the last token is recomputed). Nothing to ask (no hashes, length
    below one aligned block) means a 0-token hit without any RPC. A failing store (exception
    or error codes) gives misses, never an exception.
    """
    hashes = _check_hashes(hashes)
    n = hashes.shape[0]
    token_len = finder.align_length(num_tokens)
    empty = HitResult(0, tuple(np.zeros(0, dtype=np.uint8) for _ in range(finder.num_groups)))
    if n == 0 or token_len <= 0:
        return empty
    plan = finder.lookup_keys(hashes, num_tokens, keys)
    if not plan.keys:
        return empty
    try:
        res = list(store.batch_exists(plan.keys))
    except Exception:  # master down / RPC failure: a miss, never a crash
        return empty
    es = plan.fold(res, hashes, keys)
    hit = finder.longest_hit(hashes, es, token_len)
    if hit.tokens >= num_tokens:
        usable = finder.align_length(max(num_tokens - 1, 0))
        if usable <= 0:
            return empty
        hit = finder.longest_hit(hashes, es, usable)
    return hit


def lookup_hit_indexed(finder: HitFinder, index: _hits.ExistenceSet, hashes: list[bytes],
                       num_tokens: int) -> HitResult:
    """:func:`lookup_hit` over an existence set of the stored keys (an
    :meth:`EmbeddedStore.digest_index`) instead of ``batch_exists`` on key strings: the same
    hit (same rules, the last token recomputed), from vLLM's ``list[bytes]`` hashes read in
    place by the kernel. For ``coarse="last"`` keys in one namespace per group."""
    n = len(hashes)
    token_len = finder.align_length(num_tokens)
    if n == 0 or token_len <= 0:
        return HitResult(0, tuple(np.zeros(0, dtype=np.uint8) for _ in range(finder.num_groups)))
    hit = finder.longest_hit(hashes, index, token_len)
    if hit.tokens >= num_tokens:
        usable = finder.align_length(max(num_tokens - 1, 0))
        if usable <= 0:
            return HitResult(0, tuple(np.zeros(0, dtype=np.uint8)
                                      for _ in range(finder.num_groups)))
        hit = finder.longest_hit(hashes, index, usable)
    return hit


@dataclasses.dataclass
class SaveReport:
    """What a save did: keys written, keys skipped because already present, whether the
    store ran out of space (remaining saves skipped), and failed keys.

    ``refused_keys``: keys whose put answered NO_SPACE; ``failed_keys``: keys whose put (or
    existence check) failed otherwise; ``skipped``: keys of groups not attempted after a
    NO_SPACE. None of them is stored: a lookup never counts them as hits.
    :meth:`raise_for_failures` turns a save that did not write everything into a StoreError
    naming the request and the keys (savers that treat NO_SPACE as pressure just read the
    fields)."""

    written: int = 0
    present: int = 0
    no_space: bool = False
    failed: int = 0
    refused_keys: list = dataclasses.field(default_factory=list)
    failed_keys: list = dataclasses.field(default_factory=list)
    skipped: int = 0

    def raise_for_failures(self, request_id=None) -> None:
        """Raise StoreError (with ``.request_id`` and ``.keys``) if any key was refused,
        failed or skipped; return None when the save stored everything it had to."""
        bad = list(self.refused_keys) + list(self.failed_keys)
        if not bad and not self.failed and not self.skipped:
            return
        err = StoreError(f"save of request {request_id!r}: {len(self.refused_keys)} put(s) "
                         f"refused for lack of space (NO_SPACE), "
                         f"{max(self.failed, len(self.failed_keys))} failed, {self.skipped} "
                         f"skipped after NO_SPACE; first keys not stored: {bad[:3]}")
        err.request_id, err.keys = request_id, bad
        raise err


def _offsets(block_offsets, num_groups: int) -> list[int]:
    if block_offsets is None:
        return [0] * num_groups
    out = [int(x) for x in block_offsets]
    if len(out) != num_groups or min(out, default=0) < 0:
        raise HashInputError(f"block_offsets needs {num_groups} ints >= 0, got {block_offsets!r}")
    return out


def save_blocks(finder: HitFinder, keys: KeyBuilder, store: KVStore, hashes: np.ndarray,
                num_tokens: int, block_ids: Sequence[Sequence[int]],
                segments: Sequence[GroupSegments | None], start_token: int = 0, *,
                row_offset: int = 0, block_offsets: Sequence[int] | None = None) -> SaveReport:
    """Write the blocks ``finder.store_rows`` selects for ``[start_token, num_tokens)``.

    ``block_ids[g]`` is group g's block table (positional, id 0 = null, never stored) from
    position ``block_offsets[g]`` on (default 0: the whole table); ``hashes`` holds the hash
    rows from ``row_offset`` on. A saver that ships only a step's new positions and rows
    (the vLLM connector) passes both offsets. ``segments[g]`` is the group's own memory.
    Keys already present are not rewritten; NO_SPACE stops the save (it is pressure, not an
    error); other failures are counted.
    """
    if len(block_ids) != finder.num_groups or len(segments) != finder.num_groups:
        raise HashInputError(f"block_ids and segments need one entry per group "
                             f"({finder.num_groups})")
    hashes = _check_hashes(hashes)
    offs = _offsets(block_offsets, finder.num_groups)
    if isinstance(row_offset, bool) or not isinstance(row_offset, (int, np.integer)) \
            or row_offset < 0:
        raise HashInputError(f"row_offset must be an int >= 0, got {row_offset!r}")
    rep = SaveReport()
    n = hashes.shape[0] + int(row_offset)
    rows = finder.store_rows(n, num_tokens, start_token)
    h = finder.hash_block_size
    # every table and segment is checked before the first store call: a bad group is the
    # caller's error and no other group's keys are written (no half-applied save)
    work = []
    for g in finder.group_ids:
        table = _block_ids(block_ids[g], f"block_ids[{g}]")
        if rows[g].size == 0:
            continue
        seg = segments[g]
        if seg is None:
            raise HashInputError(f"segments[{g}] is missing for a stored group")
        k = finder.block_sizes[g] // h
        blocks = (rows[g] + 1) // k - 1 - offs[g]
        if blocks.size and (blocks.min() < 0 or rows[g].min() - (k - 1) < row_offset):
            raise HashInputError(f"group {g}: the save starts at block {offs[g]} / hash row "
                                 f"{row_offset} but [{start_token}, {num_tokens}) needs earlier "
                                 "ones")
        keep = blocks < table.size
        blocks, grow = blocks[keep], rows[g][keep] - row_offset
        ids = table[blocks] if blocks.size else blocks
        real = ids != 0
        ids, grow = ids[real], grow[real]
        if ids.size == 0:
            continue
        seg.parts(ids)                      # ids inside the group's segment, or raise now
        work.append((seg, ids, keys.keys(g, finder.key_digests(hashes, g, grow))))
    for seg, ids, ks in work:
        try:
            there = list(store.batch_exists(ks))
        except Exception:
            there = [0] * len(ks)
        if rep.no_space:                   # out of space: the rest is not attempted
            rep.skipped += len(ks)
            continue
        if there and all(e < 0 for e in there):
            rep.failed += len(ks)          # the store is unreachable: skip, do not block on puts
            rep.failed_keys.extend(ks)
            continue
        todo = [i for i, e in enumerate(there) if e != 1]
        rep.present += len(ks) - len(todo)
        if not todo:
            continue
        parts = seg.parts(ids[todo])
        try:
            codes = list(store.batch_put([ks[i] for i in todo], parts))
        except Exception:
            codes = [RPC_FAIL] * len(todo)
        if len(codes) != len(todo):
            codes = [RPC_FAIL] * len(todo)
        for i, c in zip(todo, codes):
            if c == OK:
                rep.written += 1
            elif c == NO_SPACE:
                rep.no_space = True
                rep.refused_keys.append(ks[i])
            else:
                rep.failed += 1
                rep.failed_keys.append(ks[i])
    return rep


def save_state(finder: HitFinder, keys: KeyBuilder, store: KVStore, hashes: np.ndarray,
               num_tokens: int, group: int, block_id: int, segments: GroupSegments, *,
               row_offset: int = 0, if_absent: bool = False) -> int:
    """Boundary put of a Mamba (state) group: write block ``block_id`` (the state after
    ``align_length(num_tokens)`` tokens) under the key of that boundary's hash row.

    Align-mode Mamba tables are not append-only, so states are never saved positionally
    (``store_masks`` is all-zero for them); the caller hands the exact state block over.
    ``hashes`` holds the rows from ``row_offset`` on. Returns the store's code (OK,
    NO_SPACE, ...); 0 tokens to name writes nothing (OK). ``if_absent``: a key already
    present is not rewritten (PRESENT), as ``save_blocks`` does.
    """
    if isinstance(block_id, (bool, np.bool_)) or not isinstance(block_id, (int, np.integer)):
        raise BlockTableError(f"block_id must be an int, got {type(block_id).__name__} {block_id!r}")
    hashes = _check_hashes(hashes)
    g = finder._check_group(group)
    if finder.layout.groups[g].kind != GroupKind.MAMBA or g not in finder.group_ids:
        raise HashInputError(f"group {g} is not a looked-up Mamba group")
    row = finder.boundary_row(num_tokens)
    if row < 0:
        return OK
    row -= int(row_offset)
    if not 0 <= row < hashes.shape[0]:
        raise HashInputError(f"hashes cover rows [{row_offset}, {row_offset + hashes.shape[0]}); "
                             f"the boundary needs row {row + row_offset}")
    k = keys.keys(g, finder.key_digests(hashes, g, np.array([row], dtype=np.int64)))
    parts = segments.parts([block_id])     # a bad id is the caller's error, not a store failure
    try:
        if if_absent and int(list(store.batch_exists(k))[0]) == 1:
            return PRESENT
        return int(list(store.batch_put(k, parts))[0])
    except Exception:
        return RPC_FAIL


def load_blocks(finder: HitFinder, keys: KeyBuilder, store: KVStore, hashes: np.ndarray,
                hit: HitResult, block_ids: Sequence[Sequence[int]],
                segments: Sequence[GroupSegments | None]) -> bool:
    """Load the blocks of ``hit`` (its masks) into group tables ``block_ids``; True if every
    block arrived. An empty load is a success that never reaches the store."""
    return not load_blocks_failed(finder, keys, store, hashes, hit, block_ids, segments)


def load_blocks_failed(finder: HitFinder, keys: KeyBuilder, store: KVStore, hashes: np.ndarray,
                       hit: HitResult, block_ids: Sequence[Sequence[int]],
                       segments: Sequence[GroupSegments | None]) -> list[tuple[int, int]]:
    """:func:`load_blocks` that says what did not arrive: the ``(group, block index)`` of
    every block whose key was missing, evicted, short or otherwise failed (every block of
    the load when the store call itself failed). Empty: everything arrived."""
    if len(block_ids) != finder.num_groups or len(segments) != finder.num_groups:
        raise HashInputError(f"block_ids and segments need one entry per group "
                             f"({finder.num_groups})")
    hashes = _check_hashes(hashes)
    h = finder.hash_block_size
    all_keys: list[str] = []
    all_parts: list = []
    where: list[tuple[int, int]] = []
    for g in finder.group_ids:
        mask = hit.masks[g]
        blocks = np.flatnonzero(mask).astype(np.int64)
        if blocks.size == 0:
            continue
        bs = finder.block_sizes[g]
        k = bs // h
        rows = (blocks + 1) * k - 1
        # a fine-grained hit may end inside its last block: that block's key is the
        # row at the hit boundary (vLLM's TailKeyBoundary)
        tail = hit.tokens // h - 1
        rows = np.minimum(rows, tail)
        table = _block_ids(block_ids[g], f"block_ids[{g}]")
        if blocks.max() >= table.size:
            raise HashInputError(f"block_ids[{g}] has {table.size} blocks; the hit needs "
                                 f"{int(blocks.max()) + 1}")
        seg = segments[g]
        if seg is None:
            raise HashInputError(f"segments[{g}] is missing for a loaded group")
        all_keys.extend(keys.keys(g, finder.key_digests(hashes, g, rows)))
        all_parts.extend(seg.parts(table[blocks]))
        where.extend((g, int(b)) for b in blocks)
    if not all_keys:
        return []
    try:
        codes = list(store.batch_get(all_keys, all_parts))
    except Exception:
        return where
    if len(codes) != len(all_keys):
        return where
    return [w for w, c in zip(where, codes) if c < 0]
