"""docs/examples/pd_proxy.py against stand-in HTTP engines on 127.0.0.1 (aiohttp servers in this
process that record what they receive): pull and push legs, decode-only fallback when the
prefill leg fails or the decode leg fails before any output, client disconnects cancelling
the upstream requests, streaming passed through as it arrives, /health, /v1/models, the CLI.
The real engines behind it are tested in tests/engine (push with a dead prefill engine:
test_push_peer_loss.py) and by the `vllm serve` harness (tests/serve)."""
from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("pd_proxy", ROOT / "docs" / "examples" / "pd_proxy.py")
pd_proxy = importlib.util.module_from_spec(_spec)
sys.modules["pd_proxy"] = pd_proxy
_spec.loader.exec_module(pd_proxy)

BOUND = 20.0      # seconds: every wait below is bounded by this (never a timed assertion)
PARAMS = {"do_remote_prefill": True, "do_remote_decode": False,
          "remote_block_ids": [[0, 7, 8], [4, 5, 6]], "remote_engine_id": "p0",
          "remote_request_id": "r1", "remote_host": "127.0.0.1", "remote_port": 5600}
BODY = {"model": "m", "prompt": "hello", "max_tokens": 32, "temperature": 0}

Handler = Callable[[web.Request, dict], Awaitable[web.StreamResponse]]


