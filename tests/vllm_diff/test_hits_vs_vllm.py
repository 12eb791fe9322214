"""Differential tests: HitFinder vs vLLM's own HybridKVCacheCoordinator / manager classmethods,
and vs vLLM's MooncakeStoreCoordinator, whichever vLLM is installed (0.32 or 0.33).

vLLM's coordinator is built from real vLLM specs (no VllmConfig, vllm-hma.md §8 "No-config
route"); its managers' block pool is replaced by vLLM's own ``ExternalCachedBlockPool`` over a
Python set, so the hit rule under test is vLLM's code, and the cached set is the same blocks
the ExistenceSet holds. hmacore's layout is translated from those same specs
(``group_from_spec``), so the spec groups vLLM merges (spec equality: head shape and dtype
included) are the ones hmacore must merge.

The two coordinators disagree from 0.33 on (docs/vllm.md "Which hit rule"): the core one
gates the eagle drop on ``use_eagle`` and reads windows alone, the store one drops on flagged
groups always and covers ``window + extra_retained_tokens``. The finder under test takes the
installed version's rule from ``_compat.core_hit_rule`` / ``_compat.store_hit_rule``, and the
layouts draw ``extra_retained_tokens`` and eagle-flagged groups, so a rule that follows the
wrong version fails here.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import assume, event, given
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
from hmacore.integrations.vllm import _compat as C  # noqa: E402
from hmacore.integrations.vllm.layout import group_from_spec  # noqa: E402
from hmacore.presets import get_preset  # noqa: E402
from hmacore.hits import ExistenceSet  # noqa: E402
from hmacore.spec import GroupKind, GroupSpec, KVLayout  # noqa: E402

from hits_scenarios import chunked_layouts, draw_max_length, layouts, make_hashes, populate  # noqa: E402
from oracle_hits import OracleFinder  # noqa: E402

pytestmark = pytest.mark.vllm

#: (num_kv_heads, head_size, dtype): equal page bytes for a block size, unequal vLLM specs
HEADS = ((1, 16, torch.float16), (2, 8, torch.float16), (4, 4, torch.float16),
         (1, 16, torch.bfloat16))
#: max_length past the rows (vLLM passes num_tokens - 1; hmacore takes any int < 2**63)
HUGE = st.one_of(st.sampled_from([2**63 - 1, 2**62, 2**32 + 1]), st.integers(0, 2**63 - 1))


def rule_flags(rule: dict) -> dict:
    """The installed vLLM's rule (``_compat``) without ``eagle``, which the tests draw."""
    return {k: v for k, v in rule.items() if k != "eagle"}


#: the installed vLLM's core / store coordinator rules
CORE = rule_flags(C.core_hit_rule(None))
STORE = rule_flags(C.store_hit_rule(None))


def vllm_spec(s, heads=HEADS[0]):
    n, hs, dt = heads
    attn = dict(block_size=s.block_size, num_kv_heads=n, head_size=hs, dtype=dt)
    if s.kind == GroupKind.FULL:
        return FullAttentionSpec(**attn)
    if s.kind == GroupKind.SLIDING_WINDOW:
        return SlidingWindowSpec(**attn, sliding_window=s.sliding_window,
                                 extra_retained_tokens=s.extra_retained_tokens)
    if s.kind == GroupKind.CHUNKED_LOCAL:
        return ChunkedLocalAttentionSpec(**attn, attention_chunk_size=s.chunk_size)
    return MambaSpec(block_size=s.block_size, shapes=((4,),), dtypes=(torch.float16,),
                     mamba_cache_mode="align")


def draw_heads(data, layout):
    """One head shape per group: all the default (twins merge), or drawn per group (twins
    of one kind / block size / window differ in head shape at equal page bytes)."""
    if data.draw(st.booleans()):
        return [HEADS[0]] * layout.num_groups
    return [data.draw(st.sampled_from(HEADS)) for _ in layout.groups]


def from_vllm(layout: KVLayout, heads):
    """(vLLM KV cache groups, hmacore's translation of them) for a layout's shape."""
    groups = [KVCacheGroupSpec(list(s.layer_names), vllm_spec(s, hd), is_eagle_group=s.eagle)
              for s, hd in zip(layout.groups, heads)]
    translated = tuple(group_from_spec(g, grp.kv_cache_spec, layer_names=grp.layer_names,
                                       eagle=grp.is_eagle_group, transfer=s.transfer)
                       for g, (grp, s) in enumerate(zip(groups, layout.groups)))
    return groups, KVLayout(groups=translated, prefix_match_unit=layout.prefix_match_unit)


