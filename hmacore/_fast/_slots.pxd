# The open-addressing slot table shared by ExistenceSet (_hits.pyx) and the routing table
# (_route.pyx): slots of an int32 tag (a group id, or EMPTY / DELETED) and a digest, a
# power-of-two capacity, linear probing. Each table keeps its own hash of (group, digest).
from libc.stdint cimport uint8_t, uint64_t
from libc.string cimport memcmp, memcpy

from hmacore._fast._types cimport group_id_t

cdef enum:
    SLOT_EMPTY = -1
    SLOT_DELETED = -2


cdef inline Py_ssize_t probe_slots(const uint8_t* slots, Py_ssize_t cap, Py_ssize_t slot_size,
                                   int digest_size, group_id_t group, const uint8_t* digest,
                                   uint64_t key_hash, Py_ssize_t* insert_at) noexcept nogil:
    """The slot index of key (group, digest), or -1 when absent; then ``insert_at`` (if not
    NULL) gets the slot an insert should use (the first tombstone passed, else the empty slot
    that ended the probe). Requires ``cap > 0``, a power of two; terminates because a table
    always keeps an empty slot."""
    cdef Py_ssize_t mask = cap - 1, first_free = -1, j
    cdef group_id_t tag
    cdef const uint8_t* slot
    j = <Py_ssize_t>(key_hash & <uint64_t>mask)
    while True:
        slot = slots + j * slot_size
        memcpy(&tag, slot, 4)
        if tag == SLOT_EMPTY:
            if insert_at != NULL:
                insert_at[0] = first_free if first_free >= 0 else j
            return -1
        if tag == SLOT_DELETED:
            if first_free < 0:
                first_free = j
        elif tag == group and memcmp(slot + 4, digest, digest_size) == 0:
            return j
        j = (j + 1) & mask
