"""Real NIXL (UCX, DRAM), prefill TP=1 -> decode TP=2: one prefill rank's blocks are read by
both decode ranks. The prefill process runs a SendTracker (consumers from the TP mapping) and
maps each ``<req>:done`` notification to the sender's decode rank from that rank's socket
handshake. It must release the request only after BOTH decode ranks notified (a duplicate
notification does not count twice); when one decode rank dies after reading (killed by PID
before it notifies), the request is released when its lease ends, reported as expired with the
dead rank missing."""
import time

import numpy as np
import pytest

from hmacore.transport.nixl_desc import DescAgent

from tp_proc import TpPeer
from oracle_tp import oracle_heads, rank_pages, request_ids, tp_case_layout, tp_pattern

pytestmark = pytest.mark.nixl

CASE, TOKENS, NB = "full_sliding", 100, 32


def _prefill(lease_s):
    cfg = dict(name="P-send", case=CASE, tp=1, rank=0, nb=NB, tokens=TOKENS,
               track={"req": "req-1", "decode_tp": 2, "lease_s": lease_s})
    peer = TpPeer({"role": "prefill", "agents": [cfg], "serve_s": 300})
    return peer, peer.line(timeout=120)["agents"]["P-send"]["port"]


def _decode_rank(d):
    """Decode rank d of TP=2 in this process, before any handshake (agent creation is slow on
    a loaded box: done before the lease starts)."""
    from peer_tp import build_rank
    _, paged, plan = build_rank(CASE, 2, d, NB, None, None, fill=False)
    return DescAgent(f"D-send-r{d}", plan.registration_ranges()), paged, plan


def _read_as_decode_rank(rank, port):
    """Handshake, READ, check every byte. Returns the prefill agent's name."""
    from peer_tp import decode_ids, tp_payload
    from hmacore.transport.handshake import exchange_handshake
    from hmacore.transport.tp_peer import tp_pair_plans
    agent, paged, plan = rank
    d = int(agent.name[-1])
    layout, shard, hbb = tp_case_layout(CASE)
    pos, p_ids, _ = request_ids(layout, TOKENS)
    d_ids = decode_ids(layout, pos, NB)
    me = tp_payload(plan, agent, agent.name, CASE, 2, d)
    got = exchange_handshake("127.0.0.1", port, me)
    _, pairs, _ = tp_pair_plans(me, plan, [got])
    name = agent.add_remote(got.agent_metadata)
    agent.prep_pair(name, name, pairs[0].local.descriptors(), pairs[0].remote.descriptors())
    agent.wait(agent.post("READ", name, *pairs[0].desc_ids(d_ids, p_ids)), timeout=10)
    pages = rank_pages(shard, hbb, 2)
    for g, spec in enumerate(layout.groups):
        for n in spec.layer_names:
            want = tp_pattern(n, pos[g], spec.block_size, pages[g],
                              oracle_heads(shard[g][0], 2, d), shard[g][1])
            assert (paged.kv_caches[n][np.asarray(d_ids[g])] == want).all(), (d, n)
    return name


def test_prefill_releases_only_after_both_decode_ranks_notified():
    peer, port = _prefill(lease_s=120)
    ranks = []
    try:
        ranks = [_decode_rank(0), _decode_rank(1)]
        a0, a1 = ranks[0][0], ranks[1][0]
        peer.send("add")
        assert peer.line(timeout=60) == {"added": True}
        pname = _read_as_decode_rank(ranks[0], port)
        a0.send_notif(pname, b"req-1:done")
        ev = peer.line(timeout=60)
        assert ev == {"notify": "D-send-r0", "rank": 0, "outcome": None, "duplicates": 0}
        a0.send_notif(pname, b"req-1:done")  # a duplicate does not count twice
        ev = peer.line(timeout=60)
        assert ev == {"notify": "D-send-r0", "rank": 0, "outcome": None, "duplicates": 1}
        _read_as_decode_rank(ranks[1], port)
        a1.send_notif(pname, b"req-1:done")
        ev = peer.line(timeout=60)
        assert ev["rank"] == 1 and ev["outcome"] == {"status": "done", "notified": [0, 1],
                                                     "missing": []}
        assert ev["after_s"] < 120  # released on the second notification, not the lease
    finally:
        for a, _, _ in ranks:
            a.close()
        peer.kill()


def test_dead_decode_rank_leaves_release_to_the_lease():
    lease = 20.0  # generous: the box is shared; the dead rank's READ must finish inside it
    peer, port = _prefill(lease_s=lease)
    dead = TpPeer({"role": "decode", "serve_s": 300, "agents": [
        dict(name="D-send-r1", case=CASE, tp=2, rank=1, nb=NB, tokens=TOKENS, ports=[port])]})
    r0 = None
    try:
        r0 = _decode_rank(0)
        assert dead.line(timeout=120) == {"ready": True}
        peer.send("add")
        assert peer.line(timeout=60) == {"added": True}
        dead.send("go")
        assert dead.line(timeout=60) == {"read": True}  # it read its half of the heads ...
        dead.kill()                                     # ... and died before notifying
        pname = _read_as_decode_rank(r0, port)
        a0 = r0[0]
        a0.send_notif(pname, b"req-1:done")
        ev = peer.line(timeout=60)
        assert ev == {"notify": "D-send-r0", "rank": 0, "outcome": None, "duplicates": 0}
        t = time.monotonic()
        ev = peer.line(timeout=lease + 60)
        assert ev["expired"] == {"status": "expired", "request": "req-1", "notified": [0],
                                 "missing": [1]}
        assert ev["after_s"] >= lease
        assert time.monotonic() - t < lease + 60
    finally:
        if r0 is not None:
            r0[0].close()
        dead.kill()
        peer.kill()
