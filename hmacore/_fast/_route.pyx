"""Bulk application of KV events to one engine's counted (group, hash) residency.

vLLM's prefix cache maps a (group, hash) key to a *set* of blocks (two requests that compute
the same block before either is cached both insert it), and emits one ``BlockStored`` hash
per insertion and one ``BlockRemoved`` hash per removal. A key is resident while its count is
positive, so one engine's residency is a multiset. It is kept as nested layers of
``ExistenceSet``: a key of count c is in layers 0..c-1. Layer 0 is the residency the hit
kernel probes; higher layers exist only while some key has duplicate insertions (rare).

Rows are applied in order: op 1 stores (count + 1), op -1 removes (count - 1, a no-op at 0),
op 0 clears every key (``AllBlocksCleared``). The caller validated ops, groups and digests.
"""
from libc.stdint cimport int8_t, int32_t, int64_t, uint8_t

import numpy as np

from hmacore._fast._hits cimport ExistenceSet


def apply_rows(list layers, const int8_t[::1] ops, const int32_t[::1] groups,
               const uint8_t[:, ::1] digests):
    """Apply rows to ``layers`` (a list of ExistenceSet, at least one, same digest size).

    Returns ``(stored, removed, ignored, applied)``: stores (every store counts), removes
    that lowered a count, removes of a key not resident (no-ops), rows applied (== len(ops);
    if memory runs out MemoryError is raised, naming the rows applied before it)."""
    cdef Py_ssize_t n = ops.shape[0], i, stores = 0
    cdef int64_t stored = 0, removed = 0, ignored = 0
    cdef ExistenceSet base = <ExistenceSet>layers[0]
    cdef int rc = 0
    cdef int8_t op
    if groups.shape[0] != n or digests.shape[0] != n:
        raise ValueError("ops, groups and digests must have one row each")
    if n and digests.shape[1] != base.digest_size:
        raise ValueError(f"digests must be {base.digest_size} bytes wide")
    for i in range(n):
        stores += ops[i] > 0
    # base (layer 0) stays locked for the whole batch; the common row touches nothing else
    base.lock()
    try:
        if base.reserve(stores) < 0:
            raise MemoryError(f"KV events: no room for {stores} more keys (nothing applied)")
        for i in range(n):
            op = ops[i]
            if op > 0:
                rc = base.put(groups[i], &digests[i, 0])
                if rc == 1:
                    stored += 1
                    continue
                if rc < 0:
                    raise MemoryError(f"KV event row {i}: out of memory ({i} rows applied)")
                if _store_duplicate(layers, groups[i], &digests[i, 0]) < 0:
                    raise MemoryError(f"KV event row {i}: out of memory ({i} rows applied)")
                stored += 1
            elif op < 0:
                if len(layers) == 1:
                    rc = base.drop(groups[i], &digests[i, 0])
                elif base.has(groups[i], &digests[i, 0]):
                    rc = _remove_duplicate(layers, groups[i], &digests[i, 0])
                else:
                    rc = 0
                if rc:
                    removed += 1
                else:
                    ignored += 1
            else:
                base.unlock()
                del layers[1:]
                base.clear()
                base.lock()
    finally:
        base.unlock()
    return stored, removed, ignored, n


cdef int _store_duplicate(list layers, int32_t g, const uint8_t* d) except -2:
    """One more insertion of a key layer 0 already holds: put it in the first layer above that
    lacks it (a new layer if all hold it). -1 if out of memory."""
    cdef Py_ssize_t k = 1, depth = len(layers)
    cdef ExistenceSet layer
    cdef int rc = 0
    while k < depth:
        layer = <ExistenceSet>layers[k]
        layer.lock()
        rc = layer.put(g, d)
        layer.unlock()
        if rc != 0:
            return -1 if rc < 0 else 0
        k += 1
    layer = ExistenceSet((<ExistenceSet>layers[0]).digest_size)
    layers.append(layer)
    layer.lock()
    rc = layer.put(g, d)
    layer.unlock()
    return -1 if rc < 0 else 0


cdef int _remove_duplicate(list layers, int32_t g, const uint8_t* d) except -2:
    """One removal of a key layer 0 holds (layer 0 is locked by the caller): drop it from the
    deepest layer holding it (layers are nested); drop an emptied top layer. Returns 1."""
    cdef Py_ssize_t k = 1, depth = len(layers)
    cdef ExistenceSet layer
    cdef bint held
    while k < depth:
        layer = <ExistenceSet>layers[k]
        layer.lock()
        held = layer.has(g, d)
        layer.unlock()
        if not held:
            break
        k += 1
    if k == 1:
        (<ExistenceSet>layers[0]).drop(g, d)
        return 1
    layer = <ExistenceSet>layers[k - 1]
    layer.lock()
    layer.drop(g, d)
    held = layer._size > 0
    layer.unlock()
    if not held and k == depth:
        del layers[k - 1:]       # the top duplicate level emptied
    return 1


def pack_event_lists(list ops, list groups, list hashes, int num_groups):
    """Event rows as Python lists (as msgspec decodes a batch) -> (ops int8, groups int32,
    (N, 16) uint8 keys: 8 zero bytes + the 64-bit hash big-endian), in one typed pass.
    Raises ValueError / TypeError / OverflowError naming the first bad row."""
    cdef Py_ssize_t n = len(ops), i, b
    cdef long op, g
    cdef unsigned long long v
    if len(groups) != n or len(hashes) != n:
        raise ValueError(f"ops, groups and hashes must have one entry per row: "
                         f"{n} ops, {len(groups)} groups, {len(hashes)} hashes")
    ops_a = np.empty(n, np.int8)
    groups_a = np.empty(n, np.int32)
    keys = np.zeros((n, 16), np.uint8)
    cdef int8_t[::1] o = ops_a
    cdef int32_t[::1] gr = groups_a
    cdef uint8_t[:, ::1] k = keys
    for i in range(n):
        item = ops[i]
        if type(item) is not int:
            raise TypeError(f"ops[{i}] must be an int, got {type(item).__name__}")
        op = item
        if op < -1 or op > 1:
            raise ValueError(f"ops[{i}] must be 1 (store), -1 (remove) or 0 (clear), got {op}")
        o[i] = <int8_t>op
        item = groups[i]
        if type(item) is not int:
            raise TypeError(f"groups[{i}] must be an int, got {type(item).__name__}")
        g = item
        if op != 0 and (g < 0 or g >= num_groups):
            raise ValueError(f"groups[{i}] must be a group id in [0, {num_groups}), got {g}")
        gr[i] = <int32_t>(g if op != 0 else 0)
        item = hashes[i]
        if type(item) is not int:
            raise TypeError(f"hashes[{i}] must be an int (a 64-bit hash), got {type(item).__name__}")
        if item < 0:
            raise OverflowError(f"hashes[{i}] must be in [0, 2**64), got {item}")
        v = item                     # OverflowError past 2**64 - 1
        for b in range(8):
            k[i, 15 - b] = <uint8_t>(v >> (8 * b))
    return ops_a, groups_a, keys
