"""hmacore.windows golden vectors (vllm-hma.md §4.2, §4.6, §11.2, §11.4, §11.8, §13.2) and
bad-input handling."""
import numpy as np
import pytest

from hmacore.errors import BlockTableError
from hmacore.presets import get_preset
from hmacore.spec import GroupKind, GroupSpec, KVLayout
from hmacore.windows import (clip_state_blocks, clip_to_window, expand_group, expand_layout_to_kernel,
                             expand_to_kernel, map_block_size, trim_remote_to_local)

FULL, SW, MAMBA = GroupKind.FULL, GroupKind.SLIDING_WINDOW, GroupKind.MAMBA
# FA + SW(bs 16, window 32) -> window_blocks 3 (the §11.2 N=96 example).
FA_SW = KVLayout(groups=(GroupSpec(FULL, 16), GroupSpec(SW, 16, sliding_window=32)), num_blocks=1000)
FA_MAMBA = KVLayout(groups=(GroupSpec(FULL, 16), GroupSpec(MAMBA, 16, num_speculative_blocks=2)),
                    num_blocks=1000)


def lists(t):
    return [x.tolist() for x in t]


def check_int32(t):
    assert all(isinstance(x, np.ndarray) and x.dtype == np.int32 for x in t)


# -- clipping -------------------------------------------------------------------------
def test_sw_clip_golden():
    got = clip_to_window((list(range(1, 21)), [0, 0, 0, 0, 7, 8]), FA_SW)
    check_int32(got)
    assert lists(got) == [list(range(1, 21)), [0, 7, 8]]


def test_sw_clip_full_hit_and_short_lists():
    assert clip_to_window((), FA_SW) == ()
    assert clip_to_window([], FA_SW) == ()
    single = KVLayout(groups=(GroupSpec(SW, 16, sliding_window=32),))
    assert clip_to_window((), single) == ()          # full hit, also with one group
    assert lists(clip_to_window(([],), single)) == [[]]
    assert trim_remote_to_local((), ([1],), single) == ((), ())
    assert lists(clip_to_window(([1, 2], [5, 6]), FA_SW)) == [[1, 2], [5, 6]]
    assert lists(clip_to_window(([], []), FA_SW)) == [[], []]


def test_sw_clip_uses_each_groups_block_size():
    dsv4 = get_preset("deepseek-v4", num_blocks=1000)
    table = tuple(list(range(1, 33)) for _ in range(5))
    got = clip_to_window(table, dsv4)
    assert [len(x) for x in got] == [32, 3, 3, 3, 17]
    assert got[4].tolist() == list(range(16, 33))


def test_sw_clip_exact_bound():
    layout = KVLayout(groups=(GroupSpec(SW, 16, sliding_window=129),))
    ids = list(range(1, 21))
    assert len(clip_to_window((ids,), layout)[0]) == 10
    assert clip_to_window((ids,), layout, exact=True)[0].tolist() == ids[-9:]


@pytest.mark.parametrize("blocks,n,want", [([11, 12, 13], 2, [11]), ([11], 2, [11]), ([], 2, []),
                                           ([11, 12, 13], 0, [13]), ([11, 12, 13], 5, [11]),
                                           ([11, 12, 13, 14], 1, [13])])
def test_clip_state_blocks_golden(blocks, n, want):
    got = clip_state_blocks(blocks, n)
    assert got.dtype == np.int32 and got.tolist() == want


def test_mamba_clip_in_layout():
    assert lists(clip_to_window(([1, 2, 3], [4, 5, 6]), FA_MAMBA)) == [[1, 2, 3], [4]]
    assert lists(clip_to_window(([1, 2, 3], [4, 5, 6]), FA_MAMBA, clip_state=False)) == \
        [[1, 2, 3], [4, 5, 6]]


