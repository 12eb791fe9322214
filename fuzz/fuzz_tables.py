#!/usr/bin/env python3
"""Atheris harness: hmacore.tables (conversion, masks, ids_from_objects, TrackerSet).

Each input picks one entry point:
* as_block_table / from_wire / to_wire: the oracle is the documented rule (valid iff every
  id is an int in [0, num_blocks)); canonical forms must be accepted, the result is G
  contiguous int32 arrays holding the ids, an int32 contiguous group comes back as is, and
  the caller's arrays are never modified.
* fill_blocks / count_hashed vs tests/oracle_core.py, with adversarial masks.
* ids_from_objects: exact int ids in [0, 2**31) and ``block_hash is not None`` flags.
* TrackerSet: a sequence of up to 16 calls (add, append, update_after_alloc, replace,
  preempt, finish, watermarks, apply_step, apply_step_lists, apply_step_flat, views,
  copies) against oracle_core.Trackers; a refused call must leave every table, state and
  watermark unchanged, and views taken earlier must keep showing their snapshot.
"""
import copy
import pickle
import sys

import atheris

with atheris.instrument_imports(include=["hmacore"]):
    import numpy as np
    from hmacore.spec import GroupKind, GroupSpec, KVLayout
    from hmacore.tables import (RequestState, TrackerSet, as_block_table, count_hashed,
                                fill_blocks, from_wire, ids_from_objects, to_wire)

from fuzzlib import (INT32_MAX, TOKEN_MAX, Draw, call, expect, group, ids_ok,  # noqa: E402
                     instrument_harness, is_int, same, shrinks, snapshot, table)
import oracle_core  # noqa: E402

NUM_BLOCKS = (None, 1, 2, 7, 64, INT32_MAX)
BAD_NUM_BLOCKS = (0, -1, True, 3.0, "9", 2**31, 2**64)


def check_table(d: Draw) -> None:
    G = d.int(1, 4) if not d.chance(16) else d.pick((0, -1, True, 1.0, None, 2**70))
    nb = d.pick(NUM_BLOCKS) if not d.chance(12) else d.pick(BAD_NUM_BLOCKS)
    good_args = is_int(G) and G >= 1 and (nb is None or (is_int(nb) and 1 <= nb <= INT32_MAX))
    built = G if good_args and G <= 4 else 1     # G may be 2**70: build a small table
    obj, meaning, canonical = table(d, built, nb if good_args and nb else 64)
    before, shaky = snapshot(obj), shrinks(obj)
    hi = nb if nb else 2**31
    valid = good_args and built == G and meaning is not None and \
        all(ids_ok(m, hi) for m in meaning)
    ok, got = call(as_block_table, obj, G, num_blocks=nb)
    if ok:
        expect(valid, lambda: f"accepted an invalid table {obj!r} -> {got!r}")
        expect(isinstance(got, tuple) and len(got) == G, "not one array per group")
        for a, m in zip(got, meaning):
            expect(isinstance(a, np.ndarray) and a.dtype == np.int32 and a.ndim == 1
                   and a.flags.c_contiguous, lambda: f"not contiguous int32: {a!r}")
            expect(a.tolist() == m, lambda: f"{before!r} -> {got!r}, want {meaning!r}")
        groups = obj if isinstance(obj, (list, tuple)) and len(obj) == G and G > 1 else ()
        for x, a in zip(groups, got):   # "a contiguous int32 group is returned as is"
            if type(x) is np.ndarray and x.dtype == np.int32 and x.flags.c_contiguous:
                expect(a is x, "a contiguous int32 group was copied")
    else:
        expect(not (valid and canonical), lambda: f"refused a valid table {obj!r}: {got}")
    if shaky:
        return      # the ShrinkingInt emptied its list: later calls see another table
    expect(same(obj, before), lambda: f"input modified: {before!r} -> {obj!r}")
    ok2, got2 = call(from_wire, obj, G, num_blocks=nb)      # the same rules
    expect(ok2 == ok, lambda: f"from_wire {ok2} but as_block_table {ok}: {got2}")
    if isinstance(obj, (list, tuple)):
        # to_wire: every element is a group (no flat form); ids in [0, 2**31)
        parts = [group_meaning(x) for x in obj]
        valid_w = all(p is not None and ids_ok(p, 2**31) for p in parts)
        ok3, got3 = call(to_wire, obj)
        if ok3:
            expect(valid_w and got3 == parts, lambda: f"to_wire({obj!r}) = {got3!r}")
            expect(all(type(v) is int for g in got3 for v in g), "to_wire: not Python ints")
        else:
            expect(not (valid_w and all(_canonical_group(x) for x in obj)),
                   lambda: f"to_wire refused {obj!r}: {got3}")


