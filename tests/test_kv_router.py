"""docs/examples/kv_router.py against stand-in HTTP engines (stdlib servers on 127.0.0.1 that
record what they receive) and KV events sent over real ZMQ in vLLM's wire format: routing by
predicted hit, ties by load, text prompts, streaming passed through as it arrives, P/D legs.
The real engines behind it: tests/serve/test_serve_kv_router.py."""
from __future__ import annotations

import importlib.util
import json
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

zmq = pytest.importorskip("zmq")      # hmacore[routing]
msgspec = pytest.importorskip("msgspec")

from hmacore import RoutingIndex  # noqa: E402
from hmacore.spec import KVLayout  # noqa: E402
from hmacore.transport import kv_event_wire as W  # noqa: E402
from ports import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("kv_router", ROOT / "docs/examples/kv_router.py")
assert _spec is not None and _spec.loader is not None
kv_router = importlib.util.module_from_spec(_spec)
sys.modules["kv_router"] = kv_router
_spec.loader.exec_module(kv_router)

BOUND = 30.0
BS = 16
LAYOUT = KVLayout.from_dict({"groups": [
    {"kind": "sliding_window", "block_size": BS, "sliding_window": 32},
    {"kind": "full", "block_size": BS}]})
PROMPT = [(i * 37) % 900 + 3 for i in range(6 * BS + 5)]


