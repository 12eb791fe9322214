"""Existence set of (group id, block hash) keys and vLLM's cross-group longest-hit rule.

``ExistenceSet`` is an open-addressing hash set over fixed-width slots: a slot is a 4-byte
tag (the group id, or -1 empty / -2 deleted) followed by the digest (16 or 32 bytes). No
Python object is kept per key. Probing is linear over a power-of-two table kept at most 3/4
full; bulk calls take an (N, digest_size) C-contiguous uint8 array.

``longest_hit`` runs the per-manager lookups of vLLM's single-type KV cache managers and the
fixed point of its ``HybridKVCacheCoordinator`` over an ``ExistenceSet``. The Python layer
(hmacore/hits.py) compiles a KVLayout into the ``specs``/``members`` arrays it takes.
Units: ``max_length``, block sizes, windows, ``hash_block`` and ``align`` are tokens; hash
rows are blocks of ``hash_block`` tokens; the output holds block counts of each spec group.
"""
from cpython.pythread cimport (PyThread_acquire_lock, PyThread_allocate_lock,
                               PyThread_free_lock, PyThread_release_lock, WAIT_LOCK)
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcmp, memcpy, memset

import numpy as np
cimport numpy as cnp

cnp.import_array()

from hmacore.errors import HashInputError

cdef int32_t TAG_EMPTY = -1
cdef int32_t TAG_DELETED = -2
cdef Py_ssize_t MIN_CAP = 16

# spec kinds (hmacore.spec.GroupKind values)
cdef enum:
    K_FULL = 0
    K_SLIDING = 1
    K_CHUNKED = 2
    K_MAMBA = 3

# columns of the ``specs`` table
SPEC_COLUMNS = ("kind", "block_size", "window", "chunk", "eagle", "member_start",
                "member_end", "fine_lookup")
cdef enum:
    C_KIND = 0
    C_BS = 1
    C_WINDOW = 2
    C_CHUNK = 3
    C_EAGLE = 4
    C_MSTART = 5
    C_MEND = 6
    C_FINE = 7
    NCOLS = 8
MAX_SPEC_GROUPS = 256


cdef inline uint64_t _mix(uint64_t x) noexcept nogil:
    x ^= x >> 30
    x *= <uint64_t>0xbf58476d1ce4e5b9
    x ^= x >> 27
    x *= <uint64_t>0x94d049bb133111eb
    x ^= x >> 31
    return x


cdef inline uint64_t _rotl(uint64_t x, int r) noexcept nogil:
    return (x << r) | (x >> (64 - r))


cdef inline uint64_t _key_hash(int32_t group, const uint8_t* d, int ds) noexcept nogil:
    # Digests are already uniform (sha256 / xxh3): fold the words with distinct rotations
    # and odd multipliers, then one full mix (two mixes for 32-byte digests instead of five).
    cdef uint64_t w0, w1, h
    memcpy(&w0, d, 8)
    memcpy(&w1, d + 8, 8)
    h = (<uint64_t>(<uint32_t>group) * <uint64_t>0x9e3779b97f4a7c15) ^ w0 \
        ^ (_rotl(w1, 29) * <uint64_t>0xc2b2ae3d27d4eb4f)
    if ds == 32:
        memcpy(&w0, d + 16, 8)
        memcpy(&w1, d + 24, 8)
        h = _mix(h) ^ _rotl(w0, 17) ^ (_rotl(w1, 43) * <uint64_t>0x165667b19e3779f9)
    return _mix(h)


def _check_group(object group, str name="group"):
    if isinstance(group, bool) or not isinstance(group, (int, np.integer)):
        raise HashInputError(f"{name} must be an int group id, got {type(group).__name__}")
    g = int(group)
    if g < 0 or g > 2147483647:
        raise HashInputError(f"{name} must be in [0, 2**31-1], got {g}")
    return g


def _check_digest(object digest, int ds):
    if not isinstance(digest, (bytes, bytearray, memoryview)):
        raise HashInputError(f"digest must be bytes of length {ds}, got {type(digest).__name__}")
    b = bytes(digest)
    if len(b) != ds:
        raise HashInputError(f"digest must be {ds} bytes (the set's digest_size), got {len(b)}")
    return b


