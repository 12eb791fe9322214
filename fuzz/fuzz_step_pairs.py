#!/usr/bin/env python3
"""Atheris harness: ``TrackerSet.step_pairs`` (a push producer's whole step in one C call).

Each input builds a TrackerSet of 1-3 groups and a plain-Python model of it (requests added,
some preempted or finished), then runs up to 6 steps. A step draws req_ids (tracked, repeated,
unknown, unhashable, a non-sequence), new_block_ids (None or G id lists in any form
:func:`fuzzlib.group` makes, a wrong group count, a non-list), spans (None, (start, end),
reversed, negative, past int64, floats, NumPy ints, wrong arity), the consumer's tables
(:func:`fuzzlib.table` forms, negative ids inside or outside the span) and block_sizes
(valid, 0, bools, floats, NumPy ints, a wrong count, a non-sequence). The oracle is the
documented rule (hmacore/tables.py ``step_pairs``) and tests/test_tables_push_step.py's
``oracle_pairs``: an accepted step must return exactly the oracle's pairs and offsets and
leave every table and state as the model says; a refused one must raise a TrackerStateError /
BlockTableError and change nothing. Inputs whose acceptance the rule leaves open (a NumPy
int where an exact int is documented, a negative consumer id outside the span) may go either
way, but an accepted one must still be exact.
"""
import sys

import atheris

with atheris.instrument_imports(include=["hmacore"]):
    import numpy as np
    from hmacore.errors import BlockTableError, TrackerStateError
    from hmacore.spec import GroupKind, GroupSpec, KVLayout
    from hmacore.tables import RequestState, TrackerSet

from fuzzlib import (Draw, call, expect, group, instrument_harness, is_int,  # noqa: E402
                     shrinks, table)

NEW, RUNNING, PREEMPTED = int(RequestState.NEW), int(RequestState.RUNNING), \
    int(RequestState.PREEMPTED)
SIZES = (1, 2, 4, 16, 64, 256)
NB = (2, 8, 64, 5000)
BAD = object()                # a malformed entry (None means "nothing")
ARRAY_FORMS = ("array", "strided", "swapped", "readonly", "subclass", "object", "float",
               "bool", "twod")


def oracle_pairs(mine, theirs, block_sizes, start, end):
    """Per group, (mine[p], theirs[p]) for the positions of tokens [start, end) both tables
    hold, both ids non-null."""
    out = []
    for m, t, bs in zip(mine, theirs, block_sizes):
        lo, hi = start // bs, -(-end // bs)
        out.append([(m[p], t[p]) for p in range(lo, min(hi, len(m), len(t))) if m[p] and t[p]])
    return out


def exact(v) -> bool:
    return type(v) is int


def hashable(x) -> bool:
    try:
        hash(x)
    except TypeError:
        return False
    return True


