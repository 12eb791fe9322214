"""P/D end to end with real NIXL (UCX, DRAM): two engines in one process, each a real vLLM
Scheduler with a SCHEDULER-role HmaNixlConnector and a WORKER-role one over paged KV memory.
P prefills and holds its blocks; D pulls them by READ; the bytes D holds equal P's; P frees
on D's notification; neither engine leaks a block."""
import contextlib
import os
import threading
import time

import pytest

import harness as H
from ports import free_port
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from hmacore.integrations.vllm.nixl.connector import HmaNixlConnector
from hmacore.demo.paged_memory import allocate_paged_kv, fill_pattern, read_pages, verify_pattern
from hmacore.windows import trim_remote_to_local

pytestmark = pytest.mark.nixl
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
# tests/mooncake/test_te_connector.py runs these tests again inside a network namespace with
# the Mooncake Transfer Engine as the transport ("transport": "mooncake")
TRANSPORT = {"transport": os.environ["HMACORE_TEST_TRANSPORT"]} \
    if os.environ.get("HMACORE_TEST_TRANSPORT") else {}


class Engine:
    def __init__(self, make_kcc, extra=None, page_bytes=64, **vkw):
        self.vc = H.vllm_config(extra={"side_channel_port": free_port(),
                                       "kv_lease_duration": 30, **TRANSPORT,
                                       **(extra or {})}, **vkw)
        self.kcc = make_kcc()
        self.s = H.make_scheduler(self.vc, self.kcc)
        self.w = HmaNixlConnector(self.vc, KVConnectorRole.WORKER, self.kcc)
        self.paged = allocate_paged_kv(self.w.layout, self.kcc.num_blocks, page_bytes=page_bytes)
        self.w.register_kv_caches(self.paged.kv_caches)
        # the driver the connector built is the configured one
        assert type(self.w.worker.agent).__name__ == (
            "MooncakeTeAgent" if TRANSPORT else "NixlAgent")
        self.d = H.Driver(self.s, worker=self.w)

    def close(self):
        self.w.shutdown()


CASES = {
    "gemma": (dict(), lambda: H.gemma_like(num_blocks=64), 150),
    "qwen3next": (dict(block_size=64, mamba_cache_mode="align"),
                  lambda: H.qwen3_next_like(num_blocks=64), 200),
    "dsv4": (dict(max_num_batched_tokens=1024), lambda: H.dsv4_like(num_blocks=600), 600),
}


@pytest.mark.parametrize("case", list(CASES))
def test_pd_pull_moves_the_right_bytes(case):
    vkw, make, n = CASES[case]
    P, D = Engine(make, **vkw), Engine(make, **vkw)
    try:
        prompt = [1 + i % 900 for i in range(n)]
        p_req = H.make_request("req", prompt, H.C.resolve_kv_cache_block_sizes(
            P.kcc, P.vc)[1], params={"do_remote_decode": True}, max_tokens=1)
        P.s.add_request(p_req)
        while "req" not in P.d.finished_params():
            P.d.step()
        params = P.d.finished_params()["req"]
        # the "model" wrote the prompt's KV: pattern by table position
        p_table = P.s.kv_cache_manager.get_block_ids("req")
        fill_pattern(P.paged, p_table)

        hbs = H.C.resolve_kv_cache_block_sizes(D.kcc, D.vc)[1]
        d_req = H.make_request("d-req", prompt, hbs, params=params, max_tokens=3)
        D.s.add_request(d_req)
        D.d.step()                                       # READ posted
        rr = D.d.metas[-1].reqs_to_recv["d-req"]
        assert rr.awaiting and rr.remote.block_ids == params["remote_block_ids"]
        deadline = time.monotonic() + 20
        while d_req.status == H.RequestStatus.WAITING_FOR_REMOTE_KVS:
            assert time.monotonic() < deadline, "READ did not complete"
            D.d.step()
            P.d.step()          # P answers the READ's done: D takes the data only then
        # D's blocks hold P's bytes, group by group, position by position
        local, remote = trim_remote_to_local(rr.local_block_ids, rr.remote.block_ids,
                                             D.w.layout)
        for g, spec in enumerate(D.w.layout.groups):
            for name in spec.layer_names:
                assert (read_pages(D.paged.kv_caches[name], local[g]) ==
                        read_pages(P.paged.kv_caches[name], remote[g])).all()
        d_table = D.s.kv_cache_manager.get_block_ids("d-req")
        positions = [[j for j, b in enumerate(g) if b in set(loc.tolist())]
                     for g, loc in zip(d_table, local)]
        only = [[b for b in g if b in set(loc.tolist())] for g, loc in zip(d_table, local)]
        assert verify_pattern(D.paged, only, positions) == []
        assert sum(len(g) for g in only) > 0
        D.d.run()
        H.assert_no_leak(D.s)
        drain_p(P)
    finally:
        P.close()
        D.close()


