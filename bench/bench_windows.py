"""Window clipping, prefix trimming and kernel expansion for 256 requests, hmacore vs the
plain-Python oracle (tests/oracle_core.py), side by side in one pytest-benchmark group per
case; outputs are checked equal before timing.

Inputs: ``lists`` = per-group Python lists (what vLLM hands a connector, e.g. in
request_finished / kv_transfer_params); ``arrays`` = int32 arrays (what TrackerSet holds).

Run: python -m pytest bench/bench_windows.py --benchmark-only
"""
import numpy as np
import pytest

from hmacore.grain import cdiv
from hmacore.presets import get_preset
from hmacore.windows import (clip_to_window, clip_windows, expand_layout_to_kernel,
                             trim_remote_to_local)
from _tables_fixtures import window_tables
from tests import oracle_core as oracle

NUM_REQS = 256
LAYOUTS = {"2groups": get_preset("gpt-oss-120b", num_blocks=2**31 - 1),
           "5groups": get_preset("deepseek-v4", num_blocks=2**31 - 1)}
TOKENS = [4096, 32768, 131072]


def as_lists(result):
    return [[x if isinstance(x, list) else x.tolist() for x in t] for t in result]


CASES = [(name, n, form) for name in LAYOUTS for n in TOKENS for form in ("lists", "arrays")]


@pytest.fixture(scope="module", params=CASES, ids=lambda p: f"{p[0]}-{p[1] // 1024}k-{p[2]}")
def clip_case(request):
    """``clip-*``: :func:`clip_windows` (vLLM's clipper contract: cut groups validated and
    kept in the caller's form, whole groups passed through) vs the oracle, which has the same
    contract. ``clipcheck-*``: :func:`clip_to_window`, which also converts every whole
    group to int32 and range-checks it (O(all blocks)); the oracle does not, so that ratio
    measures the price of the extra validation, not the same work."""
    name, tokens, form = request.param
    layout = LAYOUTS[name]
    ts = window_tables(layout, tokens, NUM_REQS)
    inp = [tuple(t) for t in ts] if form == "lists" else \
        [tuple(np.array(g, dtype=np.int32) for g in t) for t in ts]
    groups = oracle.layout_to_dicts(layout)
    want = [oracle.clip(t, groups) for t in ts]
    assert as_lists([clip_to_window(t, layout) for t in inp]) == want
    assert as_lists([clip_windows(t, layout) for t in inp]) == want
    return layout, inp, ts, groups, f"{name}-{tokens // 1024}k-{form}"


def test_clip_hmacore(benchmark, clip_case):
    layout, inp, _, _, group = clip_case
    benchmark.group = "clip-" + group
    benchmark.extra_info["impl"] = "hmacore"
    benchmark(lambda: [clip_windows(t, layout) for t in inp])


def test_clip_oracle(benchmark, clip_case):
    _, _, ts, groups, group = clip_case
    benchmark.group = "clip-" + group
    benchmark.extra_info["impl"] = "oracle"
    benchmark(lambda: [oracle.clip(t, groups) for t in ts])


def test_clipcheck_hmacore(benchmark, clip_case):
    layout, inp, _, _, group = clip_case
    benchmark.group = "clipcheck-" + group
    benchmark.extra_info["impl"] = "hmacore"
    benchmark(lambda: [clip_to_window(t, layout) for t in inp])


def test_clipcheck_oracle(benchmark, clip_case):
    _, _, ts, groups, group = clip_case
    benchmark.group = "clipcheck-" + group
    benchmark.extra_info["impl"] = "oracle"
    benchmark(lambda: [oracle.clip(t, groups) for t in ts])


@pytest.fixture(scope="module", params=[(name, n) for name in LAYOUTS for n in TOKENS],
                ids=lambda p: f"{p[0]}-{p[1] // 1024}k")
def trim_case(request):
    """D holds the last half of each group's P-side clipped blocks uncached (lists, as they
    arrive in kv_transfer_params)."""
    name, tokens = request.param
    layout = LAYOUTS[name]
    groups = oracle.layout_to_dicts(layout)
    remote = [oracle.clip(t, groups) for t in window_tables(layout, tokens, NUM_REQS)]
    local = []
    for r in remote:
        real = [[b for b in g if b] for g in r]
        local.append([list(range(10**6, 10**6 + len(g) // 2)) for g in real])
    got = [trim_remote_to_local(tuple(l), tuple(r), layout) for l, r in zip(local, remote)]
    want = [oracle.trim(l, r, groups) for l, r in zip(local, remote)]
    assert [[as_lists([a])[0] for a in pair] for pair in got] == [list(w) for w in want]
    return layout, local, remote, groups, f"trim-{name}-{tokens // 1024}k"


def test_trim_hmacore(benchmark, trim_case):
    layout, local, remote, _, group = trim_case
    benchmark.group = group
    benchmark.extra_info["impl"] = "hmacore"
    benchmark(lambda: [trim_remote_to_local(tuple(l), tuple(r), layout)
                       for l, r in zip(local, remote)])


def test_trim_oracle(benchmark, trim_case):
    _, local, remote, groups, group = trim_case
    benchmark.group = group
    benchmark.extra_info["impl"] = "oracle"
    benchmark(lambda: [oracle.trim(l, r, groups) for l, r in zip(local, remote)])


@pytest.fixture(scope="module", params=TOKENS, ids=lambda n: f"qwen3next-{n // 1024}k")
def expand_case(request):
    """Qwen3-Next: 3 Mamba groups (1 state block each) + FA with kernel ratio 34."""
    tokens = request.param
    layout = get_preset("qwen3-next-80b", num_blocks=2**20)
    n = cdiv(tokens, 544)
    inp = [([r + 1], [r + 2], [r + 3], list(range(1000 + r, 1000 + r + n))) for r in range(NUM_REQS)]
    groups = oracle.layout_to_dicts(layout)
    want = [[oracle.expand(g, spec["kr"]) for g, spec in zip(t, groups)] for t in inp]
    assert as_lists([expand_layout_to_kernel(t, layout) for t in inp]) == want
    return layout, inp, groups, f"expand-qwen3next-{tokens // 1024}k"


def test_expand_hmacore(benchmark, expand_case):
    layout, inp, _, group = expand_case
    benchmark.group = group
    benchmark.extra_info["impl"] = "hmacore"
    benchmark(lambda: [expand_layout_to_kernel(t, layout) for t in inp])


def test_expand_oracle(benchmark, expand_case):
    _, inp, groups, group = expand_case
    benchmark.group = group
    benchmark.extra_info["impl"] = "oracle"
    benchmark(lambda: [[oracle.expand(g, spec["kr"]) for g, spec in zip(t, groups)] for t in inp])
