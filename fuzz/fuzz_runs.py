#!/usr/bin/env python3
"""Atheris harness: the coalesced-runs kernel (hmacore/_fast/_runs.pyx through hmacore.runs).

Each input picks one entry point:
* DescTable / desc_table: rows (N x 3 ``(addr, len, dev)``) as structured segments (steps up,
  down, with gaps, interleaved), random rows, or hostile ones (negative, past 2**64, floats,
  bools, strings, ragged, wrong shapes), with domains or registered ranges (overlapping,
  malformed, too small). The oracle is the documented rule (integer rows, length > 0, end
  below 2**64, uint32 device; ranges of uint64 fields ending at 2**64 at most, disjoint, every
  row inside one range of its device); an accepted table
  must give its rows back unchanged.
* find_runs: two valid tables and paired descriptor ids in many forms (lists, int32/int64/
  unsigned/byte-swapped arrays, bools, floats, 2-D, out of range, unequal lengths). The
  oracle is tests/test_runs.py's sort-and-merge (pairs grouped by offset, devices and
  domains, abutting local bytes merged): exactly its runs whenever the pairs' local bytes are
  disjoint, and always every byte once, ``order`` a permutation whose address merge gives the
  runs and whose id merge gives ``num_runs + index_breaks``.
* buffer_runs: per-key ``(addr, size)`` buffers (adjacent, gaps, across registered
  buffers, hostile values) against a plain merge of consecutive adjacent buffers of one key
  inside one registered buffer.
Bad input must raise BlockTableError / LayoutError with nothing computed.
"""
import sys

import atheris

with atheris.instrument_imports(include=["hmacore"]):
    import numpy as np
    from hmacore.errors import BlockTableError, LayoutError
    from hmacore.runs import DescTable, buffer_runs, desc_table, find_runs

from fuzzlib import Draw, call, expect, instrument_harness, is_int  # noqa: E402

U64 = 2**64
DEV_MAX = 2**32 - 1
LENS = (1, 8, 64, 4096)
BAD_VALUES = (-1, U64, 2**70, 2.5, 64.0, True, "64", None, np.float64(8.0), np.int64(-3))


def rows_struct(d: Draw):
    """Valid rows: 1-4 segments, each ``count`` descriptors of one length from a base with a
    constant step (contiguous up/down, gaps, interleaved layers), rarely near 2**64."""
    rows = []
    for _ in range(d.int(1, 4)):
        ln = d.pick(LENS)
        step = d.pick((ln, ln, -ln, 2 * ln, 3 * ln, 0))
        count = d.int(1, 12)
        top = U64 - 1 - (count + 1) * 3 * ln
        base = d.pick((0, 4096, 1 << 20, 1 << 40, top)) + d.int(0, 3) * ln
        if step < 0:
            base += count * ln
        dev = d.pick((0, 0, 1, DEV_MAX))
        rows += [[base + i * step, ln, dev] for i in range(count)]
    return rows


def rows_any(d: Draw):
    """``(obj, meaning)``: rows in some form and the list of int triples it stands for (None:
    malformed)."""
    k = d.int(0, 9)
    rows = rows_struct(d) if k < 7 else [[d.int(0, 1 << 16), d.pick(LENS + (0,)),
                                          d.pick((0, 1, DEV_MAX, DEV_MAX + 1))]
                                         for _ in range(d.int(0, 6))]
    meaning = [list(r) for r in rows]
    if d.chance(5) and rows:
        i, j = d.int(0, len(rows) - 1), d.int(0, 2)
        v = d.pick(BAD_VALUES)
        rows[i][j] = v
        meaning = None if not (is_int(v) and 0 <= v < U64) else meaning
        if meaning is not None:
            meaning[i][j] = int(v)
    form = d.pick(("list", "list", "array", "array", "int64", "tuple", "ragged", "flat",
                   "float", "obj"))
    if form == "ragged" and rows:
        rows[0] = rows[0][:2]
        return rows, None
    if form == "flat":
        return [v for r in rows for v in r], (None if rows else [])
    if form == "tuple":
        return tuple(tuple(r) for r in rows), meaning
    if meaning is None:
        return rows, None            # hostile values stay Python objects
    if form == "array":
        return np.array(meaning, dtype=np.uint64).reshape(-1, 3), meaning
    if form == "int64":
        if all(v < 2**63 for r in meaning for v in r):
            return np.array(meaning, dtype=np.int64).reshape(-1, 3), meaning
        return rows, meaning
    if form == "float":
        return np.array(meaning, dtype=np.float64).reshape(-1, 3), (meaning if not rows
                                                                   else None)
    if form == "obj":
        return np.array(meaning, dtype=object).reshape(-1, 3), meaning
    return rows, meaning


