# Existence set of (group id, block hash) keys and the longest-hit kernel (see _hits.pyx).
from cpython.pythread cimport PyThread_type_lock
from libc.stdint cimport uint8_t

from hmacore._fast._types cimport group_id_t


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
