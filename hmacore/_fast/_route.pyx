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

from hmacore._fast._hits cimport ExistenceSet


def apply_rows(list layers, const int8_t[::1] ops, const int32_t[::1] groups,
               const uint8_t[:, ::1] digests):
    """Apply rows to ``layers`` (a list of ExistenceSet, at least one, same digest size).

    Returns ``(stored, removed, ignored, applied)``: stores (every store counts), removes
    that lowered a count, removes of a key not resident (no-ops), rows applied (== len(ops)
    unless memory ran out, then MemoryError is raised after ``applied`` rows)."""
    cdef Py_ssize_t n = ops.shape[0], i, k, depth
    cdef int64_t stored = 0, removed = 0, ignored = 0
    cdef ExistenceSet base = <ExistenceSet>layers[0]
    cdef ExistenceSet layer
    cdef int rc = 0
    cdef int8_t op
    cdef int32_t g
    cdef const uint8_t* d
    if groups.shape[0] != n or digests.shape[0] != n:
        raise ValueError("ops, groups and digests must have one row each")
    if n and digests.shape[1] != base.digest_size:
        raise ValueError(f"digests must be {base.digest_size} bytes wide")
    for i in range(n):
        op = ops[i]
        if op == 0:
            del layers[1:]
            base.clear()
            continue
        g = groups[i]
        d = &digests[i, 0]
        depth = len(layers)
        if op > 0:
            k = 0
            while k < depth:
                layer = <ExistenceSet>layers[k]
                layer.lock()
                rc = layer.put(g, d)
                layer.unlock()
                if rc != 0:
                    break
                k += 1
            if k == depth:           # every layer holds it: one more duplicate level
                layer = ExistenceSet(base.digest_size)
                layers.append(layer)
                layer.lock()
                rc = layer.put(g, d)
                layer.unlock()
            if rc < 0:
                raise MemoryError(f"KV event row {i}: out of memory after {i} rows applied")
            stored += 1
        else:
            # nested layers: the deepest layer holding the key is its count; drop it there
            k = 0
            while k < depth:
                layer = <ExistenceSet>layers[k]
                layer.lock()
                rc = layer.has(g, d)
                layer.unlock()
                if not rc:
                    break
                k += 1
            if k == 0:
                ignored += 1
                continue
            layer = <ExistenceSet>layers[k - 1]
            layer.lock()
            layer.drop(g, d)
            layer.unlock()
            removed += 1
            if k - 1 > 0 and k == depth and len(layer) == 0:
                del layers[k - 1:]   # the top duplicate level emptied
    return stored, removed, ignored, n
