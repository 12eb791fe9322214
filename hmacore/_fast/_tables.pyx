"""Typed kernels for hmacore.tables: id conversion/validation, unhashed-block selection, and
the per-request growable int32 block tables that back TrackerSet.

Every function here trusts the shapes/dtypes the Python layer (hmacore/tables.py) checked;
the Python layer turns the IdStatus codes returned here into BlockTableError messages.
"""
from cpython.bool cimport PyBool_Check
from cpython.long cimport PyLong_Check
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.string cimport memcpy

import numpy as np

from hmacore._fast._types cimport block_id_t, flag_t, token_t

cdef extern from "Python.h":
    long long PyLong_AsLongLongAndOverflow(object, int*) except? -1

cdef long long INT32_MAX = 2147483647


cdef Py_ssize_t first_bad_id(const block_id_t[::1] ids, long long num_blocks) noexcept nogil:
    """Index of the first id < 0 or >= num_blocks (num_blocks <= 0: only the sign), else -1."""
    cdef Py_ssize_t i, n = ids.shape[0]
    if num_blocks > 0:
        for i in range(n):
            if ids[i] < 0 or ids[i] >= num_blocks:
                return i
    else:
        for i in range(n):
            if ids[i] < 0:
                return i
    return -1


def scan_int32(const block_id_t[::1] ids, long long num_blocks):
    """``(status, index)`` of the first bad id of a contiguous int32 array, ``(ID_OK, -1)`` if none."""
    cdef Py_ssize_t i
    with nogil:
        i = first_bad_id(ids, num_blocks)
    if i < 0:
        return ID_OK, -1
    return (ID_NEGATIVE if ids[i] < 0 else ID_PAST_POOL), i


def seq_to_int32(object seq, long long num_blocks):
    """Convert a list/tuple of Python (or NumPy) integers to a fresh int32 array.

    Returns ``(array, ID_OK, -1)`` or ``(None, status, index)`` for the first bad element.
    Bools and floats are rejected (``True`` is not block 1).
    """
    cdef Py_ssize_t i, n = len(seq)
    cdef int overflow
    cdef long long v
    out = np.empty(n, dtype=np.int32)
    cdef block_id_t[::1] o = out
    for i in range(n):
        x = seq[i]
        if PyBool_Check(x):
            return None, ID_NOT_INT, i
        if not PyLong_Check(x):
            if isinstance(x, np.integer):
                x = int(x)
            else:
                return None, ID_NOT_INT, i
        v = PyLong_AsLongLongAndOverflow(x, &overflow)
        if overflow < 0 or (overflow == 0 and v < 0):
            return None, ID_NEGATIVE, i
        if overflow > 0 or v > INT32_MAX:
            return None, ID_PAST_INT32, i
        if num_blocks > 0 and v >= num_blocks:
            return None, ID_PAST_POOL, i
        o[i] = <block_id_t>v
    return out, ID_OK, -1


def select_unhashed(const block_id_t[::1] ids, const flag_t[::1] hashed, block_id_t[::1] out):
    """Write the blocks a connector must fill into ``out``; return how many.

    Skips the leading null (id 0) run, then keeps ids that are not hashed and not null
    (vLLM ``get_unhashed_block_ids_all_groups`` for one group). ``out`` needs len(ids) slots.
    """
    cdef Py_ssize_t i = 0, k = 0, n = ids.shape[0]
    with nogil:
        while i < n and ids[i] == 0:
            i += 1
        while i < n:
            if ids[i] != 0 and hashed[i] == 0:
                out[k] = ids[i]
                k += 1
            i += 1
    return k


def count_hashed_nonnull(const block_id_t[::1] ids, const flag_t[::1] hashed):
    """Number of positions with a hash and a non-null id (vLLM ``local_num_computed_blocks``)."""
    cdef Py_ssize_t i, k = 0, n = ids.shape[0]
    with nogil:
        for i in range(n):
            if ids[i] != 0 and hashed[i] != 0:
                k += 1
    return k


