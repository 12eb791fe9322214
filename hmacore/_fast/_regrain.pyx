# cython: language_level=3
"""Block-size remapping between two peers: per-group block ids of a source (block size bs) and
a destination (block size bd) -> paired byte runs ``(addr, bytes, dev)``.

The compiled plan (hmacore.regrain.RegrainPlan) holds, per region pair, both sides' base,
stride, kernel block size and bytes, and the chunk pairs (offset of a token-major chunk inside
each side's kernel block, bytes per token row). Per request this module walks each attention
group's token range ``[lo, hi)`` in segments that stay inside one kernel block on both sides
(boundaries at multiples of ``min(kernel sizes)``: the sizes divide each other, checked by the
plan), emits one byte range per chunk and segment, and merges a range into the previous one
of the same pair when both sides abut. State (Mamba) pairs copy ``state_len`` bytes (the
unpadded state, or the whole page) from the start of each paired block, one per paired id,
independent of tokens.

Every index and id is validated by the Python front (hmacore.regrain) before this kernel runs;
the kernel only reads arrays the call holds references to.
"""
import numpy as np
cimport numpy as cnp
from libc.stdint cimport int32_t, int64_t, uint8_t, uint64_t
from libc.stdlib cimport malloc, realloc, free

cnp.import_array()


cdef struct RunBuf:
    uint64_t* rows      # 6 per run: src addr, src dev, dst addr, dst dev, bytes, pair
    Py_ssize_t n
    Py_ssize_t cap


cdef int _grow(RunBuf* b) noexcept nogil:
    cdef Py_ssize_t cap = b.cap * 2 if b.cap else 256
    cdef uint64_t* p = <uint64_t*>realloc(b.rows, cap * 6 * sizeof(uint64_t))
    if p == NULL:
        return -1
    b.rows = p
    b.cap = cap
    return 0


cdef inline int _emit(RunBuf* b, uint64_t sa, uint64_t sdev, uint64_t da, uint64_t ddev,
                      uint64_t n, Py_ssize_t pair, Py_ssize_t* last) noexcept nogil:
    """Append one range, or extend the previous range of the same pair when it abuts on both
    sides. ``last[0]`` is the index of the previous range of this pair (-1: none)."""
    cdef uint64_t* r
    if last[0] >= 0:
        r = b.rows + last[0] * 6
        if r[0] + r[4] == sa and r[2] + r[4] == da:
            r[4] += n
            return 0
    if b.n == b.cap and _grow(b) != 0:
        return -1
    r = b.rows + b.n * 6
    r[0] = sa
    r[1] = sdev
    r[2] = da
    r[3] = ddev
    r[4] = n
    r[5] = <uint64_t>pair
    last[0] = b.n
    b.n += 1
    return 0


