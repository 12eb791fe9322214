"""hmacore.regrain refuses what it cannot map, with a message naming the rule (nothing built,
nothing computed)."""
import numpy as np
import pytest

from hmacore.errors import BlockTableError, LayoutError
from hmacore.regrain import RegrainPlan, TokenPage, block_size_ratio, token_page, token_ranges
from hmacore.spec import GroupKind, GroupSpec, KVLayout

from regrain_scenarios import World, allocate


def test_non_integer_ratio_refused():
    with pytest.raises(LayoutError, match="integer multiple"):
        block_size_ratio(16, 24)
    assert block_size_ratio(16, 64) == (4, False)
    assert block_size_ratio(64, 16) == (4, True)


def test_layout_without_contiguous_token_rows_refused_by_name():
    with pytest.raises(LayoutError, match="'HDNX' does not keep a block's token rows"):
        token_page("HDNX", block_size=16, head_bytes=8)
    with pytest.raises(LayoutError, match="page_layout must be one of"):
        token_page("XYZ", block_size=16, head_bytes=8)


def test_cpu_vec_page_model():
    """vLLM CPU's vec pages: per head, K transposed ([head_dim, tokens]) then V ([tokens,
    head_dim]); K chunks of one element per token row."""
    page = token_page("CPU_VEC", block_size=32, heads=2, head_start=1, head_bytes=16, kv=2,
                      head_dim=4)
    off = page.offsets()
    assert off[("k", 1, 0)] == (0, 4) and off[("k", 1, 3)] == (3 * 32 * 4, 4)
    assert off[("v", 1)] == (4 * 32 * 4, 16) and off[("k", 2, 0)] == (2 * 32 * 16, 4)
    assert page.block_bytes == 2 * 2 * 32 * 16
    with pytest.raises(LayoutError, match="kv=2"):
        token_page("CPU_VEC", block_size=32, head_bytes=16, kv=1, head_dim=4)
    with pytest.raises(LayoutError, match="head_dim must be an int"):
        token_page("CPU_VEC", block_size=32, head_bytes=16, kv=2)
    with pytest.raises(LayoutError, match="not head_dim 3 elements"):
        token_page("CPU_VEC", block_size=32, head_bytes=16, kv=2, head_dim=3)


def test_token_page_rules():
    with pytest.raises(LayoutError, match="must divide block_size"):
        TokenPage(16, 5, ((("kv", 0), 4),))
    with pytest.raises(LayoutError, match="repeated keys"):
        TokenPage(16, 16, ((1, 4), (1, 4)))
    with pytest.raises(LayoutError, match="row bytes"):
        TokenPage(16, 16, ((1, 0),))


def _sides(name="gemma_p16_d32"):
    s = allocate(name, "src", 16)
    d = allocate(name, "dst", 16)
    return s, d


def test_mismatched_rows_refused():
    (sl, _, sp, sg), (dl, _, dp, dg) = _sides()
    bad = [token_page("HND", block_size=32, heads=2, head_bytes=4, kv=2) for _ in dg]
    with pytest.raises(LayoutError):   # the region is 1024 B, this page 512 B, rows differ
        RegrainPlan(sl, dl, sp, dp, sg, bad)
    heads3 = [token_page("HND", block_size=32, heads=1, head_start=1, head_bytes=16, kv=2)
              for _ in dg]
    with pytest.raises(LayoutError, match="rows must match|has no source chunk"):
        RegrainPlan(sl, dl, sp, dp, sg, heads3)


def test_groups_must_match():
    (sl, _, sp, sg), (dl, _, dp, dg) = _sides()
    other = KVLayout(groups=(dl.groups[0], GroupSpec(GroupKind.FULL, 32, dl.groups[1].layer_names)))
    with pytest.raises(LayoutError, match="same groups"):
        RegrainPlan(sl, other, sp, dp, sg, dg)
    with pytest.raises(LayoutError, match="one TokenPage or None per group"):
        RegrainPlan(sl, dl, sp, dp, sg, dg[:1])
    with pytest.raises(LayoutError, match="must be a TokenPage"):
        RegrainPlan(sl, dl, sp, dp, sg, [None, None])


