"""Heterogeneous tensor parallelism: which remote ranks a local rank reads, and which bytes.

vLLM shards KV heads across TP ranks: with ``tp <= H`` (H = total KV heads of a layer) rank r
holds heads ``[r*H/tp, (r+1)*H/tp)``; with ``tp > H`` heads are replicated and rank r holds
the single head ``r*H // tp``. vLLM rejects ``H % tp`` (tp <= H) and ``tp % H`` (tp > H)
remainders; so does :func:`kv_heads_of_rank`. MLA groups hold one latent per token that
is the same on every rank (replicated); Mamba state groups are whole pages between equal TP
sizes and, with a :attr:`GroupSharding.state` geometry, byte ranges of the conv and ssm states
between different TP sizes (:class:`StateSlice`, rule in :mod:`hmacore.state_tp`).

Units: heads are global KV head indices; ``head_bytes`` is bytes of one head inside one chunk
of one block; descriptors are the sub-block byte ranges a NIXL transfer moves.

Everything here is computed once per peer pair (:class:`TpMapping` per local rank and remote
TP size, :class:`TpPairPlan` per (local rank, remote rank)); per request only
:meth:`TpPairPlan.desc_ids` runs, which is TransferPlan's Cython flattening.

Page model (documented choice): every region's block is ``chunks`` equal, consecutive chunks,
each head-major ``[heads_on_rank, head_bytes]`` (inside a head the bytes are token-major).
``chunks=2`` is the HND K-then-V page (``[2, heads, block_size, head_size]``), ``chunks=1``
vLLM 0.32's CPU ``LBHNC`` page (``[heads, block_size, 2*head_size]``) and every Mamba state
sub-page (``[heads, ...]``). A head slice is therefore ``chunks`` contiguous byte ranges per
block. NHD pages (heads innermost) are not head-sliceable per block and are not modelled;
nor are head-sharded regions whose kernel block is smaller than the logical block (each kernel
block is head-major on its own), which are rejected. A block-size ratio between the peers
(local block = ratio x remote block) composes: each head's token-major bytes are split into
``ratio`` sub-blocks (one descriptor per head per sub-block).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .errors import BlockTableError, HandshakeError, LayoutError
from .plan import BLOCK_ID_DTYPE, Region, TransferPlan
from .spec import GroupKind, KVLayout
from .state_tp import GlobalStateGeometry, source_ranks, state_ranges

__all__ = ["GroupSharding", "HeadSlice", "StateSlice", "TpMapping", "TpPairPlan", "kv_heads_of_rank",
           "default_shardings", "build_pair_plans", "expected_consumers", "consumer_ranks",
           "PAGE_LAYOUTS", "HEAD_MAJOR_LAYOUTS"]

#: vLLM KV cache page layouts hmacore knows by name. Head-major layouts (heads outside tokens)
#: are head-sliceable per block; in NHD / LBNHC pages heads are innermost (one head's bytes
#: are ``block_size`` strided pieces), so only whole pages can move.
PAGE_LAYOUTS = ("HND", "LBHNC", "NHD", "LBNHC")
HEAD_MAJOR_LAYOUTS = ("HND", "LBHNC")


#: Upper bounds of head counts and TP sizes (real models: <= a few hundred KV / state heads,
#: TP <= a few hundred ranks). Every per-plan cost is at most linear in these.
MAX_HEADS = 1 << 16
MAX_TP = 1 << 16


def _int(name: str, v: Any, lo: int, hi: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or int(v) < lo \
            or (hi is not None and int(v) > hi):
        bound = "" if hi is None else f" and <= {hi}"
        raise LayoutError(f"{name} must be an int >= {lo}{bound}, got {v!r}")
    return int(v)


def kv_heads_of_rank(num_heads: int, tp: int, rank: int) -> tuple[int, int]:
    """Global KV heads ``[start, stop)`` that TP rank ``rank`` of ``tp`` holds (vLLM's rule).

    Raises LayoutError when ``tp <= num_heads`` and tp does not divide the heads, when
    ``tp > num_heads`` and the heads do not divide tp, or when rank is not in ``[0, tp)``.
    """
    h = _int("num_heads", num_heads, 1, MAX_HEADS)
    tp = _int("tp", tp, 1, MAX_TP)
    rank = _int("rank", rank, 0)
    if rank >= tp:
        raise LayoutError(f"rank must be in [0, {tp}), got {rank}")
    if tp <= h:
        if h % tp:
            raise LayoutError(f"tp {tp} does not divide num_heads {h} (vLLM requires it)")
        n = h // tp
        return rank * n, rank * n + n
    if tp % h:
        raise LayoutError(f"num_heads {h} does not divide tp {tp} (vLLM requires it when "
                          "tp > num_heads: heads are replicated tp/num_heads times)")
    s = rank * h // tp
    return s, s + 1


@dataclasses.dataclass(frozen=True)
class GroupSharding:
    """How one group's pages are split across TP ranks.

    Attributes:
        num_heads: total KV heads per layer (attention) or total state heads along the leading
            dim of each state sub-page (Mamba). Ignored when ``replicated``.
        chunks: head-major chunks per block of each region (2 = K then V; 1 = LBHNC or a
            state sub-page). See the module docstring.
        replicated: every rank holds the whole page (MLA; Mamba when not sharded).
        state: a Mamba group's TP-independent state geometry (conv sub-projections and ssm
            heads, :class:`hmacore.state_tp.GlobalStateGeometry`), or None. With it the group
            must be ``replicated`` (equal TP sizes copy whole pages, as without it); between
            different TP sizes :class:`TpMapping` gives it :class:`StateSlice` byte ranges.
    """

    num_heads: int = 1
    chunks: int = 1
    replicated: bool = False
    state: GlobalStateGeometry | None = None

    def __post_init__(self) -> None:
        _int("num_heads", self.num_heads, 1, MAX_HEADS)
        _int("chunks", self.chunks, 1, MAX_HEADS)
        if self.state is not None:
            if not isinstance(self.state, GlobalStateGeometry):
                raise LayoutError(f"GroupSharding.state must be a GlobalStateGeometry or None, "
                                  f"got {type(self.state).__name__}")
            if not self.replicated:
                raise LayoutError("GroupSharding with a state geometry must be replicated=True "
                                  "(whole pages at equal TP; state ranges between TP sizes)")


def default_shardings(layout: KVLayout, num_heads: int, *, kv_chunks: int = 2,
                      mamba_state: GlobalStateGeometry | Sequence[GlobalStateGeometry | None]
                      | None = None, mamba_heads: int | None = None,
                      mamba_sharded: bool | None = None) -> tuple[GroupSharding, ...]:
    """One GroupSharding per group: MLA replicated; attention ``num_heads`` heads in
    ``kv_chunks`` chunks; Mamba groups as the caller says, no default:

    * ``mamba_state``: vLLM's exact model (what the vLLM connector declares and its pull path
      uses): ``GroupSharding(1, 1, True, state=geometry)``, whole pages at equal TP sizes,
      :class:`StateSlice` byte ranges between TP sizes. One :class:`GlobalStateGeometry` for
      every Mamba group, or one entry per group of the layout (None for non-Mamba groups).
    * ``mamba_sharded=False``: replicated whole pages without a geometry (equal TP sizes only:
      :class:`TpMapping` then reads the whole page of one remote rank).
    * ``mamba_sharded=True``: the older head-major model (each state sub-page
      ``[mamba_heads on the rank, bytes]``, default ``num_heads``), which is NOT vLLM's conv
      state layout (its sub-projections are sharded one by one); kept for synthetic layouts.

    Raises LayoutError when the layout has Mamba groups and neither (or both) is given, or a
    Mamba group lacks a geometry in ``mamba_state``."""
    G = layout.num_groups
    mamba = [g for g, s in enumerate(layout.groups) if s.kind == GroupKind.MAMBA and not s.mla]
    geos: list[Any] = [None] * G
    if mamba_state is not None:
        if mamba_sharded is not None:
            raise LayoutError("default_shardings: give mamba_state (vLLM's state model) or "
                              "mamba_sharded (True: head-major model, False: whole pages), "
                              "not both")
        if isinstance(mamba_state, GlobalStateGeometry):
            geos = [mamba_state if g in mamba else None for g in range(G)]
        else:
            geos = list(mamba_state)
            if len(geos) != G:
                raise LayoutError(f"default_shardings: mamba_state must be one "
                                  f"GlobalStateGeometry or one entry per group ({G}), got "
                                  f"{len(geos)} entries")
        for g in mamba:
            if not isinstance(geos[g], GlobalStateGeometry):
                raise LayoutError(f"default_shardings: mamba_state[{g}] must be the Mamba "
                                  f"group's GlobalStateGeometry, got {geos[g]!r}")
    elif mamba and mamba_sharded is None:
        raise LayoutError(f"default_shardings: groups {mamba} are Mamba state; say how they "
                          "are split across TP ranks: mamba_state=GlobalStateGeometry (vLLM's "
                          "model: whole pages at equal TP, state byte ranges between TP "
                          "sizes), mamba_sharded=False (whole pages, equal TP only) or "
                          "mamba_sharded=True (the older head-major model, not vLLM's layout)")
    out = []
    for g, spec in enumerate(layout.groups):
        if spec.mla:
            out.append(GroupSharding(replicated=True))
        elif spec.kind == GroupKind.MAMBA:
            if geos[g] is not None:
                out.append(GroupSharding(1, 1, True, state=geos[g]))
            else:
                out.append(GroupSharding(mamba_heads or num_heads, 1, not mamba_sharded))
        else:
            out.append(GroupSharding(num_heads, kv_chunks))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class HeadSlice:
    """Global heads ``[start, stop)`` of one group read from ``remote_rank``.

    ``local_index``/``remote_index``: position of ``start`` among the heads each rank holds
    (the head offset inside a chunk, in heads). Replicated groups: one slice, heads (0, 1),
    both indices 0, ``replicated`` True (the whole page moves)."""

    group: int
    remote_rank: int
    start: int
    stop: int
    local_index: int
    remote_index: int
    replicated: bool = False

    @property
    def num_heads(self) -> int:
        return self.stop - self.start


@dataclasses.dataclass(frozen=True)
class StateSlice:
    """The Mamba state bytes of one group read from ``remote_rank`` (different TP sizes):
    ``ranges`` are ``(remote_offset, local_offset, nbytes)`` from each side's layer page
    start (:func:`hmacore.state_tp.state_ranges`, the remote side the source)."""

    group: int
    remote_rank: int
    ranges: tuple[tuple[int, int, int], ...]
    replicated: bool = False


class TpMapping:
    """Head slices one local rank reads, per group, from a remote deployment of another TP size.

    Every head a local rank holds is read from exactly one remote rank: when several remote
    ranks hold a head (remote tp > heads), rank ``first + local_rank % copies`` is chosen;
    replicated groups read from ``local_rank % remote_tp``. Slices keep head order.

    Args:
        layout: the model's layout (both sides agree on it up to block sizes).
        shardings: one GroupSharding per group.
        local_tp / local_rank / remote_tp: TP sizes and this rank.
        page_layout: the pages' vLLM KV cache layout, one of :data:`PAGE_LAYOUTS` (default
            ``"HND"``). With ``"NHD"``/``"LBNHC"`` (heads innermost) every head-sharded slice
            must be a whole page on both sides (equal heads per rank), else LayoutError.

    Raises LayoutError (nothing built) for DCP/PCP (``layout.context_parallel > 1``: tokens are
    interleaved across ranks, so a block is not one rank's pages), NHD pages that would need
    head slices, bad TP sizes or ranks, and shardings that do not match the layout.
    """

    def __init__(self, layout: KVLayout, shardings: Sequence[GroupSharding], *, local_tp: int,
                 local_rank: int, remote_tp: int, page_layout: str = "HND"):
        if layout.context_parallel != 1:
            raise LayoutError(f"layout.context_parallel={layout.context_parallel}: decode/prefill "
                              "context parallelism (DCP/PCP) interleaves a block's tokens across "
                              "ranks; heterogeneous-TP mapping does not support it")
        if page_layout not in PAGE_LAYOUTS:
            raise LayoutError(f"page_layout must be one of {list(PAGE_LAYOUTS)}, got {page_layout!r}")
        if len(shardings) != layout.num_groups:
            raise LayoutError(f"shardings has {len(shardings)} entries, layout has "
                              f"{layout.num_groups} groups")
        for g, s in enumerate(shardings):
            if not isinstance(s, GroupSharding):
                raise LayoutError(f"shardings[{g}] must be a GroupSharding, got {type(s).__name__}")
        self.layout = layout
        self.shardings = tuple(shardings)
        self.local_tp = _int("local_tp", local_tp, 1, MAX_TP)
        self.local_rank = _int("local_rank", local_rank, 0)
        self.remote_tp = _int("remote_tp", remote_tp, 1, MAX_TP)
        if self.local_rank >= self.local_tp:
            raise LayoutError(f"local_rank must be in [0, {self.local_tp}), got {local_rank}")
        slices: list[tuple[HeadSlice | StateSlice, ...]] = []
        for g, sh in enumerate(self.shardings):
            if not layout.groups[g].transfer:
                slices.append(())
            elif sh.state is not None and self.local_tp != self.remote_tp:
                slices.append(self._state(g, sh.state))
            elif sh.replicated:
                slices.append((HeadSlice(g, self.local_rank % self.remote_tp, 0, 1, 0, 0, True),))
            else:
                slices.append(self._shard(g, sh.num_heads))
        self.page_layout = page_layout
        if page_layout not in HEAD_MAJOR_LAYOUTS:
            for g, ss in enumerate(slices):
                if self.shardings[g].replicated:
                    continue
                h = self.shardings[g].num_heads
                nl, nr = _per_rank(h, self.local_tp), _per_rank(h, self.remote_tp)
                for hs in ss:
                    # state pages (StateSlice) do not depend on the KV page layout
                    if isinstance(hs, HeadSlice) and not hs.num_heads == nl == nr:
                        raise LayoutError(
                            f"page_layout {page_layout!r} puts heads innermost: group {g} needs "
                            f"heads [{hs.start}, {hs.stop}) of remote rank {hs.remote_rank} (local "
                            f"rank holds {nl} heads, remote {nr}), which are not whole pages; "
                            "head slices need a head-major layout (HND, LBHNC; vLLM: "
                            "VLLM_KV_CACHE_LAYOUT=HND) or equal heads per rank on both sides")
        self.slices: tuple[tuple[HeadSlice | StateSlice, ...], ...] = tuple(slices)
        self.remote_ranks: tuple[int, ...] = tuple(sorted({s.remote_rank for ss in slices for s in ss}))

    def _state(self, g: int, geo: GlobalStateGeometry) -> tuple[StateSlice, ...]:
        """Per source rank (remote side), the state byte ranges this rank reads."""
        try:
            src, dst = geo.at(self.remote_tp), geo.at(self.local_tp)
            out = []
            for p in source_ranks(self.remote_tp, self.local_tp, self.local_rank):
                ranges = state_ranges(src, p, dst, self.local_rank)
                if ranges:
                    out.append(StateSlice(g, p, tuple(ranges)))
        except (HandshakeError, LayoutError) as e:
            raise LayoutError(f"group {g} (Mamba state) between local TP {self.local_tp} and "
                              f"remote TP {self.remote_tp}: {e}") from None
        return tuple(out)

    def _shard(self, g: int, h: int) -> tuple[HeadSlice, ...]:
        """Maximal runs of this rank's heads ``[lo, hi)`` held by one remote rank, in head
        order. O(runs), not O(heads): with remote_tp <= h remote rank p holds the block
        ``[p*n, (p+1)*n)`` (n = h / remote_tp), so the runs are the pieces of ``[lo, hi)``
        cut at multiples of n; with remote_tp > h every head has its own source rank
        ``head*copies + local_rank % copies``, one run per head: at most h < remote_tp
        runs. Either way at most min(heads of this rank, remote_tp) <= MAX_TP runs."""
        lo, hi = kv_heads_of_rank(h, self.local_tp, self.local_rank)
        kv_heads_of_rank(h, self.remote_tp, 0)  # validates remote_tp against h
        runs: list[list[int]] = []  # [remote_rank, start, stop]
        if self.remote_tp <= h:
            n = h // self.remote_tp
            head = lo
            while head < hi:            # terminates: head grows by >= 1 each round
                p = head // n
                stop = min(hi, (p + 1) * n)
                runs.append([p, head, stop])
                head = stop
        else:
            copies = self.remote_tp // h
            runs = [[head * copies + self.local_rank % copies, head, head + 1]
                    for head in range(lo, hi)]
        out = []
        for p, s, e in runs:
            rlo, _ = kv_heads_of_rank(h, self.remote_tp, p)
            out.append(HeadSlice(g, p, s, e, s - lo, s - rlo))
        return tuple(out)

    def groups_of(self, remote_rank: int) -> tuple[int, ...]:
        """Groups this local rank reads (some heads of) from ``remote_rank``."""
        return tuple(g for g, ss in enumerate(self.slices) if any(s.remote_rank == remote_rank for s in ss))

    def table(self) -> list[dict[str, Any]]:
        """The slices as rows (for printing and docs)."""
        return [dataclasses.asdict(s) for ss in self.slices for s in ss]


def _per_rank(num_heads: int, tp: int) -> int:
    lo, hi = kv_heads_of_rank(num_heads, tp, 0)
    return hi - lo


def _region_groups(layout: KVLayout, reg: Region) -> list[int]:
    if reg.group >= 0:
        return [reg.group]
    return [g for g in layout.transfer_group_ids
            if (layout.groups[g].kind == GroupKind.MAMBA) == reg.state]


class TpPairPlan:
    """Sub-block descriptors for one (local rank, remote rank) pair, in matching order.

    ``local`` and ``remote`` are TransferPlans over virtual regions (per local region, chunk
    and head run; per head when a block-size ratio splits blocks): their ``descriptors()`` are
    the N x 3 ``(addr, len, dev)`` rows of each side's dlist and :meth:`desc_ids` gives
    index-for-index matching ids. Built once per pair.

    Regions are paired by (group, layer), not by index: whether layers of several groups alias
    one slot depends on page sizes, which differ across TP sizes (a replicated MLA page and a
    head-sharded page may be equal at one TP size only). A slot aliased on both sides with the
    same layers and one sharding stays shared (group -1); otherwise one owned virtual region
    per group is emitted (its descriptors then count once per group).

    Args:
        mapping: the local rank's TpMapping.
        remote_rank: one of ``mapping.remote_ranks``.
        local_plan / remote_plan: each side's full TransferPlan over the same layers (the
            remote one e.g. from its handshake region table).
        block_size_ratio: local block size / remote block size for attention groups (>= 1).
            Local logical blocks are split into that many token sub-blocks per head.
    """

    def __init__(self, mapping: TpMapping, remote_rank: int, local_plan: TransferPlan,
                 remote_plan: TransferPlan, *, block_size_ratio: int = 1):
        layout = mapping.layout
        remote_rank = _int("remote_rank", remote_rank, 0)
        if remote_rank not in mapping.remote_ranks:
            raise LayoutError(f"remote_rank {remote_rank} serves nothing to local rank "
                              f"{mapping.local_rank}; sources are {list(mapping.remote_ranks)}")
        bsr = _int("block_size_ratio", block_size_ratio, 1)
        self.mapping, self.remote_rank, self.block_size_ratio = mapping, remote_rank, bsr
        self.groups = mapping.groups_of(remote_rank)
        l2g = layout.layer_to_group
        # (group, layer) -> remote regions holding that layer's pages for the group, in order
        rindex: dict[tuple[int, str], list[int]] = {}
        for ri, rr in enumerate(remote_plan.regions):
            for n in rr.layers:
                g = l2g.get(n)
                if g is None:
                    raise LayoutError(f"remote region {ri} names layer {n!r} that the layout lacks")
                if rr.group in (-1, g):
                    rindex.setdefault((g, n), []).append(ri)
        # (group, layer) -> local regions holding it, in order (state parts: conv, ssm, ...)
        lindex: dict[tuple[int, str], list[int]] = {}
        for li, lr_ in enumerate(local_plan.regions):
            for n in lr_.layers:
                g = l2g.get(n)
                if g is not None and lr_.group in (-1, g):
                    lindex.setdefault((g, n), []).append(li)
        self._parts = (lindex, rindex, local_plan, remote_plan)
        seen: dict[tuple[int, str], int] = {}
        lregs: list[Region] = []
        rregs: list[Region] = []
        for r, lr in enumerate(local_plan.regions):
            gs = _region_groups(layout, lr)
            firsts = {}
            for g in gs:
                names = [n for n in lr.layers if l2g[n] == g]
                if names:  # a group without a layer in this slot has nothing to move here
                    k = (g, names[0])
                    firsts[g] = (k, seen.get(k, 0))
                    seen[k] = seen.get(k, 0) + 1
            pairs = []
            for g, (k, nth) in firsts.items():
                cands = rindex.get(k, [])
                if nth >= len(cands):
                    raise LayoutError(f"remote plan has no region #{nth} for layer {k[1]!r} of "
                                      f"group {g}: both sides must register the same layers")
                pairs.append((g, remote_plan.regions[cands[nth]]))
            if not pairs:
                continue
            rr0 = pairs[0][1]
            shs = {mapping.shardings[g] for g, _ in pairs}
            if lr.group == -1 and rr0.group == -1 and rr0.layers == lr.layers and len(shs) == 1 \
                    and all(rr is rr0 for _, rr in pairs) and len(pairs) == len(gs):
                todo = [(-1, gs[0], rr0)]          # both sides alias the slot: keep it shared
            else:
                todo = [(g, g, rr) for g, rr in pairs]   # one owned virtual region per group
            for owner, g, rr in todo:
                if (lr.state, lr.ratio) != (rr.state, rr.ratio):
                    raise LayoutError(f"region {r}: local (state {lr.state}, ratio {lr.ratio}) and "
                                      f"remote (state {rr.state}, ratio {rr.ratio}) differ")
                if owner == -1:
                    lo, ro = lr, rr
                else:  # an owned virtual region names only its group's layers (per-layer plans)
                    lo = dataclasses.replace(lr, group=owner,
                                             layers=tuple(n for n in lr.layers if l2g[n] == g))
                    ro = dataclasses.replace(rr, group=owner,
                                             layers=tuple(n for n in rr.layers if l2g[n] == g))
                for s in mapping.slices[g]:
                    if s.remote_rank != remote_rank:
                        continue
                    if isinstance(s, StateSlice):
                        k, nth = firsts[g]
                        self._emit_state(r, lo, ro, s, k, nth, lregs, rregs)
                    else:
                        self._emit(r, lo, ro, mapping.shardings[g], s, bsr, lregs, rregs)
        self.local = TransferPlan(layout, lregs, mem_type=local_plan.mem_type)
        self.remote = TransferPlan(layout, rregs, mem_type=remote_plan.mem_type)
        if bsr > 1:
            self.local = self.local.with_block_size_ratio(bsr)
        self._served = np.zeros(layout.num_groups, dtype=bool)
        self._served[list(self.groups)] = True
        self._state = tuple(s.kind == GroupKind.MAMBA for s in layout.groups)

    def _emit_state(self, r, lr, rr, s: StateSlice, key, nth, lregs, rregs) -> None:
        """One virtual region per state byte range inside this layer part (the ``nth`` region
        of the layer on each side: a whole page, or one state tensor when the layer is
        registered as several regions); a range must lie in one part on both sides."""
        lindex, rindex, lplan, rplan = self._parts
        lparts = [lplan.regions[i].block_len for i in lindex[key]]
        rparts = [rplan.regions[i].block_len for i in rindex[key]]
        if len(lparts) != len(rparts):
            raise LayoutError(f"region {r}: layer {key[1]!r} is {len(lparts)} state region(s) "
                              f"locally and {len(rparts)} remotely; both sides must register "
                              "its state tensors alike")
        if lr.ratio != 1 or rr.ratio != 1:
            raise LayoutError(f"region {r}: a state region with kernel ratio "
                              f"{lr.ratio}/{rr.ratio} cannot be cut into state ranges")
        l0, r0 = sum(lparts[:nth]), sum(rparts[:nth])
        for src, dst, n in s.ranges:
            if not l0 <= dst < l0 + lr.block_len:
                continue       # this range belongs to another part of the layer
            if dst + n > l0 + lr.block_len or not r0 <= src or src + n > r0 + rr.block_len:
                raise LayoutError(f"region {r}: state range (remote {src}, local {dst}, {n} B) "
                                  f"of layer {key[1]!r} straddles its part #{nth} (local "
                                  f"[{l0}, {l0 + lr.block_len}), remote [{r0}, "
                                  f"{r0 + rr.block_len}))")
            lregs.append(dataclasses.replace(lr, base=lr.base + dst - l0, block_len=n))
            rregs.append(dataclasses.replace(rr, base=rr.base + src - r0, block_len=n))

    def _emit(self, r, lr, rr, sh: GroupSharding, s: HeadSlice, bsr, lregs, rregs) -> None:
        if s.replicated:
            split = 1 if lr.state else bsr
            if lr.block_len != rr.block_len * split:
                raise LayoutError(f"region {r} is replicated but its block is {lr.block_len} B "
                                  f"locally and {rr.block_len} B remotely (expected local = "
                                  f"{split} x remote)")
            lregs.append(lr)
            rregs.append(rr)
            return
        k, h = sh.chunks, sh.num_heads
        nl = kv_heads_of_rank(h, self.mapping.local_tp, 0)
        nr = kv_heads_of_rank(h, self.mapping.remote_tp, 0)
        hl, hr = nl[1] - nl[0], nr[1] - nr[0]
        if lr.block_len % (k * hl) or rr.block_len % (k * hr):
            raise LayoutError(f"region {r}: blocks of {lr.block_len} B (local, {hl} heads) / "
                              f"{rr.block_len} B (remote, {hr} heads) do not split into {k} "
                              "chunks of whole heads")
        hb = lr.block_len // (k * hl)
        split = 1 if lr.state else bsr
        hbr = rr.block_len // (k * hr)
        if hbr * split != hb:
            raise LayoutError(f"region {r}: {hb} B per head per chunk locally, {hbr} B remotely; "
                              f"expected local = {split} x remote (head size, block size or "
                              "block_size_ratio disagree)")
        if lr.ratio != 1:
            # a logical block is then kr kernel blocks, each head-major: a head slice is not a
            # fixed set of ranges per logical block that Region can express
            raise LayoutError(f"region {r}: kernel ratio {lr.ratio} with head-sharded pages is not "
                              "supported; plan with kernel_block_size equal to the block size")
        per_head = bsr > 1 and not lr.state
        runs = [(i, 1) for i in range(s.num_heads)] if per_head else [(0, s.num_heads)]
        for c in range(k):
            for i, n in runs:
                loff = c * (lr.block_len // k) + (s.local_index + i) * hb
                roff = c * (rr.block_len // k) + (s.remote_index + i) * hbr
                lregs.append(dataclasses.replace(lr, base=lr.base + loff, block_len=n * hb))
                rregs.append(dataclasses.replace(rr, base=rr.base + roff, block_len=n * hbr))

    def desc_ids(self, local_block_ids: Sequence[Any], remote_block_ids: Sequence[Any], *,
                 out_local: np.ndarray | None = None, out_remote: np.ndarray | None = None
                 ) -> tuple[np.ndarray, np.ndarray]:
        """``(local, remote)`` int64 descriptor ids into :attr:`local` / :attr:`remote`'s dlists,
        equal length, paired index-for-index.

        Both arguments are per-group block id lists (window clipped, null-stripped, prefix
        trimmed) for every group of the layout; groups this pair does not serve are ignored.
        For attention groups the remote list must be ``block_size_ratio`` times as long as
        the local one (local block b pairs with remote blocks ``b*ratio .. b*ratio+ratio-1``);
        state groups pair 1:1. Raises BlockTableError (nothing computed) otherwise.
        ``out_local``/``out_remote``: reusable int64 buffers (see TransferPlan.desc_ids); the
        results are then prefix views of them (no allocation per request; on an error the
        buffers may hold partial ids, but nothing is returned).
        """
        G = self.mapping.layout.num_groups
        for name, ids in (("local_block_ids", local_block_ids), ("remote_block_ids", remote_block_ids)):
            if isinstance(ids, (str, bytes)) or not hasattr(ids, "__len__") or len(ids) != G:
                raise BlockTableError(f"{name} must be {G} per-group id lists")
        empty = np.empty(0, dtype=BLOCK_ID_DTYPE)
        loc, rem = [], []
        for g in range(G):
            if not self._served[g]:
                loc.append(empty)
                rem.append(empty)
                continue
            m = 1 if self._state[g] else self.block_size_ratio
            if len(remote_block_ids[g]) != m * len(local_block_ids[g]):
                raise BlockTableError(f"group {g}: {len(local_block_ids[g])} local and "
                                      f"{len(remote_block_ids[g])} remote blocks; remote must be "
                                      f"{m} x local")
            loc.append(local_block_ids[g])
            rem.append(remote_block_ids[g])
        lids = self.local.desc_ids(loc, out=out_local)
        rids = self.remote.desc_ids(rem, out=out_remote)
        if lids.size != rids.size:  # unreachable if the regions pair up; guard the contract
            raise BlockTableError(f"{lids.size} local vs {rids.size} remote descriptors")
        return lids, rids


def build_pair_plans(mapping: TpMapping, local_plan: TransferPlan,
                     remote_plans: Mapping[int, TransferPlan], *, block_size_ratio: int = 1
                     ) -> dict[int, TpPairPlan]:
    """One TpPairPlan per source rank of ``mapping`` (``remote_plans[rank]`` must exist)."""
    missing = [p for p in mapping.remote_ranks if p not in remote_plans]
    if missing:
        raise LayoutError(f"remote_plans lacks source ranks {missing}")
    return {p: TpPairPlan(mapping, p, local_plan, remote_plans[p], block_size_ratio=block_size_ratio)
            for p in mapping.remote_ranks}


def consumer_ranks(layout: KVLayout, shardings: Sequence[GroupSharding], *, local_tp: int,
                   remote_tp: int, remote_rank: int) -> tuple[int, ...]:
    """The local (decode) ranks, ascending, that read some bytes of ``remote_rank`` of the
    remote (prefill) side: exactly the ranks whose completion notification that prefill rank
    waits for before it releases a request's blocks (see hmacore.sends.SendTracker).
    Computed once per deployment pair. Raises LayoutError for a rank outside ``[0, remote_tp)``
    or TP sizes the shardings reject."""
    remote_rank = _int("remote_rank", remote_rank, 0)
    if remote_rank >= _int("remote_tp", remote_tp, 1):
        raise LayoutError(f"remote_rank must be in [0, {remote_tp}), got {remote_rank}")
    return tuple(d for d in range(_int("local_tp", local_tp, 1))
                 if remote_rank in TpMapping(layout, shardings, local_tp=local_tp, local_rank=d,
                                             remote_tp=remote_tp).remote_ranks)


def expected_consumers(layout: KVLayout, shardings: Sequence[GroupSharding], *, local_tp: int,
                       remote_tp: int, remote_rank: int) -> int:
    """How many local (decode) ranks read from ``remote_rank`` of the remote (prefill) side:
    the count of completion notifications that prefill rank waits for (vLLM's
    ``expected_consumers``); ``len(consumer_ranks(...))``. Computed once per deployment pair."""
    return len(consumer_ranks(layout, shardings, local_tp=local_tp, remote_tp=remote_tp,
                              remote_rank=remote_rank))
