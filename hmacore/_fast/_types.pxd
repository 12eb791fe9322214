# The one place for hmacore's C integer types.
from libc.stdint cimport int32_t, int64_t, uint8_t, uint64_t

ctypedef int32_t block_id_t    # a block id inside one pool (id 0 = null block)
ctypedef int64_t desc_id_t     # a descriptor index into a prepared NIXL dlist (can pass 2**31)
ctypedef int64_t token_t       # token counts and positions
ctypedef uint8_t flag_t        # per-block booleans (hashed, present, mask)
