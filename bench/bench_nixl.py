"""End-to-end NIXL READ of one request (two UCX agents, one process, DRAM): through hmacore
(desc ids on both plans + post + bounded wait + release) next to raw NIXL calls on the same
buffers with precomputed descriptor ids. The difference is hmacore's per-request overhead."""
import numpy as np
import pytest

from hmacore.paged import allocate_paged_kv, fill_pattern, verify_pattern
from hmacore.plan import TransferPlan
from hmacore.presets import get_preset

pytestmark = pytest.mark.nixl

TOKENS = 2048
PAGE = 1024


@pytest.fixture(scope="module")
def agents():
    from hmacore.transport.nixl import NixlAgent
    layout = get_preset("gemma-3")
    plan0 = TransferPlan.from_layout(layout, 1024, page_bytes=PAGE)
    counts = plan0.request_blocks(TOKENS)
    table, k = [], 1
    for n in counts:
        table.append(list(range(k, k + n)))
        k += n
    nb = k + 1
    src = allocate_paged_kv(layout, nb, page_bytes=PAGE)
    dst = allocate_paged_kv(layout, nb, page_bytes=PAGE)
    fill_pattern(src, table)
    a = NixlAgent("bench-d", TransferPlan.from_kv_caches(layout, dst.kv_caches, num_blocks=nb))
    b = NixlAgent("bench-p", TransferPlan.from_kv_caches(layout, src.kv_caches, num_blocks=nb))
    peer = a.add_peer(b.handshake_payload())
    yield a, b, peer, table, dst
    a.close()
    b.close()


INPUTS = ["lists", "int32"]   # block ids as Python lists (proxy JSON) or int32 arrays (tracker/clip)


@pytest.mark.parametrize("ids", INPUTS)
def test_read_hmacore(benchmark, agents, ids):
    a, _, peer, table, dst = agents
    benchmark.group = f"nixl-read-gemma3-2048tok-{ids}"
    benchmark.extra_info["impl"] = "hmacore"
    if ids == "int32":
        table = tuple(np.asarray(g, dtype=np.int32) for g in table)

    def run():
        a.wait(a.read("bench", peer, table, table), timeout=30)

    run()
    assert verify_pattern(dst, table) == []
    benchmark(run)


@pytest.mark.parametrize("ids", INPUTS)
def test_read_raw_nixl(benchmark, agents, ids):
    a, _, peer, table, dst = agents
    benchmark.group = f"nixl-read-gemma3-2048tok-{ids}"
    benchmark.extra_info["impl"] = "raw"
    agent, local = a._agent, a._local
    remote = a._peers[peer].dlist
    lids = a.plan.desc_ids(table).astype(np.int32)
    rids = a._peers[peer].plan.desc_ids(table).astype(np.int32)
    benchmark.extra_info["descriptors"] = int(lids.size)

    def run():
        h = agent.make_prepped_xfer("READ", local, lids, remote, rids)
        state = agent.transfer(h)
        while state == "PROC":
            state = agent.check_xfer_state(h)
        assert state == "DONE"
        agent.release_xfer_handle(h)

    for s in dst.storages:
        s[:] = 0
    run()
    assert verify_pattern(dst, table) == []
    benchmark(run)
