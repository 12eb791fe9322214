"""hmacore.tables: block-table conversion/validation, wire helpers, fill_blocks and
count_hashed (vllm-hma.md §3.1, §4.2, §11.3) against the plain-Python oracle."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from hmacore.errors import BlockTableError
from hmacore.tables import (as_block_table, count_hashed, fill_blocks, from_wire,
                            pair_block_spans, to_tuple, to_wire)
from tests import oracle_core as oracle


def as_lists(t):
    return [x.tolist() for x in t]


def check_int32(t):
    for x in t:
        assert isinstance(x, np.ndarray) and x.dtype == np.int32 and x.ndim == 1
        assert x.flags.c_contiguous


# -- accepted forms ---------------------------------------------------------------------
@pytest.mark.parametrize("obj", [
    ([1, 2], [3]), [[1, 2], [3]], ((1, 2), (3,)),
    (np.array([1, 2]), np.array([3], dtype=np.uint16)),
    [np.array([1, 2], dtype=np.int32), [np.int64(3)]],
    (np.array([9, 1, 9, 2], dtype=np.int32)[1::2], [3]),   # non-contiguous: copied
    (np.array([1, 2], dtype=object), [3]),
])
def test_accepts_two_groups(obj):
    t = as_block_table(obj, 2, num_blocks=10)
    check_int32(t)
    assert as_lists(t) == [[1, 2], [3]]


@pytest.mark.parametrize("obj", [[4, 5, 6], (4, 5, 6), np.array([4, 5, 6]), [[4, 5, 6]]])
def test_single_group_flat_backcompat(obj):
    assert as_lists(as_block_table(obj, 1)) == [[4, 5, 6]]


def test_empty_groups():
    assert as_lists(as_block_table(([], []), 2)) == [[], []]
    assert as_lists(as_block_table([], 1)) == [[]]
    check_int32(as_block_table(([], np.array([], dtype=np.float64)[:0].astype(np.int64)), 2))


def test_contiguous_int32_is_not_copied_but_readonly_is_accepted():
    a = np.array([1, 2, 3], dtype=np.int32)
    assert as_block_table((a,), 1)[0] is a
    a.flags.writeable = False
    assert as_lists(as_block_table((a, [0]), 2)) == [[1, 2, 3], [0]]


def test_boundaries():
    assert as_lists(as_block_table(([0, 9],), 1, num_blocks=10)) == [[0, 9]]
    assert as_lists(as_block_table(([2**31 - 1],), 1)) == [[2**31 - 1]]
    assert as_lists(as_block_table((np.array([2**31 - 1], dtype=np.uint64),), 1)) == [[2**31 - 1]]


# -- rejected forms ---------------------------------------------------------------------
BAD = [
    (([1], [2], [3]), 2, None, "block_ids has 3 groups, the layout has 2"),
    (([1],), 2, None, "block_ids has 1 groups, the layout has 2"),
    ((), 2, None, "block_ids has 0 groups, the layout has 2"),
    (([1, -1], [2]), 2, None, "group 0, index 1: block id -1 is negative"),
    (([1], [2, 10]), 2, 10, "group 1, index 1: block id 10 is >= num_blocks \\(10\\)"),
    (([1], [2**31]), 2, None, "group 1, index 0: block id 2147483648 does not fit in int32"),
    (([1], [2**70]), 2, None, "group 1, index 0: block id .* does not fit in int32"),
    (([1], [-(2**70)]), 2, None, "group 1, index 0: block id .* is negative"),
    (([1.0], [2]), 2, None, "group 0, index 0: block ids must be integers, got float"),
    (([True], [2]), 2, None, "group 0, index 0: block ids must be integers, got bool"),
    (([1], ["2"]), 2, None, "group 1, index 0: block ids must be integers, got str"),
    (([1], [None]), 2, None, "group 1, index 0: block ids must be integers"),
    (([1], [np.float32(2)]), 2, None, "group 1, index 0: block ids must be integers"),
    (([1], [np.bool_(True)]), 2, None, "group 1, index 0: block ids must be integers"),
    ((np.array([1.0]), [2]), 2, None, "group 0 must hold integers, got dtype float64"),
    ((np.array([True]), [2]), 2, None, "group 0 must hold integers, got dtype bool"),
    ((np.array([1, -3]), [2]), 2, None, "group 0, index 1: block id -3 is negative"),
    ((np.array([1, -3], dtype=np.int32), [2]), 2, None, "group 0, index 1: block id -3 is negative"),
    (([1], np.array([5, 6], dtype=np.int32)), 2, 6, "group 1, index 1: block id 6 is >= num_blocks"),
    (([1], np.array([2**31], dtype=np.uint64)), 2, None, "group 1, index 0: .* does not fit in int32"),
    (([1], np.array([2**63], dtype=np.uint64)), 2, None, "group 1, index 0: .* does not fit in int32"),
    ((np.zeros((2, 2), dtype=np.int32)), 2, None, "2-D arrays are not accepted"),
    ((np.zeros((1, 2), dtype=np.int32)), 1, None, "2-D arrays are not accepted"),
    ((np.zeros((2, 2), dtype=np.int32), [1]), 2, None, "group 0 must be 1-D, got shape \\(2, 2\\)"),
    (np.array([1, 2], dtype=np.int32), 2, None, "a flat array is a single-group table"),
    (([1], None), 2, None, "group 1 is None"),
    (([1], {2}), 2, None, "group 1 must be a list/tuple/1-D array of ids, got set"),
    ("12", 1, None, "block_ids must be a tuple/list with one id sequence per group, got str"),
    (None, 1, None, "got NoneType"),
    (iter([[1]]), 1, None, "got list_iterator"),
    ([1, 2], 2, None, "group 0 must be a list/tuple/1-D array of ids, got int"),  # flat = 1 group
]


@pytest.mark.parametrize("obj,G,nb,msg", BAD, ids=[b[3] for b in BAD])
def test_rejects(obj, G, nb, msg):
    with pytest.raises(BlockTableError, match=msg):
        as_block_table(obj, G, num_blocks=nb)


def test_error_names_the_argument():
    with pytest.raises(BlockTableError, match="^remote_block_ids: group 0, index 0"):
        from_wire([[-1], []], 2)
    with pytest.raises(BlockTableError, match="^mine: group 1"):
        as_block_table([[1], [-1]], 2, name="mine")


@pytest.mark.parametrize("G,nb,msg", [(0, None, "num_groups must be an int >= 1"),
                                      (True, None, "num_groups must be an int >= 1"),
                                      (1.0, None, "num_groups must be an int >= 1"),
                                      (1, 0, "num_blocks must be None or an int in \\[1, 2\\*\\*31-1\\]"),
                                      (1, 2**31, "num_blocks must be None or an int"),
                                      (1, True, "num_blocks must be None or an int")])
def test_rejects_bad_parameters(G, nb, msg):
    with pytest.raises(BlockTableError, match=msg):
        as_block_table([[1]], G, num_blocks=nb)


def test_block_table_error_is_value_error():
    assert issubclass(BlockTableError, ValueError)


# -- wire -------------------------------------------------------------------------------
def test_wire_roundtrip():
    t = as_block_table(([0, 7, 8], []), 2)
    w = to_wire(t)
    assert w == [[0, 7, 8], []] and all(type(x) is int for x in w[0])
    assert as_lists(from_wire(w, 2)) == w
    assert to_tuple(t) == ([0, 7, 8], [])
    assert as_lists(from_wire([1, 2, 3], 1)) == [[1, 2, 3]]   # pre-HMA flat wire format
    with pytest.raises(BlockTableError, match="remote_block_ids has 1 groups, the layout has 2"):
        from_wire([[1]], 2)


# -- fill_blocks / count_hashed ---------------------------------------------------------
def test_fill_blocks_golden():
    table = ([0, 0, 5, 6, 7, 8], [3, 4, 0, 9], [0, 0], [])
    hashed = [[0, 0, 1, 0, 0, 1], [1, 0, 0, 0], [0, 0], []]
    got = fill_blocks(table, [np.array(h, dtype=bool) for h in hashed])
    check_int32(got)
    # Leading nulls stripped; hashed (5, 8) and interior null kept out.
    assert as_lists(got) == [[6, 7], [4, 9], [], []]
    assert count_hashed(table, [np.array(h, dtype=np.uint8) for h in hashed]) == (2, 1, 0, 0)
    assert as_lists(fill_blocks([1, 2], [[False, True]])) == [[1]]  # single group, flat


def test_fill_blocks_rejects():
    with pytest.raises(BlockTableError, match="hashed has 1 groups, the table has 2"):
        fill_blocks(([1], [2]), [[0]])
    with pytest.raises(BlockTableError, match="hashed: group 1 must be a 1-D mask of length 1"):
        fill_blocks(([1], [2]), [[0], [0, 1]])
    with pytest.raises(BlockTableError, match="hashed: group 0 must be a bool/uint8 mask"):
        fill_blocks(([1], [2]), [np.array([1.0]), [0]])
    with pytest.raises(BlockTableError, match="hashed: group 1 must be a bool/uint8 mask"):
        fill_blocks(([1], [2]), [[1], [2]])
    assert as_lists(fill_blocks(([1], [2]), [[1], [0]])) == [[], [2]]
    with pytest.raises(BlockTableError, match="hashed must be a tuple/list"):
        count_hashed(([1], [2]), np.zeros(2, dtype=bool))
    with pytest.raises(BlockTableError, match="table: group 0, index 0: block id -1"):
        count_hashed(([-1], [2]), [[0], [0]])
    with pytest.raises(BlockTableError, match="at least one group"):
        fill_blocks([], [])


@st.composite
def tables_with_masks(draw):
    G = draw(st.integers(1, 5))
    table, masks = [], []
    for _ in range(G):
        n = draw(st.integers(0, 40))
        lead = draw(st.integers(0, n))
        ids = [0] * lead + draw(st.lists(st.integers(0, 50), min_size=n - lead, max_size=n - lead))
        table.append(ids)
        masks.append(draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    return table, masks


@given(tables_with_masks())
def test_fill_and_count_match_oracle(tm):
    table, masks = tm
    as_arrays = [np.array(m, dtype=bool) for m in masks]
    tup = tuple(table) if len(table) > 1 else (table[0],)
    assert as_lists(fill_blocks(tup, as_arrays)) == oracle.fill_blocks(table, masks)
    assert list(count_hashed(tup, [a.view(np.uint8) for a in as_arrays])) == \
        oracle.count_hashed(table, masks)


@given(st.lists(st.lists(st.one_of(st.integers(-5, 2**31 + 5), st.booleans(), st.floats()),
                         max_size=6), min_size=1, max_size=4),
       st.one_of(st.none(), st.integers(1, 100)))
def test_as_block_table_matches_rule(groups, nb):
    """Accepts exactly the tables whose every element is a non-bool int in range."""
    hi = nb if nb is not None else 2**31
    ok = all(type(x) is int and 0 <= x < hi for g in groups for x in g)
    obj = tuple(groups)
    if len(groups) == 1:
        obj = (groups[0],)
    if ok:
        assert as_lists(as_block_table(obj, len(groups), num_blocks=nb)) == groups
    else:
        with pytest.raises(BlockTableError):
            as_block_table(obj, len(groups), num_blocks=nb)


# -- the Cython kernels guard their own entry points (TableStore: tests/test_tables_tracker.py)
def test_kernel_guards():
    from hmacore._fast._tables import count_hashed_nonnull, select_unhashed
    ids = np.array([1, 2], dtype=np.int32)
    with pytest.raises(ValueError, match="hashed must have 2 entries"):
        select_unhashed(ids, np.zeros(1, np.uint8), np.zeros(2, np.int32))
    with pytest.raises(ValueError, match="out at least 2"):
        select_unhashed(ids, np.zeros(2, np.uint8), np.zeros(1, np.int32))
    with pytest.raises(ValueError, match="hashed must have 2 entries"):
        count_hashed_nonnull(ids, np.zeros(3, np.uint8))
    from hmacore._fast._tables import TableStore
    st = TableStore(2)
    s = st.add("r", 0)
    with pytest.raises(ValueError, match="keep has 3 entries, expected 2"):
        st.clip_views(s, np.zeros(3, dtype=np.int64))
    with pytest.raises(ValueError):  # read-only/wrong-dtype buffers are refused by Cython
        st.append(s, 0, np.array([1], dtype=np.int64))
    st.append(s, 0, np.array([1, 2], dtype=np.int32))
    v = st.view_group(s, 0)
    assert not v.flags.writeable and v.tolist() == [1, 2]
    for _ in range(100):  # growth keeps the prefix
        st.append(s, 0, np.array([3], dtype=np.int32))
    assert st.copy_group(s, 0).tolist() == [1, 2] + [3] * 100 and v.tolist() == [1, 2]
    taken = st.take_group(s, 0)
    assert taken.flags.writeable and st.length(s, 0) == 0


def test_table_store_guards():
    from hmacore._fast._tables import STEP_UNKNOWN, TableStore
    with pytest.raises(ValueError, match="num_groups must be >= 1"):
        TableStore(0)
    st = TableStore(2)
    s = st.add("x", 0)
    with pytest.raises(ValueError, match="'x' already has a slot"):
        st.add("x", 0)
    with pytest.raises(TypeError):
        st.add([], 0)
    assert len(st) == 1                            # the failed add took no slot
    for bad_s, bad_g, msg in [(s + 1, 0, "slot 1 is not in use"), (-1, 0, "slot -1 is not in use"),
                              (s, 2, "group 2 out of range for 2 groups"), (s, -1, "group -1 out")]:
        with pytest.raises(IndexError, match=msg):
            st.append(bad_s, bad_g, np.array([1], dtype=np.int32))
        with pytest.raises(IndexError, match=msg):
            st.view_group(bad_s, bad_g)
    with pytest.raises(IndexError, match="mark 4 out of range"):
        st.mark(s, 4)
    with pytest.raises(ValueError, match="groups\\[1\\] must be a list/tuple of ints"):
        st.extend_groups(s, [[1, 2], [-1]])
    assert st.lengths(s) == (0, 0)                 # all-or-nothing
    with pytest.raises(ValueError, match="keep must be a C-contiguous 1-D int64 array of 2"):
        st.clip_spans(["x"], np.zeros(3, dtype=np.int64))
    assert st.clip_spans(["x", "y"], np.zeros(2, dtype=np.int64)) == (None, 1)
    with pytest.raises(TypeError, match="req_ids must be a list or tuple, got dict_keys"):
        st.clip_spans(st.index.keys(), np.zeros(2, dtype=np.int64))
    with pytest.raises(TypeError, match="req_ids must be a list or tuple, got str"):
        st.step_flat("x", np.zeros(0, np.int32), np.zeros(2, np.int64), 0, 3, 0, 2)

    class Ids(list):
        pass
    spans, bad = st.clip_spans(Ids(["x"]), np.zeros(2, dtype=np.int64))
    assert bad == -1 and spans.tolist() == [[[0, 0], [0, 0]]]
    assert st.step_flat(Ids(["x"]), np.array([4], np.int32), np.array([0, 1, 1], np.int64),
                        0, 3, 0, 2) is None and st.lengths(s) == (1, 0)
    assert st.step_flat(["y"], np.zeros(0, np.int32), np.zeros(3, np.int64), 0, 3, 0, 2) == \
        (STEP_UNKNOWN, 0)
    st.pop("x")
    with pytest.raises(IndexError, match="slot 0 is not in use"):
        st.length(s, 0)


def test_pair_block_spans_matches_a_plain_python_pairing():
    rng = np.random.default_rng(7)
    for _ in range(300):
        ng = int(rng.integers(1, 5))
        bss = [int(rng.choice([1, 4, 16, 64])) for _ in range(ng)]
        mine = [rng.integers(0, 4, int(rng.integers(0, 30))).astype(np.int32) for _ in bss]
        theirs = [rng.integers(0, 4, int(rng.integers(0, 30))).astype(np.int32) for _ in bss]
        start = int(rng.integers(0, 400))
        end = start + int(rng.integers(0, 400))
        local, remote = pair_block_spans(mine, theirs, bss, start, end)
        for g, bs in enumerate(bss):
            lo, hi = start // bs, -(-end // bs)
            want = [(int(mine[g][p]), int(theirs[g][p])) for p in range(lo, hi)
                    if p < len(mine[g]) and p < len(theirs[g])
                    and mine[g][p] and theirs[g][p]]
            assert list(zip(local[g].tolist(), remote[g].tolist())) == want
            assert local[g].dtype == remote[g].dtype == np.int32
    with pytest.raises(BlockTableError, match="mine: group 0"):
        pair_block_spans([[-1]], [[1]], [16], 0, 16)
    with pytest.raises(ValueError, match="bad token span"):
        pair_block_spans([[1]], [[1]], [16], 10, 5)
    with pytest.raises(ValueError, match="block size 0"):
        pair_block_spans([[1]], [[1]], [0], 0, 5)
    with pytest.raises(BlockTableError, match="mine: group 0, index 1: block id -3 is negative"):
        pair_block_spans((np.array([1, -3], np.int32),), (np.array([1, 2], np.int32),),
                         [16], 0, 32)
