"""Typed kernels for hmacore.windows: kernel-block expansion and null-run scans.

Callers (hmacore/windows.py) validate dtypes, shapes and the int32 overflow bound first.
"""
from cpython.ref cimport Py_INCREF
from cpython.tuple cimport PyTuple_New, PyTuple_SET_ITEM

import numpy as np
cimport numpy as cnp

from hmacore._fast._types cimport block_id_t

cnp.import_array()

cdef extern from "Python.h":
    long long PyLong_AsLongLongAndOverflow(object, int*) except? -1

cdef long long INT32_MAX = 2147483647


def max_id(const block_id_t[::1] ids):
    """Largest id in ``ids`` (-1 when empty)."""
    cdef Py_ssize_t i, n = ids.shape[0]
    cdef block_id_t m = -1
    with nogil:
        for i in range(n):
            if ids[i] > m:
                m = ids[i]
    return m


def leading_nulls(const block_id_t[::1] ids):
    """Length of the leading run of null (0) ids."""
    cdef Py_ssize_t i = 0, n = ids.shape[0]
    with nogil:
        while i < n and ids[i] == 0:
            i += 1
    return i


def expand_into(const block_id_t[::1] ids, long long ratio, long long stride,
                block_id_t[::1] out):
    """Write ``b*stride + k for b in ids for k in range(ratio)`` into ``out``, stopping when
    ``out`` is full; return the number written. The caller guarantees no int32 overflow."""
    cdef Py_ssize_t i, j = 0, n = ids.shape[0], cap = out.shape[0]
    cdef long long k, base
    with nogil:
        for i in range(n):
            if j >= cap:
                break
            base = <long long>ids[i] * stride
            for k in range(ratio):
                if j >= cap:
                    break
                out[j] = <block_id_t>(base + k)
                j += 1
    return j


def first_null(const block_id_t[::1] ids):
    """Index of the first null (0) id, -1 when there is none."""
    cdef Py_ssize_t i, n = ids.shape[0], found = -1
    with nogil:
        for i in range(n):
            if ids[i] == 0:
                found = i
                break
    return found


cdef inline bint _all_in_range(const block_id_t* src, Py_ssize_t start, Py_ssize_t end,
                               long long lo, long long hi) noexcept nogil:
    """lo <= src[i] < hi for all i in [start, end); a min/max reduction the compiler
    vectorises (no early exit)."""
    cdef block_id_t mn = 2147483647, mx = -2147483648, v
    cdef Py_ssize_t i
    if end <= start:
        return True
    for i in range(start, end):
        v = src[i]
        mn = v if v < mn else mn
        mx = v if v > mx else mx
    return mn >= lo and mx < hi


cdef inline bint _is_id_array(object x):
    return (cnp.PyArray_CheckExact(x) and cnp.PyArray_NDIM(<cnp.ndarray>x) == 1
            and cnp.PyArray_TYPE(<cnp.ndarray>x) == cnp.NPY_INT32
            and cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>x))


def clip_groups(object groups, const long long[::1] plan, long long num_blocks):
    """Fast path of ``clip_to_window`` (plan encoding: see ``hmacore.windows.window_plan``).

    ``groups``: a list/tuple with one entry per plan entry, each a list/tuple of Python ints
    or a 1-D C-contiguous int32 array. Returns a tuple of int32 arrays (views for array
    input) holding the clipped part, validated (``0 <= id < num_blocks``, or < 2**31 when
    num_blocks is 0). Returns None when the input is off this path or anything kept is
    invalid: the caller's general path then decides and names the error.
    """
    cdef Py_ssize_t G = plan.shape[0], g, n, start, end, i
    cdef long long keep, spec, v
    cdef long long hi = num_blocks if num_blocks > 0 else INT32_MAX + 1
    cdef int overflow
    cdef const block_id_t* src
    cdef block_id_t* dst
    cdef bint is_arr
    cdef cnp.npy_intp dim
    if not (type(groups) is tuple or type(groups) is list) or len(groups) != G:
        return None
    out = [None] * G
    for g in range(G):
        x = groups[g]
        is_arr = _is_id_array(x)
        if not is_arr and not (type(x) is list or type(x) is tuple):
            return None
        n = len(x)
        keep = plan[g]
        if keep > 0:
            start = n - keep if n > keep else 0
            end = n
        elif keep == 0 or n == 0:
            start = 0
            end = n
        else:
            spec = -1 - keep
            end = n - (spec if spec < n - 1 else n - 1)
            start = end - 1
        if is_arr:
            src = <const block_id_t*>cnp.PyArray_DATA(<cnp.ndarray>x)
            if not _all_in_range(src, start, end, 0, hi):
                return None
            out[g] = x[start:end]
        else:
            dim = end - start
            arr = cnp.PyArray_EMPTY(1, &dim, cnp.NPY_INT32, 0)
            dst = <block_id_t*>cnp.PyArray_DATA(<cnp.ndarray>arr)
            for i in range(start, end):
                item = x[i]
                if type(item) is not int:
                    return None
                v = PyLong_AsLongLongAndOverflow(item, &overflow)
                if overflow or v < 0 or v >= hi:
                    return None
                dst[i - start] = <block_id_t>v
            out[g] = arr
    return tuple(out)


