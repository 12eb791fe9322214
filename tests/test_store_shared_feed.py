"""ChangeFeed: one reader's exact view of a SharedStore's changes, whichever process makes them.

Other processes put and evict (CLOCK) while the reader follows the segment's event log; the
reader's changes, tallied the way a RoutingIndex counts events, always hold exactly the keys
in the store (a tally without the removals does not: the negative control). A reader that
falls behind the log's ring, or a store emptied by a crash reset, resyncs: the difference
between the store and what it reported, never a wrong residency. Children are spawned,
bounded in time and stopped by PID."""
from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest

from hmacore.errors import HashInputError
from hmacore.transport.shared_changes import ChangeFeed
from hmacore.transport.shared_store import SharedStore
from hmacore.transport.store import OK, EmbeddedStore

from test_store_shared import NS, TIMEOUT, _child_churn, _digests, _files, _key, _name, \
    _spawn, _stop, _value


@pytest.fixture
def stores():
    """Open stores through ``open(cap, page)``; all closed (and gone) at the end."""
    opened: list[SharedStore] = []

    def open_(cap=1 << 20, page=4096):
        opened.append(SharedStore(_name(), cap, page))
        return opened[-1]

    yield open_
    for s in opened:
        s.close()
        assert _files(s.name) == [False] * 3, f"segment {s.name} left behind"


class Tally:
    """Counts per (group, digest) like RoutingIndex: a store +1, a remove -1 (a remove of a
    key not held is ignored and counted). ``removals=False``: the negative control."""

    def __init__(self, removals: bool = True) -> None:
        self.counts: dict[tuple[int, bytes], int] = {}
        self.removals = removals
        self.doubles = self.ignored = 0

    def apply(self, runs) -> None:
        for run in runs:
            for d in run.digests:
                k = (run.group, d)
                if run.present:
                    self.doubles += self.counts.get(k, 0) > 0
                    self.counts[k] = self.counts.get(k, 0) + 1
                elif not self.removals:
                    continue
                elif self.counts.get(k, 0) > 0:
                    self.counts[k] -= 1
                else:
                    self.ignored += 1

    def keys(self) -> set[tuple[int, bytes]]:
        return {k for k, n in self.counts.items() if n > 0}


def store_keys(st: SharedStore, ns_id: int = 1) -> set[tuple[int, bytes]]:
    """Every key of namespace ``ns_id`` in the store, read from its index."""
    meta, digest = st._a["meta"], st._a["digest"]
    live = np.flatnonzero((meta != 0) & (((meta >> 32) & 0xFFFF) == ns_id))
    return {(int(meta[j]) & 0xFFFFFFFF, digest[j, :int(meta[j]) >> 48 & 0xFF].tobytes())
            for j in live}


def test_feed_follows_two_other_processes_evicting_exactly():
    """Two children each put 400 keys of 1-3 pages into a 64-page store (evicting each other's
    keys) while this process follows the log, reading as they go; once they are done the
    tally of everything read is the store."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    name, page, n = _name(), 256, 400
    st = SharedStore(name, 64 * page, page)
    feed = ChangeFeed(st, NS)
    tally, control = Tally(), Tally(removals=False)
    kids = [_spawn(_child_churn, name, 64 * page, page, seed, n, q) for seed in (1, 2)]
    try:
        done, reads = 0, 0
        while done < len(kids):
            runs = feed.read()
            tally.apply(runs)
            control.apply(runs)
            reads += 1
            try:
                assert q.get(timeout=0.01)[0] == "done"
                done += 1
            except Exception as e:    # queue.Empty: the children are still putting
                if type(e).__name__ != "Empty":
                    raise
            assert len(tally.keys()) == len(feed)
        for k in kids:
            k.join(TIMEOUT)
        tally.apply(feed.read())
        assert tally.keys() == store_keys(st) and len(tally.keys()) == len(st)
        assert tally.doubles == 0 and tally.ignored == 0    # set semantics: counts stay 0/1
        assert feed.skipped == 0 and feed.resyncs == 1      # the log was followed throughout
        assert st.evictions > 0 and reads > 1
        assert control.keys() != store_keys(st)            # dropping removals is caught
        assert {g for g, _ in tally.keys()} <= {1, 2}
    finally:
        for k in kids:
            _stop(k)
        st.close()


def test_feed_resyncs_after_falling_behind_the_ring_and_after_a_reset(stores):
    st = stores(cap=512 * 64, page=64)                 # 512 pages: log_cap 1024 rows
    v = _value(5, 64)
    st.register(v.ctypes.data, 64)
    part = [[(v.ctypes.data, 64)]]
    d = _digests(900, 11)
    other_ns = "other@tp_rank:0@pcp0@dcp0@pp_rank:0"
    assert st.batch_put([_key(0, x) for x in d[:100]], part * 100) == [OK] * 100
    feed, tally = ChangeFeed(st, NS), Tally()
    tally.apply(feed.read())                           # a new reader: the store's contents
    assert feed.resyncs == 1 and tally.keys() == store_keys(st) and len(tally.keys()) == 100
    assert feed.read() == []                           # nothing new
    # under the ring: followed from the log (an overwrite, a remove, another namespace)
    st.batch_put([_key(0, d[0])], part)
    st.batch_remove([_key(0, d[1])])
    st.batch_put([_key(1, x, other_ns) for x in d[:5]], part * 5)
    st.batch_put([_key(1, b"\x07" * 16)], part)       # a 16-byte digest, same namespace
    runs = feed.read()
    tally.apply(runs)
    assert feed.resyncs == 1 and tally.keys() == store_keys(st)
    assert (1, b"\x07" * 16) in tally.keys() and len(tally.keys()) == 100
    # past the ring: 2 x 900 puts and removes (3600 rows > 1024) before the next read
    for _ in range(2):
        st.batch_put([_key(2, x) for x in d], part * len(d))
        st.batch_remove([_key(2, x) for x in d[::2]])
    runs = feed.read()
    assert feed.resyncs == 2
    kinds = [r.present for r in runs]
    assert kinds == sorted(kinds)                       # the difference: removals, then stores
    tally.apply(runs)
    assert tally.keys() == store_keys(st) and tally.ignored == tally.doubles == 0
    assert feed.skipped == 0
    assert st.evictions > 0                            # 1300 keys into 512 pages
    # a process died halfway through a change: the next user empties the store (no log rows)
    with pytest.raises(RuntimeError):
        with st._locked(mutate=True):
            raise RuntimeError("killed mid-change")
    assert len(st) == 0 and st.resets == 1
    runs = feed.read()
    assert feed.resyncs == 3 and runs and not any(r.present for r in runs)
    tally.apply(runs)
    assert tally.keys() == set() and len(feed) == 0


def test_feed_arguments_are_checked(stores):
    st = stores()
    with pytest.raises(HashInputError, match="store must be a SharedStore"):
        ChangeFeed(EmbeddedStore(1 << 20), NS)
    for bad in ("", [], [NS, ""], [NS, 3]):
        with pytest.raises(HashInputError, match="namespaces must be"):
            ChangeFeed(st, bad)
    with pytest.raises(HashInputError, match="namespaces must be"):
        st.read_log([""], -1, -1)
