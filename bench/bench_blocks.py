"""vLLM 0.32.0's own ``KVCacheBlocks`` helpers next to hmacore's equivalents on the same
blocks: ``get_block_ids()`` (KVCacheBlock objects -> per-group id lists) vs
``TrackerSet.block_ids(copy=False)`` (the tracker already holds ids), and
``get_unhashed_block_ids_all_groups()`` vs ``tables.fill_blocks`` (ids + hashed masks).
Tables: DeepSeek-V4's five groups (256/64/64/4/8 tokens per block), SW groups null-padded in
front of their window, the first 3/4 of every group's blocks hashed. Outputs checked equal
before timing."""
from __future__ import annotations

import numpy as np
import pytest

from hmacore.grain import cdiv
from hmacore.presets import get_preset
from hmacore.spec import GroupKind
from hmacore.tables import TrackerSet, fill_blocks

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock  # noqa: E402

TOKENS = [4096, 32768, 131072]
LAYOUT = get_preset("deepseek-v4", num_blocks=2**31 - 1)


def scenario(tokens):
    ids, hashed, nid = [], [], 1
    for spec in LAYOUT.groups:
        n = cdiv(tokens, spec.block_size)
        keep = min(n, spec.window_blocks()) if spec.kind == GroupKind.SLIDING_WINDOW else n
        ids.append(np.array([0] * (n - keep) + list(range(nid, nid + keep)), dtype=np.int32))
        nid += keep
        hashed.append((np.arange(n) < n * 3 // 4).astype(np.uint8))
    blocks = []
    for g, (t, h) in enumerate(zip(ids, hashed)):
        row = []
        for b, m in zip(t.tolist(), h.tolist()):
            blk = KVCacheBlock(b)
            if b == 0:
                blk.is_null = True
            elif m:
                blk._block_hash = (b.to_bytes(32, "little"), g)
            row.append(blk)
        blocks.append(row)
    return ids, hashed, KVCacheBlocks(tuple(blocks))


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("impl", ["hmacore", "vllm"])
def test_get_block_ids(benchmark, tokens, impl):
    ids, _, kvb = scenario(tokens)
    ts = TrackerSet(LAYOUT)
    ts.add("r", tuple(ids))
    want = [x.tolist() for x in ids]
    assert [list(x) for x in kvb.get_block_ids()] == want
    assert [x.tolist() for x in ts.block_ids("r", copy=False)] == want
    benchmark.group = f"block_ids-dsv4-{tokens}"
    benchmark.extra_info["impl"] = impl
    benchmark.extra_info["blocks"] = sum(x.size for x in ids)
    if impl == "hmacore":
        benchmark(ts.block_ids, "r", copy=False)
    else:
        benchmark(kvb.get_block_ids)


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("impl", ["hmacore", "vllm"])
def test_unhashed_block_ids(benchmark, tokens, impl):
    ids, hashed, kvb = scenario(tokens)
    want = kvb.get_unhashed_block_ids_all_groups()
    assert [x.tolist() for x in fill_blocks(tuple(ids), hashed)] == want
    benchmark.group = f"unhashed_block_ids-dsv4-{tokens}"
    benchmark.extra_info["impl"] = impl
    t = tuple(ids)
    if impl == "hmacore":
        benchmark(fill_blocks, t, hashed)
    else:
        benchmark(kvb.get_unhashed_block_ids_all_groups)
