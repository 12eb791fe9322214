# cython: language_level=3
"""Maximal runs: (local, remote) descriptor pairs -> one descriptor per run contiguous on both
sides.

A :class:`DescTable` is one NIXL dlist's descriptors (N x 3 ``(addr, len, dev)`` rows) kept as
segments: consecutive descriptor ids whose address advances by a constant step with one
length, device and registration domain (a plan's region is one segment, so a table costs
O(regions), not O(descriptors)). :func:`coalesce` takes paired descriptor ids of one transfer
and returns the maximal runs: pairs whose local bytes abut and whose remote bytes abut with
the same offset are one run, in any order (ascending, descending, interleaved across
layers, K and V). A run never spans a gap, never crosses a device or a registration domain,
and covers exactly the bytes of its pairs.

Two linear passes: (1) the pairs in the order given are cut into pieces that go up or down
one descriptor at a time; (2) pieces are chained by a hash of their local start address
(piece q follows p when q starts where p ends on both sides). Every id is validated before
any unchecked access; raw pointers only go into arrays this module holds a reference to.
"""
import numpy as np
cimport numpy as cnp
from libc.stdint cimport int8_t, int32_t, int64_t, uint8_t, uint64_t
from libc.stdlib cimport malloc, free, realloc

from hmacore.errors import BlockTableError, LayoutError

cnp.import_array()

ctypedef fused idx_t:
    int32_t
    int64_t

cdef int64_t DEV_MASK = 0xFFFFFFFF     # NIXL device ids are uint32
DEV_MAX = 0xFFFFFFFF



def int_array(name, x, dtype, lo, hi, err):
    """``x`` (an integer ndarray, or nested lists/tuples of ints) as a C-contiguous ndarray
    of ``dtype`` with every value in ``[lo, hi)``; else ``err`` naming ``name`` and the rule.
    Bools, floats, strings and other objects are refused, never truncated or parsed (NumPy's
    own casts would); Python and NumPy ints are read by value."""
    if not isinstance(x, np.ndarray):
        try:
            x = np.array(x, dtype=object)
        except (ValueError, TypeError) as e:
            raise err(f"{name} must be a rectangular table of ints ({e})") from None
    if x.size == 0:
        return np.ascontiguousarray(x, dtype=dtype) if x.dtype.kind in "iuObf" else \
            np.zeros(x.shape, dtype=dtype)
    if x.dtype.kind == "O":
        flat = x.ravel().tolist()
        for i, v in enumerate(flat):
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
                raise err(f"{name} must hold ints, got {type(v).__name__} {v!r} at flat "
                          f"index {i}")
            if not lo <= v < hi:
                raise err(f"{name} must lie in [{lo}, {hi}), got {int(v)} at flat index {i}")
        return np.array([int(v) for v in flat], dtype=dtype).reshape(x.shape)
    if x.dtype.kind not in "iu":
        raise err(f"{name} must hold ints, got dtype {x.dtype}")
    if int(x.min()) < lo or int(x.max()) >= hi:
        raise err(f"{name} must lie in [{lo}, {hi})")
    return np.ascontiguousarray(x, dtype=dtype)


