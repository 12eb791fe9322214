"""Push mode, the decode side when its prefill peer is missing or misbehaves (vLLM's real
Scheduler, real NIXL, two in-process engines): the request settles long before
``push_recv_timeout`` (900 s here; every wait below is bounded far lower), under both
``kv_load_failure_policy`` values, and no connector hook raises into the engine loop.
The same with real engines and killed / restarted prefill processes:
tests/engine/test_push_peer_loss_inference.py."""
import pytest

import harness as H
import push_harness as PH
from ports import free_port

pytestmark = pytest.mark.nixl

GEMMA = lambda: H.gemma_like(num_blocks=64)  # noqa: E731
SLOW = {"push_recv_timeout": 900.0}


def _prompt(n):
    return [1 + i % 900 for i in range(n)]


def _settled(D, r, policy: str, P=None) -> None:
    """``r``'s push failed: recompute -> computed locally and finished normally; fail ->
    finished with an error; the engine keeps going and, once P answered D's cancel (``P``
    steps too), holds no block."""
    PH.step_until(lambda: not D.s.requests, [D], timeout=60, what="D settles the request")
    want = H.RequestStatus.FINISHED_LENGTH_CAPPED if policy == "recompute" \
        else H.RequestStatus.FINISHED_ERROR
    assert r.status == want, r.status
    PH.step_until(lambda: not D.conn.held_blocks(), [D] if P is None else [P, D],
                  timeout=30, what="P answers D's cancel")
    H.assert_no_leak(D.s)
    # a plain request afterwards runs normally
    plain = H.make_request("plain", _prompt(40), 16, max_tokens=2)
    D.s.add_request(plain)
    PH.step_until(lambda: not D.s.requests, [D], timeout=60, what="a plain request")
    assert plain.status == H.RequestStatus.FINISHED_LENGTH_CAPPED
    H.assert_no_leak(D.s)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_prefill_never_started(policy):
    D = PH.Engine(GEMMA, extra=SLOW, load_failure_policy=policy)
    try:
        d_params, _ = PH.push_params("nobody", free_port())
        r = H.make_request("d", _prompt(100), 16, params=d_params, max_tokens=2)
        D.s.add_request(r)
        PH.step_until(lambda: r.status != H.RequestStatus.WAITING_FOR_REMOTE_KVS
                      and D.metas, [D], timeout=60, what="the refused handshake")
        assert any("Connection refused" in e for e in D.w.worker.errors), D.w.worker.errors
        _settled(D, r, policy)
    finally:
        D.close()


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_unclaimed_registration_is_dropped_and_decode_told(policy):
    """P got D's registration but never the request (a lost prefill leg): P drops it after
    its lease and tells D, which stops waiting."""
    P = PH.Engine(GEMMA, extra={"kv_lease_duration": 2.0})
    D = PH.Engine(GEMMA, extra=SLOW, load_failure_policy=policy)
    try:
        d_params, _ = PH.push_params("lost", P.port)
        r = H.make_request("d", _prompt(100), 16, params=d_params, max_tokens=2)
        D.s.add_request(r)
        PH.step_until(lambda: "lost" in P.conn.registered(), [D, P], what="P registers")
        PH.step_until(lambda: "lost" not in P.conn.registered()
                      and r.status != H.RequestStatus.WAITING_FOR_REMOTE_KVS, [P, D],
                      timeout=60, what="P drops the registration, D hears of it")
        _settled(D, r, policy, P)
        assert not P.w.worker._regs
    finally:
        P.close()
        D.close()


def test_hook_errors_do_not_escape(monkeypatch):
    """NIXL raising inside the worker's hooks (here: reading notifications, and the WRITE of
    one layer on P) is logged and counted; the push fails, the engines keep stepping."""
    P = PH.Engine(GEMMA)
    D = PH.Engine(GEMMA, extra=SLOW, load_failure_policy="recompute")
    try:
        d_params, p_params = PH.push_params("boom", P.port)
        r = H.make_request("d", _prompt(100), 16, params=d_params, max_tokens=2)
        D.s.add_request(r)
        PH.step_until(lambda: "boom" in P.conn.registered(), [D, P], what="P registers")
        calls = {"n": 0}
        notifs = D.w.worker.agent.notifs

        def flaky_notifs():
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("nixl went wrong")
            return notifs()

        monkeypatch.setattr(D.w.worker.agent, "notifs", flaky_notifs)

        def broken_save(sub, layer):
            raise RuntimeError("nixlBackendError")

        monkeypatch.setattr(P.w.worker.pusher, "save_layer", broken_save)
        P.s.add_request(H.make_request("p", _prompt(100), 16, params=p_params, max_tokens=1))
        PH.step_until(lambda: r.request_id in D.conn.failed_recving, [P, D], timeout=60,
                      what="D hears the push failed")
        assert any("nixl went wrong" in e for e in D.w.worker.errors), D.w.worker.errors
        PH.step_until(lambda: not P.s.requests, [P], timeout=60, what="P ends its request")
        _settled(D, r, "recompute", P)
        H.assert_no_leak(P.s)
    finally:
        P.close()
        D.close()


