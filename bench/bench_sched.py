"""hmacore's connector bookkeeping for one decode step next to vLLM 0.32.0's own scheduler step,
same step, same process: the "< 2% of vLLM's scheduler step" target.

vLLM: the real v1 ``Scheduler`` (built by tests/vllm/harness.py on CPU, no model, no connector)
over the five-group DeepSeek-V4-like KV cache config, 256 running requests in decode; one step
is ``schedule()`` + ``update_from_output()`` with one sampled token per request.
hmacore: what a connector does with that step's ``SchedulerOutput``: ``TrackerSet.apply_step_lists``
(every request's ``new_block_ids`` flattened in one C pass + ``apply_step_flat``), then
``clip_tracked_spans`` (the window each request would transfer). The tracker is checked equal to
vLLM's own KV cache manager tables (clipped) before timing. Reported as one case: ratio =
vLLM step / hmacore bookkeeping; the fraction is its inverse (``fraction_of_vllm_step``).
"""
from __future__ import annotations

import gc
import os
import sys

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tests", "vllm"))

import harness as H  # noqa: E402

from hmacore.integrations.vllm.layout import layout_from_kv_cache_config  # noqa: E402
from hmacore.tables import TrackerSet  # noqa: E402
from hmacore.windows import clip_tracked_spans  # noqa: E402

NUM_REQS = 256
PROMPT = 512


def bookkeeping(ts, so, G):
    cached = so.scheduled_cached_reqs
    ts.apply_step_lists(cached.req_ids, cached.new_block_ids)
    return clip_tracked_spans(ts, cached.req_ids)


class Engine:
    """A real vLLM scheduler in steady decode with NUM_REQS running requests, and hmacore's
    tracker following it."""

    def __init__(self):
        vc = H.vllm_config(connector=False, max_num_batched_tokens=8192)
        vc.scheduler_config.max_num_seqs = NUM_REQS
        kcc = H.dsv4_like(num_blocks=120000)
        self.s = s = H.make_scheduler(vc, kcc)
        hbs = H.C.resolve_kv_cache_block_sizes(kcc, vc)[1]
        for r in range(NUM_REQS):
            s.add_request(H.make_request(f"r{r}", [1 + (r * 7 + i) % 900 for i in range(PROMPT)],
                                         hbs, max_tokens=3000))
        while len(s.running) < NUM_REQS or any(
                q.num_computed_tokens < q.num_prompt_tokens for q in s.running):
            self.vllm_step()
        self.layout = layout_from_kv_cache_config(kcc, vllm_config=vc)
        self.G = len(kcc.kv_cache_groups)
        self.ts = TrackerSet(self.layout)
        for q in s.running:
            self.ts.add(q.request_id, tuple(s.kv_cache_manager.get_block_ids(q.request_id)))
        self.so = None

    def vllm_step(self):
        so = self.s.schedule()
        self.s.update_from_output(so, H.runner_output(so, self.s))
        self.so = so
        return so

    def step_and_check(self):
        """One vLLM step, hmacore's bookkeeping of it, and hmacore's clipped tables ==
        vLLM's KV cache manager tables, clipped."""
        self.vllm_step()
        assert len(self.so.scheduled_cached_reqs.req_ids) == NUM_REQS
        s, ts = self.s, self.ts
        spans = bookkeeping(ts, self.so, self.G)
        for i, rid in enumerate(self.so.scheduled_cached_reqs.req_ids):
            got = [ts.block_ids(rid, copy=False)[g][spans[i, g, 0]:spans[i, g, 1]].tolist()
                   for g in range(self.G)]
            want = H.oracle_clip(s.kv_cache_manager.get_block_ids(rid), s.kv_cache_config)
            # equal, except positions vLLM freed in place since (null 0 there): appended ids
            # cannot show in-place frees (update_after_alloc merges those, see TrackerSet)
            assert [len(x) for x in got] == [len(x) for x in want]
            assert all(a == b or b == 0 for x, y in zip(got, want) for a, b in zip(x, y))


@pytest.fixture(scope="module")
def engine():
    e = Engine()
    for _ in range(4):          # a few checked steps: tracker == vLLM's tables
        e.step_and_check()
    return e


ROUNDS = 40


def test_sched_vllm(benchmark, engine):
    """vLLM's scheduler step; the tracker catches up on each step untimed (in setup)."""
    benchmark.group = f"sched_step-dsv4-{NUM_REQS}req"
    benchmark.extra_info["impl"] = "vllm"
    pending = []

    def step():
        pending.append(engine.vllm_step())

    def setup():
        while pending:
            bookkeeping(engine.ts, pending.pop(), engine.G)
        gc.collect()
        return (), {}
    benchmark.pedantic(step, setup=setup, rounds=ROUNDS)
    setup()
    engine.step_and_check()


def test_sched_hmacore(benchmark, engine):
    """hmacore's bookkeeping of each step (vLLM produces the step untimed, in setup)."""
    benchmark.group = f"sched_step-dsv4-{NUM_REQS}req"
    benchmark.extra_info["impl"] = "hmacore"
    benchmark.extra_info["requests"] = NUM_REQS
    benchmark.extra_info["groups"] = engine.G

    def setup():
        so = engine.vllm_step()
        gc.collect()
        return (engine.ts, so, engine.G), {}
    benchmark.pedantic(bookkeeping, setup=setup, rounds=ROUNDS)
    engine.step_and_check()
