"""Which ``KVStore`` an :class:`HmaStoreConnector` talks to, from ``kv_connector_extra_config``.

* ``{"store": "embedded"}`` (default): a store inside the engine's own processes,
  ``store_capacity_bytes`` (default 1 GiB). ``store_scope`` says where it lives:

  - ``"process"``: one process-wide :class:`~hmacore.transport.store.EmbeddedStore` per
    ``store_name`` (default ``"default"``), so a scheduler-side lookup and the worker-side
    save/load of one process (or two engines of one test process) share it.
  - ``"shared"``: a :class:`~hmacore.transport.shared_store.SharedStore` (shared memory,
    ``/dev/shm/hmacore-kv-<name>``) that the engine's scheduler and worker processes open by
    name. The name is the engine's ``engine_id`` (engines on one host never collide), or
    ``store_name`` when given (engines configured with one name share one store). Capacity
    reserved at creation; ``store_page_bytes`` (default 16 KiB) is its page size. The last
    process to shut down removes it; a segment left by killed engines is reclaimed.
  - ``"auto"`` (default): ``"shared"`` when vLLM runs the scheduler and the workers in
    different processes (its executor is not ``uni`` / ``external_launcher``: vLLM's
    multiprocess engine on CPU, or several workers), else ``"process"``.
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

import hashlib
import re
import threading
from typing import Any

from ....errors import ConfigError
from ....transport.store import RPC_FAIL, EmbeddedStore
from .._config import number, text
from .. import _compat as C

logger = C.get_logger(__name__)

__all__ = ["open_store", "release_store", "register_store", "drop_store", "store_scope",
           "UnavailableStore"]

_LOCK = threading.Lock()
_STORES: dict[str, Any] = {}
_OPENS: dict[int, int] = {}          # id(shared store) -> connectors holding it
SCOPES = ("auto", "process", "shared")
# executors that run the scheduler and the (only) worker in one process
_ONE_PROCESS_EXECUTORS = ("uni", "external_launcher")


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
    """Forget the store called ``name``; a shared store is also closed (detached)."""
    with _LOCK:
        s = _STORES.pop(str(name), None)
        _OPENS.pop(id(s), None)
    if s is not None and hasattr(s, "close") and type(s).__name__ == "SharedStore":
        s.close()


def release_store(store: Any) -> None:
    """A connector is done with ``store`` (its shutdown): a shared store is closed when the
    last connector of the process releases it (the last process removes the segment)."""
    with _LOCK:
        n = _OPENS.get(id(store))
        if n is None:
            return
        if n > 1:
            _OPENS[id(store)] = n - 1
            return
        del _OPENS[id(store)]
        for k, v in list(_STORES.items()):
            if v is store:
                del _STORES[k]
    store.close()


def store_scope(extra: dict, vllm_config: Any = None) -> str:
    """``"process"`` or ``"shared"``: ``store_scope`` from ``extra``, ``"auto"`` resolved
    from vLLM's executor (see the module docstring)."""
    scope = text(extra, "store_scope", "auto").lower()
    if scope not in SCOPES:
        raise ConfigError(f"kv_connector_extra_config.store_scope must be one of "
                          f"{', '.join(SCOPES)}, got {extra.get('store_scope')!r}")
    if scope != "auto":
        return scope
    pc = getattr(vllm_config, "parallel_config", None)
    backend = getattr(pc, "distributed_executor_backend", None)
    one_process = backend is None or (isinstance(backend, str)
                                      and backend in _ONE_PROCESS_EXECUTORS)
    return "process" if one_process else "shared"


def _segment_name(raw: str) -> str:
    """A file-name-safe store name (letters, digits, ``.``, ``_``, ``-``; <= 150 chars)."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", raw).lstrip("._-") or "store"
    if len(name) > 150 or name != raw:     # distinct raw names keep distinct segments
        name = name[:120] + "-" + hashlib.sha256(raw.encode()).hexdigest()[:16]
    return name


def _open_shared(extra: dict, vllm_config: Any) -> Any:
    from ....transport.shared_store import DEFAULT_PAGE_BYTES, SharedStore
    cap = number(extra, "store_capacity_bytes", 1 << 30, integer=True, minimum=1)
    page = number(extra, "store_page_bytes", DEFAULT_PAGE_BYTES, integer=True, minimum=64)
    if page % 64 or cap < page:
        raise ConfigError(f"kv_connector_extra_config: store_page_bytes ({page}) must be a "
                          f"multiple of 64 and at most store_capacity_bytes ({cap})")
    raw = extra.get("store_name")
    if not raw:
        ktc = getattr(vllm_config, "kv_transfer_config", None)
        raw = getattr(ktc, "engine_id", None)
        if not raw:
            raise ConfigError('store_scope "shared" needs kv_transfer_config.engine_id or '
                              'kv_connector_extra_config.store_name')
    name = _segment_name(str(raw))
    key = "embedded:" + str(raw)
    with _LOCK:
        s = _STORES.get(key)
        if s is not None and (type(s).__name__ != "SharedStore" or s.closed):
            if type(s).__name__ == "SharedStore":
                s = None                    # closed: open afresh
            else:
                raise ConfigError(f"store_name {raw!r} is an in-process store in this process; "
                                  'store_scope "shared" needs another store_name')
        if s is None:
            s = _STORES[key] = SharedStore(name, cap, page)
            logger.info("HmaStoreConnector: shared store %s (%d bytes, %d-byte pages) %s",
                        s.segment_path, s.capacity_bytes, s.page_bytes,
                        "reclaimed from dead processes" if s.reclaimed
                        else "created" if s.created else "attached")
        elif (s.capacity_bytes, s.page_bytes) != (cap - cap % page, page):
            raise ConfigError(f"store_name {raw!r} is open in this process with "
                              f"{s.capacity_bytes} B / {s.page_bytes} B pages; asked for "
                              f"{cap} B / {page} B")
        _OPENS[id(s)] = _OPENS.get(id(s), 0) + 1
        return s


def open_store(extra: dict, vllm_config: Any = None) -> Any:
    """The store named by ``extra`` (see the module docstring); never raises for an
    unreachable store (an :class:`UnavailableStore` is returned and the reason logged).
    Bad values, and a shared store that cannot be reserved, raise (at start-up)."""
    kind = text(extra, "store", "embedded").lower()
    if kind == "embedded":
        if store_scope(extra, vllm_config) == "shared":
            return _open_shared(extra, vllm_config)
        if store_scope({}, vllm_config) == "shared":
            logger.warning('HmaStoreConnector: store_scope "process" while vLLM runs the '
                           "scheduler and the workers in different processes: lookups never "
                           "see the workers' saves (no store hit will happen); use "
                           'store_scope "auto" or "shared"')
        number(extra, "store_page_bytes", 64, integer=True, minimum=64)   # shared only; checked
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
