"""Mamba state hmacore has no state geometry for, end to end, pull and push (issue 20).

vLLM's ShortConv (LFM2's convolution block, ``mamba_type`` SHORT_CONV) is a Mamba type vLLM
really has and hmacore does not model across TP sizes: each rank process builds the real
``ShortConv`` layers in its TP group (tp_rank.short_conv_layers: their ``get_kv_cache_spec``
is the state group's spec) and the connector's ``_compat.mamba_state_geometry`` gives None
with its real reason, "mamba_type SHORT_CONV: state sharding not modelled". Engines as in
test_pd_nixl_tp.py / test_push_tp.py: the real vLLM Scheduler here, one process per TP rank
(vLLM's TP group, WORKER-role connector, CPU pages), real NIXL over loopback.

* Equal TP sizes (P2/D2; P1/D1 slow): the state moves as whole pages (P's state padding
  byte included); every byte of every D rank's state and attention pages is checked, the
  load completes, no block leaks.
* Other TP sizes (P2/D1, P1/D2): refused by name. Pull: each D rank's worker refuses the
  pairing before any handshake (``NixlWorker._check_state_geometry``), logs the rule with
  the real reason, the request's load fails (policy ``fail``), nothing is written into D,
  P frees the request's blocks at its lease's end (D never reached it). Push: P's rank 0
  refuses each decode rank at its handshake server (``mamba_tp_refusal``, recorded in its
  errors) and each D rank records P's rule as its handshake failure: D never registers, P
  prefills without push, D's load fails with every byte of its caches still zero, no leak.
  Then the same engines still move a request at equal TP (which found the P/D role swap bug
  ``NixlAgent.add_notify_peer`` had: tests/nixl/test_nixl_agent.py).
"""
import time

import pytest

import harness as H
from test_pd_nixl_tp import _prefill, pull_state_every_byte
from test_push_tp import PUSH, push_refused, push_state_every_byte, run_out_refused
from tp_harness import PAIRS, engine_pool, run_out_both, zeroed


pytestmark = pytest.mark.nixl

CASE = "short_conv-sd"
#: the real reason _compat.mamba_state_geometry gives for vLLM's ShortConv layers
WHY = "mamba_type SHORT_CONV: state sharding not modelled"

#: engine sets (tp_harness.engine_pool): TP 1, TP 2 and a second TP 2 per transfer mode,
#: and two TP 1 engines per mode for P1/D1 (slow); one set runs at a time
POOLS = {
    "pull": (("tp1", CASE, 1), ("tp2", CASE, 2), ("tp2b", CASE, 2)),
    "pull11": (("tp1", CASE, 1), ("tp1b", CASE, 1)),
    "push": (("tp1", CASE, 1, PUSH), ("tp2", CASE, 2, PUSH), ("tp2b", CASE, 2, PUSH)),
    "push11": (("tp1", CASE, 1, PUSH), ("tp1b", CASE, 1, PUSH)),
}
#: equal TP sizes: (P engine, D engine) of the TP 2 set / the TP 1 set
EQUAL = {2: ("tp2", "tp2b"), 1: ("tp1", "tp1b")}


@pytest.fixture(scope="module")
def engines():
    yield from engine_pool("ng-", pools=POOLS)


def _equal(engines, mode: str, tp: int):
    """(P, D) of equal TP size ``tp`` in ``mode`` ("pull" / "push")."""
    e = engines(mode if tp == 2 else f"{mode}11")
    return tuple(e[k] for k in EQUAL[tp])


def _untouched(D) -> None:
    """Every byte of every layer of every D rank is still zero (nothing was written)."""
    empty = [[] for _ in D.kcc.kv_cache_groups]
    for r, st in enumerate(D.call_all("check", table=empty, loaded=empty)):
        assert st["stray"] == 0, (r, st)


# -- pull ------------------------------------------------------------------------------------


@pytest.mark.parametrize("tp_p,tp_d", [(2, 1), (1, 2)])
def test_no_geometry_across_tp_pull_refused_by_name(engines, tp_p, tp_d):
    """Pull across TP sizes with ShortConv state: every D rank refuses the pairing before
    any handshake, logging the rule with the real reason; D's request fails its load
    (policy ``fail``), nothing is written into D's caches, D leaks nothing. The engines stay
    up: the same D (TP 2) or the same P (TP 2) moves a request at equal TP right after,
    every byte checked. P never heard of D: it frees the refused request's blocks at its
    lease's end (kv_lease_duration), no leak."""
    e = engines("pull")
    P, D = (e[k] for k in PAIRS[(tp_p, tp_d)])
    prompt = zeroed(P, D, (3, 19, 7), tp_p, tp_d)
    rid = f"ng{tp_p}{tp_d}"
    params = _prefill(P, prompt, rid=f"p-{rid}")
    assert params["tp_size"] == tp_p != D.tp
    seen = [len(r.log_text()) for r in D.ranks]
    hbs = H.C.resolve_kv_cache_block_sizes(D.kcc, D.vc)[1]
    req = H.make_request(f"d-{rid}", prompt, hbs, params=params, max_tokens=3)
    D.s.add_request(req)
    deadline = time.monotonic() + 60
    D.step()
    while req.status == H.RequestStatus.WAITING_FOR_REMOTE_KVS:
        assert time.monotonic() < deadline, "the load neither completed nor failed"
        D.step()
        P.step()
    assert req.status == H.RequestStatus.FINISHED_ERROR, req.status
    rule = (f"KV load of d-{rid} failed to start: group 1 is Mamba state without a state "
            f"geometry ({WHY}); its pages pair only between equal TP sizes (this rank: TP "
            f"{tp_d}, engine at 127.0.0.1:{P.port}: TP {tp_p})")
    for r, (rank, at) in enumerate(zip(D.ranks, seen)):
        assert rule in rank.log_text()[at:], (r, rank.log_text()[at:][-2000:])
    _untouched(D)
    D.run_out()
    H.assert_no_leak(D.s)
    # the engines stay up: a request at equal TP through the same D (TP 2) or P (TP 2)
    F_P, F_D = (e["tp2b"], D) if D.tp == 2 else (P, e["tp2b"])
    pull_state_every_byte(F_P, F_D, zeroed(F_P, F_D, (3, 19, 11), tp_p, tp_d), f"ngf{tp_p}{tp_d}")
    run_out_both(F_P, F_D)
    # P's lease on the refused request's blocks ends (nothing told P: D never handshook)
    P.run_out(timeout=2 * P.vc.kv_transfer_config.kv_connector_extra_config[
        "kv_lease_duration"] + 30)
    H.assert_no_leak(P.s)
    assert P.s.connector.scheduler.leases() == {}


