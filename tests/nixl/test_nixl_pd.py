"""Real NIXL (UCX, DRAM), two processes: the prefill peer fills every layer's blocks with the
pattern, this process pulls exactly the window-clipped blocks of a request and checks every
byte, and the descriptor/byte figures against the plan's HMA and non-HMA numbers."""
import json
import os
import time

import numpy as np
import pytest

from hmacore.errors import TransferError
from hmacore.grain import cdiv
from hmacore.paged import allocate_paged_kv, fill_pattern, verify_pattern
from hmacore.plan import TransferPlan
from hmacore.presets import get_preset
from hmacore.spec import GroupKind
from hmacore.transport.handshake import exchange_handshake
from hmacore.transport.nixl import NixlAgent

pytestmark = pytest.mark.nixl
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

CASES = {  # preset -> (page_bytes, kernel_block_size, num_tokens)
    "gemma-3": (48, None, 1500),                    # full + 6 sliding (window 1024)
    "gpt-oss": (64, None, 700),                     # sliding (128) + full
    "deepseek-v4": ((256, 128, 128, 64, 32), None, 1100),  # five groups, differing pages
    "qwen3-next": (544, 272, 2000),                 # 3 GDN state groups + full, kernel ratio 2
}


def request_tables(layout, num_tokens, p_first=1, d_first=1):
    """P's full table (null ids outside the window), the clipped P ids, D's ids, positions."""
    p_table, p_clip, d_ids, positions = [], [], [], []
    nxt_p, nxt_d = p_first, d_first
    for spec in layout.groups:
        n = cdiv(num_tokens, spec.block_size)
        keep = n
        w = spec.window_blocks()
        if w and n > w:
            keep = w
        if spec.kind == GroupKind.MAMBA:
            keep = 1
        real = list(range(nxt_p, nxt_p + keep))
        nxt_p += keep
        p_table.append([0] * (n - keep) + real)
        clip = p_table[-1][-keep:] if keep and len(p_table[-1]) > keep else p_table[-1]
        p_clip.append(clip)
        d_ids.append(list(range(nxt_d, nxt_d + len(clip))))
        nxt_d += len(clip)
        positions.append(list(range(n - len(clip), n)))
    return p_table, p_clip, d_ids, positions, max(nxt_p, nxt_d)


@pytest.mark.parametrize("preset", sorted(CASES))
def test_pull_clipped_blocks_every_byte(start_peer, preset):
    page, kbs, tokens = CASES[preset]
    layout = get_preset(preset)
    p_table, p_clip, d_ids, positions, used = request_tables(layout, tokens)
    nb = used + 2
    peer = start_peer(name=f"prefill-{preset}", preset=preset, num_blocks=nb, page_bytes=page,
                      kernel_block_size=kbs, fill_table=p_table, serve_s=40)
    paged = allocate_paged_kv(layout, nb, page_bytes=page)
    plan = TransferPlan.from_kv_caches(layout, paged.kv_caches, num_blocks=nb, kernel_block_size=kbs)
    with NixlAgent(f"decode-{preset}", plan) as agent:
        remote = exchange_handshake("127.0.0.1", peer.port, agent.handshake_payload())
        name = agent.add_peer(remote)
        assert verify_pattern(paged, d_ids, positions) != []  # nothing there before the pull
        t = agent.read("req-1", name, d_ids, p_clip, notif=b"pulled")
        agent.wait(t, timeout=20)
        assert verify_pattern(paged, d_ids, positions) == []
        assert agent.valid_blocks("req-1") == tuple(tuple(g) for g in d_ids)
        # nothing outside the pulled blocks was written
        touched = {(name, b) for g, ids in enumerate(d_ids)
                   for name in layout.groups[g].layer_names for b in ids}
        for g, spec in enumerate(layout.groups):
            for lname in spec.layer_names:
                arr = paged.kv_caches[lname]
                parts = list(arr) if isinstance(arr, tuple) else [arr]
                for b in range(nb):
                    if (lname, b) not in touched and not any(
                            (other, b) in touched for other in _aliases(paged, lname)):
                        assert all(not p[b].any() for p in parts), (lname, b)
        figs = plan.request_figures(tokens)
        assert t.descriptors == figs.hma_descriptors
        assert t.bytes == figs.hma_bytes
        assert figs.hma_descriptors < figs.non_hma_descriptors
        assert figs.hma_bytes < figs.non_hma_bytes
        agent.send_notif(name, "end", b"bye")
    assert peer.proc.wait(timeout=10) == 0


