# Existence set of (group id, block hash) keys and the longest-hit kernel (see _hits.pyx).
from cpython.pythread cimport PyThread_type_lock
from libc.stdint cimport int64_t, uint8_t, uint64_t

from hmacore._fast._types cimport group_id_t, token_t


cdef class ExistenceSet:
    """Open-addressing hash set of fixed-width keys: int32 group id + digest_size bytes."""
    cdef readonly int digest_size
    cdef uint8_t* _slots          # capacity * _slot_size bytes; slot = int32 tag + digest
    cdef Py_ssize_t _cap          # number of slots (power of two, or 0)
    cdef Py_ssize_t _size         # live keys
    cdef Py_ssize_t _used         # live keys + tombstones
    cdef Py_ssize_t _slot_size
    cdef bint _initialised        # __init__ ran (it may run once)
    cdef PyThread_type_lock _lock  # taken (without the GIL) by every public operation

    cdef bytes _live_slots(self)
    cdef inline bint fits(self, Py_ssize_t extra) noexcept nogil
    cdef inline Py_ssize_t probe(self, group_id_t group, const uint8_t* digest,
                                 Py_ssize_t* insert_at) noexcept nogil
    cdef bint has(self, group_id_t group, const uint8_t* digest) noexcept nogil
    cdef int put(self, group_id_t group, const uint8_t* digest) noexcept nogil
    cdef bint drop(self, group_id_t group, const uint8_t* digest) noexcept nogil
    cdef int _rehash(self, Py_ssize_t new_cap) noexcept nogil
    cdef int reserve(self, Py_ssize_t extra) noexcept nogil
    cdef void lock(self) noexcept nogil
    cdef void unlock(self) noexcept nogil


# Engine-mask mode of the hit kernel (routing: hmacore/_fast/_route.pyx).
ctypedef const uint64_t* (*mask_fill_t)(void* state, group_id_t group,
                                        Py_ssize_t row) noexcept nogil

cdef struct SpecRow:
    int64_t kind
    int64_t block_size
    int64_t window
    int64_t chunk
    int64_t eagle
    int64_t member_start
    int64_t member_end
    int64_t fine_lookup

cdef struct KernelTables:
    const SpecRow* sp
    Py_ssize_t S
    const group_id_t* members
    int64_t num_members
    int64_t hash_block
    int64_t align
    bint partial
    bint unitary

cdef int kernel_tables(object kernel, KernelTables* out) except -1
cdef token_t hit_over_masks(const KernelTables* k, Py_ssize_t n_rows, token_t max_length,
                            const uint64_t** memo, mask_fill_t fill, void* fill_state,
                            Py_ssize_t word, uint64_t bit, int64_t* out) noexcept nogil
