"""HitFinder: vllm-hma.md §13.2 golden vectors, masks/rows, the duck-typed pool, bad inputs."""
from __future__ import annotations

import numpy as np
import pytest

from hmacore.errors import HashInputError, LayoutError
from hmacore.hits import ExistenceSet, ExternalBlockPool, HitFinder
from hmacore.presets import get_preset
from hmacore.spec import GroupKind, GroupSpec, KVLayout, MambaMode

from hits_scenarios import make_hashes


def FA(bs, name, **kw):
    return GroupSpec(GroupKind.FULL, bs, (name,), **kw)


def SW(bs, window, name, **kw):
    return GroupSpec(GroupKind.SLIDING_WINDOW, bs, (name,), sliding_window=window, **kw)


def MB(bs, name, **kw):
    return GroupSpec(GroupKind.MAMBA, bs, (name,), mamba_mode=MambaMode.ALIGN, **kw)


def put_blocks(es, finder, hashes, g, blocks):
    k = finder.block_sizes[g] // finder.hash_block_size
    rows = np.array([(i + 1) * k - 1 for i in blocks], dtype=np.int64)
    es.add_many(g, np.ascontiguousarray(hashes[rows]))


def test_full_attention_prefix_of_five_blocks():
    f = HitFinder(KVLayout(groups=(FA(16, "a"),)))
    hs = make_hashes(8, 32, 0)
    es = ExistenceSet(32)
    put_blocks(es, f, hs, 0, [0, 1, 2, 3, 4, 6, 7])     # block 5 missing: downward closed
    r = f.longest_hit(hs, es, 8 * 16 - 1)
    assert r.tokens == 5 * 16 and r.masks[0].tolist() == [1] * 5


def test_full_plus_sliding_window_run_ending_at_block_7():
    f = HitFinder(KVLayout(groups=(FA(4, "f"), SW(4, 8, "s"))))
    hs = make_hashes(11, 32, 1)
    es = ExistenceSet(32)
    put_blocks(es, f, hs, 0, range(10))
    put_blocks(es, f, hs, 1, [6, 7, 9])
    r = f.longest_hit(hs, es, 43)
    assert r.tokens == 32
    assert r.masks[0].tolist() == [1] * 8                      # FA trimmed to 8 blocks
    assert r.masks[1].tolist() == [0] * 6 + [1, 1]


def test_sliding_window_short_run_anchored_at_block_0():
    f = HitFinder(KVLayout(groups=(FA(4, "f"), SW(4, 16, "s"))))   # need cdiv(15, 4) = 4
    hs = make_hashes(11, 16, 2)
    es = ExistenceSet(16)
    put_blocks(es, f, hs, 0, range(10))
    put_blocks(es, f, hs, 1, [0, 1, 5, 6, 8])
    r = f.longest_hit(hs, es, 43)
    assert r.tokens == 8 and r.masks[1].tolist() == [1, 1] and r.masks[0].tolist() == [1, 1]


def test_mamba_skips_unaligned_hit():
    f = HitFinder(KVLayout(groups=(FA(8, "f"), MB(4, "m"))))
    assert f.alignment == 8 and not f.partial
    hs = make_hashes(10, 16, 3)
    es = ExistenceSet(16)
    put_blocks(es, f, hs, 0, range(5))
    put_blocks(es, f, hs, 1, [1, 2])          # block 2 ends at 12 tokens: not 8-aligned
    r = f.longest_hit(hs, es, 39)
    assert r.tokens == 8 and r.masks[1].tolist() == [0, 1] and r.masks[0].tolist() == [1]


def test_merged_groups_need_every_member():
    layout = KVLayout(groups=(FA(4, "f"), SW(4, 8, "s1"), SW(4, 8, "s2")))
    f = HitFinder(layout)
    assert [sg.group_ids for sg in f.spec_groups] == [(0,), (1, 2)]
    hs = make_hashes(6, 16, 4)
    es = ExistenceSet(16)
    put_blocks(es, f, hs, 0, range(6))
    put_blocks(es, f, hs, 1, range(6))
    put_blocks(es, f, hs, 2, [0, 1, 2, 3])      # blocks 4, 5 missing in one member
    r = f.longest_hit(hs, es, 23)
    assert r.tokens == 16
    assert r.masks[1].tolist() == r.masks[2].tolist() == [0, 0, 1, 1]


