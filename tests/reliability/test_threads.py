"""Thread safety: GIL-releasing kernels on shared read-only plans / finders / existence sets
and per-thread trackers give the single-threaded answers; one ExistenceSet under concurrent
add/discard/contains stays consistent; EmbeddedStore under concurrent put/get/exists keeps
every byte. Threads are joined with a timeout (a hang fails the test)."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from hmacore.hits import ExistenceSet, HitFinder
from hmacore.plan import TransferPlan
from hmacore.presets import get_preset
from hmacore.tables import TrackerSet, fill_blocks
from hmacore.transport.store import OK, EmbeddedStore
from hmacore.windows import clip_tracked, expand_layout_to_kernel
from rel_common import EXAMPLES

pytestmark = pytest.mark.reliability
THREADS = 4
ROUNDS = max(20, EXAMPLES // 3)


def run_threads(fn, n=THREADS, timeout=120):
    errors, results = [], [None] * n

    def wrap(i):
        try:
            results[i] = fn(i)
        except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
            errors.append(e)

    ths = [threading.Thread(target=wrap, args=(i,), daemon=True) for i in range(n)]
    for t in ths:
        t.start()
    for t in ths:
        t.join(timeout)
        assert not t.is_alive(), "thread hung"
    if errors:
        raise errors[0]
    return results


def _requests(layout, nb, seed, n):
    rng = np.random.default_rng(seed)
    return [tuple(rng.integers(1, nb, size=rng.integers(0, 40), dtype=np.int32)
                  for _ in layout.groups) for _ in range(n)]


def test_plan_tracker_clip_kernels_concurrently():
    layout = get_preset("gemma-3", num_blocks=4096)
    plan = TransferPlan.from_layout(layout, 4096, page_bytes=64)   # shared, read-only
    reqs = _requests(layout, 4096, 7, ROUNDS)

    def pipeline(i):
        ts = TrackerSet(layout)                                     # per-thread tracker
        out = []
        for k, table in enumerate(reqs):
            ts.add(k, table)
            ts.append(k, [t[:3] for t in table])
            (clipped,) = clip_tracked(ts, [k])
            ids = [c[c != 0] for c in clipped]
            out.append((plan.desc_ids(ids).tobytes(),
                        b"".join(x.tobytes() for x in expand_layout_to_kernel(ids, layout)),
                        b"".join(x.tobytes() for x in fill_blocks(ids, [np.zeros(len(x), bool)
                                                                         for x in ids]))))
            ts.finish(k)
        return out

    want = pipeline(-1)
    for got in run_threads(pipeline):
        assert got == want


def test_longest_hit_shared_finder_and_set_while_other_sets_mutate():
    layout = get_preset("gpt-oss-120b")
    finder = HitFinder(layout)
    rng = np.random.default_rng(3)
    hashes = [np.ascontiguousarray(rng.integers(0, 256, (int(n), 32), dtype=np.uint8))
              for n in rng.integers(1, 200, ROUNDS)]
    es = ExistenceSet(32)
    for h in hashes:
        for g in finder.group_ids:
            es.add_many(g, h[: rng.integers(0, h.shape[0] + 1)])
    hb = finder.hash_block_size
    want = [finder.longest_hit(h, es, h.shape[0] * hb) for h in hashes]

    def worker(i):
        own = ExistenceSet(32)
        out = []
        for h in hashes:
            own.add_many(0, h)                          # mutation of a private set
            r = finder.longest_hit(h, es, h.shape[0] * hb)
            out.append((r.tokens, [m.tobytes() for m in r.masks]))
        return out

    for got in run_threads(worker):
        assert got == [(w.tokens, [m.tobytes() for m in w.masks]) for w in want]


def test_one_existence_set_concurrent_add_discard_contains():
    es = ExistenceSet(16)
    rng = np.random.default_rng(5)
    blocks = [np.ascontiguousarray(rng.integers(0, 256, (64, 16), dtype=np.uint8))
              for _ in range(THREADS)]
    stable = np.ascontiguousarray(rng.integers(0, 256, (256, 16), dtype=np.uint8))
    es.add_many(9, stable)

    def worker(i):
        for _ in range(ROUNDS):
            assert es.add_many(i, blocks[i]) == 64            # thread i owns group i
            assert es.contains_many(i, blocks[i]).all()
            assert es.leading_run(9, stable) == 256           # never disturbed
            assert es.discard_many(i, blocks[i]) == 64
        return True

    assert all(run_threads(worker))
    assert len(es) == 256


def test_embedded_store_concurrent_put_get_exists_keeps_every_byte():
    n_keys, size = 64, 512
    store = EmbeddedStore(n_keys * size * THREADS)   # room for everything: no eviction
    src = np.random.default_rng(9).integers(0, 256, (THREADS, n_keys, size), dtype=np.uint8)
    dst = np.zeros_like(src)
    store.register(src.ctypes.data, src.nbytes)
    store.register(dst.ctypes.data, dst.nbytes)
    checked = [0] * THREADS

    def worker(t):
        keys = [f"t{t}-k{i}" for i in range(n_keys)]
        for rnd in range(max(3, ROUNDS // 10)):
            parts = [[(src[t, i].ctypes.data, size)] for i in range(n_keys)]
            assert store.batch_put(keys, parts) == [OK] * n_keys
            assert store.batch_exists(keys) == [1] * n_keys
            other = f"t{(t + 1) % THREADS}-k{rnd % n_keys}"
            store.batch_exists([other])                   # cross-thread reads
            got = store.batch_get(keys, [[(dst[t, i].ctypes.data, size)] for i in range(n_keys)])
            assert got == [size] * n_keys
            assert np.array_equal(dst[t], src[t])
            checked[t] += dst[t].nbytes
            dst[t] = 0
        return True

    assert all(run_threads(worker))
    assert store.used_bytes == THREADS * n_keys * size == len(store) * size
    print(f"\nthreads: store bytes verified {sum(checked)}")


# -- threading contract (see the class docstrings) ---------------------------------------------
def test_tracker_set_shared_by_eight_threads_is_refused_not_corrupted():
    """A TrackerSet has one owner thread: a mutation from any other thread raises a clear
    TrackerStateError instead of mixing requests' block ids."""
    from hmacore.errors import TrackerStateError

    layout = get_preset("gemma-3", num_blocks=4096)
    ts = TrackerSet(layout)
    G = layout.num_groups
    barrier = threading.Barrier(8)

    def worker(i):
        barrier.wait()
        done = 0
        try:
            for k in range(ROUNDS):
                rid = (i, k)
                ids = [[1 + (i * 97 + k + g) % 4000] * 3 for g in range(G)]
                ts.add(rid, ids)
                ts.append(rid, [[1 + i] for _ in range(G)])
                out = ts.finish(rid)
                assert [x.tolist() for x in out] == [ids[g] + [1 + i] for g in range(G)]
                done += 1
        except TrackerStateError as e:
            assert "thread" in str(e)
            return ("refused", done)
        return ("ok", done)

    results = run_threads(worker, n=8)
    assert sum(r[0] == "ok" for r in results) <= 1
    assert sum(r[0] == "refused" and r[1] == 0 for r in results) >= 7
    assert len(ts) <= 1          # at most the owner's request in flight when others failed


