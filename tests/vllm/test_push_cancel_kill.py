"""A cancelled push whose prefill engine dies: the prefill engine is a whole engine in its own
process (push_peer_proc.py: real vLLM Scheduler, real NIXL), SIGKILLed by PID while three
decode engines in this process (real vLLM Schedulers, real NIXL) hold cancels of its pushes.

1. P registers the three pushes, pushes the first chunk of one of them, then stalls (not
   stepped; its process and NIXL agent stay alive). Each D's ``push_recv_timeout`` passes:
   the request fails at once (``recompute``: re-run locally; ``fail``: ended) and D pins
   the registered blocks in vLLM's block pool (a stalled P may still WRITE into them).
2. While P lives, D keeps them pinned through several liveness pings; other requests that
   take every other block get none of them.
3. P is SIGKILLed. The two decode engines stepped on find the dead agent at their next ping
   and release the blocks (``push_cancels_unacknowledged``); nothing leaks.
4. The third decode engine is not stepped while a new P process takes over the same port
   with a new engine id. Its first step with a new push request for that address finds
   the old agent gone, releases the old hold, handshakes the new engine afresh and gets
   the whole prompt pushed by it (every byte checked).

Each wait is bounded; both prefill processes are stopped by PID.
"""
import os
import time

import pytest

import harness as H
import push_harness as PH
from ports import free_port
from tp_harness import RankProc

from hmacore.integrations.vllm.nixl.push_worker import PEER_CHECK_INTERVAL_S

pytestmark = pytest.mark.nixl

PEER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "push_peer_proc.py")
GEMMA = lambda: H.gemma_like(num_blocks=64)  # noqa: E731
N = 150                     # prompt tokens: P (budget 40 per step) pushes them in 4 steps
ACK_S = 120.0               # push_cancel_ack_timeout: far beyond every wait below
#: D's push_recv_timeout per decode engine; the restarted P must push "b"'s second
#: request within its value
DECODERS = {"rec": ("recompute", 5.0), "fail": ("fail", 5.0), "b": ("recompute", 10.0)}


def _prompt(base: int, n: int = N) -> list[int]:
    return [base + i % 800 for i in range(n)]


def _registered_blocks(D, rid: str) -> set[int]:
    return {b for g in PH.registration(D, rid).block_ids for b in g if b}


def _refs(D, blocks) -> list[int]:
    return [D.s.kv_cache_manager.block_pool.blocks[b].ref_cnt for b in blocks]


def _peer(name: str) -> RankProc:
    return RankProc({"rank": name}, timeout=240.0, script=PEER)


def _step_all(Ds, until, what: str, timeout: float = 30.0, also=None) -> None:
    deadline = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < deadline, f"{what} not reached within {timeout} s"
        for D in Ds:
            D.step()
        if also is not None:
            also()


