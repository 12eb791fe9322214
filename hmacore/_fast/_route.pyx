"""Engines' counted (group, hash) residency in one shared table, and the routing query.

vLLM's prefix cache maps a (group, hash) key to a *set* of blocks (two requests that compute
the same block before either is cached both insert it), and emits one ``BlockStored`` hash
per insertion and one ``BlockRemoved`` hash per removal. A key is resident on an engine while
its count there is positive.

``SharedResidency`` keeps every engine's residency in one open-addressing table. A slot is
the key's engine mask (``words`` uint64 words, bit b = engine b holds the key at count >= 1),
then a 4-byte tag (group id, -1 empty, -2 deleted) and the key (8 bytes: a 64-bit event hash,
big-endian; or a 16/32-byte digest), padded to 8 bytes: one probe reads tag, key and mask
from the same cache line. The tags and keys are probed by ``_slots.probe_slots`` (shared with
ExistenceSet) from the base ``slots + 8 * words``. A slot lives while some engine holds the
key; a deleted slot followed by an empty one becomes empty (with the tombstones before it),
so remove-heavy streams do not fill the table with tombstones. Counts above 1 are rare; per
engine they are nested layers of ``ExistenceSet`` (a key of count c is in duplicate layers
0..c-2; 8-byte keys are kept there as 16 bytes, 8 zero bytes first).

Events: a batch's key hashes are computed first, then the rows are applied in order with
the home slot of a row a few rows ahead prefetched (the table is far larger than the cache
for a fleet's residency; past 1 MiB also the line ending the next slot, where a straddling
slot's tail or the probe's second slot is). A query probes the table once per (group, hash row) its rule
reaches, for all engines at once: the probes are memoised per query (``hit_over_masks`` in
_hits.pyx runs vLLM's rule for each engine over the memo); ``route`` reads the query's
digests in place (the last 8 bytes for 8-byte keys) and builds the per-engine result.

Rows are applied in order: op 1 stores (count + 1), op -1 removes (count - 1, a no-op at 0),
op 0 clears the engine (``AllBlocksCleared``). The caller validated ops, groups and digests.
Not thread-safe by itself: RoutingIndex serialises every call with its lock.
"""
cimport cython
from cpython.ref cimport PyObject
from libc.stdint cimport int8_t, int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free, malloc, realloc
from libc.string cimport memcmp, memcpy, memset

cimport numpy as cnp
import numpy as np

from hmacore._fast._hits cimport (ExistenceSet, KernelTables, hit_over_masks, kernel_tables,
                                  mask_fill_t)
from hmacore._fast._slots cimport SLOT_DELETED, SLOT_EMPTY, probe_slots
from hmacore._fast._types cimport group_id_t, token_t

cnp.import_array()

from hmacore.errors import (ArgumentTypeError, ArgumentValueError, ConfigError,
                            HashInputError, HmacoreError)

cdef extern from *:
    """
    #if defined(__GNUC__) || defined(__clang__)
    #define HMACORE_PREFETCH(p) __builtin_prefetch((p), 1, 3)
    #else
    #define HMACORE_PREFETCH(p) ((void)(p))
    #endif
    """
    void prefetch "HMACORE_PREFETCH"(const void* p) noexcept nogil

cdef extern from *:
    """
    /* An exact int's value without an exception: 0 and *out on success, -1 if it does not
       fit (negative / past 2**64 - 1; past a long). CPython 3.11's (and earlier) digit
       layout is read directly (PyLong_AsUnsignedLongLong goes through _PyLong_AsByteArray
       there, half the cost of a batch); other versions call the API. */
    #if PY_VERSION_HEX < 0x030C0000 && !defined(PYPY_VERSION) && PyLong_SHIFT == 30
    static inline int hmacore_as_u64(PyObject* x, unsigned long long* out) {
        Py_ssize_t size = Py_SIZE(x);
        const digit* d = ((PyLongObject*)x)->ob_digit;
        switch (size) {
        case 0: *out = 0; return 0;
        case 1: *out = d[0]; return 0;
        case 2: *out = (unsigned long long)d[0] | ((unsigned long long)d[1] << 30); return 0;
        case 3:
            if (d[2] >> 4) return -1;
            *out = (unsigned long long)d[0] | ((unsigned long long)d[1] << 30)
                   | ((unsigned long long)d[2] << 60);
            return 0;
        default: return -1;
        }
    }
    static inline int hmacore_as_long(PyObject* x, long* out) {
        Py_ssize_t size = Py_SIZE(x);
        const digit* d = ((PyLongObject*)x)->ob_digit;
        if (size == 0) { *out = 0; return 0; }
        if (size == 1) { *out = (long)d[0]; return 0; }
        if (size == -1) { *out = -(long)d[0]; return 0; }
        return -1;    /* |x| >= 2**30: no group id or op */
    }
    #else
    static inline int hmacore_as_u64(PyObject* x, unsigned long long* out) {
        unsigned long long v = PyLong_AsUnsignedLongLong(x);
        if (v == (unsigned long long)-1 && PyErr_Occurred()) { PyErr_Clear(); return -1; }
        *out = v;
        return 0;
    }
    static inline int hmacore_as_long(PyObject* x, long* out) {
        int overflow = 0;
        long v = PyLong_AsLongAndOverflow(x, &overflow);
        if (overflow || (v == -1 && PyErr_Occurred())) { PyErr_Clear(); return -1; }
        *out = v;
        return 0;
    }
    #endif
    """
    int as_u64 "hmacore_as_u64"(PyObject* x, unsigned long long* out) noexcept
    int as_long "hmacore_as_long"(PyObject* x, long* out) noexcept

cdef extern from *:
    """
    /* Two exact str objects with equal contents: length, kind and bytes (no hashing, no
       error path; PyUnicode_Compare is several times the cost per event). */
    static inline int hmacore_str_eq(PyObject* a, PyObject* b) {
        Py_ssize_t n;
        if (a == b) return 1;
    #if PY_VERSION_HEX < 0x030C0000
        if (!PyUnicode_IS_READY(a) || !PyUnicode_IS_READY(b)) {
            int r = PyUnicode_Compare(a, b);
            if (r == -1 && PyErr_Occurred()) PyErr_Clear();
            return r == 0;
        }
    #endif
        n = PyUnicode_GET_LENGTH(a);
        if (n != PyUnicode_GET_LENGTH(b) || PyUnicode_KIND(a) != PyUnicode_KIND(b)) return 0;
        n *= PyUnicode_KIND(a);
        if (n <= 16) {       /* a medium name: compared in line, not through a libc call */
            const unsigned char* x = (const unsigned char*)PyUnicode_DATA(a);
            const unsigned char* y = (const unsigned char*)PyUnicode_DATA(b);
            Py_ssize_t i;
            for (i = 0; i < n; i++) if (x[i] != y[i]) return 0;
            return 1;
        }
        return memcmp(PyUnicode_DATA(a), PyUnicode_DATA(b), (size_t)n) == 0;
    }
    #define hmacore_type_of(o) ((PyObject*)Py_TYPE(o))
    """
    int str_eq "hmacore_str_eq"(PyObject* a, PyObject* b) noexcept
    PyObject* type_of "hmacore_type_of"(PyObject* o) noexcept nogil
    PyObject* list_item "PyList_GET_ITEM"(PyObject* l, Py_ssize_t i) noexcept nogil
    Py_ssize_t list_size "PyList_GET_SIZE"(PyObject* l) noexcept nogil
    Py_ssize_t bytes_size "PyBytes_GET_SIZE"(PyObject* o) noexcept nogil
    char* bytes_data "PyBytes_AS_STRING"(PyObject* o) noexcept nogil

cdef extern from "structmember.h":
    ctypedef struct PyMemberDef:
        const char* name
        int type
        Py_ssize_t offset
        int flags
    ctypedef struct PyMemberDescrObject:
        PyMemberDef* d_member
    enum:
        T_OBJECT
        T_OBJECT_EX
        PY_AUDIT_READ

import types as _types

# event fields apply_events reads: per class, stored then removed
cdef enum:
    F_HASHES, F_MEDIUM, F_GROUP, F_KIND, F_LOOKAHEAD, N_FIELDS
_FIELD_NAMES = ("block_hashes", "medium", "group_idx", "kv_cache_spec_kind",
                "lookahead_token_ids")


cdef Py_ssize_t _member_offset(object cls, str name) except -2:
    """The instance offset of ``cls``'s object slot ``name`` (a member descriptor: msgspec
    Struct fields, ``__slots__``), read directly as the descriptor's ``__get__`` does; -1 when
    it is anything else (then read by ``getattr``)."""
    cdef PyMemberDef* m
    for base in cls.__mro__:
        d = base.__dict__.get(name)
        if d is None:
            continue
        if type(d) is not _types.MemberDescriptorType or not isinstance(d.__objclass__, type) \
                or not issubclass(cls, d.__objclass__):
            return -1
        m = (<PyMemberDescrObject*><PyObject*>d).d_member
        if (m.type != T_OBJECT and m.type != T_OBJECT_EX) or m.flags & PY_AUDIT_READ:
            return -1
        return m.offset
    return -1


