"""The `vllm serve` lines of docs/vllm.md "Transports" over Mooncake TE, run for real.

``unshare -n -- python scripts/te_serve_check.py LOGDIR pull|push`` (as root; brings ``lo`` up
inside the new namespace): a prefill server on port 8100 and a decode server on port 8200 with
the documented ``--kv-transfer-config`` (side channel 5600 / 5601, ``"transport":
"mooncake"``; push adds ``"transfer_mode": "push"``), serving the tiny gemma3-like model with
the flags tests/serve/serve_harness.py adds for it (float32, no tokenizer, small KV cache),
and docs/examples/pd_proxy.py on port 8300. Four prompts go through the proxy and then to the
decode server alone (no transfer); prints one JSON line: whether the tokens are equal, and
how far the decode server's hmacore counters moved (loads, bytes, failures) for the proxied
requests, and the prefill server's bytes (``prefill_bytes``: push mode's layer WRITEs; a pull
moves its bytes by D's READs, counted on D). Every server is stopped by PID on exit.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "serve"), str(ROOT / "tests"), str(ROOT)]

from hmacore.demo.engine_driver import make_prompts  # noqa: E402
from hmacore.demo.tiny_model import write_tiny_model  # noqa: E402
from serve_harness import complete, proxy, scrape, total, vllm_serve  # noqa: E402


def ktc(role: str, side_port: int, push: bool) -> dict:
    """The documented config (docs/vllm.md, Transports), push adding transfer_mode."""
    return {"kv_connector": "HmaNixlConnector",
            "kv_connector_module_path": "hmacore.integrations.vllm", "kv_role": role,
            "kv_connector_extra_config": {"side_channel_port": side_port,
                                          "transport": "mooncake",
                                          **({"transfer_mode": "push"} if push else {})}}


def main(logdir: str, mode: str) -> int:
    import openai

    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    log = Path(logdir)
    log.mkdir(parents=True, exist_ok=True)
    model = write_tiny_model(log / "tiny-gemma3", "gemma3", window=64, seed=0)
    push = mode == "push"
    procs = {}
    try:
        procs["p"] = vllm_serve("p", model, 8100, log, ktc("kv_producer", 5600, push),
                                env={"VLLM_CPU_OMP_THREADS_BIND": "0"})
        procs["d"] = vllm_serve("d", model, 8200, log, ktc("kv_consumer", 5601, push),
                                env={"VLLM_CPU_OMP_THREADS_BIND": "1"})
        for s in procs.values():
            s.wait_ready()
        args = ["--mode", "push", "--prefill-side-channel", "127.0.0.1:5600"] if push else []
        procs["proxy"] = proxy("proxy", 8300, log, "http://127.0.0.1:8100",
                               "http://127.0.0.1:8200", args=args)
        procs["proxy"].wait_ready()
        prompts = make_prompts([10, 100, 150, 37], seed=1)
        decode = openai.OpenAI(base_url="http://127.0.0.1:8200/v1", api_key="x", timeout=300)
        via = openai.OpenAI(base_url="http://127.0.0.1:8300/v1", api_key="x", timeout=300)
        before = scrape("http://127.0.0.1:8200")
        p_before = scrape("http://127.0.0.1:8100")
        got = [complete(via, p) for p in prompts]
        after = scrape("http://127.0.0.1:8200")
        p_after = scrape("http://127.0.0.1:8100")
        ref = [complete(decode, p) for p in prompts]   # same model, greedy, no transfer

        def moved(name: str) -> float:
            return total(after, name) - total(before, name)

        print(json.dumps({"mode": mode, "equal": got == ref,
                          "loads": moved("vllm:hma_loads_total"),
                          "bytes": moved("vllm:hma_transfer_bytes_total"),
                          "failures": moved("vllm:hma_transfer_failures_total"),
                          "prefill_bytes": total(p_after, "vllm:hma_transfer_bytes_total")
                          - total(p_before, "vllm:hma_transfer_bytes_total")}), flush=True)
        return 0 if got == ref else 1
    finally:
        for s in procs.values():
            s.close()


if __name__ == "__main__":
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main(sys.argv[1], sys.argv[2]))
