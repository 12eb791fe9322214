"""HmaNixlWorker's TP rules that need no second engine process: done messages, and the
pairings it refuses (each refusal fails the load, nothing is read, the worker stays usable).
Real NIXL agents in this process (UCX, loopback)."""
import socket
import time

import pytest

import harness as H
import test_state_tp_vllm as STV

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


def _worker(kcc, name, shardings, tp=(0, 1), remap=True, why=()):
    layout = layout_from_kv_cache_config(kcc)
    wtp = WorkerTp(tp[0], tp[1], tuple(shardings), "torch.float16", 16, "LBNHC", tuple(why))
    w = HmaNixlWorker(layout, kcc.num_blocks, name, "127.0.0.1", _port(), tp=wtp,
                      block_size_remap=remap)
    w.register_kv_caches(allocate_paged_kv(layout, kcc.num_blocks).kv_caches)  # spec page sizes
    return w


def _load(w, remote: RemotePeer, local_ids):
    req = RecvRequest("d-req", local_ids, tuple(0 for _ in local_ids), remote, awaiting=True)
    w.start_load_kv(HmaNixlConnectorMetadata(reqs_to_recv={"d-req": req},
                                             scheduler_clock=time.perf_counter()))
    return w.get_transfer_results()


#: the tiny GDN's TP-independent state geometry (test_state_tp_vllm), DS; its content at
#: TP 1 (896 B) fits qwen3_next_like's 4096 B state pages
GDN = STV.hm_global("gdn", "DS")
ATTN = GroupSharding(2, 1, False)


def _hybrid(bs: int = 64, heads: int = 2):
    """qwen3_next_like with ``heads`` KV heads per rank (1 at TP 2 of the 2-head model)."""
    fa = H.attn(bs, heads)
    return H.KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[
        H.group(["model.layers.3.attn"], fa),
        H.group(["model.layers.0.linear_attn"], H.mamba(bs, fa.page_size_bytes))])


def test_mamba_group_without_geometry_refuses_another_tp_size(caplog):
    """A Mamba group this rank has no state geometry for (a state type not modelled): the
    pairing with an engine of another TP size is refused before any handshake, naming the
    group and why; a live P (TP 1) is there, so lifting the refusal would pair."""
    P = _worker(_hybrid(), "P-nogeo", [ATTN, GroupSharding(1, 1, True)])
    D = _worker(_hybrid(heads=1), "D-nogeo", [ATTN, GroupSharding(1, 1, True)], tp=(0, 2),
                why=("", "mamba_type KDA: state sharding not modelled"))
    try:
        remote = RemotePeer("P-nogeo", "p-req", "127.0.0.1", P.port, [[3], [4]], tp_size=1)
        assert _load(D, remote, [[5], [6]]) == (set(), {"d-req"}, {"d-req"})
        assert "group 1 is Mamba state without a state geometry (mamba_type KDA: state " \
               "sharding not modelled); its pages pair only between equal TP sizes (this " \
               "rank: TP 2, engine at 127.0.0.1:" in caplog.text
        assert D.agent.peers == ()                       # nothing was connected
    finally:
        D.shutdown()
        P.shutdown()


def test_peer_without_state_geometry_is_refused_at_the_handshake(caplog):
    """D declares the group's geometry, P (another TP size) does not: the handshake refuses
    by name (protocol 5 state check), nothing is read."""
    P = _worker(_hybrid(), "P-nogeo2", [ATTN, GroupSharding(1, 1, True)])
    D = _worker(_hybrid(heads=1), "D-geo2", [ATTN, GroupSharding(1, 1, True, state=GDN)], tp=(0, 2))
    try:
        remote = RemotePeer("P-nogeo2", "p-req", "127.0.0.1", P.port, [[3], [4]], tp_size=1)
        assert _load(D, remote, [[5], [6]]) == (set(), {"d-req"}, {"d-req"})
        # P's handshake server refuses first (its own view: "local" is P)
        assert "group 1 is Mamba state and the TP sizes differ (local 1, remote 2) but the " \
               "local side sent no state geometry" in caplog.text
        assert D.agent.peers == ()
    finally:
        D.shutdown()
        P.shutdown()


@pytest.mark.parametrize("p_geo,msg", [
    (None, "group 1 is Mamba state and the TP sizes differ (local 1, remote 2) but the local "
           "side sent no state geometry"),
    (STV.hm_global("gdn", "SD"), "disagrees on group 1's Mamba state geometry: conv_layout "
                                 "local 'SD', remote 'DS' (a DS/SD conv state mix is a "
                                 "transposed copy"),
], ids=["p-without-geometry", "ds-sd-mix"])
def test_mamba_block_size_remap_across_tp_sizes_refusals(caplog, p_geo, msg):
    """Block sizes AND TP sizes differ: the remap pairs the state geometry's byte ranges
    (tests/vllm/test_pd_nixl_tp.py moves them), so what still refuses is what refuses without
    a remap: a side without a state geometry, or geometries that differ (a DS/SD conv layout
    mix), at the handshake by name; nothing is connected or read."""
    P = _worker(_hybrid(bs=32), f"P-remap-{p_geo is None}",
                [ATTN, GroupSharding(1, 1, True, state=p_geo)])
    D = _worker(_hybrid(bs=64, heads=1), f"D-remap-{p_geo is None}",
                [ATTN, GroupSharding(1, 1, True, state=GDN)], tp=(0, 2))
    try:
        remote = RemotePeer(P.engine_id, "p-req", "127.0.0.1", P.port, [[3, 4], [4]],
                            tp_size=1)
        assert _load(D, remote, [[5], [6]]) == (set(), {"d-req"}, {"d-req"})
        assert msg in caplog.text
        assert "a block-size remap moves state pages only between equal TP sizes" \
            not in caplog.text
        assert D.agent.peers == ()
    finally:
        D.shutdown()
        P.shutdown()


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
