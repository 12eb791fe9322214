"""Block-size remap combined with heterogeneous TP on real memory: vLLM CPU (LBHNC) pages
``[blocks, heads of the rank, tokens, 2*head_bytes]`` on every rank of a prefill engine (TP
tp_p, block size bp) and one decode rank (TP tp_d, block size bd). The decode rank applies
the runs of every source rank it reads from (memmove per run); afterwards each of its heads'
token rows in ``[lo, hi)`` holds the tag of (layer, token, GLOBAL head), every other byte is
untouched."""
import ctypes

import numpy as np
import pytest

from hmacore.plan import TransferPlan
from hmacore.regrain import RegrainPlan, token_page, token_ranges
from hmacore.spec import GroupKind, GroupSpec, KVLayout
from hmacore.tp import GroupSharding, TpMapping, kv_heads_of_rank

H, HB, NB = 4, 8, 40
LAYERS = ("f.0", "s.0")


def layout(bs):
    return KVLayout(groups=(GroupSpec(GroupKind.FULL, bs, ("f.0",)),
                            GroupSpec(GroupKind.SLIDING_WINDOW, bs, ("s.0",), sliding_window=40)))


def tag(layer, t, head, n):
    x = (np.arange(n, dtype=np.uint64) + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
    x ^= np.full(1, (LAYERS.index(layer) << 48) | (t << 8) | head, np.uint64) \
        * np.uint64(0xBF58476D1CE4E5B9)
    return (x >> np.uint64(40)).astype(np.uint8)


def rank_side(bs, tp, rank):
    h0, h1 = kv_heads_of_rank(H, tp, rank)
    kv = {n: np.zeros((NB, h1 - h0, bs, 2 * HB), np.uint8) for n in LAYERS}
    lay = layout(bs)
    plan = TransferPlan.from_kv_caches(lay, kv, num_blocks=NB)
    page = token_page("LBHNC", block_size=bs, heads=h1 - h0, head_start=h0, head_bytes=HB, kv=2)
    return lay, kv, plan, [page, page], (h0, h1)


@pytest.mark.parametrize("bp, bd", [(16, 32), (32, 8), (8, 8)])
@pytest.mark.parametrize("tp_p, tp_d, d", [(1, 2, 1), (2, 1, 0), (4, 2, 1), (2, 4, 3)])
def test_tp_and_block_sizes_every_byte(bp, bd, tp_p, tp_d, d):
    n, trim = 101, 16
    rng = np.random.default_rng(bp * 100 + bd + tp_p * 7 + tp_d)
    dlay, dkv, dplan, dpg, (dh0, dh1) = rank_side(bd, tp_d, d)
    for a in dkv.values():
        a[...] = rng.integers(0, 256, a.shape, dtype=np.uint8)
    before = {k: v.copy() for k, v in dkv.items()}
    lo, hi = token_ranges(dlay, n, trim)
    d_first = [x // bd for x in lo]
    d_ids = [list(rng.permutation(np.arange(1, NB))[:-(-hi[g] // bd) - d_first[g]])
             for g in range(2)]
    shard = [GroupSharding(num_heads=H, chunks=1)] * 2
    mapping = TpMapping(dlay, shard, local_tp=tp_d, local_rank=d, remote_tp=tp_p,
                        page_layout="LBHNC")
    sources = {}
    for p in mapping.remote_ranks:
        slay, skv, splan, spg, (sh0, sh1) = rank_side(bp, tp_p, p)
        s_ids = [list(rng.permutation(np.arange(1, NB))[:-(-n // bp)]) for _ in range(2)]
        for g, name in enumerate(LAYERS):
            skv[name][...] = rng.integers(0, 256, skv[name].shape, dtype=np.uint8)
            for i, b in enumerate(s_ids[g]):
                for r in range(bp):
                    for h in range(sh0, sh1):
                        skv[name][b, h - sh0, r] = tag(name, i * bp + r, h, 2 * HB)
        plan = RegrainPlan(slay, dlay, splan, dplan, spg, dpg, tp=(mapping, p))
        runs = plan.runs(s_ids, d_ids, lo, hi, dst_first=d_first)
        for (sa, ln, _), (da, _, _) in zip(runs.src.tolist(), runs.dst.tolist()):
            ctypes.memmove(da, sa, ln)
        sources[p] = skv
    for g, name in enumerate(LAYERS):
        want = before[name].copy()
        for t in range(lo[g], hi[g]):
            b = d_ids[g][t // bd - d_first[g]]
            for h in range(dh0, dh1):
                want[b, h - dh0, t % bd] = tag(name, t, h, 2 * HB)
        assert np.array_equal(dkv[name], want), f"{name}: {(dkv[name] != want).sum()} bytes"
    assert len(sources) == len(mapping.remote_ranks) >= 1


@pytest.mark.parametrize("tp_p, tp_d, d", [(2, 1, 0), (4, 2, 1), (1, 2, 1)])
def test_tp_and_block_sizes_cpu_vec_pages(tp_p, tp_d, d):
    """vLLM CPU's vec-kernel pages (CPU_VEC: per head K transposed ``[head_bytes, tokens]``,
    then V ``[tokens, head_bytes]``; 1-byte elements here), P 16 / D 32 tokens per block:
    each source rank's plan pairs only the chunks of its own heads (keys ``("k", head, d)``
    and ``("v", head)``), and after every source rank's runs each D head's K column and V row
    of every token in ``[lo, hi)`` holds P's bytes, every other byte untouched."""
    bp, bd, n, trim = 16, 32, 101, 16
    rng = np.random.default_rng(tp_p * 10 + tp_d)

    def side(bs, tp, rank):
        h0, h1 = kv_heads_of_rank(H, tp, rank)
        kv = {x: np.zeros((NB, h1 - h0, 2 * HB * bs), np.uint8) for x in LAYERS}
        lay = layout(bs)
        plan = TransferPlan.from_kv_caches(lay, kv, num_blocks=NB)
        page = token_page("CPU_VEC", block_size=bs, heads=h1 - h0, head_start=h0,
                          head_bytes=HB, kv=2, head_dim=HB)
        return lay, kv, plan, [page, page], (h0, h1)

    def k_at(arr, b, h, t, bs):       # K column of token t (HB bytes, bs apart) and V row
        head = arr[b, h]
        return head[:HB * bs].reshape(HB, bs)[:, t], head[HB * bs:].reshape(bs, HB)[t]

    dlay, dkv, dplan, dpg, (dh0, dh1) = side(bd, tp_d, d)
    for a in dkv.values():
        a[...] = rng.integers(0, 256, a.shape, dtype=np.uint8)
    want = {k: v.copy() for k, v in dkv.items()}
    lo, hi = token_ranges(dlay, n, trim)
    d_first = [x // bd for x in lo]
    d_ids = [list(rng.permutation(np.arange(1, NB))[:-(-hi[g] // bd) - d_first[g]])
             for g in range(2)]
    shard = [GroupSharding(num_heads=H, chunks=1)] * 2
    mapping = TpMapping(dlay, shard, local_tp=tp_d, local_rank=d, remote_tp=tp_p,
                        page_layout="LBHNC")
    for p in mapping.remote_ranks:
        slay, skv, splan, spg, (sh0, sh1) = side(bp, tp_p, p)
        s_ids = [list(rng.permutation(np.arange(1, NB))[:-(-n // bp)]) for _ in range(2)]
        for a in skv.values():
            a[...] = rng.integers(0, 256, a.shape, dtype=np.uint8)
        plan = RegrainPlan(slay, dlay, splan, dplan, spg, dpg, tp=(mapping, p))
        mine = set(range(max(sh0, dh0), min(sh1, dh1)))
        assert {len(pr.chunks) for pr in plan.pairs} == {len(mine) * (HB + 1)}
        runs = plan.runs(s_ids, d_ids, lo, hi, dst_first=d_first)
        for (sa, ln, _), (da, _, _) in zip(runs.src.tolist(), runs.dst.tolist()):
            ctypes.memmove(da, sa, ln)
        for g, name in enumerate(LAYERS):
            for t in range(lo[g], hi[g]):
                sb, db = s_ids[g][t // bp], d_ids[g][t // bd - d_first[g]]
                for h in mine:
                    sk, sv = k_at(skv[name], sb, h - sh0, t % bp, bp)
                    dk, dv = k_at(want[name], db, h - dh0, t % bd, bd)
                    dk[...], dv[...] = sk, sv
    for name in LAYERS:
        assert np.array_equal(dkv[name], want[name]), \
            f"{name}: {(dkv[name] != want[name]).sum()} bytes"
