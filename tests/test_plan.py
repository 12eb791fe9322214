"""TransferPlan: golden vectors (vllm-hma.md §13.2), registration geometry, figures."""
import numpy as np
import pytest

from hmacore.errors import LayoutError
from hmacore.demo.paged_memory import allocate_paged_kv
from hmacore.plan import Region, TransferPlan, layer_sort_key
from hmacore.presets import get_preset
from hmacore.spec import GroupKind, GroupSpec, KVLayout

from oracle_plan import oracle_descriptors


def _layout(kinds, layers_per_group=1, bs=16):
    groups = []
    for g, kind in enumerate(kinds):
        kw = {"sliding_window": 32} if kind == GroupKind.SLIDING_WINDOW else {}
        groups.append(GroupSpec(kind, bs, tuple(f"g{g}.{i}" for i in range(layers_per_group)), **kw))
    return KVLayout(groups=tuple(groups))


def _regions(n, logical, ratio=1, group=-1, state=False, base=0):
    return [Region(base + i * 10**7, 64, 64, logical, ratio, group, state, (f"l{i}",))
            for i in range(n)]


def test_golden_classic_shared_four_regions():
    plan = TransferPlan(_layout([GroupKind.FULL, GroupKind.SLIDING_WINDOW]), _regions(4, 1000))
    assert not plan.group_major
    got = plan.desc_ids(([5, 6], [9]))
    assert got.dtype == np.int64
    assert got.tolist() == [5, 6, 9, 1005, 1006, 1009, 2005, 2006, 2009, 3005, 3006, 3009]


def test_golden_empty_groups():
    plan = TransferPlan(_layout([GroupKind.FULL, GroupKind.SLIDING_WINDOW]), _regions(4, 1000))
    empty = plan.desc_ids(([], []))
    assert empty.dtype == np.int64 and empty.shape == (0,)
    assert plan.desc_ids(([], [9])).tolist() == [9, 1009, 2009, 3009]
    assert plan.desc_ids((np.array([], np.float64), [9])).tolist() == [9, 1009, 2009, 3009]


def test_golden_hybrid_ssm():
    layout = _layout([GroupKind.FULL, GroupKind.MAMBA])
    plan = TransferPlan(layout, _regions(2, 100) + _regions(4, 100, state=True, base=10**9))
    assert plan.group_major
    assert plan.desc_ids(([3, 5], [1, 2])).tolist() == \
        [3, 5, 103, 105, 201, 202, 301, 302, 401, 402, 501, 502]


def test_golden_hybrid_ssm_ratio4():
    # Upstream vector: FA regions hold 400 kernel blocks (ratio 4), SSM 100 logical. Its FA ids
    # 3 and 7 are kernel ids; 3 lies inside logical block 0 (the null block), hence allow_null.
    layout = _layout([GroupKind.FULL, GroupKind.MAMBA])
    plan = TransferPlan(layout, _regions(2, 100, ratio=4) + _regions(4, 100, state=True, base=10**9))
    got = plan.desc_ids(([3, 7], [1, 2]), kernel_ids=True, allow_null=True)
    assert got.tolist() == [3, 7, 403, 407, 801, 802, 901, 902, 1001, 1002, 1101, 1102]
    # logical ids are expanded by the ratio: logical 1 -> kernel 4..7
    assert plan.desc_ids(([1], [2])).tolist() == [4, 5, 6, 7, 404, 405, 406, 407, 802, 902, 1002, 1102]


def test_golden_region_owned_groups_with_shared_region():
    layout = _layout([GroupKind.FULL, GroupKind.SLIDING_WINDOW])
    regions = [Region(0, 64, 64, 10, 1, -1, False, ("s",)),     # shared by both groups
               Region(10**6, 64, 64, 10, 1, 0, False, ("a",)),  # group 0 only
               Region(2 * 10**6, 64, 64, 10, 1, 1, False, ("b",))]  # group 1 only
    plan = TransferPlan(layout, regions)
    assert plan.desc_ids(([1, 2], [3])).tolist() == [1, 2, 11, 12, 3, 23]
    assert plan.desc_ids(([], [3])).tolist() == [3, 23]


