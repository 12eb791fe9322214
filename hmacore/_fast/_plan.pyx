# cython: language_level=3
"""Descriptor-id flattening: per-group block ids -> int64 indices into a prepared dlist.

The plan (hmacore.plan.TransferPlan) describes regions as parallel arrays; this module only
does the per-request arithmetic. Every entry validates its arguments completely before any
unchecked memory access (the build turns boundscheck/wraparound off).

Raw pointers into the caller's id arrays are only taken from a tuple this module holds for
the whole call (a list argument is copied into one first): another thread replacing an
element of the caller's list while the GIL is released can never free an array being read.
"""
import numpy as np
cimport numpy as cnp
from cpython.list cimport PyList_AsTuple, PyList_CheckExact
from cpython.tuple cimport PyTuple_CheckExact
from libc.stdlib cimport malloc, free
from libc.string cimport memcpy
from libc.stdint cimport int32_t, int64_t, uint8_t

from hmacore.errors import BlockTableError

from hmacore._fast._types cimport (block_id_t, desc_id_t, desc_id32_t, group_id_t,
                                   out_desc_id_t, BLOCK_ID_NPY, DESC_ID_NPY, DESC_ID32_NPY,
                                   GROUP_ID_NPY)
from hmacore._fast._helpers cimport (ID_OK, id_min_max, is_block_id_array, is_list_or_tuple,
                                     seq_to_ids)

cnp.import_array()

BLOCK_ID_DTYPE = cnp.PyArray_DescrFromType(BLOCK_ID_NPY)
DESC_ID_DTYPE = cnp.PyArray_DescrFromType(DESC_ID_NPY)
GROUP_ID_DTYPE = cnp.PyArray_DescrFromType(GROUP_ID_NPY)
# at most this many groups take the fast path (stack arrays of pointers / lengths)
cdef enum:
    MAX_FAST_GROUPS = 64


cdef inline tuple _owned(object block_ids):
    """``block_ids`` as a tuple this call owns (an exact list is copied; a tuple is already
    immutable), or None when it is neither: every raw pointer the fast paths take comes
    from the arrays such a tuple keeps alive."""
    if PyTuple_CheckExact(block_ids):
        return <tuple>block_ids
    if PyList_CheckExact(block_ids):
        return PyList_AsTuple(block_ids)
    return None


cdef tuple _lists_as_arrays(tuple held, Py_ssize_t G):
    """The worker's form of a table (one list of exact ints per group, what the connector
    metadata carries) as fresh int32 arrays, in one C pass per group with no Python object
    per id; None when any group is not such a list or holds anything else (the checked path
    then converts it or names the bad entry). Ids are range-checked against int32 here and
    against the regions by the caller's scan."""
    cdef Py_ssize_t g, m, bad = 0
    cdef cnp.npy_intp dim
    if len(held) != G:
        return None
    out = []
    for g in range(G):
        x = held[g]
        if not is_list_or_tuple(x):
            return None
        m = len(x)
        dim = m
        a = cnp.PyArray_EMPTY(1, &dim, BLOCK_ID_NPY, 0)
        # exact ints only: no user code runs, so the list cannot change under the loop
        if m and seq_to_ids(x, 0, m, 0, (<long long>1) << 31, True,
                            <block_id_t*>cnp.PyArray_DATA(<cnp.ndarray>a), &bad) != ID_OK:
            return None
        out.append(a)
    return tuple(out)


cdef inline bint _serves(int r, int g, const group_id_t* rgroup, const uint8_t* rstate,
                         const uint8_t* gstate) noexcept nogil:
    return rstate[r] == gstate[g] and (rgroup[r] == -1 or rgroup[r] == g)


cdef object _bad_id(str msg, int g, Py_ssize_t i):
    err = BlockTableError(msg)
    err.group = g
    err.block_index = i
    return err


def _region_array(name, arr, dtype, Py_ssize_t n):
    if not isinstance(arr, np.ndarray) or arr.dtype != dtype or arr.ndim != 1 \
            or not arr.flags.c_contiguous or arr.shape[0] != n:
        raise BlockTableError(f"{name} must be a C-contiguous 1-D {np.dtype(dtype).name} array "
                              f"of length {n}")
    return arr


