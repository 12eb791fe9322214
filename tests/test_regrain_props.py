"""Hypothesis: hmacore.regrain's kernel moves exactly the bytes the token-by-token oracle names
(block-size ratios both ways, kernel blocks, sliding windows, prefix trims, clipped tables,
partial first/last blocks, Mamba state blocks, heterogeneous TP)."""
import os

import numpy as np
from hypothesis import assume, given, settings, strategies as st

from hmacore.plan import Region, TransferPlan
from hmacore.regrain import RegrainPlan, token_page, token_ranges
from hmacore.spec import GroupKind, GroupSpec, KVLayout
from hmacore.tp import GroupSharding, TpMapping

from oracle_regrain import oracle_map, page_bytes, runs_map
from oracle_tp import oracle_heads

# the byte-level oracle is slow: a fraction of the profile's examples (CI 2000 -> 500 / 250)
EXAMPLES = int(os.environ.get("HMACORE_EXAMPLES", "2000"))
KINDS = {"full": GroupKind.FULL, "swa": GroupKind.SLIDING_WINDOW, "mamba": GroupKind.MAMBA}


def _spec(grp, bs, side):
    kw = {}
    if grp["kind"] == "swa":
        kw["sliding_window"] = grp["window"]
    if grp["kind"] != "mamba" and grp[f"{side}_page"][0] == "MLA":
        kw["mla"] = True
    return GroupSpec(KINDS[grp["kind"]], bs, tuple(grp["layers"]), **kw)


def build(world, side):
    """(layout, TransferPlan, pages) of one side; also fills world[side_regions]."""
    groups = world["groups"]
    layout = KVLayout(groups=tuple(_spec(g, g[f"{side}_bs"], side) for g in groups))
    regions, state_regions, pages = [], [], []
    base = 1 << 20 if side == "src" else 1 << 30
    world[f"{side}_regions"] = {}
    for gi, grp in enumerate(groups):
        nb = world[f"{side}_nb"]
        if grp["kind"] == "mamba":
            pages.append(None)
            blen, ratio = grp.get(f"{side}_state_len", grp["state_len"]), 1
            cuts = grp.get("cuts")
            if cuts:
                # the layer's state tensors as parts of its page (vLLM's per-state views):
                # equal cuts inside the state on both sides, the last part running to each
                # side's page end (its padding)
                stride = blen + grp["gap"]
                bounds = [0, *cuts, blen]
                for layer in grp["layers"]:
                    for a, b in zip(bounds, bounds[1:]):
                        state_regions.append(Region(
                            base=base + a, block_len=b - a, stride=stride, logical_blocks=nb,
                            ratio=1, group=gi, state=True, layers=(layer,)))
                    world[f"{side}_regions"][layer] = (base, stride, nb)
                    base += stride * nb + 64
                continue
        else:
            page = grp[f"{side}_page"]
            pages.append(token_page(page[0], block_size=grp[f"{side}_bs"], heads=page[1],
                                    head_start=page[2], head_bytes=page[3], kv=page[4],
                                    kernel_block_size=page[5]))
            ratio = grp[f"{side}_bs"] // page[5]
            blen = page_bytes(page, grp[f"{side}_bs"]) + (grp["pad"] if ratio == 1 else 0)
        stride = blen + grp["gap"]
        for layer in grp["layers"]:
            reg = Region(base=base, block_len=blen, stride=stride, logical_blocks=nb,
                         ratio=ratio, group=gi, state=grp["kind"] == "mamba", layers=(layer,))
            (state_regions if reg.state else regions).append(reg)
            world[f"{side}_regions"][layer] = (base, stride, nb)
            base += stride * nb + 64
    return layout, TransferPlan(layout, regions + state_regions), pages


