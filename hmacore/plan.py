"""Transfer plans: registered KV regions -> descriptor lists and per-request descriptor ids.

A plan is built once, when a connector registers its KV caches, and answers per request
"which descriptor indices move these block ids". Units: ``block_len``/``stride`` in bytes,
``logical_blocks`` in blocks of the pool, descriptors per region = ``logical_blocks * ratio``
(ratio = kernel blocks per logical block x peer block-size ratio; 1 for state regions).

Region order (the dlist order, identical on both peers for equal shapes): attention regions in
numeric-aware layer-name order, one per unique (base address, block length, stride); then
Mamba/state sub-regions in the same order. A region used by several groups of its kind is
shared (``group == -1``) when every group of that kind uses it; a region used by only some of
them is listed once per user so that ``-1`` never lets a group touch another group's bytes.
"""
from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ._fast import _plan, _tables
from .errors import BlockTableError, LayoutError
from .grain import cdiv
from .spec import GroupKind, KVLayout

__all__ = ["Region", "TransferPlan", "GroupFigures", "RequestFigures", "layer_sort_key",
           "describe_layout_plan"]

SHARED = -1
# tied to the kernels' C block_id_t; BLOCK_ID_DTYPE and STATUS_CHANGED are missing from
# _fast/_tables.pyi (owned with the kernels)
BLOCK_ID_DTYPE = _tables.BLOCK_ID_DTYPE  # type: ignore[attr-defined]


def layer_sort_key(name: str) -> tuple:
    """Numeric-aware sort key: ``layers.10`` after ``layers.9``."""
    return tuple((0, int(t)) if t.isdigit() else (1, t) for t in re.split(r"(\d+)", name) if t)


@dataclasses.dataclass(frozen=True)
class Region:
    """One registered memory region: ``logical_blocks`` blocks of ``block_len`` bytes, ``stride``
    bytes apart, starting at ``base``. ``ratio`` descriptors per block (each ``block_len //
    ratio`` bytes). ``group`` is the owning group or -1 (shared); ``state`` marks Mamba state."""

    base: int
    block_len: int
    stride: int
    logical_blocks: int
    ratio: int
    group: int
    state: bool
    layers: tuple[str, ...]
    dev_id: int = 0

    @property
    def num_descs(self) -> int:
        return self.logical_blocks * self.ratio

    @property
    def desc_len(self) -> int:
        """Bytes of one descriptor of this region."""
        return self.block_len // self.ratio

    @property
    def span(self) -> tuple[int, int]:
        """``(address, bytes)`` covering every block of the region."""
        return self.base, (self.logical_blocks - 1) * self.stride + self.block_len

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["layers"] = list(self.layers)
        return d


@dataclasses.dataclass(frozen=True)
class GroupFigures:
    """Per-request cost of one group: blocks (of the group), descriptors, bytes."""

    group: int
    name: str
    blocks: int
    descriptors: int
    bytes: int


@dataclasses.dataclass(frozen=True)
class RequestFigures:
    """HMA (window-clipped, per group) vs non-HMA (every layer full attention) for one request."""

    num_tokens: int
    groups: tuple[GroupFigures, ...]
    hma_descriptors: int
    hma_bytes: int
    non_hma_descriptors: int
    non_hma_bytes: int

    @property
    def descriptor_saving(self) -> float:
        """Fraction of descriptors HMA avoids (0 = none)."""
        return 1 - self.hma_descriptors / self.non_hma_descriptors if self.non_hma_descriptors else 0.0

    @property
    def byte_saving(self) -> float:
        return 1 - self.hma_bytes / self.non_hma_bytes if self.non_hma_bytes else 0.0


