"""Paged KV memory shaped the way vLLM hands it to a connector, plus a verifiable byte pattern
(the demo's and the tests' memory; where pages live is :mod:`hmacore.paged`).

The pattern: byte ``i`` of the page of block index ``j`` of layer ``L`` is a hash of (layer,
token position ``j * bs + i * bs // page_bytes``, ``i``) for attention and of (layer, state
position ``j``, ``i``) for Mamba, so a receiver can check every byte it got and where it landed.
Every array returned here is a uint8 NumPy view.
"""
from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Sequence

import numpy as np

from ..errors import BlockTableError, LayoutError
from ..paged import layer_geometry, page_sizes
from ..spec import GroupKind, KVLayout

__all__ = ["PagedKV", "allocate_paged_kv", "fill_pattern", "expected_bytes", "expected_pages",
           "read_page", "read_pages", "verify_pattern"]

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