def rows_ok(m) -> bool:
    return m is not None and all(len(r) == 3 and r[1] > 0 and r[0] + r[1] < U64
                                 and r[2] <= DEV_MAX for r in m)


def ranges_for(d: Draw, m):
    """``(ranges, meaning)``: registered ranges covering (or not) valid rows ``m``."""
    out = []
    by_dev: dict = {}
    for a, n, dev in m:
        by_dev.setdefault(dev, []).append((a, a + n))
    for dev, spans in sorted(by_dev.items()):
        spans.sort()
        lo, hi = spans[0][0], max(e for _, e in spans)
        if d.chance(3) and len(spans) > 1:      # split in two at a row boundary
            cut = d.pick(spans[1:])[0]
            if lo < cut < hi:
                out += [[lo, cut - lo, dev], [cut, hi - cut, dev]]
                continue
        out.append([lo, hi - lo, dev])
    meaning = [list(r) for r in out]
    k = d.int(0, 7)
    if k == 0 and out:
        out[0][1] = max(out[0][1] - 1, 1)       # too small for its last row: refused
        meaning[0][1] = out[0][1]
    elif k == 1 and out:
        i, j = d.int(0, len(out) - 1), d.int(0, 2)
        v = d.pick(BAD_VALUES + (0,))
        out[i][j] = v
        meaning = None if not is_int(v) else meaning
        if meaning is not None:
            meaning[i][j] = int(v)
    elif k == 2:
        out.append(d.pick(([0, 1 << 30, 0], [5, 5], "abc", [1, 2, 3, 4], 7)))
        meaning = None if not isinstance(out[-1], list) or len(out[-1]) != 3 else \
            meaning + [list(out[-1])]
    return (out if d.bool() else [tuple(r) if isinstance(r, list) else r for r in out]), \
        meaning


def ranges_ok(rg, m) -> bool:
    """The documented rule of desc_table's ranges."""
    if rg is None:
        return False
    if any(not 0 <= v < U64 for r in rg for v in r) or any(r[1] <= 0 or r[0] + r[1] > U64 or
                                                r[2] > DEV_MAX for r in rg):
        return False
    s = sorted(rg)
    if any(s[k][0] < s[k - 1][0] + s[k - 1][1] for k in range(1, len(s))):
        return False
    if m and not s:
        return False
    return all(any(x <= a and a + n <= x + rn and dv == dev for x, rn, dv in s)
               for a, n, dev in m)


def domains_of(rg, m):
    """The range of each row (its index in address order)."""
    s = sorted(rg)
    return [next(i for i, (x, rn, dv) in enumerate(s) if x <= a and a + n <= x + rn
                 and dv == dev) for a, n, dev in m]