def test_golden_int64_overflow():
    # 160 regions x 2^24 logical blocks x ratio 16: offsets pass 2^31 (and 2^32).
    layout = _layout([GroupKind.FULL])
    plan = TransferPlan(layout, _regions(160, 2**24, ratio=16))
    got = plan.desc_ids(([2**24 - 1],))
    assert got.dtype == np.int64
    per_region = 2**24 * 16
    assert got[-1] == 159 * per_region + (2**24 - 1) * 16 + 15
    assert got[-1] > 2**31 * 19
    assert got.size == 160 * 16


def test_out_buffer_written_in_place():
    plan = TransferPlan(_layout([GroupKind.FULL, GroupKind.SLIDING_WINDOW]), _regions(4, 1000))
    buf = np.full(20, -7, np.int64)
    got = plan.desc_ids(([5, 6], [9]), out=buf)
    assert np.shares_memory(got, buf) and got.size == 12
    assert buf[:12].tolist() == [5, 6, 9, 1005, 1006, 1009, 2005, 2006, 2009, 3005, 3006, 3009]
    assert (buf[12:] == -7).all()
    assert plan.count_desc_ids(([5, 6], [9])) == 12


def test_ascending_runs_stay_contiguous():
    plan = TransferPlan(_layout([GroupKind.FULL]), _regions(3, 100, ratio=2))
    got = plan.desc_ids((np.arange(10, 20, dtype=np.int32),))
    for r in range(3):
        seg = got[r * 20:(r + 1) * 20]
        assert (np.diff(seg) == 1).all()


def test_layer_sort_key_numeric():
    names = ["layers.10", "layers.9", "layers.1"]
    assert sorted(names, key=layer_sort_key) == ["layers.1", "layers.9", "layers.10"]


def test_from_kv_caches_classic_aliasing_shares_regions():
    layout = get_preset("gpt-oss")
    paged = allocate_paged_kv(layout, 16, page_bytes=64)
    plan = TransferPlan.from_kv_caches(layout, paged.kv_caches, num_blocks=16)
    assert len(plan.regions) == 18 and all(r.group == -1 for r in plan.regions)
    assert not plan.group_major
    # every region is one slot storage: layer j of both groups
    for r, reg in enumerate(plan.regions):
        assert reg.base == paged.storages[r].ctypes.data
        assert reg.block_len == 64 and reg.stride == 64 and len(reg.layers) == 2


def test_from_kv_caches_split_kv_and_mla():
    layout = KVLayout(groups=(
        GroupSpec(GroupKind.FULL, 16, ("a.0", "a.1")),
        GroupSpec(GroupKind.SLIDING_WINDOW, 16, ("m.0", "m.1"), sliding_window=32, mla=True)))
    paged = allocate_paged_kv(layout, 8, page_bytes=(128, 64), kv_split=True)
    plan = TransferPlan.from_kv_caches(layout, paged.kv_caches, num_blocks=8)
    # a.* split into K and V regions of 64 B, m.* one latent region each
    assert [(r.layers, r.block_len, r.group) for r in plan.regions] == [
        (("a.0",), 64, 0), (("a.0",), 64, 0), (("a.1",), 64, 0), (("a.1",), 64, 0),
        (("m.0",), 64, 1), (("m.1",), 64, 1)]
    k = paged.kv_caches["a.0"]
    assert plan.regions[0].base == k[0].ctypes.data and plan.regions[1].base == k[1].ctypes.data


