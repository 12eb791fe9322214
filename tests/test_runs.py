"""The run planner (hmacore.runs): maximal runs against a plain-Python oracle over the
per-block plan, byte for byte on real memory, on block-major / layer-major / K-V split pages,
ascending, descending and scattered tables; bad input refused."""
import ctypes
import os
import pickle

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from hmacore.errors import BlockTableError, LayoutError
from hmacore.plan import TransferPlan
from hmacore.runs import (DescTable, RunPlanner, buffer_runs, desc_table, find_runs,
                          plan_table)
from hmacore.spec import GroupKind, GroupSpec, KVLayout


def oracle_runs(lrows, lids, rrows, rids):
    """Maximal runs by sorting: per pair (local addr, remote addr, len, devs), grouped by
    (remote - local, devs), sorted by local address, abutting intervals merged."""
    pairs = []
    for i, j in zip(lids, rids):
        la, ln, ld = (int(v) for v in lrows[i])
        ra, rn, rd = (int(v) for v in rrows[j])
        assert ln == rn
        pairs.append((ra - la, ld, rd, la, ra, ln))
    pairs.sort()
    out = []
    for d, ld, rd, la, ra, ln in pairs:
        if out and out[-1][0] == (d, ld, rd) and out[-1][1] + out[-1][3] == la:
            out[-1][3] += ln
        else:
            out.append([(d, ld, rd), la, ra, ln])
    return sorted((la, ra, ln, k[1], k[2]) for k, la, ra, ln in out)


def ours(runs):
    return sorted((int(a), int(b), int(n), int(d), int(e))
                  for (a, n, d), (b, _, e) in zip(runs.local.tolist(), runs.remote.tolist()))


def check_order(runs, lrows, lids, rrows, rids):
    """``order`` is a permutation whose consecutive merge by address gives the same runs;
    merging only consecutive ids as well (NIXL's merge of prepped ids) gives
    ``num_runs + index_breaks``."""
    order = runs.order
    assert sorted(order.tolist()) == list(range(len(lids)))
    merged = by_ids = 0
    prev = None
    for k in order.tolist():
        la, ln, _ = (int(v) for v in lrows[lids[k]])
        ra = int(rrows[rids[k]][0])
        if prev is None or prev[0] != la or prev[1] != ra:
            merged += 1
            by_ids += 1
        elif prev[2] + 1 != lids[k] or prev[3] + 1 != rids[k]:
            by_ids += 1
        prev = (la + ln, ra + ln, int(lids[k]), int(rids[k]))
    assert merged == runs.num_runs
    assert by_ids == runs.num_runs + runs.index_breaks


def _layout(kinds=(GroupKind.FULL,), layers=2):
    groups = []
    for g, k in enumerate(kinds):
        kw = {"sliding_window": 64} if k == GroupKind.SLIDING_WINDOW else {}
        groups.append(GroupSpec(k, 16, tuple(f"m.{g}.{j}" for j in range(layers)), **kw))
    return KVLayout(groups=tuple(groups))


