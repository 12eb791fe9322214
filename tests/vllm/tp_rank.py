"""One TP rank of a test engine, in its own process: vLLM's TP group initialized for real
(gloo over loopback), a WORKER-role HmaNixlConnector built from the engine's config, and this
rank's KV caches as real CPU tensors shaped like vLLM's CPU pages (``LBHNC``: blocks x this
rank's KV heads x block_size x 2*head_size; MLA: blocks x block_size x head_size).

Driven by tests/vllm/tp_harness.py over stdin/stdout, one JSON line per command:
``fill`` (P: write the pattern of each block's token positions), ``step`` (one model-runner
step of the connector's worker side; metadata pickled; with ``forward`` the forward pass
runs in between: per layer, in layer order, the pattern of the ``fill`` tables' blocks is
written, then ``save_kv_layer``, as push mode needs), ``drop_regs`` (fault injection: this
rank's push registrations are never sent; ``undrop`` ends it), ``push_state`` (push
worker internals), ``check`` (D: compare loaded blocks
with the pattern of this rank's heads; count non-zero bytes elsewhere), ``check_tokens``
(the same per token range, after a block-size remap), ``zero``, ``quit``.
Usage: python tp_rank.py '<json args>' (spawned by the harness; bounded by it).
"""
import base64
import json
import os
import pickle
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
os.environ.setdefault("UCX_NET_DEVICES", "lo")

import torch  # noqa: E402,F401  (initialise torch before tp_cases pulls in vLLM/NIXL)

import tp_cases  # noqa: E402


def _b64(obj) -> str:
    return base64.b64encode(pickle.dumps(obj)).decode()


def _unb64(text: str):
    return pickle.loads(base64.b64decode(text))


