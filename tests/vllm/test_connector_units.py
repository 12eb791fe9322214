"""HmaNixlConnector pieces outside a full flow: clip golden vectors (vllm-hma.md §13.2),
parameter validation, single-group finish, heartbeats, metadata serialization."""
import pickle
import re

import numpy as np
import pytest

import harness as H
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.request import RequestStatus

from hmacore import GroupKind, GroupSpec, KVLayout
from hmacore.integrations.vllm._clip import clip_table
from hmacore.integrations.vllm.nixl.metadata import HmaNixlWorkerMeta
from hmacore.integrations.vllm.nixl.connector import HmaNixlConnector


def test_clip_golden_vectors():
    lay = KVLayout(groups=(GroupSpec(GroupKind.FULL, 16),
                           GroupSpec(GroupKind.SLIDING_WINDOW, 16, sliding_window=32)))
    full = list(range(1, 21))
    assert clip_table((full, [0, 0, 0, 0, 7, 8]), lay) == [full, [0, 7, 8]]
    assert clip_table(([], []), lay) == [[], []]
    assert clip_table(([1], [5, 6]), lay) == [[1], [5, 6]]          # shorter than the window
    # 4096-token window of 32-token blocks needs 129 blocks, not 128
    big = KVLayout(groups=(GroupSpec(GroupKind.FULL, 32),
                           GroupSpec(GroupKind.SLIDING_WINDOW, 32, sliding_window=4096)))
    assert len(clip_table(([1], list(range(1, 201))), big)[1]) == 129


def test_clip_state_and_non_transfer_groups():
    lay = KVLayout(groups=(GroupSpec(GroupKind.FULL, 64),
                           GroupSpec(GroupKind.MAMBA, 64, num_speculative_blocks=2),
                           GroupSpec(GroupKind.SLIDING_WINDOW, 64, sliding_window=64,
                                     transfer=False)))
    assert clip_table(([1, 2], [0, 5, 6, 7], [8, 9]), lay) == [[1, 2], [5], []]
    assert clip_table(([1], [4], [8]), lay) == [[1], [4], []]
    assert clip_table(([1], [], []), lay) == [[1], [], []]
    assert clip_table(([1], [0, 5, 6, 7], []), lay, clip_state=False)[1] == [0, 5, 6, 7]
    with pytest.raises(ValueError, match="2 groups, the layout has 3"):
        clip_table(([1], [2]), lay)


def connector(kcc=None, **kw):
    vc = H.vllm_config(**kw)
    return HmaNixlConnector(vc, KVConnectorRole.SCHEDULER, kcc or H.gemma_like())


@pytest.mark.parametrize("bad", [
    dict(remote_block_ids=[[1, 2, 3]]),                        # 1 group for a 2-group layout
    dict(remote_block_ids=[[1, 2], [-4]]),                     # negative id
    dict(remote_block_ids=[[1.5], [2]]),                       # not ints
    dict(remote_host=None),                                    # missing peer address
    dict(remote_port="not-a-port"),
    dict(hma_layout_fingerprint="0" * 32),                     # P's layout differs
])
def test_bad_remote_params_fall_back_to_local_compute(bad):
    s = H.make_scheduler(H.vllm_config(), H.gemma_like())
    params = {**H.remote_params("a", s.kv_cache_config, 100), **bad}
    r = H.make_request("a", list(range(1, 101)), 16, params=params)
    assert s.connector.get_num_new_matched_tokens(r, 0) == (0, False)
    s.add_request(r)
    d = H.Driver(s)
    d.step()
    assert r.status == RequestStatus.RUNNING
    recv = d.metas[-1].reqs_to_recv
    if "remote_host" in bad:        # P cannot be named: nothing queued
        assert not recv
    else:   # only tell P to free: by handshake when the endpoint and layout are sound,
        m = recv["a"]               # else only through an agent of P already loaded
        assert m.remote is not None and not m.awaiting
        assert not any(m.remote.block_ids) and not any(m.local_block_ids)
        assert m.remote.known_only == ("remote_block_ids" not in bad)
    d.run()
    H.assert_no_leak(s)


