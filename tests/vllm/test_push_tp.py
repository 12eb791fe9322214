"""Layer-wise push (decode first) through HmaNixlConnector between engines of different
tensor-parallel sizes.

Each engine is a real vLLM Scheduler in this process and one process per TP rank (vLLM's TP
group initialized with gloo; a WORKER-role connector over CPU tensors shaped like vLLM's CPU
pages, each rank holding its KV heads); vLLM's KVOutputAggregator folds the ranks' outputs.
Real NIXL (UCX, loopback). D registers its blocks with every P rank; P's forward pass writes,
layer by layer, the pattern of (layer, token, global head) into the scheduled blocks and calls
``save_kv_layer`` per layer, which WRITEs that layer's head slices into D's blocks. Checked on
every D rank: every byte of every pushed block equals the pattern of that rank's heads,
nothing else was written; no block leaked on either engine; P freed its blocks. The same
with a block-size remap between the TP sizes (P and D of other block sizes): D's blocks hold
exactly the token rows it needs, written as byte runs per (P rank, D rank).
"""
import time

import pytest

import harness as H
import push_harness as PH
import tp_cases
from tp_harness import PAIRS, check_loaded_bytes, engine_pool, pair, run_out_both, zeroed


pytestmark = pytest.mark.nixl

PUSH = {"transfer_mode": "push", "push_register_timeout": 4, "push_recv_timeout": 8}

#: engine sets other than a case's TP 1 / TP 2 / TP 2 (tp_harness.engine_pool): the dsv4 set
#: gains a TP 1 engine of half the block sizes (1 rank process more); "remap-gemma" is TP 2
#: with 32-token blocks and TP 1 with 64-token blocks, vec-kernel pages (3 rank processes)
POOLS = {"dsv4": (("tp1", "dsv4", 1), ("tp2", "dsv4", 2), ("tp2b", "dsv4", 2),
                  ("tp1h", "dsv4-half", 1)),
         "remap-gemma": (("tp2", "gemma-vec32", 2), ("tp1", "gemma-vec64", 1)),
         # GDN + attention, TP 2 with 32-token blocks and conv state DS, TP 1 with 64 and
         # conv state SD (tp_cases.STATE_REMAP_CASES): a DS/SD mix, refused per peer (3 rank
         # processes)
         "remap-gdn-mix": (("tp2", "gdn-ds-b32", 2), ("tp1", "gdn-sd-b64", 1)),
         # per state case (tp_cases.STATE_REMAP_CASES): TP 1 and TP 2 at 32- and 64-token
         # blocks, head size 64 (vLLM CPU's vec kernel), started together (6 rank processes)
         **{f"rs-{c}": tuple((f"b{bs}t{tp}", f"{c}-b{bs}", tp) for bs in (32, 64)
                             for tp in (1, 2)) for c in tp_cases.STATE_CASES}}


@pytest.fixture(scope="module")
def engines():
    yield from engine_pool("push-", extra=PUSH, pools=POOLS)


# per (case, P TP, D TP): the D ranks each P rank WRITEs to (written out, not computed)
CONSUMERS = {
    ("gemma", 2, 1): [[0], [0]],        # D's two heads come one from each P rank
    ("gemma", 1, 2): [[0, 1]],          # each D rank gets its head from P's only rank
    ("gemma", 2, 2): [[0], [1]],        # same TP: whole pages, rank to rank
    ("gemma-chunk", 2, 1): [[0], [0]],  # the same over 3 prefill steps
    ("gemma-chunk", 1, 2): [[0, 1]],
    ("gemma-chunk", 2, 2): [[0], [1]],
    ("dsv4", 2, 1): [[0], []],          # MLA replicated: D rank 0 reads P rank 0 only
    ("dsv4", 1, 2): [[0, 1]],
    ("dsv4", 2, 2): [[0], [1]],
}


