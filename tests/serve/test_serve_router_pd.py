"""The KV-aware router in P/D mode over real ``vllm serve``: one prefill engine ``p``
(HmaNixlConnector ``kv_producer``), two decode engines ``d1``, ``d2`` (``kv_consumer``, pull),
all with ZMQ KV events on, docs/examples/kv_router.py (``--prefill p --engine d1 --engine
d2``) in front, everything over HTTP on loopback. The engines start once for the module.

What a P/D decode engine reports (vLLM 0.32): its ``usage.prompt_tokens_details.
cached_tokens`` is NOT its own hit. The prefill engine's scheduler puts its own cached tokens
into the ``kv_transfer_params`` it returns (``remote_prefill_cached_tokens``, when they carry
``do_remote_prefill``, as hmacore's do), and the decode engine's output processor reports that
number instead (vllm/v1/engine/output_processor.py). The decode engine's own split is in its
``/metrics``: ``vllm:prompt_tokens_by_source{source=...}``, from the scheduler's prefill stats,
``local_cache_hit`` (its prefix cache: what the router predicts for it), ``external_kv_transfer``
(tokens loaded from the prefill engine) and ``local_compute``.

The reference tokens are ``p``'s own (a plain request: no transfer, greedy, float32), taken
before the flow; ``p``'s prefix cache is then reset, so the flow starts with nothing cached.

1. prompts of several lengths (inside and past the 64-token window) and a streamed one
   (with ``min_tokens``) through the router: the single engine's tokens; prefilled by ``p``
   with hit 0 (nothing cached), decoded by ``d1`` (a tie: first engine), which loaded the
   whole prompt;
2. ``d2`` computes a prompt itself (the router learns it from ``d2``'s events only); a prompt
   continuing it goes to ``d2``, whose local hit (metrics) equals the router's prediction
   and whose loaded tokens are the rest; a prompt ``d1`` holds (loaded from ``p`` in 1) goes
   back to ``d1`` the same way;
3. that repeated prompt: the router's predicted prefill hit equals ``p``'s cached tokens
   (its metrics, and the decode answer's ``cached_tokens``);
4. ``p`` stopped: the prefill leg fails, the router answers ``x-pd-path: decode-only``, the
   decode engine computes the prompt (nothing loaded) and gives the single engine's tokens.
"""
from __future__ import annotations

import json
import sys
import time
import urllib.request
import zlib

import pytest

from hmacore.demo.engine_driver import make_prompts
from hmacore.demo.tiny_model import write_tiny_model
from ports import free_port, free_ports
from serve_harness import (ROOT, Server, post_json, router_score, scrape, vllm_serve,
                           wait_router_score)

WAIT = 120.0
MAX_TOKENS = 12
BS = 32                  # serve_harness's --block-size
LAYOUT = {"groups": [{"kind": "sliding_window", "block_size": BS, "sliding_window": 64},
                     {"kind": "full", "block_size": BS}]}      # vLLM's order for the tiny gemma2
CONNECTOR = {"kv_connector": "HmaNixlConnector",
             "kv_connector_module_path": "hmacore.integrations.vllm"}
# p on one core, the decode engines on the other (a P/D pair on one core stalls its reads)
CPU = {"p": "0", "d1": "1", "d2": "1"}

_P = make_prompts([37, 100, 150, 200, 170, 230, 150, 120], seed=zlib.crc32(b"router-pd"))
ROUND = _P[:4]                       # 1. non-streamed
STREAMED = _P[4]                     # 1. streamed
Q1 = _P[5]                           # 2. computed by d2 alone
Q2 = Q1 + _P[6]                      # 2. continues Q1
FAILED = _P[7]                       # 4. after p is stopped
REFERENCE = [*ROUND, STREAMED, Q2, FAILED]




def request(prompt: list[int], **kw) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True, **kw}