def _tensor_parts(name: str, x: Any) -> list[tuple[int, int, int, int]]:
    """``(base, rows, stride bytes, row bytes)`` of an array/tensor whose dim 0 is blocks.

    NumPy arrays and anything with ``data_ptr()`` (torch) are accepted; torch is never imported.
    """
    if callable(getattr(x, "data_ptr", None)):
        esz = x.element_size()
        row_ok = x.dim() >= 1 and (x.dim() == 1 or x[0].is_contiguous())
        base, shape, stride0 = x.data_ptr(), tuple(x.shape), x.stride(0) * esz
        row = (int(np.prod(shape[1:])) if len(shape) > 1 else 1) * esz
    elif isinstance(x, np.ndarray):
        row_ok = x.ndim >= 1 and (x.ndim == 1 or x[0].flags.c_contiguous)
        base, shape, stride0 = x.ctypes.data, x.shape, x.strides[0]
        row = (int(np.prod(shape[1:])) if len(shape) > 1 else 1) * x.itemsize
    else:
        raise LayoutError(f"kv_caches[{name!r}] must be a NumPy array or a tensor with data_ptr(), "
                          f"got {type(x).__name__}")
    if not row_ok:
        raise LayoutError(f"kv_caches[{name!r}]: each block (dim 0 row) must be contiguous")
    if stride0 < row:
        raise LayoutError(f"kv_caches[{name!r}]: dim-0 stride {stride0} B is smaller than a block "
                          f"({row} B); blocks would overlap")
    return [(base, shape[0], stride0, row)]


def _layer_parts(name: str, value: Any, num_blocks: int, state: bool, mla: bool):
    if isinstance(value, (tuple, list)) and value and all(hasattr(v, "shape") for v in value):
        if not state:
            raise LayoutError(f"kv_caches[{name!r}]: a tuple of sub-arrays is only valid for "
                              "Mamba/state layers")
        items = list(value)
    else:
        items = [value]
    parts = []
    for k, item in enumerate(items):
        if not hasattr(item, "shape"):
            _tensor_parts(name, item)  # raises the type error
        shape = tuple(item.shape)
        if shape and shape[0] == num_blocks:
            parts += _tensor_parts(name, item)
        elif not state and not mla and len(shape) >= 2 and shape[0] == 2 and shape[1] == num_blocks:
            parts += _tensor_parts(name, item[0]) + _tensor_parts(name, item[1])  # K then V
        else:
            raise LayoutError(f"kv_caches[{name!r}] part {k} has shape {shape}: dim 0 must be "
                              f"num_blocks ({num_blocks})" +
                              ("" if state or mla else " or (2, num_blocks, ...) for split K/V"))
    return parts


_INT64_MAX = 2**63 - 1


def _check_region_ints(r: int, reg: Region) -> None:
    """The region fields the descriptor arithmetic stores in fixed-width arrays: ints (not
    bools) in range, so a handshake's huge value is refused instead of overflowing NumPy."""
    for name, bits in (("block_len", 63), ("stride", 63), ("logical_blocks", 63),
                       ("ratio", 31), ("group", 31)):
        v = getattr(reg, name)
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) \
                or not -2**bits <= v < 2**bits:
            raise LayoutError(f"region {r}: {name} must be an int{bits + 1}, got {v!r}")
    if reg.logical_blocks * reg.ratio > _INT64_MAX:
        raise LayoutError(f"region {r}: {reg.logical_blocks} blocks x ratio {reg.ratio} "
                          "descriptors do not fit int64 descriptor ids")


