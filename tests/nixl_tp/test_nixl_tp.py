"""Real NIXL (UCX, DRAM), heterogeneous TP: one process per prefill rank (the rank-0 process
also hosts the TP=1 prefill deployment), decode ranks as agents in this process. Prefill pages
are head-sharded the way vLLM shards KV heads and filled with a pattern derived from (layer,
token, global head). Each prefill rank answers the TP-aware socket handshake (loopback); every
decode rank handshakes with the prefill ranks, builds its TpPairPlans from what the handshakes
delivered (tp_pair_plans), READs its head slices and checks every byte of every layer, and that
nothing else was written.
"""
import numpy as np
import pytest

from hmacore.transport.handshake import exchange_handshake
from hmacore.transport.nixl_desc import DescAgent

from hmacore.transport.tp_peer import tp_pair_plans

from tp_proc import TpPeer
from oracle_tp import oracle_heads, rank_pages, request_ids, tp_case_layout, tp_pattern

pytestmark = pytest.mark.nixl

CASES = ["full_sliding", "dsv4"]
TOKENS = 100
NB = 32


def _name(case, tp, rank):
    return f"P-{case}-tp{tp}-r{rank}"


@pytest.fixture(scope="module")
def prefill():
    """{(case, tp, rank): handshake port} of the prefill ranks, from two processes."""
    r0 = [dict(name=_name(c, tp, 0), case=c, tp=tp, rank=0, nb=NB, tokens=TOKENS)
          for c in CASES for tp in (1, 2)]
    r1 = [dict(name=_name(c, 2, 1), case=c, tp=2, rank=1, nb=NB, tokens=TOKENS) for c in CASES]
    # block-size ratio: prefill TP=2 with 8-token blocks holding the decode's 16-token positions
    dpos, _, _ = request_ids(tp_case_layout("full_sliding")[0], TOKENS)
    ppos = [[2 * j + h for j in g for h in (0, 1)] for g in dpos]
    for rank, lst in ((0, r0), (1, r1)):
        lst.append(dict(name=_name("bs8", 2, rank), case="full_sliding", tp=2, rank=rank, nb=NB,
                        tokens=TOKENS, bs_div=2, positions=ppos))
    peers = [TpPeer({"role": "prefill", "agents": a, "serve_s": 400}) for a in (r0, r1)]
    try:
        out = {}
        for p, cfgs in zip(peers, (r0, r1)):
            info = p.line()["agents"]
            for cfg in cfgs:
                case = "bs8" if cfg.get("bs_div") else cfg["case"]
                out[(case, cfg["tp"], cfg["rank"])] = info[cfg["name"]]["port"]
        yield out
    finally:
        for p in peers:
            p.kill()


def _decode_rank(case, tp_d, d):
    from peer_tp import build_rank, decode_ids
    layout, shard, hbb = tp_case_layout(case)
    pos, _, _ = request_ids(layout, TOKENS)
    d_ids = decode_ids(layout, pos, NB)  # a different, reversed placement than the prefill's
    _, paged, plan = build_rank(case, tp_d, d, NB, None, None, fill=False)
    return layout, shard, hbb, pos, d_ids, paged, plan


def _handshake_and_read(agent, plan, case, tp_d, d, ports, d_ids, p_ids):
    """Handshake with every prefill rank (socket, loopback), build the pair plans from what it
    delivered, READ from every source rank. Returns (ratio, source ranks)."""
    from peer_tp import tp_payload
    me = tp_payload(plan, agent, agent.name, case, tp_d, d)
    got = [exchange_handshake("127.0.0.1", port, me) for port in ports]
    mapping, pairs, ratio = tp_pair_plans(me, plan, got)
    by_rank = {p.tp.tp_rank: p for p in got}
    handles = []
    for p, pair in pairs.items():
        name = by_rank[p].agent_name
        assert agent.add_remote(by_rank[p].agent_metadata) == name
        agent.prep_pair(name, name, pair.local.descriptors(), pair.remote.descriptors())
        lids, rids = pair.desc_ids(d_ids, p_ids)
        assert lids.size > 0
        handles.append(agent.post("READ", name, lids, rids))
    for h in handles:
        agent.wait(h, timeout=10)
    return ratio, mapping.remote_ranks


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("tp_p,tp_d", [(2, 1), (1, 2), (2, 2)])
def test_hetero_tp_pull_every_byte(prefill, case, tp_p, tp_d):
    for d in range(tp_d):
        layout, shard, hbb, pos, d_ids, paged, plan = _decode_rank(case, tp_d, d)
        _, p_ids, _ = request_ids(layout, TOKENS)
        ports = [prefill[(case, tp_p, p)] for p in range(tp_p)]
        agent = DescAgent(f"D-{case}-{tp_p}{tp_d}-r{d}", plan.registration_ranges())
        try:
            ratio, sources = _handshake_and_read(agent, plan, case, tp_d, d, ports, d_ids, p_ids)
        finally:
            agent.close()
        assert ratio == 1 and sources == (tuple(range(tp_p)) if tp_d < tp_p else (d * tp_p // tp_d,))
        pages = rank_pages(shard, hbb, tp_d)
        checked = 0
        for g, spec in enumerate(layout.groups):
            h, k, repl = shard[g]
            heads = None if repl else oracle_heads(h, tp_d, d)
            for name in spec.layer_names:
                arr = paged.kv_caches[name]
                want = tp_pattern(name, pos[g], spec.block_size, pages[g], heads, k)
                got = arr[np.asarray(d_ids[g])]
                assert (got == want).all(), (case, tp_p, tp_d, d, name)
                checked += got.size
        # nothing outside the request's blocks was written
        touched = {b for g in d_ids for b in g}
        for name, arr in paged.kv_caches.items():
            others = np.asarray(sorted(set(range(NB)) - touched))
            assert not arr[others].any(), name
        assert checked == sum(len(d_ids[g]) * pages[g] * len(s.layer_names)
                              for g, s in enumerate(layout.groups))


def test_hetero_tp_with_block_size_ratio_every_byte(prefill):
    """P TP=2 with 8-token blocks -> D TP=1 with 16-token blocks: each D block's head slice is
    read as two token halves from two P blocks of the head's owner."""
    case, tp_p, tp_d, d = "full_sliding", 2, 1, 0
    layout, shard, hbb, pos, d_ids, paged, plan = _decode_rank(case, tp_d, d)
    p_ids, nxt = [], 1  # the peer numbered its blocks 1.. in position order, group by group
    for g in pos:
        p_ids.append(list(range(nxt, nxt + 2 * len(g))))
        nxt += 2 * len(g)
    agent = DescAgent("D-bs8", plan.registration_ranges())
    try:
        ratio, _ = _handshake_and_read(agent, plan, case, tp_d, d,
                                       [prefill[("bs8", tp_p, p)] for p in range(tp_p)], d_ids, p_ids)
    finally:
        agent.close()
    assert ratio == 2  # from the handshake: prefill blocks of 8 tokens, decode blocks of 16
    pages = rank_pages(shard, hbb, tp_d)
    for g, spec in enumerate(layout.groups):
        h, k, _ = shard[g]
        for name in spec.layer_names:
            want = tp_pattern(name, pos[g], spec.block_size, pages[g], oracle_heads(h, tp_d, d), k)
            assert (paged.kv_caches[name][np.asarray(d_ids[g])] == want).all(), name
