"""Invariant-first random flows through vLLM's real Scheduler with HmaNixlConnector.

Random mixes of P-side (producer) and D-side (remote prefill) requests, aborts, finished and
failed loads (recompute policy), finished sends and lease expiry. Invariants, every step:
  * the connector's tracked tables equal vLLM's KVCacheManager tables (nulls included);
  * producers' emitted ids are the window/state clip of vLLM's table;
  * every load's local ids are blocks vLLM allocated to that request.
At the end: no block leaked, nothing tracked, no lease, nothing awaited.
"""
import os

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import harness as H
from test_scheduler_flows import setup

ACTIONS = st.lists(st.tuples(
    st.sampled_from(["add_p", "add_d", "abort", "recv", "fail", "send", "tick", "none"]),
    st.integers(1, 160), st.integers(0, 10_000)), min_size=5, max_size=30)


# Each example drives a real Scheduler (~2-20 ms): 200 by default, raise it locally with
# HMACORE_VLLM_EXAMPLES (the suite-wide HMACORE_EXAMPLES would be far too slow here).
@settings(max_examples=int(os.environ.get("HMACORE_VLLM_EXAMPLES", "200")), deadline=None,
          suppress_health_check=list(HealthCheck))
@given(case=st.sampled_from(["gemma", "qwen3next", "dsv4"]), actions=ACTIONS)
def test_random_flows_keep_invariants(case, actions):
    # pools sized so that any single request fits (else it waits forever, by design)
    s, kcc, _ = setup(case, num_blocks=300 if case != "dsv4" else 2000,
                      load_failure_policy="recompute", extra={"kv_lease_duration": 5})
    now = [0.0]
    conn = s.connector.scheduler
    conn.clock = lambda: now[0]
    d = H.Driver(s)
    inflight: set[str] = set()   # the fake worker's view: async loads it was told to start
    n_req = 0
    hash_bs = H.C.resolve_kv_cache_block_sizes(kcc, s.vllm_config)[1]

    def live():
        return sorted(r for r in s.requests if not s.requests[r].is_finished())

    def check():
        meta, tables = d.metas[-1], d.table_at_meta[-1]
        for rid, tracked in d.tracked_at_meta[-1].items():
            H.assert_mirror(tracked, tables[rid], kcc, rid)
        for rid, rr in meta.reqs_to_recv.items():
            if rid in tables:
                for g, ids in enumerate(rr.local_block_ids):
                    assert set(ids) <= set(tables[rid][g]) - {0}

    for kind, size, pick in actions:
        kv = {}
        if kind in ("add_p", "add_d"):
            rid = f"r{n_req}"
            n_req += 1
            n = 8 + size * 3
            params = ({"do_remote_decode": True} if kind == "add_p"
                      else H.remote_params(rid, kcc, n))
            s.add_request(H.make_request(rid, [1 + (pick + i) % 900 for i in range(n)], hash_bs,
                                         params=params, max_tokens=1 + pick % 8))
        elif kind == "abort" and live():
            s.finish_requests(live()[pick % len(live())], H.RequestStatus.FINISHED_ABORTED)
        elif kind == "recv" and inflight:
            kv["finished_recving"] = set(inflight)
        elif kind == "fail" and inflight:
            rid = sorted(inflight)[pick % len(inflight)]
            kv["finished_recving"] = kv["failed_recving"] = {rid}
        elif kind == "send" and conn.leases():
            kv["finished_sending"] = set(conn.leases())
        elif kind == "tick":
            now[0] += 1 + pick % 6
        d.step(**kv)
        inflight -= kv.get("finished_recving", set())
        inflight |= {r for r, m in d.metas[-1].reqs_to_recv.items() if m.awaiting}
        check()

    # drain: every load completes, every lease is either read or expires
    for _ in range(200):
        if not s.requests:
            break
        now[0] += 1
        done, inflight = inflight, set()
        d.step(finished_recving=done)
        inflight |= {r for r, m in d.metas[-1].reqs_to_recv.items() if m.awaiting}
        check()
    H.assert_no_leak(s)
    assert not conn.leases() and not conn.awaiting()
    assert not inflight
