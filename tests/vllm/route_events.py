"""vLLM KV events -> RoutingIndex rows (test helper; the transport-side adapter will do the same
after decoding the msgspec batches)."""
from __future__ import annotations

import numpy as np

from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

from hmacore.route_index import OP_CLEAR, OP_REMOVE, OP_STORE


def event_rows(events, int_hashes: bool = True):
    """(ops, groups, hashes) for a list of vLLM KV events, one row per block hash, in order."""
    ops: list[int] = []
    groups: list[int] = []
    hashes: list = []
    blank = 0 if int_hashes else None
    for ev in events:
        if isinstance(ev, BlockStored):
            op = OP_STORE
        elif isinstance(ev, BlockRemoved):
            op = OP_REMOVE
        elif isinstance(ev, AllBlocksCleared):
            ops.append(OP_CLEAR)
            groups.append(0)
            hashes.append(blank)
            continue
        else:
            raise TypeError(f"unexpected KV event {type(ev).__name__}")
        n = len(ev.block_hashes)
        ops.extend([op] * n)
        groups.extend([ev.group_idx] * n)
        hashes.extend(ev.block_hashes)
    if not int_hashes:
        width = next((len(h) for h in hashes if h is not None), 32)
        hashes = [bytes(width) if h is None else h for h in hashes]
        arr = (np.frombuffer(b"".join(hashes), np.uint8).reshape(-1, width) if hashes
               else np.zeros((0, width), np.uint8))
        return np.array(ops, np.int8), np.array(groups, np.int32), arr
    return np.array(ops, np.int8), np.array(groups, np.int32), hashes
