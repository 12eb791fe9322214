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
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcmp, memcpy, memset
from cpython.object cimport PyObject
from cpython.list cimport PyList_CheckExact


cdef extern from "Python.h":
    # Reads of a bytes object's fields: no reference counting, safe without the GIL as long
    # as the object is alive and the list holding it cannot change (the GIL is held then).
    bint PyBytes_CheckExact(PyObject*) nogil
    Py_ssize_t PyBytes_GET_SIZE(PyObject*) nogil
    char* PyBytes_AS_STRING(PyObject*) nogil
    PyObject** PySequence_Fast_ITEMS(object)

import numpy as np
cimport numpy as cnp

cnp.import_array()

from hmacore._fast._slots cimport SLOT_DELETED, SLOT_EMPTY, probe_slots
from hmacore._fast._types cimport group_id_t, token_t, GROUP_ID_NPY, TOKEN_NPY, TOKEN_MAX
from hmacore._fast._helpers cimport PyLong_AsLongLongAndOverflow, sat_add
from hmacore.errors import HashInputError

cdef Py_ssize_t MIN_CAP = 16
# Largest number of keys a set holds: 2**55 keys need a 2**57-slot table (3/4 load), whose
# byte size (x 36) and every intermediate of reserve() stay below 2**63.
MAX_KEYS = 1 << 55
cdef Py_ssize_t _MAX_KEYS = MAX_KEYS

GROUP_ID_DTYPE = cnp.PyArray_DescrFromType(GROUP_ID_NPY)
TOKEN_DTYPE = cnp.PyArray_DescrFromType(TOKEN_NPY)

# spec kinds (hmacore.spec.GroupKind values)
cdef enum:
    K_FULL = 0
    K_SLIDING = 1
    K_CHUNKED = 2
    K_MAMBA = 3

# One row of the ``specs`` table (an (S, 8) C-contiguous int64 array): the kernels read it
# through this struct (eight int64 fields, no padding: checked at import).
# (SpecRow is declared in _hits.pxd: kind, block_size, window, chunk, eagle, member_start,
# member_end, fine_lookup; GroupKind value, tokens, 1 = drop the last matched block, the
# spec's members[member_start:member_end], 1 = sub-block lookups supported)
SPEC_COLUMNS = ("kind", "block_size", "window", "chunk", "eagle", "member_start",
                "member_end", "fine_lookup")
cdef enum:
    NCOLS = 8
if sizeof(SpecRow) != NCOLS * sizeof(int64_t) or len(SPEC_COLUMNS) != NCOLS:
    raise ImportError("hmacore._fast._hits: SpecRow does not match the specs table")
SPEC_EAGLE_COLUMN = SPEC_COLUMNS.index("eagle")
MAX_SPEC_GROUPS = 256
# Block sizes, windows, chunks and the alignment are bounded so that every product the
# kernel forms (rows x tokens per row, blocks x block size) stays below 2**63.
MAX_SPEC_TOKENS = 1 << 32


cdef inline uint64_t _mix(uint64_t x) noexcept nogil:
    x ^= x >> 30
    x *= <uint64_t>0xbf58476d1ce4e5b9
    x ^= x >> 27
    x *= <uint64_t>0x94d049bb133111eb
    x ^= x >> 31
    return x


cdef inline uint64_t _rotl(uint64_t x, int r) noexcept nogil:
    return (x << r) | (x >> (64 - r))


cdef inline uint64_t _key_hash(group_id_t group, const uint8_t* d, int ds) noexcept nogil:
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


cdef enum KeyOp:
    KEY_HAS = 0
    KEY_DROP = 1
    KEY_PUT = 2


cdef int _one_key(ExistenceSet es, group, digest, KeyOp op) except -2:
    """One key under the set's lock, arguments checked first: has / drop (1 or 0) or put
    (1 new, 0 present, -1 out of memory)."""
    cdef group_id_t g = _check_group(group)
    cdef bytes b = _check_digest(digest, es.digest_size)
    cdef const uint8_t* p = <const uint8_t*><char*>b
    cdef int r
    with nogil:
        es.lock()
        if op == KEY_PUT:
            r = es.put(g, p)
        elif op == KEY_DROP:
            r = es.drop(g, p)
        else:
            r = es.has(g, p)
        es.unlock()
    return r


