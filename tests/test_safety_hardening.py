"""Silent wrong answers, overflow and atomicity of the core (hits, tables, plan, tp)."""
from __future__ import annotations

import dataclasses
import sys
import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hmacore.errors import BlockTableError, HashInputError, LayoutError, TrackerStateError
from hmacore.hits import ExistenceSet, HitFinder
from hmacore.plan import TransferPlan
from hmacore.spec import GroupKind, GroupSpec, KVLayout, MambaMode
from hmacore.tables import TrackerSet, to_tuple, to_wire
from hmacore.tp import GroupSharding, TpMapping, kv_heads_of_rank

from hits_scenarios import layouts, make_hashes, populate
from oracle_hits import OracleFinder

BIG = 2**63 - 1


# -- 4a. saturating arithmetic in the hit kernel -----------------------------------------------
def _eagle_layout():
    return KVLayout(groups=(GroupSpec(GroupKind.FULL, 4, ("f",)),
                            GroupSpec(GroupKind.SLIDING_WINDOW, 4, ("s",), sliding_window=8)))


@pytest.mark.parametrize("max_length", [BIG, BIG - 1, BIG - 3, 2**62, sys.maxsize])
def test_eagle_hit_with_max_length_near_2_63_is_not_zero(max_length):
    layout = _eagle_layout()
    finder = HitFinder(layout, eagle=True)
    oracle = OracleFinder(layout, eagle=True)
    hashes = make_hashes(40, 16, 1)
    es = ExistenceSet(16)
    for g in finder.group_ids:
        es.add_many(g, hashes)
    raw = [bytes(r) for r in hashes]
    py = {(g, r) for g in finder.group_ids for r in raw}
    want, _ = oracle.longest_hit(raw, py, max_length)
    got = finder.longest_hit(hashes, es, max_length)
    assert want > 0 and got.tokens == want


@given(data=st.data(), layout=layouts(), ds=st.sampled_from([16, 32]),
       top=st.integers(0, 2**20))
def test_huge_max_length_matches_oracle(data, layout, ds, top):
    try:
        finder = HitFinder(layout, eagle=True)
    except LayoutError:
        return
    oracle = OracleFinder(layout, eagle=True)
    n = data.draw(st.integers(0, 40))
    hashes = make_hashes(n, ds, data.draw(st.integers(0, 2**32 - 1)))
    es, py = populate(data, finder, oracle, hashes, ds)
    max_length = BIG - top
    raw = [bytes(r) for r in hashes]
    got = finder.longest_hit(hashes, es, max_length)
    want_tokens, want_masks = oracle.longest_hit(raw, py, max_length)
    assert got.tokens == want_tokens
    assert [m.tolist() for m in got.masks] == [[int(b) for b in m] for m in want_masks]


def test_max_length_past_2_63_is_refused():
    finder = HitFinder(_eagle_layout())
    with pytest.raises(HashInputError, match="2\\*\\*63"):
        finder.hit_tokens(make_hashes(1, 16, 0), None, 2**63)


# -- 4b. merge key = vLLM's spec equality -----------------------------------------------------
def test_twin_groups_with_different_head_shapes_are_not_merged():
    # 8 heads x 128 and 16 heads x 64 have the same page bytes: vLLM's specs differ
    a = GroupSpec(GroupKind.SLIDING_WINDOW, 16, ("a",), sliding_window=64, page_bytes=32768,
                  num_kv_heads=8, head_size=128, dtype="bfloat16")
    b = GroupSpec(GroupKind.SLIDING_WINDOW, 16, ("b",), sliding_window=64, page_bytes=32768,
                  num_kv_heads=16, head_size=64, dtype="bfloat16")
    c = dataclasses.replace(a, layer_names=("c",))
    f = GroupSpec(GroupKind.FULL, 16, ("f",), page_bytes=32768)
    finder = HitFinder(KVLayout(groups=(f, a, b, c)))
    assert sorted(sg.group_ids for sg in finder.spec_groups) == [(0,), (1, 3), (2,)]
    d = dataclasses.replace(a, layer_names=("d",), dtype="float8_e4m3")
    finder = HitFinder(KVLayout(groups=(f, a, d)))
    assert sorted(sg.group_ids for sg in finder.spec_groups) == [(0,), (1,), (2,)]


