"""One scheduler step of tracker updates + window clipping, hmacore vs the plain-Python
oracle (tests/oracle_core.py), 256 requests x {2, 5} groups x {4k, 32k, 128k} tokens.

Two scenarios per size: ``step`` = one decode step in steady state (every request appends
one block per group via ``apply_step``, then every request's table is window-clipped);
``alloc`` = the full table arriving twice per request (``update_after_alloc``, prefill /
async-load path). The oracle does the same work with plain lists (its step calls append per
request; it has no all-or-nothing validation).

Layouts: 2 groups = gpt-oss-120b (SW bs16 w128 + FA bs16), 5 groups = DeepSeek-V4
(256/64/64/4/8). Tables look like vLLM's: full length per group, SW groups null-padded
(id 0) in front of their in-window tail. Inputs are Python lists (what vLLM hands a
connector). Each pair shares a pytest-benchmark group; results are checked equal first.

Run: python -m pytest bench/bench_tables.py --benchmark-only --benchmark-group-by=group
"""
import gc

import pytest

from hmacore.grain import cdiv
from hmacore.presets import get_preset
from hmacore.spec import GroupKind
from hmacore.tables import TrackerSet
import numpy as np

from hmacore.windows import clip_tracked, clip_tracked_spans
from tests import oracle_core as oracle

NUM_REQS = 256
LAYOUTS = {2: get_preset("gpt-oss-120b", num_blocks=2**31 - 1),
           5: get_preset("deepseek-v4", num_blocks=2**31 - 1)}
TOKENS = [4096, 32768, 131072]


def full_tables(layout, tokens, num_reqs):
    """Per request: the table vLLM would hold after ``tokens`` tokens (lists of ints)."""
    out, next_id = [], 1
    for _ in range(num_reqs):
        t = []
        for spec in layout.groups:
            n = cdiv(tokens, spec.block_size)
            if spec.kind == GroupKind.SLIDING_WINDOW:
                keep = min(n, spec.window_blocks())
                t.append([0] * (n - keep) + list(range(next_id, next_id + keep)))
                next_id += keep
            else:
                t.append(list(range(next_id, next_id + n)))
                next_id += n
        out.append(t)
    return out, next_id


def step_inputs(layout, start_id):
    """One decode step: every request gets one new block in every group."""
    return [[[start_id + r * layout.num_groups + g] for g in range(layout.num_groups)]
            for r in range(NUM_REQS)]


def lib_step(ts, layout, new_ids):
    ts.apply_step(cached=[(r, tuple(ids), False) for r, ids in enumerate(new_ids)])
    return clip_tracked(ts, range(NUM_REQS))


def ora_step(ora, groups, new_ids):
    for r, ids in enumerate(new_ids):
        ora.append(r, ids)
    return [oracle.clip(ora.reqs[r]["t"], groups) for r in range(NUM_REQS)]


def make_lib(layout, tables, warm=None):
    ts = TrackerSet(layout)
    for r, t in enumerate(tables):
        ts.add(r, tuple(t))
    if warm is not None:  # one earlier decode step: steady-state buffers/lists
        lib_step(ts, layout, warm)
    return ts


def make_ora(layout, tables, warm=None):
    ora = oracle.Trackers(layout.num_groups)
    for r, t in enumerate(tables):
        ora.add(r, t)
    if warm is not None:
        ora_step(ora, oracle.layout_to_dicts(layout), warm)
    return ora


@pytest.fixture(scope="module", params=[(g, n) for g in (2, 5) for n in TOKENS],
                ids=lambda p: f"{p[0]}groups-{p[1] // 1024}k")
def case(request):
    groups, tokens = request.param
    layout = LAYOUTS[groups]
    tables, next_id = full_tables(layout, tokens, NUM_REQS)
    warm = step_inputs(layout, next_id)
    new_ids = step_inputs(layout, next_id + NUM_REQS * groups)
    # Same inputs, same outputs: checked once before anything is timed.
    got = lib_step(make_lib(layout, tables, warm), layout, new_ids)
    want = ora_step(make_ora(layout, tables, warm), oracle.layout_to_dicts(layout), new_ids)
    assert [[x.tolist() for x in t] for t in got] == want
    return layout, tables, (warm, new_ids), f"step-{groups}groups-{tokens // 1024}k"


def _settled(obj):
    """Setup result with the cyclic GC's counters reset: the allocations of building a fresh
    tracker/oracle must not bill a collection to whichever implementation runs next."""
    gc.collect()
    return (obj,), {}


def _rounds(tables):
    size = sum(len(g) for g in tables[0])
    return 3 if size > 20000 else 10


def test_step_hmacore(benchmark, case):
    layout, tables, (warm, new_ids), group = case
    benchmark.group = group
    benchmark.extra_info["impl"] = "hmacore"
    benchmark.pedantic(lambda ts: lib_step(ts, layout, new_ids),
                       setup=lambda: _settled(make_lib(layout, tables, warm)), rounds=_rounds(tables))


