"""Regression tests for the bugs the coverage-guided fuzzers (fuzz/, docs/reliability.md
"Coverage-guided fuzzing") found. Each one failed before its fix: a bare exception that is not
an HmacoreError, a hang, or a wrong answer."""
import time

import numpy as np
import pytest

from hmacore.errors import BlockTableError, HashInputError, LayoutError, TrackerStateError
from hmacore.hits import ExistenceSet, HitFinder
from hmacore.keys import KeyBuilder
from hmacore.plan import TransferPlan
from hmacore.presets import get_preset
from hmacore.spec import GroupKind, GroupSpec, KVLayout
from hmacore.tables import TrackerSet, ids_from_objects
from hmacore.windows import clip_to_window, clip_windows, window_plan


def _layout(*specs, num_blocks=64):
    return KVLayout(groups=tuple(specs), num_blocks=num_blocks)


def test_unhashable_req_id_is_a_tracker_state_error():
    ts = TrackerSet(_layout(GroupSpec(GroupKind.FULL, 16, ("a",))))
    ts.add("r", [[1, 2]])
    with pytest.raises(TrackerStateError, match="hashable"):
        ts.add([1], [[1]])                               # was TypeError
    for kw in ({"finished": [[1]]}, {"preempted": [{}]}, {"new": [([1], [[3]])]},
               {"cached": [([1], [[3]], False)]}):
        with pytest.raises(TrackerStateError, match="hashable"):
            ts.apply_step(**kw)                          # was TypeError
    assert list(ts) == ["r"] and ts.block_ids("r")[0].tolist() == [1, 2]


class _Block:
    def __init__(self, block_id):
        self.block_id, self.block_hash = block_id, None


def test_ids_from_objects_bad_blocks_are_block_table_errors():
    with pytest.raises(BlockTableError, match="index 1"):
        ids_from_objects(iter([_Block(1), _Block(True)]))   # was TypeError (len of iterator)
    with pytest.raises(BlockTableError, match="index 1.*'block_id'"):
        ids_from_objects([_Block(1), object()])             # was AttributeError
    with pytest.raises(BlockTableError, match="list of block objects"):
        ids_from_objects(7)
    assert ids_from_objects(iter([_Block(5)]))[0].tolist() == [5]


def test_windows_past_int64_clip_like_keep_all():
    sw = GroupSpec(GroupKind.SLIDING_WINDOW, 16, ("s",), sliding_window=2**70)
    mamba = GroupSpec(GroupKind.MAMBA, 16, ("m",), num_speculative_blocks=2**70)
    lay = _layout(sw, mamba)
    table = ([1, 2, 3], [4, 5, 6])
    # was OverflowError: window_plan stores the window in an int64 array
    assert [x.tolist() for x in clip_to_window(table, lay)] == [[1, 2, 3], [4]]
    assert [list(x) for x in clip_windows(table, lay)] == [[1, 2, 3], [4]]
    assert window_plan(lay).tolist()[0] > 0


def test_byte_swapped_int32_ids_are_read_by_value():
    big = np.array([2**24], dtype=">i4")        # native bytes of id 1 read the other way
    lay = _layout(GroupSpec(GroupKind.SLIDING_WINDOW, 16, ("s",), sliding_window=64))
    with pytest.raises(BlockTableError, match="16777216"):
        clip_to_window((big,), lay)              # was accepted (raw bytes = 1, < 64)
    got = clip_to_window((np.array([3], dtype=">i4"),), lay)[0]
    assert got.dtype == np.int32 and got.dtype.isnative and got.tolist() == [3]
    plan = TransferPlan.from_layout(get_preset("llama-3-70b"), 64)
    with pytest.raises(BlockTableError):
        plan.desc_ids([big])                     # was the descriptors of block 1
    want = plan.desc_ids([np.array([5], np.int32)])
    assert plan.desc_ids([np.array([5], ">i4")]).tolist() == want.tolist()
    with pytest.raises(BlockTableError, match="out"):
        plan.desc_ids([np.array([5], np.int32)], out=np.zeros(want.size, ">i8"))  # was
        # filled with native-order int64s the caller reads byte-swapped
    assert plan._desc.pair_ids32(plan._desc, [big], [big], [1]) is None


