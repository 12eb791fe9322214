# Included by _route.pyx: vLLM's KV event batch read straight from its msgpack bytes.
#
# What the subscriber receives is the payload; decoding it into msgspec structs first (one
# object per event, its hash list, one int per hash) cost the subscriber more than the
# index's own work on every preset (docs/routing.md, "From the payload"). This reader walks
# the bytes once and packs the rows into the table's scratch: no Python object per event or
# per hash, the token ids skipped in place.
#
# It reads the batch as vLLM's publisher writes it (msgspec, kv_event_wire.EventBatch):
# ``[ts: float, events: [{"type": tag, field: value, ...}, ...], data_parallel_rank?]``, the
# tag first in each event's map, every other field in any order; the fields it does not
# read (token ids, parent hash, LoRA name, cache salts...) are stepped over as msgspec skips
# them, their text and ext data unchecked. It DECLINES (returns -1, nothing applied) anything
# else or anything the decoded path would refuse: an encoding msgspec writes differently, a
# duplicate field, non-ASCII text in a field it reads (medium, spec kind), lookahead token
# ids, a group out of range, a refused spec kind, a negative or wrong-size hash, another DP
# rank, nesting past 16 in a skipped field, trailing bytes. The caller then decodes with msgspec and applies the structs
# (``apply_events``), which applies the batch or refuses it with the exact rule: so a
# declined batch costs the slow path, never a different result.
# tests/test_kv_payload.py checks this against msgspec + apply_events on random, vLLM-encoded
# and mutated payloads.

cdef enum:
    SKIP_DEPTH = 16         # nesting skipped in an unread field (vLLM's fields nest <= 2)
    KIND_CACHE = 64         # longest spec-kind string remembered as checked

cdef enum:                  # event fields by name (block_hashes .. lookahead_token_ids)
    K_NONE = -1
    K_TYPE = 5


cdef extern from *:
    """
    #include <string.h>
    /* 1 if the n bytes at s are all ASCII (8 at a time) */
    static inline int hmacore_ascii(const unsigned char* s, Py_ssize_t n) {
        unsigned long long acc = 0, w;
        Py_ssize_t i = 0;
        for (; i + 8 <= n; i += 8) { memcpy(&w, s + i, 8); acc |= w; }
        for (; i < n; i++) acc |= s[i];
        return (acc & 0x8080808080808080ULL) == 0;
    }
    /* n bytes equal (n <= 24: a field name; loads of 8, 4 and 1 bytes, no libc call) */
    static inline int hmacore_eq(const unsigned char* a, const char* b, Py_ssize_t n) {
        unsigned long long x, y;
        unsigned int u, v;
        Py_ssize_t i = 0;
        for (; i + 8 <= n; i += 8) {
            memcpy(&x, a + i, 8); memcpy(&y, b + i, 8);
            if (x != y) return 0;
        }
        if (i + 4 <= n) {
            memcpy(&u, a + i, 4); memcpy(&v, b + i, 4);
            if (u != v) return 0;
            i += 4;
        }
        for (; i < n; i++) if (a[i] != (unsigned char)b[i]) return 0;
        return 1;
    }
    /* k (1, 2, 4 or 8) big-endian bytes */
    static inline unsigned long long hmacore_be(const unsigned char* p, int k) {
        unsigned long long v8; unsigned int v4; unsigned short v2;
        switch (k) {
        case 1: return p[0];
        case 2: memcpy(&v2, p, 2); return __builtin_bswap16(v2);
        case 4: memcpy(&v4, p, 4); return __builtin_bswap32(v4);
        default: memcpy(&v8, p, 8); return __builtin_bswap64(v8);
        }
    }
    """
    bint _ascii "hmacore_ascii"(const uint8_t* s, Py_ssize_t n) noexcept nogil
    bint _eq "hmacore_eq"(const uint8_t* a, const char* b, Py_ssize_t n) noexcept nogil
    uint64_t _be "hmacore_be"(const uint8_t* p, int k) noexcept nogil


cdef struct Cursor:
    const uint8_t* p
    const uint8_t* end


cdef inline bint _need(Cursor* c, Py_ssize_t k) noexcept nogil:
    return c.end - c.p >= k


