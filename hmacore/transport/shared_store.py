"""``SharedStore``: the embedded store in a shared-memory segment, for engines whose scheduler
and workers are different processes (vLLM's multiprocess engine).

Same protocol and codes as :class:`~hmacore.transport.store.EmbeddedStore` (``batch_exists``,
``batch_put``, ``batch_get``, ``batch_remove``, ``register``, ``unregister``,
``digest_index``); every process that opens the same name sees the same keys and bytes.

Segment layout (one file, :class:`~.shm_segment.Segment`; all integers int64 unless noted)::

    header      4 KiB: geometry, counters, the busy word, the generation, the event-log head
    namespaces  255 x 256 B: key namespace strings (id = row + 1; 0 = opaque keys)
    index       index_cap rows: meta, home, first page, pages, length, ref (uint8), digest (32 B)
    event log   log_cap rows: meta (+ removed flag), digest (32 B)
    next        n_pages: the next page of a value's chain / of the free list (-1 ends it)
    data        n_pages x page_bytes (4 KiB aligned)

* **Keys.** A KeyBuilder key ``<namespace>@group:<g>@<hex>`` is stored as (namespace id,
  digest width, group, digest): ``meta = LIVE | width << 48 | ns << 32 | group``. Any other
  key (and any key once the namespace table is full) is opaque: its BLAKE2b-256 digest,
  namespace 0.
* **Index.** Linear probing over a power-of-two table at most half full (every value takes at
  least one page and the table has two rows per page), deletion by backward shift (no
  tombstones, so probes stay short however long the store runs).
* **Values.** A chain of fixed-size pages from a free list; copies go run by run (pages
  adjacent in the pool are one ``memmove``). Capacity is ``n_pages * page_bytes``.
* **Eviction.** CLOCK over the index: a get or put sets a row's reference bit; the hand
  clears set bits and evicts the first row whose bit is clear (LRU's cheap approximation;
  no per-access list update in shared memory).
* **Lock.** One process-shared mutex (``flock`` on the segment's lock file) around every
  operation: the kernel releases it when its holder dies, which a seqlock or a futex in the
  segment would not. A mutation first stores its process id in the busy word and clears it
  when done: whoever takes the mutex and finds the word set knows a process died halfway
  and resets the store (empties it and bumps the generation). It is a cache: losing it costs
  recomputation, never wrong bytes.
* **Digest index without key strings.** A scheduler looks up vLLM's ``list[bytes]`` with the
  hit kernel over an :class:`~hmacore._fast._hits.ExistenceSet`. ``digest_index(ns)`` returns
  this process's mirror of namespace ``ns``, brought up to date from the event log (every
  put, overwrite, eviction and removal of a namespaced key appends (meta, digest)): when the
  log head has not moved, one read of the header and no lock; else the new events under the
  lock, applied outside it with ``add_many`` / ``discard_many`` per run of one group. A
  mirror that fell more than ``log_cap`` events behind, or saw the generation change, is
  rebuilt from the index (one NumPy pass). The mirror is exact as of the call: saves a
  worker finished before the scheduler asks are in it.
* **Change feeds.** :meth:`SharedStore.read_log` hands a reader the log rows of some
  namespaces since its position, or a snapshot of their keys when it cannot follow the log
  (new reader, fell behind the ring, generation changed);
  :class:`~.shared_changes.ChangeFeed` turns that into exact store / removal runs (the
  store connector's KV events of the shared store).
"""
from __future__ import annotations

import atexit
import ctypes
import dataclasses
import hashlib
import os
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from ..errors import HashInputError, StoreError
from .._fast import _hits
from .shm_segment import Segment, sweep_stale, valid_segment_name
from .store import INVALID, NO_SPACE, NOT_FOUND, OK, _check_keys, _check_parts, split_key

__all__ = ["SharedStore", "LogRead", "SEGMENT_PREFIX", "DEFAULT_PAGE_BYTES", "LIVE", "REMOVED"]

