"""A KV-aware router for ``vllm serve`` engines: each request goes to the engine that holds
the longest prefix of its prompt, by vLLM's own hybrid rule (hmacore.RoutingIndex, fed by the
engines' ZMQ KV events through hmacore.transport.kv_events).

Standard library + hmacore only. Prompts must be token id lists (the engines run with
``--skip-tokenizer-init``, or the client tokenizes): the router hashes them as vLLM does. A
text prompt cannot be scored and goes to the least loaded engine.

  * ``POST /v1/completions``: routed to the engine with the longest predicted hit, ties broken
    by fewest requests in flight, then by the order the engines were given. The answer (a
    stream: passed through as it arrives) carries ``x-routed-to`` (engine name) and
    ``x-predicted-hit`` (tokens the index predicted that engine holds).
  * P/D mode (``--prefill`` engines given): the prefill engine is picked the same way among
    the prefill engines and gets the request with ``max_tokens = 1`` and
    ``kv_transfer_params = {"do_remote_decode": true}`` (hmacore's NIXL connector, pull mode;
    see pd_proxy.py); the decode engine, picked the same way among the ``--engine`` ones, gets
    the request with the prefill answer's ``kv_transfer_params``. A failed prefill leg falls
    back to the decode engine alone. P/D answers carry ``x-pd-path`` (``pull``, or
    ``decode-only`` when the prefill leg failed) and, after a prefill leg that worked,
    ``x-prefilled-by`` and ``x-prefill-hit`` (the prefill engine's predicted hit).
  * ``POST /router/score`` ``{"prompt": [ids]}``: every engine's predicted hit (no request).
  * ``GET /router/stats``: the event streams' counters. ``GET /health``: 200 while at least
    one decode engine answers its ``/health``.

Each engine is ``NAME=URL,EVENTS[,REPLAY]`` with the engine started with
``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint":
"EVENTS", "replay_endpoint": "REPLAY"}'`` (a ``tcp://127.0.0.1:PORT`` endpoint: the engine
connects to it, the router binds it). The router must hash like the engines: the same
``--prefix-caching-hash-algo`` (``--hash-algo``) and ``PYTHONHASHSEED`` (``--seed``), and the
engines' KV cache groups (``--layout``, a layout file as docs/embedding.md describes)::

    python kv_router.py --port 8000 --layout layout.json --seed 0 \\
        --engine a=http://127.0.0.1:8100,tcp://127.0.0.1:5557,tcp://127.0.0.1:5558 \\
        --engine b=http://127.0.0.1:8200,tcp://127.0.0.1:5567,tcp://127.0.0.1:5568
"""
from __future__ import annotations

import argparse
import dataclasses
import http.client
import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from hmacore import RoutingIndex
from hmacore.spec import KVLayout
from hmacore.transport.kv_events import EngineStream, KVEventSubscriber

logger = logging.getLogger("kv_router")


@dataclasses.dataclass(frozen=True)
class Engine:
    name: str
    url: str
    events: str
    replay: str | None = None
    role: str = "decode"            # "decode" (or a plain engine) / "prefill"

    @property
    def key(self) -> tuple[str, int]:
        return (self.name, 0)

    @classmethod
    def parse(cls, text: str, role: str) -> Engine:
        name, sep, rest = text.partition("=")
        parts = rest.split(",")
        if not sep or not name or len(parts) not in (2, 3):
            raise ValueError(f"an engine must be NAME=URL,EVENTS[,REPLAY], got {text!r}")
        url = parts[0].rstrip("/")
        if urlsplit(url).scheme != "http" or not urlsplit(url).hostname:
            raise ValueError(f"engine {name}: URL must be http://HOST:PORT, got {url!r}")
        return cls(name, url, parts[1], parts[2] if len(parts) == 3 else None, role)