def test_p_side_matches_nothing_and_never_async_zero():
    c = connector()
    r = H.make_request("p", list(range(1, 101)), 16, params={"do_remote_decode": True})
    assert c.get_num_new_matched_tokens(r, 0) == (0, False)
    d = H.make_request("d", list(range(1, 101)), 16,
                       params=H.remote_params("d", H.gemma_like(), 100))
    assert c.get_num_new_matched_tokens(d, 100) == (0, False)   # nothing left: not (0, True)
    assert c.get_num_new_matched_tokens(d, 32) == (68, True)
    assert c.get_num_new_matched_tokens(d, 32) == (68, True)    # side-effect free


def test_single_group_request_finished_path():
    single = H.KVCacheConfig(num_blocks=64, kv_cache_tensors=[],
                             kv_cache_groups=[H.group(["a"], H.attn(16))])
    c = connector(single)
    r = H.make_request("p", list(range(1, 41)), 16, params={"do_remote_decode": True})
    r.status = RequestStatus.FINISHED_STOPPED
    r.num_computed_tokens = 40
    delay, params = c.request_finished(r, [3, 4, 5])
    assert delay and params["remote_block_ids"] == [[3, 4, 5]]
    assert params["remote_num_tokens"] == 40
    two = connector()
    with pytest.raises(ValueError, match="has 2 groups"):
        two.request_finished(r, [3, 4, 5])


def test_group_count_mismatch_at_finish_raises():
    c = connector()
    r = H.make_request("p", list(range(1, 41)), 16, params={"do_remote_decode": True})
    r.status = RequestStatus.FINISHED_STOPPED
    with pytest.raises(Exception, match="3 groups, the layout has 2"):
        c.request_finished_all_groups(r, ([1], [2], [3]))


def test_heartbeats_throttled_to_a_sixth_of_the_lease():
    s = H.make_scheduler(H.vllm_config(extra={"kv_lease_duration": 12}), H.gemma_like())
    now = [0.0]
    s.connector.scheduler.clock = lambda: now[0]
    d = H.Driver(s)
    H_req = H.make_request("a", list(range(1, 101)), 16,
                           params=H.remote_params("a", s.kv_cache_config, 100))
    s.add_request(H_req)
    d.step()
    assert d.metas[-1].heartbeats == {"P-engine": ["P-a"]}
    now[0] = 1.0
    d.step()
    assert d.metas[-1].heartbeats == {}
    now[0] = 2.5
    d.step()
    assert d.metas[-1].heartbeats == {"P-engine": ["P-a"]}
    d.step(finished_recving={"a"})
    now[0] = 10.0
    d.run()
    assert all(not m.heartbeats for m in d.metas[-2:])
    H.assert_no_leak(s)


def test_metadata_pickles_and_worker_meta_aggregates():
    s = H.make_scheduler(H.vllm_config(), H.gemma_like())
    s.add_request(H.make_request("a", list(range(1, 101)), 16,
                                 params=H.remote_params("a", s.kv_cache_config, 100)))
    so = s.schedule()
    meta = pickle.loads(pickle.dumps(so.kv_connector_metadata))
    assert meta.reqs_to_recv["a"].local_block_ids == \
        so.kv_connector_metadata.reqs_to_recv["a"].local_block_ids
    assert all(isinstance(x, int) for g in meta.reqs_to_recv["a"].local_block_ids for x in g)
    agg = HmaNixlWorkerMeta(renewed={"a"}).aggregate(HmaNixlWorkerMeta(renewed={"b"}))
    assert agg.renewed == {"a", "b"}


def test_lease_must_be_positive():
    with pytest.raises(ValueError, match="kv_lease_duration must be a number > 0"):
        connector(extra={"kv_lease_duration": 0})


