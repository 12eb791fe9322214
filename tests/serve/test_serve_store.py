"""HmaStoreConnector under real ``vllm serve`` (vLLM's default multiprocess engine: API
server, EngineCore and worker in separate processes), driven over HTTP with ``openai``.

The embedded store lives in shared memory (``store_scope`` auto -> shared), so the scheduler
side (EngineCore) sees what the worker saved. Both engines name the same store
(``store_name``), so the second engine reloads what the first one computed.

1. engine A computes the prompts, its local prefix cache is reset (``/reset_prefix_cache``,
   dev mode), the same prompts again load from the store: equal tokens, store hits counted;
2. engine B, started afterwards on the same host, loads the same prompts from the store on
   its first sight of them: equal tokens, store hits counted.

KV events are on (ZMQ, loopback) and followed by hmacore's subscriber with a store tier: the
shared store's tier events come from each engine's scheduler process (EngineCore) reading the
segment's event log, while the worker process writes. A's tier holds exactly the store's keys
(the test attaches to the segment to count them); B's first events (a resync of a store it
did not fill) hold the same keys, and both tiers score every prompt alike.
"""
from __future__ import annotations

import json
import os
import time
import urllib.request
import zlib

import pytest

from hmacore.demo.engine_driver import make_prompts
from hmacore.demo.tiny_model import write_tiny_model
from ports import free_port
from serve_harness import complete, scrape, total, vllm_serve

from hmacore import RoutingIndex
from hmacore.spec import KVLayout
from hmacore.transport.kv_events import EngineStream, KVEventSubscriber
from hmacore.transport.shared_store import DEFAULT_PAGE_BYTES, SharedStore

openai = pytest.importorskip("openai")

LENGTHS = [10, 100, 150, 37]     # 10 tokens: less than a block, nothing to load
CAPACITY = 64 << 20
WAIT = 120.0                     # seconds events are waited for: a bound, not a speed claim
# the tiny gemma2's KV cache groups in vLLM's order (docs/routing.md, the router example)
LAYOUT = {"groups": [{"kind": "sliding_window", "block_size": 32, "sliding_window": 64},
                     {"kind": "full", "block_size": 32}]}


def store_ktc(name: str) -> dict:
    return {"kv_connector": "HmaStoreConnector",
            "kv_connector_module_path": "hmacore.integrations.vllm", "kv_role": "kv_both",
            "kv_connector_extra_config": {"store_name": name,
                                          "store_capacity_bytes": CAPACITY}}


def events_args(stream: EngineStream) -> list[str]:
    return ["--kv-events-config", json.dumps({
        "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": stream.endpoint,
        "replay_endpoint": stream.replay_endpoint})]


def wait_tier(tier: RoutingIndex, key, want: int) -> int:
    """The tier's resident keys of engine ``key`` once they reach ``want`` (bounded)."""
    deadline = time.monotonic() + WAIT
    while tier.resident_blocks(key) != want and time.monotonic() < deadline:
        time.sleep(0.2)
    return tier.resident_blocks(key)


def run(server, prompts) -> list[list[int]]:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0,
                           timeout=300)
    return [complete(client, p) for p in prompts]


def hits(before: dict, after: dict) -> float:
    return total(after, "vllm:hma_store_hit_tokens_total") - \
        total(before, "vllm:hma_store_hit_tokens_total")


def test_store_reloads_in_the_same_engine_and_across_engines(tmp_path):
    model = write_tiny_model(tmp_path / "tiny-gemma2", "gemma2", window=64, seed=0)
    prompts = make_prompts(LENGTHS, seed=zlib.crc32(b"serve-store"))
    name = f"hmserve{os.getpid()}"
    env = {"VLLM_SERVER_DEV_MODE": "1", "PYTHONHASHSEED": "0"}     # /reset_prefix_cache
    streams = [EngineStream(e, f"tcp://127.0.0.1:{free_port()}",
                            f"tcp://127.0.0.1:{free_port()}") for e in ("a", "b")]
    layout = KVLayout.from_dict(LAYOUT)
    tier = RoutingIndex(layout, seed="0")
    sub = KVEventSubscriber(RoutingIndex(layout, seed="0"), streams, tier_index=tier)
    sub.start()
    a = vllm_serve("store-a", model, free_port(), tmp_path, store_ktc(name), env=env,
                   extra_args=events_args(streams[0]))
    servers = [a]
    store = None
    try:
        a.wait_ready()
        m0 = scrape(a.url)
        first = run(a, prompts)
        m1 = scrape(a.url)
        assert total(m1, "vllm:hma_store_keys_written_total") > \
            total(m0, "vllm:hma_store_keys_written_total")
        req = urllib.request.Request(a.url + "/reset_prefix_cache", method="POST")
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.status == 200
        again = run(a, prompts)
        m2 = scrape(a.url)
        assert again == first
        assert hits(m1, m2) > 0, "engine A did not reload from its store"
        # A's store tier, from its EngineCore reading the segment's log: the store's keys
        store = SharedStore(name, CAPACITY, DEFAULT_PAGE_BYTES)      # attach, to count
        assert not store.created and len(store) > 0
        assert wait_tier(tier, ("a", 0), len(store)) == len(store)

        b = vllm_serve("store-b", model, free_port(), tmp_path, store_ktc(name), env=env,
                       extra_args=events_args(streams[1]))
        servers.append(b)
        b.wait_ready()
        n0 = scrape(b.url)
        other = run(b, prompts)
        n1 = scrape(b.url)
        assert other == first
        assert hits(n0, n1) > 0, "engine B did not load what engine A stored"
        # B saved nothing new (every key was there): its tier is its first read of the store
        assert wait_tier(tier, ("b", 0), len(store)) == len(store)
        assert tier.resident_blocks(("a", 0)) == len(store)
        scores = [tier.query(p).hits for p in prompts]
        assert all(h[("a", 0)] == h[("b", 0)] for h in scores), scores
        assert max(h[("a", 0)] for h in scores) > 0, scores
        st = sub.stats()
        assert all(x.bad_batches == 0 and x.bad_frames == 0 and x.resets == 0
                   for x in st.values()), st
        assert st[("a", 0)].tier_rows > 0 and st[("b", 0)].tier_rows > 0, st
        assert a.alive() and b.alive()
    finally:
        for s in servers:
            s.close()
        sub.close()
        if store is not None:
            store.close()
