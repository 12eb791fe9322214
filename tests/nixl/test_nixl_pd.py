"""Real NIXL (UCX, DRAM), two processes: the prefill peer fills every layer's blocks with the
pattern, this process pulls exactly the window-clipped blocks of a request and checks every
byte, and the descriptor/byte figures against the plan's HMA and non-HMA numbers."""
import json
import os
import time

import pytest

from hmacore.errors import TransferError
from hmacore.grain import cdiv
from hmacore.demo.paged_memory import allocate_paged_kv, fill_pattern, verify_pattern
from hmacore.plan import TransferPlan
from hmacore.presets import get_preset
from hmacore.spec import GroupKind, GroupSpec, KVLayout
from hmacore.transport.handshake import exchange_handshake
from hmacore.transport.nixl import NixlAgent

from conftest import SLOW, Peer

pytestmark = pytest.mark.nixl
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

CASES = {  # preset -> (page_bytes, kernel_block_size, num_tokens)
    "gemma-3": (48, None, 1500),                    # full + 6 sliding (window 1024)
    "gpt-oss": (64, None, 700),                     # sliding (128) + full
    "deepseek-v4": ((256, 128, 128, 64, 32), None, 1100),  # five groups, differing pages
    "qwen3-next": (544, 272, 2000),                 # 3 GDN state groups + full, kernel ratio 2
}
PUSH_TOKENS = 300


def request_tables(layout, num_tokens):
    """P's full table (null ids outside the window), the clipped P ids, D's ids, positions."""
    p_table, p_clip, d_ids, positions = [], [], [], []
    nxt_p = nxt_d = 1
    for spec in layout.groups:
        n = cdiv(num_tokens, spec.block_size)
        keep = n
        w = spec.window_blocks()
        if w and n > w:
            keep = w
        if spec.kind == GroupKind.MAMBA:
            keep = 1
        p_table.append([0] * (n - keep) + list(range(nxt_p, nxt_p + keep)))
        nxt_p += keep
        clip = p_table[-1][-keep:] if keep and len(p_table[-1]) > keep else p_table[-1]
        p_clip.append(clip)
        d_ids.append(list(range(nxt_d, nxt_d + len(clip))))
        nxt_d += len(clip)
        positions.append(list(range(n - len(clip), n)))
    return p_table, p_clip, d_ids, positions, max(nxt_p, nxt_d) + 2


@pytest.fixture(scope="module")
def prefill_peer():
    """One peer process hosting a filled prefill agent per preset and an empty push target."""
    agents = []
    for preset, (page, kbs, tokens) in CASES.items():
        p_table, _, _, _, nb = request_tables(get_preset(preset), tokens)
        agents.append({"name": f"prefill-{preset}", "preset": preset, "num_blocks": nb,
                       "page_bytes": page, "kernel_block_size": kbs, "fill_table": p_table})
    nb = request_tables(get_preset("gpt-oss"), PUSH_TOKENS)[4]
    agents.append({"name": "push-target", "preset": "gpt-oss", "num_blocks": nb, "page_bytes": 64})
    peer = Peer(agents, serve_s=60)
    yield peer
    peer.kill()


@pytest.mark.parametrize("preset", sorted(CASES))
def test_pull_clipped_blocks_every_byte(prefill_peer, preset):
    page, kbs, tokens = CASES[preset]
    layout = get_preset(preset)
    _, p_clip, d_ids, positions, nb = request_tables(layout, tokens)
    paged = allocate_paged_kv(layout, nb, page_bytes=page)
    plan = TransferPlan.from_kv_caches(layout, paged.kv_caches, num_blocks=nb, kernel_block_size=kbs)
    with NixlAgent(f"decode-{preset}", plan) as agent:
        port = prefill_peer.ports[f"prefill-{preset}"]
        name = agent.add_peer(exchange_handshake("127.0.0.1", port, agent.handshake_payload()))
        assert verify_pattern(paged, d_ids, positions) != []  # nothing there before the pull
        t = agent.read("req-1", name, d_ids, p_clip, notif=b"pulled")
        agent.wait(t, timeout=20)
        assert verify_pattern(paged, d_ids, positions) == []
        assert [v.tolist() for v in agent.valid_blocks("req-1")] == d_ids
        # nothing outside the pulled pages was written: zero them, then every byte is zero
        for g, ids in enumerate(d_ids):
            for lname in layout.groups[g].layer_names:
                arr = paged.kv_caches[lname]
                for part in (arr if isinstance(arr, tuple) else [arr]):
                    part[ids] = 0
        assert not any(s.any() for s in paged.storages)
        figs = plan.request_figures(tokens)
        assert t.block_descriptors == figs.hma_descriptors
        assert 0 < t.runs <= t.descriptors <= t.block_descriptors
        assert t.bytes == figs.hma_bytes
        assert figs.hma_descriptors < figs.non_hma_descriptors
        assert figs.hma_bytes < figs.non_hma_bytes


