"""A NIXL peer process for the heterogeneous-TP and layer-wise push tests (run with
subprocess, never forked; the test kills it by PID and bounds its life with ``serve_s``).

argv[1] is JSON ``{"role": "prefill" | "pusher" | "decode", "agents": [cfg, ...], "serve_s": S}``.

prefill: each cfg ``{name, case, tp, rank, nb, tokens, bs_div (opt), positions (opt),
track (opt)}`` hosts one TP rank's paged KV (pages sized for its heads), filled with tp_pattern
for the request's P ids, a DescAgent over it and a HandshakeServer (loopback) answering with
its TP-aware payload. It prints ``{"agents": {name: {"port": P}}}`` and serves (the test
handshakes, then READs) until stdin closes or S passes. With ``track = {req, decode_tp,
lease_s}`` the agent also runs a SendTracker for ``req`` (added on the first stdin line, which
it acknowledges with ``{"added": true}``): each
``<req>:done`` notification is mapped to the sender's decode rank (from its handshake) and
printed as ``{"notify": name, "rank": r, "outcome": ..., "duplicates": n}``; a lease expiry
as ``{"expired": outcome, "after_s": seconds since add}``; a completion adds ``"after_s"``.

decode: one cfg ``{name, case, tp, rank, nb, tokens, ports}``: a decode rank that handshakes
with the prefill ranks' servers once a stdin line arrives (it prints ``{"ready": true}`` first),
READs its head slices, prints ``{"read": bytes_ok}`` and
waits (the test kills it before it notifies: a decode rank that died).

pusher: one cfg ``{name, case, nb, tokens, scale, layers_before_stall (opt), compute_s}``; prints its
agent info, then reads one stdin line ``{"meta", "regions", "ids", "name"}`` (the decode
side's agent, plan and block ids), runs a simulated forward (``compute_s`` of busy work per
layer), calls save_layer after each layer, progresses until SENT and prints a timing report.
With ``layers_before_stall = k`` it stops after k layers are written and prints
``{"stalled": k}`` (the test then kills it). With ``decode_dies_after = k`` (and ``lease_s``)
it pauses after k layers (``{"paused": k}``), and after a stdin line (the decode process was
killed meanwhile) pushes the rest and progresses until the lease releases the request,
printing what the release callback saw.

receiver: one cfg ``{name, case, nb, tokens, scale, until}``: a decode process for layer-wise
push (prints its agent, plan and block ids; reports once ``until`` layers arrived; killed).
"""
import base64
import json
import os
import select
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))                 # tests/ (oracle_tp)
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # repo root

import numpy as np  # noqa: E402

from hmacore.layerwise import LayerPlan, LayerwisePusher, PushState  # noqa: E402
from hmacore.sends import SendTracker  # noqa: E402
from hmacore.demo.paged_memory import allocate_paged_kv  # noqa: E402
from hmacore.plan import TransferPlan  # noqa: E402
from hmacore.tp import GroupSharding  # noqa: E402
from hmacore.transport.nixl_desc import DescAgent  # noqa: E402
from hmacore.transport.handshake import (HandshakePayload, HandshakeServer,  # noqa: E402
                                         exchange_handshake)
from hmacore.transport.tp_peer import tp_pair_plans  # noqa: E402
from oracle_tp import (oracle_heads, rank_pages, request_ids, tp_case_layout,  # noqa: E402
                       tp_pattern)


def build_rank(case, tp, rank, nb, table, positions, fill=True, scale=1, bs_div=1):
    """Paged KV of one TP rank, filled with the pattern at ``table``'s ids; its plan."""
    layout, shard, hbb = tp_case_layout(case, scale, bs_div)
    pages = rank_pages(shard, hbb, tp)
    paged = allocate_paged_kv(layout, nb, page_bytes=pages)
    if fill:
        for g, spec in enumerate(layout.groups):
            if not table[g]:
                continue
            h, k, repl = shard[g]
            heads = None if repl else oracle_heads(h, tp, rank)
            for name in spec.layer_names:
                paged.kv_caches[name][np.asarray(table[g])] = tp_pattern(
                    name, positions[g], spec.block_size, pages[g], heads, k)
    plan = TransferPlan.from_kv_caches(layout, paged.kv_caches, num_blocks=nb)
    return layout, paged, plan


