"""P/D pull under real ``vllm serve`` across two simulated hosts: the prefill server in one
network namespace, the decode server and the proxy in another, joined by a veth pair; UCX over
TCP on that link only; the client (the ``openai`` package) runs on the decode host.

The prefill server listens on every interface and advertises its link address. Each engine
gets its own CPU (``VLLM_CPU_OMP_THREADS_BIND``): with both pinned to one core, the prefill
engine's transfer progress starved and every READ stalled until its lease expired (found
here; see hmacore/transport/cpus.py). Checked: greedy tokens equal a single server's, every
request loaded over the link (decode's ``vllm:hma_loads_total``), the prefill engine heard
every decode "done" (no lease expired), and the KV bytes crossed the link (veth counters).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from hmacore.demo.engine_driver import make_prompts
from hmacore.demo.tiny_model import write_tiny_model
from ports import free_port
from serve_harness import ROOT, complete, proxy, vllm_serve

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from two_hosts import two_hosts  # noqa: E402

openai = pytest.importorskip("openai")

LENGTHS = [10, 100, 150, 37]
CONNECTOR = {"kv_connector": "HmaNixlConnector",
             "kv_connector_module_path": "hmacore.integrations.vllm"}

# run on the decode host: every prompt through the proxy, then both servers' /metrics
CLIENT = """
import json, sys
sys.path.insert(0, sys.argv[1])
import openai
from serve_harness import complete, scrape
args = json.loads(sys.argv[2])
client = openai.OpenAI(base_url=args["proxy"] + "/v1", api_key="x", max_retries=0, timeout=600)
before = {k: scrape(u) for k, u in args["servers"].items()}
tokens = [complete(client, p) for p in args["prompts"]]
after = {k: scrape(u) for k, u in args["servers"].items()}
print(json.dumps({"tokens": tokens, "before": before, "after": after}))
"""


def on_host(host, code: str, *args: str, timeout: float = 900) -> dict:
    r = subprocess.run([*host.wrapper(), sys.executable, "-c", code, *args],
                       capture_output=True, text=True, timeout=timeout, cwd=str(ROOT))
    assert r.returncode == 0, f"client failed ({r.returncode}):\n{r.stderr[-3000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])


def descendants(pid: int) -> set[int]:
    """``pid`` and every process below it (the server's engine core and workers)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        out.add(p)
        todo.extend(children.get(p, ()))
    return out


def moved(res: dict, server: str, name: str) -> float:
    def tot(s):
        return sum(v for k, v in s.items() if k == name or k.startswith(name + "{"))
    return tot(res["after"][server]) - tot(res["before"][server])


def test_pull_across_two_hosts_under_vllm_serve(tmp_path):
    model = write_tiny_model(tmp_path / "tiny-gemma2", "gemma2", window=64, seed=0)
    prompts = make_prompts(LENGTHS, seed=zlib.crc32(b"serve-two-hosts"))
    single = vllm_serve("single", model, free_port(), tmp_path, None)
    servers = [single]
    try:
        single.wait_ready()
        ref_client = openai.OpenAI(base_url=single.url + "/v1", api_key="x", max_retries=0,
                                   timeout=300)
        ref = [complete(ref_client, p) for p in prompts]
        single.close()
        with two_hosts() as (a, b):
            side = free_port()
            p = vllm_serve("p", model, free_port(), tmp_path, dict(
                CONNECTOR, kv_role="kv_producer", kv_connector_extra_config={
                    "side_channel_host": a.addr, "side_channel_listen_host": "0.0.0.0",
                    "side_channel_port": side, "kv_lease_duration": 120}),
                wrapper=a.wrapper(), host=a.addr,
                env=dict(a.ucx_env(), VLLM_CPU_OMP_THREADS_BIND="0"))
            d = vllm_serve("d", model, free_port(), tmp_path, dict(
                CONNECTOR, kv_role="kv_consumer", kv_connector_extra_config={
                    "side_channel_host": b.addr, "side_channel_port": free_port()}),
                wrapper=b.wrapper(), host=b.addr,
                env=dict(b.ucx_env(), VLLM_CPU_OMP_THREADS_BIND="1"))
            servers += [p, d]
            for s in (p, d):      # health checked from inside each host (Server.check_wrapper)
                s.wait_ready()
            px = proxy("proxy", free_port(), tmp_path, p.url, d.url, wrapper=b.wrapper(),
                       host=b.addr)
            servers.append(px)
            px.wait_ready()
            rx0, _ = b.link_bytes()
            res = on_host(b, CLIENT, str(Path(__file__).parent), json.dumps(
                {"proxy": px.url, "prompts": prompts, "servers": {"p": p.url, "d": d.url}}))
            rx1, _ = b.link_bytes()
            logs = {s.name: s.log_tail(400) for s in (p, d)}
            ours = descendants(p.pid) | descendants(d.pid)
    finally:
        for s in servers:
            s.close()
    assert res["tokens"] == ref
    assert moved(res, "d", "vllm:hma_loads_total") == len(LENGTHS)
    assert moved(res, "d", "vllm:hma_transfer_failures_total") == 0
    # the prefill engine heard every decode "done": no lease had to expire
    assert moved(res, "p", "vllm:hma_lease_expiries_total") == 0, logs["p"]
    # each engine has its own core: neither warned that the other shares its pinned CPUs
    # (other processes on a busy machine may, and are named by pid)
    named = {int(x) for t in logs.values()
             for m in re.findall(r"already uses \(pids \[([0-9, ]+)\]", t)
             for x in m.split(",")}
    assert not named & ours, (named, ours)
    nbytes = moved(res, "d", "vllm:hma_transfer_bytes_total")
    assert nbytes > 0 and rx1 - rx0 >= nbytes, (rx1 - rx0, nbytes)
