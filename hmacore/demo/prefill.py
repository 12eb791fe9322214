"""The demo's prefill process: ``python -m hmacore.demo.prefill '<scenario json>'``.

It plays vLLM's prefill instance with hmacore's bookkeeping: allocates paged KV memory for the
layout, answers the NIXL handshake, and for each request allocates its per-group table, writes
the (layer, token position) byte pattern into every live block, finishes the request (window
and state clip) and prints its ``kv_transfer_params`` as one JSON line on stdout (the proxy's
job in a real deployment). It frees a request's blocks when the decode side's NIXL
notification arrives, and exits after the last one (every wait bounded).
"""
from __future__ import annotations

import json
import queue
import sys
import time

NOTIF_TIMEOUT_S = 60.0
HANDSHAKE_TIMEOUT_S = 60.0


def emit(**msg) -> None:
    sys.stdout.write(json.dumps(msg) + "\n")
    sys.stdout.flush()


def main(argv: list[str]) -> int:
    from ..transport import configure_ucx_env
    configure_ucx_env()
    from .paged_memory import allocate_paged_kv, fill_pattern
    from ..plan import TransferPlan
    from ..tables import TrackerSet, to_wire
    from ..transport.handshake import HandshakeServer
    from ..transport.nixl import NixlAgent
    from ..windows import clip_to_window
    from .scenario import BlockPool, Scenario

    sc = Scenario.from_json(argv[0])
    corrupt = "--inject-corruption" in argv
    layout = sc.layout()
    num_blocks = sc.num_blocks()
    layout = layout.with_num_blocks(num_blocks)
    paged = allocate_paged_kv(layout, num_blocks, page_bytes=sc.page_size())
    for s in paged.storages:   # written once, as vLLM's torch.zeros KV cache is
        s.fill(0)
    plan = TransferPlan.from_kv_caches(layout, paged.kv_caches, num_blocks=num_blocks)
    pool = BlockPool(num_blocks)
    trackers = TrackerSet(layout)
    peers: queue.Queue = queue.Queue()
    with NixlAgent("hmacore-demo-prefill", plan) as agent, \
            HandshakeServer(agent.handshake_payload(), on_peer=peers.put) as server:
        emit(event="ready", port=server.port, agent=agent.name, num_blocks=num_blocks)
        # Know the decode agent before any request is handed off: its READ notifications are
        # only reliably delivered to an agent that has loaded its metadata.
        agent.add_peer(peers.get(timeout=HANDSHAKE_TIMEOUT_S))
        pending = []
        for r, n in enumerate(sc.request_lengths()):
            rid = f"req-{r}"
            table = pool.allocate_table(layout, n)
            fill_pattern(paged, table)
            if corrupt and r == 0:  # self-test of the decode side's verifier
                _flip_one_byte(paged, layout, table)
            t0 = time.perf_counter_ns()
            trackers.add(rid, table, num_prompt_tokens=n)
            trackers.set_scheduled_tokens(rid, n)
            finished = trackers.finish(rid)           # vLLM: request_finished_all_groups
            remote = clip_to_window(finished, layout)  # what D needs: windows and state clipped
            us = (time.perf_counter_ns() - t0) / 1e3
            emit(event="finished", request_id=rid, bookkeeping_us=us, kv_transfer_params={
                "do_remote_prefill": True, "remote_engine_id": agent.name,
                "remote_request_id": rid, "remote_host": "127.0.0.1", "remote_port": server.port,
                "remote_block_ids": to_wire(remote), "remote_num_tokens": n})
            pending.append((rid, table))
        for rid, table in pending:   # free each request's blocks when D says it has them
            try:
                agent.wait_notif(rid, timeout=NOTIF_TIMEOUT_S)
            except Exception as e:  # noqa: BLE001 - reported, blocks still freed below
                emit(event="error", request_id=rid, message=str(e))
            pool.free(table)
            emit(event="released", request_id=rid)
        emit(event="done", free_blocks=pool.num_free, num_blocks=num_blocks)
    return 0


def _flip_one_byte(paged, layout, table) -> None:
    g = layout.transfer_group_ids[-1]
    live = [b for b in table[g] if b]
    name = layout.groups[g].layer_names[0]
    arr = paged.kv_caches[name]
    part = arr[0] if isinstance(arr, tuple) else arr
    flat = part[live[-1]].reshape(-1)
    flat[0] ^= 0xFF


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
