"""Tier-1 proof: HmaNixlConnector inside vLLM 0.32's real v1 Scheduler and KV cache manager
(CPU, no model), loaded by kv_connector_module_path, HMA on. After every flow: no block leaked.
Emitted per-group block ids are checked against vLLM's own KVCacheManager tables, clipped by
an independent statement of the window rule (harness.oracle_clip)."""
import time

import pytest

import harness as H
from vllm.v1.core.kv_cache_coordinator import HybridKVCacheCoordinator
from vllm.v1.request import RequestStatus

from hmacore.integrations.vllm.nixl.metadata import HmaNixlWorkerMeta
from hmacore.integrations.vllm.nixl.connector import HmaNixlConnector

CASES = {
    # name: (vllm_config kwargs, kv cache config factory, prompt tokens)
    "gemma": (dict(), lambda n: H.gemma_like(num_blocks=n), 150),
    "qwen3next": (dict(block_size=64, mamba_cache_mode="align"),
                  lambda n: H.qwen3_next_like(num_blocks=n), 200),
    "dsv4": (dict(max_num_batched_tokens=1024), lambda n: H.dsv4_like(num_blocks=n), 600),
    # grouped by vLLM itself (get_kv_cache_configs) from the tiny gemma2 config.json
    "gemma_derived": (dict(), lambda n: H.derived_gemma(H.vllm_config()), 300),
}


def setup(case, num_blocks=400, **over):
    vkw, make, prompt = CASES[case]
    vkw = {**vkw, **over}
    vc = H.vllm_config(**vkw)
    kcc = make(num_blocks)
    s = H.make_scheduler(vc, kcc)
    return s, kcc, prompt


def hash_bs(s):
    return s.kv_cache_manager.hash_block_size if hasattr(s.kv_cache_manager, "hash_block_size") \
        else H.C.resolve_kv_cache_block_sizes(s.kv_cache_config, s.vllm_config)[1]


def req(s, rid, n, *, params=None, max_tokens=4, base=1):
    r = H.make_request(rid, [base + i % 900 for i in range(n)], hash_bs(s), params=params,
                       max_tokens=max_tokens)
    s.add_request(r)
    return r


def fresh_blocks(s, rid):
    """vLLM's own view: per group, non-null blocks without a block hash (to be filled)."""
    out = []
    for grp in s.kv_cache_manager.get_blocks(rid).blocks:
        out.append([b.block_id for b in grp if not b.is_null and b.block_hash is None])
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_hma_on_and_connector_loaded_by_module_path(case):
    s, kcc, _ = setup(case)
    assert isinstance(s.kv_cache_manager.coordinator, HybridKVCacheCoordinator)
    assert len(s.kv_cache_config.kv_cache_groups) > 1
    assert type(s.connector) is HmaNixlConnector
    assert s.vllm_config.kv_transfer_config.kv_connector_module_path == "hmacore.integrations.vllm"
    assert not s.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
    assert s.connector.layout.num_groups == len(kcc.kv_cache_groups)


@pytest.mark.parametrize("case", list(CASES))
def test_async_load(case):
    s, kcc, n = setup(case)
    d = H.Driver(s)
    r = req(s, "a", n, params=H.remote_params("a", kcc, n))
    expected_count = n - d.conn.backoff
    d.step()
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert r.num_computed_tokens == expected_count
    m = d.metas[-1].reqs_to_recv["a"]
    assert m.awaiting and m.num_external_tokens == expected_count
    table = d.table_at_meta[-1]["a"]
    # every non-null block of a brand-new request is to be filled; clipped by the rule
    assert m.local_block_ids == H.oracle_clip([[b for b in g if b] for g in table], kcc)
    assert m.local_num_computed_blocks == (0,) * len(table)
    assert m.remote.block_ids == H.remote_params("a", kcc, n)["remote_block_ids"]
    assert d.metas[-1].heartbeats == {"P-engine": ["P-a"]}
    assert d.conn.awaiting() == {"a"}
    d.step()                                   # still waiting: nothing scheduled
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    d.step(finished_recving={"a"})
    assert d.conn.awaiting() == set()
    d.run()
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED
    H.assert_no_leak(s)


@pytest.mark.parametrize("case", list(CASES))
def test_sync_load(case):
    s, kcc, n = setup(case, extra={"sync_load": True})
    d = H.Driver(s)
    r = req(s, "a", n, params=H.remote_params("a", kcc, n))
    d.step()
    assert r.status == RequestStatus.RUNNING
    m = d.metas[-1].reqs_to_recv["a"]
    assert not m.awaiting and m.num_external_tokens == min(n - d.conn.backoff, n - 1)
    assert r.num_computed_tokens == n
    assert m.local_block_ids == H.oracle_clip(
        [[b for b in g if b] for g in d.table_at_meta[-1]["a"]], kcc)
    assert d.conn.awaiting() == set()
    d.run()
    H.assert_no_leak(s)