KV_DTYPE, HEAD_DIM = "uint8", 16  # declared by every test rank (the bytes are a pattern)


def tp_payload(plan, agent, name, case, tp, rank):
    """A rank's TP-aware handshake payload (shardings of the case)."""
    shard = [GroupSharding(*s) for s in tp_case_layout(case)[1]]
    return HandshakePayload.for_tp_plan(plan, name, agent.metadata(), tp_size=tp, tp_rank=rank,
                                        shardings=shard, kv_dtype=KV_DTYPE, head_dim=HEAD_DIM)


def decode_ids(layout, pos, nb):
    """Decode-side ids: a different, reversed placement than the prefill side's."""
    d_ids, nxt = [], nb - 1
    for g in range(layout.num_groups):
        d_ids.append(list(range(nxt, nxt - len(pos[g]), -1)))
        nxt -= len(pos[g])
    return d_ids


def info(agent, plan):
    return {"meta": base64.b64encode(agent.metadata()).decode(), "regions": plan.region_table()}


def stdin_line(deadline):
    while time.monotonic() < deadline:
        r, _, _ = select.select([sys.stdin], [], [], 0.05)
        if r:
            return sys.stdin.readline()
    return ""


def prefill(args):
    hosted, out, trackers = [], {}, []
    for cfg in args["agents"]:
        bs_div = cfg.get("bs_div", 1)
        layout, _, _ = tp_case_layout(cfg["case"], 1, bs_div)
        if "positions" in cfg:  # explicit P block positions (block-size-ratio case), ids 1..
            pos, nxt, ids = cfg["positions"], 1, []
            for g in pos:
                ids.append(list(range(nxt, nxt + len(g))))
                nxt += len(g)
        else:
            pos, ids, _ = request_ids(layout, cfg["tokens"])
        _, paged, plan = build_rank(cfg["case"], cfg["tp"], cfg["rank"], cfg["nb"], ids, pos,
                                    bs_div=bs_div)
        agent = DescAgent(cfg["name"], plan.registration_ranges())
        peers = {}  # decode agent name -> its TP rank, as its handshake said
        server = HandshakeServer(tp_payload(plan, agent, cfg["name"], cfg["case"], cfg["tp"],
                                            cfg["rank"]),
                                 on_peer=lambda p, peers=peers: peers.__setitem__(p.agent_name,
                                                                                  p.tp.tp_rank))
        hosted.append((agent, paged, server))
        out[cfg["name"]] = {"port": server.port}
        if "track" in cfg:
            t = cfg["track"]
            shard = [GroupSharding(*s) for s in tp_case_layout(cfg["case"], 1, bs_div)[1]]
            tracker = SendTracker.for_deployment(layout, shard, prefill_tp=cfg["tp"],
                                                 prefill_rank=cfg["rank"], decode_tp=t["decode_tp"])
            trackers.append((agent, peers, tracker, t))
    print(json.dumps({"agents": out}), flush=True)
    added = None
    deadline = time.monotonic() + args["serve_s"]
    while time.monotonic() < deadline:
        r, _, _ = select.select([sys.stdin], [], [], 0.01 if trackers else 0.1)
        if r:
            if not sys.stdin.readline():
                break
            if trackers and added is None:  # "add": the request's blocks are handed out now
                added = time.monotonic()
                for _, _, tracker, t in trackers:
                    tracker.add(t["req"], lease_s=t["lease_s"])
                print(json.dumps({"added": True}), flush=True)
        for agent, peers, tracker, t in trackers:
            for sender, msg in agent.notifs_by_agent():
                rid, _, body = msg.decode().partition(":")
                if body != "done":
                    continue
                rank = peers.get(sender)
                ev = {"notify": sender, "rank": rank}
                if rank is None:
                    ev["outcome"] = "no handshake from this agent: ignored"
                else:
                    o = tracker.notify(rid, rank)
                    ev["outcome"] = None if o is None else {
                        "status": o.status.value, "notified": list(o.notified),
                        "missing": list(o.missing)}
                    ev["duplicates"] = tracker.duplicates
                    if o is not None and added is not None:
                        ev["after_s"] = time.monotonic() - added
                print(json.dumps(ev), flush=True)
            for o in tracker.poll():
                print(json.dumps({"expired": {"status": o.status.value, "request": o.request_id,
                                              "notified": list(o.notified),
                                              "missing": list(o.missing)},
                                  "after_s": time.monotonic() - added}), flush=True)
    for agent, _, server in hosted:
        server.close()
        agent.close()
    return 0