def test_progress_delay_is_read_and_must_be_non_negative():
    assert connector().scheduler.progress_delay_us == 1000
    assert connector(extra={"nixl_progress_delay_us": 5000}).scheduler.progress_delay_us == 5000
    with pytest.raises(ValueError, match="nixl_progress_delay_us must be an integer >= 0"):
        connector(extra={"nixl_progress_delay_us": -1})


def test_layout_is_the_translation():
    c = connector(H.dsv4_like())
    assert c.layout.block_sizes == (256, 64, 64, 4, 8)
    assert c.get_loaded_kv_cache_group_ids(None) == (0, 1, 2, 3, 4)
    assert c.supports_divergent_local_hybrid_hits
    assert np.array_equal(c.layout.window_blocks(), (0, 3, 5, 3, 17))


def test_p_side_prompt_cut_for_mamba_backoff_once():
    c = connector(H.qwen3_next_like(), block_size=64, mamba_cache_mode="align")
    assert c.scheduler.backoff == 1
    r = H.make_request("p", list(range(1, 201)), 64, params={"do_remote_decode": True},
                       max_tokens=9)
    c.on_new_request(r)
    assert r.num_prompt_tokens == 199 and len(r.prompt_token_ids) == 199 and r.max_tokens == 1
    assert r.num_tokens == 199
    c.on_new_request(r)                       # guarded: a re-added request is not cut again
    assert r.num_prompt_tokens == 199
    d = H.make_request("d", list(range(1, 201)), 64,
                       params=H.remote_params("d", H.qwen3_next_like(), 200))
    assert c.get_num_new_matched_tokens(d, 0) == (199, True)   # D recomputes the last token
    g = connector()                            # gemma-like: no backoff, nothing cut
    r2 = H.make_request("q", list(range(1, 101)), 16, params={"do_remote_decode": True})
    g.on_new_request(r2)
    assert r2.num_prompt_tokens == 100


def test_tp_worker_needs_vllm_parallel_state():
    """TP > 1 pull workers take their rank from vLLM's TP group: outside a vLLM worker (no
    model-parallel groups) that is a clear error, not rank 0 by accident."""
    vc = H.vllm_config()
    vc.parallel_config.tensor_parallel_size = 2
    with pytest.raises(RuntimeError, match="tensor_parallel_size=2 but vLLM's model-parallel "
                                           "groups are not initialized"):
        HmaNixlConnector(vc, KVConnectorRole.WORKER, H.gemma_like())


def test_push_worker_needs_vllm_parallel_state():
    """Push workers run one per TP rank too (rank from vLLM's TP group); outside a vLLM
    worker TP > 1 is a clear error, PP > 1 is refused."""
    vc = H.vllm_config(extra={"transfer_mode": "push"})
    vc.parallel_config.tensor_parallel_size = 2
    with pytest.raises(RuntimeError, match="tensor_parallel_size=2 but vLLM's model-parallel "
                                           "groups are not initialized"):
        HmaNixlConnector(vc, KVConnectorRole.WORKER, H.gemma_like())
    vc = H.vllm_config(extra={"transfer_mode": "push"})
    vc.parallel_config.pipeline_parallel_size = 2
    with pytest.raises(NotImplementedError, match=r"\(transfer_mode='push'\) worker: "
                                                  "tensor_parallel_size=1, "
                                                  "pipeline_parallel_size=2; only PP = 1"):
        HmaNixlConnector(vc, KVConnectorRole.WORKER, H.gemma_like())


def test_pull_worker_refuses_pipeline_parallel():
    vc = H.vllm_config()
    vc.parallel_config.pipeline_parallel_size = 2
    with pytest.raises(NotImplementedError, match="pipeline_parallel_size=2; only PP = 1"):
        HmaNixlConnector(vc, KVConnectorRole.WORKER, H.gemma_like())


