"""EmbeddedStore and the lookup/save/load flows over a hybrid layout (no server)."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from hmacore.errors import HashInputError
from hmacore.hits import HitFinder
from hmacore.keys import KeyBuilder
from hmacore.presets import get_preset
from hmacore.spec import GroupKind, GroupSpec, KVLayout
from hmacore.transport.store import (INVALID, NO_SPACE, NOT_FOUND, OK, PRESENT, EmbeddedStore,
                                     GroupSegments, load_blocks, lookup_hit,
                                     lookup_hit_indexed, save_blocks,
                                     save_state)

from hits_scenarios import make_hashes


def test_put_get_exists_remove_roundtrip():
    st = EmbeddedStore(1 << 20)
    src = np.arange(256, dtype=np.uint8)
    dst = np.zeros(256, dtype=np.uint8)
    st.register(src.ctypes.data, src.nbytes)
    st.register(dst.ctypes.data, dst.nbytes)
    a, b = src.ctypes.data, dst.ctypes.data
    assert st.batch_put(["k1", "k2"], [[(a, 64), (a + 128, 64)], [(a + 64, 8)]]) == [OK, OK]
    assert st.batch_exists(["k1", "k2", "k3"]) == [1, 1, 0]
    assert st.batch_get(["k1", "k3"], [[(b, 128)], [(b, 8)]]) == [128, NOT_FOUND]
    assert np.array_equal(dst[:64], src[:64]) and np.array_equal(dst[64:128], src[128:192])
    assert st.batch_get(["k2"], [[(b, 4)]]) == [INVALID]                 # wrong size
    assert st.batch_remove(["k1", "k1"]) == [OK, NOT_FOUND]
    assert st.batch_exists([]) == [] and st.batch_put([], []) == []


def test_unregistered_memory_is_refused_not_read():
    st = EmbeddedStore(1 << 20)
    buf = np.zeros(64, dtype=np.uint8)
    assert st.batch_put(["k"], [[(buf.ctypes.data, 64)]]) == [INVALID]
    st.register(buf.ctypes.data, 32)
    assert st.batch_put(["k"], [[(buf.ctypes.data, 64)]]) == [INVALID]   # runs past the region
    assert len(st) == 0


def test_lru_eviction_and_no_space():
    st = EmbeddedStore(300)
    buf = np.zeros(400, dtype=np.uint8)
    st.register(buf.ctypes.data, 400)
    a = buf.ctypes.data
    for i in range(3):
        assert st.batch_put([f"k{i}"], [[(a, 100)]]) == [OK]
    st.batch_get(["k0"], [[(a + 200, 100)]])           # k0 becomes most recent
    assert st.batch_put(["k3"], [[(a, 100)]]) == [OK]  # evicts k1 (least recent)
    assert st.batch_exists(["k0", "k1", "k2", "k3"]) == [1, 0, 1, 1]
    assert st.used_bytes == 300 and st.evictions == 1
    assert st.batch_put(["big"], [[(a, 400)]]) == [NO_SPACE]


def test_thread_safety_under_concurrent_puts():
    st = EmbeddedStore(64 * 200)
    buf = np.ones(64, dtype=np.uint8)
    st.register(buf.ctypes.data, 64)

    def worker(t):
        for i in range(200):
            st.batch_put([f"{t}-{i}"], [[(buf.ctypes.data, 64)]])
            st.batch_exists([f"{t}-{i}"])

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert st.used_bytes == 64 * len(st) <= 64 * 200


def test_bad_store_inputs():
    with pytest.raises(HashInputError):
        EmbeddedStore(0)
    st = EmbeddedStore(100)
    with pytest.raises(HashInputError):
        st.batch_exists("abc")
    with pytest.raises(HashInputError):
        st.batch_put(["a"], [])
    with pytest.raises(HashInputError):
        st.batch_put(["a"], [[(0, 4)]])
    with pytest.raises(HashInputError):
        GroupSegments((), (), 4)


class KVMemory:
    """Per-group paged KV: each group owns its own layers (num_blocks x page bytes each)."""

    def __init__(self, layout, num_blocks, layers=2, seed=0):
        rng = np.random.default_rng(seed)
        self.arrays = [[rng.integers(0, 256, (num_blocks, 8 * s.block_size), dtype=np.uint8)
                        for _ in range(layers)] for s in layout.groups]
        self.segments = [GroupSegments.from_arrays(a) for a in self.arrays]

    def register(self, store):
        for arrs in self.arrays:
            for a in arrs:
                store.register(a.ctypes.data, a.nbytes)


def _tables(finder, num_tokens, first_id):
    tables = []
    for g, bs in enumerate(finder.block_sizes):
        n = -(-num_tokens // bs)
        tables.append(list(range(first_id, first_id + n)))
    return tables


@pytest.mark.parametrize("preset", ["gpt-oss-120b", "deepseek-v4", "gemma-3-27b"])
def test_save_then_lookup_then_load_round_trip(preset):
    layout = get_preset(preset, num_blocks=1024)
    finder = HitFinder(layout)
    T = 3 * finder.scheduler_block_size + 5
    hashes = make_hashes(T // finder.hash_block_size, 32, 1)
    keys = KeyBuilder("model")
    store = EmbeddedStore(1 << 30)
    src, dst = KVMemory(layout, 1024, seed=1), KVMemory(layout, 1024, seed=2)
    src.register(store)
    dst.register(store)
    src_tables, dst_tables = _tables(finder, T, 1), _tables(finder, T, 400)
    rep = save_blocks(finder, keys, store, hashes, T, src_tables, src.segments)
    assert rep.written > 0 and rep.failed == 0 and not rep.no_space
    again = save_blocks(finder, keys, store, hashes, T, src_tables, src.segments)
    assert again.written == 0 and again.present == rep.written      # nothing rewritten
    hit = lookup_hit(finder, keys, store, hashes, T)
    assert hit.tokens == 3 * finder.scheduler_block_size           # all aligned blocks
    assert load_blocks(finder, keys, store, hashes, hit, dst_tables, dst.segments)
    for g in finder.group_ids:
        for i in np.flatnonzero(hit.masks[g]):
            for s, d in zip(src.arrays[g], dst.arrays[g]):
                assert np.array_equal(s[src_tables[g][i]], d[dst_tables[g][i]])
    # the whole prompt cached: the hit is re-derived below num_tokens (last token recomputed)
    exact = 3 * finder.scheduler_block_size
    assert lookup_hit(finder, keys, store, hashes[: exact // finder.hash_block_size],
                      exact).tokens == 2 * finder.scheduler_block_size


def test_lookup_with_nothing_to_ask_never_calls_the_store():
    class Exploding:
        def batch_exists(self, keys):
            raise AssertionError("no RPC expected")

    finder = HitFinder(get_preset("gpt-oss-120b"))
    keys = KeyBuilder("m")
    assert lookup_hit(finder, keys, Exploding(), np.zeros((0, 32), np.uint8), 1000).tokens == 0
    assert lookup_hit(finder, keys, Exploding(), make_hashes(4, 32, 0), 8).tokens == 0


def test_failing_store_means_miss():
    class Down:
        def batch_exists(self, keys):
            raise ConnectionError("master down")

    class Errors:
        def batch_exists(self, keys):
            return [-900] * len(keys)

    finder = HitFinder(get_preset("gpt-oss-120b"))
    hs = make_hashes(64, 32, 0)
    for store in (Down(), Errors()):
        assert lookup_hit(finder, KeyBuilder("m"), store, hs, 1024).tokens == 0


def test_no_space_stops_saving():
    layout = KVLayout(groups=(GroupSpec(GroupKind.FULL, 4, ("f",)),))
    finder = HitFinder(layout)
    mem = KVMemory(layout, 64)
    store = EmbeddedStore(1)            # every value is bigger than the store
    mem.register(store)
    rep = save_blocks(finder, KeyBuilder("m"), store, make_hashes(8, 16, 0), 32,
                      [list(range(1, 9))], mem.segments)
    assert rep.no_space and rep.written == 0


def test_null_blocks_are_never_stored_or_loaded():
    layout = get_preset("gpt-oss-120b", num_blocks=64)
    finder = HitFinder(layout)
    mem = KVMemory(layout, 64)
    store = EmbeddedStore(1 << 24)
    mem.register(store)
    T = 160
    hs = make_hashes(T // 16, 32, 3)
    tables = [[0] * 8 + [5, 6], list(range(10, 20))]    # SW table with a null head
    rep = save_blocks(finder, KeyBuilder("m"), store, hs, T, tables, mem.segments)
    assert rep.failed == 0
    with pytest.raises(HashInputError, match="null"):
        mem.segments[0].parts([0])


def test_mamba_states_go_through_boundary_puts():
    layout = get_preset("qwen3-next-80b", num_blocks=64)     # 3 Mamba groups + FA, bs 544
    finder = HitFinder(layout)
    T = 3 * 544 + 5
    hs = make_hashes(T // finder.hash_block_size, 32, 4)
    keys, store = KeyBuilder("qwen"), EmbeddedStore(1 << 30)
    src, dst = KVMemory(layout, 64, seed=5), KVMemory(layout, 64, seed=6)
    src.register(store)
    dst.register(store)
    src_t, dst_t = _tables(finder, T, 1), _tables(finder, T, 20)
    rep = save_blocks(finder, keys, store, hs, T, src_t, src.segments)
    assert rep.written == 3                                  # FA only: states never positional
    assert lookup_hit(finder, keys, store, hs, T).tokens == 0
    for g in (0, 1, 2):
        assert save_state(finder, keys, store, hs, T, g, 40 + g, src.segments[g]) == OK
    hit = lookup_hit(finder, keys, store, hs, T)
    assert hit.tokens == 3 * 544
    assert [m.tolist() for m in hit.masks[:3]] == [[0, 0, 1]] * 3
    assert load_blocks(finder, keys, store, hs, hit, dst_t, dst.segments)
    for g in (0, 1, 2):
        for s_arr, d_arr in zip(src.arrays[g], dst.arrays[g]):
            assert np.array_equal(s_arr[40 + g], d_arr[dst_t[g][2]])
    # if_absent: a state already stored is not rewritten (its bytes stay the first put's)
    puts = []
    put = store.batch_put
    store.batch_put = lambda k, p: puts.append(k) or put(k, p)
    assert save_state(finder, keys, store, hs, T, 0, 7, src.segments[0], if_absent=True) == PRESENT
    assert puts == []
    assert save_state(finder, keys, store, hs, T, 0, 7, src.segments[0]) == OK and len(puts) == 1
    with pytest.raises(HashInputError, match="Mamba"):
        save_state(finder, keys, store, hs, T, 3, 1, src.segments[3])


def test_flows_reject_bad_hash_arrays():
    finder = HitFinder(get_preset("gpt-oss-120b"))
    store = EmbeddedStore(1 << 20)
    for bad in ([b"\0" * 32], np.zeros((4, 20), np.uint8), np.zeros((8, 32), np.uint8)[::2]):
        with pytest.raises(HashInputError):
            lookup_hit(finder, KeyBuilder("m"), store, bad, 64)
        with pytest.raises(HashInputError):
            save_blocks(finder, KeyBuilder("m"), store, bad, 64, [[1], [2]], [None, None])
    assert len(store) == 0


@pytest.mark.parametrize("preset", ["gpt-oss-120b", "deepseek-v4", "qwen3-next-80b"])
def test_digest_index_lookup_equals_the_key_lookup(preset):
    """The embedded store's digest index follows its keys through puts, LRU evictions and
    removals: a lookup on it (vLLM's list[bytes] read in place) equals lookup_hit on key
    strings, for requests sharing prefixes, at every stage."""
    layout = get_preset(preset, num_blocks=4096)
    finder = HitFinder(layout)
    keys = KeyBuilder("model")
    ns = keys.prefix(finder.group_ids[0]).rpartition("@group:")[0]
    rng = np.random.default_rng(3)
    h = finder.hash_block_size
    T = 4 * finder.scheduler_block_size + 3
    base = make_hashes(T // h, 32, 5)
    reqs = []
    for r in range(8):                 # shared prefixes of random lengths, then new rows
        cut = int(rng.integers(0, base.shape[0] + 1))
        tail = make_hashes(base.shape[0] - cut, 32, 100 + r)
        reqs.append(np.ascontiguousarray(np.concatenate([base[:cut], tail])))
    mem = KVMemory(layout, 4096, seed=1)
    probe = KVMemory(layout, 1, seed=2)
    # half of what all saves write: later saves evict earlier keys
    big = EmbeddedStore(1 << 30)
    mem.register(big)
    for i, hashes in enumerate(reqs):
        save_blocks(finder, keys, big, hashes, T, _tables(finder, T, 1 + 40 * i), mem.segments)
    store = EmbeddedStore(big.used_bytes // 2)
    mem.register(store)
    probe.register(store)

    def check(stage):
        index = store.digest_index(ns)
        for i, hashes in enumerate(reqs):
            for n in (T, T - 1, finder.scheduler_block_size, 1):
                want = lookup_hit(finder, keys, store, hashes, n)
                if index is None:
                    assert want.tokens == 0, (stage, i, n)
                    continue
                rows = [bytes(r) for r in hashes]
                got = lookup_hit_indexed(finder, index, rows, n)
                assert got.tokens == want.tokens, (stage, i, n)
                for g in finder.group_ids:
                    assert np.array_equal(got.masks[g], want.masks[g]), (stage, i, n, g)

    check("empty")
    for i, hashes in enumerate(reqs):
        save_blocks(finder, keys, store, hashes, T, _tables(finder, T, 1 + 40 * i),
                    mem.segments)
        check(f"after save {i}")
    assert store.evictions > 0, "the store was meant to evict"
    hit_keys = [k for k in store._data if "@group:" in k][:: 3]
    store.batch_remove(hit_keys)
    check("after removals")
    assert len(store.digest_index(ns)) == sum(1 for k in store._data if k.startswith(ns))


def test_digest_index_ignores_foreign_keys_and_mixed_widths():
    st = EmbeddedStore(1 << 20)
    buf = np.zeros(64, dtype=np.uint8)
    st.register(buf.ctypes.data, 64)
    p = [[(buf.ctypes.data, 8)]]
    st.batch_put(["plain-key"], p)
    st.batch_put(["m@group:x@abcd"], p)              # group not a number
    st.batch_put(["m@group:1@zz"], p)                # not hex
    st.batch_put(["m@group:1@" + "ab" * 20], p)      # 20 bytes: no digest width hmacore uses
    assert st.digest_index("m") is None and len(st) == 4
    st.batch_put(["m@group:1@" + "ab" * 16], p)
    es = st.digest_index("m")
    assert es is not None and (1, bytes.fromhex("ab" * 16)) in es and len(es) == 1
    st.batch_put(["m@group:1@" + "cd" * 32], p)      # another width: no index any more
    assert st.digest_index("m") is None