cdef class DescTable:
    """Compressed address table of one dlist (see the module docstring).

    Args:
        rows: N x 3 uint64 ``(addr, len, dev)`` (what ``prep_xfer_dlist`` takes).
        domains: optional int64[N], the registration range of each row (runs never cross
            one); default: one domain.

    Raises LayoutError for a malformed table (zero length, an address range that wraps, a
    device id past uint32, a negative domain). Immutable; picklable.
    """
    def __init__(self, rows, domains=None):
        a = int_array("rows", rows, np.uint64, 0, 2**64, LayoutError)
        if a.ndim == 1 and a.size == 0:
            a = a.reshape(0, 3)                  # an empty dlist: no rows
        if a.ndim != 2 or a.shape[1] != 3:
            raise LayoutError(f"rows must be N x 3 (addr, len, dev), got shape {a.shape}")
        cdef Py_ssize_t N = a.shape[0], i, S = 0
        if domains is None:
            d = np.zeros(N, dtype=np.int64)
        else:
            d = int_array("domains", domains, np.int64, 0, 2**31, LayoutError)
            if d.ndim != 1 or d.shape[0] != N:
                raise LayoutError(f"domains must hold one int per row ({N}), got shape {d.shape}")
        if N:
            addr, ln, dev = a[:, 0], a[:, 1], a[:, 2]
            bad = np.flatnonzero((ln == 0) | (addr + ln < addr) | (dev > DEV_MAX))
            if bad.size:
                i = int(bad[0])
                raise LayoutError(f"row {i} = {tuple(int(v) for v in a[i])}: a descriptor needs "
                                  "a length > 0, an end address below 2**64 and a uint32 device")
        start = np.empty(N + 1, dtype=np.int64)
        base = np.empty(max(N, 1), dtype=np.uint64)
        step = np.zeros(max(N, 1), dtype=np.uint64)
        length = np.empty(max(N, 1), dtype=np.uint64)
        kind = np.empty(max(N, 1), dtype=np.int64)
        cdef const uint64_t[:, ::1] r = a
        cdef const int64_t[::1] dm = d
        cdef int64_t[::1] st = start
        cdef uint64_t[::1] bs = base
        cdef uint64_t[::1] sp = step
        cdef uint64_t[::1] lg = length
        cdef int64_t[::1] kd = kind
        cdef int64_t k
        with nogil:
            i = 0
            while i < N:
                st[S] = i
                bs[S] = r[i, 0]
                lg[S] = r[i, 1]
                k = (dm[i] << 32) | <int64_t>r[i, 2]
                kd[S] = k
                i += 1
                if i < N and r[i, 1] == lg[S] and ((dm[i] << 32) | <int64_t>r[i, 2]) == k:
                    sp[S] = r[i, 0] - r[i - 1, 0]
                    i += 1
                    while i < N and r[i, 1] == lg[S] and \
                            ((dm[i] << 32) | <int64_t>r[i, 2]) == k and \
                            r[i, 0] - r[i - 1, 0] == sp[S]:
                        i += 1
                S += 1
            st[S] = N
        self.num_descs = N
        self.num_segments = S
        arrays = [start[:S + 1].copy(), base[:max(S, 1)].copy(), step[:max(S, 1)].copy(),
                  length[:max(S, 1)].copy(), kind[:max(S, 1)].copy()]
        for x in arrays:
            x.flags.writeable = False
        self._arrays = arrays
        self.start = <const int64_t*>cnp.PyArray_DATA(<cnp.ndarray>arrays[0])
        self.base = <const uint64_t*>cnp.PyArray_DATA(<cnp.ndarray>arrays[1])
        self.step = <const uint64_t*>cnp.PyArray_DATA(<cnp.ndarray>arrays[2])
        self.length = <const uint64_t*>cnp.PyArray_DATA(<cnp.ndarray>arrays[3])
        self.kind = <const int64_t*>cnp.PyArray_DATA(<cnp.ndarray>arrays[4])

    cdef Table table(self):
        cdef Table t
        t.start = self.start
        t.base = self.base
        t.step = self.step
        t.length = self.length
        t.kind = self.kind
        t.S = self.num_segments
        return t

    def rows(self):
        """The N x 3 uint64 rows back (for checks; O(N))."""
        out = np.empty((self.num_descs, 3), dtype=np.uint64)
        cdef Py_ssize_t s, i
        cdef uint64_t[:, ::1] o = out
        for s in range(self.num_segments):
            for i in range(self.start[s], self.start[s + 1]):
                o[i, 0] = self.base[s] + <uint64_t>(i - self.start[s]) * self.step[s]
                o[i, 1] = self.length[s]
                o[i, 2] = <uint64_t>(self.kind[s] & DEV_MASK)
        return out

    def __reduce__(self):
        return (DescTable, (self.rows(), self._domains()))

    def _domains(self):
        out = np.empty(self.num_descs, dtype=np.int64)
        cdef Py_ssize_t s
        for s in range(self.num_segments):
            out[self.start[s]:self.start[s + 1]] = self.kind[s] >> 32
        return out