def test_region_table_values_past_the_arrays_are_layout_errors():
    plan = TransferPlan.from_layout(get_preset("gpt-oss-120b"), 8)
    for key, value in (("base", float("inf")), ("logical_blocks", 2**70), ("ratio", 2**40),
                       ("block_len", -2**70), ("group", 2**40)):
        table = plan.region_table()
        table[0][key] = value
        with pytest.raises(LayoutError):
            TransferPlan.from_region_table(plan.layout, table)   # was OverflowError


def test_from_layout_bad_page_bytes_and_state_parts():
    lay = get_preset("qwen3-next-80b")
    for page in (True, 1.5, "64"):
        with pytest.raises(LayoutError, match="page_bytes"):
            TransferPlan.from_layout(lay, 8, page_bytes=page)   # was TypeError
    t0 = time.monotonic()
    with pytest.raises(LayoutError, match="state_parts"):
        TransferPlan.from_layout(lay, 8, state_parts=2**70)      # was an endless loop
    assert time.monotonic() - t0 < 5


def test_desc_bytes_refuses_bools():
    plan = TransferPlan.from_layout(get_preset("llama-3-70b"), 8)
    with pytest.raises(BlockTableError, match="bools"):
        plan.desc_bytes([5, True])               # was 2 descriptors (True read as id 1)
    assert plan.desc_bytes([5, 1]) == 2 * plan.regions[0].desc_len


class _Shrinking(np.int64):
    """Empties the list holding it when converted."""

    def __int__(self):
        self.owner.clear()
        return int(np.int64(self))

    __index__ = __int__


def test_desc_ids_list_changed_by_its_element():
    plan = TransferPlan.from_layout(get_preset("llama-3-70b"), 8)
    for first in (-1, 3):
        ids = [_Shrinking(first), -1, 99]
        ids[0].owner = ids
        with pytest.raises(BlockTableError):     # was IndexError / RuntimeError
            plan.desc_ids([ids])


def test_existence_set_arguments_are_hash_input_errors():
    for size in ("32", 32.0, None, 2**70, True, 8):
        with pytest.raises(HashInputError, match="digest_size"):
            ExistenceSet(size)                   # was TypeError / OverflowError
    assert ExistenceSet(np.int64(16)).digest_size == 16


def test_chunked_hit_stays_inside_the_rows():
    lay = KVLayout(groups=(GroupSpec(GroupKind.CHUNKED_LOCAL, 4, ("c",), chunk_size=16),))
    finder = HitFinder(lay)
    rows = np.zeros((2, 32), np.uint8)
    hit = finder.longest_hit(rows, None, 2**63 - 1)          # mask mode: every probe hits
    assert hit.tokens == 8 and [m.tolist() for m in hit.masks] == [[1, 1]]  # was 2**63 - 16
    assert finder.longest_hit(rows, ExistenceSet(32), 2**63 - 1).tokens == 0
    # inside vLLM's domain (max_length < the tokens the rows cover) nothing changed
    assert finder.longest_hit(np.zeros((8, 32), np.uint8), None, 20).tokens == 20


def test_fold_presence_ragged_results():
    kb = KeyBuilder("m")
    with pytest.raises(HashInputError, match="flat sequence"):
        kb.fold_presence(0, [[1], [1, 2]], 2)    # was ValueError from NumPy