cdef class ExistenceSet:
    """Set of (group id, block hash) keys with bulk, allocation-free membership.

    ``digest_size`` is 16 (xxh3-128) or 32 (sha256) bytes; every key of one set has it.
    Group ids are ints in [0, 2**31-1]. Memory: ``capacity * (4 + digest_size)`` bytes
    (see ``nbytes``); the table doubles when it would pass 3/4 full, so a key costs
    between 1.33x and 2.67x its 20 or 36 slot bytes (measured: 72 B/key for 32-byte
    digests at 50% load, 36-72 B/key for 16-byte ones). At most ``MAX_KEYS`` (2**55) keys.

    Threads: thread-safe. Every operation takes the set's lock with the GIL released, so
    bulk loops and the hit kernel run without the GIL while other threads keep running (and
    never see a table being resized); one set may be shared by any number of threads.

    ``__init__`` runs once (a second call raises RuntimeError: it would change the slot size
    under a live table). Picklable; ``copy.copy`` / ``deepcopy`` give independent sets.
    """

    def __cinit__(self, *args, **kwargs):
        # A valid empty 32-byte set even if __init__ never runs (ExistenceSet.__new__).
        self._slots = NULL
        self._cap = 0
        self._size = 0
        self._used = 0
        self.digest_size = 32
        self._slot_size = 4 + 32
        self._initialised = False
        self._lock = PyThread_allocate_lock()
        if self._lock == NULL:
            raise MemoryError("ExistenceSet: cannot allocate a lock")

    def __init__(self, digest_size=32, capacity=0):
        if self._initialised:
            raise RuntimeError("ExistenceSet is already initialised: __init__ runs once "
                               "(it would change the slot size under the live table); "
                               "build a new set instead")
        # checked here, not by a C-typed argument (that raises a bare TypeError for "32" and
        # OverflowError for 2**70)
        if isinstance(digest_size, bool) or not isinstance(digest_size, (int, np.integer)) \
                or digest_size not in (16, 32):
            raise HashInputError(f"digest_size must be 16 or 32 bytes, got {digest_size!r}")
        if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)):
            raise HashInputError(f"capacity must be an int (keys), got {type(capacity).__name__}")
        if capacity < 0:
            raise HashInputError(f"capacity must be >= 0 keys, got {capacity}")
        if capacity > MAX_KEYS:
            raise HashInputError(f"capacity must be <= 2**55 keys (MAX_KEYS), got {capacity}")
        cdef Py_ssize_t cap = capacity
        cdef int rc = 0, ds = digest_size
        if cap:
            with nogil:
                self.lock()
                self.digest_size = ds
                self._slot_size = 4 + ds
                rc = self.reserve(cap)
                self.unlock()
        else:
            self.digest_size = ds
            self._slot_size = 4 + ds
        self._initialised = True
        if rc < 0:
            raise MemoryError("ExistenceSet: cannot allocate the table")

    def __reduce__(self):
        return _existence_set_from_slots, (self.digest_size, self._live_slots())

    def __repr__(self):
        return (f"ExistenceSet(digest_size={self.digest_size}, keys={self._size}, "
                f"capacity={self._cap})")

    cdef bytes _live_slots(self):
        # Every live slot (group tag + digest), concatenated (pickling).
        cdef Py_ssize_t i, k = 0
        cdef group_id_t tag
        cdef bytearray out
        self.lock()
        try:
            out = bytearray(self._size * self._slot_size)
            for i in range(self._cap):
                memcpy(&tag, self._slots + i * self._slot_size, 4)
                if tag >= 0 and k < self._size:
                    memcpy(<char*>out + k * self._slot_size, self._slots + i * self._slot_size,
                           self._slot_size)
                    k += 1
        finally:
            self.unlock()
        return bytes(out)

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
    # Invariants (under the lock): _cap is 0 or a power of two >= MIN_CAP; every probe
    # sequence ends on an empty slot because _used (live + tombstones) stays <= 3/4 _cap
    # (reserve() runs before every insert), so the linear probes below terminate.
    cdef int _rehash(self, Py_ssize_t new_cap) noexcept nogil:
        cdef uint8_t* fresh = <uint8_t*>malloc(new_cap * self._slot_size)
        cdef Py_ssize_t i, j, mask = new_cap - 1
        cdef group_id_t tag
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
                if tag == SLOT_EMPTY:
                    break
                j = (j + 1) & mask
            memcpy(fresh + j * self._slot_size, src, self._slot_size)
        if self._slots != NULL:
            free(self._slots)
        self._slots = fresh
        self._cap = new_cap
        self._used = self._size
        return 0

    cdef inline bint fits(self, Py_ssize_t extra) noexcept nogil:
        """``extra`` more keys fit without a rehash (3/4 load, tombstones included)."""
        return self._cap > 0 and (self._used + extra) * 4 <= self._cap * 3

    cdef int reserve(self, Py_ssize_t extra) noexcept nogil:
        """Make room for ``extra`` more keys without passing 3/4 load; -1 if out of memory
        or past MAX_KEYS (every product below then stays far from overflow)."""
        cdef Py_ssize_t cap
        if extra < 0 or extra > _MAX_KEYS - self._size:
            return -1
        if self.fits(extra):
            return 0
        cap = MIN_CAP
        while cap * 3 < (self._size + extra) * 4 + 4:    # terminates: cap <= 2**58
            cap *= 2
        if cap < self._cap:
            cap = self._cap      # only tombstones to clear: rehash at the same size
        return self._rehash(cap)

    cdef inline Py_ssize_t probe(self, group_id_t group, const uint8_t* digest,
                                 Py_ssize_t* insert_at) noexcept nogil:
        """The one linear probe of has / put / drop (``_slots.probe_slots``). Requires
        ``_cap > 0``."""
        return probe_slots(self._slots, self._cap, self._slot_size, self.digest_size, group,
                           digest, _key_hash(group, digest, self.digest_size), insert_at)

    cdef bint has(self, group_id_t group, const uint8_t* digest) noexcept nogil:
        return self._size != 0 and self.probe(group, digest, NULL) >= 0

    cdef int put(self, group_id_t group, const uint8_t* digest) noexcept nogil:
        """1 if added, 0 if already present, -1 if out of memory."""
        cdef Py_ssize_t at = -1
        cdef group_id_t tag
        cdef uint8_t* slot
        if self.reserve(1) < 0:
            return -1
        if self.probe(group, digest, &at) >= 0:
            return 0
        slot = self._slots + at * self._slot_size
        memcpy(&tag, slot, 4)
        if tag == SLOT_EMPTY:          # a reused tombstone was already counted in _used
            self._used += 1
        memcpy(slot, &group, 4)
        memcpy(slot + 4, digest, self.digest_size)
        self._size += 1
        return 1

    cdef bint drop(self, group_id_t group, const uint8_t* digest) noexcept nogil:
        cdef Py_ssize_t j
        cdef group_id_t tag = SLOT_DELETED
        if self._size == 0:
            return False
        j = self.probe(group, digest, NULL)
        if j < 0:
            return False
        memcpy(self._slots + j * self._slot_size, &tag, 4)
        self._size -= 1
        return True

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
        cdef int rc = _one_key(self, group, digest, KEY_PUT)
        if rc < 0:
            raise MemoryError("ExistenceSet: cannot grow the table")
        return rc == 1

    def discard(self, group, digest):
        """Remove key (group, digest) if present; True if it was there."""
        return _one_key(self, group, digest, KEY_DROP) == 1

    def contains(self, group, digest):
        """True if key (group, digest) is in the set."""
        return _one_key(self, group, digest, KEY_HAS) == 1

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
        cdef group_id_t g = _check_group(group)
        _check_digests(digests, self.digest_size)
        cdef const uint8_t[:, ::1] d = digests
        cdef Py_ssize_t i, n = d.shape[0], added = 0, need
        cdef int rc = 0
        if n == 0:
            return 0
        with nogil:
            self.lock()
            # Grow once for the keys that are really new: when n more keys would need a
            # rehash, count the absent rows first (re-adding present keys never grows).
            need = n
            if not self.fits(n):
                need = 0
                for i in range(n):
                    need += not self.has(g, &d[i, 0])
            rc = self.reserve(need)
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
        cdef group_id_t g = _check_group(group)
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
        cdef group_id_t g = _check_group(group)
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
        cdef group_id_t g = _check_group(group)
        _check_digests(digests, self.digest_size)
        cdef const uint8_t[:, ::1] d = digests
        cdef Py_ssize_t i = 0, n = d.shape[0]
        with nogil:
            self.lock()
            while i < n and self.has(g, &d[i, 0]):
                i += 1
            self.unlock()
        return i