cdef inline object _read_field(object ev, Py_ssize_t off, str name):
    """Field ``name`` of ``ev`` (exact type checked by the caller, ``off`` from
    ``_member_offset`` of that type)."""
    cdef PyObject* p
    if off < 0:
        # optional fields (vLLM 0.32 has no lookahead_token_ids) read as None when absent
        return getattr(ev, name, None) if name[0] in "kl" else getattr(ev, name)
    p = (<PyObject**>((<char*><PyObject*>ev) + off))[0]
    if p == NULL:
        raise AttributeError(name)
    return <object>p


cdef inline PyObject* _slot_field(PyObject* ev, Py_ssize_t off, str name) except NULL:
    """Field at object-slot offset ``off`` (>= 0) of ``ev``, borrowed: valid while ``ev`` is
    and the slot is not reassigned (no code runs between the read and its use)."""
    cdef PyObject* p = (<PyObject**>((<char*>ev) + off))[0]
    if p == NULL:
        raise AttributeError(name)
    return p


cdef Py_ssize_t MIN_CAP = 16
# 2**50 keys: every byte count below (slots x (24..48 + 8 x words)) stays below 2**63
cdef Py_ssize_t MAX_KEYS = 1 << 50
# engine bits: 2**16 engines (1024 mask words) at most
MAX_ENGINES = 1 << 16
cdef uint64_t ZERO_MASK[1024]
memset(ZERO_MASK, 0, sizeof(ZERO_MASK))
# rows ahead whose home slot an event batch prefetches (a power of two: a ring of hashes)
cdef enum:
    PREFETCH_AHEAD = 16
# table bytes above which an event batch prefetches two lines per row (the cache's share
# of the table: a second prefetch into a table that fits is only cost)
cdef Py_ssize_t PREFETCH2_BYTES = 1 << 20
# scratch rows apply_events keeps between calls (more are freed after the call unless they
# take no more bytes than the table)
cdef Py_ssize_t SCRATCH_KEEP = 1 << 16


cdef inline uint64_t _mix(uint64_t x) noexcept nogil:
    # splitmix64's finaliser: every input bit reaches every output bit
    x ^= x >> 30
    x *= 0xbf58476d1ce4e5b9ULL
    x ^= x >> 27
    x *= 0x94d049bb133111ebULL
    x ^= x >> 31
    return x


cdef inline uint64_t _key_hash(group_id_t g, const uint8_t* d, int ds) noexcept nogil:
    """Hash of (group, key): an 8-byte key whole, else the last 16 digest bytes, mixed with
    the group id. An 8-byte key is already a uniform hash (the tail of vLLM's sha256 / xxhash
    digest): one mixing round spreads the group into it (half the latency per event row)."""
    cdef uint64_t w0 = 0, w1
    if ds == 8:
        memcpy(&w1, d, 8)
        return _mix(w1 ^ (<uint64_t><uint32_t>g) * 0x9e3779b97f4a7c15ULL)
    else:
        memcpy(&w0, d + ds - 16, 8)
        memcpy(&w1, d + ds - 8, 8)
    return _mix(w1 ^ _mix(w0 ^ (<uint64_t><uint32_t>g) * 0x9e3779b97f4a7c15ULL))


cdef extern from *:
    """
    /* v's 8 bytes big-endian at out: one byte swap and store (the byte loop it replaces
       was not folded into one by the compiler: a third of a batch's packing). */
    static inline void hmacore_put_be64(unsigned char* out, unsigned long long v) {
    #if (defined(__GNUC__) || defined(__clang__)) && defined(__BYTE_ORDER__) \
            && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
        v = __builtin_bswap64(v);
        memcpy(out, &v, 8);
    #else
        int b;
        for (b = 0; b < 8; b++) out[7 - b] = (unsigned char)(v >> (8 * b));
    #endif
    }
    """
    void _put_be64 "hmacore_put_be64"(uint8_t* out, uint64_t v) noexcept nogil


cdef inline Py_ssize_t _slot_bytes(Py_ssize_t words, int ds) noexcept nogil:
    """Bytes of one slot: mask words, tag, key, padded to 8 (the masks stay aligned)."""
    return (8 * words + 4 + ds + 7) & ~(<Py_ssize_t>7)


cdef inline const uint8_t* _dup_key(int ds, const uint8_t* d, uint8_t* buf) noexcept nogil:
    """The key as the duplicate layers (ExistenceSet: 16 or 32 bytes) hold it."""
    if ds != 8:
        return d
    memset(buf, 0, 8)
    memcpy(buf + 8, d, 8)
    return buf


cdef struct FillState:
    const uint8_t* tags        # the table's tag base (slots + 8 * words)
    const uint8_t* hashes      # the query's key bytes of row 0
    Py_ssize_t stride          # bytes from one query row's key to the next
    Py_ssize_t cap, slot_size, mask_bytes, size
    int ds


cdef const uint64_t* _fill(void* state, group_id_t g, Py_ssize_t row) noexcept nogil:
    """The engine mask of key (g, query row ``row``), or a zero mask if no engine holds it."""
    cdef FillState* st = <FillState*>state
    cdef const uint8_t* d = st.hashes + row * st.stride
    cdef Py_ssize_t mask, j
    cdef group_id_t tag
    cdef const uint8_t* slot
    if st.size == 0:
        return ZERO_MASK
    mask = st.cap - 1
    j = <Py_ssize_t>(_key_hash(g, d, st.ds) & <uint64_t>mask)
    while True:
        slot = st.tags + j * st.slot_size
        memcpy(&tag, slot, 4)
        if tag == SLOT_EMPTY:
            return ZERO_MASK
        if tag == g and (memcmp(slot + 4, d, 8) == 0 if st.ds == 8
                         else memcmp(slot + 4, d, st.ds) == 0):
            return <const uint64_t*>(slot - st.mask_bytes)
        j = (j + 1) & mask