def map_runs(const int32_t[::1] pair_group, const uint8_t[::1] pair_state,
             const uint64_t[::1] src_base, const int64_t[::1] src_stride,
             const uint64_t[::1] src_dev, const int64_t[::1] src_kbs,
             const int64_t[::1] src_klen,
             const uint64_t[::1] dst_base, const int64_t[::1] dst_stride,
             const uint64_t[::1] dst_dev, const int64_t[::1] dst_kbs,
             const int64_t[::1] dst_klen,
             const int64_t[::1] state_len, const int64_t[::1] chunk_lo,
             const int64_t[::1] chunk_src_off, const int64_t[::1] chunk_dst_off,
             const int64_t[::1] chunk_row,
             const int64_t[::1] src_bs, const int64_t[::1] dst_bs,
             const int32_t[::1] src_ids, const int64_t[::1] src_off, const int64_t[::1] src_first,
             const int32_t[::1] dst_ids, const int64_t[::1] dst_off, const int64_t[::1] dst_first,
             const int64_t[::1] lo, const int64_t[::1] hi):
    """Paired runs of one request: ``(src rows, dst rows, pair index per run)``, rows M x 3
    uint64 ``(addr, bytes, dev)``. Arguments are validated by hmacore.regrain (the region
    pair table once, the ids and token ranges per request)."""
    cdef Py_ssize_t K = pair_group.shape[0]
    cdef Py_ssize_t k, j, i, n, last, g
    cdef int64_t t, e, u, bs, bd, r_s, r_d, ks, kd, s0, d0
    cdef uint64_t sa, da
    cdef int32_t sid, did
    cdef RunBuf buf
    cdef int failed = 0
    buf.rows = NULL
    buf.n = 0
    buf.cap = 0
    with nogil:
        for k in range(K):
            g = pair_group[k]
            last = -1
            if pair_state[k]:
                n = src_off[g + 1] - src_off[g]
                for i in range(n):
                    sid = src_ids[src_off[g] + i]
                    did = dst_ids[dst_off[g] + i]
                    if _emit(&buf, src_base[k] + <uint64_t>sid * <uint64_t>src_stride[k],
                             src_dev[k], dst_base[k] + <uint64_t>did * <uint64_t>dst_stride[k],
                             dst_dev[k], <uint64_t>state_len[k], k, &last) != 0:
                        failed = 1
                        break
                if failed:
                    break
                continue
            bs = src_bs[g]
            bd = dst_bs[g]
            ks = src_kbs[k]
            kd = dst_kbs[k]
            u = ks if ks < kd else kd
            t = lo[g]
            while t < hi[g]:
                e = (t // u + 1) * u
                if e > hi[g]:
                    e = hi[g]
                sid = src_ids[src_off[g] + t // bs - src_first[g]]
                did = dst_ids[dst_off[g] + t // bd - dst_first[g]]
                r_s = t % bs
                r_d = t % bd
                # start of this segment's kernel block on each side
                sa = src_base[k] + <uint64_t>sid * <uint64_t>src_stride[k] \
                    + <uint64_t>((r_s // ks) * src_klen[k])
                da = dst_base[k] + <uint64_t>did * <uint64_t>dst_stride[k] \
                    + <uint64_t>((r_d // kd) * dst_klen[k])
                s0 = r_s % ks
                d0 = r_d % kd
                for j in range(chunk_lo[k], chunk_lo[k + 1]):
                    if _emit(&buf, sa + <uint64_t>(chunk_src_off[j] + s0 * chunk_row[j]),
                             src_dev[k],
                             da + <uint64_t>(chunk_dst_off[j] + d0 * chunk_row[j]),
                             dst_dev[k], <uint64_t>((e - t) * chunk_row[j]), k, &last) != 0:
                        failed = 1
                        break
                    # chunks of one segment never abut the next chunk's range of the same
                    # segment on both sides unless the pages are laid out alike; _emit merges
                    # then (last = this range)
                if failed:
                    break
                t = e
            if failed:
                break
    if failed:
        free(buf.rows)
        raise MemoryError("regrain: cannot grow the run buffer")
    src = np.empty((buf.n, 3), dtype=np.uint64)
    dst = np.empty((buf.n, 3), dtype=np.uint64)
    pairs = np.empty(buf.n, dtype=np.int64)
    cdef uint64_t[:, ::1] sv = src
    cdef uint64_t[:, ::1] dv = dst
    cdef int64_t[::1] pv = pairs
    for i in range(buf.n):
        sv[i, 0] = buf.rows[i * 6]
        sv[i, 1] = buf.rows[i * 6 + 4]
        sv[i, 2] = buf.rows[i * 6 + 1]
        dv[i, 0] = buf.rows[i * 6 + 2]
        dv[i, 1] = buf.rows[i * 6 + 4]
        dv[i, 2] = buf.rows[i * 6 + 3]
        pv[i] = <int64_t>buf.rows[i * 6 + 5]
    free(buf.rows)
    return src, dst, pairs
