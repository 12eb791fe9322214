"""Typed kernels for hmacore.windows: kernel-block expansion and null-run scans.

Callers (hmacore/windows.py) validate dtypes, shapes and the int32 overflow bound first.
"""
from hmacore._fast._types cimport block_id_t


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
