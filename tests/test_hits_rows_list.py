"""The hit kernel reads vLLM's ``Request.block_hashes`` (a list of bytes) in place: the same
answer as the (N, ds) array form on random layouts, a bad probed row is named, the list is
never converted, and threads replacing list items cannot crash it."""
from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from hmacore.errors import HashInputError, LayoutError
from hmacore.hits import ExistenceSet, HitFinder
from hmacore.presets import get_preset

from hits_scenarios import draw_max_length, layouts, make_hashes, populate
from oracle_hits import OracleFinder


@given(data=st.data(), layout=layouts(), eagle=st.booleans(), ds=st.sampled_from([16, 32]))
def test_list_rows_equal_array_rows(data, layout, eagle, ds):
    try:
        finder = HitFinder(layout, eagle=eagle)
    except LayoutError:
        assume(False)
    oracle = OracleFinder(layout, eagle=eagle)
    n = data.draw(st.integers(0, 96))
    hashes = make_hashes(n, ds, data.draw(st.integers(0, 2**32 - 1)))
    es, _ = populate(data, finder, oracle, hashes, ds)
    max_length = draw_max_length(data, n, finder.hash_block_size)
    raw = [bytes(r) for r in hashes]
    want = finder.longest_hit(hashes, es, max_length)
    got = finder.longest_hit(raw, es, max_length)
    assert got == want
    assert finder.hit_tokens(raw, es, max_length) == want.tokens


def _scenario():
    layout = get_preset("deepseek-v4")
    finder = HitFinder(layout)
    hashes = make_hashes(4096, 32, 7)
    es = ExistenceSet(32)
    for g in finder.group_ids:
        k = finder.block_sizes[g] // finder.hash_block_size
        rows = (np.arange(4096 // k) + 1) * k - 1
        es.add_many(g, np.ascontiguousarray(hashes[rows]))
    return finder, hashes, es


def test_a_bad_probed_row_is_named_and_unprobed_rows_are_not_read():
    finder, hashes, es = _scenario()
    raw = [bytes(r) for r in hashes]
    full = finder.longest_hit(raw, es, 4096 * 4 - 1).tokens
    assert full > 0
    # rows the hit never probes may hold anything: they are not read
    probed_past = raw[:full // 4] + [None] * (len(raw) - full // 4)
    assert finder.longest_hit(probed_past, es, full).tokens <= full
    bad = list(raw)
    bad[63] = b"short"                      # the first full-attention row (block 256 tokens)
    with pytest.raises(HashInputError, match=r"hashes\[63\] must be 32 bytes"):
        finder.longest_hit(bad, es, 4096 * 4 - 1)
    bad[63] = bytearray(raw[63])            # not exactly bytes
    with pytest.raises(HashInputError, match=r"hashes\[63\]"):
        finder.longest_hit(bad, es, 4096 * 4 - 1)
    with pytest.raises(HashInputError, match="mask mode"):
        finder.longest_hit(raw, None, 256)


def test_threads_replacing_items_never_crash():
    finder, hashes, es = _scenario()
    raw = [bytes(r) for r in hashes]
    want = finder.longest_hit(raw, es, 4096 * 4 - 1).tokens
    stop = threading.Event()

    def churn():
        i = 0
        while not stop.is_set():
            raw[i % len(raw)] = bytes(hashes[i % len(raw)])   # a fresh equal object
            i += 1

    t = threading.Thread(target=churn)
    t.start()
    try:
        for _ in range(300):
            assert finder.longest_hit(raw, es, 4096 * 4 - 1).tokens == want
    finally:
        stop.set()
        t.join()
