"""Fault injection with real NIXL (two peer processes + this decoder, UCX over loopback):
a peer killed while requests to it are in flight, expired leases mixed into live traffic,
and a real-TCP handshake with a peer of a mismatched layout. For each: the failed requests
are named, nothing wrong is marked valid, blocks are released exactly once (invariant
checker), and the survivor keeps serving with byte-verified transfers. Extends
tests/nixl/test_nixl_pd.py (one request per fault there; many interleaved requests here)."""
from __future__ import annotations

import os
import signal
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


MID_ITER = int(os.environ.get("HMACORE_MIDFLIGHT_ITER", "3"))
MID_REQS = 4          # per iteration: READ, WRITE, READ, WRITE


def freeze(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP ``pid`` and wait (bounded) until every one of its threads is stopped: kill()
    returns before delivery, and a thread asleep in poll() (NIXL's progress thread) could
    still answer a request that lands in that window."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while True:
        states = set()
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    states.add(f.read().rsplit(")", 1)[1].split()[0])
            except OSError:        # a thread that just exited
                pass
        if states <= {"T", "t"}:
            return
        assert time.monotonic() < deadline, f"peer {pid} not stopped after {timeout} s: {states}"
        time.sleep(0.01)


def test_peer_killed_mid_transfer_deterministic():
    """The peer dies while transfers are provably in flight, every iteration.

    The doomed peer and this decoder run UCX over TCP only, so every byte of a READ or WRITE
    needs the peer's UCX worker (with shared memory or CMA, a frozen peer's memory is still
    read and written: 3 of 4 transfers completed in that setup); after the handshake and one
    verified warm-up READ it is frozen (SIGSTOP), then
    4 transfers (2 READ, 2 WRITE, 1,200-token requests) are posted to it and polled: all must
    still be in flight 0.3 s later. Then the peer is SIGKILLed (by PID) and reaped. Every
    one of those requests must fail, named, with nothing marked valid, within a bounded
    wait; its blocks are released exactly once. The decoder then hand-shakes a replacement
    peer and READs and WRITEs to it, byte-verified (WRITEs read back), and the invariant
    checker finds the pool empty."""
    fig = {"iterations": 0, "posted_to_doomed": 0, "in_flight_at_kill": 0,
           "failed_named": 0, "beat_kill": 0, "max_fail_wait_s": 0.0,
           "replacement_verified": 0}
    saved_tls = os.environ.get("UCX_TLS")
    os.environ["UCX_TLS"] = "tcp"      # both ends TCP only: no shared-memory/CMA path that
    try:                                # could move bytes without the peer's CPU
        dec = Decoder(NixlAgent, "midflight-decode", seed=9)
    finally:
        if saved_tls is None:
            os.environ.pop("UCX_TLS")
        else:
            os.environ["UCX_TLS"] = saved_tls
    procs = []
    try:
        with dec.agent:
            pay = dec.agent.handshake_payload()
            for it in range(MID_ITER):
                doomed = PeerProc(f"doomed{it}", serve_s=150, env={"UCX_TLS": "tcp"})
                procs.append(doomed)
                name = dec.agent.add_peer(exchange_handshake("127.0.0.1", doomed.port, pay))
                dec.new_request(f"warm{it}", 400)
                dec.submit(f"warm{it}", name)
                assert dec.complete(f"warm{it}")            # the path works before the fault
                freeze(doomed.proc.pid)
                reqs = []
                for k in range(MID_REQS):
                    req = f"mid{it}-{k}"
                    dec.new_request(req, 1200)
                    dec.submit(req, name, op="WRITE" if k % 2 else "READ")
                    reqs.append(req)
                fig["posted_to_doomed"] += len(reqs)
                time.sleep(0.3)
                states = {}
                for req in reqs:
                    try:
                        states[req] = dec.agent.poll(dec.pending[req][0])
                    except TransferError:
                        states[req] = "ERR"
                in_flight = [r for r in reqs if states[r] == "PROC"]
                assert in_flight == reqs, f"not in flight before the kill: {states}"
                fig["in_flight_at_kill"] += len(in_flight)
                os.kill(doomed.proc.pid, signal.SIGKILL)
                doomed.proc.wait(timeout=10)
                for req in reqs:
                    t0 = time.monotonic()
                    ok = dec.complete(req, timeout=15)      # asserts named + nothing valid
                    waited = time.monotonic() - t0
                    fig["max_fail_wait_s"] = max(fig["max_fail_wait_s"], round(waited, 2))
                    assert waited < 20
                    if ok:
                        fig["beat_kill"] += 1
                    else:
                        fig["failed_named"] += 1
                assert fig["beat_kill"] == 0, "a transfer to a frozen, then killed peer completed"
                dec.agent.remove_peer(name)
                assert name not in dec.agent.peers
                # a new peer: the decoder keeps serving, byte-verified both ways
                repl = PeerProc(f"replacement{it}", serve_s=150)
                procs.append(repl)
                rname = dec.agent.add_peer(exchange_handshake("127.0.0.1", repl.port, pay))
                for k in range(4):
                    req = f"repl{it}-{k}"
                    dec.new_request(req, int(dec.rng.integers(1, 1200)))
                    dec.submit(req, rname, op="WRITE" if k % 2 else "READ")
                    assert dec.complete(req)
                    fig["replacement_verified"] += 1
                dec.agent.send_notif(rname, "end", b"bye")
                assert repl.proc.wait(timeout=20) == 0
                dec.agent.remove_peer(rname)
                fig["iterations"] += 1
            dec.chk.check_tracker(dec.ts, dec.pool)
            assert len(dec.ts) == 0 and dec.pool.num_free == dec.nb - 1
    finally:
        for p in procs:
            if p.proc.poll() is None:
                os.kill(p.proc.pid, signal.SIGCONT)
            p.kill()
    fig.update(verified=dec.verified, bytes_checked=dec.bytes_checked)
    print(f"\nnixl mid-flight kill: {fig}")
    assert fig["in_flight_at_kill"] == MID_ITER * MID_REQS == fig["failed_named"]