class Router:
    """Picks engines by predicted hit, then load; counts requests in flight."""

    def __init__(self, index: RoutingIndex, engines: list[Engine], timeout: float) -> None:
        names = [e.name for e in engines]
        if len(set(names)) != len(names):
            raise ValueError(f"engine names must differ: {names}")
        self.index = index
        self.engines = engines
        self.timeout = timeout
        self.inflight = {e.name: 0 for e in engines}
        self._lock = threading.Lock()
        self.subscriber = KVEventSubscriber(index, [
            EngineStream(e.name, e.events, e.replay) for e in engines])

    def scores(self, prompt: object) -> dict[str, int]:
        """Predicted hit in tokens per engine (0 for everything if the prompt is not ids)."""
        if not (isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt)):
            return {e.name: 0 for e in self.engines}
        hits = self.index.query(prompt).hits
        return {e.name: int(hits.get(e.key, 0)) for e in self.engines}

    def pick(self, role: str, scores: dict[str, int]) -> tuple[Engine, int]:
        """The engine of ``role`` with the longest hit, then fewest in flight; reserves it."""
        with self._lock:
            cands = [(-scores[e.name], self.inflight[e.name], i, e)
                     for i, e in enumerate(self.engines) if e.role == role]
            _, _, _, best = min(cands)
            self.inflight[best.name] += 1
        return best, scores[best.name]

    def done(self, engine: Engine) -> None:
        with self._lock:
            self.inflight[engine.name] -= 1

    def connect(self, engine: Engine) -> http.client.HTTPConnection:
        u = urlsplit(engine.url)
        return http.client.HTTPConnection(str(u.hostname), u.port or 80, timeout=self.timeout)


class Handler(BaseHTTPRequestHandler):
    router: Router          # set on the subclass by make_server
    protocol_version = "HTTP/1.0"    # the body of a passed-through stream ends at close

    def log_message(self, fmt: str, *args: object) -> None:
        logger.debug(fmt, *args)

    def _json(self, status: int, obj: object, headers: dict | None = None) -> None:
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def _body(self) -> dict | None:
        try:
            n = int(self.headers.get("Content-Length", "0"))
            body = json.loads(self.rfile.read(n) or b"null")
            if not isinstance(body, dict):
                raise ValueError("the request body must be a JSON object")
            return body
        except ValueError as e:
            self._json(400, {"error": {"message": f"bad request body: {e}",
                                       "type": "BadRequestError"}})
            return None

    def do_GET(self) -> None:
        r = self.router
        if self.path == "/health":
            up = {}
            for e in r.engines:
                try:
                    c = r.connect(e)
                    c.request("GET", "/health")
                    up[e.name] = c.getresponse().status == 200
                    c.close()
                except OSError:
                    up[e.name] = False
            ok = any(up[e.name] for e in r.engines if e.role == "decode")
            self._json(200 if ok else 503, {"status": "ok" if ok else "down", "engines": up})
        elif self.path == "/router/stats":
            stats = r.subscriber.stats()
            self._json(200, {e.name: dataclasses.asdict(stats[e.key]) for e in r.engines})
        else:
            self._json(404, {"error": {"message": f"no route {self.path}"}})

    def do_POST(self) -> None:
        if self.path == "/router/score":
            body = self._body()
            if body is not None:
                self._json(200, self.router.scores(body.get("prompt")))
        elif self.path == "/v1/completions":
            body = self._body()
            if body is not None:
                self._complete(body)
        else:
            self._json(404, {"error": {"message": f"no route {self.path}"}})

    def _complete(self, body: dict) -> None:
        r = self.router
        scores = r.scores(body.get("prompt"))
        headers = {}
        if any(e.role == "prefill" for e in r.engines):
            pre, pre_hit = r.pick("prefill", scores)
            try:
                params = self._prefill(pre, body)
            finally:
                r.done(pre)
            if params is not None:
                body = dict(body, kv_transfer_params=params)
                headers.update({"x-pd-path": "pull", "x-prefilled-by": pre.name,
                                "x-prefill-hit": str(pre_hit)})
            else:       # the decode engine computes the prompt: nothing was prefilled
                headers["x-pd-path"] = "decode-only"
        engine, hit = r.pick("decode", scores)
        headers.update({"x-routed-to": engine.name, "x-predicted-hit": str(hit)})
        try:
            self._relay(engine, body, headers)
        finally:
            r.done(engine)

    def _prefill(self, engine: Engine, body: dict) -> dict | None:
        """The prefill leg; its kv_transfer_params, or None (decode computes the prompt)."""
        leg = dict(body, max_tokens=1, stream=False,
                   kv_transfer_params={"do_remote_decode": True})
        # min_tokens > 1 would make the engine refuse the 1-token leg (a silent decode-only)
        for key in ("stream_options", "min_tokens"):
            leg.pop(key, None)
        try:
            c = self.router.connect(engine)
            c.request("POST", self.path, json.dumps(leg), {"Content-Type": "application/json"})
            resp = c.getresponse()
            answer = json.loads(resp.read())
            c.close()
            params = answer.get("kv_transfer_params") if resp.status == 200 else None
            return params if isinstance(params, dict) else None
        except (OSError, ValueError, http.client.HTTPException) as e:
            logger.warning("prefill leg on %s failed (%s): decoding without transfer",
                           engine.name, e)
            return None

    def _relay(self, engine: Engine, body: dict, headers: dict) -> None:
        try:
            c = self.router.connect(engine)
            c.request("POST", self.path, json.dumps(body), {"Content-Type": "application/json"})
            resp = c.getresponse()
        except (OSError, http.client.HTTPException) as e:
            self._json(502, {"error": {"message": f"{engine.name}: {e}", "type": "BadGateway"}},
                       headers)
            return
        try:
            self.send_response(resp.status)
            self.send_header("Content-Type", resp.getheader("Content-Type", "application/json"))
            for k, v in headers.items():
                self.send_header(k, v)
            self.end_headers()
            while True:
                chunk = resp.read1(65536)
                if not chunk:
                    break
                self.wfile.write(chunk)
                self.wfile.flush()
        finally:
            c.close()


