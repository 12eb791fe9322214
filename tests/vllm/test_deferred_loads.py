"""HmaNixlConnector (D side of a P/D pull) and HmaStoreConnector (async store loads) where
vLLM's real Scheduler does not start a load at allocation time.

* Deferred loads (vLLM 0.33): a consumer engine with overlapping batches (async scheduling)
  and a HiSparse host pool defers an async load while a step is in flight
  (``Scheduler.deferred_loads``): ``update_state_after_alloc`` is not called at allocation
  but from the second call site, ``_drain_deferred_loads`` in ``update_from_output``, once
  the fence step finished. The connector must queue nothing until that call, then exactly
  one READ of the blocks allocated back then; a request aborted while its load is deferred
  gets no READ, only the notify that lets P free its blocks. The store connector's deferred
  load likewise: no store read before the hook, one after it, with the reported hit.
* Requeue after an allocation failure (0.32 and 0.33): the connector reported a remote hit,
  the block pool cannot hold the request, vLLM leaves it waiting and asks again next step.
  No READ may be posted for blocks that were never allocated, no wait / heartbeat may start,
  and once the blocks exist the load is queued exactly once with the hit it was reported.

Real Scheduler (0.33's ``AsyncScheduler`` for the deferred case), real KV cache manager, the
connector loaded by module path. The one stand-in: ``KVCacheConfig.hisparse_host_num_blocks``
is set by hand (what 0.33's planner sets when HiSparse is on), since the scheduler reads only
that field to decide the deferral; no model runs (fake model output, as everywhere here).
"""
from __future__ import annotations

from collections import deque

import pytest

import harness as H
from test_scheduler_flows import CASES
from test_store_connector import store_name  # noqa: F401 (fixture)
from vllm.v1.request import RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from hmacore.integrations.vllm import _compat as C

NEEDS_033 = pytest.mark.skipif(
    not C.AT_LEAST_033, reason="vLLM 0.32's scheduler has no deferred loads: "
    "update_state_after_alloc has one call site there (at allocation), no "
    "Scheduler.deferred_loads / _drain_deferred_loads second call site")


def record_calls(s):
    """Wrap the connector's two load hooks: ``allocs`` records (rid, tokens, vLLM's block
    ids then), ``matched`` (rid, returned count) of get_num_new_matched_tokens."""
    allocs: list = []
    matched: list = []
    conn = s.connector
    real_alloc, real_match = conn.update_state_after_alloc, conn.get_num_new_matched_tokens

    def alloc(request, blocks, num_external_tokens):
        allocs.append((request.request_id, int(num_external_tokens),
                       s.kv_cache_manager.get_block_ids(request.request_id)))
        return real_alloc(request, blocks, num_external_tokens)

    def match(request, num_computed_tokens):
        got = real_match(request, num_computed_tokens)
        matched.append((request.request_id, got[0]))
        return got

    conn.update_state_after_alloc = alloc
    conn.get_num_new_matched_tokens = match
    return allocs, matched


def request(s, kcc, rid, n, *, remote=False, max_tokens=2, base=1):
    r = H.make_request(rid, [base + i % 900 for i in range(n)],
                       s.kv_cache_manager.hash_block_size
                       if hasattr(s.kv_cache_manager, "hash_block_size")
                       else H.C.resolve_kv_cache_block_sizes(kcc, s.vllm_config)[1],
                       params=H.remote_params(rid, kcc, n) if remote else None,
                       max_tokens=max_tokens)
    s.add_request(r)
    return r


def assert_forgotten(conn, rid):
    assert rid not in conn.awaiting() and rid not in conn._local_tokens
    assert rid not in conn._recv_pending and rid not in conn.failed_recving


# -- deferred loads (0.33) ------------------------------------------------------------------
class AsyncDriver:
    """Two steps in flight, as vLLM's engine core runs an async-scheduling engine: a step is
    scheduled before the previous one's output is processed. The worker reports every load
    of a step's metadata finished with that step's output."""

    def __init__(self, s):
        self.s = s
        self.inflight: deque = deque()
        self.metas: list = []

    @property
    def conn(self):
        return self.s.connector.scheduler

    def schedule(self):
        so = self.s.schedule()
        self.metas.append(so.kv_connector_metadata)
        self.inflight.append(so)
        return so

    def process(self):
        so = self.inflight.popleft()
        done = {rid for rid, m in so.kv_connector_metadata.reqs_to_recv.items() if m.awaiting}
        return self.s.update_from_output(so, H.runner_output(so, self.s,
                                                             finished_recving=done))

    def run(self, max_steps=80):
        for _ in range(max_steps):
            if not self.s.has_unfinished_requests() and not self.inflight:
                return
            if self.s.has_unfinished_requests():
                self.schedule()
            if len(self.inflight) >= 2 or not self.s.has_unfinished_requests():
                self.process()
        raise AssertionError(f"not done after {max_steps} steps")