cdef inline Py_ssize_t _seg(const int64_t* start, Py_ssize_t S, Py_ssize_t cur,
                            int64_t i) noexcept nogil:
    """Segment holding descriptor id i (0 <= i < start[S]); ``cur`` is tried first."""
    if start[cur] <= i < start[cur + 1]:
        return cur
    cdef Py_ssize_t lo = 0, hi = S - 1, mid
    while lo < hi:                      # start[lo] <= i < start[hi + 1]
        mid = (lo + hi + 1) >> 1
        if start[mid] <= i:
            lo = mid
        else:
            hi = mid - 1
    return lo


cdef struct Piece:
    uint64_t lstart
    uint64_t rstart
    uint64_t nbytes
    int64_t lkind
    int64_t rkind
    int64_t first       # index of its first pair in the given order
    int64_t count
    int64_t next        # chained piece, -1 = none
    int64_t llo         # local / remote descriptor ids at the piece's lowest and highest
    int64_t lhi         # address (what NIXL's merge of prepped ids needs consecutive)
    int64_t rlo
    int64_t rhi
    int8_t down         # 1: the pairs go down (descending ids)
    uint8_t has_prev


cdef int64_t _pieces(const idx_t* lids, const idx_t* rids, Py_ssize_t n,
                     const Table* L, const Table* R, Piece** outp, int64_t* cap,
                     int64_t* bad, int64_t* breaks) noexcept nogil:
    """Pass 1: cut the pairs into pieces (``outp[0]``, ``cap[0]`` entries, grown by doubling:
    fresh tables make few pieces); returns the piece count, -1 with ``bad[0]`` the first
    pair whose local and remote lengths differ, or -2 (no memory). ``breaks`` counts the
    steps inside a piece whose descriptor ids are not consecutive on both sides."""
    cdef Piece* out = outp[0]
    cdef Piece* grown
    cdef Py_ssize_t k = 0, P = 0, ls = 0, rs = 0
    cdef uint64_t la, ra, ln, rn, lo, ro, tot
    cdef int64_t lk, rk
    cdef int8_t down
    cdef Piece* p
    while k < n:
        ls = _seg(L.start, L.S, ls, lids[k])
        rs = _seg(R.start, R.S, rs, rids[k])
        ln = L.length[ls]
        rn = R.length[rs]
        if ln != rn:
            bad[0] = k
            return -1
        lo = L.base[ls] + <uint64_t>(lids[k] - L.start[ls]) * L.step[ls]
        ro = R.base[rs] + <uint64_t>(rids[k] - R.start[rs]) * R.step[rs]
        lk = L.kind[ls]
        rk = R.kind[rs]
        if P == cap[0]:
            grown = <Piece*>realloc(out, 2 * cap[0] * sizeof(Piece))
            if grown == NULL:
                return -2
            out = outp[0] = grown
            cap[0] *= 2
        p = &out[P]
        p.first = k
        p.count = 1
        p.lkind = lk
        p.rkind = rk
        p.next = -1
        p.has_prev = 0
        p.llo = p.lhi = lids[k]
        p.rlo = p.rhi = rids[k]
        down = -1                       # -1: undecided (one pair so far)
        tot = ln
        k += 1
        while k < n:
            ls = _seg(L.start, L.S, ls, lids[k])
            rs = _seg(R.start, R.S, rs, rids[k])
            if L.kind[ls] != lk or R.kind[rs] != rk:
                break
            ln = L.length[ls]
            if ln != R.length[rs]:
                bad[0] = k
                return -1
            la = L.base[ls] + <uint64_t>(lids[k] - L.start[ls]) * L.step[ls]
            ra = R.base[rs] + <uint64_t>(rids[k] - R.start[rs]) * R.step[rs]
            if down != 1 and la == lo + tot and ra == ro + tot:
                down = 0
                if lids[k] != p.lhi + 1 or rids[k] != p.rhi + 1:
                    breaks[0] += 1
                p.lhi = lids[k]
                p.rhi = rids[k]
            elif down != 0 and la + ln == lo and ra + ln == ro:
                down = 1
                lo = la
                ro = ra
                if lids[k] != p.llo - 1 or rids[k] != p.rlo - 1:
                    breaks[0] += 1
                p.llo = lids[k]
                p.rlo = rids[k]
            else:
                break
            tot += ln
            p.count += 1
            k += 1
        p.lstart = lo
        p.rstart = ro
        p.nbytes = tot
        p.down = 1 if down == 1 else 0
        P += 1
    return P