class TransferPlan:
    """Regions of one peer and the descriptor-id arithmetic over them. Build once, use per request.

    Attributes:
        layout: the KV layout (group ids index ``block_ids``).
        regions: tuple of :class:`Region`, in dlist order.
        mem_type: NIXL memory type of every region (``"DRAM"`` or ``"VRAM"``).
        group_major: False = classic HMA ordering (``for region: for group``), True = owned
            regions or state regions present (``for group: for region serving it``).

    Threads: immutable after construction (attributes cannot be rebound; the compiled
    descriptor plan keeps private read-only region arrays and no scratch buffer), so one
    plan may be shared by any number of threads. ``desc_ids`` reads a caller's list of
    per-group arrays through a private tuple of them, so another thread replacing list
    elements meanwhile cannot free an array being read (the result is then the ids the list
    held when the call started, or after). A caller-provided ``out`` buffer must not be
    shared by two concurrent calls. Picklable.
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get("_frozen"):
            raise AttributeError(f"TransferPlan is immutable (cannot set {name!r})")
        object.__setattr__(self, name, value)

    def __repr__(self) -> str:
        return (f"TransferPlan(groups={self.layout.num_groups}, regions={len(self.regions)}, "
                f"descriptors={self.num_descs}, mem_type={self.mem_type!r}, "
                f"{'group' if self.group_major else 'region'}-major)")

    def __init__(self, layout: KVLayout, regions: Sequence[Region], *, mem_type: str = "DRAM"):
        if mem_type not in ("DRAM", "VRAM"):
            raise LayoutError(f"mem_type must be 'DRAM' or 'VRAM', got {mem_type!r}")
        self.layout = layout
        self.regions = tuple(regions)
        self.mem_type = mem_type
        if not self.regions:
            raise LayoutError("a plan needs at least one region")
        seen_state = False
        total = 0
        for r, reg in enumerate(self.regions):
            _check_region_ints(r, reg)
            total += reg.num_descs
            if reg.state:
                seen_state = True
            elif seen_state:
                raise LayoutError(f"region {r}: attention regions must precede state regions")
            if reg.ratio < 1 or reg.block_len % reg.ratio or reg.logical_blocks < 1:
                raise LayoutError(f"region {r}: block_len {reg.block_len} must be a multiple of "
                                  f"ratio {reg.ratio} and logical_blocks >= 1")
            if reg.state and reg.ratio != 1:
                raise LayoutError(f"region {r}: state regions are never ratio-expanded")
            if not -1 <= reg.group < layout.num_groups:
                raise LayoutError(f"region {r}: group {reg.group} is not -1 or a group id")
        if total > _INT64_MAX:      # descriptor ids are int64
            raise LayoutError(f"the regions hold {total} descriptors, more than int64 ids address")
        counts = np.array([r.num_descs for r in self.regions], dtype=np.int64)
        self._offset = np.zeros(len(counts), dtype=np.int64)
        np.cumsum(counts[:-1], out=self._offset[1:])
        self.num_descs = int(counts.sum())
        self._logical = np.array([r.logical_blocks for r in self.regions], dtype=np.int64)
        self._ratio = np.array([r.ratio for r in self.regions], dtype=np.int32)
        self._rgroup = np.array([r.group for r in self.regions], dtype=_plan.GROUP_ID_DTYPE)
        self._rstate = np.array([r.state for r in self.regions], dtype=np.uint8)
        self._gstate = np.array([s.kind == GroupKind.MAMBA for s in layout.groups], dtype=np.uint8)
        self._desc_len = np.array([r.desc_len for r in self.regions], dtype=np.int64)
        # bytes one logical block of group g moves over every region serving g
        self._group_block_bytes = tuple(
            sum(r.block_len for r in self.regions
                if r.state == bool(self._gstate[g]) and r.group in (SHARED, g))
            for g in range(layout.num_groups))
        self.group_major = bool(self._rstate.any() or (self._rgroup != SHARED).any())
        self._desc = _plan.DescPlan(self._offset, self._logical, self._ratio, self._rgroup,
                                    self._rstate, self._gstate, self.group_major,
                                    functools.partial(_as_tuple_n, layout.num_groups))
        for a in (self._offset, self._logical, self._ratio, self._rgroup, self._rstate,
                  self._gstate, self._desc_len):
            a.flags.writeable = False
        self._frozen = True

    # -- construction --------------------------------------------------------------------
    @classmethod
    def from_kv_caches(cls, layout: KVLayout, kv_caches: Mapping[str, Any], *, num_blocks: int,
                       kernel_block_size: int | None = None, mem_type: str = "DRAM",
                       dev_id: int = 0) -> TransferPlan:
        """Plan for the caches a connector's ``register_kv_caches`` receives.

        Args:
            layout: the layout whose transferred groups' layers are all in ``kv_caches``.
            kv_caches: layer name -> array/tensor with blocks on dim 0 (K/V packed), or
                ``(2, num_blocks, ...)`` (K/V split: two regions), or for Mamba layers a tuple
                of sub-arrays (one state sub-region each).
            num_blocks: logical blocks per layer (the pool size).
            kernel_block_size: tokens per kernel block for every attention group (must divide
                each group's block size); default: each group's ``kernel_block_size``.
            mem_type: ``"DRAM"`` or ``"VRAM"``; dev_id: device id of every region.
        """
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, (int, np.integer)) or num_blocks < 2:
            raise LayoutError(f"num_blocks must be an int >= 2, got {num_blocks!r}")
        num_blocks = int(num_blocks)
        l2g = layout.layer_to_group
        for name in kv_caches:
            if name not in l2g:
                raise LayoutError(f"kv_caches has layer {name!r} that no layout group names")
        parts: dict[str, list] = {}
        for g in layout.transfer_group_ids:
            spec = layout.groups[g]
            for name in spec.layer_names:
                if name not in kv_caches:
                    raise LayoutError(f"kv_caches lacks layer {name!r} of group {g}")
                parts[name] = _layer_parts(name, kv_caches[name], num_blocks,
                                           spec.kind == GroupKind.MAMBA, spec.mla)
        return cls._from_parts(layout, parts, num_blocks, kernel_block_size, mem_type, dev_id)

    @classmethod
    def from_layout(cls, layout: KVLayout, num_blocks: int | None = None, *,
                    page_bytes: int | Sequence[int] | None = None, kv_split: bool = False,
                    state_parts: int = 2, kernel_block_size: int | None = None,
                    base: int = 1 << 32) -> TransferPlan:
        """A plan over virtual addresses, shaped as :func:`hmacore.paged.allocate_paged_kv` would
        allocate (for printing, figures and benchmarks; no memory is touched)."""
        from .paged import layer_geometry
        nb = num_blocks if num_blocks is not None else layout.num_blocks
        if nb is None:
            raise LayoutError("num_blocks is needed (the layout has none)")
        storage, geo, _ = layer_geometry(layout, nb, page_bytes=page_bytes, kv_split=kv_split,
                                         state_parts=state_parts)
        starts = np.concatenate([[0], np.cumsum(storage)]).astype(object) + base
        parts = {name: [(int(starts[s]) + off, int(nb), stride, length)
                        for s, off, stride, length in plist] for name, plist in geo.items()}
        return cls._from_parts(layout, parts, int(nb), kernel_block_size, "DRAM", 0)

    @classmethod
    def _from_parts(cls, layout: KVLayout, parts: Mapping[str, list[tuple[int, int, int, int]]],
                    num_blocks: int, kernel_block_size: int | None, mem_type: str,
                    dev_id: int) -> TransferPlan:
        l2g = layout.layer_to_group
        ratios: dict[int, int] = {}
        for g in layout.transfer_group_ids:
            spec = layout.groups[g]
            if spec.kind == GroupKind.MAMBA:
                ratios[g] = 1
            elif kernel_block_size is not None:
                if isinstance(kernel_block_size, bool) or not isinstance(kernel_block_size, int) \
                        or kernel_block_size <= 0 or spec.block_size % kernel_block_size:
                    raise LayoutError(f"kernel_block_size {kernel_block_size!r} must be a positive "
                                      f"int dividing group {g}'s block size {spec.block_size}")
                ratios[g] = spec.block_size // kernel_block_size
            else:
                ratios[g] = spec.kernel_ratio
        # key -> [layers, groups, ratio]; attention first, then state, each in layer order
        keyed: dict[tuple, list] = {}
        for name in sorted(parts, key=layer_sort_key):
            g = l2g[name]
            state = layout.groups[g].kind == GroupKind.MAMBA
            for base, rows, stride, length in parts[name]:
                if rows != num_blocks:
                    raise LayoutError(f"layer {name!r}: {rows} blocks, expected {num_blocks}")
                if length % ratios[g]:
                    raise LayoutError(f"layer {name!r}: block of {length} B is not divisible by "
                                      f"kernel ratio {ratios[g]}")
                entry = keyed.setdefault((state, base, length, stride), [[], [], ratios[g]])
                if entry[2] != ratios[g]:
                    raise LayoutError(f"layer {name!r} shares memory with a group of another "
                                      f"kernel ratio ({entry[2]} vs {ratios[g]})")
                entry[0].append(name)
                if g not in entry[1]:
                    entry[1].append(g)
        kind_groups = {st: sorted(g for g in layout.transfer_group_ids
                                  if (layout.groups[g].kind == GroupKind.MAMBA) == st)
                       for st in (False, True)}
        regions = []
        for st in (False, True):
            for (state, base, length, stride), (names, groups, ratio) in keyed.items():
                if state != st:
                    continue
                owners = [SHARED] if (len(groups) > 1 and sorted(groups) == kind_groups[st]) \
                    else sorted(groups)
                for owner in owners:
                    regions.append(Region(base=base, block_len=length, stride=stride,
                                          logical_blocks=num_blocks, ratio=ratio, group=owner,
                                          state=st, layers=tuple(names), dev_id=dev_id))
        return cls(layout, regions, mem_type=mem_type)

    def with_block_size_ratio(self, ratio: int) -> TransferPlan:
        """The plan seen at a peer's smaller block size: every attention block split into
        ``ratio`` sub-blocks (local block size = ratio x remote block size)."""
        if isinstance(ratio, bool) or not isinstance(ratio, int) or ratio < 1:
            raise LayoutError(f"ratio must be an int >= 1, got {ratio!r}")
        regions = []
        for r, reg in enumerate(self.regions):
            if reg.state:
                regions.append(reg)
                continue
            if reg.block_len % (reg.ratio * ratio):
                raise LayoutError(f"region {r}: block of {reg.block_len} B cannot be split "
                                  f"{reg.ratio * ratio} ways")
            regions.append(dataclasses.replace(reg, ratio=reg.ratio * ratio))
        return TransferPlan(self.layout, regions, mem_type=self.mem_type)

    # -- wire form -----------------------------------------------------------------------
    def region_table(self) -> list[dict[str, Any]]:
        """The regions as JSON-able dicts (what a handshake carries)."""
        return [r.to_dict() for r in self.regions]

    @classmethod
    def from_region_table(cls, layout: KVLayout, table: Sequence[Mapping[str, Any]], *,
                          mem_type: str = "DRAM") -> TransferPlan:
        """A peer's plan rebuilt from its :meth:`region_table` (addresses are the peer's)."""
        try:
            regions = [Region(base=int(d["base"]), block_len=int(d["block_len"]),
                              stride=int(d["stride"]), logical_blocks=int(d["logical_blocks"]),
                              ratio=int(d["ratio"]), group=int(d["group"]), state=bool(d["state"]),
                              layers=tuple(d["layers"]), dev_id=int(d.get("dev_id", 0)))
                       for d in table]
        except (KeyError, TypeError, ValueError, OverflowError) as e:   # inf -> OverflowError
            raise LayoutError(f"region table entry is malformed: {e}") from None
        return cls(layout, regions, mem_type=mem_type)

    def shape_signature(self) -> list[tuple]:
        """Everything but addresses: equal signatures -> identical desc-id order on both peers."""
        return [(r.block_len, r.logical_blocks, r.ratio, r.group, r.state, len(r.layers))
                for r in self.regions]

    # -- per request -----------------------------------------------------------------------
    def _as_tuple(self, block_ids: Sequence[Any]) -> tuple[np.ndarray, ...]:
        return _as_tuple_n(self.layout.num_groups, block_ids)

    def desc_ids(self, block_ids: Sequence[Any], *, out: np.ndarray | None = None,
                 kernel_ids: bool = False, allow_null: bool = False) -> np.ndarray:
        """Descriptor indices (int64) into this plan's dlist for one request's blocks.

        ``block_ids[g]`` are group g's block ids (lists or 1-D integer arrays; already window
        clipped, prefix trimmed, null ids stripped). Attention ids are logical and expanded
        by each region's ratio unless ``kernel_ids``. Order: see :attr:`group_major`; ascending
        ids give consecutive descriptor indices (NIXL merges them). ``out`` (int64, C-contiguous,
        large enough) is written in place and a prefix view returned. Raises BlockTableError.
        """
        # One Cython call: int32-array groups take an O(1) form check + one min/max pass per
        # group; anything else goes through _as_tuple_n's conversion and the full checks.
        return self._desc.run(block_ids, kernel_ids=kernel_ids, allow_null=allow_null, out=out)

    def count_desc_ids(self, block_ids: Sequence[Any], *, kernel_ids: bool = False) -> int:
        """How many descriptor ids :meth:`desc_ids` returns (size an ``out`` buffer with it)."""
        return _plan.count_desc_ids(self._as_tuple(block_ids), self._ratio, self._rgroup,
                                    self._rstate, self._gstate, kernel_ids)

    def table_bytes(self, lengths: Sequence[int]) -> int:
        """Bytes moved for a table with ``lengths[g]`` logical blocks in group g (O(G x R)).
        Each length must be an int >= 0 (bools, floats and negatives raise BlockTableError)."""
        if isinstance(lengths, (str, bytes)) or not hasattr(lengths, "__len__"):
            raise BlockTableError(f"lengths must be one block count per group, got "
                                  f"{type(lengths).__name__}")
        if len(lengths) != self.layout.num_groups:
            raise BlockTableError(f"lengths has {len(lengths)} groups, the layout has "
                                  f"{self.layout.num_groups}")
        total = 0
        for g, (n, b) in enumerate(zip(lengths, self._group_block_bytes)):
            if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)) or n < 0:
                raise BlockTableError(f"lengths[{g}] must be an int >= 0 (blocks), got {n!r}")
            total += int(n) * b
        return total

    def desc_bytes(self, desc_ids: np.ndarray) -> int:
        """Total bytes the given descriptor ids cover (integer ids in ``[0, num_descs)``;
        floats and bools raise BlockTableError, never truncated)."""
        if isinstance(desc_ids, (list, tuple)) and any(isinstance(v, (bool, np.bool_))
                                                       for v in desc_ids):
            # np.asarray([5, True]) is an int array holding 1: a bool would pass as id 1
            raise BlockTableError("desc_ids must be integers, not bools")
        d = np.asarray(desc_ids)
        if d.size == 0:
            return 0
        if d.dtype.kind not in "iu":
            raise BlockTableError(f"desc_ids must be integers, got dtype {d.dtype}")
        if d.min() < 0 or d.max() >= self.num_descs:
            raise BlockTableError(f"desc_ids must lie in [0, {self.num_descs})")
        r = np.searchsorted(self._offset, d, side="right") - 1
        return int(self._desc_len[r].sum())

    # -- descriptor lists ---------------------------------------------------------------------
    def descriptors(self) -> np.ndarray:
        """N x 3 uint64 ``(addr, len, dev_id)``, one row per descriptor, in dlist order."""
        out = np.empty((self.num_descs, 3), dtype=np.uint64)
        for r, reg in enumerate(self.regions):
            o, n = int(self._offset[r]), reg.num_descs
            i = np.arange(n, dtype=np.uint64)
            ratio = np.uint64(reg.ratio)
            out[o:o + n, 0] = np.uint64(reg.base) + (i // ratio) * np.uint64(reg.stride) \
                + (i % ratio) * np.uint64(reg.desc_len)
            out[o:o + n, 1] = reg.desc_len
            out[o:o + n, 2] = reg.dev_id
        return out

    def strided_descriptors(self) -> np.ndarray:
        """N x 5 uint64 ``(addr, len, dev_id, stride, count)``: one row per region when its
        descriptors are evenly spaced, else one row per logical block (sub-blocks abut)."""
        rows = []
        for reg in self.regions:
            if reg.ratio == 1:
                rows.append([(reg.base, reg.block_len, reg.dev_id, reg.stride, reg.logical_blocks)])
            elif reg.stride == reg.block_len:
                rows.append([(reg.base, reg.desc_len, reg.dev_id, reg.desc_len, reg.num_descs)])
            else:
                rows.append([(reg.base + b * reg.stride, reg.desc_len, reg.dev_id, reg.desc_len,
                              reg.ratio) for b in range(reg.logical_blocks)])
        return np.array([r for rs in rows for r in rs], dtype=np.uint64).reshape(-1, 5)

    def registration_ranges(self) -> list[tuple[int, int, int]]:
        """Disjoint ``(addr, bytes, dev_id)`` ranges covering every region (aliases merged)."""
        spans = sorted((r.dev_id, *r.span) for r in self.regions)
        merged: list[list[int]] = []
        for dev, a, n in spans:
            if merged and merged[-1][0] == dev and a <= merged[-1][1] + merged[-1][2]:
                merged[-1][2] = max(merged[-1][2], a + n - merged[-1][1])
            else:
                merged.append([dev, a, n])
        return [(a, n, dev) for dev, a, n in merged]

    # -- figures ----------------------------------------------------------------------------
    def request_blocks(self, num_tokens: int, *, exact: bool = False) -> tuple[int, ...]:
        """Blocks per group a request of ``num_tokens`` tokens moves under HMA: all covering
        blocks, sliding window clipped to ``window_blocks``, Mamba to its one state slot."""
        if isinstance(num_tokens, np.integer):
            num_tokens = int(num_tokens)
        blocks = self.layout.blocks_for_tokens(num_tokens, clipped=True, exact=exact)
        return tuple(n if spec.transfer else 0 for n, spec in zip(blocks, self.layout.groups))

    def request_figures(self, num_tokens: int, *, exact: bool = False) -> RequestFigures:
        """Per group blocks/descriptors/bytes of one request (HMA) and the non-HMA equivalent.

        Non-HMA = every layer treated as full attention in ONE group: one block size S (lcm of
        the transferred groups' block sizes), no window clip, no aliasing (each layer its own
        regions); a layer keeps its bytes per token and kernel block size, so its page and
        kernel descriptors per block scale by ``S / bs_g``; a Mamba layer keeps one state page
        per block of S tokens."""
        blocks = self.request_blocks(num_tokens, exact=exact)
        figs = []
        for g, spec in enumerate(self.layout.groups):
            sel = [r for r, reg in enumerate(self.regions)
                   if bool(reg.state) == (spec.kind == GroupKind.MAMBA)
                   and reg.group in (SHARED, g)] if spec.transfer else []
            figs.append(GroupFigures(g, spec.name or f"g{g}", blocks[g],
                                     sum(blocks[g] * int(self._ratio[r]) for r in sel),
                                     sum(blocks[g] * self.regions[r].block_len for r in sel)))
        # non-HMA: one group, so one block size S (the lcm); a layer of group g keeps its bytes
        # per token, so its page (and kernel descriptors per block) scale by S / bs_g
        nd = nb = 0
        l2g = self.layout.layer_to_group
        sizes = [s.block_size for s in self.layout.groups if s.transfer]
        S = int(np.lcm.reduce(sizes)) if sizes else 1
        n = cdiv(int(num_tokens), S)
        for reg in self.regions:
            for name in reg.layers:
                g = l2g[name]
                if reg.group not in (SHARED, g):
                    continue
                scale = 1 if reg.state else S // self.layout.groups[g].block_size
                nd += n * reg.ratio * scale
                nb += n * reg.block_len * scale
        return RequestFigures(int(num_tokens), tuple(figs), sum(f.descriptors for f in figs),
                              sum(f.bytes for f in figs), nd, nb)

    def describe(self, num_tokens: int) -> str:
        """Human-readable plan: regions, per-group descriptors and bytes for one request, HMA
        vs non-HMA (for ``hmacore plan``)."""
        f = self.request_figures(num_tokens)
        shared = sum(r.group == SHARED for r in self.regions)
        state = sum(r.state for r in self.regions)
        lines = [f"transfer plan: {len(self.regions)} regions ({shared} shared, "
                 f"{len(self.regions) - shared} group-owned, {state} state), "
                 f"{self.num_descs:,} descriptors in the dlist, "
                 f"{'group-major' if self.group_major else 'region-major'} ids",
                 f"request of {num_tokens:,} tokens:",
                 f"  {'group':<10} {'kind':<15} {'bs':>5} {'blocks':>8} {'descs':>12} {'bytes':>16}"]
        for fg in f.groups:
            spec = self.layout.groups[fg.group]
            lines.append(f"  {fg.name:<10} {spec.kind.name:<15} {spec.block_size:>5} {fg.blocks:>8,} "
                         f"{fg.descriptors:>12,} {fg.bytes:>16,}")
        lines.append(f"  HMA:     {f.hma_descriptors:>12,} descriptors {f.hma_bytes:>18,} bytes")
        lines.append(f"  non-HMA: {f.non_hma_descriptors:>12,} descriptors {f.non_hma_bytes:>18,} bytes")
        lines.append(f"  saving:  {100 * f.descriptor_saving:.1f}% descriptors, "
                     f"{100 * f.byte_saving:.1f}% bytes")
        return "\n".join(lines)


def describe_layout_plan(layout: KVLayout, num_tokens: int) -> tuple[str, dict[str, Any]]:
    """``(text, dict)`` for ``hmacore plan``: the plan a connector would register for ``layout``
    (classic HMA aliasing when page sizes agree) and one request's HMA vs non-HMA figures.

    Uses ``layout.num_blocks`` (or just enough blocks for the request). Groups with unknown
    ``page_bytes`` (0) get a placeholder page, and byte figures are then reported as None.
    """
    known = all(layout.groups[g].page_bytes > 0 for g in layout.transfer_group_ids)
    nb = layout.num_blocks or max(2, sum(layout.blocks_for_tokens(int(num_tokens), clipped=False)) + 1)
    if known:
        plan = TransferPlan.from_layout(layout, nb)
    else:
        ratios = [s.kernel_ratio for s in layout.groups]
        plan = TransferPlan.from_layout(layout, nb, page_bytes=16 * int(np.lcm.reduce(ratios)))
    f = plan.request_figures(int(num_tokens))
    text = plan.describe(int(num_tokens))
    if not known:
        text += "\n  (page_bytes unknown for some group: byte figures are placeholders)"
    doc = {
        "regions": len(plan.regions),
        "shared_regions": sum(r.group == SHARED for r in plan.regions),
        "state_regions": sum(r.state for r in plan.regions),
        "dlist_descriptors": plan.num_descs,
        "desc_id_order": "group-major" if plan.group_major else "region-major",
        "groups": [{"group": g.group, "name": g.name, "blocks": g.blocks,
                    "descriptors": g.descriptors, "bytes": g.bytes if known else None}
                   for g in f.groups],
        "hma": {"descriptors": f.hma_descriptors, "bytes": f.hma_bytes if known else None},
        "non_hma": {"descriptors": f.non_hma_descriptors,
                    "bytes": f.non_hma_bytes if known else None},
        "descriptor_saving": f.descriptor_saving,
        "byte_saving": f.byte_saving if known else None,
    }
    return text, doc


_INT32_MIN, _INT32_MAX = -(2 ** 31), 2 ** 31 - 1


def _as_tuple_n(num_groups: int, block_ids: Sequence[Any]) -> tuple[np.ndarray, ...]:
    """``block_ids`` (one id sequence per group) as a tuple of C-contiguous int32 arrays."""
    if isinstance(block_ids, (str, bytes)) or not hasattr(block_ids, "__len__"):
        raise BlockTableError(f"block_ids must be a sequence of {num_groups} "
                              f"per-group id lists, got {type(block_ids).__name__}")
    if len(block_ids) != num_groups:
        raise BlockTableError(f"block_ids has {len(block_ids)} groups, the layout has "
                              f"{num_groups}")
    return tuple(_as_block_ids(g, x) for g, x in enumerate(block_ids))


def _as_block_ids(g: int, x: Any) -> np.ndarray:
    """Group g's ids as a C-contiguous int32 array (no copy when already one)."""
    if isinstance(x, np.ndarray):
        if x.ndim != 1:
            raise BlockTableError(f"block_ids[{g}] must be 1-D, got shape {x.shape}")
        if not x.flags.c_contiguous:
            raise BlockTableError(f"block_ids[{g}] must be C-contiguous (use np.ascontiguousarray)")
        if x.size == 0:  # an empty group is empty whatever its dtype (np.array([]) is float)
            return np.empty(0, dtype=BLOCK_ID_DTYPE)
        a = x
    else:
        if not isinstance(x, (list, tuple)):
            try:
                x = list(x)
            except TypeError:
                raise BlockTableError(f"block_ids[{g}] must be a sequence of ints") from None
        # the package's id scan (as_block_table's): bools / NumPy bools are not block ids
        # (np.asarray([True, 1]) would silently turn True into block 1)
        n = len(x)
        out, status, i = _tables.seq_to_int32(x, 0)
        if status == _tables.STATUS_OK:
            # an array whenever the status is OK (no cast(): a per-group conversion path)
            return out  # type: ignore[return-value]
        # an element's __int__ may have changed the list after it was read: the messages
        # below index it, so refuse any size change (not only the scan's own CHANGED)
        if status == _tables.STATUS_CHANGED or len(x) != n:  # type: ignore[attr-defined]
            raise BlockTableError(f"block_ids[{g}] changed size while being converted (at "
                                  f"index {i}); pass ids nothing else mutates")
        if isinstance(x[i], (bool, np.bool_)):
            err = BlockTableError(f"block_ids[{g}][{i}]: block ids must be integers, not bools "
                                  f"(got {x[i]!r})")
            err.group, err.block_index = g, i
            raise err
        try:
            a = np.asarray(x)
        except (TypeError, ValueError, RuntimeError):   # RuntimeError: the list changed
            raise BlockTableError(f"block_ids[{g}] must be a sequence of ints") from None
        if a.size == 0:
            return np.empty(0, dtype=BLOCK_ID_DTYPE)
        if a.ndim != 1:
            raise BlockTableError(f"block_ids[{g}] must be a flat list of ints, got shape {a.shape}")
    if a.dtype.kind not in "iu":
        raise BlockTableError(f"block_ids[{g}] must hold integers, got dtype {a.dtype}")
    if a.dtype == BLOCK_ID_DTYPE:
        return a
    if a.size and (int(a.min()) < _INT32_MIN or int(a.max()) > _INT32_MAX):
        raise BlockTableError(f"block_ids[{g}] has ids outside int32 (block ids are int32)")
    return a.astype(BLOCK_ID_DTYPE)
