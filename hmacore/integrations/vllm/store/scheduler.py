"""Scheduler side of :class:`~hmacore.integrations.vllm.store.connector.HmaStoreConnector`.

Hash-addressed offload / prefix reuse: a request's KV blocks are saved under keys derived from
vLLM's ``Request.block_hashes`` (rows at the hash block size) and any instance sharing the
store finds them again.

* ``get_num_new_matched_tokens``: one bulk existence probe plus hmacore's cross-group
  longest hit (:func:`hmacore.transport.store.lookup_hit`; on the embedded store
  :func:`~hmacore.transport.store.lookup_hit_indexed` over its digest index, from vLLM's
  ``list[bytes]`` in place) under vLLM's rule for this engine (the EAGLE last-block drop
  when the speculative method asks for it, the engine's hit alignment: :func:`hit_finder`);
  returns ``(hit - num_computed_tokens, load_async)`` (0 when not positive). The answer is
  cached per request for one scheduling pass (repeated calls in one ``schedule()`` probe
  once; the next step asks again).
* ``update_state_after_alloc``: tracks the full per-group table (``blocks.get_block_ids()``)
  in a :class:`~hmacore.tables.TrackerSet`; with external tokens it queues a
  :class:`~.metadata.StoreLoad`.
* ``build_connector_meta``: per scheduled request, a :class:`~.metadata.StoreSave` of the
  tokens that become computed in this step, aligned down to the hit alignment, from the
  request's save watermark on (loaded tokens are not saved again). When a load fails in
  part and vLLM restarts the request at a safe point (invalid block ids), saves start again
  at the first reported block: the recompute saves the blocks whose keys were lost, and
  ``save_blocks`` skips every key still present (those that arrived are not written
  twice). A request restarted from 0 (``failed_recving``) has its watermark reset to 0.
  Mamba (align mode) groups: when the step ends exactly on an aligned boundary, the block
  holding the state after it is handed over for a boundary put (``save_state``); other
  boundaries are never materialised by vLLM and are not saved.
* ``request_finished``: ``(False, None)``: saves run inside the step that computes the
  tokens, so finishing never delays a free.

Units: tokens; block tables per group in blocks of that group (vLLM group order).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ....errors import ConfigError, HashInputError
from ....grain import cdiv
from ....hits import HitFinder
from ....keys import KeyBuilder
from ....spec import GroupKind
from ....tables import RequestState, TrackerSet
from ....transport.store import lookup_hit, lookup_hit_indexed
from .. import _compat as C
from .._clip import skipped_blocks
from .._config import STORE_KEYS, check_keys, flag, number, text
from .._metrics import StatsCounter
from .._roles import TableFollower
from ..layout import layout_from_kv_cache_config
from .metadata import HmaStoreConnectorMetadata, StoreLoad, StoreSave

logger = C.get_logger(__name__)

__all__ = ["HmaStoreScheduler", "hashes_array", "hit_finder", "key_builder"]


def hit_finder(layout: Any, vllm_config: Any, kv_cache_config: Any) -> HitFinder:
    """The HitFinder vLLM's own store coordinator would be for this engine: the installed
    vLLM's store rule (``_compat.store_hit_rule``: ``eagle`` from the speculative config, the
    eagle drop on flagged groups, windows covering ``extra_retained_tokens`` from 0.33),
    ``alignment`` from the engine core's ``cache_hit_alignment_tokens`` (block-aligned hits
    with prefix caching off). Scheduler and worker use the same one: store masks and
    boundary puts depend on it."""
    return HitFinder(layout, alignment=C.cache_hit_alignment_tokens(kv_cache_config, vllm_config),
                     **C.store_hit_rule(vllm_config))


def hashes_array(block_hashes: Any, start: int = 0, stop: int | None = None) -> np.ndarray:
    """Rows ``[start, stop)`` of vLLM's ``Request.block_hashes`` (``list[bytes]``, one digest
    per hash block) as an (N, digest) uint8 array: one list slice and one ``bytes.join``,
    both C loops, no Python object per row."""
    rows = block_hashes[start:stop]
    if not rows:
        return np.zeros((0, 32), dtype=np.uint8)
    raw = b"".join(rows)
    width = len(rows[0])
    if len(raw) != width * len(rows):
        raise HashInputError(f"block_hashes[{start}:{stop}]: digests differ in length")
    return np.frombuffer(raw, dtype=np.uint8).reshape(-1, width)


def key_builder(vllm_config: Any, extra: dict) -> KeyBuilder:
    """Store keys of this engine: model name (``model_name`` or the model path, the key
    separators ``@`` and ``:`` replaced by ``_``), ``cache_prefix`` and ``store_namespace``
    from the extra config; rank 0."""
    model = text(extra, "model_name", "")
    if not model:
        mc = getattr(vllm_config, "model_config", None)
        model = str(getattr(mc, "model", None) or "model")
    return KeyBuilder(str(model).replace("@", "_").replace(":", "_"),
                      cache_prefix=text(extra, "cache_prefix", ""),
                      store_namespace=text(extra, "store_namespace", ""))


class HmaStoreScheduler(TableFollower):
    """Per-request store bookkeeping of one engine (scheduler process).

    Args:
        vllm_config: the engine's ``VllmConfig`` (``kv_transfer_config`` set).
        kv_cache_config: the scheduler's ``KVCacheConfig``.
        store: the ``KVStore`` lookups probe (see ``backend.open_store``).
    """

    def __init__(self, vllm_config: Any, kv_cache_config: Any, store: Any) -> None:
        ktc = vllm_config.kv_transfer_config
        if ktc is None:
            raise ConfigError("HmaStoreConnector needs vllm_config.kv_transfer_config")
        extra = check_keys(ktc.kv_connector_extra_config, STORE_KEYS, "HmaStoreConnector")
        self.layout = layout_from_kv_cache_config(kv_cache_config, vllm_config=vllm_config,
                                                  for_store=True)
        self.finder = hit_finder(self.layout, vllm_config, kv_cache_config)
        self.keys = key_builder(vllm_config, extra)
        self.store = store
        self.load_async = flag(extra, "load_async", False)
        # a request whose async load failed as a whole (vLLM restarts it from 0) looks the
        # store up afresh this many times: blocks that went missing since the first lookup
        # are then left out by the hit rule itself, which keeps exactly the prefix intact in
        # every group (vLLM 0.32 / 0.33 take no block ids from multi-group models)
        self.load_retries = number(extra, "load_retries", 1, integer=True, minimum=0)
        self._retries: dict[str, int] = {}
        self.do_load = bool(ktc.is_kv_consumer)
        self.do_save = bool(ktc.is_kv_producer)
        self.trackers = TrackerSet(self.layout)
        self._kv_cache_manager: Any = None
        self._requests: dict[str, Any] = {}
        self._hits: dict[str, tuple[int, int]] = {}     # rid -> (num hash rows, hit tokens)
        self._hit_requests: dict[str, Any] = {}         # rid -> the request of each _hits entry
        self._loads: dict[str, StoreLoad] = {}
        self.failed_recving: set[str] = set()
        # rid -> the block ids its load writes, until the request ends: a load reported
        # through invalid block ids is never retried (a short get would fail again)
        self._loading: dict[str, frozenset[int]] = {}
        # rid -> the token saves start from again, below its save watermark: vLLM restarted
        # it at a safe point under the loaded hit, and what it recomputes from there may
        # include blocks whose keys were lost (the store would keep a hole there)
        self._resave: dict[str, int] = {}
        self.stats = {"lookups": 0, "hit_tokens": 0, "loads": 0, "saves": 0}
        self.counters = StatsCounter()     # vLLM's stats / /metrics (_metrics.py)
        self._index_ns = self._index_namespace()
        self._events: list = []      # the store tier's KV events from the worker (events.py)

    def _index_namespace(self) -> str | None:
        """The one key namespace of every looked-up group when a lookup can run on the
        store's digest index (``EmbeddedStore.digest_index``: coarse ``last`` keys, one
        namespace per group, all groups in one); else None (key strings and batch_exists)."""
        if not hasattr(self.store, "digest_index") or self.finder.coarse != "last":
            return None
        spaces = set()
        for g in self.finder.group_ids:
            if self.keys.namespaces(g) != (self.keys.rank,):
                return None
            spaces.add(self.keys.prefix(g).rpartition("@group:")[0])
        return spaces.pop() if len(spaces) == 1 else None

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
                index = (self.store.digest_index(self._index_ns)
                         if self._index_ns is not None else None)
                if index is not None:   # embedded: the kernel reads vLLM's list in place
                    hit = lookup_hit_indexed(self.finder, index, request.block_hashes,
                                             int(request.num_tokens)).tokens
                else:   # key strings (Mooncake; an embedded namespace without an index)
                    hit = lookup_hit(self.finder, self.keys, self.store,
                                     hashes_array(request.block_hashes),
                                     int(request.num_tokens)).tokens
            except Exception as e:   # never let a lookup take the scheduler down
                logger.warning("store lookup of %s failed (%s); treated as a miss", rid, e)
                hit = 0
        self.stats["lookups"] += 1
        self.counters.add("store_lookups")
        self._hits[rid] = (n_rows, hit)
        self._hit_requests[rid] = request
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
        if self.do_save:     # saves read each step's new blocks: follow the table
            self._requests[rid] = request
            self._track_full(rid, table, int(request.num_prompt_tokens), at_alloc=True)
        if num_external_tokens <= 0:
            return
        cached = self._hits.get(rid)
        hit = cached[1] if cached is not None else 0
        skip = hit - int(num_external_tokens)
        if hit <= 0 or skip < 0:
            logger.warning("%s: %d external tokens but the store hit is %d tokens; no load",
                           rid, num_external_tokens, hit)
            return
        rows = request.block_hashes[:hit // self.finder.hash_block_size]
        self._loads[rid] = StoreLoad(
            request_id=rid, hit_tokens=hit, skip_tokens=skip,
            block_ids=[list(g) for g in table], hashes=b"".join(rows),
            digest_size=len(rows[0]), awaiting=self.load_async)
        self._loading[rid] = frozenset(int(b) for g in table for b in g if b)
        if rid in self.trackers:
            # what was loaded is in the store already: saves start after it
            self.trackers.set_saved_tokens(rid, max(self.trackers.saved_tokens(rid), hit))
            if self.load_async:
                self.trackers.set_state(rid, RequestState.WAITING_FOR_REMOTE)
        self.stats["loads"] += 1
        self.stats["hit_tokens"] += hit
        self.counters.add("store_loads")
        self.counters.add("store_hit_tokens", hit)

    def build_connector_meta(self, scheduler_output: Any) -> HmaStoreConnectorMetadata:
        meta = HmaStoreConnectorMetadata()
        for rid in C.preempted_ids(scheduler_output):
            self._hits.pop(rid, None)
            self._loading.pop(rid, None)    # its blocks were freed: ids may be reused
            self._hit_requests.pop(rid, None)
            self._resave.pop(rid, None)     # preempt resets its watermark to 0
        scheduled = scheduler_output.num_scheduled_tokens
        for rid in self._follow_step(scheduler_output):
            if self.do_save:
                save = self._save_for(rid, int(scheduled.get(rid, 0)))
                if save is not None:
                    meta.saves[rid] = save
        meta.loads, self._loads = self._loads, {}
        # a probe answer is valid for one scheduling pass: a request that did not get its
        # blocks asks the store again next step (keys may have been evicted meanwhile). A
        # request vLLM allocated blocks for and left waiting for remote KVs keeps its hit:
        # vLLM 0.33 may defer its update_state_after_alloc past this step (async loads on
        # a consumer with overlapping batches and HiSparse), and that call loads the hit
        # vLLM accepted.
        keep = [rid for rid, req in self._hit_requests.items() if C.waits_for_remote_kvs(req)]
        self._hits = {rid: self._hits[rid] for rid in keep if rid in self._hits}
        self._hit_requests = {rid: self._hit_requests[rid] for rid in self._hits}
        return meta

    def _save_for(self, rid: str, num_scheduled: int) -> StoreSave | None:
        """The save of the tokens computed once this step ran (meta is built before vLLM
        advances ``num_computed_tokens``): only the new positions of each group and the new
        hash rows, so its cost does not grow with the request's length."""
        req = self._requests.get(rid)
        if req is None or num_scheduled <= 0:
            return None
        finder = self.finder
        h = finder.hash_block_size
        done = int(req.num_computed_tokens) + num_scheduled
        done = min(done, len(req.block_hashes) * h)      # keys need hash rows
        end = finder.align_length(done)
        saved = self.trackers.saved_tokens(rid)
        start = min(saved, self._resave.get(rid, saved))
        if end <= start:
            return None
        views = self.trackers.block_ids(rid, copy=False)
        # the first block each group may store (store_rows' rule) and the first hash row any
        # key of them (or a Mamba boundary put at `end`) reads
        row0 = max(end // h - 1, 0)
        # vLLM has nulled (and freed) the blocks before each window by now: never name them
        processed = max(0, int(req.num_computed_tokens) - int(getattr(req, "num_in_flight_tokens", 0)))
        ids, offsets = [], []
        for g, view in enumerate(views):
            bs = finder.block_sizes[g]
            lo = min(end // bs, cdiv(start, bs))
            # an int32 copy (the tracker's storage moves on), never a list: no Python object
            # per block on this per-step path
            group = view[lo:min(end // bs, view.shape[0])].copy()
            gone = min(max(skipped_blocks(self.layout.groups[g], processed) - lo, 0), len(group))
            group[:gone] = 0
            ids.append(group)
            offsets.append(lo)
            if g in finder.group_ids:
                row0 = min(row0, lo * (bs // h))
        raw = b"".join(req.block_hashes[row0:end // h])
        if end >= saved:
            self.trackers.set_saved_tokens(rid, end)
            self._resave.pop(rid, None)
        else:      # still re-saving below the watermark
            self._resave[rid] = end
        self.stats["saves"] += 1
        self.counters.add("store_saves")
        states = []
        if end == done:
            # align-mode Mamba: the state after exactly `end` tokens is in block end/bs - 1
            for g in finder.group_ids:
                bs = finder.block_sizes[g]
                if self.layout.groups[g].kind == GroupKind.MAMBA and end % bs == 0 \
                        and end // bs <= views[g].shape[0]:
                    b = int(views[g][end // bs - 1])
                    if b:
                        states.append((g, b))
        return StoreSave(request_id=rid, start_token=start, num_tokens=end, block_ids=ids,
                         hashes=raw, digest_size=len(req.block_hashes[0]),
                         state_blocks=states, block_offsets=offsets, row_offset=row0)

    def take_events(self) -> list:
        """KV events of the store tier reported by the worker since the last call."""
        out, self._events = self._events, []
        return out

    def update_connector_output(self, connector_output: Any) -> None:
        store_events = getattr(connector_output, "kv_cache_events", None)
        if store_events is not None:
            self._events.extend(store_events.get_all_events())
        invalid = getattr(connector_output, "invalid_block_ids", None)
        if invalid:
            for rid, ids in self._loading.items():
                if ids & invalid:
                    self.failed_recving.add(rid)   # vLLM restarts it; never re-load it
                    self._resave_from_invalid(rid, invalid)
        for rid in connector_output.failed_recving or ():
            tries = self._retries.get(rid, 0)
            if tries < self.load_retries:
                self._retries[rid] = tries + 1
                self.counters.add("store_load_retries")
            else:
                self.failed_recving.add(rid)
            self._loading.pop(rid, None)      # vLLM frees its blocks (or fails it)
            self._hits.pop(rid, None)
            self._hit_requests.pop(rid, None)
            self._resave.pop(rid, None)
            if rid in self.trackers:
                # vLLM frees and reallocates (recompute policy): the next full table replaces
                # ours; nothing was loaded, so nothing counts as saved.
                self.trackers.preempt(rid)

    def _resave_from_invalid(self, rid: str, invalid: set[int]) -> None:
        """Saves of ``rid`` start again at its first block vLLM was told is invalid: vLLM
        restarts the request there (the landing block of ``plan_vllm_report``) and the
        blocks from there on, whose keys may be lost, are recomputed."""
        if rid not in self.trackers:
            return
        saved = self.trackers.saved_tokens(rid)
        point = saved
        for g, view in enumerate(self.trackers.block_ids(rid, copy=False)):
            if not view.size:
                continue
            bad = np.flatnonzero(np.isin(view, np.fromiter(invalid, dtype=view.dtype)))
            if bad.size:
                point = min(point, int(bad[0]) * self.finder.block_sizes[g])
        point = self.finder.align_length(point)
        if point < saved:
            self._resave[rid] = min(point, self._resave.get(rid, saved))

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict | None]:
        """Forget the request; never delays the free (saves completed in their step)."""
        rid = request.request_id
        if rid in self.trackers:
            self.trackers.finish(rid)
        self._requests.pop(rid, None)
        self._hits.pop(rid, None)
        self._hit_requests.pop(rid, None)
        self._loads.pop(rid, None)
        self._loading.pop(rid, None)
        self._retries.pop(rid, None)
        self._resave.pop(rid, None)
        self.failed_recving.discard(rid)
        return False, None