def test_role_methods_are_guarded():
    c = connector()
    with pytest.raises(RuntimeError, match="worker-side method called on a SCHEDULER-role"):
        c.register_kv_caches({})


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_worker_side_refuses_more_than_one_worker_per_engine(tp, pp):
    from types import SimpleNamespace

    from hmacore.integrations.vllm._roles import require_single_worker
    cfg = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=tp,
                                                          pipeline_parallel_size=pp))
    with pytest.raises(NotImplementedError, match=f"tensor_parallel_size={tp}, "
                                                  f"pipeline_parallel_size={pp}"):
        require_single_worker(cfg, "HmaNixlConnector")
    require_single_worker(SimpleNamespace(parallel_config=SimpleNamespace(
        tensor_parallel_size=1, pipeline_parallel_size=1)), "HmaNixlConnector")


def test_push_worker_meta_aggregates_registering_ranks():
    from hmacore.integrations.vllm.nixl.push_metadata import HmaPushWorkerMeta
    a = HmaPushWorkerMeta(registered={"x": [0]})
    b = HmaPushWorkerMeta(registered={"x": [1], "y": [1]}, withdrawn={"z"})
    m = a.aggregate(b).aggregate(None)
    assert m.withdrawn == {"z"} and HmaPushWorkerMeta(withdrawn={"w"}).aggregate(b).withdrawn \
        == {"w", "z"}
    assert m.registered == {"x": [0, 1], "y": [1]}
    assert pickle.loads(pickle.dumps(m)).registered == m.registered


def test_push_scheduler_starts_only_when_every_prefill_rank_reported():
    """TP-2 prefill engine: a push counts as registered only once both ranks reported it
    (each rank reports once every decode rank reading from it registered); reports of one
    rank in different steps accumulate."""
    from types import SimpleNamespace

    from hmacore.integrations.vllm.nixl.push_metadata import HmaPushWorkerMeta
    vc = H.vllm_config(extra={"transfer_mode": "push"}, tp=2)
    sched = HmaNixlConnector(vc, KVConnectorRole.SCHEDULER, H.gemma_like()).scheduler

    def report(meta):
        sched.update_connector_output(SimpleNamespace(
            finished_recving=None, failed_recving=None, finished_sending=None,
            kv_connector_worker_meta=meta))

    report(HmaPushWorkerMeta(registered={"x": [1]}))
    assert sched.registered() == set()
    report(HmaPushWorkerMeta(registered={"x": [0]}))
    assert sched.registered() == {"x"} and sched._reg_partial == {}
    report(HmaPushWorkerMeta(registered={"y": [0, 1]}))
    assert sched.registered() == {"x", "y"}
    report(HmaPushWorkerMeta(withdrawn={"y"}))    # D cancelled y before any request claimed it
    assert sched.registered() == {"x"} and "y" in sched._withdrawn


def test_push_scheduler_drops_only_unclaimed_stale_registrations():
    """A complete registration no request of this engine claims within kv_lease_duration is
    dropped; one a request claimed stays however long its request runs; the sweep visits only
    unclaimed registrations (claimed ones are not re-scanned every step)."""
    from types import SimpleNamespace

    from hmacore.integrations.vllm.nixl.push_metadata import HmaPushWorkerMeta
    vc = H.vllm_config(extra={"transfer_mode": "push", "kv_lease_duration": 10})
    sched = HmaNixlConnector(vc, KVConnectorRole.SCHEDULER, H.gemma_like()).scheduler
    now = [100.0]
    sched.clock = lambda: now[0]

    def report(meta=None):
        sched.update_connector_output(SimpleNamespace(
            finished_recving=None, failed_recving=None, finished_sending=None,
            kv_connector_worker_meta=meta))

    claimer = SimpleNamespace(request_id="p-y", kv_transfer_params={
        "do_remote_decode": True, "transfer_mode": "push", "push_id": "y"})
    assert sched._is_push_producer(claimer) == "y"
    report(HmaPushWorkerMeta(registered={"x": [0], "y": [0]}))
    now[0] += 5
    report(HmaPushWorkerMeta(registered={"z": [0]}))
    assert sched.registered() == {"x", "y", "z"}
    assert list(sched._unclaimed_at) == ["x", "z"]
    now[0] += 6                       # x: 11 s unclaimed; z: 6 s
    report()
    assert sched.registered() == {"y", "z"}
    now[0] += 100
    report()
    assert sched.registered() == {"y"} and sched._unclaimed_at == {}