def test_dead_peer_is_a_failed_recv_and_recompute():
    P = Engine(lambda: H.gemma_like(num_blocks=64), load_failure_policy="recompute")
    D = Engine(lambda: H.gemma_like(num_blocks=64), load_failure_policy="recompute")
    try:
        n = 100
        params = H.remote_params("x", D.kcc, n)
        params["remote_port"] = free_port()              # nobody listens there
        r = H.make_request("x", [1 + i for i in range(n)], 16, params=params)
        D.s.add_request(r)
        D.d.step()
        deadline = time.monotonic() + 20
        while "x" not in D.s.connector.scheduler.failed_recving:
            assert time.monotonic() < deadline, "the failed handshake was never reported"
            D.d.step()
        assert r.num_computed_tokens == 0                # recompute policy: start over
        D.d.run()
        assert r.status == H.RequestStatus.FINISHED_LENGTH_CAPPED
        H.assert_no_leak(D.s)
    finally:
        P.close()
        D.close()


def p_prefill(P, n, rid="req"):
    prompt = [1 + i % 900 for i in range(n)]
    P.s.add_request(H.make_request(rid, prompt, 16, params={"do_remote_decode": True},
                                   max_tokens=1))
    while rid not in P.d.finished_params():
        P.d.step()
    fill_pattern(P.paged, P.s.kv_cache_manager.get_block_ids(rid))
    return prompt, P.d.finished_params()[rid]


def drain_p(P):
    """P frees every request once D's "done" notification arrives (bounded: 20 s, under a
    30 s lease): nothing leaked, no lease left."""
    deadline = time.monotonic() + 20
    while P.s.requests:
        assert time.monotonic() < deadline, "P never saw D's notification"
        P.d.step()
    H.assert_no_leak(P.s)
    assert P.s.connector.scheduler.leases() == {}


@contextlib.contextmanager
def stepping(engine):
    """Step ``engine`` on a thread while the body runs (a sync load blocks the caller's
    step; the prefill engine, another process in real use, keeps stepping)."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def loop():
        try:
            while not stop.is_set():
                engine.d.step()
                time.sleep(0.002)
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(e)
    t = threading.Thread(target=loop, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(timeout=30)
    assert not t.is_alive() and not errors, errors


def test_sync_load_completes_before_the_forward_pass():
    P = Engine(lambda: H.gemma_like(num_blocks=64))
    D = Engine(lambda: H.gemma_like(num_blocks=64), extra={"sync_load": True})
    try:
        prompt, params = p_prefill(P, 150)
        r = H.make_request("d", prompt, 16, params=params, max_tokens=2)
        D.s.add_request(r)
        with stepping(P):                  # a live P answers the READ's done meanwhile
            D.d.step()                     # one step: READ posted and waited, request runs
        assert r.status == H.RequestStatus.RUNNING
        rr = D.d.metas[-1].reqs_to_recv["d"]
        local, remote = trim_remote_to_local(rr.local_block_ids, rr.remote.block_ids,
                                             D.w.layout)
        assert sum(len(g) for g in local) > 0
        for g, spec in enumerate(D.w.layout.groups):
            for name in spec.layer_names:
                assert (read_pages(D.paged.kv_caches[name], local[g]) ==
                        read_pages(P.paged.kv_caches[name], remote[g])).all()
        D.d.run()
        H.assert_no_leak(D.s)
        drain_p(P)
    finally:
        P.close()
        D.close()


def test_d_abort_before_scheduling_still_frees_p():
    P = Engine(lambda: H.gemma_like(num_blocks=64))
    D = Engine(lambda: H.gemma_like(num_blocks=64))
    try:
        prompt, params = p_prefill(P, 150)
        assert P.s.requests                # P holds the blocks under its lease
        D.s.add_request(H.make_request("d", prompt, 16, params=params))
        D.s.finish_requests("d", H.RequestStatus.FINISHED_ABORTED)
        D.d.step()                         # notify-only: nothing read, P told to free
        assert not any(D.d.metas[-1].reqs_to_recv["d"].local_block_ids)
        H.assert_no_leak(D.s)
        drain_p(P)
    finally:
        P.close()
        D.close()


def _load_from(P, D, rid, n, base=1):
    """D loads P's prefill of an ``n``-token prompt; returns (finished ok, bytes equal)."""
    prompt = [base + i % 900 for i in range(n)]
    P.s.add_request(H.make_request(rid, prompt, 16, params={"do_remote_decode": True},
                                   max_tokens=1))
    while rid not in P.d.finished_params():
        P.d.step()
    fill_pattern(P.paged, P.s.kv_cache_manager.get_block_ids(rid))
    params = P.d.finished_params()[rid]
    d_req = H.make_request("d-" + rid, prompt, 16, params=params, max_tokens=2)
    D.s.add_request(d_req)
    D.d.step()
    rr = D.d.metas[-1].reqs_to_recv["d-" + rid]
    deadline = time.monotonic() + 20
    while d_req.status == H.RequestStatus.WAITING_FOR_REMOTE_KVS:
        assert time.monotonic() < deadline, "the load never ended"
        D.d.step()
        P.d.step()
    ok = "d-" + rid not in D.s.connector.scheduler.failed_recving
    local, remote = trim_remote_to_local(rr.local_block_ids, rr.remote.block_ids, D.w.layout)
    same = all((read_pages(D.paged.kv_caches[name], local[g]) ==
                read_pages(P.paged.kv_caches[name], remote[g])).all()
               for g, spec in enumerate(D.w.layout.groups) for name in spec.layer_names)
    D.d.run()
    return ok, same


