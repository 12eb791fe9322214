"""Mooncake store backend of the ``KVStore`` protocol (hmacore/transport/store.py).

Targets ``mooncake-transfer-engine-non-cuda==0.3.13.post1`` (``MooncakeDistributedStore``),
imported lazily. Contracts:

* ``register_group_segments`` registers only the memory of each group's OWN layers
  (``GroupSegments``), never one shared list for every group.
* one ``batch_is_exist`` per ``batch_exists`` call; puts/gets are zero-copy multi-buffer
  batches from/into registered memory.
* an empty key list returns ``[]`` without any RPC (no modulo, no average, no call).
* NO_SPACE (-200) is passed through (savers skip saving); any exception from the client
  (master down, RPC failure) becomes per-key RPC_FAIL codes: a miss, never a crash and
  never a wrong hit.
* ``connect`` checks that the master accepts TCP connections (bounded wait) before
  ``setup``, because ``setup`` with no master blocks for about 90 s.
* master killed and restarted: a call that sees the master gone (an exception or RPC_FAIL)
  marks the client *suspect*. The next call first recovers -- bounded: ``recover_timeout_s``
  of probing, once more after a re-created client (plus its setup) -- tried at most once per
  ``retry_interval_s`` (while the master is down every call is
  an immediate miss/failure, never a hang): once the master's port answers, a 64-byte probe
  put (from the client's own registered buffer) must succeed. Mooncake 0.3.13's client
  re-mounts its segment on the new master by itself about 1 s after the restart (puts
  answer NO_SPACE until then); if the probe keeps failing with RPC errors while the port
  answers, the client is re-created (``setup`` again, every registered buffer registered
  again). The new master knows none of the old objects: lookups answer 0 (miss), never a
  stale hit. Limitation: a restart that no call observed (no failed call in between) is
  not detected; saves then see NO_SPACE for about 1 s (skipped, not wrong).
"""
from __future__ import annotations

import ctypes
import socket
import threading
import time
from collections.abc import Sequence

from ..errors import StoreError
from ..runs import buffer_runs
from .store import NO_SPACE, OK, RPC_FAIL, GroupSegments

__all__ = ["MooncakeStore", "wait_for_port"]


