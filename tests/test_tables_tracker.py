"""TrackerSet: scheduler-contract unit tests (vllm-hma.md §1.6, §11.3, §13.1 item 10, §13.2
'Trackers') and a stateful differential test against the dict-of-lists oracle, including bad
operations that must raise and leave the set unchanged."""
import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from hmacore.errors import BlockTableError, HmacoreError, TrackerStateError
from hmacore.presets import get_preset
from hmacore.spec import GroupKind, GroupSpec, KVLayout
from hmacore.tables import RequestState, TrackerSet
from hmacore.windows import clip_to_window, clip_tracked, clip_tracked_spans
from tests import oracle_core as oracle

NB = 64


def lists(t):
    return [x.tolist() for x in t]


def snapshot(ts):
    return {r: (lists(ts.block_ids(r)), int(ts.state(r)), ts.scheduled_tokens(r),
                ts.saved_tokens(r), ts.loaded_tokens(r)) for r in ts}


@pytest.fixture
def ts():
    return TrackerSet(get_preset("gpt-oss-120b", num_blocks=NB))


# -- unit tests -------------------------------------------------------------------------
def test_add_copies_and_lifecycle(ts):
    a = np.array([1, 2], dtype=np.int32)
    ts.add("r", (a, [3]), num_prompt_tokens=40)
    a[0] = 9  # caller's array is not aliased
    assert lists(ts.block_ids("r")) == [[1, 2], [3]]
    assert ts.state("r") == RequestState.NEW and ts.num_prompt_tokens("r") == 40
    assert len(ts) == 1 and "r" in ts and "x" not in ts and [] not in ts
    out = ts.finish("r")
    assert lists(out) == [[1, 2], [3]] and all(x.dtype == np.int32 for x in out)
    assert len(ts) == 0 and "r" not in ts
    with pytest.raises(TrackerStateError, match="'r' is not tracked"):
        ts.finish("r")


def test_block_ids_views_are_readonly(ts):
    ts.add("r", ([1, 2], [3]))
    v = ts.block_ids("r", copy=False)
    assert lists(v) == [[1, 2], [3]]
    with pytest.raises(ValueError):
        v[0][0] = 5
    c = ts.block_ids("r")
    c[0][0] = 5  # copies are the caller's
    assert lists(ts.block_ids("r")) == [[1, 2], [3]]


def test_duplicate_add_raises_and_changes_nothing(ts):
    ts.add("r", ([1], [2]))
    with pytest.raises(TrackerStateError, match="already tracked"):
        ts.add("r", ([5], [6]))
    assert lists(ts.block_ids("r")) == [[1], [2]]


def test_append_none_and_empty_groups_are_noops(ts):
    ts.add("r", ([1], [2]))
    assert ts.append("r", None) == (1, 1)
    assert ts.append("r", ([], [])) == (1, 1)
    assert ts.append("r", (None, [7])) == (1, 2)
    assert ts.state("r") == RequestState.RUNNING
    with pytest.raises(BlockTableError, match="new_block_ids has 1 groups, the layout has 2"):
        ts.append("r", ([3],))
    assert lists(ts.block_ids("r")) == [[1], [2, 7]]


def test_double_update_after_alloc_appends_only_suffix(ts):
    ts.add("r", ([], []))
    assert ts.update_after_alloc("r", ([0, 0, 5], [1, 2, 3])) == (3, 3)
    assert ts.update_after_alloc("r", ([0, 0, 5], [1, 2, 3])) == (0, 0)
    assert ts.update_after_alloc("r", ([0, 0, 5, 6], [1, 2, 3])) == (1, 0)
    assert lists(ts.block_ids("r")) == [[0, 0, 5, 6], [1, 2, 3]]


def test_update_after_alloc_nulls_freed_positions(ts):
    ts.add("r", ([4, 5, 6], [1]))
    assert ts.update_after_alloc("r", ([0, 0, 6, 7], [1])) == (1, 0)
    assert lists(ts.block_ids("r")) == [[0, 0, 6, 7], [1]]


