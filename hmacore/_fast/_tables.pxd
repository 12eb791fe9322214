# Typed kernels and per-request storage behind hmacore.tables (cimport-able by other kernels).
from hmacore._fast._types cimport block_id_t, flag_t, token_t
# Status codes of the id converters/scanners live with the shared converter.
from hmacore._fast._helpers cimport (IdStatus, ID_OK, ID_NOT_INT, ID_NEGATIVE, ID_PAST_INT32,
                                     ID_PAST_POOL, ID_NULL, ID_CHANGED)

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
    cdef object _spans_buf          # int64 storage behind clip_spans results (recycled)

    cdef void _grow_slots(self) except *
    cdef void _set_buffer(self, Py_ssize_t k, object arr) except *
    cdef inline bint _exported(self, Py_ssize_t k) noexcept
    cdef void _detach(self, Py_ssize_t k, bint keep) except *
    cdef void _reserve(self, Py_ssize_t k, Py_ssize_t need) except *
    cdef inline Py_ssize_t _k(self, Py_ssize_t s, int g) except -1
    cdef Py_ssize_t _resolve(self, object req_ids) except -2
    cdef object _spans_array(self, Py_ssize_t R, int G)
    cdef object _check_batch(self, Py_ssize_t R, const long long* slot, const long long* off,
                             int preempted_state)