def decode(args):
    """One decode rank in its own process: handshake, READ, report, then wait to be killed."""
    cfg = args["agents"][0]
    deadline = time.monotonic() + args["serve_s"]
    layout, shard, hbb = tp_case_layout(cfg["case"])
    pos, p_ids, _ = request_ids(layout, cfg["tokens"])
    d_ids = decode_ids(layout, pos, cfg["nb"])
    _, paged, plan = build_rank(cfg["case"], cfg["tp"], cfg["rank"], cfg["nb"], None, None,
                                fill=False)
    agent = DescAgent(cfg["name"], plan.registration_ranges())
    me = tp_payload(plan, agent, cfg["name"], cfg["case"], cfg["tp"], cfg["rank"])
    print(json.dumps({"ready": True}), flush=True)
    if not stdin_line(deadline):  # "go"
        return 4
    got = [exchange_handshake("127.0.0.1", port, me) for port in cfg["ports"]]
    _, pairs, _ = tp_pair_plans(me, plan, got)
    by_rank = {p.tp.tp_rank: p for p in got}
    handles = []
    for p, pair in pairs.items():
        name = agent.add_remote(by_rank[p].agent_metadata)
        agent.prep_pair(name, name, pair.local.descriptors(), pair.remote.descriptors())
        handles.append(agent.post("READ", name, *pair.desc_ids(d_ids, p_ids)))
    for h in handles:
        agent.wait(h, timeout=10)
    pages = rank_pages(shard, hbb, cfg["tp"])
    ok = all(bool((paged.kv_caches[n][np.asarray(d_ids[g])] == tp_pattern(
        n, pos[g], spec.block_size, pages[g],
        None if shard[g][2] else oracle_heads(shard[g][0], cfg["tp"], cfg["rank"]),
        shard[g][1])).all()) for g, spec in enumerate(layout.groups) for n in spec.layer_names)
    print(json.dumps({"read": ok}), flush=True)
    stdin_line(deadline)  # the test kills this process here, before it notifies
    agent.close()
    return 0


def pusher(args):
    cfg = args["agents"][0]
    deadline = time.monotonic() + args["serve_s"]
    layout, _, _ = tp_case_layout(cfg["case"])
    pos, ids, _ = request_ids(layout, cfg["tokens"])
    _, paged, plan = build_rank(cfg["case"], 1, 0, cfg["nb"], ids, pos, scale=cfg.get("scale", 1))
    agent = DescAgent(cfg["name"], plan.registration_ranges())
    print(json.dumps({"agents": {cfg["name"]: info(agent, plan)}}), flush=True)
    line = stdin_line(deadline)
    if not line:
        return 4
    d = json.loads(line)
    dplan = TransferPlan.from_region_table(layout, d["regions"])
    peer = agent.add_remote(base64.b64decode(d["meta"]))
    agent.prep_pair(peer, peer, plan.descriptors(), dplan.descriptors())
    released = []
    lp = LayerwisePusher(agent, LayerPlan(plan), {peer: LayerPlan(dplan)},
                         release=lambda rid, lids: released.append((rid, time.monotonic(), lids)))
    lp.start("req-1", peer, ids, d["ids"], lease_s=cfg.get("lease_s", args["serve_s"]))
    if cfg.get("decode_dies_after") is not None:
        return _push_to_dying_decode(lp, cfg["decode_dies_after"], released, ids, deadline)
    stall = cfg.get("layers_before_stall")
    scratch = np.random.default_rng(0).random((96, 96))
    t0 = time.monotonic()
    saves = []
    for k, layer in enumerate(lp.local.layers):
        if stall is not None and k == stall:
            while lp._reqs["req-1"].pending and time.monotonic() < deadline:
                lp.progress()
            print(json.dumps({"stalled": k}), flush=True)
            stdin_line(deadline)  # the test kills this process here
            return 5
        end = time.monotonic() + cfg["compute_s"]
        while time.monotonic() < end:  # simulated layer forward: busy compute
            scratch = np.tanh(scratch @ scratch.T * 1e-3)
        t_fwd = time.monotonic()  # this layer's compute ended
        lp.save_layer("req-1", layer)
        saves.append(t_fwd)
        lp.progress()
    while lp.state("req-1") == PushState.PUSHING and time.monotonic() < deadline:
        lp.progress()
    # baseline: the same bytes as ONE write posted after the forward (no layer-wise overlap)
    tb = time.monotonic()
    h = agent.post("WRITE", peer, plan.desc_ids(ids), dplan.desc_ids(d["ids"]))
    agent.wait(h, timeout=10)
    bulk = time.monotonic() - tb
    print(json.dumps({"state": lp.state("req-1").value, "error": lp.error("req-1"), "bulk_write_s": bulk,
                      "t0": t0, "forward_end": t_fwd, "saves": saves,
                      "last_write_done": lp.last_write_done("req-1"),
                      "layers": len(lp.local.layers)}), flush=True)
    stdin_line(deadline)
    agent.close()
    return 0


