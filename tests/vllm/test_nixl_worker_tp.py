"""HmaNixlWorker's TP rules that need no second engine process: done messages, and the
pairings it refuses (each refusal fails the load, nothing is read, the worker stays usable).
Real NIXL agents in this process (UCX, loopback)."""
import socket
import time

import pytest

import harness as H

from hmacore.integrations.vllm.nixl._tp import WorkerTp
from hmacore.integrations.vllm.layout import layout_from_kv_cache_config
from hmacore.integrations.vllm.nixl.metadata import (HmaNixlConnectorMetadata, RecvRequest,
                                                RemotePeer)
from hmacore.integrations.vllm.nixl.worker import HmaNixlWorker, done_message, parse_done
from hmacore.demo.paged_memory import allocate_paged_kv
from hmacore.tp import GroupSharding

pytestmark = pytest.mark.nixl


def test_done_messages_round_trip_and_garbage_is_refused():
    assert parse_done(done_message(1, 2)) == (1, 2)
    assert parse_done(b"done") == (0, 1)                      # a TP-1 reader's plain done
    for bad in (b"HB", b"done@", b"done@2/2", b"done@-1/2", b"done@x/2", b"done@1", b"nope"):
        assert parse_done(bad) is None, bad


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(kcc, name, shardings, tp=(0, 1), remap=True):
    layout = layout_from_kv_cache_config(kcc)
    wtp = WorkerTp(tp[0], tp[1], tuple(shardings), "torch.float16", 16, "LBNHC")
    w = HmaNixlWorker(layout, kcc.num_blocks, name, "127.0.0.1", _port(), tp=wtp,
                      block_size_remap=remap)
    w.register_kv_caches(allocate_paged_kv(layout, kcc.num_blocks).kv_caches)  # spec page sizes
    return w


def _load(w, remote: RemotePeer, local_ids):
    req = RecvRequest("d-req", local_ids, tuple(0 for _ in local_ids), remote, awaiting=True)
    w.start_load_kv(HmaNixlConnectorMetadata(reqs_to_recv={"d-req": req},
                                             scheduler_clock=time.perf_counter()))
    return w.get_transfer_results()


def test_mamba_groups_refuse_another_tp_size(caplog):
    kcc = H.qwen3_next_like(num_blocks=16)
    w = _worker(kcc, "D-mamba", [GroupSharding(2, 1, False), GroupSharding(1, 1, True)])
    try:
        remote = RemotePeer("P", "p-req", "127.0.0.1", _port(), [[3], [4]], tp_size=2)
        assert _load(w, remote, [[5], [6]]) == (set(), {"d-req"}, {"d-req"})
        assert "groups [1] are Mamba state; their pages pair only between equal TP sizes " \
               "(this rank: TP 1, engine at" in caplog.text
        assert w.agent.peers == ()                       # nothing was connected
    finally:
        w.shutdown()


def test_other_block_sizes_are_refused_when_remap_is_off(caplog):
    """The off switch (kv_connector_extra_config.block_size_remap=false): refused as before."""
    sh = [GroupSharding(2, 1, False)] * 2
    P = _worker(H.gemma_like(num_blocks=16, bs=32), "P-bs32-off", sh, remap=False)
    D = _worker(H.gemma_like(num_blocks=16, bs=16), "D-bs16-off", sh, remap=False)
    try:
        remote = RemotePeer("P-bs32-off", "p-req", "127.0.0.1", P.port, [[1, 2], [3, 4]])
        assert _load(D, remote, [[5, 6, 7], [8, 9, 10]]) == (set(), {"d-req"}, {"d-req"})
        assert "has block sizes [32, 32], this engine [16, 16]" in caplog.text
    finally:
        D.shutdown()
        P.shutdown()


def test_block_sizes_that_are_not_multiples_are_refused(caplog):
    sh = [GroupSharding(2, 1, False)] * 2
    P = _worker(H.gemma_like(num_blocks=16, bs=24), "P-bs24", sh)
    D = _worker(H.gemma_like(num_blocks=16, bs=16), "D-bs16", sh)
    try:
        remote = RemotePeer("P-bs24", "p-req", "127.0.0.1", P.port, [[1, 2], [3, 4]])
        assert _load(D, remote, [[5, 6, 7], [8, 9, 10]]) == (set(), {"d-req"}, {"d-req"})
        assert "different block sizes must be whole multiples" in caplog.text
    finally:
        D.shutdown()
        P.shutdown()


def test_a_remap_without_token_range_is_refused(caplog):
    """Equal TP sizes, block sizes 32 vs 16 (a block-size remap): metadata without the token
    range and table starts (which the scheduler side adds) fails the load; nothing is read."""
    sh = [GroupSharding(2, 1, False)] * 2
    P = _worker(H.gemma_like(num_blocks=16, bs=32), "P-bs32", sh)
    D = _worker(H.gemma_like(num_blocks=16, bs=16), "D-bs16", sh)
    try:
        remote = RemotePeer("P-bs32", "p-req", "127.0.0.1", P.port, [[1, 2], [3, 4]])
        assert _load(D, remote, [[5, 6, 7], [8, 9, 10]]) == (set(), {"d-req"}, {"d-req"})
        assert "a block-size remap needs the token range" in caplog.text
    finally:
        D.shutdown()
        P.shutdown()


def test_a_rank_that_is_not_the_advertised_one_is_refused(caplog):
    """kv_transfer_params say TP 1 but the engine at that port is rank 0 of TP 2."""
    sh = [GroupSharding(2, 1, False)] * 2
    P = _worker(H.gemma_like(num_blocks=16, heads=1), "P-r0", sh, tp=(0, 2))
    D = _worker(H.gemma_like(num_blocks=16), "D-tp1", sh)
    try:
        remote = RemotePeer("P", "p-req", "127.0.0.1", P.port, [[1], [2]], tp_size=1)
        assert _load(D, remote, [[5], [6]]) == (set(), {"d-req"}, {"d-req"})
        assert "is rank 0 of TP 2; kv_transfer_params said TP 1" in caplog.text
    finally:
        D.shutdown()
        P.shutdown()