def init_tp(tp: int, rank: int, dist_port: int, dist_ident: str, vc) -> None:
    """vLLM's own parallel state for this rank (what a vLLM worker sets up before it builds
    the KV connector). ``dist_ident``: this engine's VLLM_DIST_IDENT, the same on its ranks
    and on no other engine (vLLM's CPU communicator names its shared memory after it)."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps
    # vLLM's CPU worker sets this before init; its CPU communicator reads it (KeyError
    # otherwise) whenever vllm's compiled ops happen to be loaded in this process already,
    # and names its /dev/shm segments after it: one per engine, never reused (a segment a
    # killed rank left behind made a later engine on the same port fail with EEXIST)
    os.environ["VLLM_DIST_IDENT"] = dist_ident
    with set_current_vllm_config(vc):
        ps.init_distributed_environment(world_size=tp, rank=rank, local_rank=rank,
                                        distributed_init_method=f"tcp://127.0.0.1:{dist_port}",
                                        backend="gloo")
        ps.initialize_model_parallel(tensor_model_parallel_size=tp)


def stand_in_layers(case, tp: int, vc) -> None:
    """What a loaded model registers in ``static_forward_context`` and the worker reads to
    tell Mamba2's B/C sharding: per Mamba layer a stand-in whose ``conv1d`` is of the class
    vLLM's MambaMixer2 builds (MergedColumnParallelLinear when the groups are sharded over
    ``tp``, ColumnParallelLinear when n_groups == 1 is replicated), built without __init__."""
    import types

    from vllm.model_executor.layers import linear
    model, _ = case.state
    _, p, _ = tp_cases.STV.MODELS[model]
    merged = "n_groups" not in p or p["n_groups"] % tp == 0
    cls = linear.MergedColumnParallelLinear if merged else linear.ColumnParallelLinear
    ctx = vc.compilation_config.static_forward_context
    for name in tp_cases.STATE_LAYERS:
        ctx[name] = types.SimpleNamespace(conv1d=cls.__new__(cls))


def short_conv_layers(kcc, vc) -> None:
    """What loading an LFM2-like model does for its convolution blocks: vLLM's real
    ``ShortConv`` layer per state layer (built in this rank's TP group; it registers itself
    in ``static_forward_context``, where the worker reads it), and the KV cache spec vLLM
    asks of it (``get_kv_cache_spec``) must be the state group's spec of ``kcc``, so the
    connector sees what vLLM would give it (hmacore has no state geometry for SHORT_CONV)."""
    import types

    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.mamba.short_conv import ShortConv
    (grp,) = [g for g in kcc.kv_cache_groups if list(g.layer_names) == list(tp_cases.STATE_LAYERS)]
    want = grp.kv_cache_spec
    vc.cache_config.mamba_block_size = want.block_size
    vc.cache_config.mamba_page_size_padded = want.page_size_padded
    cfg = types.SimpleNamespace(conv_L_cache=tp_cases.SHORT_CONV_L, conv_bias=False)
    with set_current_vllm_config(vc):
        for i, name in enumerate(tp_cases.STATE_LAYERS):
            layer = ShortConv(cfg, tp_cases.SHORT_CONV_DIM, i, model_config=vc.model_config,
                              cache_config=vc.cache_config, prefix=name)
            got = layer.get_kv_cache_spec(vc)
            assert got == want, (name, got, want)
            assert vc.compilation_config.static_forward_context[name] is layer


def main() -> None:
    args = json.loads(sys.argv[1])
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from hmacore.integrations.vllm.nixl.connector import HmaNixlConnector
    from hmacore.plan import layer_sort_key
    case = tp_cases.CASES[args["case"]]
    tp, rank = args["tp"], args["rank"]
    vc = tp_cases.engine_config(case, tp=tp, port=args["port"], engine_id=args["engine_id"],
                                extra=args.get("extra"))
    init_tp(tp, rank, args["dist_port"], args["dist_ident"], vc)
    kcc = case.kcc(tp)
    if case.state is not None and case.state[0] == "short_conv":
        short_conv_layers(kcc, vc)
    elif case.state is not None:
        stand_in_layers(case, tp, vc)
    conn = HmaNixlConnector(vc, KVConnectorRole.WORKER, kcc)
    caches = tp_cases.allocate(case, kcc, tp)
    conn.register_kv_caches(caches)
    from hmacore.integrations.vllm import _compat as HC
    print(json.dumps({"ready": conn.worker.name, "port": conn.worker.port,
                      "agent": type(conn.worker.agent).__name__,
                      "conv_layout": HC.conv_state_layout()}), flush=True)
    planned: list = []   # P: (push id, step, remap?) of every step this rank's worker planned
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "quit":
            break
        if op == "zero":
            for t in caches.values():
                t.zero_()
            out = {"ok": True}
        elif op == "fill":
            tp_cases.fill(case, kcc, caches, cmd["table"], tp, rank)
            out = {"ok": True}
        elif op == "check":
            out = tp_cases.check(case, kcc, caches, cmd["table"], cmd["loaded"], tp,
                                 cmd.get("as_rank", rank), cmd.get("state_pad", 0))
        elif op == "check_tokens":
            st = cmd.get("state")
            out = tp_cases.check_tokens(case, kcc, caches, cmd["table"], cmd["lo"], cmd["hi"],
                                        tp, cmd.get("as_rank", rank),
                                        None if st is None else tuple(st))
        elif op == "drop_regs":      # fault injection: this rank's registrations are lost
            send = conn.worker.agent.send_notif
            conn.worker.agent.send_notif = lambda peer, msg: (
                None if b":REG:" in bytes(msg) else send(peer, msg))
            out = {"ok": True}
        elif op == "undrop":
            conn.worker.agent.send_notif = send
            out = {"ok": True}
        elif op == "push_state":     # push worker internals the tests assert on
            w = conn.worker
            out = {"errors": w.errors, "regs": sorted(w._regs), "pushes": sorted(w._pushes),
                   "expect": sorted(w._expect),
                   "stats": [{k: v for k, v in r.items() if k in ("push_id", "ok", "rank",
                                                                  "consumers", "steps")}
                             for r in w.stats()],
                   "planned": planned}
        elif op == "step":
            conn.bind_connector_metadata(_unb64(cmd["meta"]))
            conn.start_load_kv(None)
            planned.extend([sv.push_id, sv.step, sv.regrain is not None]   # P: its own plan
                           for sv in getattr(conn.worker, "planned", {}).values())
            if cmd.get("forward"):    # the forward pass: layer by layer, as the model runner
                for name in sorted(caches, key=layer_sort_key):
                    for table in cmd.get("fill", {}).values():   # P computes these blocks
                        tp_cases.fill(case, kcc, caches, table, tp, rank, layers={name})
                    conn.save_kv_layer(name, caches[name], None)
            conn.wait_for_save()
            r = conn.get_transfer_results(set(cmd["finished"]))
            wmeta = conn.build_connector_worker_meta()
            conn.clear_connector_metadata()
            out = {"result": _b64(dict(finished_sending=r.finished_sending,
                                       finished_recving=r.finished_recving,
                                       failed_recving=r.failed_recving, worker_meta=wmeta))}
        else:
            out = {"error": f"unknown op {op!r}"}
        print(json.dumps(out), flush=True)
    conn.shutdown()
    sys.stdout.flush()
    os._exit(0)   # no gloo teardown handshake with ranks that may already be gone


if __name__ == "__main__":
    main()
