"""Soak: thousands of requests through TrackerSet -> clip -> TransferPlan -> real NIXL READ
or WRITE (two processes, UCX over loopback) -> byte verification -> finish, bounded in time,
for four layouts (``rel_nixl.soak_case``: FULL+SW+MAMBA, gpt-oss full+sliding, the five-group
deepseek-v4, the Mamba qwen3-next), with RSS, tracemalloc and Python object counts compared
between warm-up and the end.

READ: every page read is compared with the peer's fill pattern. WRITE (every 3rd request):
pages holding the pattern of never-used positions are pushed, read back into scratch blocks
and compared (rel_nixl.Decoder).

CI form: HMACORE_SOAK_S (default 15) seconds and HMACORE_SOAK_MIN (default 300) requests
per layout (a target: posting stops at the hard limit whatever the count; at least 200
requests, 100 of them after the memory baseline, must have been verified) (the RSS bound is not
checked under ASan, whose quarantine keeps freed
memory resident; tracemalloc and object counts still are). The
`slow` form: 75 s and 2,000 requests per layout. Either stops posting at 6x its nominal
time (at least 120 s) whatever the count."""
from __future__ import annotations

import os
import time
import tracemalloc

import pytest

from hmacore.transport.handshake import exchange_handshake
from hmacore.transport.nixl import NixlAgent
from rel_nixl import Decoder, PeerProc, object_count, rss_bytes, soak_case

pytestmark = [pytest.mark.reliability, pytest.mark.nixl]

RSS_TOLERANCE = 16 << 20      # bytes of RSS growth allowed between warm-up and the end
TRACED_TOLERANCE = 1 << 20    # bytes of Python-heap (tracemalloc) growth allowed
OBJ_TOLERANCE = 2000          # Python objects growth allowed
WARMUP = 100                  # requests before the baseline is taken
MEASURED = 100                # requests after the baseline, at least
IN_FLIGHT = 8                 # requests posted before the oldest is completed
WRITE_EVERY = 3               # every 3rd request is a WRITE
HARD_FACTOR = 6               # hard time limit, in units of the nominal duration
CASES = ["fsm", "gpt-oss", "deepseek-v4", "qwen3-next"]
SANITIZED = os.environ.get("HMACORE_SANITIZED") == "1"    # scripts/sanitize.sh (ASan preload)


def soak(case, seconds, min_requests):
    """Run for ``seconds`` and at least ``min_requests`` requests, but never past
    ``HARD_FACTOR * seconds`` (a loaded box fails the request count, it never hangs)."""
    layout, page, nb, max_tokens = soak_case(case)
    peer = PeerProc(f"soak-{case}", serve_s=max(HARD_FACTOR * seconds, 120.0) + 90,
                    layout=layout, page=page, nb=nb)
    tracemalloc.start()
    try:
        dec = Decoder(NixlAgent, f"soak-decode-{case}", seed=11, layout=layout, page=page, nb=nb)
        with dec.agent:
            name = dec.agent.add_peer(exchange_handshake("127.0.0.1", peer.port,
                                                         dec.agent.handshake_payload()))
            start = time.monotonic()
            deadline = start + seconds
            hard = start + max(HARD_FACTOR * seconds, 120.0)
            i = 0
            order = []
            base = None

            def posting():
                now = time.monotonic()
                return now < hard and (now < deadline or i < min_requests)

            while posting() or order:
                if posting():
                    req = f"req-{i}"
                    dec.new_request(req, int(dec.rng.integers(1, max_tokens)))
                    dec.submit(req, name, op="WRITE" if i % WRITE_EVERY == WRITE_EVERY - 1 else "READ")
                    order.append(req)
                    i += 1
                if len(order) >= IN_FLIGHT or (order and not posting()):
                    assert dec.complete(order.pop(0))
                if i == WARMUP and base is None:
                    base = (rss_bytes(), tracemalloc.get_traced_memory()[0], object_count())
                if i % 500 == 0:
                    dec.chk.check_tracker(dec.ts, dec.pool)
            elapsed = time.monotonic() - start
            end = (rss_bytes(), tracemalloc.get_traced_memory()[0], object_count())
            dec.chk.check_tracker(dec.ts, dec.pool)
            assert len(dec.ts) == 0 and dec.pool.num_free == dec.nb - 1   # all released
            dec.agent.send_notif(name, "end", b"bye")
        assert peer.proc.wait(timeout=20) == 0
    finally:
        tracemalloc.stop()
        peer.kill()
    base = base or end
    report = {"case": case, "seconds": round(elapsed, 1), "requests_verified": dec.verified,
              "reads": dec.ops["READ"], "writes": dec.ops["WRITE"], "failed": dec.failed,
              "bytes_checked": dec.bytes_checked, "blocks_released": dec.released,
              "rss_start": base[0], "rss_end": end[0], "rss_growth": end[0] - base[0],
              "traced_start": base[1], "traced_end": end[1], "traced_growth": end[1] - base[1],
              "object_growth": end[2] - base[2]}
    print(f"\nsoak: {report}")
    # the count is a target (a loaded box reaches the hard time limit first); correctness and
    # memory are the verdict, over a measured window of at least MEASURED requests
    assert dec.failed == 0 and dec.verified == i and dec.verified >= WARMUP + MEASURED
    assert dec.ops["READ"] > 0 and dec.ops["WRITE"] > 0
    if not SANITIZED:   # ASan's quarantine keeps freed memory resident (up to 256 MiB)
        assert report["rss_growth"] <= RSS_TOLERANCE, report
    assert report["traced_growth"] <= TRACED_TOLERANCE, report
    assert report["object_growth"] <= OBJ_TOLERANCE, report
    return report


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", CASES)
def test_soak_ci(case):
    soak(case, float(os.environ.get("HMACORE_SOAK_S", "15")),
         max(int(os.environ.get("HMACORE_SOAK_MIN", "300")), WARMUP + MEASURED))


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", CASES)
def test_soak_long(case):
    soak(case, 75.0, 2000)