def group_meaning(x):
    """The ids one group object stands for (None: not a group of integer ids)."""
    if isinstance(x, np.ndarray):
        if x.ndim != 1 or (x.dtype.kind not in "iuO" and x.size):
            return None
        x = x.tolist()
    elif not isinstance(x, (list, tuple)):
        return None
    return [int(v) for v in x] if all(is_int(v) for v in x) else None


def _canonical_group(x) -> bool:
    if isinstance(x, (list, tuple)):
        return all(type(v) is int for v in x)
    return type(x) is np.ndarray and x.ndim == 1 and x.dtype.kind in "iu" and x.dtype.isnative


# -- fill_blocks / count_hashed ------------------------------------------------------------
def masks_for(d: Draw, meaning):
    """(masks, mask meaning or None): per group a mask of the group's length in some form;
    sometimes a wrong length, values 2, a float dtype or an extra group."""
    out, mean = [], []
    for m in meaning:
        n = len(m)
        if d.chance(10):
            n = n + d.pick((-1, 1, 5)) if n else 1
            mean = None
        bits = [d.bool() for _ in range(max(n, 0))]
        kind = d.pick(("bool", "u8", "i64", "list", "boollist", "u8big", "bad", "strided"))
        if kind == "bool":
            out.append(np.array(bits, dtype=np.bool_))
        elif kind == "u8":
            out.append(np.array(bits, dtype=np.uint8))
        elif kind == "u8big":          # uint8 is taken as is: any nonzero value is "hashed"
            out.append(np.array([7 * b for b in bits], dtype=np.uint8))
        elif kind == "i64":
            out.append(np.array(bits, dtype=np.int64))
        elif kind == "list":
            out.append([int(b) for b in bits])
        elif kind == "boollist":
            out.append(list(bits))
        elif kind == "strided":
            out.append(np.repeat(np.array(bits, dtype=np.uint8), 2)[::2])
        else:
            out.append(np.array([2] * n, dtype=np.int64) if n else np.zeros(0, np.float64))
            if n and mean is not None:
                mean = None
        if mean is not None:
            mean.append(bits)
    if d.chance(15):
        out.append(np.zeros(0, np.uint8))
        mean = None
    return out, mean


def check_masks(d: Draw) -> None:
    G = d.int(1, 4)
    obj, meaning, canonical = table(d, G, 40)
    valid = meaning is not None and all(ids_ok(m, 2**31) for m in meaning)
    # fill_blocks takes the table's own group count: a nested table of n groups is valid
    if isinstance(obj, (list, tuple)) and obj and isinstance(obj[0], (list, tuple, np.ndarray)) \
            and meaning is None and all(group_meaning(x) is not None for x in obj):
        meaning = [group_meaning(x) for x in obj]
        valid = all(ids_ok(m, 2**31) for m in meaning)
        canonical = all(_canonical_group(x) for x in obj)
    masks, mmean = masks_for(d, meaning if meaning is not None else [[]])
    shaky = shrinks(obj)
    ok, got = call(fill_blocks, obj, masks)
    ok2, got2 = call(count_hashed, obj, masks)
    if shaky:       # the first call emptied a list: the second one sees another table
        ok2, got2 = ok, oracle_core.count_hashed(meaning, mmean) if ok else None
    expect(ok == ok2, lambda: f"fill_blocks ok={ok} but count_hashed ok={ok2}: {got} / {got2}")
    if ok:
        expect(valid and mmean is not None, lambda: f"accepted invalid {obj!r} / {masks!r}")
        expect([x.tolist() for x in got] == oracle_core.fill_blocks(meaning, mmean),
               lambda: f"fill_blocks({obj!r}, {masks!r}) = {got!r}")
        expect(list(got2) == oracle_core.count_hashed(meaning, mmean),
               lambda: f"count_hashed({obj!r}, {masks!r}) = {got2!r}")
        expect(all(x.dtype == np.int32 for x in got), "fill_blocks: not int32")
    elif valid and canonical and mmean is not None and len(obj):
        raise AssertionError(f"refused valid input {obj!r} / {masks!r}: {got}")