@pytest.fixture(scope="module")
def scenario():
    port = free_port()
    p1, p2 = _peer("push-kill-p1"), _peer("push-kill-p2")   # both import vLLM meanwhile
    Ds: dict = {}
    out: dict = {"port": port}
    try:
        for name, (policy, recv) in DECODERS.items():
            Ds[name] = PH.Engine(GEMMA, load_failure_policy=policy,
                                 extra={"push_recv_timeout": recv, "push_cancel_ack_timeout": ACK_S})
        for p in (p1, p2):
            p.read()
        out["p1"] = p1.call("start", port=port, budget=40)
        # -- 1. P registers the three pushes and pushes a first chunk of one; then stalls
        reqs, p_params = {}, {}
        for i, (name, D) in enumerate(Ds.items()):
            d_params, p_params[name] = PH.push_params(f"kill-{name}", port)
            reqs[name] = H.make_request(f"d-{name}", _prompt(1 + 7 * i), 16, params=d_params,
                                        max_tokens=2)
            D.s.add_request(reqs[name])
        state: dict = {"pushed": {}}

        def step_p1():
            state.update(p1.call("step"))
        _step_all(Ds.values(), lambda: len(state.get("registered", ())) == 3,
                  "P registers the three pushes", also=step_p1)
        for i, name in enumerate(Ds):
            p1.call("add", rid=f"p-{name}", prompt=_prompt(1 + 7 * i), params=p_params[name])
        step_p1()
        assert state["pushed"] == {"p-rec": False}, state      # P is mid-push, then stalls
        out["stalled_at"] = time.monotonic()
        held = {name: _registered_blocks(D, f"d-{name}") for name, D in Ds.items()}
        # -- each D's deadline passes: the request fails at once, the blocks stay pinned
        failed: dict = {}        # name -> (seconds after the stall, status) when it failed

        def note_failures():
            for name, r in reqs.items():
                if name not in failed and r.status != H.RequestStatus.WAITING_FOR_REMOTE_KVS:
                    failed[name] = (time.monotonic() - out["stalled_at"], r.status)
        _step_all(Ds.values(), lambda: len(failed) == len(reqs), "every D's deadline",
                  also=note_failures)
        for D in Ds.values():
            D.step()
        out["failed"] = failed
        out["pinned"] = {name: set(D.conn.held_blocks()) for name, D in Ds.items()}
        out["held"] = held
        out["holds"] = {name: D.w.worker.holds() for name, D in Ds.items()}
        # -- 2. P alive: the hold lasts through several pings; others get no held block
        rec = Ds["rec"]
        xs = [f"x{i}" for i in range(6)]          # more than the pool holds
        for i, x in enumerate(xs):
            rec.s.add_request(H.make_request(x, _prompt(300 + 11 * i), 16, max_tokens=3000))
        t = time.monotonic()
        _step_all([rec, Ds["fail"]], lambda: time.monotonic() - t > 4 * PEER_CHECK_INTERVAL_S,
                  "pings")
        out["alive_pinned"] = {n: set(Ds[n].conn.held_blocks()) for n in ("rec", "fail")}
        out["alive_refs"] = {n: _refs(Ds[n], held[n]) for n in ("rec", "fail")}
        out["others"] = {b for rid in xs if rid in rec.s.requests
                         for g in rec.s.kv_cache_manager.get_block_ids(rid) for b in g if b}
        out["free_while_held"] = H.free_blocks(rec.s)
        out["starved"] = [x for x in xs if x in rec.s.requests
                          and rec.s.requests[x].status != H.RequestStatus.RUNNING]
        # -- 3. SIGKILL P: the stepped decode engines release at their next ping
        p1.proc.kill()
        p1.proc.wait(timeout=30)
        out["p1_exit"] = p1.proc.returncode
        killed = time.monotonic()
        _step_all([rec, Ds["fail"]], lambda: not rec.conn.held_blocks()
                  and not Ds["fail"].conn.held_blocks(), "release after the kill", timeout=20)
        out["released_after"] = time.monotonic() - killed
        out["counters"] = {n: dict(Ds[n].w.worker.counters._data) for n in ("rec", "fail")}
        rec.s.finish_requests(xs, H.RequestStatus.FINISHED_ABORTED)
        _step_all([rec, Ds["fail"]], lambda: not rec.s.requests and not Ds["fail"].s.requests,
                  "the failed requests settle", timeout=60)
        out["final_status"] = {n: reqs[n].status for n in ("rec", "fail")}
        for n in ("rec", "fail"):
            H.assert_no_leak(Ds[n].s)
        # -- 4. a new P (new engine id) on the same port; D "b" was not stepped meanwhile
        b = Ds["b"]
        out["b_holds_before"] = b.w.worker.holds()
        out["p2"] = p2.call("start", port=port, budget=256)
        d_params, p_params = PH.push_params("kill-b2", port)
        r2 = H.make_request("d-b2", _prompt(500), 16, params=d_params, max_tokens=2)
        p2.call("add", rid="p-b2", prompt=_prompt(500), params=p_params)
        b.s.add_request(r2)
        b.forward = False         # D's pages of the new request get only what P2 WRITEs
        _step_all([b], lambda: r2.status != H.RequestStatus.WAITING_FOR_REMOTE_KVS
                  and "d-b2" in {r for m in b.metas for r in getattr(m, "push_regs", {})},
                  "the new P's push", timeout=60, also=lambda: p2.call("step"))
        out["b_after"] = dict(holds=b.w.worker.holds(), pinned=set(b.conn.held_blocks()),
                              counters=dict(b.w.worker.counters._data),
                              sources=[s.names for k, s in b.w.worker._sources.items()
                                       if k == ("127.0.0.1", port)],
                              computed=r2.num_computed_tokens, status=r2.status,
                              bad=PH.bad_pages(b, PH.registration(b, "d-b2").block_ids,
                                               PH.registration(b, "d-b2").num_tokens))
        b.forward = True
        _step_all([b], lambda: not b.s.requests, "D b finishes", timeout=60,
                  also=lambda: state.update(p2.call("step")))
        H.assert_no_leak(b.s)
        deadline = time.monotonic() + 30
        while state["requests"] or state["free"] != state["blocks"] - 1:
            assert time.monotonic() < deadline, state
            state.update(p2.call("step"))
        out["p2_state"] = state
        out["b_final"] = reqs["b"].status
        yield out
    finally:
        for p in (p1, p2):
            try:
                if p.proc.poll() is None:
                    p.proc.stdin.write('{"op": "quit"}\n')
                    p.proc.stdin.flush()
                    p.proc.wait(timeout=10)
            except Exception:  # noqa: BLE001 - a dead or stuck process is killed below
                pass
            p.kill()
        for D in Ds.values():
            D.close()


