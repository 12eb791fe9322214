"""NixlAgent in one process (two UCX agents, DRAM): pull, push, notifications, failures."""
import os

import numpy as np
import pytest

from hmacore.errors import HandshakeError, TransferError
from hmacore.paged import allocate_paged_kv, fill_pattern, verify_pattern
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
    assert t.descriptors == 18 * 5 and t.bytes == 18 * 5 * 64
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