def count_desc_ids(tuple block_ids, cnp.ndarray region_ratio, cnp.ndarray region_group,
                   cnp.ndarray region_state, cnp.ndarray group_state, bint kernel_ids):
    """Number of descriptor ids ``flatten_desc_ids`` emits for these per-group id arrays."""
    cdef Py_ssize_t R = region_ratio.shape[0], G = group_state.shape[0]
    _region_array("region_ratio", region_ratio, np.int32, R)
    _region_array("region_group", region_group, GROUP_ID_DTYPE, R)
    _region_array("region_state", region_state, np.uint8, R)
    _region_array("group_state", group_state, np.uint8, G)
    cdef const int32_t[::1] ratio = region_ratio
    cdef const group_id_t[::1] rgroup = region_group
    cdef const uint8_t[::1] rstate = region_state
    cdef const uint8_t[::1] gstate = group_state
    cdef Py_ssize_t g, r, n = 0, m
    if len(block_ids) != G:
        raise BlockTableError(f"block_ids has {len(block_ids)} groups, the plan has {G}")
    for g in range(G):
        m = len(block_ids[g])
        if m == 0:
            continue
        for r in range(R):
            if _serves(r, g, &rgroup[0], &rstate[0], &gstate[0]):
                n += m if (kernel_ids or rstate[r]) else m * ratio[r]
    return n


def flatten_desc_ids(tuple block_ids, cnp.ndarray region_offset, cnp.ndarray region_logical,
                     cnp.ndarray region_ratio, cnp.ndarray region_group,
                     cnp.ndarray region_state, cnp.ndarray group_state, *,
                     bint group_major, bint kernel_ids=False, bint allow_null=False, out=None):
    """Descriptor ids (int64) of one request's blocks, region-major or group-major.

    Args:
        block_ids: G C-contiguous 1-D int32 arrays, group g's block ids in table order.
            Attention groups: logical ids (expanded to ``id*ratio + k``) or, with
            ``kernel_ids``, kernel-block ids. State groups: logical ids, never expanded.
        region_offset: int64[R], first descriptor index of region r in the dlist.
        region_logical: int64[R], logical blocks of region r (ids must be below it).
        region_ratio: int32[R], descriptors per logical block (kernel x peer ratio; 1 for state).
        region_group: int32[R], owning group or -1 (shared by every group of its kind).
        region_state: uint8[R], 1 for Mamba/state regions.
        group_state: uint8[G], 1 for Mamba/state groups.
        group_major: False = ``for r: for g: ids`` (classic HMA, every region shared);
            True = ``for g: for r serving g: ids`` (owned regions, state regions).
        kernel_ids: attention ids are already kernel-granular.
        allow_null: accept id 0 (logical) / ids below the ratio (kernel).
        out: optional C-contiguous int64 buffer with room for the result; written in place.

    Returns:
        int64 array (a prefix view of ``out`` when given). Empty groups are skipped; all-empty
        input gives an empty int64 array. Raises BlockTableError (with ``group`` and
        ``block_index`` attributes where an id is at fault) and writes nothing on bad input.
    """
    cdef Py_ssize_t R = region_offset.shape[0], G = group_state.shape[0]
    _region_array("region_offset", region_offset, np.int64, R)
    _region_array("region_logical", region_logical, np.int64, R)
    n_obj = count_desc_ids(block_ids, region_ratio, region_group, region_state, group_state,
                           kernel_ids)
    cdef Py_ssize_t n = n_obj
    cdef const int64_t[::1] off = region_offset
    cdef const int64_t[::1] logical = region_logical
    cdef const int32_t[::1] ratio = region_ratio
    cdef const group_id_t[::1] rgroup = region_group
    cdef const uint8_t[::1] rstate = region_state
    cdef const uint8_t[::1] gstate = group_state
    cdef Py_ssize_t g, r, i, m
    cdef int64_t lo, hi, v, rr
    cdef block_id_t mn, mx
    cdef bint served
    cdef const block_id_t[::1] ids
    for r in range(R):
        if ratio[r] < 1 or logical[r] < 1 or off[r] < 0:
            raise BlockTableError(f"region {r}: ratio, logical block count must be >= 1 and "
                                  "offset >= 0")
    # Validate every group's ids before writing anything.
    for g in range(G):
        a = block_ids[g]
        if not isinstance(a, np.ndarray) or a.dtype != BLOCK_ID_DTYPE or a.ndim != 1 \
                or not a.flags.c_contiguous:
            raise BlockTableError(f"block_ids[{g}] must be a C-contiguous 1-D int32 array")
        m = a.shape[0]
        if m == 0:
            continue
        ids = a          # the memoryview holds a buffer export: the array cannot go away
        with nogil:
            id_min_max(&ids[0], m, &mn, &mx)
        served = False
        for r in range(R):
            if not _serves(r, g, &rgroup[0], &rstate[0], &gstate[0]):
                continue
            served = True
            rr = 1 if (rstate[r] or not kernel_ids) else ratio[r]
            hi = logical[r] * rr
            lo = 0 if allow_null else rr
            if mn >= lo and mx < hi:
                continue
            for i in range(m):
                v = ids[i]
                if v < lo or v >= hi:
                    why = (" (id 0 and its kernel blocks are the null block)"
                           if 0 <= v < lo else "")
                    raise _bad_id(f"block_ids[{g}][{i}] = {v} is out of range [{lo}, {hi}) "
                                  f"of region {r}{why}", g, i)
        if not served:
            raise _bad_id(f"block_ids[{g}] has {m} ids but no region serves group {g}", g, 0)
    if out is None:
        result = np.empty(n, dtype=DESC_ID_DTYPE)
    else:
        if not isinstance(out, np.ndarray) or out.dtype != DESC_ID_DTYPE or out.ndim != 1 \
                or not out.flags.c_contiguous or not out.flags.writeable:
            raise BlockTableError("out must be a writeable C-contiguous 1-D int64 array")
        if out.shape[0] < n:
            raise BlockTableError(f"out has room for {out.shape[0]} descriptor ids, {n} needed")
        result = out[:n]
    if n == 0:
        return result
    cdef desc_id_t[::1] dst = result
    cdef const block_id_t** ptrs = <const block_id_t**>malloc(G * sizeof(block_id_t*))
    cdef Py_ssize_t* lens = <Py_ssize_t*>malloc(G * sizeof(Py_ssize_t))
    if ptrs == NULL or lens == NULL:
        free(ptrs); free(lens)
        raise MemoryError()
    cdef cnp.ndarray arr
    for g in range(G):       # block_ids is a tuple: it keeps every array alive meanwhile
        arr = block_ids[g]
        lens[g] = arr.shape[0]
        ptrs[g] = <const block_id_t*>cnp.PyArray_DATA(arr)
    with nogil:
        _emit(ptrs, lens, G, R, &off[0], &ratio[0], &rgroup[0], &rstate[0], &gstate[0],
              group_major, kernel_ids, &dst[0])
    free(ptrs)
    free(lens)
    return result


