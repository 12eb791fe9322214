"""The connectors follow vLLM's block tables incrementally (scheduler output only, never
``get_block_ids``): proven against vLLM 0.32's real Scheduler under random traffic with
preemptions, chunked prefill, prefix sharing, sliding windows and align-mode Mamba.

At every step, for every request HmaStoreConnector tracks:
* its followed table equals vLLM's own except where vLLM nulled a block in place (sliding
  window / Mamba only, never full attention) — ``harness.assert_mirror``;
* every StoreSave names exactly vLLM's block ids at the positions it stores (its offsets),
  none of them nulled: the positions a step reads are always current;
* a save carries only the new positions and hash rows (its size does not grow with the
  request).
"""
import os
import random

import numpy as np
import pytest

import harness as H
from test_store_connector import CASES, Instance

from hmacore.integrations.vllm.store.backend import drop_store

pytestmark = pytest.mark.vllm

# the cases of test_store_connector with small pools: gemma preempts; dsv4 (a 600-token
# prompt needs ~250 blocks over its five groups) runs two requests at a time; qwen3next runs
# without preemption (in smaller pools vLLM 0.32 with align-mode Mamba raises
# "Cannot get 1 free blocks" from its block pool; not investigated yet)
POOLS = {"gemma": 48, "dsv4": 520, "qwen3next": 40}


@pytest.mark.parametrize("case", sorted(POOLS))
@pytest.mark.parametrize("seed", [0, 1])
def test_followed_tables_mirror_vllm(case, seed):
    rng = random.Random(seed)
    vkw, _, prompt = CASES[case]
    name = f"mirror-{case}-{seed}-{os.getpid()}"
    CASES[name] = (vkw, lambda: _small(case), prompt)
    inst = Instance(name, {"store_name": name})
    try:
        sched, kcc = inst.s, inst.kcc
        shared = [rng.randrange(1, 900) for _ in range(prompt)]
        for i in range(8):   # some prompts share a prefix (local prefix-cache hits)
            n = rng.randrange(prompt // 4, prompt)
            toks = shared[:n] if i % 2 else [rng.randrange(1, 900) for _ in range(n)]
            sched.add_request(H.make_request(f"r{i}", toks, inst.hbs,
                                             max_tokens=rng.randrange(60, 200)))
        preempted, saves_checked, steps = set(), 0, 0
        conn = sched.connector.scheduler
        while sched.has_unfinished_requests():
            so = sched.schedule()
            meta = so.kv_connector_metadata
            mgr = sched.kv_cache_manager
            # the tracked-lookup path of _follow_step gives iter_scheduled's entries
            some = [r for r in so.num_scheduled_tokens if rng.random() < 0.5] + ["absent"]
            want = sorted((e for e in H.C.iter_scheduled(so) if e[0] in some),
                          key=lambda e: e[0])
            got = sorted(H.C.scheduled_entries(so, some), key=lambda e: e[0])
            assert got == want, steps
            for rid in so.num_scheduled_tokens:
                if rid in conn.trackers:
                    H.assert_mirror(conn.trackers.block_ids(rid), mgr.get_block_ids(rid), kcc,
                                    (rid, steps))
            for rid, sv in meta.saves.items():
                table = mgr.get_block_ids(rid)
                for g, (ids, off) in enumerate(zip(sv.block_ids, sv.block_offsets)):
                    assert ids.dtype == np.int32, ids.dtype     # no Python int per block
                    assert ids.tolist() == list(table[g][off:off + len(ids)]), (rid, g, steps)
                    bs = kcc.kv_cache_groups[g].kv_cache_spec.block_size
                    assert off >= sv.start_token // bs - 1 or not len(ids), (rid, g, off)
                    assert len(ids) <= sv.num_tokens // bs - sv.start_token // bs + 1
                saves_checked += 1
            preempted |= set(so.preempted_req_ids or ())
            w = inst.w
            w.bind_connector_metadata(meta)
            w.start_load_kv(None)
            w.wait_for_save()
            r = w.get_transfer_results(so.finished_req_ids)
            w.clear_connector_metadata()
            sched.update_from_output(so, H.runner_output(
                so, sched, finished_recving=r.finished_recving, failed_recving=r.failed_recving))
            steps += 1
            assert steps < 1500
        H.assert_no_leak(sched)
        assert len(conn.trackers) == 0
        assert saves_checked > 0
        assert preempted or case != "gemma", "the pool was meant to force a preemption"
    finally:
        CASES.pop(name, None)
        inst.close()
        drop_store(name)


def _small(case):
    n = POOLS[case]
    return {"gemma": lambda: H.gemma_like(num_blocks=n),
            "dsv4": lambda: H.dsv4_like(num_blocks=n),
            "qwen3next": lambda: H.qwen3_next_like(num_blocks=n)}[case]()