@st.composite
def page_pair(draw, src_bs, dst_bs, tp_heads=None):
    layout = draw(st.sampled_from(["HND", "LBHNC", "NHD", "LBNHC", "MLA"] if tp_heads is None
                                  else ["HND", "LBHNC", "MLA"]))
    hb = draw(st.integers(1, 3))
    kv = 1 if layout == "MLA" else draw(st.integers(1, 2))
    if layout == "MLA":
        heads = [(0, 1), (0, 1)]
    elif tp_heads is None:
        n = draw(st.integers(1, 2))
        heads = [(0, n), (0, n)]
    else:
        heads = [(h[0], len(h)) for h in tp_heads]
    pages = []
    for bs, (h0, n) in zip((src_bs, dst_bs), heads):
        kr = draw(st.sampled_from([k for k in (1, 2, 4) if bs % k == 0]))
        pages.append((layout, n, h0, hb, kv, bs // kr))
    ks, kd = pages[0][5], pages[1][5]
    assume(max(ks, kd) % min(ks, kd) == 0)
    return pages


@st.composite
def worlds(draw, tp=None):
    """A world, its request (ids, firsts, ranges) and the TP tuple for the oracle."""
    ngroups = draw(st.integers(1, 3))
    groups = []
    heads_of = None
    for gi in range(ngroups):
        kind = draw(st.sampled_from(["full", "swa", "mamba"]))
        unit = draw(st.sampled_from([1, 2, 4]))
        src_bs = unit * draw(st.sampled_from([1, 2, 4]))
        r = draw(st.sampled_from([1, 2, 4]))
        dst_bs = src_bs * r if draw(st.booleans()) or src_bs % r else src_bs // r
        grp = {"kind": kind, "window": draw(st.integers(1, 24)), "src_bs": src_bs,
               "dst_bs": dst_bs, "layers": [f"g{gi}.l{j}" for j in range(draw(st.integers(1, 2)))],
               "pad": draw(st.sampled_from([0, 0, 5])), "gap": draw(st.sampled_from([0, 0, 3]))}
        if kind == "mamba":
            grp["src_bs"] = grp["dst_bs"] = src_bs   # Mamba block sizes are the scheduler's
            grp["state_len"] = draw(st.integers(1, 40))
            if draw(st.booleans()):
                # pages padded to each side's own page size (vLLM: the attention page, so
                # other block sizes give other page bytes); the state bytes are equal
                grp["state_bytes"] = draw(st.integers(1, grp["state_len"]))
                grp["src_state_len"] = grp["state_bytes"] + draw(st.integers(0, 40))
                grp["dst_state_len"] = grp["state_bytes"] + draw(st.integers(0, 40))
                if grp["state_bytes"] > 1:
                    grp["cuts"] = sorted(draw(st.sets(st.integers(1, grp["state_bytes"] - 1),
                                                      max_size=3)))
        else:
            if tp is not None:
                H, dtp, d, stp, p = tp
                heads_of = [oracle_heads(H, stp, p), oracle_heads(H, dtp, d)]
                grp["num_heads"] = H
            sp, dp = draw(page_pair(src_bs, dst_bs, heads_of))
            grp["src_page"], grp["dst_page"] = sp, dp
            if sp[0] == "MLA":
                grp.pop("num_heads", None)
        groups.append(grp)
    world = {"groups": groups}
    n = draw(st.integers(0, 40))
    trim = draw(st.integers(0, n))
    world["src_nb"] = max(-(-n // g["src_bs"]) for g in groups) + 3
    world["dst_nb"] = max(-(-n // g["dst_bs"]) for g in groups) + 3
    return world, n, trim


def request(draw, world, lo, hi):
    src_ids, dst_ids, sf, df = [], [], [], []
    for g, grp in enumerate(world["groups"]):
        if grp["kind"] == "mamba":
            k = draw(st.integers(0, 2))
            src_ids.append(draw(st.permutations(range(1, world["src_nb"])))[:k])
            dst_ids.append(draw(st.permutations(range(1, world["dst_nb"])))[:k])
            sf.append(0)
            df.append(0)
            continue
        for side, ids, first in (("src", src_ids, sf), ("dst", dst_ids, df)):
            bs = grp[f"{side}_bs"]
            need = -(-hi[g] // bs)
            f = draw(st.integers(0, lo[g] // bs)) if hi[g] > lo[g] else 0
            perm = list(draw(st.permutations(range(1, world[f"{side}_nb"]))))
            tab = perm[:max(0, need - f)] + perm[need:need + draw(st.integers(0, 1))]
            # blocks wholly before lo may be vLLM's null padding (never read)
            tab = [0 if (f + i + 1) * bs <= lo[g] and draw(st.booleans()) else b
                   for i, b in enumerate(tab)]
            ids.append(tab)
            first.append(f)
    return src_ids, dst_ids, sf, df


def check(world, n, trim, data, tp=None, tp_arg=None):
    slayout, splan, spages = build(world, "src")
    dlayout, dplan, dpages = build(world, "dst")
    lo, hi = token_ranges(dlayout, n, trim)
    src_ids, dst_ids, sf, df = request(data.draw, world, lo, hi)
    sizes = [g.get("state_bytes") for g in world["groups"]]
    plan = RegrainPlan(slayout, dlayout, splan, dplan, spages, dpages,
                       tp=None if tp_arg is None else tp_arg(dlayout),
                       src_state_bytes=sizes, dst_state_bytes=sizes)
    runs = plan.runs(src_ids, dst_ids, lo, hi, src_first=sf, dst_first=df)
    want = oracle_map(world, src_ids, dst_ids, lo, hi, sf, df, tp=tp)
    got = runs_map(runs)
    assert got == want
    assert runs.nbytes == len(want)
    # one run per maximal piece: no two consecutive runs of a pair abut on both sides
    for i in range(1, runs.num_runs):
        if runs.pairs[i] == runs.pairs[i - 1]:
            s0, d0 = runs.src[i - 1], runs.dst[i - 1]
            assert not (s0[0] + s0[1] == runs.src[i][0] and d0[0] + d0[1] == runs.dst[i][0])


@settings(max_examples=max(50, EXAMPLES // 4))
@given(worlds(), st.data())
def test_kernel_matches_oracle(w, data):
    world, n, trim = w
    check(world, n, trim, data)


TP_CASES = [(h, dtp, stp) for h in (1, 2, 4) for dtp in (1, 2, 4) for stp in (1, 2, 4)
            if (h % dtp == 0 if dtp <= h else dtp % h == 0)
            and (h % stp == 0 if stp <= h else stp % h == 0)]


@settings(max_examples=max(50, EXAMPLES // 8))
@given(st.sampled_from(TP_CASES), st.data())
def test_kernel_matches_oracle_with_tp(case, data):
    H, dtp, stp = case
    d = data.draw(st.integers(0, dtp - 1))
    mapping_holder = {}

    def tp_arg(dlayout):
        shard = [GroupSharding(replicated=True) if s.mla else
                 GroupSharding(num_heads=H, chunks=2) for s in dlayout.groups]
        m = TpMapping(dlayout, shard, local_tp=dtp, local_rank=d, remote_tp=stp)
        mapping_holder["m"] = m
        p = mapping_holder["p"]
        assume(p in m.remote_ranks)   # only replicated groups, read from another rank
        return (m, p)

    # pick the source rank first (one the destination reads from for some head)
    heads = oracle_heads(H, dtp, d)
    from oracle_tp import oracle_source
    sources = sorted({oracle_source(H, stp, d, h) for h in heads})
    p = data.draw(st.sampled_from(sources))
    mapping_holder["p"] = p
    world, n, trim = data.draw(worlds(tp=(H, dtp, d, stp, p)))
    assume(all(g["kind"] != "mamba" for g in world["groups"]))
    check(world, n, trim, data, tp=(H, dtp, d, stp, p), tp_arg=tp_arg)


def test_partial_blocks_are_byte_ranges():
    """P 16 / D 4, one HND head: tokens [5, 27) -> ranges starting/ending mid-block."""
    world = {"groups": [{"kind": "full", "src_bs": 16, "dst_bs": 4, "layers": ["a"], "pad": 0,
                         "gap": 0, "window": 1, "src_page": ("HND", 1, 0, 2, 2, 16),
                         "dst_page": ("HND", 1, 0, 2, 2, 4)}], "src_nb": 4, "dst_nb": 9}
    slayout, splan, spages = build(world, "src")
    dlayout, dplan, dpages = build(world, "dst")
    plan = RegrainPlan(slayout, dlayout, splan, dplan, spages, dpages)
    runs = plan.runs([[1, 2]], [[1, 2, 3, 4, 5, 6, 7]], [5], [27])
    assert runs_map(runs) == oracle_map(world, [[1, 2]], [[1, 2, 3, 4, 5, 6, 7]], [5], [27],
                                        [0], [0])
    # D block 1 (tokens 4..7) gets only tokens 5..7: K rows of 2 B at row 1 -> 6 bytes
    assert int(runs.dst[0, 1]) == 6
    assert runs.nbytes == (27 - 5) * 2 * 2


def test_np_arrays_and_lists_agree():
    world = {"groups": [{"kind": "full", "src_bs": 8, "dst_bs": 16, "layers": ["a"], "pad": 0,
                         "gap": 0, "window": 1, "src_page": ("LBHNC", 2, 0, 1, 2, 8),
                         "dst_page": ("LBHNC", 2, 0, 1, 2, 16)}], "src_nb": 8, "dst_nb": 8}
    slayout, splan, spages = build(world, "src")
    dlayout, dplan, dpages = build(world, "dst")
    plan = RegrainPlan(slayout, dlayout, splan, dplan, spages, dpages)
    a = plan.runs([[3, 1, 2, 5]], [[2, 4]], [0], [30])
    b = plan.runs([np.array([3, 1, 2, 5], np.int32)], [np.array([2, 4], np.int64)], [0], [30])
    assert np.array_equal(a.src, b.src) and np.array_equal(a.dst, b.dst)
