# Declarations of hmacore._fast._runs (maximal runs of paired descriptors): a dlist's
# compressed address table, usable from other kernels without the GIL through Table.
from libc.stdint cimport int64_t, uint64_t

cdef struct Table:
    const int64_t* start       # S + 1 first descriptor ids of the segments
    const uint64_t* base       # address of each segment's first descriptor
    const uint64_t* step       # address step inside a segment (mod 2**64)
    const uint64_t* length     # bytes of each descriptor of a segment
    const int64_t* kind        # registration domain << 32 | device id
    Py_ssize_t S

cdef class DescTable:
    cdef readonly Py_ssize_t num_descs
    cdef readonly Py_ssize_t num_segments
    cdef object _arrays
    cdef const int64_t* start
    cdef const uint64_t* base
    cdef const uint64_t* step
    cdef const uint64_t* length
    cdef const int64_t* kind
    cdef Table table(self)