cdef object _take_ids(object x, Py_ssize_t start, Py_ssize_t end, long long hi, bint no_null):
    """x[start:end] as validated int32 (view for int32 arrays), or None when x is off the
    fast path or an id is < 0, >= hi, or (no_null) 0."""
    cdef Py_ssize_t i
    cdef long long v
    cdef int overflow
    cdef long long lo = 1 if no_null else 0
    cdef const block_id_t* src
    cdef block_id_t* dst
    if _is_id_array(x):
        src = <const block_id_t*>cnp.PyArray_DATA(<cnp.ndarray>x)
        if not _all_in_range(src, start, end, lo, hi):
            return None
        return x[start:end]
    if not (type(x) is list or type(x) is tuple):
        return None
    cdef cnp.npy_intp dim = end - start
    arr = cnp.PyArray_EMPTY(1, &dim, cnp.NPY_INT32, 0)   # C-level: no np.empty call
    dst = <block_id_t*>cnp.PyArray_DATA(<cnp.ndarray>arr)
    for i in range(start, end):
        item = x[i]
        if type(item) is not int:
            return None
        v = PyLong_AsLongLongAndOverflow(item, &overflow)
        if overflow or v < lo or v >= hi:
            return None
        dst[i - start] = <block_id_t>v
    return arr


def trim_groups(object local, object remote, const signed char[::1] is_state,
                long long num_blocks):
    """Fast path of ``trim_remote_to_local`` with equal kernel ratios.

    ``local``/``remote``: list/tuple with one entry per group (lists/tuples of Python ints or
    1-D C-contiguous int32 arrays). Attention groups end-align remote to local and require
    real (non-null) remote blocks; state groups (``is_state[g]``) pair from the front with
    ``|len(local) - len(remote)| <= 1``. Returns ``(local, remote)`` tuples of int32 arrays,
    or None when anything is off this path or invalid (the general path names the error).
    """
    cdef Py_ssize_t G = is_state.shape[0], g, nl, nr, n
    cdef long long hi_local = num_blocks if num_blocks > 0 else INT32_MAX + 1
    cdef long long hi_remote = INT32_MAX + 1
    if not (type(local) is tuple or type(local) is list) or len(local) != G:
        return None
    if not (type(remote) is tuple or type(remote) is list) or len(remote) != G:
        return None
    out_l = [None] * G
    out_r = [None] * G
    for g in range(G):
        l = local[g]
        r = remote[g]
        if not ((type(l) is list or type(l) is tuple or _is_id_array(l)) and
                (type(r) is list or type(r) is tuple or _is_id_array(r))):
            return None
        nl = len(l)
        nr = len(r)
        if is_state[g]:
            if nl - nr > 1 or nr - nl > 1:
                return None
            n = nl if nl < nr else nr
            a = _take_ids(l, 0, nl, hi_local, False)
            b = _take_ids(r, 0, n, hi_remote, False)
            if a is None or b is None:
                return None
            out_l[g] = a[:n]
            out_r[g] = b
        else:
            if nl > nr:
                return None
            a = _take_ids(l, 0, nl, hi_local, False)
            b = _take_ids(r, nr - nl, nr, hi_remote, True)
            if a is None or b is None:
                return None
            out_l[g] = a
            out_r[g] = b
    return tuple(out_l), tuple(out_r)


