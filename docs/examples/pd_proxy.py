"""A minimal P/D proxy for two ``vllm serve`` instances running HmaNixlConnector (pull mode).

For each ``POST /v1/completions`` (or ``/v1/chat/completions``):
1. send the request to the prefill instance with ``max_tokens = 1`` and
   ``kv_transfer_params = {"do_remote_decode": true}``: it computes the prompt and keeps the KV
   under a lease;
2. take the ``kv_transfer_params`` of its response (per-group block ids, engine id, host, port,
   lease expiry, layout fingerprint) and send the original request to the decode instance
   with them: it pulls the KV over NIXL and generates;
3. return the decode instance's response.

Standard library only; one thread per request. Usage::

    python pd_proxy.py --port 8000 --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200
"""
from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PATHS = ("/v1/completions", "/v1/chat/completions")


def post_json(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def prefill_request(body: dict) -> dict:
    """The prefill leg: one token, KV kept for the decode instance; no streaming."""
    out = dict(body, max_tokens=1, stream=False,
               kv_transfer_params={"do_remote_decode": True})
    out.pop("max_completion_tokens", None)
    out.pop("stream_options", None)
    return out


def decode_request(body: dict, prefill_response: dict) -> dict:
    """The decode leg: the original request plus the prefill instance's kv_transfer_params."""
    params = prefill_response.get("kv_transfer_params")
    if not isinstance(params, dict) or not params.get("do_remote_prefill"):
        raise ValueError("prefill response has no kv_transfer_params with do_remote_prefill "
                         "(is HmaNixlConnector loaded with kv_role kv_producer?)")
    return dict(body, kv_transfer_params=params)


def make_handler(prefill: str, decode: str, timeout: float):
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            if self.path not in PATHS:
                return self._reply(404, {"error": f"unknown path {self.path}"})
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                if body.get("stream"):
                    return self._reply(400, {"error": "stream=true is not supported by this proxy"})
                first = post_json(prefill + self.path, prefill_request(body), timeout)
                self._reply(200, post_json(decode + self.path, decode_request(body, first),
                                           timeout))
            except (ValueError, urllib.error.URLError, OSError) as e:
                self._reply(502, {"error": f"{type(e).__name__}: {e}"})

        def _reply(self, code: int, obj: dict) -> None:
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args) -> None:
            return

    return Handler


def serve(port: int, prefill: str, decode: str, *, host: str = "127.0.0.1",
          timeout: float = 300.0) -> ThreadingHTTPServer:
    """A started-later server (call ``serve_forever``); ``port`` 0 picks a free port."""
    return ThreadingHTTPServer((host, port), make_handler(prefill.rstrip("/"),
                                                          decode.rstrip("/"), timeout))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--prefill", required=True, help="base URL of the prefill instance")
    ap.add_argument("--decode", required=True, help="base URL of the decode instance")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per upstream call")
    a = ap.parse_args()
    serve(a.port, a.prefill, a.decode, host=a.host, timeout=a.timeout).serve_forever()


if __name__ == "__main__":
    main()
