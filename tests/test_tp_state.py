"""Mamba state groups between TP sizes in hmacore.tp (issue 20): a GroupSharding with a
state geometry gives TpMapping StateSlices (hmacore.state_tp ranges) at different TP sizes and
whole pages at equal TP; TpPairPlan turns them into descriptors, per layer part.

Each test copies P's tagged pages into D's through the descriptors (addresses are offsets in
one numpy arena per side) and compares every byte of D's page with D's own sharding of the
same global state (the page builder shards each sub-projection and the ssm heads on its own,
as vLLM does; tests/vllm/test_state_tp_vllm.py checks that rule against vLLM's loaders).
"""
import numpy as np
import pytest

from hmacore.errors import LayoutError
from hmacore.plan import Region, TransferPlan
from hmacore.regrain import RegrainPlan
from hmacore.spec import GroupKind, GroupSpec, KVLayout
from hmacore.state_tp import GlobalStateGeometry
from hmacore.tp import (GroupSharding, HeadSlice, StateSlice, TpMapping, TpPairPlan,
                        consumer_ranks)

LAYERS = ("ssm.0", "ssm.1")
LAY = KVLayout([GroupSpec(GroupKind.MAMBA, 16, LAYERS, name="ssm")])
GDN = GlobalStateGeometry("GDN_ATTN", "DS", 3, 2, (16, 16, 32), (2, 2, 4), 4, 128)
M2G1 = GlobalStateGeometry("MAMBA2", "SD", 3, 2, (8, 4, 4), (4, 1, 1), 4, 32)
NB = 4  # blocks per region


def _page(g: GlobalStateGeometry, tp: int, rank: int, layer: int, pad: int) -> np.ndarray:
    """Rank ``rank``'s page of layer ``layer``: byte (piece, global unit, element) tags."""
    geo = g.at(tp)
    R, dt = geo.conv_rows, geo.conv_itemsize
    cols = []
    for j, (w, rep) in enumerate(zip(geo.proj_widths, geo.proj_replicated)):
        lo = 0 if rep else rank * w
        cols += [(j, c) for c in range(lo, lo + w)]
    conv = np.array([[[(layer * 31 + j * 7 + c * 5 + r * 3 + b) % 251 for b in range(dt)]
                      for r in range(R)] for j, c in cols], np.uint8)     # (C, R, dt)
    if geo.conv_layout == "SD":
        conv = conv.transpose(1, 0, 2)
    h0 = rank * geo.ssm_heads
    ssm = np.array([[(layer * 17 + (h0 + h) * 11 + e) % 253 for e in range(geo.ssm_head_bytes)]
                    for h in range(geo.ssm_heads)], np.uint8)
    return np.concatenate([conv.reshape(-1), ssm.reshape(-1), np.zeros(pad, np.uint8)])


def _plan(g, tp, split, page):
    """One region per layer (whole page of ``page`` B), or conv and ssm regions per layer."""
    geo = g.at(tp)
    regs, base = [], 0
    for n in LAYERS:
        parts = (geo.conv_bytes, page - geo.conv_bytes) if split else (page,)
        for blen in parts:
            regs.append(Region(base, blen, blen, NB, 1, 0, True, (n,)))
            base += blen * NB
    return TransferPlan(LAY, regs), base


def _arena(g, tp, rank, split, page, plan, size):
    mem = np.zeros(size, np.uint8)
    for li, n in enumerate(LAYERS):
        regs = [r for r in plan.regions if r.layers == (n,)]
        for b in range(NB):
            pg = _page(g, tp, rank, li * 10 + b, page - g.at(tp).content_bytes)
            off = 0
            for r in regs:
                mem[r.base + b * r.stride:r.base + b * r.stride + r.block_len] = \
                    pg[off:off + r.block_len]
                off += r.block_len
    return mem


def _gather(plan, mem, n, b):
    regs = [r for r in plan.regions if r.layers == (n,)]
    return np.concatenate([mem[r.base + b * r.stride:r.base + b * r.stride + r.block_len]
                           for r in regs])


@pytest.mark.parametrize("g", [GDN, M2G1], ids=["gdn-DS", "mamba2g1-SD"])
@pytest.mark.parametrize("split", [False, True], ids=["page", "tensors"])
@pytest.mark.parametrize("tp_p,tp_d", [(1, 2), (2, 1), (2, 2), (1, 1)])
def test_pair_plans_copy_d_own_sharding(g, split, tp_p, tp_d):
    pages = {1: 1024, 2: 512}
    rp = {p: _plan(g, tp_p, split, pages[tp_p]) for p in range(tp_p)}
    for d in range(tp_d):
        lplan, size = _plan(g, tp_d, split, pages[tp_d])
        m = TpMapping(LAY, [GroupSharding(1, 1, True, state=g)], local_tp=tp_d, local_rank=d,
                      remote_tp=tp_p)
        if tp_p == tp_d:
            assert m.slices[0] == (HeadSlice(0, d, 0, 1, 0, 0, True),)   # whole page
        else:
            assert all(isinstance(s, StateSlice) for s in m.slices[0])
        dst = np.full(size, 0xEE, np.uint8)
        for p in m.remote_ranks:
            rplan, rsize = rp[p]
            src = _arena(g, tp_p, p, split, pages[tp_p], rplan, rsize)
            pair = TpPairPlan(m, p, lplan, rplan)
            lids, rids = pair.desc_ids([[2]], [[3]])       # D block 2 <- P block 3
            ld, rd = pair.local.descriptors()[lids], pair.remote.descriptors()[rids]
            for (la, ln, _), (ra, rn, _) in zip(ld.tolist(), rd.tolist()):
                assert ln == rn > 0
                dst[la:la + ln] = src[ra:ra + rn]
        for li, n in enumerate(LAYERS):
            got = _gather(lplan, dst, n, 2)
            content = g.at(tp_d).content_bytes
            if tp_p == tp_d:      # whole page: P's padding (zeros) moves too
                assert np.array_equal(got, _page(g, tp_d, d, li * 10 + 3, pages[tp_d] - content))
            else:
                assert np.array_equal(got[:content], _page(g, tp_d, d, li * 10 + 3, 0)), (n, d)
                assert (got[content:] == 0xEE).all(), "padding never written"
            for b in (0, 1, 3):   # other blocks untouched
                assert (_gather(lplan, dst, n, b) == 0xEE).all()


