"""Hypothesis: the Cython flattening equals the plain-Python oracle; plans built from real
paged memory address exactly the pages of the right layers."""
import numpy as np
from hypothesis import assume, given, strategies as st

from hmacore.errors import BlockTableError
from hmacore.demo.paged_memory import allocate_paged_kv
from hmacore.plan import Region, TransferPlan
from hmacore.spec import GroupKind, GroupSpec, KVLayout

from oracle_plan import oracle_desc_ids

KINDS = [GroupKind.FULL, GroupKind.SLIDING_WINDOW, GroupKind.CHUNKED_LOCAL, GroupKind.MAMBA]


def _spec(kind, bs, layers, **kw):
    if kind == GroupKind.SLIDING_WINDOW:
        kw["sliding_window"] = bs * 2
    if kind == GroupKind.CHUNKED_LOCAL:
        kw["chunk_size"] = bs * 4
    return GroupSpec(kind, bs, layers, **kw)


@st.composite
def plans(draw):
    kinds = draw(st.lists(st.sampled_from(KINDS), min_size=1, max_size=5))
    layout = KVLayout(groups=tuple(_spec(k, 16, (f"g{g}",)) for g, k in enumerate(kinds)))
    gstate = [k == GroupKind.MAMBA for k in kinds]
    n_attn = draw(st.integers(0, 5))
    n_state = draw(st.integers(0, 4))
    logical = draw(st.integers(2, 60))
    regions = []
    for i in range(n_attn + n_state):
        state = i >= n_attn
        owners = [-1] + [g for g in range(len(kinds)) if gstate[g] == state]
        regions.append(Region(i * 10**6, 64, 64, logical,
                              1 if state else draw(st.sampled_from([1, 2, 4, 16])),
                              draw(st.sampled_from(owners)), state, (f"r{i}",)))
    if not regions:
        regions.append(Region(0, 64, 64, logical, 1, -1, False, ("r0",)))
    plan = TransferPlan(layout, regions)
    return plan, gstate


def _served(plan, gstate, g):
    return any(bool(r.state) == gstate[g] and r.group in (-1, g) for r in plan.regions)


@given(data=st.data(), pg=plans())
def test_flatten_matches_oracle(data, pg):
    plan, gstate = pg
    logical = plan.regions[0].logical_blocks
    kernel_ids = data.draw(st.booleans())
    table = []
    for g in range(plan.layout.num_groups):
        if not _served(plan, gstate, g):
            table.append([])
            continue
        hi = logical
        if kernel_ids and not gstate[g]:
            # kernel ids must fit every attention region serving g: use the smallest ratio
            hi = logical * min(r.ratio for r in plan.regions if not r.state and r.group in (-1, g))
        lo = 1 if not (kernel_ids and not gstate[g]) else \
            max(r.ratio for r in plan.regions if not r.state and r.group in (-1, g))
        if lo >= hi:
            table.append([])
            continue
        table.append(data.draw(st.lists(st.integers(lo, hi - 1), max_size=12)))
    want = oracle_desc_ids([(r.logical_blocks, r.ratio, r.group, r.state) for r in plan.regions],
                           gstate, table, group_major=plan.group_major, kernel_ids=kernel_ids)
    got = plan.desc_ids(table, kernel_ids=kernel_ids)
    assert got.dtype == np.int64 and got.tolist() == want
    assert plan.count_desc_ids(table, kernel_ids=kernel_ids) == len(want)
    out = np.full(len(want) + 3, -1, np.int64)
    assert plan.desc_ids([np.asarray(t, np.int64) for t in table], out=out,
                         kernel_ids=kernel_ids).tolist() == want
    assert (out[len(want):] == -1).all()
    if want:
        assert 0 <= min(want) and max(want) < plan.num_descs


@given(data=st.data(), pg=plans())
def test_out_of_range_rejected_and_nothing_written(data, pg):
    plan, gstate = pg
    served = [g for g in range(plan.layout.num_groups) if _served(plan, gstate, g)]
    assume(served)
    g = data.draw(st.sampled_from(served))
    logical = plan.regions[0].logical_blocks
    bad = data.draw(st.one_of(st.integers(-2**31, 0), st.integers(logical, 2**31 - 1)))
    table = [[] for _ in range(plan.layout.num_groups)]
    table[g] = [1, bad]
    out = np.full(4096, 7, np.int64)
    try:
        plan.desc_ids(table, out=out)
        raise AssertionError("accepted an out-of-range id")
    except BlockTableError as e:
        assert e.group == g and e.block_index == 1
    assert (out == 7).all()


@st.composite
def paged_layouts(draw):
    n = draw(st.integers(1, 4))
    groups, pages = [], []
    for g in range(n):
        kind = draw(st.sampled_from(KINDS))
        nl = draw(st.integers(1, 3))
        mla = kind != GroupKind.MAMBA and draw(st.booleans())
        groups.append(_spec(kind, 16, tuple(f"L{g}.{i}" for i in range(nl)), mla=mla))
        pages.append(draw(st.sampled_from([32, 64, 96])))
    if draw(st.booleans()):
        pages = [pages[0]] * n  # classic HMA: one page size, aliased slots
    kv_split = draw(st.booleans())
    kernel = draw(st.sampled_from([None, 8, 4]))  # bs 16 -> kernel ratio 1, 2 or 4
    return KVLayout(groups=tuple(groups)), pages, kv_split, kernel


def _merged(intervals):
    out = []
    for a, n in sorted(intervals):
        if out and a == out[-1][0] + out[-1][1]:
            out[-1][1] += n
        else:
            out.append([a, n])
    return out


