"""A failed NIXL READ (real UCX transfer, error injected where the worker polls / waits for
it) inside vLLM 0.32's real Scheduler, per KV cache group layout:

* one group: the worker reports the load's blocks by id and vLLM keeps the local prefix
  (``recompute``: num_computed_tokens == the local hit, the suffix recomputed) or fails the
  request alone (``fail``), async and sync loads alike;
* several groups: vLLM 0.32 takes no block ids, the load is reported per request and vLLM
  restarts it from 0; the engine stays up.
"""
import os
import time

import pytest

import harness as H
from test_partial_recovery import LAYERS
from test_pd_nixl import Engine, drain_p, p_prefill
from vllm.v1.kv_cache_interface import KVCacheConfig

from hmacore.errors import TransferError

pytestmark = pytest.mark.nixl
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")


def full_only():
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[],
                         kv_cache_groups=[H.group(LAYERS, H.attn(16))])


def inject_read_error(D):
    """The next READ D polls or waits for reports a NIXL error (the transfer itself is real)."""
    agent = D.w.worker.agent
    hit = []

    def poll(t, *a, **k):
        hit.append(t)
        raise TransferError("injected: remote peer gone mid-transfer")
    agent.poll = poll
    agent.wait = poll
    return hit


def warm_local_prefix(D, prompt, tokens):
    """D computes ``prompt[:tokens]`` itself: its prefix cache then holds those blocks."""
    D.s.add_request(H.make_request("warm", prompt[:tokens], 16, max_tokens=1))
    D.d.run()




@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
def test_one_group_failed_read_keeps_the_local_prefix(sync):
    P = Engine(full_only, load_failure_policy="recompute")
    D = Engine(full_only, load_failure_policy="recompute",
               extra={"sync_load": True} if sync else None)
    try:
        n = 150
        prompt, params = p_prefill(P, n)
        warm_local_prefix(D, prompt, 64)
        r = H.make_request("d", prompt, 16, params=params, max_tokens=2)
        D.s.add_request(r)
        hit = inject_read_error(D)
        steps = [D.d.step().num_scheduled_tokens.get("d", 0)]   # READ posted (sync: waited)
        rr = D.d.metas[-1].reqs_to_recv["d"]
        assert rr.start_tokens == 64 and len(rr.local_block_ids[0]) > 0
        deadline = time.monotonic() + 20
        while not hit or r.status == H.RequestStatus.WAITING_FOR_REMOTE_KVS:
            assert time.monotonic() < deadline, "the load never ended"
            steps.append(D.d.step().num_scheduled_tokens.get("d", 0))
        rep = D.w.worker.recoveries["d"]
        assert (rep.safe_tokens, rep.lands_at, rep.per_request) == (64, 64, False)
        assert rep.block_ids == set(rr.local_block_ids[0])   # a READ fails as a whole
        assert "d" not in D.s.connector.scheduler.failed_recving
        while D.s.has_unfinished_requests():
            steps.append(D.d.step().num_scheduled_tokens.get("d", 0))
        # after the failure the request computes exactly [64, n): the local prefix is kept
        # (a sync load first scheduled its one last token: the load was to supply the rest)
        prefill = [x for x in steps if x > 1]
        assert prefill == [n - 64], steps
        assert r.status == H.RequestStatus.FINISHED_LENGTH_CAPPED
        H.assert_no_leak(D.s)
    finally:
        P.close()
        D.close()


@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
def test_one_group_failed_read_under_fail_policy_fails_alone(sync):
    P = Engine(full_only)
    D = Engine(full_only, extra={"sync_load": True} if sync else None)
    try:
        prompt, params = p_prefill(P, 150)
        warm_local_prefix(D, prompt, 64)
        r = H.make_request("d", prompt, 16, params=params, max_tokens=2)
        other = H.make_request("o", [7 + i % 300 for i in range(40)], 16, max_tokens=3)
        D.s.add_request(r)
        D.s.add_request(other)
        inject_read_error(D)
        D.d.run()
        assert r.status == H.RequestStatus.FINISHED_ERROR
        assert other.status == H.RequestStatus.FINISHED_LENGTH_CAPPED
        H.assert_no_leak(D.s)
    finally:
        P.close()
        D.close()


def test_multi_group_failed_read_is_per_request_and_restarts_from_zero():
    P = Engine(lambda: H.gemma_like(num_blocks=64), load_failure_policy="recompute")
    D = Engine(lambda: H.gemma_like(num_blocks=64), load_failure_policy="recompute")
    try:
        prompt, params = p_prefill(P, 150)
        r = H.make_request("d", prompt, 16, params=params, max_tokens=2)
        D.s.add_request(r)
        inject_read_error(D)
        deadline = time.monotonic() + 20
        D.d.step()
        while "d" not in D.s.connector.scheduler.failed_recving:
            assert time.monotonic() < deadline, "the failed READ was never reported"
            D.d.step()
        assert "d" not in D.w.worker.recoveries     # no block ids: vLLM would raise
        assert r.num_computed_tokens == 0
        D.d.run()
        assert r.status == H.RequestStatus.FINISHED_LENGTH_CAPPED
        H.assert_no_leak(D.s)
    finally:
        P.close()
        D.close()


def test_failed_sync_load_tells_the_prefill_engine_to_free_at_once(monkeypatch):
    # a sync load's READ fails (NIXL reports an error once the real READ left flight; a
    # failed READ delivers no done to P, modelled by posting it without one): vLLM restarts
    # the request, and D tells P "done" so P frees its blocks now, not at its 30 s lease end
    P = Engine(full_only)
    D = Engine(full_only, load_failure_policy="recompute", extra={"sync_load": True})
    try:
        prompt, params = p_prefill(P, 150)
        agent = D.w.worker.agent
        read, poll = agent.read, agent.poll

        def read_without_done(*args, **kwargs):
            return read(*args, **{**kwargs, "notif": None})

        def failing(t, *args, **kwargs):
            deadline = time.monotonic() + 20
            while poll(t) == "PROC" and time.monotonic() < deadline:
                time.sleep(0.001)
            raise TransferError("injected: READ reported an error")
        monkeypatch.setattr(agent, "read", read_without_done)
        monkeypatch.setattr(agent, "poll", failing)
        monkeypatch.setattr(agent, "wait", failing)
        r = H.make_request("d", prompt, 16, params=params, max_tokens=2)
        D.s.add_request(r)
        D.d.run()                                    # READ posted, failed, recomputed
        assert D.w.worker.recoveries["d"].lands_at == 0
        assert r.status == H.RequestStatus.FINISHED_LENGTH_CAPPED
        H.assert_no_leak(D.s)
        drain_p(P)                                   # bounded by 20 s < the 30 s lease
        P.d.step()
        assert not any(m.expired for m in P.d.metas)     # D's done freed them
    finally:
        P.close()
        D.close()
