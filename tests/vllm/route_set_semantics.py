"""A pytest plugin that swaps the routing index's counted event kernel for set semantics (a
remove drops the key even if vLLM still holds it in another block), to show that the counts
are needed. Not a test: docs/routing.md runs

    PYTHONPATH=tests/vllm python -m pytest -p route_set_semantics tests/vllm/test_route_schedulers.py

and expects mismatches (failures)."""
import hmacore._fast._route as _route

_counted = _route.apply_rows


def _set_semantics(residency, bit, ops, groups, digests):
    """Row by row; a remove is repeated until the key is gone (its count forced to 0)."""
    stored = removed = ignored = 0
    for i in range(len(ops)):
        row = (ops[i:i + 1], groups[i:i + 1], digests[i:i + 1])
        if ops[i] >= 0:
            stored += _counted(residency, bit, *row)[0]
            continue
        s, r, ig, _ = _counted(residency, bit, *row)
        removed += r
        ignored += ig
        while r:
            _, r, _, _ = _counted(residency, bit, *row)
    return stored, removed, ignored, len(ops)


_route.apply_rows = _set_semantics
