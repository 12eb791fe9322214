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

from ...spec import KVLayout
from ...windows import clip_to_window

__all__ = ["clip_table"]


def clip_table(table: Sequence[Any], layout: KVLayout, *,
               clip_state: bool = True) -> list[list[int]]:
    """Clip a per-group table (blocks of each group) to what a peer transfers; lists out."""
    if len(table) != layout.num_groups:
        raise ValueError(f"table has {len(table)} groups, the layout has {layout.num_groups}")
    clipped = clip_to_window(tuple(table), layout, clip_state=clip_state)
    return [ids.tolist() if spec.transfer else []
            for ids, spec in zip(clipped, layout.groups)]
