"""Push mode failure paths (two in-process engines, real Scheduler, real NIXL): D's deadline,
a peer gone midway, a registration that never comes, transfer_mode mismatches and bad
params. Each failure is per request: D reports failed_recving with nothing valid (vLLM's
recompute policy then applies), P frees its blocks; no block leaks on either side."""
import logging
import time

import pytest

import harness as H
import push_harness as PH
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from hmacore.integrations.vllm.nixl.connector import HmaNixlConnector

pytestmark = pytest.mark.nixl

GEMMA = lambda: H.gemma_like(num_blocks=64)  # noqa: E731


def _prompt(n):
    return [1 + i % 900 for i in range(n)]


def _recomputed(D, r, engines=None):
    """r failed its load: vLLM restarted it from token 0 and it finishes normally; blocks
    held for a cancelled push are released once P answers (``engines`` step, default D)."""
    assert r.request_id in D.conn.failed_recving
    assert r.num_computed_tokens == 0
    PH.step_until(lambda: not D.s.requests, [D], what="D finishes after recompute")
    assert r.status == H.RequestStatus.FINISHED_LENGTH_CAPPED
    held = getattr(D.conn, "held_blocks", set)     # a pull-mode D holds nothing
    PH.step_until(lambda: not held(), engines or [D],
                  what="the cancelled push's blocks released")
    H.assert_no_leak(D.s)


def test_d_deadline_is_a_failed_recv_and_recompute():
    P = PH.Engine(GEMMA)
    D = PH.Engine(GEMMA, extra={"push_recv_timeout": 1.0}, load_failure_policy="recompute")
    try:
        d_params, _ = PH.push_params("late", P.port)
        r = H.make_request("d", _prompt(100), 16, params=d_params, max_tokens=2)
        D.s.add_request(r)
        t0 = time.monotonic()
        PH.step_until(lambda: "d" in D.conn.failed_recving, [D], what="D's deadline")
        assert time.monotonic() - t0 >= 0.9
        assert any("deadline" in e for e in D.w.worker.errors), D.w.worker.errors
        assert D.conn.held_blocks()                   # P may still WRITE: blocks held
        _recomputed(D, r, [P, D])   # P sees the registration and D's cancel, answers it
        assert D.w.worker.counters._data.get("push_cancels_acknowledged") == 1
        assert "late" not in P.conn.registered()      # a late P request is not pushed
    finally:
        P.close()
        D.close()


def test_cancel_after_p_took_the_registration_in_withdraws_it():
    """D's deadline passes after P's scheduler took the registration in (P stepped in
    between; the race a loaded machine produced): the cancel withdraws it, P's request that
    comes later prefills without push at once (no wait for a registration, nothing held)."""
    P = PH.Engine(GEMMA)
    D = PH.Engine(GEMMA, extra={"push_recv_timeout": 1.0}, load_failure_policy="recompute")
    try:
        d_params, p_params = PH.push_params("late2", P.port)
        r = H.make_request("d", _prompt(100), 16, params=d_params, max_tokens=2)
        D.s.add_request(r)
        # D sends its registration (its deadline runs from here, checked only when D steps)
        PH.step_until(lambda: "late2" in D.w.worker._expect, [D], what="D's registration sent")
        PH.step_until(lambda: "late2" in P.conn.registered(), [P], what="P takes it in")
        PH.step_until(lambda: "d" in D.conn.failed_recving, [D], what="D's deadline")
        _recomputed(D, r, [P, D])     # P answers the cancel: the registration is withdrawn
        assert "late2" not in P.conn.registered()
        assert D.w.worker.counters._data.get("push_cancels_acknowledged") == 1
        p = H.make_request("p", _prompt(100), 16, params=p_params, max_tokens=1)
        P.s.add_request(p)
        P.step()
        assert p.num_computed_tokens > 0              # scheduled at once: not held for a push
        PH.step_until(lambda: not P.s.requests, [P], what="P prefills without push")
        assert not P.conn.leases() and not P.w.worker.stats()   # nothing pushed, nothing held
        H.assert_no_leak(P.s)
    finally:
        P.close()
        D.close()


