"""Partial load failures, fault injected per group, inside vLLM 0.32's real v1 Scheduler with
HmaStoreConnector (embedded store): a key removed between the scheduler's lookup and the
worker's load.

* One KV cache group: the worker reports block ids (hmacore.recovery.plan_vllm_report) and
  vLLM restarts the request at the safe point: it keeps the loaded prefix and computes only
  the suffix (``recompute``), or fails that request alone (``fail``).
* Several groups: vLLM 0.32 raises on any invalid block id (checked here), so the load is
  reported per request; vLLM restarts it from 0 and the connector's fresh lookup
  (``load_retries``) loads exactly the prefix still intact in every group.
"""
import numpy as np
import pytest

import harness as H
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import KVCacheConfig

from hmacore.integrations.vllm import HmaStoreConnector
from hmacore.integrations.vllm.store.backend import drop_store
from hmacore.integrations.vllm.store.scheduler import hashes_array
from test_store_connector import block_bytes, fill, kv_caches, pattern

LAYERS = ["model.layers.0.attn", "model.layers.1.attn", "model.layers.2.attn",
          "model.layers.3.attn"]


def full_only(num_blocks=64):
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                         kv_cache_groups=[H.group(LAYERS, H.attn(16))])


def sliding_only(num_blocks=64):
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                         kv_cache_groups=[H.group(LAYERS, H.swa(16, 64))])


KCC = {"full": (dict(), full_only), "sliding": (dict(), sliding_only),
       "gemma": (dict(), lambda: H.gemma_like(num_blocks=64)),
       "qwen3next": (dict(block_size=64, mamba_cache_mode="align"),
                     lambda: H.qwen3_next_like(num_blocks=64))}


class Engine:
    """A real Scheduler + WORKER-role HmaStoreConnector over CPU tensors; ``step`` runs what
    vLLM's model runner does around a forward pass and passes invalid block ids on."""

    def __init__(self, case, extra, policy="recompute"):
        vkw, make = KCC[case]
        self.vc = H.vllm_config(kv_connector="HmaStoreConnector", extra=extra,
                                load_failure_policy=policy, **vkw)
        self.kcc = make()
        self.s = H.make_scheduler(self.vc, self.kcc)
        self.w = HmaStoreConnector(self.vc, KVConnectorRole.WORKER, self.kcc)
        self.caches, self._storages = kv_caches(self.kcc)
        self.w.register_kv_caches(self.caches)
        self.scheduled = []       # num_scheduled_tokens of every step
        self.computed_before = []  # rid -> num_computed_tokens when each step was scheduled
        self.invalid = []         # invalid block ids reported each step
        self.written = []         # store keys the worker wrote each step

    @property
    def hbs(self):
        return H.C.resolve_kv_cache_block_sizes(self.kcc, self.vc)[1]

    def step(self, write=False, before_load=None):
        so = self.s.schedule()
        self.scheduled.append(dict(so.num_scheduled_tokens))
        self.computed_before.append({r: self.s.requests[r].num_computed_tokens
                                     - n for r, n in so.num_scheduled_tokens.items()})
        if before_load is not None:
            before_load(so)
        w = self.w
        w.bind_connector_metadata(so.kv_connector_metadata)
        w.start_load_kv(None)
        if write:
            for rid in so.num_scheduled_tokens:
                fill(self.kcc, self.caches, self.s.kv_cache_manager.get_block_ids(rid))
        w.wait_for_save()
        self.written.append((w.worker.counters.take() or {}).get("store_keys_written", 0))
        r = w.get_transfer_results(so.finished_req_ids)
        invalid = w.get_block_ids_with_load_errors()
        self.invalid.append(invalid)
        w.clear_connector_metadata()
        return self.s.update_from_output(so, H.runner_output(
            so, self.s, finished_recving=r.finished_recving, failed_recving=r.failed_recving,
            invalid_block_ids=invalid))

    def run(self, max_steps=60):
        outs = []
        for _ in range(max_steps):
            if not self.s.has_unfinished_requests():
                break
            outs.append(self.step())
        assert not self.s.has_unfinished_requests()
        H.assert_no_leak(self.s)
        return outs

    def close(self):
        self.w.shutdown()


