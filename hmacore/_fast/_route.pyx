"""Engines' counted (group, hash) residency in one shared table, and the routing query.

vLLM's prefix cache maps a (group, hash) key to a *set* of blocks (two requests that compute
the same block before either is cached both insert it), and emits one ``BlockStored`` hash
per insertion and one ``BlockRemoved`` hash per removal. A key is resident on an engine while
its count there is positive.

``SharedResidency`` keeps every engine's residency in one open-addressing table: a slot is a
4-byte tag (group id, -1 empty, -2 deleted) + the digest, and beside it the key's engine mask
(``words`` uint64 words, bit b = engine b holds the key at count >= 1). A slot lives while
some engine holds the key. Counts above 1 are rare; per engine they are nested layers of
``ExistenceSet`` (a key of count c is in duplicate layers 0..c-2).

A query probes the table once per (group, hash row) its rule reaches, for all engines at
once: the probes are memoised per query (``hit_over_masks`` in _hits.pyx runs vLLM's rule for
each engine over the memo), so an engine whose hit covers rows another engine already probed
costs a bit test per row.

Rows are applied in order: op 1 stores (count + 1), op -1 removes (count - 1, a no-op at 0),
op 0 clears the engine (``AllBlocksCleared``). The caller validated ops, groups and digests.
Not thread-safe by itself: RoutingIndex serialises every call with its lock.
"""
from libc.stdint cimport int8_t, int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free, malloc
from libc.string cimport memcmp, memcpy, memset

import numpy as np

from hmacore._fast._hits cimport (ExistenceSet, KernelTables, hit_over_masks, kernel_tables,
                                  mask_fill_t)
from hmacore._fast._slots cimport SLOT_DELETED, SLOT_EMPTY, probe_slots
from hmacore._fast._types cimport group_id_t, token_t

cdef Py_ssize_t MIN_CAP = 16
# 2**50 keys: every byte count below (slots x (20..36 + 8 x words)) stays below 2**63
cdef Py_ssize_t MAX_KEYS = 1 << 50
# engine bits: 2**16 engines (1024 mask words) at most
MAX_ENGINES = 1 << 16
cdef uint64_t ZERO_MASK[1024]
memset(ZERO_MASK, 0, sizeof(ZERO_MASK))


cdef inline uint64_t _mix(uint64_t x) noexcept nogil:
    # splitmix64's finaliser: every input bit reaches every output bit
    x ^= x >> 30
    x *= 0xbf58476d1ce4e5b9ULL
    x ^= x >> 27
    x *= 0x94d049bb133111ebULL
    x ^= x >> 31
    return x


cdef inline uint64_t _key_hash(group_id_t g, const uint8_t* d, int ds) noexcept nogil:
    """Hash of (group, digest): the last 16 digest bytes (an int hash's 8 bytes are the last
    8) mixed with the group id."""
    cdef uint64_t w0, w1
    memcpy(&w0, d + ds - 16, 8)
    memcpy(&w1, d + ds - 8, 8)
    return _mix(w1 ^ _mix(w0 ^ (<uint64_t><uint32_t>g) * 0x9e3779b97f4a7c15ULL))


cdef struct FillState:
    const uint8_t* slots
    const uint64_t* masks
    const uint8_t* hashes     # the query's (n_rows, ds) rows
    Py_ssize_t cap, slot_size, words, size
    int ds


cdef const uint64_t* _fill(void* state, group_id_t g, Py_ssize_t row) noexcept nogil:
    """The engine mask of key (g, query row ``row``), or a zero mask if no engine holds it."""
    cdef FillState* st = <FillState*>state
    cdef const uint8_t* d = st.hashes + row * st.ds
    cdef Py_ssize_t mask, j
    cdef group_id_t tag
    cdef const uint8_t* slot
    if st.size == 0:
        return ZERO_MASK
    mask = st.cap - 1
    j = <Py_ssize_t>(_key_hash(g, d, st.ds) & <uint64_t>mask)
    while True:
        slot = st.slots + j * st.slot_size
        memcpy(&tag, slot, 4)
        if tag == SLOT_EMPTY:
            return ZERO_MASK
        if tag == g and memcmp(slot + 4, d, st.ds) == 0:
            return st.masks + j * st.words
        j = (j + 1) & mask