class Step:
    """One TrackerSet plus its model: ``tables[r]`` per-group id lists, ``states[r]``."""

    def __init__(self, d: Draw):
        self.d = d
        self.G = d.int(1, 3)
        self.nb = d.pick(NB)
        groups = tuple(GroupSpec(GroupKind.FULL, d.pick(SIZES), (f"l{g}",))
                       for g in range(self.G))
        self.ts = TrackerSet(KVLayout(groups=groups, num_blocks=self.nb))
        self.tables: dict = {}
        self.states: dict = {}
        for i in range(d.int(0, 5)):
            r = d.pick((f"r{i}", i, (i, "t")))
            t = [[d.int(0, self.nb - 1) for _ in range(d.int(0, 6))] for _ in range(self.G)]
            self.ts.add(r, t)
            self.tables[r], self.states[r] = t, NEW
            k = d.int(0, 5)
            if k == 0:
                self.ts.preempt(r)
                self.tables[r], self.states[r] = [[] for _ in range(self.G)], PREEMPTED
            elif k == 1:
                self.ts.set_state(r, RequestState.RUNNING)
                self.states[r] = RUNNING

    def lib(self):
        return {r: ([x.tolist() for x in self.ts.block_ids(r)], int(self.ts.state(r)))
                for r in self.ts}

    def model(self):
        return {r: (self.tables[r], self.states[r]) for r in self.tables}

    # -- arguments: each (object, meaning, strict) ----------------------------------------
    # meaning: what the object stands for when it may be accepted (None: it must be
    # refused); strict: False when the rule leaves acceptance open (a NumPy int where ints
    # are documented, a consumer table in a non-canonical form): may be refused too.
    def req_ids(self):
        d = self.d
        known = list(self.tables)
        ids = []
        for _ in range(d.int(0, 5)):
            k = d.int(0, 9)
            if k < 7 and known:
                ids.append(d.pick(known))
            elif k < 9:
                ids.append(d.pick(("zz", 99, (1, 2), None)))
            else:
                ids.append([1])                      # unhashable
        if d.chance(12):
            return d.pick((7, None)), None, True
        form = d.pick((list, list, tuple, iter))
        return form(ids), ids, True

    def new_ids(self, R: int):
        d = self.d
        out, meaning, strict = [], [], True
        for _ in range(R if not d.chance(12) else d.int(0, R + 1)):
            if d.chance(3):
                out.append(None)
                meaning.append(None)
                continue
            ng = self.G if not d.chance(10) else d.int(0, self.G + 1)
            per, per_m = [], []
            for _ in range(ng):
                obj, m, form = group(d, self.nb, 6)
                per.append(obj)
                if form in ARRAY_FORMS:
                    m = None                         # the rule: lists (or tuples) only
                else:
                    # element by element (a pushing request's ids are read only where the
                    # consumer holds a block): an int id, or None (junk, refused if read);
                    # (m is None only for the "junk" form, which holds no ShrinkingInt)
                    m = [int(v) if is_int(v) else None for v in obj] if m is None \
                        else list(m)
                    if form not in ("list", "tuple"):
                        strict = False               # NumPy / int-subclass elements: open
                per_m.append(m)
            out.append(d.pick((list, tuple))(per))
            meaning.append(per_m if ng == self.G and all(m is not None for m in per_m)
                           else BAD)
        if len(out) != R or any(m is BAD for m in meaning):
            return out, None, True
        return (out if d.bool() else tuple(out)), meaning, strict

    def span(self):
        d = self.d
        k = d.int(0, 11)
        if k < 3:
            return None, None, True
        if k < 9:
            a = d.int(0, 3000) if not d.chance(8) else d.pick((2**62, 2**63 - 1))
            b = a + d.int(0, 3000) if a < 2**62 else d.pick((a, 2**63 - 1))
            return d.pick((tuple, list))((a, b)), (a, b), True
        bad = d.pick(((5, 2), (-1, 4), (0, 2**63), (np.int64(0), np.int64(20)), (1.0, 5.0),
                      (1, 2, 3), (True, 4), "ab", 7, (0, None)))
        if isinstance(bad, tuple) and len(bad) == 2 and all(is_int(v) for v in bad) \
                and 0 <= bad[0] <= bad[1] < 2**63:
            return bad, (int(bad[0]), int(bad[1])), False     # NumPy ints: open
        return bad, BAD, True

    def block_sizes(self):
        d = self.d
        k = d.int(0, 9)
        if k < 6:
            sizes = [d.pick(SIZES) if not d.chance(10) else d.pick((2**31, 2**63 - 1))
                     for _ in range(self.G)]
            return d.pick((tuple, list))(sizes), sizes, True
        if k == 6:
            sizes = [d.pick(SIZES) for _ in range(d.int(0, self.G + 1))]
            return sizes, (sizes if len(sizes) == self.G else None), True
        if k == 7:
            if d.bool():                          # an iterable is read once: fine
                return iter([16] * self.G), [16] * self.G, True
            return d.pick((16, None, "16")), None, True
        sizes = [d.pick(SIZES) for _ in range(self.G)]
        bad = d.pick((0, -4, True, 2.0, np.int64(16), 2**63, None))
        sizes[d.int(0, self.G - 1)] = bad
        if is_int(bad) and 1 <= bad < 2**63:
            return sizes, [int(v) for v in sizes], False
        return sizes, None, True

    # -- one step -------------------------------------------------------------------------
    def step(self):
        d = self.d
        rids, rmean, rstrict = self.req_ids()
        R = len(rmean) if rmean is not None else d.int(0, 2)
        new, nmean, nstrict = self.new_ids(R)
        spans, theirs, smean, sstrict, tmean = [], [], [], [], []
        shaky = shrinks(new)
        for _ in range(R if not d.chance(15) else d.int(0, R + 1)):
            sp, sm, ss = self.span()
            spans.append(sp)
            smean.append(sm)
            sstrict.append(ss)
            obj, tm, canonical = table(d, self.G, 64)
            if tm is not None and d.chance(6) and all(0 <= v < 2**31 for x in tm for v in x):
                g = d.int(0, self.G - 1)
                tm[g] = list(tm[g]) + [-1]          # a negative consumer id at the end
                obj = tuple(np.array(x, np.int32) for x in tm)
            theirs.append(obj)
            tmean.append((tm, canonical))
            shaky = shaky or shrinks(obj)
        if d.chance(20):                           # outer lists of the wrong length / type
            k = d.int(0, 2)
            if k == 0 and spans:
                spans = spans[:-1]
            elif k == 1 and theirs:
                theirs = theirs[:-1]
            else:
                theirs = 5
        sizes, zmean, zstrict = self.block_sizes()
        before = self.lib()
        ok, got = call(self.ts.step_pairs, rids, new, theirs, spans, sizes)
        after = self.lib()
        if shaky:       # a list emptied itself while read: any clear outcome will do
            if not ok:
                expect(isinstance(got, (TrackerStateError, BlockTableError)),
                       lambda: f"refused with {type(got).__name__}: {got}")
                expect(after == before, lambda: f"a refused step changed {before} -> {after}")
            return False
        args = (rmean, nmean, spans, smean, theirs, tmean, zmean)
        strict_ok = rstrict and nstrict and zstrict and all(sstrict)
        if ok:
            want = self.oracle(*args, strict=False)
            expect(want is not None, lambda: f"accepted an invalid step {rids!r} {new!r} "
                                             f"{theirs!r} {spans!r} {sizes!r}: {got!r}")
            pairs, tables, states = want
            local, remote, offsets = got
            expect(local.dtype == remote.dtype == np.int32 and offsets.dtype == np.int64,
                   "dtypes")
            o = offsets.tolist()
            expect(len(o) == len(rmean) * self.G + 1 and o[0] == 0 and o[-1] == len(local)
                   == len(remote), lambda: f"offsets {o}")
            lt, rt = local.tolist(), remote.tolist()
            flat = [list(zip(lt[o[i]:o[i + 1]], rt[o[i]:o[i + 1]])) for i in range(len(o) - 1)]
            expect(flat == pairs, lambda: f"pairs {flat} want {pairs}")
            self.tables, self.states = tables, states
            expect(after == self.model(), lambda: f"tables {after} want {self.model()}")
            return True
        expect(isinstance(got, (TrackerStateError, BlockTableError)),
               lambda: f"refused with {type(got).__name__}: {got}")
        expect(after == before, lambda: f"a refused step changed {before} -> {after}")
        expect(not strict_ok or self.oracle(*args, strict=True) is None,
               lambda: f"refused a valid step {rids!r} {new!r} {theirs!r} {spans!r} {sizes!r}: "
                       f"{got}")
        return True

    def oracle(self, rmean, nmean, spans, smean, theirs, tmean, zmean, *, strict):
        """``(pairs per (request, group), tables, states)``, or None: must be refused
        (``strict``: may be refused)."""
        if rmean is None or nmean is None or zmean is None or not isinstance(theirs, list) \
                or len(spans) != len(rmean) or len(theirs) != len(rmean):
            return None
        if not all(hashable(r) for r in rmean) or any(r not in self.tables for r in rmean):
            return None
        if len(set(rmean)) != len(rmean):
            return None
        tables = {r: [list(x) for x in t] for r, t in self.tables.items()}
        states = dict(self.states)
        pairs = []
        for r, n, sp, sm, (tm, canonical) in zip(rmean, nmean, spans, smean, tmean):
            if sm is BAD:
                return None
            if sp is not None and (tm is None or any(v >= 2**31 for g in tm for v in g)):
                return None
            if n is not None:
                if states[r] == PREEMPTED and any(n):
                    return None
                for g in range(self.G):
                    # sparse appends (TrackerSet.step_pairs): with a span, an id is read
                    # (and checked) only where the consumer's table holds a block; 0 elsewhere
                    mask = None if sp is None else tm[g]
                    base = len(tables[r][g])
                    for j, v in enumerate(n[g]):
                        if mask is not None and not (base + j < len(mask) and mask[base + j]):
                            tables[r][g].append(0)
                        elif v is None or not 0 <= v < self.nb:
                            return None
                        else:
                            tables[r][g].append(v)
            states[r] = RUNNING
            if sp is None:
                pairs += [[]] * self.G
                continue
            if strict and (not canonical or any(v < 0 for g in tm for v in g)):
                return None
            if any(_neg_in_span(t, tables[r][g], zmean[g], sm) for g, t in enumerate(tm)):
                return None
            pairs += oracle_pairs(tables[r], tm, zmean, *sm)
        return pairs, tables, states

    def run(self):
        for _ in range(self.d.int(1, 6)):
            if self.d.remaining() < 4 or not self.step():
                return
            if self.d.chance(4) and self.tables:       # a request finishes between steps
                r = self.d.pick(list(self.tables))
                self.ts.finish(r)
                del self.tables[r], self.states[r]


def _neg_in_span(theirs_g, mine_g, bs, span):
    """A negative consumer id at a position the span pairs (both tables hold it)."""
    lo, hi = span[0] // bs, -(-span[1] // bs)
    return any(theirs_g[p] < 0 for p in range(lo, min(hi, len(theirs_g), len(mine_g))))


def TestOneInput(data: bytes) -> None:
    d = Draw(data)
    Step(d).run()


if __name__ == "__main__":
    instrument_harness(globals())
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()
