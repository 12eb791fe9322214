"""Which ``KVStore`` an :class:`HmaStoreConnector` talks to, from ``kv_connector_extra_config``.

* ``{"store": "embedded"}`` (default): one process-wide :class:`~hmacore.transport.store.
  EmbeddedStore` per ``store_name`` (default ``"default"``), ``store_capacity_bytes`` (default
  1 GiB), so a scheduler-side lookup and the worker-side save/load of one process (or two
  engines of one test process) share it.
* ``{"store": "mooncake", "master": "host:port", ...}``: a :class:`~hmacore.transport.
  mooncake.MooncakeStore` client, one per master in the process (shared by the scheduler and
  worker sides when they live in one process); optional ``local_hostname``, ``protocol``
  (``"tcp"``), ``global_segment_size`` (bytes the client contributes to the pool, default
  256 MiB; 0 = pure client), ``local_buffer_size``, ``connect_timeout_s``.

:func:`register_store` puts any object speaking the protocol under a name (tests use it for
failing stores). A store that cannot be opened is logged and replaced by
:class:`UnavailableStore`, whose every call fails: lookups then miss, saves are skipped.
"""
from __future__ import annotations

import threading
from typing import Any

from ....errors import ConfigError
from ....transport.store import RPC_FAIL, EmbeddedStore
from .._config import number, text
from .. import _compat as C

logger = C.get_logger(__name__)

__all__ = ["open_store", "register_store", "drop_store", "UnavailableStore"]

_LOCK = threading.Lock()
_STORES: dict[str, Any] = {}


class UnavailableStore:
    """A store that is not there: every bulk call answers RPC_FAIL per key."""

    def __init__(self, reason: str = "") -> None:
        self.reason = reason

    def batch_exists(self, keys):
        return [RPC_FAIL] * len(list(keys))

    def batch_put(self, keys, parts):
        return [RPC_FAIL] * len(list(keys))

    def batch_get(self, keys, parts):
        return [RPC_FAIL] * len(list(keys))

    def batch_remove(self, keys):
        return [RPC_FAIL] * len(list(keys))

    def register(self, addr: int, size: int) -> None:
        return

    def unregister(self, addr: int) -> None:
        return


def register_store(name: str, store: Any) -> None:
    """Make ``store`` the process-wide store called ``name`` (replacing any other)."""
    with _LOCK:
        _STORES[str(name)] = store


def drop_store(name: str) -> None:
    with _LOCK:
        _STORES.pop(str(name), None)


def open_store(extra: dict) -> Any:
    """The store named by ``extra`` (see the module docstring); never raises for an
    unreachable store (an :class:`UnavailableStore` is returned and the reason logged)."""
    kind = text(extra, "store", "embedded").lower()
    if kind == "embedded":
        name = "embedded:" + text(extra, "store_name", "default")
        with _LOCK:
            s = _STORES.get(name)
            if s is None:
                cap = number(extra, "store_capacity_bytes", 1 << 30, integer=True, minimum=1)
                s = _STORES[name] = EmbeddedStore(capacity_bytes=cap)
            return s
    if kind == "mooncake":
        master = extra.get("master")
        if not master:
            raise ConfigError('kv_connector_extra_config: "store": "mooncake" needs '
                             '"master": "host:port"')
        name = f"mooncake:{master}"    # one client per master in a process, both roles
        with _LOCK:
            if name in _STORES:
                return _STORES[name]
            try:
                from ....transport.mooncake import MooncakeStore
                seg = number(extra, "global_segment_size", 256 << 20, integer=True, minimum=1)
                s = MooncakeStore(str(master),
                                  local_hostname=text(extra, "local_hostname", "127.0.0.1"),
                                  global_segment_size=seg,
                                  local_buffer_size=number(extra, "local_buffer_size", 16 << 20,
                                                           integer=True, minimum=1),
                                  protocol=text(extra, "protocol", "tcp"),
                                  connect_timeout_s=number(extra, "connect_timeout_s", 10.0,
                                                           positive=True))
            except Exception as e:   # unreachable master, missing package: misses, no crash
                logger.error("HmaStoreConnector: Mooncake store at %s unavailable (%s); "
                             "lookups will miss and saves are skipped", master, e)
                return UnavailableStore(str(e))
            _STORES[name] = s
            return s
    # a name registered with register_store
    with _LOCK:
        s = _STORES.get(kind)
    if s is None:
        raise ConfigError(f'kv_connector_extra_config "store": {kind!r} is not "embedded", '
                         '"mooncake" or a name given to register_store()')
    return s
