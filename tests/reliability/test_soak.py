"""Soak: thousands of requests through TrackerSet -> clip -> TransferPlan -> real NIXL READ
(two processes, UCX over loopback) -> byte verification -> finish, bounded in time, with
RSS and Python object counts compared between warm-up and the end.

CI form: HMACORE_SOAK_S (default 60) seconds. The `slow` form runs 300 s."""
from __future__ import annotations

import os
import time

import pytest

from hmacore.transport.handshake import exchange_handshake
from hmacore.transport.nixl import NixlAgent
from rel_nixl import Decoder, PeerProc, object_count, rss_bytes

pytestmark = [pytest.mark.reliability, pytest.mark.nixl]

RSS_TOLERANCE = 16 << 20      # bytes of RSS growth allowed between warm-up and the end
OBJ_TOLERANCE = 2000          # Python objects growth allowed
WARMUP = 200                  # requests before the baseline is taken
IN_FLIGHT = 8                 # requests posted before the oldest is completed


def soak(seconds):
    peer = PeerProc("soak-prefill", serve_s=seconds + 60)
    try:
        dec = Decoder(NixlAgent, "soak-decode", seed=11)
        with dec.agent:
            name = dec.agent.add_peer(exchange_handshake("127.0.0.1", peer.port,
                                                         dec.agent.handshake_payload()))
            deadline = time.monotonic() + seconds
            i = 0
            order = []
            base_rss = base_obj = None
            start = time.monotonic()
            while time.monotonic() < deadline or order:
                if time.monotonic() < deadline:
                    req = f"req-{i}"
                    dec.new_request(req, int(dec.rng.integers(1, 1200)))
                    dec.submit(req, name)
                    order.append(req)
                    i += 1
                if len(order) >= IN_FLIGHT or (order and time.monotonic() >= deadline):
                    assert dec.complete(order.pop(0))
                if i == WARMUP and base_rss is None:
                    base_rss, base_obj = rss_bytes(), object_count()
                if i % 500 == 0:
                    dec.chk.check_tracker(dec.ts, dec.pool)
            elapsed = time.monotonic() - start
            end_rss, end_obj = rss_bytes(), object_count()
            dec.chk.check_tracker(dec.ts, dec.pool)
            assert len(dec.ts) == 0 and dec.pool.num_free == dec.nb - 1   # all released
            dec.agent.send_notif(name, "end", b"bye")
        assert peer.proc.wait(timeout=20) == 0
    finally:
        peer.kill()
    report = {"seconds": round(elapsed, 1), "requests_verified": dec.verified,
              "failed": dec.failed, "bytes_checked": dec.bytes_checked,
              "blocks_released": dec.released, "rss_growth": end_rss - (base_rss or end_rss),
              "object_growth": end_obj - (base_obj or end_obj)}
    print(f"\nsoak: {report}")
    assert dec.failed == 0 and dec.verified == i and dec.verified > WARMUP
    assert report["rss_growth"] <= RSS_TOLERANCE, report
    assert report["object_growth"] <= OBJ_TOLERANCE, report
    return report


@pytest.mark.timeout(240)
def test_soak_ci():
    soak(float(os.environ.get("HMACORE_SOAK_S", "60")))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_soak_long():
    soak(300.0)
