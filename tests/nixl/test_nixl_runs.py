"""Coalesced posting over real NIXL (two UCX agents, DRAM): every posting mechanism moves
exactly the per-block bytes -- READ and WRITE, fresh (ascending), eviction-order
(descending) and scattered tables, layer-major and block-major pages -- and nothing else."""
import os

import numpy as np
import pytest

from hmacore.plan import TransferPlan
from hmacore.spec import GroupKind, GroupSpec, KVLayout
from hmacore.transport.nixl import NixlAgent
from hmacore.transport.nixl_post import POSTINGS

pytestmark = pytest.mark.nixl
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

NB, PAGE, LAYERS = 48, 256, 3
LAYOUT = KVLayout(groups=(
    GroupSpec(GroupKind.FULL, 16, tuple(f"m.f.{j}" for j in range(LAYERS))),
    GroupSpec(GroupKind.SLIDING_WINDOW, 16, tuple(f"m.s.{j}" for j in range(LAYERS)),
              sliding_window=64)))
NAMES = [n for g in LAYOUT.groups for n in g.layer_names]


def _side(block_major: bool):
    if block_major:    # [blocks, layers, page]: a block's layer slots adjacent
        mem = np.zeros((NB, len(NAMES), PAGE), np.uint8)
        kv = {n: mem[:, j, :] for j, n in enumerate(NAMES)}
    else:
        mem = np.zeros((len(NAMES), NB, PAGE), np.uint8)
        kv = {n: mem[j] for j, n in enumerate(NAMES)}
    return mem, kv


@pytest.fixture(scope="module", params=[False, True], ids=["layer-major", "block-major"])
def agents(request):
    made = []
    for posting in POSTINGS:
        (am, akv), (bm, bkv) = _side(request.param), _side(request.param)
        a = NixlAgent(f"runs-a-{posting}", TransferPlan.from_kv_caches(LAYOUT, akv,
                                                                       num_blocks=NB),
                      posting=posting)
        b = NixlAgent(f"runs-b-{posting}", TransferPlan.from_kv_caches(LAYOUT, bkv,
                                                                       num_blocks=NB),
                      posting=posting)
        a.add_peer(b.handshake_payload())
        b.add_peer(a.handshake_payload())
        made.append((posting, a, b, am, bm))
    yield request.param, made
    for _, a, b, _, _ in made:
        a.close()
        b.close()


def _pages(mem, block_major, ids, layers):
    """Pages of the given blocks for the given layer indices, (len(ids), len(layers), PAGE)."""
    ids = np.asarray(ids, dtype=np.intp)
    return mem[ids][:, layers] if block_major else mem[layers][:, ids].transpose(1, 0, 2)


TABLES = {
    "fresh": ([list(range(1, 9)), list(range(9, 13))], [list(range(20, 28)), list(range(28, 32))]),
    "eviction": ([list(range(40, 32, -1)), list(range(32, 28, -1))],
                 [list(range(27, 19, -1)), list(range(19, 15, -1))]),
    "scattered": ([[5, 17, 2, 33, 9, 41, 12, 28], [3, 44, 21, 8]],
                  [[30, 1, 22, 11, 46, 7, 39, 14], [25, 6, 35, 18]]),
}


@pytest.mark.parametrize("op", ["READ", "WRITE"])
@pytest.mark.parametrize("kind", list(TABLES))
def test_every_posting_moves_exactly_the_block_bytes(agents, op, kind):
    block_major, made = agents
    local, remote = TABLES[kind]
    seen = {}
    for posting, a, b, am, bm in made:
        rng = np.random.default_rng(7)
        src, dst = (bm, am) if op == "READ" else (am, bm)
        src[...] = rng.integers(0, 256, src.shape, dtype=np.uint8)
        dst[...] = 0
        before = dst.copy()
        peer = b.name
        call = a.read if op == "READ" else a.write
        t = a.wait(call(f"{op}-{kind}", peer, local, remote), timeout=20)
        assert t.state == "DONE"
        src_ids, dst_ids = (remote, local) if op == "READ" else (local, remote)
        for g in range(2):
            layers = [NAMES.index(n) for n in LAYOUT.groups[g].layer_names]
            got = _pages(dst, block_major, dst_ids[g], layers)
            assert np.array_equal(got, _pages(src, block_major, src_ids[g], layers))
            # clear what was expected to change: nothing else may differ from before
            if block_major:
                dst[np.ix_(dst_ids[g], layers)] = 0
            else:
                dst[np.ix_(layers, dst_ids[g])] = 0
        assert np.array_equal(dst, before)
        assert t.block_descriptors == 12 * LAYERS
        seen[posting] = (t.descriptors, t.runs, t.mechanism)
    runs = seen["dynamic"][1]
    assert seen["dynamic"] == (runs, runs, "dynamic")
    assert seen["prepped"] == (12 * LAYERS, runs, "prepped")
    assert seen["blocks"] == (12 * LAYERS, -1, "blocks")
    # layer-major: one run per layer; block-major: one run per block (its group's layer
    # slots abut; the other group's slots sit between two blocks), except that in the
    # eviction table g1's block 32 (slots 3-5) ends where g0's block 33 starts, on both
    # sides (remote 19 -> 20): one run of 6 slots
    expected = {("fresh", False): 2 * LAYERS, ("fresh", True): 12,
                ("eviction", False): 2 * LAYERS, ("eviction", True): 11}
    if kind in ("fresh", "eviction"):
        assert runs == expected[(kind, block_major)]
    else:
        assert runs > 6
