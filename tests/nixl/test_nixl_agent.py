"""NixlAgent in one process (two UCX agents, DRAM): pull, push, notifications, failures."""
import os

import numpy as np
import pytest

from hmacore.errors import HandshakeError, TransferError
from hmacore.demo.paged_memory import allocate_paged_kv, fill_pattern, verify_pattern
from hmacore.plan import TransferPlan
from hmacore.presets import get_preset
from hmacore.transport.nixl import NixlAgent

pytestmark = pytest.mark.nixl
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")


@pytest.fixture(scope="module")
def pair():
    layout = get_preset("gpt-oss")
    pa = allocate_paged_kv(layout, 16, page_bytes=64)
    pb = allocate_paged_kv(layout, 16, page_bytes=64)
    a = NixlAgent("agent-a", TransferPlan.from_kv_caches(layout, pa.kv_caches, num_blocks=16))
    b = NixlAgent("agent-b", TransferPlan.from_kv_caches(layout, pb.kv_caches, num_blocks=16))
    a.add_peer(b.handshake_payload())
    b.add_peer(a.handshake_payload())
    yield a, b, pa, pb
    a.close()
    b.close()


def test_read_then_write_roundtrip(pair):
    a, b, pa, pb = pair
    fill_pattern(pb, [[1, 2], [3, 4, 5]])
    t = a.read("r1", "agent-b", [[6, 7], [8, 9, 10]], [[1, 2], [3, 4, 5]], notif=b"got")
    a.wait(t, timeout=10)
    assert verify_pattern(pa, [[6, 7], [8, 9, 10]]) == []
    assert b.wait_notif("r1", timeout=10) == b"got"
    assert t.block_descriptors == 18 * 5 and t.bytes == 18 * 5 * 64
    # ids 6..10 <- 1..5 are consecutive on both sides: one run per layer slot (18 slots)
    assert (t.runs, t.descriptors, t.mechanism) == (18, 18, "dynamic")
    # push a's blocks back into fresh ids of b
    t = a.write("w1", "agent-b", [[6, 7], [8, 9, 10]], [[11, 12], [13, 14, 15]])
    a.wait(t, timeout=10)
    assert verify_pattern(pb, [[11, 12], [13, 14, 15]]) == []


def test_full_hit_moves_nothing_but_notifies(pair):
    a, b, _, _ = pair
    t = a.read("hit", "agent-b", [[], []], [[], []], notif=b"free")
    assert t.state == "DONE" and t.descriptors == 0
    assert [v.size for v in a.valid_blocks("hit")] == [0, 0]
    assert b.wait_notif("hit", timeout=10) == b"free"


def test_length_mismatch_and_bad_ids_fail_request(pair):
    a, _, pa, _ = pair
    before = [s.copy() for s in pa.storages]
    with pytest.raises(TransferError) as ei:
        a.read("m1", "agent-b", [[1], [2, 3]], [[1], [2]])
    assert ei.value.request_id == "m1" and ei.value.group == 1
    with pytest.raises(TransferError) as ei:
        a.read("m2", "agent-b", [[1], [0]], [[1], [2]])
    assert (ei.value.group, ei.value.block_index) == (1, 0)
    with pytest.raises(TransferError) as ei:
        a.read("m3", "agent-b", [[1], [2]], [[1], [99]])
    assert "remote" in str(ei.value) and ei.value.group == 1
    # equal descriptor totals, unequal groups: would pair blocks of different groups
    with pytest.raises(TransferError, match="per-group block counts") as ei:
        a.read("m5", "agent-b", [[1, 2], [3]], [[1], [2, 3]])
    assert ei.value.group == 0
    with pytest.raises(TransferError, match="unknown peer"):
        a.read("m4", "nobody", [[1], [2]], [[1], [2]])
    for m in ("m1", "m2", "m3", "m4", "m5"):
        assert a.valid_blocks(m) is None and a.failure(m) is not None
    assert all(np.array_equal(x, y) for x, y in zip(before, pa.storages))


def test_incompatible_peer_rejected(pair):
    a, _, _, _ = pair
    layout = get_preset("gemma-3")
    other = allocate_paged_kv(layout, 16, page_bytes=64)
    with NixlAgent("agent-c", TransferPlan.from_kv_caches(layout, other.kv_caches, num_blocks=16)) as c:
        with pytest.raises(HandshakeError, match="fingerprint"):
            a.add_peer(c.handshake_payload())
    assert "agent-c" not in a.peers


def test_wait_notif_is_bounded(pair):
    a, _, _, _ = pair
    with pytest.raises(TransferError, match="no notification"):
        a.wait_notif("never", timeout=0.05)


def test_closed_agent_refuses():
    layout = get_preset("gpt-oss")
    p = allocate_paged_kv(layout, 4, page_bytes=64)
    agent = NixlAgent("agent-closed", TransferPlan.from_kv_caches(layout, p.kv_caches, num_blocks=4))
    agent.close()
    agent.close()  # idempotent
    with pytest.raises(TransferError, match="closed"):
        agent.read("x", "y", [[1], [2]], [[1], [2]])


