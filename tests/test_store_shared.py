"""SharedStore: the embedded store in shared memory, across real processes (spawn).

Two processes see one store (keys, bytes, the digest index mirror); CLOCK eviction keeps the
index, the pages and every mirror in step; the capacity is exact; a segment left by killed
processes is reclaimed (same name) or swept (other names); a process killed halfway through a
change leaves a store that the next user empties, never a deadlock or torn data; bad
arguments and configs are refused with the rule in the message. Every child process is
bounded in time and killed by its PID."""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
import uuid
from types import SimpleNamespace

import numpy as np
import pytest

from hmacore.errors import ConfigError, HashInputError, StoreError
from hmacore.hits import HitFinder
from hmacore.keys import KeyBuilder
from hmacore.presets import get_preset
from hmacore.spec import GroupKind
from hmacore.transport import shared_store as S
from hmacore.transport.shared_store import SEGMENT_PREFIX, SharedStore
from hmacore.transport.shm_segment import Segment, segment_paths
from hmacore.transport.store import (INVALID, NO_SPACE, NOT_FOUND, OK, EmbeddedStore,
                                     load_blocks, lookup_hit, lookup_hit_indexed, save_blocks)

from hits_scenarios import make_hashes

SHM = "/dev/shm"
TIMEOUT = 120          # seconds: a bound on every wait for a child, never a speed claim
NS = "model@tp_rank:0@pcp0@dcp0@pp_rank:0"


def _name() -> str:
    return "t-" + uuid.uuid4().hex[:12]


def _files(name: str) -> list[bool]:
    return [os.path.exists(p) for p in segment_paths(SHM, SEGMENT_PREFIX + name)]


@pytest.fixture
def stores():
    """Open stores through ``open(name, cap, page)``; all closed (and gone) at the end."""
    opened: list[SharedStore] = []

    def open_(name=None, cap=1 << 20, page=4096):
        s = SharedStore(name or _name(), cap, page)
        opened.append(s)
        return s

    yield open_
    for s in opened:
        s.close()
    for s in opened:
        assert _files(s.name) == [False] * 3, f"segment {s.name} left behind"


def _key(group: int, digest: bytes, ns: str = NS) -> str:
    return f"{ns}@group:{group}@{digest.hex()}"


def _digests(n: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, 32, dtype=np.uint8).tobytes() for _ in range(n)]


def _value(i: int, size: int) -> np.ndarray:
    return np.random.default_rng(1000 + i).integers(0, 256, size, dtype=np.uint8)


# -- children (spawned: module-level functions) ------------------------------------------------
def _child_writer(name, cap, page, n, size, to_parent, from_parent):
    st = SharedStore(name, cap, page)
    vals = [_value(i, size) for i in range(n)]
    for v in vals:
        st.register(v.ctypes.data, v.nbytes)
    codes = st.batch_put([_key(i % 2, d) for i, d in enumerate(_digests(n, 7))],
                         [[(v.ctypes.data, size)] for v in vals])
    to_parent.put(("put", codes, st.created))
    cmd = from_parent.get(timeout=TIMEOUT)                # parent has read; now read its keys
    assert cmd == "read"
    out = np.zeros(size, np.uint8)
    st.register(out.ctypes.data, out.nbytes)
    got = st.batch_get([_key(0, b"\x11" * 32)], [[(out.ctypes.data, size)]])
    es = st.digest_index(NS)
    to_parent.put(("read", got, out.tobytes(), (0, b"\x11" * 32) in es,
                   (1, _digests(n, 7)[1]) in es))
    assert from_parent.get(timeout=TIMEOUT) == "close"
    to_parent.put(("closed", st.close()))


def _child_hold(name, cap, page, to_parent, busy, sentinel=False):
    """Open the store, put one key, then (busy) enter a change and stop there; wait to be
    killed. Without a sentinel (as if it was killed too) the files outlive the process."""
    st = SharedStore(name, cap, page, sentinel=sentinel)
    v = _value(0, 100)
    st.register(v.ctypes.data, v.nbytes)
    st.batch_put([_key(0, b"\x22" * 32)], [[(v.ctypes.data, 100)]])
    if busy:
        cm = st._locked(mutate=True)
        cm.__enter__()                     # holds the mutex, busy word set: killed mid-change
    to_parent.put(("ready", os.getpid()))
    signal.pause()