def test_p_gone_after_some_layers_leaves_nothing_valid():
    P = PH.Engine(GEMMA, max_num_batched_tokens=40)
    # a P closed inside this process is not reported disconnected by NIXL: D's cancel is
    # never answered and the hold ends at push_cancel_ack_timeout
    D = PH.Engine(GEMMA, extra={"push_recv_timeout": 3.0, "push_cancel_ack_timeout": 2.0},
                  load_failure_policy="recompute")
    try:
        d_params, p_params = PH.push_params("gone", P.port)
        r = H.make_request("d", _prompt(150), 16, params=d_params, max_tokens=2)
        D.s.add_request(r)
        D.step()
        P.s.add_request(H.make_request("p", _prompt(150), 16, params=p_params, max_tokens=1))
        PH.step_until(lambda: any(m and "p" in m.push_saves for m in P.metas), [P, D],
                      what="P's first pushed step")
        assert not P.metas[-1].push_saves["p"].final
        P.close()                                    # P dies midway (its agent is gone)
        PH.step_until(lambda: "d" in D.conn.failed_recving, [D], timeout=20,
                      what="D's deadline")
        _recomputed(D, r)
        c = D.w.worker.counters._data
        assert not c.get("push_cancels_acknowledged"), c
        if PH.TRANSPORT:
            # Mooncake TE refuses the send to the closed P at once: the push fails as a lost
            # peer before its deadline, so there is no cancel to hold blocks for
            assert c.get("transfer_failures") == 1 and not c.get("push_cancels_unacknowledged"), c
        else:
            assert c.get("push_cancels_unacknowledged") == 1, c
    finally:
        D.close()


def test_d_gone_midway_p_frees_by_lease_end():
    """D dies after P's first pushed step and P's transport hangs (WRITEs never DONE nor
    ERR, notifications neither sent nor refused: a black-holed peer): P's request finishes,
    its blocks are held under the lease and freed when it ends. (A transport that sees the
    death at once, Mooncake TE's refused connection, fails the push instead: no lease.)"""
    P = PH.Engine(GEMMA, extra={"kv_lease_duration": 6.0}, max_num_batched_tokens=40)
    D = PH.Engine(GEMMA)
    try:
        d_params, p_params = PH.push_params("dgone", P.port)
        D.s.add_request(H.make_request("d", _prompt(150), 16, params=d_params, max_tokens=2))
        D.step()
        P.s.add_request(H.make_request("p", _prompt(150), 16, params=p_params, max_tokens=1))
        t0 = P.conn.clock()                          # before any WRITE is posted
        PH.step_until(lambda: any(m and "p" in m.push_saves for m in P.metas), [P, D],
                      what="P's first pushed step")
        D.close()                                    # D dies midway
        P.w.worker.agent.state = lambda handle: "PROC"   # its WRITEs never complete
        P.w.worker.agent.send_notif = lambda remote, msg: None   # nor fail when notifying
        PH.step_until(lambda: "p" in P.conn.leases(), [P], what="P's request finishes")
        PH.step_until(lambda: not P.s.requests, [P], timeout=6.0 + 15, what="P frees")
        # held until the lease on the hung WRITEs ended: it runs from their post, after t0
        # (measured from t0, not from when this test saw the request finish: the 5 s gate
        # on the next step's WRITEs, or a loaded machine, can put that past most of it)
        assert P.conn.clock() >= t0 + 6.0
        H.assert_no_leak(P.s)
        assert P.conn.leases() == {}
        P.step()                                     # the expiry reaches the worker
        assert P.w.worker._pushes == {}              # which dropped the push too
    finally:
        P.close()


def test_registration_never_comes_p_runs_without_push():
    P = PH.Engine(GEMMA, extra={"push_register_timeout": 1.0})
    try:
        _, p_params = PH.push_params("nobody", P.port)
        r = H.make_request("p", _prompt(60), 16, params=p_params, max_tokens=1)
        P.s.add_request(r)
        P.step()
        assert r.num_computed_tokens == 0 and P.conn.held() == {"p"}
        t0 = time.monotonic()
        PH.step_until(lambda: not P.s.requests, [P], what="P runs after the timeout")
        assert time.monotonic() - t0 >= 0.9
        assert all(not m.push_saves for m in P.metas if m)
        H.assert_no_leak(P.s)
    finally:
        P.close()


def test_mode_mismatch_push_decoder_pull_prefiller():
    P = PH.Engine(GEMMA, mode="pull")
    D = PH.Engine(GEMMA, load_failure_policy="recompute")
    try:
        d_params, _ = PH.push_params("mm", P.port)
        r = H.make_request("d", _prompt(50), 16, params=d_params, max_tokens=2)
        D.s.add_request(r)
        PH.step_until(lambda: "d" in D.conn.failed_recving, [D], what="the refused handshake")
        errs = " ".join(D.w.worker.errors)
        assert "transfer_mode mismatch" in errs and "pull" in errs, errs
        _recomputed(D, r)
    finally:
        P.close()
        D.close()