def make_server(router: Router, host: str, port: int) -> ThreadingHTTPServer:
    handler = type("RouterHandler", (Handler,), {"router": router})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    return server


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--layout", required=True, help="the engines' KV cache groups (layout file)")
    ap.add_argument("--engine", action="append", default=[], metavar="NAME=URL,EVENTS[,REPLAY]",
                    help="a (decode) engine; repeat for each")
    ap.add_argument("--prefill", action="append", default=[], metavar="NAME=URL,EVENTS[,REPLAY]",
                    help="a prefill engine (P/D mode); repeat for each")
    ap.add_argument("--hash-algo", default="sha256",
                    help="the engines' --prefix-caching-hash-algo")
    ap.add_argument("--seed", default=None, help="the engines' PYTHONHASHSEED (unset: vLLM's "
                    "default seed; the router's own PYTHONHASHSEED if set)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per upstream call")
    a = ap.parse_args(argv)
    try:
        engines = [Engine.parse(t, "decode") for t in a.engine] + \
            [Engine.parse(t, "prefill") for t in a.prefill]
        if not a.engine:
            raise ValueError("give at least one --engine")
        index = RoutingIndex(KVLayout.from_file(a.layout), hash_algo=a.hash_algo, seed=a.seed)
        router = Router(index, engines, a.timeout)
    except (ValueError, OSError) as e:
        ap.error(str(e))
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    server = make_server(router, a.host, a.port)
    with router.subscriber:
        logger.info("KV router on %s:%d: %s", a.host, a.port,
                    ", ".join(f"{e.name} ({e.role}) {e.url}" for e in engines))
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            pass
        finally:
            server.server_close()


if __name__ == "__main__":
    main()
