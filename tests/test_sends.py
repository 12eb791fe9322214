"""SendTracker: unit tests and a Hypothesis differential test against a plain-Python model."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hmacore.errors import LayoutError, TrackerStateError
from hmacore.sends import SendOutcome, SendStatus, SendTracker
from hmacore.tp import GroupSharding, default_shardings

from oracle_tp import dsv4_like_layout, full_sliding_layout


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_release_only_after_every_consumer():
    clk = Clock()
    t = SendTracker([0, 1], clock=clk)
    assert t.add("r", lease_s=5) is None
    assert t.notify("r", 1) is None and t.missing("r") == (0,)
    assert t.notify("r", 1) is None and t.duplicates == 1  # counted once
    assert "r" in t
    assert t.notify("r", 0) == SendOutcome("r", SendStatus.DONE, (0, 1), ())
    assert "r" not in t and len(t) == 0
    assert t.notify("r", 0) is None and t.stray == 1  # late: ignored, not remembered
    assert "r" not in t


def test_lease_expiry_names_missing_consumers():
    clk = Clock()
    t = SendTracker([0, 1, 2], clock=clk)
    t.add("a", lease_s=2)
    t.add("b", lease_s=10)
    t.notify("a", 2)
    clk.t += 1.999
    assert t.poll() == []
    clk.t += 0.001
    assert t.poll() == [SendOutcome("a", SendStatus.EXPIRED, (2,), (0, 1))]
    assert t.requests == ("b",)
    assert t.notify("a", 0) is None and t.stray == 1


def test_bad_input_is_rejected_and_nothing_changes():
    t = SendTracker([0, 2], clock=Clock())
    t.add("r", lease_s=1)
    with pytest.raises(TrackerStateError, match=r"consumer_rank 1 is not an expected consumer .*\[0, 2\]"):
        t.notify("r", 1)
    with pytest.raises(TrackerStateError, match="consumer_rank True"):
        t.notify("r", True)
    assert t.missing("r") == (0, 2)
    with pytest.raises(TrackerStateError, match="already tracked"):
        t.add("r", lease_s=1)
    for bad in (0, -1, float("inf"), float("nan"), "1", True):
        with pytest.raises(TrackerStateError, match="lease_s must be a positive finite"):
            t.add("s", lease_s=bad)
    with pytest.raises(TrackerStateError, match="request_id must be a non-empty str"):
        t.add("", lease_s=1)
    with pytest.raises(TrackerStateError, match="'zz' is not tracked"):
        t.missing("zz")
    assert t.requests == ("r",)
    for bad, msg in (([0, 0], "distinct"), ([-1], "ints >= 0"), ([True], "ints >= 0"),
                     ("01", "sequence of decode ranks"), (3, "sequence of decode ranks")):
        with pytest.raises(LayoutError, match=msg):
            SendTracker(bad)


def test_no_consumers_completes_at_add():
    t = SendTracker([])
    assert t.add("r", lease_s=1) == SendOutcome("r", SendStatus.DONE, (), ())
    assert len(t) == 0


@pytest.mark.parametrize("tp_p,tp_d,h,want", [
    (1, 2, 4, {0: (0, 1)}), (2, 4, 4, {0: (0, 1), 1: (2, 3)}), (2, 1, 4, {0: (0,), 1: (0,)}),
    (4, 1, 2, {0: (0,), 1: (), 2: (0,), 3: ()}), (1, 4, 2, {0: (0, 1, 2, 3)})])
def test_for_deployment_consumers(tp_p, tp_d, h, want):
    sh = [GroupSharding(h, 2)] * 2
    for p, ranks in want.items():
        t = SendTracker.for_deployment(full_sliding_layout(), sh, prefill_tp=tp_p, prefill_rank=p,
                                       decode_tp=tp_d)
        assert t.consumers == ranks


def test_for_deployment_mla_replicated_groups():
    lay = dsv4_like_layout()
    sh = default_shardings(lay, 4, kv_chunks=1)
    # decode TP=4 over prefill TP=2: MLA pages from d % 2, compressor heads from d // 2
    assert SendTracker.for_deployment(lay, sh, prefill_tp=2, prefill_rank=0, decode_tp=4).consumers \
        == (0, 1, 2)
    assert SendTracker.for_deployment(lay, sh, prefill_tp=2, prefill_rank=1, decode_tp=4).consumers \
        == (1, 2, 3)


# -- differential test against a plain-Python model --------------------------------------------

class Model:
    """The contract in the plainest form: dict req -> (expiry, set of ranks seen)."""

    def __init__(self, consumers):
        self.consumers = sorted(consumers)
        self.reqs = {}
        self.dup = self.stray = 0

    def add(self, rid, lease, now):
        if rid in self.reqs:
            return "error"
        if not self.consumers:
            return ("done", (), ())
        self.reqs[rid] = [now + lease, set()]
        return None

    def notify(self, rid, rank):
        if rank not in self.consumers:
            return "error"
        if rid not in self.reqs:
            self.stray += 1
            return None
        seen = self.reqs[rid][1]
        if rank in seen:
            self.dup += 1
            return None
        seen.add(rank)
        if seen == set(self.consumers):
            del self.reqs[rid]
            return ("done", tuple(self.consumers), ())
        return None

    def poll(self, now):
        out = []
        for rid in list(self.reqs):
            exp, seen = self.reqs[rid]
            if now >= exp:
                del self.reqs[rid]
                out.append((rid, "expired", tuple(sorted(seen)),
                            tuple(c for c in self.consumers if c not in seen)))
        return out


ops = st.lists(st.one_of(
    st.tuples(st.just("add"), st.sampled_from("abcd"), st.integers(1, 5)),
    st.tuples(st.just("notify"), st.sampled_from("abcd"), st.integers(0, 4)),
    st.tuples(st.just("tick"), st.integers(0, 3)),
    st.tuples(st.just("poll"),)), max_size=60)


@settings(max_examples=300, deadline=None)
@given(consumers=st.sets(st.integers(0, 3), max_size=4), ops=ops)
def test_tracker_matches_model(consumers, ops):
    clk = Clock()
    t = SendTracker(sorted(consumers), clock=clk)
    m = Model(consumers)
    for op in ops:
        if op[0] == "add":
            want = m.add(op[1], op[2], clk.t)
            try:
                got = t.add(op[1], lease_s=op[2])
            except TrackerStateError:
                got = "error"
            if isinstance(got, SendOutcome):
                got = (got.status.value, got.notified, got.missing)
            assert got == want
        elif op[0] == "notify":
            want = m.notify(op[1], op[2])
            try:
                got = t.notify(op[1], op[2])
            except TrackerStateError:
                got = "error"
            if isinstance(got, SendOutcome):
                assert got.request_id == op[1]
                got = (got.status.value, got.notified, got.missing)
            assert got == want
        elif op[0] == "tick":
            clk.t += op[1]
        else:
            got = [(o.request_id, o.status.value, o.notified, o.missing) for o in t.poll()]
            assert got == m.poll(clk.t)
        assert set(t.requests) == set(m.reqs)
        assert (t.duplicates, t.stray) == (m.dup, m.stray)
        for rid, (_, seen) in m.reqs.items():
            assert t.missing(rid) == tuple(c for c in m.consumers if c not in seen)
