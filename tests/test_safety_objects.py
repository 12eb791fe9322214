"""Views into tracker storage, pickling, copying and reprs of the core objects."""
from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest

from hmacore._fast._tables import TableStore
from hmacore.hits import ExistenceSet, HitFinder, HitResult
from hmacore.plan import TransferPlan
from hmacore.presets import get_preset
from hmacore.spec import GroupKind, GroupSpec, KVLayout
from hmacore.tables import RequestState, TrackerSet
from hmacore.windows import clip_tracked, clip_windows

LAYOUT = KVLayout(groups=(GroupSpec(GroupKind.FULL, 16, ("a",)),
                          GroupSpec(GroupKind.SLIDING_WINDOW, 16, ("b",), sliding_window=32)),
                  num_blocks=1000)


def lists(t):
    return [x.tolist() for x in t]


# -- 8. views -------------------------------------------------------------------------------
def test_view_is_not_rewritten_by_a_replace_after_preempt():
    ts = TrackerSet(LAYOUT)
    ts.add("r", ([1, 2, 3], [4, 5]))
    v = ts.block_ids("r", copy=False)
    (c,) = clip_tracked(ts, ["r"])
    ts.preempt("r")
    ts.replace("r", ([7, 8, 9], [10, 11]))
    assert lists(v) == [[1, 2, 3], [4, 5]]          # the snapshot, not request r's new ids
    assert lists(c) == [[1, 2, 3], [4, 5]]
    assert lists(ts.block_ids("r")) == [[7, 8, 9], [10, 11]]


def test_view_is_not_rewritten_by_in_place_nulling():
    ts = TrackerSet(LAYOUT)
    ts.add("r", ([1, 2, 3], [4, 5, 6]))
    v = ts.block_ids("r", copy=False)
    ts.update_after_alloc("r", ([1, 2, 3, 7], [0, 0, 6, 8]))
    assert lists(v) == [[1, 2, 3], [4, 5, 6]]
    assert lists(ts.block_ids("r")) == [[1, 2, 3, 7], [0, 0, 6, 8]]


def test_view_of_a_finished_request_is_not_the_callers_array():
    ts = TrackerSet(LAYOUT)
    ts.add("r", ([1, 2, 3], [4]))
    v = ts.block_ids("r", copy=False)
    out = ts.finish("r")
    assert out[0].flags.writeable
    out[0][:] = 0                                  # the caller owns what finish returns
    assert lists(v) == [[1, 2, 3], [4]]


def test_views_survive_growth_and_later_appends_are_not_seen():
    ts = TrackerSet(LAYOUT)
    ts.add("r", ([1], [2]))
    v = ts.block_ids("r", copy=False)
    for i in range(200):
        ts.append("r", ([3 + i % 90], []))
    assert lists(v) == [[1], [2]]
    assert ts.num_blocks("r") == (201, 1)


def test_views_are_read_only_and_cannot_be_made_writeable():
    ts = TrackerSet(LAYOUT)
    ts.add("r", ([1, 2], [3]))
    v = ts.block_ids("r", copy=False)
    for x in v:
        with pytest.raises(ValueError):
            x[0] = 9
        with pytest.raises(ValueError):
            x.flags.writeable = True


def test_without_views_storage_is_reused_in_place():
    st = TableStore(1)
    s = st.add("r", 0)
    st.append(s, 0, np.arange(1, 50, dtype=np.int32))
    before = st.view_group(s, 0).__array_interface__["data"][0]
    st.clear(s)                               # no view alive: the buffer is reused
    st.append(s, 0, np.arange(1, 10, dtype=np.int32))
    assert st.view_group(s, 0).__array_interface__["data"][0] == before


def test_clip_spans_results_are_independent():
    from hmacore.windows import clip_tracked_spans
    ts = TrackerSet(LAYOUT)
    ts.add("a", ([1, 2, 3], [4, 5, 6, 7, 8]))
    ts.add("b", ([9], [10]))
    x = clip_tracked_spans(ts, ["a"])
    y = clip_tracked_spans(ts, ["b"])
    assert x.tolist() == [[[0, 3], [2, 5]]] and y.tolist() == [[[0, 1], [0, 1]]]


# -- 9. pickling, copying, reprs ---------------------------------------------------------------
def _tracker():
    ts = TrackerSet(LAYOUT)
    ts.add("a", ([1, 2, 3], [4, 5]), num_prompt_tokens=40)
    ts.add(("b", 2), ([6], []))
    ts.set_scheduled_tokens("a", 33)
    ts.set_saved_tokens("a", 16)
    ts.set_state(("b", 2), RequestState.WAITING_FOR_REMOTE)
    ts.preempt(("b", 2))
    ts.add("c", ([7], [8]))
    ts.finish("c")
    return ts


