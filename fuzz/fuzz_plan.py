#!/usr/bin/env python3
"""Atheris harness: hmacore.plan (descriptor ids, bytes, pairing, plan construction).

Each input builds a plan (random regions like tests/test_plan_props.py, or
TransferPlan.from_layout of a random layout) and checks one entry point:
* desc_ids / count_desc_ids vs tests/oracle_plan.py, logical and kernel ids, allow_null,
  caller ``out`` buffers (good ones: written in place, the tail untouched; bad ones: refused).
  The id rule: an id must lie in every serving region's range ([1, logical), kernel ids
  [ratio, logical*ratio); 0 / below the ratio only with allow_null); ids of a group no
  region serves are refused.
* desc_bytes (ids in [0, num_descs)), table_bytes (block counts per group).
* DescPlan.pair_ids32 (the NIXL fast path): None, or exactly both sides' desc ids (int32),
  a copy of the local table and the bytes.
* from_region_table with hostile handshake dicts, from_layout / with_block_size_ratio with
  hostile arguments: a plan or a clear LayoutError, and a plan rebuilt from its own region
  table has the same shape.
"""
import sys

import atheris

with atheris.instrument_imports(include=["hmacore"]):
    import numpy as np
    from hmacore.plan import Region, TransferPlan
    from hmacore.spec import GroupKind, GroupSpec, KVLayout

from fuzzlib import (Draw, call, expect, group, ids_ok, instrument_harness,  # noqa: E402
                     is_int, layout, shrinks)
from oracle_plan import oracle_desc_ids  # noqa: E402

KINDS = (GroupKind.FULL, GroupKind.SLIDING_WINDOW, GroupKind.CHUNKED_LOCAL, GroupKind.MAMBA)
ACCEPTED = ("list", "tuple", "array", "readonly")   # desc_ids must take these when valid


def region_plan(d: Draw):
    """A plan from random regions (shared / owned, attention then state)."""
    kinds = [d.pick(KINDS) for _ in range(d.int(1, 5))]
    specs = []
    for g, k in enumerate(kinds):
        kw = {"sliding_window": 32} if k == GroupKind.SLIDING_WINDOW else \
            {"chunk_size": 64} if k == GroupKind.CHUNKED_LOCAL else {}
        specs.append(GroupSpec(k, 16, (f"g{g}",), **kw))
    lay = KVLayout(groups=tuple(specs))
    gstate = [k == GroupKind.MAMBA for k in kinds]
    n_attn, n_state = d.int(0, 5), d.int(0, 4)
    logical = d.int(2, 60)
    regions = []
    for i in range(n_attn + n_state):
        state = i >= n_attn
        owners = [-1] + [g for g in range(len(kinds)) if gstate[g] == state]
        regions.append(Region(i * 10**6, 64, 64, logical, 1 if state else d.pick((1, 2, 4, 16)),
                              d.pick(owners), state, (f"r{i}",)))
    if not regions:
        regions.append(Region(0, 64, 64, logical, 1, -1, False, ("r0",)))
    return TransferPlan(lay, regions)


def make_plan(d: Draw):
    if d.int(0, 2):
        return region_plan(d)
    lay = layout(d, num_blocks=(None,), huge=False)
    ok, plan = call(TransferPlan.from_layout, lay, d.int(2, 40), kv_split=d.bool(),
                    state_parts=d.int(1, 3))
    return plan if ok else region_plan(d)


def served(plan, g):
    gstate = plan.layout.groups[g].kind == GroupKind.MAMBA
    return [r for r in plan.regions if bool(r.state) == gstate and r.group in (-1, g)]


def id_range(plan, g, kernel_ids, allow_null):
    """[lo, hi) valid in every region serving g (None: no region serves g)."""
    regs = served(plan, g)
    if not regs:
        return None
    lo, hi = 0, 2**63
    for r in regs:
        rr = r.ratio if kernel_ids and not r.state else 1
        lo = max(lo, 0 if allow_null else rr)
        hi = min(hi, r.logical_blocks * rr)
    return lo, hi


