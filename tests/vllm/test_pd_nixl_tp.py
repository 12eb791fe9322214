"""P/D pull through HmaNixlConnector between engines of different tensor-parallel sizes.

Each engine is a real vLLM Scheduler in this process and one process per TP rank (vLLM's TP
group initialized with gloo; a WORKER-role connector over CPU tensors shaped like vLLM's CPU
pages, each rank holding its KV heads); vLLM's KVOutputAggregator folds the ranks' outputs.
Real NIXL (UCX, loopback). P's ranks write a pattern of (layer, token, global head); after
the load, every byte of every block D loaded is compared on every D rank, and nothing else
was written. P frees only once every D rank said done; neither engine leaks a block.
"""
import time

import pytest

import harness as H
import tp_cases
from tp_harness import (PAIRS, TpEngine, check_loaded_bytes, engine_pool, pair, run_out_both,
                        zeroed)

from hmacore.windows import trim_remote_to_local

pytestmark = pytest.mark.nixl


def _prefill(P, prompt, rid="req"):
    hbs = H.C.resolve_kv_cache_block_sizes(P.kcc, P.vc)[1]
    P.s.add_request(H.make_request(rid, prompt, hbs, params={"do_remote_decode": True},
                                   max_tokens=1))
    deadline = time.monotonic() + 60
    while rid not in P.finished_params():
        assert time.monotonic() < deadline, "P never finished its prefill"
        P.step()
    table = P.s.kv_cache_manager.get_block_ids(rid)
    for r in P.ranks:
        r.call("fill", table=[list(map(int, g)) for g in table])
    return P.finished_params()[rid]


def _decode_until_loaded(D, prompt, params, rid="d-req", P=None):
    """D steps until its load ended; P (holding the lease) steps too, as a live prefill
    engine does: it answers each READ's done (D takes the data only then)."""
    hbs = H.C.resolve_kv_cache_block_sizes(D.kcc, D.vc)[1]
    req = H.make_request(rid, prompt, hbs, params=params, max_tokens=3)
    D.s.add_request(req)
    D.step()
    rr = D.metas[-1].reqs_to_recv[rid]
    deadline = time.monotonic() + 60
    while req.status == H.RequestStatus.WAITING_FOR_REMOTE_KVS:
        assert time.monotonic() < deadline, "the READs did not complete"
        D.step()
        if P is not None:
            P.step()
    return req, rr


@pytest.fixture(scope="module")
def engines():
    yield from engine_pool()


@pytest.mark.parametrize("case,tp_p,tp_d", [(c, p, d) for c in ("gemma", "dsv4")
                                            for p, d in PAIRS])
def test_mixed_tp_pull_every_byte(engines, case, tp_p, tp_d):
    P, D, prompt = pair(engines, case, tp_p, tp_d, (7, 13, 1))
    rid = f"{tp_p}{tp_d}"
    n = len(prompt)
    params = _prefill(P, prompt, rid=f"p-{rid}")
    assert params["tp_size"] == tp_p and params["remote_port"] == P.port
    req, rr = _decode_until_loaded(D, prompt, params, rid=f"d-{rid}", P=P)
    assert req.status != H.RequestStatus.FINISHED_ERROR
    assert req.num_computed_tokens >= n - 1, "D recomputed instead of loading"
    local, _ = trim_remote_to_local(rr.local_block_ids, rr.remote.block_ids, D.layout)
    loaded = [[int(b) for b in g] for g in local]
    assert sum(map(len, loaded)) > 0
    D.check_loaded(f"d-{rid}", loaded, control=case == "gemma" and tp_d == 2)
    run_out_both(P, D)
    assert P.s.connector.scheduler.leases() == {}


