"""Typed kernels for hmacore.windows: kernel-block expansion and null-run scans.

Callers (hmacore/windows.py) validate dtypes, shapes and the int32 overflow bound first.
List input is read with the shared converter of _helpers.pxd (the list is re-measured
before every element) and the outer per-group sequence is snapshotted into a tuple first,
so no allocation (which may run a finalizer) can make a loop read past a list's end.
"""
from cpython.ref cimport Py_INCREF
from cpython.tuple cimport PyTuple_New, PyTuple_SET_ITEM

import numpy as np
cimport numpy as cnp

from hmacore._fast._types cimport block_id_t, BLOCK_ID_NPY, BLOCK_ID_MAX
from hmacore._fast._helpers cimport (ID_OK, clip_span, id_bound, ids_in_range,
                                     is_block_id_array, is_list_or_tuple, seq_to_ids)

cnp.import_array()

BLOCK_ID_DTYPE = cnp.PyArray_DescrFromType(BLOCK_ID_NPY)


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


cdef inline tuple _snapshot(object groups, Py_ssize_t G):
    """The per-group sequence as a tuple this call owns, or None when it is not a list/tuple
    of G entries (off the fast path)."""
    if not is_list_or_tuple(groups) or len(groups) != G:
        return None
    return groups if type(groups) is tuple else tuple(groups)


cdef object _take_ids(object x, Py_ssize_t start, Py_ssize_t end, long long lo, long long hi):
    """x[start:end] as validated int32 (a view for int32 arrays), or None when x is off the
    fast path or an id is outside ``[lo, hi)``."""
    cdef Py_ssize_t bad = -1
    if is_block_id_array(x):
        if not ids_in_range(<const block_id_t*>cnp.PyArray_DATA(<cnp.ndarray>x) + start,
                            end - start, lo, hi):
            return None
        return x[start:end]
    if not is_list_or_tuple(x):
        return None
    cdef cnp.npy_intp dim = end - start
    arr = cnp.PyArray_EMPTY(1, &dim, BLOCK_ID_NPY, 0)   # C-level: no np.empty call
    if seq_to_ids(x, start, end, lo, hi, True,
                  <block_id_t*>cnp.PyArray_DATA(<cnp.ndarray>arr), &bad) != ID_OK:
        return None
    return arr


def clip_groups(object groups, const long long[::1] plan, long long num_blocks):
    """Fast path of ``clip_to_window`` (plan encoding: see ``hmacore.windows.window_plan``).

    ``groups``: a list/tuple with one entry per plan entry, each a list/tuple of Python ints
    or a 1-D C-contiguous int32 array. Returns a tuple of int32 arrays (views for array
    input) holding the clipped part, validated (``0 <= id < num_blocks``, or < 2**31 when
    num_blocks is 0). Returns None when the input is off this path or anything kept is
    invalid: the caller's general path then decides and names the error.
    """
    cdef Py_ssize_t G = plan.shape[0], g, start, end
    cdef long long hi = id_bound(num_blocks)
    cdef tuple gs = _snapshot(groups, G)
    if gs is None:
        return None
    out = [None] * G
    for g in range(G):
        x = gs[g]
        if not (is_block_id_array(x) or is_list_or_tuple(x)):
            return None
        clip_span(len(x), plan[g], &start, &end)
        y = _take_ids(x, start, end, 0, hi)
        if y is None:
            return None
        out[g] = y
    return tuple(out)


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
    cdef long long hi_local = id_bound(num_blocks)
    cdef long long hi_remote = <long long>BLOCK_ID_MAX + 1
    cdef tuple ls = _snapshot(local, G)
    cdef tuple rs = _snapshot(remote, G)
    if ls is None or rs is None:
        return None
    out_l = [None] * G
    out_r = [None] * G
    for g in range(G):
        l = ls[g]
        r = rs[g]
        if not ((is_list_or_tuple(l) or is_block_id_array(l)) and
                (is_list_or_tuple(r) or is_block_id_array(r))):
            return None
        nl = len(l)
        nr = len(r)
        if is_state[g]:
            if nl - nr > 1 or nr - nl > 1:
                return None
            n = nl if nl < nr else nr
            a = _take_ids(l, 0, nl, 0, hi_local)
            b = _take_ids(r, 0, n, 0, hi_remote)
            if a is None or b is None:
                return None
            out_l[g] = a[:n]
            out_r[g] = b
        else:
            if nl > nr:
                return None
            a = _take_ids(l, 0, nl, 0, hi_local)
            b = _take_ids(r, nr - nl, nr, 1, hi_remote)   # paired remote blocks are real
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
    cdef Py_ssize_t G = plan.shape[0], g, n, start, end, bad = -1
    cdef long long hi = id_bound(num_blocks)
    cdef tuple gs = _snapshot(groups, G)
    if gs is None:
        return None
    out = PyTuple_New(G)
    for g in range(G):
        x = gs[g]
        if plan[g] == 0:
            if not (is_list_or_tuple(x) or is_block_id_array(x)):
                return None
            Py_INCREF(x)
            PyTuple_SET_ITEM(out, g, x)
            continue
        if is_block_id_array(x):
            n = cnp.PyArray_DIM(<cnp.ndarray>x, 0)
            clip_span(n, plan[g], &start, &end)
            if not ids_in_range(<const block_id_t*>cnp.PyArray_DATA(<cnp.ndarray>x) + start,
                                end - start, 0, hi):
                return None
            y = x[start:end]
        elif is_list_or_tuple(x):
            n = len(x)
            clip_span(n, plan[g], &start, &end)
            if seq_to_ids(x, start, end, 0, hi, True, NULL, &bad) != ID_OK:
                return None
            y = x[start:end] if (start != 0 or end != n) else x
        else:
            return None
        Py_INCREF(y)
        PyTuple_SET_ITEM(out, g, y)
    return out