class FakeEngine:
    """A stand-in ``vllm serve``: POST /v1/completions and /v1/chat/completions go to
    ``handler(request, body)``; every body is recorded in ``seen``; a handler cancelled by
    its client's disconnect is counted in ``cancelled`` (and sets ``cancel_event``)."""

    def __init__(self, handler: Handler, healthy: bool = True) -> None:
        self.handler, self.healthy = handler, healthy
        self.seen: list[tuple[str, dict]] = []
        self.cancelled = 0
        self.cancel_event = asyncio.Event()
        self.arrived = asyncio.Event()
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def _post(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append((request.path, body))
        self.arrived.set()
        try:
            return await self.handler(request, body)
        except asyncio.CancelledError:
            self.cancelled += 1
            self.cancel_event.set()
            raise

    async def _health(self, _request: web.Request) -> web.Response:
        return web.Response(status=200 if self.healthy else 503)

    async def _models(self, _request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m"}]})

    async def start(self) -> FakeEngine:
        app = web.Application()
        for p in pd_proxy.PATHS:
            app.router.add_post(p, self._post)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


def json_answer(obj: dict, status: int = 200) -> Handler:
    async def h(_request, _body):
        return web.json_response(obj, status=status)
    return h


def dead_url() -> str:
    """A loopback URL nothing listens on (the port is bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def sse(*events: dict | str) -> list[bytes]:
    return [f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events]


def stream_answer(events: list[bytes], gate: asyncio.Event | None = None) -> Handler:
    """Stream ``events``; with ``gate``, the first event goes out, the rest once it is set."""
    async def h(request, _body):
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for i, e in enumerate(events):
            await out.write(e)
            if i == 0 and gate is not None:
                await asyncio.wait_for(gate.wait(), BOUND)
        await out.write_eof()
        return out
    return h


def decode_by_params(with_params: Handler, without: Handler) -> Handler:
    """A decode engine answering transfer requests with one handler, plain ones with another."""
    async def h(request, body):
        return await (with_params if "kv_transfer_params" in body else without)(request, body)
    return h


async def proxy_for(p: FakeEngine | str, d: FakeEngine, mode: str = "pull", **kw):
    purl = p if isinstance(p, str) else p.url
    config = pd_proxy.ProxyConfig(purl, d.url, mode, side_channel=("10.0.0.1", 5601)
                                  if mode == "push" else None, timeout=BOUND, **kw)
    runner, port = await pd_proxy.start_server(config)
    return runner, f"http://127.0.0.1:{port}"


async def post(url: str, body: dict, path: str = "/v1/completions"):
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=BOUND)) as s:
        async with s.post(url + path, json=body) as r:
            return r.status, r.headers.get("x-pd-path"), await r.read()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 3 * BOUND))


async def with_stack(p_handler: Handler | None, d_handler: Handler, test, mode: str = "pull"):
    """Start engines and proxy, run ``test(p, d, url)``, stop everything."""
    p = await FakeEngine(p_handler).start() if p_handler is not None else None
    d = await FakeEngine(d_handler).start()
    runner, url = await proxy_for(p if p is not None else dead_url(), d, mode)
    try:
        return await test(p, d, url)
    finally:
        await runner.cleanup()
        for e in (p, d):
            if e is not None:
                await e.stop()


OK_DECODED = json_answer({"choices": [{"text": "decoded"}]})
OK_PLAIN = json_answer({"choices": [{"text": "plain"}]})


# -- pull ----------------------------------------------------------------------------------
def test_pull_forwards_kv_transfer_params():
    async def t(p, d, url):
        code, path, out = await post(url, BODY)
        assert (code, path, json.loads(out)) == (200, "pull", {"choices": [{"text": "decoded"}]})
        (p_path, p_body), = p.seen
        assert p_path == "/v1/completions" and p_body["max_tokens"] == 1
        assert p_body["stream"] is False
        assert p_body["kv_transfer_params"] == {"do_remote_decode": True}
        (_, d_body), = d.seen
        assert d_body == dict(BODY, kv_transfer_params=PARAMS)   # original request + P's
    run(with_stack(json_answer({"choices": [{"text": "x"}], "kv_transfer_params": PARAMS}),
                   OK_DECODED, t))


def test_pull_chat_path_and_max_completion_tokens():
    async def t(p, d, url):
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                "max_completion_tokens": 8, "stream_options": {"include_usage": True}}
        code, path, _ = await post(url, body, "/v1/chat/completions")
        assert (code, path) == (200, "pull")
        (p_path, p_body), = p.seen
        assert p_path == "/v1/chat/completions" and p_body["max_tokens"] == 1
        assert "max_completion_tokens" not in p_body and "stream_options" not in p_body
        assert d.seen[0][1]["max_completion_tokens"] == 8
    run(with_stack(json_answer({"kv_transfer_params": PARAMS}), OK_DECODED, t))


@pytest.mark.parametrize("prefill", ["no-params", "http-500", "down"])
def test_pull_prefill_failure_falls_back_to_decode_only(prefill, caplog):
    handler = {"no-params": json_answer({"choices": []}),
               "http-500": json_answer({"error": "boom"}, status=500), "down": None}[prefill]

    async def t(p, d, url):
        code, path, out = await post(url, dict(BODY, kv_transfer_params={"x": 1}))
        assert (code, path, json.loads(out)) == (200, "decode-only",
                                                 {"choices": [{"text": "plain"}]})
        (_, d_body), = d.seen
        assert d_body == BODY                  # no kv_transfer_params: D computes the prompt
    with caplog.at_level("WARNING", logger="pd_proxy"):
        run(with_stack(handler, decode_by_params(OK_DECODED, OK_PLAIN), t))
    if prefill == "no-params":                 # the hint names both modes
        assert "pull mode" in caplog.text and "--mode push" in caplog.text


@pytest.mark.parametrize("stream", [False, True])
def test_pull_decode_failure_before_output_retries_decode_only(stream):
    """vLLM's ``fail`` policy: a failed load answers 500 (or an error event in a stream)."""
    failed = sse({"error": {"message": "Internal server error", "code": 500}}, "[DONE]") \
        if stream else None

    async def t(p, d, url):
        code, path, out = await post(url, dict(BODY, stream=stream))
        assert (code, path) == (200, "decode-only")
        if stream:
            assert out == b"".join(sse({"choices": [{"text": "plain"}]}, "[DONE]"))
        assert [("kv_transfer_params" in b) for _, b in d.seen] == [True, False]
    run(with_stack(json_answer({"kv_transfer_params": PARAMS}),
                   decode_by_params(stream_answer(failed) if stream else
                                    json_answer({"error": "x"}, status=500),
                                    stream_answer(sse({"choices": [{"text": "plain"}]},
                                                      "[DONE]")) if stream else OK_PLAIN), t))


def test_decode_client_error_is_passed_through():
    async def t(p, d, url):
        code, path, out = await post(url, BODY)
        assert (code, path, json.loads(out)) == (400, "pull", {"error": "bad"})
        assert len(d.seen) == 1                  # a 4xx is the client's: no retry
    run(with_stack(json_answer({"kv_transfer_params": PARAMS}),
                   json_answer({"error": "bad"}, status=400), t))


def test_decode_down_is_502():
    async def t():
        d = await FakeEngine(OK_PLAIN).start()
        await d.stop()
        p = await FakeEngine(json_answer({"kv_transfer_params": PARAMS})).start()
        config = pd_proxy.ProxyConfig(p.url, d.url, timeout=BOUND)
        runner, port = await pd_proxy.start_server(config)
        try:
            code, _, out = await post(f"http://127.0.0.1:{port}", BODY)
            assert code == 502 and b"decode" in out
        finally:
            await runner.cleanup()
            await p.stop()
    run(t())


# -- push ----------------------------------------------------------------------------------
def push_pair() -> tuple[Handler, Handler, dict]:
    """A push-mode stand-in: D answers a transfer request only once P got the same push_id
    (as a real decode engine waits for the push); P answers its one token."""
    state: dict = {"p_ids": set(), "p_arrived": asyncio.Event()}

    async def p(_request, body):
        state["p_ids"].add(body["kv_transfer_params"]["push_id"])
        state["p_arrived"].set()
        return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": None})

    async def d(_request, body):
        if "kv_transfer_params" in body:
            await asyncio.wait_for(state["p_arrived"].wait(), BOUND)
            assert body["kv_transfer_params"]["push_id"] in state["p_ids"]
            return web.json_response({"choices": [{"text": "pushed"}]})
        return web.json_response({"choices": [{"text": "plain"}]})
    return p, d, state


def test_push_sends_decode_and_prefill_with_one_push_id():
    p_h, d_h, _ = push_pair()

    async def t(p, d, url):
        code, path, out = await post(url, BODY)
        assert (code, path, json.loads(out)) == (200, "push", {"choices": [{"text": "pushed"}]})
        (_, d_body), = d.seen
        (_, p_body), = p.seen
        dp, pp = d_body["kv_transfer_params"], p_body["kv_transfer_params"]
        assert dp == {"do_remote_prefill": True, "transfer_mode": "push",
                      "push_id": dp["push_id"], "remote_host": "10.0.0.1", "remote_port": 5601}
        assert pp == {"do_remote_decode": True, "transfer_mode": "push",
                      "push_id": dp["push_id"]}
        assert p_body["max_tokens"] == 1 and ":" not in dp["push_id"] and "@" not in dp["push_id"]
        code, _, _ = await post(url, BODY)          # a fresh push id per request
        assert d.seen[1][1]["kv_transfer_params"]["push_id"] != dp["push_id"]
    run(with_stack(p_h, d_h, t, mode="push"))


@pytest.mark.parametrize("prefill", ["http-500", "down"])
def test_push_prefill_failure_cancels_decode_and_falls_back(prefill):
    async def waiting_decode(_request, _body):          # waits for a push that never comes
        await asyncio.sleep(10 * BOUND)
        return web.json_response({})

    async def t(p, d, url):
        code, path, out = await post(url, BODY)
        assert (code, path, json.loads(out)) == (200, "decode-only",
                                                 {"choices": [{"text": "plain"}]})
        await asyncio.wait_for(d.cancel_event.wait(), BOUND)   # the waiting request was cut
        assert [("kv_transfer_params" in b) for _, b in d.seen] == [True, False]
    run(with_stack(json_answer({"error": "boom"}, status=500) if prefill == "http-500" else None,
                   decode_by_params(waiting_decode, OK_PLAIN), t, mode="push"))


def test_push_decode_error_event_falls_back_streaming():
    """vLLM's ``fail`` policy with a dead prefill engine: the decode stream's first event is
    an error; the client sees only the decode-only stream."""
    plain = sse({"choices": [{"text": "pl"}]}, {"choices": [{"text": "ain"}]}, "[DONE]")

    async def t(p, d, url):
        code, path, out = await post(url, dict(BODY, stream=True))
        assert (code, path, out) == (200, "decode-only", b"".join(plain))
    run(with_stack(json_answer({"choices": []}),
                   decode_by_params(stream_answer(sse(
                       {"choices": [{"delta": {"role": "assistant", "content": ""}}]},
                       {"error": {"message": "Internal server error"}}, "[DONE]")),
                       stream_answer(plain)), t, mode="push"))


# -- streaming, disconnects ------------------------------------------------------------------
def test_stream_is_passed_through_as_it_arrives():
    """D sends its first token event, then waits until the client has read it through the
    proxy: the rest can only come after, so the proxy did not buffer the whole stream."""
    gate = asyncio.Event()
    events = sse({"choices": [{"text": "a"}]}, {"choices": [{"text": "b"}]}, "[DONE]")

    async def t(p, d, url):
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=BOUND)) as s:
            async with s.post(url + "/v1/completions", json=dict(BODY, stream=True)) as r:
                assert r.status == 200 and r.headers["x-pd-path"] == "pull"
                first = await r.content.readuntil(b"\n\n")
                assert first == events[0]
                gate.set()
                assert await r.content.read() == b"".join(events[1:])
    run(with_stack(json_answer({"kv_transfer_params": PARAMS}), stream_answer(events, gate), t))


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("stream", [False, True])
def test_client_disconnect_cancels_upstream(mode, stream):
    """The client goes away while the decode engine works: the decode request (and in push
    mode the prefill request) is cancelled upstream."""
    async def hang(_request, _body):
        await asyncio.sleep(10 * BOUND)
        return web.json_response({})

    async def pull_prefill(_request, _body):
        return web.json_response({"kv_transfer_params": PARAMS})

    async def t(p, d, url):
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=BOUND)) as s:
            task = asyncio.ensure_future(s.post(url + "/v1/completions",
                                                json=dict(BODY, stream=stream)))
            await asyncio.wait_for(d.arrived.wait(), BOUND)
            if mode == "push":
                await asyncio.wait_for(p.arrived.wait(), BOUND)
            task.cancel()                     # the client disconnects
            with pytest.raises(asyncio.CancelledError):
                await task
        await asyncio.wait_for(d.cancel_event.wait(), BOUND)
        if mode == "push":
            await asyncio.wait_for(p.cancel_event.wait(), BOUND)
        assert len(d.seen) == 1               # no fallback request after a disconnect
    run(with_stack(hang if mode == "push" else pull_prefill, hang, t, mode=mode))