def test_state_blocks_must_be_equal():
    (sl, _, sp, sg), (dl, _, dp, dg) = _sides("qwen_next_p16_d64")
    import dataclasses
    regs = [dataclasses.replace(r, block_len=r.block_len - 16) if r.state else r
            for r in dp.regions]
    from hmacore.plan import TransferPlan
    with pytest.raises(LayoutError, match="state blocks map one to one"):
        RegrainPlan(sl, dl, sp, TransferPlan(dl, regs), sg, dg)


def _state_side(bs, page, parts=None, base=1 << 20):
    """A Mamba-only side: layers m0, m1, pages of ``page`` bytes (padding included), each
    layer one region (the whole page) or ``parts`` regions ((offset, bytes) in the page)."""
    from hmacore.plan import Region, TransferPlan
    layout = KVLayout(groups=(GroupSpec(GroupKind.MAMBA, bs, ("m0", "m1")),))
    regs = []
    for j, name in enumerate(("m0", "m1")):
        start = base + j * page * 8
        for off, n in parts or [(0, page)]:
            regs.append(Region(base=start + off, block_len=n, stride=page, logical_blocks=8,
                               ratio=1, group=0, state=True, layers=(name,)))
    return layout, TransferPlan(layout, regs)


def test_padded_state_pages_map_by_state_bytes():
    """State pages padded to other sizes (vLLM pads the Mamba page to each engine's attention
    page): refused as whole pages, mapped by their unpadded state (the page's first bytes)
    when both sides name it; unequal states, states larger than a page and parts that do not
    hold the state back to back are refused by name."""
    sl, sp = _state_side(16, 64)
    dl, dp = _state_side(32, 128, base=1 << 30)
    with pytest.raises(LayoutError, match="give src_state_bytes and dst_state_bytes"):
        RegrainPlan(sl, dl, sp, dp, [None], [None])
    with pytest.raises(LayoutError, match="a state maps only onto a state of equal bytes"):
        RegrainPlan(sl, dl, sp, dp, [None], [None], src_state_bytes=[40], dst_state_bytes=[41])
    with pytest.raises(LayoutError, match="a state of 65 B does not fit the source pages"):
        RegrainPlan(sl, dl, sp, dp, [None], [None], src_state_bytes=[65], dst_state_bytes=[65])
    with pytest.raises(LayoutError, match=r"src_state_bytes\[0\] must be an int >= 1"):
        RegrainPlan(sl, dl, sp, dp, [None], [None], src_state_bytes=[0], dst_state_bytes=[0])
    with pytest.raises(LayoutError, match="one int or None per group"):
        RegrainPlan(sl, dl, sp, dp, [None], [None], src_state_bytes=[40, 1],
                    dst_state_bytes=[40, 1])
    plan = RegrainPlan(sl, dl, sp, dp, [None], [None], src_state_bytes=[40],
                       dst_state_bytes=[40])
    runs = plan.runs([[3, 4]], [[5, 1]], [0], [0])
    got = list(zip(runs.src[:, 0].tolist(), runs.dst[:, 0].tolist(), runs.src[:, 1].tolist()))
    s0, d0 = 1 << 20, 1 << 30
    assert got == [(s0 + 3 * 64, d0 + 5 * 128, 40), (s0 + 4 * 64, d0 + 128, 40),
                   (s0 + 8 * 64 + 3 * 64, d0 + 8 * 128 + 5 * 128, 40),
                   (s0 + 8 * 64 + 4 * 64, d0 + 8 * 128 + 128, 40)]
    # a layer's state tensors as parts (conv 24 B then ssm 32 B, padding after): the state's
    # bytes of each part move, the padding does not
    sl2, sp2 = _state_side(16, 64, parts=[(0, 24), (24, 40)])
    dl2, dp2 = _state_side(32, 128, parts=[(0, 24), (24, 104)], base=1 << 30)
    plan = RegrainPlan(sl2, dl2, sp2, dp2, [None], [None], src_state_bytes=[56],
                       dst_state_bytes=[56])
    assert [p.state_bytes for p in plan.pairs] == [24, 32, 24, 32]
    bad, bp = _state_side(32, 128, parts=[(0, 16), (24, 104)], base=1 << 30)
    with pytest.raises(LayoutError, match="starts 24 B into its page, its parts end at 16 B"):
        RegrainPlan(sl2, bad, sp2, bp, [None], [None], src_state_bytes=[56],
                    dst_state_bytes=[56])
    odd, op = _state_side(32, 128, parts=[(0, 16), (16, 112)], base=1 << 30)
    with pytest.raises(LayoutError, match="state part 0 holds state bytes"):
        RegrainPlan(sl2, odd, sp2, op, [None], [None], src_state_bytes=[56],
                    dst_state_bytes=[56])