# -- ids_from_objects ---------------------------------------------------------------------
class Blk:
    __slots__ = ("block_id", "block_hash")

    def __init__(self, block_id, block_hash):
        self.block_id, self.block_hash = block_id, block_hash


class NoId:
    """A block without a block_id attribute."""

    block_hash = None


class Shrinking:
    """A block whose block_id property empties the list holding it."""

    block_hash = b"h"

    def __init__(self, owner):
        self.owner = owner

    @property
    def block_id(self):
        self.owner.clear()
        return 3


def check_objects(d: Draw) -> None:
    form = d.pick((list, list, tuple, iter))
    objs, want_ids, want_flags = [], [], []
    bad = shaky = False     # shaky: the list shrinks under the call (refusal optional)
    for _ in range(d.int(0, 10)):
        k = d.int(0, 15)
        if k == 14:
            objs.append(NoId())
            bad = True
            continue
        if k == 15:
            objs.append(Shrinking(objs))   # empties the list the call reads: list form only
            shaky = shaky or form is list
            want_ids.append(3)
            want_flags.append(True)
            continue
        v = d.block_id(64) if k < 12 else d.pick((True, np.int64(3), 2.0, None, "1", 2**70))
        h = None if d.bool() else d.pick((b"x", "y", 0, np.zeros(1)))
        objs.append(Blk(v, h))
        bad = bad or not (type(v) is int and 0 <= v <= INT32_MAX)   # exact ints only
        want_ids.append(v)
        want_flags.append(h is not None)
    arg = objs if form is list else form(list(objs))
    ok, got = call(ids_from_objects, arg, group=d.int(0, 3))
    if ok:
        expect(not bad, lambda: f"accepted bad blocks {objs!r}: {got!r}")
        ids, flags = got
        expect(ids.dtype == np.int32 and flags.dtype == np.bool_, "wrong dtypes")
        expect(ids.tolist() == want_ids and flags.tolist() == want_flags,
               lambda: f"ids_from_objects -> {ids!r} {flags!r}, want {want_ids} {want_flags}")
    else:
        expect(bad or shaky, lambda: f"refused valid blocks: {got}")


# -- TrackerSet vs oracle_core.Trackers ---------------------------------------------------
REQ_IDS = ("a", "b", "c", 0, 1, ("t", 2))
UNHASHABLE = ([1], {"r": 1})
STATES = {"NEW": 0, "WAITING_FOR_REMOTE": 1, "RUNNING": 2, "PREEMPTED": 3}
MARKS = ("scheduled_tokens", "saved_tokens", "loaded_tokens")


def token_ok(n) -> bool:
    return is_int(n) and 0 <= n <= TOKEN_MAX


class Model:
    """oracle_core.Trackers plus the prompt-token mark it does not keep."""

    def __init__(self, G: int):
        self.t = oracle_core.Trackers(G)
        self.prompt: dict = {}

    def state(self):
        return {r: (tables, st, s, v, l, self.prompt[r])
                for r, (tables, st, s, v, l) in self.t.snapshot().items()}


def lib_state(ts: TrackerSet):
    out = {}
    for r in ts:
        out[r] = ([x.tolist() for x in ts.block_ids(r)], int(ts.state(r)), ts.scheduled_tokens(r),
                  ts.saved_tokens(r), ts.loaded_tokens(r), ts.num_prompt_tokens(r))
    return out


def rid(d: Draw):
    return d.pick(REQ_IDS) if not d.chance(24) else d.pick(UNHASHABLE)


def hashable(r) -> bool:
    try:
        hash(r)
        return True
    except TypeError:
        return False


def based_table(d: Draw, model: Model, r, G: int):
    """Ids of a full table that mostly extends r's tracked one (nulls, rarely a change)."""
    cur = model.t.reqs[r]["t"] if r in model.t.reqs else [[] for _ in range(G)]
    out = []
    for ids in cur:
        ids = list(ids)
        for i in range(len(ids)):
            if d.chance(5):
                ids[i] = 0
            elif d.chance(40):
                ids[i] = d.int(1, 63)
        if ids and d.chance(20):
            ids.pop()
        out.append(ids + [d.int(0, 63) for _ in range(d.int(0, 3))])
    return out