def test_push_write_verified_by_peer(prefill_peer):
    layout = get_preset("gpt-oss")
    p_table, p_clip, d_ids, positions, nb = request_tables(layout, PUSH_TOKENS)
    paged = allocate_paged_kv(layout, nb, page_bytes=64)
    fill_pattern(paged, p_table)
    plan = TransferPlan.from_kv_caches(layout, paged.kv_caches, num_blocks=nb)
    with NixlAgent("prefill-pusher", plan) as agent:
        port = prefill_peer.ports["push-target"]
        name = agent.add_peer(exchange_handshake("127.0.0.1", port, agent.handshake_payload()))
        t = agent.write("req-7", name, p_clip, d_ids)
        agent.wait(t, timeout=20)
        agent.send_notif(name, "req-7", b"verify:" + json.dumps([d_ids, positions]).encode())
        assert agent.wait_notif("req-7", timeout=20) == b"ok"
        # a wrong expectation is reported as bad: the check can fail
        wrong = [list(reversed(g)) for g in d_ids]
        agent.send_notif(name, "req-8", b"verify:" + json.dumps([wrong, positions]).encode())
        assert agent.wait_notif("req-8", timeout=20) == b"bad"


def test_peer_exits_cleanly(prefill_peer):
    layout = get_preset("gpt-oss")
    nb = request_tables(layout, PUSH_TOKENS)[4]
    paged = allocate_paged_kv(layout, nb, page_bytes=64)
    with NixlAgent("closer", TransferPlan.from_kv_caches(layout, paged.kv_caches, num_blocks=nb)) as a:
        name = a.add_peer(exchange_handshake("127.0.0.1", prefill_peer.ports["push-target"],
                                             a.handshake_payload()))
        a.send_notif(name, "end", b"bye")
    assert prefill_peer.proc.wait(timeout=10 * SLOW) == 0


def test_dead_peer_fails_request_and_survivor_keeps_working(start_peer):
    layout = KVLayout(groups=(GroupSpec(GroupKind.FULL, 16, tuple(f"l.{i}" for i in range(16))),))
    nb, page = 66, 65536
    # The doomed peer only offers UCX's TCP transport, so the ~68 MB pull runs over loopback
    # TCP (~0.3 GB/s, vs CMA's ~3 GB/s) and is still in flight when the peer is killed.
    small_table = [list(range(1, 5))]
    base = {"layout": layout.to_dict(), "num_blocks": nb, "page_bytes": page}
    doomed = start_peer([{**base, "name": "prefill-doomed"}], serve_s=30, env={"UCX_TLS": "tcp"})
    fresh = start_peer([{**base, "name": "prefill-fresh", "fill_table": small_table}], serve_s=30)
    paged = allocate_paged_kv(layout, nb, page_bytes=page)
    plan = TransferPlan.from_kv_caches(layout, paged.kv_caches, num_blocks=nb)
    ids = [list(range(1, nb))]
    with NixlAgent("decode-survivor", plan) as agent:
        name = agent.add_peer(exchange_handshake("127.0.0.1", doomed.ports["prefill-doomed"],
                                                 agent.handshake_payload()))
        # a wait that runs out of time fails the request. A 68 MB TCP pull is normally still
        # in flight at the first poll, but on a quiet machine it may finish inside the post:
        # try a few, at least one must be caught in flight
        caught = None
        for attempt in range(8):
            slow = agent.read(f"req-slow-{attempt}", name, ids, ids)
            try:
                agent.wait(slow, timeout=0.0)
            except TransferError as e:
                caught = (e, slow)
                break
        assert caught is not None, "every 68 MB pull finished inside its post"
        e, slow = caught
        assert "did not complete within" in str(e)
        assert e.request_id == slow.request_id and slow.state == "FAILED"
        assert agent.valid_blocks(slow.request_id) is None
        t = agent.read("req-dead", name, ids, ids)
        doomed.kill()
        try:
            agent.wait(t, timeout=15)
            completed = True  # the pull beat the kill: the later request must still fail
        except TransferError as e:
            completed = False
            assert e.request_id == "req-dead"
            assert agent.valid_blocks("req-dead") is None
            assert agent.failure("req-dead") is e
        # posting to the dead peer fails (bounded), nothing is marked valid
        with pytest.raises(TransferError) as ei:
            agent.wait(agent.read("req-after", name, ids, ids), timeout=10)
        assert ei.value.request_id == "req-after"
        assert agent.valid_blocks("req-after") is None and agent.failure("req-after") is not None
        if completed:
            assert agent.valid_blocks("req-dead") is not None
        # an expired lease fails before anything is posted
        with pytest.raises(TransferError, match="lease"):
            agent.read("req-lease", name, ids, ids, expires_at=time.monotonic() - 1)
        # a bad descriptor (block id past the pool) fails with group and block index
        with pytest.raises(TransferError) as ei:
            agent.read("req-bad", name, [[1, 2, nb + 5]], [[1, 2, 3]])
        assert (ei.value.group, ei.value.block_index) == (0, 2)
        agent.remove_peer(name)
        # the survivor works with a fresh peer
        name2 = agent.add_peer(exchange_handshake("127.0.0.1", fresh.ports["prefill-fresh"],
                                                  agent.handshake_payload()))
        d = [list(range(10, 14))]
        agent.wait(agent.read("req-ok", name2, d, small_table), timeout=20)
        assert verify_pattern(paged, d) == []
        assert [v.tolist() for v in agent.valid_blocks("req-ok")] == d
        agent.send_notif(name2, "end", b"bye")
    assert fresh.proc.wait(timeout=10) == 0