cdef class SharedResidency:
    """Every engine's counted (group, hash) residency: one key table with an engine mask per
    key (see the module docstring). Engines are mask bits from :meth:`add_engine`."""
    cdef readonly int digest_size
    cdef uint8_t* _slots           # _cap * _slot_size
    cdef uint64_t* _masks          # _cap * _words
    cdef Py_ssize_t _cap, _size, _used, _slot_size, _words
    cdef list _resident            # per bit: distinct keys held (count >= 1)
    cdef list _dups                # per bit: list of ExistenceSet (count >= 2, >= 3, ...)
    cdef list _live                # per bit: in use

    def __cinit__(self, int digest_size=16):
        if digest_size not in (16, 32):
            raise ValueError(f"digest_size must be 16 or 32 bytes, got {digest_size}")
        self.digest_size = digest_size
        self._slot_size = 4 + digest_size
        self._slots = NULL
        self._masks = NULL
        self._cap = self._size = self._used = 0
        self._words = 1
        self._resident = []
        self._dups = []
        self._live = []

    def __dealloc__(self):
        free(self._slots)
        free(self._masks)

    def __reduce__(self):
        raise TypeError("SharedResidency cannot be pickled (a raw table owned by one "
                        "RoutingIndex); rebuild the index from the engines' event streams")

    # -- table ---------------------------------------------------------------------------
    cdef inline Py_ssize_t _probe(self, group_id_t g, const uint8_t* d,
                                  Py_ssize_t* insert_at) noexcept nogil:
        """Slot of key (g, d) or -1 (``_slots.probe_slots``). Requires _cap > 0."""
        return probe_slots(self._slots, self._cap, self._slot_size, self.digest_size, g, d,
                           _key_hash(g, d, self.digest_size), insert_at)

    cdef int _rehash(self, Py_ssize_t cap, Py_ssize_t words) noexcept nogil:
        """Rebuild with ``cap`` slots and ``words`` mask words (>= the current); -1 if out of
        memory (the table is then unchanged)."""
        cdef uint8_t* slots = <uint8_t*>malloc(cap * self._slot_size)
        cdef uint64_t* masks = <uint64_t*>calloc(cap * words, 8)
        cdef Py_ssize_t i, j, m = cap - 1
        cdef group_id_t tag
        cdef uint8_t* src
        if slots == NULL or masks == NULL:
            free(slots)
            free(masks)
            return -1
        memset(slots, 0xFF, cap * self._slot_size)
        for i in range(self._cap):
            src = self._slots + i * self._slot_size
            memcpy(&tag, src, 4)
            if tag < 0:
                continue
            j = <Py_ssize_t>(_key_hash(tag, src + 4, self.digest_size) & <uint64_t>m)
            while True:
                memcpy(&tag, slots + j * self._slot_size, 4)
                if tag == SLOT_EMPTY:
                    break
                j = (j + 1) & m
            memcpy(slots + j * self._slot_size, src, self._slot_size)
            memcpy(masks + j * words, self._masks + i * self._words, self._words * 8)
        free(self._slots)
        free(self._masks)
        self._slots = slots
        self._masks = masks
        self._cap = cap
        self._words = words
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

    cdef int _set(self, group_id_t g, const uint8_t* d, Py_ssize_t w, uint64_t b) noexcept nogil:
        """Set the engine bit of key (g, d): 1 if newly set, 0 if it was set, -1 no memory."""
        cdef Py_ssize_t at = -1, j
        cdef group_id_t tag
        cdef uint8_t* slot
        if self._reserve(1) < 0:
            return -1
        j = self._probe(g, d, &at)
        if j >= 0:
            if self._masks[j * self._words + w] & b:
                return 0
            self._masks[j * self._words + w] |= b
            return 1
        slot = self._slots + at * self._slot_size
        memcpy(&tag, slot, 4)
        if tag == SLOT_EMPTY:
            self._used += 1
        memcpy(slot, &g, 4)
        memcpy(slot + 4, d, self.digest_size)
        memset(self._masks + at * self._words, 0, self._words * 8)
        self._masks[at * self._words + w] = b
        self._size += 1
        return 1

    cdef void _unset_slot(self, Py_ssize_t j, Py_ssize_t w, uint64_t b) noexcept nogil:
        """Clear the engine bit of slot j; a slot no engine holds any more is deleted."""
        cdef Py_ssize_t k
        cdef uint64_t* m = self._masks + j * self._words
        cdef group_id_t tag = SLOT_DELETED
        m[w] &= ~b
        for k in range(self._words):
            if m[k]:
                return
        memcpy(self._slots + j * self._slot_size, &tag, 4)
        self._size -= 1

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
        cdef Py_ssize_t j, w = bit >> 6
        cdef uint64_t b = (<uint64_t>1) << (bit & 63)
        cdef group_id_t tag
        if self._resident[bit]:
            for j in range(self._cap):
                memcpy(&tag, self._slots + j * self._slot_size, 4)
                if tag >= 0 and self._masks[j * self._words + w] & b:
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
        """Bytes of the shared table (slots and masks; duplicate layers not included)."""
        return self._cap * (self._slot_size + 8 * self._words)

    @property
    def num_keys(self):
        """Distinct keys held by at least one engine."""
        return self._size

    # -- events --------------------------------------------------------------------------
    def apply_rows(self, Py_ssize_t bit, const int8_t[::1] ops, const int32_t[::1] groups,
                   const uint8_t[:, ::1] digests):
        """Apply rows to engine ``bit``; returns ``(stored, removed, ignored, applied)``:
        stores (every store counts), removes that lowered a count, removes of a key not
        resident (no-ops), rows applied (== len(ops); if memory runs out MemoryError is
        raised, naming the rows applied before it)."""
        self._check(bit)
        cdef Py_ssize_t n = ops.shape[0], i, j, stores = 0, w = bit >> 6
        cdef uint64_t b = (<uint64_t>1) << (bit & 63)
        cdef int64_t stored = 0, removed = 0, ignored = 0, resident = self._resident[bit]
        cdef int rc = 0
        cdef int8_t op
        cdef list dups = self._dups[bit]
        if groups.shape[0] != n or digests.shape[0] != n:
            raise ValueError("ops, groups and digests must have one row each")
        if n and digests.shape[1] != self.digest_size:
            raise ValueError(f"digests must be {self.digest_size} bytes wide")
        for i in range(n):
            stores += ops[i] > 0
        if self._reserve(stores) < 0:
            raise MemoryError(f"KV events: no room for {stores} more keys (nothing applied)")
        try:
            for i in range(n):
                op = ops[i]
                if op > 0:
                    rc = self._set(groups[i], &digests[i, 0], w, b)
                    if rc < 0:
                        raise MemoryError(f"KV event row {i}: out of memory ({i} rows applied)")
                    if rc == 1:
                        resident += 1
                    elif _store_duplicate(dups, self.digest_size, groups[i],
                                          &digests[i, 0]) < 0:
                        raise MemoryError(f"KV event row {i}: out of memory ({i} rows applied)")
                    stored += 1
                elif op < 0:
                    # one probe: the duplicate layers never move the table's slots
                    j = self._probe(groups[i], &digests[i, 0], NULL) if self._size else -1
                    if j < 0 or not (self._masks[j * self._words + w] & b):
                        ignored += 1
                        continue
                    removed += 1
                    if dups and _remove_duplicate(dups, groups[i], &digests[i, 0]):
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
        return stored, removed, ignored, n

    # -- queries -------------------------------------------------------------------------
    def hits(self, kernel, int num_groups, const uint8_t[:, ::1] hashes, token_t max_length,
             bits):
        """Per engine bit of ``bits`` (a sequence), its hit in tokens by ``kernel``'s rule (a
        HitKernel; group ids < ``num_groups``) for the query rows ``hashes`` capped at
        ``max_length``: an int64 array in the order of ``bits``."""
        cdef KernelTables kt
        kernel_tables(kernel, &kt)          # pointers valid while `kernel` is referenced
        cdef Py_ssize_t n_rows = hashes.shape[0], e, nb = len(bits), bit, k
        cdef const int64_t[::1] bit_a = np.asarray(bits, dtype=np.int64)
        for e in range(nb):
            bit = bit_a[e]
            if not 0 <= bit < len(self._live) or not self._live[bit]:
                self._check(bit)
        for k in range(kt.num_members):
            if not 0 <= kt.members[k] < num_groups:
                raise ValueError("kernel group ids must be < num_groups")
        if n_rows and hashes.shape[1] != self.digest_size:
            raise ValueError(f"hashes must be {self.digest_size} bytes wide")
        out = np.zeros(nb, np.int64)
        cdef int64_t[::1] o = out
        if n_rows == 0 or nb == 0 or kt.S == 0:
            return out
        cdef const uint64_t** memo = <const uint64_t**>calloc(num_groups * n_rows,
                                                                sizeof(uint64_t*))
        cdef int64_t* spans = <int64_t*>malloc(kt.S * 2 * sizeof(int64_t))
        cdef FillState st
        if memo == NULL or spans == NULL:
            free(memo)
            free(spans)
            raise MemoryError("routing query: no memory for the probe memo")
        st.slots = self._slots
        st.masks = self._masks
        st.hashes = &hashes[0, 0]
        st.cap = self._cap
        st.slot_size = self._slot_size
        st.words = self._words
        st.size = self._size
        st.ds = self.digest_size
        try:
            # the GIL stays held: the memo points into this table's arrays, which only a
            # call on this object (serialised by the GIL, and by RoutingIndex's lock) changes
            for e in range(nb):
                bit = bit_a[e]
                o[e] = hit_over_masks(&kt, n_rows, max_length, memo, _fill, &st,
                                      bit >> 6, (<uint64_t>1) << (bit & 63), spans)
        finally:
            free(memo)
            free(spans)
        return out


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
    layer = ExistenceSet(ds)
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