class Tracker:
    """One TrackerSet fuzzing sequence."""

    def __init__(self, d: Draw):
        self.d = d
        self.G = d.int(1, 4)
        self.nb = d.pick((None, 2, 8, 64, INT32_MAX))
        self.hi = self.nb or 2**31
        layout = KVLayout(groups=tuple(GroupSpec(GroupKind.FULL, 16, (f"l{g}",))
                                       for g in range(self.G)), num_blocks=self.nb)
        self.ts = TrackerSet(layout)
        self.model = Model(self.G)
        self.views: list = []       # (array, ids it showed when taken)

    def table(self, *, none_groups=False, r=None):
        d = self.d
        ids = based_table(d, self.model, r, self.G) if r is not None and d.bool() else None
        obj, meaning, canonical = table(d, self.G, self.nb or 64, max_len=6,
                                        none_groups=none_groups, ids=ids)
        ok = meaning is not None and all(ids_ok(m, self.hi) for m in meaning)
        return obj, (meaning if ok else None), canonical

    def run(self) -> None:
        d = self.d
        for _ in range(d.int(1, 16)):
            before = lib_state(self.ts)
            expect(before == self.model.state(), lambda: f"diverged: {before} vs "
                   f"{self.model.state()}")
            op = d.pick(("add", "add", "append", "append", "update", "replace", "preempt",
                         "finish", "mark", "step", "step", "lists", "flat", "view", "state",
                         "copy"))
            trial = copy.deepcopy(self.model)
            ok, want_ok, canonical, got, want = getattr(self, "op_" + op)(trial)
            if ok:
                expect(want_ok, lambda: f"{op}: accepted an invalid call -> {got!r}")
                expect(want is None or got == want, lambda: f"{op}: {got!r}, want {want!r}")
                self.model = trial
            else:
                expect(not (want_ok and canonical), lambda: f"{op}: refused a valid call: {got}")
                after = lib_state(self.ts)
                expect(after == before, lambda: f"{op} failed but changed the set: {before} -> "
                       f"{after}")
            for a, ids in self.views:
                expect(a.tolist() == ids, lambda: f"a view changed: {ids} -> {a.tolist()}")

    # each op_: (ok, should succeed, canonical input, result, expected result or None)
    def _model(self, fn):
        try:
            return True, fn()
        except oracle_core.OracleError:
            return False, None

    def op_add(self, m: Model):
        d, r = self.d, rid(self.d)
        n = d.token() if d.chance(4) else d.int(0, 100)
        obj, meaning, canonical = self.table()
        ok, got = call(self.ts.add, r, obj, num_prompt_tokens=n)
        want_ok = hashable(r) and token_ok(n) and meaning is not None
        if want_ok:
            want_ok, _ = self._model(lambda: m.t.add(r, meaning))
            m.prompt[r] = int(n) if want_ok else None
        return ok, want_ok, canonical, got, None

    def op_append(self, m: Model):
        d, r = self.d, rid(self.d)
        if d.chance(6):
            obj, meaning, canonical = None, None, True
            valid = True
        else:
            obj, meaning, canonical = self.table(none_groups=True)
            valid = meaning is not None
        ok, got = call(self.ts.append, r, obj)
        want_ok = valid and hashable(r) and r in m.t.reqs
        want = None
        if want_ok:
            want_ok, _ = self._model(lambda: m.t.append(r, meaning))
            want = tuple(len(x) for x in m.t.reqs[r]["t"]) if want_ok else None
        return ok, want_ok, canonical, got, want

    def op_update(self, m: Model):
        r = rid(self.d)
        obj, meaning, canonical = self.table(r=r if hashable(r) else None)
        ok, got = call(self.ts.update_after_alloc, r, obj)
        want_ok = meaning is not None and hashable(r) and r in m.t.reqs
        want = None
        if want_ok:
            want_ok, added = self._model(lambda: m.t.update_after_alloc(r, meaning))
            want = tuple(added) if want_ok else None
        return ok, want_ok, canonical, got, want

    def op_replace(self, m: Model):
        r = rid(self.d)
        obj, meaning, canonical = self.table(r=r if hashable(r) else None)
        ok, got = call(self.ts.replace, r, obj)
        want_ok = meaning is not None and hashable(r) and r in m.t.reqs
        if want_ok:
            m.t.replace(r, meaning)
        return ok, want_ok, canonical, got, None

    def op_preempt(self, m: Model):
        r = rid(self.d)
        ok, got = call(self.ts.preempt, r)
        want_ok = hashable(r) and r in m.t.reqs
        if want_ok:
            m.t.preempt(r)
        return ok, want_ok, True, got, None

    def op_finish(self, m: Model):
        r = rid(self.d)
        ok, got = call(self.ts.finish, r)
        want_ok = hashable(r) and r in m.t.reqs
        want = None
        if want_ok:
            want = m.t.finish(r)
            del m.prompt[r]
        if ok:
            got = [x.tolist() for x in got]
        return ok, want_ok, True, got, want

    def op_mark(self, m: Model):
        d, r = self.d, rid(self.d)
        name = d.pick(MARKS)
        key = {"scheduled_tokens": "s", "saved_tokens": "v", "loaded_tokens": "l"}[name]
        cur = m.t.reqs[r][key] if hashable(r) and r in m.t.reqs else 0
        n = d.token() if d.chance(3) else max(0, cur + d.int(-2, 50))
        ok, got = call(getattr(self.ts, "set_" + name), r, n)
        want_ok = hashable(r) and r in m.t.reqs and token_ok(n)
        if want_ok:
            want_ok, _ = self._model(lambda: m.t.set_mark(r, key, int(n)))
        return ok, want_ok, True, got, None

    def op_step(self, m: Model):
        d = self.d
        finished = [rid(d) for _ in range(d.int(0, 2))]
        preempted = [rid(d) for _ in range(d.int(0, 2))]
        new, cached, valid, canonical = [], [], True, True
        for _ in range(d.int(0, 2)):
            obj, meaning, c = self.table()
            r = rid(d)
            new.append((r, obj) if not d.chance(30) else (r,))
            valid = valid and meaning is not None and len(new[-1]) == 2
            canonical = canonical and c
            new[-1] = (new[-1], meaning)
        for _ in range(d.int(0, 3)):
            r = rid(d)
            resumed = d.chance(3)
            if d.chance(5):
                obj, meaning, c = None, None, True
                valid = valid and not resumed
            else:
                obj, meaning, c = self.table(none_groups=not resumed, r=r if hashable(r) else None)
                valid = valid and meaning is not None
            canonical = canonical and c
            cached.append(((r, obj, resumed), meaning))
        all_ids = finished + preempted + [x[0][0] for x in new] + [x[0][0] for x in cached]
        ok, got = call(self.ts.apply_step, [x[0] for x in new], [x[0] for x in cached],
                       finished, preempted=preempted)
        want_ok = valid and all(hashable(r) for r in all_ids)
        want = None
        if want_ok:
            want_ok, want = self._model(lambda: m.t.apply_step(
                [(x[0][0], x[1]) for x in new], [(x[0][0], x[1], x[0][2]) for x in cached],
                finished, preempted))
            for r in finished if want_ok else ():
                m.prompt.pop(r, None)
            for r, _ in (x[0] for x in new) if want_ok else ():
                m.prompt[r] = 0
        if ok:
            got = {r: [x.tolist() for x in t] for r, t in got.items()}
        return ok, want_ok, canonical, got, want

    def _lists(self):
        """(req_ids, new_block_ids, meaning per request or None, canonical)."""
        d, G = self.d, self.G
        req_ids = [rid(d) for _ in range(d.int(0, 3))]
        entries, meanings, canonical = [], [], True
        for _ in range(len(req_ids) + (d.pick((-1, 1)) if d.chance(20) else 0)):
            if d.chance(5):
                entries.append(None)
                meanings.append(None)
                continue
            groups, mean = [], []
            for _g in range(G if not d.chance(20) else d.int(0, G + 1)):
                ids = [d.block_id(self.nb or 64) for _ in range(d.int(0, 4))]
                obj, meaning, form = group(d, 64, ids=ids) if d.chance(6) else (ids, ids, "list")
                groups.append(obj)
                mean.append(meaning)
                canonical = canonical and form in ("list", "tuple")
            entries.append(groups if d.bool() else tuple(groups))
            meanings.append(mean)
        return req_ids, entries, meanings, canonical

    def _lists_model(self, m: Model, req_ids, meanings):
        if len(req_ids) != len(meanings) or not all(hashable(r) for r in req_ids):
            return False
        for mean in meanings:
            if mean is not None and (len(mean) != self.G or
                                     not all(ids_ok(x, self.hi) for x in mean)):
                return False
        ok, _ = self._model(lambda: [m.t.append(r, mean) for r, mean in zip(req_ids, meanings)])
        return ok

    def op_lists(self, m: Model):
        req_ids, entries, meanings, canonical = self._lists()
        ok, got = call(self.ts.apply_step_lists, req_ids, entries)
        return ok, self._lists_model(m, req_ids, meanings), canonical, got, None

    def op_flat(self, m: Model):
        d = self.d
        req_ids, _, meanings, _ = self._lists()
        meanings = [mean if mean is not None and len(mean) == self.G and
                    all(x is not None for x in mean) else [[]] * self.G for mean in meanings]
        meanings = (meanings + [[[]] * self.G] * len(req_ids))[:len(req_ids)]
        flat = [v for mean in meanings for x in mean for v in x]
        counts = [len(x) for mean in meanings for x in mean]
        ids = np.array([v if -2**31 <= v <= INT32_MAX else -1 for v in flat], dtype=np.int32)
        offsets = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(np.int64)
        fault = d.pick(("none",) * 6 + ("ids64", "off32", "strided", "len", "start", "down",
                                          "listids"))
        if fault == "strided" and ids.size < 2 or fault == "down" and len(offsets) < 3:
            fault = "none"      # a 0/1-element view is contiguous; nothing to break
        if fault == "ids64":
            ids = ids.astype(np.int64)
        elif fault == "off32":
            offsets = offsets.astype(np.int32)
        elif fault == "strided":
            ids = np.repeat(ids, 2)[::2]
        elif fault == "len":
            offsets = offsets[:-1]
        elif fault == "start":
            offsets = offsets + 1
        elif fault == "down":
            offsets[1] = offsets[-1] + 1
        elif fault == "listids":
            ids = ids.tolist()
        ok, got = call(self.ts.apply_step_flat, req_ids, ids, offsets)
        exact = [[[v if -2**31 <= v <= INT32_MAX else -1 for v in x] for x in mean]
                 for mean in meanings]
        want_ok = fault == "none" and self._lists_model(m, req_ids, exact)
        return ok, want_ok, True, got, None

    def op_view(self, m: Model):
        d, r = self.d, rid(self.d)
        copy_ = d.bool()
        ok, got = call(self.ts.block_ids, r, copy=copy_)
        want_ok = hashable(r) and r in m.t.reqs
        want = [list(x) for x in m.t.reqs[r]["t"]] if want_ok else None
        if ok:
            if not copy_:
                expect(all(not a.flags.writeable for a in got), "a view is writeable")
                self.views.extend((a, a.tolist()) for a in got)
                del self.views[:-8]
            got = [a.tolist() for a in got]
        return ok, want_ok, True, got, want

    def op_state(self, m: Model):
        d, r = self.d, rid(self.d)
        st = d.pick(("NEW", "WAITING_FOR_REMOTE", "RUNNING", "PREEMPTED", 4, 9, "RUNNING!", None))
        arg = RequestState[st] if st in STATES else st
        ok, got = call(self.ts.set_state, r, arg)
        want_ok = hashable(r) and r in m.t.reqs and st in ("NEW", "WAITING_FOR_REMOTE",
                                                           "RUNNING")
        if want_ok:
            m.t.reqs[r]["state"] = STATES[st]
        return ok, want_ok, True, got, None

    def op_copy(self, m: Model):
        how = self.d.pick((copy.copy, copy.deepcopy, lambda t: pickle.loads(pickle.dumps(t))))
        other = how(self.ts)
        expect(lib_state(other) == lib_state(self.ts), "a copy differs")
        if self.d.bool():
            self.ts = other      # go on with the copy (the original must not matter)
        return True, True, True, None, None


def TestOneInput(data: bytes) -> None:
    d = Draw(data)
    which = d.int(0, 7)
    if which == 0:
        check_table(d)
    elif which == 1:
        check_masks(d)
    elif which == 2:
        check_objects(d)
    else:
        Tracker(d).run()


if __name__ == "__main__":
    instrument_harness(globals())
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()
