"""Differential tests: HitFinder vs vLLM's own HybridKVCacheCoordinator / manager classmethods.

vLLM's coordinator is built from real vLLM specs (no VllmConfig, vllm-hma.md §8 "No-config
route"); its managers' block pool is replaced by vLLM's own ``ExternalCachedBlockPool`` over a
Python set, so the hit rule under test is vLLM's code, and the cached set is the same blocks
the ExistenceSet holds.
"""
from __future__ import annotations

import math

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

# "vllm.v1", not "vllm": with tests/ on sys.path, tests/vllm is importable as a namespace
# package named vllm when the real one is not installed
pytest.importorskip("vllm.v1")
vllm = pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.coordinator import (  # noqa: E402
    ExternalCachedBlockPool,
)
from vllm.v1.core.kv_cache_coordinator import get_kv_cache_coordinator  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)

from hmacore.errors import LayoutError  # noqa: E402
from hmacore.hits import ExternalBlockPool, HitFinder  # noqa: E402
from hmacore.presets import get_preset  # noqa: E402
from hmacore.spec import GroupKind, KVLayout  # noqa: E402

from hits_scenarios import chunked_layouts, draw_max_length, layouts, make_hashes, populate  # noqa: E402
from oracle_hits import OracleFinder  # noqa: E402

pytestmark = pytest.mark.vllm


def vllm_spec(s):
    attn = dict(block_size=s.block_size, num_kv_heads=1, head_size=16, dtype=torch.float16)
    if s.kind == GroupKind.FULL:
        return FullAttentionSpec(**attn)
    if s.kind == GroupKind.SLIDING_WINDOW:
        return SlidingWindowSpec(**attn, sliding_window=s.sliding_window)
    if s.kind == GroupKind.CHUNKED_LOCAL:
        return ChunkedLocalAttentionSpec(**attn, attention_chunk_size=s.chunk_size)
    return MambaSpec(block_size=s.block_size, shapes=((4,),), dtypes=(torch.float16,),
                     mamba_cache_mode="align")


def vllm_coordinator(layout: KVLayout, eagle: bool):
    groups = [KVCacheGroupSpec(list(s.layer_names), vllm_spec(s), is_eagle_group=s.eagle)
              for s in layout.groups]
    config = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)
    lcm = math.lcm(*(s.block_size for s in layout.groups))
    return get_kv_cache_coordinator(
        config, max_model_len=1 << 20, max_in_flight_tokens=1 << 12, use_eagle=eagle,
        enable_caching=True, enable_kv_cache_events=False, dcp_world_size=1,
        pcp_world_size=1, scheduler_block_size=lcm, hash_block_size=layout.hash_block_size)


def run_vllm(coord, h, cached, hashes, max_length):
    pool = ExternalCachedBlockPool(h, cached)
    coord.block_pool = pool
    for m in coord.single_type_managers:
        m.block_pool = pool
    blocks, hit, _ = coord.find_longest_cache_hit(hashes, max_length)
    return hit, [[int(b is not pool.null_block) for b in blks] for blks in blocks]


def compare(data, layout, eagle, ds, max_rows, min_rows=0):
    try:
        finder = HitFinder(layout, eagle=eagle)
    except LayoutError:
        assume(False)
    coord = vllm_coordinator(layout, eagle)
    if layout.num_groups > 1:
        assert coord.enable_partial_hash_hits == finder.partial
        assert coord._cache_hit_alignment_tokens == finder.alignment
    oracle = OracleFinder(layout, "last", eagle)
    n = data.draw(st.integers(min_rows, max_rows)) if data.draw(st.booleans()) else \
        data.draw(st.integers(0, max_rows))
    hashes = make_hashes(n, ds, data.draw(st.integers(0, 2**32 - 1)))
    es, py = populate(data, finder, oracle, hashes, ds)
    h = finder.hash_block_size
    max_length = draw_max_length(data, n, h)
    raw = [bytes(r) for r in hashes]
    want_hit, want_masks = run_vllm(coord, h, py, raw, max_length)
    got = finder.longest_hit(hashes, es, max_length)
    assert got.tokens == want_hit
    assert [m.tolist() for m in got.masks] == want_masks
    # vLLM's manager classmethods over hmacore's duck-typed pool give the same hit too
    hit2, masks2 = run_vllm_over_pool(coord, ExternalBlockPool(h, es), raw, max_length)
    assert (hit2, masks2) == (want_hit, want_masks)


def run_vllm_over_pool(coord, pool, raw, max_length):
    coord.block_pool = pool
    for m in coord.single_type_managers:
        m.block_pool = pool
    blocks, hit, _ = coord.find_longest_cache_hit(raw, max_length)
    return hit, [[int(b is not pool.null_block) for b in blks] for blks in blocks]


@given(data=st.data(), layout=layouts(), eagle=st.booleans(), ds=st.sampled_from([16, 32]))
def test_random_layouts_match_vllm(data, layout, eagle, ds):
    compare(data, layout, eagle, ds, max_rows=48)


@given(data=st.data(), bs=st.sampled_from([2, 4, 8]), mult=st.integers(1, 4),
       with_full=st.booleans())
def test_chunked_local_matches_vllm(data, bs, mult, with_full):
    compare(data, chunked_layouts(bs, mult, with_full), False, 16, max_rows=40)


@pytest.mark.parametrize("name", ["deepseek-v4", "gpt-oss-120b", "gemma-3-27b",
                                  "qwen3-next-80b", "llama-3-70b"])
@given(data=st.data(), eagle=st.booleans())
def test_presets_match_vllm(name, data, eagle):
    layout = get_preset(name)
    rows = {"deepseek-v4": 640, "qwen3-next-80b": 64}.get(name, 300)
    compare(data, layout, eagle, 32, max_rows=rows,
            min_rows=HitFinder(layout).scheduler_block_size // HitFinder(layout).hash_block_size)


@given(data=st.data(), layout=layouts(), eagle=st.booleans())
def test_store_and_lookup_masks_match_vllm_mooncake_coordinator(data, layout, eagle):
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.coordinator import (
        MooncakeStoreCoordinator)
    try:
        finder = HitFinder(layout, eagle=eagle)
    except LayoutError:
        assume(False)
    groups = [KVCacheGroupSpec(list(s.layer_names), vllm_spec(s), is_eagle_group=s.eagle)
              for s in layout.groups]
    coord = MooncakeStoreCoordinator(groups, finder.scheduler_block_size, finder.hash_block_size,
                                     use_eagle=eagle, enable_partial_hash_hits=finder.partial)
    assert coord.eagle_group_ids == set(finder.eagle_group_ids)
    n_align = data.draw(st.integers(0, 12))
    tokens = n_align * finder.alignment
    start = data.draw(st.integers(0, tokens))

    def dense(masks, ref):
        return [([1] * len(mine) if theirs is None else [int(b) for b in theirs])
                for mine, theirs in zip(ref, masks)]

    mine_store = finder.store_masks(tokens, start)
    assert [m.tolist() for m in mine_store] == dense(coord.store_mask(tokens, start), mine_store)
    mine_look = finder.lookup_masks(tokens)
    assert [m.tolist() for m in mine_look] == dense(coord.lookup_mask(tokens), mine_look)