# ---------------------------------------------------------------------------------------
# Per-layout compiled clip plans, cached on the layout object itself
# ---------------------------------------------------------------------------------------
cdef str _ATTR = "_hmacore_windows"


def _no_plan():
    """What a pickled layout carries instead of its compiled plans (rebuilt on first use)."""
    return None


cdef class LayoutClip:
    """The window clip of one layout, compiled once: the int64 plan for each (exact,
    clip_state) combination (see ``hmacore.windows.window_plan``), the per-group state flags
    (int8, 1 = MAMBA) and the pool size (0 = unknown). Read-only arrays.

    Built by ``hmacore.windows`` and stored on the layout object (attribute
    ``_hmacore_windows``; KVLayout is frozen, so the plans stay valid for its lifetime;
    dataclass equality, hashing and ``to_dict`` ignore it, and a pickled layout carries
    None there, rebuilt on first use). Immutable: shareable between threads.
    """
    cdef readonly tuple plans           # index exact * 2 + clip_state
    cdef readonly object state_groups
    cdef readonly long long num_blocks

    def __init__(self, plans, state_groups, long long num_blocks):
        if self.plans is not None:
            raise RuntimeError("LayoutClip is already initialised")
        plans = tuple(plans)
        if len(plans) != 4:
            raise ValueError("plans must hold the 4 (exact, clip_state) plans")
        for p in plans:
            if not (isinstance(p, np.ndarray) and p.dtype == np.int64 and p.ndim == 1
                    and p.flags.c_contiguous and not p.flags.writeable):
                raise ValueError("every plan must be a read-only C-contiguous int64 array")
        self.plans = plans
        self.state_groups = state_groups
        self.num_blocks = num_blocks

    def plan(self, bint exact, bint clip_state):
        return self.plans[exact * 2 + clip_state]

    def __reduce__(self):
        return _no_plan, ()

    def __repr__(self):
        return f"LayoutClip(groups={len(self.plans[0])}, num_blocks={self.num_blocks})"


cdef object _compile_fn = None
cdef object _fallback_fn = None


def register_clip_helpers(compile_fn, fallback_fn):
    """``compile_fn(layout)`` -> the layout's LayoutClip, built and stored on it (raising for
    a non-layout); ``fallback_fn(block_ids, layout, exact, clip_state)`` -> the general path."""
    global _compile_fn, _fallback_fn
    _compile_fn = compile_fn
    _fallback_fn = fallback_fn


cpdef LayoutClip layout_clip(object layout):
    """The layout's compiled clip plans (cached on the layout; built on first use)."""
    lc = getattr(layout, _ATTR, None)
    if type(lc) is LayoutClip:
        return <LayoutClip>lc
    return _compile_fn(layout)


def clip_windows(block_ids, layout, bint exact=False, bint clip_state=True):
    """One C call of ``hmacore.windows.clip_windows`` (see there for the contract)."""
    cdef LayoutClip lc = layout_clip(layout)
    if is_list_or_tuple(block_ids) and len(block_ids) == 0:
        return ()
    fast = clip_keep_form(block_ids, lc.plans[exact * 2 + clip_state], lc.num_blocks)
    if fast is not None:
        return fast
    return _fallback_fn(block_ids, layout, exact, clip_state)
