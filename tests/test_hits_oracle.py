"""Differential tests: native HitFinder vs the plain-Python oracle on random layouts."""
from __future__ import annotations

import pytest
from hypothesis import assume, event, given
from hypothesis import strategies as st

from hmacore.errors import LayoutError
from hmacore.hits import HitFinder
from hmacore.presets import get_preset
from hmacore.spec import GroupKind, GroupSpec, KVLayout, MambaMode

from hits_scenarios import chunked_layouts, draw_max_length, layouts, make_hashes, populate
from oracle_hits import OracleFinder


def _compare(data, layout, coarse, eagle, ds, max_rows, min_rows=0, **rule):
    try:
        finder = HitFinder(layout, coarse=coarse, eagle=eagle, **rule)
    except LayoutError:
        assume(False)
    oracle = OracleFinder(layout, coarse=coarse, eagle=eagle, **rule)
    assert finder.alignment == oracle.align and finder.partial == oracle.partial
    n = data.draw(st.integers(min_rows, max_rows)) if data.draw(st.booleans()) else \
        data.draw(st.integers(0, max_rows))
    hashes = make_hashes(n, ds, data.draw(st.integers(0, 2**32 - 1)))
    es, py = populate(data, finder, oracle, hashes, ds)
    h = finder.hash_block_size
    max_length = draw_max_length(data, n, h)
    raw = [bytes(r) for r in hashes]
    got = finder.longest_hit(hashes, es, max_length)
    want_tokens, want_masks = oracle.longest_hit(raw, py, max_length)
    assert got.tokens == want_tokens
    assert [m.tolist() for m in got.masks] == [[int(b) for b in m] for m in want_masks]
    assert got.tokens % finder.alignment == 0 and got.tokens <= max_length
    event("hit > 0" if got.tokens else "hit == 0")
    event("fine-grained" if finder.partial else "aligned to " + ("block" if finder.unitary else "lcm"))
    # mask mode at the found length, eagle not re-applied (the loader's view)
    got_m = finder.load_masks(hashes, got.tokens)
    _, want_m = oracle.longest_hit(raw, None, got.tokens, apply_eagle=False)
    assert [m.tolist() for m in got_m] == [[int(b) for b in m] for m in want_m]


@given(data=st.data(), layout=layouts(), coarse=st.sampled_from(["last", "concat"]),
       eagle=st.booleans(), ds=st.sampled_from([16, 32]))
def test_random_layouts_match_oracle(data, layout, coarse, eagle, ds):
    _compare(data, layout, coarse, eagle, ds, max_rows=48)


@given(data=st.data(), layout=layouts(extra=True), eagle=st.booleans(),
       eagle_gated=st.booleans(), retained_coverage=st.booleans(),
       single_spec_direct=st.booleans(), ds=st.sampled_from([16, 32]))
def test_hit_rules_match_oracle(data, layout, eagle, eagle_gated, retained_coverage,
                                single_spec_direct, ds):
    """Every rule flag: both eagle rules (flagged groups always drop / only with ``eagle``),
    both window rules (the window / window + extra retained tokens) and both ways of looking
    up a single spec group, on layouts with retained tokens."""
    event("coverage" if retained_coverage else "window")
    _compare(data, layout, "last", eagle, ds, max_rows=48, eagle_gated=eagle_gated,
             retained_coverage=retained_coverage, single_spec_direct=single_spec_direct)


@given(data=st.data(), bs=st.sampled_from([2, 4, 8]), mult=st.integers(1, 4),
       with_full=st.booleans())
def test_chunked_local_matches_oracle(data, bs, mult, with_full):
    _compare(data, chunked_layouts(bs, mult, with_full), "last", False, 16, max_rows=40)


@pytest.mark.parametrize("name", ["deepseek-v4", "gpt-oss-120b", "gemma-3-27b", "qwen3-next-80b",
                                  "llama-3-70b"])
@given(data=st.data(), eagle=st.booleans())
def test_presets_match_oracle(name, data, eagle):
    layout = get_preset(name)
    # keep the row count small for big blocks: DSv4 h=4 -> 640 rows = 2560 tokens (10 MLA blocks)
    rows = {"deepseek-v4": 640, "qwen3-next-80b": 64}.get(name, 300)
    _compare(data, layout, "last", eagle, 32, max_rows=rows,
             min_rows=HitFinder(layout).scheduler_block_size // HitFinder(layout).hash_block_size)


@given(data=st.data(), eagle=st.booleans(), hm=st.sampled_from([2, 4, 8]))
def test_full_plus_fine_grained_mamba_matches_oracle(data, eagle, hm):
    layout = KVLayout(groups=(GroupSpec(GroupKind.FULL, 4 * hm, ("a",), eagle=eagle),
                              GroupSpec(GroupKind.MAMBA, 4 * hm, ("m",), mamba_mode=MambaMode.ALIGN),
                              GroupSpec(GroupKind.FULL, 4, ("b",))))
    _compare(data, layout, "last", eagle, 16, max_rows=60)
