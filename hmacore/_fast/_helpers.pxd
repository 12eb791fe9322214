# Shared inline helpers of the Cython kernels: block-id checks and conversion, the clip-span
# rule, array form checks, saturating token arithmetic. Every .pyx of hmacore/_fast cimports
# what it needs from here (one definition each; the modules must call cnp.import_array()).
from cpython.object cimport PyObject, PyTypeObject
cimport numpy as cnp

from hmacore._fast._types cimport block_id_t, token_t, BLOCK_ID_NPY, BLOCK_ID_MAX, TOKEN_MAX

cdef extern from "Python.h":
    long long PyLong_AsLongLongAndOverflow(object, int*) except? -1
    Py_ssize_t PySequence_Fast_GET_SIZE(object)
    PyObject* PySequence_Fast_GET_ITEM(object, Py_ssize_t)
    bint PyLong_Check(object)
    bint PyLong_CheckExact(object)
    bint PyBool_Check(object)
    bint PyList_CheckExact(object)
    bint PyTuple_CheckExact(object)
    bint PyObject_TypeCheck(object, PyTypeObject*)
    object PyNumber_Long(object)

cdef extern from "numpy/arrayobject.h":
    PyTypeObject PyIntegerArrType_Type      # np.integer


# Status codes of the id converters/scanners (hmacore.tables turns them into messages).
cdef enum IdStatus:
    ID_OK = 0
    ID_NOT_INT = 1      # float, bool, str, None ...
    ID_NEGATIVE = 2
    ID_PAST_INT32 = 3   # > 2**31 - 1
    ID_PAST_POOL = 4    # >= num_blocks
    ID_NULL = 5         # 0 <= id < lo: the null block where a real block is required
    ID_CHANGED = 6      # the list changed size while it was being read


cdef inline bint is_list_or_tuple(object x) noexcept:
    return PyList_CheckExact(x) or PyTuple_CheckExact(x)


cdef inline long long id_bound(long long num_blocks) noexcept nogil:
    """Exclusive upper bound of valid ids: num_blocks, or 2**31 when it is unknown (<= 0)."""
    return num_blocks if num_blocks > 0 else <long long>BLOCK_ID_MAX + 1


cdef inline int seq_to_ids(object seq, Py_ssize_t start, Py_ssize_t end, long long lo,
                           long long hi, bint exact_int, block_id_t* dst,
                           Py_ssize_t* bad) except -1:
    """Check the ids ``seq[start:end]`` of a list/tuple (``lo <= id < hi``, ``hi <= 2**31``)
    and, when ``dst`` is not NULL, write them to ``dst[0:end - start]``.

    Returns ID_OK, or the status of the first bad element with its index in ``bad[0]``.
    ``exact_int``: only exact ints are accepted, so no user code can run; else also int
    subclasses (read by value, no user code) and NumPy integers (``int(x)``: user code may
    run), never bools. Then ``dst`` must be memory user code cannot free or move (a fresh
    array the caller holds), never a store's buffer.

    Safety: ``seq`` is re-measured before every element (user code run by ``int(x)``, or a
    finalizer run by the caller's allocations, may shrink it: ID_CHANGED, never a read past
    the end) and each element is held by a strong reference while it is converted.
    Terminates: ``i`` runs once from ``start`` to ``end``.
    """
    cdef Py_ssize_t i
    cdef int overflow
    cdef long long v
    cdef object x
    for i in range(start, end):
        if i >= PySequence_Fast_GET_SIZE(seq):
            bad[0] = i
            return ID_CHANGED
        x = <object>PySequence_Fast_GET_ITEM(seq, i)
        if not PyLong_CheckExact(x):
            if exact_int or PyBool_Check(x):
                bad[0] = i
                return ID_NOT_INT
            if not PyLong_Check(x):
                if not PyObject_TypeCheck(x, &PyIntegerArrType_Type):
                    bad[0] = i
                    return ID_NOT_INT
                x = PyNumber_Long(x)          # may run user code (a subclass's __int__)
        v = PyLong_AsLongLongAndOverflow(x, &overflow)
        if overflow < 0 or (overflow == 0 and v < 0):
            bad[0] = i
            return ID_NEGATIVE
        if overflow > 0 or v > BLOCK_ID_MAX:
            bad[0] = i
            return ID_PAST_INT32
        if v >= hi:
            bad[0] = i
            return ID_PAST_POOL
        if v < lo:
            bad[0] = i
            return ID_NULL
        if dst != NULL:
            dst[i - start] = <block_id_t>v
    return ID_OK


