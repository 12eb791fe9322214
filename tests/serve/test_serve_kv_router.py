"""KV-aware routing over real ``vllm serve``: two engines with ZMQ KV events on, the example
router (docs/examples/kv_router.py) in front, all over HTTP on loopback.

1. a prompt goes to engine a (nothing cached anywhere: the tie goes to the first engine);
   repeated, it goes to a again, and a's reported cached tokens
   (``usage.prompt_tokens_details.cached_tokens``) equal the router's predicted hit;
2. a prompt sent to engine b directly (the router learns it from b's events only), then a
   prompt continuing it (its 224-token prefix shared) through the router: routed to b,
   cached tokens equal the prediction; a streamed request is passed through, routed the same
   way;
3. ``/reset_prefix_cache`` on b (dev mode), then any request on b (vLLM publishes a step's
   events after the step, so an idle engine's ``AllBlocksCleared`` leaves with its next
   request): b's ``AllBlocksCleared`` empties it in the index, the same prompt falls back
   (predicted 0, routed by load/order, nothing cached).
"""
from __future__ import annotations

import json
import sys
import urllib.request
import zlib

import pytest

from hmacore.demo.engine_driver import make_prompts
from hmacore.demo.tiny_model import write_tiny_model
from ports import free_port
from serve_harness import ROOT, Server, post_json, router_score, vllm_serve, wait_router_score

BS = 32                  # serve_harness's --block-size
# the tiny gemma2's KV cache groups as vLLM orders them: its first layer slides, so the
# sliding-window group is group 0 (the router checks every BlockStored's kv_cache_spec_kind
# against this; the opposite order is refused batch by batch, see docs/routing.md)
LAYOUT = {"groups": [{"kind": "sliding_window", "block_size": BS, "sliding_window": 64},
                     {"kind": "full", "block_size": BS}]}




def complete(url: str, prompt: list[int]) -> tuple[str, int, int]:
    """(engine it went to, predicted hit, engine's cached tokens) of one routed request."""
    headers, out = post_json(url + "/v1/completions", {
        "model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0.0,
        "ignore_eos": True})
    cached = out["usage"]["prompt_tokens_details"]["cached_tokens"]
    return headers["x-routed-to"], int(headers["x-predicted-hit"]), int(cached)






def test_router_sends_prompts_to_the_engine_holding_their_prefix(tmp_path):
    model = write_tiny_model(tmp_path / "tiny-gemma2", "gemma2", window=64, seed=0)
    layout = tmp_path / "layout.json"
    layout.write_text(json.dumps(LAYOUT))
    env = {"VLLM_SERVER_DEV_MODE": "1", "PYTHONHASHSEED": "0"}
    servers: list[Server] = []
    specs = {}
    try:
        for name in ("a", "b"):
            port, ev, rep = free_port(), free_port(), free_port()
            cfg = {"enable_kv_cache_events": True, "publisher": "zmq",
                   "endpoint": f"tcp://127.0.0.1:{ev}", "replay_endpoint": f"tcp://127.0.0.1:{rep}"}
            specs[name] = f"{name}=http://127.0.0.1:{port},{cfg['endpoint']},{cfg['replay_endpoint']}"
            servers.append(vllm_serve(f"route-{name}", model, port, tmp_path, None, env=env,
                                      extra_args=["--kv-events-config", json.dumps(cfg),
                                                  "--enable-prompt-tokens-details"]))
        a, b = servers
        rport = free_port()
        router = Server("router", [sys.executable, str(ROOT / "docs/examples/kv_router.py"),
                                   "--port", str(rport), "--layout", str(layout), "--seed", "0",
                                   "--engine", specs["a"], "--engine", specs["b"]],
                        rport, tmp_path / "router.log", start_timeout=60.0,
                        listening_is_ready=True)
        servers.append(router)
        for s in servers:
            s.wait_ready()
        url = router.url
        p1, q1, fresh = make_prompts([200, 230, 150], seed=zlib.crc32(b"kv-router"))

        # 1. a repeated prompt: first to a (tie), then to a with the predicted hit cached
        assert complete(url, p1) == ("a", 0, 0)
        s = wait_router_score(url, p1, "a", lambda v: v > 0)
        assert s["a"] == 192 and s["b"] == 0, s         # 6 full blocks (capped at 199)
        assert complete(url, p1) == ("a", 192, 192)

        # 2. b learns q1 from its own traffic; q2 continues q1 (a second turn): it goes to b.
        # (A prompt sharing only q1's first blocks would hit nowhere: the sliding-window
        # group keeps the blocks of the window at q1's end only, and the index knows it.)
        post_json(b.url + "/v1/completions", {"model": "tiny", "prompt": q1, "max_tokens": 2})
        q2 = q1 + fresh
        s = wait_router_score(url, q2, "b", lambda v: v > 0)
        assert s["a"] == 0 and s["b"] == 224, s         # q1's 7 full blocks
        assert complete(url, q2) == ("b", 224, 224)
        assert router_score(url, q1[:160] + fresh)["b"] == 0   # see above
        # streamed, passed through as it arrives; q2 now fully on b
        s = wait_router_score(url, q2, "b", lambda v: v > 224)
        req = urllib.request.Request(url + "/v1/completions", json.dumps({
            "model": "tiny", "prompt": q2, "max_tokens": 4, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}).encode(),
            {"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(req, timeout=300) as r:
            assert r.headers["x-routed-to"] == "b"
            predicted = int(r.headers["x-predicted-hit"])
            events = [json.loads(line[5:]) for line in r.read().decode().splitlines()
                      if line.startswith("data:") and "[DONE]" not in line]
        assert predicted == s["b"] == 352, s            # q2's 11 full blocks
        assert any(c.get("finish_reason") for e in events for c in e["choices"]), events
        usage = events[-1]["usage"]
        assert usage["completion_tokens"] == 4, events
        assert usage["prompt_tokens_details"]["cached_tokens"] == predicted

        # 3. b's prefix cache reset: the index drops b, q2 falls back to a (tie, order)
        req = urllib.request.Request(b.url + "/reset_prefix_cache", method="POST")
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.status == 200
        # vLLM publishes a step's events after the step: an idle engine's AllBlocksCleared
        # leaves with its next request (10 tokens: less than a block, nothing stored)
        post_json(b.url + "/v1/completions", {"model": "tiny", "prompt": fresh[:10], "max_tokens": 1})
        s = wait_router_score(url, q2, "b", lambda v: v == 0)
        assert s == {"a": 0, "b": 0}, s
        assert complete(url, q2) == ("a", 0, 0)

        with urllib.request.urlopen(url + "/router/stats", timeout=30) as r:
            stats = json.loads(r.read())
        for name in ("a", "b"):
            st = stats[name]
            assert st["bad_batches"] == 0 and st["bad_frames"] == 0 and st["restarts"] == 0, st
        assert stats["b"]["cleared"] == 1
        assert all(s.alive() for s in servers)
    finally:
        for s in servers:
            s.close()


pytestmark = pytest.mark.timeout(900)