def vllm_coordinator(groups, layout: KVLayout, eagle: bool, block_aligned: bool = False):
    config = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)
    lcm = math.lcm(*(s.block_size for s in layout.groups))
    return get_kv_cache_coordinator(
        config, max_model_len=1 << 20, max_in_flight_tokens=1 << 12, use_eagle=eagle,
        enable_caching=True, enable_kv_cache_events=False, dcp_world_size=1,
        pcp_world_size=1, scheduler_block_size=lcm, hash_block_size=layout.hash_block_size,
        allow_partial_hash_hits=not block_aligned)


def run_vllm(coord, h, cached, hashes, max_length):
    pool = ExternalCachedBlockPool(h, cached)
    coord.block_pool = pool
    for m in coord.single_type_managers:
        m.block_pool = pool
    blocks, hit, _ = coord.find_longest_cache_hit(hashes, max_length)
    return hit, [[int(b is not pool.null_block) for b in blks] for blks in blocks]


def partition(finder, coord):
    """(hmacore's spec groups, vLLM's) as {member ids: eagle drop}."""
    mine = {tuple(sg.group_ids): sg.eagle for sg in finder.spec_groups}
    if not hasattr(coord, "attention_groups"):      # one group: the unitary coordinator
        # 0.33: the groups that drop (flagged and use_eagle); 0.32: the flagged ones
        drop = getattr(coord, "drop_eagle_group_ids", coord.eagle_group_ids)
        return mine, {(0,): 0 in drop}
    return mine, {tuple(g.group_ids): g.use_eagle for g in coord.attention_groups}


def compare(data, layout, eagle, ds, max_rows, min_rows=0, heads=None, huge=False):
    groups, layout = from_vllm(layout, heads or [HEADS[0]] * layout.num_groups)
    block_aligned = data.draw(st.integers(0, 3)) == 0     # vLLM's alignment with caching off
    try:
        finder = HitFinder(layout, eagle=eagle, **CORE)
        if block_aligned:
            finder = HitFinder(layout, eagle=eagle, alignment=finder.scheduler_block_size,
                               **CORE)
    except LayoutError:
        assume(False)
    coord = vllm_coordinator(groups, layout, eagle, block_aligned)
    mine, theirs = partition(finder, coord)
    assert mine == theirs                      # same merges, same eagle drop per spec group
    if layout.num_groups > 1:
        assert coord.enable_partial_hash_hits == finder.partial
        assert coord._cache_hit_alignment_tokens == finder.alignment
    oracle = OracleFinder(layout, "last", eagle, alignment=finder.alignment, **CORE)
    n = data.draw(st.integers(min_rows, max_rows)) if data.draw(st.booleans()) else \
        data.draw(st.integers(0, max_rows))
    hashes = make_hashes(n, ds, data.draw(st.integers(0, 2**32 - 1)))
    es, py = populate(data, finder, oracle, hashes, ds)
    h = finder.hash_block_size
    max_length = draw_max_length(data, n, h)
    if huge and data.draw(st.integers(0, 3)) == 0:
        max_length = data.draw(HUGE)
    # vLLM's managers only take caps within the request (num_tokens - 1): past the rows
    # hmacore's hit is the one at the largest such cap
    vllm_cap = min(max_length, n * h + h - 1)
    raw = [bytes(r) for r in hashes]
    want_hit, want_masks = run_vllm(coord, h, py, raw, vllm_cap)
    got = finder.longest_hit(hashes, es, max_length)
    assert got.tokens == want_hit
    assert [m.tolist() for m in got.masks] == want_masks
    # vLLM's manager classmethods over hmacore's duck-typed pool give the same hit too
    hit2, masks2 = run_vllm_over_pool(coord, ExternalBlockPool(h, es), raw, vllm_cap)
    assert (hit2, masks2) == (want_hit, want_masks)


def run_vllm_over_pool(coord, pool, raw, max_length):
    coord.block_pool = pool
    for m in coord.single_type_managers:
        m.block_pool = pool
    blocks, hit, _ = coord.find_longest_cache_hit(raw, max_length)
    return hit, [[int(b is not pool.null_block) for b in blks] for blks in blocks]


@given(data=st.data(), layout=layouts(extra=True), eagle=st.booleans(),
       ds=st.sampled_from([16, 32]))
def test_random_layouts_match_vllm(data, layout, eagle, ds):
    compare(data, layout, eagle, ds, max_rows=48, heads=draw_heads(data, layout), huge=True)


@given(data=st.data(), h=st.sampled_from([1, 2, 4]), window=st.integers(1, 17),
       eagle=st.booleans(), flags=st.lists(st.booleans(), min_size=3, max_size=3))
