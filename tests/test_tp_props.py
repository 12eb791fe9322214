"""Hypothesis: heterogeneous-TP pair plans read every needed local byte exactly once, from the
remote byte the plain-Python oracle names (head order, chunks, block pairing, ratios)."""

from hypothesis import assume, given, strategies as st

from hmacore.plan import TransferPlan
from hmacore.spec import GroupKind, GroupSpec, KVLayout
from hmacore.tp import GroupSharding, TpMapping, build_pair_plans

from oracle_tp import (dsv4_like_layout, expected_sources, full_sliding_layout, oracle_heads,
                       rank_pages, simulate_reads)

TPS = [1, 2, 3, 4, 6, 8]


def _valid(h, tp):
    return h % tp == 0 if tp <= h else tp % h == 0


def mamba_layout(bs=16):
    return KVLayout(groups=(
        GroupSpec(GroupKind.FULL, bs, ("attn.0", "attn.1"), name="full"),
        GroupSpec(GroupKind.MAMBA, bs, ("ssm.0", "ssm.1"), name="ssm"),
    ))


@st.composite
def cases(draw):
    kind = draw(st.sampled_from(["full_sliding", "dsv4", "mamba"]))
    ratio = draw(st.sampled_from([1, 1, 2]))
    h = draw(st.sampled_from([1, 2, 3, 4, 6, 8]))
    tp_l = draw(st.sampled_from([t for t in TPS if _valid(h, t)]))
    tp_r = draw(st.sampled_from([t for t in TPS if _valid(h, t)]))
    k = draw(st.sampled_from([1, 2]))
    if kind == "full_sliding":
        layout, rlayout = full_sliding_layout(16), full_sliding_layout(16 // ratio)
    elif kind == "dsv4":
        layout, rlayout = dsv4_like_layout(1), dsv4_like_layout(ratio)
    else:
        layout, rlayout = mamba_layout(16), mamba_layout(16 // ratio)
    mamba_sharded = draw(st.booleans())
    shard = []
    for spec in layout.groups:
        if spec.mla:
            shard.append((1, 1, True))
        elif spec.kind == GroupKind.MAMBA:
            shard.append((h, 1, not mamba_sharded))
        else:
            shard.append((h, k, False))
    state_parts = 1 if mamba_sharded else draw(st.sampled_from([1, 2]))
    hbb = [16 * ratio * draw(st.integers(1, 2)) for _ in layout.groups]
    hbb_r = [b if spec.kind == GroupKind.MAMBA else b // ratio for b, spec in zip(hbb, layout.groups)]
    d = draw(st.integers(0, tp_l - 1))
    nb = 6
    lplan = TransferPlan.from_layout(layout, nb, page_bytes=rank_pages(shard, hbb, tp_l),
                                     state_parts=state_parts, base=1 << 20)
    rplans = {p: TransferPlan.from_layout(rlayout, nb * ratio, page_bytes=rank_pages(shard, hbb_r, tp_r),
                                          state_parts=state_parts, base=(p + 2) << 24)
              for p in range(tp_r)}
    # block ids distinct across groups on each side (a pool block belongs to one group)
    G = layout.num_groups
    lens = [draw(st.integers(0, 2)) for _ in range(G)]
    assume(sum(lens) <= nb - 1)
    lpool = draw(st.permutations(range(1, nb)))
    lids, at = [], 0
    for n in lens:
        lids.append(list(lpool[at:at + n]))
        at += n
    rlens = [n * (1 if spec.kind == GroupKind.MAMBA else ratio) for n, spec in zip(lens, layout.groups)]
    rpool = draw(st.permutations(range(1, nb * ratio)))
    rids, at = [], 0
    for n in rlens:
        rids.append(list(rpool[at:at + n]))
        at += n
    return layout, shard, tp_l, d, tp_r, ratio, lplan, rplans, lids, rids


@given(cases())
def test_every_needed_byte_read_once_from_the_oracle_source(case):
    layout, shard, tp_l, d, tp_r, ratio, lplan, rplans, lids, rids = case
    m = TpMapping(layout, [GroupSharding(*s) for s in shard], local_tp=tp_l, local_rank=d,
                  remote_tp=tp_r)
    pairs = build_pair_plans(m, lplan, {p: rplans[p] for p in m.remote_ranks},
                             block_size_ratio=ratio)
    want = expected_sources(layout, shard, lplan, rplans, tp_l, d, tp_r, lids, rids, ratio)
    got = simulate_reads(pairs, lids, rids)
    assert set(got) == set(want)
    for addr, srcs in got.items():
        assert srcs == [want[addr]], addr


@given(st.sampled_from([1, 2, 3, 4, 6, 8]), st.sampled_from(TPS), st.sampled_from(TPS))
def test_slices_partition_local_heads_in_order(h, tp_l, tp_r):
    assume(_valid(h, tp_l) and _valid(h, tp_r))
    layout = full_sliding_layout()
    for d in range(tp_l):
        m = TpMapping(layout, [GroupSharding(h, 2)] * 2, local_tp=tp_l, local_rank=d, remote_tp=tp_r)
        for g in range(2):
            heads = [x for s in m.slices[g] for x in range(s.start, s.stop)]
            assert heads == oracle_heads(h, tp_l, d)
            for s in m.slices[g]:
                rheads = oracle_heads(h, tp_r, s.remote_rank)
                assert rheads[s.remote_index:s.remote_index + s.num_heads] == list(range(s.start, s.stop))


@given(cases())
def test_per_layer_pair_ids_partition_the_pair_ids(case):
    """Layer-wise push over a TP pair: the layers' descriptor ids (local and remote) are a
    partition of the pair's request ids, paired index-for-index with equal lengths."""
    from hmacore.layerwise import LayerPlan
    layout, shard, tp_l, d, tp_r, ratio, lplan, rplans, lids, rids = case
    assume(ratio == 1)
    m = TpMapping(layout, [GroupSharding(*s) for s in shard], local_tp=tp_l, local_rank=d,
                  remote_tp=tp_r)
    for p, pair in build_pair_plans(m, lplan, {p: rplans[p] for p in m.remote_ranks}).items():
        full_l, full_r = pair.desc_ids(lids, rids)
        ll, rl = LayerPlan(pair.local), LayerPlan(pair.remote)
        assert ll.layers == rl.layers
        served = [ids if g in pair.groups else [] for g, ids in enumerate(lids)]
        rserved = [ids if g in pair.groups else [] for g, ids in enumerate(rids)]
        got = {}
        ldesc, rdesc = pair.local.descriptors(), pair.remote.descriptors()
        for layer in ll.layers:
            a, b = ll.desc_ids(layer, served), rl.desc_ids(layer, rserved)
            assert len(a) == len(b)
            assert (ldesc[a, 1] == rdesc[b, 1]).all()
            for x, y in zip(a.tolist(), b.tolist()):
                assert x not in got
                got[x] = y
        assert got == dict(zip(full_l.tolist(), full_r.tolist()))
