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
"""
from __future__ import annotations

import socket
import time
from collections.abc import Sequence

from ..errors import StoreError
from .store import RPC_FAIL, GroupSegments

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
                 device: str = "", connect_timeout_s: float = 10.0) -> None:
        host, _, port = master.rpartition(":")
        if not host or not port.isdigit():
            raise StoreError(f"master must be 'host:port', got {master!r}")
        if not wait_for_port(host, int(port), connect_timeout_s):
            raise StoreError(f"mooncake master {master} does not accept connections "
                             f"(waited {connect_timeout_s} s)")
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:   # pragma: no cover - depends on the environment
            raise StoreError("mooncake is not installed: pip install "
                             "mooncake-transfer-engine-non-cuda==0.3.13.post1 "
                             f"(and apt-get install libibverbs1): {e}") from e
        self._store = MooncakeDistributedStore()
        rc = self._store.setup(local_hostname, metadata, int(global_segment_size),
                               int(local_buffer_size), protocol, device, master)
        if rc != 0:
            raise StoreError(f"MooncakeDistributedStore.setup failed with code {rc}")
        self._registered: list[int] = []
        self.calls = {"exists": 0, "put": 0, "get": 0, "remove": 0}

    # -- memory ---------------------------------------------------------------------------
    def register(self, addr: int, size: int) -> None:
        rc = self._store.register_buffer(int(addr), int(size))
        if rc != 0:
            raise StoreError(f"register_buffer({addr:#x}, {size}) failed with code {rc}")
        self._registered.append(int(addr))

    def unregister(self, addr: int) -> None:
        self._store.unregister_buffer(int(addr))
        if int(addr) in self._registered:
            self._registered.remove(int(addr))

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
        try:
            res = list(self._store.batch_is_exist(keys))
        except Exception:
            return [RPC_FAIL] * len(keys)
        if len(res) != len(keys):
            return [RPC_FAIL] * len(keys)
        return [int(r) for r in res]

    def batch_put(self, keys: Sequence[str], parts) -> list[int]:
        keys = list(keys)
        if not keys:
            return []
        ptrs = [[int(a) for a, _ in p] for p in parts]
        sizes = [[int(s) for _, s in p] for p in parts]
        if len(ptrs) != len(keys):
            raise StoreError(f"parts has {len(ptrs)} entries for {len(keys)} keys")
        self.calls["put"] += 1
        try:
            return [int(r) for r in self._store.batch_put_from_multi_buffers(keys, ptrs, sizes)]
        except Exception:
            return [RPC_FAIL] * len(keys)

    def batch_get(self, keys: Sequence[str], parts) -> list[int]:
        keys = list(keys)
        if not keys:
            return []
        ptrs = [[int(a) for a, _ in p] for p in parts]
        sizes = [[int(s) for _, s in p] for p in parts]
        if len(ptrs) != len(keys):
            raise StoreError(f"parts has {len(ptrs)} entries for {len(keys)} keys")
        self.calls["get"] += 1
        try:
            return [int(r) for r in self._store.batch_get_into_multi_buffers(keys, ptrs, sizes)]
        except Exception:
            return [RPC_FAIL] * len(keys)

    def batch_remove(self, keys: Sequence[str]) -> list[int]:
        keys = list(keys)
        if not keys:
            return []
        self.calls["remove"] += 1
        try:
            return [int(r) for r in self._store.batch_remove(keys, True)]
        except Exception:
            return [RPC_FAIL] * len(keys)

    def close(self) -> None:
        for addr in list(self._registered):
            try:
                self._store.unregister_buffer(addr)
            except Exception:
                pass
        self._registered.clear()
        try:
            self._store.close()
        except Exception:
            pass
