"""Mamba / GDN state pages across P and D TP sizes (hmacore.state_tp, issue 20).

Golden byte ranges are worked out by hand from the design rule (written next to each case);
the Hypothesis test shards a random global state per rank the way vLLM does (each conv
sub-projection and the ssm heads separately, DS or SD) and checks every byte of every
destination page after copying with :func:`state_ranges`.
"""
import dataclasses

import numpy as np
import pytest
from hypothesis import given, strategies as st

from hmacore.errors import HandshakeError, LayoutError
from hmacore.state_tp import (STATE_KINDS, GlobalStateGeometry, StateGeometry, source_ranks,
                              state_ranges)


def gdn_g(layout="DS", rows=3):
    """Design note's tiny GDN: num_k_heads 2, num_v_heads 4, head dims 8, kernel 4, fp16.
    Global Q 16, K 16, V 32 channels; ssm (4 heads, 8, 8) fp16 = 128 B per head."""
    return GlobalStateGeometry("GDN_ATTN", layout, rows, 2, (16, 16, 32), (2, 2, 4), 4, 128)


def gdn(tp, layout="DS", rows=3):
    return gdn_g(layout, rows).at(tp)


def mamba2_g(n_groups, layout="DS"):
    """Tiny Mamba2: I 8, N 4, nheads 4, head_dim 2, kernel 4 (R 3), conv fp16, ssm fp32
    (2*4*4 = 32 B per head). n_groups == 1: B and C (width N) replicated on every rank."""
    return GlobalStateGeometry("MAMBA2", layout, 3, 2, (8, 4 * n_groups, 4 * n_groups),
                               (4, n_groups, n_groups), 4, 32)


def mamba2(tp, n_groups, layout="DS"):
    return mamba2_g(n_groups, layout).at(tp)


def mamba1(tp, layout="DS"):
    """Tiny Mamba1: I 8, state 4 fp32 (16 B per channel), kernel 4 (R 3), conv fp16."""
    return GlobalStateGeometry("MAMBA1", layout, 3, 2, (8,), (8,), 8, 16).at(tp)