def out_buffer(d: Draw, need: int):
    """(out, valid, filler)."""
    k = d.int(0, 9)
    if k < 5:
        return None, True
    if k < 8:
        return np.full(need + d.int(0, 4), -7, np.int64), True
    bad = d.pick(("small", "int32", "strided", "readonly", "swapped", "2d"))
    if bad == "small":
        return np.zeros(need - 1, np.int64) if need else np.zeros(0, np.int64), need == 0
    if bad == "int32":
        return np.zeros(need, np.int32), need == 0 and False
    if bad == "strided":
        return np.zeros(2 * need + 4, np.int64)[::2], False
    if bad == "readonly":
        a = np.zeros(need, np.int64)
        a.flags.writeable = False
        return a, False
    if bad == "swapped":
        return np.zeros(need, ">i8"), False
    return np.zeros((need, 1), np.int64), False


def draw_table(d: Draw, plan, kernel_ids):
    """(table, meanings or None, forms) with ids around each group's valid range."""
    G = plan.layout.num_groups
    n = G if not d.chance(10) else d.int(0, G + 1)
    forms, meanings, objs = [], [], []
    for g in range(n):
        rng = id_range(plan, g, kernel_ids, False) if g < G else None
        lo, hi = rng if rng else (1, 8)
        hi = min(hi, 10**6)
        ids = []
        for _ in range(d.int(0, 8) if rng or d.chance(4) else 0):
            ids.append(d.int(lo, max(lo, hi - 1)) if d.int(0, 7) else
                       d.pick((0, lo - 1, hi, hi + 1, -1, 2**31, d.int(1, 127) << 24)))
        obj, meaning, form = group(d, 64, ids=ids)
        objs.append(obj)
        meanings.append(meaning)
        forms.append(form)
    outer = d.pick((list, list, tuple, iter)) if not d.chance(30) else (lambda x: "ab")
    return outer(objs), (meanings if n == G else None), forms, outer in (list, tuple)


def check_desc_ids(d: Draw) -> None:
    plan = make_plan(d)
    kernel_ids, allow_null = d.bool(), d.chance(4)
    table, meanings, forms, seq = draw_table(d, plan, kernel_ids)
    shaky = shrinks(table)
    regions = [(r.logical_blocks, r.ratio, r.group, r.state) for r in plan.regions]
    gstate = [s.kind == GroupKind.MAMBA for s in plan.layout.groups]
    valid = seq and meanings is not None and all(m is not None for m in meanings)
    if valid:
        for g, m in enumerate(meanings):
            rng = id_range(plan, g, kernel_ids, allow_null)
            valid = valid and (not m or (rng is not None and ids_ok(m, rng[1], rng[0])))
    want = oracle_desc_ids(regions, gstate, meanings, group_major=plan.group_major,
                           kernel_ids=kernel_ids) if valid else None
    out, good_out = out_buffer(d, len(want) if want is not None else 0)
    ok, got = call(plan.desc_ids, table, out=out, kernel_ids=kernel_ids, allow_null=allow_null)
    if ok:
        expect(valid and good_out, lambda: f"desc_ids accepted {table!r} out={out!r} -> {got!r}")
        expect(got.dtype == np.int64 and got.tolist() == want,
               lambda: f"desc_ids({table!r}) = {got.tolist()}, want {want}")
        if out is not None:
            expect(got.size == 0 or np.shares_memory(got, out), "not written into out")
            expect((out[len(want):] == -7).all(), "desc_ids wrote past its result")
        if want:
            expect(0 <= min(want) and max(want) < plan.num_descs, "desc id outside the dlist")
    else:
        expect(not (valid and good_out and all(f in ACCEPTED for f in forms)),
               lambda: f"desc_ids refused valid {table!r}: {got}")
        if isinstance(out, np.ndarray) and out.dtype == np.int64 and out.flags.writeable:
            expect((out == -7).all() or (out == 0).all(), "a refused call wrote into out")
    if seq and valid and not shaky:
        ok2, cnt = call(plan.count_desc_ids, list(table), kernel_ids=kernel_ids)
        expect(not ok2 or cnt == len(want), lambda: f"count_desc_ids {cnt}, want {len(want)}")
    if ok and d.bool():
        check_desc_bytes(d, plan, got)


