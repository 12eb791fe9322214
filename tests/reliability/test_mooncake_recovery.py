"""MooncakeStore's recovery logic against a scripted client (no Mooncake needed).

The real master kill/restart runs in test_faults_store (mc_restart.py, unshare -n); there,
Mooncake 0.3.13 re-mounts the client's segment by itself, so the last resort (re-creating
the client) never triggers. Here a fake ``MooncakeDistributedStore`` whose clients never
recover from a master restart forces that path: the store must fail fast while the master
is down, re-create the client once the master's port answers, register every buffer again,
answer misses (never stale hits) for objects of the old master, and serve again; every
call bounded in time. The "master port" is a listening socket on 127.0.0.1 in this process.
"""
from __future__ import annotations

import ctypes
import socket
import time

import pytest

from hmacore.errors import StoreError
from hmacore.transport.mooncake import MooncakeStore
from hmacore.transport.store import NO_SPACE, RPC_FAIL

pytestmark = pytest.mark.reliability


class Master:
    """The scripted master: ``epoch`` bumps on restart (objects lost); ``down`` closes the
    port; ``full`` makes every put answer NO_SPACE."""

    def __init__(self):
        self.epoch = 0
        self.objects: dict[str, bytes] = {}
        self.full = False
        self.sock = None
        self.up()

    def up(self, port=0):
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]

    def down(self):
        self.sock.close()

    def restart(self):
        self.epoch += 1
        self.objects = {}
        self.up(self.port)


class FakeClient:
    """Bound to the master epoch it was set up in; after a restart it only answers RPC_FAIL
    (a client that cannot follow a new master), while the port is closed it raises."""

    def __init__(self, master, log):
        self.m, self.epoch, self.log = master, master.epoch, log
        self.buffers: dict[int, int] = {}
        log.append("setup")

    def _alive(self):
        try:
            socket.create_connection(("127.0.0.1", self.m.port), timeout=0.2).close()
        except OSError:
            raise RuntimeError("master connection lost") from None
        return self.epoch == self.m.epoch

    def register_buffer(self, addr, size):
        self.buffers[addr] = size
        return 0

    def unregister_buffer(self, addr):
        self.buffers.pop(addr, None)
        return 0

    def batch_is_exist(self, keys):
        if not self._alive():
            return [RPC_FAIL] * len(keys)
        return [int(k in self.m.objects) for k in keys]

    def batch_put_from_multi_buffers(self, keys, ptrs, sizes):
        if not self._alive():
            return [RPC_FAIL] * len(keys)
        if self.m.full:
            return [NO_SPACE] * len(keys)
        for k, p, s in zip(keys, ptrs, sizes):
            assert all(any(b <= a and a + n <= b + sz for b, sz in self.buffers.items())
                       for a, n in zip(p, s)), "put from unregistered memory"
            self.m.objects[k] = b"".join(ctypes.string_at(a, n) for a, n in zip(p, s))
        return [0] * len(keys)

    def batch_get_into_multi_buffers(self, keys, ptrs, sizes):
        if not self._alive():
            return [RPC_FAIL] * len(keys)
        out = []
        for k, p, s in zip(keys, ptrs, sizes):
            v = self.m.objects.get(k)
            if v is None:
                out.append(-704)
                continue
            off = 0
            for a, n in zip(p, s):
                ctypes.memmove(a, v[off:off + n], n)
                off += n
            out.append(len(v))
        return out

    def batch_remove(self, keys, force):
        if not self._alive():
            return [RPC_FAIL] * len(keys)
        return [0 if self.m.objects.pop(k, None) is not None else -704 for k in keys]

    def close(self):
        self.log.append("close")
        return 0


def make_store(master, log, **kw):
    class Scripted(MooncakeStore):
        def _new_client(self):
            return FakeClient(master, log)
    return Scripted(f"127.0.0.1:{master.port}", connect_timeout_s=2, **kw)