def pack_event_lists(list ops, list groups, list hashes, int num_groups):
    """Event rows as Python lists (as msgspec decodes a batch) -> (ops int8, groups int32,
    (N, 16) uint8 keys: 8 zero bytes + the 64-bit hash big-endian), in one typed pass.
    Raises ValueError / TypeError / OverflowError naming the first bad row."""
    cdef Py_ssize_t n = len(ops), i, b
    cdef long op, g
    cdef unsigned long long v
    if len(groups) != n or len(hashes) != n:
        raise ValueError(f"ops, groups and hashes must have one entry per row: "
                         f"{n} ops, {len(groups)} groups, {len(hashes)} hashes")
    ops_a = np.empty(n, np.int8)
    groups_a = np.empty(n, np.int32)
    keys = np.zeros((n, 16), np.uint8)
    cdef int8_t[::1] o = ops_a
    cdef int32_t[::1] gr = groups_a
    cdef uint8_t[:, ::1] k = keys
    for i in range(n):
        item = ops[i]
        if type(item) is not int:
            raise TypeError(f"ops[{i}] must be an int, got {type(item).__name__}")
        op = item
        if op < -1 or op > 1:
            raise ValueError(f"ops[{i}] must be 1 (store), -1 (remove) or 0 (clear), got {op}")
        o[i] = <int8_t>op
        item = groups[i]
        if type(item) is not int:
            raise TypeError(f"groups[{i}] must be an int, got {type(item).__name__}")
        g = item
        if op != 0 and (g < 0 or g >= num_groups):
            raise ValueError(f"groups[{i}] must be a group id in [0, {num_groups}), got {g}")
        gr[i] = <int32_t>(g if op != 0 else 0)
        item = hashes[i]
        if type(item) is not int:
            raise TypeError(f"hashes[{i}] must be an int (a 64-bit hash), got {type(item).__name__}")
        if item < 0:
            raise OverflowError(f"hashes[{i}] must be in [0, 2**64), got {item}")
        v = item                     # OverflowError past 2**64 - 1
        for b in range(8):
            k[i, 15 - b] = <uint8_t>(v >> (8 * b))
    return ops_a, groups_a, keys
