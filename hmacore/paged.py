"""Paged KV memory shaped the way vLLM hands it to a connector, plus a verifiable byte pattern.

Units: ``num_blocks`` counts blocks of the shared pool (id 0 = null block); ``page_bytes`` is
bytes of one block of one layer. Every array returned here is a uint8 NumPy view.

Aliasing ("classic HMA"): when every transferred group has the same page size, vLLM allocates
one storage per *layer slot* and lets layer j of every group view it, so layers of different
groups alias one allocation (a block id belongs to one group at a time, so the copies never
collide). When page sizes differ, each layer gets its own storage. Attention pages hold K and V
packed per block (``(num_blocks, page_bytes)``) or, with ``kv_split=True``, the older
``(2, num_blocks, page_bytes // 2)`` K-then-V layout. MLA layers hold one latent page. Mamba
layers get a tuple of ``state_parts`` strided views (conv/ssm-like sub-pages) over the page.

The pattern: byte ``i`` of the page of block index ``j`` of layer ``L`` is a hash of (layer,
token position ``j * bs + i * bs // page_bytes``, ``i``) for attention and of (layer, state
position ``j``, ``i``) for Mamba, so a receiver can check every byte it got and where it landed.
"""
from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Mapping, Sequence

import numpy as np

from .errors import BlockTableError, LayoutError
from .spec import GroupKind, KVLayout

__all__ = ["PagedKV", "allocate_paged_kv", "layer_geometry", "page_sizes", "fill_pattern", "expected_bytes",
           "expected_pages", "read_page", "read_pages", "verify_pattern"]

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLD = np.uint64(0x9E3779B97F4A7C15)


@dataclasses.dataclass
class PagedKV:
    """Allocated paged KV memory.

    Attributes:
        layout: the layout it was allocated for.
        num_blocks: blocks per layer (the pool size).
        page_bytes: per group, bytes of one block of one layer.
        kv_caches: layer name -> uint8 view (attention/MLA: one array; Mamba: tuple of parts).
        storages: the underlying allocations (keep them alive as long as the views).
        shared: True when layers of different groups alias one storage per layer slot.
    """

    layout: KVLayout
    num_blocks: int
    page_bytes: tuple[int, ...]
    kv_caches: dict[str, object]
    storages: list[np.ndarray]
    shared: bool


def page_sizes(layout: KVLayout, page_bytes: int | Sequence[int] | None = None) -> tuple[int, ...]:
    """Per group page size in bytes: the override (one int for all, or one per group) or the spec's."""
    if page_bytes is None:
        sizes = tuple(s.page_bytes for s in layout.groups)
    elif isinstance(page_bytes, (int, np.integer)) and not isinstance(page_bytes, bool):
        sizes = (int(page_bytes),) * layout.num_groups
    else:
        sizes = tuple(int(p) for p in page_bytes)
        if len(sizes) != layout.num_groups:
            raise LayoutError(f"page_bytes has {len(sizes)} entries, layout has "
                              f"{layout.num_groups} groups")
    for g, p in enumerate(sizes):
        if p <= 0 or p % 16:
            raise LayoutError(f"page_bytes of group {g} must be a positive multiple of 16, got {p}")
    return sizes


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
    if isinstance(state_parts, bool) or not isinstance(state_parts, int) or state_parts < 1:
        raise LayoutError(f"state_parts must be an int >= 1, got {state_parts!r}")
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


def allocate_paged_kv(layout: KVLayout, num_blocks: int, *,
                      page_bytes: int | Sequence[int] | None = None, kv_split: bool = False,
                      state_parts: int = 2, shared: bool | None = None) -> PagedKV:
    """Allocate zeroed paged KV memory for every layer of every transferred group.

    Args:
        layout: the groups and their layers.
        num_blocks: blocks per layer (>= 2; id 0 is the null block).
        page_bytes: override of the per-group page size in bytes (the presets' are huge).
        kv_split: non-MLA attention layers as ``(2, num_blocks, page/2)`` (K then V) instead
            of K/V packed per block.
        state_parts: sub-pages per Mamba layer (each a strided view of the page).
        shared: alias one storage per layer slot across groups (classic HMA). Default: True
            exactly when all transferred groups have equal page sizes.
    """
    storage, parts, shared = layer_geometry(layout, num_blocks, page_bytes=page_bytes,
                                            kv_split=kv_split, state_parts=state_parts,
                                            shared=shared)
    num_blocks = int(num_blocks)
    mems = [np.zeros(n, np.uint8) for n in storage]
    kv: dict[str, object] = {}
    l2g = layout.layer_to_group
    for name, plist in parts.items():
        spec = layout.groups[l2g[name]]
        views = []
        for s, off, stride, length in plist:
            pages = np.lib.stride_tricks.as_strided(mems[s][off:], shape=(num_blocks, length),
                                                    strides=(stride, 1))
            views.append(pages)
        if spec.kind == GroupKind.MAMBA:
            kv[name] = tuple(views)
        elif len(views) == 2:  # K/V split: one (2, num_blocks, page/2) array
            kv[name] = mems[plist[0][0]].reshape(2, num_blocks, -1)
        else:
            kv[name] = mems[plist[0][0]].reshape(num_blocks, -1)
    return PagedKV(layout, num_blocks, page_sizes(layout, page_bytes), kv, mems, shared)