def test_step_oracle(benchmark, case):
    layout, tables, (warm, new_ids), group = case
    benchmark.group = group
    benchmark.extra_info["impl"] = "oracle"
    groups = oracle.layout_to_dicts(layout)
    benchmark.pedantic(lambda ora: ora_step(ora, groups, new_ids),
                       setup=lambda: _settled(make_ora(layout, tables, warm)), rounds=_rounds(tables))


# -- the batched step API: one call for every request's new ids, one call for the clip -----
def flat_inputs(new_ids):
    """The step's new ids as one int32 array + int64 offsets (request-major, group-minor)."""
    ids = np.array([b for per_req in new_ids for g in per_req for b in g], dtype=np.int32)
    lens = [len(g) for per_req in new_ids for g in per_req]
    return ids, np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)


REQS = list(range(NUM_REQS))


def lib_step_flat(ts, flat):
    ts.apply_step_flat(REQS, *flat)
    return clip_tracked_spans(ts, REQS)


def spans_to_lists(ts, spans):
    return [[ts.block_ids(r, copy=False)[g][spans[r, g, 0]:spans[r, g, 1]].tolist()
             for g in range(spans.shape[1])] for r in REQS]


@pytest.fixture(scope="module", params=[(g, n) for g in (2, 5) for n in TOKENS],
                ids=lambda p: f"{p[0]}groups-{p[1] // 1024}k")
def flat_case(request):
    """``step_flat``: the same decode step as ``step`` through ``apply_step_flat`` (new ids as
    one int32 array + offsets, built once outside the timing like vLLM's own flat
    ``new_block_ids`` arrays would be) and ``clip_tracked_spans`` ([start, end) per request
    and group into the tracker's buffers instead of one view object per group)."""
    groups, tokens = request.param
    layout = LAYOUTS[groups]
    tables, next_id = full_tables(layout, tokens, NUM_REQS)
    warm = step_inputs(layout, next_id)
    new_ids = step_inputs(layout, next_id + NUM_REQS * groups)
    flat = flat_inputs(new_ids)
    ts = make_lib(layout, tables, warm)
    got = spans_to_lists(ts, lib_step_flat(ts, flat))
    want = ora_step(make_ora(layout, tables, warm), oracle.layout_to_dicts(layout), new_ids)
    assert got == want
    return layout, tables, (warm, new_ids, flat), f"step_flat-{groups}groups-{tokens // 1024}k"


def test_step_flat_hmacore(benchmark, flat_case):
    layout, tables, (warm, _, flat), group = flat_case
    benchmark.group = group
    benchmark.extra_info["impl"] = "hmacore"
    benchmark.pedantic(lambda ts: lib_step_flat(ts, flat),
                       setup=lambda: _settled(make_lib(layout, tables, warm)), rounds=_rounds(tables) * 3)


def test_step_flat_oracle(benchmark, flat_case):
    layout, tables, (warm, new_ids, _), group = flat_case
    benchmark.group = group
    benchmark.extra_info["impl"] = "oracle"
    groups = oracle.layout_to_dicts(layout)
    benchmark.pedantic(lambda ora: ora_step(ora, groups, new_ids),
                       setup=lambda: _settled(make_ora(layout, tables, warm)), rounds=_rounds(tables) * 3)


# -- prefill-style step: the full table arrives (twice) for every request --------------
def lib_alloc(ts, tables):
    for r, t in enumerate(tables):
        ts.update_after_alloc(r, t)
        ts.update_after_alloc(r, t)   # vLLM may deliver the same full table again


def ora_alloc(ora, tables):
    for r, t in enumerate(tables):
        ora.update_after_alloc(r, t)
        ora.update_after_alloc(r, t)


@pytest.fixture(scope="module", params=[(g, n) for g in (2, 5) for n in TOKENS],
                ids=lambda p: f"{p[0]}groups-{p[1] // 1024}k")
def alloc_case(request):
    groups, tokens = request.param
    layout = LAYOUTS[groups]
    tables, _ = full_tables(layout, tokens, NUM_REQS)
    empty = [[[] for _ in layout.groups] for _ in range(NUM_REQS)]
    ts, ora = make_lib(layout, empty), make_ora(layout, empty)
    lib_alloc(ts, tables)
    ora_alloc(ora, tables)
    assert [[x.tolist() for x in ts.block_ids(r)] for r in range(NUM_REQS)] == \
        [ora.reqs[r]["t"] for r in range(NUM_REQS)]
    return layout, tables, empty, f"alloc-{groups}groups-{tokens // 1024}k"


def test_alloc_hmacore(benchmark, alloc_case):
    layout, tables, empty, group = alloc_case
    benchmark.group = group
    benchmark.extra_info["impl"] = "hmacore"
    benchmark.pedantic(lambda ts: lib_alloc(ts, tables),
                       setup=lambda: _settled(make_lib(layout, empty)), rounds=_rounds(tables))


def test_alloc_oracle(benchmark, alloc_case):
    layout, tables, empty, group = alloc_case
    benchmark.group = group
    benchmark.extra_info["impl"] = "oracle"
    benchmark.pedantic(lambda ora: ora_alloc(ora, tables),
                       setup=lambda: _settled(make_ora(layout, empty)), rounds=_rounds(tables))
