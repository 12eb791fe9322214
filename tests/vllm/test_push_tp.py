"""Layer-wise push (decode first) through HmaNixlConnector between engines of different
tensor-parallel sizes.

Each engine is a real vLLM Scheduler in this process and one process per TP rank (vLLM's TP
group initialized with gloo; a WORKER-role connector over CPU tensors shaped like vLLM's CPU
pages, each rank holding its KV heads); vLLM's KVOutputAggregator folds the ranks' outputs.
Real NIXL (UCX, loopback). D registers its blocks with every P rank; P's forward pass writes,
layer by layer, the pattern of (layer, token, global head) into the scheduled blocks and calls
``save_kv_layer`` per layer, which WRITEs that layer's head slices into D's blocks. Checked on
every D rank: every byte of every pushed block equals the pattern of that rank's heads,
nothing else was written; no block leaked on either engine; P freed its blocks.
"""
import time

import pytest

import harness as H
from tp_harness import TpEngine

pytestmark = pytest.mark.nixl

PUSH = {"transfer_mode": "push", "push_register_timeout": 4, "push_recv_timeout": 8}


def push_params(push_id, p_port):
    d = {"do_remote_prefill": True, "transfer_mode": "push", "push_id": push_id,
         "remote_host": "127.0.0.1", "remote_port": p_port}
    p = {"do_remote_decode": True, "transfer_mode": "push", "push_id": push_id}
    return d, p


def _run_out(E, timeout=60):
    deadline = time.monotonic() + timeout
    while E.s.requests:
        assert time.monotonic() < deadline, f"requests still held: {list(E.s.requests)}"
        E.step()


@pytest.fixture(scope="module")
def engines():
    """Per case, three push engines (TP 1, TP 2, a second TP 2), started together and reused
    by that case's tests; a case's engines are closed when the next case starts."""
    live: dict[str, dict[str, TpEngine]] = {}

    def get(case: str) -> dict[str, TpEngine]:
        if case not in live:
            for old in live.pop(next(iter(live), None), {}).values() if live else ():
                old.close()
            started = {}
            try:
                for key, tp in (("tp1", 1), ("tp2", 2), ("tp2b", 2)):
                    started[key] = TpEngine(case, tp, f"push-{case}-{key}", extra=PUSH)
                live[case] = {k: e.wait_ready() for k, e in started.items()}
            except Exception:
                for e in started.values():
                    e.close()
                raise
        return live[case]
    yield get
    for group in live.values():
        for e in group.values():
            e.close()


PAIRS = {(2, 1): ("tp2", "tp1"), (1, 2): ("tp1", "tp2"), (2, 2): ("tp2", "tp2b")}


def _start(P, D, prompt, rid):
    hbs = H.C.resolve_kv_cache_block_sizes(D.kcc, D.vc)[1]
    d_params, p_params = push_params(f"push-{rid}", P.port)
    d_req = H.make_request(f"d-{rid}", prompt, hbs, params=d_params, max_tokens=3)
    p_req = H.make_request(f"p-{rid}", prompt, hbs, params=p_params, max_tokens=1)
    D.s.add_request(d_req)
    P.s.add_request(p_req)
    return d_req, p_req


def _until_loaded(P, D, d_req, timeout=60):
    deadline = time.monotonic() + timeout
    while d_req.status == H.RequestStatus.WAITING_FOR_REMOTE_KVS or \
            d_req.request_id not in {r for m in D.metas for r in getattr(m, "push_regs", {})}:
        assert time.monotonic() < deadline, "the push did not complete"
        D.step()
        P.step(fill=True)


def _registration(D, rid):
    for m in D.metas:
        if rid in getattr(m, "push_regs", {}):
            return m.push_regs[rid]
    raise AssertionError(f"no registration of {rid}")


@pytest.mark.parametrize("case,tp_p,tp_d", [(c, p, d) for c in ("gemma", "dsv4")
                                            for p, d in PAIRS])
def test_mixed_tp_push_every_byte(engines, case, tp_p, tp_d):
    e = engines(case)
    P, D = (e[k] for k in PAIRS[(tp_p, tp_d)])
    for eng in (P, D):
        eng.call_all("zero")
    rid = f"{case}-{tp_p}{tp_d}"
    n = P.case.prompt_tokens
    prompt = [1 + (i * 5 + tp_p * 17 + tp_d * 3) % 900 for i in range(n)]
    d_req, p_req = _start(P, D, prompt, rid)
    _until_loaded(P, D, d_req)
    assert d_req.status != H.RequestStatus.FINISHED_ERROR
    assert d_req.num_computed_tokens >= n - 1, "D recomputed instead of receiving the push"
    reg = _registration(D, d_req.request_id)
    assert reg.awaiting
    loaded = [[int(b) for b in g if b] for g in reg.block_ids]
    assert sum(map(len, loaded)) > 0
    table = [list(map(int, g)) for g in D.s.kv_cache_manager.get_block_ids(d_req.request_id)]
    groups = D.kcc.kv_cache_groups
    want = sum(len(loaded[g]) * grp.kv_cache_spec.page_size_bytes * len(grp.layer_names)
               for g, grp in enumerate(groups))
    for r, got in enumerate(D.call_all("check", table=table, loaded=loaded)):
        assert got == {"bad": 0, "checked": want, "stray": 0}, (case, tp_p, tp_d, r, got)
    if case == "gemma" and tp_d == 2:   # control: rank 0 holds other heads than rank 1
        assert D.ranks[0].call("check", table=table, loaded=loaded, as_rank=1)["bad"] > 0
    _run_out(D)
    H.assert_no_leak(D.s)
    _run_out(P)            # P frees once every P rank reported its pushes ended
    H.assert_no_leak(P.s)
    sched = P.s.connector.scheduler
    assert sched.leases() == {} and sched.registered() == set() and sched.held() == set()
    assert sched._reg_partial == {}
