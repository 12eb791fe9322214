"""Plain-Python oracle for hmacore.recovery: token-level rules and a literal model of vLLM
0.32's single-group truncation (Scheduler._update_requests_with_invalid_blocks)."""
from __future__ import annotations

from hmacore.spec import GroupKind

NULL, UNKNOWN = 0, -1


def tokens_needed(spec, p: int) -> range:
    """Token positions whose KV (or, for Mamba, whose state) the token at ``p`` reads."""
    if p == 0:
        return range(0)
    if spec.kind == GroupKind.SLIDING_WINDOW:
        return range(max(0, p - (spec.sliding_window - 1 + spec.extra_retained_tokens)), p)
    if spec.kind == GroupKind.CHUNKED_LOCAL:
        return range(p - p % spec.chunk_size, p)
    if spec.kind == GroupKind.MAMBA:
        return range(p - 1, p)          # the state after token p-1 lives in that token's block
    return range(0, p)


def point_is_safe(layout, tables, failed, p: int) -> bool:
    for g, spec in enumerate(layout.groups):
        bs, table = spec.block_size, tables[g]
        for t in range(p):                      # a failed block holding a token below p
            if (g, t // bs) in failed:
                return False
        for t in tokens_needed(spec, p):
            b = t // bs
            if b >= len(table) or table[b] == NULL:
                return False
    return True


def safe_point(layout, tables, failed, start: int, end: int) -> int:
    failed = set(failed)
    if not failed:
        return end
    grain = layout.scheduler_block_size
    for p in range(end, start - 1, -1):
        if p in (start, end) or p % grain == 0:
            if p == start or point_is_safe(layout, tables, failed, p):
                return p
    raise AssertionError("start is always safe")


def vllm_truncation(block_size: int, table, reported, num_computed: int) -> int:
    """vLLM 0.32, one request, one group: the num_computed_tokens it restarts at."""
    n_blocks = (num_computed + block_size - 1) // block_size
    for idx, block_id in zip(range(n_blocks), table):
        if block_id in reported:
            return idx * block_size
    return num_computed