def _push_to_dying_decode(lp, k, released, ids, deadline):
    """Push k layers, wait until their WRITEs are DONE, print ``{"paused": k}``; after a stdin
    line (the test killed the decode process meanwhile) push the remaining layers and progress
    until the lease releases the request; print what the release callback saw."""
    t_start = time.monotonic()
    layers = lp.local.layers
    for layer in layers[:k]:
        lp.save_layer("req-1", layer)
    while lp._reqs["req-1"].pending and time.monotonic() < deadline:
        lp.progress()
    print(json.dumps({"paused": k, "state": lp.state("req-1").value}), flush=True)
    if not stdin_line(deadline):
        return 4
    t_go = time.monotonic()
    for layer in layers[k:]:
        lp.save_layer("req-1", layer)  # WRITEs to a dead peer: fail to post, error or hang
        lp.progress()
    state = lp.state("req-1").value
    error = lp.error("req-1")
    while not released and time.monotonic() < deadline:
        lp.progress()
        time.sleep(0.005)
    rid, t_rel, lids = released[0] if released else (None, 0.0, None)
    print(json.dumps({"released": rid, "count": len(released), "state": state, "error": error,
                      "after_start_s": t_rel - t_start, "after_go_s": t_rel - t_go,
                      "ids_match": lids is not None and [list(x) for x in lids] == ids,
                      "still_tracked": list(lp.requests)}), flush=True)
    stdin_line(deadline)
    return 0


def receiver(args):
    """A decode process for layer-wise push: prints its agent, plan and block ids, counts layer
    notifications and prints ``{"arrived": n, ...}`` once ``until`` layers arrived; then waits
    to be killed."""
    from hmacore.layerwise import LayerwiseReceiver
    cfg = args["agents"][0]
    deadline = time.monotonic() + args["serve_s"]
    layout, _, _ = tp_case_layout(cfg["case"])
    pos, _, _ = request_ids(layout, cfg["tokens"])
    d_ids = decode_ids(layout, pos, cfg["nb"])
    _, paged, plan = build_rank(cfg["case"], 1, 0, cfg["nb"], None, None, fill=False,
                                scale=cfg.get("scale", 1))
    agent = DescAgent(cfg["name"], plan.registration_ranges())
    recv = LayerwiseReceiver(agent, len(LayerPlan(plan).layers))
    recv.expect("req-1", d_ids, timeout_s=args["serve_s"])
    print(json.dumps({**info(agent, plan), "ids": d_ids}), flush=True)
    while recv.layers_arrived("req-1") < cfg["until"] and time.monotonic() < deadline:
        recv.poll()
        time.sleep(0.001)
    print(json.dumps({"arrived": recv.layers_arrived("req-1"), "state": recv.state("req-1").value,
                      "valid": recv.valid_blocks("req-1") is not None}), flush=True)
    stdin_line(deadline)  # killed here
    return 0


def main():
    args = json.loads(sys.argv[1])
    return {"prefill": prefill, "pusher": pusher, "decode": decode,
            "receiver": receiver}[args["role"]](args)


if __name__ == "__main__":
    sys.exit(main())