def test_push_scheduler_step_report_fast_path_keeps_lease_expiry_and_stats():
    """A step whose report is empty returns early (finished_sending None) unless a lease can
    expire: an expired lease is still freed then; the stats hook builds nothing until
    something was counted, then exactly what was counted."""
    from types import SimpleNamespace

    vc = H.vllm_config(extra={"transfer_mode": "push", "kv_lease_duration": 10})
    conn = HmaNixlConnector(vc, KVConnectorRole.SCHEDULER, H.gemma_like())
    sched = conn.scheduler
    now = [100.0]
    sched.clock = lambda: now[0]

    def report(sending=None):
        out = SimpleNamespace(finished_recving=None, failed_recving=set(),
                              finished_sending=sending, kv_connector_worker_meta=None)
        conn.update_connector_output(out)
        return out.finished_sending

    assert report() is None and report(set()) is None
    assert conn.get_kv_connector_stats() is None
    sched._leases["p-1"] = now[0] + 10
    assert report() is None                  # lease still running
    now[0] += 11
    assert report() == {"p-1"}               # expired with nothing reported: freed
    assert sched._leases == {} and sched._expired_pending == {"p-1"}
    stats = conn.get_kv_connector_stats()
    assert stats is not None and stats.data == {"lease_expiries": 1}
    assert conn.get_kv_connector_stats() is None


def test_mamba_groups_of_other_block_sizes_map_state_to_state(caplog):
    """D (pull), P's Mamba group of another block size: D loads up to P's state point (P keeps
    one state, after remote_num_tokens), fewer tokens when P's state is earlier than D's
    planned end, none when it is later or P's states are not D's bytes (each refusal logged
    with the rule); D computes the rest itself."""
    vc = H.vllm_config(block_size=64, mamba_cache_mode="align")
    s = H.make_scheduler(vc, H.qwen3_next_like(num_blocks=64))
    conn = s.connector.scheduler
    mine = conn.state_bytes
    assert mine == [None, 96]          # shapes (4, 8) and (16,) of float16, page padded

    def ask(rid, **over):
        params = dict(do_remote_prefill=True, do_remote_decode=False,
                      remote_block_ids=[[11, 12, 13, 14], [15]], remote_engine_id="P-engine",
                      remote_request_id="P-" + rid, remote_host="127.0.0.1", remote_port=5600,
                      tp_size=1, remote_num_tokens=99, remote_block_sizes=[32, 32],
                      remote_block_first=[0, 3], remote_state_bytes=list(mine),
                      hma_regrain_fingerprint=conn.layout.regrain_fingerprint())
        params.update(over)
        params = {k: v for k, v in params.items() if v is not None}
        r = H.make_request(rid, list(range(1, 101)), 64, params=params)
        return s.connector.get_num_new_matched_tokens(r, 0)

    assert ask("a") == (99, True)               # P's state after 99 tokens = D's load end
    assert ask("b", remote_num_tokens=80) == (80, True)   # lands on P's earlier state
    assert ask("c", remote_num_tokens=120) == (0, False)
    assert "request c: P keeps its Mamba state after 120 tokens and D's load would end at " \
           "99; a Mamba block holds one state" in caplog.text
    assert ask("d", remote_state_bytes=None) == (0, False)
    assert "its params carry no remote_state_bytes" in caplog.text
    assert ask("e", remote_state_bytes=[None, 97]) == (0, False)
    assert "group 1 (Mamba): P's state is 97 B per layer, ours 96 B (remote_state_bytes); a " \
           "state maps only onto a state of equal bytes" in caplog.text
    # P of another TP size: its per-rank states differ from ours (the worker pairs the state
    # geometry's byte ranges, refusing at the handshake a side without one); the load point
    # rule is the same
    assert ask("f", tp_size=2, remote_state_bytes=[None, 48]) == (99, True)
    assert ask("g", tp_size=2, remote_num_tokens=120) == (0, False)
    assert ask("h", tp_size=2, remote_state_bytes=None) == (0, False)
    assert "a block-size remap moves state pages only between equal TP sizes" \
        not in caplog.text


