"""Push mode is exact like pull: after D gives up on a push (its ``push_recv_timeout``), no WRITE
of P lands in a block D gave to another request. Two in-process engines (real vLLM Scheduler,
real NIXL, paged DRAM KV): P's worker is stalled after its first pushed step (P not stepped,
as the pull test ``test_read_finished_after_the_lease_ended_is_a_failed_load`` stalls it),
D's deadline passes, D fails the request at once (both ``kv_load_failure_policy`` values) and
sends CANCEL, but keeps the registered blocks pinned in vLLM's block pool. P then resumes: its
next step still WRITEs into those blocks (it reads the CANCEL after its forward pass), then
answers CANCELLED once none of its WRITEs is in flight, and only then D frees the blocks.

Memory check: every block D handed to another request while the hold lasted is filled with a
marker and must still hold it after P's late WRITEs and the release. The same scenario with
the hold disabled (D frees at cancel, the behaviour before) must show clobbered markers."""
import time

import numpy as np
import pytest

import harness as H
import push_harness as PH
from hmacore.demo.paged_memory import _write_pages, read_pages

pytestmark = pytest.mark.nixl

GEMMA = lambda: H.gemma_like(num_blocks=64)  # noqa: E731
MARK = 0x55


def _prompt(n, base=1):
    return [base + i % 900 for i in range(n)]


def _pages(E, ids):
    """{(layer, block): bytes} of every layer's page of blocks ``ids`` (a group's layers only
    hold that group's blocks, but reading every layer is harmless: same pool of ids)."""
    out = {}
    for g, spec in enumerate(E.layout.groups):
        for layer in spec.layer_names:
            for b in ids:
                out[(layer, b)] = read_pages(E.paged.kv_caches[layer], [b])[0].copy()
    return out


def _mark(E, ids):
    for spec in E.layout.groups:
        for layer in spec.layer_names:
            for b in ids:
                page = read_pages(E.paged.kv_caches[layer], [b])[0]
                page[...] = MARK
                _write_pages(E.paged.kv_caches[layer], [b], page[None])


def _tables(E):
    """Every block id the requests D runs hold now."""
    mgr = E.s.kv_cache_manager
    return {b for rid in E.s.requests for g in mgr.get_block_ids(rid) for b in g if b}


