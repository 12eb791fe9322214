"""Where vLLM-shaped paged KV memory puts every layer's pages (geometry only, nothing allocated).

Units: ``num_blocks`` counts blocks of the shared pool (id 0 = null block); ``page_bytes`` is
bytes of one block of one layer.

Aliasing ("classic HMA"): when every transferred group has the same page size, vLLM allocates
one storage per *layer slot* and lets layer j of every group view it, so layers of different
groups alias one allocation (a block id belongs to one group at a time, so the copies never
collide). When page sizes differ, each layer gets its own storage. Attention pages hold K and V
packed per block (``(num_blocks, page_bytes)``) or, with ``kv_split=True``, the older
``(2, num_blocks, page_bytes // 2)`` K-then-V layout. MLA layers hold one latent page. Mamba
layers get ``state_parts`` strided sub-pages (conv/ssm-like) over the page.

The demo and the tests allocate such memory and fill it with a verifiable byte pattern with
:mod:`hmacore.demo.paged_memory`.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import cast

import numpy as np

from .errors import LayoutError
from .spec import GroupKind, KVLayout

__all__ = ["layer_geometry", "page_sizes", "MAX_STATE_PARTS"]

#: Mamba state sub-pages per layer (vLLM's conv + ssm states are 2; a page of 16-byte cuts
#: has no use for more than a few)
MAX_STATE_PARTS = 256


def page_sizes(layout: KVLayout, page_bytes: int | Sequence[int] | None = None) -> tuple[int, ...]:
    """Per group page size in bytes: the override (one int for all, or one per group) or the spec's."""
    if page_bytes is None:
        sizes = tuple(s.page_bytes for s in layout.groups)
    elif isinstance(page_bytes, (int, np.integer)) and not isinstance(page_bytes, bool):
        sizes = (int(page_bytes),) * layout.num_groups
    else:
        if isinstance(page_bytes, (str, bytes)) or not isinstance(page_bytes, Iterable):
            raise LayoutError(f"page_bytes must be an int or one int per group, got "
                              f"{page_bytes!r}")
        sizes = tuple(cast(Iterable[int], page_bytes))
        if len(sizes) != layout.num_groups:
            raise LayoutError(f"page_bytes has {len(sizes)} entries, layout has "
                              f"{layout.num_groups} groups")
    for g, p in enumerate(sizes):
        if isinstance(p, (bool, np.bool_)) or not isinstance(p, (int, np.integer)):
            raise LayoutError(f"page_bytes of group {g} must be an int, got {p!r}")
        if p <= 0 or p % 16:
            raise LayoutError(f"page_bytes of group {g} must be a positive multiple of 16, got {p}")
    return tuple(int(p) for p in sizes)


def layer_geometry(layout: KVLayout, num_blocks: int, *,
                   page_bytes: int | Sequence[int] | None = None, kv_split: bool = False,
                   state_parts: int = 2, shared: bool | None = None
                   ) -> tuple[list[int], dict[str, list[tuple[int, int, int, int]]], bool]:
    """Where every layer's pages live, without allocating.

    Returns ``(storage_bytes, parts, shared)``: the byte size of each storage, and per layer a
    list of ``(storage index, byte offset, stride bytes, block bytes)`` parts (one for packed
    attention/MLA, K then V for ``kv_split``, ``state_parts`` for Mamba).
    """
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, (int, np.integer)) or num_blocks < 2:
        raise LayoutError(f"num_blocks must be an int >= 2, got {num_blocks!r}")
    num_blocks = int(num_blocks)
    sizes = page_sizes(layout, page_bytes)
    gids = layout.transfer_group_ids
    distinct = sorted({sizes[g] for g in gids})
    if shared is None:
        shared = len(distinct) == 1 and not (kv_split and any(
            layout.groups[g].mla or layout.groups[g].kind == GroupKind.MAMBA for g in gids))
    elif shared and len(distinct) != 1:
        raise LayoutError(f"shared=True needs one page size for every transferred group (got {distinct})")
    if shared and kv_split and any(layout.groups[g].mla or layout.groups[g].kind == GroupKind.MAMBA
                                   for g in gids):
        # a slot's bytes must mean block b for every layer viewing it; K/V split puts block b's K
        # at b*page/2, where a packed (MLA/Mamba) view has block b/2
        raise LayoutError("kv_split with shared slots needs every group to be non-MLA attention "
                          "(MLA and Mamba pages are packed per block); use shared=False")
    if isinstance(state_parts, bool) or not isinstance(state_parts, int) \
            or not 1 <= state_parts <= MAX_STATE_PARTS:
        # bounded: the cuts are computed one by one (2**70 parts would never return)
        raise LayoutError(f"state_parts must be an int in [1, {MAX_STATE_PARTS}], got "
                          f"{state_parts!r}")
    storage: list[int] = []
    parts: dict[str, list[tuple[int, int, int, int]]] = {}
    if shared:
        slots = max(len(layout.groups[g].layer_names) for g in gids)
        storage = [num_blocks * distinct[0]] * slots
    for g in gids:
        spec, page = layout.groups[g], sizes[g]
        for j, name in enumerate(spec.layer_names):
            if shared:
                s = j
            else:
                s = len(storage)
                storage.append(num_blocks * page)
            if spec.kind == GroupKind.MAMBA:
                parts[name] = [(s, a, page, b - a) for a, b in _part_bounds(page, state_parts)]
            elif kv_split and not spec.mla:
                half = page // 2
                parts[name] = [(s, 0, half, half), (s, num_blocks * half, half, half)]
            else:
                parts[name] = [(s, 0, page, page)]
    return storage, parts, bool(shared)


def _part_bounds(page: int, parts: int) -> list[tuple[int, int]]:
    # Unequal parts on purpose (conv state is smaller than ssm state): 16-byte aligned cuts.
    cuts = [0]
    for k in range(1, parts):
        cuts.append(min(page, max(cuts[-1] + 16, (page * k // (parts + 1)) // 16 * 16)))
    cuts.append(page)
    return [(cuts[k], cuts[k + 1]) for k in range(parts) if cuts[k + 1] > cuts[k]]
