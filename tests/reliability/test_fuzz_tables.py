"""Fuzz hmacore.tables' table entry points (as_block_table, from_wire, fill_blocks,
count_hashed) with adversarial inputs: every call returns the oracle's answer or raises a
clear error; inputs are never modified."""
from __future__ import annotations

import copy

import numpy as np
import pytest
from hypothesis import event, given, strategies as st

from hmacore.tables import as_block_table, count_hashed, fill_blocks, from_wire
from oracle_core import count_hashed as o_count, fill_blocks as o_fill
from rel_common import FUZZ, INT32_MAX, call, group_form, meaning_ok

pytestmark = pytest.mark.reliability


@st.composite
def tables(draw, nb, adversarial=True, mismatched_counts=True):
    """``mismatched_counts=False`` for entry points with no group-count argument (fill_blocks,
    count_hashed take the table's own length), where a count "mismatch" is just another G."""
    G = draw(st.integers(1, 5))
    n = G if (not mismatched_counts or draw(st.integers(0, 4))) else draw(st.integers(0, G + 2))
    groups = [draw(group_form(nb, adversarial=adversarial)) for _ in range(n)]
    outer = draw(st.sampled_from(["list", "tuple", "tuple", "2d", "dict"])) if adversarial else "tuple"
    objs = [g[0] for g in groups]
    if outer == "2d":
        return G, np.zeros((n, 3), dtype=np.int32), None, False
    if outer == "dict":
        return G, dict(enumerate(objs)), None, False
    table = list(objs) if outer == "list" else tuple(objs)
    if n != G and not (G == 1 and n == 0):
        return G, table, None, False
    if G == 1 and n == 0:
        return G, table, [[]], True
    return G, table, [g[1] for g in groups], all(g[2] for g in groups)


def _frozen(x):
    return copy.deepcopy(x) if not isinstance(x, np.ndarray) else x.copy()


@FUZZ
@given(data=st.data(), nb=st.one_of(st.none(), st.integers(1, 50), st.just(INT32_MAX)))
def test_as_block_table_answer_or_clear_error(data, nb):
    G, table, meaning, canonical = data.draw(tables(nb or 60))
    hi = nb if nb is not None else 2**31
    want_ok = meaning is not None and all(meaning_ok(m, hi) for m in meaning)
    before = [(_frozen(g) if isinstance(g, np.ndarray) else None) for g in
              (table if isinstance(table, (list, tuple)) else [])]
    ok, got = call(as_block_table, table, G, num_blocks=nb)
    event(f"ok={ok} expected={want_ok}")
    if ok:
        assert want_ok, f"accepted an invalid table {table!r} -> {got!r}"
        assert len(got) == G
        for a, m in zip(got, meaning):
            assert a.dtype == np.int32 and a.ndim == 1 and a.flags.c_contiguous
            assert a.tolist() == m
    else:
        assert not (want_ok and canonical), f"refused a valid table {table!r}: {got}"
    for g, b in zip(table if isinstance(table, (list, tuple)) else [], before):
        if b is not None and g.dtype != object:
            assert np.array_equal(g, b), "input array modified"
    # the wire form goes through the same rules
    ok2, got2 = call(from_wire, table, G, num_blocks=nb)
    assert ok2 == ok


@FUZZ
@given(data=st.data())
def test_bad_num_groups_and_num_blocks(data):
    G = data.draw(st.one_of(st.integers(-3, 0), st.sampled_from([True, 1.0, "2", None, 2**70])))
    ok, _ = call(as_block_table, [[1]], G)
    assert not ok or (isinstance(G, int) and not isinstance(G, bool) and G == 1)
    nb = data.draw(st.one_of(st.integers(-3, 0), st.sampled_from([True, 3.0, "9", 2**31, 2**64])))
    ok, _ = call(as_block_table, [[0]], 1, num_blocks=nb)
    assert not ok


@st.composite
def masks_for(draw, meaning):
    """(masks, meaning_of_masks or None): per group a mask of the group's length in some
    dtype; sometimes wrong length / values / group count."""
    out, mean = [], []
    for m in meaning:
        n = len(m)
        if draw(st.integers(0, 9)) == 0:
            n = n + draw(st.sampled_from([-1, 1, 5])) if n else 1
            mean = None
        bits = draw(st.lists(st.booleans(), min_size=max(n, 0), max_size=max(n, 0)))
        kind = draw(st.sampled_from(["bool", "u8", "i64", "list", "bad"]))
        if kind == "bool":
            out.append(np.array(bits, dtype=np.bool_))
        elif kind == "u8":
            out.append(np.array(bits, dtype=np.uint8))
        elif kind == "i64":
            out.append(np.array(bits, dtype=np.int64))
        elif kind == "list":
            out.append([int(b) for b in bits])
        else:
            out.append(np.array([2] * n, dtype=np.int64) if n else np.zeros(0, np.float64))
            if n and mean is not None:
                mean = None
        if mean is not None:
            mean.append(bits)
    if draw(st.integers(0, 14)) == 0:
        out.append(np.zeros(0, np.uint8))
        mean = None
    return out, mean


@FUZZ
@given(data=st.data())
def test_fill_blocks_and_count_hashed_vs_oracle(data):
    nb = 40
    G, table, meaning, canonical = data.draw(tables(nb, mismatched_counts=False))
    valid = meaning is not None and all(meaning_ok(m, 2**31) for m in meaning)
    masks, mmean = data.draw(masks_for([m if m is not None else [] for m in meaning]
                                       if meaning is not None else [[]] * G))
    ok, got = call(fill_blocks, table, masks)
    ok2, got2 = call(count_hashed, table, masks)
    assert ok == ok2
    if ok:
        assert valid and mmean is not None, f"accepted invalid input {table!r} / {masks!r}"
        assert [x.tolist() for x in got] == o_fill(meaning, mmean)
        assert list(got2) == o_count(meaning, mmean)
        assert all(x.dtype == np.int32 for x in got)
    elif valid and canonical and mmean is not None and len(meaning) == G and len(table):
        # a single-group table given as one group is a legal 1-group table
        raise AssertionError(f"refused valid input {table!r} / {masks!r}: {got}")
