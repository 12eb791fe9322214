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
from tp_harness import TpEngine

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


def _decode_until_loaded(D, prompt, params, rid="d-req"):
    hbs = H.C.resolve_kv_cache_block_sizes(D.kcc, D.vc)[1]
    req = H.make_request(rid, prompt, hbs, params=params, max_tokens=3)
    D.s.add_request(req)
    D.step()
    rr = D.metas[-1].reqs_to_recv[rid]
    deadline = time.monotonic() + 60
    while req.status == H.RequestStatus.WAITING_FOR_REMOTE_KVS:
        assert time.monotonic() < deadline, "the READs did not complete"
        D.step()
    return req, rr


def _run_out(E, timeout=60):
    deadline = time.monotonic() + timeout
    while E.s.requests:
        assert time.monotonic() < deadline, f"requests still held: {list(E.s.requests)}"
        E.step()


@pytest.mark.parametrize("case", ["gemma", "dsv4"])
@pytest.mark.parametrize("tp_p,tp_d", [(2, 1), (1, 2), (2, 2)])
def test_mixed_tp_pull_every_byte(case, tp_p, tp_d):
    P = TpEngine(case, tp_p, "P")
    try:
        D = TpEngine(case, tp_d, "D")
    except Exception:
        P.close()
        raise
    try:
        n = P.case.prompt_tokens
        prompt = [1 + i % 900 for i in range(n)]
        params = _prefill(P, prompt)
        assert params["tp_size"] == tp_p and params["remote_port"] == P.port
        req, rr = _decode_until_loaded(D, prompt, params)
        assert req.status != H.RequestStatus.FINISHED_ERROR
        assert req.num_computed_tokens >= n - 1, "D recomputed instead of loading"
        local, _ = trim_remote_to_local(rr.local_block_ids, rr.remote.block_ids, D.layout)
        loaded = [[int(b) for b in g] for g in local]
        assert sum(map(len, loaded)) > 0
        table = [list(map(int, g)) for g in D.s.kv_cache_manager.get_block_ids("d-req")]
        specs = [g.kv_cache_spec for g in D.kcc.kv_cache_groups]
        want = sum(len(loaded[g]) * s.page_size_bytes * len(D.kcc.kv_cache_groups[g].layer_names)
                   for g, s in enumerate(specs))
        for r, rank in enumerate(D.ranks):
            got = rank.call("check", table=table, loaded=loaded)
            assert got == {"bad": 0, "checked": want, "stray": 0}, (case, tp_p, tp_d, r, got)
        _run_out(D)
        H.assert_no_leak(D.s)
        _run_out(P)            # P frees once every D rank's done reached every P rank
        H.assert_no_leak(P.s)
        assert P.s.connector.scheduler.leases() == {}
    finally:
        D.close()
        P.close()