def test_clip_validates_only_what_it_keeps():
    # Index in the message is the caller's index, not the slice's.
    with pytest.raises(BlockTableError, match="block_ids: group 1, index 5: block id -1 is negative"):
        clip_to_window(([1], [0, 0, 0, 5, 6, -1]), FA_SW)
    # An entry clipped away is never inspected (O(kept) for list input).
    assert lists(clip_to_window(([1], [-7, 0, 0, 5, 6, 7]), FA_SW)) == [[1], [5, 6, 7]]
    with pytest.raises(BlockTableError, match="group 1 must be 1-D"):
        clip_to_window(([1], np.zeros((2, 2), np.int32)), FA_SW)
    a = np.arange(1, 10, dtype=np.int32)
    got = clip_to_window(([1], a), FA_SW)[1]
    assert got.tolist() == [7, 8, 9] and np.shares_memory(got, a)


def test_clip_rejects():
    with pytest.raises(BlockTableError, match="block_ids has 1 groups, the layout has 2"):
        clip_to_window(([1],), FA_SW)
    with pytest.raises(BlockTableError, match="group 1, index 0: block id -2 is negative"):
        clip_to_window(([1], [-2]), FA_SW)
    with pytest.raises(BlockTableError, match="block id 1000 is >= num_blocks"):
        clip_to_window(([1000], []), FA_SW)
    with pytest.raises(BlockTableError, match="num_speculative_blocks must be an int >= 0"):
        clip_state_blocks([1], -1)
    with pytest.raises(BlockTableError, match="num_speculative_blocks must be an int >= 0"):
        clip_state_blocks([1], True)
    with pytest.raises(TypeError, match="layout must be a KVLayout"):
        clip_to_window(([1], [2]), "gpt-oss")


# -- trimming -------------------------------------------------------------------------
def test_trim_golden_end_alignment():
    local = ([], [2, 3, 4, 5, 6])
    remote = ([], [100, 101, 102, 103, 104, 105, 106])
    l, r = trim_remote_to_local(local, remote, FA_SW)
    assert lists(l) == [[], [2, 3, 4, 5, 6]] and lists(r) == [[], [102, 103, 104, 105, 106]]


def test_trim_empty_local_gives_empty_remote_not_whole_list():
    l, r = trim_remote_to_local(([], [5]), ([1, 2, 3], [9]), FA_SW)
    assert lists(r) == [[], [9]]
    assert trim_remote_to_local((), ([1], [2]), FA_SW) == ((), ())


def test_trim_strips_remote_leading_nulls():
    # P list [0, p4, p5] (window longer than the prompt), D list [d4, d5] -> [p4, p5].
    l, r = trim_remote_to_local(([1, 2, 3], [40, 50]), ([7, 8, 9], [0, 104, 105]), FA_SW)
    assert lists(r) == [[7, 8, 9], [104, 105]]
    with pytest.raises(BlockTableError, match="group 1: the remote block paired with local index 0 "
                       "is the null block 0; remote has fewer real blocks than the 3 local needs"):
        trim_remote_to_local(([], [40, 50, 60]), ([], [0, 104, 105]), FA_SW)
    with pytest.raises(BlockTableError, match="group 1: local needs 4 blocks but remote has only 3"):
        trim_remote_to_local(([], [40, 50, 60, 70]), ([], [0, 104, 105]), FA_SW)


def test_trim_mamba_pairs_by_position():
    l, r = trim_remote_to_local(([1], [7]), ([11], [17, 18]), FA_MAMBA)
    assert lists(l) == [[1], [7]] and lists(r) == [[11], [17]]
    l, r = trim_remote_to_local(([1], []), ([11], [17]), FA_MAMBA)
    assert lists(l) == [[1], []] and lists(r) == [[11], []]
    with pytest.raises(BlockTableError, match="group 1 \\(MAMBA\\): local has 3 state slots, remote 1"):
        trim_remote_to_local(([1], [5, 6, 7]), ([11], [17]), FA_MAMBA)