def test_twins_with_other_head_shapes_match_vllm(data, h, window, eagle, flags):
    """Full attention + two sliding-window twins (same block size and window, equal page
    bytes) whose head shapes may differ, each EAGLE-flagged or not: vLLM looks the twins up
    apart unless their specs are equal; merged, they would share one eagle drop and (with
    two spec groups) the single-pass shortcut, and the hit could differ."""
    bs = h * data.draw(st.sampled_from([1, 2]))
    fa, a, b = (data.draw(st.sampled_from(HEADS)) for _ in range(3))
    layout = KVLayout(groups=(
        GroupSpec(GroupKind.FULL, bs, ("f",), eagle=flags[0]),
        GroupSpec(GroupKind.SLIDING_WINDOW, bs, ("a",), sliding_window=window, eagle=flags[1]),
        GroupSpec(GroupKind.SLIDING_WINDOW, bs, ("b",), sliding_window=window, eagle=flags[2])))
    compare(data, layout, eagle, 16, max_rows=40, heads=[fa, a, b], huge=True)


def test_twins_with_other_head_shapes_are_looked_up_apart():
    """A case merging by page bytes gets wrong: the eagle drop of the flagged twin must not
    reach the other one."""
    layout = KVLayout(groups=(GroupSpec(GroupKind.FULL, 4, ("f",)),
                              GroupSpec(GroupKind.SLIDING_WINDOW, 4, ("a",), sliding_window=9),
                              GroupSpec(GroupKind.SLIDING_WINDOW, 4, ("b",), sliding_window=9,
                                        eagle=True)))
    groups, layout = from_vllm(layout, [HEADS[0], HEADS[1], HEADS[2]])
    a, b = layout.groups[1:]
    assert a.page_bytes == b.page_bytes and (a.num_kv_heads, b.num_kv_heads) == (2, 4)
    # use_eagle on (0.33's core coordinator drops nothing without it); only b is flagged
    finder = HitFinder(layout, eagle=True, **CORE)
    assert [sg.group_ids for sg in finder.spec_groups] == [(0,), (1,), (2,)]
    assert finder.eagle_group_ids == {2}
    coord = vllm_coordinator(groups, layout, True)
    assert partition(finder, coord)[0] == partition(finder, coord)[1]
    hashes = make_hashes(12, 16, 5)
    raw = [bytes(r) for r in hashes]
    # bs = h = 4: block i is row i. Twin a holds blocks 0-5 and the 2-block run 9-10 its
    # window needs; the flagged twin b needs 3 (one to drop) and holds every block.
    rows = {0: range(12), 1: [*range(6), 9, 10], 2: range(12)}
    py = {(g, raw[r]) for g, rs in rows.items() for r in rs}
    es = ExistenceSet(16)
    for g, rs in rows.items():
        es.add_many(g, np.ascontiguousarray(hashes[list(rs)]))
    want = run_vllm(coord, 4, py, raw, 47)
    got = finder.longest_hit(hashes, es, 47)
    assert want[0] == 44 and (got.tokens, [m.tolist() for m in got.masks]) == want
    # merged by page bytes alone (the rule before GroupSpec carried head fields), twin a
    # takes b's eagle drop and needs 3 blocks in a row: only blocks 0-5 qualify
    merged = HitFinder(KVLayout(groups=(layout.groups[0],) + tuple(
        dataclasses.replace(s, num_kv_heads=None, head_size=None, head_size_v=None)
        for s in layout.groups[1:])), eagle=True, **CORE)
    assert [sg.group_ids for sg in merged.spec_groups] == [(0,), (1, 2)]
    assert merged.longest_hit(hashes, es, 47).tokens == 20


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
            min_rows=HitFinder(layout).scheduler_block_size // HitFinder(layout).hash_block_size,
            huge=True)


def store_coordinator(groups, finder: HitFinder, eagle: bool):
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.coordinator import (
        MooncakeStoreCoordinator)
    return MooncakeStoreCoordinator(groups, finder.scheduler_block_size, finder.hash_block_size,
                                    use_eagle=eagle, enable_partial_hash_hits=finder.partial)


def store_finder(data, layout: KVLayout, eagle: bool) -> HitFinder:
    """The installed vLLM's store rule, hits at the derived grain or block-aligned."""
    try:
        finder = HitFinder(layout, eagle=eagle, **STORE)
        if data.draw(st.booleans()):
            finder = HitFinder(layout, eagle=eagle, alignment=finder.scheduler_block_size,
                               **STORE)
    except LayoutError:
        assume(False)
    return finder


@given(data=st.data(), layout=layouts(extra=True), eagle=st.booleans(),
       ds=st.sampled_from([16, 32]))
