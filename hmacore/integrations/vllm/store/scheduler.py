"""Scheduler side of :class:`~hmacore.integrations.vllm.store.connector.HmaStoreConnector`.

Hash-addressed offload / prefix reuse: a request's KV blocks are saved under keys derived from
vLLM's ``Request.block_hashes`` (rows at the hash block size) and any instance sharing the
store finds them again.

* ``get_num_new_matched_tokens``: one bulk existence probe plus hmacore's cross-group longest
  hit (:func:`hmacore.transport.store.lookup_hit`); returns ``(hit - num_computed_tokens,
  load_async)`` (0 when not positive). The answer is cached per request for one scheduling
  pass (repeated calls in one ``schedule()`` probe once; the next step asks again).
* ``update_state_after_alloc``: tracks the full per-group table (``blocks.get_block_ids()``)
  in a :class:`~hmacore.tables.TrackerSet`; with external tokens it queues a
  :class:`~.metadata.StoreLoad`.
* ``build_connector_meta``: per scheduled request, a :class:`~.metadata.StoreSave` of the
  tokens that become computed in this step, aligned down to the hit alignment, from the
  request's save watermark on (loaded tokens are not saved again).
  Mamba (align mode) groups: when the step ends exactly on an aligned boundary, the block
  holding the state after it is handed over for a boundary put (``save_state``); other
  boundaries are never materialised by vLLM and are not saved.
* ``request_finished``: ``(False, None)``: saves run inside the step that computes the
  tokens, so finishing never delays a free.

Units: tokens; block tables per group in blocks of that group (vLLM group order).
"""
from __future__ import annotations

import logging
from typing import Any

import numpy as np

from ....hits import HitFinder
from ....keys import KeyBuilder
from ....spec import GroupKind
from ....tables import RequestState, TrackerSet
from ....transport.store import lookup_hit
from .. import _compat as C
from .._roles import TableFollower
from ..layout import layout_from_kv_cache_config
from .metadata import HmaStoreConnectorMetadata, StoreLoad, StoreSave

logger = logging.getLogger(__name__)

__all__ = ["HmaStoreScheduler", "hashes_array", "key_builder"]


def hashes_array(block_hashes: Any, limit: int | None = None) -> np.ndarray:
    """vLLM ``Request.block_hashes`` (bytes per row) as an (N, digest) uint8 array."""
    rows = list(block_hashes if limit is None else block_hashes[:limit])
    if not rows:
        return np.zeros((0, 32), dtype=np.uint8)
    w = len(rows[0])
    return np.frombuffer(b"".join(bytes(r) for r in rows), dtype=np.uint8).reshape(-1, w)


def key_builder(vllm_config: Any, extra: dict) -> KeyBuilder:
    """Store keys of this engine: model name (``model_name`` or the model path, ``@``
    replaced), ``cache_prefix`` and ``store_namespace`` from the extra config; rank 0."""
    model = extra.get("model_name")
    if not model:
        mc = getattr(vllm_config, "model_config", None)
        model = str(getattr(mc, "model", None) or "model")
    return KeyBuilder(str(model).replace("@", "_"),
                      cache_prefix=str(extra.get("cache_prefix") or ""),
                      store_namespace=str(extra.get("store_namespace") or ""))