@pytest.mark.parametrize("form", ["int32", "lists", "int64", "mixed", "2d"])
def test_every_id_form_moves_the_same_and_keeps_a_private_copy(pair, form):
    """int32 arrays take the one-call fast path, other forms the checked path: same blocks
    moved, same figures, and valid_blocks is a private int32 copy (the caller may reuse its
    arrays as soon as read() returns)."""
    a, b, pa, pb = pair
    src, dst = [[1, 2], [3, 4]], [[6, 7], [8, 9]]
    fill_pattern(pb, src)
    for s in pa.storages:
        s[:] = 0
    if form == "int32":
        local = tuple(np.array(x, np.int32) for x in dst)
    elif form == "lists":
        local = [list(x) for x in dst]
    elif form == "int64":
        local = [np.array(x, np.int64) for x in dst]
    elif form == "mixed":
        local = [list(dst[0]), np.array(dst[1], np.int32)]
    else:
        local = np.array(dst, np.int32)       # a 2-D array: one row per group
    t = a.wait(a.read(f"form-{form}", "agent-b", local, [np.array(x, np.int32) for x in src]))
    assert t.state == "DONE" and a.poll(t) == "DONE" and t.handle is None
    assert verify_pattern(pa, dst) == []
    assert t.block_descriptors == 4 * 18 and t.bytes == 4 * 18 * 64   # gpt-oss: 18 per block
    got = a.valid_blocks(f"form-{form}")
    assert [g.tolist() for g in got] == dst and all(g.dtype == np.int32 for g in got)
    # mutate the caller's ids: the recorded valid blocks must not change
    if form in ("int32", "int64", "2d"):
        for g in local:
            g[:] = 15
    elif form == "mixed":
        local[0][0] = 15
        local[1][:] = 15
    else:
        local[0][0] = 15
    assert [g.tolist() for g in a.valid_blocks(f"form-{form}")] == dst


def test_int32_fast_path_errors_match_checked_path(pair):
    """Bad int32 tables fall back to the checked path: same group/block_index as lists."""
    a, _, _, _ = pair
    i32 = lambda t: tuple(np.array(x, np.int32) for x in t)  # noqa: E731
    for rid, local, remote, where, msg in [
            ("f1", [[1], [0]], [[1], [2]], (1, 0), "bad local"),      # null id
            ("f2", [[1], [2]], [[1], [99]], (1, 0), "bad remote"),    # past the pool
            ("f3", [[1, 2], [3]], [[1], [2, 3]], (0, None), "per-group block counts")]:
        for form in (lambda t: t, i32):
            with pytest.raises(TransferError, match=msg) as ei:
                a.read(rid, "agent-b", form(local), form(remote))
            assert (ei.value.group, ei.value.block_index) == where
            assert a.valid_blocks(rid) is None and a.failure(rid) is ei.value


def test_wide_dlists_take_the_checked_path(pair):
    """A peer whose dlist could pass 2**31 descriptors never gets int32 ids from the fast path."""
    a, _, _, _ = pair
    p = a._peers["agent-b"]
    assert p.ids32
    p.ids32 = False
    try:
        t = a.wait(a.read("wide", "agent-b", ((np.array([6], np.int32),) * 2),
                          [[1], [2]]))
        assert t.state == "DONE" and t.block_descriptors == 2 * 18
    finally:
        p.ids32 = True


def test_unclaimed_notifications_expire_but_live_ones_stay(pair):
    # a late message (its request no longer tracked) waits in its queue until the receiver's
    # grace period ends; a live request's queue stays whatever its age
    import time
    a, b, _, _ = pair
    for rid in ("late-x", "live-y"):
        a.send_notif("agent-b", rid, b"done@0/1")
    deadline = time.monotonic() + 10
    while not (b.has_notifications("late-x") and b.has_notifications("live-y")):
        assert time.monotonic() < deadline, "notifications never arrived"
        b.fetch_notifs()
        time.sleep(0.001)
    past = time.monotonic() - 60
    assert b.drop_unclaimed_notifs(past, set(), cap=100) == 0     # younger than the grace
    assert b.drop_unclaimed_notifs(time.monotonic() + 1, {"live-y"}, cap=100) == 1
    assert not b.has_notifications("late-x")
    assert b.notifications("live-y", fetch=False) == [b"done@0/1"]


def test_notify_handshake_keeps_a_transfer_peer(pair):
    """P and D roles swapped: ``b`` is a's transfer peer (a reads from b); b then handshakes
    with a's server to read from a, whose ``on_peer`` is ``add_notify_peer``. The same agent
    (same metadata) stays a transfer peer: a still reads from b. A notify-only entry for an
    unknown agent is still notify-only."""
    a, b, pa, pb = pair
    assert a.add_notify_peer(b.handshake_payload()) == "agent-b"
    fill_pattern(pb, [[1], [2]])
    t = a.read("swap", "agent-b", [[3], [4]], [[1], [2]])
    a.wait(t, timeout=10)
    assert verify_pattern(pa, [[3], [4]]) == []
    layout = get_preset("gpt-oss")
    pc = allocate_paged_kv(layout, 16, page_bytes=64)
    c = NixlAgent("agent-c", TransferPlan.from_kv_caches(layout, pc.kv_caches, num_blocks=16))
    try:
        assert a.add_notify_peer(c.handshake_payload()) == "agent-c"
        with pytest.raises(TransferError, match="added for notifications only"):
            a.read("notify", "agent-c", [[5], [6]], [[1], [2]])
    finally:
        a.remove_peer("agent-c")
        c.close()