def _aliases(paged, lname):
    base = _base(paged.kv_caches[lname])
    return [n for n, a in paged.kv_caches.items() if _base(a) == base and n != lname]


def _base(arr):
    return (arr[0] if isinstance(arr, tuple) else arr).ctypes.data


def test_push_write_verified_by_peer(start_peer):
    layout = get_preset("gpt-oss")
    p_table, p_clip, d_ids, positions, used = request_tables(layout, 300)
    nb = used + 2
    peer = start_peer(name="decode-target", preset="gpt-oss", num_blocks=nb, page_bytes=64, serve_s=30)
    paged = allocate_paged_kv(layout, nb, page_bytes=64)
    fill_pattern(paged, p_table)
    plan = TransferPlan.from_kv_caches(layout, paged.kv_caches, num_blocks=nb)
    with NixlAgent("prefill-pusher", plan) as agent:
        name = agent.add_peer(exchange_handshake("127.0.0.1", peer.port, agent.handshake_payload()))
        t = agent.write("req-7", name, p_clip, d_ids)
        agent.wait(t, timeout=20)
        agent.send_notif(name, "req-7", b"verify:" + json.dumps([d_ids, positions]).encode())
        assert agent.wait_notif("req-7", timeout=20) == b"ok"
        # a wrong expectation is reported as bad: the check can fail
        wrong = [list(reversed(g)) for g in d_ids]
        agent.send_notif(name, "req-8", b"verify:" + json.dumps([wrong, positions]).encode())
        assert agent.wait_notif("req-8", timeout=20) == b"bad"
        agent.send_notif(name, "end", b"bye")
    assert peer.proc.wait(timeout=10) == 0


def test_dead_peer_fails_request_and_survivor_keeps_working(start_peer):
    # One full-attention group, 80 layers of 16 KiB pages: a ~80 MiB pull, killed mid-flight.
    layout = get_preset("llama-3-70b")
    nb = 66
    # The doomed peer only offers UCX's TCP transport, so the pull runs over loopback TCP
    # (~0.3 GB/s, vs CMA's ~3 GB/s) and is still in flight when the peer is killed.
    big = start_peer(name="prefill-doomed", preset="llama-3-70b", num_blocks=nb, page_bytes=16384,
                     serve_s=30, env={"UCX_TLS": "tcp"})
    paged = allocate_paged_kv(layout, nb, page_bytes=16384)
    plan = TransferPlan.from_kv_caches(layout, paged.kv_caches, num_blocks=nb)
    ids = [list(range(1, nb))]
    with NixlAgent("decode-survivor", plan) as agent:
        name = agent.add_peer(exchange_handshake("127.0.0.1", big.port, agent.handshake_payload()))
        t = agent.read("req-dead", name, ids, ids)
        big.kill()
        try:
            agent.wait(t, timeout=15)
            completed = True  # the pull beat the kill: the later request must still fail
        except TransferError as e:
            completed = False
            assert e.request_id == "req-dead"
            assert agent.valid_blocks("req-dead") is None
            assert agent.failure("req-dead") is e
        # posting to the dead peer fails (bounded), nothing is marked valid
        t2 = None
        with pytest.raises(TransferError) as ei:
            t2 = agent.read("req-after", name, ids, ids)
            agent.wait(t2, timeout=10)
        assert ei.value.request_id == "req-after"
        assert agent.valid_blocks("req-after") is None
        assert agent.failure("req-after") is not None
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
        small_table = [list(range(1, 5))]
        fresh = start_peer(name="prefill-fresh", preset="llama-3-70b", num_blocks=nb,
                           page_bytes=16384, fill_table=small_table, serve_s=30)
        name2 = agent.add_peer(exchange_handshake("127.0.0.1", fresh.port, agent.handshake_payload()))
        d = [list(range(10, 14))]
        agent.wait(agent.read("req-ok", name2, d, small_table), timeout=20)
        assert verify_pattern(paged, d) == []
        assert agent.valid_blocks("req-ok") == tuple(tuple(g) for g in d)
        agent.send_notif(name2, "end", b"bye")
    assert fresh.proc.wait(timeout=10) == 0
