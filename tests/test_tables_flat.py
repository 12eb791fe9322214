"""TrackerSet.apply_step_flat and windows.clip_tracked_spans (the batched step API) against the
dict-of-lists oracle, plus bad input: clear errors, nothing changed."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hmacore.errors import BlockTableError, TrackerStateError
from hmacore.presets import get_preset
from hmacore.tables import RequestState, TrackerSet
from hmacore.windows import clip_tracked, clip_tracked_spans
from tests import oracle_core as oracle

NB = 1000
LAYOUTS = [get_preset("gpt-oss-120b", num_blocks=NB), get_preset("deepseek-v4", num_blocks=NB),
           get_preset("qwen3-next-80b", num_blocks=NB)]


def flat(step, G):
    """[[ids of g for g] for r] -> (int32 ids, int64 offsets)."""
    ids, offs = [], [0]
    for per_req in step:
        for g in range(G):
            ids.extend(per_req[g])
            offs.append(len(ids))
    return np.array(ids, dtype=np.int32), np.array(offs, dtype=np.int64)


def snapshot(ts):
    return {r: ([x.tolist() for x in ts.block_ids(r)], int(ts.state(r))) for r in ts}


@settings(max_examples=60, deadline=None)
@given(data=st.data(), li=st.integers(0, len(LAYOUTS) - 1), nreq=st.integers(0, 6),
       steps=st.integers(1, 3))
def test_flat_step_matches_oracle(data, li, nreq, steps):
    layout = LAYOUTS[li]
    G = layout.num_groups
    ids_st = st.lists(st.integers(0, NB - 1), max_size=5)
    ts, ora = TrackerSet(layout), oracle.Trackers(G)
    for r in range(nreq):
        t = [data.draw(ids_st) for _ in range(G)]
        ts.add(r, t)
        ora.add(r, t)
    groups = oracle.layout_to_dicts(layout)
    for _ in range(steps):
        reqs = data.draw(st.lists(st.integers(0, max(nreq - 1, 0)), max_size=nreq)) if nreq else []
        step = [[data.draw(ids_st) for _ in range(G)] for _ in reqs]
        ids, offs = flat(step, G)
        ts.apply_step_flat(reqs, ids, offs)
        for r, new in zip(reqs, step):
            ora.append(r, new)
        assert {r: v[0] for r, v in snapshot(ts).items()} == {r: v["t"] for r, v in ora.reqs.items()}
        assert all(ts.state(r) == RequestState.RUNNING for r in reqs)
        spans = clip_tracked_spans(ts, list(range(nreq)))
        views = clip_tracked(ts, list(range(nreq)))
        for r in range(nreq):
            full = ts.block_ids(r, copy=False)
            got = [full[g][spans[r, g, 0]:spans[r, g, 1]].tolist() for g in range(G)]
            assert got == [v.tolist() for v in views[r]]
            assert got == [list(x) for x in oracle.clip(ora.reqs[r]["t"], groups)]


def _ts():
    ts = TrackerSet(LAYOUTS[0])
    ts.add("a", ([1], [2]))
    ts.add("b", ([3], [4]))
    return ts


@pytest.mark.parametrize("req_ids,ids,offs,exc,msg", [
    (["a", "zz"], [5, 6], [0, 1, 1, 2, 2], TrackerStateError, "'zz' is not tracked"),
    (["a"], [5, 6], [0, 2], BlockTableError, "offsets must have len"),
    (["a"], [5, 6], [0, 3, 2], BlockTableError, "non-decreasing"),
    (["a"], [5, 6], [1, 1, 2], BlockTableError, "start at 0 and end at len"),
    (["a", "b"], [5, -6], [0, 1, 1, 2, 2], BlockTableError, r"new_ids\[1\]: block id -6 is negative"),
    (["a", "b"], [5, NB], [0, 1, 1, 2, 2], BlockTableError, r"new_ids\[1\]: block id 1000 is >= num_blocks"),
])
def test_flat_step_bad_input_changes_nothing(req_ids, ids, offs, exc, msg):
    ts = _ts()
    before = snapshot(ts)
    with pytest.raises(exc, match=msg):
        ts.apply_step_flat(req_ids, np.array(ids, np.int32), np.array(offs, np.int64))
    assert snapshot(ts) == before


def test_flat_step_rejects_dtypes_and_preempted():
    ts = _ts()
    before = snapshot(ts)
    with pytest.raises(BlockTableError, match="new_ids must be a C-contiguous 1-D int32"):
        ts.apply_step_flat(["a"], np.array([1, 2], np.int64), np.array([0, 1, 2], np.int64))
    with pytest.raises(BlockTableError, match="offsets must be a C-contiguous 1-D int64"):
        ts.apply_step_flat(["a"], np.array([1, 2], np.int32), [0, 1, 2])
    ts.preempt("b")
    before = snapshot(ts)
    with pytest.raises(TrackerStateError, match="PREEMPTED"):
        ts.apply_step_flat(["a", "b"], np.array([5, 6], np.int32), np.array([0, 1, 1, 2, 2], np.int64))
    assert snapshot(ts) == before


def test_clip_spans_unknown_request():
    ts = _ts()
    with pytest.raises(TrackerStateError, match="'x' is not tracked"):
        clip_tracked_spans(ts, ["a", "x"])
    with pytest.raises(TypeError, match="trackers must be a TrackerSet"):
        clip_tracked_spans({}, ["a"])


def test_apply_step_lists_matches_flat_and_rejects():
    layout = LAYOUTS[1]                          # 5 groups
    G = layout.num_groups
    a, b = TrackerSet(layout), TrackerSet(layout)
    for ts in (a, b):
        for r in range(3):
            ts.add(r, [[r + 1]] * G)
    step = [([5], [], [6, 7], [], [8]), None, ([9], [10], [], [], [])]
    a.apply_step_lists([0, 1, 2], step)
    ids, offs = flat([s if s is not None else [[]] * G for s in step], G)
    b.apply_step_flat([0, 1, 2], ids, offs)
    assert snapshot(a) == snapshot(b)
    before = snapshot(a)
    for bad, msg in [([([5],) * 2, None, None], r"new_block_ids\[0\] must be None or 5"),
                     ([None, None, ([1], [2.0], [], [], [])], r"new_block_ids\[2\]\[1\]\[0\] must be an int"),
                     ([None, None, ([1], [-2], [], [], [])], r"new_block_ids\[2\]\[1\]\[0\]: block id -2"),
                     ([None, None, ([1], [NB], [], [], [])], "block id 1000 is >= num_blocks"),
                     ([None, None], "3 req_ids but 2 new_block_ids")]:
        with pytest.raises(BlockTableError, match=msg):
            a.apply_step_lists([0, 1, 2], bad)
        assert snapshot(a) == before


def test_flat_step_rejects_more_forms_and_ids():
    ts = _ts()
    before = snapshot(ts)
    offs = np.array([0, 1, 2], np.int64)
    for bad in (np.array([1, 2], ">i4"), np.array([1, 2], np.uint32), np.array([[1, 2]], np.int32),
                np.array([1, 0, 2], np.int32)[::2], [1, 2], np.array([1.0, 2.0])):
        with pytest.raises(BlockTableError, match="new_ids must be a C-contiguous 1-D int32"):
            ts.apply_step_flat(["a"], bad, offs)
    for bad in (np.array([0, 1, 2], ">i8"), np.array([0, 1, 2], np.int32),
                np.array([0, 1, 2], np.uint64), np.array([0, 0, 1, 1, 2, 2], np.int64)[::2]):
        with pytest.raises(BlockTableError, match="offsets must be a C-contiguous 1-D int64"):
            ts.apply_step_flat(["a"], np.array([1, 2], np.int32), bad)
    with pytest.raises(TrackerStateError, match="req_id must be hashable"):
        ts.apply_step_flat(["a", ["b"]], np.array([5, 6], np.int32), np.array([0, 1, 1, 2, 2], np.int64))
    with pytest.raises(TrackerStateError, match="req_id must be hashable"):
        clip_tracked_spans(ts, ["a", {}])
    assert snapshot(ts) == before
    # Read-only inputs and generic iterables of ids are fine.
    ids, offs = np.array([5, 6], np.int32), np.array([0, 1, 1, 2, 2], np.int64)
    ids.flags.writeable = offs.flags.writeable = False
    ts.apply_step_flat(iter(["a", "b"]), ids, offs)
    assert snapshot(ts) == {"a": ([[1, 5], [2]], 2), "b": ([[3, 6], [4]], 2)}


def test_flat_step_reuses_finished_slots():
    """A finished request's slot goes to the next add: fresh table, state and watermarks; the
    finished request's arrays are the caller's and never change afterwards."""
    ts = TrackerSet(LAYOUTS[1])
    G = ts.num_groups
    for r in range(40):
        ts.add(r, [[r + 1]] * G)
    ts.set_scheduled_tokens(5, 100)
    ts.preempt(6)
    gone = ts.finish(5)
    ts.finish(6)
    ts.add("new", [[] for _ in range(G)])
    ts.add("new2", [[9]] * G)
    assert ts.num_blocks("new") == (0,) * G and ts.state("new") == RequestState.NEW
    assert ts.scheduled_tokens("new") == 0 and ts.block_ids("new2")[0].tolist() == [9]
    ids, offs = flat([[[7]] * G, [[8]] * G], G)
    ts.apply_step_flat(["new", "new2"], ids, offs)
    assert [x.tolist() for x in gone] == [[6]] * G
    assert ts.block_ids("new")[0].tolist() == [7] and ts.block_ids("new2")[0].tolist() == [9, 8]
    assert len(ts) == 40 and 5 not in ts and "new" in ts


def test_clip_spans_results_are_independent():
    """Each result stays valid while held (the int64 storage is only reused once dropped)."""
    ts = _ts()
    a = clip_tracked_spans(ts, ["a", "b"])
    ts.apply_step_flat(["a"], np.array([5, 6, 7], np.int32), np.array([0, 2, 3], np.int64))
    b = clip_tracked_spans(ts, ["a"])
    assert a.tolist() == [[[0, 1], [0, 1]], [[0, 1], [0, 1]]]
    assert b.tolist() == [[[0, 3], [0, 2]]] and not np.shares_memory(a, b)
    view = b[0]
    del a, b
    c = clip_tracked_spans(ts, ["b", "a"])
    assert view.tolist() == [[0, 3], [0, 2]] and not np.shares_memory(view, c)
    assert c.shape == (2, 2, 2) and c.dtype == np.int64 and c.flags.c_contiguous
    assert clip_tracked_spans(ts, []).shape == (0, 2, 2)