def test_unpairable_step_gives_up_the_push(monkeypatch):
    """P's worker cannot pair a push step (a BlockTableError, e.g. D registered ids that
    do not fit): the request prefills without push, D is told, nothing raises or leaks."""
    from hmacore.errors import BlockTableError

    P = PH.Engine(GEMMA)
    D = PH.Engine(GEMMA, extra=SLOW, load_failure_policy="fail")
    try:
        d_params, p_params = PH.push_params("odd", P.port)
        r = H.make_request("d", _prompt(100), 16, params=d_params, max_tokens=2)
        D.s.add_request(r)
        PH.step_until(lambda: "odd" in P.conn.registered(), [D, P], what="P registers")

        # P's worker plans the step: its batched pairing refuses (it changes nothing), and so
        # does pairing this request alone: the push fails on the worker, D is told, P's
        # scheduler learns it ended (finished_sending) and holds nothing for it
        tables = P.w.worker.tables
        batched = tables.step_pairs
        refused = []

        def refuse_pairs(scheduled, new_ids, theirs, spans, block_sizes):
            if any(t is not None for t in theirs):
                refused.append(list(scheduled))
                raise BlockTableError("group 1: 3 local vs 2 remote blocks")
            return batched(scheduled, new_ids, theirs, spans, block_sizes)

        monkeypatch.setattr(tables, "step_pairs", refuse_pairs)
        p = H.make_request("p", _prompt(100), 16, params=p_params, max_tokens=1)
        P.s.add_request(p)
        PH.step_until(lambda: not P.s.requests and r.request_id in D.conn.failed_recving
                      or r.status == H.RequestStatus.FINISHED_ERROR, [P, D], timeout=60,
                      what="P gives up, D hears of it")
        assert p.status == H.RequestStatus.FINISHED_LENGTH_CAPPED
        assert refused == [["p"], ["p"]]        # the batch, then the request alone
        # the worker failed the push itself (not P's lease running out), so P held nothing
        stats = P.w.stats()
        assert stats and not stats[-1]["ok"] and "cannot be planned" in stats[-1]["error"], stats
        PH.step_until(lambda: not P.s.requests, [P], timeout=60, what="P ends its request")
        H.assert_no_leak(P.s)
        assert len(tables) == 0 and P.conn.leases() == {}
        _settled(D, r, "fail", P)
    finally:
        P.close()
        D.close()


def test_a_hanging_handshake_does_not_stall_the_engine(monkeypatch):
    """P's address accepts connections but never answers (a hung or overloaded host): the
    handshake waits on its own thread while the engine keeps serving other requests; when
    the connection fails, the push request fails and is recomputed."""
    import socket

    from hmacore.integrations.vllm.nixl import push_decode   # D's handshake reads it there

    monkeypatch.setattr(push_decode, "FIRST_CONTACT_TIMEOUT_S", 120.0)
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)                    # connections complete in the backlog; nobody answers
    D = PH.Engine(GEMMA, extra=SLOW, load_failure_policy="recompute")
    try:
        d_params, _ = PH.push_params("hung", silent.getsockname()[1])
        r = H.make_request("d", _prompt(100), 16, params=d_params, max_tokens=2)
        D.s.add_request(r)
        D.step()
        plain = H.make_request("plain", _prompt(40), 16, max_tokens=2)
        D.s.add_request(plain)
        PH.step_until(lambda: plain.status == H.RequestStatus.FINISHED_LENGTH_CAPPED, [D],
                      timeout=60, what="a plain request beside the hung handshake")
        assert r.status == H.RequestStatus.WAITING_FOR_REMOTE_KVS   # still handshaking
        silent.close()                  # the pending connection is reset: the handshake fails
        PH.step_until(lambda: not D.s.requests, [D], timeout=60, what="the push fails")
        assert r.status == H.RequestStatus.FINISHED_LENGTH_CAPPED
        assert any("hung" in e or "127.0.0.1" in e for e in D.w.worker.errors)
        H.assert_no_leak(D.s)
    finally:
        silent.close()
        D.close()
