"""A P/D proxy for two ``vllm serve`` instances running HmaNixlConnector, pull or push mode.

Pull mode (``--mode pull``, the connector's default ``transfer_mode``), per request:
  1. the prefill instance gets the request with ``max_tokens = 1`` and
     ``kv_transfer_params = {"do_remote_decode": true}``: it computes the prompt and keeps its KV
     under a lease;
  2. the decode instance gets the original request plus the ``kv_transfer_params`` of the
     prefill response (block ids, engine id, side-channel address, lease): it READs the KV.

Push mode (``--mode push``, both engines with ``"transfer_mode": "push"``), per request: a
fresh ``push_id``; the decode instance gets the request **first** with ``kv_transfer_params =
{"do_remote_prefill": true, "transfer_mode": "push", "push_id": ..., "remote_host",
"remote_port"}`` (the prefill engine's side channel, ``--prefill-side-channel``) and waits;
the prefill instance gets it at the same time with ``max_tokens = 1`` and ``{"do_remote_decode":
true, "transfer_mode": "push", "push_id": ...}`` and WRITEs each layer into the decode
instance's blocks.

Failures (the client gets an answer whenever the decode instance can give one):
  * decode-only fallback: when the prefill leg fails (connection refused, timeout, an HTTP
    error, pull: no usable ``kv_transfer_params``), or the decode leg fails before it produced
    any output (HTTP 5xx, or an error event first in a stream: vLLM's ``fail``
    ``kv_load_failure_policy``), the request goes to the decode instance once more without
    ``kv_transfer_params``: it computes the prompt itself. In push mode a prefill failure
    cancels the waiting decode request first. The response carries ``x-pd-path``: ``pull``,
    ``push`` or ``decode-only``.
  * a client that disconnects cancels the upstream requests (their HTTP connections close,
    and vLLM aborts a request whose client went away; a push-mode prefill engine then tells
    the decode engine the push failed).
  * ``GET /health`` checks both instances' ``/health``: 200 while the decode instance is up
    (``"status": "degraded"`` when only the prefill instance is down: requests fall back),
    503 when the decode instance is down.
Streaming (``"stream": true``) is passed through as it arrives (after the first event that
carries output, so a failed load can still fall back). ``GET /v1/models`` is the decode
instance's. Uses aiohttp (a dependency of vLLM). Usage::

    python pd_proxy.py --port 8000 --mode pull \\
        --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200
    python pd_proxy.py --port 8000 --mode push --prefill-side-channel 127.0.0.1:5600 \\
        --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import uuid
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web

PATHS = ("/v1/completions", "/v1/chat/completions")
MODES = ("pull", "push")
#: hmacore's default side_channel_port (kv_connector_extra_config)
DEFAULT_SIDE_CHANNEL_PORT = 5600

logger = logging.getLogger("pd_proxy")


@dataclasses.dataclass(frozen=True)
class ProxyConfig:
    """``prefill`` / ``decode``: base URLs. ``mode``: ``"pull"`` or ``"push"``.
    ``side_channel``: push mode, the prefill engine's ``(side_channel_host,
    side_channel_port)``. ``timeout``: seconds per upstream request; ``health_timeout``:
    seconds per upstream health check."""

    prefill: str
    decode: str
    mode: str = "pull"
    side_channel: tuple[str, int] | None = None
    timeout: float = 600.0
    health_timeout: float = 5.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        for name in ("prefill", "decode"):
            url = getattr(self, name)
            if urlsplit(url).scheme not in ("http", "https") or not urlsplit(url).hostname:
                raise ValueError(f"{name} must be an http(s) base URL, got {url!r}")
            object.__setattr__(self, name, url.rstrip("/"))
        if self.mode == "push" and self.side_channel is None:
            object.__setattr__(self, "side_channel",
                               (urlsplit(self.prefill).hostname, DEFAULT_SIDE_CHANNEL_PORT))


def parse_side_channel(text: str, prefill: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``PORT`` (host: the prefill URL's) -> ``(host, port)``; ValueError."""
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = "", text
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--prefill-side-channel must be HOST:PORT or PORT with a port in "
                         f"[1, 65535], got {text!r}")
    return host or urlsplit(prefill).hostname or "127.0.0.1", int(port)


