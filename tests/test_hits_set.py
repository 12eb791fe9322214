"""ExistenceSet: behaviour against a Python set, bulk APIs, memory, and bad inputs."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hmacore.errors import HashInputError
from hmacore.hits import ExistenceSet, as_hash_array

DIGESTS = st.sampled_from([16, 32])


@given(ds=DIGESTS, ops=st.lists(st.tuples(st.sampled_from(["add", "discard", "has"]),
                                          st.integers(0, 3), st.integers(0, 40)), max_size=300))
def test_matches_python_set(ds, ops):
    es, ref = ExistenceSet(ds), set()
    pool = [bytes([i % 251]) * ds if i % 3 else i.to_bytes(ds, "big") for i in range(41)]
    for op, g, i in ops:
        key = (g, pool[i])
        if op == "add":
            assert es.add(g, pool[i]) == (key not in ref)
            ref.add(key)
        elif op == "discard":
            assert es.discard(g, pool[i]) == (key in ref)
            ref.discard(key)
        else:
            assert es.contains(g, pool[i]) == (key in ref)
            assert (key in es) == (key in ref)
        assert len(es) == len(ref)
    for g in range(4):
        arr = np.frombuffer(b"".join(pool), dtype=np.uint8).reshape(-1, ds)
        mask = es.contains_many(g, arr)
        assert mask.tolist() == [int((g, p) in ref) for p in pool]
        run = next((i for i, p in enumerate(pool) if (g, p) not in ref), len(pool))
        assert es.leading_run(g, arr) == run


def test_bulk_roundtrip_and_memory():
    rng = np.random.default_rng(1)
    for ds in (16, 32):
        arr = rng.integers(0, 256, size=(50_000, ds), dtype=np.uint8)
        es = ExistenceSet(ds)
        assert es.add_many(7, arr) == 50_000
        assert es.add_many(7, arr[:10]) == 0           # duplicates are not new
        assert len(es) == 50_000
        assert es.contains_many(7, arr).all() and not es.contains_many(8, arr).any()
        assert es.leading_run(7, arr) == 50_000
        bytes_per_key = es.nbytes / len(es)
        assert 1.33 * (4 + ds) <= bytes_per_key <= 2.67 * (4 + ds) + 1e-9
        assert es.discard_many(7, arr[:25_000]) == 25_000
        assert es.leading_run(7, arr) == 0 and es.leading_run(7, arr[25_000:]) == 25_000
        # tombstones are reused / cleared: re-adding keeps the table bounded
        for _ in range(3):
            es.add_many(7, arr[:25_000])
            es.discard_many(7, arr[:25_000])
        assert len(es) == 25_000 and es.capacity <= 2 ** 17
        es.clear()
        assert len(es) == 0 and not es.contains_many(7, arr).any()


def test_structured_digests_do_not_collide_badly():
    # digests that differ only in the last bytes (small ints) must still spread
    es = ExistenceSet(32)
    arr = np.zeros((20_000, 32), dtype=np.uint8)
    arr[:, -4:] = np.arange(20_000, dtype=">u4").view(np.uint8).reshape(-1, 4)
    assert es.add_many(0, arr) == 20_000
    assert es.contains_many(0, arr).all()


def test_empty_everything():
    es = ExistenceSet(16)
    empty = np.zeros((0, 16), dtype=np.uint8)
    assert es.add_many(0, empty) == 0
    assert es.contains_many(0, empty).shape == (0,)
    assert es.contains_many(0, empty).dtype == np.uint8
    assert es.leading_run(0, empty) == 0
    assert es.discard_many(0, empty) == 0
    assert len(es) == 0 and es.nbytes == 0
    assert not es.contains(0, b"\0" * 16) and not es.discard(0, b"\0" * 16)
    assert as_hash_array([], 16).shape == (0, 16)


@pytest.mark.parametrize("bad, rule", [
    (np.zeros((4, 32), dtype=np.uint8), "shape"),                 # wrong digest size
    (np.zeros((4, 16), dtype=np.int64), "dtype"),                 # wrong dtype
    (np.zeros((8, 16), dtype=np.uint8)[::2], "C-contiguous"),     # non-contiguous rows
    (np.zeros((4, 32), dtype=np.uint8)[:, :16], "C-contiguous"),  # non-contiguous view
    (np.zeros(16, dtype=np.uint8), "shape"),                      # 1-D
    ([b"\0" * 16], "numpy"),                                      # not an array
])
def test_bad_digest_arrays_are_rejected(bad, rule):
    es = ExistenceSet(16)
    es.add(0, b"\1" * 16)
    for call in (es.add_many, es.contains_many, es.leading_run, es.discard_many):
        with pytest.raises(HashInputError, match=rule):
            call(0, bad)
    assert len(es) == 1 and es.contains(0, b"\1" * 16)   # nothing changed


@pytest.mark.parametrize("group", [-1, 2 ** 31, 1.0, True, "0", None])
def test_bad_group_ids_are_rejected(group):
    es = ExistenceSet(16)
    with pytest.raises(HashInputError, match="group"):
        es.add(group, b"\0" * 16)
    with pytest.raises(HashInputError, match="group"):
        es.contains_many(group, np.zeros((1, 16), dtype=np.uint8))
    assert len(es) == 0


def test_bad_digests_and_sizes_are_rejected():
    with pytest.raises(HashInputError, match="digest_size"):
        ExistenceSet(20)
    with pytest.raises(HashInputError, match="capacity"):
        ExistenceSet(16, -1)
    es = ExistenceSet(32)
    with pytest.raises(HashInputError, match="32 bytes"):
        es.add(0, b"\0" * 16)
    with pytest.raises(HashInputError, match="bytes"):
        es.add(0, "x" * 32)
    with pytest.raises(HashInputError, match="tuple"):
        _ = b"\0" * 32 in es
    with pytest.raises(HashInputError):
        as_hash_array([b"\0" * 16, b"\0" * 32])
    assert len(es) == 0


def test_presized_set_does_not_grow():
    es = ExistenceSet(16, capacity=1000)
    cap = es.capacity
    es.add_many(0, np.random.default_rng(0).integers(0, 256, (1000, 16), dtype=np.uint8))
    assert es.capacity == cap


def test_concurrent_bulk_mutation_and_lookup():
    import threading
    rng = np.random.default_rng(3)
    blocks = [rng.integers(0, 256, (5000, 32), dtype=np.uint8) for _ in range(4)]
    es = ExistenceSet(32)
    es.add_many(9, blocks[0])
    errors = []

    def writer(i):
        for _ in range(5):
            es.add_many(i, blocks[i])          # grows the table while readers run
            es.discard_many(i, blocks[i][:2500])

    def reader():
        for _ in range(20):
            if not es.contains_many(9, blocks[0]).all():
                errors.append("lost key")

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(1, 4)]
    threads += [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(es) == 5000 + 3 * 2500