def test_mode_mismatch_pull_decoder_push_prefiller(caplog):
    P = PH.Engine(GEMMA)
    D = PH.Engine(GEMMA, mode="pull", load_failure_policy="recompute")
    try:
        params = H.remote_params("x", D.kcc, 50)
        params["remote_port"] = P.port                # P's push-mode handshake server
        r = H.make_request("x", _prompt(50), 16, params=params, max_tokens=2)
        D.s.add_request(r)
        with caplog.at_level(logging.WARNING):
            PH.step_until(lambda: "x" in D.conn.failed_recving, [D],
                          what="the refused handshake")
        assert "transfer_mode mismatch" in caplog.text
        _recomputed(D, r)
        # P records the pull-mode peer once its handshake thread queued it (after its reply)
        PH.step_until(lambda: any("transfer_mode mismatch" in e for e in P.w.worker.errors),
                      [P], timeout=10, what="P records the mismatch")
    finally:
        P.close()
        D.close()


@pytest.mark.parametrize("extra, needle", [
    ({"transfer_mode": "bulk"}, "kv_connector_extra_config.transfer_mode"),
    ({"transfer_mode": "push", "sync_load": True}, "sync_load"),
    ({"transfer_mode": "push", "push_recv_timeout": 0}, "push_recv_timeout"),
    ({"transfer_mode": "push", "push_register_timeout": "x"}, "push_register_timeout"),
])
def test_bad_config_is_a_clear_error(extra, needle):
    vc = H.vllm_config(extra=extra)
    kcc = H.gemma_like(num_blocks=16)
    with pytest.raises(ValueError, match=needle):
        HmaNixlConnector(vc, KVConnectorRole.SCHEDULER, kcc)


def test_push_with_mamba_groups_and_tp_starts():
    """Push with Mamba groups at TP > 1 is no longer refused at start-up (issue 20 (c)): what a
    pair of engines cannot move is refused per decode peer (test_mamba_tp_refusal_names_the_
    rule; end to end: test_push_tp.py -k "mamba_state or refused_per_peer")."""
    vc = H.vllm_config(extra={"transfer_mode": "push"}, block_size=64, mamba_cache_mode="align",
                       tp=2)
    conn = HmaNixlConnector(vc, KVConnectorRole.SCHEDULER, H.qwen3_next_like(num_blocks=16))
    assert conn.scheduler.tp_size == 2
    assert any(g.kind.name == "MAMBA" for g in conn.scheduler.layout.groups)


def test_mamba_tp_refusal_names_the_rule():
    """_tp.mamba_tp_refusal (both push sides, per peer): equal TP sizes and layouts without
    Mamba pair, and so do Mamba groups with a state geometry across TP sizes (with or without
    a block-size remap); a Mamba group without a state geometry (with the worker's reason,
    remap or not) and a worker without a TP description are refused by name."""
    from hmacore.integrations.vllm.layout import layout_from_kv_cache_config
    from hmacore.integrations.vllm.nixl._tp import WorkerTp, mamba_tp_refusal
    from hmacore.tp import GroupSharding
    import test_state_tp_vllm as STV

    layout = layout_from_kv_cache_config(H.qwen3_next_like(num_blocks=16))
    attn = GroupSharding(2, 1, False)

    def wtp(state, why=()):
        return WorkerTp(0, 2, (attn, GroupSharding(1, 1, True, state=state)), "torch.float16",
                        16, "LBNHC", why)

    geo = wtp(STV.hm_global("gdn", "DS"))
    assert mamba_tp_refusal(layout, geo, 2, 1, False) is None
    assert mamba_tp_refusal(layout, wtp(None), 2, 2, True) is None    # equal TP: whole pages
    gemma = layout_from_kv_cache_config(H.gemma_like(num_blocks=16))
    assert mamba_tp_refusal(gemma, None, 2, 1, True) is None
    # a block-size remap across TP sizes pairs the state geometry's byte ranges
    # (test_push_tp.py::test_mamba_state_remap_across_tp_push_every_byte)
    assert mamba_tp_refusal(layout, geo, 2, 1, True) is None
    assert mamba_tp_refusal(layout, geo, 1, 2, True) is None
    assert mamba_tp_refusal(layout, wtp(None, ("", "mamba_type KDA: not modelled")), 2, 1,
                            True) == (
        "group 1 is Mamba state without a state geometry (mamba_type KDA: not modelled); its "
        "pages pair only between equal TP sizes (a block-size remap included) (this rank: TP "
        "2, peer: TP 1)")
    assert mamba_tp_refusal(layout, wtp(None, ("", "mamba_type KDA: not modelled")), 2, 1,
                            False) == (
        "group 1 is Mamba state without a state geometry (mamba_type KDA: not modelled); its "
        "pages pair only between equal TP sizes (this rank: TP 2, peer: TP 1)")
    assert "(its state type is not modelled across TP sizes)" in \
        mamba_tp_refusal(layout, wtp(None), 1, 2, False)
    assert "(this worker has no TP description)" in mamba_tp_refusal(layout, None, 1, 2, False)


