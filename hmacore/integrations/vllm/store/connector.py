"""``HmaStoreConnector``: a vLLM 0.32 KV connector (KVConnectorBase_V1 + SupportsHMA) for KV
offload and cross-instance prefix reuse through a hash-addressed store, HMA on.

Load it with ``KVTransferConfig(kv_connector="HmaStoreConnector",
kv_connector_module_path="hmacore.integrations.vllm", kv_role="kv_both",
kv_connector_extra_config={...})``. Keys of ``kv_connector_extra_config``:

* ``store``: ``"embedded"`` (default; ``store_capacity_bytes`` default 1 GiB;
  ``store_scope``: ``"auto"`` (default) puts it in shared memory when vLLM runs the scheduler
  and the workers in different processes (its multiprocess engine), ``"process"`` keeps one
  in-process store per ``store_name``, ``"shared"`` always uses shared memory
  (``store_page_bytes``, see ``backend``)) or ``"mooncake"`` (``master``: ``"host:port"``,
  optional ``local_hostname``, ``protocol``, ``global_segment_size``, ``local_buffer_size``,
  ``connect_timeout_s``), or a name given to ``backend.register_store``.
* ``load_async`` (default False): False loads inside ``start_load_kv`` before the forward pass
  (``get_num_new_matched_tokens`` returns ``(n, False)``); True parks the request in
  WAITING_FOR_REMOTE_KVS and reports ``finished_recving`` / ``failed_recving``.
* ``model_name``, ``cache_prefix``, ``store_namespace``: key parts (``hmacore.keys``).

Hits follow vLLM's rule for the engine's config (``scheduler.hit_finder``): the EAGLE
last-block drop when ``speculative_config.use_eagle_block_drop()`` (and for groups vLLM
flags ``is_eagle_group``), aligned to ``kv_cache_config.cache_hit_alignment_tokens``.

KV events (``--kv-events-config`` with ``enable_kv_cache_events``): the connector also
reports what its embedded store gains and loses of this engine's keys, per group, as vLLM KV
events with ``medium="HMACORE_STORE"`` (:mod:`.events`): a router's second tier. An
in-process store (``store_scope`` ``"process"``) is reported by the worker after its saves; a
shared-memory store (``"shared"``, the default under ``vllm serve``) by the scheduler side from
the segment's event log, including changes made by other engines sharing the store.

``kv_role``: ``kv_producer`` only saves, ``kv_consumer`` only loads, ``kv_both`` does both.
Scheduler role: :class:`~.scheduler.HmaStoreScheduler`; worker role:
:class:`~.worker.HmaStoreWorker` (TP = PP = 1).
"""
from __future__ import annotations

from typing import Any

from .. import _compat as C
from .._roles import RoleDispatch, require_single_worker
from .._config import STORE_KEYS, check_keys
from .backend import open_store, release_store
from .events import SharedStoreEventSource, StoreEventSource, StoreKVEvents
from .scheduler import HmaStoreScheduler, key_builder

__all__ = ["HmaStoreConnector"]

_logger = C.get_logger(__name__)


class HmaStoreConnector(RoleDispatch, C.KVConnectorBase_V1, C.SupportsHMA):
    """Hash-addressed store connector keeping HMA on; see the module docstring."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        extra = check_keys(ktc.kv_connector_extra_config if ktc is not None else None,
                           STORE_KEYS, type(self).__name__)
        worker = role != C.KVConnectorRole.SCHEDULER
        store = open_store(extra, vllm_config)
        sched = HmaStoreScheduler(vllm_config, kv_cache_config, store)  # validates the config
        self._layout = sched.layout
        self.store = store
        self.scheduler: HmaStoreScheduler | None = None
        self.worker = None
        self.store_events: StoreEventSource | None = None
        self.shared_events: SharedStoreEventSource | None = None
        kec = getattr(vllm_config, "kv_events_config", None)
        events_on = kec is not None and bool(kec.enable_kv_cache_events)
        shared = hasattr(store, "read_log")     # changed by every attached process
        if not worker:
            if events_on and shared:    # the scheduler side reads the segment's event log
                self.shared_events = SharedStoreEventSource(store, sched.keys, sched.layout)
            self.scheduler = sched
            _logger.info("HmaStoreConnector (%s): %s; store %s, hit alignment %d tokens, "
                         "lookups %s", ktc.kv_role, C.layout_summary(sched.layout),
                         type(store).__name__, sched.finder.alignment,
                         "on the store's digest index" if sched._index_ns is not None
                         else "by key")
        else:
            require_single_worker(vllm_config, type(self).__name__)
            from .worker import HmaStoreWorker
            # the scheduler side's finder: same eagle drop and alignment on both sides
            self.worker = HmaStoreWorker(sched.finder, int(kv_cache_config.num_blocks), store,
                                         key_builder(vllm_config, extra))
            if events_on and not shared:
                if hasattr(store, "watch_changes"):
                    self.store_events = StoreEventSource(store, sched.keys, sched.layout)
                else:
                    _logger.warning("HmaStoreConnector: %s reports no changes; no KV events "
                                    "for the store tier", type(store).__name__)

    # -- scheduler side -------------------------------------------------------------------------
    def request_finished(self, request: Any, block_ids: list[int]):
        """Single-group path (HMA off, one group): ``(False, None)`` too."""
        return self._sched().request_finished(request, (list(block_ids),))

    def shutdown(self) -> None:
        """Unregister the worker's memory, then release the store (a shared store's last
        process removes its segment)."""
        try:
            super().shutdown()
        finally:
            if self.store_events is not None:
                self.store_events.close()
                self.store_events = None
            self.shared_events = None
            store, self.store = self.store, None
            if store is not None:
                release_store(store)

    def take_events(self):
        """The store tier's KV events since the last call: the worker's (an in-process
        store), or the shared store's changes of this engine's keys by any process."""
        events = self._sched().take_events()
        if self.shared_events is not None:
            try:
                events.extend(self.shared_events.take())
            except Exception as e:   # a store gone at shut-down must not fail the step
                _logger.warning("HmaStoreConnector: store-tier events not read (%s)", e)
        return events

    # -- worker side -----------------------------------------------------------------------------
    def get_kv_connector_kv_cache_events(self) -> StoreKVEvents | None:
        """This step's store changes of this engine's keys as KV events (None if none)."""
        src = self.store_events
        events = src.take() if src is not None else []
        return StoreKVEvents(events) if events else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks of partially failed loads vLLM can restart from (see HmaStoreWorker)."""
        w = self.worker
        return w.take_invalid_blocks() if w is not None else set()

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        """Nothing per layer: whole blocks of every group are saved in ``wait_for_save``."""
        return

    def wait_for_save(self) -> None:
        """Write this step's saves (the blocks the store masks keep)."""
        self._work().wait_for_save(self._get_connector_metadata())