def test_consumers_include_every_state_source():
    sh = [GroupSharding(1, 1, True, state=GDN)]
    assert consumer_ranks(LAY, sh, local_tp=1, remote_tp=2, remote_rank=1) == (0,)
    assert consumer_ranks(LAY, sh, local_tp=2, remote_tp=1, remote_rank=0) == (0, 1)
    m = TpMapping(LAY, sh, local_tp=1, local_rank=0, remote_tp=2)
    assert m.remote_ranks == (0, 1) and m.groups_of(1) == (0,)
    assert m.table()[1]["ranges"][0] == (0, 48, 48)


def test_refusals():
    with pytest.raises(LayoutError, match="state must be a GlobalStateGeometry"):
        GroupSharding(1, 1, True, state=GDN.to_wire())
    with pytest.raises(LayoutError, match="must be replicated=True"):
        GroupSharding(4, 1, False, state=GDN)
    with pytest.raises(LayoutError, match=r"group 0 \(Mamba state\) between local TP 4 and remote "
                                          r"TP 1: .*tp 4 does not divide conv sub-projection 0"):
        TpMapping(LAY, [GroupSharding(1, 1, True, state=GDN)], local_tp=4, local_rank=0,
                  remote_tp=1)
    # a layer registered whole on one side and as two tensors on the other
    lplan, _ = _plan(GDN, 2, False, 512)
    rplan, _ = _plan(GDN, 1, True, 1024)
    m = TpMapping(LAY, [GroupSharding(1, 1, True, state=GDN)], local_tp=2, local_rank=0,
                  remote_tp=1)
    with pytest.raises(LayoutError, match="is 1 state region.s. locally and 2 remotely"):
        TpPairPlan(m, 0, lplan, rplan)
    # the remap path (RegrainPlan) takes the state ranges (tests/test_regrain_state_tp.py);
    # without a geometry a Mamba group between TP sizes is refused by name
    assert RegrainPlan._tp_heads((m, 0), 1)[0] == m.slices[0][0].ranges
    m0 = TpMapping(LAY, [GroupSharding(1, 1, True)], local_tp=2, local_rank=0, remote_tp=1)
    with pytest.raises(LayoutError, match="group 0: Mamba state between TP sizes 1 .source. and "
                                          "2 .destination. without a state geometry"):
        RegrainPlan._tp_heads((m0, 0), 1)


def test_default_shardings_says_how_mamba_groups_split():
    """No silent default for Mamba groups (review finding, issue 20 (d)): the vLLM-exact state
    model from a geometry, whole pages, or the older head-major model, each asked for by name;
    nothing given refuses naming the arguments."""
    from hmacore.tp import default_shardings
    lay = KVLayout([GroupSpec(GroupKind.FULL, 16, ("a.0",)),
                    GroupSpec(GroupKind.MAMBA, 16, LAYERS, name="ssm")])
    with pytest.raises(LayoutError, match=r"groups \[1\] are Mamba state; say how .*"
                                          "mamba_state=GlobalStateGeometry"):
        default_shardings(lay, 4)
    sh = default_shardings(lay, 4, mamba_state=GDN)
    assert sh == (GroupSharding(4, 2), GroupSharding(1, 1, True, state=GDN))
    assert default_shardings(lay, 4, mamba_state=[None, GDN]) == sh
    m = TpMapping(lay, sh, local_tp=1, local_rank=0, remote_tp=2)
    assert all(isinstance(s, StateSlice) for s in m.slices[1])       # the pull path's model
    assert default_shardings(lay, 4, mamba_sharded=False)[1] == GroupSharding(4, 1, True)
    assert default_shardings(lay, 4, mamba_sharded=True, mamba_heads=8)[1] == \
        GroupSharding(8, 1, False)
    with pytest.raises(LayoutError, match="not both"):
        default_shardings(lay, 4, mamba_state=GDN, mamba_sharded=False)
    with pytest.raises(LayoutError, match=r"mamba_state\[1\] must be the Mamba group's "
                                          "GlobalStateGeometry, got None"):
        default_shardings(lay, 4, mamba_state=[GDN, None])
    with pytest.raises(LayoutError, match=r"one entry per group \(2\), got 1"):
        default_shardings(lay, 4, mamba_state=[GDN])
    # layouts without Mamba groups need neither
    assert default_shardings(KVLayout([GroupSpec(GroupKind.FULL, 16, ("a.0",))]), 2) == \
        (GroupSharding(2, 2),)
