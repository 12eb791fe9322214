"""A NIXL peer process for the heterogeneous-TP and layer-wise push tests (run with
subprocess, never forked; the test kills it by PID and bounds its life with ``serve_s``).

argv[1] is JSON ``{"role": "prefill" | "pusher", "agents": [cfg, ...], "serve_s": S}``.

prefill: each cfg ``{name, case, tp, rank, nb, tokens, bs_div (opt), positions (opt)}`` hosts one TP rank's paged KV (pages
sized for its heads), filled with tp_pattern for the request's P ids, and a DescAgent over it.
It prints ``{"agents": {name: TpPeerInfo JSON}}`` and serves (the test
READs) until stdin closes or S passes.

pusher: one cfg ``{name, case, nb, tokens, scale, layers_before_stall (opt), compute_s}``; prints its
agent info, then reads one stdin line ``{"meta", "regions", "ids", "name"}`` (the decode
side's agent, plan and block ids), runs a simulated forward (``compute_s`` of busy work per
layer), calls save_layer after each layer, progresses until SENT and prints a timing report.
With ``layers_before_stall = k`` it stops after k layers are written and prints
``{"stalled": k}`` (the test then kills it).
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
from hmacore.paged import allocate_paged_kv  # noqa: E402
from hmacore.plan import TransferPlan  # noqa: E402
from hmacore.tp import GroupSharding  # noqa: E402
from hmacore.transport.nixl_desc import DescAgent  # noqa: E402
from hmacore.transport.tp_peer import TpPeerInfo  # noqa: E402
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


def info(agent, plan):
    return {"meta": base64.b64encode(agent.metadata()).decode(), "regions": plan.region_table()}


def stdin_line(deadline):
    while time.monotonic() < deadline:
        r, _, _ = select.select([sys.stdin], [], [], 0.05)
        if r:
            return sys.stdin.readline()
    return ""


def prefill(args):
    hosted, out = [], {}
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
        hosted.append((agent, paged))
        shard = [GroupSharding(*s) for s in tp_case_layout(cfg["case"], 1, bs_div)[1]]
        out[cfg["name"]] = TpPeerInfo.for_plan(plan, cfg["name"], agent.metadata(), tp_size=cfg["tp"],
                                               tp_rank=cfg["rank"], shardings=shard).to_bytes().decode()
    print(json.dumps({"agents": out}), flush=True)
    deadline = time.monotonic() + args["serve_s"]
    while time.monotonic() < deadline:
        r, _, _ = select.select([sys.stdin], [], [], 0.1)
        if r and not sys.stdin.readline():
            break
    for agent, _ in hosted:
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
    lp = LayerwisePusher(agent, LayerPlan(plan), {peer: LayerPlan(dplan)})
    lp.start("req-1", peer, ids, d["ids"], lease_s=args["serve_s"])
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


def main():
    args = json.loads(sys.argv[1])
    return prefill(args) if args["role"] == "prefill" else pusher(args)


if __name__ == "__main__":
    sys.exit(main())
