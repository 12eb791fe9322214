"""Real Mooncake store (master on 127.0.0.1 inside unshare -n, two client processes)."""
from __future__ import annotations

import pytest

from netns import run_scenario

pytestmark = [pytest.mark.mooncake, pytest.mark.timeout(400)]


def test_hybrid_request_round_trip_over_tcp():
    r = run_scenario("roundtrip", port=50051)
    saver, loader = r["saver"], r["loader"]
    assert saver["failed"] == 0 and not saver["no_space"] and saver["written"] > 0
    assert saver["regions"] == 5 * 2                 # each group's own 2 layers, nothing shared
    assert loader["hit"] == 3 * 256                  # DSv4: every hybrid hit is 256-aligned
    assert loader["loaded"] is True
    assert loader["compared"] > 0 and loader["mismatched"] == 0
    assert loader["partial_hit"] == 256              # shares only the first 256 tokens
    assert loader["exists_calls"] == 2               # one batch_is_exist per lookup


def test_master_killed_gives_misses_not_errors():
    r = run_scenario("master_killed", port=50061)
    assert r["written"] > 0 and r["before"] == 3 * 256
    assert r["after"] == 0                           # a miss, never a stale or wrong hit
    assert r["lookup_s"] < 30 and r["save_s"] < 30
    assert r["save_written"] == 0 and r["save_failed"] > 0
    assert r["empty_ok"] is True


def test_adjacent_buffers_reach_mooncake_as_one():
    """Block-major pages: a key's per-layer buffers abut and are posted as one buffer; the
    value round-trips byte for byte."""
    r = run_scenario("runs", port=50101)
    assert r["put"] == [0] * 6 and r["got"] == [2 * 256] * 6, r
    assert r["same"] is True
    assert r["buffers"] == {"given": 2 * 6 * 2, "posted": 6 * 2}   # put + get, 2 layers each


def test_demo_store_path_against_a_real_master():
    r = run_scenario("demo", port=50071)
    assert r["returncode"] == 0, r
    assert r["store"] == "mooncake"
    for req in r["requests"]:
        assert req["hit_tokens"] == (req["tokens"] - 1) // 256 * 256   # DSv4: 256-aligned
        assert req["keys_written"] > 0
    assert r["verification"]["ok"] and r["verification"]["pages_checked"] > 0


@pytest.mark.vllm
@pytest.mark.parametrize("case,port,hit", [("gemma", 50081, 144), ("dsv4", 50091, 512)])
def test_store_connector_across_processes(case, port, hit):
    """HmaStoreConnector with "store": "mooncake": two vLLM instances in two processes."""
    r = run_scenario(f"connector-{case}", port=port)
    saver, loader = r["saver"], r["loader"]
    assert saver.get("failed") == 0 and saver.get("saved", 0) >= hit, r
    # the store tier's KV events: one stored hash per key put, and the hit a RoutingIndex
    # computes from them equals the connector's own lookup through the master
    assert saver["events_stored"] == saver["keys_written"] > 0, r
    assert saver["events_medium"] == ["HMACORE_STORE"], r
    assert saver["index_hit"] == saver["lookup_hit"] == hit, r
    assert loader.get("hit") == hit, r
    assert loader["compared"] > 0 and loader["mismatched"] == 0
    assert loader["miss"] == 0 and loader["leak_free"] is True


@pytest.mark.vllm
@pytest.mark.parametrize("case,fault,port,restart,hit", [
    # full (one group, 16), gemma (full 16 + sliding 16/window 64) and qwen3next (full 64 +
    # Mamba); the hit is 144 / 144 / 192 tokens
    ("full", "0.5", 50111, 80, 144),      # one group: told by block ids, restarts at block 5
    ("gemma", "1.8", 50101, 128, 144),    # the last sliding block: 128 is intact in both groups
    ("qwen3next", "1.2", 50121, 0, 192),  # the Mamba state: no other state was saved
])
def test_store_connector_key_removed_between_lookup_and_load(case, fault, port, restart, hit):
    """A real master loses one key between the scheduler's lookup and the worker's load.
    One group: the block ids are reported and vLLM restarts the request at the safe point.
    Several groups: the request is reported per request, vLLM restarts it, and the fresh
    lookup loads exactly the prefix intact in every group. Its recompute puts the removed
    key back (and writes nothing else): a new lookup hits the whole prefix again."""
    r = run_scenario(f"connector-partial-{case}-{fault}", port=port)
    saver, loader = r["saver"], r["loader"]
    assert saver.get("failed") == 0, r
    assert loader.get("removed") == 1 and loader["restart"] == restart, r
    if case == "full":
        assert loader["per_request"] is False and len(loader["invalid"]) == 1, r
    else:
        assert loader["per_request"] is True and loader["invalid"] == [], r
    assert loader["prefill"] == loader["n"] - restart, r
    assert loader["status"] == "FINISHED_LENGTH_CAPPED", r
    assert loader["resaved"] is True and loader["written"] == 1, r
    assert loader["again_hit"] == hit, r
