"""Per-group window clipping, prefix trimming and kernel/peer block-size expansion.

Units: inputs and outputs are block tables (one int32 array per group, blocks of that
group; id 0 = null). Window sizes are blocks of the group they belong to. Outputs may be
views of the input arrays (clipping and trimming only slice); treat them as read-only.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ._fast import _windows as _k
from .errors import BlockTableError
from .spec import GroupKind, KVLayout
from .tables import BLOCK_ID_DTYPE, TrackerSet, _as_group, _split_groups, as_block_table

__all__ = [
    "clip_to_window", "clip_windows", "clip_tracked_spans", "clip_state_blocks", "window_plan",
    "clip_tracked", "trim_remote_to_local", "expand_to_kernel",
    "expand_layout_to_kernel", "expand_group", "map_block_size",
]

_INT32_MAX = 2**31 - 1


def _is_full_hit(block_ids: Any, num_groups: int) -> bool:
    """The empty tuple/list is vLLM's 'full prefix hit, nothing to move' signal (any G; a
    single empty group is ``([],)``)."""
    return isinstance(block_ids, (tuple, list)) and len(block_ids) == 0


def _check_layout(layout: Any) -> KVLayout:
    if not isinstance(layout, KVLayout):
        raise TypeError(f"layout must be a KVLayout, got {type(layout).__name__}")
    return layout


MAX_RATIO = 1 << 16   # kernel / block-size ratios seen in practice are <= a few hundred (261)


def _ratio(name: str, v: Any) -> int:
    """A kernel or block-size ratio: 1 .. MAX_RATIO (a larger one is a bug and would allocate
    ``len(ids) * ratio`` entries)."""
    v = _pos_int(name, v)
    if v > MAX_RATIO:
        raise BlockTableError(f"{name} must be <= {MAX_RATIO}, got {v}")
    return v


def _pos_int(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 1 <= v <= _INT32_MAX:
        raise BlockTableError(f"{name} must be an int >= 1 and <= 2**31-1, got {v!r}")
    return int(v)


def _per_group_ints(name: str, v: Any, num_groups: int, *, minimum: int = 1) -> tuple[int, ...]:
    if isinstance(v, (int, np.integer)) and not isinstance(v, bool):
        v = (v,) * num_groups
    if not isinstance(v, (list, tuple)) or len(v) != num_groups:
        raise BlockTableError(f"{name} must be an int or one int per group ({num_groups}), "
                              f"got {v!r}")
    out = []
    for g, x in enumerate(v):
        if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < minimum:
            raise BlockTableError(f"{name}[{g}] must be an int >= {minimum}, got {x!r}")
        out.append(int(x))
    return tuple(out)


def _split(block_ids: Any, num_groups: int, name: str) -> Sequence[Any]:
    """The raw per-group sequences, with group count and group types checked (ids are
    checked later, on the part that is kept)."""
    groups = _split_groups(block_ids, num_groups, name)
    for g, x in enumerate(groups):
        if not isinstance(x, (list, tuple, np.ndarray)) or \
                (isinstance(x, np.ndarray) and x.ndim != 1):
            _as_group(x, g, 0, name)  # raises the general message
    return groups


def _take(x: Any, start: int, end: int, g: int, hi: int, name: str) -> np.ndarray:
    """x[start:end] as validated contiguous int32 (a view when x already is int32)."""
    return _as_group(x[start:end], g, hi, name, start)


def _state_slot(n: int, num_speculative_blocks: int) -> tuple[int, int]:
    if n == 0:
        return 0, 0
    end = n - min(num_speculative_blocks, n - 1)
    return end - 1, end


def clip_state_blocks(blocks: Any, num_speculative_blocks: int) -> np.ndarray:
    """Keep a Mamba group's running-state slot (blocks of that group).

    Drops ``min(num_speculative_blocks, len - 1)`` trailing speculative scratch slots, then
    keeps the last remaining entry. Empty stays empty; one block stays as is. Only the kept
    entry is validated.
    """
    if isinstance(num_speculative_blocks, bool) or \
            not isinstance(num_speculative_blocks, (int, np.integer)) or num_speculative_blocks < 0:
        raise BlockTableError(f"num_speculative_blocks must be an int >= 0, got "
                              f"{num_speculative_blocks!r}")
    x = _split(blocks, 1, "blocks")[0]
    start, end = _state_slot(len(x), int(num_speculative_blocks))
    return _take(x, start, end, 0, 0, "blocks")


def clip_to_window(block_ids: Any, layout: KVLayout, *, exact: bool = False,
                   clip_state: bool = True) -> tuple[np.ndarray, ...]:
    """Cut each group to the blocks a transfer must move.

    SLIDING_WINDOW groups keep their last ``spec.window_blocks(exact)`` entries (the whole
    list when shorter; leading nulls kept, as vLLM's P side sends them). MAMBA groups, with
    ``clip_state``, keep the running-state slot (:func:`clip_state_blocks`). FULL and
    CHUNKED_LOCAL groups are untouched. ``()`` (full prefix hit) is returned unchanged.

    The group count, group types and every returned id are validated (BlockTableError, see
    :func:`~hmacore.tables.as_block_table`); clipped-away entries are not inspected, so the
    cost is O(kept blocks) for list input. Outputs are views when the input already is
    contiguous int32.
    """
    layout = _check_layout(layout)
    if _is_full_hit(block_ids, layout.num_groups):
        return ()
    fast = _k.clip_groups(block_ids, _plan(layout, exact, clip_state), layout.num_blocks or 0)
    if fast is not None:
        return fast
    # General path: any input form, and the error messages.
    groups = _split(block_ids, layout.num_groups, "block_ids")
    hi = layout.num_blocks or 0
    out = []
    for g, (spec, x) in enumerate(zip(layout.groups, groups)):
        n = len(x)
        if spec.kind == GroupKind.SLIDING_WINDOW:
            start, end = max(0, n - spec.window_blocks(exact)), n  # keep >= 2: never x[-0:]
        elif spec.kind == GroupKind.MAMBA and clip_state:
            start, end = _state_slot(n, spec.num_speculative_blocks)
        else:
            start, end = 0, n
        out.append(_take(x, start, end, g, hi, "block_ids"))
    return tuple(out)


def clip_windows(block_ids: Any, layout: KVLayout, *, exact: bool = False,
                 clip_state: bool = True) -> tuple[Any, ...]:
    """:func:`clip_to_window` with vLLM's clipper contract: only what is cut is touched.

    Groups the clip leaves whole (FULL, CHUNKED_LOCAL, and MAMBA without ``clip_state``) are
    returned as the very objects passed in, not copied and not inspected (O(1) per group;
    their ids are validated where they are consumed: ``TrackerSet``, ``plan.desc_ids``,
    ``from_wire``). Clipped groups keep their form: a list/tuple gives a list slice, a
    contiguous int32 array a view; every kept id is validated (BlockTableError naming the
    group and index). Cost: O(kept blocks of the clipped groups). Other input forms (NumPy
    arrays of other dtypes, generators, ...) are converted like :func:`clip_to_window`.
    ``()`` (full prefix hit) is returned unchanged.
    """
    return _k.clip_windows(block_ids, layout, exact, clip_state)


# LayoutClip / layout_clip: missing from _fast/_windows.pyi (owned with the kernels)
def _compile(layout: Any) -> _k.LayoutClip:  # type: ignore[name-defined]
    """The layout's compiled clip plans, built once and stored on the layout object (a
    frozen KVLayout: valid for its lifetime; see ``_windows.LayoutClip``)."""
    layout = _check_layout(layout)
    plans = []
    for exact in (False, True):
        for clip_state in (False, True):
            plan = window_plan(layout, exact=exact, clip_state=clip_state)
            plan.flags.writeable = False
            plans.append(plan)
    state = np.array([s.kind == GroupKind.MAMBA for s in layout.groups], dtype=np.int8)
    state.flags.writeable = False
    lc = _k.LayoutClip(plans, state, layout.num_blocks or 0)  # type: ignore[attr-defined]
    object.__setattr__(layout, "_hmacore_windows", lc)   # the cache lives on the layout
    return lc


def _clip_general(block_ids: Any, layout: KVLayout, exact: bool, clip_state: bool) -> tuple:
    # Off the fast path: clip_to_window converts the form or raises the precise error.
    return clip_to_window(block_ids, layout, exact=exact, clip_state=clip_state)


def window_plan(layout: KVLayout, *, exact: bool = False, clip_state: bool = True) -> np.ndarray:
    """The per-group clip of :func:`clip_to_window` as an int64 array (one entry per group):
    ``k > 0`` keep the last k blocks (SLIDING_WINDOW), ``0`` keep all, ``-1 - s`` keep the
    running-state slot of a MAMBA group with s speculative scratch slots."""
    layout = _check_layout(layout)
    plan = np.zeros(layout.num_groups, dtype=np.int64)
    for g, spec in enumerate(layout.groups):
        # GroupSpec takes any int window / slot count; past _PLAN_CAP the clip is the same
        # (no table is that long), and the int64 entry must not overflow
        if spec.kind == GroupKind.SLIDING_WINDOW:
            plan[g] = min(spec.window_blocks(exact), _PLAN_CAP)
        elif spec.kind == GroupKind.MAMBA and clip_state:
            plan[g] = -1 - min(spec.num_speculative_blocks, _PLAN_CAP)
    return plan


_PLAN_CAP = 2**62   # window_plan entries: keep-last / speculative-slot counts this large clip alike


def _state_groups(layout: KVLayout) -> np.ndarray:
    """int8 per group: 1 for MAMBA (state slots), compiled once per layout object."""
    return _k.layout_clip(layout).state_groups  # type: ignore[attr-defined]


def _plan(layout: KVLayout, exact: bool, clip_state: bool) -> np.ndarray:
    """window_plan (read-only), compiled once per layout object (cached on the layout)."""
    return _k.layout_clip(layout).plans[2 * bool(exact) + bool(clip_state)]  # type: ignore[attr-defined]


def clip_tracked(trackers: TrackerSet, req_ids: Sequence[Any], *, exact: bool = False,
                 clip_state: bool = True) -> list[tuple[np.ndarray, ...]]:
    """:func:`clip_to_window` of many tracked requests' tables, straight from the tracker's
    buffers (ids were validated when tracked; no copy, no re-validation).

    Returns read-only views, one tuple per request in ``req_ids`` order; like
    ``TrackerSet.block_ids(copy=False)`` they are snapshots: they keep showing the clipped
    table of this call whatever later updates do (see TrackerSet, "Views"). Raises
    TrackerStateError for an unknown request (before returning anything).
    """
    if not isinstance(trackers, TrackerSet):
        raise TypeError(f"trackers must be a TrackerSet, got {type(trackers).__name__}")
    return trackers._clip_views(req_ids, _plan(trackers.layout, exact, clip_state))


def clip_tracked_spans(trackers: TrackerSet, req_ids: Sequence[Any], *, exact: bool = False,
                       clip_state: bool = True) -> np.ndarray:
    """:func:`clip_tracked` as positions: an int64 array ``(len(req_ids), num_groups, 2)``
    whose ``[r, g]`` row is the ``[start, end)`` range (blocks of group g) of request
    ``req_ids[r]``'s clipped table inside ``trackers.block_ids(req_ids[r], copy=False)[g]``.

    One call for a whole step, no Python object per request. Raises TrackerStateError for an
    unknown request. Positions are valid until the next update of that request.
    """
    if not isinstance(trackers, TrackerSet):
        raise TypeError(f"trackers must be a TrackerSet, got {type(trackers).__name__}")
    return trackers._clip_spans(req_ids, _plan(trackers.layout, exact, clip_state))


def trim_remote_to_local(local: Any, remote: Any, layout: KVLayout, *,
                         local_kernel_ratios: Sequence[int] | int | None = None,
                         remote_kernel_ratios: Sequence[int] | int | None = None
                         ) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]]:
    """Pair D's blocks to fill (``local``) with P's blocks (``remote``), group by group.

    D only pulls the uncached suffix. Attention groups with equal kernel ratios: end-align
    (``remote[len(remote) - len(local):]``), which drops P's leading null padding
    (``[0, p4, p5]`` vs ``[d4, d5]`` -> ``[p4, p5]``); every paired remote block must be real
    (not 0); an empty local group gives an empty remote group (never the whole list). Unequal ratios
    (lists are
    kernel-granular): front-trim both to the shorter length, allowing a length difference of
    at most ``local_ratio + remote_ratio`` padding blocks. MAMBA groups pair state slots by
    position from the front, allowing ``|len(local) - len(remote)| <= 1``.

    Afterwards ``len(local[g]) == len(remote[g])`` for every g. ``local == ()`` (full local
    hit) returns ``((), ())``.

    Raises:
        BlockTableError: a group cannot be paired (remote has fewer real blocks than local
            needs, or a length difference beyond the allowed padding). Remote ids are
            validated on the part that is kept.
    """
    layout = _check_layout(layout)
    G = layout.num_groups
    if _is_full_hit(local, G):
        return (), ()
    if local_kernel_ratios is None and remote_kernel_ratios is None:
        fast = _k.trim_groups(local, remote, _state_groups(layout), layout.num_blocks or 0)
        if fast is not None:
            return fast
    # General path: any input form, kernel ratios, and the error messages.
    lt = as_block_table(local, G, num_blocks=layout.num_blocks, name="local")
    rt = _split(remote, G, "remote")  # ids checked on the kept part; pool size is the peer's
    lr = _per_group_ints("local_kernel_ratios", 1 if local_kernel_ratios is None
                         else local_kernel_ratios, G)
    rr = _per_group_ints("remote_kernel_ratios", 1 if remote_kernel_ratios is None
                         else remote_kernel_ratios, G)
    out_l, out_r = [], []
    for g, (spec, l, r) in enumerate(zip(layout.groups, lt, rt)):
        nl, nr = l.shape[0], len(r)
        if spec.kind == GroupKind.MAMBA:
            if abs(nl - nr) > 1:
                raise BlockTableError(f"group {g} (MAMBA): local has {nl} state slots, remote "
                                      f"{nr}; they may differ by at most 1")
            n = min(nl, nr)
            out_l.append(l[:n])
            out_r.append(_take(r, 0, n, g, 0, "remote"))
        elif lr[g] == rr[g]:
            if nl > nr:
                raise BlockTableError(f"group {g}: local needs {nl} blocks but remote has only {nr}")
            tail = _take(r, nr - nl, nr, g, 0, "remote")
            j = _k.first_null(tail)
            if j >= 0:
                raise BlockTableError(
                    f"group {g}: the remote block paired with local index {j} is the null block "
                    f"0; remote has fewer real blocks than the {nl} local needs")
            out_l.append(l)
            out_r.append(tail)
        else:
            if abs(nl - nr) > lr[g] + rr[g]:
                raise BlockTableError(f"group {g}: local has {nl} kernel blocks, remote {nr}; "
                                      f"more than the {lr[g] + rr[g]} blocks of padding the "
                                      "kernel ratios allow")
            n = min(nl, nr)
            out_l.append(l[:n])
            out_r.append(_take(r, 0, n, g, 0, "remote"))
    return tuple(out_l), tuple(out_r)


def _check_out(out: Any, need: int) -> np.ndarray:
    if not isinstance(out, np.ndarray):
        raise BlockTableError(f"out must be a NumPy array, got {type(out).__name__}")
    if out.dtype != BLOCK_ID_DTYPE or out.ndim != 1:
        raise BlockTableError(f"out must be a 1-D int32 array, got {out.ndim}-D {out.dtype}")
    if not out.flags.c_contiguous:
        raise BlockTableError("out must be C-contiguous")
    if not out.flags.writeable:
        raise BlockTableError("out must be writeable")
    if out.shape[0] < need:
        raise BlockTableError(f"out has {out.shape[0]} slots, needs {need}")
    return out


def expand_group(ids: Any, ratio: int, *, stride: int | None = None, limit: int | None = None,
                 out: np.ndarray | None = None) -> np.ndarray:
    """One group: ``[b*stride + k for b in ids for k in range(ratio)]`` (kernel blocks).

    ``stride`` defaults to ``ratio``. ``limit`` keeps only the first ``limit`` entries (peer
    block-size mapping clips to the remote length). ``out``: optional contiguous writeable
    int32 buffer with room for the result; the returned array is a view of it.

    Raises:
        BlockTableError: bad ids/ratio/out, or a result id past int32.
    """
    a = as_block_table(ids, 1, name="ids")[0]
    ratio = _ratio("ratio", ratio)
    stride = ratio if stride is None else _pos_int("stride", stride)
    if ratio > stride:
        raise BlockTableError(f"ratio ({ratio}) must be <= stride ({stride}): kernel blocks "
                              "of neighbouring logical blocks would overlap")
    total = a.shape[0] * ratio
    if limit is not None:
        if isinstance(limit, bool) or not isinstance(limit, (int, np.integer)) or limit < 0:
            raise BlockTableError(f"limit must be an int >= 0, got {limit!r}")
        total = min(total, int(limit))
    top = _k.max_id(a)
    if top >= 0 and top * stride + ratio - 1 > _INT32_MAX:
        raise BlockTableError(f"ids: block {top} x stride {stride} + {ratio - 1} overflows int32 "
                              "kernel block ids")
    buf = np.empty(total, dtype=BLOCK_ID_DTYPE) if out is None else _check_out(out, total)[:total]
    n = _k.expand_into(a, ratio, stride, buf)
    return buf[:n]


def expand_to_kernel(block_ids: Any, ratios: Sequence[int] | int, *,
                     strides: Sequence[int] | int | None = None) -> tuple[np.ndarray, ...]:
    """Logical -> kernel block ids per group: ``b*stride_g + k for k in range(ratio_g)``.

    ``ratios``: one int for every group or one per group; ratio 1 (use it for MAMBA groups)
    is the identity. ``strides`` default to the ratios (Mamba hybrids address remote kernel
    blocks with the remote stride, e.g. 261, while moving ``ratio`` of them).
    Raises BlockTableError on int32 overflow.
    """
    if isinstance(block_ids, (list, tuple)) and len(block_ids) == 0:
        return ()
    if isinstance(block_ids, (list, tuple)) and isinstance(block_ids[0], (list, tuple, np.ndarray)):
        n = len(block_ids)
    elif isinstance(ratios, (list, tuple)):
        n = len(ratios)
    else:
        n = 1
    table = as_block_table(block_ids, n)
    rs = _per_group_ints("ratios", ratios, n)
    ss = rs if strides is None else _per_group_ints("strides", strides, n)
    return tuple(ids if r == 1 and s == 1 else expand_group(ids, r, stride=s)
                 for ids, r, s in zip(table, rs, ss))


def expand_layout_to_kernel(block_ids: Any, layout: KVLayout) -> tuple[np.ndarray, ...]:
    """:func:`expand_to_kernel` with ``spec.kernel_ratio`` per group (MAMBA: 1, untouched)."""
    layout = _check_layout(layout)
    if _is_full_hit(block_ids, layout.num_groups):
        return ()
    table = as_block_table(block_ids, layout.num_groups, num_blocks=layout.num_blocks)
    return tuple(ids if s.kernel_ratio == 1 else expand_group(ids, s.kernel_ratio)
                 for s, ids in zip(layout.groups, table))


def map_block_size(block_ids: Any, ratio: int, remote_lengths: Sequence[int],
                   layout: KVLayout) -> tuple[np.ndarray, ...]:
    """Map local blocks to a peer with ``ratio`` times smaller blocks (vllm-hma.md §4.6 3).

    Attention groups: each local block b becomes remote-size blocks ``b*ratio + k`` (k <
    ratio), clipped to ``remote_lengths[g]`` (blocks of the remote group; the uncovered
    sub-blocks are the caller's to zero). MAMBA groups are unchanged. All groups empty after
    mapping -> ``()`` (full hit).
    """
    layout = _check_layout(layout)
    G = layout.num_groups
    ratio = _ratio("ratio", ratio)
    lengths = _per_group_ints("remote_lengths", remote_lengths, G, minimum=0) \
        if not isinstance(remote_lengths, (int, np.integer)) else \
        _per_group_ints("remote_lengths", [remote_lengths] * G, G, minimum=0)
    if _is_full_hit(block_ids, G):
        return ()
    table = as_block_table(block_ids, G, num_blocks=layout.num_blocks)
    out = tuple(ids if spec.kind == GroupKind.MAMBA else
                expand_group(ids, ratio, limit=lengths[g])
                for g, (spec, ids) in enumerate(zip(layout.groups, table)))
    if all(x.shape[0] == 0 for x in out):
        return ()
    return out


_k.register_clip_helpers(_compile, _clip_general)