@pytest.mark.parametrize("full,msg", [
    (([4, 9, 6], [1]), "group 0, index 1 of 'r': tracked block 5 changed to 9"),
    (([4, 5, 6], [0, 3]), None),  # legal: 1 -> 0, append 3
    (([4, 5], [1]), "group 0 of 'r' has 2 blocks but 3 are tracked"),
    (([4, 5, 6], [1], [2]), "full_table has 3 groups"),
    (([4, 5, 6], [1, NB]), "full_table: group 1, index 1: block id 64 is >= num_blocks"),
])
def test_update_after_alloc_rejects_illegal_changes_atomically(ts, full, msg):
    ts.add("r", ([4, 5, 6], [1]))
    before = snapshot(ts)
    if msg is None:
        assert ts.update_after_alloc("r", full) == (0, 1)
        return
    with pytest.raises(BlockTableError, match=msg):
        ts.update_after_alloc("r", full)
    assert snapshot(ts) == before


def test_null_may_not_become_real(ts):
    ts.add("r", ([0, 5], [1]))
    with pytest.raises(BlockTableError, match="tracked block 0 changed to 3"):
        ts.update_after_alloc("r", ([3, 5], [1]))


def test_preempt_replace_resume(ts):
    ts.add("r", ([1, 2], [3]))
    ts.set_scheduled_tokens("r", 32)
    ts.set_saved_tokens("r", 16)
    ts.set_loaded_tokens("r", 16)
    ts.preempt("r")
    assert ts.state("r") == RequestState.PREEMPTED
    assert ts.num_blocks("r") == (0, 0)
    assert (ts.scheduled_tokens("r"), ts.saved_tokens("r"), ts.loaded_tokens("r")) == (0, 0, 0)
    with pytest.raises(TrackerStateError, match="PREEMPTED"):
        ts.append("r", ([4], []))
    ts.replace("r", ([7, 8, 9], [10]))
    assert ts.state("r") == RequestState.RUNNING
    assert lists(ts.block_ids("r")) == [[7, 8, 9], [10]]
    ts.append("r", ([11], []))
    assert ts.num_blocks("r") == (4, 1)


def test_watermarks_never_run_backwards(ts):
    ts.add("r", ([], []))
    ts.set_scheduled_tokens("r", 10)
    ts.set_scheduled_tokens("r", 10)
    with pytest.raises(TrackerStateError, match="scheduled_tokens of 'r' cannot run backwards: 10 -> 9"):
        ts.set_scheduled_tokens("r", 9)
    for bad in (-1, True, 1.5, None):
        with pytest.raises(TrackerStateError, match="saved_tokens must be an int >= 0"):
            ts.set_saved_tokens("r", bad)
    assert ts.scheduled_tokens("r") == 10 and ts.saved_tokens("r") == 0
    with pytest.raises(TrackerStateError, match="num_prompt_tokens must be an int >= 0"):
        ts.add("q", ([], []), num_prompt_tokens=-1)
    assert "q" not in ts


def test_set_state(ts):
    ts.add("r", ([], []))
    ts.set_state("r", RequestState.WAITING_FOR_REMOTE)
    assert ts.state("r") == RequestState.WAITING_FOR_REMOTE
    for bad, msg in ((RequestState.FINISHED, "set by preempt"), (RequestState.PREEMPTED, "set by"),
                     (17, "state must be a RequestState")):
        with pytest.raises(TrackerStateError, match=msg):
            ts.set_state("r", bad)
    assert ts.state("r") == RequestState.WAITING_FOR_REMOTE


def test_unknown_and_unhashable_ids(ts):
    for op in (ts.block_ids, ts.num_blocks, ts.state, ts.preempt, ts.finish, ts.scheduled_tokens):
        with pytest.raises(TrackerStateError, match="not tracked"):
            op("nope")
    with pytest.raises(TrackerStateError, match="req_id must be hashable"):
        ts.block_ids(["x"])
    with pytest.raises(TrackerStateError, match="not tracked"):
        ts.append("nope", None)
    with pytest.raises(TrackerStateError, match="not tracked"):
        ts.update_after_alloc("nope", ([], []))


def test_bad_tables_on_add(ts):
    for bad, msg in ((([1],), "block_ids has 1 groups"), (([-1], []), "block id -1 is negative"),
                     (([NB], []), "is >= num_blocks"), (([1.0], []), "must be integers"),
                     ((np.zeros((2, 1), np.int32)), "2-D arrays")):
        with pytest.raises(BlockTableError, match=msg):
            ts.add("r", bad)
    assert len(ts) == 0