def test_from_kv_caches_state_subregions_after_attention():
    layout = get_preset("qwen3-next")
    paged = allocate_paged_kv(layout, 4, page_bytes=256, state_parts=2)
    plan = TransferPlan.from_kv_caches(layout, paged.kv_caches, num_blocks=4, kernel_block_size=272)
    states = [r.state for r in plan.regions]
    assert states == sorted(states) and sum(states) == 24
    assert all(r.logical_blocks == 4 and r.ratio == 1 for r in plan.regions if r.state)
    assert all(r.ratio == 2 and r.group == 3 for r in plan.regions if not r.state)
    assert all(r.group == -1 and r.stride == 256 for r in plan.regions if r.state)


def test_groups_never_touch_other_groups_bytes_with_differing_pages():
    # Per-group page sizes differ: every group's descriptors must land inside that group's
    # own layers' pages of the requested block ids, and cover them exactly.
    layout = get_preset("dsv4")
    pages = (256, 128, 128, 64, 32)
    nb = 12
    paged = allocate_paged_kv(layout, nb, page_bytes=pages)
    plan = TransferPlan.from_kv_caches(layout, paged.kv_caches, num_blocks=nb)
    rows = plan.descriptors()
    table = [[1, 3, 4], [2, 5], [6], [7, 8, 9], [10, 11]]
    for g in range(5):
        only = [table[h] if h == g else [] for h in range(5)]
        ids = plan.desc_ids(only)
        got = sorted((int(rows[i, 0]), int(rows[i, 1])) for i in ids)
        want = sorted((paged.kv_caches[name][b].ctypes.data, pages[g])
                      for name in layout.groups[g].layer_names for b in table[g])
        assert got == want


def test_descriptors_match_oracle_with_kernel_ratio_and_stride():
    layout = get_preset("qwen3-next")
    paged = allocate_paged_kv(layout, 5, page_bytes=128, state_parts=3)
    plan = TransferPlan.from_kv_caches(layout, paged.kv_caches, num_blocks=5, kernel_block_size=136)
    want = oracle_descriptors([(r.base, r.block_len, r.stride, r.logical_blocks, r.ratio, r.dev_id)
                               for r in plan.regions])
    got = plan.descriptors()
    assert got.dtype == np.uint64 and got.shape == (plan.num_descs, 3)
    assert [tuple(map(int, row)) for row in got] == want
    strided = plan.strided_descriptors()
    expanded = []
    for addr, length, dev, stride, count in strided.tolist():
        expanded += [(addr + i * stride, length, dev) for i in range(count)]
    assert expanded == want


def test_registration_ranges_merge_aliases():
    layout = get_preset("qwen3-next")
    paged = allocate_paged_kv(layout, 4, page_bytes=544)
    plan = TransferPlan.from_kv_caches(layout, paged.kv_caches, num_blocks=4)
    ranges = plan.registration_ranges()
    assert sorted((a, n) for a, n, _ in ranges) == sorted((s.ctypes.data, s.nbytes) for s in paged.storages)


def test_region_table_roundtrip_same_ids():
    layout = get_preset("gemma-3")
    a = allocate_paged_kv(layout, 8, page_bytes=32)
    b = allocate_paged_kv(layout, 8, page_bytes=32)
    pa = TransferPlan.from_kv_caches(layout, a.kv_caches, num_blocks=8)
    pb = TransferPlan.from_region_table(layout, TransferPlan.from_kv_caches(
        layout, b.kv_caches, num_blocks=8).region_table())
    assert pa.shape_signature() == pb.shape_signature()
    table = [[1, 2], [3], [], [4], [5, 6], [7], []]
    assert pa.desc_ids(table).tolist() == pb.desc_ids(table).tolist()


def test_block_size_ratio_splits_attention_only():
    layout = _layout([GroupKind.FULL, GroupKind.MAMBA])
    plan = TransferPlan(layout, _regions(1, 10) + _regions(1, 10, state=True, base=10**9))
    half = plan.with_block_size_ratio(2)
    assert half.regions[0].ratio == 2 and half.regions[0].desc_len == 32
    assert half.regions[1].ratio == 1
    assert half.desc_ids(([3], [4])).tolist() == [6, 7, 24]
    with pytest.raises(LayoutError, match="split"):
        plan.with_block_size_ratio(128)


