"""P/D pull under real ``vllm serve``: a prefill server, a decode server, the example proxy, and
a single server without a connector for the reference tokens, all driven over HTTP with the
``openai`` client.

One flow, in order (the servers take 1-2 minutes to start on 2 cores, so the module shares
them):
1. concurrent requests through the proxy give the single server's greedy tokens, and the
   decode server's ``/metrics`` counters move by what was loaded;
2. the prefill server is SIGKILLed while requests are in flight: every request is still
   answered with the single server's tokens (the proxy falls back to decode-only, the decode
   connector reports the failed reads and vLLM recomputes), and the decode server stays up;
3. a new prefill server on the same ports (a new engine id) is reconnected: requests load
   from it again.
"""
from __future__ import annotations

import concurrent.futures as cf
import zlib

import pytest

from hmacore.demo.engine_driver import make_prompts
from hmacore.demo.tiny_model import write_tiny_model
from ports import free_port, free_ports
from serve_harness import MAX_TOKENS, complete, proxy, scrape, total, vllm_serve

openai = pytest.importorskip("openai")

LENGTHS = [10, 100, 150, 37, 70, 129, 5, 64]     # inside and past the 64-token window
CONNECTOR = {"kv_connector": "HmaNixlConnector",
             "kv_connector_module_path": "hmacore.integrations.vllm"}


def prompts(name: str) -> list[list[int]]:
    return make_prompts(LENGTHS, seed=zlib.crc32(name.encode()))


ROUNDS = ("concurrent", "killed", "restarted")
# each engine its own core (two engines pinned to one core stall each other's transfers;
# docs/vllm.md); the reference engine is done before the P/D rounds start
CPU = {"p": {"VLLM_CPU_OMP_THREADS_BIND": "0"}, "d": {"VLLM_CPU_OMP_THREADS_BIND": "1"}}


def prefill_ktc(side_port: int) -> dict:
    return dict(CONNECTOR, kv_role="kv_producer",
                kv_connector_extra_config={"side_channel_port": side_port,
                                           "kv_lease_duration": 60})


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    logdir = tmp_path_factory.mktemp("serve-pull")
    model = write_tiny_model(logdir / "tiny-gemma2", "gemma2", window=64, seed=0)
    side = free_ports(2)
    ports = {k: free_port() for k in ("single", "p", "d", "proxy")}
    s = {"logdir": logdir, "model": model, "side": side, "ports": ports}
    procs = {
        "single": vllm_serve("single", model, ports["single"], logdir, None, env=CPU["d"]),
        "p": vllm_serve("p", model, ports["p"], logdir, prefill_ktc(side), env=CPU["p"]),
        "d": vllm_serve("d", model, ports["d"], logdir,
                        dict(CONNECTOR, kv_role="kv_consumer",
                             kv_load_failure_policy="recompute",
                             kv_connector_extra_config={"side_channel_port": side + 1}),
                        env=CPU["d"]),
    }
    s["procs"] = procs
    try:
        for p in procs.values():
            p.wait_ready()
        single = openai.OpenAI(base_url=procs["single"].url + "/v1", api_key="x",
                               max_retries=0, timeout=300)
        s["ref"] = {r: [complete(single, q) for q in prompts(r)] for r in ROUNDS}
        procs["single"].close()
        procs["proxy"] = proxy("proxy", ports["proxy"], logdir, procs["p"].url,
                               procs["d"].url)
        procs["proxy"].wait_ready()
        s["client"] = openai.OpenAI(base_url=procs["proxy"].url + "/v1", api_key="x",
                                    max_retries=0, timeout=300)
        yield s
    finally:
        for p in s["procs"].values():
            p.close()