def _start(P, D, prompt, rid, wait_registered=True):
    d_params, p_params = PH.push_params(f"push-{rid}", P.port)
    d_req = H.make_request(f"d-{rid}", prompt, H.C.resolve_kv_cache_block_sizes(D.kcc, D.vc)[1],
                           params=d_params, max_tokens=3)
    p_req = H.make_request(f"p-{rid}", prompt, H.C.resolve_kv_cache_block_sizes(P.kcc, P.vc)[1],
                           params=p_params, max_tokens=1)
    D.s.add_request(d_req)
    # P's request comes once P's scheduler holds D's registration (every P rank reported
    # it): its wait for one (push_register_timeout, 4 s to keep test_d_rank_never_registers
    # short) must not race D's first handshake with a new pair of engines on a loaded host
    pid, deadline = f"push-{rid}", time.monotonic() + 60
    while wait_registered and pid not in P.s.connector.scheduler.registered():
        assert time.monotonic() < deadline, f"P's scheduler did not get D's registration of {pid}"
        D.step()
        P.step(fill=True)
    P.s.add_request(p_req)
    return d_req, p_req


def _until_loaded(P, D, d_req, timeout=60):
    deadline = time.monotonic() + timeout
    while d_req.status == H.RequestStatus.WAITING_FOR_REMOTE_KVS or \
            d_req.request_id not in {r for m in D.metas for r in getattr(m, "push_regs", {})}:
        assert time.monotonic() < deadline, "the push did not complete"
        D.step()
        P.step(fill=True)


def _registration(D, rid):
    for m in D.metas:
        if rid in getattr(m, "push_regs", {}):
            return m.push_regs[rid]
    raise AssertionError(f"no registration of {rid}")


@pytest.mark.parametrize("case,tp_p,tp_d", [(c, p, d) for c in ("gemma", "gemma-chunk", "dsv4")
                                            for p, d in PAIRS])