cdef inline void id_min_max(const block_id_t* p, Py_ssize_t n, block_id_t* mn,
                            block_id_t* mx) noexcept nogil:
    """Smallest and largest of ``p[0:n]`` (n >= 1); a branch-free reduction the compiler
    vectorises."""
    cdef block_id_t lo = p[0], hi = p[0], v
    cdef Py_ssize_t i
    for i in range(1, n):
        v = p[i]
        lo = v if v < lo else lo
        hi = v if v > hi else hi
    mn[0] = lo
    mx[0] = hi


cdef inline bint ids_in_range(const block_id_t* p, Py_ssize_t n, long long lo,
                              long long hi) noexcept nogil:
    """``lo <= p[i] < hi`` for every i < n (true when n <= 0)."""
    cdef block_id_t mn, mx
    if n <= 0:
        return True
    id_min_max(p, n, &mn, &mx)
    return mn >= lo and mx < hi


cdef inline Py_ssize_t first_id_out_of_range(const block_id_t* p, Py_ssize_t n, long long lo,
                                             long long hi) noexcept nogil:
    """Index of the first id outside ``[lo, hi)``, -1 when none (the min/max pass first; the
    index search runs only for bad input)."""
    cdef Py_ssize_t i
    if ids_in_range(p, n, lo, hi):
        return -1
    for i in range(n):
        if p[i] < lo or p[i] >= hi:
            return i
    return -1


cdef inline bint is_block_id_array(object x) noexcept:
    """An exact ndarray, 1-D, C-contiguous, native byte order, of the block-id type (what
    the fast paths read through a raw pointer; a byte-swapped '>i4' array has the same type
    number but other bytes)."""
    return (cnp.PyArray_CheckExact(x) and cnp.PyArray_NDIM(<cnp.ndarray>x) == 1
            and cnp.PyArray_TYPE(<cnp.ndarray>x) == BLOCK_ID_NPY
            and cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>x)
            and cnp.PyArray_ISNOTSWAPPED(<cnp.ndarray>x))


cdef inline bint is_c1d_signed(object a, int itemsize) noexcept:
    """A 1-D C-contiguous native-endian signed-integer ndarray of that item size."""
    if not cnp.PyArray_Check(a):
        return False
    cdef cnp.ndarray arr = <cnp.ndarray>a
    return (cnp.PyArray_NDIM(arr) == 1 and cnp.PyArray_IS_C_CONTIGUOUS(arr)
            and cnp.PyArray_ISSIGNED(arr) and cnp.PyArray_ITEMSIZE(arr) == itemsize
            and cnp.PyArray_ISNOTSWAPPED(arr))


cdef inline void clip_span(Py_ssize_t n, long long keep, Py_ssize_t* a,
                           Py_ssize_t* b) noexcept nogil:
    """``[a, b)`` kept of a group of n entries by a window plan entry: ``keep > 0`` the last
    keep entries; ``0`` everything; ``-1 - s`` the running-state slot of a Mamba group with
    s speculative scratch slots (drops ``min(s, n - 1)`` trailing slots, keeps the last one
    left). Always ``0 <= a <= b <= n``."""
    cdef Py_ssize_t k, end
    if keep > 0:
        a[0] = n - keep if n > keep else 0
        b[0] = n
    elif keep == 0 or n == 0:
        a[0] = 0
        b[0] = n
    else:
        k = -1 - keep
        end = n - (k if k < n - 1 else n - 1)
        a[0] = end - 1
        b[0] = end


cdef inline token_t sat_add(token_t a, token_t b) noexcept nogil:
    """``a + b`` for ``a, b >= 0``, saturated at TOKEN_MAX instead of wrapping."""
    return TOKEN_MAX if a > TOKEN_MAX - b else a + b