@cython.final
cdef class SharedResidency:
    """Every engine's counted (group, hash) residency: one key table with an engine mask per
    key (see the module docstring). Engines are mask bits from :meth:`add_engine`.
    ``digest_size``: 8 (64-bit event hashes, big-endian), 16 or 32 (digests)."""
    cdef readonly int digest_size
    cdef uint8_t* _slots           # _cap * _slot_size: [mask words][tag][key][pad]
    cdef Py_ssize_t _cap, _size, _used, _slot_size, _words
    cdef list _resident            # per bit: distinct keys held (count >= 1)
    cdef list _dups                # per bit: list of ExistenceSet (count >= 2, >= 3, ...)
    cdef list _live                # per bit: in use
    # apply_events' scratch rows (ops, groups, keys), reused across calls; _busy refuses a
    # re-entrant call while they are being filled
    cdef int8_t* _s_ops
    cdef int32_t* _s_groups
    cdef uint8_t* _s_keys
    cdef Py_ssize_t _s_cap
    cdef bint _busy
    cdef object _ev_types          # the event classes _ev_off was resolved for
    cdef Py_ssize_t _ev_off[2][N_FIELDS]
    cdef bint _ev_direct           # every field apply_events reads is an object slot
    cdef object _ev_refused        # the last refused_kinds tuple found well-formed
    cdef object _med_obj           # apply_payload: the last medium str and its UTF-8 bytes
    cdef bytes _med_bytes

    def __cinit__(self, int digest_size=16):
        if digest_size not in (8, 16, 32):
            raise ValueError(f"digest_size must be 8, 16 or 32 bytes, got {digest_size}")
        self.digest_size = digest_size
        self._words = 1
        self._slot_size = _slot_bytes(1, digest_size)
        self._slots = NULL
        self._cap = self._size = self._used = 0
        self._s_ops = NULL
        self._s_groups = NULL
        self._s_keys = NULL
        self._s_cap = 0
        self._busy = False
        self._ev_types = None
        self._ev_refused = None
        self._ev_direct = False
        self._resident = []
        self._dups = []
        self._live = []

    def __dealloc__(self):
        free(self._slots)
        self._free_scratch()

    cdef void _free_scratch(self) noexcept nogil:
        free(self._s_ops)
        free(self._s_groups)
        free(self._s_keys)
        self._s_ops = NULL
        self._s_groups = NULL
        self._s_keys = NULL
        self._s_cap = 0

    cdef Py_ssize_t _clear_row(self, Py_ssize_t n) except -1:
        """Scratch row ``n`` becomes an AllBlocksCleared row (op 0); the next row's index."""
        if self._grow_scratch(n + 1) < 0:
            raise MemoryError("KV events: no memory for the batch's rows")
        self._s_ops[n] = 0
        self._s_groups[n] = 0
        memset(self._s_keys + n * self.digest_size, 0, self.digest_size)
        return n + 1

    cdef int _grow_scratch(self, Py_ssize_t rows) noexcept nogil:
        """Room for ``rows`` scratch rows (contents kept); -1 if out of memory."""
        cdef Py_ssize_t cap = self._s_cap if self._s_cap else 64
        cdef void* p
        if rows <= self._s_cap:
            return 0
        while cap < rows:
            cap *= 2
        p = realloc(self._s_ops, cap)
        if p == NULL:
            return -1
        self._s_ops = <int8_t*>p
        p = realloc(self._s_groups, cap * 4)
        if p == NULL:
            return -1
        self._s_groups = <int32_t*>p
        p = realloc(self._s_keys, cap * self.digest_size)
        if p == NULL:
            return -1
        self._s_keys = <uint8_t*>p
        self._s_cap = cap       # only once all three hold cap rows
        return 0

    def __reduce__(self):
        raise TypeError("SharedResidency cannot be pickled (a raw table owned by one "
                        "RoutingIndex); rebuild the index from the engines' event streams")

    # -- table ---------------------------------------------------------------------------
    cdef inline uint8_t* _tags(self) noexcept nogil:
        return self._slots + 8 * self._words

    cdef inline uint64_t* _mask(self, Py_ssize_t j) noexcept nogil:
        return <uint64_t*>(self._slots + j * self._slot_size)

    cdef inline group_id_t _tag(self, Py_ssize_t j) noexcept nogil:
        cdef group_id_t tag
        memcpy(&tag, self._slots + j * self._slot_size + 8 * self._words, 4)
        return tag

    cdef inline void _set_tag(self, Py_ssize_t j, group_id_t tag) noexcept nogil:
        memcpy(self._slots + j * self._slot_size + 8 * self._words, &tag, 4)

    cdef inline Py_ssize_t _probe(self, group_id_t g, const uint8_t* d, uint64_t h,
                                  Py_ssize_t* insert_at) noexcept nogil:
        """Slot of key (g, d) (hash h) or -1 (``_slots.probe_slots``). Requires _cap > 0."""
        if self.digest_size == 8:       # a constant size: the key compare is one load
            return probe_slots(self._tags(), self._cap, self._slot_size, 8, g, d, h,
                               insert_at)
        return probe_slots(self._tags(), self._cap, self._slot_size, self.digest_size, g, d,
                           h, insert_at)

    cdef int _rehash(self, Py_ssize_t cap, Py_ssize_t words) noexcept nogil:
        """Rebuild with ``cap`` slots and ``words`` mask words (>= the current); -1 if out of
        memory (the table is then unchanged)."""
        cdef Py_ssize_t ss = _slot_bytes(words, self.digest_size)
        cdef uint8_t* slots = <uint8_t*>malloc(cap * ss)
        cdef Py_ssize_t i, j, m = cap - 1, old_mb = 8 * self._words, mb = 8 * words
        cdef group_id_t tag
        cdef uint8_t* src
        cdef uint8_t* dst
        if slots == NULL:
            return -1
        memset(slots, 0xFF, cap * ss)
        for i in range(self._cap):
            src = self._slots + i * self._slot_size
            memcpy(&tag, src + old_mb, 4)
            if tag < 0:
                continue
            j = <Py_ssize_t>(_key_hash(tag, src + old_mb + 4, self.digest_size) & <uint64_t>m)
            while True:
                memcpy(&tag, slots + j * ss + mb, 4)
                if tag == SLOT_EMPTY:
                    break
                j = (j + 1) & m
            dst = slots + j * ss
            memcpy(dst, src, old_mb)
            memset(dst + old_mb, 0, mb - old_mb)
            memcpy(dst + mb, src + old_mb, 4 + self.digest_size)
        free(self._slots)
        self._slots = slots
        self._cap = cap
        self._words = words
        self._slot_size = ss
        self._used = self._size
        return 0

    cdef int _reserve(self, Py_ssize_t extra) noexcept nogil:
        """Room for ``extra`` more keys under 3/4 load (tombstones count); -1 if no memory."""
        cdef Py_ssize_t cap
        if extra < 0 or extra > MAX_KEYS - self._size:
            return -1
        if self._cap > 0 and (self._used + extra) * 4 <= self._cap * 3:
            return 0
        cap = MIN_CAP
        while cap * 3 < (self._size + extra) * 4 + 4:
            cap *= 2
        if cap < self._cap:
            cap = self._cap          # only tombstones to clear
        return self._rehash(cap, self._words)

    cdef inline int _set(self, group_id_t g, const uint8_t* d, uint64_t h, Py_ssize_t w,
                  uint64_t b) noexcept nogil:
        """Set the engine bit of key (g, d) (hash h): 1 if newly set, 0 if it was set, -1 no
        memory."""
        cdef Py_ssize_t at = -1, j
        cdef uint64_t* m
        if self._reserve(1) < 0:
            return -1
        j = self._probe(g, d, h, &at)
        if j >= 0:
            m = self._mask(j)
            if m[w] & b:
                return 0
            m[w] |= b
            return 1
        if self._tag(at) == SLOT_EMPTY:
            self._used += 1
        m = self._mask(at)
        if self._words == 1:
            m[0] = b
        else:
            memset(m, 0, 8 * self._words)
            m[w] = b
        self._set_tag(at, g)
        if self.digest_size == 8:
            memcpy(self._tags() + at * self._slot_size + 4, d, 8)
        else:
            memcpy(self._tags() + at * self._slot_size + 4, d, self.digest_size)
        self._size += 1
        return 1

    cdef inline void _unset_slot(self, Py_ssize_t j, Py_ssize_t w, uint64_t b) noexcept nogil:
        """Clear the engine bit of slot j; a slot no engine holds any more is deleted: made
        empty (with the tombstones just before it) when the next slot is empty, since no
        probe passes through it then, else a tombstone."""
        cdef Py_ssize_t k, m = self._cap - 1
        cdef uint64_t* mask = self._mask(j)
        mask[w] &= ~b
        for k in range(self._words):
            if mask[k]:
                return
        self._size -= 1
        if self._tag((j + 1) & m) != SLOT_EMPTY:
            self._set_tag(j, SLOT_DELETED)
            return
        self._set_tag(j, SLOT_EMPTY)
        self._used -= 1
        k = (j - 1) & m
        while self._tag(k) == SLOT_DELETED:      # stops at j at the latest (now empty)
            self._set_tag(k, SLOT_EMPTY)
            self._used -= 1
            k = (k - 1) & m

    # -- engines -------------------------------------------------------------------------
    def add_engine(self):
        """A free engine bit (the lowest), its residency empty."""
        cdef Py_ssize_t bit
        for bit in range(len(self._live)):
            if not self._live[bit]:
                self._live[bit] = True
                return bit
        bit = len(self._live)
        if bit >= MAX_ENGINES:
            raise ValueError(f"at most {MAX_ENGINES} engines")
        if bit >= self._words * 64:
            if self._rehash(self._cap if self._cap else MIN_CAP, self._words + 1) < 0:
                raise MemoryError("routing index: no room to widen the engine masks")
        self._live.append(True)
        self._resident.append(0)
        self._dups.append([])
        return bit

    def clear_engine(self, Py_ssize_t bit):
        """Empty an engine's residency (``AllBlocksCleared``, a reset)."""
        self._check(bit)
        self._clear(bit)

    def remove_engine(self, Py_ssize_t bit):
        """Empty an engine and free its bit for reuse."""
        self._check(bit)
        self._clear(bit)
        self._live[bit] = False

    cdef _check(self, Py_ssize_t bit):
        if not 0 <= bit < len(self._live) or not self._live[bit]:
            raise ValueError(f"engine bit {bit} is not in use")

    cdef _clear(self, Py_ssize_t bit):
        cdef Py_ssize_t j, w = bit >> 6, others = 0, e
        cdef uint64_t b = (<uint64_t>1) << (bit & 63)
        if self._resident[bit]:
            for e in range(len(self._resident)):
                if e != bit:
                    others += <Py_ssize_t>self._resident[e]
            if others == 0:
                # no other engine holds a key: every slot goes, no scan
                memset(self._slots, 0xFF, self._cap * self._slot_size)
                self._size = self._used = 0
            else:
                for j in range(self._cap):
                    if self._tag(j) >= 0 and self._mask(j)[w] & b:
                        self._unset_slot(j, w, b)
        self._resident[bit] = 0
        self._dups[bit] = []

    def resident(self, Py_ssize_t bit):
        """Distinct keys the engine holds."""
        self._check(bit)
        return self._resident[bit]

    def duplicate_nbytes(self, Py_ssize_t bit):
        """Bytes of the engine's duplicate layers (keys it holds more than once)."""
        self._check(bit)
        return sum(layer.nbytes for layer in self._dups[bit])

    @property
    def nbytes(self):
        """Bytes of the shared table (slots with their masks; duplicate layers not
        included)."""
        return self._cap * self._slot_size

    @property
    def num_keys(self):
        """Distinct keys held by at least one engine."""
        return self._size

    # -- events --------------------------------------------------------------------------
    def apply_rows(self, Py_ssize_t bit, ops, groups, digests):
        """Apply rows to engine ``bit``: ``ops`` int8 (N,), ``groups`` int32 (N,),
        ``digests`` uint8 (N, digest_size), C-contiguous arrays. Returns ``(stored, removed,
        ignored, applied)``: stores (every store counts), removes that lowered a count, removes
        of a key not resident (no-ops), rows applied (== N; if memory runs out MemoryError is
        raised, naming the rows applied before it). Raw pointers, not memoryviews: a small
        batch (one engine step) pays no buffer acquisition."""
        self._check(bit)
        cdef int ds = self.digest_size
        _check_array(ops, cnp.NPY_INT8, 1, 1, "ops", "int8")
        _check_array(groups, cnp.NPY_INT32, 1, 1, "groups", "int32")
        _check_array(digests, cnp.NPY_UINT8, 2, ds, "digests", "uint8")
        cdef Py_ssize_t n = cnp.PyArray_DIM(<cnp.ndarray>ops, 0)
        if cnp.PyArray_DIM(<cnp.ndarray>groups, 0) != n \
                or cnp.PyArray_DIM(<cnp.ndarray>digests, 0) != n:
            raise ValueError("ops, groups and digests must have one row each")
        if self._busy:
            raise RuntimeError("routing index: a call is already applying events")
        cdef int64_t out[3]
        # the arrays are referenced by this call's arguments for the whole (GIL-held) call
        self._apply_packed(bit, n, <const int8_t*>cnp.PyArray_DATA(<cnp.ndarray>ops),
                           <const int32_t*>cnp.PyArray_DATA(<cnp.ndarray>groups),
                           <const uint8_t*>cnp.PyArray_DATA(<cnp.ndarray>digests), out)
        return out[0], out[1], out[2], n

    cdef int _apply_packed(self, Py_ssize_t bit, Py_ssize_t n, const int8_t* ops,
                           const int32_t* groups, const uint8_t* digests,
                           int64_t* out) except -1:
        """Apply ``n`` validated rows to engine ``bit`` (in use); ``out`` gets (stored,
        removed, ignored). The GIL is held: the rows' buffers must stay referenced."""
        cdef int ds = self.digest_size
        cdef Py_ssize_t i, j, stores = 0, w = bit >> 6, ahead
        cdef uint64_t b = (<uint64_t>1) << (bit & 63)
        cdef int64_t stored = 0, removed = 0, ignored = 0, resident = self._resident[bit]
        cdef int rc = 0
        cdef int8_t op
        cdef list dups = self._dups[bit]
        cdef uint64_t ring[PREFETCH_AHEAD]     # key hashes of rows i .. i + AHEAD - 1
        cdef uint64_t h
        cdef uint8_t buf[16]
        cdef bint fast, wide
        cdef uint8_t* slots
        cdef uint8_t* slot
        cdef uint64_t cm, k64, s64
        cdef Py_ssize_t free_at, slot_size
        cdef group_id_t tag
        cdef int32_t g
        out[0] = out[1] = out[2] = 0
        if n == 0:
            return 0
        for i in range(n):
            stores += ops[i] > 0
        if self._reserve(stores) < 0:
            raise MemoryError(f"KV events: no room for {stores} more keys (nothing applied)")
        for i in range(min(n, PREFETCH_AHEAD)):
            ring[i] = _key_hash(groups[i], digests + i * ds, ds)
        fast = ds == 8 and self._words == 1 and self._cap > 0    # then slots are 24 bytes
        # the table does not move during the batch (room reserved above; a clear keeps it)
        slots = self._slots
        cm = <uint64_t>(self._cap - 1)
        slot_size = self._slot_size
        # a table past the cache: also the line ending the home slot's successor (a slot
        # straddling two lines, or the probe's second slot, is then no miss; deepseek-v4's
        # 3 MiB table: 8-17% of the stream call); smaller, the second prefetch is only cost
        wide = self._cap * slot_size > PREFETCH2_BYTES
        try:
            for i in range(n):
                h = ring[i & (PREFETCH_AHEAD - 1)]
                ahead = i + PREFETCH_AHEAD
                if ahead < n:
                    ring[ahead & (PREFETCH_AHEAD - 1)] = _key_hash(groups[ahead],
                                                                   digests + ahead * ds, ds)
                    if slots != NULL:
                        j = <Py_ssize_t>(ring[ahead & (PREFETCH_AHEAD - 1)] & cm)
                        prefetch(slots + j * slot_size)
                        if wide:
                            prefetch(slots + <Py_ssize_t>((j + 1) & cm) * slot_size
                                     + slot_size - 1)
                op = ops[i]
                if fast:
                    # 8-byte keys, one mask word: the probe inlined on hoisted locals (the
                    # table does not move inside a batch: its room was reserved above)
                    memcpy(&k64, digests + i * 8, 8)
                    g = groups[i]
                    if op != 0:
                        j = <Py_ssize_t>(h & cm)
                        free_at = -1
                        while True:
                            slot = slots + j * 24
                            memcpy(&tag, slot + 8, 4)
                            if tag == SLOT_EMPTY:
                                break
                            if tag == SLOT_DELETED:
                                if free_at < 0:
                                    free_at = j
                            else:
                                memcpy(&s64, slot + 12, 8)
                                if tag == g and s64 == k64:
                                    break
                            j = (j + 1) & cm
                        if op > 0:
                            if tag != SLOT_EMPTY:           # the key is in the table
                                if (<uint64_t*>slot)[0] & b:
                                    if _store_duplicate(dups, 8, g, _dup_key(8, digests + i * 8,
                                                                             buf)) < 0:
                                        raise MemoryError(f"KV event row {i}: out of memory "
                                                          f"({i} rows applied)")
                                else:
                                    (<uint64_t*>slot)[0] |= b
                                    resident += 1
                            else:
                                if free_at >= 0:
                                    j = free_at
                                    slot = slots + j * 24
                                else:
                                    self._used += 1
                                (<uint64_t*>slot)[0] = b
                                memcpy(slot + 8, &g, 4)
                                memcpy(slot + 12, &k64, 8)
                                self._size += 1
                                resident += 1
                            stored += 1
                            continue
                        if tag == SLOT_EMPTY or not ((<uint64_t*>slot)[0] & b):
                            ignored += 1
                            continue
                        removed += 1
                        if dups and _remove_duplicate(dups, g, _dup_key(8, digests + i * 8,
                                                                        buf)):
                            continue
                        self._unset_slot(j, 0, b)
                        resident -= 1
                        continue
                if op > 0:
                    rc = self._set(groups[i], digests + i * ds, h, w, b)
                    if rc < 0:
                        raise MemoryError(f"KV event row {i}: out of memory ({i} rows applied)")
                    if rc == 1:
                        resident += 1
                    elif _store_duplicate(dups, ds, groups[i],
                                          _dup_key(ds, digests + i * ds, buf)) < 0:
                        raise MemoryError(f"KV event row {i}: out of memory ({i} rows applied)")
                    stored += 1
                elif op < 0:
                    # one probe: the duplicate layers never move the table's slots
                    j = self._probe(groups[i], digests + i * ds, h, NULL) if self._size else -1
                    if j < 0 or not (self._mask(j)[w] & b):
                        ignored += 1
                        continue
                    removed += 1
                    if dups and _remove_duplicate(dups, groups[i],
                                                  _dup_key(ds, digests + i * ds, buf)):
                        continue
                    self._unset_slot(j, w, b)
                    resident -= 1
                else:
                    self._resident[bit] = resident
                    self._clear(bit)
                    dups = self._dups[bit]
                    resident = 0
        finally:
            self._resident[bit] = resident
            out[0] = stored
            out[1] = removed
            out[2] = ignored
        return 0

    cdef Py_ssize_t _pack_direct(self, list events, object t_stored, object t_removed,
                                 object t_cleared, object medium, tuple refused_kinds,
                                 int num_groups, int64_t* cleared, int64_t* other,
                                 int64_t* lookahead) except -1:
        """``apply_events``' walk when every field it reads is an object slot: the events,
        their fields and the hashes are read as borrowed pointers (no reference counting, no
        attribute lookup). Safe because no Python code runs between a read and its use:
        exact types are checked before every read, errors are raised (and their messages
        built) only when the walk stops, and the one call that can run code, the spec-kind
        lookup (``refused_kinds`` is the caller's: a non-str key's ``__eq__`` runs), holds
        strong references to the event and the kind across it and re-reads the list and the
        hashes after it. Returns the rows packed; same checks, order and messages as the
        general walk."""
        cdef PyObject* lst = <PyObject*>events
        cdef PyObject* ps = <PyObject*>t_stored
        cdef PyObject* pr = <PyObject*>t_removed
        cdef PyObject* pc = <PyObject*>t_cleared
        cdef PyObject* p_none = <PyObject*>None
        cdef PyObject* p_int = <PyObject*>int
        cdef PyObject* p_str = <PyObject*>str
        cdef PyObject* p_bytes = <PyObject*>bytes
        cdef PyObject* p_list = <PyObject*>list
        cdef PyObject* p_med = <PyObject*>medium
        cdef PyObject* ev
        cdef PyObject* hl
        cdef PyObject* m
        cdef PyObject* item
        cdef PyObject* kind
        cdef PyObject* t
        cdef object ev_ref, kind_ref
        cdef Py_ssize_t e
        cdef Py_ssize_t n = 0, i = 0, k, nh
        cdef Py_ssize_t* off
        cdef int ds = self.digest_size
        cdef long g
        cdef unsigned long long v
        cdef int8_t op
        cdef uint8_t* key
        while i < list_size(lst):
            e = i
            ev = list_item(lst, i)
            i += 1
            t = type_of(ev)
            if t == pc:
                n = self._clear_row(n)
                cleared[0] += 1
                continue
            if t == ps:
                op = 1
                off = self._ev_off[0]
            elif t == pr:
                op = -1
                off = self._ev_off[1]
            else:
                raise TypeError(f"events[{e}] must be a stored, removed or cleared "
                                f"event, got {(<object>t).__name__}")
            hl = _slot_field(ev, off[F_HASHES], "block_hashes")
            if type_of(hl) != p_list:
                raise TypeError(f"events[{e}].block_hashes must be a list, got "
                                f"{(<object>type_of(hl)).__name__}")
            nh = list_size(hl)
            m = _slot_field(ev, off[F_MEDIUM], "medium")
            if m != p_none and m != p_med and (
                    p_med == p_none or type_of(m) != p_str or not str_eq(m, p_med)):
                if type_of(m) != p_str:
                    raise TypeError(f"events[{e}].medium must be a str or None")
                other[0] += nh
                continue
            item = _slot_field(ev, off[F_GROUP], "group_idx")
            if item == p_none:
                g = 0
            elif type_of(item) != p_int:
                raise TypeError(f"events[{e}].group_idx must be an int, got "
                                f"{(<object>type_of(item)).__name__}")
            elif as_long(item, &g) < 0 or g < 0 or g >= num_groups:
                raise ValueError(f"events[{e}].group_idx must be a group id in "
                                 f"[0, {num_groups}), got {<object>item}")
            if op > 0:
                kind = _slot_field(ev, off[F_KIND], "kv_cache_spec_kind")
                if type_of(kind) == p_str and (<dict>refused_kinds[g]):
                    ev_ref = <object>ev             # alive across the lookup's code
                    kind_ref = <object>kind
                    if kind_ref in <dict>refused_kinds[g]:
                        raise ConfigError(
                            f"events[{e}]: the engine's group {g} is {kind_ref!r} but the "
                            f"index's layout has {(<dict>refused_kinds[g])[kind_ref]}: give "
                            "the router the engines' own KV cache groups, in their order")
                    if i > list_size(lst) or list_item(lst, e) != ev:
                        raise ValueError("events changed while being applied")
                    hl = _slot_field(ev, off[F_HASHES], "block_hashes")
                    if type_of(hl) != p_list:
                        raise TypeError(f"events[{e}].block_hashes must be a list, got "
                                        f"{(<object>type_of(hl)).__name__}")
                    nh = list_size(hl)
                    ev_ref = kind_ref = None
                if _slot_field(ev, off[F_LOOKAHEAD], "lookahead_token_ids") != p_none:
                    lookahead[0] += nh
            if self._grow_scratch(n + nh) < 0:
                raise MemoryError("KV events: no memory for the batch's rows")
            key = self._s_keys + n * ds
            for k in range(nh):
                item = list_item(hl, k)
                if ds == 8:
                    if type_of(item) != p_int:
                        raise TypeError(f"events[{e}].block_hashes[{k}] must be an int "
                                        f"(a 64-bit hash), got {(<object>type_of(item)).__name__}")
                    if as_u64(item, &v) < 0:
                        raise OverflowError(f"events[{e}].block_hashes[{k}] must be in "
                                            f"[0, 2**64), got {<object>item}")
                    _put_be64(key, v)
                else:
                    if type_of(item) != p_bytes or bytes_size(item) != ds:
                        raise TypeError(f"events[{e}].block_hashes[{k}] must be a "
                                        f"{ds}-byte digest")
                    memcpy(key, bytes_data(item), ds)
                key += ds
            for k in range(nh):
                self._s_ops[n + k] = op
                self._s_groups[n + k] = <int32_t>g
            n += nh
        return n

    def apply_events(self, Py_ssize_t bit, list events, tuple types, object medium,
                     tuple refused_kinds, int num_groups):
        """Apply a decoded KV event batch's ``events`` to engine ``bit`` in one call; ``bit <
        0`` validates only (an unknown engine's batch). Returns ``(stored, removed, ignored,
        cleared, rows, other_rows, lookahead_rows)``.

        ``types``: the (stored, removed, cleared) event classes; every event's exact type is
        one of them. Stored / removed events are read by attribute (vLLM's schema):
        ``block_hashes`` (a list of 64-bit ints for 8-byte keys, else ``digest_size``-byte
        bytes), ``group_idx`` (None is group 0, else in [0, num_groups)), ``medium`` (None or
        equal to ``medium`` is applied; any other str is left out and counted in
        ``other_rows``); stored events also ``kv_cache_spec_kind``, refused when in
        ``refused_kinds[group]`` (a dict: kind -> the layout's kind name; ConfigError), and
        ``lookahead_token_ids`` (not None: its hashes counted in ``lookahead_rows``).

        Every event is validated and packed into scratch rows this object owns before any is
        applied: a bad event raises (TypeError / ValueError / OverflowError naming
        ``events[i]``, ConfigError for a kind) with nothing applied."""
        cdef int64_t r[7]
        self._apply_events(bit, events, types, medium, refused_kinds, num_groups, r)
        return r[0], r[1], r[2], r[3], r[4], r[5], r[6]

    def apply_payload(self, Py_ssize_t bit, bytes payload not None, object medium,
                      tuple refused_kinds, int num_groups, int64_t dp_rank):
        """Apply one KV event batch from its msgpack bytes (vLLM's publisher's payload) to
        engine ``bit`` (``bit < 0``: validate only). Returns the seven counts of
        :meth:`apply_events` for the same batch, or None: declined, nothing applied (the
        caller decodes it and calls ``apply_events``, which applies it or refuses it by
        name; see _route_payload.pxi for what is declined). ``dp_rank``: the batch's
        ``data_parallel_rank`` must be absent, None or this."""
        cdef int64_t r[7]
        if self._apply_payloads(bit, [payload], medium, refused_kinds, num_groups, dp_rank,
                                r) == 0:
            return None
        return r[0], r[1], r[2], r[3], r[4], r[5], r[6]

    cdef Py_ssize_t _apply_payloads(self, Py_ssize_t bit, list payloads, object medium,
                                    tuple refused_kinds, int num_groups, int64_t dp_rank,
                                    int64_t* r) except -1:
        """Consecutive batches of one engine from their bytes: each is read in turn into
        the scratch rows until one is declined, then the rows of those read are applied in
        one pass (what applying them one call each does: rows apply in order). Returns how
        many were applied (counts summed in ``r``); the caller takes the declined one and
        those after it on. ``payloads`` holds exact bytes objects (checked first)."""
        cdef Py_ssize_t n = 0, m, k, done = 0, np_ = len(payloads)
        cdef int64_t cleared = 0, other = 0, c1, o1
        cdef int64_t out[3]
        cdef const uint8_t* med = NULL
        cdef Py_ssize_t med_len = -1
        cdef bytes pl
        for k in range(np_):
            if type(payloads[k]) is not bytes:
                raise TypeError(f"payloads[{k}] must be bytes (a KV event batch's msgpack), "
                                f"got {type(payloads[k]).__name__}")
        if bit >= 0:
            self._check(bit)
        if medium is not None:
            if type(medium) is not str:
                raise TypeError(f"medium must be a str or None, got {type(medium).__name__}")
            if medium is not self._med_obj:
                try:
                    self._med_bytes = (<str>medium).encode("utf-8")
                except UnicodeEncodeError:      # a lone surrogate: equal to no payload text
                    self._med_bytes = None
                self._med_obj = medium
            if self._med_bytes is None:
                med_len = -2                    # every str medium is another one
            else:
                med = <const uint8_t*>(<const char*>self._med_bytes)
                med_len = len(self._med_bytes)
        self._begin(refused_kinds, num_groups)
        try:
            # the list is ours (the caller's is copied by index_apply_payloads) and each
            # payload an immutable bytes object it holds: code a spec-kind lookup runs
            # cannot change what is read
            for k in range(np_):
                pl = <bytes>payloads[k]
                c1 = o1 = 0
                m = _pack_payload(self, n, <const uint8_t*>(<const char*>pl), len(pl), med,
                                  med_len, refused_kinds, num_groups, dp_rank, &c1, &o1)
                if m < 0:
                    break
                n = m
                cleared += c1
                other += o1
                done += 1
            if done == 0:
                return 0
            if bit < 0:
                out[0] = out[1] = out[2] = 0
            else:
                self._check(bit)
                self._apply_packed(bit, n, self._s_ops, self._s_groups, self._s_keys, out)
        finally:
            self._end()
        r[0], r[1], r[2], r[3], r[4], r[5], r[6] = out[0], out[1], out[2], cleared, n, other, 0
        return done

    cdef int _begin(self, tuple refused_kinds, int num_groups) except -1:
        """What both event paths check before packing (the refusal dicts once per tuple),
        then the call is marked busy (a re-entrant call is refused); ``_end`` after it."""
        if len(refused_kinds) != num_groups:
            raise TypeError(f"refused_kinds must be one dict per group ({num_groups})")
        if refused_kinds is not self._ev_refused:
            self._check_refused(refused_kinds, num_groups)
        if self._busy:
            raise RuntimeError("routing index: a call is already applying events")
        self._busy = True
        return 0

    cdef void _end(self) noexcept:
        self._busy = False
        # a replay's or a burst's rows are let go, unless they take no more bytes than the
        # table (op, group and key per row): an index that big sees batches that big again,
        # and regrowing them every call (realloc copies, fresh pages) was 5% of
        # deepseek-v4's stream call
        if self._s_cap > SCRATCH_KEEP and \
                self._s_cap * (5 + self.digest_size) > self._cap * self._slot_size:
            self._free_scratch()

    cdef int _resolve_types(self, tuple types) except -1:
        """Check the event classes and take their fields' slot offsets (once per tuple)."""
        cdef Py_ssize_t k
        if len(types) != 3 or not all(isinstance(t, type) for t in types):
            raise TypeError("types must be the (stored, removed, cleared) event classes")
        for k in range(N_FIELDS):
            self._ev_off[0][k] = _member_offset(types[0], _FIELD_NAMES[k])
            self._ev_off[1][k] = _member_offset(types[1], _FIELD_NAMES[k])
        self._ev_direct = all(self._ev_off[0][k] >= 0 for k in range(N_FIELDS)) and all(
            self._ev_off[1][k] >= 0 for k in (F_HASHES, F_MEDIUM, F_GROUP))
        self._ev_types = types
        return 0

    cdef int _check_refused(self, tuple refused_kinds, int num_groups) except -1:
        """Check the per-group refusal dicts (once per tuple)."""
        if not all(type(d) is dict for d in refused_kinds):
            raise TypeError(f"refused_kinds must be one dict per group ({num_groups})")
        self._ev_refused = refused_kinds
        return 0

    cdef int _apply_events(self, Py_ssize_t bit, list events, tuple types, object medium,
                           tuple refused_kinds, int num_groups, int64_t* r) except -1:
        """``apply_events``' body (also called by ``index_apply_events`` without a Python
        call): the seven counts into ``r``."""
        cdef Py_ssize_t n = 0, i, k, ne = len(events)
        cdef int ds = self.digest_size
        cdef long g
        cdef unsigned long long v
        cdef int64_t cleared = 0, other = 0, lookahead = 0, nh
        cdef int8_t op
        cdef int64_t out[3]
        cdef object ev, hl, item, m, kind
        cdef object t_stored, t_removed, t_cleared     # classes (msgspec: a metaclass)
        cdef uint8_t* key
        cdef Py_ssize_t* off
        if bit >= 0:
            self._check(bit)
        if medium is not None and type(medium) is not str:
            raise TypeError(f"medium must be a str or None, got {type(medium).__name__}")
        # the checks of `types` and `refused_kinds` run once per tuple object (tuples are
        # immutable; a small batch's fixed cost was mostly these generator expressions)
        # (in cdef helpers: a generator expression in this method made Cython allocate its
        # closure scope on every call, 2% of one step's batch)
        if types is not self._ev_types:
            self._resolve_types(types)
        t_stored, t_removed, t_cleared = types
        self._begin(refused_kinds, num_groups)
        try:
            if self._ev_direct:
                n = self._pack_direct(events, t_stored, t_removed, t_cleared, medium,
                                      refused_kinds, num_groups, &cleared, &other, &lookahead)
                ne = 0          # packed: skip the general walk below
            # the event classes are the caller's decoded structs: attribute reads run no
            # code of ours that could call back; _busy refuses a re-entrant fill regardless
            for i in range(ne):
                if i >= len(events):
                    raise ValueError("events changed while being applied")
                ev = events[i]
                if type(ev) is t_cleared:
                    n = self._clear_row(n)
                    cleared += 1
                    continue
                if type(ev) is t_stored:
                    op = 1
                    off = self._ev_off[0]
                elif type(ev) is t_removed:
                    op = -1
                    off = self._ev_off[1]
                else:
                    raise TypeError(f"events[{i}] must be a stored, removed or cleared "
                                    f"event, got {type(ev).__name__}")
                hl = _read_field(ev, off[F_HASHES], "block_hashes")
                if type(hl) is not list:
                    raise TypeError(f"events[{i}].block_hashes must be a list, got "
                                    f"{type(hl).__name__}")
                m = _read_field(ev, off[F_MEDIUM], "medium")
                if m is not None and m is not medium and (
                        medium is None or type(m) is not str or <str>m != <str>medium):
                    if type(m) is not str:
                        raise TypeError(f"events[{i}].medium must be a str or None")
                    other += len(<list>hl)
                    continue
                item = _read_field(ev, off[F_GROUP], "group_idx")
                if item is None:
                    g = 0
                elif type(item) is not int:
                    raise TypeError(f"events[{i}].group_idx must be an int, got "
                                    f"{type(item).__name__}")
                elif as_long(<PyObject*>item, &g) < 0 or g < 0 or g >= num_groups:
                    raise ValueError(f"events[{i}].group_idx must be a group id in "
                                     f"[0, {num_groups}), got {item}")
                if op > 0:
                    kind = _read_field(ev, off[F_KIND], "kv_cache_spec_kind")
                    if type(kind) is str and kind in <dict>refused_kinds[g]:
                        raise ConfigError(
                            f"events[{i}]: the engine's group {g} is {kind!r} but the index's "
                            f"layout has {(<dict>refused_kinds[g])[kind]}: give the router "
                            "the engines' own KV cache groups, in their order")
                    if _read_field(ev, off[F_LOOKAHEAD], "lookahead_token_ids") is not None:
                        lookahead += len(<list>hl)
                # no code runs from here to the end of the rows (exact ints / bytes only), so
                # the list keeps this length
                nh = len(<list>hl)
                if self._grow_scratch(n + nh) < 0:
                    raise MemoryError("KV events: no memory for the batch's rows")
                for k in range(nh):
                    item = (<list>hl)[k]
                    key = self._s_keys + (n + k) * ds
                    if ds == 8:
                        if type(item) is not int:
                            raise TypeError(f"events[{i}].block_hashes[{k}] must be an int "
                                            f"(a 64-bit hash), got {type(item).__name__}")
                        if as_u64(<PyObject*>item, &v) < 0:
                            raise OverflowError(f"events[{i}].block_hashes[{k}] must be in "
                                                f"[0, 2**64), got {item}")
                        _put_be64(key, v)
                    else:
                        if type(item) is not bytes or len(<bytes>item) != ds:
                            raise TypeError(f"events[{i}].block_hashes[{k}] must be a "
                                            f"{ds}-byte digest")
                        memcpy(key, <const char*>(<bytes>item), ds)
                    self._s_ops[n + k] = op
                    self._s_groups[n + k] = <int32_t>g
                n += nh
            if bit < 0:
                out[0] = out[1] = out[2] = 0
            else:
                self._check(bit)        # still in use (nothing above can free it; cheap)
                self._apply_packed(bit, n, self._s_ops, self._s_groups, self._s_keys, out)
        finally:
            self._end()
        r[0], r[1], r[2], r[3], r[4], r[5], r[6] = out[0], out[1], out[2], cleared, n, other, \
            lookahead
        return 0

    # -- queries -------------------------------------------------------------------------
    def route(self, kernel, int num_groups, hashes, token_t max_length, tuple names, bits):
        """Every engine's hit for the query rows ``hashes`` by ``kernel``'s rule (a HitKernel;
        group ids < ``num_groups``), capped at ``max_length``: ``(hits, best, best_engines)``
        with ``hits`` a dict ``names[e] -> tokens`` for the engine bits ``bits`` (an int64
        array, one per name), ``best`` the longest and ``best_engines`` the names holding it
        (empty when ``best`` is 0).

        ``hashes``: the rows' digests, an (N, D) uint8 array or a list of N ``bytes`` of one
        length D; D must be ``digest_size``, or >= 8 when the keys are 8 bytes (the last 8
        digest bytes are the key: vLLM's int hash of a digest). Read in place. Raises
        ValueError / TypeError naming the bad argument."""
        cdef KernelTables kt
        kernel_tables(kernel, &kt)          # pointers valid while `kernel` is referenced
        cdef int ds = self.digest_size
        cdef Py_ssize_t n_rows, width, e, nb, k, i
        cdef int64_t bit
        cdef const int64_t* bit_p
        cdef cnp.ndarray arr
        cdef const uint8_t* base = NULL
        cdef uint8_t* packed = NULL
        cdef object item
        if not (cnp.PyArray_CheckExact(bits) and cnp.PyArray_NDIM(<cnp.ndarray>bits) == 1
                and cnp.PyArray_TYPE(<cnp.ndarray>bits) == cnp.NPY_INT64
                and cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>bits)):
            raise TypeError("bits must be a 1-D C-contiguous int64 array")
        nb = cnp.PyArray_DIM(<cnp.ndarray>bits, 0)
        if nb != len(names):
            raise ValueError(f"names and bits must have one entry per engine: {len(names)} "
                             f"names, {nb} bits")
        bit_p = <const int64_t*>cnp.PyArray_DATA(<cnp.ndarray>bits)
        for e in range(nb):
            if not 0 <= bit_p[e] < len(self._live):
                raise ValueError(f"engine bit {bit_p[e]} is not in use")
        for k in range(kt.num_members):
            if not 0 <= kt.members[k] < num_groups:
                raise ValueError("kernel group ids must be < num_groups")
        if type(hashes) is list:
            n_rows = len(<list>hashes)
            width = ds
            if n_rows:
                item = (<list>hashes)[0]
                if type(item) is not bytes:
                    raise ValueError(f"hashes[0] must be a digest (bytes), got "
                                     f"{type(item).__name__}")
                width = len(<bytes>item)
        elif cnp.PyArray_Check(hashes):
            arr = <cnp.ndarray>hashes
            if cnp.PyArray_TYPE(arr) != cnp.NPY_UINT8 or cnp.PyArray_NDIM(arr) != 2:
                raise ValueError("hashes must be an (N, digest) uint8 array")
            if not cnp.PyArray_IS_C_CONTIGUOUS(arr):
                arr = np.ascontiguousarray(arr)
            n_rows = cnp.PyArray_DIM(arr, 0)
            width = cnp.PyArray_DIM(arr, 1)
        else:
            raise TypeError(f"hashes must be a list of digests (bytes) or an (N, digest) "
                            f"uint8 array, got {type(hashes).__name__}")
        if (width < 8) if ds == 8 else (width != ds):
            raise ValueError(f"hashes must be {'>= 8' if ds == 8 else ds}-byte digests, got "
                             f"{width} bytes")
        if type(hashes) is list:
            if n_rows:
                packed = <uint8_t*>malloc(n_rows * ds)
                if packed == NULL:
                    raise MemoryError("routing query: no memory for the query's keys")
            for i in range(n_rows):
                item = (<list>hashes)[i]
                if type(item) is not bytes or len(<bytes>item) != width:
                    free(packed)
                    raise ValueError(f"hashes[{i}] must be {width} bytes (the digests of "
                                     f"one hash algorithm)")
                memcpy(packed + i * ds, <const char*>(<bytes>item) + width - ds, ds)
            base = packed
            width = ds
        elif n_rows:
            base = <const uint8_t*>cnp.PyArray_DATA(arr) + width - ds
        hits = {}
        if n_rows == 0 or nb == 0 or kt.S == 0:
            free(packed)
            for e in range(nb):
                hits[names[e]] = 0
            return hits, 0, ()
        cdef const uint64_t** memo = <const uint64_t**>calloc(num_groups * n_rows,
                                                                sizeof(uint64_t*))
        cdef int64_t* spans = <int64_t*>malloc(kt.S * 2 * sizeof(int64_t))
        cdef int64_t* found = <int64_t*>malloc(nb * sizeof(int64_t))
        cdef int64_t best = 0
        cdef FillState st
        if memo == NULL or spans == NULL or found == NULL:
            free(memo)
            free(spans)
            free(found)
            free(packed)
            raise MemoryError("routing query: no memory for the probe memo")
        st.tags = self._tags()
        st.hashes = base
        st.stride = width
        st.cap = self._cap
        st.slot_size = self._slot_size
        st.mask_bytes = 8 * self._words
        st.size = self._size
        st.ds = ds
        try:
            # the GIL stays held: the memo points into this table, which only a call on this
            # object (serialised by the GIL, and by RoutingIndex's lock) changes; `arr` /
            # `hashes` are referenced for the whole call
            for e in range(nb):
                bit = bit_p[e]
                found[e] = hit_over_masks(&kt, n_rows, max_length, memo, _fill, &st,
                                          bit >> 6, (<uint64_t>1) << (bit & 63), spans)
                if found[e] > best:
                    best = found[e]
            for e in range(nb):
                hits[names[e]] = found[e]
            holders = tuple([names[e] for e in range(nb) if found[e] == best]) if best else ()
        finally:
            free(memo)
            free(spans)
            free(found)
            free(packed)
        return hits, best, holders


