"""A whole push-mode prefill engine in its own process (test-only): push_harness.Engine (a
real vLLM Scheduler, a WORKER-role HmaNixlConnector over paged DRAM KV, real NIXL), driven
over stdin/stdout one JSON line per command, like tp_rank.py (tp_harness.RankProc spawns
and bounds it; a test SIGKILLs it by PID to kill the engine mid-push).

The process imports vLLM at once but builds the engine only on ``start`` (``port``: its
handshake port, ``budget``: max_num_batched_tokens), so a replacement engine can be spawned
early and take over the port of one just killed. Its engine id is new (vLLM draws one).
Commands: ``start``, ``add`` (a request: ``rid``, ``prompt``, ``params``, ``max_tokens``),
``step`` (one engine step: the forward pass writes the pattern and pushes), ``state``,
``quit``. Usage: python push_peer_proc.py '{"rank": "<log name>"}'.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
os.environ.setdefault("UCX_NET_DEVICES", "lo")

import harness as H  # noqa: E402
import push_harness as PH  # noqa: E402


def _state(P) -> dict:
    pool = P.s.kv_cache_manager.block_pool
    w = P.w.worker
    return {"requests": sorted(P.s.requests), "registered": sorted(P.conn.registered()),
            "errors": w.errors, "stats": [{k: r[k] for k in ("push_id", "ok", "steps")}
                                          for r in w.stats()],
            "answered": w.counters._data.get("push_cancels_answered", 0),
            "free": pool.get_num_free_blocks(), "blocks": pool.num_gpu_blocks}


def main() -> None:
    P = None
    print(json.dumps({"imported": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "quit":
            break
        if op == "start":
            P = PH.Engine(lambda: H.gemma_like(num_blocks=64), port=cmd["port"],
                          max_num_batched_tokens=cmd.get("budget", 256))
            out = {"agent": P.w.worker.name, "port": P.port,
                   "engine_id": P.vc.kv_transfer_config.engine_id}
        elif op == "add":
            P.s.add_request(H.make_request(cmd["rid"], cmd["prompt"], 16, params=cmd["params"],
                                           max_tokens=cmd.get("max_tokens", 1)))
            out = {"ok": True}
        elif op == "step":
            so = P.step()
            saves = getattr(so.kv_connector_metadata, "push_saves", None) or {}
            out = {"pushed": {rid: bool(s.final) for rid, s in saves.items()}, **_state(P)}
        elif op == "state":
            out = _state(P)
        else:
            out = {"error": f"unknown op {op!r}"}
        print(json.dumps(out), flush=True)
    if P is not None:
        P.close()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