def timed(fn, *a):
    t0 = time.monotonic()
    r = fn(*a)
    return r, time.monotonic() - t0


def test_client_recreated_after_restart_no_stale_hit():
    m, log = Master(), []
    st = make_store(m, log, recover_timeout_s=0.5, retry_interval_s=0.2)
    try:
        src = ctypes.create_string_buffer(b"A" * 64 + b"B" * 64, 128)
        dst = ctypes.create_string_buffer(128)
        st.register(ctypes.addressof(src), 128)
        st.register(ctypes.addressof(dst), 128)
        a, d = ctypes.addressof(src), ctypes.addressof(dst)
        assert st.batch_put(["k1", "k2"], [[(a, 64)], [(a + 64, 64)]]) == [0, 0]
        assert st.batch_exists(["k1", "k2"]) == [1, 1]
        m.down()
        res, s = timed(st.batch_exists, ["k1", "k2"])
        assert res == [RPC_FAIL, RPC_FAIL] and s < 1.0 and st.suspect
        for _ in range(5):                           # while down: every call fails fast
            res, s = timed(st.batch_put, ["k3"], [[(a, 8)]])
            assert res == [RPC_FAIL] and s < 1.0
        m.restart()
        time.sleep(0.25)                             # past the retry interval
        res, s = timed(st.batch_exists, ["k1", "k2"])
        assert res == [0, 0], "a stale hit after the master restart"   # old objects gone
        assert s < 3.0 and not st.suspect
        assert st.recovery["reconnected"] == 1 and log.count("setup") == 2
        client = st._store
        assert client.epoch == m.epoch
        assert set(client.buffers) == {a, d, ctypes.addressof(st._probe_buf)}  # re-registered
        assert st.batch_put(["k1"], [[(a + 64, 64)]]) == [0]          # serving again
        assert st.batch_get(["k1"], [[(d, 64)]]) == [64] and dst.raw[:64] == b"B" * 64
        assert st.batch_remove(["k1"]) == [0] and st.batch_exists(["k1"]) == [0]
    finally:
        st.close()
        m.down()


def test_recovery_gives_up_bounded_and_retries_later():
    """The master's port answers but the new client cannot be set up: the store stays
    suspect, each attempt is bounded, calls in between fail fast; it recovers once setup
    works again. A full store after the restart is usable (NO_SPACE is not a dead master)."""
    m, log = Master(), []
    st = make_store(m, log, recover_timeout_s=0.3, retry_interval_s=0.5)
    broken = {"on": False}
    real_new = st._new_client

    def flaky():
        if broken["on"]:
            raise StoreError("setup failed with code -1")
        return real_new()
    st._new_client = flaky
    try:
        buf = ctypes.create_string_buffer(64)
        st.register(ctypes.addressof(buf), 64)
        m.down()
        assert st.batch_exists(["x"]) == [RPC_FAIL]
        m.restart()
        broken["on"] = True
        time.sleep(0.55)
        res, s = timed(st.batch_exists, ["x"])
        assert res == [RPC_FAIL] and s < 2.0 and st.suspect
        res, s = timed(st.batch_exists, ["x"])       # within the retry interval: no attempt
        assert res == [RPC_FAIL] and s < 0.1
        broken["on"] = False
        m.full = True
        time.sleep(0.55)
        res, s = timed(st.batch_exists, ["x"])
        assert res == [0] and not st.suspect and s < 2.0
        assert st.recovery["gave_up"] == 1          # probe saw NO_SPACE: usable, full
        assert st.batch_put(["x"], [[(ctypes.addressof(buf), 64)]]) == [NO_SPACE]
    finally:
        st.close()
        m.down()


@pytest.mark.parametrize("kw", [{"recover_timeout_s": -1}, {"retry_interval_s": True},
                                {"recover_timeout_s": "5"}, {"retry_interval_s": 601}])
def test_bad_recovery_settings(kw):
    with pytest.raises(StoreError, match=next(iter(kw))):
        MooncakeStore("127.0.0.1:1", **kw)
