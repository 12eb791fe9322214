"""Prefill and decode with different block sizes: per group, P's blocks onto D's, as byte runs.

Units: token positions (``lo``, ``hi``); blocks of one side's group (``block_size`` tokens
each, ids into that side's pool, id 0 = null); bytes (runs are ``(addr, bytes, dev)`` rows).

The mapping rule. Group g moves tokens ``[lo_g, hi_g)``. Token ``t`` lives on each side in
block ``ids[t // bs - first]`` at row ``t % bs``; inside a block, kernel block
``row // kernel_bs`` holds it at row ``row % kernel_bs`` of every chunk. A *chunk* is a
token-major piece of a kernel block (``kernel_bs`` rows of ``row`` bytes): HND pages are one
chunk per (K/V, head), LBHNC one per head, NHD one per K/V, an MLA latent one; vLLM CPU's
"vec" pages (CPU_VEC) hold K transposed, so one chunk per (head, K element) plus V per head.
Both sides' pages name their chunks with the same keys (global head index, part); chunk
``key`` of the destination receives chunk ``key`` of the source, row for row. So a token range
is a byte range inside a block exactly when the page is token-major per chunk; layouts that
interleave tokens inside a chunk are refused by name (:data:`REFUSED_LAYOUTS`).

What is refused (LayoutError, nothing built): block sizes whose ratio is not an integer either
way (P 16 / D 24: vLLM's hash grain would not align either, and each 8-token piece would be
its own descriptor), kernel block sizes likewise, groups whose kinds or layers differ, Mamba
states of unequal bytes (or state pages of unequal bytes when no state size is given), a state
larger than its page, chunks of unequal row bytes (a head's bytes per token differ:
dtype, head size or an NHD page sliced by TP), a destination chunk the source lacks.

Window clipping and prefix trimming happen in each side's own grain: the caller gives each
side's table as it holds it (clipped tables say where they start: ``first``, in blocks of
that side) and the token range per group (:func:`token_ranges`: prefix trim, sliding window,
chunked-local start). Partial first/last blocks (a range starting or ending inside a block of
either side) become byte ranges inside the block.

Mamba state blocks are mapped by state, not by tokens: ``src_ids[g][i] -> dst_ids[g][i]``,
independent of token ranges; the caller pairs the blocks holding the same state (the state
after the same number of tokens; in vLLM P's running-state slot and D's slot for the tokens
it loads, see docs/vllm.md "Mamba state across block sizes"). A state block is a page holding
the state tensors back to back from its start, padded to the engine's page size (vLLM pads the
Mamba page to its attention page, so two engines of different block sizes have state pages
of different bytes). With ``src_state_bytes`` / ``dst_state_bytes`` (per group, the unpadded
state bytes of one layer's page) a state pair copies those bytes only, from each page's
start; they must be equal on both sides and fit both pages. Without them the whole page
moves and both pages must be of equal bytes (pages of equal block size).

Heterogeneous TP composes: with ``tp=(mapping, remote_rank)`` only the chunks of the heads
the destination rank reads from that source rank are paired (keys are global head indices).
A Mamba group whose sharding carries a state geometry (:class:`hmacore.tp.StateSlice` between
different TP sizes) pairs one state region per state byte range this rank reads from that
source rank (:func:`hmacore.state_tp.state_ranges`, offsets from each side's layer page
start), still ``src_ids[g][i] -> dst_ids[g][i]``: the ids are each side's own state-group
table, whatever the block sizes; a range must lie inside one registered part (whole page or
state tensor) on both sides and inside each side's unpadded state when its bytes are given.
A Mamba group between different TP sizes without a state geometry is refused by name.

Cost: :class:`RegrainPlan` is built once per peer pair; :meth:`RegrainPlan.runs` is one
Cython pass per request (O(segments x chunks), no Python object per block), returning the
runs merged wherever both sides abut, ready for ``hmacore.transport.nixl_post``'s dynamic
posting (``Runs.local`` / ``Runs.remote``).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

from ._fast import _regrain
from .errors import BlockTableError, LayoutError
from .plan import BLOCK_ID_DTYPE, Region, TransferPlan, _as_block_ids
from .runs import Runs
from .spec import GroupKind, KVLayout

__all__ = ["TokenPage", "token_page", "plan_pages", "TOKEN_MAJOR_LAYOUTS", "REFUSED_LAYOUTS", "RegionPair",
           "RegrainPlan", "RegrainRuns", "token_ranges", "block_size_ratio"]

#: Page layouts whose chunks keep a block's token rows contiguous (see :func:`token_page`).
TOKEN_MAJOR_LAYOUTS = ("HND", "LBHNC", "NHD", "LBNHC", "MLA", "CPU_VEC")
#: Layouts known not to: a token range inside a block is not one byte range per chunk.
REFUSED_LAYOUTS = {
    "HDNX": "keys packed as [heads, head_size/x, block_size, x] (the legacy paged-attention key "
            "cache): one token's row is head_size/x pieces of x elements, block_size*x apart",
}
_MAX_TOKENS = 1 << 62


def _int(name: str, v: Any, lo: int, hi: int | None = None) -> int:
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or int(v) < lo \
            or (hi is not None and int(v) > hi):
        bound = "" if hi is None else f" and <= {hi}"
        raise LayoutError(f"{name} must be an int >= {lo}{bound}, got {v!r}")
    return int(v)


def block_size_ratio(src_block_size: int, dst_block_size: int) -> tuple[int, bool]:
    """``(ratio, src_larger)``: the integer ratio of the two block sizes and which side is
    larger. Raises LayoutError when neither divides the other."""
    a = _int("src_block_size", src_block_size, 1)
    b = _int("dst_block_size", dst_block_size, 1)
    big, small = max(a, b), min(a, b)
    if big % small:
        raise LayoutError(f"block sizes {a} (source) and {b} (destination): one must be an "
                          "integer multiple of the other (P 16 / D 32 and P 64 / D 16 map; "
                          "16 / 24 does not)")
    return big // small, a >= b


@dataclasses.dataclass(frozen=True)
class TokenPage:
    """One block of one region on one side: ``block_size // kernel_block_size`` kernel blocks
    back to back, each the ``chunks`` in order, chunk j ``kernel_block_size`` token rows of
    ``chunks[j][1]`` bytes. ``chunks[j][0]`` is the chunk's key (equal keys pair across
    sides). ``layout`` is the page layout's name, for messages."""

    block_size: int
    kernel_block_size: int
    chunks: tuple[tuple[Hashable, int], ...]
    layout: str = "custom"

    def __post_init__(self) -> None:
        bs = _int("TokenPage.block_size", self.block_size, 1)
        kbs = _int("TokenPage.kernel_block_size", self.kernel_block_size, 1)
        if bs % kbs:
            raise LayoutError(f"TokenPage.kernel_block_size {kbs} must divide block_size {bs}")
        if not self.chunks:
            raise LayoutError("TokenPage.chunks must name at least one chunk")
        keys = [k for k, _ in self.chunks]
        if len(set(keys)) != len(keys):
            raise LayoutError(f"TokenPage.chunks has repeated keys: {keys}")
        for k, row in self.chunks:
            _int(f"TokenPage.chunks[{k!r}] row bytes", row, 1)

    @property
    def kernel_ratio(self) -> int:
        return self.block_size // self.kernel_block_size

    @property
    def kernel_bytes(self) -> int:
        """Bytes of one kernel block (padding, if any, sits after the last kernel block)."""
        return self.kernel_block_size * sum(r for _, r in self.chunks)

    @property
    def block_bytes(self) -> int:
        return self.kernel_bytes * self.kernel_ratio

    def offsets(self) -> dict[Hashable, tuple[int, int]]:
        """key -> (byte offset inside a kernel block, bytes per token row)."""
        out, off = {}, 0
        for k, row in self.chunks:
            out[k] = (off, row)
            off += self.kernel_block_size * row
        return out


