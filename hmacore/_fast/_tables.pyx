"""Typed kernels for hmacore.tables: id conversion/validation, unhashed-block selection, the
growable int32 block tables of every tracked request by slot (TableStore, what TrackerSet
keeps).

Every function here trusts the shapes/dtypes the Python layer (hmacore/tables.py) checked;
the Python layer turns the IdStatus codes returned here into BlockTableError messages.
List input is converted by the shared :func:`_helpers.seq_to_ids` (re-measures the list
before every element: user code run by a conversion can never make it read past the end).
"""
from cpython.list cimport PyList_Check, PyList_GET_ITEM
from cpython.mem cimport PyMem_Free, PyMem_Malloc, PyMem_Realloc
from cpython.object cimport PyObject
from cpython.tuple cimport PyTuple_Check
from libc.stdlib cimport qsort
from libc.string cimport memcpy

import numpy as np
cimport numpy as cnp

from hmacore._fast._types cimport (block_id_t, flag_t, token_t, BLOCK_ID_NPY, BLOCK_ID_MAX,
                                   DESC_ID_NPY, DESC_ID32_NPY, FLAG_NPY, GROUP_ID_NPY,
                                   TOKEN_NPY)
from hmacore._fast._helpers cimport (ID_OK, ID_NOT_INT, ID_NEGATIVE, ID_PAST_INT32,
                                     ID_PAST_POOL, ID_NULL, ID_CHANGED, clip_span,
                                     first_id_out_of_range, id_bound, is_block_id_array,
                                     is_c1d_signed,
                                     is_list_or_tuple, seq_to_ids)

cnp.import_array()

cdef extern from "Python.h":
    Py_ssize_t Py_REFCNT(PyObject*)
    bint PyUnicode_CheckExact(PyObject*)
    bint PyLong_CheckExact(PyObject*)
    long long PyLong_AsLongLongAndOverflow(object, int*) except? -1
    Py_ssize_t PySequence_Fast_GET_SIZE(object)
    PyObject* PySequence_Fast_GET_ITEM(object, Py_ssize_t)

# Python-level dtypes of the C typedefs of _types.pxd (the one source of truth).
BLOCK_ID_DTYPE = cnp.PyArray_DescrFromType(BLOCK_ID_NPY)
DESC_ID_DTYPE = cnp.PyArray_DescrFromType(DESC_ID_NPY)
DESC_ID32_DTYPE = cnp.PyArray_DescrFromType(DESC_ID32_NPY)
TOKEN_DTYPE = cnp.PyArray_DescrFromType(TOKEN_NPY)
FLAG_DTYPE = cnp.PyArray_DescrFromType(FLAG_NPY)
GROUP_ID_DTYPE = cnp.PyArray_DescrFromType(GROUP_ID_NPY)
if BLOCK_ID_DTYPE.itemsize != sizeof(block_id_t) or TOKEN_DTYPE.itemsize != sizeof(token_t) \
        or FLAG_DTYPE.itemsize != sizeof(flag_t):
    raise ImportError("hmacore._fast: _types.pxd typedefs and NumPy type numbers disagree")
BLOCK_ID_LIMIT = <long long>BLOCK_ID_MAX + 1     # ids are < 2**31

cdef extern from *:
    """
    #if defined(__GNUC__) || defined(__clang__)
    #define HMACORE_PREFETCH_W(p) __builtin_prefetch((const void *)(p), 1, 3)
    #else
    #define HMACORE_PREFETCH_W(p) ((void)(p))
    #endif
    """
    void prefetch_w "HMACORE_PREFETCH_W" (const void* p) noexcept nogil

cdef enum:
    _READ_AHEAD = 16        # int objects requested ahead of the one being converted


cdef int read_ids_ahead(object seq, Py_ssize_t start, Py_ssize_t end, long long lo,
                        long long hi, bint exact_int, block_id_t* dst,
                        Py_ssize_t* bad) except -1:
    """:func:`seq_to_ids` over ``seq[start:end]`` (same checks, results and safety), in
    chunks of ``_READ_AHEAD`` whose int objects are requested from memory while the chunk
    before them converts. vLLM's ids are one scattered int object each, usually out of
    cache when a connector reads them: without the read-ahead every id waits for its own
    cache miss, with it the misses of a chunk overlap. A prefetch never faults; only slots
    below the list's current length are read (re-measured per chunk; seq_to_ids re-measures
    per element)."""
    cdef Py_ssize_t i = start, j, n, stop
    cdef int status
    stop = min(start + _READ_AHEAD, end, PySequence_Fast_GET_SIZE(seq))
    for j in range(start, stop):
        prefetch_w(PySequence_Fast_GET_ITEM(seq, j))
    while i < end:
        n = min(<Py_ssize_t>_READ_AHEAD, end - i)
        stop = min(i + n + _READ_AHEAD, end, PySequence_Fast_GET_SIZE(seq))
        for j in range(i + n, stop):
            prefetch_w(PySequence_Fast_GET_ITEM(seq, j))
        status = seq_to_ids(seq, i, i + n, lo, hi, exact_int,
                            NULL if dst == NULL else dst + (i - start), bad)
        if status != ID_OK:
            return status
        i += n
    return ID_OK


