# The one place for hmacore's C integer types (cimported by every kernel, in the manner of
# scikit-learn's utils/_typedefs.pxd). The NumPy type numbers below are tied to these
# typedefs: the modules build their Python-level dtypes from them (BLOCK_ID_DTYPE, ...) and
# _tables checks the sizes at import, so changing a typedef here changes every array.
cimport numpy as cnp
from libc.stdint cimport int32_t, int64_t, uint8_t, uint64_t

ctypedef int32_t block_id_t    # a block id inside one pool (id 0 = null block)
ctypedef int64_t desc_id_t     # a descriptor index into a prepared NIXL dlist (can pass 2**31)
ctypedef int32_t desc_id32_t   # NIXL's int32 fast path (every dlist under 2**31 descriptors)
ctypedef int64_t token_t       # token counts and positions
ctypedef uint8_t flag_t        # per-block booleans (hashed, present, mask)
ctypedef int32_t group_id_t    # a KV cache group id (the ExistenceSet key tag)

# Descriptor-id output of the flattening kernels: int64 in general, int32 for NIXL.
ctypedef fused out_desc_id_t:
    desc_id32_t
    desc_id_t

# NumPy type numbers of the typedefs above (C constants; Python: *_DTYPE in _tables).
cdef enum:
    BLOCK_ID_NPY = cnp.NPY_INT32
    DESC_ID_NPY = cnp.NPY_INT64
    DESC_ID32_NPY = cnp.NPY_INT32
    TOKEN_NPY = cnp.NPY_INT64
    FLAG_NPY = cnp.NPY_UINT8
    GROUP_ID_NPY = cnp.NPY_INT32

# Bounds (C constants).
cdef enum:
    BLOCK_ID_MAX = 2147483647          # largest block id (int32)
cdef extern from *:
    """
    #define HMACORE_TOKEN_MAX ((long long)0x7FFFFFFFFFFFFFFFLL)
    """
    const long long TOKEN_MAX "HMACORE_TOKEN_MAX"   # largest token count (int64)