def test_push_remap_refuses_mamba_groups_of_other_block_sizes_by_name():
    """A remap plan without state sizes (a push worker given none) refuses Mamba groups of
    other block sizes naming the rule; with them (pull's, and push's from its KV cache
    config) the states pair."""
    from hmacore.errors import LayoutError
    from hmacore.integrations.vllm.nixl._regrain import regrain_plan
    from hmacore.plan import Region, TransferPlan

    def side(bs, page, base):
        lay = KVLayout(groups=(GroupSpec(GroupKind.MAMBA, bs, ("m0",)),))
        return lay, TransferPlan(lay, [Region(base=base, block_len=page, stride=page,
                                              logical_blocks=8, ratio=1, group=0, state=True,
                                              layers=("m0",))])
    (sl, sp), (dl, dp) = side(32, 4096, 1 << 20), side(64, 8192, 1 << 30)
    with pytest.raises(LayoutError, match=r"groups \[0\] \(Mamba\): a remap moves a Mamba "
                       "state by its unpadded bytes and this worker was given none"):
        regrain_plan(sl, dl, sp, dp, [None], [None])
    plan = regrain_plan(sl, dl, sp, dp, [None], [None], state=[96])
    assert [p.state_bytes for p in plan.pairs] == [96]


def _push_worker(**kw):
    from hmacore.integrations.vllm.nixl._tp import WorkerTp
    from hmacore.integrations.vllm.nixl.push_worker import HmaPushWorker
    from hmacore.tp import GroupSharding
    lay = KVLayout(groups=(GroupSpec(GroupKind.FULL, 16, ("a.0",)),
                           GroupSpec(GroupKind.SLIDING_WINDOW, 16, ("a.1",), sliding_window=64)))
    tp = WorkerTp(0, 2, (GroupSharding(2, 1, False),) * 2, "torch.float16", 64, "LBHNC")
    return HmaPushWorker(lay, 64, "e", "127.0.0.1", 5999, tp=tp, **kw)


def test_push_remap_refusals_name_the_key_and_the_rule():
    """Push mode: a decode rank of other block sizes pairs through a remap (at any pair of TP
    sizes, over either transport), not when block_size_remap is false."""
    from hmacore.errors import HandshakeError
    _push_worker()._check_remap([32, 32])       # remapped
    with pytest.raises(HandshakeError, match=r"block sizes \[32, 32\] differ from this engine's "
                       r"\[16, 16\] and kv_connector_extra_config.block_size_remap is false"):
        _push_worker(block_size_remap=False)._check_remap([32, 32])
    w = _push_worker()
    w.transport = "mooncake"      # Mooncake TE posts byte runs too (TeDescAgent.post_runs)
    w._check_remap([32, 32])


