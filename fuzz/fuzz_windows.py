#!/usr/bin/env python3
"""Atheris harness: hmacore.windows vs tests/oracle_core.py over random layouts.

Each input picks one entry point:
* clip_to_window: the oracle's kept positions; every kept id must be an int in [0,
  num_blocks) (clipped-away entries are not inspected, so junk there may pass).
* clip_windows: agrees with clip_to_window; groups left whole may come back as the very
  objects given (then only they are exempt from the id check).
* clip_state_blocks, trim_remote_to_local (with kernel ratios), expand_group (ratio,
  stride, limit, out buffers), expand_to_kernel, expand_layout_to_kernel, map_block_size:
  the oracle's answer or a clear refusal; int32 overflow is refused, never wrapped.
* clip_tracked / clip_tracked_spans: equal to clip_to_window of each tracked table.
"""
import sys

import atheris

with atheris.instrument_imports(include=["hmacore"]):
    import numpy as np
    from hmacore.tables import TrackerSet
    from hmacore.windows import (MAX_RATIO, clip_state_blocks, clip_to_window, clip_tracked,
                                 clip_tracked_spans, clip_windows, expand_group,
                                 expand_layout_to_kernel, expand_to_kernel, map_block_size,
                                 trim_remote_to_local, window_plan)

from fuzzlib import (CANONICAL, INT32_MAX, Draw, call, expect, group, ids_ok,  # noqa: E402
                     instrument_harness, is_int, layout, shrinks, table)
import oracle_core as oracle  # noqa: E402


def raw(obj, meaning):
    """The per-element view the library slices: a list's own elements, an array's values
    (None when the array is malformed)."""
    if isinstance(obj, (list, tuple)):
        return list(obj)
    if isinstance(obj, np.ndarray):
        return meaning
    return None


def adv_table(d: Draw, G: int, nb: int, max_len=20):
    """(table, per-group raw elements or None, right group count, canonical forms)."""
    n = G if not d.chance(7) else d.int(0, G + 1)
    forms = [group(d, nb, max_len) for _ in range(n)]
    t = tuple(f[0] for f in forms) if d.bool() else [f[0] for f in forms]
    return t, [raw(f[0], f[1]) for f in forms], n == G, all(f[2] in CANONICAL for f in forms)


def kept(raws, lay, exact, clip_state):
    """Per group the kept elements (oracle positions over the raw elements)."""
    pos = oracle.clip([list(range(len(r))) for r in raws], oracle.layout_to_dicts(lay), exact,
                      clip_state)
    return [[r[i] for i in p] for r, p in zip(raws, pos)]


def as_ints(x):
    return np.asarray(x).tolist() if isinstance(x, np.ndarray) else list(x)


def check_clip(d: Draw) -> None:
    lay = layout(d)
    G, nb = lay.num_groups, lay.num_blocks or 2**31
    exact, clip_state = d.bool(), d.bool()
    t, raws, right, canonical = adv_table(d, G, min(nb, 5000))
    shaky = shrinks(t)
    ok, got = call(clip_to_window, t, lay, exact=exact, clip_state=clip_state)
    ok_w, got_w = call(clip_windows, t, lay, exact=exact, clip_state=clip_state)
    if len(t) == 0:
        expect(ok and got == () and ok_w and got_w == (), "() is a full hit, returned as is")
        return
    if not right:
        expect(not ok and not ok_w, "wrong group count accepted")
        return
    if any(r is None for r in raws):      # a malformed array (float, 2-D...): refused
        expect(not ok, lambda: f"malformed group accepted: {t!r}")
        return
    want = kept(raws, lay, exact, clip_state)
    kept_valid = all(ids_ok(w, nb) for w in want)
    if ok:
        expect(kept_valid, lambda: f"kept invalid ids {want}")
        expect([as_ints(x) for x in got] == want, lambda: f"clip {t!r} -> {got!r}, want {want}")
        expect(all(x.dtype == np.int32 for x in got), "clip: not int32")
    else:
        expect(not (kept_valid and canonical), lambda: f"refused a valid table {t!r}: {got}")
    # clip_windows: clip_to_window's answer, except groups returned as given
    if shaky:
        return
    if ok:
        expect(ok_w, lambda: f"clip_windows refused what clip_to_window takes: {got_w}")
    if ok_w:
        plan = window_plan(lay, exact=exact, clip_state=clip_state)
        for g, (x, w) in enumerate(zip(got_w, want)):
            if x is t[g] and plan[g] == 0:
                continue        # left whole: returned as given, not inspected
            expect(len(x) == len(w) and as_ints(x) == w and ids_ok(w, nb),
                   lambda: f"clip_windows group {g}: {x!r}, want {w}")