def saved_prompt(case, store_name, n):
    A = Engine(case, {"store_name": store_name})
    prompt = [1 + i % 900 for i in range(n)]
    A.s.add_request(H.make_request("a", prompt, A.hbs, max_tokens=2))
    for _ in range(20):
        if not A.s.has_unfinished_requests():
            break
        A.step(write=True)
    A.close()
    return prompt


def assert_saved_again(engine, lost_keys, prompt, hit, written):
    """After the recovery, the lost keys are in the store again, the request's saves wrote
    ``written`` keys in all (the lost ones plus any never stored: a key that arrived is
    never written twice), and a new request with ``prompt`` hits ``hit`` tokens."""
    assert lost_keys and all(e == 1 for e in engine.w.store.batch_exists(lost_keys)), lost_keys
    assert sum(engine.written) == written, engine.written
    again = H.make_request("again", prompt, engine.hbs, max_tokens=1)
    assert engine.s.connector.get_num_new_matched_tokens(again, 0)[0] == hit


def remover(engine, rid, faults):
    """Removes the store keys of ``faults`` ((group, block index)) for request ``rid``, once,
    after the scheduler looked the store up and before the worker loads."""
    done = []

    def before_load(so):
        if done or rid not in so.kv_connector_metadata.loads:
            return
        sched = engine.s.connector.scheduler
        hashes = hashes_array(engine.s.requests[rid].block_hashes)
        keys = []
        for g, idx in faults:
            k = sched.finder.block_sizes[g] // sched.finder.hash_block_size
            keys += sched.keys.keys(g, sched.finder.key_digests(
                hashes, g, np.array([(idx + 1) * k - 1], dtype=np.int64)))
        assert all(c == 0 for c in engine.w.store.batch_remove(keys)), keys
        done.append(keys)
    return before_load, done


@pytest.fixture
def store_name(request):
    name = "pr-" + request.node.name
    yield name
    drop_store("embedded:" + name)


def errored(outs):
    return {o.request_id for out in outs for eco in out.values() for o in eco.outputs
            if o.finish_reason is not None and str(o.finish_reason) in ("error", "FinishReason.ERROR")}