def async_consumer(case, num_blocks=400):
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    vkw, make, n = CASES[case]
    vc = H.vllm_config(kv_role="kv_consumer", **vkw)
    vc.scheduler_config.async_scheduling = True
    kcc = make(num_blocks)
    kcc.hisparse_host_num_blocks = 64
    sched_bs, hash_bs = C.resolve_kv_cache_block_sizes(kcc, vc)
    vc.cache_config.num_gpu_blocks = kcc.num_blocks
    s = AsyncScheduler(vllm_config=vc, kv_cache_config=kcc,
                       structured_output_manager=StructuredOutputManager(vc),
                       block_size=sched_bs, hash_block_size=hash_bs, log_stats=False)
    assert s.defer_block_free and s.defer_async_loads     # the 0.33 path under test
    return s, kcc, n


def defer_one(case):
    """A local request in flight, then a remote one whose load 0.33 defers."""
    s, kcc, n = async_consumer(case)
    allocs, matched = record_calls(s)
    drv = AsyncDriver(s)
    request(s, kcc, "x", 40, max_tokens=6, base=5)
    drv.schedule()                                      # step 1 in flight
    d = request(s, kcc, "d", n, remote=True)
    drv.schedule()                                      # d allocated, its load deferred
    assert "d" in s.deferred_loads
    assert d.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert not [a for a in allocs if a[0] == "d"], "the hook ran at allocation"
    assert "d" not in drv.metas[-1].reqs_to_recv
    assert "d" not in drv.conn._recv_pending and not drv.conn.awaiting()
    assert not drv.metas[-1].heartbeats
    return s, kcc, n, drv, allocs, matched, d


@NEEDS_033
@pytest.mark.parametrize("case", ["gemma", "qwen3next"])
def test_deferred_load_is_queued_once_from_the_second_call_site(case):
    s, kcc, n, drv, allocs, matched, d = defer_one(case)
    hit = [c for rid, c in matched if rid == "d"][-1]
    assert hit > 0
    blocks_then = s.kv_cache_manager.get_block_ids("d")
    drv.process()                    # step 1 done: the fence passed, the load starts
    assert "d" not in s.deferred_loads
    mine = [a for a in allocs if a[0] == "d"]
    assert len(mine) == 1 and mine[0][1] == hit and mine[0][2] == blocks_then
    assert "d" in drv.conn._recv_pending and drv.conn.awaiting() == {"d"}
    drv.run()
    recvs = [m.reqs_to_recv["d"] for m in drv.metas if "d" in m.reqs_to_recv]
    assert len(recvs) == 1, "the load was queued more than once"
    m = recvs[0]
    assert m.awaiting and m.num_external_tokens == hit
    assert m.local_block_ids == H.oracle_clip([[b for b in g if b] for g in blocks_then], kcc)
    assert m.remote.block_ids == H.remote_params("d", kcc, n)["remote_block_ids"]
    # the async load's second (0-token) call after finished_recving queues nothing more
    assert [t for rid, t, _ in allocs if rid == "d"][1:] in ([], [0])
    assert d.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert_forgotten(drv.conn, "d")
    H.assert_no_leak(s)


@NEEDS_033
@pytest.mark.parametrize("case", ["gemma", "qwen3next"])
def test_deferred_load_aborted_before_it_starts_reads_nothing(case):
    s, kcc, n, drv, allocs, matched, d = defer_one(case)
    s.finish_requests("d", RequestStatus.FINISHED_ABORTED)
    assert "d" not in s.deferred_loads                  # vLLM dropped the deferred load
    drv.run()
    assert not [a for a in allocs if a[0] == "d"], "a load hook ran for an aborted request"
    recvs = [m.reqs_to_recv["d"] for m in drv.metas if "d" in m.reqs_to_recv]
    # only the notify that lets P free its blocks: no READ, nothing awaited
    assert len(recvs) == 1
    assert not recvs[0].awaiting and not any(recvs[0].local_block_ids)
    assert recvs[0].remote.request_id == "P-d"
    assert not any("P-d" in ids for m in drv.metas for ids in m.heartbeats.values())
    assert_forgotten(drv.conn, "d")
    H.assert_no_leak(s)


# -- requeue after an allocation failure (0.32 and 0.33) -------------------------------------
# (pool blocks, filler prompt tokens): the filler leaves too few free blocks for the remote
# request, and gives them back when it finishes
TINY = {"gemma": (30, 180), "qwen3next": (8, 300)}