def test_restarted_prefill_engine_is_handshaken_afresh():
    # a prefill engine restarts on the same host:port with a new engine id: D drops the
    # stale agent and handshakes again (keyed by address alone, it kept reading from the
    # dead agent and every load failed)
    port = free_port()
    make = lambda: H.gemma_like(num_blocks=64)  # noqa: E731
    D = Engine(make, load_failure_policy="recompute")
    P1 = Engine(make, extra={"side_channel_port": port}, engine_id="prefill-1")
    P2 = None
    try:
        assert _load_from(P1, D, "a", 150) == (True, True)
        drain_p(P1)
        P1.close()
        P2 = Engine(make, extra={"side_channel_port": port}, engine_id="prefill-2")
        assert _load_from(P2, D, "b", 150, base=7) == (True, True)
        assert set(D.w.worker._engine_peers) == {"prefill-2"}
        drain_p(P2)
        H.assert_no_leak(D.s)
    finally:
        for e in (P1, P2, D):
            if e is not None:
                e.close()


def test_notify_only_load_to_a_dead_prefill_does_not_raise():
    # D aborted before scheduling queues a notify-only entry; P is gone: the notification
    # fails inside the hook and is logged, the step goes on
    P = Engine(lambda: H.gemma_like(num_blocks=64))
    D = Engine(lambda: H.gemma_like(num_blocks=64), load_failure_policy="recompute")
    try:
        prompt, params = p_prefill(P, 150)
        P.close()
        D.s.add_request(H.make_request("d", prompt, 16, params=params))
        D.s.finish_requests("d", H.RequestStatus.FINISHED_ABORTED)
        D.d.step()
        D.d.step()
        H.assert_no_leak(D.s)
    finally:
        D.close()


def test_a_bug_while_starting_a_load_is_a_failed_recv(monkeypatch):
    # any exception inside the worker's load start (here a stand-in bug) ends that load in
    # failed_recving; it never escapes the hook and kills the engine
    from hmacore.integrations.vllm.nixl import worker as W
    P = Engine(lambda: H.gemma_like(num_blocks=64), load_failure_policy="recompute")
    D = Engine(lambda: H.gemma_like(num_blocks=64), load_failure_policy="recompute")
    try:
        prompt, params = p_prefill(P, 150)

        def broken(*a, **kw):
            raise KeyError("stand-in bug")
        monkeypatch.setattr(W, "trim_remote_to_local", broken)
        r = H.make_request("d", prompt, 16, params=params, max_tokens=2)
        D.s.add_request(r)
        deadline = time.monotonic() + 20
        while "d" not in D.s.connector.scheduler.failed_recving:
            assert time.monotonic() < deadline, "the failure was never reported"
            D.d.step()
        monkeypatch.undo()
        # vLLM restarts it from 0 and the connector loads it again (load_retries): the bug is
        # gone, so the retry reads P's blocks (P answers the READ's done) and it finishes
        deadline = time.monotonic() + 60
        while D.s.has_unfinished_requests():
            assert time.monotonic() < deadline, "the request never finished"
            D.d.step()
            P.d.step()
        assert r.status == H.RequestStatus.FINISHED_LENGTH_CAPPED
        assert D.d.metas and sum("d" in m.reqs_to_recv for m in D.d.metas) == 2   # retried
        H.assert_no_leak(D.s)
        drain_p(P)                                  # the retry's done freed P's blocks
    finally:
        P.close()
        D.close()


