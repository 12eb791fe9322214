"""HmaStoreConnector under real ``vllm serve`` (vLLM's default multiprocess engine: API
server, EngineCore and worker in separate processes), driven over HTTP with ``openai``.

The embedded store lives in shared memory (``store_scope`` auto -> shared), so the scheduler
side (EngineCore) sees what the worker saved. Both engines name the same store
(``store_name``), so the second engine reloads what the first one computed.

1. engine A computes the prompts, its local prefix cache is reset (``/reset_prefix_cache``,
   dev mode), the same prompts again load from the store: equal tokens, store hits counted;
2. engine B, started afterwards on the same host, loads the same prompts from the store on
   its first sight of them: equal tokens, store hits counted.
"""
from __future__ import annotations

import os
import urllib.request
import zlib

import pytest

from hmacore.demo.engine_driver import make_prompts
from hmacore.demo.tiny_model import write_tiny_model
from ports import free_port
from serve_harness import complete, scrape, total, vllm_serve

openai = pytest.importorskip("openai")

LENGTHS = [10, 100, 150, 37]     # 10 tokens: less than a block, nothing to load


def store_ktc(name: str) -> dict:
    return {"kv_connector": "HmaStoreConnector",
            "kv_connector_module_path": "hmacore.integrations.vllm", "kv_role": "kv_both",
            "kv_connector_extra_config": {"store_name": name,
                                          "store_capacity_bytes": 64 << 20}}


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
    env = {"VLLM_SERVER_DEV_MODE": "1"}            # /reset_prefix_cache
    a = vllm_serve("store-a", model, free_port(), tmp_path, store_ktc(name), env=env)
    servers = [a]
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

        b = vllm_serve("store-b", model, free_port(), tmp_path, store_ktc(name), env=env)
        servers.append(b)
        b.wait_ready()
        n0 = scrape(b.url)
        other = run(b, prompts)
        n1 = scrape(b.url)
        assert other == first
        assert hits(n0, n1) > 0, "engine B did not load what engine A stored"
        assert a.alive() and b.alive()
    finally:
        for s in servers:
            s.close()
