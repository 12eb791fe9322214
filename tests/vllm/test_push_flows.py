"""Layer-wise push mode (decode first) between two engines in one process: vLLM's real
Scheduler + HmaNixlConnector on both sides, real NIXL (UCX, DRAM).

D registers its blocks, P is held until the registration arrives, then P's worker WRITEs
every layer of every step's computed block positions into D's blocks as the (simulated)
forward pass produces them. Checked: every byte of every block D asked for (pattern by
token position, so partly filled blocks re-written in a later step are covered), that P
was held before the registration, that nothing leaks on either side.
"""
import time

import pytest

import harness as H
import push_harness as PH

from hmacore.integrations.vllm import _compat as C

pytestmark = pytest.mark.nixl

CASES = {
    # name: (engine kwargs, KV cache config, prompt tokens, P's token budget per step)
    "gemma-1step": (dict(), lambda: H.gemma_like(num_blocks=64), 150, 256),
    "gemma-chunk64": (dict(), lambda: H.gemma_like(num_blocks=64), 150, 64),
    "gemma-chunk40": (dict(), lambda: H.gemma_like(num_blocks=64), 150, 40),
    "gemma-short": (dict(), lambda: H.gemma_like(num_blocks=64), 37, 64),
    "dsv4-chunk200": (dict(), lambda: H.dsv4_like(num_blocks=600), 600, 200),
    "qwen3next-1step": (dict(block_size=64, mamba_cache_mode="align"),
                        lambda: H.qwen3_next_like(num_blocks=64), 200, 256),
    "qwen3next-chunk64": (dict(block_size=64, mamba_cache_mode="align"),
                          lambda: H.qwen3_next_like(num_blocks=64), 200, 64),
    # vLLM 0.33 allows Mamba "none" mode only with prefix caching off (its MambaManager asserts)
    "qwen3next-none-chunk64": (dict(block_size=64, mamba_cache_mode="none",
                                    **({"prefix_caching": False} if C.AT_LEAST_033 else {})),
                               lambda: H.qwen3_next_like(num_blocks=64, mode="none"), 200, 64),
}


def _expected_steps(P, n: int, budget: int) -> int:
    """P's prefill steps: P computes the prompt less the backoff D recomputes (1 token with
    Mamba groups); in Mamba align mode vLLM cuts a chunk of more than one block at its last
    block boundary (so the state of every full block is kept) and computes the tail after."""
    left, steps = n - P.conn.backoff, 0
    bs = P.layout.groups[0].block_size
    align = any(s.kind.name == "MAMBA" and s.mamba_mode.value == "align" for s in P.layout.groups)
    while left > 0:
        c = min(budget, left)
        if align and c >= bs:
            c -= c % bs
        left -= c
        steps += 1
    return steps


def _engines(case):
    vkw, make, n, budget = CASES[case]
    P = PH.Engine(make, max_num_batched_tokens=budget, **vkw)
    D = PH.Engine(make, max_num_batched_tokens=max(budget, 256) if "dsv4" not in case
                  else 1024, **vkw)
    return P, D, n


