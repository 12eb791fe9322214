"""Block-size remap AND another TP size with Mamba state groups (issue 20 (b)): a RegrainPlan
given a TpMapping whose Mamba group has a state geometry pairs the state byte ranges of
hmacore.state_tp (one state region pair per range per layer per source rank), block ids from
each side's own state-group table, while the attention (MLA latent) group maps token rows.

Real memory: every rank's pages are numpy buffers registered with
``TransferPlan.from_kv_caches`` (a Mamba layer as one whole page, or as its conv and ssm
views into the page, as vLLM's ``bind_kv_cache`` does), pages padded to each side's attention
page (other block sizes: other paddings). The runs of every source rank are applied with
memmove; then every content byte of D's state page equals the plain-numpy oracle of D's own
sharding (test_state_tp._page: each sub-projection sharded on its own), padding and every
other block untouched, each byte written once; every latent row in ``[lo, hi)`` is P's.
"""
import ctypes

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hmacore.errors import LayoutError
from hmacore.plan import TransferPlan
from hmacore.regrain import RegrainPlan, token_page, token_ranges
from hmacore.spec import GroupKind, GroupSpec, KVLayout
from hmacore.state_tp import GlobalStateGeometry
from hmacore.tp import GroupSharding, TpMapping
from test_state_tp import _page, geometry_pairs

NB = 12          # blocks per pool
LAT = 8          # latent bytes per token (MLA group)
SLAYERS = ("m.0", "m.1")


def layout(abs_, sbs):
    return KVLayout([GroupSpec(GroupKind.FULL, abs_, ("a.0",), mla=True),
                     GroupSpec(GroupKind.MAMBA, sbs, SLAYERS, mamba_mode="align")])


def side(geo, tp, rank, bs, split, pad, fill):
    """One rank: an MLA latent cache of ``bs``-token blocks and per Mamba layer a page buffer
    of ``content + pad`` bytes per block, filled with ``fill``; its plan and token pages."""
    g = geo.at(tp)
    lay = layout(bs, bs)
    lat = np.full((NB, bs, LAT), fill, np.uint8)
    bufs = {n: np.full((NB, g.content_bytes + pad), fill, np.uint8) for n in SLAYERS}
    kv = {"a.0": lat}
    for n, b in bufs.items():
        kv[n] = (b[:, :g.conv_bytes], b[:, g.conv_bytes:]) if split else b
    plan = TransferPlan.from_kv_caches(lay, kv, num_blocks=NB)
    pages = [token_page("MLA", block_size=bs, head_bytes=LAT), None]
    return lay, plan, pages, lat, bufs, g


def apply(runs):
    for (sa, sn, _), (da, dn, _) in zip(runs.src.tolist(), runs.dst.tolist()):
        assert sn == dn > 0
        ctypes.memmove(da, sa, sn)


def written(runs, bufs, lat):
    """Per destination byte of the Mamba buffers (and latent), how many runs write it."""
    spans = [(b.ctypes.data, b.nbytes, k) for k, b in list(bufs.items()) + [("a.0", lat)]]
    cnt = {k: np.zeros(b.nbytes, np.int64) for k, b in list(bufs.items()) + [("a.0", lat)]}
    for da, dn, _ in runs.dst.tolist():
        k = next(k for a, n, k in spans if a <= da < a + n)
        base = next(a for a, n, kk in spans if kk == k)
        cnt[k][da - base:da - base + dn] += 1
    return cnt


