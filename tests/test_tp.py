"""Heterogeneous TP: worked examples (docs/hetero-tp.md), golden descriptors, bad inputs."""
import numpy as np
import pytest

from hmacore.errors import BlockTableError, LayoutError
from hmacore.plan import TransferPlan
from hmacore.spec import GroupKind, GroupSpec, KVLayout
from hmacore.tp import (GroupSharding, HeadSlice, TpMapping, TpPairPlan, build_pair_plans,
                        default_shardings, kv_heads_of_rank)

from oracle_tp import dsv4_like_layout, full_sliding_layout, rank_pages

FS = full_sliding_layout()
KV4 = [GroupSharding(4, 2)] * 2  # 4 KV heads, K then V chunks


def _slices(m, g):
    return [(s.remote_rank, s.start, s.stop, s.local_index, s.remote_index) for s in m.slices[g]]


@pytest.mark.parametrize("h,tp,rank,want", [
    (8, 1, 0, (0, 8)), (8, 2, 1, (4, 8)), (8, 8, 7, (7, 8)),
    (2, 4, 0, (0, 1)), (2, 4, 1, (0, 1)), (2, 4, 2, (1, 2)), (1, 3, 2, (0, 1))])
def test_vllm_head_sharding(h, tp, rank, want):
    assert kv_heads_of_rank(h, tp, rank) == want


def test_p2_d1_reads_half_blocks_from_two_ranks():
    m = TpMapping(FS, KV4, local_tp=1, local_rank=0, remote_tp=2)
    assert m.remote_ranks == (0, 1)
    assert _slices(m, 0) == [(0, 0, 2, 0, 0), (1, 2, 4, 2, 0)]
    assert m.groups_of(1) == (0, 1)


def test_p1_d2_each_rank_reads_its_head_half():
    m = TpMapping(FS, KV4, local_tp=2, local_rank=1, remote_tp=1)
    assert m.remote_ranks == (0,)
    assert _slices(m, 1) == [(0, 2, 4, 0, 2)]


def test_p2_d2_is_one_to_one():
    for d in range(2):
        m = TpMapping(FS, KV4, local_tp=2, local_rank=d, remote_tp=2)
        assert m.remote_ranks == (d,)
        assert _slices(m, 0) == [(d, 2 * d, 2 * d + 2, 0, 0)]


def test_replicated_remote_heads_read_once_from_a_chosen_copy():
    # 2 heads on P tp=4: ranks 0,1 hold head 0; ranks 2,3 hold head 1
    m0 = TpMapping(FS, [GroupSharding(2, 2)] * 2, local_tp=1, local_rank=0, remote_tp=4)
    assert _slices(m0, 0) == [(0, 0, 1, 0, 0), (2, 1, 2, 1, 0)]
    m1 = TpMapping(FS, [GroupSharding(2, 2)] * 2, local_tp=2, local_rank=1, remote_tp=4)
    assert _slices(m1, 0) == [(3, 1, 2, 0, 0)]


def test_mla_groups_read_from_local_rank_mod_remote_tp():
    lay = dsv4_like_layout()
    sh = default_shardings(lay, 4, kv_chunks=1)
    assert [s.replicated for s in sh] == [True, True, True, False, False]
    for tp_l, d, tp_r, src in [(2, 1, 1, 0), (1, 0, 2, 0), (2, 1, 2, 1), (4, 3, 2, 1)]:
        m = TpMapping(lay, sh, local_tp=tp_l, local_rank=d, remote_tp=tp_r)
        assert m.slices[0] == (HeadSlice(0, src, 0, 1, 0, 0, True),)


def test_golden_descriptors_p2_d1():
    # 4 heads, K/V chunks, 16 B per head per chunk per block: D page 128 B, P pages 64 B
    sh = [(4, 2, False)] * 2
    lplan = TransferPlan.from_layout(FS, 4, page_bytes=rank_pages(sh, [16, 16], 1), base=0x10000)
    rp = {p: TransferPlan.from_layout(FS, 4, page_bytes=rank_pages(sh, [16, 16], 2),
                                      base=0x100000 * (p + 1)) for p in range(2)}
    m = TpMapping(FS, KV4, local_tp=1, local_rank=0, remote_tp=2)
    pairs = build_pair_plans(m, lplan, rp)
    pair = pairs[1]
    lids, rids = pair.desc_ids([[3], [2]], [[1], [2]])
    assert lids.dtype == np.int64 and rids.dtype == np.int64
    ld, rd = pair.local.descriptors()[lids], pair.remote.descriptors()[rids]
    # layer slot 0 (shared by full.0 and swa.0), K chunk then V chunk, region-major
    assert ld[:, :2].tolist() == [
        [0x10000 + 3 * 128 + 32, 32], [0x10000 + 2 * 128 + 32, 32],
        [0x10000 + 3 * 128 + 96, 32], [0x10000 + 2 * 128 + 96, 32],
        [0x10000 + 4 * 128 + 3 * 128 + 32, 32], [0x10000 + 4 * 128 + 2 * 128 + 32, 32],
        [0x10000 + 4 * 128 + 3 * 128 + 96, 32], [0x10000 + 4 * 128 + 2 * 128 + 96, 32]]
    assert rd[:, :2].tolist() == [
        [0x200000 + 64, 32], [0x200000 + 128, 32], [0x200000 + 64 + 32, 32],
        [0x200000 + 128 + 32, 32], [0x200000 + 256 + 64, 32], [0x200000 + 256 + 128, 32],
        [0x200000 + 256 + 96, 32], [0x200000 + 256 + 160, 32]]