def _check_bytes(D, rid):
    reg = PH.registration(D, rid)
    n = reg.num_tokens
    assert reg.awaiting
    assert sum(1 for g in reg.block_ids for b in g if b) > 0
    # every block D asked for holds P's bytes (the pattern of its token positions) for every
    # computed token, in every layer
    assert PH.bad_pages(D, reg.block_ids, n) == []
    # sliding groups asked only for their window: at most cdiv(window, bs) + 1 positions;
    # Mamba groups for one state slot, the block holding the state after the n loaded tokens
    for g, spec in zip(reg.block_ids, D.layout.groups):
        if spec.sliding_window:
            assert sum(1 for b in g if b) <= -(-spec.sliding_window // spec.block_size) + 1
        if spec.kind.name == "MAMBA":
            assert [p for p, b in enumerate(g) if b] == [(n - 1) // spec.block_size]
    return reg


def _check_counts(P, steps):
    """P's stats count what its layer WRITEs moved: one transfer per (step, layer) with
    blocks, exactly the bytes and per-block descriptors of the PushSaves' pages in P's plan
    (either transport), never more descriptors than per block."""
    w = P.w.worker
    rows = w.plan.descriptors()
    want = {"transfers": 0, "transfer_bytes": 0, "transfer_block_descriptors": 0}
    for save in steps:
        for layer in w.layers.layers:
            ids = w.layers.desc_ids(layer, save.local_block_ids)
            if ids.size:
                want["transfers"] += 1
                want["transfer_bytes"] += int(rows[ids, 1].sum())
                want["transfer_block_descriptors"] += int(ids.size)
    got = P.w.get_kv_connector_stats().data
    assert {k: got.get(k) for k in want} == want, (got, want)
    assert 0 < got["transfer_descriptors"] <= got["transfer_block_descriptors"], got


def _finish(P, D, rid):
    PH.step_until(lambda: not D.s.requests, [D], what="D finishes")
    H.assert_no_leak(D.s)
    PH.step_until(lambda: not P.s.requests, [P], what="P frees its blocks")
    H.assert_no_leak(P.s)
    assert P.conn.leases() == {} and P.conn.registered() == set()


@pytest.mark.parametrize("order", ["d_first", "p_first"])
@pytest.mark.parametrize("case", list(CASES))
def test_push_moves_every_byte(case, order):
    P, D, n = _engines(case)
    try:
        prompt = [1 + i % 900 for i in range(n)]
        d_params, p_params = PH.push_params("push-1", P.port)
        hbs = H.C.resolve_kv_cache_block_sizes(D.kcc, D.vc)[1]
        d_req = H.make_request("d-req", prompt, hbs, params=d_params, max_tokens=3)
        p_req = H.make_request("p-req", prompt, hbs, params=p_params, max_tokens=1)
        if order == "d_first":
            D.s.add_request(d_req)
            D.step()                                 # registration sent to P
            P.s.add_request(p_req)
        else:
            P.s.add_request(p_req)
            for _ in range(3):
                P.step()                             # held: nothing scheduled without D
            assert p_req.num_computed_tokens == 0 and P.conn.held() == {"p-req"}
            D.s.add_request(d_req)
            D.step()
        assert d_req.status == H.RequestStatus.WAITING_FOR_REMOTE_KVS
        PH.step_until(lambda: "d-req" not in D.conn.awaiting(), [P, D],
                      what="the push completes")
        assert "d-req" not in D.conn.failed_recving
        _check_bytes(D, "d-req")
        steps = [m.push_saves["p-req"] for m in P.metas if m and "p-req" in m.push_saves]
        assert [s.step for s in steps] == list(range(len(steps)))
        assert steps[-1].final and not any(s.final for s in steps[:-1])
        assert len(steps) == _expected_steps(P, n, CASES[case][3])
        # P follows p-req until its final WRITE is planned (inside schedule()): every
        # earlier push step's table was checked against vLLM's
        assert P.mirror_checks >= len(steps) - 1
        # every push step's WRITE pairs equal the per-request pairing of vLLM's own table
        assert P.save_checks == len(steps)
        _check_counts(P, [m["p-req"] for m in P.planned if "p-req" in m])
        stats = P.w.stats()
        assert stats and stats[-1]["ok"] and stats[-1]["push_id"] == "push-1", stats
        assert stats[-1]["steps"] == len(steps)
        assert stats[-1]["forward_end"] > 0 and stats[-1]["write_after_forward_ms"] is not None
        _finish(P, D, "d-req")
        assert d_req.status == H.RequestStatus.FINISHED_LENGTH_CAPPED
    finally:
        P.close()
        D.close()


def test_two_pushes_in_one_batch():
    P, D, _ = _engines("gemma-chunk64")
    try:
        reqs = []
        for k, n in enumerate((100, 70)):
            prompt = [1 + (i * (k + 3)) % 900 for i in range(n)]
            d_params, p_params = PH.push_params(f"push-{k}", P.port)
            D.s.add_request(H.make_request(f"d{k}", prompt, 16, params=d_params, max_tokens=2))
            reqs.append(H.make_request(f"p{k}", prompt, 16, params=p_params, max_tokens=1))
        D.step()
        for r in reqs:
            P.s.add_request(r)
        PH.step_until(lambda: not D.conn.awaiting(), [P, D], what="both pushes complete")
        for k in range(2):
            _check_bytes(D, f"d{k}")
        _finish(P, D, None)
    finally:
        P.close()
        D.close()


@pytest.mark.parametrize("case", ["gemma-chunk40", "qwen3next-chunk64", "dsv4-chunk200"])
def test_push_survives_preemption_mid_prompt(case):
    """vLLM preempts P's push request mid-prompt (``reset_prefix_cache`` with running
    requests: every running request preempted, its blocks freed, the prefix cache emptied)
    and resumes it with a new table: the scheduler output's resumed entry is its WHOLE
    table, which replaces P's worker's table instead of being appended. The push restarts
    from token 0 in the new blocks; every byte D asked for arrives; nothing leaks."""
    P, D, n = _engines(case)
    try:
        prompt = [1 + i % 900 for i in range(n)]
        d_params, p_params = PH.push_params("push-pre", P.port)
        hbs = H.C.resolve_kv_cache_block_sizes(D.kcc, D.vc)[1]
        d_req = H.make_request("d-req", prompt, hbs, params=d_params, max_tokens=3)
        p_req = H.make_request("p-req", prompt, hbs, params=p_params, max_tokens=1)
        D.s.add_request(d_req)
        D.step()
        P.s.add_request(p_req)
        PH.step_until(lambda: any(m and "p-req" in m.push_saves for m in P.metas), [P, D],
                      what="P's first push step")
        first = [list(map(int, g)) for g in P.s.kv_cache_manager.get_block_ids("p-req")]
        assert not P.metas[-1].push_saves["p-req"].final
        assert P.s.reset_prefix_cache(reset_running_requests=True)
        assert p_req.num_preemptions == 1
        PH.step_until(lambda: "d-req" not in D.conn.awaiting(), [P, D], timeout=60,
                      what="the push completes")
        sent = [m.push_saves["p-req"] for m in P.metas if m and "p-req" in m.push_saves]
        resumed = [s for s in sent[1:] if s.full]
        assert len(resumed) == 1 and resumed[0].start == 0      # the whole table again
        again = [list(map(int, g)) for g in P.s.kv_cache_manager.get_block_ids("p-req")]
        assert again != first[:len(again)], "the resumed request was meant to get new blocks"
        assert "d-req" not in D.conn.failed_recving
        _check_bytes(D, "d-req")
        assert P.save_checks == len(sent) and P.mirror_checks >= len(sent) - 1
        _finish(P, D, "d-req")
        assert len(P.w.worker.tables) == 0
    finally:
        P.close()
        D.close()


# (case, shared prefix tokens, A's prompt tokens, B's prompt tokens, P's local hit on B,
#  P's push steps of B)
PREFIX_HIT = {
    # full + sliding window 64 (bs 16): a hit of 6 blocks, then 2 steps ([0, 136), [136, 150));
    # the full group wants positions 0..9 (0..5 from P's hit), the sliding group its window's
    # 5..9 (5 from P's hit; P's hit blocks 0..1 are nulled out of the window, not needed)
    "gemma-chunk40": (100, 130, 150, 96, 2),
    # full + Mamba in align mode (bs 64): vLLM keeps the state at every block boundary, so
    # B hits 2 blocks (the state after token 128 included); D wants full positions 0..3
    "qwen3next-chunk64": (150, 170, 200, 128, 2),
    # five groups (bs 256, 64, 64, 4, 8): a hit of 512 tokens (vLLM's hit is a multiple of
    # every group's block size); the SWA groups' and C128's windows reach into the hit
    "dsv4-chunk200": (520, 560, 600, 512, 1),
}


@pytest.mark.parametrize("case", list(PREFIX_HIT))
def test_push_with_local_prefix_hit_on_p(case):
    """P first serves a plain request A, so its full blocks are in P's prefix cache; then
    push request B shares A's first blocks: vLLM's scheduler on P gives B a local hit, P
    computes only the rest, and its first pushed step's span starts at token 0 so the hit
    blocks reach D too. Every byte D asked for arrives, in every group and layer."""
    shared, n_a, n_b, hit, num_steps = PREFIX_HIT[case]
    P, D, _ = _engines(case)
    try:
        hbs = H.C.resolve_kv_cache_block_sizes(D.kcc, D.vc)[1]
        common = [1 + i % 900 for i in range(shared)]
        a = H.make_request("a-req", common + [901 + i for i in range(n_a - shared)], hbs,
                           max_tokens=1)
        P.s.add_request(a)
        PH.step_until(lambda: not P.s.requests, [P], what="P serves A")
        H.assert_no_leak(P.s)
        prompt = common + [950 + i for i in range(n_b - shared)]
        d_params, p_params = PH.push_params("push-hit", P.port)
        d_req = H.make_request("d-req", prompt, hbs, params=d_params, max_tokens=3)
        p_req = H.make_request("p-req", prompt, hbs, params=p_params, max_tokens=1)
        D.s.add_request(d_req)
        D.step()                                     # registration sent to P
        P.s.add_request(p_req)
        deadline = time.monotonic() + 30
        while True:                  # held until D's registration arrives, then the local hit
            so = P.step()
            if "p-req" in so.num_scheduled_tokens:
                break
            assert time.monotonic() < deadline, ("P never scheduled B", P.conn.held())
            D.step()
        # what P had computed when it first scheduled B: its local hit
        first = p_req.num_computed_tokens - so.num_scheduled_tokens["p-req"]
        assert first == hit, (first, hit)
        save0 = P.metas[-1].push_saves["p-req"]
        PH.step_until(lambda: "d-req" not in D.conn.awaiting(), [P, D],
                      what="the push completes")
        assert "d-req" not in D.conn.failed_recving
        reg = _check_bytes(D, "d-req")
        # (the hit's tokens are in the first pushed step's span: it starts at token 0)
        assert save0.step == 0 and save0.start == 0 and save0.end > hit, save0
        assert reg.start_tokens == 0 and reg.num_tokens == n_b - P.conn.backoff
        # D asked for blocks inside P's hit (full attention: all of them), and got them
        bs0 = D.layout.groups[0].block_size
        assert all(reg.block_ids[0][:hit // bs0]), reg.block_ids[0]
        # and a sliding window that reaches into the hit
        sliding = [(g, spec) for g, spec in zip(reg.block_ids, D.layout.groups)
                   if spec.sliding_window]
        assert not sliding or any(any(g[:hit // spec.block_size]) for g, spec in sliding)
        steps = [m.push_saves["p-req"] for m in P.metas if m and "p-req" in m.push_saves]
        assert [s.step for s in steps] == list(range(len(steps))) and steps[-1].final
        assert len(steps) == num_steps          # P computes only the tokens past its hit
        assert P.save_checks == len(steps)
        _check_counts(P, [m["p-req"] for m in P.planned if "p-req" in m])
        _finish(P, D, "d-req")
    finally:
        P.close()
        D.close()
