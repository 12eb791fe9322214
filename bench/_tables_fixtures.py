"""Block tables the benchmarks build as inputs (outside the timed calls)."""
from hmacore.grain import cdiv
from hmacore.spec import GroupKind


def window_tables(layout, tokens: int, num_reqs: int, first_id: int = 1) -> list[list[list[int]]]:
    """Per request, per group, the block ids vLLM holds after ``tokens`` tokens (Python lists):
    ``cdiv(tokens, block_size)`` positions, of which a sliding-window group keeps only its
    last ``window_blocks()`` (the rest are 0, the null block). Ids are consecutive from
    ``first_id`` across groups and requests, so no two requests share a block."""
    out, nid = [], first_id
    for _ in range(num_reqs):
        t = []
        for spec in layout.groups:
            n = cdiv(tokens, spec.block_size)
            keep = min(n, spec.window_blocks()) if spec.kind == GroupKind.SLIDING_WINDOW else n
            t.append([0] * (n - keep) + list(range(nid, nid + keep)))
            nid += keep
        out.append(t)
    return out