@pytest.mark.parametrize("case", ["gemma", "qwen3next"])
def test_requeue_after_allocation_failure_loads_once(case):
    vkw, make, n = CASES[case]
    nb, filler = TINY[case]
    vc = H.vllm_config(kv_role="kv_consumer", **vkw)
    kcc = make(nb)
    s = H.make_scheduler(vc, kcc)
    allocs, matched = record_calls(s)
    drv = H.Driver(s)
    request(s, kcc, "x", filler, max_tokens=6, base=3)
    drv.step()
    d = request(s, kcc, "d", n, remote=True)
    refused = 0
    for _ in range(20):
        drv.step()
        if "d" in drv.metas[-1].reqs_to_recv:
            break
        # the hit was reported, the pool could not hold the request: nothing started
        assert [rid for rid, c in matched if rid == "d" and c > 0], "no hit was reported"
        assert d.status == RequestStatus.WAITING
        assert not [a for a in allocs if a[0] == "d"]
        assert not drv.conn.awaiting() and "d" not in drv.conn._recv_pending
        assert not drv.metas[-1].heartbeats
        refused += 1
    assert refused >= 2, "the allocation never failed: the scenario did not happen"
    hits = [c for rid, c in matched if rid == "d"]
    assert len(hits) >= refused + 1 and len(set(hits)) == 1      # asked again, same answer
    mine = [a for a in allocs if a[0] == "d"]
    assert len(mine) == 1 and mine[0][1] == hits[0]
    m = drv.metas[-1].reqs_to_recv["d"]
    assert m.awaiting and m.num_external_tokens == hits[0]
    table = drv.table_at_meta[-1]["d"]
    assert m.local_block_ids == H.oracle_clip([[b for b in g if b] for g in table], kcc)
    drv.step(finished_recving={"d"})
    drv.run()
    recvs = [mm.reqs_to_recv["d"] for mm in drv.metas if "d" in mm.reqs_to_recv]
    assert len(recvs) == 1, "the load was queued more than once"
    assert d.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert_forgotten(drv.conn, "d")
    H.assert_no_leak(s)


# -- the store connector's deferred load (0.33) ------------------------------------------------
class AsyncStoreDriver:
    """The store connector's worker runs each step's metadata in order while the next step
    is scheduled (two in flight); its transfer results go with that step's output."""

    def __init__(self, inst):
        self.i = inst
        self.inflight: deque = deque()

    def schedule(self):
        i = self.i
        so = i.s.schedule()
        meta = so.kv_connector_metadata
        i.metas.append(meta)
        i.w.bind_connector_metadata(meta)
        i.w.start_load_kv(None)
        i.w.wait_for_save()
        r = i.w.get_transfer_results(so.finished_req_ids)
        i.w.clear_connector_metadata()
        self.inflight.append((so, r))
        return so

    def process(self):
        so, r = self.inflight.popleft()
        self.i.s.update_from_output(so, H.runner_output(
            so, self.i.s, finished_recving=r.finished_recving, failed_recving=r.failed_recving))

    def run(self, max_steps=80):
        s = self.i.s
        for _ in range(max_steps):
            if not s.has_unfinished_requests() and not self.inflight:
                return
            if s.has_unfinished_requests():
                self.schedule()
            if len(self.inflight) >= 2 or not s.has_unfinished_requests():
                self.process()
        raise AssertionError(f"not done after {max_steps} steps")


@NEEDS_033
@pytest.mark.parametrize("case", ["gemma", "qwen3next"])
def test_store_deferred_load_is_queued_once(case, store_name):  # noqa: F811
    from test_hit_zeroed import assert_forgotten as store_forgotten, saved_instance
    from test_store_connector import Instance
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    prompt = saved_instance(case, {"store_name": store_name})
    B = Instance(case, {"store_name": store_name, "load_async": True})
    try:
        B.vc.scheduler_config.async_scheduling = True
        B.kcc.hisparse_host_num_blocks = 64
        sched_bs, hash_bs = C.resolve_kv_cache_block_sizes(B.kcc, B.vc)
        B.s = AsyncScheduler(vllm_config=B.vc, kv_cache_config=B.kcc,
                             structured_output_manager=StructuredOutputManager(B.vc),
                             block_size=sched_bs, hash_block_size=hash_bs, log_stats=False)
        assert B.s.defer_async_loads
        allocs, matched = record_calls(B.s)
        drv = AsyncStoreDriver(B)
        B.s.add_request(H.make_request("x", [901 + i % 50 for i in range(40)], B.hbs,
                                       max_tokens=6))
        drv.schedule()
        r = H.make_request("b", prompt, B.hbs, max_tokens=2)
        B.s.add_request(r)
        drv.schedule()
        assert "b" in B.s.deferred_loads
        hit = [c for rid, c in matched if rid == "b"][-1]
        assert hit > 0
        sched = B.s.connector.scheduler
        assert not [a for a in allocs if a[0] == "b"]
        assert not any("b" in m.loads for m in B.metas), "a load before the hook ran"
        blocks_then = B.s.kv_cache_manager.get_block_ids("b")
        drv.process()                              # the fence passed: the load starts
        mine = [a for a in allocs if a[0] == "b"]
        assert len(mine) == 1 and mine[0][1] == hit and mine[0][2] == blocks_then
        drv.run()
        loads = [m.loads["b"] for m in B.metas if "b" in m.loads]
        assert len(loads) == 1 and loads[0].hit_tokens == hit
        assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED
        assert r.num_computed_tokens >= len(prompt)
        store_forgotten(sched, "b")
        H.assert_no_leak(B.s)
    finally:
        B.close()
