"""TrackerSet.step_pairs (a push producer's whole step in one C call: append the new ids of
every followed request, then pair each one's span with the consumer's table) against the
per-request path it replaces (apply_step_lists + pair_block_spans per request) and a
plain-Python oracle; bad input: a clear error naming the argument, nothing changed."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hmacore.errors import BlockTableError, TrackerStateError
from hmacore.presets import get_preset
from hmacore.tables import RequestState, TrackerSet, pair_block_spans

NB = 1000
LAYOUTS = [get_preset("gpt-oss-120b", num_blocks=NB), get_preset("deepseek-v4", num_blocks=NB)]


def oracle_pairs(mine, theirs, block_sizes, start, end):
    """Plain Python: per group, (mine[p], theirs[p]) for the positions of tokens
    [start, end) held by both tables, both ids non-null."""
    out = []
    for m, t, bs in zip(mine, theirs, block_sizes):
        lo, hi = start // bs, -(-end // bs)
        out.append([(m[p], t[p]) for p in range(lo, min(hi, len(m), len(t))) if m[p] and t[p]])
    return out


def snapshot(ts):
    return {r: ([x.tolist() for x in ts.block_ids(r)], int(ts.state(r))) for r in ts}


def split(local, remote, offsets, r, G):
    o = offsets.tolist()
    return [list(zip(local[o[r * G + g]:o[r * G + g + 1]].tolist(),
                     remote[o[r * G + g]:o[r * G + g + 1]].tolist())) for g in range(G)]


@settings(max_examples=80, deadline=None)
@given(data=st.data(), li=st.integers(0, len(LAYOUTS) - 1), nreq=st.integers(0, 5),
       steps=st.integers(1, 3))
def test_step_pairs_matches_per_request_pairing_and_oracle(data, li, nreq, steps):
    layout = LAYOUTS[li]
    G, sizes = layout.num_groups, layout.block_sizes
    ids = st.lists(st.integers(0, NB - 1), max_size=6)
    batched, per_request = TrackerSet(layout), TrackerSet(layout)
    tables, sparse, registered = {}, {}, {}
    for r in range(nreq):
        table = [data.draw(ids) for _ in range(G)]
        for ts in (batched, per_request):
            ts.add(f"r{r}", table)
        tables[f"r{r}"] = [list(x) for x in table]
        sparse[f"r{r}"] = [list(x) for x in table]
    for _ in range(steps):
        rids = data.draw(st.lists(st.sampled_from(sorted(tables) or ["-"]), unique=True)
                         .filter(lambda x: "-" not in x))
        new = [data.draw(st.none() | st.lists(ids, min_size=G, max_size=G)) for _ in rids]
        theirs, spans = [], []
        for r in rids:
            if data.draw(st.booleans()):
                theirs.append(None)
                spans.append(None)
                continue
            # the consumer's registration: drawn once per request, the same table at every
            # step (a push registration is; the sparse appends rely on it)
            if r not in registered:
                registered[r] = [np.array(data.draw(st.lists(st.integers(0, 3), max_size=14)),
                                          np.int32) for _ in range(G)]
            t = registered[r]
            theirs.append(tuple(t) if data.draw(st.booleans()) else [x.tolist() for x in t])
            a = data.draw(st.integers(0, 3000))
            spans.append((a, a + data.draw(st.integers(0, 3000))))
        local, remote, offsets = batched.step_pairs(rids, new, theirs, spans, sizes)
        assert local.dtype == remote.dtype == np.int32 and offsets.dtype == np.int64
        assert offsets.tolist()[0] == 0 and offsets.tolist()[-1] == len(local) == len(remote)
        assert len(offsets) == len(rids) * G + 1
        # the per-request path the push scheduler used before: same appends, same pairs
        with_ids = [(r, n) for r, n in zip(rids, new) if n is not None]
        if with_ids:
            per_request.apply_step_lists([r for r, _ in with_ids], [n for _, n in with_ids])
        for i, r in enumerate(rids):
            if new[i] is not None:
                for g in range(G):
                    tables[r][g].extend(new[i][g])
                    # sparse appends: a pushing request keeps an id only where the
                    # consumer's table holds a block
                    t = None if spans[i] is None else list(theirs[i][g])
                    sparse[r][g].extend(x if t is None or (p < len(t) and t[p]) else 0
                                        for p, x in enumerate(new[i][g], len(sparse[r][g])))
            got = split(local, remote, offsets, i, G)
            if spans[i] is None:
                assert got == [[]] * G
                continue
            loc, rem = pair_block_spans(per_request.block_ids(r, copy=False),
                                        [np.asarray(t, np.int32) for t in theirs[i]], sizes,
                                        *spans[i])
            assert got == [list(zip(a.tolist(), b.tolist())) for a, b in zip(loc, rem)]
            assert got == oracle_pairs(tables[r], [list(t) for t in theirs[i]], sizes,
                                       *spans[i])
            assert batched.state(r) == RequestState.RUNNING
        assert {r: t for r, (t, _) in snapshot(batched).items()} == sparse
        assert {r: t for r, (t, _) in snapshot(per_request).items()} == tables


def test_step_pairs_empty_and_follow_only():
    layout = LAYOUTS[0]
    ts = TrackerSet(layout)
    local, remote, offsets = ts.step_pairs([], [], [], [], layout.block_sizes)
    assert len(local) == len(remote) == 0 and offsets.tolist() == [0]
    ts.add("a", [[1, 2], [3, 4]])
    local, remote, offsets = ts.step_pairs(["a"], [[[5], []]], [None], [None], (16, 16))
    assert len(local) == 0 and offsets.tolist() == [0, 0, 0]
    assert [x.tolist() for x in ts.block_ids("a")] == [[1, 2, 5], [3, 4]]
    assert ts.state("a") == RequestState.RUNNING


def test_step_pairs_leaves_earlier_views_alone_and_reserve_keeps_the_table():
    layout = LAYOUTS[0]
    ts = TrackerSet(layout)
    ts.add("a", [[1, 2], [3, 4]])
    ts.reserve("a", [64, 64])
    assert [x.tolist() for x in ts.block_ids("a")] == [[1, 2], [3, 4]]
    view = ts.block_ids("a", copy=False)
    theirs = (np.arange(1, 9, dtype=np.int32), np.array([0, 0, 0, 7], np.int32))
    local, remote, _ = ts.step_pairs(["a"], [[[5, 6], [8, 9]]], [theirs], [(0, 64)], (16, 16))
    assert [x.tolist() for x in view] == [[1, 2], [3, 4]]       # snapshots stay snapshots
    assert local.tolist() == [1, 2, 5, 6, 9] and remote.tolist() == [1, 2, 3, 4, 7]
    with pytest.raises(BlockTableError, match=r"blocks\[1\] must be an int"):
        ts.reserve("a", [1, -1])
    with pytest.raises(BlockTableError, match="blocks must have 2 entries"):
        ts.reserve("a", [1])
    with pytest.raises(TrackerStateError, match="not tracked"):
        ts.reserve("zz", [1, 1])


def test_step_pairs_reads_new_ids_only_where_the_consumer_holds_a_block():
    """A pushing request's appended ids are read (and checked) only at positions the
    consumer's table holds a block; the others hold 0 and are never paired, so the pairs
    equal those of the full table."""
    layout = LAYOUTS[0]
    ts, full = TrackerSet(layout), TrackerSet(layout)
    ts.add("a", [[], []])
    full.add("a", [[], []])
    theirs = (np.array([7, 8, 9, 10], np.int32), np.array([0, 0, 0, 11], np.int32))
    # group 1's positions 0-2 are outside the consumer's window: not read, even a non-int
    new = [[[1, 2, 3, 4], ["not read", object(), 5.5, 6]]]
    local, remote, offsets = ts.step_pairs(["a"], new, [theirs], [(0, 64)], (16, 16))
    assert [x.tolist() for x in ts.block_ids("a")] == [[1, 2, 3, 4], [0, 0, 0, 6]]
    assert local.tolist() == [1, 2, 3, 4, 6] and remote.tolist() == [7, 8, 9, 10, 11]
    assert offsets.tolist() == [0, 4, 5]
    lf, rf, of = full.step_pairs(["a"], [[[1, 2, 3, 4], [1, 2, 3, 6]]], [theirs], [(0, 64)],
                                 (16, 16))
    assert (lf.tolist(), rf.tolist(), of.tolist()) == (local.tolist(), remote.tolist(),
                                                       offsets.tolist())
    # a later step: a position past the consumer's table is not read; one it holds a block
    # at is read and checked, naming the entry
    local, _, _ = ts.step_pairs(["a"], [[[], ["x"]]], [theirs], [(64, 80)], (16, 16))
    assert [x.tolist() for x in ts.block_ids("a")] == [[1, 2, 3, 4], [0, 0, 0, 6, 0]]
    before = snapshot(ts)
    ts2 = TrackerSet(layout)
    ts2.add("a", [[], [1, 2, 3]])
    with pytest.raises(BlockTableError, match=r"new_block_ids\[0\]\[1\]\[0\] must be an int"):
        ts2.step_pairs(["a"], [[[], ["x"]]], [theirs], [(64, 80)], (16, 16))
    assert [x.tolist() for x in ts2.block_ids("a")] == [[], [1, 2, 3]]
    # follow-only steps (no span) read every id
    with pytest.raises(BlockTableError, match=r"new_block_ids\[0\]\[1\]\[0\] must be an int"):
        ts.step_pairs(["a"], [[[], ["x"]]], [None], [None], (16, 16))
    assert snapshot(ts) == before


BAD = [
    # (req_ids, new_block_ids, theirs, spans, block_sizes), error class, message
    ((["zz"], [None], [None], [None], (16, 16)), TrackerStateError, "'zz' is not tracked"),
    ((["a", "a"], [None, None], [None, None], [None, None], (16, 16)), TrackerStateError,
     r"req_ids\[0\] is given twice"),
    ((["p"], [[[1], [2]]], [None], [None], (16, 16)), TrackerStateError,
     r"req_ids\[0\] is PREEMPTED"),
    ((["a"], [[[1], [NB]]], [None], [None], (16, 16)), BlockTableError, "is >= num_blocks"),
    ((["a"], [[[1], [-1]]], [None], [None], (16, 16)), BlockTableError,
     r"new_block_ids\[0\]\[1\]\[0\]: block id -1"),
    ((["a"], [[[1], [1.0]]], [None], [None], (16, 16)), BlockTableError,
     r"new_block_ids\[0\]\[1\]\[0\] must be an int"),
    ((["a"], [[[1]]], [None], [None], (16, 16)), BlockTableError,
     r"new_block_ids\[0\] must be None or 2 per-group lists"),
    ((["a"], [None], [[[1, -2], [1]]], [(0, 64)], (16, 16)), BlockTableError,
     r"theirs\[0\]: group 0, index 1: block id -2 is negative"),
    ((["a"], [None], [(np.array([1, -2], np.int32), np.array([1], np.int32))], [(0, 64)],
      (16, 16)), BlockTableError, r"theirs\[0\]\[0\]\[1\]: block id -2 is negative"),
    ((["a"], [None], [[[1], [1], [1]]], [(0, 64)], (16, 16)), BlockTableError,
     r"theirs\[0\] has 3 groups, the layout has 2"),
    ((["a"], [None], [None], [(5, 2)], (16, 16)), BlockTableError,
     r"spans\[0\] = \(5, 2\): need 0 <= start <= end"),
    ((["a"], [None], [None], [(-1, 2)], (16, 16)), BlockTableError, r"spans\[0\]"),
    ((["a"], [None], [None], [(0, 2**63)], (16, 16)), BlockTableError, r"spans\[0\]"),
    ((["a"], [None], [None], [3], (16, 16)), BlockTableError, r"spans\[0\] must be None or"),
    ((["a"], [None], [None], [None], (16, 0)), BlockTableError, r"block_sizes\[1\] must be"),
    ((["a"], [None], [None], [None], (16,)), BlockTableError, "block_sizes must be a list of 2"),
    ((["a"], [None, None], [None], [None], (16, 16)), BlockTableError,
     "new_block_ids must be a list of 2 entries"),
    ((["a"], [None], [None], [], (16, 16)), BlockTableError, "spans must be a list of 2"),
    ((["a"], [None], [], [None], (16, 16)), BlockTableError, "theirs must be a list of 2"),
    (([["unhashable"]], [None], [None], [None], (16, 16)), TrackerStateError, "hashable"),
]


@pytest.mark.parametrize("args,cls,msg", BAD)
def test_step_pairs_refuses_bad_input_and_changes_nothing(args, cls, msg):
    layout = LAYOUTS[0]
    ts = TrackerSet(layout)
    ts.add("a", [[1, 2], [3, 4]])
    ts.add("b", [[5], [6]])
    ts.add("p", [[7], [8]])
    ts.preempt("p")
    before = snapshot(ts)
    # a valid request after the bad one: its appends must not land either
    req_ids, new, theirs, spans, sizes = args
    with pytest.raises(cls, match=msg):
        ts.step_pairs([*req_ids, "b"], [*new, [[9], [9]]], [*theirs, None], [*spans, None],
                      sizes)
    assert snapshot(ts) == before