SEGMENT_PREFIX = "hmacore-kv-"
DEFAULT_PAGE_BYTES = 16 << 10
MAGIC = 0x31524F5453414D48           # b"HMASTOR1"
VERSION = 1
HEADER_BYTES = 4096
NS_CAP = 255
NS_ROW = 256                         # 2-byte length + up to 254 bytes of UTF-8
DIGEST = 32                          # index digest column (16-byte digests zero-padded)
LIVE = 1 << 62
REMOVED = 1 << 61                    # event-log flag: the key left the store
MIN_PAGE_BYTES = 64
MAX_LOG = 1 << 16
_M64 = (1 << 64) - 1
_SCAN = 4096                         # slots the clock hand examines per NumPy pass

# header words (int64)
(H_MAGIC, H_VERSION, H_CAPACITY, H_PAGE, H_PAGES, H_INDEX_CAP, H_LOG_CAP, H_BUSY, H_GEN,
 H_LOG_HEAD, H_HAND, H_FREE_HEAD, H_FREE_PAGES, H_ENTRIES, H_USED, H_EVICTIONS, H_RESETS,
 H_NS_COUNT, H_PUTS) = range(19)


def _pow2_at_least(n: int) -> int:
    return 1 << max(int(n) - 1, 1).bit_length()


@dataclasses.dataclass(frozen=True)
class _Geometry:
    """Sizes and byte offsets of a segment with ``capacity_bytes`` of pages."""

    capacity_bytes: int
    page_bytes: int

    @property
    def n_pages(self) -> int:
        return self.capacity_bytes // self.page_bytes

    @property
    def index_cap(self) -> int:
        return max(16, _pow2_at_least(2 * self.n_pages))

    @property
    def log_cap(self) -> int:
        return min(max(1024, _pow2_at_least(2 * self.n_pages)), MAX_LOG)

    def offsets(self) -> dict[str, int]:
        off, out = HEADER_BYTES, {}

        def take(name: str, nbytes: int, align: int = 64) -> None:
            nonlocal off
            off = -(-off // align) * align
            out[name] = off
            off += nbytes

        c, lg, n = self.index_cap, self.log_cap, self.n_pages
        take("ns", NS_CAP * NS_ROW)
        for col in ("meta", "home", "first", "npages", "length"):
            take(col, 8 * c)
        take("ref", c)
        take("digest", DIGEST * c)
        take("ev_meta", 8 * lg)
        take("ev_digest", DIGEST * lg)
        take("next", 8 * n)
        take("data", n * self.page_bytes, 4096)
        out["total"] = -(-off // 4096) * 4096
        return out


def _int_arg(value, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise HashInputError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


@dataclasses.dataclass(frozen=True)
class LogRead:
    """What :meth:`SharedStore.read_log` found: the reader's new position ``(head, gen)``;
    ``snapshot``: ``metas`` / ``digests`` are every key now in the store (the reader could
    not follow the log) rather than the log rows since its position. A row's ``meta`` is
    ``LIVE | width << 48 | namespace id << 32 | group``, plus :data:`REMOVED` for a log row
    of a key that left the store; ``digests`` are 32-byte rows (narrower digests
    zero-padded: the first ``width`` bytes are the key's)."""

    head: int
    gen: int
    snapshot: bool
    metas: np.ndarray
    digests: np.ndarray


class _Mirror:
    """This process's ExistenceSet of one namespace and how far it has read the log."""

    __slots__ = ("es", "width", "mixed", "seen", "gen", "ns_id")

    def __init__(self) -> None:
        self.es: _hits.ExistenceSet | None = None
        self.width = 0
        self.mixed = False
        self.seen = -1
        self.gen = -1
        self.ns_id: int | None = None


_OPEN: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_all() -> None:      # a process that exits without shutdown still detaches
    for s in list(_OPEN):
        try:
            s.close()
        except Exception:   # pragma: no cover - best effort at exit
            pass


class SharedStore:
    """KV store in shared memory, one per ``name`` on a host (see the module docstring).

    Args:
        name: the store's name; its segment is ``/dev/shm/hmacore-kv-<name>``. Processes
            opening the same name share the store; the first creates it, the last to
            :meth:`close` removes it; a segment whose processes all died is reclaimed.
        capacity_bytes: bytes of value pages (all reserved in the tmpfs at creation).
        page_bytes: the page size; a value of L bytes takes ``max(1, ceil(L / page))`` pages.
        directory: the tmpfs directory.
        sentinel: the creator starts a sentinel process that removes the segment once all
            its processes are gone, even killed ones (:mod:`._shm_sentinel`); without it a
            segment of killed processes waits for the next open's sweep.

    Raises StoreError if the segment cannot be reserved, or exists with another capacity or
    page size; HashInputError for bad arguments.
    """

    def __init__(self, name: str, capacity_bytes: int, page_bytes: int = DEFAULT_PAGE_BYTES,
                 *, directory: str = "/dev/shm", sentinel: bool = True) -> None:
        cap = _int_arg(capacity_bytes, "capacity_bytes", 1)
        page = _int_arg(page_bytes, "page_bytes", MIN_PAGE_BYTES)
        if page % 64:
            raise HashInputError(f"page_bytes must be a multiple of 64, got {page}")
        if cap < page:
            raise HashInputError(f"capacity_bytes ({cap}) must hold at least one page "
                                 f"(page_bytes {page})")
        if not isinstance(name, str) or len(name) > 180 or not valid_segment_name(name):
            raise HashInputError(f"name must be 1-180 characters of letters, digits, '.', '_', "
                                 f"'-', got {name!r}")
        self.name = name
        self._geo = _Geometry(cap - cap % page, page)
        self._off = self._geo.offsets()
        self._tlock = threading.RLock()
        self._regions: dict[int, int] = {}
        self._mirrors: dict[str, _Mirror] = {}
        self._ns_cache: dict[str, int] = {}
        self._ns_gen = -1
        self._views_ready = False
        # segments of killed engines (this name's too: it is then made afresh)
        self._swept_own = SEGMENT_PREFIX + name in sweep_stale(directory, SEGMENT_PREFIX)
        self._seg = Segment(SEGMENT_PREFIX + name, self._off["total"], self._init_segment,
                            self._check_segment, directory, sentinel=sentinel)
        self._views()
        _OPEN.add(self)

    # -- segment set-up ---------------------------------------------------------------------
    def _arrays(self, buf) -> dict[str, np.ndarray]:
        g, o = self._geo, self._off
        c, lg = g.index_cap, g.log_cap

        def col(name: str, dtype, shape) -> np.ndarray:
            n = int(np.prod(shape))
            return np.frombuffer(buf, dtype=dtype, count=n, offset=o[name]).reshape(shape)

        return {"hdr": np.frombuffer(buf, dtype=np.int64, count=HEADER_BYTES // 8),
                "ns": col("ns", np.uint8, (NS_CAP, NS_ROW)),
                "meta": col("meta", np.int64, (c,)), "home": col("home", np.int64, (c,)),
                "first": col("first", np.int64, (c,)), "npages": col("npages", np.int64, (c,)),
                "length": col("length", np.int64, (c,)), "ref": col("ref", np.uint8, (c,)),
                "digest": col("digest", np.uint8, (c, DIGEST)),
                "ev_meta": col("ev_meta", np.int64, (lg,)),
                "ev_digest": col("ev_digest", np.uint8, (lg, DIGEST)),
                "next": col("next", np.int64, (g.n_pages,)),
                "data": col("data", np.uint8, (g.n_pages * g.page_bytes,))}

    def _init_segment(self, buf) -> None:
        a = self._arrays(buf)
        hdr = a["hdr"]
        hdr[:] = 0
        g = self._geo
        hdr[H_VERSION], hdr[H_CAPACITY], hdr[H_PAGE] = VERSION, g.capacity_bytes, g.page_bytes
        hdr[H_PAGES], hdr[H_INDEX_CAP], hdr[H_LOG_CAP] = g.n_pages, g.index_cap, g.log_cap
        self._empty(a)
        hdr[H_MAGIC] = MAGIC            # last: a half-written header is never taken as valid

    def _check_segment(self, buf) -> None:
        if len(buf) < HEADER_BYTES:
            raise StoreError(f"segment {self._seg_name()} is too small to be a store")
        hdr = np.frombuffer(buf, dtype=np.int64, count=HEADER_BYTES // 8)
        magic, version = int(hdr[H_MAGIC]), int(hdr[H_VERSION])
        theirs = (int(hdr[H_CAPACITY]), int(hdr[H_PAGE]))
        del hdr                 # no view of the map may outlive a failed open
        if magic != MAGIC or version != VERSION:
            raise StoreError(f"segment {self._seg_name()} is not an hmacore store of version "
                             f"{VERSION}")
        g = self._geo
        if theirs != (g.capacity_bytes, g.page_bytes) or len(buf) != self._off["total"]:
            raise StoreError(f"store {self.name!r} is open elsewhere with capacity "
                             f"{theirs[0]} B and page size {theirs[1]} B; this process asks for "
                             f"{g.capacity_bytes} B / {g.page_bytes} B (configure the same "
                             "store_capacity_bytes and store_page_bytes, or another store_name)")

    def _seg_name(self) -> str:
        return SEGMENT_PREFIX + self.name

    @staticmethod
    def _empty(a: dict[str, np.ndarray]) -> None:
        """Every key gone, every page free, a new generation (the caller holds the mutex)."""
        hdr = a["hdr"]
        a["meta"][:] = 0
        a["ref"][:] = 0
        a["ns"][:] = 0
        n = a["next"].shape[0]
        a["next"][:] = np.arange(1, n + 1, dtype=np.int64)
        a["next"][n - 1] = -1
        hdr[H_FREE_HEAD], hdr[H_FREE_PAGES] = 0, n
        hdr[H_ENTRIES] = hdr[H_USED] = hdr[H_NS_COUNT] = hdr[H_HAND] = 0
        hdr[H_GEN] += 1

    def _views(self) -> None:
        assert self._seg.buf is not None
        a = self._arrays(self._seg.buf)
        self._a = a
        self._hdr, self._meta, self._home = a["hdr"], a["meta"], a["home"]
        self._first, self._npages, self._length = a["first"], a["npages"], a["length"]
        self._ref, self._digest, self._next = a["ref"], a["digest"], a["next"]
        self._ev_meta, self._ev_digest = a["ev_meta"], a["ev_digest"]
        self._data_base = a["data"].ctypes.data
        self._mask = self._geo.index_cap - 1
        self._shift = 64 - (self._geo.index_cap.bit_length() - 1)
        self._views_ready = True

    def _drop_views(self) -> None:
        for k in ("_a", "_hdr", "_meta", "_home", "_first", "_npages", "_length", "_ref",
                  "_digest", "_next", "_ev_meta", "_ev_digest"):
            self.__dict__.pop(k, None)
        self._views_ready = False

    def _live(self) -> None:
        """Open, and owned by this process (a forked child re-opens: fresh locks)."""
        if self._seg.closed:
            raise StoreError(f"store {self.name!r} is closed")
        if os.getpid() != self._seg.pid:
            self._drop_views()
            self._seg.ensure_owner()
            self._views()
            self._mirrors.clear()
            self._ns_cache.clear()

    @contextmanager
    def _locked(self, mutate: bool) -> Iterator[None]:
        """Thread lock + the segment's mutex; a store left half-changed by a dead process is
        emptied first. ``mutate``: mark the store busy for the duration (an exception inside
        empties it: nothing half-written survives)."""
        with self._tlock:
            self._live()
            with self._seg.locked():
                hdr = self._hdr
                if int(hdr[H_BUSY]) != 0:
                    self._empty(self._a)
                    hdr[H_RESETS] += 1
                    hdr[H_BUSY] = 0
                if not mutate:
                    yield
                    return
                hdr[H_BUSY] = os.getpid()
                try:
                    yield
                except BaseException:
                    self._empty(self._a)
                    hdr[H_RESETS] += 1
                    raise
                finally:
                    hdr[H_BUSY] = 0

    # -- properties -------------------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        return self._geo.capacity_bytes

    @property
    def page_bytes(self) -> int:
        return self._geo.page_bytes

    @property
    def segment_path(self) -> str:
        return self._seg.paths[0]

    @property
    def created(self) -> bool:
        """This process created the segment (or reclaimed a stale one)."""
        return self._seg.created

    @property
    def reclaimed(self) -> bool:
        """This process found the segment left by processes that all died, and re-made it."""
        return self._seg.reclaimed or self._swept_own

    def _counter(self, word: int) -> int:
        with self._tlock:
            self._live()
            return int(self._hdr[word])

    @property
    def used_bytes(self) -> int:
        return self._counter(H_USED)

    @property
    def evictions(self) -> int:
        return self._counter(H_EVICTIONS)

    @property
    def resets(self) -> int:
        """Times the store was emptied because a process died halfway through a change."""
        return self._counter(H_RESETS)

    def __len__(self) -> int:
        return self._counter(H_ENTRIES)

    def __repr__(self) -> str:
        state = "closed" if self._seg.closed else f"{len(self)} keys"
        return (f"SharedStore({self.name!r}, capacity_bytes={self.capacity_bytes}, "
                f"page_bytes={self.page_bytes}, {state})")

    # -- lifetime ---------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._seg.closed

    def close(self) -> bool:
        """Detach this process; the last process removes the segment (True then)."""
        with self._tlock:
            if self._seg.closed:
                return False
            self._mirrors.clear()
            self._drop_views()
            _OPEN.discard(self)
            return self._seg.close()

    # -- registration -------------------------------------------------------------------------
    def register(self, addr: int, size: int) -> None:
        if int(addr) <= 0 or int(size) <= 0:
            raise HashInputError("register: addr and size must be > 0")
        with self._tlock:
            self._regions[int(addr)] = int(size)

    def unregister(self, addr: int) -> None:
        with self._tlock:
            self._regions.pop(int(addr), None)

    def _inside(self, addr: int, size: int) -> bool:
        for base, n in self._regions.items():
            if base <= addr and addr + size <= base + n:
                return True
        return False

    # -- keys -----------------------------------------------------------------------------------
    def _ns_table(self) -> None:
        """Refresh the namespace cache from the table (mutex held)."""
        gen = int(self._hdr[H_GEN])
        if gen != self._ns_gen:
            self._ns_cache.clear()
            self._ns_gen = gen
        n = int(self._hdr[H_NS_COUNT])
        if len(self._ns_cache) == n:
            return
        ns = self._a["ns"]
        for i in range(len(self._ns_cache), n):
            ln = int(ns[i, 0]) | int(ns[i, 1]) << 8
            self._ns_cache[ns[i, 2:2 + ln].tobytes().decode()] = i + 1

    def _ns_id(self, name: str, create: bool) -> int | None:
        """The namespace's id; 0 (opaque) when it can never get one (too long, table full);
        None when it has none yet and ``create`` is False (mutex held)."""
        self._ns_table()
        got = self._ns_cache.get(name)
        if got is not None:
            return got
        raw = name.encode()
        n = int(self._hdr[H_NS_COUNT])
        if len(raw) > NS_ROW - 2 or n >= NS_CAP:
            return 0
        if not create:
            return None
        row = self._a["ns"][n]
        row[0], row[1] = len(raw) & 0xFF, len(raw) >> 8
        row[2:2 + len(raw)] = np.frombuffer(raw, dtype=np.uint8)
        self._hdr[H_NS_COUNT] = n + 1
        self._ns_cache[name] = n + 1
        return n + 1

    def _encode(self, key: str, create: bool) -> tuple[int, bytes] | None:
        """(meta, 32-byte digest) of ``key``; None if it cannot be in the store."""
        parts = split_key(key)
        if parts is not None:
            ns, group, digest = parts
            ns_id = self._ns_id(ns, create)
            if ns_id is None:
                return None
            if ns_id:
                return (LIVE | len(digest) << 48 | ns_id << 32 | group,
                        digest.ljust(DIGEST, b"\0"))
        return LIVE, hashlib.blake2b(key.encode(), digest_size=DIGEST).digest()

    def _home_slot(self, meta: int, d32: bytes) -> int:
        x = (int.from_bytes(d32[:8], "little") ^ (meta * 0x9E3779B97F4A7C15)) & _M64
        return ((x * 0xBF58476D1CE4E5B9) & _M64) >> self._shift

    def _find(self, meta: int, d32: bytes) -> tuple[int, bool]:
        """(slot, found): the key's row, or the empty row ending its probe."""
        mv, mask = self._meta, self._mask
        j = self._home_slot(meta, d32)
        while True:             # ends: the table is at most half full
            m = int(mv[j])
            if m == 0:
                return j, False
            if m == meta and self._digest[j].tobytes() == d32:
                return j, True
            j = (j + 1) & mask

    # -- pages ----------------------------------------------------------------------------------
    def _chain(self, first: int, n: int) -> list[int]:
        out, p, nxt = [], first, self._next
        for _ in range(n):
            out.append(p)
            p = int(nxt[p])
        return out

    def _alloc(self, n: int) -> list[int]:
        hdr = self._hdr
        pages = self._chain(int(hdr[H_FREE_HEAD]), n)
        hdr[H_FREE_HEAD] = int(self._next[pages[-1]])
        self._next[pages[-1]] = -1
        hdr[H_FREE_PAGES] -= n
        return pages

    def _copy(self, pages: list[int], parts, into_pool: bool) -> None:
        """Copy between the value's pages (runs of adjacent pages at a time) and ``parts``."""
        page, base = self._geo.page_bytes, self._data_base
        runs: list[list[int]] = []
        for p in pages:
            if runs and runs[-1][0] + runs[-1][1] == p:
                runs[-1][1] += 1
            else:
                runs.append([p, 1])
        ri = off = 0
        for addr, size in parts:
            done = 0
            while done < size:
                start, cnt = runs[ri]
                n = min(size - done, cnt * page - off)
                pool = base + start * page + off
                if into_pool:
                    ctypes.memmove(pool, addr + done, n)
                else:
                    ctypes.memmove(addr + done, pool, n)
                done += n
                off += n
                if off == cnt * page:
                    ri, off = ri + 1, 0

    # -- rows -----------------------------------------------------------------------------------
    def _event(self, meta: int, d32: bytes, removed: bool) -> None:
        if not (meta >> 32) & 0xFFFF:
            return              # opaque keys have no digest index
        hdr = self._hdr
        head = int(hdr[H_LOG_HEAD])
        slot = head % self._geo.log_cap
        self._ev_meta[slot] = meta | (REMOVED if removed else 0)
        self._ev_digest[slot] = np.frombuffer(d32, dtype=np.uint8)
        hdr[H_LOG_HEAD] = head + 1

    def _remove_at(self, j: int) -> None:
        """Drop row j: free its pages, log it, close the gap by backward shift."""
        hdr = self._hdr
        meta, n = int(self._meta[j]), int(self._npages[j])
        pages = self._chain(int(self._first[j]), n)
        self._next[pages[-1]] = int(hdr[H_FREE_HEAD])
        hdr[H_FREE_HEAD] = pages[0]
        hdr[H_FREE_PAGES] += n
        hdr[H_ENTRIES] -= 1
        hdr[H_USED] -= int(self._length[j])
        self._event(meta, self._digest[j].tobytes(), removed=True)
        mv, home, mask = self._meta, self._home, self._mask
        i = k = j
        while True:
            k = (k + 1) & mask
            if int(mv[k]) == 0:
                break
            h = int(home[k])
            if ((k - h) & mask) >= ((k - i) & mask):      # row k may move back to i
                for col in (mv, home, self._first, self._npages, self._length, self._ref):
                    col[i] = col[k]
                self._digest[i] = self._digest[k]
                i = k
        mv[i] = 0

    def _evict_one(self) -> None:
        """CLOCK: clear reference bits from the hand on; evict the first clear row."""
        hdr, cap = self._hdr, self._geo.index_cap
        hand = int(hdr[H_HAND])
        for _ in range(2 * (cap // _SCAN + 1) + 2):     # two sweeps clear every bit
            end = min(hand + _SCAN, cap)
            cand = np.flatnonzero((self._meta[hand:end] != 0) & (self._ref[hand:end] == 0))
            if cand.size:
                j = hand + int(cand[0])
                self._ref[hand:j] = 0
                self._remove_at(j)
                hdr[H_EVICTIONS] += 1
                hdr[H_HAND] = j          # a shifted row may sit at j now: look again
                return
            self._ref[hand:end] = 0
            hand = end % cap
            hdr[H_HAND] = hand
        raise StoreError("shared store: pages are held but no row holds them")   # invariant

    # -- protocol -------------------------------------------------------------------------------
    def batch_exists(self, keys) -> list[int]:
        keys = _check_keys(keys)
        with self._locked(mutate=False):
            out = []
            for k in keys:
                enc = self._encode(k, create=False)
                out.append(0 if enc is None else int(self._find(*enc)[1]))
            return out

    def batch_put(self, keys, parts) -> list[int]:
        keys = _check_keys(keys)
        parts = _check_parts(keys, parts)
        with self._locked(mutate=True):     # (holds the thread lock: regions cannot change)
            return [self._put(k, p) if all(self._inside(a, s) for a, s in p) else INVALID
                    for k, p in zip(keys, parts)]

    def _put(self, k: str, p) -> int:
        page, hdr = self._geo.page_bytes, self._hdr
        length = sum(s for _, s in p)
        need = max(1, -(-length // page))
        if need > self._geo.n_pages:
            return NO_SPACE
        enc = self._encode(k, create=True)
        assert enc is not None
        meta, d32 = enc
        j, found = self._find(meta, d32)
        if found:
            self._remove_at(j)
        while int(hdr[H_FREE_PAGES]) < need:
            self._evict_one()
        pages = self._alloc(need)
        self._copy(pages, p, into_pool=True)
        j, _ = self._find(meta, d32)         # rows may have moved while pages were freed
        self._meta[j], self._home[j] = meta, self._home_slot(meta, d32)
        self._first[j], self._npages[j], self._length[j] = pages[0], need, length
        self._ref[j] = 1
        self._digest[j] = np.frombuffer(d32, dtype=np.uint8)
        hdr[H_ENTRIES] += 1
        hdr[H_USED] += length
        hdr[H_PUTS] += 1
        self._event(meta, d32, removed=False)
        return OK

    def batch_get(self, keys, parts) -> list[int]:
        keys = _check_keys(keys)
        parts = _check_parts(keys, parts)
        with self._locked(mutate=False):
            return [self._get(k, p, all(self._inside(a, s) for a, s in p))
                    for k, p in zip(keys, parts)]

    def _get(self, k: str, p, inside: bool) -> int:
        enc = self._encode(k, create=False)
        if enc is None:
            return NOT_FOUND
        j, found = self._find(*enc)
        if not found:
            return NOT_FOUND
        length = int(self._length[j])
        if not inside or sum(s for _, s in p) != length:
            return INVALID
        self._copy(self._chain(int(self._first[j]), int(self._npages[j])), p, into_pool=False)
        self._ref[j] = 1
        return length

    def batch_remove(self, keys) -> list[int]:
        keys = _check_keys(keys)
        with self._locked(mutate=True):
            out = []
            for k in keys:
                enc = self._encode(k, create=False)
                j, found = self._find(*enc) if enc is not None else (0, False)
                if found:
                    self._remove_at(j)
                out.append(OK if found else NOT_FOUND)
            return out

    # -- digest index -----------------------------------------------------------------------
    def digest_index(self, namespace: str) -> _hits.ExistenceSet | None:
        """This process's existence set of ``namespace``'s keys, up to date with every change
        any process finished before this call (see the module docstring); None if the
        namespace has no keys yet or mixes digest widths."""
        with self._tlock:
            self._live()
            m = self._mirrors.get(namespace)
            if m is None:
                m = self._mirrors[namespace] = _Mirror()
            hdr = self._hdr
            if m.seen == int(hdr[H_LOG_HEAD]) and m.gen == int(hdr[H_GEN]):
                return None if m.mixed else m.es       # nothing new: no lock taken
            with self._locked(mutate=False):
                head, gen = int(hdr[H_LOG_HEAD]), int(hdr[H_GEN])
                ns_id = self._ns_id(namespace, create=False) or None
                rebuild = (m.gen != gen or m.ns_id != ns_id
                           or head - m.seen > self._geo.log_cap)
                if ns_id is None:
                    metas, digests = np.zeros(0, np.int64), np.zeros((0, DIGEST), np.uint8)
                elif rebuild:
                    live = (self._meta != 0) & (((self._meta >> 32) & 0xFFFF) == ns_id)
                    metas, digests = self._meta[live], self._digest[live]
                else:
                    idx = np.arange(m.seen, head, dtype=np.int64) % self._geo.log_cap
                    metas, digests = self._ev_meta[idx], self._ev_digest[idx]
            if rebuild:
                m.es, m.width, m.mixed = None, 0, False
            m.seen, m.gen, m.ns_id = head, gen, ns_id
            if ns_id is not None:
                self._apply(m, metas, digests)
            return None if m.mixed else m.es

    def read_log(self, namespaces, seen: int, gen: int) -> LogRead:
        """The changes of ``namespaces``' keys since a reader's position ``(seen, gen)``
        (a :class:`LogRead`): the log rows ``[seen, head)`` of those namespaces, in order; or,
        when the reader cannot follow the log (``seen < 0``: a new reader; the generation
        changed: the store was emptied; more than ``log_cap`` events behind: overwritten),
        a snapshot of every key of those namespaces in the store now (``snapshot`` True).
        One call under the mutex; the arrays are copies."""
        names = [namespaces] if isinstance(namespaces, str) else list(namespaces)
        if not all(isinstance(n, str) and n for n in names):
            raise HashInputError(f"namespaces must be non-empty strs, got {namespaces!r}")
        seen, gen = int(seen), int(gen)
        with self._tlock:
            self._live()
            hdr = self._hdr
            if seen >= 0 and seen == int(hdr[H_LOG_HEAD]) and gen == int(hdr[H_GEN]):
                return LogRead(seen, gen, False, np.zeros(0, np.int64),
                               np.zeros((0, DIGEST), np.uint8))       # nothing new: no lock
            with self._locked(mutate=False):
                head, now = int(hdr[H_LOG_HEAD]), int(hdr[H_GEN])
                ids = [i for i in (self._ns_id(n, create=False) for n in names) if i]
                snapshot = seen < 0 or gen != now or head - seen > self._geo.log_cap
                if snapshot:
                    metas, digests = self._meta, self._digest
                else:
                    idx = np.arange(seen, head, dtype=np.int64) % self._geo.log_cap
                    metas, digests = self._ev_meta[idx], self._ev_digest[idx]
                sel = np.isin((metas >> 32) & 0xFFFF, np.asarray(ids, np.int64))
                if snapshot:
                    sel &= metas != 0
                metas, digests = metas[sel].copy(), digests[sel].copy()
        return LogRead(head, now, snapshot, metas, digests)

    @staticmethod
    def _apply(m: _Mirror, metas: np.ndarray, digests: np.ndarray) -> None:
        """Replay (meta, digest) rows of the mirror's namespace into its set, in order."""
        if m.mixed or metas.size == 0:
            return
        sel = ((metas >> 32) & 0xFFFF) == m.ns_id
        metas, digests = metas[sel], digests[sel]
        if metas.size == 0:
            return
        widths = (metas >> 48) & 0xFF
        if m.width == 0:
            m.width = int(widths[0])
            m.es = _hits.ExistenceSet(m.width)
        if (widths != m.width).any():
            m.mixed, m.es = True, None          # like EmbeddedStore: looked up by keys
            return
        es = m.es
        assert es is not None
        run = (metas & 0xFFFFFFFF) * 2 + ((metas & REMOVED) != 0)
        cuts = np.flatnonzero(np.diff(run)) + 1
        for s, e in zip([0, *cuts.tolist()], [*cuts.tolist(), metas.size]):
            d = np.ascontiguousarray(digests[s:e, :m.width])
            group = int(metas[s] & 0xFFFFFFFF)
            if metas[s] & REMOVED:
                es.discard_many(group, d)
            else:
                es.add_many(group, d)