def test_apply_step_golden(ts):
    ts.add("a", ([1], [2]))
    ts.add("b", ([3], [4]))
    ts.add("c", ([5], [6]))
    ts.preempt("c")
    done = ts.apply_step(new=[("d", ([7, 8], [9]))],
                         cached=[("a", ([10], None), False), ("b", None, False),
                                 ("c", ([11], [12]), True)],
                         finished=["b"][:0])
    assert done == {}
    assert lists(ts.block_ids("a")) == [[1, 10], [2]]
    assert lists(ts.block_ids("c")) == [[11], [12]] and ts.state("c") == RequestState.RUNNING
    assert lists(ts.block_ids("d")) == [[7, 8], [9]] and ts.state("d") == RequestState.NEW
    done = ts.apply_step(finished=["a"], preempted=["b"])
    assert list(done) == ["a"] and lists(done["a"]) == [[1, 10], [2]]
    assert ts.state("b") == RequestState.PREEMPTED and "a" not in ts


@pytest.mark.parametrize("kw,exc,msg", [
    ({"new": [("a", ([1], [2]))]}, TrackerStateError, "new: req_id 'a' is already tracked"),
    ({"new": [("z", ([1], [2])), ("z", ([1], [2]))]}, TrackerStateError, "already tracked"),
    ({"new": [("z", ([1],))]}, BlockTableError, "new\\['z'\\] has 1 groups"),
    ({"cached": [("q", None, False)]}, TrackerStateError, "cached: req_id 'q' is not tracked"),
    ({"cached": [("a", None, True)]}, BlockTableError, "resumed request needs its full table"),
    ({"cached": [("a", ([-1], [2]), False)]}, BlockTableError, "block id -1 is negative"),
    ({"finished": ["a", "a"]}, TrackerStateError, "finished: req_id 'a' is not tracked"),
    ({"finished": ["a"], "cached": [("a", None, False)]}, TrackerStateError, "not tracked"),
    ({"preempted": ["a"], "cached": [("a", ([3], []), False)]}, TrackerStateError, "PREEMPTED"),
    ({"preempted": ["q"]}, TrackerStateError, "preempted: req_id 'q' is not tracked"),
    ({"new": [("z",)]}, TrackerStateError, "items must be"),
    ({"cached": [("a", None)]}, TrackerStateError, "items must be"),
])
def test_apply_step_is_all_or_nothing(ts, kw, exc, msg):
    ts.add("a", ([1], [2]))
    ts.add("b", ([3], [4]))
    before = snapshot(ts)
    kw = {"new": [("ok", ([5], [6]))], "cached": [("b", ([7], []), False)], "finished": [],
          **{k: v + ([] if k != "cached" else []) for k, v in kw.items()}}
    with pytest.raises(exc, match=msg):
        ts.apply_step(**kw)
    assert snapshot(ts) == before


def test_single_group_flat_tables():
    ts = TrackerSet(get_preset("llama-3-70b", num_blocks=NB))
    ts.add("r", [1, 2, 3])
    ts.append("r", [4])
    assert ts.update_after_alloc("r", [1, 2, 3, 4, 5]) == (1,)
    assert lists(ts.finish("r")) == [[1, 2, 3, 4, 5]]


def test_clip_tracked():
    ts = TrackerSet(KVLayout(groups=(GroupSpec(GroupKind.FULL, 16),
                                     GroupSpec(GroupKind.SLIDING_WINDOW, 16, sliding_window=32),
                                     GroupSpec(GroupKind.MAMBA, 16, num_speculative_blocks=1))))
    ts.add("a", ([1, 2, 3, 4], [0, 0, 5, 6, 7, 8], [9, 10, 11]))
    ts.add("b", ([], [], []))
    a, b = clip_tracked(ts, ["a", "b"])
    assert lists(a) == [[1, 2, 3, 4], [6, 7, 8], [10]] and lists(b) == [[], [], []]
    assert lists(clip_tracked(ts, ["a"], clip_state=False)[0])[2] == [9, 10, 11]
    with pytest.raises(TrackerStateError, match="'zz' is not tracked"):
        clip_tracked(ts, ["a", "zz"])
    with pytest.raises(TypeError, match="trackers must be a TrackerSet"):
        clip_tracked({}, ["a"])


def test_rejects_non_layout():
    with pytest.raises(TypeError, match="layout must be a KVLayout"):
        TrackerSet(2)


def test_large_tables_grow():
    ts = TrackerSet(get_preset("deepseek-v4"))
    for step in range(300):
        ts.append("r", None) if "r" in ts else ts.add("r", ([], [], [], [], []))
        ts.append("r", ([step], [step, step + 1], [], [1] * 3, list(range(step % 7))))
    assert ts.num_blocks("r") == (300, 600, 0, 900, sum(s % 7 for s in range(300)))
    assert ts.block_ids("r")[0].tolist() == list(range(300))