def check_state_blocks(d: Draw) -> None:
    obj, meaning, form = group(d, 64)
    s = d.int(0, 3) if not d.chance(8) else d.pick((-1, True, 2.0, 2**70, np.int64(2)))
    rw = raw(obj, meaning)      # before the call: a ShrinkingInt empties its list
    ok, got = call(clip_state_blocks, obj, s)
    good_s = is_int(s) and s >= 0
    if not good_s or rw is None or (isinstance(obj, list) and len(obj) == 1
                                    and isinstance(obj[0], (list, tuple))):
        expect(not ok or (good_s and rw is not None), lambda: f"accepted s={s!r} -> {got}")
        return
    want = oracle.clip_state(rw, int(s))
    valid = ids_ok(want, 2**31)
    if ok:
        expect(valid and got.tolist() == want, lambda: f"clip_state_blocks -> {got}, want {want}")
    else:
        expect(not (valid and form in CANONICAL), lambda: f"refused {obj!r}: {got}")


RATIOS = (1, 2, 3, 4, 16, 34, 261)
BAD_RATIOS = (0, -1, True, 2.0, None, MAX_RATIO + 1, 2**31 - 1, 2**70)


def ratio_list(d: Draw, G: int):
    """None, an int, or one per group; sometimes malformed."""
    k = d.int(0, 7)
    if k < 3:
        return None, [1] * G
    if k == 3:
        r = d.int(1, 3)
        return r, [r] * G
    if k == 7:
        bad = d.pick((0, -1, True, 2.5, "2", [1] * (G + 1), (1,) * max(G - 1, 0)))
        return bad, None
    rs = [d.int(1, 3) for _ in range(G)]
    return (tuple(rs) if d.bool() else rs), rs


def check_trim(d: Draw) -> None:
    lay = layout(d)
    G, nb = lay.num_groups, lay.num_blocks or 2**31
    local, lmean, lcanon = table(d, G, min(nb, 5000), max_len=8)
    remote, rraws, right, rcanon = adv_table(d, G, min(nb, 5000), max_len=12)
    lr_arg, lr = ratio_list(d, G)
    rr_arg, rr = ratio_list(d, G)
    empty = isinstance(local, (list, tuple)) and len(local) == 0   # before: lists may shrink
    ok, got = call(trim_remote_to_local, local, remote, lay, local_kernel_ratios=lr_arg,
                   remote_kernel_ratios=rr_arg)
    if empty:
        expect(ok and got == ((), ()), "local () is a full hit")
        return
    local_ok = lmean is not None and all(ids_ok(m, nb) for m in lmean)
    if not (right and local_ok and lr and rr) or any(r is None for r in rraws):
        if ok:   # junk only outside the kept tail is fine; the kept part must be valid
            expect(local_ok and lr and rr, lambda: f"accepted bad local/ratios -> {got}")
            expect(all(ids_ok(as_ints(x), 2**31) for x in got[1]), "kept invalid remote ids")
        return
    try:
        want_l, want_r = oracle.trim(lmean, rraws, oracle.layout_to_dicts(lay), lr, rr)
    except oracle.OracleError:
        expect(not ok, lambda: f"oracle refuses, library returned {got}")
        return
    kept_valid = all(ids_ok(w, 2**31) for w in want_r)
    if ok:
        expect(kept_valid, lambda: f"kept invalid remote ids {want_r}")
        expect([as_ints(x) for x in got[0]] == want_l and [as_ints(x) for x in got[1]] == want_r,
               lambda: f"trim -> {got}, want {want_l} {want_r}")
        expect(all(len(a) == len(b) for a, b in zip(*got)), "trim: unequal lengths")
    else:
        expect(not (kept_valid and lcanon and rcanon), lambda: f"refused valid input: {got}")


