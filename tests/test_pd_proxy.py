"""docs/examples/pd_proxy.py: the P/D proxy forwards the prefill leg's kv_transfer_params to the
decode leg (HTTP on 127.0.0.1, stand-in backends that record what they receive; the real
two-engine P/D flow is tests/engine/test_pd_inference.py)."""
import importlib.util
import json
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "pd_proxy", Path(__file__).resolve().parents[1] / "docs" / "examples" / "pd_proxy.py")
pd_proxy = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pd_proxy)

PARAMS = {"do_remote_prefill": True, "do_remote_decode": False,
          "remote_block_ids": [[0, 7, 8], [4, 5, 6]], "remote_engine_id": "p0",
          "remote_request_id": "r1", "remote_host": "127.0.0.1", "remote_port": 5600}


def backend(answer):
    seen = []

    class H(BaseHTTPRequestHandler):
        def do_POST(self):
            seen.append((self.path, json.loads(self.rfile.read(int(self.headers["Content-Length"])))))
            data = json.dumps(answer(seen[-1][1])).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, seen


def post(port, path, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture
def stack(request):
    p_answer = getattr(request, "param", lambda b: {"choices": [{"text": "x"}],
                                                     "kv_transfer_params": PARAMS})
    p, p_seen = backend(p_answer)
    d, d_seen = backend(lambda b: {"choices": [{"text": "decoded"}]})
    proxy = pd_proxy.serve(0, f"http://127.0.0.1:{p.server_port}", f"http://127.0.0.1:{d.server_port}",
                           timeout=10)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    yield proxy.server_port, p_seen, d_seen
    for s in (proxy, p, d):
        s.shutdown()
        s.server_close()


def test_forwards_kv_transfer_params(stack):
    port, p_seen, d_seen = stack
    body = {"model": "m", "prompt": "hello", "max_tokens": 32, "temperature": 0}
    code, out = post(port, "/v1/completions", body)
    assert code == 200 and out == {"choices": [{"text": "decoded"}]}
    (p_path, p_body), = p_seen
    assert p_path == "/v1/completions" and p_body["max_tokens"] == 1
    assert p_body["kv_transfer_params"] == {"do_remote_decode": True}
    (d_path, d_body), = d_seen
    assert d_body == dict(body, kv_transfer_params=PARAMS)    # original request + P's params


@pytest.mark.parametrize("stack", [lambda b: {"choices": []}], indirect=True)
def test_prefill_without_params_is_502_and_decode_not_called(stack):
    port, p_seen, d_seen = stack
    code, out = post(port, "/v1/completions", {"prompt": "x", "max_tokens": 4})
    assert code == 502 and "do_remote_prefill" in out["error"] and not d_seen


def test_unknown_path_and_streaming_rejected(stack):
    port, p_seen, d_seen = stack
    assert post(port, "/v1/embeddings", {})[0] == 404
    code, out = post(port, "/v1/completions", {"prompt": "x", "stream": True})
    assert code == 400 and "stream" in out["error"] and not p_seen