def prefill_body(body: dict, params: dict) -> dict:
    """The prefill leg: one token, no streaming, the KV kept for the decode instance."""
    out = dict(body, max_tokens=1, stream=False, kv_transfer_params=params)
    for key in ("max_completion_tokens", "stream_options", "min_tokens"):
        out.pop(key, None)
    return out


def decode_only_body(body: dict) -> dict:
    """The request as a plain one: the decode instance computes the prompt itself."""
    out = dict(body)
    out.pop("kv_transfer_params", None)
    return out


class _LegFailed(Exception):
    """An upstream leg failed (connection, timeout, HTTP error, unusable answer)."""


def _carries_output(event: dict) -> bool:
    """Whether a streamed event shows generated output (text, content, a finish)."""
    for choice in event.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta") or {}
        if choice.get("text") or choice.get("finish_reason") or (
                isinstance(delta, dict) and any(delta.get(k) for k in (
                    "content", "reasoning_content", "reasoning", "tool_calls"))):
            return True
    return False


class PDProxy:
    """The proxy's request handling; :func:`make_app` wires it into an aiohttp application."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.session: aiohttp.ClientSession | None = None
        self._background: set[asyncio.Task] = set()

    async def start(self, _app: web.Application | None = None) -> None:
        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.config.timeout),
            connector=aiohttp.TCPConnector(limit=0))

    async def stop(self, _app: web.Application | None = None) -> None:
        for task in list(self._background):
            task.cancel()
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        if self.session is not None:
            await self.session.close()

    # -- legs ------------------------------------------------------------------------------
    @staticmethod
    def _headers(request: web.Request) -> dict:
        h = {"Content-Type": "application/json"}
        if "Authorization" in request.headers:
            h["Authorization"] = request.headers["Authorization"]
        return h

    async def _prefill(self, request: web.Request, body: dict, params: dict) -> dict:
        """The prefill leg's JSON answer; _LegFailed on any failure."""
        assert self.session is not None
        try:
            async with self.session.post(self.config.prefill + request.path,
                                         json=prefill_body(body, params),
                                         headers=self._headers(request)) as resp:
                if resp.status != 200:
                    raise _LegFailed(f"prefill answered HTTP {resp.status}: "
                                     f"{(await resp.text())[:200]}")
                return await resp.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            raise _LegFailed(f"prefill leg failed: {type(e).__name__}: {e}") from None

    async def _open_decode(self, request: web.Request, body: dict
                           ) -> tuple[aiohttp.ClientResponse, list[bytes] | bytes]:
        """Send the decode leg and read up to its first output: the whole body (no stream),
        or the stream's events up to and including the first one that carries output. The
        caller closes the response. _LegFailed if it failed before any output (HTTP 5xx, an
        error event first), the response then closed: nothing reached the client yet."""
        assert self.session is not None
        try:
            resp = await self.session.post(self.config.decode + request.path, json=body,
                                           headers=self._headers(request))
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise _LegFailed(f"decode leg failed: {type(e).__name__}: {e}") from None
        try:
            if resp.status >= 500:
                raise _LegFailed(f"decode answered HTTP {resp.status}: "
                                 f"{(await resp.text())[:200]}")
            if not body.get("stream") or resp.status != 200:
                return resp, await resp.read()
            events: list[bytes] = []
            while True:
                try:
                    raw = await resp.content.readuntil(b"\n\n")
                except ValueError:               # an event longer than the read limit
                    raw = await resp.content.read(1 << 20)
                if not raw:
                    return resp, events          # the stream ended
                events.append(raw)
                data = raw.strip()
                if not data.startswith(b"data:"):
                    continue
                data = data[5:].strip()
                if data == b"[DONE]":
                    return resp, events
                try:
                    event = json.loads(data)
                except ValueError:
                    return resp, events          # not ours to judge: pass it through
                if isinstance(event, dict) and event.get("error") is not None:
                    raise _LegFailed(f"decode stream failed: {json.dumps(event['error'])[:200]}")
                if isinstance(event, dict) and _carries_output(event):
                    return resp, events
        except BaseException:
            resp.close()
            raise

    async def _push_decode(self, request: web.Request, body: dict
                           ) -> tuple[aiohttp.ClientResponse, Any] | None:
        """Push mode: decode leg and prefill leg at once. The decode leg's first output, or
        None when the prefill leg failed first (the decode request is then cancelled) or the
        decode leg failed before output."""
        push_id = f"pd-{uuid.uuid4().hex}"
        host, port = self.config.side_channel or ("", 0)
        d_body = dict(body, kv_transfer_params={
            "do_remote_prefill": True, "transfer_mode": "push", "push_id": push_id,
            "remote_host": host, "remote_port": port})
        d_task = asyncio.ensure_future(self._open_decode(request, d_body))
        p_task = asyncio.ensure_future(self._prefill(request, body, {
            "do_remote_decode": True, "transfer_mode": "push", "push_id": push_id}))
        try:
            await asyncio.wait({d_task, p_task}, return_when=asyncio.FIRST_COMPLETED)
            if p_task.done() and p_task.exception() is not None and not d_task.done():
                logger.warning("push %s: %s; decode request cancelled, decoding without "
                               "transfer", push_id, p_task.exception())
                d_task.cancel()
                with contextlib.suppress(BaseException):
                    await d_task
                return None
            try:
                out = await d_task
            except _LegFailed as e:
                logger.warning("push %s: %s; decoding without transfer", push_id, e)
                p_task.cancel()          # its push has no taker any more
                with contextlib.suppress(BaseException):
                    await p_task
                return None
            if not p_task.done():        # let the prefill leg end on its own (1 token)
                self._background.add(p_task)
                p_task.add_done_callback(self._prefill_done)
            elif p_task.exception() is not None:
                logger.warning("push %s: %s (the decode engine answered anyway)", push_id,
                               p_task.exception())
            return out
        except BaseException:            # client gone (cancelled) or a bug: stop both legs
            for t in (d_task, p_task):
                t.cancel()
            raise

    def _prefill_done(self, task: asyncio.Task) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.warning("%s (the decode engine answered anyway)", task.exception())

    # -- handlers --------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise ValueError("the request body must be a JSON object")
        except ValueError as e:
            return web.json_response({"error": {"message": f"bad request body: {e}",
                                                "type": "BadRequestError"}}, status=400)
        path, opened = "decode-only", None
        if self.config.mode == "pull":
            try:
                answer = await self._prefill(request, body, {"do_remote_decode": True})
                params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
                if not isinstance(params, dict) or not params.get("do_remote_prefill"):
                    raise _LegFailed(
                        "the prefill answer has no kv_transfer_params with do_remote_prefill: "
                        "the prefill instance is not running HmaNixlConnector in pull mode "
                        "with kv_role kv_producer (a prefill engine with transfer_mode "
                        "'push' needs --mode push here)")
                opened = await self._open_decode(request, dict(body, kv_transfer_params=params))
                path = "pull"
            except _LegFailed as e:
                logger.warning("%s; decoding without transfer", e)
        else:
            opened = await self._push_decode(request, body)
            path = "push" if opened is not None else path
        if opened is None:
            try:
                opened = await self._open_decode(request, decode_only_body(body))
            except _LegFailed as e:
                return web.json_response({"error": {"message": str(e), "type": "BadGateway"}},
                                         status=502)
        return await self._relay(request, *opened, path)

    async def _relay(self, request: web.Request, resp: aiohttp.ClientResponse,
                     head: list[bytes] | bytes, path: str) -> web.StreamResponse:
        """Pass the decode answer through (a stream as it arrives); closes ``resp``."""
        with contextlib.closing(resp):
            headers = {"Content-Type": resp.headers.get("Content-Type", "application/json"),
                       "x-pd-path": path}
            if isinstance(head, bytes):
                return web.Response(status=resp.status, body=head, headers=headers)
            out = web.StreamResponse(status=resp.status, headers=headers)
            await out.prepare(request)
            for chunk in head:
                await out.write(chunk)
            async for chunk in resp.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    async def models(self, request: web.Request) -> web.Response:
        assert self.session is not None
        try:
            async with self.session.get(self.config.decode + "/v1/models",
                                        headers=self._headers(request)) as resp:
                return web.Response(status=resp.status, body=await resp.read(),
                                    content_type="application/json")
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return web.json_response({"error": {"message": f"decode: {e}"}}, status=502)

    async def _check(self, base: str) -> str:
        assert self.session is not None
        try:
            async with self.session.get(
                    base + "/health",
                    timeout=aiohttp.ClientTimeout(total=self.config.health_timeout)) as resp:
                return "ok" if resp.status == 200 else f"HTTP {resp.status}"
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__

    async def health(self, _request: web.Request) -> web.Response:
        prefill, decode = await asyncio.gather(self._check(self.config.prefill),
                                               self._check(self.config.decode))
        status = "down" if decode != "ok" else "ok" if prefill == "ok" else "degraded"
        return web.json_response({"status": status, "mode": self.config.mode,
                                  "prefill": prefill, "decode": decode},
                                 status=503 if status == "down" else 200)