def test_eagle_drop_applied_once_per_candidate():
    f = HitFinder(KVLayout(groups=(FA(4, "f", eagle=True), SW(4, 8, "s"))))
    hs = make_hashes(10, 16, 5)
    es = ExistenceSet(16)
    put_blocks(es, f, hs, 0, range(10))
    put_blocks(es, f, hs, 1, range(10))
    # FA probes up to 40 tokens (eagle margin), drops one block -> 36; SW accepts 36.
    assert f.longest_hit(hs, es, 39).tokens == 36
    assert f.longest_hit(hs, es, 39, apply_eagle=False).tokens == 36  # capped by max_length
    assert f.longest_hit(hs, es, 40, apply_eagle=False).tokens == 40


def test_eagle_fallback_flags_every_group():
    layout = KVLayout(groups=(FA(4, "f"), SW(4, 8, "s")))
    assert HitFinder(layout, eagle=True).eagle_group_ids == {0, 1}
    assert HitFinder(layout).eagle_group_ids == frozenset()


def test_deepseek_v4_hits_are_256_aligned():
    layout = get_preset("deepseek-v4")
    f = HitFinder(layout)
    assert f.hash_block_size == 4 and f.alignment == 256 and not f.partial
    assert [sg.group_ids for sg in f.spec_groups] == [(0,), (1, 2), (3,), (4,)]
    n = 1000                                   # 4000 tokens
    hs = make_hashes(n, 32, 6)
    es = ExistenceSet(32)
    for g in range(5):
        k = f.block_sizes[g] // 4
        put_blocks(es, f, hs, g, range(n // k))
    r = f.longest_hit(hs, es, 3999)
    assert r.tokens == 3840 and r.tokens % 256 == 0
    assert r.masks[0].tolist() == [1] * 15
    assert r.masks[1].sum() == 2 and r.masks[1].size == 60   # SWA 64, window 128: 2-block run
    assert r.masks[3].sum() == 2 and r.masks[3].size == 960  # C4: bs 4, window 8
    assert r.masks[4].sum() == 16 and r.masks[4].size == 480  # C128: bs 8, window 128


def test_fine_grained_mamba_hits_inside_a_block():
    layout = KVLayout(groups=(FA(16, "f"), MB(16, "m"), FA(4, "g")))
    f = HitFinder(layout)
    assert f.partial and f.alignment == 4 == f.hash_block_size
    hs = make_hashes(12, 16, 7)
    es = ExistenceSet(16)
    es.add_many(0, np.ascontiguousarray(hs[[3, 5]]))    # FA: block 0 + partial tail row 5
    es.add_many(2, np.ascontiguousarray(hs[:8]))
    es.add_many(1, np.ascontiguousarray(hs[[5]]))       # Mamba state at 24 tokens
    r = f.longest_hit(hs, es, 47)
    assert r.tokens == 24
    assert r.masks[0].tolist() == [1, 1] and r.masks[1].tolist() == [0, 1]


def test_empty_hashes_and_zero_length():
    f = HitFinder(get_preset("gpt-oss-120b"))
    es = ExistenceSet(32)
    empty = np.zeros((0, 32), dtype=np.uint8)
    r = f.longest_hit(empty, es, 1000)
    assert r.tokens == 0 and all(m.size == 0 for m in r.masks)
    assert f.longest_hit(make_hashes(4, 32, 0), es, 0).tokens == 0
    assert all(rows.size == 0 for rows in f.lookup_rows(0, 1000))
    assert all(rows.size == 0 for rows in f.lookup_rows(100, 10))   # below one aligned block


def test_mixed_block_sizes_coarse_rows_and_concat_keys():
    layout = KVLayout(groups=(FA(256, "big"), SW(64, 128, "small")))
    f = HitFinder(layout)
    assert f.hash_block_size == 64 and f.alignment == 256
    rows = f.lookup_rows(8, 512)
    assert rows[0].tolist() == [3, 7]                  # coarse hash of 256-block i = row 4i+3
    assert rows[1].tolist() == [2, 3, 6, 7]            # SW tails before each 256 boundary
    hs = make_hashes(8, 16, 8)
    assert np.array_equal(f.key_digests(hs, 0, rows[0]), hs[[3, 7]])
    fc = HitFinder(layout, coarse="concat")
    cat = fc.key_digests(hs, 0, rows[0])
    assert cat.shape == (2, 64) and bytes(cat[1]) == b"".join(bytes(r) for r in hs[4:8])
    with pytest.raises(HashInputError, match="end blocks"):
        fc.key_digests(hs, 0, np.array([2]))


def test_store_masks_match_lookup_masks_except_mamba():
    layout = KVLayout(groups=(FA(16, "f"), SW(32, 64, "s"), MB(32, "m")))
    f = HitFinder(layout)
    assert f.alignment == 32 and not f.partial    # SW bs 32 != h 16: no fine-grained hits
    store, look = f.store_masks(256), f.lookup_masks(256)
    assert store[0].tolist() == look[0].tolist() == [1] * 16
    # need = cdiv(63, 32) = 2 >= 32 // 32 blocks per segment -> every block is reachable
    assert store[1].tolist() == [1] * 8
    assert store[2].tolist() == [0] * 8 and look[2].tolist() == [1] * 8
    layout2 = KVLayout(groups=(FA(64, "f"), SW(16, 17, "s")))       # need 1 of 4 per segment
    m = HitFinder(layout2).store_masks(256)[1].tolist()
    assert m == [0, 0, 0, 1] * 4
    assert HitFinder(layout2).store_masks(256, start_token=100)[1].tolist() == [1, 0, 0, 0, 1, 0, 0, 0, 1]
    with pytest.raises(HashInputError, match="multiple"):
        f.store_masks(250)


def test_store_rows_only_cover_stored_blocks():
    layout = KVLayout(groups=(FA(64, "f"), SW(16, 17, "s"), MB(16, "m")))
    f = HitFinder(layout)
    assert f.alignment == 64 and not f.partial
    rows = f.store_rows(num_hashes=16, num_tokens=300)       # h = 16, aligned to 256
    assert rows[0].tolist() == [3, 7, 11, 15]
    assert rows[1].tolist() == [3, 7, 11, 15]
    assert rows[2].tolist() == []
    assert f.boundary_row(300) == 15 and f.boundary_row(10) == -1


def test_external_block_pool_modes():
    es = ExistenceSet(16)
    pool = ExternalBlockPool(4, es)
    h = b"\7" * 16
    es.add(0, h)
    assert pool.get_cached_block(h, [0])[0].block_id == 1
    assert pool.get_cached_block(h, [0, 1]) is None            # one group misses
    assert pool.get_cached_block(b"\1" * 16 + h, [0]) is not None   # concat: last digest
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert pool.contains(0, h) and not pool.contains(1, h)
    mask_pool = ExternalBlockPool(4)
    assert len(mask_pool.get_cached_block(b"x" * 16, [3, 4])) == 2
    assert not mask_pool.contains(0, h)
    with pytest.raises(HashInputError, match="multiple of 16"):
        pool.get_cached_block(b"\0" * 10, [0])


@pytest.mark.parametrize("layout, kw, rule", [
    (KVLayout(groups=(GroupSpec(GroupKind.MAMBA, 16, ("m",), mamba_mode=MambaMode.NONE),
                      FA(16, "f"))), {}, "align"),
    (KVLayout(groups=(FA(16, "f"), MB(32, "m"))), {"coarse": "concat"}, "concat"),
    (KVLayout(groups=(FA(16, "f"),)), {"coarse": "middle"}, "coarse"),
    (KVLayout(groups=(GroupSpec(GroupKind.CHUNKED_LOCAL, 16, ("c",), chunk_size=64,
                                eagle=True), FA(16, "f"))), {}, "eagle"),
    (KVLayout(groups=(GroupSpec(GroupKind.CHUNKED_LOCAL, 16, ("c",), chunk_size=64),
                      FA(32, "f"))), {}, "alignment"),
    (KVLayout(groups=(FA(16, "f", transfer=False),)), {}, "prefix-cacheable"),
])
def test_bad_layouts_are_rejected(layout, kw, rule):
    with pytest.raises(LayoutError, match=rule):
        HitFinder(layout, **kw)


def test_bad_lookup_inputs_are_rejected():
    f = HitFinder(get_preset("gpt-oss-120b"))
    es = ExistenceSet(32)
    hs = make_hashes(4, 32, 0)
    with pytest.raises(HashInputError, match="shape"):
        f.longest_hit(make_hashes(4, 16, 0), es, 10)                # digest size != set's
    with pytest.raises(HashInputError, match="C-contiguous"):
        f.longest_hit(make_hashes(8, 32, 0)[::2], es, 10)
    with pytest.raises(HashInputError, match="dtype"):
        f.longest_hit(hs.astype(np.int16), es, 10)
    with pytest.raises(HashInputError, match="max_length"):
        f.longest_hit(hs, es, -1)
    with pytest.raises(HashInputError, match="max_length"):
        f.longest_hit(hs, es, 3.5)
    with pytest.raises(HashInputError, match="ExistenceSet"):
        f.longest_hit(hs, {(0, b"")}, 10)
    with pytest.raises(HashInputError, match="group"):
        f.key_digests(hs, 5, np.array([0]))
    with pytest.raises(HashInputError, match="rows"):
        f.key_digests(hs, 0, np.array([4]))
    assert len(es) == 0


def test_eagle_flag_spreads_to_merged_members():
    layout = KVLayout(groups=(FA(4, "f"), SW(4, 8, "s1", eagle=True), SW(4, 8, "s2")))
    f = HitFinder(layout)
    assert f.eagle_group_ids == {1, 2}
    assert f.store_masks(16)[2].tolist() == f.store_masks(16)[1].tolist()


def test_alignment_option_turns_fine_grained_hits_off():
    # vLLM resolves cache_hit_alignment_tokens = scheduler block size when prefix caching is
    # off: the same state then gives a block-aligned hit only
    layout = KVLayout(groups=(FA(16, "f"), MB(16, "m"), FA(4, "g")))
    hs = make_hashes(12, 16, 7)
    es = ExistenceSet(16)
    es.add_many(0, np.ascontiguousarray(hs[[3, 5, 7]]))
    es.add_many(2, np.ascontiguousarray(hs[:8]))
    es.add_many(1, np.ascontiguousarray(hs[[3, 5]]))     # states at 16 and 24 tokens
    assert HitFinder(layout).longest_hit(hs, es, 47).tokens == 24
    assert HitFinder(layout, alignment=4).partial            # the derived default, given
    f = HitFinder(layout, alignment=16)
    assert (f.partial, f.alignment) == (False, 16)
    r = f.longest_hit(hs, es, 47)
    assert r.tokens == 16 and r.masks[1].tolist() == [1]
    assert f.align_length(47) == 32 and f.lookup_rows(12, 47)[1].tolist() == [3, 7]
    # concatenated keys need block-aligned lookups: allowed once fine-grained hits are off
    assert HitFinder(layout, alignment=16, coarse="concat").coarse == "concat"


@pytest.mark.parametrize("alignment, rule", [
    (8, "alignment must be None or a hit grain vLLM resolves for this layout: 4 or 16 tokens"),
    (32, "got 32"),
    (0, "got 0"),
    (16.0, "alignment must be None or an int \\(tokens\\), got float 16.0"),
    (True, "got bool True"),
    ("16", "got str '16'"),
])
def test_bad_alignment_is_rejected(alignment, rule):
    with pytest.raises(LayoutError, match=rule):
        HitFinder(KVLayout(groups=(FA(16, "f"), MB(16, "m"), FA(4, "g"))), alignment=alignment)


def test_alignment_of_a_block_aligned_layout_is_its_scheduler_block():
    gemma = KVLayout(groups=(FA(16, "f"), SW(32, 64, "s")))
    assert HitFinder(gemma, alignment=32).alignment == 32 == HitFinder(gemma).alignment
    with pytest.raises(LayoutError, match="32 tokens .* got 16"):
        HitFinder(gemma, alignment=16)          # no fine-grained Mamba: the hash block is not a grain
    one = KVLayout(groups=(FA(16, "f"),))
    assert HitFinder(one, alignment=np.int64(16)).alignment == 16
    with pytest.raises(LayoutError, match="16 tokens"):
        HitFinder(one, alignment=8)


def test_pickled_finder_keeps_eagle_and_alignment():
    import pickle
    layout = KVLayout(groups=(FA(16, "f"), MB(16, "m"), FA(4, "g")))
    f = HitFinder(layout, eagle=True, alignment=16)
    g = pickle.loads(pickle.dumps(f))
    assert (g.alignment, g.partial, g.eagle_group_ids) == (16, False, f.eagle_group_ids)
    hs = make_hashes(12, 16, 3)
    assert g.longest_hit(hs, None, 47) == f.longest_hit(hs, None, 47)