cdef inline uint64_t _slot(uint64_t key, int bits) noexcept nogil:
    return (key * <uint64_t>0x9E3779B97F4A7C15) >> (64 - bits)


cdef inline uint64_t _start_key(uint64_t start, int64_t kind) noexcept nogil:
    # a start address is only unique on its device and domain (``kind``)
    return start ^ (<uint64_t>kind * <uint64_t>0xC2B2AE3D27D4EB4F)


cdef int _chain(Piece* pc, int64_t P, int64_t* breaks) noexcept nogil:
    """Pass 2: link piece p to the piece starting where p ends on both sides (same device
    and domain). Starts seen twice on one device and domain (overlapping input) are never
    linked; the same address on two devices is two starts. ``breaks`` counts links whose
    descriptor ids are not consecutive. 0, or -1 (no memory)."""
    cdef int bits = 1
    while (<int64_t>1 << bits) < 2 * P:
        bits += 1
    cdef uint64_t cap = (<uint64_t>1) << bits, mask = cap - 1, h
    cdef uint64_t* keys = <uint64_t*>malloc(cap * sizeof(uint64_t))
    cdef int64_t* kinds = <int64_t*>malloc(cap * sizeof(int64_t))
    cdef int64_t* vals = <int64_t*>malloc(cap * sizeof(int64_t))
    if keys == NULL or kinds == NULL or vals == NULL:
        free(keys)
        free(kinds)
        free(vals)
        return -1
    cdef int64_t i, q, k
    cdef uint64_t e
    for h in range(cap):
        vals[h] = -1
    for i in range(P):
        e = pc[i].lstart
        k = pc[i].lkind
        h = _slot(_start_key(e, k), bits)
        while vals[h] != -1 and (keys[h] != e or kinds[h] != k):
            h = (h + 1) & mask
        if vals[h] == -1:
            keys[h] = e
            kinds[h] = k
            vals[h] = i
        else:
            vals[h] = -2                # a start seen twice: link nothing to it
    for i in range(P):
        e = pc[i].lstart + pc[i].nbytes
        k = pc[i].lkind
        h = _slot(_start_key(e, k), bits)
        while vals[h] != -1 and (keys[h] != e or kinds[h] != k):
            h = (h + 1) & mask
        q = vals[h]
        if q < 0 or q == i or pc[q].has_prev or pc[q].rkind != pc[i].rkind \
                or pc[q].rstart != pc[i].rstart + pc[i].nbytes:
            continue
        pc[i].next = q
        pc[q].has_prev = 1
        if pc[q].llo != pc[i].lhi + 1 or pc[q].rlo != pc[i].rhi + 1:
            breaks[0] += 1
    free(keys)
    free(kinds)
    free(vals)
    return 0


cdef void _emit(Piece* pc, int64_t P, uint64_t* lrow, uint64_t* rrow,
                int64_t* order) noexcept nogil:
    cdef int64_t i, q, m = 0, o = 0, j
    cdef uint64_t tot
    for i in range(P):
        if pc[i].has_prev:
            continue
        tot = 0
        q = i
        while q >= 0:
            tot += pc[q].nbytes
            if order != NULL:
                if pc[q].down:
                    for j in range(pc[q].first + pc[q].count - 1, pc[q].first - 1, -1):
                        order[o] = j
                        o += 1
                else:
                    for j in range(pc[q].first, pc[q].first + pc[q].count):
                        order[o] = j
                        o += 1
            q = pc[q].next
        lrow[3 * m] = pc[i].lstart
        lrow[3 * m + 1] = tot
        lrow[3 * m + 2] = <uint64_t>(pc[i].lkind & DEV_MASK)
        rrow[3 * m] = pc[i].rstart
        rrow[3 * m + 1] = tot
        rrow[3 * m + 2] = <uint64_t>(pc[i].rkind & DEV_MASK)
        m += 1