def check_desc_bytes(d: Draw, plan, ids) -> None:
    offs = np.cumsum([0] + [r.logical_blocks * r.ratio for r in plan.regions])
    vals = ids.tolist()
    kind = d.pick(("array", "list", "junk", "float", "bool", "edge"))
    if kind == "list":
        arg = vals
    elif kind == "junk" and vals:
        arg = vals[:-1] + [d.pick((1.5, None, True, "1", 2**70))]
        vals = None
    elif kind == "float":
        arg = np.array(vals, np.float64)
        vals = None if vals else []
    elif kind == "bool":
        arg = np.ones(len(vals), np.bool_)
        vals = None if vals else []
    elif kind == "edge":
        v = d.pick((-1, plan.num_descs, plan.num_descs - 1, 0, 2**63 - 1))
        arg = np.array(vals + [v], np.int64)
        vals = vals + [v]
    else:
        arg = ids
    ok, got = call(plan.desc_bytes, arg)
    valid = vals is not None and ids_ok(vals, plan.num_descs)
    if ok:
        expect(valid, lambda: f"desc_bytes accepted {arg!r}")
        want = sum(plan.regions[int(np.searchsorted(offs, v, side="right")) - 1].block_len //
                   plan.regions[int(np.searchsorted(offs, v, side="right")) - 1].ratio
                   for v in vals)
        expect(got == want, lambda: f"desc_bytes({vals}) = {got}, want {want}")
    else:
        expect(not valid, lambda: f"desc_bytes refused {arg!r}: {got}")


def check_table_bytes(d: Draw) -> None:
    plan = make_plan(d)
    G = plan.layout.num_groups
    lengths = [d.int(0, 50) if d.int(0, 9) else d.pick((-1, True, 1.5, None, np.int64(3), 2**70))
               for _ in range(G + (d.pick((-1, 1)) if d.chance(10) else 0))]
    arg = d.pick((list, tuple, np.array))(lengths) if not d.chance(20) else "ab"
    seen = [] if isinstance(arg, str) else list(arg)   # what the call sees (NumPy converts)
    ok, got = call(plan.table_bytes, arg)
    valid = not isinstance(arg, str) and len(seen) == G and all(is_int(n) and n >= 0
                                                                 for n in seen)
    if ok:
        expect(valid, lambda: f"table_bytes accepted {arg!r}")
        want = sum(int(n) * sum(r.block_len for r in served(plan, g)) for g, n in enumerate(seen))
        expect(got == want, lambda: f"table_bytes({seen}) = {got}, want {want}")
    else:
        expect(not valid, lambda: f"table_bytes refused {arg!r}: {got}")


def check_pairs(d: Draw) -> None:
    plan = make_plan(d)
    G = plan.layout.num_groups
    remote = plan if d.bool() else TransferPlan.from_region_table(plan.layout, plan.region_table())
    local_t, lmean, _, _ = draw_table(d, plan, False)
    if lmean is not None and d.int(0, 3) and isinstance(local_t, list):
        # the fast path reads int32 arrays only: give it mostly those
        local_t = [np.array(m, np.int32) if m is not None and ids_ok(m, 2**31) else x
                   for x, m in zip(local_t, lmean)]
    if d.bool() and lmean is not None:     # same lengths on both sides (the common case)
        remote_t = [np.array([v for v in (m or [])], dtype=np.int32)[::-1].copy()
                    if all(-2**31 <= v < 2**31 for v in (m or [])) else m for m in lmean]
        rmean = [list(reversed(m)) if m is not None else None for m in lmean]
    else:
        remote_t, rmean, _, _ = draw_table(d, remote, False)
    gb = [d.int(0, 4096) for _ in range(G)]
    res = call(plan._desc.pair_ids32, remote._desc, local_t, remote_t, gb)
    ok, got = res
    expect(ok, lambda: f"pair_ids32 raised {got}")
    if got is None:
        return
    lids, rids, copy_, nbytes = got
    ok_l, want_l = call(plan.desc_ids, [np.asarray(x) for x in lmean])
    ok_r, want_r = call(remote.desc_ids, [np.asarray(x) for x in rmean])
    expect(ok_l and ok_r, lambda: f"pair_ids32 paired invalid tables {local_t!r} / {remote_t!r}")
    expect(lids.dtype == np.int32 and rids.dtype == np.int32 and lids.tolist() == want_l.tolist()
           and rids.tolist() == want_r.tolist(), lambda: f"pair_ids32 ids differ: {got}")
    expect([c.tolist() for c in copy_] == [list(m) for m in lmean], "pair_ids32 copy differs")
    expect(nbytes == sum(len(m) * b for m, b in zip(lmean, gb)), "pair_ids32 bytes differ")
    expect(all(len(a) == len(b) for a, b in zip(lmean, rmean)), "paired unequal lengths")