def test_push_remap_across_tp_names_what_cannot_be_planned():
    """Push across TP and block sizes: the plan of one (P rank, D rank) pair is the pull
    side's RegrainPlan with tp=(D rank's TpMapping, P rank); pages that cannot be paired row
    for row (NHD: a token row holds all of the rank's heads, 1 head on P rank 1, 2 on D) are
    a HandshakeError naming the peer and the rule; LBHNC pages of the same ranks plan."""
    from hmacore.errors import HandshakeError
    from hmacore.integrations.vllm.nixl.push_worker import _regrain_plan_with
    from hmacore.plan import TransferPlan
    from hmacore.regrain import token_page
    from hmacore.tp import GroupSharding, TpMapping

    def side(bs, heads):
        lay = KVLayout(groups=(GroupSpec(GroupKind.FULL, bs, ("a.0",)),))
        kv = {"a.0": np.zeros((8, heads, bs, 32), np.uint8)}
        return lay, TransferPlan.from_kv_caches(lay, kv, num_blocks=8)

    (play, pplan), (dlay, dplan) = side(16, 1), side(32, 2)
    mapping = TpMapping(dlay, [GroupSharding(2, 1)], local_tp=1, local_rank=0, remote_tp=2)
    lbhnc = [token_page("LBHNC", block_size=16, heads=1, head_start=1, head_bytes=16)], \
        [token_page("LBHNC", block_size=32, heads=2, head_bytes=16)]
    plan = _regrain_plan_with(play, pplan, lbhnc[0], dlay, dplan, lbhnc[1], mapping, 1,
                              "prefill rank 1 ('p#tp1@push')", log=False)
    assert [c for p in plan.pairs for c in p.chunks] == [(0, 1024, 32)]   # head 1 only
    nhd = [token_page("NHD", block_size=16, heads=1, head_start=1, head_bytes=16)], \
        [token_page("NHD", block_size=32, heads=2, head_bytes=16)]
    with pytest.raises(HandshakeError, match=r"block-size remap with prefill rank 1 "
                       r"\('p#tp1@push'\): group 0: chunk \(0, None\) is 16 B per token on "
                       r"the source \(NHD\) and 32 B on the destination"):
        _regrain_plan_with(play, pplan, nhd[0], dlay, dplan, nhd[1], mapping, 1,
                           "prefill rank 1 ('p#tp1@push')", log=False)


def test_push_remap_step_that_cannot_be_planned_ends_the_push():
    """P's worker: a remap step whose tokens D registered no block for (a null id where D
    needs a token) is refused naming the group and the blocks; the push fails (D is told),
    the worker follows the request no more and nothing raises."""
    from hmacore.integrations.vllm.nixl.push_metadata import PushSave
    from hmacore.integrations.vllm.nixl.push_worker import HmaPushWorker, _Reg
    vc = H.vllm_config(extra={"transfer_mode": "push"})
    layout = HmaNixlConnector(vc, KVConnectorRole.SCHEDULER, H.gemma_like()).scheduler.layout
    w = HmaPushWorker(layout, 400, "p-engine", "127.0.0.1", 1)     # no agent: nothing sent
    theirs = [[1, 0, 3, 4, 5], [0, 0, 3, 4, 5]]            # D 32-token blocks, 150 tokens
    w._regs["x"] = _Reg(1, theirs, agents={0: "d-agent"}, reported=True,
                        remap=(0, 150, [32, 32]))
    table = [list(range(1, 11))] * 2                       # P: 16-token blocks
    save = PushSave(request_id="r", push_id="x", step=0, final=True, start=0, end=150,
                    new_block_ids=table, full=True)
    assert w._plan_step([save]) == []
    err = w._pushes["x"].failed
    assert err is not None and "step 0 cannot be planned" in err
    assert re.search(r"group 0: tokens \[0, 150\) need D's blocks 0..4; .* null", err), err
    assert "r" not in w.tables and "x" not in w._followed
    # D registered every block it needs: the same step is planned as token ranges
    w2 = HmaPushWorker(layout, 400, "p-engine", "127.0.0.1", 1)
    w2._regs["x"] = _Reg(1, [[1, 2, 3, 4, 5], [0, 0, 3, 4, 5]], agents={0: "d-agent"},
                         reported=True, remap=(0, 150, [32, 32]))
    planned = w2._plan_step([save])
    assert len(planned) == 1 and planned[0].regrain is not None and not w2._pushes
    assert planned[0].local_block_ids[0].tolist() == list(range(1, 11))
    assert planned[0].remote_block_ids[0].tolist() == [1, 2, 3, 4, 5]