def test_empty_request_gives_empty_int64():
    sh = [(4, 2, False)] * 2
    lplan = TransferPlan.from_layout(FS, 4, page_bytes=rank_pages(sh, [16, 16], 2))
    rplan = TransferPlan.from_layout(FS, 4, page_bytes=rank_pages(sh, [16, 16], 1))
    pair = TpPairPlan(TpMapping(FS, KV4, local_tp=2, local_rank=0, remote_tp=1), 0, lplan, rplan)
    lids, rids = pair.desc_ids([[], np.array([])], [[], []])
    assert lids.dtype == rids.dtype == np.int64 and lids.size == rids.size == 0


# -- bad inputs ---------------------------------------------------------------------------

@pytest.mark.parametrize("args,msg", [
    ((6, 4, 0), "tp 4 does not divide num_heads 6"),
    ((2, 3, 0), "num_heads 2 does not divide tp 3"),
    ((4, 2, 2), r"rank must be in \[0, 2\)"),
    ((4, 2, -1), "rank must be an int >= 0"),
    ((0, 1, 0), "num_heads must be an int >= 1"),
    ((4, True, 0), "tp must be an int >= 1"),
])
def test_bad_sharding_args(args, msg):
    with pytest.raises(LayoutError, match=msg):
        kv_heads_of_rank(*args)


def test_bad_mapping_args():
    with pytest.raises(LayoutError, match="shardings has 1 entries"):
        TpMapping(FS, KV4[:1], local_tp=1, local_rank=0, remote_tp=1)
    with pytest.raises(LayoutError, match=r"shardings\[0\] must be a GroupSharding"):
        TpMapping(FS, [(4, 2), (4, 2)], local_tp=1, local_rank=0, remote_tp=1)
    with pytest.raises(LayoutError, match=r"local_rank must be in \[0, 2\)"):
        TpMapping(FS, KV4, local_tp=2, local_rank=2, remote_tp=1)
    with pytest.raises(LayoutError, match="tp 3 does not divide num_heads 4"):
        TpMapping(FS, KV4, local_tp=1, local_rank=0, remote_tp=3)
    with pytest.raises(LayoutError, match="chunks must be an int >= 1"):
        GroupSharding(4, 0)


def _plans(tp_l, tp_r, hbb_r=16, lay=FS, kbs=None):
    sh = [(4, 2, False)] * 2
    lplan = TransferPlan.from_layout(lay, 4, page_bytes=rank_pages(sh, [16, 16], tp_l),
                                     kernel_block_size=kbs)
    rplan = TransferPlan.from_layout(lay, 4, page_bytes=rank_pages(sh, [hbb_r] * 2, tp_r),
                                     kernel_block_size=kbs)
    return lplan, rplan


def test_bad_pair_args():
    m = TpMapping(FS, KV4, local_tp=2, local_rank=0, remote_tp=2)
    lplan, rplan = _plans(2, 2)
    with pytest.raises(LayoutError, match="remote_rank 1 serves nothing to local rank 0"):
        TpPairPlan(m, 1, lplan, rplan)
    with pytest.raises(LayoutError, match="block_size_ratio must be an int >= 1"):
        TpPairPlan(m, 0, lplan, rplan, block_size_ratio=0)
    lplan, rplan = _plans(2, 2, hbb_r=32)
    with pytest.raises(LayoutError, match="16 B per head per chunk locally, 32 B remotely"):
        TpPairPlan(m, 0, lplan, rplan)
    lplan, rplan = _plans(2, 2, kbs=8)
    with pytest.raises(LayoutError, match="kernel ratio 2 with head-sharded pages"):
        TpPairPlan(m, 0, lplan, rplan)
    other = KVLayout(groups=(GroupSpec(GroupKind.FULL, 16, ("x.0", "x.1")),
                             GroupSpec(GroupKind.SLIDING_WINDOW, 16, ("y.0", "y.1"), sliding_window=32)))
    lplan, _ = _plans(2, 2)
    _, rplan = _plans(2, 2, lay=other)
    with pytest.raises(LayoutError, match="names layer 'x.0' that the layout lacks"):
        TpPairPlan(m, 0, lplan, rplan)
    with pytest.raises(LayoutError, match=r"remote_plans lacks source ranks \[0\]"):
        build_pair_plans(m, lplan, {})