def wait_for_port(host: str, port: int, timeout_s: float) -> bool:
    """True once ``host:port`` accepts a TCP connection, False after ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)


class MooncakeStore:
    """A ``MooncakeDistributedStore`` client speaking the ``KVStore`` protocol.

    Args:
        master: ``"host:port"`` of ``mooncake_master``.
        local_hostname: address this client advertises (127.0.0.1 in tests).
        metadata: metadata server; ``"P2PHANDSHAKE"`` needs none.
        global_segment_size: bytes this client contributes to the pool (0: a pure client
            whose data lives in other clients' segments and crosses the TCP transport).
        local_buffer_size: bytes of the client's local transfer buffer.
        protocol: ``"tcp"`` on CPU machines.
        connect_timeout_s: how long to wait for the master's port before giving up.
    """

    def __init__(self, master: str = "127.0.0.1:50051", *, local_hostname: str = "127.0.0.1",
                 metadata: str = "P2PHANDSHAKE", global_segment_size: int = 64 << 20,
                 local_buffer_size: int = 16 << 20, protocol: str = "tcp",
                 device: str = "", connect_timeout_s: float = 10.0,
                 recover_timeout_s: float = 5.0, retry_interval_s: float = 1.0) -> None:
        host, _, port = master.rpartition(":")
        if not host or not port.isdigit():
            raise StoreError(f"master must be 'host:port', got {master!r}")
        for name, v in (("recover_timeout_s", recover_timeout_s),
                        ("retry_interval_s", retry_interval_s)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 600:
                raise StoreError(f"{name} must be a number of seconds in [0, 600], got {v!r}")
        self.master = master
        self._host, self._port = host, int(port)
        self._setup_args = (local_hostname, metadata, int(global_segment_size),
                            int(local_buffer_size), protocol, device, master)
        self.recover_timeout_s = float(recover_timeout_s)
        self.retry_interval_s = float(retry_interval_s)
        if not wait_for_port(host, int(port), connect_timeout_s):
            raise StoreError(f"mooncake master {master} does not accept connections "
                             f"(waited {connect_timeout_s} s)")
        self._store = self._new_client()
        self._registered: dict[int, int] = {}      # addr -> bytes, re-registered on reconnect
        # the client's own buffer for the readiness probe after a master restart
        self._probe_buf = ctypes.create_string_buffer(64)
        self._probe_key = f"__hmacore_probe__@{local_hostname}@{id(self):x}@{time.time_ns()}"
        self._register_raw(ctypes.addressof(self._probe_buf), 64)
        self._suspect = False
        self._last_try = -float("inf")
        self._recover_lock = threading.Lock()   # one recovery at a time (shared clients)
        self.calls = {"exists": 0, "put": 0, "get": 0, "remove": 0}
        # change journals (watch_changes): this client's successful puts and removes only;
        # the master's evictions and other clients' writes are not visible here
        self._journals: list[list[tuple[str, bool]]] = []
        self._journal_lock = threading.Lock()
        #: buffers handed to put/get batches, and what reached Mooncake after merging runs
        self.buffers = {"given": 0, "posted": 0}
        self.recovery = {"suspected": 0, "recovered": 0, "reconnected": 0, "gave_up": 0,
                         "probe_waits": 0}

    def _new_client(self):
        """A set-up ``MooncakeDistributedStore`` (StoreError if setup fails)."""
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:   # pragma: no cover - depends on the environment
            raise StoreError("mooncake is not installed: pip install "
                             "mooncake-transfer-engine-non-cuda==0.3.13.post1 "
                             f"(and apt-get install libibverbs1): {e}") from e
        store = MooncakeDistributedStore()
        rc = store.setup(*self._setup_args)
        if rc != 0:
            raise StoreError(f"MooncakeDistributedStore.setup failed with code {rc}")
        return store

    # -- memory ---------------------------------------------------------------------------
    def _register_raw(self, addr: int, size: int) -> None:
        rc = self._store.register_buffer(int(addr), int(size))
        if rc != 0:
            raise StoreError(f"register_buffer({addr:#x}, {size}) failed with code {rc}")

    def register(self, addr: int, size: int) -> None:
        self._register_raw(addr, size)
        self._registered[int(addr)] = int(size)

    def unregister(self, addr: int) -> None:
        self._store.unregister_buffer(int(addr))
        self._registered.pop(int(addr), None)

    # -- master restart ---------------------------------------------------------------------
    @property
    def suspect(self) -> bool:
        """True while the last call saw the master gone and no recovery succeeded yet."""
        return self._suspect

    def _mark(self, codes: list[int] | None) -> list[int] | None:
        if codes is None or any(c == RPC_FAIL for c in codes):
            if not self._suspect:
                self.recovery["suspected"] += 1
            self._suspect = True
        return codes

    def _probe(self) -> int:
        addr = ctypes.addressof(self._probe_buf)
        try:
            code = int(list(self._store.batch_put_from_multi_buffers(
                [self._probe_key], [[addr]], [[64]]))[0])
        except Exception:  # noqa: BLE001
            return RPC_FAIL
        if code == OK:
            try:
                self._store.batch_remove([self._probe_key], True)
            except Exception:  # noqa: BLE001
                pass
        return code

    def _reconnect(self) -> bool:
        """Re-create the client against the (restarted) master and register every buffer
        again; False if setup fails (the client stays suspect)."""
        old = self._store
        try:
            for addr in list(self._registered) + [ctypes.addressof(self._probe_buf)]:
                try:
                    old.unregister_buffer(addr)
                except Exception:  # noqa: BLE001
                    pass
            old.close()
        except Exception:  # noqa: BLE001
            pass
        try:
            self._store = self._new_client()
            self._register_raw(ctypes.addressof(self._probe_buf), 64)
            for addr, size in self._registered.items():
                self._register_raw(addr, size)
        except Exception:  # noqa: BLE001 - still not usable: stay suspect, try again later
            return False
        self.recovery["reconnected"] += 1
        return True

    def _recover(self) -> bool:
        """Bounded recovery after the master was seen gone: True when the client works."""
        now = time.monotonic()
        if now < self._last_try + self.retry_interval_s:
            return False                   # tried recently: fail fast, never hang
        self._last_try = now
        deadline = now + self.recover_timeout_s
        if not wait_for_port(self._host, self._port, min(0.5, self.recover_timeout_s)):
            return False                   # the master is still down
        reconnected = False
        while True:
            code = self._probe()
            if code == OK:
                self._suspect = False
                self.recovery["recovered"] += 1
                return True
            if time.monotonic() >= deadline:
                if code == NO_SPACE:       # the master answers; the pool is full: usable
                    self._suspect = False
                    self.recovery["gave_up"] += 1
                    return True
                if reconnected:
                    return False
                # the master answers but this client cannot use it: a new client
                if not self._reconnect():
                    return False
                reconnected = True
                deadline = time.monotonic() + self.recover_timeout_s
                continue
            self.recovery["probe_waits"] += 1
            time.sleep(0.1)                # NO_SPACE until the segment is re-mounted (~1 s)

    def _call(self, method: str, *args) -> list[int] | None:
        """Codes of one client call, or None (RPC failure / master gone)."""
        if self._suspect:
            if not self._recover_lock.acquire(blocking=False):
                return None                # another thread is recovering: fail fast
            try:
                ok = self._recover()
            finally:
                self._recover_lock.release()
            if not ok:
                return None
        try:
            return self._mark([int(r) for r in getattr(self._store, method)(*args)])
        except Exception:  # noqa: BLE001 - master down / RPC failure: a failed batch, not a crash
            return self._mark(None)

    def register_group_segments(self, segments: Sequence[GroupSegments | None]) -> int:
        """Register each group's own segments (one per layer); returns how many regions.
        Regions shared by several groups (the same base) are registered once."""
        done = set()
        for seg in segments:
            if seg is None:
                continue
            for base, blk in zip(seg.bases, seg.block_bytes):
                if base in done:
                    continue
                self.register(base, blk * seg.num_blocks)
                done.add(base)
        return len(done)

    # -- protocol -------------------------------------------------------------------------
    def batch_exists(self, keys: Sequence[str]) -> list[int]:
        keys = list(keys)
        if not keys:
            return []
        self.calls["exists"] += 1
        res = self._call("batch_is_exist", keys)
        if res is None or len(res) != len(keys):
            return [RPC_FAIL] * len(keys)
        return res

    def batch_put(self, keys: Sequence[str], parts) -> list[int]:
        """Write each key's value from its (addr, size) buffers in registered memory."""
        keys = list(keys)
        res = self._batch_buffers("put", "batch_put_from_multi_buffers", keys, parts)
        self._journal(keys, res, True)
        return res

    # -- change journals (the store connector's KV events) ---------------------------------
    def watch_changes(self) -> list[tuple[str, bool]]:
        """A journal of this client's key changes: ``(key, True)`` per successful put,
        ``(key, False)`` per successful remove. Mooncake's master evicts without telling
        its clients, so evictions never appear (nor other clients' writes)."""
        journal: list[tuple[str, bool]] = []
        with self._journal_lock:
            self._journals.append(journal)
        return journal

    def take_changes(self, journal: list[tuple[str, bool]]) -> list[tuple[str, bool]]:
        with self._journal_lock:
            out = journal[:]
            del journal[:]
        return out

    def unwatch_changes(self, journal: list[tuple[str, bool]]) -> None:
        with self._journal_lock:
            self._journals[:] = [j for j in self._journals if j is not journal]

    def _journal(self, keys: list[str], codes: list[int], present: bool) -> None:
        if not self._journals:
            return
        done = [(k, present) for k, c in zip(keys, codes) if c == OK]
        with self._journal_lock:
            for journal in self._journals:
                journal.extend(done)

    def batch_get(self, keys: Sequence[str], parts) -> list[int]:
        """Read each key's value into its (addr, size) buffers in registered memory."""
        return self._batch_buffers("get", "batch_get_into_multi_buffers", keys, parts)

    def _batch_buffers(self, call: str, method: str, keys: Sequence[str], parts) -> list[int]:
        keys = list(keys)
        if not keys:   # an empty batch never reaches the RPC
            return []
        parts = list(parts)
        if len(parts) != len(keys):
            raise StoreError(f"parts has {len(parts)} entries for {len(keys)} keys")
        # adjacent buffers of a key (a block's adjacent layer slots) as one buffer, never
        # across two registered buffers: the value's bytes and order are unchanged
        runs = buffer_runs(parts, list(self._registered.items()))
        ptrs = [[a for a, _ in p] for p in runs]
        sizes = [[s for _, s in p] for p in runs]
        self.buffers["given"] += sum(len(p) for p in parts)
        self.buffers["posted"] += sum(len(p) for p in ptrs)
        self.calls[call] += 1
        res = self._call(method, keys, ptrs, sizes)
        if res is None or len(res) != len(keys):
            return [RPC_FAIL] * len(keys)
        return res

    def batch_remove(self, keys: Sequence[str]) -> list[int]:
        keys = list(keys)
        if not keys:
            return []
        self.calls["remove"] += 1
        res = self._call("batch_remove", keys, True)
        if res is None or len(res) != len(keys):
            return [RPC_FAIL] * len(keys)
        self._journal(keys, res, False)
        return res

    def close(self) -> None:
        for addr in list(self._registered) + [ctypes.addressof(self._probe_buf)]:
            try:
                self._store.unregister_buffer(addr)
            except Exception:
                pass
        self._registered.clear()
        try:
            self._store.close()
        except Exception:
            pass