def check_table(d: Draw) -> None:
    obj, m = rows_any(d)
    valid = rows_ok(m)
    mode = d.int(0, 2)
    if mode == 0:
        ok, got = call(DescTable, obj)
    elif mode == 1:
        n = len(m) if m is not None else d.int(0, 3)
        dm = [d.int(0, 3) for _ in range(n)]
        k = d.int(0, 5)
        if k == 0 and dm:
            dm[d.int(0, n - 1)] = d.pick((-1, 2**31, 2**40, 2.5, True))
            valid = False
        elif k == 1:
            dm = dm + [0]
            valid = False
        ok, got = call(DescTable, obj, np.array(dm, dtype=object) if d.bool() else dm)
    else:
        rg, rm = ranges_for(d, m) if valid else ([[0, 1 << 20, 0]], [[0, 1 << 20, 0]])
        valid = valid and ranges_ok(rm, m)
        ok, got = call(desc_table, obj, rg)
    if ok:
        expect(valid, lambda: f"accepted invalid rows {obj!r}: {got!r}")
        back = got.rows().tolist()
        expect(back == m, lambda: f"rows {back} want {m}")
        expect(got.num_descs == len(m), "num_descs")
    else:
        expect(not valid, lambda: f"refused valid rows {obj!r}: {got}")
        expect(isinstance(got, LayoutError), lambda: f"{type(got).__name__}: {got}")


def oracle_runs(lrows, lids, rrows, rids, ldom, rdom):
    """tests/test_runs.py's oracle with registration domains: pairs grouped by (offset,
    devices, domains), sorted by local address, abutting local bytes merged."""
    pairs = []
    for i, j in zip(lids, rids):
        la, ln, ld = lrows[i]
        ra, _, rd = rrows[j]
        pairs.append(((ra - la, ld, rd, ldom[i], rdom[j]), la, ra, ln))
    pairs.sort()
    out = []
    for key, la, ra, ln in pairs:
        if out and out[-1][0] == key and out[-1][1] + out[-1][3] == la:
            out[-1][3] += ln
        else:
            out.append([key, la, ra, ln])
    return sorted((la, ra, ln, k[1], k[2]) for k, la, ra, ln in out)


def ids_for(d: Draw, N: int, count: int):
    """``(obj, meaning)``: descriptor ids (None: malformed)."""
    ids, i = [], d.int(0, max(N - 1, 0))
    while len(ids) < count:
        k = d.int(0, 7)
        if k < 4:
            i = i + 1 if i + 1 < N else 0
        elif k < 6:
            i = i - 1 if i > 0 else N - 1
        else:
            i = d.int(0, max(N - 1, 0))
        ids.append(i)
    meaning = list(ids)
    if d.chance(8) and ids:
        v = d.pick((-1, N, N + 5, 2**31, 2**63, True, 1.5, None, "1"))
        ids[d.int(0, len(ids) - 1)] = v
        if not is_int(v):
            return ids, None
        meaning = ids
    form = d.pick(("list", "list", "i32", "i64", "u16", "u64", "swapped", "f64", "bool",
                   "twod", "tuple", "strided"))
    ints = all(is_int(v) for v in meaning)
    if form == "list" or not ints:
        return ids, meaning
    if form == "tuple":
        return tuple(ids), meaning
    if form in ("f64", "bool"):
        return np.array(ids, dtype=np.float64 if form == "f64" else np.bool_), \
            ([] if not ids else None)
    if form == "twod":
        return np.array(ids, dtype=np.int64).reshape(1, -1) if all(
            -2**63 <= v < 2**63 for v in ids) else ids, None
    dt = {"i32": np.int32, "i64": np.int64, "u16": np.uint16, "u64": np.uint64,
          "swapped": np.dtype(">i8"), "strided": np.int64}[form]
    info = np.iinfo(dt)
    if not all(info.min <= v <= info.max for v in ids):
        return ids, meaning
    a = np.array(ids, dtype=dt)
    if form == "strided":
        b = np.zeros(2 * len(ids), dtype=dt)
        b[::2] = a
        a = b[::2]
    return a, meaning