def test_request_refusals_name_the_rule():
    w = World("gemma_p16_d32", 100, 0, 3)
    plan = w.plan()
    s = [t for t, _ in w.st]
    d = [t for t, _ in w.dt]
    lo, hi = w.lo, w.hi
    sf, df = [f for _, f in w.st], [f for _, f in w.dt]
    with pytest.raises(BlockTableError, match="holds blocks"):
        plan.runs([x[:-1] for x in s], d, lo, hi, src_first=sf, dst_first=df)
    null = [list(x) for x in d]
    null[0][0] = 0
    with pytest.raises(BlockTableError, match="null block"):
        plan.runs(s, null, lo, hi, src_first=sf, dst_first=df)
    big = [list(x) for x in s]
    big[0][0] = 64
    with pytest.raises(BlockTableError, match=r"real block id in \[1, 64\)"):
        plan.runs(big, d, lo, hi, src_first=sf, dst_first=df)
    with pytest.raises(BlockTableError, match="must be >= lo"):
        plan.runs(s, d, [50, 50], [10, 10], src_first=sf, dst_first=df)
    with pytest.raises(BlockTableError, match=r"int in \[0, 2\*\*62\)"):
        plan.runs(s, d, [0.5, 0], hi, src_first=sf, dst_first=df)
    with pytest.raises(BlockTableError, match="one entry per group"):
        plan.runs(s[:1], d, lo, hi)
    with pytest.raises(BlockTableError, match="bools"):
        plan.runs([[True] * len(s[0]), s[1]], d, lo, hi, src_first=sf, dst_first=df)


def test_mamba_counts_must_match():
    w = World("qwen_next_p16_d64", 100, 0, 3)
    plan = w.plan()
    s = [t for t, _ in w.st]
    d = [list(t) for t, _ in w.dt]
    d[1] = d[1] + [5]
    with pytest.raises(BlockTableError, match="map one to one"):
        plan.runs(s, d, w.lo, w.hi, src_first=[f for _, f in w.st],
                  dst_first=[f for _, f in w.dt])


def test_token_ranges():
    lay = KVLayout(groups=(GroupSpec(GroupKind.FULL, 16, ("a",)),
                           GroupSpec(GroupKind.SLIDING_WINDOW, 16, ("b",), sliding_window=32),
                           GroupSpec(GroupKind.MAMBA, 16, ("c",))))
    # sliding window: the 32 tokens before the last (vLLM recomputes token 99 after a
    # whole-prompt load; it attends to tokens 68..98)
    assert token_ranges(lay, 100, 20) == ((20, 68, 0), (100, 100, 0))
    assert token_ranges(lay, 10, 0) == ((0, 0, 0), (10, 10, 0))
    chunked = KVLayout(groups=(GroupSpec(GroupKind.CHUNKED_LOCAL, 16, ("a",), chunk_size=32),))
    # token 63 lies in the chunk [32, 64): its chunk is needed even though 64 starts a new one
    assert token_ranges(chunked, 64, 0) == ((32,), (64,))
    assert token_ranges(chunked, 65, 0) == ((64,), (65,))
    with pytest.raises(LayoutError):
        token_ranges(lay, 10, 11)


def test_empty_ranges_move_nothing():
    w = World("gemma_p16_d32", 64, 64, 3)
    r = w.runs()
    assert r.num_runs == 0 and r.nbytes == 0 and r.src.shape == (0, 3)
    assert np.array_equal(r.as_runs().local, r.dst)


def test_regrain_fingerprint_ignores_only_what_follows_the_block_size():
    def lay(bs, window=64, unit=None, kernel=None):
        return KVLayout(groups=(GroupSpec(GroupKind.FULL, bs, ("a",), kernel_block_size=kernel),
                                GroupSpec(GroupKind.SLIDING_WINDOW, bs, ("b",),
                                          sliding_window=window)), prefix_match_unit=unit)
    base = lay(16)
    assert base.regrain_fingerprint() == lay(64, unit=64, kernel=32).regrain_fingerprint()
    assert base.pairing_fingerprint() != lay(64).pairing_fingerprint()
    assert base.regrain_fingerprint() != lay(16, window=32).regrain_fingerprint()
    assert base.fingerprint() == KVLayout(groups=base.groups).fingerprint()
