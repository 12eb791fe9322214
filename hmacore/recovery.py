"""Partial load-failure recovery: the restart point that is safe in every KV cache group,
and what to tell an engine so that its recovery lands there.

A load fills a request's blocks for tokens ``[start, end)`` (``start``: the tokens the
engine already had, its local prefix hit; ``end``: the tokens computed once the load is
done). When some of those blocks fail, the request can restart at a token position ``p``
only if every group has what the next token needs there:

* FULL attention: every block covering ``[0, p)``;
* SLIDING_WINDOW: the blocks covering the window before ``p``, ``[p - (w - 1 + extra), p)``;
* CHUNKED_LOCAL: the blocks covering ``[floor(p / chunk) * chunk, p)``;
* MAMBA: the state block at ``p`` (index ``cdiv(p, bs) - 1``).

and no failed block may cover a token before ``p`` in any group: the engine caches every
full block before the restart point under its hash, so a failed block there would be served
to later prefix hits even when the restart itself does not read it. ``start`` is safe by
contract (the engine's own hit rule checked it), so a safe point always exists. Candidates
are ``start``, ``end`` and the multiples of the layout's scheduler grain (the lcm of the
block sizes) in between.

vLLM 0.32 / 0.33 (``Scheduler._update_requests_with_invalid_blocks``) take a flat set of
block ids; for one request it truncates ``num_computed_tokens`` to ``i * block_size`` at the
first index ``i < cdiv(end, block_size)`` whose id is in the set, and it raises (stopping
the engine) when the model has more than one KV cache group. :func:`plan_vllm_report` turns
a safe point into that set for single-group layouts, and says when the engine cannot be told
(several groups, or no reportable block at a safe point): then the load must be reported per
request (``failed_recving``: vLLM restarts the request from 0 and re-reads its local prefix
cache). See docs/vllm.md, "Partial load failures".

Units: tokens for positions, blocks of group g for indices; block id 0 is the null block
(never loaded, never reported); id ``UNKNOWN`` marks a present block whose id the caller
does not know (a local prefix hit): present, but not reportable.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from .errors import ArgumentTypeError, ArgumentValueError
from .grain import cdiv
from .spec import GroupKind, GroupSpec, KVLayout

NULL_BLOCK = 0
UNKNOWN = -1     # a block that is present (local prefix hit) but whose id is not ours to report


def _int(name: str, value: object, minimum: int = 0) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ArgumentTypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ArgumentValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def needed_blocks(spec: GroupSpec, p: int) -> range:
    """Indices of the blocks of a group the next token at position ``p`` reads."""
    bs = spec.block_size
    if p <= 0:
        return range(0)
    hi = cdiv(p, bs)
    if spec.kind == GroupKind.SLIDING_WINDOW:
        reach = int(spec.sliding_window or 1) - 1 + spec.extra_retained_tokens
        return range(max(0, p - reach) // bs, hi)
    if spec.kind == GroupKind.CHUNKED_LOCAL:
        chunk = int(spec.chunk_size or 1)
        return range((p // chunk) * chunk // bs, hi)
    if spec.kind == GroupKind.MAMBA:
        return range(hi - 1, hi)
    return range(0, hi)


def _check(layout: KVLayout, tables: Sequence[Sequence[int]], failed: Iterable[tuple[int, int]],
           start: int, end: int) -> dict[int, set[int]]:
    if not isinstance(layout, KVLayout):
        raise ArgumentTypeError(f"layout must be a KVLayout, got {type(layout).__name__}")
    _int("start", start)
    _int("end", end)
    if start > end:
        raise ArgumentValueError(f"start must be <= end, got start={start} end={end}")
    if isinstance(tables, (str, bytes)) or len(tables) != layout.num_groups:
        raise ArgumentValueError(f"tables must hold one block-id list per group "
                                 f"({layout.num_groups}), got {len(tables)}")
    for g, table in enumerate(tables):
        for i, b in enumerate(table):
            _int(f"tables[{g}][{i}]", b, minimum=UNKNOWN)
    by_group: dict[int, set[int]] = {}
    for item in failed:
        if not isinstance(item, tuple) or len(item) != 2:
            raise ArgumentValueError(f"failed must hold (group, block index) pairs, got {item!r}")
        g = _int("failed group", item[0])
        i = _int("failed block index", item[1])
        if g >= layout.num_groups:
            raise ArgumentValueError(f"failed group must be < {layout.num_groups}, got {g}")
        if i >= len(tables[g]):
            raise ArgumentValueError(f"failed block index {i} of group {g} is past its table "
                                     f"({len(tables[g])} blocks)")
        by_group.setdefault(g, set()).add(i)
    return by_group


def _is_safe(layout: KVLayout, tables: Sequence[Sequence[int]], failed: dict[int, set[int]],
             p: int) -> bool:
    for g, spec in enumerate(layout.groups):
        bs = spec.block_size
        bad = failed.get(g, ())
        if any(i * bs < p for i in bad):           # cached under its hash: never below p
            return False
        table = tables[g]
        for i in needed_blocks(spec, p):
            if i >= len(table) or table[i] == NULL_BLOCK:
                return False
    return True


def candidate_points(layout: KVLayout, start: int, end: int) -> list[int]:
    """``end``, the scheduler-grain multiples in ``(start, end)`` and ``start``, descending."""
    grain = layout.scheduler_block_size
    points = {start, end}
    points.update(range((start // grain + 1) * grain, end, grain))
    return sorted(points, reverse=True)


def safe_restart_point(layout: KVLayout, tables: Sequence[Sequence[int]],
                       failed: Iterable[tuple[int, int]], *, start: int, end: int) -> int:
    """The longest token prefix in ``[start, end]`` that is intact in every group (see the
    module docstring). ``tables[g]``: the request's block ids of group g by position (0 =
    null, ``UNKNOWN`` = present but not ours); ``failed``: ``(group, block index)`` of the
    blocks the load did not fill. Returns ``end`` when nothing failed."""
    bad = _check(layout, tables, failed, start, end)
    if not bad:
        return end
    for p in candidate_points(layout, start, end):
        if p == start or _is_safe(layout, tables, bad, p):
            return p
    return start  # unreachable: start is a candidate


@dataclasses.dataclass(frozen=True)
class VllmReport:
    """What to tell vLLM about a partially failed load of one request.

    ``safe_tokens``: the safe restart point. ``block_ids``: the ids for
    ``get_block_ids_with_load_errors``; vLLM then restarts the request at ``lands_at``.
    ``per_request``: vLLM cannot be told by block ids (several groups, or no reportable block
    at a safe point): report the request in ``failed_recving`` (async loads; vLLM restarts
    it from 0) and leave ``block_ids`` empty. ``tokens_lost``: ``end - lands_at`` (or ``end``
    per request)."""

    safe_tokens: int
    block_ids: frozenset[int]
    lands_at: int
    per_request: bool
    tokens_lost: int


def vllm_landing(block_size: int, table: Sequence[int], reported: Iterable[int], end: int) -> int:
    """Where vLLM 0.32/0.33 truncate a single-group request whose ``end`` computed tokens
    were loaded and ``reported`` was returned by ``get_block_ids_with_load_errors``
    (``Scheduler._update_requests_with_invalid_blocks``): ``i * block_size`` at the first
    index ``i < cdiv(end, block_size)`` whose id is reported, else ``end``."""
    ids = set(reported)
    for i in range(min(len(table), cdiv(end, block_size))):
        if table[i] in ids:
            return i * block_size
    return end


def plan_vllm_report(layout: KVLayout, tables: Sequence[Sequence[int]],
                     failed: Iterable[tuple[int, int]], *, start: int, end: int) -> VllmReport:
    """The block ids that make vLLM's group-unaware truncation land on the safe restart point
    (or the closest safe point below it whose block is ours to report: a block the load wrote,
    so that no other request sharing a cached block is truncated with it).

    The set holds the landing block plus every failed non-null block at or after it (vLLM's
    ``fail`` policy evicts exactly those); ids below the landing index are never reported."""
    failed = list(failed)
    safe = safe_restart_point(layout, tables, failed, start=start, end=end)
    bad = _check(layout, tables, failed, start, end)
    if not bad:
        return VllmReport(end, frozenset(), end, False, 0)
    if layout.num_groups != 1:
        return VllmReport(safe, frozenset(), 0, True, end)
    spec, table = layout.groups[0], tables[0]
    bs = spec.block_size
    for q in candidate_points(layout, start, safe):
        if q > safe or q % bs or q >= end:
            continue
        i = q // bs
        if i >= len(table) or table[i] in (NULL_BLOCK, UNKNOWN):
            continue
        if q != start and not _is_safe(layout, tables, bad, q):
            continue
        ids = {table[i]}
        ids.update(table[j] for j in bad.get(0, ()) if j >= i and table[j] > NULL_BLOCK)
        return VllmReport(safe, frozenset(ids), q, False, end - q)
    return VllmReport(safe, frozenset(), 0, True, end)