@pytest.mark.parametrize("bad, needle", [
    ({"push_id": "a:b"}, "push_id"),
    ({"push_id": "a@1"}, "without ':' or '@'"),
    ({"push_id": ""}, "push_id"),
    ({"remote_port": "80"}, "remote_port"),
    ({"remote_host": None}, "remote_host"),
    ({"transfer_mode": "pull"}, "transfer_mode"),
])
def test_bad_push_params_run_locally(bad, needle, caplog):
    D = PH.Engine(GEMMA)
    try:
        d_params, _ = PH.push_params("ok", 5999)
        r = H.make_request("d", _prompt(40), 16, params={**d_params, **bad}, max_tokens=2)
        D.s.add_request(r)
        with caplog.at_level(logging.WARNING):
            D.step()
        assert needle in caplog.text
        assert r.status == H.RequestStatus.RUNNING and not D.metas[-1].push_regs
        PH.step_until(lambda: not D.s.requests, [D], what="D computes locally")
        H.assert_no_leak(D.s)
    finally:
        D.close()


def test_d_abort_while_awaiting_keeps_blocks_until_push_ends():
    P = PH.Engine(GEMMA, max_num_batched_tokens=64)
    D = PH.Engine(GEMMA)
    try:
        d_params, p_params = PH.push_params("ab", P.port)
        D.s.add_request(H.make_request("d", _prompt(150), 16, params=d_params, max_tokens=2))
        D.step()                                     # registered, awaiting the push
        D.s.finish_requests("d", H.RequestStatus.FINISHED_ABORTED)
        assert "d" in D.s.requests                   # vLLM keeps its blocks meanwhile
        P.s.add_request(H.make_request("p", _prompt(150), 16, params=p_params, max_tokens=1))
        PH.step_until(lambda: not D.s.requests and not P.s.requests, [P, D],
                      what="the push ends and both engines free")
        H.assert_no_leak(D.s)
        H.assert_no_leak(P.s)
    finally:
        P.close()
        D.close()


@pytest.mark.parametrize("when", ["before_any_step", "midway"])
def test_p_abort_fails_d_and_frees_p(when):
    P = PH.Engine(GEMMA, max_num_batched_tokens=40)
    D = PH.Engine(GEMMA, load_failure_policy="recompute")
    try:
        d_params, p_params = PH.push_params("pab", P.port)
        r = H.make_request("d", _prompt(150), 16, params=d_params, max_tokens=2)
        D.s.add_request(r)
        D.step()
        P.s.add_request(H.make_request("p", _prompt(150), 16, params=p_params, max_tokens=1))
        if when == "midway":
            PH.step_until(lambda: any(m and "p" in m.push_saves for m in P.metas), [P, D],
                          what="P's first pushed step")
        else:
            PH.step_until(lambda: "pab" in P.conn.registered(), [P, D],
                          what="the registration reaches P's scheduler")
        P.s.finish_requests("p", H.RequestStatus.FINISHED_ABORTED)
        # D is checked the step its load fails (stepped on, it recomputes at once), then P
        # alone steps until it frees
        PH.step_until(lambda: "d" in D.conn.failed_recving, [P, D], timeout=15, what="D fails")
        PH.step_until(lambda: not P.s.requests, [P], timeout=15, what="P frees")
        H.assert_no_leak(P.s)
        assert any("prefill side reported" in e for e in D.w.worker.errors), D.w.worker.errors
        _recomputed(D, r, [P, D])     # P answers the cancel D still sends
    finally:
        P.close()
        D.close()