cdef object _ids(name, x, Py_ssize_t bound):
    """``x`` as a C-contiguous int32/int64 1-D array with every id in [0, bound)."""
    if isinstance(x, np.ndarray) and (x.dtype == np.int32 or x.dtype == np.int64):
        if x.ndim != 1:
            raise BlockTableError(f"{name} must be 1-D, got shape {x.shape}")
        x = np.ascontiguousarray(x)
        if x.size and (int(x.min()) < 0 or int(x.max()) >= bound):
            raise BlockTableError(f"{name} must lie in [0, {bound})")
        return x
    if isinstance(x, np.ndarray) and x.size and (x.dtype.kind == "b" or
                                                 x.dtype.kind not in "iuO"):
        raise BlockTableError(f"{name} must be integer descriptor ids, got dtype {x.dtype}")
    x = int_array(name, x, np.int64, 0, bound, BlockTableError)
    if x.ndim != 1:
        raise BlockTableError(f"{name} must be 1-D, got shape {x.shape}")
    return x


def coalesce(DescTable local, local_ids, DescTable remote, remote_ids, *, bint order=False):
    """Maximal runs of one transfer's paired descriptors.

    Args:
        local, remote: the two dlists' tables.
        local_ids, remote_ids: equal-length 1-D integer descriptor ids, paired by position.
        order: also return the pair indices in run order (each run's pairs by ascending
            address): posting the per-descriptor ids in that order lets NIXL's own merge of
            consecutive descriptors find the same runs.

    Returns:
        ``(local_rows, remote_rows, order_or_None, nbytes, index_breaks)``: M x 3 uint64
        ``(addr, len, dev)`` per run (row i of both pairs up), the order (int64[N]), the bytes
        moved, and how many steps inside the runs join descriptors whose ids are not
        consecutive on both sides (NIXL's merge of prepped ids posted in ``order`` stops
        there: M + index_breaks descriptors reach the backend that way).

    Raises BlockTableError (nothing computed) for ids out of range, unequal lengths, or a
    pair whose local and remote descriptors differ in length.
    """
    li = _ids("local_ids", local_ids, local.num_descs)
    ri = _ids("remote_ids", remote_ids, remote.num_descs)
    cdef Py_ssize_t n = li.shape[0]
    if ri.shape[0] != n:
        raise BlockTableError(f"{n} local vs {ri.shape[0]} remote descriptor ids")
    if li.dtype != ri.dtype:
        li = li.astype(np.int64)
        ri = ri.astype(np.int64)
    cdef int64_t P = 0, bad = -1, M = 0, i, breaks = 0, cap = 0
    cdef Piece* pc = NULL
    cdef cnp.ndarray lrows, rrows, ordr
    cdef int rc = 0
    if n:
        cap = min(n, 256)
        pc = <Piece*>malloc(cap * sizeof(Piece))
        if pc == NULL:
            raise MemoryError()
    try:
        if n:
            if li.dtype == np.int32:
                P = _pieces_i32(li, ri, n, local, remote, &pc, &cap, &bad, &breaks)
            else:
                P = _pieces_i64(li, ri, n, local, remote, &pc, &cap, &bad, &breaks)
            if P == -2:
                raise MemoryError()
            if P < 0:
                raise BlockTableError(f"descriptor pair {bad}: local descriptor {int(li[bad])} "
                                      f"and remote descriptor {int(ri[bad])} differ in length")
            if P > 1:
                with nogil:
                    rc = _chain(pc, P, &breaks)
                if rc:
                    raise MemoryError()
            for i in range(P):
                M += not pc[i].has_prev
        lrows = np.empty((M, 3), dtype=np.uint64)
        rrows = np.empty((M, 3), dtype=np.uint64)
        ordr = np.empty(n if order else 0, dtype=np.int64)
        if n:
            with nogil:
                _emit(pc, P, <uint64_t*>cnp.PyArray_DATA(lrows),
                      <uint64_t*>cnp.PyArray_DATA(rrows),
                      <int64_t*>cnp.PyArray_DATA(ordr) if order else NULL)
    finally:
        free(pc)
    nbytes = int(lrows[:, 1].sum()) if M else 0
    return lrows, rrows, (ordr if order else None), nbytes, breaks