def test_connector_stats_count_what_moved():
    # vLLM's stats pipeline: the decode worker counts its READs (bytes, descriptors, blocks
    # per group), the prefill scheduler what clipping left out; both reach Prometheus
    import functools

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    make = lambda: H.gemma_like(num_blocks=64)  # noqa: E731
    P, D = Engine(make), Engine(make)
    seen = []      # what vLLM's Scheduler collects from P's scheduler side every step
    take = P.s.connector.get_kv_connector_stats

    def collect():
        st = take()
        if st is not None:
            seen.append(st)
        return st
    P.s.connector.get_kv_connector_stats = collect
    try:
        assert _load_from(P, D, "s", 150) == (True, True)
        w = D.w.get_kv_connector_stats().data
        assert w["transfers"] == 1 and w["loads"] == 1 and w["transfer_bytes"] > 0
        assert w["transfer_descriptors"] > 0 and w["transfer_seconds"] > 0
        # posted as maximal runs: never more descriptors than one per block per layer slot
        assert 0 < w["transfer_descriptors"] <= w["transfer_block_descriptors"]
        assert set(w["blocks_moved"]) == {"0", "1"} and all(w["blocks_moved"].values())
        assert D.w.get_kv_connector_stats() is None          # taken: nothing new since
        assert seen, "vLLM's Scheduler never got P's stats"
        p = functools.reduce(lambda a, b: a.aggregate(b), seen).data
        sliding = next(g for g, s in enumerate(P.w.layout.groups) if s.sliding_window)
        assert p["blocks_clipped"][str(sliding)] > 0          # the window spared the rest
        stats = HmaNixlConnector.build_kv_connector_stats(w).aggregate(
            HmaNixlConnector.build_kv_connector_stats(p))
        red = stats.reduce()
        assert red["transfers"] == 1 and red[f"blocks_clipped[group {sliding}]"] > 0
        reg = CollectorRegistry()
        types = {k: functools.partial(k, registry=reg) for k in (Counter, Gauge, Histogram)}
        prom = HmaNixlConnector.build_prom_metrics(D.vc, types, ["model_name", "engine"],
                                                   {0: ["m", "0"]})
        prom.observe(stats.data, 0)
        assert reg.get_sample_value("vllm:hma_transfers_total",
                                    {"model_name": "m", "engine": "0"}) == 1
        assert reg.get_sample_value("vllm:hma_blocks_clipped_total",
                                    {"model_name": "m", "engine": "0",
                                     "group": str(sliding)}) == p["blocks_clipped"][str(sliding)]
        drain_p(P)
    finally:
        P.close()
        D.close()


def test_read_finished_after_the_lease_ended_is_a_failed_load():
    # P's lease ends (its blocks freed, reusable) before P's worker hears the READ's done:
    # P answers LATE and D reports the load failed (recompute), never taking bytes that a
    # reused block may have overwritten. Modelled here by P's scheduler stepping without
    # its worker (P's worker stalled) past the lease, then the worker catching up.
    P = Engine(lambda: H.gemma_like(num_blocks=64), extra={"kv_lease_duration": 1})
    D = Engine(lambda: H.gemma_like(num_blocks=64), load_failure_policy="recompute")
    try:
        prompt, params = p_prefill(P, 150)
        r = H.make_request("d", prompt, 16, params=params, max_tokens=2)
        D.s.add_request(r)
        D.d.step()                                   # READ posted (done on its way to P)
        assert any(len(g) for g in D.d.metas[-1].reqs_to_recv["d"].local_block_ids)
        worker, P.d.worker = P.d.worker, None
        time.sleep(1.3)
        P.d.step()                                   # the lease expires: blocks freed
        assert not P.s.requests
        P.d.worker = worker
        deadline = time.monotonic() + 20
        while "d" not in D.s.connector.scheduler.failed_recving:
            assert time.monotonic() < deadline, "the failed load was never reported"
            P.d.step()                               # worker: lease ended, done -> LATE
            D.d.step()
        assert r.num_computed_tokens == 0            # recompute: nothing loaded was kept
        late = D.w.worker.counters._data.get("late_reads", 0)
        assert late == 1, D.w.worker.counters._data
        D.d.run()
        assert r.status == H.RequestStatus.FINISHED_LENGTH_CAPPED
        H.assert_no_leak(D.s)
        H.assert_no_leak(P.s)
    finally:
        P.close()
        D.close()