def test_request_figures_gpt_oss():
    plan = TransferPlan.from_layout(get_preset("gpt-oss"), 65536)
    f = plan.request_figures(131072)
    page = 2 * 16 * 8 * 64 * 2
    assert [g.blocks for g in f.groups] == [9, 8192]  # cdiv(128, 16) + 1 = 9
    assert f.hma_descriptors == 18 * (9 + 8192)
    assert f.non_hma_descriptors == 36 * 8192
    assert f.hma_bytes == 18 * (9 + 8192) * page and f.non_hma_bytes == 36 * 8192 * page
    assert "non-HMA" in plan.describe(131072)


def test_request_figures_qwen3_next_state_and_ratio():
    plan = TransferPlan.from_layout(get_preset("qwen3-next"), 64, state_parts=2)
    f = plan.request_figures(1088)  # 2 blocks of 544
    assert [g.blocks for g in f.groups] == [1, 1, 1, 2]
    assert f.groups[3].descriptors == 12 * 2 * 34  # 12 attention slots, ratio 34
    assert f.groups[0].descriptors == 24  # 12 slots x 2 state parts, one state block


def test_request_figures_zero_tokens():
    f = TransferPlan.from_layout(get_preset("dsv4"), 64).request_figures(0)
    assert f.hma_descriptors == f.non_hma_descriptors == 0 and f.descriptor_saving == 0.0


def test_table_bytes_matches_desc_bytes():
    plan = TransferPlan.from_layout(get_preset("qwen3-next"), 64, page_bytes=544, kernel_block_size=272)
    table = [[1], [2], [3], [4, 5, 6]]
    assert plan.table_bytes([len(t) for t in table]) == plan.desc_bytes(plan.desc_ids(table))


def test_non_hma_uses_one_block_size_for_mixed_groups():
    layout = get_preset("dsv4")  # block sizes 256/64/64/4/8 -> one group of 256-token blocks
    plan = TransferPlan.from_layout(layout, 64)
    f = plan.request_figures(300)  # 2 blocks of 256 tokens = 512 tokens of every layer
    per_token = sum(len(s.layer_names) * s.page_bytes // s.block_size for s in layout.groups)
    assert f.non_hma_bytes == 512 * per_token
    assert f.non_hma_descriptors == sum(len(s.layer_names) * 512 // s.block_size for s in layout.groups)
    # HMA: mla 2 blocks, windows clip: swa cdiv(128,64)+1 = 3 of 5, c4 3 of 75, c128 17 of 38
    assert [g.blocks for g in f.groups] == [2, 3, 3, 3, 17]


def test_desc_ids_from_metadata_lists_match_arrays():
    """The worker's form (one list of Python ints per group) gives the arrays' answer; a list
    holding anything else goes through the checked path (NumPy ints work, floats are named)."""
    from hmacore.errors import BlockTableError
    from hmacore.presets import get_preset
    plan = TransferPlan.from_layout(get_preset("gpt-oss-120b", num_blocks=4096))
    arrays = tuple(np.arange(1 + 7 * g, 40 + 7 * g, dtype=np.int32) for g in range(2))
    lists = [a.tolist() for a in arrays]
    assert np.array_equal(plan.desc_ids(lists), plan.desc_ids(arrays))
    mixed = [lists[0], [np.int64(x) for x in lists[1]]]
    assert np.array_equal(plan.desc_ids(mixed), plan.desc_ids(arrays))
    with pytest.raises(BlockTableError, match=r"block_ids\[1\]"):
        plan.desc_ids([lists[0], lists[1][:-1] + [2.5]])
    with pytest.raises(BlockTableError):
        plan.desc_ids([lists[0], lists[1] + [4096]])      # past the pool