@pytest.mark.parametrize("case", list(CASES))
def test_partial_local_prefix_hit_loads_only_the_rest(case):
    s, kcc, n = setup(case)
    d = H.Driver(s)
    req(s, "warm", n)                           # same prompt, computed locally
    d.run()
    r = req(s, "b", n, params=H.remote_params("b", kcc, n))
    d.step()
    meta = d.metas[-1]
    assert "b" in meta.reqs_to_recv
    m = meta.reqs_to_recv["b"]
    # vLLM's own table: hashed (locally hit) blocks are not read again
    assert m.local_block_ids == H.oracle_clip(fresh_blocks(s, "b"), kcc)
    hit_blocks = tuple(sum(1 for b in g if not b.is_null and b.block_hash is not None)
                       for g in s.kv_cache_manager.get_blocks("b").blocks)
    assert m.local_num_computed_blocks == hit_blocks
    assert any(hit_blocks), "expected a local prefix hit"
    if m.awaiting:
        d.step(finished_recving={"b"})
    d.run()
    assert r.is_finished()
    H.assert_no_leak(s)


def test_full_local_hit_is_notify_only():
    # qwen3-next-like: D recomputes 1 token (Mamba backoff), so a local hit of every aligned
    # block leaves nothing to pull: P must still be told (notify-only, empty local table).
    s, kcc, _ = setup("qwen3next")
    n = 129                                     # 2 full 64-token blocks + 1 recomputed token
    d = H.Driver(s)
    req(s, "warm", n)
    d.run()
    r = req(s, "b", n, params=H.remote_params("b", kcc, n))
    d.step()
    m = d.metas[-1].reqs_to_recv["b"]
    assert m.local_block_ids == [[], []] and not m.awaiting and m.remote is not None
    assert r.status == RequestStatus.RUNNING   # never parked
    d.run()
    H.assert_no_leak(s)


@pytest.mark.parametrize("case", list(CASES))
def test_abort_before_scheduling_notifies_p(case):
    s, kcc, n = setup(case)
    d = H.Driver(s)
    r = req(s, "a", n, params=H.remote_params("a", kcc, n))
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    d.step()
    m = d.metas[-1].reqs_to_recv["a"]
    assert m.remote.request_id == "P-a" and not any(m.local_block_ids) and not m.awaiting
    assert r.is_finished()
    H.assert_no_leak(s)


@pytest.mark.parametrize("case", list(CASES))
def test_abort_while_waiting_for_remote(case):
    s, kcc, n = setup(case)
    d = H.Driver(s)
    req(s, "a", n, params=H.remote_params("a", kcc, n))
    d.step()
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    # the worker may still be writing: blocks are held until it reports the recv done
    assert "a" in s.requests
    assert H.free_blocks(s) < s.kv_cache_manager.block_pool.num_gpu_blocks - 1
    d.step(finished_recving={"a"})
    H.assert_no_leak(s)
    assert d.conn.awaiting() == set()


@pytest.mark.parametrize("case", list(CASES))
def test_abort_p_side_after_scheduling(case):
    s, kcc, n = setup(case, max_num_batched_tokens=64 if case != "dsv4" else 256)
    d = H.Driver(s)
    req(s, "p", n, params={"do_remote_decode": True})
    d.step()                                    # chunked prefill in progress
    s.finish_requests("p", RequestStatus.FINISHED_ABORTED)
    d.step()
    assert "p" in d.metas[-1].reqs_not_processed
    assert d.conn.leases() == {}
    H.assert_no_leak(s)


def p_finish(case, **over):
    s, kcc, n = setup(case, **over)
    d = H.Driver(s)
    r = req(s, "p", n, params={"do_remote_decode": True}, max_tokens=1)
    snap = {}
    while "p" not in d.finished_params():
        d.step()
        if "p" in s.requests and not r.is_finished():
            snap["computed"] = r.num_computed_tokens
    return s, kcc, d, r