def check_runs(d: Draw) -> None:
    lrows = rows_struct(d)
    same = d.chance(3)
    rrows = lrows if same else rows_struct(d)
    if d.chance(3):     # force equal lengths so most pairs are legal
        ln = d.pick(LENS)
        for r in lrows + rrows:
            r[1] = ln
    if not (rows_ok(lrows) and rows_ok(rrows)):
        return
    with_dom = d.chance(3)
    ldom = [d.int(0, 1) for _ in lrows] if with_dom else [0] * len(lrows)
    rdom = [d.int(0, 1) for _ in rrows] if with_dom else [0] * len(rrows)
    lt = DescTable(np.array(lrows, np.uint64), np.array(ldom) if with_dom else None)
    rt = lt if same and not with_dom else DescTable(np.array(rrows, np.uint64),
                                                    np.array(rdom) if with_dom else None)
    if rt is lt:
        rdom = ldom
    n = d.int(0, 24)
    lo, lm = ids_for(d, len(lrows), n)
    ro, rm = ids_for(d, len(rrows), n if not d.chance(12) else d.int(0, n + 1))
    order = d.bool()
    ok, got = call(find_runs, lt, lo, rt, ro, order=order)
    valid = lm is not None and rm is not None and len(lm) == len(rm) \
        and all(0 <= v < len(lrows) for v in lm) and all(0 <= v < len(rrows) for v in rm) \
        and all(lrows[i][1] == rrows[j][1] for i, j in zip(lm, rm))
    if not ok:
        expect(not valid, lambda: f"refused valid ids {lo!r} {ro!r}: {got}")
        expect(isinstance(got, BlockTableError), lambda: f"{type(got).__name__}: {got}")
        return
    expect(valid, lambda: f"accepted invalid ids {lo!r} {ro!r}: {got!r}")
    nbytes = sum(lrows[i][1] for i in lm)
    expect(got.nbytes == nbytes and got.block_descriptors == len(lm), "bytes / count")
    runs = sorted((int(a), int(b), int(n), int(x), int(y))
                  for (a, n, x), (b, _, y) in zip(got.local.tolist(), got.remote.tolist()))
    expect(sum(r[2] for r in runs) == nbytes, "the runs' bytes differ from the pairs'")
    # maximal runs are unique when no two pairs' local bytes overlap on one device (rows of
    # a real plan never do; random segments and repeated ids may)
    disjoint, reach = True, {}
    for dev, a, e in sorted((lrows[i][2], lrows[i][0], lrows[i][0] + lrows[i][1]) for i in lm):
        if dev in reach and a < reach[dev]:
            disjoint = False
        reach[dev] = max(reach.get(dev, 0), e)
    if disjoint:
        want = oracle_runs(lrows, lm, rrows, rm, ldom, rdom)
        expect(runs == want, lambda: f"runs {runs} want {want} ({lm} -> {rm})")
    if order:
        check_order(got, lrows, lm, rrows, rm, disjoint, ldom, rdom)
    else:
        expect(got.order is None, "order given unasked")


def check_order(runs, lrows, lids, rrows, rids, disjoint, ldom, rdom) -> None:
    """``order`` is a permutation; with disjoint local bytes, merging consecutive pairs by
    address gives the runs, merging only consecutive ids as well gives ``num_runs +
    index_breaks`` (a pair given twice may sit where an address merge joins two runs: the
    bytes are still moved once per pair)."""
    order = runs.order.tolist()
    expect(sorted(order) == list(range(len(lids))), lambda: f"order {order}")
    if not disjoint:
        return
    merged = by_ids = 0
    prev = None
    for k in order:
        la, ln, ld = lrows[lids[k]]
        ra, _, rd = rrows[rids[k]]
        where = (ld, rd, ldom[lids[k]], rdom[rids[k]])    # runs never cross these
        if prev is None or prev[0] != la or prev[1] != ra or prev[4] != where:
            merged += 1
            by_ids += 1
        elif prev[2] + 1 != lids[k] or prev[3] + 1 != rids[k]:
            by_ids += 1
        prev = (la + ln, ra + ln, lids[k], rids[k], where)
    expect(merged == runs.num_runs, lambda: f"order merges into {merged} != {runs.num_runs}")
    expect(by_ids == runs.num_runs + runs.index_breaks,
           lambda: f"id merge {by_ids} != {runs.num_runs} + {runs.index_breaks}")