class StandIn:
    """An engine: answers /v1/completions (a stream of three events when asked, the last
    one only once ``release`` is set) and records the bodies it got."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        self.release = threading.Event()
        self.hold = threading.Event()        # set: requests wait for release
        me = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"

            def log_message(self, *a: object) -> None:
                pass

            def do_GET(self) -> None:
                self.send_response(200 if self.path == "/health" else 404)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                me.bodies.append(body)
                if me.hold.is_set():
                    me.release.wait(BOUND)
                self.send_response(200)
                if body.get("stream"):
                    self.send_header("Content-Type", "text/event-stream")
                    self.end_headers()
                    self.wfile.write(b'data: {"choices": [{"text": "a"}]}\n\n')
                    self.wfile.flush()
                    me.release.wait(BOUND)
                    self.wfile.write(b"data: [DONE]\n\n")
                    return
                out = {"choices": [{"text": "x"}]}
                if body.get("kv_transfer_params", {}).get("do_remote_decode"):
                    out["kv_transfer_params"] = {"do_remote_prefill": True, "from": "p"}
                data = json.dumps(out).encode()
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fleet():
    """Two engines a, b (+ prefill p when asked), the router on a free port, and a raw PUB
    per engine sending KV event batches."""
    made: list = []

    def make(pd: bool = False):
        names = ["a", "b"] + (["p"] if pd else [])
        engines = {n: StandIn() for n in names}
        ports = {n: free_port() for n in names}
        specs = [kv_router.Engine(n, engines[n].url, f"tcp://127.0.0.1:{ports[n]}", None,
                                  "prefill" if n == "p" else "decode") for n in names]
        router = kv_router.Router(RoutingIndex(LAYOUT, seed="0"), specs, timeout=BOUND)
        router.subscriber.start()
        server = kv_router.make_server(router, "127.0.0.1", 0)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        pubs = {}
        for n in names:
            s = zmq.Context.instance().socket(zmq.PUB)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(f"tcp://127.0.0.1:{ports[n]}")
            pubs[n] = s
        made.append((engines, router, server, pubs))
        return engines, router, f"http://127.0.0.1:{server.server_address[1]}", pubs

    yield make
    for engines, router, server, pubs in made:
        server.shutdown()
        server.server_close()
        router.subscriber.close()
        for s in pubs.values():
            s.close()
        for e in engines.values():
            e.close()


def store(router, pubs, name: str, tokens: list[int]) -> None:
    """Send engine ``name``'s batch 0 storing ``tokens``' blocks in both groups, resent
    until the router has it (a PUB drops until the subscription arrives)."""
    hashes = [int.from_bytes(d[-8:], "big") for d in router.index.block_hashes(tokens)]
    ev = [W.BlockStored(block_hashes=hashes, block_size=BS, group_idx=g) for g in (0, 1)]
    payload = msgspec.msgpack.encode(W.EventBatch(ts=0.0, events=ev))
    deadline = time.monotonic() + BOUND
    while not router.subscriber.wait_for((name, 0), 1, 0.1):
        assert time.monotonic() < deadline
        pubs[name].send_multipart((b"", bytes(8), payload))


def post(url: str, body: dict) -> tuple[dict, bytes]:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=BOUND) as r:
        return dict(r.headers), r.read()


def test_longest_hit_wins_then_load_then_order(fleet):
    engines, router, url, pubs = fleet()
    store(router, pubs, "b", PROMPT)
    want = (len(PROMPT) - 1) // BS * BS
    assert json.loads(post(url + "/router/score", {"prompt": PROMPT})[1]) == {"a": 0, "b": want}
    h, _ = post(url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 1})
    assert (h["x-routed-to"], h["x-predicted-hit"]) == ("b", str(want))
    h, _ = post(url + "/v1/completions", {"prompt": "text", "max_tokens": 1})
    assert (h["x-routed-to"], h["x-predicted-hit"]) == ("a", "0")     # tie: first engine
    # a request held in flight on a: the next tie goes to b
    engines["a"].hold.set()
    t = threading.Thread(target=post, args=(url + "/v1/completions", {"prompt": "t"}))
    t.start()
    deadline = time.monotonic() + BOUND
    while router.inflight["a"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    h, _ = post(url + "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 1})
    assert h["x-routed-to"] == "b"
    engines["a"].release.set()
    t.join(BOUND)
    assert router.inflight == {"a": 0, "b": 0}
    assert [b["prompt"] for b in engines["b"].bodies] == [PROMPT, [5, 6, 7]]


def test_stream_is_passed_through_as_it_arrives(fleet):
    engines, router, url, pubs = fleet()
    req = urllib.request.Request(url + "/v1/completions", json.dumps(
        {"prompt": PROMPT, "stream": True}).encode(), {"Content-Type": "application/json"},
        method="POST")
    with urllib.request.urlopen(req, timeout=BOUND) as r:
        first = r.readline()                 # arrives while the engine still holds the rest
        assert first.startswith(b"data: {") and not engines["a"].release.is_set()
        engines["a"].release.set()
        rest = r.read()
    assert rest.strip().endswith(b"data: [DONE]")


def test_pd_mode_picks_prefill_and_decode_by_hit(fleet):
    engines, router, url, pubs = fleet(pd=True)
    store(router, pubs, "b", PROMPT)
    store(router, pubs, "p", PROMPT)
    h, _ = post(url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "min_tokens": 4,
                                          "stream": False})
    assert (h["x-prefilled-by"], h["x-routed-to"], h["x-pd-path"]) == ("p", "b", "pull")
    (pre,) = engines["p"].bodies
    assert pre["max_tokens"] == 1 and pre["kv_transfer_params"] == {"do_remote_decode": True}
    assert "min_tokens" not in pre          # vLLM refuses min_tokens > max_tokens
    (dec,) = engines["b"].bodies
    assert dec["max_tokens"] == 8 and dec["min_tokens"] == 4
    assert dec["kv_transfer_params"] == {"do_remote_prefill": True, "from": "p"}
    assert engines["a"].bodies == []


def test_health_and_stats(fleet):
    engines, router, url, pubs = fleet()
    store(router, pubs, "a", PROMPT)
    with urllib.request.urlopen(url + "/health", timeout=BOUND) as r:
        assert json.loads(r.read()) == {"status": "ok", "engines": {"a": True, "b": True}}
    with urllib.request.urlopen(url + "/router/stats", timeout=BOUND) as r:
        stats = json.loads(r.read())
    assert stats["a"]["batches"] == 1 and stats["a"]["stored"] == 2 * len(PROMPT) // BS
    for e in engines.values():
        e.close()
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(url + "/health", timeout=BOUND)
    assert err.value.code == 503


def test_engine_argument_errors():
    with pytest.raises(ValueError, match="NAME=URL,EVENTS"):
        kv_router.Engine.parse("a=http://127.0.0.1:1", "decode")
    with pytest.raises(ValueError, match="URL must be http"):
        kv_router.Engine.parse("a=ftp://x,tcp://127.0.0.1:1", "decode")