PROXY_KEY = web.AppKey("proxy", PDProxy)


def make_app(config: ProxyConfig) -> web.Application:
    """The proxy as an aiohttp application (run it with ``handler_cancellation=True`` so a
    client that disconnects cancels its handler and with it the upstream requests:
    :func:`run` and :func:`start_server` do)."""
    proxy = PDProxy(config)
    app = web.Application(client_max_size=64 << 20)
    app.on_startup.append(proxy.start)
    app.on_cleanup.append(proxy.stop)
    for p in PATHS:
        app.router.add_post(p, proxy.completions)
    app.router.add_get("/health", proxy.health)
    app.router.add_get("/v1/models", proxy.models)
    app[PROXY_KEY] = proxy
    return app


async def start_server(config: ProxyConfig, host: str = "127.0.0.1",
                       port: int = 0) -> tuple[web.AppRunner, int]:
    """Start the proxy on ``host:port`` (0: a free port) in the running event loop; returns
    the runner (``await runner.cleanup()`` stops it) and the bound port."""
    runner = web.AppRunner(make_app(config), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, int(bound)


def run(config: ProxyConfig, host: str, port: int) -> None:
    web.run_app(make_app(config), host=host, port=port, handler_cancellation=True,
                access_log=None, print=None)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--prefill", required=True, help="base URL of the prefill instance")
    ap.add_argument("--decode", required=True, help="base URL of the decode instance")
    ap.add_argument("--mode", choices=MODES, default="pull",
                    help="the engines' kv_connector_extra_config.transfer_mode")
    ap.add_argument("--prefill-side-channel", default=None, metavar="HOST:PORT",
                    help="push mode: the prefill engine's side_channel_host:side_channel_port "
                         f"(default: the prefill URL's host, port {DEFAULT_SIDE_CHANNEL_PORT})")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per upstream call")
    a = ap.parse_args(argv)
    try:
        side = parse_side_channel(a.prefill_side_channel, a.prefill) \
            if a.prefill_side_channel else None
        config = ProxyConfig(a.prefill, a.decode, a.mode, side, a.timeout)
    except ValueError as e:
        ap.error(str(e))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s "
                                                   "%(message)s")
    logger.info("P/D proxy (%s mode) on %s:%d: prefill %s, decode %s%s", config.mode, a.host,
                a.port, config.prefill, config.decode,
                f", prefill side channel {config.side_channel[0]}:{config.side_channel[1]}"
                if config.side_channel else "")
    run(config, a.host, a.port)


if __name__ == "__main__":
    main()