def test_merge_key_without_head_fields_keeps_page_bytes_and_mla():
    f = GroupSpec(GroupKind.FULL, 16, ("f",), page_bytes=100)
    g = GroupSpec(GroupKind.FULL, 16, ("g",), page_bytes=200)
    m = GroupSpec(GroupKind.FULL, 16, ("m",), page_bytes=100, mla=True)
    h = GroupSpec(GroupKind.FULL, 16, ("h",), page_bytes=100)
    finder = HitFinder(KVLayout(groups=(f, g, m, h)))
    assert sorted(sg.group_ids for sg in finder.spec_groups) == [(0, 3), (1,), (2,)]


def test_split_twins_hit_matches_the_oracle():
    a = GroupSpec(GroupKind.SLIDING_WINDOW, 4, ("a",), sliding_window=9, page_bytes=64,
                  num_kv_heads=2, head_size=8)
    b = GroupSpec(GroupKind.SLIDING_WINDOW, 4, ("b",), sliding_window=9, page_bytes=64,
                  num_kv_heads=4, head_size=4)
    layout = KVLayout(groups=(GroupSpec(GroupKind.FULL, 4, ("f",)), a, b))
    finder, oracle = HitFinder(layout, eagle=True), OracleFinder(layout, eagle=True)
    hashes = make_hashes(30, 16, 2)
    raw = [bytes(r) for r in hashes]
    es, py = ExistenceSet(16), set()
    for g, rows in ((0, range(30)), (1, [*range(0, 20), *range(22, 30)]),
                    (2, [*range(0, 25), *range(27, 30)])):
        for r in rows:
            es.add(g, raw[r])
            py.add((g, raw[r]))
    for ml in (10, 50, 100, 119):
        assert finder.longest_hit(hashes, es, ml).tokens == oracle.longest_hit(raw, py, ml)[0]


# -- 5. overflow / atomicity -------------------------------------------------------------------
LAYOUT = KVLayout(groups=(GroupSpec(GroupKind.FULL, 16, ("a",)),
                          GroupSpec(GroupKind.SLIDING_WINDOW, 16, ("b",), sliding_window=32)),
                  num_blocks=100)


@pytest.mark.parametrize("bad", [2**63, 2**64, -1, 1.5, True, "3"])
def test_add_with_bad_prompt_tokens_stores_nothing(bad):
    ts = TrackerSet(LAYOUT)
    with pytest.raises(TrackerStateError) as e:
        ts.add("r", ([1, 2], [3]), num_prompt_tokens=bad)
    assert isinstance(e.value, ValueError)
    assert "r" not in ts and len(ts) == 0
    ts.add("r", ([1, 2], [3]), num_prompt_tokens=BIG)      # the largest count still fits
    assert ts.num_prompt_tokens("r") == BIG


@pytest.mark.parametrize("setter", ["set_scheduled_tokens", "set_saved_tokens",
                                    "set_loaded_tokens"])
def test_watermark_past_int64_is_the_library_error(setter):
    ts = TrackerSet(LAYOUT)
    ts.add("r", ([1], [2]))
    getattr(ts, setter)("r", 5)
    with pytest.raises(TrackerStateError) as e:
        getattr(ts, setter)("r", 2**63)
    assert isinstance(e.value, ValueError)
    getattr(ts, setter)("r", BIG)
    assert getattr(ts, setter.replace("set_", ""))("r") == BIG


@pytest.mark.parametrize("cap", [2**61, 2**61 + 5, 2**62 - 1, 2**62, 2**63 - 1])
def test_existence_set_refuses_capacities_it_cannot_honour(cap):
    with pytest.raises(HashInputError, match="capacity"):
        ExistenceSet(32, capacity=cap)