cdef Py_ssize_t _emit_run(const block_id_t* ids, Py_ssize_t m, int64_t base, int64_t ratio,
                          out_desc_id_t* dst) noexcept nogil:
    # dst[k] = base + id*ratio + j for each id, j < ratio: m*ratio entries (the caller sized
    # dst from the same counts). Ids were checked against the region's bounds, so every
    # value fits the output type.
    cdef Py_ssize_t i, k = 0
    cdef int64_t j, b
    if ratio == 1:
        for i in range(m):
            dst[i] = <out_desc_id_t>(base + ids[i])
        return m
    for i in range(m):
        b = base + <int64_t>ids[i] * ratio
        for j in range(ratio):
            dst[k] = <out_desc_id_t>(b + j)
            k += 1
    return k


cdef void _emit(const block_id_t** ptrs, const Py_ssize_t* lens, Py_ssize_t G, Py_ssize_t R,
                const int64_t* off, const int32_t* ratio, const group_id_t* rgroup,
                const uint8_t* rstate, const uint8_t* gstate, bint group_major,
                bint kernel_ids, out_desc_id_t* dst) noexcept nogil:
    # Writes exactly the count run()/count_desc_ids() computed: per (group, serving region)
    # lens[g] ids times 1 (state / kernel ids) or the region's ratio. Two bounded loops.
    cdef Py_ssize_t g, r, pos = 0
    cdef int64_t rr
    if group_major:
        for g in range(G):
            if lens[g] == 0:
                continue
            for r in range(R):
                if _serves(r, g, rgroup, rstate, gstate):
                    rr = 1 if (rstate[r] or kernel_ids) else ratio[r]
                    pos += _emit_run(ptrs[g], lens[g], off[r], rr, dst + pos)
    else:
        for r in range(R):
            for g in range(G):
                if lens[g] != 0 and _serves(r, g, rgroup, rstate, gstate):
                    rr = 1 if (rstate[r] or kernel_ids) else ratio[r]
                    pos += _emit_run(ptrs[g], lens[g], off[r], rr, dst + pos)


