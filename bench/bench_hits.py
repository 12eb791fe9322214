"""Benchmarks: longest hit and bulk existence, hmacore vs the Python oracle vs vLLM 0.32.

Every case is one pytest-benchmark group holding one benchmark per implementation
(``extra_info["impl"]``: hmacore / oracle / vllm); every implementation's answer is checked
equal to hmacore's before timing. Cached set: the first 3/4 of the request's blocks, in every
looked-up group (what a store holding the request's prefix answers). Both hmacore and vLLM
start from the ``list[bytes]`` block hashes vLLM hands a connector (hmacore's kernel reads
the probed rows of the list in place).

    python -m pytest bench/bench_hits.py --benchmark-only
"""
from __future__ import annotations

import math
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from oracle_hits import OracleFinder  # noqa: E402

from hmacore.hits import ExistenceSet, HitFinder  # noqa: E402
from hmacore.presets import get_preset  # noqa: E402

PRESETS = ["gpt-oss-120b", "gemma-3-27b", "qwen3-next-80b", "deepseek-v4", "llama-3-70b"]
SIZES = [4096, 32768, 131072]


def _scenario(preset, tokens):
    layout = get_preset(preset)
    finder = HitFinder(layout)
    n = tokens // finder.hash_block_size
    rng = np.random.default_rng(0)
    hashes = rng.integers(0, 256, (n, 32), dtype=np.uint8)
    hashes[:, :4] = np.arange(n, dtype=">u4").view(np.uint8).reshape(-1, 4)
    hashes = np.ascontiguousarray(hashes)
    raw = [bytes(r) for r in hashes]
    es, py = ExistenceSet(32), set()
    oracle = OracleFinder(layout)
    for g in finder.group_ids:
        k = finder.block_sizes[g] // finder.hash_block_size
        nb = (n // k) * 3 // 4
        rows = (np.arange(nb) + 1) * k - 1
        es.add_many(g, np.ascontiguousarray(hashes[rows]))
        py.update(oracle.coarse_key(raw, g, i) for i in range(nb))
    return layout, finder, oracle, hashes, raw, es, py, tokens - 1


def _vllm_coordinator(layout, finder, py):
    pytest.importorskip("vllm")
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.coordinator import (
        ExternalCachedBlockPool)
    from vllm.v1.core.kv_cache_coordinator import get_kv_cache_coordinator
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,
                                            MambaSpec, SlidingWindowSpec)
    from hmacore.spec import GroupKind

    def spec(s):
        a = dict(block_size=s.block_size, num_kv_heads=1, head_size=16, dtype=torch.float16)
        if s.kind == GroupKind.FULL:
            return FullAttentionSpec(**a)
        if s.kind == GroupKind.SLIDING_WINDOW:
            return SlidingWindowSpec(**a, sliding_window=s.sliding_window)
        return MambaSpec(block_size=s.block_size, shapes=((4,),), dtypes=(torch.float16,),
                         mamba_cache_mode="align")

    groups = [KVCacheGroupSpec(list(s.layer_names), spec(s)) for s in layout.groups]
    cfg = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)
    coord = get_kv_cache_coordinator(
        cfg, max_model_len=1 << 20, max_in_flight_tokens=1 << 12, use_eagle=False,
        enable_caching=True, enable_kv_cache_events=False, dcp_world_size=1, pcp_world_size=1,
        scheduler_block_size=math.lcm(*(s.block_size for s in layout.groups)),
        hash_block_size=finder.hash_block_size)
    pool = ExternalCachedBlockPool(finder.hash_block_size, py)
    coord.block_pool = pool
    for m in coord.single_type_managers:
        m.block_pool = pool
    return coord


CASES = [(p, t) for p in PRESETS for t in SIZES]
IMPLS = ["hmacore", "oracle", "vllm"]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("preset,tokens", CASES, ids=[f"{p}-{t}" for p, t in CASES])
def test_longest_hit(benchmark, preset, tokens, impl):
    layout, finder, oracle, hashes, raw, es, py, max_len = _scenario(preset, tokens)
    benchmark.group = f"longest_hit-{preset}-{tokens}"
    benchmark.extra_info["impl"] = impl
    want = finder.longest_hit(hashes, es, max_len).tokens
    assert want > 0
    if impl == "hmacore":
        # from the list[bytes] vLLM hands the connector (Request.block_hashes): the kernel
        # reads the rows it probes in place, nothing is converted
        fn = lambda: finder.longest_hit(raw, es, max_len)  # noqa: E731
        got = fn().tokens
    elif impl == "oracle":
        fn = lambda: oracle.longest_hit(raw, py, max_len)  # noqa: E731
        got = fn()[0]
    else:
        coord = _vllm_coordinator(layout, finder, py)
        fn = lambda: coord.find_longest_cache_hit(raw, max_len)  # noqa: E731
        got = fn()[1]
    assert got == want
    benchmark(fn)          # every side calibrated alike (make bench: BENCH_ARGS)


@pytest.mark.parametrize("impl", ["hmacore", "oracle"])
@pytest.mark.parametrize("tokens", SIZES)
def test_bulk_existence(benchmark, tokens, impl):
    """contains_many over a DSv4 request's hash rows (h = 4: 32k rows at 128k tokens)."""
    _, finder, _, hashes, raw, es, _, _ = _scenario("deepseek-v4", tokens)
    g = 3                                          # C4 group: bs 4 = one row per block
    py = {(g, bytes(hashes[j])) for j in range(0, hashes.shape[0], 2)}
    es2 = ExistenceSet(32)
    es2.add_many(g, np.ascontiguousarray(hashes[::2]))
    benchmark.group = f"bulk_existence-deepseek-v4-{tokens}"
    benchmark.extra_info["impl"] = impl
    benchmark.extra_info["bytes_per_key"] = es2.nbytes / len(es2)
    want = es2.contains_many(g, hashes)
    if impl == "hmacore":
        fn = lambda: es2.contains_many(g, hashes)  # noqa: E731
        assert np.array_equal(fn(), want)
        benchmark(fn)
    else:
        fn = lambda: [(g, r) in py for r in raw]  # noqa: E731
        assert np.array_equal(np.array(fn(), dtype=np.uint8), want)
        benchmark(fn)
