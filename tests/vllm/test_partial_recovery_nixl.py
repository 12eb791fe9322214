"""A failed NIXL READ (real UCX transfer, error injected where the worker polls / waits for
it) inside vLLM 0.32's real Scheduler, per KV cache group layout:

* one group: the worker reports the load's blocks by id and vLLM keeps the local prefix
  (``recompute``: num_computed_tokens == the local hit, the suffix recomputed) or fails the
  request alone (``fail``), async and sync loads alike;
* several groups: vLLM 0.32 takes no block ids, the load is reported per request and vLLM
  restarts it from 0; the engine stays up. Under ``recompute`` D then loads it again from P's
  blocks (``load_retries``, default 1; P keeps them leased meanwhile): every group arrives
  again and nothing is recomputed; with ``load_retries: 0``, or when the retry fails too,
  the prompt is recomputed.
"""
import os
import time

import pytest

import harness as H
from test_partial_recovery import LAYERS
from test_pd_nixl import Engine, drain_p, p_prefill
from vllm.v1.kv_cache_interface import KVCacheConfig

from hmacore.demo.paged_memory import read_pages
from hmacore.errors import TransferError
from hmacore.windows import trim_remote_to_local

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


def inject_one_read_error(D):
    """The first READ D polls reports a NIXL error; later ones are real."""
    agent = D.w.worker.agent
    hit = []

    def poll(t, *a, **k):
        if not hit:
            hit.append(t)
            del agent.poll, agent.wait            # the class's methods again
            raise TransferError("injected: remote peer gone mid-transfer")
        return type(agent).poll(agent, t, *a, **k)
    agent.poll = poll
    agent.wait = poll
    return hit


def count(counters, names):
    """Record every ``counters.add`` of ``names`` (the metrics path takes them per step)."""
    seen = {n: 0 for n in names}
    add = counters.add

    def recording(name, value=1):
        if name in seen:
            seen[name] += value
        add(name, value)
    counters.add = recording
    return seen


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


@pytest.mark.parametrize("retries", [1, 0])
def test_multi_group_failed_read_is_loaded_again_from_the_prefill_engine(retries):
    """A READ of a gemma-like (sliding + full) load fails once: with a retry, vLLM restarts
    the request from 0, D loads every group again from P's still-leased blocks (the same
    bytes as P's) and computes no prompt token itself; without, it recomputes all 150."""
    P = Engine(lambda: H.gemma_like(num_blocks=64), load_failure_policy="recompute")
    D = Engine(lambda: H.gemma_like(num_blocks=64), load_failure_policy="recompute",
               extra={"load_retries": retries})
    try:
        n = 150
        prompt, params = p_prefill(P, n)
        sched = count(D.s.connector.scheduler.counters, ["load_retries"])
        work = count(D.w.worker.counters, ["loads_abandoned", "loads", "transfer_failures"])
        r = H.make_request("d", prompt, 16, params=params, max_tokens=2)
        D.s.add_request(r)
        hit = inject_one_read_error(D)
        steps, loads, checked = [], [], False
        deadline = time.monotonic() + 60
        while D.s.has_unfinished_requests():
            assert time.monotonic() < deadline, f"the request never finished: {steps}"
            steps.append(D.d.step().num_scheduled_tokens.get("d", 0))
            rr = D.d.metas[-1].reqs_to_recv.get("d")
            if rr is not None:
                loads.append(rr)
            P.d.step()          # P answers READs' done
            if len(loads) == 2 and r.status == H.RequestStatus.WAITING_FOR_REMOTE_KVS:
                continue
            if len(loads) == 2 and not checked and r.num_computed_tokens >= n - 1:
                # the retry's blocks hold P's bytes, group by group, position by position
                local, remote = trim_remote_to_local(loads[1].local_block_ids,
                                                     loads[1].remote.block_ids, D.w.layout)
                for g, spec in enumerate(D.w.layout.groups):
                    for name in spec.layer_names:
                        assert (read_pages(D.paged.kv_caches[name], local[g]) ==
                                read_pages(P.paged.kv_caches[name], remote[g])).all()
                checked = True
        assert hit, "the injected READ error never fired"
        prefill = [x for x in steps if x > 1]
        assert r.status == H.RequestStatus.FINISHED_LENGTH_CAPPED
        if retries:
            assert len(loads) == 2 and loads[0].retry and not loads[1].retry
            assert sched["load_retries"] == 1
            assert checked, "the retried load's bytes were not checked"
            assert prefill == [], steps                    # nothing recomputed
            assert (work["transfer_failures"], work["loads"]) == (1, 1)
            assert work["loads_abandoned"] == 0            # P kept its blocks for the retry
        else:
            assert len(loads) == 1 and not loads[0].retry
            assert sched["load_retries"] == 0
            assert prefill == [n], steps                   # the whole prompt recomputed
            assert work["loads_abandoned"] == 1            # P told to free at once
        H.assert_no_leak(D.s)
        drain_p(P)                                         # D's done (either way) frees P
    finally:
        P.close()
        D.close()