def _check_digests(object digests, int ds, str name="digests"):
    """Validate an (N, ds) C-contiguous uint8 array; return it (never copies)."""
    if not isinstance(digests, np.ndarray):
        raise HashInputError(f"{name} must be a numpy uint8 array of shape (N, {ds}), "
                             f"got {type(digests).__name__}")
    if digests.dtype != np.uint8:
        raise HashInputError(f"{name} must have dtype uint8, got {digests.dtype}")
    if digests.ndim != 2 or digests.shape[1] != ds:
        raise HashInputError(f"{name} must have shape (N, {ds}) (digest_size {ds}), "
                             f"got {digests.shape}")
    if not digests.flags.c_contiguous:
        raise HashInputError(f"{name} must be C-contiguous (use np.ascontiguousarray)")
    return digests


cdef class ExistenceSet:
    """Set of (group id, block hash) keys with bulk, allocation-free membership.

    ``digest_size`` is 16 (xxh3-128) or 32 (sha256) bytes; every key of one set has it.
    Group ids are ints in [0, 2**31-1]. Memory: ``capacity * (4 + digest_size)`` bytes
    (see ``nbytes``); the table doubles when it would pass 3/4 full, so a key costs
    between 1.33x and 2.67x its 20 or 36 slot bytes (measured: 72 B/key for 32-byte
    digests at 50% load, 36-72 B/key for 16-byte ones). Thread-safe: every operation takes
    the set's lock with the GIL released, so bulk loops and the hit kernel run without the
    GIL while other threads keep running (and never see a table being resized).
    """

    def __cinit__(self, int digest_size=32, Py_ssize_t capacity=0):
        self._slots = NULL
        self._cap = 0
        self._size = 0
        self._used = 0
        self._lock = PyThread_allocate_lock()
        if self._lock == NULL:
            raise MemoryError("ExistenceSet: cannot allocate a lock")

    def __init__(self, int digest_size=32, Py_ssize_t capacity=0):
        if digest_size not in (16, 32):
            raise HashInputError(f"digest_size must be 16 or 32 bytes, got {digest_size}")
        if capacity < 0:
            raise HashInputError(f"capacity must be >= 0 keys, got {capacity}")
        self.digest_size = digest_size
        self._slot_size = 4 + digest_size
        cdef int rc = 0
        if capacity:
            with nogil:
                self.lock()
                rc = self.reserve(capacity)
                self.unlock()
        if rc < 0:
            raise MemoryError("ExistenceSet: cannot allocate the table")

    def __dealloc__(self):
        if self._slots != NULL:
            free(self._slots)
            self._slots = NULL
        if self._lock != NULL:
            PyThread_free_lock(self._lock)
            self._lock = NULL

    cdef void lock(self) noexcept nogil:
        PyThread_acquire_lock(self._lock, WAIT_LOCK)

    cdef void unlock(self) noexcept nogil:
        PyThread_release_lock(self._lock)

    # -- C-level core ------------------------------------------------------------------
    cdef int _rehash(self, Py_ssize_t new_cap) noexcept nogil:
        cdef uint8_t* fresh = <uint8_t*>malloc(new_cap * self._slot_size)
        cdef Py_ssize_t i, j, mask = new_cap - 1
        cdef int32_t tag
        cdef uint8_t* src
        if fresh == NULL:
            return -1
        memset(fresh, 0xFF, new_cap * self._slot_size)   # every tag = -1 (empty)
        for i in range(self._cap):
            src = self._slots + i * self._slot_size
            memcpy(&tag, src, 4)
            if tag < 0:
                continue
            j = <Py_ssize_t>(_key_hash(tag, src + 4, self.digest_size) & <uint64_t>mask)
            while True:
                memcpy(&tag, fresh + j * self._slot_size, 4)
                if tag == TAG_EMPTY:
                    break
                j = (j + 1) & mask
            memcpy(fresh + j * self._slot_size, src, self._slot_size)
        if self._slots != NULL:
            free(self._slots)
        self._slots = fresh
        self._cap = new_cap
        self._used = self._size
        return 0

    cdef int reserve(self, Py_ssize_t extra) noexcept nogil:
        """Make room for ``extra`` more keys without passing 3/4 load; -1 if out of memory."""
        cdef Py_ssize_t need = self._used + extra
        cdef Py_ssize_t cap
        if need * 4 <= self._cap * 3 and self._cap > 0:
            return 0
        cap = MIN_CAP
        while cap * 3 < (self._size + extra) * 4 + 4:
            cap *= 2
        if cap < self._cap:
            cap = self._cap      # only tombstones to clear: rehash at the same size
        return self._rehash(cap)

    cdef bint has(self, int32_t group, const uint8_t* digest) noexcept nogil:
        cdef Py_ssize_t mask, j
        cdef int32_t tag
        cdef uint8_t* slot
        if self._size == 0:
            return False
        mask = self._cap - 1
        j = <Py_ssize_t>(_key_hash(group, digest, self.digest_size) & <uint64_t>mask)
        while True:
            slot = self._slots + j * self._slot_size
            memcpy(&tag, slot, 4)
            if tag == TAG_EMPTY:
                return False
            if tag == group and memcmp(slot + 4, digest, self.digest_size) == 0:
                return True
            j = (j + 1) & mask

    cdef int put(self, int32_t group, const uint8_t* digest) noexcept nogil:
        """1 if added, 0 if already present, -1 if out of memory."""
        cdef Py_ssize_t mask, j, first_free = -1
        cdef int32_t tag
        cdef uint8_t* slot
        if self.reserve(1) < 0:
            return -1
        mask = self._cap - 1
        j = <Py_ssize_t>(_key_hash(group, digest, self.digest_size) & <uint64_t>mask)
        while True:
            slot = self._slots + j * self._slot_size
            memcpy(&tag, slot, 4)
            if tag == TAG_EMPTY:
                break
            if tag == TAG_DELETED:
                if first_free < 0:
                    first_free = j
            elif tag == group and memcmp(slot + 4, digest, self.digest_size) == 0:
                return 0
            j = (j + 1) & mask
        if first_free >= 0:
            slot = self._slots + first_free * self._slot_size
        else:
            self._used += 1
        memcpy(slot, &group, 4)
        memcpy(slot + 4, digest, self.digest_size)
        self._size += 1
        return 1

    cdef bint drop(self, int32_t group, const uint8_t* digest) noexcept nogil:
        cdef Py_ssize_t mask, j
        cdef int32_t tag
        cdef uint8_t* slot
        if self._size == 0:
            return False
        mask = self._cap - 1
        j = <Py_ssize_t>(_key_hash(group, digest, self.digest_size) & <uint64_t>mask)
        while True:
            slot = self._slots + j * self._slot_size
            memcpy(&tag, slot, 4)
            if tag == TAG_EMPTY:
                return False
            if tag == group and memcmp(slot + 4, digest, self.digest_size) == 0:
                tag = TAG_DELETED
                memcpy(slot, &tag, 4)
                self._size -= 1
                return True
            j = (j + 1) & mask

    # -- Python surface ----------------------------------------------------------------
    def __len__(self):
        return self._size

    @property
    def capacity(self):
        """Slots in the table (keys it holds before it must grow: 3/4 of this)."""
        return self._cap

    @property
    def nbytes(self):
        """Bytes of the slot table (the set's whole per-key memory)."""
        return self._cap * self._slot_size

    def add(self, group, digest):
        """Insert key (group, digest); True if it was new."""
        cdef int32_t g = _check_group(group)
        cdef bytes b = _check_digest(digest, self.digest_size)
        cdef const uint8_t* p = <const uint8_t*><char*>b
        cdef int rc
        with nogil:
            self.lock()
            rc = self.put(g, p)
            self.unlock()
        if rc < 0:
            raise MemoryError("ExistenceSet: cannot grow the table")
        return rc == 1

    def discard(self, group, digest):
        """Remove key (group, digest) if present; True if it was there."""
        cdef int32_t g = _check_group(group)
        cdef bytes b = _check_digest(digest, self.digest_size)
        cdef const uint8_t* p = <const uint8_t*><char*>b
        cdef bint r
        with nogil:
            self.lock()
            r = self.drop(g, p)
            self.unlock()
        return r

    def contains(self, group, digest):
        """True if key (group, digest) is in the set."""
        cdef int32_t g = _check_group(group)
        cdef bytes b = _check_digest(digest, self.digest_size)
        cdef const uint8_t* p = <const uint8_t*><char*>b
        cdef bint r
        with nogil:
            self.lock()
            r = self.has(g, p)
            self.unlock()
        return r

    def __contains__(self, key):
        if not isinstance(key, tuple) or len(key) != 2:
            raise HashInputError("membership takes a (group, digest) tuple")
        return self.contains(key[0], key[1])

    def clear(self):
        """Remove every key (keeps the table's capacity)."""
        with nogil:
            self.lock()
            if self._slots != NULL:
                memset(self._slots, 0xFF, self._cap * self._slot_size)
            self._size = 0
            self._used = 0
            self.unlock()

    def add_many(self, group, digests):
        """Insert (group, row) for every row of an (N, digest_size) uint8 array; returns
        how many keys were new. Rows may repeat."""
        cdef int32_t g = _check_group(group)
        _check_digests(digests, self.digest_size)
        cdef const uint8_t[:, ::1] d = digests
        cdef Py_ssize_t i, n = d.shape[0], added = 0
        cdef int rc = 0
        if n == 0:
            return 0
        with nogil:
            self.lock()
            rc = self.reserve(n)
            if rc == 0:
                for i in range(n):
                    rc = self.put(g, &d[i, 0])
                    if rc < 0:
                        break
                    added += rc
            self.unlock()
        if rc < 0:
            raise MemoryError("ExistenceSet: cannot grow the table")
        return added

    def discard_many(self, group, digests):
        """Remove (group, row) for every row; returns how many keys were removed."""
        cdef int32_t g = _check_group(group)
        _check_digests(digests, self.digest_size)
        cdef const uint8_t[:, ::1] d = digests
        cdef Py_ssize_t i, n = d.shape[0], removed = 0
        if n == 0:
            return 0
        with nogil:
            self.lock()
            for i in range(n):
                removed += self.drop(g, &d[i, 0])
            self.unlock()
        return removed

    def contains_many(self, group, digests):
        """uint8 mask (N,): 1 where (group, row i) is in the set."""
        cdef int32_t g = _check_group(group)
        _check_digests(digests, self.digest_size)
        cdef const uint8_t[:, ::1] d = digests
        cdef Py_ssize_t i, n = d.shape[0]
        out = np.zeros(n, dtype=np.uint8)
        if n == 0:
            return out
        cdef uint8_t[::1] o = out
        with nogil:
            self.lock()
            for i in range(n):
                o[i] = self.has(g, &d[i, 0])
            self.unlock()
        return out

    def leading_run(self, group, digests):
        """Index of the first row whose key (group, row) is missing (N if all present):
        the length of the leading run of hits, in rows."""
        cdef int32_t g = _check_group(group)
        _check_digests(digests, self.digest_size)
        cdef const uint8_t[:, ::1] d = digests
        cdef Py_ssize_t i = 0, n = d.shape[0]
        with nogil:
            self.lock()
            while i < n and self.has(g, &d[i, 0]):
                i += 1
            self.unlock()
        return i


