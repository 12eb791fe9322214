"""Window / state clipping of per-group block tables.

TEMPORARY, CLEARLY-MARKED MINIMAL LOCAL VERSION: ``hmacore.windows.clip_to_window`` (branch
``core``) is the real implementation; switch :func:`clip_table` to it once that module is
merged (same rule, see vllm-hma.md §11.2). Kept small on purpose.

Rule per group g (only when the layout is hybrid, i.e. some transferred group is not FULL):
SLIDING_WINDOW keeps its last ``cdiv(window, bs) + 1`` entries (``layout.window_blocks()``);
MAMBA (``clip_state``) drops ``min(num_speculative_blocks, len - 1)`` trailing scratch slots
and keeps the last remaining entry (the running state); FULL / CHUNKED_LOCAL are unchanged;
groups with ``transfer=False`` become empty. Empty groups stay empty (no ``x[-0:]``).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ...spec import GroupKind, KVLayout

__all__ = ["clip_table"]


def clip_table(table: Sequence[np.ndarray], layout: KVLayout, *,
               clip_state: bool = True) -> list[list[int]]:
    """Clip a per-group table (blocks of each group) to what a peer transfers; lists out."""
    if len(table) != layout.num_groups:
        raise ValueError(f"table has {len(table)} groups, the layout has {layout.num_groups}")
    hybrid = layout.is_hybrid
    wb = layout.window_blocks()
    out: list[list[int]] = []
    for g, (ids, spec) in enumerate(zip(table, layout.groups)):
        ids = np.asarray(ids)
        if not spec.transfer:
            out.append([])
            continue
        n = ids.shape[0]
        if hybrid and n:
            if wb[g] and n > wb[g]:
                ids = ids[n - wb[g]:]
            elif clip_state and spec.kind == GroupKind.MAMBA:
                drop = min(spec.num_speculative_blocks, n - 1)
                ids = ids[n - drop - 1:n - drop]
        out.append([int(x) for x in ids])
    return out