@given(data=st.data(), lp=paged_layouts())
def test_groups_address_only_their_own_pages(data, lp):
    layout, pages, kv_split, kernel = lp
    nb = 9
    paged = allocate_paged_kv(layout, nb, page_bytes=pages, kv_split=kv_split, state_parts=2)
    plan = TransferPlan.from_kv_caches(layout, paged.kv_caches, num_blocks=nb,
                                       kernel_block_size=kernel)
    twin = allocate_paged_kv(layout, nb, page_bytes=pages, kv_split=kv_split, state_parts=2)
    remote = TransferPlan.from_region_table(layout, TransferPlan.from_kv_caches(
        layout, twin.kv_caches, num_blocks=nb, kernel_block_size=kernel).region_table())
    rows = plan.descriptors()
    ids_all = data.draw(st.permutations(range(1, nb)))
    table, k = [], 0
    for g in range(layout.num_groups):  # disjoint ids across groups, as a shared pool gives
        m = data.draw(st.integers(0, min(3, nb - 1 - k)))
        table.append(sorted(ids_all[k:k + m]))
        k += m
    ids = plan.desc_ids(table)
    assert ids.tolist() == remote.desc_ids(table).tolist()
    got = [(int(rows[i, 0]), int(rows[i, 1])) for i in ids]
    assert len(set(got)) == len(got)  # no byte range moved twice
    want = []
    for g, blocks in enumerate(table):
        for name in layout.groups[g].layer_names:
            arr = paged.kv_caches[name]
            parts = list(arr) if isinstance(arr, tuple) else ([arr[0], arr[1]] if arr.ndim == 3 else [arr])
            for p in parts:
                want += [(p[b].ctypes.data, p[b].nbytes) for b in blocks]
    assert _merged(got) == _merged(want)
    assert plan.desc_bytes(ids) == sum(n for _, n in want)


@given(data=st.data(), pg=plans(), r=st.sampled_from([1, 2, 4]))
def test_peer_block_size_ratio_matches_oracle(data, pg, r):
    plan, gstate = pg
    split = plan.with_block_size_ratio(r)
    logical = plan.regions[0].logical_blocks
    table = [data.draw(st.lists(st.integers(1, logical - 1), max_size=6))
             if _served(plan, gstate, g) else [] for g in range(plan.layout.num_groups)]
    want = oracle_desc_ids([(x.logical_blocks, x.ratio * (1 if x.state else r), x.group, x.state)
                            for x in plan.regions], gstate, table, group_major=plan.group_major)
    assert split.desc_ids(table).tolist() == want


@given(data=st.data(), pg=plans())
def test_pair_ids32_matches_desc_ids_or_declines(data, pg):
    """NixlAgent's fast path: int32 desc ids of both sides, a private copy of the local ids and
    the bytes moved -- exactly what desc_ids / table_bytes give -- or None (checked path)."""
    plan, gstate = pg
    logical = plan.regions[0].logical_blocks
    G = plan.layout.num_groups
    local, remote = [], []
    for g in range(G):
        n = data.draw(st.integers(0, 8)) if _served(plan, gstate, g) else 0
        local.append(data.draw(st.lists(st.integers(1, logical - 1), min_size=n, max_size=n)))
        remote.append(data.draw(st.lists(st.integers(1, logical - 1), min_size=n, max_size=n)))
    # sometimes break the fast form: a list group, an int64 group, a bad id, unequal lengths
    spoil = data.draw(st.sampled_from([None, "list", "int64", "bad", "len"]))
    la = [np.asarray(x, np.int32) for x in local]
    ra = [np.asarray(x, np.int32) for x in remote]
    g = data.draw(st.integers(0, G - 1))
    if spoil == "list":
        la[g] = local[g]
    elif spoil == "int64":
        ra[g] = ra[g].astype(np.int64)
    elif spoil == "bad" and _served(plan, gstate, g):
        ra[g] = np.append(ra[g], np.int32(data.draw(st.sampled_from([0, logical])))).astype(np.int32)
        la[g] = np.append(la[g], np.int32(1)).astype(np.int32)
    elif spoil == "len" and _served(plan, gstate, g):
        la[g] = np.append(la[g], np.int32(1)).astype(np.int32)
    else:
        spoil = None
    gb = plan._group_block_bytes
    got = plan._desc.pair_ids32(plan._desc, tuple(la), ra, gb)
    if spoil is not None:
        assert got is None
        return
    lids, rids, copy, nbytes = got
    assert lids.dtype == rids.dtype == np.int32
    assert lids.tolist() == plan.desc_ids(local).tolist()
    assert rids.tolist() == plan.desc_ids(remote).tolist()
    assert nbytes == plan.table_bytes([len(x) for x in local])
    assert [c.tolist() for c in copy] == local
    assert all(c.dtype == np.int32 and c.flags.c_contiguous and c.base is None for c in copy)
    assert not any(np.shares_memory(c, x) for c, x in zip(copy, la))


def test_pair_ids32_declines_mismatched_plans():
    plan = TransferPlan(KVLayout(groups=(_spec(GroupKind.FULL, 16, ("a",)),)),
                        [Region(0, 64, 64, 8, 1, -1, False, ("r0",))])
    other = TransferPlan(KVLayout(groups=(_spec(GroupKind.FULL, 16, ("a",)),
                                          _spec(GroupKind.FULL, 16, ("b",)))),
                         [Region(0, 64, 64, 8, 1, -1, False, ("r0",))])
    ids = (np.array([1, 2], np.int32),)
    assert plan._desc.pair_ids32(other._desc, ids, ids + ids, (64, 64)) is None
    assert plan._desc.pair_ids32(plan._desc, ids, ids, (64, 64)) is None   # group_bytes length
    lids, rids, copy, nbytes = plan._desc.pair_ids32(plan._desc, ids, list(ids), (64,))
    assert lids.tolist() == rids.tolist() == [1, 2] and nbytes == 128
