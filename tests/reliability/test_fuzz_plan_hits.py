"""Fuzz TransferPlan.desc_ids / from_kv_caches, ExistenceSet, HitFinder.longest_hit,
KeyBuilder and the EmbeddedStore protocol with adversarial inputs: the oracle's answer or a
clear error, and no state change on a failed call."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest
from hypothesis import event, given, strategies as st

from hmacore.errors import BlockTableError, HashInputError
from hmacore.hits import ExistenceSet, HitFinder
from hmacore.keys import KeyBuilder, RankNamespace
from hmacore.demo.paged_memory import allocate_paged_kv
from hmacore.plan import TransferPlan
from hmacore.presets import get_preset
from hmacore.transport.store import (NOT_FOUND, OK, EmbeddedStore, GroupSegments, load_blocks,
                                     lookup_hit, save_blocks, save_state)
from oracle_hits import OracleFinder
from oracle_plan import oracle_desc_ids
from rel_common import FUZZ, _is_int, call, group_form
from test_plan_props import plans

pytestmark = pytest.mark.reliability


# -- TransferPlan ----------------------------------------------------------------------------
@FUZZ
@given(data=st.data(), pg=plans())
def test_desc_ids_adversarial(data, pg):
    plan, gstate = pg
    G = plan.layout.num_groups
    logical = plan.regions[0].logical_blocks
    n = G if data.draw(st.integers(0, 6)) else data.draw(st.integers(0, G + 1))
    forms = [data.draw(group_form(logical + 2, max_size=8)) for _ in range(n)]
    table = [f[0] for f in forms]
    ok, got = call(plan.desc_ids, table)
    ok2, cnt = call(plan.count_desc_ids, table)
    event(f"desc_ids ok={ok}")
    served = [any(bool(r.state) == gstate[g] and r.group in (-1, g) for r in plan.regions)
              for g in range(G)]
    if n != G:
        assert not ok and not ok2
        return
    meanings = [f[1] for f in forms]
    valid = all(m is not None and all(isinstance(v, (int, np.integer)) and
                                      not isinstance(v, bool) and
                                      1 <= v < logical
                                      for v in m) and (served[g] or not m)
                for g, m in enumerate(meanings))
    if ok:
        # a junk element (bool, float, None, str, nested list...) never passes as a block id
        assert all(m is not None for m in meanings), f"junk accepted as block ids: {table!r}"
        want = oracle_desc_ids([(r.logical_blocks, r.ratio, r.group, r.state) for r in plan.regions],
                               gstate, meanings, group_major=plan.group_major)
        assert got.tolist() == want and (not ok2 or cnt == len(want))
        for g, m in enumerate(meanings):   # null and out-of-range ids of served groups never pass
            assert not served[g] or all(1 <= v < logical for v in m)
    else:
        canonical = all(f[2] and (not isinstance(f[0], np.ndarray) or f[0].flags.c_contiguous)
                        for f in forms)
        assert not (valid and canonical), f"refused a valid table: {got}"
        f0 = forms[0][0] if forms else None    # group 0 is converted first: a bool in it is named
        if isinstance(f0, list) and any(isinstance(v, bool) for v in f0):
            first = next(i for i, v in enumerate(f0) if isinstance(v, bool))
            if all(_is_int(v) and 0 <= v < 2**31 for v in f0[:first]):
                assert f"block_ids[0][{first}]" in str(got) and "bool" in str(got), str(got)
                event("bool named")


@FUZZ
@given(data=st.data())
def test_from_kv_caches_adversarial(data):
    layout = get_preset(data.draw(st.sampled_from(["gpt-oss", "qwen3-next", "deepseek-v4"])))
    nb = 8
    paged = allocate_paged_kv(layout, nb, page_bytes=64 if layout.num_groups < 5 else None)
    caches = dict(paged.kv_caches)
    fault = data.draw(st.sampled_from(["none", "drop", "extra", "nb", "noncontig", "dtype",
                                       "short", "list"]))
    name = data.draw(st.sampled_from(sorted(caches)))
    num_blocks = nb
    if fault == "drop":
        del caches[name]
    elif fault == "extra":
        caches["not.a.layer"] = np.zeros((nb, 8), np.uint8)
    elif fault == "nb":
        num_blocks = data.draw(st.sampled_from([0, 1, -5, True, 2**40, nb + 1, 3.0]))
    elif fault == "noncontig" and isinstance(caches[name], np.ndarray):
        caches[name] = np.zeros((nb, 128), np.uint8)[:, ::2]
    elif fault == "dtype":
        caches[name] = "bogus"
    elif fault == "short" and isinstance(caches[name], np.ndarray):
        caches[name] = caches[name][: nb // 2]
    elif fault == "list":
        caches[name] = [1, 2, 3]
    ok, plan = call(TransferPlan.from_kv_caches, layout, caches, num_blocks=num_blocks)
    event(f"{fault}: ok={ok}")
    if fault in ("drop", "extra", "dtype", "list") or (fault == "nb" and num_blocks != nb + 1):
        assert not ok, f"fault {fault} accepted"
    if ok:   # every region lies inside memory the caller owns
        lo = min(s.ctypes.data for s in paged.storages)
        hi = max(s.ctypes.data + s.nbytes for s in paged.storages)
        for r in plan.regions:
            a, b = r.span
            assert lo <= a and b <= hi or fault == "noncontig", (r, lo, hi)


# -- ExistenceSet vs a Python set ----------------------------------------------------------
def _digests(data, ds, n):
    rows = data.draw(st.lists(st.binary(min_size=ds, max_size=ds), min_size=n, max_size=n))
    return np.frombuffer(b"".join(rows), np.uint8).reshape(n, ds).copy() if n else \
        np.zeros((0, ds), np.uint8)


def _maybe_bad(data, arr, ds):
    kind = data.draw(st.sampled_from(["ok", "ok", "ok", "readonly", "noncontig", "dtype",
                                      "width", "1d", "list"]))
    if kind == "readonly":
        a = arr.copy()
        a.flags.writeable = False
        return a, True
    if kind == "noncontig":
        b = np.zeros((arr.shape[0] * 2, ds), np.uint8)
        b[::2] = arr
        return b[::2], None     # may be accepted (same rows) or refused with a clear error
    if kind == "dtype":
        return arr.astype(np.int16), False
    if kind == "width":
        return np.zeros((arr.shape[0], ds + 1), np.uint8), False
    if kind == "1d":
        return arr.reshape(-1), arr.shape[0] == 0 and None
    if kind == "list":
        return [bytes(r) for r in arr], None
    return arr, True


GROUPS = st.one_of(st.integers(0, 3), st.sampled_from([-1, 2**31, 2**31 - 1, True, 1.5, None, "0"]))


def _good_group(g):
    return isinstance(g, int) and not isinstance(g, bool) and 0 <= g <= 2**31 - 1


@FUZZ
@given(data=st.data(), ds=st.sampled_from([16, 32]))
def test_existence_set_vs_python_set(data, ds):
    es = ExistenceSet(ds, capacity=data.draw(st.integers(0, 8)))
    model = set()
    for _ in range(data.draw(st.integers(1, 12))):
        op = data.draw(st.sampled_from(["add", "discard", "add_many", "discard_many",
                                        "contains_many", "leading_run", "clear", "contains"]))
        g = data.draw(GROUPS)
        n = data.draw(st.integers(0, 6))
        arr = _digests(data, ds, n)
        if n and data.draw(st.booleans()) and model:   # revisit known keys
            arr[0] = np.frombuffer(sorted(model, key=repr)[0][1], np.uint8)
        before, size = set(model), len(es)
        if op in ("add", "discard", "contains"):
            d = bytes(arr[0]) if n else data.draw(st.sampled_from([b"", b"x" * (ds + 1), "str", 7]))
            ok, r = call(getattr(es, op), g, d)
            good = _good_group(g) and isinstance(d, bytes) and len(d) == ds
            assert ok == good or (not good and not ok), (op, g, d, r)
            if ok:
                key = (g, d)
                if op == "add":
                    assert r == (key not in model)
                    model.add(key)
                elif op == "discard":
                    assert r == (key in model)
                    model.discard(key)
                else:
                    assert r == (key in model)
        elif op == "clear":
            ok = True
            es.clear()
            model.clear()
        else:
            a, good = _maybe_bad(data, arr, ds)
            ok, r = call(getattr(es, op), g, a)
            if not _good_group(g) or good is False:
                assert not ok, (op, g, r)
            elif good is True:
                assert ok, r
            if ok:
                rows = [bytes(x) for x in np.asarray(arr)]
                if op == "add_many":
                    new = {(g, x) for x in rows} - model
                    assert r == len(new)
                    model |= new
                elif op == "discard_many":
                    gone = {(g, x) for x in rows} & model
                    assert r == len(gone)
                    model -= gone
                elif op == "contains_many":
                    assert r.tolist() == [int((g, x) in model) for x in rows]
                else:
                    k = 0
                    while k < len(rows) and (g, rows[k]) in model:
                        k += 1
                    assert r == k
        if not ok:
            assert model == before and len(es) == size, "failed call changed the set"
        assert len(es) == len(model)
    for g, d in model:
        assert es.contains(g, d)


# -- HitFinder.longest_hit -----------------------------------------------------------------
@FUZZ
@given(data=st.data(), preset=st.sampled_from(["gpt-oss-120b", "qwen3-next-80b", "llama-3-70b"]))
def test_longest_hit_adversarial(data, preset):
    layout = get_preset(preset)
    finder = HitFinder(layout)
    oracle = OracleFinder(layout)
    ds = 32
    n = data.draw(st.integers(0, 40))
    hashes = _digests(data, ds, n)
    es = ExistenceSet(ds)
    py = set()
    for g in finder.group_ids:
        k = finder.block_sizes[g] // finder.hash_block_size
        for i in range(data.draw(st.integers(0, n // k))):
            d = bytes(hashes[(i + 1) * k - 1])
            es.add(g, d)
            py.add((g, d))
    h, good = _maybe_bad(data, hashes, ds)
    max_length = data.draw(st.one_of(st.integers(0, n * finder.hash_block_size + 50),
                                     st.sampled_from([-1, 2**63 - 1, 2**64, True, 3.5, None])))
    good_len = isinstance(max_length, int) and not isinstance(max_length, bool) and \
        0 <= max_length < 2**63
    ok, got = call(finder.longest_hit, h, es, max_length)
    event(f"longest_hit ok={ok}")
    if not good_len or good is False:
        assert not ok, got
        return
    if good is True:
        assert ok, got
    if ok:
        want_tokens, want_masks = oracle.longest_hit([bytes(r) for r in hashes], py, max_length)
        assert got.tokens == want_tokens
        assert [m.tolist() for m in got.masks] == [[int(b) for b in m] for m in want_masks]
    assert len(es) == len(py)   # lookups never change the set


# -- KeyBuilder ------------------------------------------------------------------------------
@FUZZ
@given(data=st.data())
def test_key_builder_adversarial(data):
    model = data.draw(st.sampled_from(["m", "dsv4", "", "a@b", 7]))
    rank = RankNamespace(tp_rank=data.draw(st.integers(0, 3)))
    ok, kb = call(KeyBuilder, model, rank)
    if not (isinstance(model, str) and model and "@" not in model):
        assert not ok
        return
    assert ok
    g = data.draw(GROUPS)
    width = data.draw(st.sampled_from([16, 32, 0, 8, 17]))
    n = data.draw(st.integers(0, 5))
    d = np.frombuffer(data.draw(st.binary(min_size=n * width, max_size=n * width)),
                      np.uint8).reshape(n, width) if width else np.zeros((n, 0), np.uint8)
    ok, keys = call(kb.keys, g, d)
    # the ids ExistenceSet takes
    good_g = isinstance(g, int) and not isinstance(g, bool) and 0 <= g <= 2**31 - 1
    if not good_g or width not in (16, 32):
        assert not ok
        return
    assert ok and len(keys) == n
    for k, row in zip(keys, d):   # the oracle: the documented key layout
        assert k == (f"{model}@tp_rank:{rank.tp_rank}@pcp{rank.pcp_rank}@dcp{rank.dcp_rank}"
                     f"@pp_rank:{rank.pp_rank}@group:{g}@" + bytes(row).hex())
    assert len(set(keys)) == len({bytes(r) for r in d})


# -- EmbeddedStore protocol vs a dict ------------------------------------------------------
@FUZZ
@given(data=st.data())
def test_embedded_store_protocol_vs_dict(data):
    cap = data.draw(st.integers(64, 2048))
    store = EmbeddedStore(cap)
    buf = np.zeros(4096, np.uint8)
    out = np.zeros(4096, np.uint8)
    base, obase = buf.ctypes.data, out.ctypes.data
    store.register(base, buf.nbytes)
    store.register(obase, out.nbytes)
    model: dict[str, bytes] = {}
    for step in range(data.draw(st.integers(1, 10))):
        keys = data.draw(st.lists(st.sampled_from(["a", "b", "c", "d", "", 5]), max_size=4))
        op = data.draw(st.sampled_from(["put", "get", "exists", "remove"]))
        good_keys = all(isinstance(k, str) and k for k in keys)
        sizes = [data.draw(st.integers(0, 300)) for _ in keys]
        wild = data.draw(st.integers(0, 9)) == 0       # outside registered memory / bad addr
        parts = []
        off = 0
        for s in sizes:
            buf[off:off + s] = data.draw(st.integers(0, 255))
            a = (obase if op == "get" else base) + off
            parts.append([(a, s)])
            off += s
        if wild and parts:
            parts[0] = [(data.draw(st.sampled_from([0, -8, 8, base + 10**9])), 4)]
        if op == "put":
            ok, r = call(store.batch_put, keys, parts)
        elif op == "get":
            ok, r = call(store.batch_get, keys, parts)
        elif op == "exists":
            ok, r = call(store.batch_exists, keys)
        else:
            ok, r = call(store.batch_remove, keys)
        if not good_keys:
            assert not ok
        if not ok:
            assert store.used_bytes == sum(len(v) for v in store._data.values())
            continue
        assert len(r) == len(keys)
        if op == "put":
            for k, p, c in zip(keys, parts, r):
                if c == OK:
                    model.pop(k, None)
                    model[k] = b"".join(ctypes.string_at(a, s) for a, s in p)
                else:
                    assert c < 0
            # LRU eviction may drop old keys: the store holds a subset of the model, and
            # every key it holds has exactly the model's bytes
            model = {k: v for k, v in model.items() if store.batch_exists([k]) == [1]}
        elif op == "get":
            for k, p, c in zip(keys, parts, r):
                if k in model and c >= 0:
                    assert c == len(model[k])
                    got = b"".join(ctypes.string_at(a, s) for a, s in p)
                    assert got == model[k]
                elif k not in model:
                    assert c == NOT_FOUND
        elif op == "exists":
            assert r == [int(k in model) for k in keys]
        else:
            for k, c in zip(keys, r):
                assert (c == OK) == (k in model)   # duplicates: only the first removes
                model.pop(k, None)
        assert store.used_bytes <= cap
        assert store.used_bytes == sum(len(v) for v in model.values())


# -- GroupSegments.parts / save_blocks: the store path's block ids ---------------------------
@FUZZ
@given(data=st.data())
def test_group_segments_parts_adversarial(data):
    """``GroupSegments.parts`` answers the address rule for ids in [1, num_blocks) or refuses
    with a clear error; bools, floats, None, ids past the pool never become addresses."""
    nb = data.draw(st.integers(2, 40))
    bb = data.draw(st.lists(st.integers(1, 64), min_size=1, max_size=3))
    bases = tuple(4096 * (i + 1) * 1000 for i in range(len(bb)))
    seg = GroupSegments(bases, tuple(bb), nb)
    obj, meaning, canonical = data.draw(group_form(nb + 2, max_size=8))
    ok, got = call(seg.parts, obj)
    valid = meaning is not None and all(_is_int(v) and 1 <= v < nb for v in meaning)
    event(f"parts ok={ok}")
    if ok:
        assert meaning is not None and valid, f"accepted {obj!r}"
        assert got == [[(b + v * s, s) for b, s in zip(bases, bb)] for v in meaning]
    else:
        assert not (valid and canonical), f"refused valid ids {obj!r}: {got}"
        if isinstance(obj, list) and any(isinstance(v, bool) for v in obj):
            first = next(i for i, v in enumerate(obj) if isinstance(v, bool))
            if all(_is_int(v) and 1 <= v < nb for v in obj[:first]):   # the bool is the first fault
                assert f"index {first}" in str(got) and "integers" in str(got), str(got)
                event("bool named")


def test_save_and_load_refuse_bool_block_ids():
    """A bool in a save/load table is the caller's error (named), never block 1, and the
    store is not touched."""
    layout = get_preset("gpt-oss", num_blocks=64)
    finder = HitFinder(layout)
    keys = KeyBuilder("m")
    arrays = [[np.zeros((64, 8 * s.block_size), np.uint8)] for s in layout.groups]
    segs = [GroupSegments.from_arrays(a) for a in arrays]
    store = EmbeddedStore(1 << 20)
    for a in arrays:
        store.register(a[0].ctypes.data, a[0].nbytes)
    T = 3 * finder.scheduler_block_size
    hashes = np.ascontiguousarray(np.random.default_rng(0).integers(
        0, 256, (T // finder.hash_block_size, 32), dtype=np.uint8))
    good = [list(range(1 + 10 * g, 1 + 10 * g + -(-T // bs))) for g, bs in enumerate(finder.block_sizes)]
    for bad_value in (True, 1.0, None):
        bad = [list(t) for t in good]
        bad[1][1] = bad_value
        with pytest.raises((BlockTableError, HashInputError), match=r"block_ids\[1\]"):
            save_blocks(finder, keys, store, hashes, T, bad, segs)
        assert len(store) == 0
    assert save_blocks(finder, keys, store, hashes, T, good, segs).written > 0
    hit = lookup_hit(finder, keys, store, hashes, T + 1)
    assert hit.tokens == T
    bad = [list(t) for t in good]
    bad[0][0] = False
    with pytest.raises(BlockTableError, match=r"block_ids\[0\]"):
        load_blocks(finder, keys, store, hashes, hit, bad, segs)
    with pytest.raises(BlockTableError, match="block_id must be an int"):
        save_state(finder, keys, store, hashes, T, 0, True, segs[0])