cdef class RequestTables:
    """Per-group block tables of one request in growable int32 buffers.

    Positions are stable: entry j of group g is block j of that group (id 0 = null). Lengths
    are blocks of the respective group. Callers validate ids; these methods only move memory.
    """

    def __cinit__(self, int num_groups):
        if num_groups <= 0:
            raise ValueError(f"num_groups must be >= 1, got {num_groups}")
        self.num_groups = num_groups
        self._lens = <Py_ssize_t*>PyMem_Malloc(num_groups * sizeof(Py_ssize_t))
        if self._lens == NULL:
            raise MemoryError()
        self._bufs = []
        for g in range(num_groups):
            self._lens[g] = 0
            self._bufs.append(np.empty(0, dtype=np.int32))
        self.scheduled_tokens = 0
        self.saved_tokens = 0
        self.loaded_tokens = 0
        self.num_prompt_tokens = 0
        self.state = 0

    def __dealloc__(self):
        PyMem_Free(self._lens)

    cdef void _reserve(self, int g, Py_ssize_t need) except *:
        # Amortised doubling; the old live prefix is copied once.
        old = self._bufs[g]
        cdef Py_ssize_t cap = old.shape[0]
        if need <= cap:
            return
        cdef Py_ssize_t new_cap = cap * 2 if cap * 2 > need else need
        if new_cap < 16:
            new_cap = 16
        new = np.empty(new_cap, dtype=np.int32)
        cdef block_id_t[::1] dst = new
        cdef block_id_t[::1] src = old
        if self._lens[g]:
            memcpy(&dst[0], &src[0], self._lens[g] * sizeof(block_id_t))
        self._bufs[g] = new

    cpdef Py_ssize_t length(self, int g):
        """Tracked blocks of group g."""
        return self._lens[g]

    cpdef Py_ssize_t append(self, int g, const block_id_t[::1] ids) except -1:
        """Append ``ids`` to group g; return the new length."""
        cdef Py_ssize_t n = ids.shape[0], base = self._lens[g]
        if n == 0:
            return base
        self._reserve(g, base + n)
        cdef block_id_t[::1] dst = self._bufs[g]
        memcpy(&dst[base], &ids[0], n * sizeof(block_id_t))
        self._lens[g] = base + n
        return base + n

    cpdef Py_ssize_t assign(self, int g, const block_id_t[::1] ids) except -1:
        """Replace group g's table with ``ids``; return the new length."""
        self._lens[g] = 0
        return self.append(g, ids)

    cpdef Py_ssize_t first_illegal_change(self, int g, const block_id_t[::1] full) except -2:
        """Check a full table of group g against the tracked one.

        Returns -1 when ``full`` is legal: at least as long as the tracked table, and every
        tracked position either unchanged or changed from a real id to the null id 0.
        Otherwise the first offending position (``len(full)`` when the table shrank).
        """
        cdef Py_ssize_t i, n = self._lens[g]
        if full.shape[0] < n:
            return full.shape[0]
        if n == 0:
            return -1
        cdef const block_id_t[::1] cur = self._bufs[g]
        with nogil:
            for i in range(n):
                if full[i] != cur[i] and full[i] != 0:
                    return i
        return -1

    cpdef Py_ssize_t merge_full(self, int g, const block_id_t[::1] full) except -1:
        """Apply a legal full table (see first_illegal_change): null freed positions in place,
        append the suffix past the tracked length. Returns the number of appended blocks."""
        cdef Py_ssize_t i, n = self._lens[g], m = full.shape[0]
        cdef block_id_t[::1] cur
        if n:
            cur = self._bufs[g]
            with nogil:
                for i in range(n):
                    if full[i] == 0:
                        cur[i] = 0
        if m > n:
            self.append(g, full[n:])
        return m - n

    cpdef object copy_group(self, int g):
        """A fresh int32 array holding group g's table."""
        return self._bufs[g][:self._lens[g]].copy()

    cpdef object take_group(self, int g):
        """Group g's table as an array the caller owns (no copy); the group is emptied."""
        out = self._bufs[g][:self._lens[g]]
        self._bufs[g] = np.empty(0, dtype=np.int32)
        self._lens[g] = 0
        return out

    cpdef void clear(self):
        """Empty every group (buffers are kept for reuse)."""
        cdef int g
        for g in range(self.num_groups):
            self._lens[g] = 0


# Python-visible copies of the IdStatus codes.
STATUS_OK = ID_OK
STATUS_NOT_INT = ID_NOT_INT
STATUS_NEGATIVE = ID_NEGATIVE
STATUS_PAST_INT32 = ID_PAST_INT32
STATUS_PAST_POOL = ID_PAST_POOL