include "_route_payload.pxi"


cdef int _check_array(object a, int npy_type, int ndim, Py_ssize_t width,
                      str name, str dtype) except -1:
    """``a`` is an exact C-contiguous ndarray of that type and rank (rank 2: ``width``
    columns), read through a raw pointer."""
    if not (cnp.PyArray_CheckExact(a) and cnp.PyArray_TYPE(<cnp.ndarray>a) == npy_type
            and cnp.PyArray_NDIM(<cnp.ndarray>a) == ndim
            and cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>a)
            and (ndim == 1 or cnp.PyArray_DIM(<cnp.ndarray>a, 1) == width)):
        raise ValueError(f"{name} must be a C-contiguous {dtype} array of rank {ndim}"
                         + (f", {width} bytes wide" if ndim == 2 else ""))
    return 0


cdef int _store_duplicate(list dups, int ds, int32_t g, const uint8_t* d) except -2:
    """One more insertion of a key the engine already holds: put it in the first duplicate
    layer that lacks it (a new layer if all hold it). -1 if out of memory."""
    cdef ExistenceSet layer
    cdef int rc = 0
    for obj in dups:
        layer = <ExistenceSet>obj
        layer.lock()
        rc = layer.put(g, d)
        layer.unlock()
        if rc != 0:
            return -1 if rc < 0 else 0
    layer = ExistenceSet(16 if ds == 8 else ds)
    dups.append(layer)
    layer.lock()
    rc = layer.put(g, d)
    layer.unlock()
    return -1 if rc < 0 else 0