def _existence_set_from_slots(int digest_size, bytes slots):
    """Unpickle an ExistenceSet: ``slots`` = its live slots (group tag + digest) concatenated."""
    cdef ExistenceSet es = ExistenceSet(digest_size)
    cdef Py_ssize_t i, n, ss = 4 + digest_size
    cdef const uint8_t* p = <const uint8_t*><char*>slots
    cdef group_id_t tag
    cdef int rc = 0
    if len(slots) % ss:
        raise HashInputError("pickled ExistenceSet: slot data has a partial slot")
    n = len(slots) // ss
    with nogil:
        es.lock()
        rc = es.reserve(n)
        i = 0
        while rc >= 0 and i < n:
            memcpy(&tag, p + i * ss, 4)
            if tag < 0:
                rc = -2
                break
            rc = es.put(tag, p + i * ss + 4)
            i += 1
        es.unlock()
    if rc == -2:
        raise HashInputError("pickled ExistenceSet: a slot has no group id")
    if rc < 0:
        raise MemoryError("ExistenceSet: cannot allocate the table")
    return es


# ---------------------------------------------------------------------------------------
# Longest hit
# ---------------------------------------------------------------------------------------
cdef struct Ctx:
    const uint8_t* hashes      # N rows of ds bytes (array form), or NULL
    PyObject** items           # the N bytes objects of a list (list form), or NULL
    Py_ssize_t bad_row         # list form: the first probed row that is not ds bytes, or -1
    Py_ssize_t n_rows          # < 2**40 (memory), so n_rows * hash_block < 2**63 (hash_block <= 2**32)
    int ds
    const group_id_t* members
    token_t hash_block
    bint all_present           # mask mode: every probe hits (no set)
    # engine-mask mode (routing, ``hit_over_masks``): presence of key (group, row) for one
    # engine is bit ``bit`` of word ``word`` of the key's engine mask; memo[group * n_rows
    # + row] caches the mask pointer (NULL: not looked up yet, then ``fill`` looks it up)
    const uint64_t** memo
    mask_fill_t fill
    void* fill_state
    Py_ssize_t word
    uint64_t bit