def _part_bounds(page: int, parts: int) -> list[tuple[int, int]]:
    # Unequal parts on purpose (conv state is smaller than ssm state): 16-byte aligned cuts.
    cuts = [0]
    for k in range(1, parts):
        cuts.append(min(page, max(cuts[-1] + 16, (page * k // (parts + 1)) // 16 * 16)))
    cuts.append(page)
    return [(cuts[k], cuts[k + 1]) for k in range(parts) if cuts[k + 1] > cuts[k]]


def _layer_key(name: str) -> np.uint64:
    return np.uint64(zlib.crc32(name.encode()) + 1)


def expected_pages(layout: KVLayout, layer_name: str, block_indices, nbytes: int) -> np.ndarray:
    """Pattern pages (uint8, shape ``(len(block_indices), nbytes)``) of a layer at the given
    block indices (positions in the request's table of the layer's group, not block ids).

    Attention: byte ``i`` of block index j derives from (layer, token ``j*bs + i*bs//nbytes``,
    ``i``); Mamba: from (layer, state position j, ``i``).
    """
    l2g = layout.layer_to_group
    if layer_name not in l2g:
        raise LayoutError(f"layer_name {layer_name!r} is not in the layout")
    spec = layout.groups[l2g[layer_name]]
    j = np.asarray(block_indices, dtype=np.uint64).reshape(-1, 1)
    i = np.arange(nbytes, dtype=np.uint64).reshape(1, -1)
    if spec.kind == GroupKind.MAMBA:
        pos = j + np.uint64(1 << 40)
    else:
        bs = np.uint64(spec.block_size)
        pos = j * bs + i * bs // np.uint64(nbytes)
    with np.errstate(over="ignore"):
        x = _layer_key(layer_name) * _GOLD + pos * _M2 + i
        x ^= x >> np.uint64(30)
        x *= _M1
        x ^= x >> np.uint64(27)
        x *= _M2
        x ^= x >> np.uint64(31)
    return (x & np.uint64(0xFF)).astype(np.uint8)


def expected_bytes(layout: KVLayout, layer_name: str, block_index: int, nbytes: int) -> np.ndarray:
    """The ``nbytes`` pattern bytes (uint8) of one page: block index ``block_index`` of a layer.

    ``block_index`` is the position in the request's table of the layer's group (block j covers
    tokens ``[j*bs, (j+1)*bs)``; for Mamba, j is the state position), not a block id.
    """
    return expected_pages(layout, layer_name, [block_index], nbytes)[0]


def _parts(arr) -> list[np.ndarray]:
    if isinstance(arr, (tuple, list)):
        return list(arr)
    if arr.ndim == 3 and arr.shape[0] == 2:  # K/V split
        return [arr[0], arr[1]]
    return [arr]


def read_page(arr, block_id: int) -> np.ndarray:
    """The bytes of one block of one layer (K/V or state parts concatenated in order)."""
    return read_pages(arr, [block_id])[0]


def read_pages(arr, block_ids) -> np.ndarray:
    """Pages of several blocks of one layer, shape ``(len(block_ids), page_bytes)``."""
    ids = np.asarray(block_ids, dtype=np.intp)
    return np.concatenate([p[ids].reshape(len(ids), -1) for p in _parts(arr)], axis=1)


def _write_pages(arr, block_ids, data: np.ndarray) -> None:
    ids = np.asarray(block_ids, dtype=np.intp)
    off = 0
    for p in _parts(arr):
        width = int(np.prod(p.shape[1:]))
        p[ids] = data[:, off:off + width].reshape((len(ids),) + p.shape[1:])
        off += width


def _check_table(layout: KVLayout, block_table: Sequence[Sequence[int]]) -> None:
    if len(block_table) != layout.num_groups:
        raise BlockTableError(f"block_table has {len(block_table)} groups, layout has "
                              f"{layout.num_groups}")


def fill_pattern(paged: PagedKV, block_table: Sequence[Sequence[int]]) -> None:
    """Write the pattern into every layer's pages for a request's table (null id 0 skipped).

    ``block_table[g][j]`` is the block id holding block index j of group g.
    """
    layout = paged.layout
    _check_table(layout, block_table)
    for g in layout.transfer_group_ids:
        pairs = [(int(b), j) for j, b in enumerate(block_table[g]) if int(b) != 0]
        if not pairs:
            continue
        ids, pos = zip(*pairs)
        for name in layout.groups[g].layer_names:
            _write_pages(paged.kv_caches[name], ids,
                         expected_pages(layout, name, pos, paged.page_bytes[g]))


def verify_pattern(paged: PagedKV, block_table: Sequence[Sequence[int]],
                   positions: Sequence[Sequence[int]] | None = None) -> list[tuple[str, int, int]]:
    """Check pages against the pattern; returns ``(layer, group, block index)`` of every mismatch.

    ``block_table[g][k]`` holds the data of block index ``positions[g][k]`` (default k). Null
    ids are skipped.
    """
    layout = paged.layout
    _check_table(layout, block_table)
    bad = []
    for g in layout.transfer_group_ids:
        pos_g = positions[g] if positions is not None else range(len(block_table[g]))
        pairs = [(int(b), int(j)) for b, j in zip(block_table[g], pos_g) if int(b) != 0]
        if not pairs:
            continue
        ids, pos = zip(*pairs)
        for name in layout.groups[g].layer_names:
            ok = (read_pages(paged.kv_caches[name], ids)
                  == expected_pages(layout, name, pos, paged.page_bytes[g])).all(axis=1)
            bad += [(name, g, pos[k]) for k in np.flatnonzero(~ok)]
    return bad