cdef int _remove_duplicate(list dups, int32_t g, const uint8_t* d) except -2:
    """One removal of a key the engine holds: if a duplicate layer holds it, drop it from the
    deepest one (layers are nested; an emptied top layer is dropped) and return 1; 0 if the
    key's count is 1 (the caller clears its engine bit)."""
    cdef Py_ssize_t k = 0, depth = len(dups)
    cdef ExistenceSet layer
    cdef bint held
    while k < depth:
        layer = <ExistenceSet>dups[k]
        layer.lock()
        held = layer.has(g, d)
        layer.unlock()
        if not held:
            break
        k += 1
    if k == 0:
        return 0
    layer = <ExistenceSet>dups[k - 1]
    layer.lock()
    layer.drop(g, d)
    held = layer._size > 0
    layer.unlock()
    if not held and k == depth:
        del dups[k - 1:]
    return 1


def apply_rows(SharedResidency residency, Py_ssize_t bit, ops, groups, digests):
    """``residency.apply_rows`` (a module-level hook: tests swap in other semantics)."""
    return residency.apply_rows(bit, ops, groups, digests)


def apply_events(SharedResidency residency, Py_ssize_t bit, list events, tuple types,
                 object medium, tuple refused_kinds, int num_groups):
    """``residency.apply_events`` (a module-level hook, like ``apply_rows``)."""
    return residency.apply_events(bit, events, types, medium, refused_kinds, num_groups)


