# Typed kernels and per-request storage behind hmacore.tables (cimport-able by other kernels).
from hmacore._fast._types cimport block_id_t, flag_t, token_t

# Status codes of the id converters/scanners (hmacore.tables turns them into messages).
cdef enum IdStatus:
    ID_OK = 0
    ID_NOT_INT = 1      # float, bool, str, None ...
    ID_NEGATIVE = 2
    ID_PAST_INT32 = 3   # > 2**31 - 1
    ID_PAST_POOL = 4    # >= num_blocks

cdef Py_ssize_t first_bad_id(const block_id_t[::1] ids, long long num_blocks) noexcept nogil


cdef struct GroupBuf:
    block_id_t* data                # the table of one (slot, group): blocks of that group
    Py_ssize_t len                  # live entries
    Py_ssize_t cap                  # capacity of the owner array


cdef class TableStore:
    """Every tracked request's per-group tables, slot-indexed (one slot per request)."""
    cdef readonly int num_groups
    cdef readonly dict index        # req_id -> slot (int)
    cdef Py_ssize_t _nslots         # slots allocated (live + free)
    cdef list _bufs                 # slot*G + g: owner np.ndarray[int32] (read-only for NumPy)
    cdef GroupBuf* _gb              # slot*G + g: data/len/cap (contiguous per request)
    cdef int* _state                # per slot; FREE_SLOT when unused
    cdef token_t* _marks            # slot*NUM_MARKS + k: watermarks (tokens)
    cdef Py_ssize_t* _free          # stack of free slots
    cdef Py_ssize_t _nfree
    cdef Py_ssize_t* _scratch       # a batch's resolved slots (reused across calls)
    cdef Py_ssize_t _scratch_cap

    cdef void _grow_slots(self) except *
    cdef void _set_buffer(self, Py_ssize_t k, object arr) except *
    cdef void _reserve(self, Py_ssize_t k, Py_ssize_t need) except *
    cdef inline Py_ssize_t _k(self, Py_ssize_t s, int g) except -1
    cdef Py_ssize_t _resolve(self, object req_ids) except -2
