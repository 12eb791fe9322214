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