def test_trim_unequal_kernel_ratios_front_trims():
    l, r = trim_remote_to_local(([1, 2, 3, 4, 5], []), ([11, 12, 13], []), FA_SW,
                                local_kernel_ratios=(2, 1), remote_kernel_ratios=(1, 1))
    assert lists(l) == [[1, 2, 3], []] and lists(r) == [[11, 12, 13], []]
    with pytest.raises(BlockTableError, match="more than the 3 blocks of padding"):
        trim_remote_to_local((list(range(1, 9)), []), ([11, 12], []), FA_SW,
                             local_kernel_ratios=(2, 1), remote_kernel_ratios=1)


def test_trim_rejects():
    with pytest.raises(BlockTableError, match="local has 1 groups"):
        trim_remote_to_local(([1],), ([1], [2]), FA_SW)
    with pytest.raises(BlockTableError, match="^remote: group 0, index 1: block id -1"):
        trim_remote_to_local(([1], [2]), ([5, -1], [2]), FA_SW)
    with pytest.raises(BlockTableError, match="^remote: group 1 is None"):
        trim_remote_to_local(([1], [2]), ([5], None), FA_SW)
    with pytest.raises(BlockTableError, match="^remote: group 0, index 2: block ids must be integers"):
        trim_remote_to_local(([1, 2], [2]), ([5, 6, 7.0], [2]), FA_SW)
    with pytest.raises(BlockTableError, match="local_kernel_ratios\\[1\\] must be an int >= 1"):
        trim_remote_to_local(([1], [2]), ([1], [2]), FA_SW, local_kernel_ratios=(1, 0))
    with pytest.raises(BlockTableError, match="remote_kernel_ratios must be an int or one int per group"):
        trim_remote_to_local(([1], [2]), ([1], [2]), FA_SW, remote_kernel_ratios=(1, 1, 1))
    # remote ids may exceed the local pool (they live in the peer's pool)
    assert lists(trim_remote_to_local(([1], []), ([5000], []), FA_SW)[1]) == [[5000], []]


# -- kernel / peer block-size expansion -----------------------------------------------
def test_expand_golden():
    assert lists(expand_to_kernel([[0, 1, 2], [3, 4]], 2)) == [list(range(6)), list(range(6, 10))]
    got = expand_to_kernel(([0, 1, 2], [10, 11]), (2, 1), strides=(261, 1))
    check_int32(got)
    assert lists(got) == [[0, 1, 261, 262, 522, 523], [10, 11]]
    assert expand_to_kernel((), 2) == ()
    assert lists(expand_to_kernel([5], 3)) == [[15, 16, 17]]


def test_expand_layout_uses_kernel_ratio_and_skips_mamba():
    q = get_preset("qwen3-next-80b")  # 3 Mamba groups + FA (ratio 34)
    got = expand_layout_to_kernel(([1], [2], [3], [0, 2]), q)
    assert lists(got)[:3] == [[1], [2], [3]]
    assert got[3].tolist() == list(range(34)) + list(range(68, 102))