# -- health, models, config, CLI -------------------------------------------------------------
@pytest.mark.parametrize("p_up,d_up,code,status", [(True, True, 200, "ok"),
                                                   (False, True, 200, "degraded"),
                                                   (True, False, 503, "down")])
def test_health_checks_both_engines(p_up, d_up, code, status):
    async def t():
        p = await FakeEngine(OK_PLAIN, healthy=p_up).start()
        d = await FakeEngine(OK_PLAIN, healthy=d_up).start()
        runner, port = await pd_proxy.start_server(pd_proxy.ProxyConfig(p.url, d.url))
        try:
            async with aiohttp.ClientSession() as s:
                async with s.get(f"http://127.0.0.1:{port}/health") as r:
                    out = await r.json()
                    assert r.status == code and out["status"] == status, out
                    assert out["prefill"] == ("ok" if p_up else "HTTP 503")
                async with s.get(f"http://127.0.0.1:{port}/v1/models") as r:
                    assert r.status == 200 and (await r.json())["data"][0]["id"] == "m"
        finally:
            await runner.cleanup()
            await p.stop()
            await d.stop()
    run(t())


def test_config_errors_name_the_argument():
    with pytest.raises(ValueError, match="mode"):
        pd_proxy.ProxyConfig("http://a:1", "http://b:2", "both")
    with pytest.raises(ValueError, match="prefill"):
        pd_proxy.ProxyConfig("a:1", "http://b:2")
    with pytest.raises(ValueError, match="prefill-side-channel"):
        pd_proxy.parse_side_channel("host:99999", "http://a:1")
    assert pd_proxy.parse_side_channel("5601", "http://10.1.2.3:8100") == ("10.1.2.3", 5601)
    assert pd_proxy.parse_side_channel("h:5601", "http://a:1") == ("h", 5601)
    c = pd_proxy.ProxyConfig("http://10.1.2.3:8100/", "http://b:2", "push")
    assert c.prefill == "http://10.1.2.3:8100" and c.side_channel == ("10.1.2.3", 5600)


def test_cli_serves_health(tmp_path):
    """``python docs/examples/pd_proxy.py --prefill URL --decode URL --port N --mode push``
    starts and answers /health (both engines down: 503); stopped by its PID."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path / "proxy.log", "wb")
    proc = subprocess.Popen([sys.executable, str(ROOT / "docs" / "examples" / "pd_proxy.py"),
                             "--prefill", dead_url(), "--decode", dead_url(), "--port",
                             str(port), "--mode", "push"], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 3 * BOUND
        while True:
            assert proc.poll() is None, (tmp_path / "proxy.log").read_text()
            try:
                import urllib.error
                import urllib.request
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=BOUND)
            except urllib.error.HTTPError as e:
                assert e.code == 503 and json.loads(e.read())["status"] == "down"
                break
            except OSError:
                assert time.monotonic() < deadline, "proxy did not come up"
                time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(BOUND)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(BOUND)
        log.close()
    assert "push mode" in (tmp_path / "proxy.log").read_text()


def test_cli_rejects_bad_side_channel():
    out = subprocess.run([sys.executable, str(ROOT / "docs" / "examples" / "pd_proxy.py"),
                          "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2",
                          "--mode", "push", "--prefill-side-channel", "x:0"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--prefill-side-channel" in out.stderr