def test_bad_desc_id_args_write_nothing():
    m = TpMapping(FS, KV4, local_tp=2, local_rank=0, remote_tp=1)
    lplan, rplan = _plans(2, 1)
    pair = TpPairPlan(m, 0, lplan, rplan)
    with pytest.raises(BlockTableError, match="local_block_ids must be 2 per-group id lists"):
        pair.desc_ids([[1]], [[1], []])
    with pytest.raises(BlockTableError, match="group 1: 1 local and 2 remote blocks"):
        pair.desc_ids([[1], [2]], [[1], [2, 3]])
    with pytest.raises(BlockTableError, match="out of range"):
        pair.desc_ids([[1], [9]], [[1], [2]])
    pair2 = TpPairPlan(m, 0, lplan, rplan.with_block_size_ratio(1))
    with pytest.raises(BlockTableError, match="remote must be 1 x local"):
        pair2.desc_ids([[1, 2], []], [[1], []])


def test_block_size_ratio_two_splits_each_head_into_token_halves():
    # D block 16 tokens = 2 P blocks of 8 tokens; 2 heads, K/V chunks, 32 B/head/chunk on D
    lay16, lay8 = full_sliding_layout(16), full_sliding_layout(8)
    sh = [(2, 2, False)] * 2
    lplan = TransferPlan.from_layout(lay16, 4, page_bytes=rank_pages(sh, [32, 32], 1), base=0)
    rplan = TransferPlan.from_layout(lay8, 8, page_bytes=rank_pages(sh, [16, 16], 1), base=1 << 20)
    m = TpMapping(lay16, [GroupSharding(2, 2)] * 2, local_tp=1, local_rank=0, remote_tp=1)
    pair = TpPairPlan(m, 0, lplan, rplan, block_size_ratio=2)
    lids, rids = pair.desc_ids([[1], []], [[5, 6], []])
    ld, rd = pair.local.descriptors()[lids], pair.remote.descriptors()[rids]
    # region 0 (layer slot 0), chunk K head 0: tokens 0-7 <- P block 5, tokens 8-15 <- P block 6
    assert ld[:2, :2].tolist() == [[128, 16], [144, 16]]
    assert rd[:2, :2].tolist() == [[(1 << 20) + 5 * 64, 16], [(1 << 20) + 6 * 64, 16]]
    assert len(lids) == 2 * 2 * 2 * 2  # slots x chunks x heads x halves


def test_pair_plans_split_per_layer_in_matching_order():
    from hmacore.layerwise import LayerPlan
    lay = dsv4_like_layout()
    sh = [(1, 1, True)] * 3 + [(4, 1, False)] * 2
    hbb = [256, 64, 64, 32, 64]
    lplan = TransferPlan.from_layout(lay, 8, page_bytes=rank_pages(sh, hbb, 1))
    rplans = {p: TransferPlan.from_layout(lay, 8, page_bytes=rank_pages(sh, hbb, 2), base=(p + 2) << 30)
              for p in range(2)}
    m = TpMapping(lay, [GroupSharding(*s) for s in sh], local_tp=1, local_rank=0, remote_tp=2)
    pairs = build_pair_plans(m, lplan, rplans)
    ids = [[1], [2], [3], [4], [5]]
    for p, pair in pairs.items():
        ll, rl = LayerPlan(pair.local), LayerPlan(pair.remote)
        assert ll.layers == rl.layers
        lsum = rsum = 0
        for layer in ll.layers:
            a, b = ll.desc_ids(layer, ids), rl.desc_ids(layer, ids)
            assert (pair.local.descriptors()[a][:, 1] == pair.remote.descriptors()[b][:, 1]).all()
            lsum += len(a)
            rsum += len(b)
        full_l, full_r = pair.desc_ids(ids, ids)
        assert lsum == rsum == len(full_l) == len(full_r)
    # rank 1 serves only the sharded compressor groups' heads 2-3 to a TP=1 decode rank
    assert pairs[1].groups == (3, 4)


@pytest.mark.parametrize("tp_p,tp_d,h,want", [
    (2, 1, 4, [1, 1]), (1, 2, 4, [2]), (2, 2, 4, [1, 1]), (4, 1, 2, [1, 0, 1, 0]),
    (4, 2, 2, [1, 0, 0, 1]), (1, 4, 2, [4])])