@pytest.mark.parametrize("case,tp_p,tp_d", tp_cases.state_params(tp_cases.STATE_CASES, PAIRS))
def test_mamba_state_across_tp_pull_every_byte(engines, case, tp_p, tp_d):
    """Full attention + two Mamba-type layers (GDN; Mamba2 with 2 groups and with 1, whose
    B/C every rank holds whole), conv state DS and SD (VLLM_SSM_CONV_STATE_LAYOUT in every
    rank process), P2/D1, P1/D2 and P2/D2 (control). P's ranks hold vLLM-shaped state pages
    tagged by (layer, table position, GLOBAL conv channel / ssm head, row / element) from
    vLLM's own weight-loader sharding; every byte of every D rank's loaded state page (content
    and padding: P's padding is tp_cases.STATE_PAD, D's stays 0 across TP sizes) equals that
    oracle for D's rank, attention as in the other cases, nothing else written; D schedules
    exactly the backoff suffix; no leak on either engine."""
    P, D, prompt = pair(engines, case, tp_p, tp_d, (5, 17, 1))
    pull_state_every_byte(P, D, prompt, f"s{tp_p}{tp_d}")
    run_out_both(P, D)
    assert P.s.connector.scheduler.leases() == {}


def pull_state_every_byte(P, D, prompt, rid: str) -> None:
    """P prefills, D loads (state groups included): every byte of every D rank's loaded
    state page (padding: P's STATE_PAD copied at equal TP, D's zero kept across TP sizes)
    and attention pages checked, rank 0 read as rank 1 must differ at D TP 2; D schedules
    exactly the backoff suffix (it loaded the rest)."""
    n = len(prompt)
    params = _prefill(P, prompt, rid=f"p-{rid}")
    assert params["tp_size"] == P.tp
    hbs = H.C.resolve_kv_cache_block_sizes(D.kcc, D.vc)[1]
    req = H.make_request(f"d-{rid}", prompt, hbs, params=params, max_tokens=3)
    D.s.add_request(req)
    D.step()
    rr = D.metas[-1].reqs_to_recv[f"d-{rid}"]
    deadline = time.monotonic() + 60
    while req.status == H.RequestStatus.WAITING_FOR_REMOTE_KVS:
        assert time.monotonic() < deadline, "the READs did not complete"
        so = D.step()     # the step that sees the load done schedules the request's rest
        P.step()
    assert req.status != H.RequestStatus.FINISHED_ERROR, [r.tail() for r in D.ranks]
    backoff = D.s.connector.scheduler.backoff
    end = rr.load_start + rr.num_external_tokens
    assert backoff >= 1 and end == n - backoff, (end, n, backoff)
    assert so.num_scheduled_tokens.get(f"d-{rid}") == n - end, so.num_scheduled_tokens
    local, _ = trim_remote_to_local(rr.local_block_ids, rr.remote.block_ids, D.layout)
    loaded = [[int(b) for b in g] for g in local]
    mamba = [g for g, s in enumerate(D.layout.groups) if s.kind.name == "MAMBA"]
    assert mamba and all(len(loaded[g]) == 1 for g in mamba), loaded   # one state slot
    # P's state padding is STATE_PAD: copied with whole pages at equal TP, never read across
    D.check_loaded(f"d-{rid}", loaded, control=D.tp == 2,
                   state_pad=tp_cases.STATE_PAD if P.tp == D.tp else 0)


@pytest.fixture(scope="module")
def remap_engines():
    """Two engines of other block sizes AND other TP sizes (each plays P and D): TP 2 with
    32-token blocks, TP 1 with 64-token blocks; vLLM CPU vec-kernel pages (CPU_VEC)."""
    started = []
    try:
        for case, tp in (("gemma-vec32", 2), ("gemma-vec64", 1)):
            started.append(TpEngine(case, tp, f"remap-{case}"))
        yield [e.wait_ready() for e in started]
    finally:
        for e in started:
            e.close()


@pytest.mark.parametrize("p_first", [True, False], ids=["p_tp2_b32-d_tp1_b64",
                                                       "p_tp1_b64-d_tp2_b32"])