def run_concurrent(client, round_prompts, workers: int = 4, on_done=None) -> list:
    """Every prompt through ``client`` on ``workers`` threads; results in prompt order (an
    exception object where a request failed). ``on_done(n)`` runs after the n-th answer."""
    out: list = [None] * len(round_prompts)
    with cf.ThreadPoolExecutor(workers) as pool:
        futs = {pool.submit(complete, client, q): i for i, q in enumerate(round_prompts)}
        for n, f in enumerate(cf.as_completed(futs), 1):
            try:
                out[futs[f]] = f.result()
            except Exception as e:  # noqa: BLE001 - reported below with the request index
                out[futs[f]] = e
            if on_done:
                on_done(n)
    return out


def check_tokens(got: list, ref: list) -> None:
    errors = [(i, g) for i, g in enumerate(got) if isinstance(g, BaseException)]
    assert not errors, f"requests failed: {errors}"
    bad = [i for i, (g, r) in enumerate(zip(got, ref)) if g != r]
    assert not bad, f"tokens differ from the single server's for prompts {bad}"
    assert all(len(g) == MAX_TOKENS for g in got)


def test_concurrent_tokens_equal_and_metrics_move(servers):
    d, p = servers["procs"]["d"], servers["procs"]["p"]
    before, p_before = scrape(d.url), scrape(p.url)
    got = run_concurrent(servers["client"], prompts("concurrent"))
    check_tokens(got, servers["ref"]["concurrent"])
    after, p_after = scrape(d.url), scrape(p.url)

    def moved(name: str) -> float:
        return total(after, name) - total(before, name)

    n = len(LENGTHS)
    # every request's KV came over NIXL: one load each, bytes and descriptors with it, blocks
    # moved in both groups; the prefill side clipped the windowed group for the prompts past
    # the window (what decode never had to read)
    assert moved("vllm:hma_loads_total") == n
    assert moved("vllm:hma_transfers_total") >= n
    assert moved("vllm:hma_transfer_bytes_total") > 0
    assert moved("vllm:hma_transfer_descriptors_total") > 0
    assert moved("vllm:hma_transfer_failures_total") == 0
    groups = {k for k in after if k.startswith("vllm:hma_blocks_moved_total{")}
    assert len(groups) >= 2, f"per-group series missing: {sorted(groups)}"
    assert total(p_after, "vllm:hma_blocks_clipped_total") > \
        total(p_before, "vllm:hma_blocks_clipped_total")
    # vLLM's own accounting agrees: prompt tokens that came from the connector
    assert moved('vllm:prompt_tokens_by_source_total') > 0 or \
        moved("vllm:prompt_tokens_total") > 0


def test_prefill_killed_mid_run_every_request_answered(servers):
    procs = servers["procs"]
    d = procs["d"]
    before = scrape(d.url)

    def kill_after_first(n: int) -> None:
        if n == 1:
            procs["p"].kill()

    got = run_concurrent(servers["client"], prompts("killed"), workers=3,
                         on_done=kill_after_first)
    assert not procs["p"].alive()
    check_tokens(got, servers["ref"]["killed"])
    assert d.alive() and d.healthy(), f"decode server died\n{d.log_tail()}"
    after = scrape(d.url)
    # at most the first answers loaded over NIXL; the rest were recomputed by decode
    assert total(after, "vllm:hma_loads_total") - total(before, "vllm:hma_loads_total") < \
        len(LENGTHS)


def test_restarted_prefill_is_reconnected(servers):
    procs = servers["procs"]
    procs["p"].close()
    procs["p"] = vllm_serve("p2", servers["model"], servers["ports"]["p"], servers["logdir"],
                            prefill_ktc(servers["side"]), env=CPU["p"])
    procs["p"].wait_ready()
    d = procs["d"]
    before = scrape(d.url)
    got = run_concurrent(servers["client"], prompts("restarted"))
    check_tokens(got, servers["ref"]["restarted"])
    after = scrape(d.url)
    # every request loaded from the NEW prefill engine (a stale agent would fail every read)
    assert total(after, "vllm:hma_loads_total") - total(before, "vllm:hma_loads_total") == \
        len(LENGTHS)
    assert total(after, "vllm:hma_transfer_failures_total") == \
        total(before, "vllm:hma_transfer_failures_total")
