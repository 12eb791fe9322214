"""P/D push (layer-wise, decode first) under real ``vllm serve``: a prefill server and a
decode server with ``transfer_mode: push``, the example proxy in push mode
(``--mode push --prefill-side-channel``), concurrent requests through the ``openai`` client.

Greedy tokens equal a single server's; every request's KV was pushed (decode's
``vllm:hma_loads_total`` moves by one per request, no failure); the proxy's ``/health`` sees
both servers.
"""
from __future__ import annotations

import json
import urllib.request
import zlib

import pytest

from hmacore.demo.engine_driver import make_prompts
from hmacore.demo.tiny_model import write_tiny_model
from ports import free_port
from serve_harness import complete, proxy, scrape, total, vllm_serve
from test_serve_pd_pull import CPU, check_tokens, run_concurrent

openai = pytest.importorskip("openai")

LENGTHS = [10, 100, 150, 37, 70, 129]
CONNECTOR = {"kv_connector": "HmaNixlConnector",
             "kv_connector_module_path": "hmacore.integrations.vllm"}


def test_push_concurrent_tokens_equal_and_loads_counted(tmp_path):
    model = write_tiny_model(tmp_path / "tiny-gemma2", "gemma2", window=64, seed=0)
    prompts = make_prompts(LENGTHS, seed=zlib.crc32(b"serve-push"))
    side = free_port()
    push = {"transfer_mode": "push", "push_register_timeout": 120, "push_recv_timeout": 240}
    servers = {
        "single": vllm_serve("single", model, free_port(), tmp_path, None, env=CPU["d"]),
        "p": vllm_serve("p", model, free_port(), tmp_path, dict(
            CONNECTOR, kv_role="kv_producer",
            kv_connector_extra_config=dict(push, side_channel_port=side)), env=CPU["p"]),
        "d": vllm_serve("d", model, free_port(), tmp_path, dict(
            CONNECTOR, kv_role="kv_consumer", kv_load_failure_policy="recompute",
            kv_connector_extra_config=dict(push, side_channel_port=free_port())),
            env=CPU["d"]),
    }
    try:
        for s in servers.values():
            s.wait_ready()
        single = openai.OpenAI(base_url=servers["single"].url + "/v1", api_key="x",
                               max_retries=0, timeout=300)
        ref = [complete(single, p) for p in prompts]
        servers["single"].close()
        px = servers["proxy"] = proxy("proxy", free_port(), tmp_path, servers["p"].url,
                                      servers["d"].url,
                                      ["--mode", "push", "--prefill-side-channel",
                                       f"127.0.0.1:{side}"])
        px.wait_ready()
        with urllib.request.urlopen(px.url + "/health", timeout=60) as r:
            assert r.status == 200, r.read()
        before = scrape(servers["d"].url)
        client = openai.OpenAI(base_url=px.url + "/v1", api_key="x", max_retries=0,
                               timeout=600)
        got = run_concurrent(client, prompts)
        after = scrape(servers["d"].url)
    finally:
        for s in servers.values():
            s.close()
    check_tokens(got, ref)

    def moved(name: str) -> float:
        return total(after, name) - total(before, name)

    assert moved("vllm:hma_loads_total") == len(LENGTHS), json.dumps(
        {k: v for k, v in after.items() if k.startswith("vllm:hma")})
    assert moved("vllm:hma_transfer_failures_total") == 0
