"""Real NIXL (UCX, DRAM), layer-wise push between two processes: the prefill peer runs a
simulated forward (busy compute per layer) and WRITEs each layer into the decode side's blocks
as soon as it is computed; this process (decode) counts per-layer notifications and checks
every byte. The overlap (last layer's WRITE end vs forward end) is REPORTED, not asserted.
A second test kills the prefill peer after some layers: the decode side must end FAILED with
nothing valid. A third kills the DECODE process after some layers (both sides are processes):
the prefill side must release the request's blocks when its lease ends, once, not earlier."""
import base64
import json
import os
import time

import numpy as np
import pytest

from hmacore.layerwise import LayerPlan, LayerwiseReceiver, PushState
from hmacore.transport.nixl_desc import DescAgent

from tp_proc import TpPeer
from oracle_tp import rank_pages, request_ids, tp_case_layout, tp_pattern

pytestmark = pytest.mark.nixl

CASE, TOKENS, NB, SCALE = "dsv4", 100, 32, 256  # ~1 MiB per layer pair moved
REPORT = os.path.join(os.path.dirname(__file__), "..", "..", "build", "layerwise_overlap.json")


def _decode():
    from peer_tp import build_rank
    layout, shard, hbb = tp_case_layout(CASE, SCALE)
    pos, _, _ = request_ids(layout, TOKENS)
    d_ids, nxt = [], NB - 1
    for g in range(layout.num_groups):
        d_ids.append(list(range(nxt, nxt - len(pos[g]), -1)))
        nxt -= len(pos[g])
    _, paged, plan = build_rank(CASE, 1, 0, NB, None, None, fill=False, scale=SCALE)
    return layout, shard, hbb, pos, d_ids, paged, plan


def _layer_ok(layout, shard, hbb, pos, d_ids, paged, name):
    g = layout.layer_to_group[name]
    spec = layout.groups[g]
    want = tp_pattern(name, pos[g], spec.block_size, rank_pages(shard, hbb, 1)[g],
                      None if shard[g][2] else list(range(shard[g][0])), shard[g][1])
    return bool((paged.kv_caches[name][np.asarray(d_ids[g])] == want).all())


def _run(layers_before_stall=None, compute_s=0.01, timeout_s=10.0):
    layout, shard, hbb, pos, d_ids, paged, plan = _decode()
    cfg = dict(name="P-push", case=CASE, nb=NB, tokens=TOKENS, compute_s=compute_s, scale=SCALE)
    if layers_before_stall is not None:
        cfg["layers_before_stall"] = layers_before_stall
    # serve_s bounds the peer's whole life; its start-up (imports, agent) alone took over 30 s
    # at load 40 on 2 cores, so the bound is generous and each read below has its own limit
    peer = TpPeer({"role": "pusher", "agents": [cfg], "serve_s": 300})
    agent = DescAgent("D-push", plan.registration_ranges())
    try:
        peer.line(timeout=120)  # the pusher is up
        recv = LayerwiseReceiver(agent, len(LayerPlan(plan).layers))
        recv.expect("req-1", d_ids, timeout_s=timeout_s)
        peer.send({"meta": base64.b64encode(agent.metadata()).decode(),
                   "regions": plan.region_table(), "ids": d_ids})
        report = None
        if layers_before_stall is not None:
            assert peer.line() == {"stalled": layers_before_stall}
            time.sleep(0.05)
            peer.kill()  # peer gone after some layers
        deadline = time.monotonic() + timeout_s + 5
        while recv.state("req-1") == PushState.WAITING and time.monotonic() < deadline:
            recv.poll()
            time.sleep(0.0005)
        if layers_before_stall is None:
            report = peer.line()
        return layout, shard, hbb, pos, d_ids, paged, plan, recv, report
    finally:
        agent.close()
        peer.kill()


def test_layerwise_push_every_byte_and_overlap_report():
    layout, shard, hbb, pos, d_ids, paged, plan, recv, rep = _run()
    assert rep["state"] == "sent", rep
    assert recv.state("req-1") == PushState.READY, recv.error("req-1")
    assert [list(x) for x in recv.valid_blocks("req-1")] == d_ids
    for name in LayerPlan(plan).layers:
        assert _layer_ok(layout, shard, hbb, pos, d_ids, paged, name), name
    fwd = rep["forward_end"] - rep["t0"]
    figures = {
        "layers": rep["layers"], "forward_s": round(fwd, 4),
        "last_write_done_after_forward_end_s": round(rep["last_write_done"] - rep["forward_end"], 4),
        "decode_ready_after_forward_end_s": round(recv.ready_at("req-1") - rep["forward_end"], 4),
        "first_save_s": round(rep["saves"][0] - rep["t0"], 4),
        "same_bytes_one_write_after_forward_s": round(rep["bulk_write_s"], 4),
        "bytes": int(plan.table_bytes([len(x) for x in d_ids])),
    }
    os.makedirs(os.path.dirname(REPORT), exist_ok=True)
    with open(REPORT, "w") as f:
        json.dump(figures, f, indent=1)
    print("\nlayer-wise overlap:", figures)


def test_peer_killed_after_some_layers_leaves_request_failed():
    layout, shard, hbb, pos, d_ids, paged, plan, recv, _ = _run(layers_before_stall=4, timeout_s=1.5)
    assert recv.state("req-1") == PushState.FAILED
    assert recv.valid_blocks("req-1") is None
    assert recv.layers_arrived("req-1") == 4
    assert "deadline" in recv.error("req-1")
    layers = LayerPlan(plan).layers
    assert all(_layer_ok(layout, shard, hbb, pos, d_ids, paged, n) for n in layers[:4])
    assert not any(paged.kv_caches[n].any() for n in layers[4:])


def test_decode_killed_after_some_layers_prefill_releases_at_lease_end():
    lease = 6.0
    cfg = dict(name="P-push2", case=CASE, nb=NB, tokens=TOKENS, compute_s=0.0, scale=SCALE,
               decode_dies_after=4, lease_s=lease)
    pusher = TpPeer({"role": "pusher", "agents": [cfg], "serve_s": 300})
    recv = TpPeer({"role": "receiver", "serve_s": 300, "agents": [
        dict(name="D-push2", case=CASE, nb=NB, tokens=TOKENS, scale=SCALE, until=4)]})
    try:
        pusher.line(timeout=120)            # the pusher is up (its agent info is unused)
        d = recv.line(timeout=120)          # the decode side's agent, plan, block ids
        pusher.send(d)                      # the lease starts here
        assert pusher.line(timeout=60) == {"paused": 4, "state": "pushing"}
        assert recv.line(timeout=60) == {"arrived": 4, "state": "waiting", "valid": False}
        recv.kill()                         # decode gone after 4 of 10 layers
        pusher.send("go")
        rep = pusher.line(timeout=lease + 120)
    finally:
        recv.kill()
        pusher.kill()
    assert rep["released"] == "req-1" and rep["count"] == 1 and rep["ids_match"]
    assert rep["still_tracked"] == []
    assert rep["after_start_s"] >= lease    # held until the lease ended, not released early
    # the remaining WRITEs to the dead peer failed, or were still pending when the lease ended
    assert rep["state"] in ("failed", "pushing"), rep
    print("\ndecode killed mid-push:", rep)