def test_at_derives_the_per_rank_geometry():
    assert gdn(2) == StateGeometry("GDN_ATTN", 2, "DS", 3, 2, (8, 8, 16), (False,) * 3, 2, 128)
    # Mamba2 one group: B/C whole at every tp (also tp 1, where both readings coincide)
    for tp in (1, 2, 4):
        assert mamba2(tp, 1).proj_widths == (8 // tp, 4, 4)
        assert mamba2(tp, 1).proj_replicated == (False, True, True)
    assert mamba2(2, 2).proj_replicated == (False, False, False)
    assert mamba2(2, 2).proj_widths == (4, 4, 4)


@pytest.mark.parametrize("g,tp,msg", [
    (gdn_g(), 4, "tp 4 does not divide conv sub-projection 0's 2 groups"),
    (mamba2_g(2), 4, "tp 4 does not divide conv sub-projection 1's 2 groups"),
    (GlobalStateGeometry("MAMBA2", "DS", 3, 2, (8, 4, 4), (8, 1, 1), 2, 32), 4,
     "tp 4 does not divide the 2 ssm heads"),
    (gdn_g(), 0, r"at: tp must be an int in \[1, 65536\], got 0"),
    (gdn_g(), 2.0, r"at: tp must be an int in \[1, 65536\], got 2.0"),
    (gdn_g(), True, "tp must be an int"),
])
def test_at_refuses_a_tp_that_does_not_shard(g, tp, msg):
    with pytest.raises(LayoutError, match=msg):
        g.at(tp)
    assert issubclass(LayoutError, ValueError)


def test_gdn_sizes_match_the_note():
    assert (gdn(1).conv_bytes, gdn(1).ssm_bytes, gdn(1).content_bytes) == (384, 512, 896)
    assert (gdn(2).conv_bytes, gdn(2).ssm_bytes, gdn(2).content_bytes) == (192, 256, 448)


# DS, u = R*dt = 6 B per channel. P1 page: Q [0,96) K [96,192) V [192,384) ssm [384,896).
# D2 rank d reads Q[8d,8d+8) K[8d..] V[16d..] heads [2d, 2d+2).
def test_gdn_ds_p1_d2():
    assert state_ranges(gdn(1), 0, gdn(2), 0) == [(0, 0, 48), (96, 48, 48), (192, 96, 96),
                                                  (384, 192, 256)]
    assert state_ranges(gdn(1), 0, gdn(2), 1) == [(48, 0, 48), (144, 48, 48), (288, 96, 96),
                                                  (640, 192, 256)]


# P2 rank p page: Q [0,48) K [48,96) V [96,192) ssm [192,448); it fills slot p of each piece.
def test_gdn_ds_p2_d1():
    assert state_ranges(gdn(2), 0, gdn(1), 0) == [(0, 0, 48), (48, 96, 48), (96, 192, 96),
                                                  (192, 384, 256)]
    assert state_ranges(gdn(2), 1, gdn(1), 0) == [(0, 48, 48), (48, 144, 48), (96, 288, 96),
                                                  (192, 640, 256)]


@pytest.mark.parametrize("layout", ["DS", "SD"])
def test_equal_tp_is_the_identity(layout):
    for d in range(2):
        for p in range(2):
            # conv then ssm: never merged across the conv/ssm boundary
            want = [(0, 0, 192), (192, 192, 256)] if p == d else []
            assert state_ranges(gdn(2, layout), p, gdn(2, layout), d) == want
    assert state_ranges(mamba2(1, 1, layout), 0, mamba2(1, 1, layout), 0) == [(0, 0, 96),
                                                                              (96, 96, 128)]


# SD: conv element (row r, channel c) at (r*C + c)*2; P1 C = 64, D2 C = 32. D rank 1 reads,
# per row, Q channels 8..15 -> 0..7, K 24..31 -> 8..15, V 48..63 -> 16..31; ssm heads 2, 3.
def test_gdn_sd_p1_d2():
    want = []
    for r in range(3):
        want += [((r * 64 + 8) * 2, (r * 32) * 2, 16), ((r * 64 + 24) * 2, (r * 32 + 8) * 2, 16),
                 ((r * 64 + 48) * 2, (r * 32 + 16) * 2, 32)]
    want.append((384 + 256, 192, 256))
    got = state_ranges(gdn(1, "SD"), 0, gdn(2, "SD"), 1)
    assert got == want and len(got) == 10
    assert got[:3] == [(16, 0, 16), (48, 16, 16), (96, 32, 32)]


# SD, P2 -> D1: P rank 1's row r (32 channels) lands in D row r at Q 8.., K 24.., V 48..
def test_gdn_sd_p2_d1():
    want = []
    for r in range(3):
        want += [((r * 32) * 2, (r * 64 + 8) * 2, 16), ((r * 32 + 8) * 2, (r * 64 + 24) * 2, 16),
                 ((r * 32 + 16) * 2, (r * 64 + 48) * 2, 32)]
    want.append((192, 384 + 256, 256))
    assert state_ranges(gdn(2, "SD"), 1, gdn(1, "SD"), 0) == want


# Mamba2 G=2 (all sharded). P1 page: x [0,48) B [48,96) C [96,144) ssm [144,272).
def test_mamba2_groups_sharded():
    assert state_ranges(mamba2(1, 2), 0, mamba2(2, 2), 1) == [(24, 0, 24), (72, 24, 24),
                                                              (120, 48, 24), (208, 72, 64)]
    assert state_ranges(mamba2(2, 2), 1, mamba2(1, 2), 0) == [(0, 24, 24), (24, 72, 24),
                                                              (48, 120, 24), (72, 208, 64)]


# Mamba2 n_groups == 1: P1 page x [0,48) B [48,72) C [72,96) ssm [96,224); D2 page x [0,24)
# B [24,48) C [48,72) ssm [72,136). Both D ranks read B and C WHOLE (vLLM's formula would
# give D rank 1 P's C as its B). Adjacent conv ranges merge; B+C never merge with the heads
# that follow them (P [96..) / D [72..) is the conv/ssm boundary).
def test_mamba2_one_group_replicates_b_and_c():
    assert state_ranges(mamba2(1, 1), 0, mamba2(2, 1), 0) == [(0, 0, 24), (48, 24, 48),
                                                              (96, 72, 64)]
    assert state_ranges(mamba2(1, 1), 0, mamba2(2, 1), 1) == [(24, 0, 72), (160, 72, 64)]
    # P2 -> D1: B/C only from the first source rank; P rank 1 gives its x half and heads
    assert state_ranges(mamba2(2, 1), 0, mamba2(1, 1), 0) == [(0, 0, 24), (24, 48, 48),
                                                              (72, 96, 64)]
    assert state_ranges(mamba2(2, 1), 1, mamba2(1, 1), 0) == [(0, 24, 24), (72, 160, 64)]
    # SD (P rows of 16 channels x|B|C = 8|4|4, D rows of 12 = 4|4|4): per row, x half 2 then
    # B and C whole are contiguous on both sides -> one 24 B range per row, then the heads
    assert state_ranges(mamba2(1, 1, "SD"), 0, mamba2(2, 1, "SD"), 1) == [
        (8, 0, 24), (40, 24, 24), (72, 48, 24), (160, 72, 64)]


def test_mamba1():
    # P1: conv [0,48) ssm [48,176) (8 channels x 16 B); D2 rank 1: channels 4..7
    assert state_ranges(mamba1(1), 0, mamba1(2), 1) == [(24, 0, 24), (112, 24, 64)]
    assert state_ranges(mamba1(2), 1, mamba1(1), 0) == [(0, 24, 24), (24, 112, 64)]
    sd = state_ranges(mamba1(1, "SD"), 0, mamba1(2, "SD"), 1)
    assert sd == [(8, 0, 8), (24, 8, 8), (40, 16, 8), (112, 24, 64)]


def test_source_ranks():
    assert list(source_ranks(1, 2, 1)) == [0]
    assert list(source_ranks(2, 8, 5)) == [1]
    assert list(source_ranks(8, 2, 1)) == [4, 5, 6, 7]
    assert list(source_ranks(4, 4, 3)) == [3]
    # a rank outside the sources gives nothing
    g4 = GlobalStateGeometry("GDN_ATTN", "DS", 3, 2, (16, 16, 32), (4, 4, 8), 8, 128)
    assert state_ranges(g4.at(2), 1, g4.at(4), 0) == []
    assert state_ranges(g4.at(2), 0, g4.at(4), 1)
    with pytest.raises(HandshakeError, match="neither divides"):
        source_ranks(2, 3, 0)
    with pytest.raises(LayoutError, match="dst_rank must be an int in"):
        source_ranks(2, 1, 1)


@pytest.mark.parametrize("args,msg", [
    ((0, 2, 0), r"src_tp must be an int in \[1, 65536\], got 0"),
    ((2, 0, 0), r"dst_tp must be an int in \[1, 65536\], got 0"),
    ((2.0, 1, 0), "src_tp must be an int"),
    (("2", 1, 0), "src_tp must be an int"),
    ((None, 2, 0), "src_tp must be an int"),
    ((-2, 1, 0), "src_tp must be an int"),
    ((1, 2, 0.5), r"dst_rank must be an int in \[0, 2\), got 0.5"),
    ((1, 2, True), "dst_rank must be an int"),
])
def test_source_ranks_refuses_bad_arguments_by_name(args, msg):
    with pytest.raises(LayoutError, match=msg):
        source_ranks(*args)


# ---------------------------------------------------------------------------- property test

def _shard(glob, tp, r, replicated):
    if replicated:
        return glob
    w = glob.shape[0] // tp
    return glob[r * w:(r + 1) * w]


def _page(projs, ssm, geo, r, pad, fill):
    """vLLM's per-rank page: each sub-projection sharded on its own, concatenated on the
    channel dim; DS = (C, R) bytes, SD = (R, C); then the ssm heads; then padding."""
    conv = np.concatenate([_shard(g, geo.tp, r, rep)
                           for g, rep in zip(projs, geo.proj_replicated)])  # (C, R, dt)
    if geo.conv_layout == "SD":
        conv = conv.transpose(1, 0, 2)
    heads = _shard(ssm, geo.tp, r, False)
    return np.concatenate([conv.reshape(-1), heads.reshape(-1),
                           np.full(pad, fill, np.uint8)])


@st.composite
def geometry_pairs(draw):
    """A legal global geometry (the kind's invariants, Mamba2 B/C of one group or sharded)
    and two TP sizes it shards at."""
    kind = draw(st.sampled_from(sorted(STATE_KINDS)))
    tp_p, tp_d = draw(st.sampled_from([1, 2, 4, 8])), draw(st.sampled_from([1, 2, 4, 8]))
    top = max(tp_p, tp_d)

    def piece():
        g = top * draw(st.integers(1, 3))
        return g, g * draw(st.integers(1, 2))
    if kind == "MAMBA1":
        w = top * draw(st.integers(1, 3))
        groups, widths, heads = (w,), (w,), w
    else:
        (g0, w0), (g1, w1), (g2, w2) = piece(), piece(), piece()
        if kind == "MAMBA2" and draw(st.booleans()):
            g1, w1 = 1, draw(st.integers(1, 6))    # one group: replicated B/C
        if kind == "GDN_ATTN":
            groups, widths = (g0, g0, g2), (w0, w0, w2)
        else:
            groups, widths = (g0, g1, g1), (w0, w1, w1)
        heads = top * draw(st.integers(1, 3))
    g = GlobalStateGeometry(kind, draw(st.sampled_from(["DS", "SD"])), draw(st.integers(1, 4)),
                            draw(st.sampled_from([1, 2, 4])), widths, groups, heads,
                            draw(st.integers(1, 24)))
    return g.at(tp_p), g.at(tp_d), draw(st.integers(0, 2**31))


@given(geometry_pairs())
def test_copy_reproduces_every_destination_page(case):
    src, dst, seed = case
    rng = np.random.default_rng(seed)
    R, dt = src.conv_rows, src.conv_itemsize
    gw = [w if rep else w * src.tp for w, rep in zip(src.proj_widths, src.proj_replicated)]
    gh = src.ssm_heads * src.tp
    projs = [rng.integers(0, 256, (w, R, dt), dtype=np.uint8) for w in gw]
    ssm = rng.integers(0, 256, (gh, src.ssm_head_bytes), dtype=np.uint8)
    src_pages = [_page(projs, ssm, src, p, 7, 0x5A) for p in range(src.tp)]
    for d in range(dst.tp):
        want = _page(projs, ssm, dst, d, 9, 0xC3)
        page = np.full(dst.content_bytes + 9, 0xC3, np.uint8)
        written = np.zeros(page.size, np.int64)
        for p in range(src.tp):
            ranges = state_ranges(src, p, dst, d)
            sources = source_ranks(src.tp, dst.tp, d)
            # every source rank of d holds some ssm heads of d
            assert bool(ranges) == (p in sources)
            for s, o, nb in ranges:
                assert nb > 0 and s + nb <= src.content_bytes and o + nb <= dst.content_bytes
                # no range crosses the conv/ssm boundary on either side
                assert (s + nb <= src.conv_bytes) == (o + nb <= dst.conv_bytes)
                assert s >= src.conv_bytes or s + nb <= src.conv_bytes
                assert o >= dst.conv_bytes or o + nb <= dst.conv_bytes
                page[o:o + nb] = src_pages[p][s:s + nb]
                written[o:o + nb] += 1
        assert (written[:dst.content_bytes] == 1).all(), "every content byte written once"
        assert not written[dst.content_bytes:].any(), "padding never written"
        assert np.array_equal(page, want)


# ---------------------------------------------------------------------------- refusals

@pytest.mark.parametrize("field,other,msg", [
    ("conv_layout", "SD", "conv_layout is 'DS' at the source, 'SD'"),
    ("conv_rows", 4, "conv_rows is 3 at the source, 4"),
    ("conv_itemsize", 4, "conv_itemsize is 2 at the source, 4"),
    ("ssm_head_bytes", 64, "ssm_head_bytes is 128"),
])
def test_refuses_unequal_fields(field, other, msg):
    bad = dataclasses.replace(gdn(2), **{field: other})
    with pytest.raises(HandshakeError, match=msg):
        state_ranges(gdn(1), 0, bad, 0)


def test_refuses_other_kind_and_mismatched_pieces():
    with pytest.raises(HandshakeError, match="kind is 'MAMBA2' at the source, 'GDN_ATTN'"):
        state_ranges(mamba2(1, 2), 0, gdn(2), 0)
    # widths that neither shard one global width nor replicate
    bad = StateGeometry("GDN_ATTN", 2, "DS", 3, 2, (8, 8, 12), (False,) * 3, 2, 128)
    with pytest.raises(HandshakeError,
                       match="sub-projection 2 is 32 per rank x tp 1 .* 12 x tp 2 .* neither"):
        state_ranges(gdn(1), 0, bad, 0)
    bad = StateGeometry("GDN_ATTN", 2, "DS", 3, 2, (8, 8, 16), (False,) * 3, 3, 128)
    with pytest.raises(HandshakeError, match="ssm heads is 4 per rank x tp 1"):
        state_ranges(gdn(1), 0, bad, 0)
    # replicated on one side only; replicated but of different widths
    half = StateGeometry("MAMBA2", 2, "DS", 3, 2, (4, 4, 4), (False, False, False), 2, 32)
    with pytest.raises(HandshakeError, match="sub-projection 1 is replicated at the source, "
                                             "sharded at the destination"):
        state_ranges(mamba2(1, 1), 0, half, 0)
    wide = StateGeometry("MAMBA2", 2, "DS", 3, 2, (4, 6, 6), (False, True, True), 2, 32)
    with pytest.raises(HandshakeError, match="replicated conv sub-projection 1 is 4 wide"):
        state_ranges(mamba2(1, 1), 0, wide, 0)


def test_refuses_non_dividing_tp_and_bad_ranks():
    g2 = StateGeometry("GDN_ATTN", 2, "DS", 3, 2, (3, 3, 6), (False,) * 3, 3, 128)
    g3 = StateGeometry("GDN_ATTN", 3, "DS", 3, 2, (2, 2, 4), (False,) * 3, 2, 128)
    with pytest.raises(HandshakeError, match="TP sizes 2 .source. and 3 .destination.: "
                                             "neither divides"):
        state_ranges(g2, 0, g3, 0)
    with pytest.raises(LayoutError, match=r"src_rank must be in \[0, 1\), got 1"):
        state_ranges(gdn(1), 1, gdn(2), 0)
    with pytest.raises(LayoutError, match=r"dst_rank must be in \[0, 2\), got True"):
        state_ranges(gdn(1), 0, gdn(2), True)
    with pytest.raises(LayoutError, match="src and dst must be StateGeometry"):
        state_ranges(gdn_g(), 0, gdn(2), 0)


@pytest.mark.parametrize("kw,msg", [
    ({"kind": "KDA"}, "kind must be one of"),
    ({"conv_layout": "ds"}, "conv_layout must be one of"),
    ({"tp": 0}, r"tp must be an int in \[1,"),
    ({"conv_rows": 2.0}, "conv_rows must be an int"),
    ({"conv_itemsize": True}, "conv_itemsize must be an int"),
    ({"ssm_heads": 0}, "ssm_heads must be an int"),
    ({"ssm_head_bytes": -1}, "ssm_head_bytes must be an int"),
    ({"proj_widths": (8, 8)}, "kind GDN_ATTN has 3 conv sub-projections"),
    ({"proj_widths": (8, 0, 16)}, r"proj_widths\[1\] must be an int"),
    ({"proj_replicated": (False,)}, "proj_replicated must hold 3 bools"),
    ({"proj_replicated": (False, 1, False)}, r"proj_replicated\[1\] must be a bool"),
    # the kind's invariants (vLLM's)
    ({"proj_widths": (8, 4, 16)}, r"GDN_ATTN needs Q and K equally wide"),
    ({"proj_replicated": (False, True, True)}, "only MAMBA2's B and C .together."),
])
def test_construction_refusals(kw, msg):
    args = dataclasses.asdict(gdn(2)) | kw
    with pytest.raises(LayoutError, match=msg):
        StateGeometry(**args)


@pytest.mark.parametrize("geo,msg", [
    (("MAMBA2", 2, "DS", 3, 2, (4, 4, 6), (False, False, False), 2, 32),
     "MAMBA2 needs B and C equally wide"),
    (("MAMBA2", 2, "DS", 3, 2, (4, 4, 4), (False, False, True), 2, 32),
     "only MAMBA2's B and C .together."),
    (("MAMBA2", 2, "DS", 3, 2, (4, 4, 4), (True, True, True), 2, 32),
     "only MAMBA2's B and C .together."),
    (("MAMBA1", 2, "DS", 3, 2, (4,), (False,), 2, 16),
     "MAMBA1's ssm state has one row per conv channel: ssm_heads 2 != proj_widths.0. 4"),
])
def test_kind_invariants(geo, msg):
    with pytest.raises(LayoutError, match=msg):
        StateGeometry(*geo)


@pytest.mark.parametrize("kw,msg", [
    ({"proj_groups": (2, 2)}, "proj_groups must hold 3 ints"),
    ({"proj_groups": (2, 0, 4)}, r"proj_groups\[1\] must be an int"),
    ({"proj_groups": (3, 3, 4)}, r"proj_widths\[0\] 16 is not a multiple of proj_groups\[0\] 3"),
    ({"proj_groups": (2, 4, 4)}, "GDN_ATTN shards sub-projections 0 and 1 by the same groups"),
    ({"proj_widths": (16, 8, 32)}, "GDN_ATTN needs Q and K equally wide"),
    ({"kind": "KDA"}, "GlobalStateGeometry: kind must be one of"),
    ({"conv_rows": 0}, "GlobalStateGeometry: conv_rows must be an int"),
])
def test_global_construction_refusals(kw, msg):
    with pytest.raises(LayoutError, match=msg):
        GlobalStateGeometry(**(dataclasses.asdict(gdn_g()) | kw))


def test_wire_round_trip_and_malformed_peer():
    for g in (gdn_g("SD"), mamba2_g(1), mamba2_g(2, "SD")):
        w = g.to_wire()
        assert "tp" not in w                     # the wire geometry is TP-independent
        assert GlobalStateGeometry.from_wire(w) == g
        assert all(isinstance(v, (str, int, list)) for v in w.values())
    w = gdn_g().to_wire()
    del w["conv_rows"]
    with pytest.raises(HandshakeError, match=r"missing keys \['conv_rows'\]"):
        GlobalStateGeometry.from_wire(w)
    with pytest.raises(HandshakeError, match=r"unknown keys \['tp'\]"):
        GlobalStateGeometry.from_wire(gdn_g().to_wire() | {"tp": 2})
    with pytest.raises(HandshakeError, match="peer state geometry is malformed: .*conv_layout"):
        GlobalStateGeometry.from_wire(gdn_g().to_wire() | {"conv_layout": "XY"})
    with pytest.raises(HandshakeError, match="peer state geometry is malformed: .*proj_groups"):
        GlobalStateGeometry.from_wire(gdn_g().to_wire() | {"proj_groups": [3, 3, 4]})
    with pytest.raises(HandshakeError, match="state geometry must be a dict"):
        GlobalStateGeometry.from_wire([1, 2])
