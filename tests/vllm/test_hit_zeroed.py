"""Connector state when vLLM's real Scheduler takes back a hit the connector reported.

vLLM may drop the external hit after ``get_num_new_matched_tokens`` (``skip_reading_prefix_
cache`` in 0.32 and 0.33; from 0.33 also the aux-output connector's ``cap_external_hit``,
the partial-tail and replay rules), then calls ``update_state_after_alloc`` with 0 external
tokens; an async load brings a second ``update_state_after_alloc`` call (0 tokens) once the
load finished. In every case the connector must queue no load for a dropped hit, exactly one
load for a kept one, and hold nothing once the request is gone (no block leak either).

The aux-output cap runs 0.33's own scheduler code with a small capper object in the
scheduler's ``aux_output_connector`` slot (the hook vLLM's R3 connector fills): the capper is
the only stand-in, the Scheduler, KV cache manager and connectors are real.
"""
from __future__ import annotations

import pytest

import harness as H
from test_store_connector import CASES, Instance, store_name  # noqa: F401 (fixture)

from hmacore.integrations.vllm import _compat as C

NEEDS_033 = pytest.mark.skipif(not C.AT_LEAST_033,
                               reason="the aux-output hit cap exists from vLLM 0.33 on")


class ZeroingAuxOutput:
    """What 0.33's scheduler calls on its aux-output connector; caps every external hit
    to 0 and records what it was asked to cap."""

    def __init__(self) -> None:
        self.capped: list[int] = []

    def max_cache_hit(self, request):
        return None

    def cap_external_hit(self, request, num_local, num_external):
        self.capped.append(int(num_external))
        return 0

    def request_loading(self, request, num_tokens):
        raise AssertionError("a capped hit must not start a load")

    def request_finished(self, request):
        pass

    def build_connector_meta(self, *args):
        return None

    def take_output(self, request, output):
        return None

    def reset(self):
        pass


def count_allocs(sched):
    """Wrap the scheduler connector's update_state_after_alloc: records (rid, tokens)."""
    calls: list[tuple[str, int]] = []
    conn = sched.connector
    real = conn.update_state_after_alloc

    def wrapped(request, blocks, num_external_tokens):
        calls.append((request.request_id, int(num_external_tokens)))
        return real(request, blocks, num_external_tokens)

    conn.update_state_after_alloc = wrapped
    return calls


def saved_instance(case, extra):
    """An instance that ran one request and saved its KV to the store; returns its prompt."""
    _, _, n = CASES[case]
    A = Instance(case, extra)
    prompt = [1 + i % 900 for i in range(n)]
    A.s.add_request(H.make_request("a", prompt, A.hbs, max_tokens=4))
    A.run(write=True)
    A.close()
    return prompt


def assert_forgotten(sched_side, rid):
    """The store connector's scheduler side holds nothing of ``rid``."""
    assert rid not in sched_side.trackers
    assert rid not in sched_side._requests and rid not in sched_side._hits
    assert rid not in sched_side._hit_requests
    assert rid not in sched_side._loads


def run_zeroed(inst, rid, prompt, *, skip_reading=False):
    r = H.make_request(rid, prompt, inst.hbs, max_tokens=2)
    if skip_reading:
        r.skip_reading_prefix_cache = True     # what prompt_logprobs sets
    sched = inst.s.connector.scheduler
    # the connector does see the saved prefix
    assert sched.get_num_new_matched_tokens(r, 0)[0] > 0
    sched._hits.clear()
    calls = count_allocs(inst.s)
    inst.s.add_request(r)
    inst.run()
    assert not any(rid in m.loads for m in inst.metas), "a load was queued for a dropped hit"
    assert calls and all(n == 0 for _, n in calls)
    assert r.num_computed_tokens >= len(prompt)     # computed locally, in full
    assert_forgotten(sched, rid)
    return calls


@pytest.mark.parametrize("case", ["gemma", "qwen3next"])
def test_store_hit_dropped_for_skip_reading_prefix_cache(case, store_name):  # noqa: F811
    prompt = saved_instance(case, {"store_name": store_name})
    B = Instance(case, {"store_name": store_name, "load_async": True})
    try:
        run_zeroed(B, "b", prompt, skip_reading=True)
    finally:
        B.close()


@NEEDS_033
@pytest.mark.parametrize("load_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("case", ["gemma", "qwen3next"])
def test_store_hit_capped_to_zero_by_the_scheduler(case, load_async, store_name):  # noqa: F811
    prompt = saved_instance(case, {"store_name": store_name})
    B = Instance(case, {"store_name": store_name, "load_async": load_async})
    try:
        aux = ZeroingAuxOutput()
        B.s.aux_output_connector = aux
        run_zeroed(B, "b", prompt)
        assert aux.capped and aux.capped[0] > 0     # vLLM took back a positive hit
    finally:
        B.close()


@pytest.mark.parametrize("case", ["gemma", "qwen3next"])
def test_async_load_gets_a_second_alloc_call_and_loads_once(case, store_name):  # noqa: F811
    prompt = saved_instance(case, {"store_name": store_name})
    B = Instance(case, {"store_name": store_name, "load_async": True})
    try:
        calls = count_allocs(B.s)
        r = H.make_request("b", prompt, B.hbs, max_tokens=2)
        B.s.add_request(r)
        B.run()
        mine = [n for rid, n in calls if rid == "b"]
        # first with the hit, then (after finished_recving) with 0 tokens
        assert len(mine) == 2 and mine[0] > 0 and mine[1] == 0
        loads = [m.loads["b"] for m in B.metas if "b" in m.loads]
        assert len(loads) == 1 and loads[0].hit_tokens == mine[0]
        assert_forgotten(B.s.connector.scheduler, "b")
    finally:
        B.close()


@NEEDS_033
def test_pd_remote_hit_capped_to_zero_frees_the_prefill_side():
    """D side of a P/D pull: vLLM caps the remote hit to 0 after the connector reported it;
    the connector then queues a notify-only entry (P frees its blocks), awaits nothing, and
    the request is computed locally."""
    vc = H.vllm_config(kv_role="kv_consumer")
    kcc = H.gemma_like(num_blocks=400)
    s = H.make_scheduler(vc, kcc)
    aux = ZeroingAuxOutput()
    s.aux_output_connector = aux
    calls = count_allocs(s)
    n = 150
    r = H.make_request("d", [1 + i % 900 for i in range(n)],
                       H.C.resolve_kv_cache_block_sizes(kcc, vc)[1],
                       params=H.remote_params("d", kcc, n), max_tokens=2)
    s.add_request(r)
    d = H.Driver(s)
    d.run()
    assert aux.capped and aux.capped[0] > 0
    assert calls == [("d", 0)]
    recvs = [m.reqs_to_recv["d"] for m in d.metas if "d" in m.reqs_to_recv]
    assert len(recvs) == 1
    assert not recvs[0].awaiting and recvs[0].num_external_tokens == 0
    assert all(len(g) == 0 for g in recvs[0].local_block_ids)
    assert not d.conn.awaiting() and not d.conn._local_tokens
    assert r.num_computed_tokens >= n
    H.assert_no_leak(s)
