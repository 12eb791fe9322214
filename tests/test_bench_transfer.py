"""bench/bench_transfer.py's block tables (vLLM's own BlockPool) and report: what the
recorded figures in docs/performance.md rest on."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "bench"))
import bench_transfer as B  # noqa: E402

pytestmark = pytest.mark.vllm


def test_tables_are_real_allocations_of_n_distinct_blocks():
    nb, n = 257, 64
    fresh_d, fresh_p = B.tables("fresh", nb, n)
    assert fresh_d == list(range(1, n + 1)) == fresh_p       # a fresh pool: consecutive ids
    for kind in ("vllm", "scattered"):
        d, p = B.tables(kind, nb, n)
        for t in (d, p):
            assert len(t) == n == len(set(t)) and all(0 < b < nb for b in t)
        assert d != p                                       # each side its own history
    # the history fragments the pool: far from one ascending run, and reproducible
    t = B.vllm_table(nb, n, seed=11)
    assert t == B.vllm_table(nb, n, seed=11)
    assert sum(b - a != 1 for a, b in zip(t, t[1:])) > 4


def test_markdown_has_one_row_per_case():
    rows = []
    for mech in B.MECHANISMS:
        rows.append({"arrangement": "layer", "page": 4096, "table": "fresh", "mechanism": mech,
                     "posted_as": "dynamic" if mech in ("auto", "dynamic") else "blocks",
                     "bytes": 1 << 20, "descriptors": 8, "block_descriptors": 256, "runs": 8,
                     "post_ms": 0.1, "transfer_ms": 1.0, "gbps": 1.0, "transfer_gbps": 1.0,
                     "memcpy_gbps": 2.0, "search_ms": 0.01, "rounds": 1,
                     "transfer_cpu_ms": 0.5, "transfer_runq_ms": 0.25, "memcpy_cpu_ms": 0.5,
                     "memcpy_ms": 0.5, "cma_ms": 0.8, "cma_gbps": 1.3})
    md = B.markdown(rows)
    # per-block vs runs, the mechanisms, where the time goes: one row each
    assert md.count("| layer-major | 4 KiB | fresh |") == 3 and "50%" in md
    assert "| 1.00 / 1.00 | 0.50 / 0.50 | 0.25 / 0.25 | 0.80 | 0.50 (0.50) |" in md