def test_desc_table_rows_and_domains_are_ints_or_layout_errors():
    from hmacore.runs import DescTable, desc_table
    for rows in ([[-1, 64, 0]], [[2**64, 64, 0]], [[64, None, 0]], [[64, 1, 0], [128, 1]]):
        for make in (DescTable, desc_table):
            with pytest.raises(LayoutError, match="rows"):
                make(rows)                       # were OverflowError / TypeError / ValueError
    for rows in ([[64.5, 64, 0]], np.array([[64.5, 64, 0]]), [[True, 64, 0]], [["64", 64, 0]]):
        with pytest.raises(LayoutError, match="rows must hold ints"):
            DescTable(rows)                      # were read as 64 / 1 / 64
    with pytest.raises(LayoutError, match="domains must hold ints"):
        DescTable([[0, 64, 0]], [0.5])           # was domain 0
    with pytest.raises(LayoutError, match="ranges must hold ints"):
        desc_table([[0, 64, 0]], [(0, "4096", 0)])   # was parsed as 4096
    with pytest.raises(LayoutError, match="ranges must be"):
        desc_table([[0, 64, 0]], [(0, 4096)])    # was ValueError (unpacking)
    with pytest.raises(LayoutError, match="ranges must lie"):
        desc_table([[0, 64, 0]], [(0, 2**64, 0)])      # was OverflowError
    assert desc_table([[8, 64, 0]], [(8, 2**64 - 8, 0)]).num_descs == 1   # ends at 2**64
    empty = DescTable([])                        # an empty dlist (was refused as shape (0,))
    assert empty.num_descs == 0 and empty.rows().shape == (0, 3)
    assert DescTable(np.array([[0, 64, 0]], np.int64)).rows().tolist() == [[0, 64, 0]]


def test_find_runs_refuses_bool_and_float_ids_in_lists():
    from hmacore.runs import desc_table, find_runs
    t = desc_table(np.array([[64 * i, 64, 0] for i in range(1, 9)], dtype=np.uint64))
    with pytest.raises(BlockTableError, match="local_ids must hold ints"):
        find_runs(t, [0, True], t, [0, 1])       # was the pair (1, 1)
    with pytest.raises(BlockTableError, match="remote_ids must hold ints"):
        find_runs(t, [0], t, [1.0])
    assert find_runs(t, [0, np.int64(1)], t, [2, 3]).num_runs == 1


def test_find_runs_links_a_start_address_per_device():
    # fuzz finding (runs, 26 Nov): the same address registered on two devices counted as "a
    # start seen twice", so nothing was linked to either and a run split in two
    from hmacore.runs import desc_table, find_runs
    rows = [[4096 * i, 4096, dev] for i in range(4) for dev in (1, 7)]   # dev 1 and 7 alike
    t = desc_table(np.array(rows, dtype=np.uint64))
    ids = [2 * i + 1 for i in range(4)]                    # device 7's four pages, in order
    got = find_runs(t, ids, t, ids)
    assert got.num_runs == 1 and got.local.tolist() == [[0, 4 * 4096, 7]]
    both = find_runs(t, list(range(8)), t, list(range(8)))
    assert both.num_runs == 2 and sorted(both.local.tolist()) == [[0, 16384, 1],
                                                                  [0, 16384, 7]]


def test_buffer_runs_bad_values_are_block_table_errors():
    from hmacore.runs import buffer_runs
    for parts in ([[(2.5, 4)]], [[(0, 4.0)]], [[(2**64, 1)]], [[(2**64 - 4, 4)]],
                  [[(0, 2**63)]], [[(0, 4, 1)]], [[7]], 7):
        with pytest.raises(BlockTableError):
            buffer_runs(parts)                   # were truncated / OverflowError / TypeError
    for ranges in ([(2**64 - 1, 1)], [(1, -5)], [(2.5, 4)], [(1, 2, 3)]):
        with pytest.raises(BlockTableError, match="ranges"):
            buffer_runs([[(0, 4)]], ranges)      # were OverflowError / accepted
    assert buffer_runs([[(np.uint64(0), 4), (4, np.int64(4))]]) == [[(0, 8)]]


def test_step_pairs_non_sequence_arguments_are_named():
    ts = TrackerSet(_layout(GroupSpec(GroupKind.FULL, 16, ("a",))))
    ts.add("r", [[1, 2]])
    with pytest.raises(TrackerStateError, match="req_ids must be a sequence"):
        ts.step_pairs(7, [], [], [], (16,))      # was TypeError
    with pytest.raises(BlockTableError, match="block_sizes must be a sequence"):
        ts.step_pairs(["r"], [None], [None], [None], 16)   # was TypeError
    local, _, offsets = ts.step_pairs(iter(["r"]), [[[3]]], [None], [None], iter([16]))
    assert len(local) == 0 and offsets.tolist() == [0, 0]
    assert ts.block_ids("r")[0].tolist() == [1, 2, 3]