def test_existence_set_capacity_is_honoured():
    es = ExistenceSet(16, capacity=1000)
    assert es.capacity * 3 >= 1000 * 4


def test_add_many_of_present_keys_does_not_grow_the_table():
    es = ExistenceSet(16)
    rows = np.ascontiguousarray(np.random.default_rng(0).integers(0, 256, (50000, 16),
                                                                    dtype=np.uint8))
    assert es.add_many(1, rows) == 50000
    cap = es.capacity
    for _ in range(3):
        assert es.add_many(1, rows) == 0
        assert es.capacity == cap
    doubled = np.ascontiguousarray(np.concatenate([rows, rows]))
    assert es.add_many(2, doubled) == 50000 and es.capacity <= 2 * cap
    assert len(es) == 100000


def test_tp_mapping_with_huge_head_counts_is_fast_or_refused():
    layout = KVLayout(groups=(GroupSpec(GroupKind.FULL, 16, ("a",)),))
    t0 = time.perf_counter()
    for heads in (2**30, 2**40):
        try:
            m = TpMapping(layout, [GroupSharding(heads, 2)], local_tp=1, local_rank=0,
                          remote_tp=2)
        except LayoutError as e:
            assert "num_heads" in str(e)
        else:
            assert [(s.start, s.stop) for s in m.slices[0]] == [(0, heads // 2),
                                                                 (heads // 2, heads)]
    assert time.perf_counter() - t0 < 1.0


@pytest.mark.parametrize("h,ltp,rtp", [(8, 2, 4), (8, 4, 2), (4, 2, 8), (2, 4, 8), (8, 8, 8),
                                       (6, 3, 6), (1, 1, 4), (16, 1, 4), (12, 4, 24)])
def test_tp_slices_unchanged(h, ltp, rtp):
    layout = KVLayout(groups=(GroupSpec(GroupKind.FULL, 16, ("a",)),))
    for rank in range(ltp):
        m = TpMapping(layout, [GroupSharding(h, 2)], local_tp=ltp, local_rank=rank, remote_tp=rtp)
        lo, hi = kv_heads_of_rank(h, ltp, rank)
        want = []
        for head in range(lo, hi):    # the per-head definition
            p = head // (h // rtp) if rtp <= h else head * (rtp // h) + rank % (rtp // h)
            if want and want[-1][0] == p and want[-1][2] == head:
                want[-1][2] = head + 1
            else:
                want.append([p, head, head + 1])
        assert [[s.remote_rank, s.start, s.stop] for s in m.slices[0]] == want


def _plan():
    return TransferPlan.from_layout(LAYOUT, 100, page_bytes=64)


@pytest.mark.parametrize("lengths", [[-2, 1], [1, -1], [2.7, 1], [1, True], ["1", 1],
                                     [np.float64(2.0), 1], [None, 1]])
def test_table_bytes_refuses_non_counts(lengths):
    with pytest.raises(BlockTableError):
        _plan().table_bytes(lengths)


def test_table_bytes_accepts_numpy_ints():
    p = _plan()
    assert p.table_bytes([np.int64(2), 1]) == p.table_bytes([2, 1]) > 0


@pytest.mark.parametrize("ids", [[2.7], np.array([2.7]), [True], np.array([True]), ["1"]])
def test_desc_bytes_refuses_non_integers(ids):
    with pytest.raises(BlockTableError):
        _plan().desc_bytes(ids)


@pytest.mark.parametrize("table", [[[2.7, 1]], [[1, -2]], [[True]], [np.array([2.7])],
                                   [np.array([-1], np.int64)], [[2**31]], [None]])
def test_to_wire_refuses_non_ids(table):
    with pytest.raises(BlockTableError):
        to_wire(table)
    with pytest.raises(BlockTableError):
        to_tuple(table)


def test_to_wire_keeps_valid_tables():
    assert to_wire([[1, 2], np.array([3], np.int32), (np.int64(4),), []]) == \
        [[1, 2], [3], [4], []]
    assert all(type(x) is int for g in to_wire([np.array([5], np.uint8)]) for x in g)