HOSTILE = (-1, 0, 2**31, 2**63, 2**70, -2**70, float("inf"), float("nan"), 1.5, True, None,
           "7", [1], {"a": 1})


def check_construction(d: Draw) -> None:
    plan = make_plan(d)
    table = plan.region_table()
    for _ in range(d.int(0, 3)):      # mutate the handshake's region table
        if not table:
            break
        i = d.int(0, len(table) - 1)
        k = d.int(0, 5)
        if not isinstance(table[i], dict):
            continue
        if k == 0:
            table[i] = d.pick(("junk", 7, None, [1, 2]))
        elif k == 1:
            table[i].pop(d.pick(sorted(table[i])), None)
        elif k == 2:
            table.pop(i)
        else:
            key = d.pick(sorted(table[i]))
            table[i][key] = d.pick(HOSTILE + ("x",))
    ok, p2 = call(TransferPlan.from_region_table, plan.layout, table,
                  mem_type=d.pick(("DRAM", "DRAM", "VRAM", "HBM")))
    if ok:
        ok3, p3 = call(TransferPlan.from_region_table, p2.layout, p2.region_table())
        expect(ok3 and p3.shape_signature() == p2.shape_signature(), "region table round trip")
        expect(p2.num_descs == sum(r.logical_blocks * r.ratio for r in p2.regions), "num_descs")
    # from_layout / with_block_size_ratio with hostile arguments
    lay = layout(d, num_blocks=(None, 64), huge=d.chance(4))
    nb = d.int(2, 40) if d.int(0, 5) else d.pick(HOSTILE + (1, 2**31 - 1))
    page = None if d.bool() else d.pick((16, 32, 48, 8, 0, -16, 2**40, True, 1.5, [16] * 7))
    kbs = None if d.int(0, 3) else d.pick((1, 2, 4, 3, 0, -4, True, 2**70, 2.0))
    ok, p = call(TransferPlan.from_layout, lay, nb, page_bytes=page, kv_split=d.bool(),
                 state_parts=d.pick((1, 2, 3, 0, -1, True, 2**70)), kernel_block_size=kbs)
    if not ok:
        return
    if p.num_descs <= 4096:
        rows = p.descriptors()
        expect(rows.shape == (p.num_descs, 3), "descriptors: wrong shape")
    ok, p4 = call(p.with_block_size_ratio, d.pick((1, 2, 4, 3, 0, -1, True, 2**70, 2.0)))
    if ok:
        expect(len(p4.regions) == len(p.regions), "with_block_size_ratio: regions")
    n = d.int(0, 10**6) if d.int(0, 5) else d.pick((-1, True, 2.5, None, 2**70, np.int64(5)))
    call(p.request_figures, n)


def TestOneInput(data: bytes) -> None:
    d = Draw(data)
    [check_desc_ids, check_desc_ids, check_desc_ids, check_table_bytes, check_pairs,
     check_pairs, check_construction][d.int(0, 6)](d)


if __name__ == "__main__":
    instrument_harness(globals())
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()