def test_deadline_fails_the_request_and_pins_the_blocks(scenario):
    s = scenario
    # at D's deadline (5 / 10 s after P stalled), long before P's answer could end it
    assert all(after < DECODERS[n][1] + 15 for n, (after, _) in s["failed"].items()), s["failed"]
    assert s["failed"]["rec"][1] in (H.RequestStatus.RUNNING, H.RequestStatus.WAITING)
    assert s["failed"]["b"][1] in (H.RequestStatus.RUNNING, H.RequestStatus.WAITING)
    assert s["failed"]["fail"][1] == H.RequestStatus.FINISHED_ERROR
    for name in DECODERS:
        assert s["held"][name] and s["pinned"][name] == s["held"][name], name
        assert list(s["holds"][name]) == [f"kill-{name}"], s["holds"]


def test_held_while_the_prefill_engine_lives(scenario):
    s = scenario
    for n in ("rec", "fail"):
        assert s["alive_pinned"][n] == s["held"][n]
        assert min(s["alive_refs"][n]) >= 1
    assert s["others"] and not s["others"] & s["held"]["rec"]
    # the pool ran short (requests left waiting, fewer free blocks than D holds): freed held
    # blocks would have been handed out
    assert s["starved"] and s["free_while_held"] < len(s["held"]["rec"]), s["starved"]


def test_sigkilled_prefill_releases_the_hold(scenario):
    s = scenario
    assert s["p1_exit"] == -9
    assert s["released_after"] < 20
    print(f"released {s['released_after']:.2f} s after the SIGKILL; requests failed "
          f"{ {n: round(t, 1) for n, (t, _) in s['failed'].items()} } s after P stalled")
    for n in ("rec", "fail"):
        c = s["counters"][n]
        assert c.get("push_cancels_unacknowledged") == 1, c
        assert not c.get("push_cancels_acknowledged"), c
    assert s["final_status"]["rec"] == H.RequestStatus.FINISHED_LENGTH_CAPPED
    assert s["final_status"]["fail"] == H.RequestStatus.FINISHED_ERROR


def test_restart_with_a_new_engine_id_releases_the_old_hold(scenario):
    s = scenario
    assert s["p2"]["port"] == s["p1"]["port"]
    assert s["p2"]["engine_id"] != s["p1"]["engine_id"]
    assert list(s["b_holds_before"]) == ["kill-b"]      # still held when P came back
    a = s["b_after"]
    assert a["holds"] == {} and a["pinned"] == set()
    assert a["counters"].get("push_cancels_unacknowledged") == 1, a["counters"]
    assert not a["counters"].get("push_cancels_acknowledged"), a["counters"]
    assert a["sources"] == [(s["p2"]["agent"],)]        # handshaken afresh, old agent dropped
    assert a["computed"] >= N - 1 and a["bad"] == [], a       # the new P pushed every byte
    assert a["counters"].get("loads") == 1, a["counters"]
    assert s["b_final"] == H.RequestStatus.FINISHED_LENGTH_CAPPED
    p2 = s["p2_state"]
    assert p2["errors"] == [] and p2["stats"] == [{"push_id": "kill-b2", "ok": True,
                                                  "steps": 1}], p2