cdef object _APPLY_EVENTS = apply_events       # the hook as built (tests may swap it)


cdef extern from *:
    """
    /* An instance of `cls`, a tuple subclass without instance fields (a NamedTuple), holding
       the seven counts: what tuple.__new__(cls, counts) makes, without the tuple of counts
       it would copy from. */
    static PyObject* hmacore_counts7(PyObject* cls, const int64_t* c) {
        PyTypeObject* t = (PyTypeObject*)cls;
        PyObject* o = t->tp_alloc(t, 7);
        Py_ssize_t i;
        if (o == NULL) return NULL;
        for (i = 0; i < 7; i++) {
            PyObject* v = PyLong_FromLongLong((long long)c[i]);
            if (v == NULL) { Py_DECREF(o); return NULL; }
            PyTuple_SET_ITEM(o, i, v);
        }
        return o;
    }
    """
    object counts7 "hmacore_counts7"(object cls, const int64_t* c)


@cython.final
cdef class EventState:
    """What ``RoutingIndex.apply_events`` (:func:`index_apply_events`) reads on every call, in
    C fields: the table, the engines' key -> bit dict, the index's lock, the last
    ``spec_kinds`` object and its refusals, the result class. One per RoutingIndex; the dict
    and the lock are the index's own objects (shared, not copied)."""
    cdef SharedResidency res
    cdef dict engines
    cdef object acquire, release
    cdef int num_groups
    cdef object kinds           # the last spec_kinds object seen (held: its identity is stable)
    cdef tuple refused          # its refusals (RoutingIndex._refused_kinds)
    cdef tuple no_refusals
    cdef object stats_cls

    def __cinit__(self, SharedResidency res not None, dict engines not None, lock,
                  int num_groups, tuple no_refusals not None, type stats_cls not None):
        if not issubclass(stats_cls, tuple) or (<object>stats_cls).__itemsize__ != \
                (<object>tuple).__itemsize__ or (<object>stats_cls).__basicsize__ != \
                (<object>tuple).__basicsize__ or len(getattr(stats_cls, "_fields", ())) != 7:
            raise TypeError("stats_cls must be a 7-field NamedTuple class")
        if len(no_refusals) != num_groups:
            raise ValueError(f"no_refusals must be one dict per group ({num_groups})")
        self.res = res
        self.engines = engines
        self.acquire = lock.acquire
        self.release = lock.release
        self.num_groups = num_groups
        self.no_refusals = no_refusals
        self.stats_cls = stats_cls

    def __reduce__(self):
        raise TypeError("EventState is not picklable")


