"""Python objects allocated on the hot paths, per call and per block touched, measured with
``sys.getallocatedblocks()`` deltas (objects still alive after the call: results included) and
tracemalloc's peak block count during the call (temporaries included). Goal: a constant per
call, 0 per block. Each test also times the call once so the figures reach the report
(``objects_per_block`` entries in latest.json's ``memory`` section)."""
import gc
import sys
import tracemalloc

import numpy as np
import pytest

from hmacore.hits import ExistenceSet, HitFinder
from hmacore.plan import TransferPlan
from hmacore.presets import get_preset
from hmacore.tables import TrackerSet
from hmacore.windows import clip_tracked_spans, clip_windows

from _tables_fixtures import window_tables

NUM_REQS = 256
DSV4 = get_preset("deepseek-v4", num_blocks=2**31 - 1)
TOKENS = [4096, 131072]


def objects(fn, reps=20):
    """(objects alive after, peak temporaries) per call, averaged over ``reps`` calls."""
    fn()
    gc.collect()
    gc.disable()
    try:
        keep = []
        before = sys.getallocatedblocks()
        for _ in range(reps):
            keep.append(fn())
        after = sys.getallocatedblocks()
        keep_cost = sys.getallocatedblocks()
        del keep
        tracemalloc.start()
        tracemalloc.reset_peak()
        snap0 = tracemalloc.get_traced_memory()
        fn()
        peak = tracemalloc.get_traced_memory()[1] - snap0[0]
        tracemalloc.stop()
    finally:
        gc.enable()
    del keep_cost
    return (after - before) / reps, peak


def _record(benchmark, name, fn, blocks):
    per_call, peak = objects(fn)
    benchmark.group = f"mem-{name}"
    benchmark.extra_info.update(impl="hmacore-mem", objects_per_call=per_call,
                                objects_per_block=per_call / max(blocks, 1),
                                blocks=int(blocks), peak_traced_bytes=int(peak))
    benchmark.pedantic(fn, rounds=3, iterations=1)


@pytest.mark.parametrize("tokens", TOKENS)
def test_mem_step(benchmark, tokens):
    """apply_step_flat + clip_tracked_spans, 256 requests x 5 groups, one block per group."""
    ts = TrackerSet(DSV4)
    for r, t in enumerate(window_tables(DSV4, tokens, NUM_REQS)):
        ts.add(r, t)
    reqs = list(range(NUM_REQS))
    G = DSV4.num_groups
    ids = np.arange(10**6, 10**6 + NUM_REQS * G, dtype=np.int32)
    offs = np.arange(NUM_REQS * G + 1, dtype=np.int64)

    def step():
        ts.apply_step_flat(reqs, ids, offs)
        return clip_tracked_spans(ts, reqs)
    _record(benchmark, f"step-5groups-{tokens // 1024}k", step, ids.size)


@pytest.mark.parametrize("tokens", TOKENS)
def test_mem_clip(benchmark, tokens):
    t = [np.array(g, dtype=np.int32) for g in window_tables(DSV4, tokens, NUM_REQS)[0]]
    t = tuple(t)
    _record(benchmark, f"clip-5groups-{tokens // 1024}k", lambda: clip_windows(t, DSV4),
            sum(x.size for x in t))


@pytest.mark.parametrize("tokens", TOKENS)
def test_mem_desc_ids(benchmark, tokens):
    plan = TransferPlan.from_layout(get_preset("gpt-oss-120b", num_blocks=65536))
    table = tuple(np.arange(1, n + 1, dtype=np.int32) for n in plan.request_blocks(tokens))
    out = np.empty(plan.count_desc_ids(table), np.int64)
    _record(benchmark, f"desc_ids-gpt-oss-{tokens // 1024}k",
            lambda: plan.desc_ids(table, out=out), sum(x.size for x in table))


@pytest.mark.parametrize("tokens", TOKENS)
def test_mem_longest_hit(benchmark, tokens):
    finder = HitFinder(get_preset("deepseek-v4"))
    n = tokens // finder.hash_block_size
    hashes = np.random.default_rng(0).integers(0, 256, (n, 32), dtype=np.uint8)
    es = ExistenceSet(32)
    for g in finder.group_ids:
        k = finder.block_sizes[g] // finder.hash_block_size
        es.add_many(g, np.ascontiguousarray(hashes[(np.arange(n // k) + 1) * k - 1]))
    blocks = sum(tokens // finder.block_sizes[g] for g in finder.group_ids)
    _record(benchmark, f"longest_hit-deepseek-v4-{tokens // 1024}k",
            lambda: finder.longest_hit(hashes, es, tokens - 1), blocks)