def routed(url: str, prompt: list[int], stream: bool = False,
           **kw) -> tuple[dict, list[int], dict]:
    """(headers, token ids, usage) of one request through the router."""
    if not stream:
        headers, out = post_json(url + "/v1/completions", request(prompt, **kw))
        return headers, out["choices"][0]["token_ids"], out["usage"]
    req = urllib.request.Request(url + "/v1/completions", json.dumps(request(
        prompt, stream=True, stream_options={"include_usage": True}, **kw)).encode(),
        {"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=300) as r:
        headers = dict(r.headers)
        events = [json.loads(line[5:]) for line in r.read().decode().splitlines()
                  if line.startswith("data:") and "[DONE]" not in line]
    ids = [t for e in events for c in e["choices"] for t in c.get("token_ids") or []]
    assert len(events) > 2, events           # passed through as events, not one answer
    return headers, ids, events[-1]["usage"]






def sources(server: Server) -> dict[str, float]:
    """The engine's ``vllm:prompt_tokens_by_source`` counters by source."""
    out = {"local_compute": 0.0, "local_cache_hit": 0.0, "external_kv_transfer": 0.0}
    for k, v in scrape(server.url).items():
        if k.startswith("vllm:prompt_tokens_by_source_total{"):
            for src in out:
                if f'source="{src}"' in k:
                    out[src] += v
    return out


class Split:
    """Moves of one engine's prompt-token sources over some requests."""

    def __init__(self, server: Server) -> None:
        self.server, self.before = server, sources(server)

    def moved(self, prompt_tokens: int) -> dict[str, int]:
        """Waits (bounded) until ``prompt_tokens`` more prompt tokens are accounted (vLLM
        records an output's stats after handing it to the request), then the moves."""
        deadline = time.monotonic() + WAIT
        while True:
            now = sources(self.server)
            d = {k: int(now[k] - self.before[k]) for k in now}
            if sum(d.values()) >= prompt_tokens or time.monotonic() > deadline:
                return d
            time.sleep(0.2)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    logdir = tmp_path_factory.mktemp("router-pd")
    model = write_tiny_model(logdir / "tiny-gemma2", "gemma2", window=64, seed=0)
    layout = logdir / "layout.json"
    layout.write_text(json.dumps(LAYOUT))
    side = free_ports(3)
    procs: dict[str, Server] = {}
    specs = {}
    try:
        for i, (name, role) in enumerate((("p", "kv_producer"), ("d1", "kv_consumer"),
                                          ("d2", "kv_consumer"))):
            port, ev, rep = free_port(), free_port(), free_port()
            events = {"enable_kv_cache_events": True, "publisher": "zmq",
                      "endpoint": f"tcp://127.0.0.1:{ev}",
                      "replay_endpoint": f"tcp://127.0.0.1:{rep}"}
            ktc = dict(CONNECTOR, kv_role=role, kv_load_failure_policy="recompute",
                       kv_connector_extra_config={"side_channel_port": side + i,
                                                  "kv_lease_duration": 60})
            specs[name] = f"{name}=http://127.0.0.1:{port},{events['endpoint']}," \
                          f"{events['replay_endpoint']}"
            procs[name] = vllm_serve(
                name, model, port, logdir, ktc,
                env={"VLLM_SERVER_DEV_MODE": "1", "PYTHONHASHSEED": "0",
                     "VLLM_CPU_OMP_THREADS_BIND": CPU[name]},
                extra_args=["--kv-events-config", json.dumps(events),
                            "--enable-prompt-tokens-details"])
        rport = free_port()
        procs["router"] = Server(
            "router", [sys.executable, str(ROOT / "docs/examples/kv_router.py"),
                       "--port", str(rport), "--layout", str(layout), "--seed", "0",
                       "--prefill", specs["p"], "--engine", specs["d1"],
                       "--engine", specs["d2"]],
            rport, logdir / "router.log", start_timeout=60.0, listening_is_ready=True)
        for s in procs.values():
            s.wait_ready()
        url = procs["router"].url
        p = procs["p"]
        # the single engine's tokens: p alone, plain requests (no transfer)
        ref = {}
        for q in REFERENCE:
            ref[tuple(q)] = post_json(p.url + "/v1/completions", request(q))[1]["choices"][0][
                "token_ids"]
        # ... then nothing cached anywhere: p's prefix cache reset; its AllBlocksCleared
        # leaves with its next step (a request shorter than a block stores nothing)
        req = urllib.request.Request(p.url + "/reset_prefix_cache", method="POST")
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.status == 200
        post_json(p.url + "/v1/completions", request(FAILED[:10], max_tokens=1))
        for q in REFERENCE:
            s = wait_router_score(url, q, "p", lambda v: v == 0)
            assert s == {"p": 0, "d1": 0, "d2": 0}, s
        yield {"procs": procs, "url": url, "ref": ref}
    finally:
        for s in procs.values():
            s.close()


def test_tokens_through_the_router_equal_a_single_engines(fleet):
    url, ref, procs = fleet["url"], fleet["ref"], fleet["procs"]
    for i, q in enumerate([*ROUND, STREAMED]):
        d1, p = Split(procs["d1"]), Split(procs["p"])
        # the streamed one with min_tokens: the router drops it from the 1-token prefill leg
        # (vLLM refuses min_tokens > max_tokens: the request would go decode-only)
        headers, ids, usage = routed(url, q, stream=q is STREAMED,
                                     **({"min_tokens": MAX_TOKENS} if q is STREAMED else {}))
        assert ids == ref[tuple(q)], f"prompt {i}: tokens differ from the single engine's"
        assert usage["completion_tokens"] == MAX_TOKENS
        # nothing cached anywhere: p prefills it all, d1 (a tie: the first) loads it all
        assert (headers["x-pd-path"], headers["x-prefilled-by"], headers["x-routed-to"]) == \
            ("pull", "p", "d1"), headers
        assert headers["x-prefill-hit"] == headers["x-predicted-hit"] == "0", headers
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0, usage
        assert p.moved(len(q)) == {"local_compute": len(q), "local_cache_hit": 0,
                                   "external_kv_transfer": 0}
        assert d1.moved(len(q)) == {"local_compute": 0, "local_cache_hit": 0,
                                    "external_kv_transfer": len(q)}
        wait_router_score(url, q, "d1", lambda v: v > 0 or len(q) <= BS)


def test_decode_engine_picked_by_its_hit(fleet):
    url, ref, procs = fleet["url"], fleet["ref"], fleet["procs"]
    # d2 computes Q1 itself (a plain request): the router learns it from d2's events only
    post_json(procs["d2"].url + "/v1/completions", request(Q1, max_tokens=2))
    s = wait_router_score(url, Q2, "d2", lambda v: v > 0)
    assert s == {"p": 0, "d1": 0, "d2": 224}, s            # Q1's 7 full blocks
    d2 = Split(procs["d2"])
    headers, ids, usage = routed(url, Q2)
    assert ids == ref[tuple(Q2)]
    assert (headers["x-pd-path"], headers["x-routed-to"], headers["x-predicted-hit"]) == \
        ("pull", "d2", "224"), headers
    # d2's own prefix cache gave the predicted hit; the rest came from p
    assert d2.moved(len(Q2)) == {"local_compute": 0, "local_cache_hit": 224,
                                 "external_kv_transfer": len(Q2) - 224}
    # and the other way: a prompt d1 loaded from p in the first test goes back to d1
    q = ROUND[3]
    s = router_score(url, q)
    assert s["d1"] > 0 and s["d2"] == 0, s
    d1 = Split(procs["d1"])
    headers, ids, usage = routed(url, q)
    assert ids == ref[tuple(q)]
    assert (headers["x-routed-to"], int(headers["x-predicted-hit"])) == ("d1", s["d1"])
    split = d1.moved(len(q))
    assert split["local_cache_hit"] == s["d1"], split
    assert split["external_kv_transfer"] == len(q) - s["d1"], split


def test_prefill_hit_equals_prefill_engines_cached_tokens(fleet):
    url, ref, procs = fleet["url"], fleet["ref"], fleet["procs"]
    q = ROUND[2]            # prefilled by p in the first test: p holds it
    s = router_score(url, q)
    assert s["p"] == 128, s             # 4 full blocks of 150 tokens
    p = Split(procs["p"])
    headers, ids, usage = routed(url, q)
    assert ids == ref[tuple(q)]
    assert headers["x-prefilled-by"] == "p" and headers["x-prefill-hit"] == "128", headers
    assert p.moved(len(q)) == {"local_compute": len(q) - 128, "local_cache_hit": 128,
                               "external_kv_transfer": 0}
    # the decode engine reports p's cached tokens (remote_prefill_cached_tokens)
    assert usage["prompt_tokens_details"]["cached_tokens"] == 128, usage


def test_failed_prefill_leg_decode_computes_the_prompt(fleet):
    url, ref, procs = fleet["url"], fleet["ref"], fleet["procs"]
    procs["p"].close()
    q = FAILED
    s = router_score(url, q)
    assert s == {"p": 0, "d1": 0, "d2": 0}, s
    d1 = Split(procs["d1"])
    headers, ids, usage = routed(url, q)
    assert ids == ref[tuple(q)]
    assert headers["x-pd-path"] == "decode-only" and headers["x-routed-to"] == "d1", headers
    assert "x-prefilled-by" not in headers and "x-prefill-hit" not in headers, headers
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0, usage
    assert d1.moved(len(q)) == {"local_compute": len(q), "local_cache_hit": 0,
                                "external_kv_transfer": 0}
    with urllib.request.urlopen(url + "/router/stats", timeout=30) as r:
        stats = json.loads(r.read())
    for name in ("d1", "d2"):
        st = stats[name]
        assert st["bad_batches"] == 0 and st["bad_frames"] == 0 and st["restarts"] == 0, st
    assert all(procs[n].alive() for n in ("d1", "d2", "router"))


pytestmark = [pytest.mark.nixl, pytest.mark.timeout(1200)]
