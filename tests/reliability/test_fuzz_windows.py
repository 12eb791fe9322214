"""Fuzz hmacore.windows with adversarial tables: clip/trim/expand/map return the oracle's
answer or raise a clear error (ids are validated on the part that is kept)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, event, given, strategies as st

from hmacore.windows import (MAX_RATIO, clip_to_window, expand_group, expand_layout_to_kernel,
                             map_block_size, trim_remote_to_local)
import oracle_core as oracle
from rel_common import EDGE_INTS, FUZZ, call, group_form
from test_windows_props import NB, layouts

pytestmark = pytest.mark.reliability


def _valid(v, hi=NB):
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)) and 0 <= v < hi


def _raw(obj, meaning):
    """The per-element view the library slices (lists: the elements themselves)."""
    if isinstance(obj, (list, tuple)):
        return list(obj)
    return meaning   # arrays: None when the dtype / shape is malformed


@st.composite
def adv_table(draw, G):
    n = G if draw(st.integers(0, 6)) else draw(st.integers(0, G + 1))
    forms = [draw(group_form(NB, max_size=20)) for _ in range(n)]
    return tuple(f[0] for f in forms), [_raw(f[0], f[1]) for f in forms], n == G


@FUZZ
@given(data=st.data(), layout=layouts, exact=st.booleans(), clip_state=st.booleans())
def test_clip_to_window_adversarial(data, layout, exact, clip_state):
    G = layout.num_groups
    table, raw, right_count = data.draw(adv_table(G))
    ok, got = call(clip_to_window, table, layout, exact=exact, clip_state=clip_state)
    event(f"clip ok={ok}")
    if len(table) == 0:
        assert ok and got == ()
        return
    if not right_count and not (G == 1 and len(table) == 0):
        assert not ok, "wrong group count accepted"
        return
    if any(r is None for r in raw):
        assert not ok or all(isinstance(t, (list, tuple)) for t in table)
        if not ok:
            return
    want = oracle.clip(raw, oracle.layout_to_dicts(layout), exact, clip_state)
    kept_valid = all(_valid(v) for g in want for v in g)
    if ok:
        assert kept_valid, f"kept invalid ids {want}"
        assert [x.tolist() for x in got] == [list(map(int, g)) for g in want]
        assert all(x.dtype == np.int32 for x in got)
    else:
        canonical = all(isinstance(t, (list, tuple)) or
                        (isinstance(t, np.ndarray) and t.dtype.kind in "iu" and t.ndim == 1)
                        for t in table)
        assert not (kept_valid and canonical and all(r is not None for r in raw)), \
            f"refused a valid table: {got}"


@FUZZ
@given(data=st.data(), layout=layouts)
def test_trim_remote_to_local_adversarial(data, layout):
    G = layout.num_groups
    local = [data.draw(st.lists(st.integers(1, NB - 1), max_size=10)) for _ in range(G)]
    remote, raw, right_count = data.draw(adv_table(G))
    ok, got = call(trim_remote_to_local, local, remote, layout)
    event(f"trim ok={ok}")
    if not right_count or any(r is None for r in raw):
        if ok:   # junk only outside the kept tail is fine; the kept part must be valid
            assert all(_valid(int(v), 2**31) for g in got[1] for v in g)
        return
    try:
        want_l, want_r = oracle.trim(local, raw, oracle.layout_to_dicts(layout))
    except oracle.OracleError:
        assert not ok, f"oracle refuses, library returned {got}"
        return
    kept_valid = all(_valid(v, 2**31) for g in want_r for v in g)
    if ok:
        assert kept_valid
        assert [x.tolist() for x in got[0]] == want_l
        assert [x.tolist() for x in got[1]] == [list(map(int, g)) for g in want_r]
    else:
        assert not kept_valid or not all(
            isinstance(t, (list, tuple)) or t.dtype.kind in "iu" for t in remote), got


# Ratios above windows.MAX_RATIO (2**16) are refused (a huge ratio used to allocate gigabytes);
# 2**16 itself is valid, 2**20 and 2**31 - 1 must be refused. Strides go huge.
ratios = st.one_of(st.integers(1, 8),
                   st.sampled_from([0, -1, True, 2.0, None, 2**16, 2**20, 2**31 - 1]))
strides = st.one_of(st.none(), ratios, st.sampled_from([2**31, 2**40, 2**63]))


@FUZZ
@given(data=st.data(), ratio=ratios, stride=strides)
def test_expand_group_adversarial(data, ratio, stride):
    obj, meaning, canonical = data.draw(group_form(NB, max_size=15))
    # [[ids]] is a one-group table in the nested form (as_block_table's single-group rule),
    # not junk: a junk list drawn at position 0 of an empty group is valid input here
    assume(not (isinstance(obj, (list, tuple)) and len(obj) == 1
                and isinstance(obj[0], (list, tuple, np.ndarray))))
    if meaning is not None and data.draw(st.booleans()):
        # huge ids: the int32 overflow check must fire, never wrap
        obj = list(meaning) + [data.draw(st.sampled_from([2**28, 2**30, 2**31 - 1]))]
        meaning, canonical = obj, True
    ok, got = call(expand_group, obj, ratio, stride=stride)
    good_ratio = isinstance(ratio, int) and not isinstance(ratio, bool) and 1 <= ratio <= MAX_RATIO
    s = ratio if stride is None else stride
    good_stride = isinstance(s, int) and not isinstance(s, bool) and 1 <= s < 2**31 and (
        not good_ratio or ratio <= s)
    valid_ids = meaning is not None and all(_valid(v, 2**31) for v in meaning)
    if not (good_ratio and good_stride and valid_ids):
        assert not ok or (meaning is not None and valid_ids), f"accepted bad input -> {got}"
        if not ok:
            return
    try:
        want = oracle.expand(meaning, ratio, s)
    except oracle.OracleError:
        assert not ok, "int32 overflow not caught"
        return
    if ok:
        assert got.dtype == np.int32 and got.tolist() == want
    else:
        assert not canonical, f"refused valid input: {got}"


@FUZZ
@given(data=st.data(), layout=layouts, ratio=st.integers(1, 4))
def test_map_block_size_and_kernel_expansion(data, layout, ratio):
    G = layout.num_groups
    table = [data.draw(st.lists(st.one_of(st.integers(0, NB - 1), st.sampled_from(EDGE_INTS)),
                                max_size=8)) for _ in range(G)]
    lengths = data.draw(st.one_of(st.integers(0, 40), st.lists(st.integers(-2, 40), min_size=G,
                                                               max_size=G)))
    valid = all(_valid(v) for g in table for v in g)
    ok, got = call(map_block_size, table, ratio, lengths, layout)
    lens = [lengths] * G if isinstance(lengths, int) else lengths
    if not valid or min(lens) < 0:
        assert not ok
    else:
        try:
            want = oracle.map_block_size(table, ratio, lens, oracle.layout_to_dicts(layout))
        except oracle.OracleError:
            assert not ok
        else:
            assert ok, got
            assert (got == () and want == []) or [x.tolist() for x in got] == want
    ok, got = call(expand_layout_to_kernel, table, layout)
    if not valid:
        assert not ok
    elif ok:
        d = oracle.layout_to_dicts(layout)
        assert [x.tolist() for x in got] == [oracle.expand(t, 1 if g["kind"] == "mamba" else g["kr"])
                                             for t, g in zip(table, d)]
