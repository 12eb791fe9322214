"""A pytest plugin that swaps the routing index's counted event kernel for set semantics (a
remove drops the key even if vLLM still holds it in another block), to show that the counts
are needed. Not a test: docs/routing.md runs

    PYTHONPATH=tests/vllm python -m pytest -p route_set_semantics tests/vllm/test_route_schedulers.py

and expects mismatches (failures)."""
import numpy as np

import hmacore._fast._route as _route

_counted = _route.apply_rows


def _set_semantics(residency, bit, ops, groups, digests):
    """Row by row; a remove is repeated until the key is gone (its count forced to 0)."""
    stored = removed = ignored = 0
    for i in range(len(ops)):
        row = (ops[i:i + 1], groups[i:i + 1], digests[i:i + 1])
        if ops[i] >= 0:
            stored += _counted(residency, bit, *row)[0]
            continue
        s, r, ig, _ = _counted(residency, bit, *row)
        removed += r
        ignored += ig
        while r:
            _, r, _, _ = _counted(residency, bit, *row)
    return stored, removed, ignored, len(ops)





_counted_events = _route.apply_events


def _set_semantics_events(residency, bit, events, types, medium, refused_kinds, num_groups):
    """The same for a decoded batch: validated whole by the counted call (bit -1), then its
    applied events flattened to rows and applied as above."""
    _, _, _, cleared, _, other, lookahead = _counted_events(residency, -1, events, types, medium,
                                                            refused_kinds, num_groups)
    stored_t, removed_t, _ = types
    ops, groups, keys = [], [], []
    ds = residency.digest_size
    for ev in events:
        if type(ev) is not stored_t and type(ev) is not removed_t:
            ops.append(0)
            groups.append(0)
            keys.append(bytes(ds))
            continue
        if ev.medium is not None and ev.medium != medium:
            continue
        for h in ev.block_hashes:
            ops.append(1 if type(ev) is stored_t else -1)
            groups.append(ev.group_idx or 0)
            keys.append(h.to_bytes(8, "big") if type(h) is int else h)
    rows = (np.array(ops, np.int8), np.array(groups, np.int32),
            np.frombuffer(b"".join(keys), np.uint8).reshape(-1, ds).copy())
    if bit < 0:
        return 0, 0, 0, cleared, len(ops), other, lookahead
    stored, removed, ignored, n = _set_semantics(residency, bit, *rows)
    return stored, removed, ignored, cleared, n, other, lookahead


_route.apply_events = _set_semantics_events
_route.apply_rows = _set_semantics