def test_read_answered_alive_while_the_lease_holds():
    # the control of the test above: the same flow with P's worker live answers ALIVE and
    # the load succeeds with P's bytes
    P = Engine(lambda: H.gemma_like(num_blocks=64), extra={"kv_lease_duration": 1})
    D = Engine(lambda: H.gemma_like(num_blocks=64), load_failure_policy="recompute")
    try:
        prompt, params = p_prefill(P, 150)
        r = H.make_request("d", prompt, 16, params=params, max_tokens=2)
        D.s.add_request(r)
        D.d.step()
        deadline = time.monotonic() + 20
        while r.status == H.RequestStatus.WAITING_FOR_REMOTE_KVS:
            assert time.monotonic() < deadline, "the load never ended"
            P.d.step()
            D.d.step()
        assert "d" not in D.s.connector.scheduler.failed_recving
        assert r.num_computed_tokens > 0
        assert D.w.worker.counters._data.get("late_reads", 0) == 0
        D.d.run()
        drain_p(P)
    finally:
        P.close()
        D.close()


def test_lease_expires_while_the_prefill_engine_idles():
    # Nobody reads P's blocks (the decode side's READ failed, or D never came): P only
    # idle-steps, and vLLM's model runner then reports no connector output at all, so the
    # scheduler side's update_connector_output is not called. The lease must still end on
    # time: within its duration plus a generous margin, not at P's next busy step.
    P = Engine(lambda: H.gemma_like(num_blocks=64), extra={"kv_lease_duration": 1})
    try:
        p_prefill(P, 150)
        assert P.s.requests and P.s.connector.scheduler.leases()
        start = time.monotonic()
        idle = 0
        while P.s.requests and time.monotonic() < start + 20:
            so = P.d.step()
            assert not so.num_scheduled_tokens      # P idles: nothing to compute
            idle += 1
            time.sleep(0.01)
        assert not P.s.requests, f"lease of 1 s still held after {idle} idle steps"
        assert time.monotonic() - start < 1 + 10
        assert P.s.connector.scheduler.leases() == {}    # no reader: only expiry frees
        H.assert_no_leak(P.s)
    finally:
        P.close()


def test_failed_read_tells_the_prefill_engine_to_free_at_once(monkeypatch):
    # D's READ fails (NIXL reports an error: a failed READ delivers no done to P, modelled
    # by posting it without one). D recomputes; once none of its READs is in flight it tells
    # P "done", so P frees its blocks now, far before its 30 s lease ends.
    from hmacore.errors import TransferError
    # (load_retries 0: a retried load keeps P's blocks for the retry; see
    # test_partial_recovery_nixl.py for the retry)
    P = Engine(lambda: H.gemma_like(num_blocks=64))
    D = Engine(lambda: H.gemma_like(num_blocks=64), load_failure_policy="recompute",
               extra={"load_retries": 0})
    try:
        prompt, params = p_prefill(P, 150)
        agent = D.w.worker.agent
        read, poll = agent.read, agent.poll
        posted = []

        def read_without_done(*args, **kwargs):
            t = read(*args, **{**kwargs, "notif": None})
            posted.append(t)
            return t

        def failing_poll(t, *args, **kwargs):
            while poll(t) == "PROC":            # the real READ leaves flight first
                time.sleep(0.001)
            raise TransferError("injected: READ reported an error")
        monkeypatch.setattr(agent, "read", read_without_done)
        monkeypatch.setattr(agent, "poll", failing_poll)
        r = H.make_request("d", prompt, 16, params=params, max_tokens=2)
        D.s.add_request(r)
        deadline = time.monotonic() + 20
        while "d" not in D.s.connector.scheduler.failed_recving:
            assert time.monotonic() < deadline, "the failed load was never reported"
            D.d.step()
            P.d.step()
        assert posted and r.num_computed_tokens == 0
        drain_p(P)                                   # bounded by 20 s < the 30 s lease
        assert P.s.connector.scheduler.leases() == {}
        D.d.run()
        H.assert_no_leak(D.s)
    finally:
        P.close()
        D.close()