def clip_keep_form(object groups, const long long[::1] plan, long long num_blocks):
    """Fast path of ``hmacore.windows.clip_windows``: groups with ``plan[g] == 0`` are returned
    as the very objects given (not inspected); clipped groups keep their form (list/tuple ->
    a list slice, int32 array -> a view) and every kept id is checked (an int, ``0 <= id <
    num_blocks``, or < 2**31 when num_blocks is 0). Returns None when the input is off this
    path or a kept id is invalid (the caller then names the error)."""
    cdef Py_ssize_t G = plan.shape[0], g, n, start, end, i
    cdef long long keep, spec, v
    cdef long long hi = num_blocks if num_blocks > 0 else INT32_MAX + 1
    cdef int overflow
    cdef bint is_arr
    if not (type(groups) is tuple or type(groups) is list) or len(groups) != G:
        return None
    out = PyTuple_New(G)
    for g in range(G):
        x = groups[g]
        keep = plan[g]
        if keep == 0:
            if not (type(x) is list or type(x) is tuple or _is_id_array(x)):
                return None
            Py_INCREF(x)
            PyTuple_SET_ITEM(out, g, x)
            continue
        is_arr = _is_id_array(x)
        if not is_arr and not (type(x) is list or type(x) is tuple):
            return None
        n = len(x)
        if keep > 0:
            start = n - keep if n > keep else 0
            end = n
        elif n == 0:
            start = 0
            end = 0
        else:
            spec = -1 - keep
            end = n - (spec if spec < n - 1 else n - 1)
            start = end - 1
        if is_arr:
            if not _all_in_range(<const block_id_t*>cnp.PyArray_DATA(<cnp.ndarray>x),
                                 start, end, 0, hi):
                return None
            y = x[start:end]
        else:
            for i in range(start, end):
                item = x[i]
                if type(item) is not int:
                    return None
                v = PyLong_AsLongLongAndOverflow(item, &overflow)
                if overflow or v < 0 or v >= hi:
                    return None
            y = x[start:end] if (start != 0 or end != n) else x
        Py_INCREF(y)
        PyTuple_SET_ITEM(out, g, y)
    return out


# Per-layout clip plans for clip_windows (key: id(layout), exact, clip_state; the layout is
# kept in the entry and identity-checked, ids can be reused), and the Python helpers the
# slow path needs (registered by hmacore.windows at import).
cdef dict _CLIP_CACHE = {}
cdef object _plan_fn = None
cdef object _fallback_fn = None


def register_clip_helpers(plan_fn, fallback_fn):
    """``plan_fn(layout, exact, clip_state)`` -> (int64 plan, num_blocks or 0), raising for a
    bad layout; ``fallback_fn(block_ids, layout, exact, clip_state)`` -> the general path."""
    global _plan_fn, _fallback_fn
    _plan_fn = plan_fn
    _fallback_fn = fallback_fn


def clip_windows(block_ids, layout, bint exact=False, bint clip_state=True):
    """One C call of ``hmacore.windows.clip_windows`` (see there for the contract)."""
    key = (<long long><Py_ssize_t><void*>layout) * 4 + exact * 2 + clip_state
    entry = _CLIP_CACHE.get(key)
    if entry is None or (<tuple>entry)[0] is not layout:
        plan, nb = _plan_fn(layout, exact, clip_state)
        if len(_CLIP_CACHE) > 256:
            _CLIP_CACHE.clear()
        entry = (layout, plan, nb)
        _CLIP_CACHE[key] = entry
    if (type(block_ids) is tuple or type(block_ids) is list) and len(block_ids) == 0:
        return ()
    fast = clip_keep_form(block_ids, (<tuple>entry)[1], (<tuple>entry)[2])
    if fast is not None:
        return fast
    return _fallback_fn(block_ids, layout, exact, clip_state)