def index_apply_events(self, key, events, types, *, medium="GPU", spec_kinds=None):
    """Apply a decoded KV event batch's events (vLLM's ``KVEventBatch.events``) in one
    compiled call: no per-row Python, no per-call allocation for small batches.

    Args:
        key: the engine key.
        events: the batch's events, in order.
        types: the (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``) classes the
            events were decoded into (hmacore.transport.kv_event_wire's; the core imports
            no transport). Stored / removed events are read by attribute:
            ``block_hashes`` (64-bit ints with ``int_hashes``, else digest bytes),
            ``group_idx`` (None is group 0), ``medium``, ``kv_cache_spec_kind`` and
            ``lookahead_token_ids`` (stored).
        medium: events with ``medium`` None or equal to this are applied; others are
            left out and their hashes counted in ``other_medium``.
        spec_kinds: vLLM's ``kv_cache_spec_kind`` values -> the group kind each must be;
            a stored event contradicting its group's kind refuses the batch
            (ConfigError). None: not checked.

    The whole batch is validated first; a bad event refuses it (the error names
    ``events[i]``), nothing applied. Semantics per hash row as :meth:`apply`. Returns an
    ``ApplyStats``.

    ``RoutingIndex.apply_events`` is this function (a compiled function binds as a method):
    the whole call, lock and engine lookup included, runs without a Python frame, which was
    most of the cost of one engine step's batch. Calls ``_route.apply_events`` instead of
    the table's own method when a test has swapped that module-level hook."""
    cdef EventState st = <EventState?>self._ev
    cdef tuple refused = _refusals(st, self, spec_kinds)
    cdef Py_ssize_t bit = -1
    cdef int64_t r[7]
    cdef object hook, got
    hook = apply_events
    try:
        if type(events) is not list:
            raise TypeError(f"Argument 'events' has incorrect type (expected list, got "
                            f"{type(events).__name__})")
        if type(types) is not tuple:
            raise TypeError(f"Argument 'types' has incorrect type (expected tuple, got "
                            f"{type(types).__name__})")
        st.acquire()
        try:
            got = st.engines.get(key)
            bit = -1 if got is None else <Py_ssize_t>got
            if hook is _APPLY_EVENTS:
                st.res._apply_events(bit, <list>events, <tuple>types, medium, refused,
                                     st.num_groups, r)
            else:
                r[0], r[1], r[2], r[3], r[4], r[5], r[6] = hook(
                    st.res, bit, events, types, medium, refused, st.num_groups)
        finally:
            st.release()
    except OverflowError as e:
        raise HashInputError(str(e)) from None
    except HmacoreError:
        raise
    except TypeError as e:      # events / types / medium / a row's type (the compiled
        raise ArgumentTypeError(str(e)) from None      # call checks them all)
    except ValueError as e:
        raise ArgumentValueError(str(e)) from None
    return _stats(st, bit, r)