def test_mixed_tp_push_every_byte(engines, case, tp_p, tp_d):
    P, D, prompt = pair(engines, case, tp_p, tp_d, (5, 17, 3))
    rid = f"{case}-{tp_p}{tp_d}"
    n = len(prompt)
    d_req, p_req = _start(P, D, prompt, rid)
    _until_loaded(P, D, d_req)
    assert d_req.status != H.RequestStatus.FINISHED_ERROR
    assert d_req.num_computed_tokens >= n - 1, "D recomputed instead of receiving the push"
    reg = _registration(D, d_req.request_id)
    assert reg.awaiting
    loaded = [[int(b) for b in g if b] for g in reg.block_ids]
    assert sum(map(len, loaded)) > 0
    D.check_loaded(d_req.request_id, loaded, control=case == "gemma" and tp_d == 2)
    run_out_both(P, D)
    sched = P.s.connector.scheduler
    assert sched.leases() == {} and sched.registered() == set() and sched.held() == set()
    assert sched._reg_partial == {}
    steps = -(-n // P.case.vkw.get("max_num_batched_tokens", 256))
    for r, st in enumerate(P.call_all("push_state")):
        mine = [x for x in st["stats"] if x["push_id"] == f"push-{rid}"]
        assert mine == [{"push_id": f"push-{rid}", "ok": True, "rank": r, "steps": steps,
                         "consumers": CONSUMERS[(case, tp_p, tp_d)][r]}], (r, st)
    for st in P.call_all("push_state") + D.call_all("push_state"):
        assert st["errors"] == [] and st["regs"] == st["pushes"] == st["expect"] == [], st


#: per (P TP, D TP): the D ranks each P rank WRITEs to in the Mamba state cases (written
#: out): P2/D1 both P ranks (each holds half of D's heads, conv channels and ssm heads),
#: P1/D2 P's only rank to both, P2/D2 rank to rank (whole pages)
STATE_CONSUMERS = {(2, 1): [[0], [0]], (1, 2): [[0, 1]], (2, 2): [[0], [1]], (1, 1): [[0]]}


# make test: two other cases than the pull tests' (the rest: make test-mamba-tp)
@pytest.mark.parametrize("case,tp_p,tp_d", tp_cases.state_params(
    tp_cases.STATE_CASES, PAIRS, ci=("gdn-sd", "mamba2-g2-ds")))
def test_mamba_state_across_tp_push_every_byte(engines, case, tp_p, tp_d):
    """Push with Mamba / GDN state groups at TP > 1 (issue 20 (c)): full attention + two
    Mamba-type layers (GDN; Mamba2 with 2 groups and with 1; Mamba1; conv state DS and SD),
    P2/D2 (whole state pages rank i -> rank i), P2/D1 and P1/D2 (each P rank WRITEs the
    byte ranges of its conv channels and ssm heads that a D rank holds: hmacore.tp.StateSlice,
    the pull plan in the WRITE direction). P's forward pass writes vLLM-shaped state pages
    tagged by (layer, table position, GLOBAL conv channel / ssm head, element); every byte of
    every D rank's registered state slot and attention blocks equals the oracle for D's rank
    (state padding: P's STATE_PAD copied at equal TP, D's zero kept across TP sizes), nothing
    else written; D computes only the backoff suffix; every P rank's push ended ok with the
    consumers written out; no leak, no error on either engine."""
    P, D, prompt = pair(engines, case, tp_p, tp_d, (7, 11, 5))
    push_state_every_byte(P, D, prompt, f"{case}-{tp_p}{tp_d}")


def test_d_rank_never_registers(engines):
    """D rank 1's registrations are lost (fault injection): P's only rank never has both of
    its consumers, P's scheduler gives up at push_register_timeout and prefills without push;
    every worker forgets the push (D rank 0 is told at once, D rank 1 fails at its deadline);
    D's request fails with nothing valid; neither engine leaks a block."""
    e = engines("dsv4")
    P, D = e["tp1"], e["tp2"]
    for eng in (P, D):
        eng.call_all("zero")
    D.ranks[1].call("drop_regs")
    try:
        n = P.case.prompt_tokens
        prompt = [1 + (i * 11 + 5) % 900 for i in range(n)]
        t0 = time.monotonic()
        d_req, p_req = _start(P, D, prompt, "lost", wait_registered=False)
        deadline = time.monotonic() + 40
        while d_req.status == H.RequestStatus.WAITING_FOR_REMOTE_KVS or P.s.requests:
            assert time.monotonic() < deadline, (d_req.status, list(P.s.requests))
            D.step()
            P.step(fill=True)
        assert time.monotonic() - t0 >= PUSH["push_register_timeout"] - 0.5
        assert d_req.status == H.RequestStatus.FINISHED_ERROR, d_req.status
        assert p_req.status == H.RequestStatus.FINISHED_LENGTH_CAPPED
        assert all(not m.push_saves for m in P.metas[-10:] if m)
        D.run_out()
        # D's ranks cancelled the push: its blocks stay pinned until P's rank answers
        deadline = time.monotonic() + 40
        while D.s.connector.scheduler.held_blocks():
            assert time.monotonic() < deadline, "P never answered D's cancels"
            D.step()
            P.step(fill=True)
        H.assert_no_leak(D.s)
        H.assert_no_leak(P.s)
        sched = P.s.connector.scheduler
        assert sched.registered() == set() and sched._reg_partial == {}
        (p0,) = P.call_all("push_state")
        assert p0["regs"] == p0["pushes"] == [], p0
        d0, d1 = D.call_all("push_state")
        assert d0["expect"] == d1["expect"] == []
        assert any("prefill side reported" in x for x in d0["errors"]), d0["errors"]
        assert any("deadline" in x for x in d1["errors"]), d1["errors"]
        # nothing valid: no byte was pushed into D's blocks
        for st in D.call_all("check", table=[[] for _ in D.kcc.kv_cache_groups],
                             loaded=[[] for _ in D.kcc.kv_cache_groups]):
            assert st["stray"] == 0, st
    finally:
        D.ranks[1].call("undrop")


def test_d_refuses_a_port_that_is_not_rank_0(engines):
    """remote_port must be P's base port (rank 0, which tells the TP size): pointing D at
    rank 1's port is refused at the handshake; D's load fails, nothing leaks."""
    e = engines("dsv4")
    P, D = e["tp2"], e["tp1"]
    hbs = H.C.resolve_kv_cache_block_sizes(D.kcc, D.vc)[1]
    d_params, _ = PH.push_params("wrongport", P.port + 1)
    d_req = H.make_request("d-wrongport", [3 + i % 700 for i in range(200)], hbs,
                           params=d_params, max_tokens=3)
    D.s.add_request(d_req)
    deadline = time.monotonic() + 30
    D.step()
    while d_req.status == H.RequestStatus.WAITING_FOR_REMOTE_KVS:
        assert time.monotonic() < deadline
        D.step()
    assert d_req.status == H.RequestStatus.FINISHED_ERROR, d_req.status
    (st,) = D.call_all("push_state")
    assert any("is rank 1 of TP 2; expected rank 0 of TP 2" in x for x in st["errors"]), st
    D.run_out()
    H.assert_no_leak(D.s)


# per (pool, P engine, D engine): the D ranks each P rank WRITEs to (written out)
# (dsv4 first: its engines are the ones the tests above use, still running)
REMAP_CONSUMERS = {
    ("dsv4", "tp2", "tp1h"): [[0], []],           # MLA replicated: D rank 0 from P rank 0
    ("dsv4", "tp1h", "tp2"): [[0, 1]],
    ("remap-gemma", "tp2", "tp1"): [[0], [0]],    # each P rank: the rows of its one head
    ("remap-gemma", "tp1", "tp2"): [[0, 1]],      # P's two heads: one to each D rank
}


@pytest.mark.parametrize("pool,p_key,d_key", list(REMAP_CONSUMERS), ids=[
    "dsv4-p_tp2_x1-d_tp1_xhalf", "dsv4-p_tp1_xhalf-d_tp2_x1", "p_tp2_b32-d_tp1_b64",
    "p_tp1_b64-d_tp2_b32"])
def test_mixed_tp_and_block_sizes_push_every_byte(engines, pool, p_key, d_key):
    """Push with a block-size remap across TP sizes: each P rank WRITEs, per layer, into
    every D rank that takes heads from it, the token rows of those heads D needs (runs in
    each side's grain; MLA whole latents from one P rank). Every byte of every D rank is
    compared: the rows of the tokens D registered for (per group: window, prefix) hold P's
    pattern of that rank's heads, all else zero; controls: rank 0's bytes checked as rank
    1's heads differ, and expecting one token less finds the extra token's bytes."""
    e = engines(pool)
    P, D = e[p_key], e[d_key]
    assert P.tp != D.tp and P.layout.block_sizes != D.layout.block_sizes
    for eng in (P, D):
        eng.call_all("zero")
    # errors of the pool's earlier tests (test_d_rank_never_registers): none may be added
    errors = [st["errors"] for st in P.call_all("push_state") + D.call_all("push_state")]
    rid = f"{pool}-{p_key}-{d_key}"
    n = P.case.prompt_tokens
    prompt = [1 + (i * 3 + len(rid)) % 900 for i in range(n)]
    d_req, p_req = _start(P, D, prompt, rid)
    _until_loaded(P, D, d_req)
    assert d_req.status != H.RequestStatus.FINISHED_ERROR
    assert d_req.num_computed_tokens >= n - 1, "D recomputed instead of receiving the push"
    reg = _registration(D, d_req.request_id)
    kw = check_loaded_bytes(D, d_req.request_id, reg.num_tokens, reg.start_tokens,
                            control=pool == "remap-gemma")
    short = [max(a, b - 1) for a, b in zip(kw["lo"], kw["hi"])]
    assert D.ranks[-1].call("check_tokens", table=kw["table"], lo=kw["lo"], hi=short)["bad"] > 0
    sent = [s for m in P.metas if m for s in getattr(m, "push_saves", {}).values()
             if s.push_id == f"push-{rid}"]
    for st in P.call_all("push_state"):       # every P rank planned each step as a remap
        # (the rank processes serve the whole module: earlier tests' pushes come first)
        mine = [x for x in st["planned"] if x[0] == f"push-{rid}"][-len(sent):]
        assert [x[1] for x in mine] == [s.step for s in sent]
        ended = [r for r in st["stats"] if r["push_id"] == f"push-{rid}"]
        assert ended and ended[-1]["ok"], st["stats"]
        # a rank WRITEing to no decode rank (MLA replicated) plans nothing
        assert all(x[2] for x in mine) == bool(ended[-1]["consumers"]), (mine, ended[-1])
    assert sent
    D.run_out()
    H.assert_no_leak(D.s)
    P.run_out()
    H.assert_no_leak(P.s)
    sched = P.s.connector.scheduler
    assert sched.leases() == {} and sched.registered() == set() and sched.held() == set()
    steps = -(-n // P.case.vkw.get("max_num_batched_tokens", 256))
    for r, st in enumerate(P.call_all("push_state")):
        mine = [x for x in st["stats"] if x["push_id"] == f"push-{rid}"]
        assert mine == [{"push_id": f"push-{rid}", "ok": True, "rank": r, "steps": steps,
                         "consumers": REMAP_CONSUMERS[(pool, p_key, d_key)][r]}], (r, st)
    for st, before in zip(P.call_all("push_state") + D.call_all("push_state"), errors):
        assert st["errors"] == before and st["regs"] == st["pushes"] == st["expect"] == [], st


# -- guards (one process, TP = 1 engines speaking the TP-aware handshake) --------------------

def _reg_msg(D, pid, ids, **claims):
    import json
    body = {"agent": D.w.worker.name, "ids": ids, **claims}
    return pid.encode() + b":REG:" + json.dumps(body).encode()


@pytest.mark.parametrize("claims, needle", [
    ({"rank": 1, "tp": 2}, "claims rank 1 of TP 2, but its handshake said rank 0 of TP 1"),
    ({"rank": 3, "tp": 2}, "rank 3 of TP 2 is not a TP rank"),
    ({"rank": 0, "tp": 1, "ids": "other"}, "disagrees with earlier ones"),
])
def test_bad_registration_claims_are_refused(claims, needle):
    G = PH.H.gemma_like
    P = PH.Engine(lambda: G(num_blocks=64))
    D = PH.Engine(lambda: G(num_blocks=64))
    try:
        d_params, _ = PH.push_params("g1", P.port)
        hbs = H.C.resolve_kv_cache_block_sizes(D.kcc, D.vc)[1]
        D.s.add_request(H.make_request("d", list(range(1, 41)), hbs, params=d_params,
                                       max_tokens=2))
        # D handshakes with P (on its handshake thread), then registers g1
        PH.step_until(lambda: "g1" in P.conn.registered(), [D, P], what="g1 registered")
        reg = PH.registration(D, "d")
        pid = "g1" if claims.get("ids") == "other" else "g2"
        ids = [[b + 1 if b else 0 for b in g] for g in reg.block_ids] \
            if claims.pop("ids", None) == "other" else reg.block_ids
        peer = next(iter(D.w.worker._sources.values())).names[0]
        D.w.worker.agent.send_notif(peer, _reg_msg(D, pid, ids, **claims))
        PH.step_until(lambda: any(needle in e for e in P.w.worker.errors), [P],
                      what=f"refusal {needle!r}", timeout=10)
        assert "g2" not in P.conn.registered()
    finally:
        P.close()
        D.close()


# make test: GDN in DS (the qwen3-next-like case) at every block-size and TP pair; the rest
# of tp_cases.STATE_CASES is slow-marked (make test-mamba-tp)
@pytest.mark.parametrize("case,bp,tp_p,tp_d", tp_cases.state_params(
    tp_cases.STATE_CASES, (32, 64), PAIRS, ci=("gdn-ds",)))
def test_mamba_state_remap_across_tp_push_every_byte(engines, case, bp, tp_p, tp_d):
    """Push with block sizes AND TP sizes differing, Mamba state groups included (issue 20's
    last item): GDN, Mamba2 g2 / g1, Mamba1, conv DS and SD; P 32 / D 64 and P 64 / D 32
    tokens per block; P2/D1, P1/D2, P2/D2. Each P rank WRITEs, through one RegrainPlan per
    decode rank it serves (TP mapping and source rank: hmacore.regrain with
    hmacore.state_tp), the attention token rows of that D rank's heads and, in the step that
    ends its prompt, the state byte ranges that D rank takes from it into D's registered
    state slot. Every byte of every D rank: attention rows of [lo, hi) hold P's pattern for
    its heads, the state slot holds P's state (P's table position) as vLLM's loaders shard it
    for D's rank (tp_cases.state_page), its padding and every other block zero; rank 0 read
    as rank 1 differs (control); every P rank's push ended ok with its consumers written out;
    no leak, no new error on either engine."""
    e = engines(f"rs-{case}")
    bd = 96 - bp
    P, D = e[f"b{bp}t{tp_p}"], e[f"b{bd}t{tp_d}"]
    assert (P.tp, D.tp) == (tp_p, tp_d) and P.layout.block_sizes != D.layout.block_sizes
    prompt = zeroed(P, D, (13, 7, 3), tp_p, tp_d, shift=bp)
    errors = [st["errors"] for st in P.call_all("push_state") + D.call_all("push_state")]
    rid = f"rs-{case}-{bp}-{tp_p}{tp_d}"
    d_req, p_req = _start(P, D, prompt, rid)
    _until_loaded(P, D, d_req)
    assert d_req.status != H.RequestStatus.FINISHED_ERROR
    reg = _registration(D, d_req.request_id)
    assert reg.awaiting
    n = reg.num_tokens
    backoff = D.s.connector.scheduler.backoff
    assert backoff >= 1 and n == len(prompt) - backoff, (n, len(prompt), backoff)
    assert d_req.num_computed_tokens >= n, "D recomputed instead of receiving the push"
    state = (-(-n // bd) - 1, -(-n // bp) - 1)      # D's slot, P's state position
    check_loaded_bytes(D, d_req.request_id, n, reg.start_tokens, state=state)
    _run_out_pushed(P, D, rid, tp_p, tp_d, errors)


def test_mamba_remap_across_tp_conv_layout_mix_is_refused_per_peer(engines):
    """What push cannot move with Mamba across TP AND block sizes is refused per decode peer,
    by name, never at start-up: a DS/SD conv state mix (P TP 2 / 32-token blocks / DS -> D
    TP 1 / 64 / SD; a transposed copy, not byte ranges). P's rank 0 refuses D at its
    handshake server (HandshakePayload.check_compatible: the state geometry's
    ``conv_layout`` field named, recorded in P's errors), D records that as its handshake
    failure (logged) and never registers, so P's ranks hold nothing of it: both engines
    stay up, P's request prefills without push (no push step planned, after
    push_register_timeout), D's request fails its load with nothing written into any of D's
    blocks (every byte of D's caches still zero), no leak on either engine. (A Mamba group
    without a state geometry, refused per peer by mamba_tp_refusal: end to end
    test_nogeom_tp.py::test_no_geometry_across_tp_push_refused_by_name, unit
    test_push_failures.py::test_mamba_tp_refusal_names_the_rule.)"""
    e = engines("remap-gdn-mix")
    P, D = e["tp2"], e["tp1"]
    for eng in (P, D):
        eng.call_all("zero")
    rid = "gdn-mix-refused"
    n = P.case.prompt_tokens
    prompt = [1 + (i * 13 + 7) % 900 for i in range(n)]
    push_refused(P, D, prompt, rid)
    # whichever side's check answers first (P's handshake server or D), the field is named
    rules = [f"disagrees on group 1's Mamba state geometry: conv_layout local {a!r}, remote "
             f"{b!r} (a DS/SD conv state mix is a transposed copy"
             for a, b in (("DS", "SD"), ("SD", "DS"))]
    (d0,) = D.call_all("push_state")    # D's handshake failed: the field named
    assert any(r in x for x in d0["errors"] for r in rules), d0
    # D never registered: P's ranks (which take a decode peer in with its first
    # registration) hold nothing of it and planned nothing; P's rank 0 refused D's rank at
    # its handshake server (the field named, recorded), its rank 1 never heard of D
    p_states = P.call_all("push_state")
    assert p_states[0]["errors"] and all(
        x.startswith("handshake refused: ") and any(r in x for r in rules)
        for x in p_states[0]["errors"]), p_states[0]["errors"]
    for r, st in enumerate(p_states):
        assert (r == 0 or st["errors"] == []) and st["regs"] == st["pushes"] == [] \
            and not st["stats"], (r, st)
    assert d0["expect"] == [], d0
    run_out_refused(P, D)


def _run_out_pushed(P, D, rid: str, tp_p: int, tp_d: int, errors: list | None = None) -> None:
    """Both engines run out with nothing held; every P rank reports one successful push of
    ``rid`` over all of P's steps that pushed it (the prompt less the backoff, then its last
    step) to the D ranks STATE_CONSUMERS names; no rank gained an error (``errors``: each
    rank's errors before, P's ranks then D's; none when omitted) or kept a record."""
    run_out_both(P, D)
    sched = P.s.connector.scheduler
    assert sched.leases() == {} and sched.registered() == set() and sched.held() == set()
    steps = len([s for m in P.metas if m for s in getattr(m, "push_saves", {}).values()
                 if s.push_id == f"push-{rid}"])
    assert steps >= 1
    states = P.call_all("push_state")
    for r, st in enumerate(states):
        mine = [x for x in st["stats"] if x["push_id"] == f"push-{rid}"]
        assert mine == [{"push_id": f"push-{rid}", "ok": True, "rank": r, "steps": steps,
                         "consumers": STATE_CONSUMERS[(tp_p, tp_d)][r]}], (r, st)
    states += D.call_all("push_state")
    for st, before in zip(states, errors or [[]] * len(states)):
        assert st["errors"] == before and st["regs"] == st["pushes"] == st["expect"] == [], st


def push_state_every_byte(P, D, prompt, rid: str) -> None:
    """D registers, P's forward pass pushes the prompt (state groups included) into D: every
    byte of every D rank's registered state slot (padding: P's STATE_PAD copied at equal TP,
    D's zero kept across TP sizes) and attention blocks checked (rank 0 read as rank 1 must
    differ at D TP 2); D computes only the backoff suffix; then :func:`_run_out_pushed` (no
    rank gains an error)."""
    tp_p, tp_d = P.tp, D.tp
    n = len(prompt)
    errors = [st["errors"] for st in P.call_all("push_state") + D.call_all("push_state")]
    d_req, p_req = _start(P, D, prompt, rid)
    _until_loaded(P, D, d_req)
    assert d_req.status != H.RequestStatus.FINISHED_ERROR, [r.tail() for r in D.ranks]
    reg = _registration(D, d_req.request_id)
    assert reg.awaiting
    backoff = D.s.connector.scheduler.backoff
    assert backoff >= 1 and reg.num_tokens == n - backoff, (reg.num_tokens, n, backoff)
    assert d_req.num_computed_tokens >= n - backoff, "D recomputed instead of receiving the push"
    loaded = [[int(b) for b in g if b] for g in reg.block_ids]
    mamba = [g for g, s in enumerate(D.layout.groups) if s.kind.name == "MAMBA"]
    assert mamba and all(len(loaded[g]) == 1 for g in mamba), loaded   # one state slot
    assert all(loaded[g] for g, s in enumerate(D.layout.groups) if g not in mamba), loaded
    D.check_loaded(d_req.request_id, loaded, control=tp_d == 2,
                   state_pad=tp_cases.STATE_PAD if tp_p == tp_d else 0)
    _run_out_pushed(P, D, rid, tp_p, tp_d, errors)


def push_refused(P, D, prompt, rid: str) -> None:
    """A push D's handshake is refused for: P prefills without pushing (capped at its one
    token, no push step planned for ``rid``), D's request fails."""
    d_req, p_req = _start(P, D, prompt, rid, wait_registered=False)
    deadline = time.monotonic() + 60
    while d_req.status == H.RequestStatus.WAITING_FOR_REMOTE_KVS or P.s.requests:
        assert time.monotonic() < deadline, (d_req.status, list(P.s.requests))
        D.step()
        P.step(fill=True)
    assert p_req.status == H.RequestStatus.FINISHED_LENGTH_CAPPED, p_req.status
    assert d_req.status == H.RequestStatus.FINISHED_ERROR, d_req.status
    assert not [s for m in P.metas if m for s in getattr(m, "push_saves", {}).values()
                if s.push_id == f"push-{rid}"], "P planned a push step for a refused peer"


def run_out_refused(P, D) -> None:
    """After a refused push: both engines run out with no leak, P's scheduler holds and
    registered nothing, and every byte of every layer of every D rank is still zero."""
    D.run_out()
    P.run_out()
    H.assert_no_leak(D.s)
    H.assert_no_leak(P.s)
    sched = P.s.connector.scheduler
    assert sched.registered() == set() and sched.held() == set()
    for st in D.call_all("check", table=[[] for _ in D.kcc.kv_cache_groups],
                         loaded=[[] for _ in D.kcc.kv_cache_groups]):
        assert st["stray"] == 0, st