def _late_write(policy, *, hold=True, p_dies=False, stuck=False):
    """Run the scenario; returns what the checks need."""
    P = PH.Engine(GEMMA, max_num_batched_tokens=40)
    extra = {"push_recv_timeout": 2.0, "push_cancel_ack_timeout": 120.0}
    D = PH.Engine(GEMMA, extra=extra, load_failure_policy=policy)
    try:
        if not hold:          # the mutant: D frees the blocks at cancel (no pin)
            D.conn._hold = lambda holding, released: None
        d_params, p_params = PH.push_params("late", P.port)
        r = H.make_request("d", _prompt(150), 16, params=d_params, max_tokens=2)
        D.s.add_request(r)
        D.step()
        P.s.add_request(H.make_request("p", _prompt(150), 16, params=p_params, max_tokens=1))
        PH.step_until(lambda: any(m and "p" in m.push_saves for m in P.metas), [P, D],
                      what="P's first pushed step")
        assert not P.metas[-1].push_saves["p"].final
        held = {b for g in PH.registration(D, "d").block_ids for b in g if b}
        # P's worker stalls (P not stepped) past D's deadline: D fails the request promptly
        t0 = time.monotonic()
        PH.step_until(lambda: "d" in D.conn.failed_recving, [D], timeout=20,
                      what="D's deadline")
        failed_after = time.monotonic() - t0
        D.forward = False     # from here D's pages are only what the check writes
        D.step()              # vLLM acts on the failure (recompute: re-allocates; fail: ends)
        status = r.status
        pinned = set(D.conn.held_blocks())
        refs = [D.s.kv_cache_manager.block_pool.blocks[b].ref_cnt for b in held]
        # other requests take every block they can get while the hold lasts (a block D
        # gave back is reused for sure)
        xs = [f"x{i}" for i in range(6)]    # more than the pool holds: none ends here
        for i, x in enumerate(xs):
            D.s.add_request(H.make_request(x, _prompt(150, 7 + i), 16, max_tokens=400))
        for _ in range(8):
            D.step()
        others = _tables(D)
        _mark(D, others)
        before = _pages(D, held)
        if p_dies:
            # NIXL reports a dead prefill agent at the next send (NIXL_ERR_REMOTE_DISCONNECT):
            # D's liveness ping of the source it holds a cancel for sees it
            names = set(next(iter(D.w.worker._sources.values())).names)
            send = D.w.worker.agent.send_notif

            def dead(name, msg):
                if name in names:
                    raise RuntimeError("nixlRemoteDisconnectError: NIXL_ERR_REMOTE_DISCONNECT")
                return send(name, msg)
            D.w.worker.agent.send_notif = dead
            PH.step_until(lambda: not D.w.worker.holds() and not D.conn.held_blocks(),
                          [D], timeout=20, what="D releases after finding P dead")
            P.w.worker.agent.send_notif = lambda *a: None      # the dead P says nothing
        else:
            if stuck:
                # P's late WRITEs stay in flight (NIXL never reports them DONE): P must not
                # answer the cancel, D keeps holding
                agent = P.w.worker.agent
                agent.state = lambda handle: "PROC"
                PH.step_until(lambda: any(P.w.worker.pusher.in_flight(s)
                                          for s in P.w.worker.pusher.requests),
                              [P, D], timeout=30, what="P's late WRITEs posted")
                for _ in range(10):
                    P.step()
                    D.step()
                assert D.w.worker.holds() and D.conn.held_blocks() == held
                assert not P.w.worker.counters._data.get("push_cancels_answered")
                del agent.state                    # the WRITEs end: P answers now
            PH.step_until(lambda: not D.w.worker.holds() and not D.conn.held_blocks(),
                          [P, D], timeout=30, what="P answers the cancel and D releases")
        after_mark = _pages(D, others)
        clobbered = sorted({b for (layer, b), page in after_mark.items()
                            if not (page == MARK).all()})
        changed = sorted({b for k, page in _pages(D, held).items()
                          if not np.array_equal(page, before[k]) for b in [k[1]]})
        counters = dict(D.w.worker.counters._data)
        D.s.finish_requests(xs, H.RequestStatus.FINISHED_ABORTED)
        D.forward = True
        PH.step_until(lambda: not D.s.requests and not P.s.requests, [P, D], timeout=60,
                      what="both engines finish")
        H.assert_no_leak(D.s)
        H.assert_no_leak(P.s)
        return dict(status=status, failed_after=failed_after, held=held, pinned=pinned,
                    refs=refs, others=others, clobbered=clobbered, changed=changed,
                    counters=counters, r=r)
    finally:
        P.close()
        D.close()


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_cancelled_push_holds_blocks_until_p_answers(policy):
    out = _late_write(policy)
    assert out["failed_after"] < 15                   # the deadline, not P's answer
    if policy == "recompute":
        assert out["status"] in (H.RequestStatus.RUNNING, H.RequestStatus.WAITING)
        assert out["r"].status == H.RequestStatus.FINISHED_LENGTH_CAPPED
    else:
        assert out["status"] == H.RequestStatus.FINISHED_ERROR
    # held while P was stalled: pinned in vLLM's pool, given to no other request
    assert out["pinned"] == out["held"] and out["held"]
    assert min(out["refs"]) >= 1
    assert not out["held"] & out["others"]
    # P's late step did WRITE into the held blocks after the cancel ...
    assert out["changed"], "P wrote nothing after D's cancel: the scenario proves nothing"
    # ... and nothing landed in a block another request holds
    assert out["clobbered"] == []
    assert out["counters"].get("push_cancels_acknowledged") == 1, out["counters"]
    assert not out["counters"].get("push_cancels_unacknowledged"), out["counters"]


def test_without_the_hold_a_late_write_lands_in_a_reused_block():
    # the mutant (D frees the blocks at cancel, as before): the check above sees it
    out = _late_write("recompute", hold=False)
    assert out["held"] & out["others"]
    assert out["clobbered"], "the late WRITE should have clobbered a reused block"


def test_p_found_dead_releases_the_hold():
    out = _late_write("recompute", p_dies=True)
    assert out["pinned"] == out["held"]
    assert out["clobbered"] == [] and out["changed"] == []
    assert out["counters"].get("push_cancels_unacknowledged") == 1, out["counters"]
    assert not out["counters"].get("push_cancels_acknowledged"), out["counters"]


def test_p_answers_only_once_its_writes_ended():
    # (the WRITEs kept in flight may be step 0's last ones, posted before the cancel: no
    # "changed" check here; the other tests show late WRITEs landing in held blocks)
    out = _late_write("recompute", stuck=True)
    assert out["clobbered"] == []
    assert out["counters"].get("push_cancels_acknowledged") == 1, out["counters"]