# -- one group: vLLM restarts at the safe point --------------------------------------------------
@pytest.mark.parametrize("load_async", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("fault", [5, 8, 0], ids=["middle", "last", "first"])
def test_full_attention_block_fault_recomputes_only_the_suffix(fault, load_async, store_name):
    n = 150                                   # hit: 144 tokens = 9 blocks of 16
    prompt = saved_prompt("full", store_name, n)
    B = Engine("full", {"store_name": store_name, "load_async": load_async})
    try:
        r = H.make_request("b", prompt, B.hbs, max_tokens=2)
        B.s.add_request(r)
        hook, done = remover(B, "b", [(0, fault)])
        B.step(before_load=hook)
        assert done, "the load was never scheduled"
        table = B.s.kv_cache_manager.get_block_ids("b")[0]
        rep = B.w.worker.recoveries["b"]
        safe = 16 * fault                      # every block before the removed one is intact
        if load_async and safe == 0:
            # vLLM frees an async request restarting at 0: reported per request instead
            assert rep.per_request and not B.invalid[-1] and r.num_computed_tokens == 0
        else:
            assert (rep.safe_tokens, rep.lands_at, rep.per_request) == (safe, safe, False)
            assert B.invalid[-1] == {table[fault]}    # the landing block is the failed one
            assert r.num_computed_tokens == safe
        # the next step computes exactly the suffix [safe, n)
        B.step()
        assert B.computed_before[-1]["b"] == safe
        assert B.scheduled[-1]["b"] == n - safe
        for pos in range(fault):              # the kept prefix holds the saver's bytes
            for name in LAYERS:
                got = block_bytes(B.caches[name], table[pos])
                assert np.array_equal(got, pattern(name, pos, got.size)), (pos, name)
        B.run()
        assert r.status == H.RequestStatus.FINISHED_LENGTH_CAPPED
        assert "b" in B.s.connector.scheduler.failed_recving or r.request_id not in B.s.requests
        # the recomputed block whose key was lost is saved again, and nothing else
        assert_saved_again(B, done[0], prompt, 144, written=1)
    finally:
        B.close()


def test_sync_failed_load_step_saves_nothing_and_the_recompute_saves_once(store_name):
    """A sync load computes the rest of the prompt in the step it loads: when a block of
    the load is lost that step's KV is built on it and vLLM drops it, so its save is
    skipped; the recompute from the safe point saves the lost block and the new blocks."""
    saved_prompt("full", store_name, 150)                # 144 tokens = 9 blocks stored
    longer = [1 + i % 900 for i in range(200)]             # same first 150 tokens
    B = Engine("full", {"store_name": store_name})
    try:
        r = H.make_request("b", longer, B.hbs, max_tokens=2)
        B.s.add_request(r)
        hook, done = remover(B, "b", [(0, 5)])
        B.step(before_load=hook)
        assert done and B.scheduled[-1]["b"] == 200 - 144 and r.num_computed_tokens == 80
        assert B.written == [0]              # blocks 9..11 were computed on the lost block 5
        B.step()
        assert B.computed_before[-1]["b"] == 80 and B.written[-1] == 4   # 5 and 9..11
        B.run()
        assert r.status == H.RequestStatus.FINISHED_LENGTH_CAPPED
        assert_saved_again(B, done[0], longer, 192, written=4)
    finally:
        B.close()


@pytest.mark.parametrize("load_async", [True, False], ids=["async", "sync"])
def test_fail_policy_fails_that_request_alone(load_async, store_name):
    n = 150
    prompt = saved_prompt("full", store_name, n)
    B = Engine("full", {"store_name": store_name, "load_async": load_async}, policy="fail")
    try:
        r = H.make_request("b", prompt, B.hbs, max_tokens=2)
        other = H.make_request("c", [3 + i % 500 for i in range(40)], B.hbs, max_tokens=3)
        B.s.add_request(r)
        B.s.add_request(other)
        hook, done = remover(B, "b", [(0, 6)])
        outs = [B.step(before_load=hook)]
        outs += B.run()
        assert done and r.status == H.RequestStatus.FINISHED_ERROR
        assert other.status == H.RequestStatus.FINISHED_LENGTH_CAPPED
        assert len(other.output_token_ids) == 3
        # nothing recomputed the lost block: the store keeps the hole until a request
        # computes that prefix again; that request's saves fill it
        assert B.w.store.batch_exists(done[0]) == [0]
        B.s.add_request(H.make_request("b2", prompt, B.hbs, max_tokens=2))
        B.run()
        assert_saved_again(B, done[0], prompt, 144, written=2 + 1)    # c's 2 blocks + it
    finally:
        B.close()


def test_sliding_only_model_with_nulls_before_the_window_is_per_request(store_name):
    # window 64: the 144-token hit loads blocks 5..8 only (vLLM nulled 0..4); with block 8
    # gone no point above 0 has its window, and block 0 is null: vLLM cannot be told by ids
    n = 150
    prompt = saved_prompt("sliding", store_name, n)
    B = Engine("sliding", {"store_name": store_name, "load_async": True, "load_retries": 0})
    try:
        r = H.make_request("b", prompt, B.hbs, max_tokens=2)
        B.s.add_request(r)
        hook, done = remover(B, "b", [(0, 8)])
        B.step(before_load=hook)
        rep = B.w.worker.recoveries["b"]
        assert done and rep.per_request and rep.safe_tokens == 0 and not B.invalid[-1]
        assert r.num_computed_tokens == 0
        B.run()
        assert r.status == H.RequestStatus.FINISHED_LENGTH_CAPPED
    finally:
        B.close()


# -- several groups ------------------------------------------------------------------------------
def test_vllm_refuses_invalid_block_ids_with_several_groups(store_name):
    """The reason multi-group loads are reported per request: vLLM 0.32 raises."""
    B = Engine("gemma", {"store_name": store_name})
    try:
        B.s.add_request(H.make_request("x", list(range(1, 60)), B.hbs, max_tokens=2))
        so = B.s.schedule()
        table = B.s.kv_cache_manager.get_block_ids("x")
        with pytest.raises(RuntimeError, match="multiple KV cache groups"):
            B.s.update_from_output(so, H.runner_output(so, B.s,
                                                       invalid_block_ids={table[0][0]}))
    finally:
        B.close()


# (case, fault, first hit, hit of the fresh lookup): gemma = full 16 + sliding 16/window 64,
# every block saved; qwen3next = full 64 + one align-mode Mamba state (at the hit end)
MULTI = {
    "gemma-sliding-block": ("gemma", 150, (1, 8), 144, 128),
    "gemma-sliding-window-start": ("gemma", 150, (1, 5), 144, 80),
    "gemma-last-full-block": ("gemma", 150, (0, 8), 144, 128),
    "gemma-first-full-block": ("gemma", 150, (0, 0), 144, 0),
    "qwen3next-mamba-state": ("qwen3next", 200, (1, 2), 192, 0),
    # full block 1 gone: 64 has its full block but no Mamba state there (only 192's saved)
    "qwen3next-full-block": ("qwen3next", 200, (0, 1), 192, 0),
}


@pytest.mark.parametrize("name", list(MULTI))
def test_multi_group_fault_reloads_the_prefix_intact_in_every_group(name, store_name):
    case, n, fault, first, second = MULTI[name]
    prompt = saved_prompt(case, store_name, n)
    B = Engine(case, {"store_name": store_name, "load_async": True})
    try:
        r = H.make_request("b", prompt, B.hbs, max_tokens=2)
        B.s.add_request(r)
        hook, done = remover(B, "b", [fault])
        B.step(before_load=hook)
        assert done
        rep = B.w.worker.recoveries["b"]
        assert rep.per_request and not B.invalid[-1]     # never an id: vLLM would raise
        assert r.num_computed_tokens == 0                # vLLM: restart from 0
        assert B.s.connector.scheduler._retries == {"b": 1}
        B.run()
        # the fresh lookup's hit is the prefix intact in every group: after the restart the
        # request computes exactly [second, n) (an async load never computes in its step)
        first_compute = next(i for i, s in enumerate(B.scheduled) if "b" in s)
        assert B.computed_before[first_compute]["b"] == second
        prefill = sum(s["b"] for s, c in zip(B.scheduled, B.computed_before)
                      if "b" in s and c["b"] < n)
        assert prefill == n - second
        assert r.status == H.RequestStatus.FINISHED_LENGTH_CAPPED
        # the recompute saved the lost key again (in the group it belongs to), nothing else
        assert_saved_again(B, done[0], prompt, first, written=1)
    finally:
        B.close()


@pytest.mark.parametrize("name", ["gemma-sliding-block", "qwen3next-mamba-state"])
def test_multi_group_fault_under_fail_policy_fails_alone(name, store_name):
    case, n, fault, _, _ = MULTI[name]
    prompt = saved_prompt(case, store_name, n)
    B = Engine(case, {"store_name": store_name, "load_async": True}, policy="fail")
    try:
        r = H.make_request("b", prompt, B.hbs, max_tokens=2)
        other = H.make_request("c", [3 + i % 500 for i in range(40)], B.hbs, max_tokens=3)
        B.s.add_request(r)
        B.s.add_request(other)
        hook, done = remover(B, "b", [fault])
        B.step(before_load=hook)
        B.run()
        assert done and r.status == H.RequestStatus.FINISHED_ERROR
        assert other.status == H.RequestStatus.FINISHED_LENGTH_CAPPED
    finally:
        B.close()