@pytest.mark.parametrize("tp", [2, pytest.param(1, marks=pytest.mark.slow)])
def test_no_geometry_equal_tp_pull_every_byte(engines, tp):
    """Pull at equal TP sizes with ShortConv state (no state geometry): whole state pages
    rank to rank, every byte of every D rank's state (content and P's padding byte) and
    attention pages equal P's pattern for that rank, nothing else written; rank 0's bytes
    read as rank 1's differ (control, TP 2); no leak, no lease left."""
    P, D = _equal(engines, "pull", tp)
    pull_state_every_byte(P, D, zeroed(P, D, (5, 23, 3), tp, tp), f"nge{tp}")
    run_out_both(P, D)
    assert P.s.connector.scheduler.leases() == {}


# -- push ------------------------------------------------------------------------------------


@pytest.mark.parametrize("tp_p,tp_d", [(2, 1), (1, 2)])
def test_no_geometry_across_tp_push_refused_by_name(engines, tp_p, tp_d):
    """Push across TP sizes with ShortConv state: refused per decode peer, by name, with the
    real reason, never at start-up. P's rank 0 handshake server refuses each D rank
    (``mamba_tp_refusal``: recorded in P's errors, "this rank" = P); each D rank records P's
    refusal as its handshake failure and never registers (P's other rank never hears of it),
    so P's ranks hold nothing of the push: P's request prefills without push (no push step planned, after
    push_register_timeout), D's request fails its load with every byte of D's caches still
    zero, no leak on either engine. The engines stay up: the same D (TP 2) or the same P
    (TP 2) pushes a request at equal TP right after, every byte checked."""
    e = engines("push")
    P, D = (e[k] for k in PAIRS[(tp_p, tp_d)])
    prompt = zeroed(P, D, (7, 13, 17), tp_p, tp_d)
    errors = [st["errors"] for st in P.call_all("push_state") + D.call_all("push_state")]
    rid = f"ng-push-{tp_p}{tp_d}"
    push_refused(P, D, prompt, rid)
    rule = (f"group 1 is Mamba state without a state geometry ({WHY}); its pages pair only "
            f"between equal TP sizes (this rank: TP {tp_p}, peer: TP {tp_d})")
    # P's rank 0 refused each D rank at its handshake server, by the rule, and recorded it;
    # D's ranks stopped there (P's other rank never heard of them)
    p_states = P.call_all("push_state")
    new = p_states[0]["errors"][len(errors[0]):]
    assert len(new) == D.tp and all(
        x.startswith("handshake refused: decode peer ") and f"refused for push: {rule}" in x
        for x in new), new
    for r, (st, before) in enumerate(zip(p_states, errors)):
        assert r == 0 or st["errors"] == before, (r, st["errors"])
        assert st["regs"] == st["pushes"] == [] and \
            not [x for x in st["stats"] if x["push_id"] == f"push-{rid}"], (r, st)
    # each D rank records P's refusal as its handshake failure and registered nothing
    for r, (st, before) in enumerate(zip(D.call_all("push_state"), errors[P.tp:])):
        new = st["errors"][len(before):]
        assert any("rejected the handshake: decode peer " in x and rule in x for x in new), \
            (r, new)
        assert st["expect"] == [], (r, st)
    run_out_refused(P, D)
    # the engines stay up: a push at equal TP through the same D (TP 2) or P (TP 2)
    F_P, F_D = (e["tp2b"], D) if D.tp == 2 else (P, e["tp2b"])
    push_state_every_byte(F_P, F_D, zeroed(F_P, F_D, (7, 13, 19), tp_p, tp_d), f"ng-pushf-{tp_p}{tp_d}")


@pytest.mark.parametrize("tp", [2, pytest.param(1, marks=pytest.mark.slow)])
def test_no_geometry_equal_tp_push_every_byte(engines, tp):
    """Push at equal TP sizes with ShortConv state (no state geometry): each P rank WRITEs
    whole state pages and its attention pages into its own D rank; every byte of every D
    rank equals P's pattern for that rank (state padding: P's byte, copied), nothing else
    written; rank 0 read as rank 1 differs (control, TP 2); every P rank's push ended ok
    with its one consumer; no leak, no new error on either engine."""
    P, D = _equal(engines, "push", tp)
    push_state_every_byte(P, D, zeroed(P, D, (11, 5, 3), tp, tp), f"ng-pushe-{tp}")