def run_case(glob, tp_p, tp_d, bp, bd, split, seed, n_tokens=37, trim=5):
    rng = np.random.default_rng(seed)
    src0 = glob.at(tp_p)
    R, dt = src0.conv_rows, src0.conv_itemsize
    gw = [w if rep else w * tp_p for w, rep in zip(src0.proj_widths, src0.proj_replicated)]
    projs = [rng.integers(0, 256, (w, R, dt), dtype=np.uint8) for w in gw]
    ssm = rng.integers(0, 256, (src0.ssm_heads * tp_p, src0.ssm_head_bytes), dtype=np.uint8)
    lat_tag = rng.integers(0, 256, (n_tokens + 64, LAT), dtype=np.uint8)   # per token
    pad_p, pad_d = 3 * bp, 5 * bd            # pages padded to each side's attention page
    shard = [GroupSharding(replicated=True), GroupSharding(1, 1, True, state=glob)]
    state_p = rng.integers(1, NB)            # P's running-state slot
    for d in range(tp_d):
        dlay, dplan, dpages, dlat, dbufs, dg = side(glob, tp_d, d, bd, split, pad_d, 0xEE)
        m = TpMapping(dlay, shard, local_tp=tp_d, local_rank=d, remote_tp=tp_p)
        lo, hi = token_ranges(dlay, n_tokens, trim)
        d_ids = [list(rng.permutation(np.arange(1, NB))[:-(-hi[0] // bd) - lo[0] // bd]),
                 [int(rng.integers(1, NB))]]
        d_first = [lo[0] // bd, 0]
        before = {k: v.copy() for k, v in dbufs.items()}
        lat_before = dlat.copy()
        cnt = {k: np.zeros(b.nbytes, np.int64) for k, b in dbufs.items()}
        cnt["a.0"] = np.zeros(dlat.nbytes, np.int64)
        keep = []
        for p in m.remote_ranks:
            slay, splan, spages, slat, sbufs, sg = side(glob, tp_p, p, bp, split, pad_p, 0x5A)
            keep.append((slat, sbufs))
            p_ids = [list(rng.permutation(np.arange(1, NB))[:-(-hi[0] // bp) - lo[0] // bp]),
                     [state_p]]
            for t in range(n_tokens):       # P's latent rows: the token's tag on every rank
                if lo[0] // bp <= t // bp < lo[0] // bp + len(p_ids[0]):
                    slat[p_ids[0][t // bp - lo[0] // bp], t % bp] = lat_tag[t]
            for li, n in enumerate(SLAYERS):
                sbufs[n][state_p] = _page([x ^ li for x in projs], ssm ^ li, sg, p, pad_p, 0x5A)
            plan = RegrainPlan(slay, dlay, splan, dplan, spages, dpages, tp=(m, p),
                               src_state_bytes=[None, sg.content_bytes],
                               dst_state_bytes=[None, dg.content_bytes])
            # one state pair per range per layer (equal TP: one per registered part)
            sl = [s for s in m.slices[1] if s.remote_rank == p]
            want_pairs = 0 if not sl else len(sl[0].ranges) if tp_p != tp_d else 1 + split
            assert sum(q.group == 1 for q in plan.pairs) == want_pairs * len(SLAYERS)
            runs = plan.runs(p_ids, d_ids, lo, hi, src_first=[lo[0] // bp, 0],
                             dst_first=d_first)
            for k, c in written(runs, dbufs, dlat).items():
                cnt[k] += c
            apply(runs)
        sid = d_ids[1][0]
        for li, n in enumerate(SLAYERS):
            want = _page([x ^ li for x in projs], ssm ^ li, dg, d, 0, 0)
            got = dbufs[n]
            assert np.array_equal(got[sid, :dg.content_bytes], want), (n, d)
            assert (got[sid, dg.content_bytes:] == 0xEE).all(), "padding never written"
            others = np.arange(NB) != sid
            assert np.array_equal(got[others], before[n][others]), "other blocks untouched"
            c = cnt[n].reshape(got.shape)
            assert (c[sid, :dg.content_bytes] == 1).all(), "every state byte written once"
            assert not c[others].any() and not c[sid, dg.content_bytes:].any()
        # the latent rows (replicated MLA: read from one source rank only)
        rows = np.zeros((NB, bd), bool)
        for t in range(lo[0], hi[0]):
            b = d_ids[0][t // bd - d_first[0]]
            rows[b, t % bd] = True
            assert np.array_equal(dlat[b, t % bd], lat_tag[t]), t
        assert np.array_equal(dlat[~rows], lat_before[~rows])
        assert (cnt["a.0"].reshape(dlat.shape)[rows] == 1).all()


GDN = GlobalStateGeometry("GDN_ATTN", "DS", 3, 2, (16, 16, 32), (4, 4, 4), 4, 24)
M2G1 = GlobalStateGeometry("MAMBA2", "SD", 4, 2, (8, 4, 4), (4, 1, 1), 4, 16)
M2G2 = GlobalStateGeometry("MAMBA2", "DS", 4, 2, (8, 8, 8), (4, 4, 4), 4, 16)
M1 = GlobalStateGeometry("MAMBA1", "SD", 4, 2, (8,), (8,), 8, 12)


@pytest.mark.parametrize("glob", [GDN, M2G1, M2G2, M1], ids=["gdn", "m2g1", "m2g2", "m1"])
@pytest.mark.parametrize("split", [False, True], ids=["page", "tensors"])
@pytest.mark.parametrize("tp_p,tp_d", [(2, 1), (1, 2), (2, 2), (4, 2), (1, 4)])
@pytest.mark.parametrize("bp,bd", [(32, 16), (16, 64)])
def test_state_ranges_with_block_size_remap(glob, split, tp_p, tp_d, bp, bd):
    run_case(glob, tp_p, tp_d, bp, bd, split, seed=tp_p * 10 + tp_d + bp)


@settings(max_examples=60, deadline=None)
@given(geometry_pairs(), st.booleans(), st.sampled_from([(8, 16), (16, 8), (32, 8), (8, 32)]))
def test_state_ranges_with_remap_property(case, split, sizes):
    """Random legal geometries (every kind, DS/SD, Mamba2 B/C replicated or sharded) at any
    TP pair: the plan reproduces the oracle's page of every D rank."""
    src, dst, seed = case
    sh = [w if rep else w * src.tp for w, rep in zip(src.proj_widths, src.proj_replicated)]
    # the global geometry back from the per-rank one (groups: any multiple of both TP sizes)
    top = max(src.tp, dst.tp)
    groups = [1 if rep else top for rep in src.proj_replicated]
    glob = GlobalStateGeometry(src.kind, src.conv_layout, src.conv_rows, src.conv_itemsize,
                               tuple(sh), tuple(groups), src.ssm_heads * src.tp,
                               src.ssm_head_bytes)
    run_case(glob, src.tp, dst.tp, *sizes, split, seed)


def test_refusals_kept():
    """What still refuses with a remap: a range straddling two registered parts (a layer
    registered whole on one side, as tensors on the other), a Mamba group between TP sizes
    without a geometry, state bytes that disagree with the geometry."""
    dlay, dplan, dpages, *_ = side(GDN, 2, 0, 16, False, 16, 0)
    slay, splan, spages, *_ = side(GDN, 1, 0, 32, True, 32, 0)
    m = TpMapping(dlay, [GroupSharding(replicated=True), GroupSharding(1, 1, True, state=GDN)],
                  local_tp=2, local_rank=0, remote_tp=1)
    with pytest.raises(LayoutError, match="group 1: 4 source regions, 2 destination regions"):
        RegrainPlan(slay, dlay, splan, dplan, spages, dpages, tp=(m, 0))
    slay, splan, spages, *_ = side(GDN, 1, 0, 32, False, 32, 0)
    g1, g2 = GDN.at(1), GDN.at(2)
    with pytest.raises(LayoutError, match=r"ends at \d+ B, past the destination's 8 B state"):
        RegrainPlan(slay, dlay, splan, dplan, spages, dpages, tp=(m, 0),
                    src_state_bytes=[None, g1.content_bytes], dst_state_bytes=[None, 8])
    # the mapping's straddle rule: a destination part cut inside a range
    dlay2, dplan2, dpages2, *_ = side(GDN, 2, 0, 16, True, 16, 0)
    slay2, splan2, spages2, *_ = side(GDN, 1, 0, 32, True, 32, 0)
    regs = list(dplan2.regions)
    import dataclasses
    i = next(k for k, r in enumerate(regs) if r.layers == ("m.0",) and r.block_len == g2.conv_bytes)
    regs[i] = dataclasses.replace(regs[i], block_len=g2.conv_bytes - 4)
    regs[i + 1] = dataclasses.replace(regs[i + 1], base=regs[i + 1].base - 4,
                                      block_len=regs[i + 1].block_len + 4)
    with pytest.raises(LayoutError, match="of layer 'm.0' straddles its part #0"):
        RegrainPlan(slay2, dlay2, splan2, TransferPlan(dlay2, regs), spages2, dpages2,
                    tp=(m, 0))
    # no geometry between TP sizes: refused by name
    m0 = TpMapping(dlay, [GroupSharding(replicated=True), GroupSharding(1, 1, True)],
                   local_tp=2, local_rank=0, remote_tp=1)
    with pytest.raises(LayoutError, match="group 1: Mamba state between TP sizes 1 .source. and "
                                          "2 .destination. without a state geometry"):
        RegrainPlan(slay, dlay, splan, dplan, spages, dpages, tp=(m0, 0))