@pytest.mark.parametrize("refused", ["too_many_ids", "bad_first", "expired", "layout_known",
                                     "layout_unknown"])
def test_refused_params_tell_the_prefill_engine_to_free_at_once(refused):
    # D refuses P's block lists (more ids than remote_num_tokens allows; a malformed
    # remote_block_first): no load, the request computes locally, and a notify-only entry
    # tells P to free its blocks now instead of at its 30 s lease end. Params whose lease
    # already ended send nothing (P freed them; a "done" would wait unmatched at P). Params
    # refused for P's layout (fingerprint): D's worker tells P only through P's agent it
    # already holds (layout_known: an earlier load from P), never by a handshake on the
    # refused params' word (layout_unknown: P keeps its lease).
    P = Engine(lambda: H.gemma_like(num_blocks=64))
    D = Engine(lambda: H.gemma_like(num_blocks=64))
    try:
        if refused == "layout_known":
            assert _load_from(P, D, "earlier", 150) == (True, True)
            drain_p(P)
        prompt, params = p_prefill(P, 150)
        params = dict(params)
        if refused.startswith("layout"):
            params["hma_layout_fingerprint"] = "0" * 32
        elif refused == "too_many_ids":
            params["remote_block_ids"] = [list(g) + list(g) * 4 for g in
                                          params["remote_block_ids"]]
        elif refused == "bad_first":
            params["remote_block_first"] = "zero"
        else:
            params["remote_blocks_expiry_time"] = time.time() - 1
        r = H.make_request("d", prompt, 16, params=params, max_tokens=2)
        moved = D.w.worker.counters._data.get("transfers", 0)     # by the earlier load
        D.s.add_request(r)
        D.d.run()                                    # computed locally, no load
        assert D.w.worker.counters._data.get("transfers", 0) == moved
        H.assert_no_leak(D.s)
        if refused in ("expired", "layout_unknown"):  # nothing sent: P's lease frees them
            for _ in range(50):
                P.d.step()
            assert P.s.connector.scheduler.leases()
            assert D.w.worker.agent.peers == ()       # no handshake on refused params
        else:
            drain_p(P)                               # bounded by 20 s < the 30 s lease
            assert P.s.connector.scheduler.leases() == {}
            P.d.step()
            assert not any(m.expired for m in P.d.metas)      # D's done freed them
    finally:
        P.close()
        D.close()


def _prefill_at(P, n, rid):
    """P prefills an ``n``-token prompt in its own hash block size; (prompt, params)."""
    prompt = [1 + i % 900 for i in range(n)]
    hbs = H.C.resolve_kv_cache_block_sizes(P.kcc, P.vc)[1]
    P.s.add_request(H.make_request(rid, prompt, hbs, params={"do_remote_decode": True},
                                   max_tokens=1))
    while rid not in P.d.finished_params():
        P.d.step()
    return prompt, dict(P.d.finished_params()[rid])