# ---------------------------------------------------------------------------------------
# Compiled plan: region arrays validated once, one call per request
# ---------------------------------------------------------------------------------------
cdef class DescPlan:
    """``flatten_desc_ids`` with the plan's region arrays validated and copied once.

    Per group g it precomputes whether any region serves g, the descriptors emitted per id
    (logical and kernel ids) and the id bounds valid in *every* serving region, so
    :meth:`run` checks a group with one min/max pass. Any id outside those bounds is
    re-checked by ``flatten_desc_ids``, which raises the precise BlockTableError.

    Threads: immutable after construction (private read-only copies of the region arrays,
    no scratch buffer), so one plan may be used by any number of threads at once. The
    per-call id arrays are read through a tuple the call owns (see the module docstring).
    """
    cdef object _arrays
    cdef const int64_t* off
    cdef const int64_t* logical
    cdef const int32_t* ratio
    cdef const group_id_t* rgroup
    cdef const uint8_t* rstate
    cdef const uint8_t* gstate
    cdef Py_ssize_t R, G
    cdef bint group_major
    cdef object _per_group            # int64 (G, 6): served, per_logical, per_kernel, hi_l, hi_k, lo_k
    cdef object _convert

    def __init__(self, region_offset, region_logical, region_ratio, region_group,
                 region_state, group_state, bint group_major, convert=None):
        """``convert``: called on any ``block_ids`` off the fast path (not a tuple/list of
        int32 arrays); must return a tuple of C-contiguous int32 arrays or raise."""
        self._convert = convert
        R = len(region_offset)
        G = len(group_state)
        arrays = [np.array(region_offset, dtype=np.int64, copy=True),
                  np.array(region_logical, dtype=np.int64, copy=True),
                  np.array(region_ratio, dtype=np.int32, copy=True),
                  np.array(region_group, dtype=GROUP_ID_DTYPE, copy=True),
                  np.array(region_state, dtype=np.uint8, copy=True),
                  np.array(group_state, dtype=np.uint8, copy=True)]
        for name, a, n in zip(("region_offset", "region_logical", "region_ratio",
                               "region_group", "region_state", "group_state"), arrays,
                              (R, R, R, R, R, G)):
            _region_array(name, a, a.dtype, n)
            a.flags.writeable = False
        self._arrays = arrays
        self.R = R
        self.G = G
        self.group_major = group_major
        self.off = <const int64_t*>cnp.PyArray_DATA(<cnp.ndarray>arrays[0])
        self.logical = <const int64_t*>cnp.PyArray_DATA(<cnp.ndarray>arrays[1])
        self.ratio = <const int32_t*>cnp.PyArray_DATA(<cnp.ndarray>arrays[2])
        self.rgroup = <const group_id_t*>cnp.PyArray_DATA(<cnp.ndarray>arrays[3])
        self.rstate = <const uint8_t*>cnp.PyArray_DATA(<cnp.ndarray>arrays[4])
        self.gstate = <const uint8_t*>cnp.PyArray_DATA(<cnp.ndarray>arrays[5])
        cdef Py_ssize_t r, g
        for r in range(R):
            if self.ratio[r] < 1 or self.logical[r] < 1 or self.off[r] < 0:
                raise BlockTableError(f"region {r}: ratio, logical block count must be >= 1 "
                                      "and offset >= 0")
        pg = np.zeros((G, 6), dtype=np.int64)
        cdef int64_t[:, ::1] p = pg
        cdef int64_t rk, hi_l, hi_k, lo_k
        for g in range(G):
            hi_l = hi_k = 2147483648
            lo_k = 1
            for r in range(R):
                if not _serves(r, g, self.rgroup, self.rstate, self.gstate):
                    continue
                p[g, 0] = 1
                p[g, 1] += 1 if self.rstate[r] else self.ratio[r]
                p[g, 2] += 1
                rk = 1 if self.rstate[r] else self.ratio[r]
                hi_l = min(hi_l, self.logical[r])
                hi_k = min(hi_k, self.logical[r] * rk)
                lo_k = max(lo_k, rk)
            p[g, 3] = hi_l
            p[g, 4] = hi_k
            p[g, 5] = lo_k
        pg.flags.writeable = False
        self._per_group = pg

    def __reduce__(self):
        a = self._arrays
        return (DescPlan, (a[0], a[1], a[2], a[3], a[4], a[5], self.group_major, self._convert))

    def run(self, block_ids, *, bint kernel_ids=False, bint allow_null=False, out=None):
        """Descriptor ids (int64) of one request; same contract as ``flatten_desc_ids``.
        ``block_ids``: a tuple/list of G C-contiguous 1-D int32 arrays."""
        cdef const block_id_t* ptrs[MAX_FAST_GROUPS]
        cdef Py_ssize_t lens[MAX_FAST_GROUPS]
        cdef tuple held = _owned(block_ids)   # keeps the arrays alive while ptrs are used
        cdef Py_ssize_t n = self._scan_fast(held, kernel_ids, allow_null, ptrs, lens)
        if n < 0 and held is not None:
            # lists of Python ints (the metadata's form): one C pass into owned int32 arrays
            held = _lists_as_arrays(held, self.G)
            n = self._scan_fast(held, kernel_ids, allow_null, ptrs, lens)
        if n < 0:
            return self._slow(block_ids, kernel_ids, allow_null, out)
        cdef Py_ssize_t G = self.G
        cdef cnp.npy_intp dim = n
        if out is None:
            result = cnp.PyArray_EMPTY(1, &dim, DESC_ID_NPY, 0)
        else:
            if not (cnp.PyArray_Check(out) and cnp.PyArray_TYPE(<cnp.ndarray>out) == DESC_ID_NPY
                    and cnp.PyArray_NDIM(<cnp.ndarray>out) == 1
                    and cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>out)
                    and cnp.PyArray_ISNOTSWAPPED(<cnp.ndarray>out)
                    and cnp.PyArray_ISWRITEABLE(<cnp.ndarray>out)
                    and cnp.PyArray_DIM(<cnp.ndarray>out, 0) >= n):
                return self._slow(block_ids, kernel_ids, allow_null, out)
            result = out[:n] if cnp.PyArray_DIM(<cnp.ndarray>out, 0) != n else out
        if n == 0:
            return result
        cdef desc_id_t* dst = <desc_id_t*>cnp.PyArray_DATA(<cnp.ndarray>result)
        with nogil:      # ptrs point into arrays `held` keeps alive
            _emit(ptrs, lens, G, self.R, self.off, self.ratio, self.rgroup, self.rstate,
                  self.gstate, self.group_major, kernel_ids, dst)
        return result

    cdef Py_ssize_t _scan_fast(self, tuple block_ids, bint kernel_ids, bint allow_null,
                               const block_id_t** ptrs, Py_ssize_t* lens):
        """Descriptor count of ``block_ids`` when it is in the fast form: a tuple (the
        caller's, or the caller's list copied by :func:`_owned`; it must stay referenced as
        long as ``ptrs`` is used) of G exact C-contiguous 1-D int32 arrays whose ids lie
        inside every serving region's bounds (logical or kernel ids; id 0 only with
        ``allow_null``). Fills ``ptrs``/``lens`` (room for MAX_FAST_GROUPS groups). -1 when
        anything is off that form: the caller then takes the checked path, which converts
        or raises the precise error."""
        cdef Py_ssize_t G = self.G, g, m, n = 0
        cdef block_id_t mn, mx
        cdef int64_t lo, hi
        cdef const block_id_t* src
        cdef const int64_t[:, ::1] p = self._per_group
        if block_ids is None or len(block_ids) != G or G > MAX_FAST_GROUPS:
            return -1
        for g in range(G):
            a = block_ids[g]
            if not is_block_id_array(a):
                return -1
            m = cnp.PyArray_DIM(<cnp.ndarray>a, 0)
            src = <const block_id_t*>cnp.PyArray_DATA(<cnp.ndarray>a)
            ptrs[g] = src
            lens[g] = m
            if m == 0:
                continue
            if not p[g, 0]:
                return -1
            with nogil:
                id_min_max(src, m, &mn, &mx)
            if kernel_ids:
                hi = p[g, 4]
                lo = 0 if allow_null else p[g, 5]
                n += m * p[g, 2]
            else:
                hi = p[g, 3]
                lo = 0 if allow_null else 1
                n += m * p[g, 1]
            if mn < lo or mx >= hi:
                return -1
        return n

    def pair_ids32(self, DescPlan remote, local_ids, remote_ids, group_bytes):
        """Fast path of a positional block pairing between this plan and ``remote`` (a NIXL
        READ/WRITE): ``(local desc ids, remote desc ids, local copy, bytes)`` -- both id arrays
        int32, ``local copy`` a tuple of private int32 copies of the local groups, ``bytes``
        the sum of ``len(local_ids[g]) * group_bytes[g]``. Returns None whenever either side is
        off the fast form of :meth:`run` (G exact C-contiguous 1-D int32 arrays, logical ids in
        bounds, no null ids) or the per-group lengths differ: the caller then takes the checked
        path, which raises the precise error. The caller guarantees both dlists hold at most
        2**31 descriptors (so every id fits int32)."""
        cdef const block_id_t* lp[MAX_FAST_GROUPS]
        cdef const block_id_t* rp[MAX_FAST_GROUPS]
        cdef Py_ssize_t ll[MAX_FAST_GROUPS]
        cdef Py_ssize_t rl[MAX_FAST_GROUPS]
        cdef Py_ssize_t G = self.G, g, nl, nr
        cdef cnp.npy_intp dim
        # Owned references for as long as lp / rp are used (the lists may change meanwhile).
        cdef tuple lheld = _owned(local_ids)
        cdef tuple rheld = _owned(remote_ids)
        cdef tuple gbytes = tuple(group_bytes)
        if remote.G != G or len(gbytes) != G:
            return None
        nl = self._scan_fast(lheld, False, False, lp, ll)
        if nl < 0:
            return None
        nr = remote._scan_fast(rheld, False, False, rp, rl)
        if nr != nl:
            return None
        for g in range(G):
            if ll[g] != rl[g]:
                return None
        dim = nl
        lids = cnp.PyArray_EMPTY(1, &dim, DESC_ID32_NPY, 0)
        rids = cnp.PyArray_EMPTY(1, &dim, DESC_ID32_NPY, 0)
        table = []
        nbytes = 0
        for g in range(G):
            dim = ll[g]
            c = cnp.PyArray_EMPTY(1, &dim, BLOCK_ID_NPY, 0)
            if dim:
                memcpy(cnp.PyArray_DATA(<cnp.ndarray>c), lp[g], dim * sizeof(block_id_t))
            table.append(c)
            nbytes += ll[g] * gbytes[g]
        if nl:
            with nogil:      # lp / rp point into arrays lheld / rheld keep alive
                _emit(lp, ll, G, self.R, self.off, self.ratio, self.rgroup, self.rstate,
                      self.gstate, self.group_major, False,
                      <desc_id32_t*>cnp.PyArray_DATA(<cnp.ndarray>lids))
                _emit(rp, rl, G, remote.R, remote.off, remote.ratio, remote.rgroup, remote.rstate,
                      remote.gstate, remote.group_major, False,
                      <desc_id32_t*>cnp.PyArray_DATA(<cnp.ndarray>rids))
        return lids, rids, tuple(table), nbytes

    cdef object _slow(self, block_ids, bint kernel_ids, bint allow_null, out):
        a = self._arrays
        if self._convert is not None:
            block_ids = self._convert(block_ids)
        elif not isinstance(block_ids, tuple):
            block_ids = tuple(block_ids)
        return flatten_desc_ids(block_ids, a[0], a[1], a[2], a[3], a[4], a[5],
                                group_major=self.group_major, kernel_ids=kernel_ids,
                                allow_null=allow_null, out=out)