def test_tracker_set_hand_off_to_another_thread():
    layout = get_preset("gemma-3", num_blocks=4096)
    ts = TrackerSet(layout)
    ts.add("r", [[1]] * layout.num_groups)          # the building thread owns it

    def worker(i):
        ts.bind_to_current_thread()                 # explicit hand-off
        ts.append("r", [[2]] * layout.num_groups)
        return ts.num_blocks("r")

    assert run_threads(worker, n=1) == [(2,) * layout.num_groups]
    ts.bind_to_current_thread()
    ts.finish("r")


def test_clip_spans_results_of_concurrent_threads_are_their_own():
    from hmacore.windows import clip_tracked_spans

    layout = get_preset("gemma-3", num_blocks=4096)
    reqs = _requests(layout, 4096, 11, 32)

    def worker(i):
        ts = TrackerSet(layout)
        for k, t in enumerate(reqs):
            ts.add(k, t)
        want = clip_tracked_spans(ts, list(range(len(reqs)))).copy()
        held = []
        for _ in range(ROUNDS):
            got = clip_tracked_spans(ts, list(range(len(reqs))))
            held.append(got)
            if len(held) > 3:
                held.pop(0)
            assert all(np.array_equal(h, want) for h in held)
        return True

    assert all(run_threads(worker, n=8))


def test_shared_plan_with_list_input_while_lists_change():
    layout = get_preset("gemma-3", num_blocks=4096)
    plan = TransferPlan.from_layout(layout, 4096, page_bytes=64)
    G = layout.num_groups
    base = [np.arange(1, 200, dtype=np.int32) for _ in range(G)]
    want = plan.desc_ids(base)
    shared = list(base)
    stop = threading.Event()

    def churn(_):
        while not stop.is_set():
            for g in range(G):
                shared[g] = base[g].copy()
        return True

    def reader(_):
        for _ in range(ROUNDS * 5):
            assert np.array_equal(plan.desc_ids(shared), want)
        return True

    t = threading.Thread(target=churn, args=(0,), daemon=True)
    t.start()
    try:
        assert all(run_threads(reader, n=3))
    finally:
        stop.set()
        t.join(30)