cdef Py_ssize_t first_bad_id(const block_id_t[::1] ids, long long num_blocks) noexcept nogil:
    """Index of the first id < 0 or >= num_blocks (num_blocks <= 0: only the sign), else -1."""
    if ids.shape[0] == 0:
        return -1
    return first_id_out_of_range(&ids[0], ids.shape[0], 0, id_bound(num_blocks))


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

    Returns ``(array, ID_OK, -1)`` or ``(None, status, index)`` for the first bad element
    (STATUS_CHANGED: the list shrank while it was being converted, e.g. from an ``__int__``
    of one of its elements). Bools and floats are rejected (``True`` is not block 1).
    Other sequences are copied into a list first.
    """
    cdef Py_ssize_t n, bad = -1
    cdef int status
    if not (PyList_Check(seq) or PyTuple_Check(seq)):
        seq = list(seq)
    n = PySequence_Fast_GET_SIZE(seq)
    cdef cnp.npy_intp dim = n
    out = cnp.PyArray_EMPTY(1, &dim, BLOCK_ID_NPY, 0)
    status = seq_to_ids(seq, 0, n, 0, id_bound(num_blocks), False,
                        <block_id_t*>cnp.PyArray_DATA(<cnp.ndarray>out), &bad)
    if status != ID_OK:
        return None, status, bad
    return out, ID_OK, -1


def objects_to_ids(object seq, str id_attr, str flag_attr):
    """Read ``id_attr`` (an exact int id) and whether ``flag_attr`` is not None from every
    object of a list/tuple, in one C pass: ``(ids int32, flags uint8, ID_OK, -1)`` or
    ``(None, None, status, index)`` for the first object whose id is bad.

    What a connector needs from vLLM's ``KVCacheBlock`` objects (``block_id``, ``block_hash``)
    without a Python object per block. ``getattr`` may run user code (a property): the
    list is re-measured before every element (ID_CHANGED if it shrank), each object is held
    by a strong reference while it is read, and the outputs are fresh arrays held here.
    Terminates: ``i`` runs once over the list's length at entry.
    """
    cdef Py_ssize_t n, i
    cdef long long v
    cdef int overflow = 0
    if not is_list_or_tuple(seq):
        seq = list(seq)
    n = PySequence_Fast_GET_SIZE(seq)
    cdef cnp.npy_intp dim = n
    ids = cnp.PyArray_EMPTY(1, &dim, BLOCK_ID_NPY, 0)
    flags = cnp.PyArray_EMPTY(1, &dim, FLAG_NPY, 0)
    cdef block_id_t* dst = <block_id_t*>cnp.PyArray_DATA(<cnp.ndarray>ids)
    cdef flag_t* fdst = <flag_t*>cnp.PyArray_DATA(<cnp.ndarray>flags)
    cdef object obj, x
    for i in range(n):
        if PySequence_Fast_GET_SIZE(seq) <= i:
            return None, None, ID_CHANGED, i
        obj = <object>PySequence_Fast_GET_ITEM(seq, i)
        x = getattr(obj, id_attr)
        if not PyLong_CheckExact(<PyObject*>x):
            return None, None, ID_NOT_INT, i
        v = PyLong_AsLongLongAndOverflow(x, &overflow)
        if overflow > 0 or v > BLOCK_ID_MAX:
            return None, None, ID_PAST_INT32, i
        if overflow < 0 or v < 0:
            return None, None, ID_NEGATIVE, i
        dst[i] = <block_id_t>v
        fdst[i] = getattr(obj, flag_attr) is not None
    return ids, flags, ID_OK, -1


cdef tuple _pair_span(const block_id_t[::1] mine, const block_id_t[::1] theirs,
                      Py_ssize_t lo, Py_ssize_t hi):
    """``(mine[p], theirs[p])`` for ``lo <= p < hi`` where both are non-null, as two fresh
    int32 arrays (``hi`` already clipped to both lengths)."""
    cdef Py_ssize_t p, n = 0
    for p in range(lo, hi):
        if mine[p] < 0 or theirs[p] < 0:
            raise ValueError(f"pair_block_spans: negative block id at position {p}")
        n += mine[p] != 0 and theirs[p] != 0
    cdef cnp.npy_intp dim = n
    a = cnp.PyArray_EMPTY(1, &dim, BLOCK_ID_NPY, 0)
    b = cnp.PyArray_EMPTY(1, &dim, BLOCK_ID_NPY, 0)
    cdef block_id_t* pa = <block_id_t*>cnp.PyArray_DATA(<cnp.ndarray>a)
    cdef block_id_t* pb = <block_id_t*>cnp.PyArray_DATA(<cnp.ndarray>b)
    n = 0
    for p in range(lo, hi):
        if mine[p] != 0 and theirs[p] != 0:
            pa[n] = mine[p]
            pb[n] = theirs[p]
            n += 1
    return a, b


def pair_block_spans(tuple mine, tuple theirs, tuple block_sizes, token_t start,
                     token_t end):
    """Per group g, the blocks covering tokens ``[start, end)`` paired position by position
    between two positional tables (``mine[g]``, ``theirs[g]``: contiguous int32), skipping a
    position where either side holds the null block: ``(local, remote)``, tuples of int32
    arrays. One call per request and step (push mode's WRITE pairs): no Python object per
    block. ``block_sizes[g] >= 1`` tokens; positions past either table are not paired.
    Terminates: one bounded pass per group. The GIL is held (the arrays cannot go away)."""
    cdef Py_ssize_t g, ng = len(block_sizes)
    cdef token_t bs, lo, hi
    if len(mine) != ng or len(theirs) != ng:
        raise ValueError(f"pair_block_spans: {len(mine)} / {len(theirs)} tables for {ng} groups")
    if start < 0 or end < start:
        raise ValueError(f"pair_block_spans: bad token span [{start}, {end})")
    local, remote = [], []
    for g in range(ng):
        bs = block_sizes[g]
        if bs < 1:
            raise ValueError(f"pair_block_spans: group {g} block size {bs} < 1")
        m, t = mine[g], theirs[g]
        lo = start // bs
        hi = end // bs + (end % bs != 0)
        hi = max(lo, min(hi, <token_t>len(m), <token_t>len(t)))
        a, b = _pair_span(m, t, lo, hi)
        local.append(a)
        remote.append(b)
    return tuple(local), tuple(remote)


cdef int _check_int_seq(object seq, long long num_blocks, Py_ssize_t* bad) except -2:
    """Status of a list/tuple of exact Python ints; -1 = not a list/tuple of exact ints
    (the general path decides)."""
    if not is_list_or_tuple(seq):
        return -1
    cdef int status = read_ids_ahead(seq, 0, PySequence_Fast_GET_SIZE(seq), 0,
                                     id_bound(num_blocks), True, NULL, bad)
    if status == ID_NOT_INT or status == ID_CHANGED:
        return -1
    return status


def check_int_table(object groups, int num_groups, long long num_blocks, bint allow_none):
    """Fast pre-check of the common input shape: a list/tuple of ``num_groups`` lists/tuples
    of Python ints (``None`` groups allowed when ``allow_none``).

    Returns ``True`` when the table is valid and in that shape (then
    :meth:`TableStore.extend_groups` may consume it directly), ``False`` when the caller
    must take the general path (which also produces the error messages).
    """
    cdef Py_ssize_t g, bad = -1
    if not is_list_or_tuple(groups) or PySequence_Fast_GET_SIZE(groups) != num_groups:
        return False
    for g in range(num_groups):   # no user code runs in this loop: groups keeps its size
        seq = <object>PySequence_Fast_GET_ITEM(groups, g)
        if seq is None and allow_none:
            continue
        if _check_int_seq(seq, num_blocks, &bad) != ID_OK:
            return False
    return True


def index_identical(object seq, object item):
    """Index of the first element of ``seq`` (list or tuple) that *is* ``item``, else -1.

    Compares pointers only: no element object is read, so finding one request id among a
    scheduler step's hundreds (vLLM's ``CachedRequestData.req_ids``) costs one pass over the
    list's pointer array, not a cache miss per other id's string (``list.index`` compares by
    value). A caller falls back to ``list.index`` on -1 (an equal but distinct object).
    TypeError for anything but a list or tuple."""
    cdef Py_ssize_t i, n
    cdef PyObject* target = <PyObject*>item
    if not is_list_or_tuple(seq):
        raise TypeError(f"seq must be a list or tuple, got {type(seq).__name__}")
    n = PySequence_Fast_GET_SIZE(seq)
    for i in range(n):   # no user code runs in this loop: seq keeps its size
        if PySequence_Fast_GET_ITEM(seq, i) == target:
            return i
    return -1


def select_unhashed(const block_id_t[::1] ids, const flag_t[::1] hashed, block_id_t[::1] out):
    """Write the blocks a connector must fill into ``out``; return how many.

    Skips the leading null (id 0) run, then keeps ids that are not hashed and not null
    (vLLM ``get_unhashed_block_ids_all_groups`` for one group). ``out`` needs len(ids) slots.
    """
    cdef Py_ssize_t i = 0, k = 0, n = ids.shape[0]
    if hashed.shape[0] != n or out.shape[0] < n:
        raise ValueError(f"hashed must have {n} entries and out at least {n}, got "
                         f"{hashed.shape[0]} and {out.shape[0]}")
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
    if hashed.shape[0] != n:
        raise ValueError(f"hashed must have {n} entries, got {hashed.shape[0]}")
    with nogil:
        for i in range(n):
            if ids[i] != 0 and hashed[i] != 0:
                k += 1
    return k


STATUS_OK = ID_OK
STATUS_NOT_INT = ID_NOT_INT
STATUS_NEGATIVE = ID_NEGATIVE
STATUS_PAST_INT32 = ID_PAST_INT32
STATUS_PAST_POOL = ID_PAST_POOL
STATUS_NULL = ID_NULL
STATUS_CHANGED = ID_CHANGED


# ---------------------------------------------------------------------------------------
# Batched step input: every request's appended ids in one flat int32 array
# ---------------------------------------------------------------------------------------
def flatten_step(object new_block_ids, int num_groups):
    """vLLM's ``CachedRequestData.new_block_ids`` (a list, per request None or G lists of
    ints) -> ``(ids int32, offsets int64, None)`` for ``apply_step_flat``, or ``(None, None,
    message)`` naming the first bad entry. Two C passes (count, copy), no object per id.

    The first pass collects the R*G per-group lists into a private list, so the second pass
    (after the allocations, which may run finalizers) never re-reads the caller's outer
    lists; each inner list is re-measured element by element (seq_to_ids)."""
    return _flatten(new_block_ids, num_groups, None, NULL)


cdef tuple _flatten(object new_block_ids, int num_groups, object masks,
                    const long long* bases):
    # flatten_step's work (also the first part of TableStore.step_pairs). ``masks``: None
    # (read every id) or R*G entries, each None (read every id of that list) or a contiguous
    # int32 array T: then id j of list r*G+g, at table position p = bases[r*G+g] + j, is read
    # only where p < len(T) and T[p] != 0, and 0 is written elsewhere (those ids are neither
    # read nor checked).
    cdef Py_ssize_t R, r, g, m, total = 0, k = 0, bad = -1, j, e, tl
    cdef long long base
    cdef const block_id_t* tp
    cdef int status
    if not is_list_or_tuple(new_block_ids):
        return None, None, f"new_block_ids must be a list, got {type(new_block_ids).__name__}"
    R = len(new_block_ids)
    seqs = []
    for r in range(R):
        if r >= PySequence_Fast_GET_SIZE(new_block_ids):
            return None, None, "new_block_ids changed while being read"
        per = <object>PySequence_Fast_GET_ITEM(new_block_ids, r)
        if per is None:
            for g in range(num_groups):
                seqs.append(None)      # list.append creates no object: no GC, no finalizer
            continue
        if not is_list_or_tuple(per) or PySequence_Fast_GET_SIZE(per) != num_groups:
            return None, None, (f"new_block_ids[{r}] must be None or {num_groups} per-group "
                                "lists of ints")
        for g in range(num_groups):
            seq = <object>PySequence_Fast_GET_ITEM(per, g)
            if not is_list_or_tuple(seq):
                return None, None, f"new_block_ids[{r}][{g}] must be a list of ints"
            seqs.append(seq)
            total += PySequence_Fast_GET_SIZE(seq)
    cdef cnp.npy_intp dim = total
    ids = cnp.PyArray_EMPTY(1, &dim, BLOCK_ID_NPY, 0)
    dim = R * num_groups + 1
    offsets = cnp.PyArray_EMPTY(1, &dim, cnp.NPY_INT64, 0)
    cdef block_id_t* dst = <block_id_t*>cnp.PyArray_DATA(<cnp.ndarray>ids)
    cdef long long* off = <long long*>cnp.PyArray_DATA(<cnp.ndarray>offsets)
    off[0] = 0
    for r in range(R * num_groups):
        seq = seqs[r]
        if seq is not None:
            m = PySequence_Fast_GET_SIZE(seq)
            if k + m > total:       # a list grew between the passes
                return None, None, "new_block_ids changed while being read"
            mask = None if masks is None else masks[r]
            if mask is None:
                status = read_ids_ahead(seq, 0, m, 0, <long long>BLOCK_ID_MAX + 1, True,
                                        dst + k, &bad)
            else:
                # runs of positions the mask keeps are read; the others hold 0
                tp = <const block_id_t*>cnp.PyArray_DATA(<cnp.ndarray>mask)
                tl = cnp.PyArray_DIM(<cnp.ndarray>mask, 0)
                base = bases[r]
                status = ID_OK
                j = 0
                while j < m and status == ID_OK:
                    if base + j < tl and tp[base + j] != 0:
                        e = j + 1
                        while e < m and base + e < tl and tp[base + e] != 0:
                            e += 1
                        status = read_ids_ahead(seq, j, e, 0, <long long>BLOCK_ID_MAX + 1,
                                                True, dst + k + j, &bad)
                        j = e
                    else:
                        dst[k + j] = 0
                        j += 1
                if status == ID_OK and PySequence_Fast_GET_SIZE(seq) != m:
                    status = ID_CHANGED
            if status == ID_CHANGED:
                return None, None, "new_block_ids changed while being read"
            if status != ID_OK:
                x = seq[bad] if bad < len(seq) else None
                where = f"new_block_ids[{r // num_groups}][{r % num_groups}][{bad}]"
                if status == ID_NOT_INT:
                    return None, None, f"{where} must be an int, got {type(x).__name__}"
                return None, None, f"{where}: block id {x} is outside [0, 2**31)"
            k += m
        off[r + 1] = k
    if k != total:
        return None, None, "new_block_ids changed while being read"
    return ids, offsets, None


# ---------------------------------------------------------------------------------------
# Slot-indexed storage of every tracked request (what TrackerSet keeps)
# ---------------------------------------------------------------------------------------
cdef extern from "Python.h":
    PyObject* PyDict_GetItemWithError(object, object) except? NULL
    Py_ssize_t PyLong_AsSsize_t "PyLong_AsSsize_t" (PyObject*) except? -1

cdef int FREE_SLOT = -1
cdef enum:
    _NUM_MARKS = 4                  # scheduled, saved, loaded, num_prompt (tokens)
NUM_MARKS = _NUM_MARKS

# step_flat / clip_spans result codes (hmacore.tables picks the exception class).
STEP_UNKNOWN = 1                    # detail: index into req_ids of an untracked request
STEP_TABLE = 2                      # detail: message (bad new_ids / offsets)
STEP_STATE = 3                      # detail: message (request in the wrong state)
STEP_THEIRS = 4                     # detail: index r of a theirs[r] to convert (step_pairs)

_EMPTY_RO = np.empty(0, dtype=BLOCK_ID_DTYPE)
_EMPTY_RO.flags.writeable = False


cdef void* _realloc(void* p, size_t nbytes) except NULL:
    """PyMem_Realloc that raises MemoryError (``p`` stays valid then)."""
    cdef void* q = PyMem_Realloc(p, nbytes)
    if q == NULL:
        raise MemoryError()
    return q


def _rebuild_store(int num_groups, list entries):
    """Unpickle a TableStore: ``entries`` = [(req_id, state, marks, tables), ...]."""
    cdef TableStore st = TableStore(num_groups)
    cdef Py_ssize_t s
    cdef int g, m
    for req_id, state, marks, tables in entries:
        s = st.add(req_id, state)
        for m in range(_NUM_MARKS):
            st.set_mark(s, m, marks[m])
        for g in range(num_groups):
            st.append(s, g, np.ascontiguousarray(tables[g], dtype=BLOCK_ID_DTYPE))
    return st


cdef class TableStore:
    """The block tables, states and watermarks of every tracked request, by slot.

    ``index`` maps a request id to its slot (an int, reused after :meth:`pop`). Per (slot,
    group) the table lives in its own growable int32 buffer (positions stable, blocks of the
    group, id 0 = null); the per-request metadata (data pointer, length, capacity per group;
    state; watermarks in tokens) sits in slot-indexed C arrays, so a batch touches one
    contiguous record per request instead of a Python object and three heap blocks.

    Callers validate ids; the single-slot methods only move memory (slot and group indices
    are checked). ``step_flat`` / ``clip_spans`` validate a whole batch before writing.

    Views (``view_group``, ``clip_views``) are read-only NumPy slices of a group's buffer and
    are *snapshots*: they never change after they are returned. The store only ever writes
    past a group's length (appends), and before it rewrites a position below the length
    (``merge_full`` nulling, ``clear``/``assign`` followed by appends, ``take_group`` handing
    the buffer out) it checks whether a view is alive -- the buffer's only reference is then
    not the store's -- and if so moves the group to a fresh buffer, leaving the old one to the
    views (copy-on-write). A growth leaves the old buffer to the views too.

    Threads: not thread-safe; one thread at a time (hmacore.tables.TrackerSet enforces an
    owner thread). Picklable (``copy.copy`` / ``deepcopy`` give independent stores).
    """

    def __cinit__(self, int num_groups):
        if num_groups <= 0:
            raise ValueError(f"num_groups must be >= 1, got {num_groups}")
        self.num_groups = num_groups
        self.index = {}
        self._bufs = []
        self._nslots = 0
        self._nfree = 0
        self._scratch_cap = 0
        self._spans_buf = None

    def __dealloc__(self):
        PyMem_Free(self._gb)
        PyMem_Free(self._state)
        PyMem_Free(self._marks)
        PyMem_Free(self._free)
        PyMem_Free(self._scratch)

    def __reduce__(self):
        cdef Py_ssize_t s
        cdef int g, m
        entries = []
        for req_id, s in self.index.items():
            entries.append((req_id, self._state[s],
                            tuple([self._marks[s * _NUM_MARKS + m] for m in range(_NUM_MARKS)]),
                            tuple([self.copy_group(s, g) for g in range(self.num_groups)])))
        return _rebuild_store, (self.num_groups, entries)

    def __repr__(self):
        return (f"TableStore(num_groups={self.num_groups}, requests={len(self.index)}, "
                f"slots={self._nslots})")

    cdef void _grow_slots(self) except *:
        # Doubling; only metadata moves (the buffers stay where they are). Sizes are
        # committed last: a failed realloc leaves a consistent (old-sized) store.
        cdef Py_ssize_t old = self._nslots, n = old * 2 if old else 16, s, G = self.num_groups
        self._gb = <GroupBuf*>_realloc(self._gb, n * G * sizeof(GroupBuf))
        self._state = <int*>_realloc(self._state, n * sizeof(int))
        self._marks = <token_t*>_realloc(self._marks, n * _NUM_MARKS * sizeof(token_t))
        self._free = <Py_ssize_t*>_realloc(self._free, n * sizeof(Py_ssize_t))
        # A batch's slot scratch grows with the slots, not in the step: a step allocates
        # nothing (a malloc right after many frees can cost a heap consolidation).
        if self._scratch_cap < n:
            self._scratch = <Py_ssize_t*>_realloc(self._scratch, n * sizeof(Py_ssize_t))
            self._scratch_cap = n
        for s in range(old * G, n * G):
            self._bufs.append(None)
            self._gb[s].len = 0
            self._set_buffer(s, _EMPTY_RO)
        for s in range(n - 1, old - 1, -1):     # lowest slot on top: dense from 0
            self._state[s] = FREE_SLOT
            self._free[self._nfree] = s
            self._nfree += 1
        self._nslots = n

    cdef void _set_buffer(self, Py_ssize_t k, object arr) except *:
        # NumPy sees the buffer read-only (every slice handed out is a read-only view); this
        # class writes through the raw pointer.
        arr.flags.writeable = False
        self._bufs[k] = arr
        self._gb[k].data = <block_id_t*>cnp.PyArray_DATA(<cnp.ndarray>arr)
        self._gb[k].cap = cnp.PyArray_DIM(<cnp.ndarray>arr, 0)
        self._gb[k].len = 0 if self._gb[k].cap == 0 else self._gb[k].len

    cdef inline bint _exported(self, Py_ssize_t k) noexcept:
        # A view of group k's buffer is alive: the buffer has a reference besides _bufs[k]
        # (every NumPy view of it keeps it as its base). Borrowed read: no refcount traffic.
        return self._gb[k].cap != 0 and Py_REFCNT(PyList_GET_ITEM(self._bufs, k)) > 1

    cdef void _detach(self, Py_ssize_t k, bint keep) except *:
        # Move group k to a private buffer (the old one stays with its views): a copy of the
        # live entries when ``keep``, else nothing (the group becomes empty).
        cdef Py_ssize_t n, cap
        cdef cnp.npy_intp dim
        if not keep:
            self._gb[k].len = 0
            self._set_buffer(k, _EMPTY_RO)
            return
        dim = self._gb[k].cap
        new = cnp.PyArray_EMPTY(1, &dim, BLOCK_ID_NPY, 0)    # may run finalizers: re-read
        n = self._gb[k].len
        if n > dim:
            n = dim
        if n:
            memcpy(cnp.PyArray_DATA(<cnp.ndarray>new), self._gb[k].data, n * sizeof(block_id_t))
        self._set_buffer(k, new)
        self._gb[k].len = n

    cdef void _reserve(self, Py_ssize_t k, Py_ssize_t need) except *:
        # Growth: headroom first, then doubling. The allocation may run finalizers (GC)
        # that re-enter the store, so the record is re-read after it (never a cached
        # pointer into self._gb, which _grow_slots may move); it loops until cap >= need.
        cdef Py_ssize_t new_cap, n
        cdef cnp.npy_intp dim
        while need > self._gb[k].cap:
            new_cap = need + (need >> 3) + 16
            if self._gb[k].cap * 2 > new_cap:
                new_cap = self._gb[k].cap * 2
            dim = new_cap
            new = cnp.PyArray_EMPTY(1, &dim, BLOCK_ID_NPY, 0)
            n = self._gb[k].len
            if n > new_cap:
                continue
            if n:
                memcpy(cnp.PyArray_DATA(<cnp.ndarray>new), self._gb[k].data,
                       n * sizeof(block_id_t))
            self._set_buffer(k, new)
            self._gb[k].len = n

    cdef inline Py_ssize_t _k(self, Py_ssize_t s, int g) except -1:
        if s < 0 or s >= self._nslots or self._state[s] == FREE_SLOT:
            raise IndexError(f"slot {s} is not in use")
        if g < 0 or g >= self.num_groups:
            raise IndexError(f"group {g} out of range for {self.num_groups} groups")
        return s * self.num_groups + g

    # -- membership -------------------------------------------------------------------
    def add(self, object req_id, int state):
        """A fresh slot for ``req_id`` (empty tables, watermarks 0); returns the slot."""
        if req_id in self.index:
            raise ValueError(f"req_id {req_id!r} already has a slot")
        if self._nfree == 0:
            self._grow_slots()
        cdef Py_ssize_t s = self._free[self._nfree - 1], k
        cdef int g
        self.index[req_id] = s               # may raise (unhashable): nothing taken yet
        self._nfree -= 1
        for g in range(self.num_groups):
            self._gb[s * self.num_groups + g].len = 0
        for k in range(_NUM_MARKS):
            self._marks[s * _NUM_MARKS + k] = 0
        self._state[s] = state
        return s

    def pop(self, object req_id):
        """Remove ``req_id``; return its per-group tables as arrays the caller owns (no copy
        unless a view of a group is alive)."""
        cdef Py_ssize_t s = self.index[req_id]
        out = tuple([self.take_group(s, g) for g in range(self.num_groups)])
        del self.index[req_id]
        self._state[s] = FREE_SLOT
        self._free[self._nfree] = s
        self._nfree += 1
        return out

    def __len__(self):
        return len(self.index)

    # -- one slot ---------------------------------------------------------------------
    def get_state(self, Py_ssize_t s):
        self._k(s, 0)
        return self._state[s]

    def set_state(self, Py_ssize_t s, int state):
        self._k(s, 0)
        self._state[s] = state

    def mark(self, Py_ssize_t s, int m):
        """Watermark m of slot s (0 scheduled, 1 saved, 2 loaded, 3 num_prompt; tokens)."""
        self._k(s, 0)
        if m < 0 or m >= _NUM_MARKS:
            raise IndexError(f"mark {m} out of range")
        return self._marks[s * _NUM_MARKS + m]

    def set_mark(self, Py_ssize_t s, int m, token_t v):
        self._k(s, 0)
        if m < 0 or m >= _NUM_MARKS:
            raise IndexError(f"mark {m} out of range")
        self._marks[s * _NUM_MARKS + m] = v

    def length(self, Py_ssize_t s, int g):
        """Tracked blocks of group g of slot s."""
        return self._gb[self._k(s, g)].len

    def lengths(self, Py_ssize_t s):
        """Tracked blocks per group of slot s (blocks of each group)."""
        cdef Py_ssize_t k = self._k(s, 0)
        return tuple([self._gb[k + g].len for g in range(self.num_groups)])

    def append(self, Py_ssize_t s, int g, const block_id_t[::1] ids):
        """Append ``ids`` to group g of slot s; return the new length."""
        cdef Py_ssize_t k = self._k(s, g), n = ids.shape[0], base
        if n:
            self._reserve(k, self._gb[k].len + n)
            base = self._gb[k].len
            memcpy(self._gb[k].data + base, &ids[0], n * sizeof(block_id_t))
            self._gb[k].len = base + n
        return self._gb[k].len

    def extend_groups(self, Py_ssize_t s, object groups):
        """Append a table accepted by :func:`check_int_table` (lists of Python ints, ``None``
        = nothing for that group) to slot s; all-or-nothing.

        Every group's room is reserved first (allocations, which may run finalizers); the
        ids are then converted straight into the spare capacity with no allocation and no
        user code (exact ints only) and the lengths committed last, so a list that changed
        meanwhile is refused with nothing appended."""
        cdef Py_ssize_t k0 = self._k(s, 0), n, bad = -1
        cdef int g, G = self.num_groups, status
        if not is_list_or_tuple(groups) or len(groups) != G:
            raise ValueError(f"groups must be a list/tuple of {G} entries")
        groups = tuple(groups)          # a private snapshot of the outer sequence
        for g in range(G):
            seq = groups[g]
            if seq is not None and not is_list_or_tuple(seq):
                raise ValueError(f"groups[{g}] must be a list/tuple of ints in [0, 2**31)")
        lens = [0 if groups[g] is None else len(groups[g]) for g in range(G)]
        for g in range(G):
            if lens[g]:
                self._reserve(k0 + g, self._gb[k0 + g].len + <Py_ssize_t>lens[g])
        for g in range(G):
            n = lens[g]
            if n == 0:
                continue
            seq = groups[g]
            if self._gb[k0 + g].len + n > self._gb[k0 + g].cap:
                raise ValueError("groups changed while being read")
            status = seq_to_ids(seq, 0, n, 0, BLOCK_ID_LIMIT, True,
                                self._gb[k0 + g].data + self._gb[k0 + g].len, &bad)
            if status != ID_OK:
                raise ValueError(f"groups[{g}] must be a list/tuple of ints in [0, 2**31)"
                                 + (" (it changed while being read)" if status == ID_CHANGED
                                    else ""))
        for g in range(G):
            self._gb[k0 + g].len += <Py_ssize_t>lens[g]

    def assign(self, Py_ssize_t s, int g, const block_id_t[::1] ids):
        """Replace group g's table of slot s with ``ids``; return the new length."""
        cdef Py_ssize_t k = self._k(s, g)
        if self._exported(k):
            self._detach(k, False)
        self._gb[k].len = 0
        return self.append(s, g, ids)

    def clear(self, Py_ssize_t s):
        """Empty every group of slot s (buffers kept for reuse unless a view is alive)."""
        cdef Py_ssize_t k = self._k(s, 0)
        cdef int g
        for g in range(self.num_groups):
            if self._exported(k + g):
                self._detach(k + g, False)
            self._gb[k + g].len = 0

    def first_illegal_change(self, Py_ssize_t s, int g, const block_id_t[::1] full):
        """Check a full table of group g of slot s against the tracked one: -1 when ``full``
        is legal (at least as long as the tracked table, every tracked position unchanged or
        changed from a real id to the null id 0), else the first offending position
        (``len(full)`` when the table shrank)."""
        cdef Py_ssize_t k = self._k(s, g), i, n = self._gb[k].len
        cdef const block_id_t* cur = self._gb[k].data
        if full.shape[0] < n:
            return full.shape[0]
        for i in range(n):
            if full[i] != cur[i] and full[i] != 0:
                return i
        return -1

    def merge_full(self, Py_ssize_t s, int g, const block_id_t[::1] full):
        """Apply a legal full table: null freed positions in place (in a private copy when a
        view of the group is alive), append the suffix past the tracked length. Returns the
        number of appended blocks."""
        cdef Py_ssize_t k = self._k(s, g), i, n = self._gb[k].len, m = full.shape[0]
        cdef block_id_t* cur = self._gb[k].data
        if m < n:
            raise ValueError(f"full has {m} entries, fewer than the {n} tracked")
        for i in range(n):
            if full[i] == 0 and cur[i] != 0:
                if self._exported(k):
                    self._detach(k, True)
                    n = self._gb[k].len
                    cur = self._gb[k].data
                break
        for i in range(n):
            if full[i] == 0:
                cur[i] = 0
        if m > n:
            self.append(s, g, full[n:])
        return m - n

    def view_group(self, Py_ssize_t s, int g):
        """A read-only snapshot view of group g's live table (no copy; see the class doc)."""
        cdef Py_ssize_t k = self._k(s, g)
        return self._bufs[k][:self._gb[k].len]

    def copy_group(self, Py_ssize_t s, int g):
        """A fresh int32 array holding group g's table."""
        cdef Py_ssize_t k = self._k(s, g)
        return self._bufs[k][:self._gb[k].len].copy()

    def take_group(self, Py_ssize_t s, int g):
        """Group g's table as an array the caller owns (no copy unless a view of it is
        alive: then a copy, so the views never see the caller's writes); the group is
        emptied."""
        cdef Py_ssize_t k = self._k(s, g), n = self._gb[k].len
        if self._gb[k].cap == 0:
            out = np.empty(0, dtype=BLOCK_ID_DTYPE)
        elif self._exported(k):
            out = self._bufs[k][:n].copy()
        else:
            buf = self._bufs[k]
            self._bufs[k] = None
            buf.flags.writeable = True   # the caller owns it now
            out = buf[:n]
        self._gb[k].len = 0
        self._set_buffer(k, _EMPTY_RO)
        return out

    def clip_views(self, Py_ssize_t s, const long long[::1] keep):
        """Read-only snapshot views of slot s's clipped table: ``keep[g] > 0`` keeps the last
        keep[g] entries; ``keep[g] == 0`` keeps everything; ``keep[g] = -1 - s`` keeps the
        running state slot of a Mamba group with s speculative scratch slots."""
        cdef Py_ssize_t k0 = self._k(s, 0), a, b
        cdef int g
        if keep.shape[0] != self.num_groups:
            raise ValueError(f"keep has {keep.shape[0]} entries, expected {self.num_groups}")
        out = []
        for g in range(self.num_groups):
            clip_span(self._gb[k0 + g].len, keep[g], &a, &b)
            out.append(self._bufs[k0 + g][a:b])
        return tuple(out)

    # -- batches ----------------------------------------------------------------------
    cdef Py_ssize_t _resolve(self, object req_ids) except -2:
        # Slots of req_ids (a list or tuple) into _scratch; -1, or the index of the first
        # untracked id. An unhashable id raises TypeError. A key's __hash__/__eq__ may run
        # user code: each key is held by a strong reference while it is looked up and the
        # list is re-measured before every read.
        _check_seq(req_ids)
        cdef Py_ssize_t R = len(req_ids), r
        cdef PyObject* v
        cdef Py_ssize_t* p
        if R > self._scratch_cap:
            p = <Py_ssize_t*>PyMem_Realloc(self._scratch, R * sizeof(Py_ssize_t))
            if p == NULL:
                raise MemoryError()
            self._scratch = p
            self._scratch_cap = R
        for r in range(R):
            v = _lookup(self.index, req_ids, r)
            if v == NULL:
                return r
            self._scratch[r] = PyLong_AsSsize_t(v)
        return -1

    def step_flat(self, object req_ids, object new_ids, object offsets, long long num_blocks,
                  int preempted_state, int new_state, int running_state):
        """Append one step's new ids of many requests, all-or-nothing.

        ``req_ids``: list/tuple of R tracked ids. ``new_ids``: C-contiguous 1-D int32 array.
        ``offsets``: C-contiguous 1-D int64 array, R*G + 1 entries, 0 first, non-decreasing,
        ``len(new_ids)`` last; request ``req_ids[r]`` gets ``new_ids[offsets[r*G+g]:
        offsets[r*G+g+1]]`` appended to group g (blocks of group g). ``new_state`` requests
        become ``running_state``. Returns None, or ``(code, detail)`` with nothing changed:
        STEP_UNKNOWN (detail = index of the untracked id), STEP_TABLE or STEP_STATE (detail =
        message naming the argument and the rule). An unhashable id raises TypeError. Like
        every mutation of the store, not for concurrent use from several threads.
        """
        # Raw NumPy C API instead of typed memoryviews: acquiring a memoryview runs a lot of
        # (cold, once per step) code; these checks are a few loads.
        if not is_c1d_signed(new_ids, sizeof(block_id_t)):
            return STEP_TABLE, "new_ids must be a C-contiguous 1-D int32 array"
        if not is_c1d_signed(offsets, 8):
            return STEP_TABLE, "offsets must be a C-contiguous 1-D int64 array"
        cdef const block_id_t* ids = <const block_id_t*>cnp.PyArray_DATA(<cnp.ndarray>new_ids)
        cdef const long long* off = <const long long*>cnp.PyArray_DATA(<cnp.ndarray>offsets)
        cdef Py_ssize_t n = cnp.PyArray_DIM(<cnp.ndarray>new_ids, 0)
        cdef Py_ssize_t noff = cnp.PyArray_DIM(<cnp.ndarray>offsets, 0)
        cdef Py_ssize_t R = len(req_ids), G = self.num_groups
        cdef Py_ssize_t r, k, s, lo, m, i, kk
        cdef block_id_t* dst
        cdef Py_ssize_t bad = self._resolve(req_ids)
        if bad >= 0:
            return STEP_UNKNOWN, bad
        if noff != R * G + 1:
            return STEP_TABLE, (f"offsets must have len(req_ids) * num_groups + 1 = "
                                f"{R * G + 1} entries, got {noff}")
        if off[0] != 0 or off[R * G] != n:
            return STEP_TABLE, f"offsets must start at 0 and end at len(new_ids) = {n}"
        for k in range(R * G):
            if off[k + 1] < off[k]:
                return STEP_TABLE, (f"offsets must be non-decreasing (offsets[{k + 1}] < "
                                    f"offsets[{k}])")
        i = first_id_out_of_range(ids, n, 0, id_bound(num_blocks))
        if i >= 0:
            if ids[i] < 0:
                return STEP_TABLE, f"new_ids[{i}]: block id {ids[i]} is negative"
            return STEP_TABLE, f"new_ids[{i}]: block id {ids[i]} is >= num_blocks ({num_blocks})"
        for r in range(R):
            if self._state[self._scratch[r]] == preempted_state:
                return STEP_STATE, (f"req_ids[{r}] is PREEMPTED: a resumed request brings its "
                                    "full table (replace), not appended ids")
        # Valid: write. Only a buffer growth (rare) leaves C; the records are re-read after
        # it (never a pointer into self._gb kept across it). Appends write past each
        # group's length only, where no view can look (see the class doc).
        for r in range(R):
            s = self._scratch[r]
            for k in range(G):
                lo = off[r * G + k]
                m = off[r * G + k + 1] - lo
                if m == 0:
                    continue
                kk = s * G + k
                if self._gb[kk].len + m > self._gb[kk].cap:
                    self._reserve(kk, self._gb[kk].len + m)
                dst = self._gb[kk].data + self._gb[kk].len
                for i in range(m):
                    dst[i] = ids[lo + i]
                self._gb[kk].len += m
            if self._state[s] == new_state:
                self._state[s] = running_state
        return None

    def reserve(self, Py_ssize_t s, int g, Py_ssize_t n):
        """Room for at least ``n`` entries in group g of slot s: a capacity hint (the table
        and every view are unchanged; appends up to ``n`` entries then allocate nothing)."""
        cdef Py_ssize_t k = self._k(s, g)
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        if n > self._gb[k].cap:
            self._reserve(k, n)

    def step_pairs(self, object req_ids, object new_block_ids, object theirs, object spans,
                   object block_sizes, long long num_blocks, int preempted_state,
                   int running_state):
        """One scheduler step of the requests a push producer follows, in one call: append
        each request's new ids, mark it running, and pair the positions of its step's tokens
        with the consumer's positional table (every WRITE pair of the step).

        ``req_ids``: list/tuple of R distinct tracked ids. ``new_block_ids``: R entries, each
        None or G lists of exact ints in ``[0, num_blocks)`` (vLLM's ``new_block_ids``),
        appended to the request's groups. Every request's state then becomes
        ``running_state`` (a ``preempted_state`` request given new ids is refused: it comes
        back with its full table). ``spans[r]``: None (follow only) or ``(start, end)``
        tokens, ``0 <= start <= end``; then ``theirs[r]`` is the consumer's table, G
        contiguous int32 arrays (ignored when ``spans[r]`` is None). ``block_sizes``: G ints
        >= 1 (tokens per block of each group).

        Pairing (pair_block_spans' rule): per group g the positions ``start // bs ..
        cdiv(end, bs) - 1`` of the appended table and of ``theirs[r][g]``, positions past
        either not paired, a position where either holds the null block 0 skipped.

        Sparse appends: a request with a span gets its new ids read (and checked) only at
        the positions where ``theirs[r]`` holds a block (non-zero, inside its length); its
        other appended positions hold 0. Its table is then vLLM's at every position the
        consumer can receive (every position ever paired) and 0 elsewhere: reading a window
        group's ids that left the consumer's window, or a consumer's local hit, costs nothing.

        Returns ``(local, remote, offsets, None)``: the pairs as two int32 arrays, request by
        request and group by group, and ``offsets`` (int64, R*G + 1 entries): request r's
        group g pairs are ``[offsets[r*G + g], offsets[r*G + g + 1])``. Or ``(None, None,
        None, (code, detail))`` with nothing changed: STEP_UNKNOWN (detail: index of the
        untracked id), STEP_THEIRS (detail: the r whose ``theirs[r]`` is not G contiguous
        int32 arrays; the caller converts it), STEP_TABLE / STEP_STATE (detail: a message
        naming the argument and the rule). An unhashable id raises TypeError.

        All-or-nothing: every input is validated and every allocation made (room for the
        appends; the outputs, sized by an exact count) before the first write, and a store
        that changed meanwhile (a finalizer run by an allocation) is refused unchanged.
        Writes go past each group's length only (views never see them). Terminates: a fixed
        number of bounded passes over the inputs.
        """
        _check_seq(req_ids)
        cdef Py_ssize_t R = len(req_ids), G = self.num_groups
        cdef Py_ssize_t r, g, kk, p, lo, hi, m, i, count = 0, o, tl, base, bad
        cdef long long a, b, bs
        cdef int overflow = 0
        cdef block_id_t t, x
        cdef const block_id_t* tp
        cdef const block_id_t* cur
        cdef const block_id_t* idp
        cdef const long long* off
        cdef block_id_t* pa
        cdef block_id_t* pb
        cdef long long* po
        cdef cnp.npy_intp dim
        if not is_list_or_tuple(new_block_ids) or PySequence_Fast_GET_SIZE(new_block_ids) != R:
            return _step_fail(STEP_TABLE, f"new_block_ids must be a list of {R} entries (one "
                                          "per req_id)")
        if not is_list_or_tuple(spans) or PySequence_Fast_GET_SIZE(spans) != R:
            return _step_fail(STEP_TABLE, f"spans must be a list of {R} entries (one per req_id)")
        if not is_list_or_tuple(theirs) or PySequence_Fast_GET_SIZE(theirs) != R:
            return _step_fail(STEP_TABLE, f"theirs must be a list of {R} entries (one per req_id)")
        if not is_list_or_tuple(block_sizes) or PySequence_Fast_GET_SIZE(block_sizes) != G:
            return _step_fail(STEP_TABLE, f"block_sizes must be a list of {G} ints >= 1")
        # private snapshots of the outer sequences (finalizers cannot change what is read)
        spans, theirs, block_sizes = tuple(spans), list(theirs), tuple(block_sizes)
        # work: G block sizes, then per request slot / start / end (start -1: no pairing),
        # then per (request, group) the length before the appends
        cdef long long* work = <long long*>PyMem_Malloc((G + 3 * R + R * G + 1)
                                                        * sizeof(long long))
        if work == NULL:
            raise MemoryError()
        cdef long long* bsz = work
        cdef long long* slot = work + G
        cdef long long* start = slot + R
        cdef long long* end = start + R
        cdef long long* old = end + R
        try:
            for g in range(G):
                v = block_sizes[g]
                bs = PyLong_AsLongLongAndOverflow(v, &overflow) if PyLong_CheckExact(<PyObject*>v) \
                    else 0
                if overflow or bs < 1:
                    return _step_fail(STEP_TABLE, f"block_sizes[{g}] must be an int >= 1, "
                                                  f"got {v!r}")
                bsz[g] = bs
            for r in range(R):
                sp = spans[r]
                start[r] = -1
                if sp is None:
                    continue
                if not is_list_or_tuple(sp) or PySequence_Fast_GET_SIZE(sp) != 2 \
                        or not PyLong_CheckExact(PySequence_Fast_GET_ITEM(sp, 0)) \
                        or not PyLong_CheckExact(PySequence_Fast_GET_ITEM(sp, 1)):
                    return _step_fail(STEP_TABLE, f"spans[{r}] must be None or (start, end) "
                                                  f"ints, got {sp!r}")
                a = PyLong_AsLongLongAndOverflow(sp[0], &overflow)
                if not overflow:
                    b = PyLong_AsLongLongAndOverflow(sp[1], &overflow)
                if overflow or a < 0 or b < a:
                    return _step_fail(STEP_TABLE, f"spans[{r}] = {sp!r}: need 0 <= start <= "
                                                  "end < 2**63 (tokens)")
                tt = theirs[r]
                if not is_list_or_tuple(tt) or PySequence_Fast_GET_SIZE(tt) != G:
                    return _step_fail(STEP_THEIRS, r)
                tt = tuple(tt)
                for g in range(G):
                    if not is_block_id_array(<object>PySequence_Fast_GET_ITEM(tt, g)):
                        return _step_fail(STEP_THEIRS, r)
                theirs[r] = tt
                start[r] = a
                end[r] = b
            # a pushing request's new ids are read only at the positions the consumer's
            # table holds a block (the only ones ever paired); each list's first position is
            # its group's length now (re-checked below, after every allocation)
            bad = self._resolve(req_ids)
            if bad >= 0:
                return _step_fail(STEP_UNKNOWN, bad)
            masks = [None] * (R * G)
            for r in range(R):
                slot[r] = self._scratch[r]
                for g in range(G):
                    old[r * G + g] = self._gb[slot[r] * G + g].len
                    if start[r] >= 0:
                        masks[r * G + g] = <object>PySequence_Fast_GET_ITEM(theirs[r], g)
            ids, offs, msg = _flatten(new_block_ids, <int>G, masks, old)
            if msg is not None:
                return _step_fail(STEP_TABLE, msg)
            idp = <const block_id_t*>cnp.PyArray_DATA(<cnp.ndarray>ids)
            off = <const long long*>cnp.PyArray_DATA(<cnp.ndarray>offs)
            m = cnp.PyArray_DIM(<cnp.ndarray>ids, 0)
            i = first_id_out_of_range(idp, m, 0, id_bound(num_blocks))
            if i >= 0:
                if idp[i] < 0:
                    return _step_fail(STEP_TABLE, f"new ids: block id {idp[i]} is negative")
                return _step_fail(STEP_TABLE, f"new ids: block id {idp[i]} is >= num_blocks "
                                              f"({num_blocks})")
            bad = self._resolve(req_ids)
            for r in range(R):
                if bad >= 0 or self._scratch[r] != slot[r]:
                    return _step_fail(STEP_TABLE, "the tracked requests changed while the "
                                                  "step was prepared")
            err = self._check_batch(R, slot, off, preempted_state)
            if err is not None:
                return None, None, None, err
            # validate the consumer's tables over the spans and count the pairs
            for r in range(R):
                for g in range(G):
                    kk = slot[r] * G + g
                    if self._gb[kk].len != old[r * G + g]:
                        return _step_fail(STEP_TABLE, "the tracked requests changed while the "
                                                      "step was prepared")
                if start[r] < 0:
                    continue
                tt = theirs[r]
                for g in range(G):
                    kk = slot[r] * G + g
                    tarr = <object>PySequence_Fast_GET_ITEM(tt, g)
                    tp = <const block_id_t*>cnp.PyArray_DATA(<cnp.ndarray>tarr)
                    tl = cnp.PyArray_DIM(<cnp.ndarray>tarr, 0)
                    base = old[r * G + g]
                    lo, hi = _span_positions(start[r], end[r], bsz[g],
                                             base + off[r * G + g + 1] - off[r * G + g], tl)
                    cur = self._gb[kk].data
                    for p in range(lo, hi):
                        t = tp[p]
                        if t < 0:
                            return _step_fail(STEP_TABLE, f"theirs[{r}][{g}][{p}]: block id "
                                                          f"{t} is negative")
                        x = cur[p] if p < base else idp[off[r * G + g] + p - base]
                        count += t != 0 and x != 0
            # every allocation before the first write
            for r in range(R):
                for g in range(G):
                    m = off[r * G + g + 1] - off[r * G + g]
                    kk = slot[r] * G + g
                    if m and old[r * G + g] + m > self._gb[kk].cap:
                        self._reserve(kk, old[r * G + g] + m)
            dim = count
            local = cnp.PyArray_EMPTY(1, &dim, BLOCK_ID_NPY, 0)
            remote = cnp.PyArray_EMPTY(1, &dim, BLOCK_ID_NPY, 0)
            dim = R * G + 1
            offsets = cnp.PyArray_EMPTY(1, &dim, cnp.NPY_INT64, 0)
            # an allocation may have run a finalizer that used this store: re-check
            bad = self._resolve(req_ids)
            for r in range(R):
                if bad >= 0 or self._scratch[r] != slot[r]:
                    return _step_fail(STEP_TABLE, "the tracked requests changed while the "
                                                  "step was prepared")
                for g in range(G):
                    kk = slot[r] * G + g
                    m = off[r * G + g + 1] - off[r * G + g]
                    if self._gb[kk].len != old[r * G + g] or self._gb[kk].len + m > \
                            self._gb[kk].cap or (m and self._state[slot[r]] == preempted_state):
                        return _step_fail(STEP_TABLE, "the tracked requests changed while the "
                                                      "step was prepared")
            # commit: no allocation and no user code from here on
            for r in range(R):
                for g in range(G):
                    kk = slot[r] * G + g
                    m = off[r * G + g + 1] - off[r * G + g]
                    if m:
                        memcpy(self._gb[kk].data + self._gb[kk].len, idp + off[r * G + g],
                               m * sizeof(block_id_t))
                        self._gb[kk].len += m
                self._state[slot[r]] = running_state
            pa = <block_id_t*>cnp.PyArray_DATA(<cnp.ndarray>local)
            pb = <block_id_t*>cnp.PyArray_DATA(<cnp.ndarray>remote)
            po = <long long*>cnp.PyArray_DATA(<cnp.ndarray>offsets)
            po[0] = 0
            o = 0
            for r in range(R):
                if start[r] >= 0:
                    tt = theirs[r]
                for g in range(G):
                    if start[r] >= 0:
                        kk = slot[r] * G + g
                        tarr = <object>PySequence_Fast_GET_ITEM(tt, g)
                        tp = <const block_id_t*>cnp.PyArray_DATA(<cnp.ndarray>tarr)
                        lo, hi = _span_positions(start[r], end[r], bsz[g], self._gb[kk].len,
                                                 cnp.PyArray_DIM(<cnp.ndarray>tarr, 0))
                        cur = self._gb[kk].data
                        for p in range(lo, hi):
                            if cur[p] != 0 and tp[p] != 0 and o < count:
                                pa[o] = cur[p]
                                pb[o] = tp[p]
                                o += 1
                    po[r * G + g + 1] = o
            return local, remote, offsets, None
        finally:
            PyMem_Free(work)

    cdef object _check_batch(self, Py_ssize_t R, const long long* slot, const long long* off,
                             int preempted_state):
        # step_pairs: distinct slots (an id given twice is refused), no appends to a
        # PREEMPTED request. None when fine, else (code, message).
        cdef Py_ssize_t r, q, G = self.num_groups
        cdef long long* order
        if R > 1:
            order = <long long*>PyMem_Malloc(R * sizeof(long long))
            if order == NULL:
                raise MemoryError()
            try:
                memcpy(order, slot, R * sizeof(long long))
                qsort(order, R, sizeof(long long), _cmp_ll)
                for r in range(1, R):
                    if order[r] == order[r - 1]:
                        for q in range(R):
                            if slot[q] == order[r]:
                                break
                        return STEP_STATE, (f"req_ids[{q}] is given twice (one entry per "
                                            "request and step)")
            finally:
                PyMem_Free(order)
        for r in range(R):
            if self._state[slot[r]] == preempted_state and off[(r + 1) * G] > off[r * G]:
                return STEP_STATE, (f"req_ids[{r}] is PREEMPTED: a resumed request brings its "
                                    "full table (replace), not appended ids")
        return None

    def clip_spans(self, object req_ids, object keep):
        """``(spans, -1)``: an int64 array ``(R, G, 2)`` whose ``[r, g]`` row is the ``[start,
        end)`` range (blocks of group g) that :meth:`clip_views` would return for
        ``req_ids[r]``; or ``(None, index of the first untracked id)``. ``keep``: the
        C-contiguous int64 window plan (G entries)."""
        _check_seq(req_ids)
        cdef Py_ssize_t R = len(req_ids), r, k0, a, b
        cdef int g, G = self.num_groups
        if not is_c1d_signed(keep, 8) or cnp.PyArray_DIM(<cnp.ndarray>keep, 0) != G:
            raise ValueError(f"keep must be a C-contiguous 1-D int64 array of {G} entries")
        cdef const long long* kp = <const long long*>cnp.PyArray_DATA(<cnp.ndarray>keep)
        cdef PyObject* v
        out = self._spans_array(R, G)
        cdef long long* o = <long long*>cnp.PyArray_DATA(<cnp.ndarray>out)
        # One pass, no scratch, and nothing read from the store across a lookup (a key's
        # __eq__ may run code): safe next to a step_flat parked in a buffer growth. An
        # untracked id returns before the (unpublished) output is handed out.
        for r in range(R):
            v = _lookup(self.index, req_ids, r)
            if v == NULL:
                return None, r
            k0 = PyLong_AsSsize_t(v) * G
            for g in range(G):
                clip_span(self._gb[k0 + g].len, kp[g], &a, &b)
                o[0] = a
                o[1] = b
                o += 2
        return out, -1

    cdef object _spans_array(self, Py_ssize_t R, int G):
        # An (R, G, 2) int64 array for clip_spans: a view of this store's _spans_buf,
        # reused only when no earlier result (or any view of one) is alive -- the buffer's
        # only reference is then the store's, so the reuse is unobservable. A step then
        # needs no malloc (a fresh one right after many frees can cost a heap
        # consolidation, ~100 us). Per store, so two stores never share it.
        cdef cnp.npy_intp n = R * G * 2
        cdef cnp.npy_intp dims[3]
        if self._spans_buf is None or Py_REFCNT(<PyObject*>self._spans_buf) != 1 \
                or cnp.PyArray_DIM(<cnp.ndarray>self._spans_buf, 0) < n:
            dims[0] = n + (n >> 2) + 64
            self._spans_buf = cnp.PyArray_EMPTY(1, dims, cnp.NPY_INT64, 0)
        dims[0] = R
        dims[1] = G
        dims[2] = 2
        out = cnp.PyArray_SimpleNewFromData(3, dims, cnp.NPY_INT64,
                                            cnp.PyArray_DATA(<cnp.ndarray>self._spans_buf))
        cnp.set_array_base(<cnp.ndarray>out, self._spans_buf)
        return out