def out_buffer(d: Draw, need: int):
    """(out, valid) for expand_group's ``out``."""
    k = d.int(0, 9)
    if k < 5:
        return None, True
    if k < 7:
        return np.full(need + d.int(0, 3), -7, np.int32), True
    bad = d.pick(("small", "int64", "strided", "readonly", "list", "2d", "swapped"))
    if bad == "small":
        return np.zeros(max(need - 1, 0), np.int32), need == 0
    if bad == "int64":
        return np.zeros(need, np.int64), False
    if bad == "strided":
        a = np.zeros(2 * need + 4, np.int32)[::2]     # >= 2 entries: not contiguous
        return a, False
    if bad == "readonly":
        a = np.zeros(need, np.int32)
        a.flags.writeable = False
        return a, False
    if bad == "2d":
        return np.zeros((need, 1), np.int32), False
    if bad == "swapped":
        return np.zeros(need, ">i4"), False
    return [0] * need, False


def check_expand(d: Draw) -> None:
    obj, meaning, form = group(d, 64, 15)
    if isinstance(obj, list) and len(obj) == 1 and isinstance(obj[0], (list, tuple)):
        return    # [[ids]] is a one-group table in the nested form, not junk
    if meaning is not None and d.chance(3):   # huge ids: the int32 overflow check must fire
        obj = list(meaning) + [d.pick((2**20, 2**28, 2**30, INT32_MAX))]
        meaning, form = obj, "list"
    ratio = d.pick(RATIOS) if not d.chance(8) else d.pick(BAD_RATIOS + (MAX_RATIO,))
    stride = None if d.bool() else (ratio if is_int(ratio) and d.bool() else
                                     d.pick(RATIOS + (2**31 - 1, 2**31, 2**63, 0, True)))
    limit = None if d.bool() else d.pick((0, 1, 5, 100, -1, True, 2.0, 2**70))
    good_ratio = is_int(ratio) and 1 <= ratio <= MAX_RATIO
    s = ratio if stride is None else stride
    good_stride = is_int(s) and 1 <= s <= INT32_MAX and (not good_ratio or ratio <= s)
    good_limit = limit is None or (is_int(limit) and limit >= 0)
    valid_ids = meaning is not None and ids_ok(meaning, 2**31)
    want = None
    if good_ratio and good_stride and valid_ids:
        try:
            want = oracle.expand(meaning, ratio, s)
        except oracle.OracleError:
            want = None      # int32 overflow
    total = len(want) if want is not None else 0
    if good_limit and limit is not None and want is not None:
        want = want[:limit]
        total = len(want)
    out, good_out = out_buffer(d, total)
    ok, got = call(expand_group, obj, ratio, stride=stride, limit=limit, out=out)
    if ok:
        expect(good_ratio and good_stride and good_limit and good_out and want is not None,
               lambda: f"expand_group accepted {obj!r} r={ratio!r} s={stride!r} "
                       f"limit={limit!r} out={out!r} -> {got!r}")
        expect(got.dtype == np.int32 and got.tolist() == want,
               lambda: f"expand_group -> {got.tolist()}, want {want}")
        if out is not None:
            expect(np.shares_memory(got, out) or got.size == 0, "result is not a view of out")
    else:
        expect(not (good_ratio and good_stride and good_limit and good_out and want is not None
                    and form in CANONICAL), lambda: f"expand_group refused valid input: {got}")