@pytest.mark.parametrize("how", ["refused", "unreachable"])
def test_a_load_failing_at_the_handshake_frees_the_prefill_engine(how):
    # refused: P answers the handshake and D's worker refuses the pairing (P runs 32-token
    # blocks, D 16 with block_size_remap off; the params, stripped of the fields that would
    # have told D's scheduler, by a proxy say), so no READ is posted: D still tells P "done"
    # from P's handshake reply and P frees at once, not at its 30 s lease end.
    # unreachable: nobody answers at P's address, nothing can be sent: P's lease (1 s here)
    # is what frees the blocks.
    lease = 30 if how == "refused" else 1
    P = Engine(lambda: H.gemma_like(num_blocks=64, bs=32 if how == "refused" else 16),
               extra={"kv_lease_duration": lease}, block_size=32 if how == "refused" else 16,
               page_bytes=128 if how == "refused" else 64)     # equal bytes per token
    D = Engine(lambda: H.gemma_like(num_blocks=64), load_failure_policy="recompute",
               extra={"block_size_remap": False})
    try:
        prompt, params = _prefill_at(P, 150, "req")
        if how == "refused":
            for k in ("remote_block_sizes", "remote_num_tokens", "hma_layout_fingerprint",
                      "hma_regrain_fingerprint"):
                params.pop(k)
        else:
            params["remote_port"] = free_port()       # nobody listens there
        r = H.make_request("d", prompt, 16, params=params, max_tokens=2)
        D.s.add_request(r)
        deadline = time.monotonic() + 20
        while "d" not in D.s.connector.scheduler.failed_recving:
            assert time.monotonic() < deadline, "the failed handshake was never reported"
            D.d.step()
        assert D.w.worker.counters._data.get("transfers", 0) == 0     # no READ posted
        D.d.run()
        assert r.status == H.RequestStatus.FINISHED_LENGTH_CAPPED     # recomputed
        H.assert_no_leak(D.s)
        drain_p(P)                                   # bounded by 20 s < the 30 s lease
        P.d.step()                                   # its metadata names an expired lease
        expired = any("req" in m.expired for m in P.d.metas)
        assert expired == (how == "unreachable")     # freed by D's done / by the lease
    finally:
        P.close()
        D.close()


def test_late_notifications_are_dropped_once_unclaimed():
    # a "done" for a request P no longer tracks (sent after P freed it) waits in P's queue
    # only until the grace period ends (kv_lease_duration; shortened here), then is
    # dropped and counted; P's live lease is served all the while
    P = Engine(lambda: H.gemma_like(num_blocks=64))
    D = Engine(lambda: H.gemma_like(num_blocks=64))
    try:
        assert _load_from(P, D, "a", 150) == (True, True)
        drain_p(P)
        sent = 0
        for peer in D.w.worker._engine_peers[P.s.connector.scheduler.engine_id]:
            D.w.worker.agent.send_notif(peer, "a", b"done@0/1")     # late: P freed "a"
            sent += 1
        P.w.worker.unclaimed_grace_s = 0.5
        prompt, params = p_prefill(P, 150, rid="b")  # P holds a lease: it reads its queue
        deadline = time.monotonic() + 20
        while not P.w.worker.counters._data.get("late_messages_dropped"):
            assert time.monotonic() < deadline, "the late message was never dropped"
            P.d.step()
            time.sleep(0.01)
        # at least what was sent here (one per peer D holds for P); another late message of
        # the finished load may join them (a CI run over Mooncake TE dropped 2)
        assert sent >= 1 and P.w.worker.counters._data["late_messages_dropped"] >= sent
        assert "a" not in P.w.worker.agent._notifs
        assert P.s.connector.scheduler.leases()      # "b" still held, and still served:
        r = H.make_request("d-b", prompt, 16, params=params, max_tokens=2)
        D.s.add_request(r)
        D.d.step()                                   # READ posted
        deadline = time.monotonic() + 20
        while r.status == H.RequestStatus.WAITING_FOR_REMOTE_KVS:
            assert time.monotonic() < deadline, "the load of b never ended"
            D.d.step()
            P.d.step()
        assert "d-b" not in D.s.connector.scheduler.failed_recving
        D.d.run()
        drain_p(P)
        P.d.step()
        assert not any(m.expired for m in P.d.metas)
    finally:
        P.close()
        D.close()


@pytest.mark.parametrize("posting", ["blocks", "dynamic"])
def test_posting_mode_from_the_config(posting):
    # kv_connector_extra_config.nixl_posting reaches the worker's NIXL agent: "blocks" posts
    # one descriptor per block and layer slot, "dynamic" the coalesced runs; the bytes agree
    P = Engine(lambda: H.gemma_like(num_blocks=64), extra={"nixl_posting": posting})
    D = Engine(lambda: H.gemma_like(num_blocks=64), extra={"nixl_posting": posting})
    try:
        assert D.w.worker.agent.posting == posting
        ok, same = _load_from(P, D, f"post-{posting}", 150)
        assert ok and same
        c = D.w.worker.counters._data
        descs, blocks = c["transfer_descriptors"], c["transfer_block_descriptors"]
        if posting == "blocks":
            assert descs == blocks
        else:
            assert descs < blocks, c
    finally:
        P.close()
        D.close()