class HmaStoreScheduler(TableFollower):
    """Per-request store bookkeeping of one engine (scheduler process).

    Args:
        vllm_config: the engine's ``VllmConfig`` (``kv_transfer_config`` set).
        kv_cache_config: the scheduler's ``KVCacheConfig``.
        store: the ``KVStore`` lookups probe (see ``_store_backend.open_store``).
    """

    def __init__(self, vllm_config: Any, kv_cache_config: Any, store: Any) -> None:
        ktc = vllm_config.kv_transfer_config
        if ktc is None:
            raise ValueError("HmaStoreConnector needs vllm_config.kv_transfer_config")
        extra = dict(ktc.kv_connector_extra_config or {})
        self.layout = layout_from_kv_cache_config(kv_cache_config, vllm_config=vllm_config,
                                                  for_store=True)
        self.finder = HitFinder(self.layout)
        self.keys = key_builder(vllm_config, extra)
        self.store = store
        self.load_async = bool(extra.get("load_async", False))
        self.do_load = bool(ktc.is_kv_consumer)
        self.do_save = bool(ktc.is_kv_producer)
        self.trackers = TrackerSet(self.layout)
        self._kv_cache_manager: Any = None
        self._requests: dict[str, Any] = {}
        self._hits: dict[str, tuple[int, int]] = {}     # rid -> (num hash rows, hit tokens)
        self._loads: dict[str, StoreLoad] = {}
        self.failed_recving: set[str] = set()
        self.stats = {"lookups": 0, "hit_tokens": 0, "loads": 0, "saves": 0}

    # -- lookups ------------------------------------------------------------------------
    def lookup(self, request: Any) -> int:
        """Tokens of ``request`` the store holds (the aligned cross-group hit); cached per
        number of hash rows. Store failures are misses."""
        rid = request.request_id
        n_rows = len(request.block_hashes)
        cached = self._hits.get(rid)
        if cached is not None and cached[0] == n_rows:
            return cached[1]
        hit = 0
        if n_rows:
            try:
                hit = lookup_hit(self.finder, self.keys, self.store,
                                 hashes_array(request.block_hashes), int(request.num_tokens)).tokens
            except Exception as e:   # never let a lookup take the scheduler down
                logger.warning("store lookup of %s failed (%s); treated as a miss", rid, e)
                hit = 0
        self.stats["lookups"] += 1
        self._hits[rid] = (n_rows, hit)
        return hit

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        if not self.do_load or request.request_id in self.failed_recving:
            return 0, False     # a load of this request failed: recompute, do not retry
        count = self.lookup(request) - int(num_computed_tokens)
        if count <= 0:
            return 0, False
        return count, self.load_async

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        rid = request.request_id
        table = blocks.get_block_ids()
        self._requests[rid] = request
        self._track_full(rid, table, int(request.num_prompt_tokens))
        if num_external_tokens <= 0:
            return
        cached = self._hits.get(rid)
        hit = cached[1] if cached is not None else 0
        skip = hit - int(num_external_tokens)
        if hit <= 0 or skip < 0:
            logger.warning("%s: %d external tokens but the store hit is %d tokens; no load",
                           rid, num_external_tokens, hit)
            return
        rows = hit // self.finder.hash_block_size
        h = hashes_array(request.block_hashes, rows)
        self._loads[rid] = StoreLoad(
            request_id=rid, hit_tokens=hit, skip_tokens=skip,
            block_ids=[[int(b) for b in g] for g in table], hashes=h.tobytes(),
            digest_size=int(h.shape[1]), awaiting=self.load_async)
        # what was loaded is in the store already: saves start after it
        self.trackers.set_saved_tokens(rid, max(self.trackers.saved_tokens(rid), hit))
        if self.load_async:
            self.trackers.set_state(rid, RequestState.WAITING_FOR_REMOTE)
        self.stats["loads"] += 1
        self.stats["hit_tokens"] += hit

    def build_connector_meta(self, scheduler_output: Any) -> HmaStoreConnectorMetadata:
        meta = HmaStoreConnectorMetadata()
        for rid in C.preempted_ids(scheduler_output):
            self._hits.pop(rid, None)
        scheduled = scheduler_output.num_scheduled_tokens
        for rid in self._follow_step(scheduler_output):
            if self.do_save:
                save = self._save_for(rid, int(scheduled.get(rid, 0)))
                if save is not None:
                    meta.saves[rid] = save
        meta.loads, self._loads = self._loads, {}
        # a probe answer is valid for one scheduling pass: a request that did not get its
        # blocks asks the store again next step (keys may have been evicted meanwhile)
        self._hits.clear()
        return meta

    def _save_for(self, rid: str, num_scheduled: int) -> StoreSave | None:
        """The save of the tokens computed once this step ran (meta is built before vLLM
        advances ``num_computed_tokens``)."""
        req = self._requests.get(rid)
        if req is None or num_scheduled <= 0:
            return None
        h = self.finder.hash_block_size
        done = int(req.num_computed_tokens) + num_scheduled
        done = min(done, len(req.block_hashes) * h)      # keys need hash rows
        end = self.finder.align_length(done)
        start = self.trackers.saved_tokens(rid)
        if end <= start:
            return None
        table = self.trackers.block_ids(rid)
        hs = hashes_array(req.block_hashes, end // h)
        self.trackers.set_saved_tokens(rid, end)
        self.stats["saves"] += 1
        states = []
        if end == done:
            # align-mode Mamba: the state after exactly `end` tokens is in block end/bs - 1
            for g in self.finder.group_ids:
                spec = self.layout.groups[g]
                bs = self.finder.block_sizes[g]
                if spec.kind == GroupKind.MAMBA and end % bs == 0 and end // bs <= len(table[g]):
                    b = int(table[g][end // bs - 1])
                    if b:
                        states.append((g, b))
        return StoreSave(request_id=rid, start_token=start, num_tokens=end,
                         block_ids=[g.tolist() for g in table], hashes=hs.tobytes(),
                         digest_size=int(hs.shape[1]), state_blocks=states)

    def update_connector_output(self, connector_output: Any) -> None:
        for rid in connector_output.failed_recving or ():
            self.failed_recving.add(rid)
            self._hits.pop(rid, None)
            if rid in self.trackers:
                # vLLM frees and reallocates (recompute policy): the next full table replaces
                # ours; nothing was loaded, so nothing counts as saved.
                self.trackers.preempt(rid)

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict | None]:
        """Forget the request; never delays the free (saves completed in their step)."""
        rid = request.request_id
        if rid in self.trackers:
            self.trackers.finish(rid)
        self._requests.pop(rid, None)
        self._hits.pop(rid, None)
        self._loads.pop(rid, None)
        self.failed_recving.discard(rid)
        return False, None