cdef inline bint _probe(ExistenceSet es, Ctx* c, int64_t ms, int64_t me,
                        Py_ssize_t row) noexcept nogil:
    """All member groups [ms, me) hold the key of hash row ``row``."""
    cdef int64_t m
    cdef PyObject* o
    cdef const uint64_t* mask
    cdef Py_ssize_t at
    if c.memo != NULL:
        for m in range(ms, me):
            at = c.members[m] * c.n_rows + row
            mask = c.memo[at]
            if mask == NULL:
                mask = c.fill(c.fill_state, c.members[m], row)
                c.memo[at] = mask
            if not (mask[c.word] & c.bit):
                return False
        return True
    if c.all_present:
        return True
    cdef const uint8_t* d
    if c.items != NULL:
        # list form: read the probed row's bytes in place (no conversion of the other rows);
        # a row that is not exactly ds bytes is a miss here and an error for the caller
        o = c.items[row]
        if not PyBytes_CheckExact(o) or PyBytes_GET_SIZE(o) != c.ds:
            if c.bad_row < 0 or row < c.bad_row:
                c.bad_row = row
            return False
        d = <const uint8_t*>PyBytes_AS_STRING(o)
    else:
        d = c.hashes + row * c.ds
    for m in range(ms, me):
        if not es.has(c.members[m], d):
            return False
    return True


cdef inline token_t _cdiv(token_t a, token_t b) noexcept nogil:
    # a >= 0, b > 0 (cdivision is on: C division truncates, so no -(-a // b) trick);
    # a // b + (a % b != 0) cannot overflow where (a + b - 1) // b could.
    return a // b + (1 if a % b else 0)