def test_expected_consumers(tp_p, tp_d, h, want):
    from hmacore.tp import expected_consumers
    sh = [GroupSharding(h, 2)] * 2
    got = [expected_consumers(FS, sh, local_tp=tp_d, remote_tp=tp_p, remote_rank=p)
           for p in range(tp_p)]
    assert got == want
    with pytest.raises(LayoutError, match=r"remote_rank must be in \[0, 2\)"):
        expected_consumers(FS, sh, local_tp=1, remote_tp=2, remote_rank=2)


def test_mla_consumers_include_replicated_groups():
    from hmacore.tp import expected_consumers
    lay = dsv4_like_layout()
    sh = default_shardings(lay, 4, kv_chunks=1)
    # decode tp=4 over prefill tp=2: MLA from rank d % 2, heads from rank d // 2
    assert [expected_consumers(lay, sh, local_tp=4, remote_tp=2, remote_rank=p) for p in (0, 1)] == [3, 3]


def test_desc_ids_into_reused_buffers():
    m = TpMapping(FS, KV4, local_tp=1, local_rank=0, remote_tp=2)
    sh = [(4, 2, False)] * 2
    lplan = TransferPlan.from_layout(FS, 8, page_bytes=rank_pages(sh, [16, 16], 1))
    rplan = TransferPlan.from_layout(FS, 8, page_bytes=rank_pages(sh, [16, 16], 2))
    pair = TpPairPlan(m, 0, lplan, rplan)
    ol, orr = np.full(64, -1, np.int64), np.full(64, -1, np.int64)
    a, b = pair.desc_ids([[1, 2], [3]], [[4, 5], [6]], out_local=ol, out_remote=orr)
    ra, rb = pair.desc_ids([[1, 2], [3]], [[4, 5], [6]])
    assert (a == ra).all() and (b == rb).all() and np.shares_memory(a, ol)
    with pytest.raises(BlockTableError, match="room for 2 descriptor ids"):
        pair.desc_ids([[1, 2], [3]], [[4, 5], [6]], out_local=ol[:2])


# -- unsupported configurations fail at plan time, with the error docs/hetero-tp.md quotes ------

def test_nhd_pages_rejected_when_head_slices_are_needed():
    msg = (r"page_layout 'NHD' puts heads innermost: group 0 needs heads \[0, 2\) of remote rank 0 "
           r"\(local rank holds 4 heads, remote 2\), which are not whole pages")
    with pytest.raises(LayoutError, match=msg):
        TpMapping(FS, KV4, local_tp=1, local_rank=0, remote_tp=2, page_layout="NHD")
    with pytest.raises(LayoutError, match="page_layout 'LBNHC' puts heads innermost"):
        TpMapping(FS, KV4, local_tp=2, local_rank=0, remote_tp=1, page_layout="LBNHC")
    # whole pages on both sides are fine: equal TP, one replicated head per rank, MLA pages
    TpMapping(FS, KV4, local_tp=2, local_rank=1, remote_tp=2, page_layout="NHD")
    TpMapping(FS, [GroupSharding(2, 2)] * 2, local_tp=4, local_rank=3, remote_tp=2,
              page_layout="NHD")
    lay = dsv4_like_layout()
    TpMapping(lay, [GroupSharding(replicated=True)] * 5, local_tp=2, local_rank=1, remote_tp=1,
              page_layout="NHD")
    with pytest.raises(LayoutError, match=r"page_layout must be one of \['HND', 'LBHNC', 'NHD', "
                                          r"'LBNHC'\], got 'hnd'"):
        TpMapping(FS, KV4, local_tp=1, local_rank=0, remote_tp=1, page_layout="hnd")


def test_context_parallel_rejected():
    lay = KVLayout(groups=(GroupSpec(GroupKind.FULL, 16, ("a.0",)),), context_parallel=2)
    with pytest.raises(LayoutError, match=r"layout.context_parallel=2: decode/prefill context "
                                          r"parallelism \(DCP/PCP\)"):
        TpMapping(lay, [GroupSharding(4, 2)], local_tp=1, local_rank=0, remote_tp=2)


def test_kernel_block_smaller_than_logical_block_rejected_for_sharded_pages():
    m = TpMapping(FS, KV4, local_tp=1, local_rank=0, remote_tp=2)
    sh = [(4, 2, False)] * 2
    kw = dict(page_bytes=None, kernel_block_size=8)
    lplan = TransferPlan.from_layout(FS, 4, **{**kw, "page_bytes": rank_pages(sh, [64] * 2, 1)})
    rplan = TransferPlan.from_layout(FS, 4, **{**kw, "page_bytes": rank_pages(sh, [64] * 2, 2)})
    with pytest.raises(LayoutError, match="kernel ratio 2 with head-sharded pages is not supported; "
                                          "plan with kernel_block_size equal to the block size"):
        TpPairPlan(m, 0, lplan, rplan)
