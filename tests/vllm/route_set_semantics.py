"""A pytest plugin that swaps the routing index's counted event kernel for set semantics (a
remove drops the key even if vLLM still holds it in another block), to show that the counts
are needed. Not a test: docs/routing.md runs

    PYTHONPATH=tests/vllm python -m pytest -p route_set_semantics tests/vllm/test_route_schedulers.py

and expects mismatches (failures)."""
import hmacore._fast._route as _route


def _set_semantics(layers, ops, groups, digests):
    base = layers[0]
    stored = removed = ignored = 0
    for op, g, d in zip(ops, groups, digests):
        if op == 0:
            base.clear()
        elif op > 0:
            base.add(int(g), d.tobytes())
            stored += 1
        elif base.discard(int(g), d.tobytes()):
            removed += 1
        else:
            ignored += 1
    return stored, removed, ignored, len(ops)


_route.apply_rows = _set_semantics
