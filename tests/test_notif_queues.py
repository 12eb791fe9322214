"""NotifQueues: per-request queues whose unclaimed messages expire (late messages)."""
import time

import pytest

from hmacore.transport.notif_queues import NotifQueues


def test_unclaimed_queues_expire_oldest_first_live_ones_never():
    q = NotifQueues()
    for rid in ("a", "b", "live", "c"):
        q.add(rid, "peer", b"done")
    q.add("a", "peer", b"HB")
    t = time.monotonic() + 1          # every queue is older than this
    assert q.drop_unclaimed(t - 3600, {"live"}, cap=100) == 0    # all within their grace
    assert q.drop_unclaimed(t, {"live", "c"}, cap=100) == 3      # a (2 messages), b
    assert list(q) == ["live", "c"]
    assert q.pop("live") == [("peer", b"done")] and q.pop("live") == []


def test_cap_drops_the_oldest_unclaimed_before_their_grace_ends():
    q = NotifQueues()
    for i in range(6):
        q.add(f"r{i}", "p", b"x")
    assert q.drop_unclaimed(0.0, {"r0"}, cap=3) == 3     # r1..r3 go; r0 is live
    assert list(q) == ["r0", "r4", "r5"]
    with pytest.raises(ValueError, match="cap must be >= 0"):
        q.drop_unclaimed(0.0, set(), cap=-1)


def test_pop_first_and_membership():
    q = NotifQueues()
    q.add("r", "p", b"1")
    q.add("r", "p", b"2")
    assert q.pop_first("r") == ("p", b"1") and "r" in q
    assert q.pop_first("r") == ("p", b"2") and "r" not in q and len(q) == 0
    assert q.pop_first("r") is None
    q.add("r", "p", b"3")           # a new queue restarts its age
    assert q.drop_unclaimed(time.monotonic() - 60, set(), cap=10) == 0