def token_page(page_layout: str, *, block_size: int, head_bytes: int, heads: int = 1,
               head_start: int = 0, kv: int = 2, kernel_block_size: int | None = None,
               head_dim: int | None = None) -> TokenPage:
    """The chunks of a named vLLM page layout (per rank: ``heads`` heads from global head
    ``head_start``; ``head_bytes`` bytes per token of one head of K or V; ``kv`` parts, 2 for
    packed K/V, 1 for a split K/V region or a key-only cache):

    * ``HND``   ``[kv, heads, tokens, head_bytes]``: chunk ``(part, head)`` per part and head.
    * ``LBHNC`` ``[heads, tokens, kv*head_bytes]`` (vLLM 0.32 CPU): chunk ``("kv", head)``.
    * ``NHD``   ``[kv, tokens, heads*head_bytes]``: chunk ``(part, None)`` (heads inside rows).
    * ``LBNHC`` ``[tokens, heads*kv*head_bytes]``: one chunk ``("kv", None)``.
    * ``MLA``   ``[tokens, head_bytes]`` (one latent per token, same on every rank): one
      chunk ``("latent", None)``.
    * ``CPU_VEC`` what vLLM's CPU attention ("vec" ISA) really writes into an ``LBHNC`` page:
      per head, K transposed ``[head_dim, tokens]`` then V ``[tokens, head_dim]``; chunks
      ``("k", head, d)`` of one element per row (``head_bytes / head_dim`` bytes) for every
      ``d``, then ``("v", head)``. Needs ``head_dim`` and ``kv=2``.

    Raises LayoutError naming the layout for :data:`REFUSED_LAYOUTS` and unknown names."""
    if page_layout in REFUSED_LAYOUTS:
        raise LayoutError(f"page layout {page_layout!r} does not keep a block's token rows "
                          f"contiguous ({REFUSED_LAYOUTS[page_layout]}); a block-size remap "
                          "needs a token-major layout, one of " + ", ".join(TOKEN_MAJOR_LAYOUTS))
    if page_layout not in TOKEN_MAJOR_LAYOUTS:
        raise LayoutError(f"page_layout must be one of {list(TOKEN_MAJOR_LAYOUTS)}, got "
                          f"{page_layout!r}")
    bs = _int("block_size", block_size, 1)
    hb = _int("head_bytes", head_bytes, 1)
    n = _int("heads", heads, 1)
    h0 = _int("head_start", head_start, 0)
    kv = _int("kv", kv, 1, 2)
    kbs = bs if kernel_block_size is None else _int("kernel_block_size", kernel_block_size, 1)
    chunks: list[tuple[Hashable, int]]
    if page_layout == "HND":
        chunks = [((c, h), hb) for c in range(kv) for h in range(h0, h0 + n)]
    elif page_layout == "LBHNC":
        chunks = [(("kv", h), kv * hb) for h in range(h0, h0 + n)]
    elif page_layout == "NHD":
        chunks = [((c, None), n * hb) for c in range(kv)]
    elif page_layout == "LBNHC":
        chunks = [(("kv", None), n * kv * hb)]
    elif page_layout == "CPU_VEC":
        if kv != 2:
            raise LayoutError(f"page layout 'CPU_VEC' packs K and V in one page (kv=2), got kv={kv}")
        hd = _int("head_dim", head_dim, 1)
        if hb % hd:
            raise LayoutError(f"page layout 'CPU_VEC': head_bytes {hb} is not head_dim {hd} "
                              "elements of whole bytes")
        chunks = []
        for h in range(h0, h0 + n):
            chunks += [(("k", h, d), hb // hd) for d in range(hd)]
            chunks.append((("v", h), hb))
    else:
        chunks = [(("latent", None), hb)]
    return TokenPage(bs, kbs, tuple(chunks), page_layout)


def plan_pages(layout: KVLayout, plan: TransferPlan, *, page_layout: str,
               shardings: Sequence[Any], tp_size: int = 1, tp_rank: int = 0,
               head_dim: int | None = None) -> list[TokenPage | None]:
    """The :class:`TokenPage` of every group of a registered plan (None for Mamba groups and
    groups not moved), from the page layout name and each group's sharding (``(num_heads,
    chunks, replicated)`` or a :class:`hmacore.tp.GroupSharding`): MLA / replicated groups
    one latent chunk, head-sharded groups this rank's heads (vLLM's rule), K/V packed per
    block (``kv=2``) or split into two regions per layer (``kv=1``). Bytes per token row come
    from the region's kernel block: ``kernel_bytes / (kernel_bs * heads * kv)``; LayoutError
    when that does not divide. ``head_dim``: elements per head (``CPU_VEC`` only)."""
    from .tp import kv_heads_of_rank
    out: list[TokenPage | None] = []
    for g, spec in enumerate(layout.groups):
        regs = [r for r in plan.regions if r.group in (-1, g) and not r.state
                and any(n in r.layers for n in spec.layer_names)]
        if spec.kind == GroupKind.MAMBA or not spec.transfer or not regs:
            out.append(None)
            continue
        sh = shardings[g]
        num_heads, replicated = (int(sh[0]), bool(sh[2])) if isinstance(sh, (tuple, list)) \
            else (int(sh.num_heads), bool(sh.replicated))
        bs = spec.block_size
        kbs = spec.kernel_block_size or bs
        kernel = regs[0].block_len // regs[0].ratio
        kv = 1 if len(regs) == 2 * len(spec.layer_names) else 2
        if spec.mla or replicated:
            if kernel % kbs:
                raise LayoutError(f"group {g}: kernel block of {kernel} B is not {kbs} rows")
            out.append(token_page("MLA", block_size=bs, head_bytes=kernel // kbs,
                                  kernel_block_size=kbs))
            continue
        h0, h1 = kv_heads_of_rank(num_heads, tp_size, tp_rank)
        n = h1 - h0
        if kernel % (kbs * n * kv):
            raise LayoutError(f"group {g}: kernel block of {kernel} B is not {kbs} rows x {n} "
                              f"heads x {kv} parts of whole bytes")
        out.append(token_page(page_layout, block_size=bs, heads=n, head_start=h0,
                              head_bytes=kernel // (kbs * n * kv), kv=kv, kernel_block_size=kbs,
                              head_dim=head_dim))
    return out


@dataclasses.dataclass(frozen=True)
class RegionPair:
    """One source region and the destination region it fills, for one group: ``chunks`` are
    ``(src offset, dst offset, row bytes)`` inside each side's kernel block (attention), or
    empty for a state pair, which copies ``state_bytes`` from the start of each state page
    (the unpadded state, or the whole page)."""

    group: int
    src: Region
    dst: Region
    src_page: TokenPage | None
    dst_page: TokenPage | None
    chunks: tuple[tuple[int, int, int], ...]
    state_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class RegrainRuns:
    """The runs of one request: row i of ``src`` moves into row i of ``dst`` (M x 3 uint64
    ``(addr, bytes, dev)``); ``pairs[i]`` is the region pair a run belongs to."""

    src: np.ndarray
    dst: np.ndarray
    pairs: np.ndarray

    @property
    def num_runs(self) -> int:
        return int(self.src.shape[0])

    @property
    def nbytes(self) -> int:
        return int(self.src[:, 1].sum()) if self.src.shape[0] else 0

    def as_runs(self, local: str = "dst") -> Runs:
        """The :class:`hmacore.runs.Runs` a transfer posts (``local="dst"``: a pull, D reads;
        ``"src"``: a push, P writes)."""
        if local not in ("dst", "src"):
            raise ValueError(f"local must be 'dst' or 'src', got {local!r}")
        loc, rem = (self.dst, self.src) if local == "dst" else (self.src, self.dst)
        return Runs(loc, rem, None, self.num_runs, self.nbytes)


def _region_span_ok(side: str, r: int, reg: Region) -> None:
    end = reg.base + (reg.logical_blocks - 1) * reg.stride + reg.block_len
    if reg.base < 0 or reg.stride < reg.block_len or end > 2**64:
        raise LayoutError(f"{side} region {r}: base {reg.base}, stride {reg.stride}, "
                          f"{reg.logical_blocks} blocks of {reg.block_len} B do not fit a "
                          "non-overlapping uint64 address range")


def _group_regions(layout: KVLayout, plan: TransferPlan, g: int) -> list[int]:
    """Indices of the regions holding group g's pages, in the order of g's layers (K before V
    for split regions), each once."""
    out: list[int] = []
    for name in layout.groups[g].layer_names:
        for r, reg in enumerate(plan.regions):
            if name in reg.layers and reg.group in (-1, g) and r not in out:
                out.append(r)
    return out


def _state_cuts(g: int, side: str, layout: KVLayout, plan: TransferPlan, regs: list[int],
                state: int) -> list[tuple[int, int]]:
    """Per region of a Mamba group (``regs``, in :func:`_group_regions` order), the
    ``(offset in the layer's page, bytes)`` of the state it holds: a layer's regions are its
    page's parts (one region for a whole page, or one per state tensor), each at its base's
    offset from the layer's first part; the state is the page's first ``state`` bytes, which
    the parts must cover back to back. LayoutError naming the region otherwise."""
    out: list[tuple[int, int]] = []
    for name in layout.groups[g].layer_names:
        mine = [r for r in regs if name in plan.regions[r].layers]
        if not mine:
            continue
        first = min(plan.regions[r].base for r in mine)
        covered = 0
        for r in sorted(mine, key=lambda r: plan.regions[r].base):
            reg = plan.regions[r]
            off = reg.base - first
            if off > covered and covered < state:
                raise LayoutError(f"group {g}: {side} region {r} (layer {name!r}) starts "
                                  f"{off} B into its page, its parts end at {covered} B: the "
                                  f"{state} B state must be the page's first bytes, back to back")
            covered = max(covered, off + reg.block_len)
        if covered < state:
            raise LayoutError(f"group {g}: a state of {state} B does not fit the {side} "
                              f"pages of layer {name!r} ({covered} B)")
    for r in regs:
        reg = plan.regions[r]
        name = next(n for n in layout.groups[g].layer_names if n in reg.layers)
        first = min(plan.regions[q].base for q in regs if name in plan.regions[q].layers)
        off = reg.base - first
        out.append((off, max(0, min(reg.block_len, state - off))))
    return out


class _StateRanges(tuple):
    """A Mamba group's ``(src offset, dst offset, bytes)`` state ranges read from one source
    rank of another TP size (:class:`hmacore.tp.StateSlice` ranges, offsets from each side's
    layer page start)."""


def _state_slice_pairs(g: int, layout: KVLayout, src_plan: TransferPlan, dst_plan: TransferPlan,
                       sregs: list[int], dregs: list[int], ranges: _StateRanges,
                       sb: int | None, db: int | None) -> list[RegionPair]:
    """One state :class:`RegionPair` per state range per layer of group g: the range's bytes
    of the source layer part holding it onto the destination part holding it (a layer
    registered as one region per page, or one per state tensor, alike on both sides). A range
    must lie inside one part on both sides and inside each side's unpadded state (``sb`` /
    ``db`` when given); LayoutError naming the layer and the range otherwise."""
    out: list[RegionPair] = []
    for name in layout.groups[g].layer_names:
        parts = []
        for side, plan, regs in (("source", src_plan, sregs), ("destination", dst_plan, dregs)):
            mine = sorted((r for r in regs if name in plan.regions[r].layers),
                          key=lambda r: plan.regions[r].base)
            for r in mine:
                _region_span_ok(side, r, plan.regions[r])
                if plan.regions[r].ratio != 1:
                    raise LayoutError(f"group {g}: {side} state region {r} has kernel ratio "
                                      f"{plan.regions[r].ratio}; state ranges need ratio 1")
            first = plan.regions[mine[0]].base if mine else 0
            parts.append([(r, plan.regions[r], plan.regions[r].base - first) for r in mine])
        sparts, dparts = parts
        if len(sparts) != len(dparts):
            raise LayoutError(f"group {g}: layer {name!r} is {len(sparts)} state region(s) on "
                              f"the source and {len(dparts)} on the destination; both sides "
                              "must register its state tensors alike")
        if not sparts:
            continue
        for src, dst, n in ranges:
            for side, end, lim in (("source", src + n, sb), ("destination", dst + n, db)):
                if lim is not None and end > lim:
                    raise LayoutError(f"group {g}: state range (source {src}, destination {dst}, "
                                      f"{n} B) ends at {end} B, past the {side}'s {lim} B state "
                                      "(state geometry and state bytes disagree)")
            k = next((k for k, (_, dr, doff) in enumerate(dparts)
                      if doff <= dst < doff + dr.block_len), None)
            if k is None:
                raise LayoutError(f"group {g}: state range (source {src}, destination {dst}, "
                                  f"{n} B) of layer {name!r} lies in no destination region of "
                                  "the layer")
            rs, sr, soff = sparts[k]
            rd, dr, doff = dparts[k]
            if dst + n > doff + dr.block_len or not soff <= src \
                    or src + n > soff + sr.block_len:
                raise LayoutError(f"group {g}: state range (source {src}, destination {dst}, "
                                  f"{n} B) of layer {name!r} straddles its part #{k} "
                                  f"(destination region {rd} [{doff}, {doff + dr.block_len}), "
                                  f"source region {rs} [{soff}, {soff + sr.block_len}))")
            out.append(RegionPair(g, dataclasses.replace(sr, base=sr.base + src - soff,
                                                         block_len=n),
                                  dataclasses.replace(dr, base=dr.base + dst - doff,
                                                      block_len=n), None, None, (), n))
    return out


class RegrainPlan:
    """Region pairs between a source (P) and a destination (D) whose block sizes may differ.

    Args:
        src_layout / dst_layout: each side's layout (same groups, kinds and layers; block
            sizes per group may differ by an integer ratio either way).
        src_plan / dst_plan: each side's :class:`TransferPlan` (the remote one e.g. from its
            handshake region table).
        src_pages / dst_pages: per group a :class:`TokenPage` (attention groups), None for
            Mamba groups and groups not moved.
        tp: ``(mapping, remote_rank)``: the destination is ``mapping``'s local rank reading
            from source rank ``remote_rank``; only the chunks of heads it reads from that rank
            pair (see :class:`hmacore.tp.TpMapping`). None: every destination chunk pairs.
            Mamba groups of another TP size pair their state ranges from that rank (the
            mapping's StateSlices; a state geometry is required).
        src_state_bytes / dst_state_bytes: per group, the unpadded bytes of one layer's state
            (Mamba groups; None entries and other groups ignored), on each side; a state pair
            then copies that many bytes from the start of each page. Both None (the default) or
            an entry None: the whole page, pages of equal bytes. With state ranges (another
            TP size) the sides' states differ; each bounds its side's ranges when given.

    Built once per peer pair; immutable. Raises LayoutError (nothing built) for every rule in
    the module docstring.
    """

    def __init__(self, src_layout: KVLayout, dst_layout: KVLayout, src_plan: TransferPlan,
                 dst_plan: TransferPlan, src_pages: Sequence[TokenPage | None],
                 dst_pages: Sequence[TokenPage | None], *, tp: tuple[Any, int] | None = None,
                 src_state_bytes: Sequence[int | None] | None = None,
                 dst_state_bytes: Sequence[int | None] | None = None):
        G = src_layout.num_groups
        if dst_layout.num_groups != G:
            raise LayoutError(f"source layout has {G} groups, destination "
                              f"{dst_layout.num_groups}")
        for name, pages in (("src_pages", src_pages), ("dst_pages", dst_pages)):
            if isinstance(pages, (str, bytes)) or not hasattr(pages, "__len__") or len(pages) != G:
                raise LayoutError(f"{name} must hold one TokenPage or None per group ({G})")
        sstate = self._state_sizes("src_state_bytes", src_state_bytes, G)
        dstate = self._state_sizes("dst_state_bytes", dst_state_bytes, G)
        allowed = self._tp_heads(tp, G)
        pairs: list[RegionPair] = []
        self.src_block_sizes = tuple(s.block_size for s in src_layout.groups)
        self.dst_block_sizes = tuple(s.block_size for s in dst_layout.groups)
        state = []
        for g, (sg, dg) in enumerate(zip(src_layout.groups, dst_layout.groups)):
            is_state = sg.kind == GroupKind.MAMBA
            state.append(is_state)
            if sg.kind != dg.kind or sg.layer_names != dg.layer_names:
                raise LayoutError(f"group {g}: source is {sg.kind.name} over "
                                  f"{list(sg.layer_names)}, destination {dg.kind.name} over "
                                  f"{list(dg.layer_names)}; both sides must have the same groups")
            if not (sg.transfer and dg.transfer) or allowed[g] is False:
                continue
            sp, dp = src_pages[g], dst_pages[g]
            if not is_state:
                block_size_ratio(sg.block_size, dg.block_size)
                for side, page, spec in (("src", sp, sg), ("dst", dp, dg)):
                    if not isinstance(page, TokenPage):
                        raise LayoutError(f"{side}_pages[{g}] must be a TokenPage for attention "
                                          f"group {g}, got {type(page).__name__}")
                    if page.block_size != spec.block_size:
                        raise LayoutError(f"{side}_pages[{g}].block_size {page.block_size} != the "
                                          f"layout's {spec.block_size}")
                ka, kb = sp.kernel_block_size, dp.kernel_block_size  # type: ignore[union-attr]
                if max(ka, kb) % min(ka, kb):
                    raise LayoutError(f"group {g}: kernel block sizes {ka} (source) and {kb} "
                                      "(destination) must divide one another")
            sregs = _group_regions(src_layout, src_plan, g)
            dregs = _group_regions(dst_layout, dst_plan, g)
            if len(sregs) != len(dregs):
                raise LayoutError(f"group {g}: {len(sregs)} source regions, {len(dregs)} "
                                  "destination regions; both sides must register the same layers")
            if isinstance(allowed[g], _StateRanges):
                # another TP size: the state byte ranges this rank reads from that source rank
                # (hmacore.state_tp), block ids from each side's own state-group table
                pairs += _state_slice_pairs(g, src_layout, src_plan, dst_plan, sregs, dregs,
                                            allowed[g], sstate[g], dstate[g])
                continue
            sb, db = sstate[g], dstate[g]
            if is_state and sb is not None and db is not None:
                if sb != db:
                    raise LayoutError(f"group {g}: a state of {sb} B on the source and {db} B "
                                      "on the destination; a state maps only onto a state of "
                                      "equal bytes (same model, same TP size)")
                scut = _state_cuts(g, "source", src_layout, src_plan, sregs, sb)
                dcut = _state_cuts(g, "destination", dst_layout, dst_plan, dregs, db)
            for k, (rs, rd) in enumerate(zip(sregs, dregs)):
                sr, dr = src_plan.regions[rs], dst_plan.regions[rd]
                _region_span_ok("source", rs, sr)
                _region_span_ok("destination", rd, dr)
                if is_state:
                    if sstate[g] is None or dstate[g] is None:
                        if sr.block_len != dr.block_len:
                            raise LayoutError(
                                f"group {g}: state blocks of {sr.block_len} B (source region "
                                f"{rs}) and {dr.block_len} B (destination region {rd}) differ; "
                                "state blocks map one to one (pages padded to different sizes "
                                "map by their unpadded state: give src_state_bytes and "
                                "dst_state_bytes)")
                        pairs.append(RegionPair(g, sr, dr, None, None, (), sr.block_len))
                        continue
                    if scut[k] != dcut[k] and (scut[k][1] or dcut[k][1]):
                        raise LayoutError(
                            f"group {g}: state part {k} holds state bytes {scut[k]} (offset, "
                            f"bytes) of its page on the source (region {rs}) and {dcut[k]} on "
                            f"the destination (region {rd}); both sides must register a "
                            "layer's state parts alike")
                    if scut[k][1]:
                        pairs.append(RegionPair(g, sr, dr, None, None, (), scut[k][1]))
                    continue
                assert sp is not None and dp is not None   # checked above for attention
                chunks = self._pair_chunks(g, rs, rd, sr, dr, sp, dp, allowed[g])
                if chunks:
                    pairs.append(RegionPair(g, sr, dr, sp, dp, chunks))
        self.pairs = tuple(pairs)
        self.num_groups = G
        self._group_layers = tuple(frozenset(s.layer_names) for s in src_layout.groups)
        self._state = tuple(state)
        self._src_nb = self._pool(G, "src")
        self._dst_nb = self._pool(G, "dst")
        self._compile()

    @staticmethod
    def _state_sizes(name: str, sizes: Any, G: int) -> list[int | None]:
        if sizes is None:
            return [None] * G
        if isinstance(sizes, (str, bytes)) or not hasattr(sizes, "__len__") or len(sizes) != G:
            raise LayoutError(f"{name} must hold one int or None per group ({G})")
        return [None if v is None else _int(f"{name}[{g}]", v, 1) for g, v in enumerate(sizes)]

    @staticmethod
    def _tp_heads(tp: Any, G: int) -> list[Any]:
        """Per group: None (every chunk), False (group not read from this rank), or the set
        of global heads read from it."""
        if tp is None:
            return [None] * G
        mapping, rank = tp
        if rank not in mapping.remote_ranks:
            raise LayoutError(f"remote_rank {rank} serves nothing to local rank "
                              f"{mapping.local_rank}; sources are {list(mapping.remote_ranks)}")
        out: list[Any] = []
        for g in range(G):
            ss = [s for s in mapping.slices[g] if s.remote_rank == rank]
            if ss and any(not hasattr(s, "start") for s in ss):
                # StateSlices (a state geometry between TP sizes): one per source rank
                out.append(_StateRanges(r for s in ss for r in s.ranges))
                continue
            if ss and mapping.layout.groups[g].kind == GroupKind.MAMBA \
                    and mapping.local_tp != mapping.remote_tp:
                raise LayoutError(f"group {g}: Mamba state between TP sizes {mapping.remote_tp} "
                                  f"(source) and {mapping.local_tp} (destination) without a "
                                  "state geometry (GroupSharding.state): its per-rank states "
                                  "differ and only whole pages of equal TP sizes map; give the "
                                  "group's GlobalStateGeometry or use equal TP sizes")
            if not ss:
                out.append(False)
            elif any(s.replicated for s in ss):
                out.append(None)
            else:
                out.append({h for s in ss for h in range(s.start, s.stop)})
        return out

    @staticmethod
    def _pair_chunks(g, rs, rd, sr: Region, dr: Region, sp: TokenPage, dp: TokenPage,
                     heads: Any) -> tuple[tuple[int, int, int], ...]:
        for side, r, reg, page in (("source", rs, sr, sp), ("destination", rd, dr, dp)):
            if reg.ratio != page.kernel_ratio:
                raise LayoutError(f"group {g}: {side} region {r} has kernel ratio {reg.ratio}, its "
                                  f"page {page.kernel_ratio} ({page.block_size}/"
                                  f"{page.kernel_block_size})")
            if page.block_bytes > reg.block_len or (page.kernel_ratio > 1
                                                    and page.block_bytes != reg.block_len):
                raise LayoutError(f"group {g}: {side} region {r} has {reg.block_len} B blocks, its "
                                  f"{page.layout} page needs {page.block_bytes} B")
        so, do = sp.offsets(), dp.offsets()
        out = []
        for key, (doff, drow) in do.items():
            # the global head is a key's second field (HND, LBHNC, CPU_VEC's K and V chunks)
            head = key[1] if isinstance(key, tuple) and len(key) >= 2 else None
            if heads is not None and isinstance(head, int) and head not in heads:
                continue
            if key not in so:
                raise LayoutError(f"group {g}: destination chunk {key!r} ({dp.layout}) has no "
                                  f"source chunk ({sp.layout} has {list(so)})")
            soff, srow = so[key]
            if srow != drow:
                raise LayoutError(f"group {g}: chunk {key!r} is {srow} B per token on the source "
                                  f"({sp.layout}) and {drow} B on the destination ({dp.layout}); "
                                  "rows must match (NHD/LBNHC pages hold every head inside a "
                                  "token row and cannot be head-sliced)")
            out.append((soff, doff, drow))
        return tuple(out)

    def pair_layers(self, layers: Sequence[str]) -> np.ndarray:
        """Per region pair, the index in ``layers`` of the layer whose pages it moves (a
        region shared by several groups holds one layer of each: the pair's group picks it).
        Layer-wise push splits a request's runs by it (:func:`hmacore.layerwise.runs_by_layer`).
        LayoutError when a pair's source region holds none or several layers of its group."""
        index = {name: k for k, name in enumerate(layers)}
        out = np.empty(len(self.pairs), dtype=np.int64)
        for i, p in enumerate(self.pairs):
            mine = [n for n in p.src.layers if n in self._group_layers[p.group]]
            if len(mine) != 1 or mine[0] not in index:
                raise LayoutError(f"region pair {i} (group {p.group}): its source region holds "
                                  f"layers {list(p.src.layers)}, not exactly one listed layer "
                                  f"of group {p.group}")
            out[i] = index[mine[0]]
        return out

    def _pool(self, G: int, side: str) -> tuple[int, ...]:
        nb = [2**31 - 1] * G
        for p in self.pairs:
            reg = p.src if side == "src" else p.dst
            nb[p.group] = min(nb[p.group], reg.logical_blocks)
        return tuple(nb)

    def _compile(self) -> None:
        ps = self.pairs
        i64 = np.int64
        self._k_group = np.array([p.group for p in ps], dtype=np.int32)
        self._k_state = np.array([p.src_page is None for p in ps], dtype=np.uint8)
        self._k_sbase = np.array([p.src.base for p in ps], dtype=np.uint64)
        self._k_sstride = np.array([p.src.stride for p in ps], dtype=i64)
        self._k_sdev = np.array([p.src.dev_id for p in ps], dtype=np.uint64)
        self._k_dbase = np.array([p.dst.base for p in ps], dtype=np.uint64)
        self._k_dstride = np.array([p.dst.stride for p in ps], dtype=i64)
        self._k_ddev = np.array([p.dst.dev_id for p in ps], dtype=np.uint64)
        self._k_skbs = np.array([p.src_page.kernel_block_size if p.src_page else 1 for p in ps],
                                dtype=i64)
        self._k_dkbs = np.array([p.dst_page.kernel_block_size if p.dst_page else 1 for p in ps],
                                dtype=i64)
        self._k_sklen = np.array([p.src.block_len // p.src.ratio for p in ps], dtype=i64)
        self._k_dklen = np.array([p.dst.block_len // p.dst.ratio for p in ps], dtype=i64)
        self._k_state_len = np.array([p.state_bytes for p in ps], dtype=i64)
        lo = np.zeros(len(ps) + 1, dtype=i64)
        np.cumsum([len(p.chunks) for p in ps], out=lo[1:])
        self._k_chunk_lo = lo
        flat = [c for p in ps for c in p.chunks]
        self._k_csrc = np.array([c[0] for c in flat], dtype=i64)
        self._k_cdst = np.array([c[1] for c in flat], dtype=i64)
        self._k_crow = np.array([c[2] for c in flat], dtype=i64)
        self._k_sbs = np.array(self.src_block_sizes, dtype=i64)
        self._k_dbs = np.array(self.dst_block_sizes, dtype=i64)
        self._served = np.zeros(self.num_groups, dtype=bool)
        self._served[self._k_group] = True

    def runs(self, src_ids: Sequence[Any], dst_ids: Sequence[Any], lo: Sequence[int],
             hi: Sequence[int], *, src_first: Sequence[int] | None = None,
             dst_first: Sequence[int] | None = None) -> RegrainRuns:
        """The byte runs moving tokens ``[lo[g], hi[g])`` of every attention group (and the
        paired state blocks of every Mamba group) from source to destination.

        ``src_ids[g]`` / ``dst_ids[g]``: each side's block ids of group g, entry i holding
        that side's block ``first[g] + i`` (tokens ``[(first+i)*bs, (first+i+1)*bs)``);
        ``first`` defaults to 0 (full positional tables, null padding included). Every block
        touching ``[lo, hi)`` must be present and real (1 .. pool size - 1); blocks outside
        are never read. Mamba groups: ``src_ids[g][i] -> dst_ids[g][i]`` (each pair the
        blocks holding the same state), equal lengths, the pair's state bytes each;
        ``lo``/``hi`` ignored. Groups the plan does not move are ignored.
        Raises BlockTableError (nothing computed)."""
        G = self.num_groups
        args: tuple[tuple[str, Any], ...] = (
            ("src_ids", src_ids), ("dst_ids", dst_ids), ("lo", lo), ("hi", hi),
            ("src_first", src_first), ("dst_first", dst_first))
        for name, v in args:
            if v is None and name.endswith("first"):
                continue
            if isinstance(v, (str, bytes)) or not hasattr(v, "__len__") or len(v) != G:
                raise BlockTableError(f"{name} must have one entry per group ({G})")
        sf = [0] * G if src_first is None else list(src_first)
        df = [0] * G if dst_first is None else list(dst_first)
        s_arrs, d_arrs = [], []
        lo_a = np.zeros(G, dtype=np.int64)
        hi_a = np.zeros(G, dtype=np.int64)
        empty = np.empty(0, dtype=BLOCK_ID_DTYPE)
        for g in range(G):
            if not self._served[g]:
                s_arrs.append(empty)
                d_arrs.append(empty)
                sf[g] = df[g] = 0
                continue
            s = _as_block_ids(g, src_ids[g])
            d = _as_block_ids(g, dst_ids[g])
            if self._state[g]:
                if s.shape[0] != d.shape[0]:
                    raise BlockTableError(f"group {g} (MAMBA): {s.shape[0]} source and "
                                          f"{d.shape[0]} destination state blocks; they map one "
                                          "to one")
                self._check_ids(g, "src_ids", s, self._src_nb[g])
                self._check_ids(g, "dst_ids", d, self._dst_nb[g])
                sf[g] = df[g] = 0
            else:
                a = self._tok("lo", g, lo[g])
                b = self._tok("hi", g, hi[g])
                if b < a:
                    raise BlockTableError(f"hi[{g}] ({b}) must be >= lo[{g}] ({a})")
                for name, ids, first, bs, nb in (
                        ("src", s, sf, self.src_block_sizes[g], self._src_nb[g]),
                        ("dst", d, df, self.dst_block_sizes[g], self._dst_nb[g])):
                    f = first[g] = self._tok(f"{name}_first", g, first[g])
                    if a == b:
                        continue
                    i0, i1 = a // bs - f, (b - 1) // bs - f
                    if i0 < 0 or i1 >= ids.shape[0]:
                        raise BlockTableError(
                            f"group {g}: tokens [{a}, {b}) need {name} blocks {a // bs}.."
                            f"{(b - 1) // bs}; {name}_ids[{g}] holds blocks {f}.."
                            f"{f + ids.shape[0] - 1}")
                    self._check_ids(g, f"{name}_ids", ids[i0:i1 + 1], nb, offset=i0)
                lo_a[g], hi_a[g] = a, b
            s_arrs.append(s)
            d_arrs.append(d)
        so = np.zeros(G + 1, dtype=np.int64)
        np.cumsum([x.shape[0] for x in s_arrs], out=so[1:])
        do = np.zeros(G + 1, dtype=np.int64)
        np.cumsum([x.shape[0] for x in d_arrs], out=do[1:])
        sflat = np.ascontiguousarray(np.concatenate(s_arrs), dtype=BLOCK_ID_DTYPE)
        dflat = np.ascontiguousarray(np.concatenate(d_arrs), dtype=BLOCK_ID_DTYPE)
        src, dst, pairs = _regrain.map_runs(
            self._k_group, self._k_state, self._k_sbase, self._k_sstride, self._k_sdev,
            self._k_skbs, self._k_sklen, self._k_dbase, self._k_dstride, self._k_ddev,
            self._k_dkbs, self._k_dklen, self._k_state_len, self._k_chunk_lo, self._k_csrc,
            self._k_cdst, self._k_crow, self._k_sbs, self._k_dbs,
            sflat, so, np.array(sf, dtype=np.int64), dflat, do, np.array(df, dtype=np.int64),
            lo_a, hi_a)
        return RegrainRuns(src, dst, pairs)

    @staticmethod
    def _tok(name: str, g: int, v: Any) -> int:
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) \
                or not 0 <= int(v) < _MAX_TOKENS:
            raise BlockTableError(f"{name}[{g}] must be an int in [0, 2**62), got {v!r}")
        return int(v)

    @staticmethod
    def _check_ids(g: int, name: str, ids: np.ndarray, pool: int, offset: int = 0) -> None:
        if ids.shape[0] == 0:
            return
        bad = np.flatnonzero((ids < 1) | (ids >= pool))
        if bad.size:
            i = int(bad[0])
            raise BlockTableError(f"{name}[{g}][{offset + i}] = {int(ids[i])}: a moved block must "
                                  f"be a real block id in [1, {pool}) (0 is the null block)")


def token_ranges(layout: KVLayout, num_tokens: int, trim_tokens: int = 0
                 ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(lo, hi)`` per group: the tokens of a ``num_tokens``-token prompt the destination
    needs, past its own ``trim_tokens``-token prefix hit. Full attention ``[trim, n)``; sliding
    window: the last ``window + extra_retained_tokens`` tokens; chunked-local: from the start
    of the chunk of token ``n - 1``; Mamba ``(0, 0)`` (state blocks map by state). Both in
    tokens, so each side clips in its own block grain. Why token ``n - 1``'s context and not
    only token ``n``'s: when a load covers the whole prompt, vLLM recomputes the last prompt
    token (``num_computed_tokens = num_tokens - 1``), which attends to
    ``[n - window - extra, n - 1)``, one token more than the next token's window (whole-block
    transfers get it from the clip's extra block; a token-range remap must name it)."""
    n = _int("num_tokens", num_tokens, 0, _MAX_TOKENS - 1)
    trim = _int("trim_tokens", trim_tokens, 0, n)
    los, his = [], []
    for spec in layout.groups:
        if spec.kind == GroupKind.MAMBA:
            los.append(0)
            his.append(0)
            continue
        lo = trim
        if spec.kind == GroupKind.SLIDING_WINDOW:
            lo = max(lo, n - (int(spec.sliding_window or 0) + spec.extra_retained_tokens))
        elif spec.kind == GroupKind.CHUNKED_LOCAL:
            c = int(spec.chunk_size or 1)
            lo = max(lo, (max(n - 1, 0) // c) * c)
        los.append(min(lo, n))
        his.append(n)
    return tuple(los), tuple(his)