def test_mixed_tp_and_block_sizes_pull_every_byte(remap_engines, p_first):
    """Pull with a block-size remap across TP sizes: each D rank reads, from every P rank
    holding some of its heads, the token rows of those heads (one READ per source rank, runs
    in each side's grain). Every byte of every D rank is compared: the rows of the tokens D
    needed (per group: window, prefix) hold P's pattern for that rank's heads, all else zero;
    rank 0's bytes checked as rank 1's heads differ (negative control)."""
    P, D = remap_engines if p_first else remap_engines[::-1]
    for eng in (P, D):
        eng.call_all("zero")
    tag = "a" if p_first else "b"
    n = P.case.prompt_tokens
    prompt = [1 + (i * 7 + (3 if p_first else 5)) % 900 for i in range(n)]
    params = _prefill(P, prompt, rid=f"p-{tag}")
    assert params["remote_block_sizes"] != list(D.layout.block_sizes)
    assert params["tp_size"] == P.tp != D.tp
    req, rr = _decode_until_loaded(D, prompt, params, rid=f"d-{tag}", P=P)
    assert req.status != H.RequestStatus.FINISHED_ERROR
    assert req.num_computed_tokens >= n - 1, "D recomputed instead of loading"
    end = rr.load_start + rr.num_external_tokens
    check_loaded_bytes(D, f"d-{tag}", end, rr.load_start)
    run_out_both(P, D)
    assert P.s.connector.scheduler.leases() == {}


@pytest.fixture(scope="module")
def remap_state_engines():
    """Per state case four engines: TP 1 and TP 2 at 32-token blocks and at 64-token blocks
    (head size 64: vLLM CPU's vec kernel), started together, reused by the case's tests."""
    pools = {c: tuple((f"b{bs}t{tp}", f"{c}-b{bs}", tp) for bs in (32, 64) for tp in (1, 2))
             for c in tp_cases.STATE_CASES}
    yield from engine_pool("rs-", pools=pools)


@pytest.mark.parametrize("case,bp,tp_p,tp_d",
                         tp_cases.state_params(tp_cases.STATE_CASES, (32, 64), PAIRS,
                                               ci=("mamba2-g1-sd",)))
def test_mamba_state_remap_across_tp_pull_every_byte(remap_state_engines, case, bp, tp_p, tp_d):
    """Block sizes AND TP sizes differ with Mamba state groups (issue 20 (b)): GDN, Mamba2
    g2 / g1, Mamba1, conv DS and SD; P 32 / D 64 and P 64 / D 32 tokens per block; P2/D1,
    P1/D2, P2/D2. Each D rank reads from every P rank it needs, one READ of runs each: the
    attention token rows of its heads (regrain) and the state byte ranges of its state
    (hmacore.state_tp), P's running-state slot onto D's slot for the state after its load.
    Every byte of every D rank: attention rows of [lo, hi) hold P's pattern for its heads,
    the state slot holds P's state (P's table position) as vLLM's loaders shard it for D's
    rank (tp_cases.state_page), its padding and every other block zero; rank 0 read as rank 1
    differs (control); no leak on either engine."""
    e = remap_state_engines(case)
    bd = 96 - bp
    P, D = e[f"b{bp}t{tp_p}"], e[f"b{bd}t{tp_d}"]
    prompt = zeroed(P, D, (11, 17, 1), tp_p, tp_d, shift=bp)
    rid = f"rs{bp}{tp_p}{tp_d}"
    params = _prefill(P, prompt, rid=f"p-{rid}")
    assert params["tp_size"] == tp_p and params["remote_block_sizes"] != list(D.layout.block_sizes)
    req, rr = _decode_until_loaded(D, prompt, params, rid=f"d-{rid}", P=P)
    assert req.status != H.RequestStatus.FINISHED_ERROR
    s = params["remote_num_tokens"]
    end = rr.load_start + rr.num_external_tokens
    assert 0 < s == end and req.num_computed_tokens >= end, (s, end, req.num_computed_tokens)
    state = (-(-end // bd) - 1, -(-s // bp) - 1)      # D's slot, P's state position
    check_loaded_bytes(D, f"d-{rid}", end, rr.load_start, state=state)
    run_out_both(P, D)
    assert P.s.connector.scheduler.leases() == {}