def _memory(layout, num_blocks, page, arrangement):
    """kv_caches of one side: 'layer' (a tensor per layer), 'block' (one [blocks, layers,
    page] allocation: a block's layer slots adjacent) or 'kv' ((2, blocks, page/2) per
    layer, K then V)."""
    names = [n for g in layout.groups for n in g.layer_names]
    if arrangement == "block":
        mem = np.random.randint(0, 255, (num_blocks, len(names), page), dtype=np.uint8)
        return mem, {n: mem[:, j, :] for j, n in enumerate(names)}
    if arrangement == "kv":
        mem = np.random.randint(0, 255, (len(names), 2, num_blocks, page // 2), dtype=np.uint8)
        return mem, {n: mem[j] for j, n in enumerate(names)}
    mem = np.random.randint(0, 255, (len(names), num_blocks, page), dtype=np.uint8)
    return mem, {n: mem[j] for j, n in enumerate(names)}


def _copy_pairs(lrows, lids, rrows, rids):
    for i, j in zip(lids, rids):
        ctypes.memmove(int(lrows[i][0]), int(rrows[j][0]), int(lrows[i][1]))


def _copy_runs(runs):
    for (la, n, _), (ra, _, _) in zip(runs.local.tolist(), runs.remote.tolist()):
        ctypes.memmove(la, ra, n)


tables = st.sampled_from(["ascending", "descending", "scattered", "mixed"])


def _ids(draw, kind, num_blocks, n):
    pool = list(range(1, num_blocks))
    if kind == "ascending":
        s = draw(st.integers(1, num_blocks - n))
        return list(range(s, s + n))
    if kind == "descending":
        s = draw(st.integers(n, num_blocks - 1))
        return list(range(s, s - n, -1))
    if kind == "scattered":
        return draw(st.permutations(pool))[:n]
    out, left = [], draw(st.permutations(pool))
    while len(out) < n:                    # runs of random lengths, up or down
        k = draw(st.integers(1, 5))
        s = left.pop()
        step = draw(st.sampled_from([1, -1]))
        run = [s + step * i for i in range(k) if 1 <= s + step * i < num_blocks]
        out += [b for b in run if b not in out]
    return out[:n]


# each example allocates and copies a few hundred KiB: at most 300 even under CI's 2000
@settings(max_examples=min(300, int(os.environ.get("HMACORE_EXAMPLES", "2000"))), deadline=None)
@given(data=st.data(), arrangement=st.sampled_from(["layer", "block", "kv"]),
       groups=st.sampled_from([(GroupKind.FULL,), (GroupKind.FULL, GroupKind.SLIDING_WINDOW)]),
       local_kind=tables, remote_kind=tables)
def test_runs_match_oracle_and_bytes(data, arrangement, groups, local_kind, remote_kind):
    nb, page = 24, 32
    layout = _layout(groups, layers=data.draw(st.integers(1, 3)))
    lmem, lkv = _memory(layout, nb, page, arrangement)
    # the remote side: any arrangement with the same region shapes (K/V split pairs only
    # with K/V split; layer- and block-major pages pair with each other)
    rarr = "kv" if arrangement == "kv" else data.draw(st.sampled_from(["layer", "block"]))
    rmem, rkv = _memory(layout, nb, page, rarr)
    lplan = TransferPlan.from_kv_caches(layout, lkv, num_blocks=nb)
    rplan = TransferPlan.from_kv_caches(layout, rkv, num_blocks=nb)
    # one shared pool: groups take disjoint ids on each side
    G = layout.num_groups
    counts = [data.draw(st.integers(0, 6)) for _ in range(G)]
    lall = _ids(data.draw, local_kind, nb, sum(counts))
    rall = _ids(data.draw, remote_kind, nb, sum(counts))
    cut = np.cumsum([0] + counts)
    local = [lall[cut[g]:cut[g + 1]] for g in range(G)]
    remote = [rall[cut[g]:cut[g + 1]] for g in range(G)]
    planner = RunPlanner(lplan, rplan)
    runs = planner.runs(local, remote, order=True)
    lrows, rrows = lplan.descriptors(), rplan.descriptors()
    lids, rids = lplan.desc_ids(local), rplan.desc_ids(remote)
    assert ours(runs) == oracle_runs(lrows, lids, rrows, rids)
    assert runs.block_descriptors == lids.size
    assert runs.nbytes == lplan.desc_bytes(lids)
    check_order(runs, lrows, lids, rrows, rids)
    # byte for byte: the runs write exactly what the per-block descriptors write
    per_block = lmem.copy()
    _copy_pairs(lrows, lids, rrows, rids)
    by_block, lmem[...] = lmem.copy(), per_block
    _copy_runs(runs)
    assert np.array_equal(lmem, by_block)


def test_fresh_block_major_is_one_run_per_request():
    """A block's layer slots adjacent and consecutive ids: the whole request is one run."""
    layout = _layout(layers=4)
    _, lkv = _memory(layout, 64, 1024, "block")
    _, rkv = _memory(layout, 64, 1024, "block")
    planner = RunPlanner(TransferPlan.from_kv_caches(layout, lkv, num_blocks=64),
                         TransferPlan.from_kv_caches(layout, rkv, num_blocks=64))
    runs = planner.runs([list(range(5, 37))], [list(range(20, 52))])
    assert (runs.num_runs, runs.block_descriptors) == (1, 32 * 4)
    assert runs.local[0, 1] == 32 * 4 * 1024
    down = planner.runs([list(range(36, 4, -1))], [list(range(51, 19, -1))])   # eviction order
    assert down.num_runs == 1
    # layer-major pages: one run per layer (the lower bound for that layout)
    _, lkv = _memory(layout, 64, 1024, "layer")
    _, rkv = _memory(layout, 64, 1024, "layer")
    planner = RunPlanner(TransferPlan.from_kv_caches(layout, lkv, num_blocks=64),
                         TransferPlan.from_kv_caches(layout, rkv, num_blocks=64))
    assert planner.runs([list(range(36, 4, -1))], [list(range(51, 19, -1))]).num_runs == 4


def test_gaps_and_mismatched_directions_never_merge():
    rows = np.array([[1000 + 64 * i, 64, 0] for i in range(10)], dtype=np.uint64)
    t = desc_table(rows)
    assert find_runs(t, [0, 1, 3], t, [5, 6, 8]).num_runs == 2        # gap at 2 / 7
    assert find_runs(t, [0, 1, 2], t, [8, 7, 6]).num_runs == 3        # up locally, down remotely
    assert find_runs(t, [2, 1, 0], t, [8, 7, 6]).num_runs == 1        # down on both sides
    assert find_runs(t, [0, 1], t, [0, 1]).num_runs == 1
    assert find_runs(t, [], t, []).num_runs == 0
    # devices and registration domains are barriers
    rows2 = rows.copy()
    rows2[5:, 2] = 1
    t2 = desc_table(rows2)
    assert find_runs(t2, [4, 5], t2, [4, 5]).num_runs == 2
    t3 = desc_table(rows, [(1000, 64 * 5, 0), (1000 + 64 * 5, 64 * 5, 0)])
    assert find_runs(t3, [4, 5], t3, [4, 5]).num_runs == 2
    assert find_runs(t3, [3, 4], t3, [3, 4]).num_runs == 1


def test_duplicate_pairs_keep_every_byte():
    rows = np.array([[64 * i, 64, 0] for i in range(1, 9)], dtype=np.uint64)
    t = desc_table(rows)
    r = find_runs(t, [1, 2, 1, 2], t, [3, 4, 3, 4], order=True)
    assert r.nbytes == 4 * 64 and sorted(r.order.tolist()) == [0, 1, 2, 3]


def test_bad_input_is_refused():
    rows = np.array([[64 * i, 64, 0] for i in range(1, 9)], dtype=np.uint64)
    t = desc_table(rows)
    with pytest.raises(BlockTableError, match="local_ids must lie"):
        find_runs(t, [8], t, [0])
    with pytest.raises(BlockTableError, match="remote_ids must lie"):
        find_runs(t, [0], t, [-1])
    with pytest.raises(BlockTableError, match="1 local vs 2 remote"):
        find_runs(t, [0], t, [0, 1])
    with pytest.raises(BlockTableError, match="integer"):
        find_runs(t, np.array([0.5]), t, [0])
    with pytest.raises(BlockTableError, match="integer"):
        find_runs(t, np.array([True]), t, [0])
    short = desc_table(np.array([[0, 32, 0]], dtype=np.uint64))
    with pytest.raises(BlockTableError, match="differ in length"):
        find_runs(t, [0], short, [0])
    with pytest.raises(LayoutError, match="length > 0"):
        DescTable(np.array([[0, 0, 0]], dtype=np.uint64))
    with pytest.raises(LayoutError, match="N x 3"):
        DescTable(np.zeros((2, 2), dtype=np.uint64))
    with pytest.raises(LayoutError, match="outside every registered range"):
        desc_table(rows, [(64, 128, 0)])
    with pytest.raises(LayoutError, match="overlap"):
        desc_table(rows, [(0, 128, 0), (64, 128, 0)])


def test_table_roundtrip_and_pickle():
    layout = _layout(layers=3)
    _, kv = _memory(layout, 16, 64, "kv")
    plan = TransferPlan.from_kv_caches(layout, kv, num_blocks=16)
    t = plan_table(plan)
    assert np.array_equal(t.rows(), plan.descriptors())
    assert t.num_segments <= len(plan.regions)        # O(regions), not O(descriptors)
    t2 = pickle.loads(pickle.dumps(t))
    assert np.array_equal(t2.rows(), t.rows())


def test_buffer_runs_merge_adjacent_buffers_only_inside_a_key():
    parts = [[(100, 10), (110, 5), (200, 5)], [(205, 5)], [], [(0, 4), (4, 4)]]
    assert buffer_runs(parts) == [[(100, 15), (200, 5)], [(205, 5)], [], [(0, 8)]]
    with pytest.raises(BlockTableError, match="buffer 0"):
        buffer_runs([[(-1, 4)]])


def test_buffer_runs_never_span_two_registered_buffers():
    parts = [[(100, 10), (110, 10), (120, 10)], [(500, 4), (504, 4)]]
    # 100..120 registered as one buffer, 120.. as another; 500.. is not registered at all
    assert buffer_runs(parts, [(100, 20), (120, 100)]) == \
        [[(100, 20), (120, 10)], [(500, 4), (504, 4)]]
    assert buffer_runs(parts, [(100, 1000)]) == [[(100, 30)], [(500, 8)]]


def test_span_ranges_merge_touching_rows_per_device():
    from hmacore.runs import span_ranges
    rows = [(100, 10, 0), (110, 10, 0), (130, 5, 0), (120, 10, 1), (50, 60, 0)]
    assert span_ranges(rows) == [(50, 70, 0), (130, 5, 0), (120, 10, 1)]
    layout = _layout(layers=3)
    _, kv = _memory(layout, 16, 64, "layer")
    plan = TransferPlan.from_kv_caches(layout, kv, num_blocks=16)
    assert span_ranges(plan.descriptors()) == plan.registration_ranges()