def _same(a: TrackerSet, b: TrackerSet) -> None:
    assert list(a) == list(b) and a.layout == b.layout
    for r in a:
        assert lists(a.block_ids(r)) == lists(b.block_ids(r))
        assert a.state(r) == b.state(r)
        assert (a.scheduled_tokens(r), a.saved_tokens(r), a.loaded_tokens(r),
                a.num_prompt_tokens(r)) == (b.scheduled_tokens(r), b.saved_tokens(r),
                                            b.loaded_tokens(r), b.num_prompt_tokens(r))


@pytest.mark.parametrize("dup", [lambda x: pickle.loads(pickle.dumps(x)), copy.copy,
                                 copy.deepcopy], ids=["pickle", "copy", "deepcopy"])
def test_tracker_set_round_trips_and_copies_are_independent(dup):
    ts = _tracker()
    other = dup(ts)
    _same(ts, other)
    other.append("a", ([9], [10]))
    other.add("d", ([1], [1]))
    assert lists(ts.block_ids("a")) == [[1, 2, 3], [4, 5]] and "d" not in ts
    assert lists(other.block_ids("a")) == [[1, 2, 3, 9], [4, 5, 10]]


def test_table_store_pickles():
    st = TableStore(2)
    s = st.add("x", 2)
    st.append(s, 1, np.array([5, 6], np.int32))
    st.set_mark(s, 3, 99)
    st2 = pickle.loads(pickle.dumps(st))
    s2 = st2.index["x"]
    assert st2.copy_group(s2, 1).tolist() == [5, 6] and st2.mark(s2, 3) == 99
    assert st2.get_state(s2) == 2


@pytest.mark.parametrize("dup", [lambda x: pickle.loads(pickle.dumps(x)), copy.copy,
                                 copy.deepcopy], ids=["pickle", "copy", "deepcopy"])
def test_existence_set_round_trips(dup):
    rng = np.random.default_rng(0)
    es = ExistenceSet(16)
    rows = np.ascontiguousarray(rng.integers(0, 256, (300, 16), dtype=np.uint8))
    es.add_many(3, rows)
    es.discard_many(3, rows[:50])
    other = dup(es)
    assert other is not es and len(other) == 250 and other.digest_size == 16
    assert other.contains_many(3, rows).tolist() == es.contains_many(3, rows).tolist()
    other.add(4, b"z" * 16)
    assert not es.contains(4, b"z" * 16)


def test_hit_finder_and_result_round_trip():
    layout = get_preset("gpt-oss-120b")
    finder = HitFinder(layout, eagle=True)
    f2 = pickle.loads(pickle.dumps(finder))
    assert f2.spec_groups == finder.spec_groups and f2.eagle_group_ids == finder.eagle_group_ids
    assert f2.alignment == finder.alignment and f2.coarse == finder.coarse
    h = np.ascontiguousarray(np.random.default_rng(1).integers(0, 256, (64, 32), np.uint8))
    es = ExistenceSet(32)
    for g in finder.group_ids:
        es.add_many(g, h[:40])
    r = finder.longest_hit(h, es, 64 * finder.hash_block_size)
    r2 = pickle.loads(pickle.dumps(r))
    assert r2 == r and r2.tokens == r.tokens
    assert f2.longest_hit(h, pickle.loads(pickle.dumps(es)), 64 * finder.hash_block_size) == r
    for dup in (copy.copy, copy.deepcopy):
        assert dup(r) == r
        f3 = dup(finder)
        assert f3.longest_hit(h, es, 64 * finder.hash_block_size) == r


def test_transfer_plan_round_trips():
    layout = get_preset("gemma-3", num_blocks=64)
    plan = TransferPlan.from_layout(layout, 64, page_bytes=64)
    p2 = pickle.loads(pickle.dumps(plan))
    ids = [np.array([1, 2], np.int32)] * layout.num_groups
    assert p2.desc_ids(ids).tolist() == plan.desc_ids(ids).tolist()


def test_reprs_name_the_class_and_sizes():
    ts = _tracker()
    r = repr(ts)
    assert r.startswith("TrackerSet(") and "groups=2" in r and "requests=2" in r
    es = ExistenceSet(16)
    es.add(1, b"q" * 16)
    r = repr(es)
    assert r.startswith("ExistenceSet(") and "digest_size=16" in r and "keys=1" in r
    finder = HitFinder(get_preset("gpt-oss-120b"))
    r = repr(finder)
    assert r.startswith("HitFinder(") and "spec_groups=" in r and "alignment=" in r
    st = TableStore(3)
    assert repr(st).startswith("TableStore(") and "num_groups=3" in repr(st)


def test_layout_plan_cache_does_not_leak_into_pickles_or_equality():
    layout = KVLayout(groups=LAYOUT.groups, num_blocks=1000)
    clip_windows(([1, 2], [3, 4, 5, 6, 7, 8]), layout)
    twin = KVLayout(groups=LAYOUT.groups, num_blocks=1000)
    assert layout == twin and hash(layout) == hash(twin)
    back = pickle.loads(pickle.dumps(layout))
    assert back == layout
    assert [list(x) for x in clip_windows(([1, 2], [3, 4, 5, 6, 7, 8]), back)] == \
        [[1, 2], [6, 7, 8]]
