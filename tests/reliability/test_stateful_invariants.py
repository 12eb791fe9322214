"""Random-operation stateful test: TrackerSet + BlockPool model + InvariantChecker.

Every step applies a random scheduler operation (add with prefix-cache sharing, append,
in-place nulling of out-of-window blocks, preempt/resume, finish, watermark moves, clipped
transfers through a TransferPlan, and adversarial bad calls) and then checks the invariants
of invariants. Bad calls must raise a clear error and leave the tracker unchanged."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hmacore.errors import BlockTableError, HmacoreError
from invariants import BlockPool, CheckedStore, InvariantChecker, InvariantError, null_ranges
from hmacore.plan import TransferPlan
from hmacore.spec import GroupKind, GroupSpec, KVLayout
from hmacore.tables import TrackerSet
from hmacore.windows import clip_tracked
from rel_common import EXAMPLES, call, tracker_snapshot

pytestmark = pytest.mark.reliability

NB = 160
LAYOUT = KVLayout(groups=(GroupSpec(GroupKind.FULL, 16, ("f.0", "f.1")),
                          GroupSpec(GroupKind.SLIDING_WINDOW, 16, ("s.0",), sliding_window=32),
                          GroupSpec(GroupKind.MAMBA, 16, ("m.0",))), num_blocks=NB)
G = LAYOUT.num_groups
STATS = {"steps": 0, "bad_calls": 0, "transfers": 0, "released": 0, "checks": 0}


class TrackerMachine(RuleBasedStateMachine):
    @initialize(seed=st.integers(0, 2**32 - 1))
    def setup(self, seed):
        self.ts = TrackerSet(LAYOUT)
        self.pool = BlockPool(NB, seed)
        self.chk = InvariantChecker(G, NB)
        self.plan = TransferPlan.from_layout(LAYOUT, NB, page_bytes=64)
        self.next_id = 0
        self.finished = []

    def _live(self):
        return sorted(self.ts, key=str)

    @rule(data=st.data(), n=st.lists(st.integers(0, 4), min_size=G, max_size=G))
    def add(self, data, n):
        if self.pool.num_free < sum(n) + 1:
            return
        table = []
        live = self._live()
        donor = data.draw(st.sampled_from(live)) if live and data.draw(st.booleans()) else None
        for g in range(G):
            shared = np.zeros(0, np.int32)
            if donor is not None and g == 0:   # prefix-cache hit: share the donor's FA prefix
                d = self.ts.block_ids(donor)[0]
                d = d[d != 0]
                shared = d[:data.draw(st.integers(0, len(d)))]
                self.pool.share(0, shared)
            table.append(np.concatenate([shared, self.pool.allocate(g, n[g])]).astype(np.int32))
        r = f"r{self.next_id}"
        self.next_id += 1
        form = data.draw(st.sampled_from(["arrays", "lists"]))
        self.ts.add(r, table if form == "arrays" else [t.tolist() for t in table])
        self.chk.forget(r)

    @precondition(lambda self: len(self.ts) > 0)
    @rule(data=st.data(), n=st.lists(st.integers(0, 3), min_size=G, max_size=G))
    def append(self, data, n):
        r = data.draw(st.sampled_from(self._live()))
        if int(self.ts.state(r)) == 3 or self.pool.num_free < sum(n):
            return
        self.ts.append(r, [self.pool.allocate(g, n[g]).tolist() for g in range(G)])

    @precondition(lambda self: len(self.ts) > 0)
    @rule(data=st.data())
    def null_out_of_window(self, data):
        """vLLM frees sliding-window blocks in place: the full table shows 0 there."""
        r = data.draw(st.sampled_from(self._live()))
        full = list(self.ts.block_ids(r))
        sw = full[1].copy()
        real = np.flatnonzero(sw)
        if real.size < 3:
            return
        k = int(real[0])
        freed = sw[k:k + 1].copy()
        sw[k] = 0
        full[1] = sw
        self.ts.update_after_alloc(r, full)
        self.pool.free(1, freed)

    @precondition(lambda self: len(self.ts) > 0)
    @rule(data=st.data())
    def preempt_and_resume(self, data):
        r = data.draw(st.sampled_from(self._live()))
        old = self.ts.block_ids(r)
        self.ts.preempt(r)
        for g, ids in enumerate(old):
            self.pool.free(g, ids)
        self.chk.note_preempted(r)
        if data.draw(st.booleans()) and self.pool.num_free >= 3 * G:
            self.ts.replace(r, [self.pool.allocate(g, 2) for g in range(G)])

    @precondition(lambda self: len(self.ts) > 0)
    @rule(data=st.data())
    def finish(self, data):
        r = data.draw(st.sampled_from(self._live()))
        tables = self.ts.finish(r)
        STATS["released"] += self.chk.release(r, tables, self.pool)
        self.finished.append(r)

    @precondition(lambda self: len(self.ts) > 0)
    @rule(data=st.data(), which=st.sampled_from(["scheduled", "saved", "loaded"]),
          step=st.integers(0, 64))
    def advance_mark(self, data, which, step):
        r = data.draw(st.sampled_from(self._live()))
        cur = getattr(self.ts, f"{which}_tokens")(r)
        getattr(self.ts, f"set_{which}_tokens")(r, cur + step)

    @precondition(lambda self: len(self.ts) > 0)
    @rule(data=st.data())
    def transfer(self, data):
        """Clip -> strip nulls -> desc ids; null ids never reach the plan."""
        reqs = data.draw(st.lists(st.sampled_from(self._live()), min_size=1, max_size=3))
        for clipped in clip_tracked(self.ts, reqs):
            ids = [c[c != 0] for c in clipped]
            self.chk.check_transfer(ids)
            d = self.plan.desc_ids(ids)
            assert d.size == self.plan.count_desc_ids(ids)
            if any((c == 0).any() for c in clipped):
                with pytest.raises(InvariantError):
                    self.chk.check_transfer(clipped)
                ok, _ = call(self.plan.desc_ids, [np.ascontiguousarray(c) for c in clipped])
                assert not ok, "desc_ids accepted a null block"
            STATS["transfers"] += 1

    @rule(data=st.data())
    def bad_call(self, data):
        """Adversarial calls: a clear error, and nothing changes."""
        live = self._live()
        r = data.draw(st.sampled_from(live)) if live else "ghost"
        kind = data.draw(st.sampled_from(["unknown", "finished_twice", "backwards", "bad_id",
                                          "groups", "shrink", "change", "dup_add", "unhashable"]))
        before = tracker_snapshot(self.ts)
        free_before = self.pool.refs.copy()
        if kind == "unknown":
            ok, e = call(self.ts.append, "ghost", [[1]] * G)
        elif kind == "finished_twice" and self.finished:
            ok, e = call(self.ts.finish, self.finished[-1])
        elif kind == "backwards" and live and self.ts.saved_tokens(r) > 0:
            ok, e = call(self.ts.set_saved_tokens, r, self.ts.saved_tokens(r) - 1)
        elif kind == "bad_id" and live:
            bad = data.draw(st.sampled_from([-1, NB, 2**31, 2**40, True, 1.5]))
            ok, e = call(self.ts.append, r, [[1], [bad], []])
        elif kind == "groups" and live:
            ok, e = call(self.ts.append, r, [[1]] * (G + 1))
        elif kind == "shrink" and live and any(self.ts.num_blocks(r)):
            full = [x[:-1] if x.size else x for x in self.ts.block_ids(r)]
            ok, e = call(self.ts.update_after_alloc, r, full)
        elif kind == "change" and live and self.ts.num_blocks(r)[0]:
            full = list(self.ts.block_ids(r))
            full[0] = full[0].copy()
            full[0][0] = (int(full[0][0]) % (NB - 1)) + 1 if full[0][0] == 0 else \
                (int(full[0][0]) % (NB - 2)) + 2 if full[0][0] == 1 else 1
            ok, e = call(self.ts.update_after_alloc, r, full)
        elif kind == "dup_add" and live:
            ok, e = call(self.ts.add, r, [[]] * G)
        elif kind == "unhashable":
            ok, e = call(self.ts.finish, ["list"])
        else:
            return
        assert not ok, f"{kind} accepted"
        assert isinstance(e, (HmacoreError, ValueError, TypeError))
        assert tracker_snapshot(self.ts) == before, f"{kind}: half-applied update"
        assert (self.pool.refs == free_before).all()
        STATS["bad_calls"] += 1

    @invariant()
    def invariants_hold(self):
        if not hasattr(self, "ts"):
            return
        self.chk.check_tracker(self.ts, self.pool)
        STATS["steps"] += 1
        STATS["checks"] += 1

    def teardown(self):
        if not hasattr(self, "ts"):
            return
        for r in self._live():   # everything is released exactly once, the pool ends empty
            tables = self.ts.finish(r)
            STATS["released"] += self.chk.release(r, tables, self.pool)
        assert (self.pool.refs == 0).all() and self.pool.num_free == NB - 1


TestTrackerMachine = TrackerMachine.TestCase
TestTrackerMachine.settings = settings(max_examples=max(20, EXAMPLES // 3),
                                       stateful_step_count=40, deadline=None)


# -- the checker can fail: every invariant has a violation it catches ---------------------
def test_checker_catches_violations():
    chk = InvariantChecker(2, 10)
    pool = BlockPool(10)
    a = pool.allocate(0, 2)
    chk.check_tables({"r": (a, np.zeros(0, np.int32))}, pool)
    with pytest.raises(InvariantError, match="group"):         # same id in two groups
        chk.check_tables({"r": (a, np.zeros(0, np.int32)), "s": (np.zeros(0, np.int32), a[:1])})
    with pytest.raises(InvariantError, match="appears"):       # twice in one table
        chk.check_tables({"r": (np.array([a[0], a[0]]), np.zeros(0, np.int32))})
    with pytest.raises(InvariantError, match="references"):    # leak: pool holds, no table
        chk.check_tables({}, pool)
    chk.check_marks("r", (5, 3, 0))
    with pytest.raises(InvariantError, match="backwards"):
        chk.check_marks("r", (4, 3, 0))
    chk.release("r", (a, np.zeros(0, np.int32)), pool)
    with pytest.raises(InvariantError, match="twice"):
        chk.release("r", (a, np.zeros(0, np.int32)), pool)
    with pytest.raises(InvariantError, match="does not hold"):
        pool.free(0, a)
    with pytest.raises(InvariantError, match="null block"):
        chk.check_transfer([np.array([3, 0, 4])])


def test_checked_store_refuses_null_block_puts():
    from hmacore.transport.store import EmbeddedStore, GroupSegments
    mem = np.zeros((8, 64), np.uint8)
    seg = GroupSegments.from_arrays([mem])
    inner = EmbeddedStore(1 << 16)
    inner.register(mem.ctypes.data, mem.nbytes)
    store = CheckedStore(inner, null_ranges([seg, None]))
    assert store.batch_put(["k1"], seg.parts([3])) == [0]
    with pytest.raises(InvariantError, match="null block"):
        store.batch_put(["k0"], [[(mem.ctypes.data + 10, 8)]])
    assert inner.batch_exists(["k0", "k1"]) == [0, 1]   # nothing written for the bad put
    with pytest.raises(BlockTableError.__mro__[2] if False else Exception):
        seg.parts([0])                                   # GroupSegments refuses block 0 too


def test_report_stateful_figures():
    """Runs last in this file: prints what the machine did (for docs/reliability.md)."""
    print(f"\nstateful: {STATS}")