def _child_churn(name, cap, page, seed, n, to_parent):
    """Put n keys (values of 1-3 pages) and read some back, racing the other child."""
    st = SharedStore(name, cap, page)
    rng = np.random.default_rng(seed)
    vals = [_value(seed * 10_000 + i, int(rng.integers(1, 3 * page))) for i in range(n)]
    for v in vals:
        st.register(v.ctypes.data, v.nbytes)
    out = np.zeros(3 * page, np.uint8)
    st.register(out.ctypes.data, out.nbytes)
    digests = _digests(n, seed)
    bad = 0
    for i, (d, v) in enumerate(zip(digests, vals)):
        assert st.batch_put([_key(seed, d)], [[(v.ctypes.data, v.nbytes)]]) == [OK]
        j = int(rng.integers(0, i + 1))
        got = st.batch_get([_key(seed, digests[j])], [[(out.ctypes.data, vals[j].nbytes)]])
        if got[0] >= 0 and not np.array_equal(out[:vals[j].nbytes], vals[j]):
            bad += 1                                        # torn or foreign bytes
    to_parent.put(("done", bad))
    st.close()


def _child_forked_put(st, to_parent):
    v = _value(7, 300)
    st.register(v.ctypes.data, v.nbytes)
    to_parent.put(st.batch_put(["from-fork"], [[(v.ctypes.data, 300)]]))


def _child_segment(name, to_parent):
    Segment(name, 4096, lambda buf: buf.write(b"made"), lambda buf: None, SHM, sentinel=False)
    to_parent.put(("ready", os.getpid()))
    signal.pause()