cdef int64_t _pieces_i32(cnp.ndarray li, cnp.ndarray ri, Py_ssize_t n, DescTable L,
                         DescTable R, Piece** out, int64_t* cap, int64_t* bad,
                         int64_t* breaks):
    cdef int64_t P
    cdef Table lt = L.table(), rt = R.table()
    cdef const int32_t* lp = <const int32_t*>cnp.PyArray_DATA(li)
    cdef const int32_t* rp = <const int32_t*>cnp.PyArray_DATA(ri)
    with nogil:         # li / ri / L / R are referenced by the caller for the whole call
        P = _pieces(lp, rp, n, &lt, &rt, out, cap, bad, breaks)
    return P


cdef int64_t _pieces_i64(cnp.ndarray li, cnp.ndarray ri, Py_ssize_t n, DescTable L,
                         DescTable R, Piece** out, int64_t* cap, int64_t* bad,
                         int64_t* breaks):
    cdef int64_t P
    cdef Table lt = L.table(), rt = R.table()
    cdef const int64_t* lp = <const int64_t*>cnp.PyArray_DATA(li)
    cdef const int64_t* rp = <const int64_t*>cnp.PyArray_DATA(ri)
    with nogil:
        P = _pieces(lp, rp, n, &lt, &rt, out, cap, bad, breaks)
    return P


def coalesce_buffers(addrs, sizes, key_offsets, domains=None):
    """Runs of adjacent buffers inside each key of a multi-buffer store batch.

    Args:
        addrs, sizes: uint64/int64 1-D, every buffer of every key, key by key, in value order.
        key_offsets: int64[K + 1], key k's buffers are ``[key_offsets[k], key_offsets[k+1])``.
        domains: optional int64 per buffer (its registered buffer); buffers of different
            domains never merge.

    Returns ``(addrs, sizes, key_offsets)`` of the merged buffers: consecutive buffers of one
    key where the next starts where the previous ends become one (the value's bytes and
    their order are unchanged; buffers of different keys never merge). Raises BlockTableError
    for malformed offsets, negative sizes, or an address range that wraps.
    """
    a = np.ascontiguousarray(addrs, dtype=np.uint64)
    s = np.ascontiguousarray(sizes, dtype=np.int64)
    o = np.ascontiguousarray(key_offsets, dtype=np.int64)
    cdef Py_ssize_t n = a.shape[0], K = o.shape[0] - 1, k, i, m = 0
    if a.ndim != 1 or s.ndim != 1 or s.shape[0] != n or o.ndim != 1 or K < 0:
        raise BlockTableError("addrs and sizes must be equal 1-D arrays and key_offsets 1-D "
                              "with at least one entry")
    if o[0] != 0 or o[K] != n or (K and (np.diff(o) < 0).any()):
        raise BlockTableError(f"key_offsets must rise from 0 to {n}")
    if n and (s.min() < 0 or (a + s.astype(np.uint64) < a).any()):
        raise BlockTableError("buffer sizes must be >= 0 and no buffer may wrap past 2**64")
    dm = np.zeros(n, dtype=np.int64) if domains is None else \
        np.ascontiguousarray(domains, dtype=np.int64)
    if dm.ndim != 1 or dm.shape[0] != n:
        raise BlockTableError(f"domains must hold one int per buffer ({n})")
    cdef const int64_t[::1] D = dm
    out_a = np.empty(n, dtype=np.uint64)
    out_s = np.empty(n, dtype=np.int64)
    out_o = np.empty(K + 1, dtype=np.int64)
    cdef const uint64_t[::1] A = a
    cdef const int64_t[::1] S = s
    cdef const int64_t[::1] O = o
    cdef uint64_t[::1] OA = out_a
    cdef int64_t[::1] OS = out_s
    cdef int64_t[::1] OO = out_o
    with nogil:
        for k in range(K):
            OO[k] = m
            for i in range(O[k], O[k + 1]):
                if m > OO[k] and OA[m - 1] + <uint64_t>OS[m - 1] == A[i] and D[i] == D[i - 1]:
                    OS[m - 1] += S[i]
                else:
                    OA[m] = A[i]
                    OS[m] = S[i]
                    m += 1
        OO[K] = m
    return out_a[:m].copy(), out_s[:m].copy(), out_o