# ---------------------------------------------------------------------------------------
# Longest hit
# ---------------------------------------------------------------------------------------
cdef struct Ctx:
    const uint8_t* hashes      # N rows of ds bytes
    Py_ssize_t n_rows
    int ds
    const int32_t* members
    long long hash_block
    bint all_present           # mask mode: every probe hits (no set)


cdef inline bint _probe(ExistenceSet es, Ctx* c, long long ms, long long me,
                        Py_ssize_t row) noexcept nogil:
    """All member groups [ms, me) hold the key of hash row ``row``."""
    cdef long long m
    if c.all_present:
        return True
    cdef const uint8_t* d = c.hashes + row * c.ds
    for m in range(ms, me):
        if not es.has(c.members[m], d):
            return False
    return True


cdef inline long long _cdiv(long long a, long long b) noexcept nogil:
    # a >= 0, b > 0 (cdivision is on: C division truncates, so no -(-a // b) trick)
    return (a + b - 1) // b


cdef long long _find(ExistenceSet es, Ctx* c, const int64_t* sp, long long max_length,
                     bint drop_eagle, long long align, long long* out_len,
                     long long* out_lo) noexcept nogil:
    """One spec group's ``find_longest_cache_hit``: writes the hit list length (blocks,
    nulls included) and the first non-null index; returns the hit in tokens."""
    cdef long long kind = sp[C_KIND], bs = sp[C_BS]
    cdef long long ms = sp[C_MSTART], me = sp[C_MEND]
    cdef long long h = c.hash_block
    cdef long long k = bs // h                       # hash rows per block
    cdef long long n_coarse = c.n_rows // k
    cdef long long maxb = max_length // bs
    cdef long long n, i, j, hit, L, lo, run, need, post, sf, first, maxp, start, chunk
    cdef bint fine, found
    if maxb > n_coarse:
        maxb = n_coarse
    if maxb < 0:
        maxb = 0
    if kind == K_FULL:
        fine = align < bs and bs % align == 0
        n = 0
        while n < maxb and _probe(es, c, ms, me, (n + 1) * k - 1):
            n += 1
        hit = n * bs
        if fine:
            sf = bs // align
            first = n * sf
            maxp = first + sf - 1
            if max_length // align < maxp:
                maxp = max_length // align
            if c.n_rows < maxp:
                maxp = c.n_rows
            j = maxp - 1
            while j >= first:
                if _probe(es, c, ms, me, j):
                    hit = (j + 1) * align
                    break
                j -= 1
        if drop_eagle and hit > 0:
            hit -= align if align < bs else bs
        hit -= hit % align
        out_len[0] = _cdiv(hit, bs)
        out_lo[0] = 0
        return hit
    if kind == K_SLIDING:
        need = _cdiv(sp[C_WINDOW] - 1, bs) + (1 if drop_eagle else 0)
        run = 0
        found = False
        L = 0
        lo = 0
        i = maxb - 1
        while i >= 0:
            if _probe(es, c, ms, me, (i + 1) * k - 1):
                if run == 0 and bs != align:
                    post = i if drop_eagle else i + 1
                    if (post * bs) % align != 0:
                        i -= 1
                        continue
                run += 1
                if run >= need:
                    L = i + run
                    lo = i
                    found = True
                    break
            else:
                run = 0
            i -= 1
        if not found:
            L = run
            lo = 0
            while bs != align and (L * bs) % align != 0:
                L -= 1
        if drop_eagle and L > 0:
            L -= 1
            while bs != align and (L * bs) % align != 0:
                L -= 1
        if lo > L:
            lo = L
        out_len[0] = L
        out_lo[0] = lo
        return L * bs
    if kind == K_CHUNKED:
        chunk = sp[C_CHUNK]
        start = (max_length // chunk) * chunk if max_length > 0 else 0
        L = start // bs
        lo = L
        i = L
        while i < maxb and _probe(es, c, ms, me, (i + 1) * k - 1):
            L += 1
            i += 1
        out_len[0] = L
        out_lo[0] = lo
        return L * bs
    # K_MAMBA
    if align < bs and bs % align == 0:
        sf = bs // align
        maxp = max_length // align
        if c.n_rows < maxp:
            maxp = c.n_rows
        j = maxp - 1
        while j >= 0:
            if _probe(es, c, ms, me, j):
                out_len[0] = j // sf + 1
                out_lo[0] = j // sf
                return (j + 1) * align
            j -= 1
        out_len[0] = 0
        out_lo[0] = 0
        return 0
    i = maxb - 1
    while i >= 0:
        if _probe(es, c, ms, me, (i + 1) * k - 1):
            if bs != align and ((i + 1) * bs) % align != 0:
                i -= 1
                continue
            out_len[0] = i + 1
            out_lo[0] = i
            return (i + 1) * bs
        i -= 1
    out_len[0] = 0
    out_lo[0] = 0
    return 0


def longest_hit(ExistenceSet es, hashes, long long max_length, specs, members,
                long long hash_block, long long align, bint partial, bint unitary,
                out):
    """vLLM's longest cache hit over ``es``; returns the hit in tokens.

    Args:
        es: the existence set (keys: group id, hash row bytes), or None for mask mode:
            every probe hits (used to derive load masks for a known hit length).
        hashes: (N, es.digest_size) uint8, C-contiguous: the request's hash rows, row j
            naming tokens [0, (j+1)*hash_block). Block i of a group with block size bs is
            row (i+1)*bs/hash_block - 1 (the last row inside it).
        max_length: cap of the hit, tokens (>= 0).
        specs: (S, 8) int64 spec groups in lookup order (see SPEC_COLUMNS).
        members: int32 group ids; spec s owns members[member_start:member_end].
        hash_block: tokens per hash row. align: hit alignment in tokens.
        partial: fine-grained (sub-block) hits are enabled (align == hash_block).
        unitary: one KV cache group: a single direct lookup, no fixed point.
        out: (S, 2) int64, written: per spec (hit list length in blocks, first loaded index).
    """
    if es is None:
        if not isinstance(hashes, np.ndarray) or hashes.ndim != 2 or hashes.shape[1] not in (16, 32):
            raise HashInputError("hashes must be a uint8 array of shape (N, 16) or (N, 32)")
        _check_digests(hashes, hashes.shape[1], "hashes")
    else:
        _check_digests(hashes, es.digest_size, "hashes")
    if not isinstance(specs, np.ndarray) or specs.dtype != np.int64 or specs.ndim != 2 \
            or specs.shape[1] != NCOLS or not specs.flags.c_contiguous:
        raise HashInputError(f"specs must be a C-contiguous int64 array of shape (S, {NCOLS})")
    if not isinstance(members, np.ndarray) or members.dtype != np.int32 or members.ndim != 1 \
            or not members.flags.c_contiguous:
        raise HashInputError("members must be a C-contiguous int32 array")
    if not isinstance(out, np.ndarray) or out.dtype != np.int64 or out.shape != (specs.shape[0], 2) \
            or not out.flags.c_contiguous or not out.flags.writeable:
        raise HashInputError("out must be a writable C-contiguous int64 array of shape (S, 2)")
    if max_length < 0:
        raise HashInputError(f"max_length must be >= 0 tokens, got {max_length}")
    if hash_block <= 0 or align <= 0 or align % hash_block:
        raise HashInputError("hash_block must be > 0 and align a positive multiple of it")
    cdef const int64_t[:, ::1] sp = specs
    cdef const int32_t[::1] mem = members
    cdef int64_t[:, ::1] o = out
    cdef Py_ssize_t S = sp.shape[0], s
    cdef long long nm = mem.shape[0]
    for s in range(S):
        if not (0 <= sp[s, C_KIND] <= 3) or sp[s, C_BS] <= 0 or sp[s, C_BS] % hash_block \
                or not (0 <= sp[s, C_MSTART] < sp[s, C_MEND] <= nm):
            raise HashInputError(f"specs row {s} is malformed")
        if sp[s, C_KIND] == K_SLIDING and sp[s, C_WINDOW] <= 0:
            raise HashInputError(f"specs row {s}: sliding window must be > 0")
        if sp[s, C_KIND] == K_CHUNKED and sp[s, C_CHUNK] <= 0:
            raise HashInputError(f"specs row {s}: chunk must be > 0")
    for s in range(nm):
        if mem[s] < 0:
            raise HashInputError("members must be group ids >= 0")
    if S > MAX_SPEC_GROUPS:
        raise HashInputError(f"specs: at most {MAX_SPEC_GROUPS} spec groups, got {S}")
    if S == 0:
        return 0
    cdef const uint8_t[:, ::1] hv = hashes
    cdef Ctx c
    c.n_rows = hv.shape[0]
    c.ds = hv.shape[1]
    c.all_present = es is None
    c.hashes = &hv[0, 0] if c.n_rows > 0 else NULL
    c.members = &mem[0] if nm > 0 else NULL
    c.hash_block = hash_block
    cdef long long hit
    with nogil:
        if es is not None:
            es.lock()
        hit = _fixed_point(es, &c, &sp[0, 0], S, max_length, align, partial, unitary,
                           &o[0, 0])
        if es is not None:
            es.unlock()
    return hit


cdef long long _fixed_point(ExistenceSet es, Ctx* c, const int64_t* sp, Py_ssize_t S,
                            long long max_length, long long align, bint partial,
                            bint unitary, int64_t* out) noexcept nogil:
    cdef long long L, lo, new, curr, hit, ml, margin, bs
    cdef Py_ssize_t s, t
    cdef const int64_t* row
    cdef bint drop, simple
    cdef uint8_t done_fa[256]
    cdef uint8_t verified[256]
    cdef long long fa_len[256]
    if unitary:
        row = sp
        hit = _find(es, c, row, max_length, row[C_EAGLE] != 0, align, &L, &lo)
        out[0] = L
        out[1] = lo
        return hit
    memset(done_fa, 0, sizeof(done_fa))
    memset(verified, 0, sizeof(verified))
    simple = S == 2 and sp[C_KIND] == K_FULL
    hit = max_length
    while True:
        curr = hit
        for s in range(S):
            row = sp + s * NCOLS
            if row[C_KIND] == K_FULL and done_fa[s]:
                if fa_len[s] < curr:
                    curr = fa_len[s]
                continue
            drop = row[C_EAGLE] != 0 and not verified[s]
            ml = curr
            bs = row[C_BS]
            if drop and row[C_KIND] != K_MAMBA:
                margin = bs
                if partial and row[C_FINE] != 0 and bs > c.hash_block:
                    margin = c.hash_block
                ml = curr + margin
                if ml > c.n_rows * c.hash_block:
                    ml = c.n_rows * c.hash_block
            new = _find(es, c, row, ml, drop, align, &L, &lo)
            if drop:
                verified[s] = 1
            elif new < curr:
                memset(verified, 0, sizeof(verified))
            curr = new
            out[2 * s] = L
            out[2 * s + 1] = lo
            if row[C_KIND] == K_FULL:
                done_fa[s] = 1
                fa_len[s] = new
        if curr >= hit:
            break
        hit = curr
        if simple:
            break
    for s in range(S):
        row = sp + s * NCOLS
        if row[C_KIND] == K_FULL:
            L = _cdiv(hit, row[C_BS])
            if out[2 * s] > L:
                out[2 * s] = L
    return hit


# ---------------------------------------------------------------------------------------
# Compiled lookup: the per-layout constants validated once, one call per lookup
# ---------------------------------------------------------------------------------------
cdef inline bint _is_hash_array(object x, int ds):
    """O(1) form check of an (N, ds) C-contiguous uint8 array (ds 0: 16 or 32)."""
    if not cnp.PyArray_Check(x):
        return False
    cdef cnp.ndarray a = <cnp.ndarray>x
    if cnp.PyArray_TYPE(a) != cnp.NPY_UINT8 or cnp.PyArray_NDIM(a) != 2 \
            or not cnp.PyArray_IS_C_CONTIGUOUS(a):
        return False
    if ds == 0:
        return a.shape[1] == 16 or a.shape[1] == 32
    return a.shape[1] == ds


cdef class HitKernel:
    """``longest_hit`` with the layout's spec table checked and copied once.

    Built by :class:`hmacore.hits.HitFinder` from the same ``specs`` / ``members`` /
    ``hash_block`` / ``align`` / ``partial`` / ``unitary`` arguments ``longest_hit`` takes
    (validated here with the same rules, once). :meth:`run` validates only the per-call
    arguments (O(1) form checks), runs the kernel and returns ``(tokens, spans)``: the hit in
    tokens and a fresh (S, 2) int64 array, per spec group (hit list length in blocks, first
    loaded index).
    """
    cdef object _specs, _specs_no_eagle, _members
    cdef const int64_t* _sp
    cdef const int64_t* _sp_ne
    cdef const int32_t* _mem
    cdef Py_ssize_t S
    cdef long long nm, hash_block, align
    cdef bint partial, unitary

    def __init__(self, specs, members, long long hash_block, long long align, bint partial,
                 bint unitary):
        probe = np.zeros((specs.shape[0] if isinstance(specs, np.ndarray) and specs.ndim == 2
                          else 0, 2), dtype=np.int64)
        # reuse longest_hit's validation of the layout constants (mask mode, no rows)
        longest_hit(None, np.zeros((0, 32), dtype=np.uint8), 0, specs, members, hash_block,
                    align, partial, unitary, probe)
        self._specs = np.array(specs, dtype=np.int64, order="C", copy=True)
        self._specs_no_eagle = self._specs.copy()
        self._specs_no_eagle[:, C_EAGLE] = 0
        self._members = np.array(members, dtype=np.int32, order="C", copy=True)
        self._specs.flags.writeable = False
        self._specs_no_eagle.flags.writeable = False
        self._members.flags.writeable = False
        self.S = self._specs.shape[0]
        self.nm = self._members.shape[0]
        self._sp = <const int64_t*>cnp.PyArray_DATA(<cnp.ndarray>self._specs)
        self._sp_ne = <const int64_t*>cnp.PyArray_DATA(<cnp.ndarray>self._specs_no_eagle)
        self._mem = <const int32_t*>cnp.PyArray_DATA(<cnp.ndarray>self._members)
        self.hash_block = hash_block
        self.align = align
        self.partial = partial
        self.unitary = unitary

    @property
    def num_spec_groups(self):
        return self.S

    def run(self, exists, hashes, max_length, bint apply_eagle=True):
        """(tokens, spans) of the longest hit; see :meth:`hmacore.hits.HitFinder.longest_hit`
        for the arguments (``exists`` None = mask mode). Raises HashInputError naming the
        argument on bad input, before any work."""
        cdef ExistenceSet es
        cdef long long ml
        if exists is None:
            es = None
            if not _is_hash_array(hashes, 0):
                if isinstance(hashes, np.ndarray) and hashes.ndim == 2 \
                        and hashes.shape[1] in (16, 32):
                    _check_digests(hashes, hashes.shape[1], "hashes")
                raise HashInputError("hashes must be a uint8 array of shape (N, 16) or (N, 32)")
        elif type(exists) is ExistenceSet:
            es = <ExistenceSet>exists
            if not _is_hash_array(hashes, es.digest_size):
                _check_digests(hashes, es.digest_size, "hashes")
        else:
            raise HashInputError(f"exists must be an ExistenceSet or None, got "
                                 f"{type(exists).__name__}")
        if type(max_length) is not int:
            if isinstance(max_length, bool) or not isinstance(max_length, (int, np.integer)):
                raise HashInputError(f"max_length must be an int (tokens), got "
                                     f"{type(max_length).__name__}")
        if max_length < 0:
            raise HashInputError(f"max_length must be >= 0 tokens, got {max_length}")
        if max_length > 9223372036854775807:
            raise HashInputError(f"max_length must be < 2**63 tokens, got {max_length}")
        ml = max_length
        cdef cnp.npy_intp dims[2]
        dims[0] = self.S
        dims[1] = 2
        out = cnp.PyArray_ZEROS(2, dims, cnp.NPY_INT64, 0)
        cdef int64_t* o = <int64_t*>cnp.PyArray_DATA(<cnp.ndarray>out)
        if self.S == 0:
            return 0, out
        cdef cnp.ndarray hv = <cnp.ndarray>hashes
        cdef Ctx c
        c.n_rows = hv.shape[0]
        c.ds = hv.shape[1]
        c.all_present = es is None
        c.hashes = <const uint8_t*>cnp.PyArray_DATA(hv) if c.n_rows > 0 else NULL
        c.members = self._mem
        c.hash_block = self.hash_block
        cdef const int64_t* sp = self._sp if apply_eagle else self._sp_ne
        cdef long long hit
        with nogil:
            if es is not None:
                es.lock()
            hit = _fixed_point(es, &c, sp, self.S, ml, self.align, self.partial,
                               self.unitary, o)
            if es is not None:
                es.unlock()
        return hit, out