# -- stateful differential test ---------------------------------------------------------
LAYOUTS = {
    "llama": get_preset("llama-3-70b", num_blocks=NB),
    "gpt-oss": get_preset("gpt-oss-120b", num_blocks=NB),
    "dsv4": get_preset("deepseek-v4", num_blocks=NB),
    "qwen3-next": get_preset("qwen3-next-80b", num_blocks=NB),
}
REQS = ["r0", "r1", "r2", "r3", 7]
ids_st = st.lists(st.integers(0, NB - 1), max_size=6)


class TrackerMachine(RuleBasedStateMachine):
    @initialize(name=st.sampled_from(sorted(LAYOUTS)))
    def setup(self, name):
        self.layout = LAYOUTS[name]
        self.G = self.layout.num_groups
        self.lib = TrackerSet(self.layout)
        self.ora = oracle.Trackers(self.G)

    def _table(self, data, allow_none=False):
        groups = []
        for _ in range(self.G):
            if allow_none and data.draw(st.booleans()):
                groups.append(None)
            else:
                groups.append(data.draw(ids_st))
        return groups

    def _form(self, data, t):
        """The same table as lists (C fast path) or as NumPy arrays (general path)."""
        form = data.draw(st.sampled_from(["list", "tuple", "int32", "int64"]))
        if form == "list" or t is None:
            return tuple(t) if t is not None else None
        conv = {"tuple": tuple, "int32": lambda x: np.array(x, dtype=np.int32),
                "int64": lambda x: np.array(x, dtype=np.int64)}[form]
        return tuple(None if x is None else conv(x) for x in t)

    def _both(self, lib_fn, ora_fn):
        """Run on both; both must fail or both succeed; a failure changes nothing."""
        before = snapshot(self.lib)
        try:
            want = ora_fn()
            ora_err = None
        except oracle.OracleError as e:
            ora_err = e
        try:
            got = lib_fn()
            lib_err = None
        except HmacoreError as e:
            lib_err = e
        assert (ora_err is None) == (lib_err is None), (ora_err, lib_err)
        if lib_err is not None:
            assert snapshot(self.lib) == before
            return None
        return got, want

    @rule(r=st.sampled_from(REQS), data=st.data())
    def add(self, r, data):
        t = self._table(data)
        lt = self._form(data, t)
        self._both(lambda: self.lib.add(r, lt), lambda: self.ora.add(r, t))

    @rule(r=st.sampled_from(REQS), data=st.data())
    def append(self, r, data):
        t = None if data.draw(st.booleans()) else self._table(data, allow_none=True)
        lt = self._form(data, t)
        self._both(lambda: self.lib.append(r, lt),
                   lambda: self.ora.append(r, t))

    @rule(r=st.sampled_from(REQS), data=st.data(), bad=st.booleans())
    def update_after_alloc_twice(self, r, data, bad):
        cur = self.ora.reqs.get(r, {"t": [[] for _ in range(self.G)]})["t"]
        full = []
        for g in range(self.G):
            row = [0 if b and data.draw(st.booleans()) else b for b in cur[g]]
            full.append(row + data.draw(ids_st))
        if bad and any(full):
            g = data.draw(st.sampled_from([g for g in range(self.G) if full[g]]))
            kind = data.draw(st.sampled_from(["change", "shrink"]))
            if kind == "shrink" and cur[g]:
                full[g] = full[g][:len(cur[g]) - 1]
            else:
                i = data.draw(st.integers(0, len(full[g]) - 1))
                full[g][i] = (full[g][i] % (NB - 1)) + 1 if i >= len(cur[g]) or cur[g][i] == 0 \
                    else (cur[g][i] % (NB - 1)) + 1
        out = self._both(lambda: self.lib.update_after_alloc(r, tuple(full)),
                         lambda: self.ora.update_after_alloc(r, full))
        if out is not None:
            assert list(out[0]) == out[1]
            # The same full table a second time appends nothing.
            assert self.lib.update_after_alloc(r, tuple(full)) == (0,) * self.G
            assert self.ora.update_after_alloc(r, full) == [0] * self.G

    @rule(r=st.sampled_from(REQS), data=st.data())
    def replace(self, r, data):
        t = self._table(data)
        self._both(lambda: self.lib.replace(r, tuple(t)), lambda: self.ora.replace(r, t))

    @rule(r=st.sampled_from(REQS))
    def preempt(self, r):
        self._both(lambda: self.lib.preempt(r), lambda: self.ora.preempt(r))

    @rule(r=st.sampled_from(REQS))
    def finish(self, r):
        out = self._both(lambda: self.lib.finish(r), lambda: self.ora.finish(r))
        if out is not None:
            assert lists(out[0]) == out[1]

    @rule(r=st.sampled_from(REQS), which=st.sampled_from(["s", "v", "l"]), n=st.integers(0, 300))
    def watermark(self, r, which, n):
        setter = {"s": self.lib.set_scheduled_tokens, "v": self.lib.set_saved_tokens,
                  "l": self.lib.set_loaded_tokens}[which]
        self._both(lambda: setter(r, n), lambda: self.ora.set_mark(r, which, n))

    @rule(r=st.sampled_from(REQS), state=st.sampled_from([0, 1, 2]))
    def set_state(self, r, state):
        def ora():
            self.ora._need(r)["state"] = state
        self._both(lambda: self.lib.set_state(r, RequestState(state)), ora)

    @rule(data=st.data())
    def apply_step(self, data):
        new = [(r, self._table(data)) for r in data.draw(st.lists(st.sampled_from(REQS), max_size=2))]
        cached = []
        for r in data.draw(st.lists(st.sampled_from(REQS), max_size=3)):
            resumed = data.draw(st.booleans())
            ids = self._table(data, allow_none=not resumed) if resumed or data.draw(st.booleans()) \
                else None
            cached.append((r, ids, resumed))
        finished = data.draw(st.lists(st.sampled_from(REQS), max_size=2))
        preempted = data.draw(st.lists(st.sampled_from(REQS), max_size=1))
        out = self._both(
            lambda: self.lib.apply_step([(r, tuple(t)) for r, t in new],
                                        [(r, None if t is None else tuple(t), s) for r, t, s in cached],
                                        finished, preempted=preempted),
            lambda: self.ora.apply_step(new, cached, finished, preempted))
        if out is not None:
            assert {r: lists(v) for r, v in out[0].items()} == out[1]

    @rule(data=st.data())
    def apply_step_flat(self, data):
        # Requests may repeat, be untracked or PREEMPTED (then nothing changes), slots of
        # finished requests are reused by later adds.
        reqs = data.draw(st.lists(st.sampled_from(REQS), max_size=4))
        step = [self._table(data) for _ in reqs]
        ids = np.array([b for t in step for g in t for b in g], dtype=np.int32)
        offs = np.cumsum([0] + [len(g) for t in step for g in t]).astype(np.int64)
        self._both(lambda: self.lib.apply_step_flat(reqs, ids, offs),
                   lambda: self.ora.apply_step([], [(r, t, False) for r, t in zip(reqs, step)], []))

    @rule(r=st.sampled_from(REQS), data=st.data(),
          how=st.sampled_from(["groups", "negative", "pool", "float", "int32"]))
    def bad_table(self, r, data, how):
        t = self._table(data)
        if how == "groups":
            t = t + [[1]]
        else:
            g = data.draw(st.integers(0, self.G - 1))
            t[g] = t[g] + [{"negative": -1, "pool": NB, "float": 1.5, "int32": 2**31}[how]]
        op = data.draw(st.sampled_from(["add", "append", "update", "replace"]))
        before = snapshot(self.lib)
        fn = {"add": self.lib.add, "append": self.lib.append, "update": self.lib.update_after_alloc,
              "replace": self.lib.replace}[op]
        with pytest.raises(HmacoreError):
            fn(r, tuple(t))
        assert snapshot(self.lib) == before

    @invariant()
    def same_state(self):
        if not hasattr(self, "lib"):
            return
        want = {r: (v["t"], v["state"], v["s"], v["v"], v["l"]) for r, v in self.ora.reqs.items()}
        assert snapshot(self.lib) == want
        assert len(self.lib) == len(want)
        # Clipping straight from the tracker's buffers == clipping a copy of the table.
        reqs = list(self.lib)
        for r, views in zip(reqs, clip_tracked(self.lib, reqs)):
            assert lists(views) == lists(clip_to_window(self.lib.block_ids(r), self.layout))
            assert not any(v.flags.writeable for v in views)
        spans = clip_tracked_spans(self.lib, reqs)
        for r, views, sp in zip(reqs, clip_tracked(self.lib, reqs), spans):
            full = self.lib.block_ids(r, copy=False)
            assert [full[g][a:b].tolist() for g, (a, b) in enumerate(sp)] == lists(views)


TestTrackerMachine = TrackerMachine.TestCase