cdef token_t _find(ExistenceSet es, Ctx* c, const SpecRow* sp, token_t max_length,
                   bint drop_eagle, token_t align, token_t* out_len,
                   token_t* out_lo) noexcept nogil:
    """One spec group's ``find_longest_cache_hit``: writes the hit list length (blocks,
    nulls included) and the first non-null index; returns the hit in tokens.

    Contract: 0 <= max_length < 2**63; bs, align, hash_block in [1, 2**32] with h | bs and
    h | align (validated when the kernel is built). Every loop index is bounded by the
    row count (maxb <= n_coarse, maxp <= n_rows), so each scan terminates and every
    product (index x tokens per row/block) stays below n_rows * 2**32 < 2**63.
    """
    cdef token_t kind = sp.kind, bs = sp.block_size
    cdef int64_t ms = sp.member_start, me = sp.member_end
    cdef token_t h = c.hash_block
    cdef token_t k = bs // h                       # hash rows per block
    cdef token_t n_coarse = c.n_rows // k
    cdef token_t maxb = max_length // bs
    cdef token_t n, i, j, hit, L, lo, run, need, post, sf, first, maxp, start, chunk
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
        need = _cdiv(sp.window - 1, bs) + (1 if drop_eagle else 0)
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
        chunk = sp.chunk
        # the current chunk of min(max_length, the tokens the rows cover): the null run
        # before it must stay inside the rows too (max_length = 2**63 - 1 with 2 rows gave a
        # hit of 2**63 - 16 tokens). vLLM's max_length (num_tokens - 1, rows = full blocks)
        # never has a chunk boundary between the two, so its answers are unchanged.
        start = c.n_rows * h
        if max_length < start:
            start = max_length
        start = (start // chunk) * chunk if start > 0 else 0
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


cdef _check_layout_tables(object specs, object members, long long hash_block,
                          long long align):
    """Validate the layout constants of the kernel (raise HashInputError naming the rule)."""
    if not isinstance(specs, np.ndarray) or specs.dtype != np.int64 or specs.ndim != 2 \
            or specs.shape[1] != NCOLS or not specs.flags.c_contiguous:
        raise HashInputError(f"specs must be a C-contiguous int64 array of shape (S, {NCOLS})")
    if not isinstance(members, np.ndarray) or members.dtype != GROUP_ID_DTYPE \
            or members.ndim != 1 or not members.flags.c_contiguous:
        raise HashInputError("members must be a C-contiguous int32 array")
    if hash_block <= 0 or align <= 0 or align % hash_block:
        raise HashInputError("hash_block must be > 0 and align a positive multiple of it")
    if align > MAX_SPEC_TOKENS:
        raise HashInputError(f"the hit alignment ({align} tokens) must be <= 2**32 tokens")
    cdef Py_ssize_t S = specs.shape[0], s
    cdef int64_t nm = members.shape[0]
    if S > MAX_SPEC_GROUPS:
        raise HashInputError(f"specs: at most {MAX_SPEC_GROUPS} spec groups, got {S}")
    cdef const int64_t[:, ::1] tbl = specs
    cdef const group_id_t[::1] mem = members
    cdef const SpecRow* row
    for s in range(S):
        row = <const SpecRow*>&tbl[s, 0]
        if not (0 <= row.kind <= 3) or row.block_size <= 0 or row.block_size % hash_block \
                or not (0 <= row.member_start < row.member_end <= nm):
            raise HashInputError(f"specs row {s} is malformed")
        if row.block_size > MAX_SPEC_TOKENS:
            raise HashInputError(f"specs row {s}: block size {row.block_size} must be <= "
                                 "2**32 tokens")
        if row.kind == K_SLIDING and not 0 < row.window <= TOKEN_MAX // 2:
            raise HashInputError(f"specs row {s}: sliding window must be > 0 (and < 2**62)")
        if row.kind == K_CHUNKED and row.chunk <= 0:
            raise HashInputError(f"specs row {s}: chunk must be > 0")
    for s in range(nm):
        if mem[s] < 0:
            raise HashInputError("members must be group ids >= 0")


def longest_hit(ExistenceSet es, hashes, max_length, specs, members,
                long long hash_block, long long align, bint partial, bint unitary,
                out):
    """vLLM's longest cache hit over ``es``; returns the hit in tokens.

    Args:
        es: the existence set (keys: group id, hash row bytes), or None for mask mode:
            every probe hits (used to derive load masks for a known hit length).
        hashes: (N, es.digest_size) uint8, C-contiguous: the request's hash rows, row j
            naming tokens [0, (j+1)*hash_block). Block i of a group with block size bs is
            row (i+1)*bs/hash_block - 1 (the last row inside it).
        max_length: cap of the hit, tokens (0 <= max_length < 2**63).
        specs: (S, 8) int64 spec groups in lookup order (see SPEC_COLUMNS / SpecRow).
        members: int32 group ids; spec s owns members[member_start:member_end].
        hash_block: tokens per hash row. align: hit alignment in tokens (<= 2**32).
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
    _check_layout_tables(specs, members, hash_block, align)
    if not isinstance(out, np.ndarray) or out.dtype != np.int64 or out.shape != (specs.shape[0], 2) \
            or not out.flags.c_contiguous or not out.flags.writeable:
        raise HashInputError("out must be a writable C-contiguous int64 array of shape (S, 2)")
    cdef token_t ml = _check_max_length(max_length)
    cdef const int64_t[:, ::1] sp = specs
    cdef const group_id_t[::1] mem = members
    cdef int64_t[:, ::1] o = out
    cdef Py_ssize_t S = sp.shape[0]
    cdef int64_t nm = mem.shape[0]
    if S == 0:
        return 0
    cdef const uint8_t[:, ::1] hv = hashes
    cdef Ctx c
    c.memo = NULL
    c.n_rows = hv.shape[0]
    c.ds = hv.shape[1]
    c.all_present = es is None
    c.hashes = &hv[0, 0] if c.n_rows > 0 else NULL
    c.items = NULL
    c.bad_row = -1
    c.members = &mem[0] if nm > 0 else NULL
    c.hash_block = hash_block
    cdef token_t hit
    with nogil:
        if es is not None:
            es.lock()
        hit = _fixed_point(es, &c, <const SpecRow*>&sp[0, 0], S, ml, align, partial,
                           unitary, &o[0, 0])
        if es is not None:
            es.unlock()
    return hit


cdef token_t _check_max_length(object max_length) except -1:
    """``max_length`` as a token count in ``[0, 2**63)`` or HashInputError (one C call for
    an exact int: no Python comparison objects on the per-lookup path)."""
    cdef int overflow = 0
    cdef long long v
    if type(max_length) is not int:
        if isinstance(max_length, bool) or not isinstance(max_length, (int, np.integer)):
            raise HashInputError(f"max_length must be an int (tokens), got "
                                 f"{type(max_length).__name__}")
        max_length = int(max_length)
    v = PyLong_AsLongLongAndOverflow(max_length, &overflow)
    if overflow < 0 or (overflow == 0 and v < 0):
        raise HashInputError(f"max_length must be >= 0 tokens, got {max_length}")
    if overflow > 0:
        raise HashInputError(f"max_length must be < 2**63 tokens, got {max_length}")
    return v


cdef token_t _fixed_point(ExistenceSet es, Ctx* c, const SpecRow* sp, Py_ssize_t S,
                          token_t max_length, token_t align, bint partial,
                          bint unitary, int64_t* out) noexcept nogil:
    """vLLM's HybridKVCacheCoordinator fixed point over the S spec groups.

    Terminates: ``hit`` starts at max_length and each round either ends (no group lowered
    the candidate) or strictly lowers it (``curr < hit``), and hits are >= 0. The eagle
    margin is added with saturation (max_length may be 2**63 - 1) and capped by the rows.
    """
    cdef token_t L, lo, new, curr, hit, ml, margin, bs
    cdef Py_ssize_t s
    cdef const SpecRow* row
    cdef bint drop, simple
    cdef uint8_t done_fa[256]
    cdef uint8_t verified[256]
    cdef token_t fa_len[256]
    if unitary:
        row = sp
        hit = _find(es, c, row, max_length, row.eagle != 0, align, &L, &lo)
        out[0] = L
        out[1] = lo
        return hit
    memset(done_fa, 0, sizeof(done_fa))
    memset(verified, 0, sizeof(verified))
    simple = S == 2 and sp[0].kind == K_FULL
    hit = max_length
    while True:
        curr = hit
        for s in range(S):
            row = sp + s
            if row.kind == K_FULL and done_fa[s]:
                if fa_len[s] < curr:
                    curr = fa_len[s]
                continue
            drop = row.eagle != 0 and not verified[s]
            ml = curr
            bs = row.block_size
            if drop and row.kind != K_MAMBA:
                margin = bs
                if partial and row.fine_lookup != 0 and bs > c.hash_block:
                    margin = c.hash_block
                ml = sat_add(curr, margin)
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
            if row.kind == K_FULL:
                done_fa[s] = 1
                fa_len[s] = new
        if curr >= hit:
            break
        hit = curr
        if simple:
            break
    for s in range(S):
        row = sp + s
        if row.kind == K_FULL:
            L = _cdiv(hit, row.block_size)
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

    Threads: immutable after construction (private read-only copies of the tables, no
    scratch buffer: every call writes a fresh result), so one kernel may be used by any
    number of threads at once. Picklable.
    """
    cdef object _specs, _specs_no_eagle, _members, _args
    cdef const SpecRow* _sp
    cdef const SpecRow* _sp_ne
    cdef const group_id_t* _mem
    cdef Py_ssize_t S
    cdef long long nm, hash_block, align
    cdef bint partial, unitary

    def __init__(self, specs, members, long long hash_block, long long align, bint partial,
                 bint unitary):
        if self._args is not None:
            raise RuntimeError("HitKernel is already initialised: __init__ runs once")
        _check_layout_tables(specs, members, hash_block, align)
        self._specs = np.array(specs, dtype=np.int64, order="C", copy=True)
        self._specs_no_eagle = self._specs.copy()
        self._specs_no_eagle[:, SPEC_EAGLE_COLUMN] = 0
        self._members = np.array(members, dtype=GROUP_ID_DTYPE, order="C", copy=True)
        self._specs.flags.writeable = False
        self._specs_no_eagle.flags.writeable = False
        self._members.flags.writeable = False
        self.S = self._specs.shape[0]
        self.nm = self._members.shape[0]
        self._sp = <const SpecRow*>cnp.PyArray_DATA(<cnp.ndarray>self._specs)
        self._sp_ne = <const SpecRow*>cnp.PyArray_DATA(<cnp.ndarray>self._specs_no_eagle)
        self._mem = <const group_id_t*>cnp.PyArray_DATA(<cnp.ndarray>self._members)
        self.hash_block = hash_block
        self.align = align
        self.partial = partial
        self.unitary = unitary
        self._args = (self._specs, self._members, hash_block, align, partial, unitary)

    def __reduce__(self):
        return HitKernel, self._args

    def __repr__(self):
        return (f"HitKernel(spec_groups={self.S}, hash_block={self.hash_block}, "
                f"align={self.align}, partial={self.partial}, unitary={self.unitary})")

    @property
    def num_spec_groups(self):
        return self.S

    def run(self, exists, hashes, max_length, bint apply_eagle=True):
        """(tokens, spans) of the longest hit; see :meth:`hmacore.hits.HitFinder.longest_hit`
        for the arguments (``exists`` None = mask mode). Raises HashInputError naming the
        argument on bad input, before any work."""
        cdef ExistenceSet es
        if self._args is None:
            raise RuntimeError("HitKernel was not initialised")
        cdef bint rows_list = PyList_CheckExact(hashes)
        if exists is None:
            es = None
            if rows_list:
                raise HashInputError("hashes must be a uint8 array of shape (N, 16) or (N, 32) "
                                     "in mask mode (exists=None)")
            if not _is_hash_array(hashes, 0):
                if isinstance(hashes, np.ndarray) and hashes.ndim == 2 \
                        and hashes.shape[1] in (16, 32):
                    _check_digests(hashes, hashes.shape[1], "hashes")
                raise HashInputError("hashes must be a uint8 array of shape (N, 16) or (N, 32)")
        elif type(exists) is ExistenceSet:
            es = <ExistenceSet>exists
            if not rows_list and not _is_hash_array(hashes, es.digest_size):
                _check_digests(hashes, es.digest_size, "hashes")
        else:
            raise HashInputError(f"exists must be an ExistenceSet or None, got "
                                 f"{type(exists).__name__}")
        cdef token_t ml = _check_max_length(max_length)
        cdef cnp.npy_intp dims[2]
        dims[0] = self.S
        dims[1] = 2
        out = cnp.PyArray_ZEROS(2, dims, cnp.NPY_INT64, 0)
        cdef int64_t* o = <int64_t*>cnp.PyArray_DATA(<cnp.ndarray>out)
        if self.S == 0:
            return 0, out
        cdef Ctx c
        cdef cnp.ndarray hv
        c.memo = NULL
        c.all_present = es is None
        c.members = self._mem
        c.hash_block = self.hash_block
        c.bad_row = -1
        cdef const SpecRow* sp = self._sp if apply_eagle else self._sp_ne
        cdef token_t hit
        if rows_list:
            # vLLM's Request.block_hashes as it is: each probed row is read in place. The
            # set's lock is taken without the GIL (a holder may need the GIL to finish); the
            # list is measured after it, and the GIL is then held until the kernel is done,
            # so no thread can change the list while the kernel reads it.
            with nogil:
                es.lock()
            c.n_rows = len(hashes)
            c.ds = es.digest_size
            c.hashes = NULL
            c.items = PySequence_Fast_ITEMS(hashes) if c.n_rows > 0 else NULL
            hit = _fixed_point(es, &c, sp, self.S, ml, self.align, self.partial,
                               self.unitary, o)
            es.unlock()
            if c.bad_row >= 0:
                raise HashInputError(f"hashes[{c.bad_row}] must be {c.ds} bytes (a bytes "
                                     f"object), got {type(hashes[c.bad_row]).__name__}")
            return hit, out
        hv = <cnp.ndarray>hashes
        c.n_rows = hv.shape[0]
        c.ds = hv.shape[1]
        c.items = NULL
        c.hashes = <const uint8_t*>cnp.PyArray_DATA(hv) if c.n_rows > 0 else NULL
        with nogil:
            if es is not None:
                es.lock()
            hit = _fixed_point(es, &c, sp, self.S, ml, self.align, self.partial,
                               self.unitary, o)
            if es is not None:
                es.unlock()
        return hit, out


# ---------------------------------------------------------------------------------------
# Engine-mask mode: one kernel's rule for one engine over a shared key -> engine-mask table
# ---------------------------------------------------------------------------------------
cdef int kernel_tables(object kernel, KernelTables* out) except -1:
    """``out`` = the validated constants of a HitKernel (pointers into its private read-only
    arrays: valid while the caller holds a reference to the kernel)."""
    if type(kernel) is not HitKernel or (<HitKernel>kernel)._args is None:
        raise HashInputError("kernel must be an initialised HitKernel")
    cdef HitKernel k = <HitKernel>kernel
    out.sp = k._sp
    out.S = k.S
    out.members = k._mem
    out.num_members = k.nm
    out.hash_block = k.hash_block
    out.align = k.align
    out.partial = k.partial
    out.unitary = k.unitary
    return 0


cdef token_t hit_over_masks(const KernelTables* k, Py_ssize_t n_rows, token_t max_length,
                            const uint64_t** memo, mask_fill_t fill, void* fill_state,
                            Py_ssize_t word, uint64_t bit, int64_t* out) noexcept nogil:
    """The hit of the engine owning mask bit (word, bit): the same rule and fixed point as
    ``longest_hit``, each probe answered from the memo (one table lookup per (group, row)
    for all engines). ``memo`` has (max group id + 1) * n_rows entries; ``out`` S * 2."""
    cdef Ctx c
    if k.S == 0:
        return 0
    c.memo = memo
    c.fill = fill
    c.fill_state = fill_state
    c.word = word
    c.bit = bit
    c.hashes = NULL
    c.items = NULL
    c.bad_row = -1
    c.n_rows = n_rows
    c.ds = 0
    c.members = k.members
    c.hash_block = k.hash_block
    c.all_present = False
    return _fixed_point(None, &c, k.sp, k.S, max_length, k.align, k.partial, k.unitary, out)
