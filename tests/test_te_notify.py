"""hmacore.transport.te_notify: per-peer notification senders (no engine: the blocking engine
call is a function the test controls). The real engine with a peer that stops answering:
tests/mooncake/test_te_transport.py::test_a_stopped_peer_does_not_hold_the_caller."""
from __future__ import annotations

import threading
import time

import pytest

from hmacore.errors import TransferError
from hmacore.transport.te_notify import NotifyQueues

BOUND_S = 30.0     # generous: every wait below ends as soon as its condition holds


class Engine:
    """Records calls; a peer whose session is in ``hang`` blocks until released; ``rc``
    per session (default 0)."""

    def __init__(self):
        self.calls: list[tuple[str, int, object]] = []
        self.hang: dict[str, threading.Event] = {}
        self.rc: dict[str, int] = {}
        self.entered = threading.Event()

    def __call__(self, session, doorbell, note):
        gate = self.hang.get(session)
        if gate is not None:
            self.entered.set()
            assert gate.wait(BOUND_S)
        self.calls.append((session, doorbell, note))
        return self.rc.get(session, 0)


def until(cond, what):
    deadline = time.monotonic() + BOUND_S
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.001)


def test_in_order_per_peer_and_a_hung_peer_holds_nobody():
    eng = Engine()
    eng.hang["slow:1"] = threading.Event()
    q = NotifyQueues(eng, "t")
    try:
        q.send("slow", "slow:1", 8, "s0")            # returns while the call hangs
        assert eng.entered.wait(BOUND_S)
        q.send("slow", "slow:1", 8, "s1")
        assert q.pending("slow") == 2 and q.failed("slow") is None
        for i in range(5):
            q.send("fast", "fast:2", 16, f"f{i}")
        until(lambda: q.pending("fast") == 0, "the live peer's notifications")
        assert [n for s, _, n in eng.calls if s == "fast:2"] == [f"f{i}" for i in range(5)]
        assert q.pending("slow") == 2                  # still held, by its own thread only
        eng.hang["slow:1"].set()
        until(lambda: q.pending("slow") == 0, "the slow peer drains")
        assert [n for s, _, n in eng.calls if s == "slow:1"] == ["s0", "s1"]
        assert q.take_failures() == []
    finally:
        eng.hang["slow:1"].set()
        q.close()


def test_a_failure_is_reported_once_and_the_next_send_raises():
    eng = Engine()
    eng.rc["dead:1"] = -1
    eng.hang["dead:1"] = threading.Event()
    q = NotifyQueues(eng, "t")
    try:
        q.send("dead", "dead:1", 8, "a")
        q.send("dead", "dead:1", 8, "b")              # queued behind the failing one
        eng.hang["dead:1"].set()
        until(lambda: q.pending("dead") == 0, "the failure")
        assert [n for _, _, n in eng.calls] == ["a"]     # "b" dropped after the failure
        got = q.take_failures()
        assert got == [("dead", "engine rc -1: peer dead or unreachable?")]
        assert q.take_failures() == []                 # reported once
        with pytest.raises(TransferError, match="'dead' not sent: an earlier one failed"):
            q.send("dead", "dead:1", 8, "c")
        # a restarted peer (new endpoint under the name) starts afresh
        eng.rc["dead:2"] = 0
        q.send("dead", "dead:2", 8, "d")
        until(lambda: q.pending("dead") == 0, "the new endpoint")
        assert eng.calls[-1] == ("dead:2", 8, "d") and q.failed("dead") is None
        # forgetting the peer forgets its failure too
        eng.rc["dead:2"] = 5
        q.send("dead", "dead:2", 8, "e")
        until(lambda: q.failed("dead") is not None, "the second failure")
        q.forget("dead")
        eng.rc["dead:2"] = 0
        q.send("dead", "dead:2", 8, "f")
        until(lambda: q.pending("dead") == 0, "after forget")
        assert eng.calls[-1][2] == "f"
    finally:
        q.close()


def test_a_full_queue_raises_at_once_and_nothing_is_half_queued():
    eng = Engine()
    eng.hang["h:1"] = threading.Event()
    q = NotifyQueues(eng, "t", max_pending=3)
    try:
        for i in range(3):
            q.send("h", "h:1", 8, i)
        with pytest.raises(TransferError, match="3 are still pending"):
            q.send("h", "h:1", 8, 3)
        assert q.pending("h") == 3
        eng.hang["h:1"].set()
        until(lambda: q.pending("h") == 0, "drain")
        assert [n for _, _, n in eng.calls] == [0, 1, 2]
    finally:
        eng.hang["h:1"].set()
        q.close()


def test_close_delivers_what_was_queued_then_refuses():
    eng = Engine()
    eng.hang["p:1"] = threading.Event()
    q = NotifyQueues(eng, "t")
    q.send("p", "p:1", 8, "last words")
    threading.Timer(0.05, eng.hang["p:1"].set).start()
    q.close()                                          # waits for the call in flight
    assert [n for _, _, n in eng.calls] == ["last words"]
    with pytest.raises(TransferError, match="closed"):
        q.send("p", "p:1", 8, "late")


def test_an_engine_exception_is_a_failure():
    def boom(session, doorbell, note):
        raise RuntimeError("socket gone")
    q = NotifyQueues(boom, "t")
    try:
        q.send("x", "x:1", 8, "n")
        until(lambda: q.failed("x") is not None, "the failure")
        assert q.take_failures() == [("x", "RuntimeError: socket gone")]
    finally:
        q.close()


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "4"])
def test_max_pending_is_validated(bad):
    with pytest.raises(ValueError, match="max_pending must be an int >= 1"):
        NotifyQueues(lambda *a: 0, "t", max_pending=bad)