def test_expand_overflow_is_an_error():
    with pytest.raises(BlockTableError, match="overflows int32"):
        expand_to_kernel([[2**31 // 2]], 2)
    assert expand_to_kernel([[2**31 // 2 - 1]], 2)[0].tolist() == [2**31 - 2, 2**31 - 1]
    with pytest.raises(BlockTableError, match="overflows int32"):
        expand_group([2**31 - 1], 1, stride=2)


def test_expand_group_out():
    out = np.full(8, -7, dtype=np.int32)
    got = expand_group([1, 2], 3, out=out)
    assert got.tolist() == [3, 4, 5, 6, 7, 8] and np.shares_memory(got, out)
    assert expand_group([1, 2], 3, limit=4).tolist() == [3, 4, 5, 6]
    ro = np.zeros(6, dtype=np.int32)
    ro.flags.writeable = False
    for bad, msg in (([0] * 6, "out must be a NumPy array"),
                     (np.zeros(6, np.int64), "out must be a 1-D int32 array"),
                     (np.zeros((6, 1), np.int32), "out must be a 1-D int32 array"),
                     (np.zeros(12, np.int32)[::2], "out must be C-contiguous"),
                     (ro, "out must be writeable"), (np.zeros(5, np.int32), "out has 5 slots, needs 6")):
        with pytest.raises(BlockTableError, match=msg):
            expand_group([1, 2], 3, out=bad)


@pytest.mark.parametrize("kw,msg", [({"ratio": 0}, "ratio must be an int >= 1"),
                                    ({"ratio": True}, "ratio must be an int >= 1"),
                                    ({"ratio": 4, "stride": 2}, "ratio \\(4\\) must be <= stride"),
                                    ({"ratio": 2, "limit": -1}, "limit must be an int >= 0")])
def test_expand_group_rejects(kw, msg):
    with pytest.raises(BlockTableError, match=msg):
        expand_group([1], **kw)


def test_expand_to_kernel_rejects():
    with pytest.raises(BlockTableError, match="ratios must be an int or one int per group \\(2\\)"):
        expand_to_kernel([[1], [2]], (1, 2, 3))
    with pytest.raises(BlockTableError, match="ratios\\[0\\] must be an int >= 1"):
        expand_to_kernel([[1], [2]], (0, 1))
    with pytest.raises(BlockTableError, match="group 1, index 0: block id -1 is negative"):
        expand_to_kernel([[1], [-1]], 2)


def test_map_block_size_golden():
    # Local block 16 tokens, remote 4 (ratio 4); remote has 10 blocks -> clip to 10.
    got = map_block_size(([1, 2, 3], [9]), 4, (10, 2), FA_MAMBA)
    assert lists(got) == [[4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [9]]
    assert map_block_size(([], []), 4, (0, 0), FA_SW) == ()
    assert map_block_size(([1], []), 4, (0, 0), FA_SW) == ()
    assert map_block_size((), 4, (3, 3), FA_SW) == ()
    with pytest.raises(BlockTableError, match="remote_lengths\\[1\\] must be an int >= 0"):
        map_block_size(([1], [2]), 4, (3, -1), FA_SW)
    with pytest.raises(BlockTableError, match="ratio must be an int >= 1"):
        map_block_size(([1], [2]), 0, (3, 3), FA_SW)


def test_empty_everything():
    from hmacore.tables import TrackerSet, count_hashed, fill_blocks
    from hmacore.windows import clip_tracked
    ts = TrackerSet(FA_SW)
    assert ts.apply_step() == {} and len(ts) == 0
    assert clip_tracked(ts, []) == []
    ts.add("e", ([], []))
    assert lists(clip_tracked(ts, ["e"])[0]) == [[], []]
    assert lists(ts.finish("e")) == [[], []]
    assert lists(fill_blocks(([], []), [[], []])) == [[], []]
    assert count_hashed(([], []), [[], []]) == (0, 0)
    assert expand_group([], 3).tolist() == [] and expand_group([], 3).dtype == np.int32
    assert lists(expand_to_kernel(([], []), 4)) == [[], []]
    assert lists(expand_layout_to_kernel(([], []), FA_SW)) == [[], []]
    l, r = trim_remote_to_local(([], []), ([], []), FA_SW)
    assert lists(l) == lists(r) == [[], []]
    assert clip_state_blocks(np.array([], dtype=np.int32), 3).tolist() == []


def test_expand_rejects_a_ratio_that_would_allocate_gigabytes():
    from hmacore.errors import BlockTableError
    from hmacore.windows import MAX_RATIO, expand_group
    with pytest.raises(BlockTableError, match="ratio must be <="):
        expand_group([0], 2**31 - 1)
    assert len(expand_group([1], MAX_RATIO, stride=MAX_RATIO)) == MAX_RATIO