def check_buffers(d: Draw) -> None:
    parts, meaning = [], []
    addr = d.pick((0, 100, 1 << 40))
    for _ in range(d.int(0, 5)):
        key = []
        for _ in range(d.int(0, 5)):
            size = d.pick((0, 1, 4, 64))
            addr += d.pick((0, 0, 0, 8, -size - 4)) if addr > 1 << 10 else d.pick((0, 8))
            key.append((addr, size))
            addr += size
        parts.append(key)
        meaning.append(list(key))
    if d.chance(6) and any(parts):
        k = d.pick([i for i, p in enumerate(parts) if p])
        i, j = d.int(0, len(parts[k]) - 1), d.int(0, 1)
        v = d.pick(BAD_VALUES + (U64 - 1,))
        row = list(parts[k][i])
        row[j] = v
        parts[k][i] = tuple(row)
        meaning = None if not (is_int(v) and v >= 0) else meaning
        if meaning is not None:
            meaning[k][i] = (int(row[0]), int(row[1]))
    ranges, rmean = None, None
    if d.bool():
        allb = sorted(b for p in (meaning or []) for b in p)
        ranges = []
        for a, s in allb[::max(1, d.int(1, 3))]:
            ranges.append((a, s + d.pick((0, 0, 8, 64))))
        if d.chance(8):
            ranges.append(d.pick(((1, -5), (2.5, 4), "ab", (1, 2, 3), (True, 8))))
        rmean = ranges
    ok, got = call(buffer_runs, parts, ranges)
    valid = meaning is not None and all(a + s < U64 and s < 2**63
                                        for p in meaning for a, s in p) \
        and (ranges is None or all(isinstance(r, tuple) and len(r) == 2 and is_int(r[0])
                                   and is_int(r[1]) and r[0] >= 0 and r[1] >= 0
                                   and r[0] + r[1] < U64 for r in rmean))
    if not ok:
        expect(not valid, lambda: f"refused valid buffers {parts!r} {ranges!r}: {got}")
        expect(isinstance(got, BlockTableError), lambda: f"{type(got).__name__}: {got}")
        return
    expect(valid, lambda: f"accepted invalid buffers {parts!r} {ranges!r}: {got!r}")
    want = [merge_key(p, ranges) for p in meaning]
    expect(got == want, lambda: f"{got} want {want} ({parts!r}, {ranges!r})")


def merge_key(bufs, ranges):
    """Consecutive buffers of one key merged when the next starts where the previous ends and
    both lie in the same registered buffer (a buffer outside every range never merges)."""
    s_rg = sorted(ranges) if ranges is not None else []

    def dom(a, s):
        if ranges is None:
            return 0
        idx = max((i for i, (x, _) in enumerate(s_rg) if x <= a), default=None)
        return idx if idx is not None and a + s <= s_rg[idx][0] + s_rg[idx][1] else None
    out = []
    prev_dom = None
    for a, s in bufs:
        dm = dom(a, s)
        if out and out[-1][0] + out[-1][1] == a and dm is not None and dm == prev_dom:
            out[-1] = (out[-1][0], out[-1][1] + s)
        else:
            out.append((a, s))
        prev_dom = dm
    return out


def TestOneInput(data: bytes) -> None:
    d = Draw(data)
    which = d.int(0, 3)
    if which == 0:
        check_table(d)
    elif which == 3:
        check_buffers(d)
    else:
        check_runs(d)


if __name__ == "__main__":
    instrument_harness(globals())
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()