cdef inline int _read_uint(Cursor* c, uint64_t* out) noexcept nogil:
    """A non-negative int in any msgpack int encoding -> ``*out``; 0 ok, -1 anything else."""
    cdef uint8_t b
    cdef int k
    cdef int64_t s
    if not _need(c, 1):
        return -1
    b = c.p[0]
    if b < 0x80:
        out[0] = b
        c.p += 1
        return 0
    if 0xcc <= b <= 0xcf:               # uint 8 / 16 / 32 / 64
        k = 1 << (b - 0xcc)
        if not _need(c, 1 + k):
            return -1
        out[0] = _be(c.p + 1, k)
        c.p += 1 + k
        return 0
    if 0xd0 <= b <= 0xd3:               # int 8 / 16 / 32 / 64 holding a non-negative value
        k = 1 << (b - 0xd0)
        if not _need(c, 1 + k):
            return -1
        s = <int64_t>(_be(c.p + 1, k) << (64 - 8 * k)) >> (64 - 8 * k)
        if s < 0:
            return -1
        out[0] = <uint64_t>s
        c.p += 1 + k
        return 0
    return -1


cdef inline Py_ssize_t _read_len(Cursor* c, uint8_t fix_lo, uint8_t fix_hi, uint8_t fix_mask,
                                 uint8_t w8, uint8_t w16, uint8_t w32) noexcept nogil:
    """A header's length (fix form in [fix_lo, fix_hi], else the 8 / 16 / 32-bit forms whose
    tags are given; 0 for a form the type has not); -1 for another byte or past the end."""
    cdef uint8_t b
    cdef int k
    if not _need(c, 1):
        return -1
    b = c.p[0]
    if fix_lo <= b <= fix_hi:
        c.p += 1
        return b & fix_mask
    if b == w8 and w8:
        k = 1
    elif b == w16 and w16:
        k = 2
    elif b == w32 and w32:
        k = 4
    else:
        return -1
    if not _need(c, 1 + k):
        return -1
    c.p += 1 + k
    return <Py_ssize_t>_be(c.p - k, k)


cdef inline Py_ssize_t _read_array(Cursor* c) noexcept nogil:
    """An array header's count; -1 if not an array or it cannot fit the bytes left (every
    element takes at least one byte)."""
    cdef Py_ssize_t n = _read_len(c, 0x90, 0x9f, 0x0f, 0, 0xdc, 0xdd)
    if n > c.end - c.p:
        return -1
    return n


cdef inline Py_ssize_t _read_map(Cursor* c) noexcept nogil:
    cdef Py_ssize_t n = _read_len(c, 0x80, 0x8f, 0x0f, 0, 0xde, 0xdf)
    if n > (c.end - c.p) // 2:
        return -1
    return n


cdef inline Py_ssize_t _read_str(Cursor* c, const uint8_t** s) noexcept nogil:
    """A str: its length, ``*s`` its bytes in the payload (not checked: the caller compares
    them with an ASCII name or checks them); -1 if not a str or past the end."""
    cdef Py_ssize_t n
    if _need(c, 1) and 0xa0 <= c.p[0] <= 0xbf:        # fixstr: every name vLLM writes
        n = c.p[0] & 0x1f
        c.p += 1
    else:
        n = _read_len(c, 1, 0, 0, 0xd9, 0xda, 0xdb)
    if n < 0 or not _need(c, n):
        return -1
    s[0] = c.p
    c.p += n
    return n


cdef inline Py_ssize_t _read_ascii(Cursor* c, const uint8_t** s) noexcept nogil:
    """A str of ASCII bytes: its length, ``*s`` its bytes in the payload; -1 otherwise
    (non-ASCII text is left to msgspec's UTF-8 rules)."""
    cdef Py_ssize_t n = _read_str(c, s)
    if n < 0 or not _ascii(s[0], n):
        return -1
    return n


# an int's whole encoded size by its first byte (0: not an int)
cdef uint8_t _INT_SIZE[256]
for _b in range(256):
    _INT_SIZE[_b] = 1 if _b < 0x80 or _b >= 0xe0 else \
        (1 + (1 << (_b - 0xcc)) if 0xcc <= _b <= 0xcf else
         (1 + (1 << (_b - 0xd0)) if 0xd0 <= _b <= 0xd3 else 0))


