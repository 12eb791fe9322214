"""Heterogeneous TP: per-request descriptor ids of one (decode rank, prefill rank) pair next to
the same request on a 1:1 plan (gpt-oss-120b: 8 KV heads, 18 aliased layer slots, K/V chunks;
decode TP=1 reading prefill TP=2). Pair plans are built once; the per-request path is
TransferPlan's Cython flattening over the virtual regions (2 head-slice chunks per slot).
Also reports the one-time pair-plan build."""
import numpy as np

from hmacore.plan import TransferPlan
from hmacore.presets import get_preset
from hmacore.tp import GroupSharding, TpMapping, build_pair_plans

NB, TOKENS, HBB = 8192, 32768, 16 * 64  # 16 tokens x 64 B per head per chunk


def _setup():
    layout = get_preset("gpt-oss", num_blocks=NB)
    sh = [GroupSharding(8, 2)] * 2
    dplan = TransferPlan.from_layout(layout, NB, page_bytes=2 * 8 * HBB)
    pplans = {p: TransferPlan.from_layout(layout, NB, page_bytes=2 * 4 * HBB, base=(p + 2) << 40)
              for p in range(2)}
    m = TpMapping(layout, sh, local_tp=1, local_rank=0, remote_tp=2)
    rng = np.random.default_rng(0)
    pool = rng.permutation(np.arange(1, NB, dtype=np.int32))
    table, k = [], 0
    for n in dplan.request_blocks(TOKENS):
        table.append(np.sort(pool[k:k + n]))
        k += n
    return layout, m, dplan, pplans, table


def test_pair_plan_build(benchmark):
    _, m, dplan, pplans, _ = _setup()
    benchmark.group = "tp-pair-build"
    pairs = benchmark(build_pair_plans, m, dplan, pplans)
    assert set(pairs) == {0, 1}


def test_pair_desc_ids(benchmark):
    _, m, dplan, pplans, table = _setup()
    pair = build_pair_plans(m, dplan, pplans)[1]
    benchmark.group = "tp-desc-ids-gpt-oss-32k"
    lids, rids = benchmark(pair.desc_ids, table, table)
    assert lids.size == rids.size == 2 * dplan.desc_ids(table).size  # K and V slice per block


def test_pair_desc_ids_reused_buffers(benchmark):
    _, m, dplan, pplans, table = _setup()
    pair = build_pair_plans(m, dplan, pplans)[1]
    n = pair.local.count_desc_ids(table)
    ol, orr = np.empty(n, np.int64), np.empty(n, np.int64)
    benchmark.group = "tp-desc-ids-gpt-oss-32k"
    lids, rids = benchmark(lambda: pair.desc_ids(table, table, out_local=ol, out_remote=orr))
    ref = pair.desc_ids(table, table)
    assert (lids == ref[0]).all() and (rids == ref[1]).all()


def test_one_to_one_desc_ids(benchmark):
    _, _, dplan, _, table = _setup()
    benchmark.group = "tp-desc-ids-gpt-oss-32k"
    benchmark(lambda: (dplan.desc_ids(table), dplan.desc_ids(table)))