cdef inline tuple _step_fail(int code, object detail):
    return None, None, None, (code, detail)


cdef int _cmp_ll(const void* a, const void* b) noexcept nogil:
    cdef long long x = (<const long long*>a)[0], y = (<const long long*>b)[0]
    return (x > y) - (x < y)


cdef inline (Py_ssize_t, Py_ssize_t) _span_positions(long long start, long long end,
                                                    long long bs, Py_ssize_t mine_len,
                                                    Py_ssize_t theirs_len) noexcept:
    # Positions [lo, hi) of the blocks covering tokens [start, end) (block size bs >= 1),
    # clipped to both tables; empty (lo == hi) when none.
    cdef long long lo = start // bs, hi = end // bs + (end % bs != 0)
    if hi > mine_len:
        hi = mine_len
    if hi > theirs_len:
        hi = theirs_len
    if hi < lo:
        hi = lo
    return <Py_ssize_t>lo, <Py_ssize_t>hi


cdef inline PyObject* _lookup(dict index, object req_ids, Py_ssize_t r) except? NULL:
    # index[req_ids[r]] (borrowed), NULL when absent (or an error is set: a key's hash
    # failed). req_ids is re-measured first. Exact str / int keys hash and compare without
    # user code, so they are looked up borrowed (no refcount write per key on the step's
    # hot path); any other key is held by a strong reference while its __hash__/__eq__ may
    # run code that drops it from the list.
    if r >= PySequence_Fast_GET_SIZE(req_ids):
        raise RuntimeError("req_ids changed size while being read")
    cdef PyObject* kp = PySequence_Fast_GET_ITEM(req_ids, r)
    if PyUnicode_CheckExact(kp) or PyLong_CheckExact(kp):
        return PyDict_GetItemWithError(index, <object>kp)
    key = <object>kp
    return PyDict_GetItemWithError(index, key)


cdef inline int _check_seq(object req_ids) except -1:
    # The batch loops index req_ids with PySequence_Fast_GET_ITEM.
    if not (PyList_Check(req_ids) or PyTuple_Check(req_ids)):
        raise TypeError(f"req_ids must be a list or tuple, got {type(req_ids).__name__}")
    return 0
