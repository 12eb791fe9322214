"""Window / state clipping of per-group block tables, in the connector's wire shape.

A thin adapter over :func:`hmacore.windows.clip_to_window` (the rule lives there, see
vllm-hma.md §11.2): SLIDING_WINDOW keeps its last ``cdiv(window, bs) + 1`` entries, MAMBA
(``clip_state``) its running-state slot, FULL / CHUNKED_LOCAL are unchanged. What this adds:
groups with ``transfer=False`` (vLLM ``enable_kv_transfer=False``) become empty, and the
result is ``list[list[int]]`` (one list per group, JSON/msgpack friendly).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...spec import GroupKind, GroupSpec, KVLayout
from ...windows import clip_to_window

__all__ = ["clip_table", "skipped_blocks"]


def clip_table(table: Sequence[Any], layout: KVLayout, *,
               clip_state: bool = True) -> list[list[int]]:
    """Clip a per-group table (blocks of each group) to what a peer transfers; lists out."""
    if len(table) != layout.num_groups:
        raise ValueError(f"table has {len(table)} groups, the layout has {layout.num_groups}")
    clipped = clip_to_window(tuple(table), layout, clip_state=clip_state)
    return [ids.tolist() if spec.transfer else []
            for ids, spec in zip(clipped, layout.groups)]


def skipped_blocks(spec: GroupSpec, processed_tokens: int) -> int:
    """How many leading positions of a group's table vLLM has nulled in place once
    ``processed_tokens`` tokens are computed (vLLM 0.32 ``get_num_skipped_tokens`` //
    block size): sliding window ``max(0, n - window + 1 - extra_retained_tokens)``, chunked
    local the start of the current chunk, full attention none. Mamba states are nulled one at
    a time (``last_state_block_idx``), not as a prefix: 0 here.

    A connector that follows tables incrementally applies this to the positions it reads, so
    it never names a block vLLM has already freed (and may have handed to another request).
    """
    n = int(processed_tokens)
    if spec.kind == GroupKind.SLIDING_WINDOW:
        skipped = max(0, n - int(spec.sliding_window) + 1 - int(spec.extra_retained_tokens))
    elif spec.kind == GroupKind.CHUNKED_LOCAL:
        skipped = n // int(spec.chunk_size) * int(spec.chunk_size)
    else:
        return 0
    return skipped // int(spec.block_size)