@pytest.mark.parametrize("case", list(CASES))
def test_p_finish_holds_blocks_and_emits_per_group_clipped_ids(case):
    s, kcc, d, r = p_finish(case)
    params = d.finished_params()["p"]
    assert "p" in d.conn.leases()
    assert "p" in s.requests                    # delayed free
    # vLLM's own table of the finished request (blocks still held), computed part only
    table = s.kv_cache_manager.get_block_ids_for_computed_tokens("p", r.num_computed_tokens)
    assert params["remote_block_ids"] == H.oracle_clip(table, kcc)
    assert len(params["remote_block_ids"]) == len(kcc.kv_cache_groups)
    assert params["do_remote_prefill"] and not params["do_remote_decode"]
    assert params["remote_num_tokens"] == r.num_computed_tokens
    # wall clock for D (P's lease clock is its own monotonic clock)
    assert abs(params["remote_blocks_expiry_time"] - (time.time() + d.conn.lease_s)) < 5
    d.step()
    assert "p" in d.metas[-1].reqs_to_send
    d.step(finished_sending={"p"})
    H.assert_no_leak(s)
    assert d.conn.leases() == {}


@pytest.mark.parametrize("case", list(CASES))
def test_lease_renewal_and_expiry_frees_blocks(case):
    s, kcc, n = setup(case, extra={"kv_lease_duration": 10})
    now = [1000.0]
    s.connector.scheduler.clock = lambda: now[0]
    d = H.Driver(s)
    req(s, "p", n, params={"do_remote_decode": True}, max_tokens=1)
    while "p" not in d.finished_params():
        d.step()
    assert d.conn.leases()["p"] == pytest.approx(1010.0)
    now[0] = 1008.0
    d.step(worker_meta=HmaNixlWorkerMeta(renewed={"p"}))       # D heartbeat renews
    assert d.conn.leases()["p"] == pytest.approx(1018.0)
    now[0] = 1015.0
    d.step()
    assert "p" in s.requests                                   # not yet expired
    now[0] = 1018.5
    d.step()                                                   # expired -> freed
    H.assert_no_leak(s)
    d.step()
    assert "p" in d.metas[-1].expired
    d.step(finished_sending={"p"})                             # late report: ignored
    H.assert_no_leak(s)


def test_renewed_lease_does_not_shield_an_older_one():
    # leases expire in deadline order; a renewal moves a lease behind the others, so the
    # walk that stops at the first running lease still reaches every expired one
    s, kcc, n = setup("gemma", extra={"kv_lease_duration": 10})
    now = [1000.0]
    s.connector.scheduler.clock = lambda: now[0]
    d = H.Driver(s)
    req(s, "a", n, params={"do_remote_decode": True}, max_tokens=1)
    while "a" not in d.finished_params():
        d.step()
    now[0] = 1002.0
    req(s, "b", n, params={"do_remote_decode": True}, max_tokens=1, base=300)
    while "b" not in d.finished_params():
        d.step()
    assert d.conn.leases() == {"a": pytest.approx(1010.0), "b": pytest.approx(1012.0)}
    now[0] = 1009.0
    d.step(worker_meta=HmaNixlWorkerMeta(renewed={"a"}))       # a: 1019, now after b
    now[0] = 1012.5
    d.step()
    assert "b" in d.metas[-1].expired or "b" not in d.conn.leases()
    assert list(d.conn.leases()) == ["a"]
    now[0] = 1019.5
    d.step()
    d.step()
    assert d.conn.leases() == {}
    H.assert_no_leak(s)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("retries", [0, 1, 2])
def test_failed_recving_recompute_policy(case, retries):
    # a load failed as a whole: vLLM restarts the request from 0; the connector loads it
    # again `load_retries` times (the worker keeps P's blocks for every load but the last),
    # then the request computes its prompt
    s, kcc, n = setup(case, load_failure_policy="recompute", extra={"load_retries": retries})
    d = H.Driver(s)
    r = req(s, "a", n, params=H.remote_params("a", kcc, n))
    d.step()
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    loads = [d.metas[-1].reqs_to_recv["a"]]
    for _ in range(retries):
        d.step(finished_recving={"a"}, failed_recving={"a"})
        assert "a" in d.conn.failed_recving
        if "a" not in d.metas[-1].reqs_to_recv:
            d.step()
        assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS    # loading again
        loads.append(d.metas[-1].reqs_to_recv["a"])
    assert [x.retry for x in loads] == [True] * retries + [False]
    assert all(x.local_block_ids and x.remote == loads[0].remote for x in loads)
    d.step(finished_recving={"a"}, failed_recving={"a"})
    assert "a" in d.conn.failed_recving
    d.step()
    assert r.status == RequestStatus.RUNNING and "a" not in d.metas[-1].reqs_to_recv
    d.run()
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED
    H.assert_no_leak(s)