def test_store_rule_hits_match_vllm_store_coordinator(data, layout, eagle, ds):
    """The store connector's hit (and the loader's masks) vs vLLM's own
    ``MooncakeStoreCoordinator.find_longest_cache_hit`` / ``load_mask``, on layouts with
    extra retained tokens, eagle-flagged groups and twins of equal coverage."""
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.coordinator import (
        ExternalCachedBlockPool as StorePool)
    groups, layout = from_vllm(layout, draw_heads(data, layout))
    finder = store_finder(data, layout, eagle)
    coord = store_coordinator(groups, finder, eagle)
    assert {tuple(g.group_ids): g.use_eagle for g in coord.attention_groups} == \
        {sg.group_ids: sg.eagle for sg in finder.spec_groups}
    oracle = OracleFinder(layout, "last", eagle, alignment=finder.alignment, **STORE)
    n = data.draw(st.integers(0, 40))
    hashes = make_hashes(n, ds, data.draw(st.integers(0, 2**32 - 1)))
    es, py = populate(data, finder, oracle, hashes, ds)
    h = finder.hash_block_size
    max_length = draw_max_length(data, n, h)
    raw = [bytes(r) for r in hashes]
    want_masks, want_hit = coord.find_longest_cache_hit(raw, max_length, StorePool(h, py))
    got = finder.longest_hit(hashes, es, max_length)
    event("hit > 0" if got.tokens else "hit == 0")
    event("retained tokens" if any(s.extra_retained_tokens for s in layout.groups) else "none")
    assert got.tokens == want_hit
    assert [m.tolist() for m in got.masks] == [[int(b) for b in m] for m in want_masks]
    want_load = coord.load_mask(raw, got.tokens)
    assert [m.tolist() for m in finder.load_masks(hashes, got.tokens)] == \
        [[int(b) for b in m] for m in want_load]


@given(data=st.data(), layout=layouts(extra=True), eagle=st.booleans())
def test_store_and_lookup_masks_match_vllm_mooncake_coordinator(data, layout, eagle):
    groups, layout = from_vllm(layout, draw_heads(data, layout))
    finder = store_finder(data, layout, eagle)
    coord = store_coordinator(groups, finder, eagle)
    assert coord.eagle_group_ids == set(finder.eagle_group_ids)
    assert {tuple(g.group_ids) for g in coord.attention_groups} == \
        {sg.group_ids for sg in finder.spec_groups}
    assert coord.align_lookup_length(10**6 + 7) == finder.align_length(10**6 + 7)
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


def test_the_two_coordinators_disagree_where_docs_say():
    """docs/vllm.md "Which hit rule": one full-attention group plus an eagle-flagged sliding
    window (window 8, 4 retained tokens, blocks of 4 tokens) with use_eagle off. Each
    coordinator of the installed vLLM gives the hit its hmacore rule gives, and from 0.33 the
    two answers differ (store: flagged drop + 12-token coverage; core: neither)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.coordinator import (
        ExternalCachedBlockPool as StorePool)
    layout = KVLayout(groups=(GroupSpec(GroupKind.FULL, 4, ("f",)),
                              GroupSpec(GroupKind.SLIDING_WINDOW, 4, ("s",), sliding_window=8,
                                        extra_retained_tokens=4, eagle=True)))
    groups, layout = from_vllm(layout, [HEADS[0]] * 2)
    hashes = make_hashes(10, 16, 11)
    raw = [bytes(r) for r in hashes]
    # full attention holds every block; the window holds blocks 0-6 and 8-9 (a 2-block run
    # at the end, a 7-block run before the hole at 7)
    rows = {0: range(10), 1: [*range(7), 8, 9]}
    py = {(g, raw[r]) for g, rs in rows.items() for r in rs}
    es = ExistenceSet(16)
    for g, rs in rows.items():
        es.add_many(g, np.ascontiguousarray(hashes[list(rs)]))
    core = HitFinder(layout, eagle=False, **CORE).longest_hit(hashes, es, 40).tokens
    store = HitFinder(layout, eagle=False, **STORE).longest_hit(hashes, es, 40).tokens
    assert core == run_vllm(vllm_coordinator(groups, layout, False), 4, py, raw, 40)[0]
    finder = HitFinder(layout, eagle=False, **STORE)
    assert store == store_coordinator(groups, finder, False).find_longest_cache_hit(
        raw, 40, StorePool(4, py))[1]
    if C.AT_LEAST_033:
        # core: no drop, need cdiv(7, 4) = 2 blocks: blocks 8-9 -> 40 tokens;
        # store: drop + need cdiv(11, 4) + 1 = 4 blocks: the run 3-6 -> 28, minus the drop 24
        assert (core, store) == (40, 24)
    else:
        # 0.32: both drop on the flagged group and read the window alone: need 3 blocks,
        # the run 4-6 ends at 28 tokens, minus the dropped block: 24
        assert core == store == 24
