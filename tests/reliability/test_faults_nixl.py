"""Fault injection with real NIXL (two peer processes + this decoder, UCX over loopback):
a peer killed while requests to it are in flight, expired leases mixed into live traffic,
and a real-TCP handshake with a peer of a mismatched layout. For each: the failed requests
are named, nothing wrong is marked valid, blocks are released exactly once (invariant
checker), and the survivor keeps serving with byte-verified transfers. Extends
tests/nixl/test_nixl_pd.py (one request per fault there; many interleaved requests here)."""
from __future__ import annotations

import time

import pytest

from hmacore.errors import HandshakeError, TransferError
from hmacore.spec import GroupKind, GroupSpec, KVLayout
from hmacore.transport.handshake import exchange_handshake
from hmacore.transport.nixl import NixlAgent
from rel_nixl import Decoder, PeerProc

pytestmark = [pytest.mark.reliability, pytest.mark.nixl, pytest.mark.timeout(240)]

ROUNDS = 3
PER_PEER = 12


def test_peer_killed_with_requests_in_flight_leases_and_bad_handshake():
    doomed = PeerProc("doomed", serve_s=150, env={"UCX_TLS": "tcp"})   # slow path: TCP only
    fresh = PeerProc("fresh", serve_s=150)
    other = KVLayout(groups=(GroupSpec(GroupKind.FULL, 32, ("f.0", "f.1")),))
    alien = PeerProc("alien", serve_s=150, layout=other, page=128, nb=64)
    figures = {"faults": 0, "named_failures": 0, "verified_after_fault": 0}
    try:
        dec = Decoder(NixlAgent, "fault-decode", seed=5)
        with dec.agent:
            pay = dec.agent.handshake_payload()
            d_name = dec.agent.add_peer(exchange_handshake("127.0.0.1", doomed.port, pay))
            f_name = dec.agent.add_peer(exchange_handshake("127.0.0.1", fresh.port, pay))
            # 1. mismatched layout: refused at the handshake, never becomes a peer
            with pytest.raises(HandshakeError):
                dec.agent.add_peer(exchange_handshake("127.0.0.1", alien.port, pay))
            assert "alien" not in dec.agent.peers and len(dec.agent.peers) == 2
            figures["faults"] += 1
            # 2. traffic to both peers, some with expired leases, then the doomed peer dies
            i = 0
            on_doomed, on_fresh = [], []
            for _ in range(PER_PEER):
                for peer, bucket in ((d_name, on_doomed), (f_name, on_fresh)):
                    req = f"r{i}"
                    i += 1
                    dec.new_request(req, 600)
                    if i % 5 == 0:            # the lease on the remote blocks has run out
                        with pytest.raises(TransferError, match="lease"):
                            dec.submit(req, peer, expires_at=time.monotonic() - 0.5)
                        dec.abort(req)
                        figures["faults"] += 1
                        figures["named_failures"] += 1
                        continue
                    dec.submit(req, peer, expires_at=time.monotonic() + 60)
                    bucket.append(req)
            doomed.kill()
            figures["faults"] += 1
            for req in on_fresh:
                assert dec.complete(req), f"{req} on the surviving peer failed"
            doomed_ok = sum(dec.complete(req) for req in on_doomed)   # beat the kill, or named
            figures["named_failures"] += len(on_doomed) - doomed_ok
            # 3. requests after the death: every one fails, named, nothing valid
            for k in range(4):
                req = f"after{k}"
                dec.new_request(req, 300)
                try:
                    dec.submit(req, d_name)
                except TransferError as e:
                    assert e.request_id == req
                    dec.abort(req)
                    figures["named_failures"] += 1
                    continue
                assert not dec.complete(req, timeout=15), "a transfer to a dead peer succeeded"
                figures["named_failures"] += 1
            dec.agent.remove_peer(d_name)
            # 4. the survivor keeps serving, byte-verified
            for r in range(ROUNDS * PER_PEER):
                req = f"s{r}"
                dec.new_request(req, int(dec.rng.integers(1, 2000)))
                dec.submit(req, f_name)
                assert dec.complete(req)
                figures["verified_after_fault"] += 1
            dec.chk.check_tracker(dec.ts, dec.pool)
            assert len(dec.ts) == 0 and dec.pool.num_free == dec.nb - 1
            dec.agent.send_notif(f_name, "end", b"bye")
        assert fresh.proc.wait(timeout=20) == 0
    finally:
        for p in (doomed, fresh, alien):
            p.kill()
    figures.update(verified=dec.verified, failed=dec.failed, bytes_checked=dec.bytes_checked)
    print(f"\nnixl faults: {figures}")
    assert figures["named_failures"] >= 4 + PER_PEER * 2 // 5 - 1