cdef int _skip_items(Cursor* c, Py_ssize_t n, int depth) noexcept nogil:
    """Step over an array's ``n`` items (token ids: ints, mostly 3 bytes each). In chunks
    whose items all fit the bytes left even at 9 bytes each (no bounds check per item): the
    chunk's items by runs of one encoding (independent loads at the run's stride) when the
    first 16 items mostly repeat their encoding, else one after another by a size table
    without a branch per item (real token ids mix 1, 2, 3 and 5-byte forms: a branch on
    each item's form mispredicts half the time)."""
    cdef Py_ssize_t i = 0, j, k, m, stop, lim, same = 0
    cdef uint8_t b, prev = 0
    cdef bint runs
    # the first items decide the mode (checked one by one)
    while i < n and i < 16:
        b = c.p[0] if c.p < c.end else 0xc1
        k = _INT_SIZE[b]
        if k == 0:
            if _skip(c, depth + 1) < 0:
                return -1
        else:
            if c.end - c.p < k:
                return -1
            c.p += k
            same += b == prev or (b < 0x80 and prev < 0x80)
        prev = b
        i += 1
    runs = same >= 12
    while i < n:
        m = min(n - i, (c.end - c.p) // 9)
        if m == 0:                      # the last few bytes: checked
            b = c.p[0] if c.p < c.end else 0xc1
            k = _INT_SIZE[b]
            if k == 0:
                if _skip(c, depth + 1) < 0:
                    return -1
            elif c.end - c.p < k:
                return -1
            else:
                c.p += k
            i += 1
            continue
        stop = i + m
        if runs:
            while i < stop:
                b = c.p[0]
                k = _INT_SIZE[b]
                if k == 0:
                    break
                j = 1
                lim = stop - i
                if b < 0x80:
                    while j < lim and c.p[j] < 0x80:
                        j += 1
                else:
                    while j < lim and c.p[j * k] == b:
                        j += 1
                c.p += j * k
                i += j
        else:
            while i < stop:
                k = _INT_SIZE[c.p[0]]
                if k == 0:
                    break
                c.p += k
                i += 1
        if i < stop:                    # an item that is not an int
            if _skip(c, depth + 1) < 0:
                return -1
            i += 1
    return 0


cdef int _skip(Cursor* c, int depth) noexcept nogil:
    """Step over one value of a field the index does not read, as msgspec's decoder does
    (text and ext data unchecked); -1 on 0xc1 (malformed), past the end or too deep."""
    cdef uint8_t b
    cdef Py_ssize_t n, i
    cdef const uint8_t* s
    if not _need(c, 1) or depth > SKIP_DEPTH:
        return -1
    b = c.p[0]
    n = _INT_SIZE[b]                # an int of any sign (its size is its first byte's)
    if n or b == 0xc0 or b == 0xc2 or b == 0xc3:
        n = n or 1                  # nil, false, true
        if not _need(c, n):
            return -1
        c.p += n
        return 0
    if b == 0xca or b == 0xcb:
        n = 5 if b == 0xca else 9
        if not _need(c, n):
            return -1
        c.p += n
        return 0
    if 0xa0 <= b <= 0xbf or 0xd9 <= b <= 0xdb:
        # as msgspec skips an unknown field's text: its bytes unchecked (not UTF-8 is fine)
        return 0 if _read_str(c, &s) >= 0 else -1
    if 0xd4 <= b <= 0xd8:               # fixext 1 / 2 / 4 / 8 / 16: type byte + data
        n = 2 + (1 << (b - 0xd4))
        if not _need(c, n):
            return -1
        c.p += n
        return 0
    if 0xc7 <= b <= 0xc9:               # ext 8 / 16 / 32: length, type byte, data
        n = _read_len(c, 1, 0, 0, 0xc7, 0xc8, 0xc9)
        if n < 0 or not _need(c, n + 1):
            return -1
        c.p += n + 1
        return 0
    if 0xc4 <= b <= 0xc6:
        n = _read_len(c, 1, 0, 0, 0xc4, 0xc5, 0xc6)
        if n < 0 or not _need(c, n):
            return -1
        c.p += n
        return 0
    if 0x90 <= b <= 0x9f or b == 0xdc or b == 0xdd:
        n = _read_array(c)
        if n < 0:
            return -1
        return _skip_items(c, n, depth)
    if 0x80 <= b <= 0x8f or b == 0xde or b == 0xdf:
        n = _read_map(c)
        if n < 0:
            return -1
        for i in range(2 * n):
            if _skip(c, depth + 1) < 0:
                return -1
        return 0
    return -1                       # 0xc1 (msgspec: malformed)


cdef inline int _field_id(const uint8_t* s, Py_ssize_t n) noexcept nogil:
    """An event map key -> F_* (the fields apply_events reads), K_TYPE, or K_NONE (a key
    not matched is not checked here: the caller checks it is ASCII)."""
    if n == 12:
        return F_HASHES if _eq(s, b"block_hashes", 12) else K_NONE
    if n == 6:
        return F_MEDIUM if _eq(s, b"medium", 6) else K_NONE
    if n == 9:
        return F_GROUP if _eq(s, b"group_idx", 9) else K_NONE
    if n == 18:
        return F_KIND if _eq(s, b"kv_cache_spec_kind", 18) else K_NONE
    if n == 19:
        return F_LOOKAHEAD if _eq(s, b"lookahead_token_ids", 19) else K_NONE
    if n == 4:
        return K_TYPE if _eq(s, b"type", 4) else K_NONE
    return K_NONE


cdef inline int _event_tag(Cursor* c) noexcept nogil:
    """The event map's first entry must be ``"type": tag``: 1 stored, -1 removed, 0 cleared,
    2 anything else."""
    cdef const uint8_t* s
    cdef Py_ssize_t n = _read_str(c, &s)
    if n != 4 or not _eq(s, b"type", 4):
        return 2
    n = _read_str(c, &s)
    if n == 11 and _eq(s, b"BlockStored", 11):
        return 1
    if n == 12 and _eq(s, b"BlockRemoved", 12):
        return -1
    if n == 16 and _eq(s, b"AllBlocksCleared", 16):
        return 0
    return 2


cdef Py_ssize_t _pack_payload(SharedResidency res, Py_ssize_t n, const uint8_t* data,
                              Py_ssize_t size, const uint8_t* medium, Py_ssize_t medium_len,
                              tuple refused_kinds, int num_groups, int64_t dp_rank,
                              int64_t* cleared, int64_t* other) except -2:
    """Pack a payload's rows into ``res``' scratch from row ``n`` on (as ``_pack_direct``
    packs structs); the rows then packed, or -1: declined (rows from ``n`` on undefined,
    ``cleared`` / ``other`` partly counted: the caller keeps neither, nothing is applied).
    ``medium_len`` -1: the caller's medium is None (only a nil medium is applied); -2: a str no
    payload text can equal (every str medium is another).
    Raises only MemoryError (a spec-kind lookup's own error propagates: the caller's dict)."""
    cdef Cursor c
    cdef Py_ssize_t ne, e, nf, f, nh, k, j, slen, start
    cdef int ds = res.digest_size, op, fid
    cdef uint32_t seen
    cdef uint64_t v, g
    cdef const uint8_t* s
    cdef const uint8_t* kind
    cdef Py_ssize_t kind_len
    cdef bint is_other
    cdef uint8_t* key
    # per group, the last spec kind found not refused (kinds repeat on every stored event)
    cdef uint8_t kind_ok[KIND_CACHE]
    cdef Py_ssize_t kind_ok_len = -1
    cdef int64_t kind_ok_group = -1
    cdef dict refused
    c.p = data
    c.end = data + size
    ne = _read_len(&c, 0x92, 0x93, 0x0f, 0, 0, 0)           # [ts, events] or [.., dp rank]
    if ne < 0:
        return -1
    if _need(&c, 1) and c.p[0] == 0xcb and _need(&c, 9):   # ts: float64 (or float32)
        c.p += 9
    elif _need(&c, 5) and c.p[0] == 0xca:
        c.p += 5
    else:
        return -1
    nf = ne
    ne = _read_array(&c)
    if ne < 0:
        return -1
    for e in range(ne):
        f = _read_map(&c)
        if f < 1:
            return -1
        op = _event_tag(&c)
        if op == 2:
            return -1
        f -= 1
        if op == 0:                     # AllBlocksCleared: no fields it reads
            for k in range(f):
                slen = _read_str(&c, &s)
                if slen < 0 or _field_id(s, slen) == K_TYPE or _skip(&c, 1) < 0:
                    return -1
            n = res._clear_row(n)
            cleared[0] += 1
            continue
        seen = 0
        start = n
        nh = -1
        g = 0
        is_other = False
        kind = NULL
        kind_len = -1
        for k in range(f):
            slen = _read_str(&c, &s)
            if slen < 0:
                return -1
            fid = _field_id(s, slen)      # another key is skipped as msgspec does: any bytes
            if op < 0 and (fid == F_KIND or fid == F_LOOKAHEAD):
                fid = K_NONE            # not BlockRemoved fields: skipped as msgspec does
            if fid == K_TYPE:
                return -1
            if fid == K_NONE:
                if _skip(&c, 1) < 0:
                    return -1
                continue
            if seen & (1u << fid):
                return -1               # a field twice
            seen |= 1u << fid
            if fid == F_HASHES:
                nh = _read_array(&c)
                if nh < 0 or res._grow_scratch(n + nh) < 0:
                    if nh < 0:
                        return -1
                    raise MemoryError("KV events: no memory for the batch's rows")
                key = res._s_keys + n * ds
                for j in range(nh):
                    if ds == 8:
                        if _read_uint(&c, &v) < 0:
                            return -1
                        _put_be64(key, v)
                    else:
                        slen = _read_len(&c, 1, 0, 0, 0xc4, 0xc5, 0xc6)
                        if slen != ds or not _need(&c, ds):
                            return -1
                        memcpy(key, c.p, ds)
                        c.p += ds
                    key += ds
                n += nh
            elif fid == F_MEDIUM:
                if _need(&c, 1) and c.p[0] == 0xc0:
                    c.p += 1
                else:
                    slen = _read_str(&c, &s)
                    if slen < 0:
                        return -1
                    # the caller's medium (valid UTF-8) or another ASCII name
                    is_other = slen != medium_len or not _eq(s, <const char*>medium, slen)
                    if is_other and not _ascii(s, slen):
                        return -1
            elif fid == F_GROUP:
                if _need(&c, 1) and c.p[0] == 0xc0:
                    c.p += 1
                elif _read_uint(&c, &g) < 0 or g >= <uint64_t>num_groups:
                    return -1
            elif fid == F_KIND:
                if _need(&c, 1) and c.p[0] == 0xc0:
                    c.p += 1
                else:
                    kind_len = _read_ascii(&c, &kind)
                    if kind_len < 0:
                        return -1
            else:                       # lookahead_token_ids: only None is read here
                if not _need(&c, 1) or c.p[0] != 0xc0:
                    return -1
                c.p += 1
        if nh < 0:                      # block_hashes is required
            return -1
        if is_other:
            other[0] += nh
            n = start
            continue
        if kind_len >= 0 and op > 0:
            refused = <dict>refused_kinds[g]
            if refused and not (kind_ok_group == <int64_t>g and kind_ok_len == kind_len and
                                memcmp(kind_ok, kind, kind_len) == 0):
                if (<const char*>kind)[:kind_len].decode("ascii") in refused:
                    return -1           # apply_events refuses it by name
                if kind_len <= KIND_CACHE:
                    memcpy(kind_ok, kind, kind_len)
                    kind_ok_len = kind_len
                    kind_ok_group = <int64_t>g
        for k in range(start, n):
            res._s_ops[k] = <int8_t>op
            res._s_groups[k] = <int32_t>g
    if nf == 3:                         # data_parallel_rank: None or the stream's
        if _need(&c, 1) and c.p[0] == 0xc0:
            c.p += 1
        elif _read_uint(&c, &v) < 0 or dp_rank < 0 or v != <uint64_t>dp_rank:
            return -1
    if c.p != c.end:
        return -1
    return n