def check_expand_table(d: Draw) -> None:
    lay = layout(d, huge=False)
    G, nb = lay.num_groups, lay.num_blocks or 2**31
    t, meaning, canonical = table(d, G, min(nb, 5000), max_len=10)
    valid = meaning is not None and all(ids_ok(m, nb) for m in meaning)
    dicts = oracle.layout_to_dicts(lay)
    empty, shaky = isinstance(t, (list, tuple)) and len(t) == 0, shrinks(t)
    ok, got = call(expand_layout_to_kernel, t, lay)
    if empty:
        expect(ok and got == (), "() is a full hit")
    elif valid:
        try:
            want = [oracle.expand(x, 1 if g["kind"] == "mamba" else g["kr"])
                    for x, g in zip(meaning, dicts)]
        except oracle.OracleError:
            want = None      # int32 overflow
        if ok:
            expect(want is not None and [x.tolist() for x in got] == want,
                   lambda: f"expand_layout_to_kernel -> {got}, want {want}")
        else:
            expect(want is None or not canonical, lambda: f"refused valid input: {got}")
    else:
        expect(not ok, lambda: f"expand_layout_to_kernel accepted {t!r}")
    if shaky:
        return      # the call emptied a list: the calls below would see another table
    # map_block_size: attention groups -> ratio x smaller remote blocks, clipped to lengths
    ratio = d.pick((1, 2, 4, 8)) if not d.chance(10) else d.pick(BAD_RATIOS)
    lengths = d.int(0, 40) if d.bool() else [d.int(-2, 40) for _ in range(G + d.pick((0,) * 9 + (1,)))]
    lens = [lengths] * G if isinstance(lengths, int) else lengths
    ok, got = call(map_block_size, t, ratio, lengths, lay)
    good = is_int(ratio) and 1 <= ratio <= MAX_RATIO and len(lens) == G and min(lens) >= 0
    if not good:
        expect(not ok, lambda: f"map_block_size accepted ratio={ratio!r} lengths={lengths!r}")
        return
    if isinstance(t, (list, tuple)) and len(t) == 0:
        expect(ok and got == (), "() is a full hit")
        return
    if not valid:
        expect(not ok, lambda: f"map_block_size accepted {t!r}")
        return
    try:
        want = oracle.map_block_size(meaning, ratio, lens, dicts)
    except oracle.OracleError:
        expect(not ok, "int32 overflow not refused")
        return
    if ok:
        expect((got == () and want == []) or [x.tolist() for x in got] == want,
               lambda: f"map_block_size -> {got}, want {want}")
    else:
        expect(not canonical, lambda: f"map_block_size refused valid input: {got}")
    # expand_to_kernel with per-group ratios / strides
    rs = [d.pick((1, 2, 4, 16, 34)) for _ in range(G)]
    ss = [r + d.int(0, 300) for r in rs] if d.bool() else None
    ok, got = call(expand_to_kernel, t, tuple(rs), strides=None if ss is None else tuple(ss))
    try:
        want = [oracle.expand(x, r, s) for x, r, s in zip(meaning, rs, ss or rs)]
    except oracle.OracleError:
        expect(not ok, "expand_to_kernel: int32 overflow not refused")
        return
    if ok:
        expect([x.tolist() for x in got] == want, lambda: f"expand_to_kernel -> {got}, want {want}")
    else:
        expect(not canonical, lambda: f"expand_to_kernel refused valid input: {got}")


def check_tracked(d: Draw) -> None:
    lay = layout(d, num_blocks=(None, 64))
    G, nb = lay.num_groups, lay.num_blocks or 2**31
    ts = TrackerSet(lay)
    names = []
    for i in range(d.int(0, 4)):
        ts.add(f"r{i}", [[d.int(0, min(nb, 64) - 1) for _ in range(d.int(0, 12))]
                         for _ in range(G)])
        names.append(f"r{i}")
        if d.bool():
            ts.append(f"r{i}", [[d.int(1, min(nb, 64) - 1)] * d.int(0, 3) for _ in range(G)])
    req = [d.pick(names + ["nope", 5]) if names and not d.chance(8) else "nope"
           for _ in range(d.int(0, 4))]
    form = d.pick((list,) * 6 + (iter, tuple, lambda r: [[1]], lambda r: "ab"))
    listed = form(req)
    listed = list(listed) if not isinstance(listed, str) else ["a", "b"]
    exact, clip_state = d.bool(), d.bool()
    ok, got = call(clip_tracked, ts, form(req), exact=exact, clip_state=clip_state)
    ok2, spans = call(clip_tracked_spans, ts, form(req), exact=exact, clip_state=clip_state)
    known = all(isinstance(r, str) and r in names for r in listed)
    expect(ok == known and ok2 == known,
           lambda: f"clip_tracked ok={ok} spans ok={ok2} for {listed!r} ({got} / {spans})")
    if not ok:
        return
    plan = window_plan(lay, exact=exact, clip_state=clip_state)
    expect(spans.shape == (len(got), G, 2) and plan.shape == (G,), "spans: wrong shape")
    for r, views, sp in zip(listed, got, spans):
        want = clip_to_window(ts.block_ids(r), lay, exact=exact, clip_state=clip_state)
        full = ts.block_ids(r)
        for g in range(G):
            expect(views[g].tolist() == want[g].tolist() and not views[g].flags.writeable,
                   lambda: f"clip_tracked {r} group {g}: {views[g]} vs {want[g]}")
            a, b = sp[g]
            expect(full[g][a:b].tolist() == want[g].tolist(), "clip_tracked_spans disagrees")


def TestOneInput(data: bytes) -> None:
    d = Draw(data)
    [check_clip, check_clip, check_clip, check_state_blocks, check_trim, check_trim,
     check_expand, check_expand_table, check_tracked][d.int(0, 8)](d)


if __name__ == "__main__":
    instrument_harness(globals())
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()