def _descendants(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            kids = [int(x) for x in f.read().split()]
    except OSError:
        return []
    return kids + [g for k in kids for g in _descendants(k)]


def _spawn(target, *args):
    ctx = mp.get_context("spawn")
    p = ctx.Process(target=target, args=args, daemon=True)
    p.start()
    return p


def _stop(p) -> None:
    if p.is_alive():
        os.kill(p.pid, signal.SIGKILL)
    p.join(TIMEOUT)
    assert not p.is_alive()


# -- two processes -----------------------------------------------------------------------------
def test_two_processes_share_keys_bytes_and_the_digest_index():
    ctx = mp.get_context("spawn")
    to_parent, from_parent = ctx.Queue(), ctx.Queue()
    name, size, n = _name(), 5000, 12
    child = _spawn(_child_writer, name, 1 << 20, 4096, n, size, to_parent, from_parent)
    try:
        tag, codes, child_created = to_parent.get(timeout=TIMEOUT)
        assert tag == "put" and codes == [OK] * n and child_created
        st = SharedStore(name, 1 << 20, 4096)                 # attaches
        assert not st.created and len(st) == n
        digests = _digests(n, 7)
        keys = [_key(i % 2, d) for i, d in enumerate(digests)]
        assert st.batch_exists(keys) == [1] * n
        es = st.digest_index(NS)                              # mirror rebuilt from the index
        assert es is not None and len(es) == n
        assert all((i % 2, d) in es for i, d in enumerate(digests))
        out = np.zeros((n, size), np.uint8)
        st.register(out.ctypes.data, out.nbytes)
        got = st.batch_get(keys, [[(out[i].ctypes.data, size)] for i in range(n)])
        assert got == [size] * n
        for i in range(n):                                    # bytes written by the child
            assert np.array_equal(out[i], _value(i, size))
        # the parent writes and removes; the child sees both (its mirror from the log)
        mine = _value(99, size)
        st.register(mine.ctypes.data, mine.nbytes)
        assert st.batch_put([_key(0, b"\x11" * 32)], [[(mine.ctypes.data, size)]]) == [OK]
        assert st.batch_remove([keys[1]]) == [OK]
        from_parent.put("read")
        tag, got, raw, has_new, has_removed = to_parent.get(timeout=TIMEOUT)
        assert got == [size] and raw == mine.tobytes() and has_new and not has_removed
        from_parent.put("close")
        assert to_parent.get(timeout=TIMEOUT) == ("closed", False)   # the parent still uses it
        child.join(TIMEOUT)
        assert _files(name) == [True] * 3
        assert st.close() is True                             # the last user removes it
        assert _files(name) == [False] * 3
    finally:
        _stop(child)


def test_two_processes_racing_puts_and_gets_keep_every_invariant():
    """Two children put 400 keys each (1-3 pages) into a 64-page store and read random earlier
    keys back, at once: every byte read is the bytes put; then the pages, the counters, the
    keys and the mirror agree."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    name, page, n = _name(), 256, 400
    st = SharedStore(name, 64 * page, page)
    kids = [_spawn(_child_churn, name, 64 * page, page, seed, n, q) for seed in (1, 2)]
    try:
        results = [q.get(timeout=TIMEOUT) for _ in kids]
        assert results == [("done", 0), ("done", 0)]
        for k in kids:
            k.join(TIMEOUT)
        keys = [_key(seed, d) for seed in (1, 2) for d in _digests(n, seed)]
        present = st.batch_exists(keys)
        a = st._a
        live = a["meta"] != 0
        assert sum(present) == len(st) == int(live.sum()) and st.evictions > 0
        assert int(a["npages"][live].sum()) + int(a["hdr"][S.H_FREE_PAGES]) == 64
        assert int(a["length"][live].sum()) == st.used_bytes
        es = st.digest_index(NS)
        assert {(seed, d) for seed in (1, 2) for d in _digests(n, seed) if (seed, d) in es} \
            == {(k[0], k[1]) for k, p in zip(((seed, d) for seed in (1, 2)
                                              for d in _digests(n, seed)), present) if p}
    finally:
        for k in kids:
            _stop(k)
        st.close()


def test_a_forked_child_reopens_with_its_own_locks(stores):
    st = stores()
    st.digest_index("x")
    q = mp.get_context("fork").Queue()
    child = mp.get_context("fork").Process(target=_child_forked_put, args=(st, q), daemon=True)
    child.start()
    try:
        assert q.get(timeout=TIMEOUT) == [OK]
        child.join(TIMEOUT)
        assert child.exitcode == 0
    finally:
        _stop(child)
    assert st.batch_exists(["from-fork"]) == [1] and len(st) == 1
    assert _files(st.name) == [True] * 3          # the child's exit did not remove it


# -- eviction and capacity ---------------------------------------------------------------------
def test_clock_eviction_keeps_referenced_keys_and_the_mirror_exact(stores):
    st = stores(cap=8 * 256, page=256)                        # 8 pages
    vals = np.arange(256 * 2, dtype=np.uint8)
    st.register(vals.ctypes.data, vals.nbytes)
    a = vals.ctypes.data
    d = _digests(20, 1)
    assert st.batch_put([_key(0, x) for x in d[:8]], [[(a, 256)]] * 8) == [OK] * 8
    es = st.digest_index(NS)
    assert len(es) == 8 and st.evictions == 0
    # a full sweep clears every bit; then key 3 is read: the next evictions spare it
    assert st.batch_put([_key(0, d[8])], [[(a, 256)]]) == [OK]     # evicts one
    st.batch_get([_key(0, d[3])], [[(a + 256, 256)]])
    assert st.batch_put([_key(0, x) for x in d[9:14]], [[(a, 256)]] * 5) == [OK] * 5
    present = st.batch_exists([_key(0, x) for x in d[:14]])
    assert present[3] == 1 and sum(present) == 8 and st.evictions == 6
    assert len(st) == 8 and st.used_bytes == 8 * 256
    es = st.digest_index(NS)                                   # follows every eviction
    assert sorted(x for x in d[:14] if (0, x) in es) == sorted(
        x for x, p in zip(d[:14], present) if p)


def test_capacity_in_pages_multi_page_values_and_no_space(stores):
    st = stores(cap=10 * 128, page=128)                        # 10 pages of 128 B
    src = _value(1, 1280)
    dst = np.zeros(1280, np.uint8)
    st.register(src.ctypes.data, src.nbytes)
    st.register(dst.ctypes.data, dst.nbytes)
    s, t = src.ctypes.data, dst.ctypes.data
    assert st.batch_put(["too-big"], [[(s, 1280), (s, 1)]]) == [NO_SPACE]
    # fragment the free list: 1-page values, drop every other one, then a 4-page value
    assert st.batch_put([f"small{i}" for i in range(8)], [[(s + i, 100)] for i in range(8)]) \
        == [OK] * 8
    assert st.batch_remove([f"small{i}" for i in range(0, 8, 2)]) == [OK] * 4
    parts = [(s + 3, 200), (s + 700, 1), (s + 300, 299)]      # 500 B in three pieces: 4 pages
    assert st.batch_put(["multi"], [parts]) == [OK]
    assert st.evictions == 0 and len(st) == 5
    assert st.batch_get(["multi"], [[(t, 500)]]) == [500]
    assert np.array_equal(dst[:500], np.concatenate([src[3:203], src[700:701], src[300:599]]))
    assert st.batch_get(["multi"], [[(t, 499)]]) == [INVALID]   # wrong size
    assert st.batch_put(["whole"], [[(s, 1280)]]) == [OK]      # evicts everything else
    assert len(st) == 1 and st.used_bytes == 1280
    assert st.batch_get(["whole", "multi"], [[(t, 1280)], [(t, 500)]]) == [1280, NOT_FOUND]
    assert np.array_equal(dst, src)


def test_overwrite_opaque_keys_and_unregistered_memory(stores):
    st = stores()
    buf = _value(2, 512)
    st.register(buf.ctypes.data, 256)
    a = buf.ctypes.data
    assert st.batch_put(["plain"], [[(a, 300)]]) == [INVALID]            # past the region
    assert st.batch_put(["plain", "plain"], [[(a, 10)], [(a + 10, 20)]]) == [OK, OK]
    assert len(st) == 1 and st.used_bytes == 20                           # overwritten
    assert st.digest_index("plain") is None                               # opaque: no index
    out = np.zeros(20, np.uint8)
    assert st.batch_get(["plain"], [[(out.ctypes.data, 20)]]) == [INVALID]   # unregistered
    st.register(out.ctypes.data, 20)
    assert st.batch_get(["plain"], [[(out.ctypes.data, 20)]]) == [20]
    assert np.array_equal(out, buf[10:30])


def test_mirror_rebuilds_after_the_log_wraps_and_skips_mixed_widths(stores):
    st = stores(cap=4096 * 64, page=64)                          # 4096 pages, log 8192 rows
    other = SharedStore(st.name, 4096 * 64, 64)                  # a second handle, same process
    try:
        v = _value(3, 64)
        st.register(v.ctypes.data, 64)
        d = _digests(3000, 4)
        assert other.digest_index(NS) is None                    # no key yet
        st.batch_put([_key(0, x) for x in d[:10]], [[(v.ctypes.data, 64)]] * 10)
        assert len(other.digest_index(NS)) == 10
        for _ in range(4):                                       # > log_cap events meanwhile
            st.batch_put([_key(1, x) for x in d], [[(v.ctypes.data, 64)]] * len(d))
            st.batch_remove([_key(1, x) for x in d])
        st.batch_put([_key(1, x) for x in d[:5]], [[(v.ctypes.data, 64)]] * 5)
        es = other.digest_index(NS)
        assert len(es) == 15 and (1, d[4]) in es and (1, d[5]) not in es
        st.batch_put([_key(2, b"\x01" * 16)], [[(v.ctypes.data, 64)]])   # a 16-byte digest
        assert other.digest_index(NS) is None and st.digest_index(NS) is None
    finally:
        other.close()


@pytest.mark.parametrize("preset", ["gpt-oss-120b", "deepseek-v4", "qwen3-next-80b"])
def test_lookup_on_the_mirror_equals_the_key_lookup_and_loads_the_bytes(stores, preset):
    """The flows of test_store_embedded over a SharedStore: saves, a lookup on the digest
    index mirror equal to the key lookup (through evictions), loads with the saved bytes."""
    from test_store_embedded import KVMemory, _tables
    layout = get_preset(preset, num_blocks=1024)
    finder = HitFinder(layout)
    keys = KeyBuilder("model")
    ns = keys.prefix(finder.group_ids[0]).rpartition("@group:")[0]
    h = finder.hash_block_size
    T = 3 * finder.scheduler_block_size + 3
    reqs = [make_hashes(T // h, 32, 20 + r) for r in range(6)]
    src, dst = KVMemory(layout, 1024, seed=1), KVMemory(layout, 1024, seed=2)
    value = max(sum(a[0].nbytes for a in arrs) for arrs in src.arrays)   # one block, bytes
    page = -(-value // 64) * 64
    probe = EmbeddedStore(1 << 30)
    src.register(probe)
    per_request = save_blocks(finder, keys, probe, reqs[0], T, _tables(finder, T, 1),
                              src.segments).written
    st = stores(cap=page * 2 * per_request, page=page)          # two requests of all six
    src.register(st)
    dst.register(st)
    for i, hashes in enumerate(reqs):
        rep = save_blocks(finder, keys, st, hashes, T, _tables(finder, T, 1 + 60 * i),
                          src.segments)
        assert rep.failed == 0
        index = st.digest_index(ns)
        for j, hs in enumerate(reqs[:i + 1]):
            want = lookup_hit(finder, keys, st, hs, T)
            got = lookup_hit_indexed(finder, index, [bytes(r) for r in hs], T)
            assert got.tokens == want.tokens, (i, j)
            for g in finder.group_ids:
                assert np.array_equal(got.masks[g], want.masks[g])
    assert st.evictions > 0
    if any(g.kind == GroupKind.MAMBA for g in layout.groups):
        return          # states are saved by boundary puts only: no hit here to load
    last = len(reqs) - 1
    hit = lookup_hit(finder, keys, st, reqs[last], T)
    assert hit.tokens > 0
    src_t, dst_t = _tables(finder, T, 1 + 60 * last), _tables(finder, T, 800)
    assert load_blocks(finder, keys, st, reqs[last], hit, dst_t, dst.segments)
    for g in finder.group_ids:
        for i in np.flatnonzero(hit.masks[g]):
            for s, d in zip(src.arrays[g], dst.arrays[g]):
                assert np.array_equal(s[src_t[g][i]], d[dst_t[g][i]])


# -- lifetime: close, stale segments, a process killed mid-change --------------------------------
def test_last_close_removes_the_segment_and_a_closed_store_refuses():
    name = _name()
    a = SharedStore(name, 1 << 16, 1024)
    b = SharedStore(name, 1 << 16, 1024)
    assert a.created and not b.created
    assert b.close() is False and _files(name) == [True] * 3
    assert a.close() is True and _files(name) == [False] * 3
    assert a.close() is False
    with pytest.raises(StoreError, match="closed"):
        a.batch_exists(["k"])


@pytest.mark.parametrize("busy", [False, True], ids=["idle", "mid-change"])
def test_killed_users_leave_a_segment_that_is_reclaimed(busy):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    name = _name()
    child = _spawn(_child_hold, name, 1 << 16, 1024, q, busy)
    try:
        assert q.get(timeout=TIMEOUT)[0] == "ready"
        live = SharedStore(name, 1 << 16, 1024) if not busy else None
        if live is not None:                 # alive: attaching keeps the child's key
            assert not live.created and live.batch_exists([_key(0, b"\x22" * 32)]) == [1]
            live.close()
        os.kill(child.pid, signal.SIGKILL)
        child.join(TIMEOUT)
        assert _files(name) == [True] * 3    # the killed process could not clean up
        st = SharedStore(name, 1 << 16, 1024)
        try:
            assert st.created and st.reclaimed and len(st) == 0
            assert st.batch_exists([_key(0, b"\x22" * 32)]) == [0]
        finally:
            st.close()
        assert _files(name) == [False] * 3
    finally:
        _stop(child)


def test_a_segment_whose_users_died_is_reinitialised_by_the_next_opener():
    """The segment layer alone (no sweep first): the next opener finds nobody attached to
    the leftover files and runs ``init`` again; an opener while a user lives only checks."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    name = SEGMENT_PREFIX + _name()
    child = _spawn(_child_segment, name, q)
    made = []
    try:
        assert q.get(timeout=TIMEOUT)[0] == "ready"
        seen = Segment(name, 4096, made.append, lambda buf: made.append("checked"), SHM)
        assert not seen.created and made == ["checked"] and seen.buf[:4] == b"made"
        assert seen.close() is False
        os.kill(child.pid, signal.SIGKILL)
        child.join(TIMEOUT)
        seg = Segment(name, 4096, lambda buf: made.append("init"), lambda buf: None, SHM)
        assert seg.created and seg.reclaimed and made[-1] == "init"
        assert seg.buf[:4] == b"\0\0\0\0"              # the dead users' bytes are gone
        assert seg.close() is True
        assert [os.path.exists(p) for p in segment_paths(SHM, name)] == [False] * 3
    finally:
        _stop(child)


def test_a_process_killed_mid_change_empties_the_store_for_the_others():
    """The killed process held the mutex with the busy word set: the kernel drops the lock;
    the next user finds the word and empties the store (no deadlock, no torn index)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    name = _name()
    st = SharedStore(name, 1 << 16, 1024)
    try:
        v = _value(5, 100)
        st.register(v.ctypes.data, 100)
        st.batch_put(["mine"], [[(v.ctypes.data, 100)]])
        assert len(st.digest_index(NS) or ()) == 0
        child = _spawn(_child_hold, name, 1 << 16, 1024, q, True)
        try:
            assert q.get(timeout=TIMEOUT)[0] == "ready"
            os.kill(child.pid, signal.SIGKILL)
            child.join(TIMEOUT)
        finally:
            _stop(child)
        assert st.batch_exists(["mine", _key(0, b"\x22" * 32)]) == [0, 0]
        assert st.resets == 1 and len(st) == 0 and st.used_bytes == 0
        assert st.batch_put(["mine"], [[(v.ctypes.data, 100)]]) == [OK]   # usable again
    finally:
        st.close()


@pytest.mark.parametrize("busy", [False, True], ids=["idle", "mid-change"])
def test_the_sentinel_removes_the_segment_when_every_user_is_killed(busy):
    """vLLM may SIGKILL its engine core and workers at shut-down: no close runs. The
    creator's sentinel (own session) sees the last LOCK_SH go and removes the files."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    name = _name()
    child = _spawn(_child_hold, name, 1 << 16, 1024, q, busy, True)
    try:
        assert q.get(timeout=TIMEOUT)[0] == "ready"
        if not busy:            # (busy: the child holds the mutex; nobody else gets in)
            other = SharedStore(name, 1 << 16, 1024)    # a second user, closed cleanly
            assert not other.created and _files(name) == [True] * 3
            assert other.close() is False
        assert _files(name) == [True] * 3
        for pid in _descendants(child.pid) + [child.pid]:   # vLLM kills the whole tree
            os.kill(pid, signal.SIGKILL)
        child.join(TIMEOUT)
        deadline = time.monotonic() + TIMEOUT
        while any(_files(name)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _files(name) == [False] * 3
    finally:
        _stop(child)


def test_segments_of_killed_engines_are_swept_when_another_opens():
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    dead = _name()
    child = _spawn(_child_hold, dead, 1 << 16, 1024, q, False)
    try:
        assert q.get(timeout=TIMEOUT)[0] == "ready"
        keep = SharedStore(_name(), 1 << 16, 1024)    # in use: never swept
        os.kill(child.pid, signal.SIGKILL)
        child.join(TIMEOUT)
    finally:
        _stop(child)
    assert _files(dead) == [True] * 3
    other = SharedStore(_name(), 1 << 16, 1024)
    try:
        assert _files(dead) == [False] * 3 and _files(keep.name) == [True] * 3
    finally:
        other.close()
        keep.close()


# -- bad arguments and configs -----------------------------------------------------------------
def test_bad_arguments_are_refused_with_the_rule():
    for kw, match in [(dict(capacity_bytes=0), "capacity_bytes"),
                      (dict(capacity_bytes=True), "capacity_bytes"),
                      (dict(page_bytes=100), "multiple of 64"),
                      (dict(page_bytes=32), "page_bytes"),
                      (dict(capacity_bytes=1024, page_bytes=2048), "at least one page"),
                      (dict(name="../etc"), "name"), (dict(name=""), "name")]:
        args = dict(name=_name(), capacity_bytes=1 << 16, page_bytes=1024) | kw
        with pytest.raises(HashInputError, match=match):
            SharedStore(**args)
    name = _name()
    st = SharedStore(name, 1 << 16, 1024)
    try:
        with pytest.raises(StoreError, match="store_capacity_bytes"):
            SharedStore(name, 1 << 17, 1024)                   # another geometry
        assert len(st) == 0 and _files(name) == [True] * 3     # the first is untouched
        with pytest.raises(HashInputError):
            st.batch_put(["a"], [[(0, 4)]])
        with pytest.raises(HashInputError):
            st.batch_exists("abc")
    finally:
        st.close()
    with pytest.raises(StoreError, match="does not exist"):
        SharedStore(_name(), 1 << 16, 1024, directory="/nonexistent-dir")


def test_a_store_the_tmpfs_cannot_hold_is_an_error_at_open(monkeypatch):
    def full(fd, off, n):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "posix_fallocate", full)
    name = _name()
    with pytest.raises(StoreError, match="lower store_capacity_bytes"):
        SharedStore(name, 1 << 16, 1024)
    monkeypatch.undo()
    st = SharedStore(name, 1 << 16, 1024)       # nothing half-made stands in the way
    assert st.created and not st.reclaimed
    st.close()


def _vllm_config(backend, engine_id="eng-1"):
    return SimpleNamespace(parallel_config=SimpleNamespace(distributed_executor_backend=backend),
                           kv_transfer_config=SimpleNamespace(engine_id=engine_id))


def test_backend_scope_follows_the_executor_and_config_errors():
    from hmacore.integrations.vllm.store import backend as B
    from hmacore.transport.store import EmbeddedStore
    assert B.store_scope({}, _vllm_config("mp")) == "shared"
    assert B.store_scope({}, _vllm_config("ray")) == "shared"
    assert B.store_scope({}, _vllm_config("uni")) == "process"
    assert B.store_scope({}, _vllm_config("external_launcher")) == "process"
    assert B.store_scope({"store_scope": "process"}, _vllm_config("mp")) == "process"
    assert B.store_scope({"store_scope": "shared"}, _vllm_config("uni")) == "shared"
    with pytest.raises(ConfigError, match="store_scope must be one of"):
        B.store_scope({"store_scope": "global"}, _vllm_config("mp"))
    extra = {"store_capacity_bytes": 1 << 16, "store_page_bytes": 1024}
    eid = "eng-" + uuid.uuid4().hex[:8]
    a = B.open_store(dict(extra), _vllm_config("mp", eid))
    b = B.open_store(dict(extra), _vllm_config("mp", eid))          # the same engine
    c = B.open_store(dict(extra), _vllm_config("mp", eid + "x"))    # another engine
    try:
        assert isinstance(a, SharedStore) and a is b and c is not a
        assert a.name == eid and _files(eid) == [True] * 3
        B.release_store(a)
        assert not a.closed                                          # b still holds it
        B.release_store(b)
        assert a.closed and _files(eid) == [False] * 3
    finally:
        B.release_store(c)
    assert c.closed
    p = B.open_store({"store_scope": "process", "store_name": "t-proc-" + eid},
                     _vllm_config("mp"))
    assert isinstance(p, EmbeddedStore)
    B.drop_store("embedded:t-proc-" + eid)
    named = {**extra, "store_name": "shared by engines/1"}          # not a file name as is
    x = B.open_store(dict(named), _vllm_config("mp", "e1"))
    try:
        assert x.name.startswith("shared_by_engines_1-")
        assert B.open_store(dict(named), _vllm_config("mp", "e2")) is x
        for bad, match in [({"store_page_bytes": 100}, "multiple of 64"),
                           ({"store_page_bytes": 1 << 20}, "at most store_capacity_bytes"),
                           ({"store_page_bytes": "x"}, "store_page_bytes"),
                           ({"store_capacity_bytes": 0}, "store_capacity_bytes")]:
            with pytest.raises(ConfigError, match=match):
                B.open_store({**extra, **bad}, _vllm_config("mp", "e3"))
        with pytest.raises(ConfigError, match="open in this process"):
            B.open_store({**named, "store_capacity_bytes": 1 << 17}, _vllm_config("mp", "e4"))
    finally:
        B.drop_store("embedded:shared by engines/1")
    assert x.closed


def test_geometry_is_what_the_module_docstring_says():
    g = S._Geometry(1 << 20, 4096)
    off = g.offsets()
    assert g.n_pages == 256 and g.index_cap == 512 and g.log_cap == 1024
    assert off["data"] % 4096 == 0 and off["total"] >= off["data"] + (1 << 20)
    assert S._Geometry(1 << 30, 64).log_cap == S.MAX_LOG