cdef tuple _refusals(EventState st, object index, object spec_kinds):
    """The index's per-group spec-kind refusals for ``spec_kinds`` (cached per object)."""
    cdef tuple refused
    if spec_kinds is None:
        return st.no_refusals
    if spec_kinds is st.kinds:
        return st.refused
    refused = index._refused_kinds(spec_kinds)
    st.kinds = spec_kinds
    st.refused = refused
    return refused


cdef object _stats(EventState st, Py_ssize_t bit, int64_t* r):
    """The table's seven counts -> the index's ApplyStats (rows of an unknown engine are
    counted as such)."""
    if bit < 0:         # (stored, removed, ignored, unknown_engine, cleared, other, lookahead)
        r[3] = r[4]
        r[0] = r[1] = r[2] = r[4] = 0
    else:
        r[4], r[3] = r[3], 0
    return counts7(st.stats_cls, r)


def index_apply_payload(self, key, payload, *, dp_rank=0, medium="GPU", spec_kinds=None):
    """Apply one KV event batch from the msgpack bytes vLLM's publisher sends (the third
    frame of its message) in one compiled call: no Python object per event or per hash,
    the token ids stepped over in place.

    Args:
        key: the engine key.
        payload: the batch's bytes (exactly ``bytes``).
        dp_rank: the stream's data-parallel rank; a batch naming another is declined.
        medium, spec_kinds: as :meth:`apply_events`.

    Returns the ``ApplyStats`` ``apply_events`` returns for the same batch decoded, or
    None: declined, nothing applied. It declines what it does not read exactly as msgspec
    would and everything the decoded path refuses (the list is in
    hmacore/_fast/_route_payload.pxi); the caller then decodes the payload and calls
    ``apply_events``, which applies it or refuses it naming the rule. ``RoutingIndex.
    apply_payload`` is this function."""
    if type(payload) is not bytes:
        raise ArgumentTypeError(f"payload must be bytes (a KV event batch's msgpack), got "
                                f"{type(payload).__name__}")
    stats, done = _apply_payloads(self, key, [payload], dp_rank, medium, spec_kinds)
    return stats if done else None


def index_apply_payloads(self, key, payloads, *, dp_rank=0, medium="GPU", spec_kinds=None):
    """Consecutive KV event batches of one engine (a list of payloads, in stream order) in
    one compiled call: each is read as :func:`index_apply_payload` reads it until one is
    declined; those before it are applied (in order, as one call each would). Returns
    ``(ApplyStats summed over the batches applied, how many were applied)``; the caller
    takes ``payloads[applied]`` (declined, nothing of it applied) by the decoded path and
    goes on after it. ``RoutingIndex.apply_payloads`` is this function (the KV event
    subscriber's path for what queued up on its socket)."""
    if type(payloads) is not list:
        raise ArgumentTypeError(f"payloads must be a list of bytes, got "
                                f"{type(payloads).__name__}")
    return _apply_payloads(self, key, list(payloads), dp_rank, medium, spec_kinds)


cdef tuple _apply_payloads(object index, object key, list payloads, object dp_rank,
                           object medium, object spec_kinds):
    """The two entry points' body: (ApplyStats, applied) for payloads the caller does not
    hold elsewhere (a fresh list)."""
    cdef EventState st = <EventState?>index._ev
    cdef tuple refused = _refusals(st, index, spec_kinds)
    cdef Py_ssize_t bit = -1, done
    cdef int64_t r[7]
    cdef object got
    if type(dp_rank) is not int or dp_rank < 0 or dp_rank >= 2**63:
        raise ArgumentValueError(f"dp_rank must be an int in [0, 2**63), got {dp_rank!r}")
    try:
        st.acquire()
        try:
            got = st.engines.get(key)
            bit = -1 if got is None else <Py_ssize_t>got
            done = st.res._apply_payloads(bit, payloads, medium, refused, st.num_groups,
                                          <int64_t>dp_rank, r)
        finally:
            st.release()
    except TypeError as e:      # a payload / medium / refusal tables
        raise ArgumentTypeError(str(e)) from None
    if done == 0:
        r[0] = r[1] = r[2] = r[3] = r[4] = r[5] = r[6] = 0
    return _stats(st, bit, r), done


def pack_event_lists(list ops, list groups, list hashes, int num_groups):
    """Event rows as Python lists (as msgspec decodes a batch) -> (ops int8, groups int32,
    (N, 8) uint8 keys: the 64-bit hash big-endian, the number of clears), in one typed pass.
    Raises ValueError / TypeError / OverflowError naming the first bad row."""
    cdef Py_ssize_t n = len(ops), i, clears = 0
    cdef long op, g
    cdef unsigned long long v
    cdef object item
    if len(groups) != n or len(hashes) != n:
        raise ValueError(f"ops, groups and hashes must have one entry per row: "
                         f"{n} ops, {len(groups)} groups, {len(hashes)} hashes")
    ops_a = np.empty(n, np.int8)
    groups_a = np.empty(n, np.int32)
    keys = np.empty((n, 8), np.uint8)
    cdef int8_t* o = <int8_t*>cnp.PyArray_DATA(ops_a)
    cdef int32_t* gr = <int32_t*>cnp.PyArray_DATA(groups_a)
    cdef uint8_t* k = <uint8_t*>cnp.PyArray_DATA(keys)
    # no user code runs in this loop (exact ints only), so the lists cannot change under it
    for i in range(n):
        item = ops[i]
        if type(item) is not int:
            raise TypeError(f"ops[{i}] must be an int, got {type(item).__name__}")
        if as_long(<PyObject*>item, &op) < 0 or op < -1 or op > 1:
            raise ValueError(f"ops[{i}] must be 1 (store), -1 (remove) or 0 (clear), "
                             f"got {item}")
        o[i] = <int8_t>op
        clears += op == 0
        item = groups[i]
        if type(item) is not int:
            raise TypeError(f"groups[{i}] must be an int, got {type(item).__name__}")
        if op != 0:
            if as_long(<PyObject*>item, &g) < 0 or g < 0 or g >= num_groups:
                raise ValueError(f"groups[{i}] must be a group id in [0, {num_groups}), "
                                 f"got {item}")
            gr[i] = <int32_t>g
        else:
            gr[i] = 0
        item = hashes[i]
        if type(item) is not int:
            raise TypeError(f"hashes[{i}] must be an int (a 64-bit hash), got "
                            f"{type(item).__name__}")
        if as_u64(<PyObject*>item, &v) < 0:
            raise OverflowError(f"hashes[{i}] must be in [0, 2**64), got {item}")
        _put_be64(k + i * 8, v)
    return ops_a, groups_a, keys, clears