@pytest.mark.parametrize("case", ["gemma", "qwen3next"])
def test_preemption_and_resume_tables_match_vllm(case):
    # A small pool + long decodes force preemptions. Producers' emitted ids must be the clip
    # of vLLM's own table (pull mode follows no table per step; push mode's follower is
    # checked every step in push_harness.Engine.step).
    nb = {"gemma": 34, "qwen3next": 14}[case]
    s, kcc, _ = setup(case, num_blocks=nb)
    d = H.Driver(s)
    n = {"gemma": 64, "qwen3next": 128}[case]
    if case == "gemma":      # P-side producers decoding (gemma has no prefill backoff)
        for i in range(3):
            req(s, f"p{i}", n, params={"do_remote_decode": True}, max_tokens=120,
                base=1 + 50 * i)
    else:                    # Mamba P sides stop after 1 token: use D sides that decode
        for i in range(3):
            req(s, f"d{i}", n, params=H.remote_params(f"d{i}", kcc, n), max_tokens=150,
                base=1 + 50 * i)
    steps = 0
    while s.has_unfinished_requests() and steps < 500:
        d.step(finished_sending=set(d.conn.leases()), finished_recving=d.conn.awaiting())
        steps += 1
    assert not s.has_unfinished_requests()
    assert d.preempted, "the pool was meant to force a preemption"
    if case == "gemma":
        # each producer's params name its final table (after its preemptions), clipped
        finished = d.finished_params()
        assert sorted(finished) == ["p0", "p1", "p2"]
        for rid, params in finished.items():
            last = [t[rid] for t in d.table_at_meta if rid in t][-1]
            assert params["remote_block_ids"] == H.oracle_clip(last, kcc), rid
            assert all(b > 0 for g in params["remote_block_ids"] for b in g), rid
    d.step(finished_sending=set(d.conn.leases()))
    H.assert_no_leak(s)


def test_p_to_d_roundtrip_params():
    # P's kv_transfer_params fed to a D scheduler: D reads exactly P's clipped ids
    sp, kcc, d_p, _ = p_finish("gemma")
    params = d_p.finished_params()["p"]
    sd = H.make_scheduler(H.vllm_config(), H.gemma_like())
    dd = H.Driver(sd)
    n = params["remote_num_tokens"]
    r = H.make_request("d", [1 + i % 900 for i in range(n)], 16, params=params)
    sd.add_request(r)
    dd.step()
    m = dd.metas[-1].reqs_to_recv["d"]
    assert m.remote.block_ids == params["remote_block_ids"]
    assert m.remote.engine_id == sp.vllm_config.kv_transfer_config.engine_id
    dd.step(finished_recving={"d"})
    dd.run()
    H.assert_no_leak(sd)


@pytest.mark.parametrize("forge", ["swapped_groups", "full_too_short", "full_null", "too_many",
                                   "expired", "bad_expiry", "bad_num_tokens"])
def test_d_refuses_params_that_cannot_be_p_s(forge, caplog):
    # D checks P's params against its own layout and remote_num_tokens: a refused request
    # runs without a remote load (computes its prompt), with a warning naming the rule
    sp, kcc, d_p, _ = p_finish("gemma")
    params = dict(d_p.finished_params()["p"])
    ids = [list(g) for g in params["remote_block_ids"]]
    full = next(g for g, grp in enumerate(kcc.kv_cache_groups)
                if type(grp.kv_cache_spec).__name__ == "FullAttentionSpec")
    n = params["remote_num_tokens"]
    if forge == "swapped_groups":
        ids = ids[::-1]
    elif forge == "full_too_short":
        ids[full] = ids[full][:-1]
    elif forge == "full_null":
        ids[full][0] = 0
    elif forge == "too_many":
        ids[full] = ids[full] + [7, 8, 9]
    elif forge == "expired":
        params["remote_blocks_expiry_time"] = time.time() - 1
    elif forge == "bad_expiry":
        params["remote_blocks_expiry_time"] = "soon"
    else:
        params["remote_num_tokens"] = -3
    params["remote_block_ids"] = ids
    sd = H.make_scheduler(H.vllm_config(), H.gemma_like())
    dd = H.Driver(sd)
    r = H.make_request("d", [1 + i % 900 for i in range(n)], 16, params=params, max_tokens=2)
    sd.add_request(r)
    with caplog.at_level("WARNING"):
        dd.step()
    assert "kv_transfer_params rejected" in caplog.text, caplog.text
    m = dd.metas[-1].reqs_to_recv.get("d")
    if forge == "expired":          # P has freed them already: nothing to tell it
        assert m is None or m.remote is None
    else:                           # a notify-only entry: P frees at once, not at lease end
        assert m is not None and m.remote is not None and not m.awaiting
        assert not any(m.remote.block_ids) and not any(m.local_block_ids)
    dd.run()
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED
    H.assert_no_leak(sd)
