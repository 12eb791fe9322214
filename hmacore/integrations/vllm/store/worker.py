"""Worker side of :class:`~hmacore.integrations.vllm.store.connector.HmaStoreConnector`.

* ``register_kv_caches``: per group, a :class:`~hmacore.transport.store.GroupSegments` of the
  group's OWN layers only (vLLM lets layer j of every group alias one storage; listing another
  group's layers would read/write its bytes), K/V-split tensors giving two segments per layer;
  every distinct region is registered with the store once.
* ``start_load_kv``: each :class:`~.metadata.StoreLoad` is read with
  :func:`~hmacore.transport.store.load_blocks` into the blocks its hit's load masks select,
  minus blocks the local prefix cache already holds and null positions.
* ``wait_for_save``: each :class:`~.metadata.StoreSave` is written with
  :func:`~hmacore.transport.store.save_blocks` (only the blocks the store mask keeps; keys
  already present are skipped; NO_SPACE stops the save). Save failures are logged, never
  raised. Mamba (align) state blocks named by the save go through ``save_state`` (boundary
  puts); a state layer's segment is its whole page per block (sub-states and padding).
* Failures: a load knows which blocks did not arrive (key missing or evicted since the
  lookup, short or failed get). :func:`hmacore.recovery.plan_vllm_report` picks the restart
  point safe in every group; where vLLM can be told by block ids (one KV cache group, a block
  this load wrote at that point) the ids go to ``get_block_ids_with_load_errors`` and vLLM
  restarts the request there (``recompute``) or fails it alone (``fail``). Otherwise an async
  load is reported in ``finished_recving`` and ``failed_recving`` (vLLM restarts it from 0);
  a sync load raises (with several KV cache groups vLLM 0.32/0.33 has no per-request path
  for a sync load; it refuses invalid block ids). See docs/vllm.md, "Partial load failures".
  A sync load computes the rest of the prompt in its own step: when the load failed, that
  step's save is skipped (its KV was computed on the blocks that did not arrive and vLLM
  drops it); the scheduler side saves the recompute again from the restart point.

Single worker (TP = PP = 1), like HmaNixlConnector.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ....errors import HmacoreError, LayoutError
from .._metrics import StatsCounter
from ....hits import HitFinder, HitResult
from ....keys import KeyBuilder
from ....plan import _layer_parts
from ....recovery import UNKNOWN, VllmReport, plan_vllm_report
from ....spec import GroupKind
from ....transport.store import NO_SPACE, OK, PRESENT, GroupSegments, SaveReport, \
    save_blocks, save_state, load_blocks_failed
from .metadata import HmaStoreConnectorMetadata, StoreLoad, StoreSave
from .. import _compat as C

logger = C.get_logger(__name__)

__all__ = ["HmaStoreWorker", "group_segments_from_kv_caches"]


def group_segments_from_kv_caches(layout, kv_caches: dict[str, Any],
                                  num_blocks: int) -> list[GroupSegments | None]:
    """Per group, the segments of its own layers (None for groups not transferred)."""
    out: list[GroupSegments | None] = []
    for g, spec in enumerate(layout.groups):
        if not spec.transfer:
            out.append(None)
            continue
        bases, sizes = [], []
        for name in spec.layer_names:
            if name not in kv_caches:
                raise LayoutError(f"kv_caches lacks layer {name!r} of group {g}")
            parts = _layer_parts(name, kv_caches[name], num_blocks,
                                 spec.kind == GroupKind.MAMBA, spec.mla)
            if spec.kind == GroupKind.MAMBA:
                parts = _state_page(name, parts)
            for base, rows, stride, length in parts:
                if rows != num_blocks or stride != length:
                    raise LayoutError(f"layer {name!r}: blocks must be contiguous rows of one "
                                      f"region ({rows} rows, stride {stride} B, block {length} B)")
                bases.append(int(base))
                sizes.append(int(length))
        out.append(GroupSegments(tuple(bases), tuple(sizes), int(num_blocks)))
    return out


def _state_page(name: str, parts):
    """A Mamba layer's state sub-views (conv, ssm, ... strided over one page per block) as
    ONE segment: the whole page of each block (sub-states and padding), saved and loaded as
    a unit."""
    strides = {p[2] for p in parts}
    rows = {p[1] for p in parts}
    if len(strides) != 1 or len(rows) != 1:
        raise LayoutError(f"layer {name!r}: state parts disagree on block stride / count")
    stride, nrows = strides.pop(), rows.pop()
    lo = min(p[0] for p in parts)
    if max(p[0] + p[3] for p in parts) > lo + stride:
        raise LayoutError(f"layer {name!r}: state parts do not fit one {stride}-byte page")
    return [(lo, nrows, stride, stride)]


def _hashes(raw: bytes, width: int) -> np.ndarray:
    return np.frombuffer(raw, dtype=np.uint8).reshape(-1, width) if raw else \
        np.zeros((0, width), dtype=np.uint8)


class HmaStoreWorker:
    """Store I/O of one worker. Created by the connector in the WORKER role.

    Args:
        finder: the scheduler side's HitFinder (its layout, eagle and alignment decide the
            store masks, the boundary puts and the load masks); num_blocks: blocks per layer.
        store: the ``KVStore``; keys: the engine's KeyBuilder (same as the scheduler's).
    """

    LOADED_HISTORY = 1024   # how many loads / saves loaded_blocks / last_saves remember

    def __init__(self, finder: HitFinder, num_blocks: int, store: Any, keys: KeyBuilder) -> None:
        self.finder = finder
        self.layout = finder.layout
        self.counters = StatsCounter()     # vLLM's stats / /metrics (_metrics.py)
        self.num_blocks = int(num_blocks)
        self.store = store
        self.keys = keys
        self.segments: list[GroupSegments | None] | None = None
        self._regions: list[int] = []
        self._done_recving: set[str] = set()
        self._failed_recving: set[str] = set()
        self._invalid_blocks: set[int] = set()   # for get_block_ids_with_load_errors
        # requests whose load failed in this step: their save of the step is not written
        self._failed_loads: set[str] = set()
        # rid -> the recovery of its last partially failed load (tests, debugging)
        self.recoveries: dict[str, VllmReport] = {}
        self.last_saves: dict[str, SaveReport] = {}
        # rid -> per-group ids filled, the last LOADED_HISTORY loads (for tests and debugging)
        self.loaded_blocks: dict[str, list[list[int]]] = {}

    # -- registration -----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> list[GroupSegments | None]:
        self.segments = group_segments_from_kv_caches(self.layout, kv_caches, self.num_blocks)
        seen = set()
        for seg in self.segments:
            if seg is None:
                continue
            for base, blk in zip(seg.bases, seg.block_bytes):
                if base in seen:
                    continue
                seen.add(base)
                self.store.register(base, blk * seg.num_blocks)
                self._regions.append(base)
        return self.segments

    def _need_segments(self) -> list[GroupSegments | None]:
        if self.segments is None:
            raise RuntimeError("register_kv_caches must run before loads and saves")
        return self.segments

    # -- loads ------------------------------------------------------------------------------
    def _load_hit(self, ld: StoreLoad, hashes: np.ndarray) -> tuple[HitResult, list[list[int]]]:
        """The hit's load masks without the local prefix and null / missing positions."""
        masks = list(self.finder.load_masks(hashes, ld.hit_tokens))
        filled = []
        for g in range(self.layout.num_groups):
            m = np.array(masks[g], dtype=np.uint8, copy=True)
            table = np.asarray(ld.block_ids[g] if g < len(ld.block_ids) else [], dtype=np.int64)
            if m.size:
                bs = self.finder.block_sizes[g]
                m[:min(m.size, ld.skip_tokens // bs)] = 0      # local prefix hit: keep
                n = min(m.size, table.size)
                m[n:] = 0
                m[:n][table[:n] == 0] = 0                       # null positions hold nothing
            masks[g] = m
            filled.append(table[np.flatnonzero(m)].tolist() if m.size else [])
        return HitResult(int(ld.hit_tokens), tuple(masks)), filled

    def _load(self, ld: StoreLoad) -> tuple[HitResult | None, list[tuple[int, int]]]:
        """Run one load: ``(hit, failed positions)``; ``(None, [])`` when it was rejected
        before reaching the store (nothing is known to have arrived)."""
        try:
            hashes = _hashes(ld.hashes, ld.digest_size)
            hit, filled = self._load_hit(ld, hashes)
            failed = load_blocks_failed(self.finder, self.keys, self.store, hashes, hit,
                                        ld.block_ids, self._need_segments())
        except HmacoreError as e:
            logger.warning("store load of %s rejected: %s", ld.request_id, e)
            return None, []
        if not failed:
            self.loaded_blocks[ld.request_id] = filled
            if len(self.loaded_blocks) > self.LOADED_HISTORY:   # a record, not a leak
                del self.loaded_blocks[next(iter(self.loaded_blocks))]
        return hit, failed

    def _recovery(self, ld: StoreLoad, hit: HitResult | None,
                  failed: list[tuple[int, int]]) -> VllmReport | None:
        """What to tell vLLM about a partially failed load (None: per request). Blocks the
        load did not write are present (local prefix hit) but never ours to report."""
        if hit is None:
            return None
        tables = []
        for g, ids in enumerate(ld.block_ids):
            mask = hit.masks[g]
            tables.append([b if b == 0 or (i < len(mask) and mask[i]) else UNKNOWN
                           for i, b in enumerate(ids)])
        try:
            rep = plan_vllm_report(self.layout, tables, failed, start=int(ld.skip_tokens),
                                   end=int(ld.hit_tokens))
        except HmacoreError as e:   # a bug here must not take the engine down
            logger.warning("no recovery plan for %s: %s", ld.request_id, e)
            return None
        if rep.lands_at == 0 and not rep.per_request and ld.awaiting:
            # vLLM frees an async request restarting at 0: the per-request path does the
            # same and lets the scheduler side look the store up afresh (load_retries)
            rep = dataclasses.replace(rep, block_ids=frozenset(), per_request=True)
        self.recoveries[ld.request_id] = rep
        if len(self.recoveries) > self.LOADED_HISTORY:
            del self.recoveries[next(iter(self.recoveries))]
        return rep

    def start_load_kv(self, meta: HmaStoreConnectorMetadata) -> None:
        self._failed_loads = set()
        for rid, ld in meta.loads.items():
            hit, failed = self._load(ld)
            ok = hit is not None and not failed
            if ld.awaiting:
                self._done_recving.add(rid)
            if ok:
                continue
            self._failed_loads.add(rid)
            self.counters.add("store_load_failures")
            rep = self._recovery(ld, hit, failed)
            if rep is not None and not rep.per_request:
                logger.warning("store load of %s: %d blocks did not arrive; vLLM restarts it "
                               "at token %d (safe point %d)", rid, len(failed), rep.lands_at,
                               rep.safe_tokens)
                self._invalid_blocks |= rep.block_ids
            elif ld.awaiting:
                logger.warning("async store load of %s failed; reported failed_recving", rid)
                self._failed_recving.add(rid)
            else:
                raise RuntimeError(f"sync KV load of {rid!r} from the store failed (set "
                                   "load_async: true to have vLLM recompute instead)")

    def take_invalid_blocks(self) -> set[int]:
        """Block ids for ``get_block_ids_with_load_errors`` since the last call."""
        out, self._invalid_blocks = self._invalid_blocks, set()
        return out

    # -- saves ------------------------------------------------------------------------------
    def _save(self, sv: StoreSave) -> SaveReport:
        try:
            hashes = _hashes(sv.hashes, sv.digest_size)
            rep = save_blocks(self.finder, self.keys, self.store, hashes, sv.num_tokens,
                              sv.block_ids, self._need_segments(), start_token=sv.start_token,
                              row_offset=sv.row_offset, block_offsets=sv.block_offsets)
            for g, block in sv.state_blocks:
                code = save_state(self.finder, self.keys, self.store, hashes, sv.num_tokens, g,
                                  block, self._need_segments()[g], row_offset=sv.row_offset,
                                  if_absent=True)
                if code == PRESENT:     # a state that arrived (or was saved) is not rewritten
                    rep.present += 1
                    continue
                if code == OK:
                    rep.written += 1
                elif code == NO_SPACE:
                    rep.no_space = True
                else:
                    rep.failed += 1
        except HmacoreError as e:
            logger.warning("store save of %s rejected: %s", sv.request_id, e)
            rep = SaveReport(failed=1)
        if rep.failed:
            logger.warning("store save of %s: %d keys failed", sv.request_id, rep.failed)
        return rep

    def wait_for_save(self, meta: HmaStoreConnectorMetadata) -> None:
        failed_loads, self._failed_loads = self._failed_loads, set()
        if not meta.saves:
            return
        # the embedded stores count their evictions (the shared one host-wide: what this
        # engine's saves pushed out, plus any other engine's saving at the same moment);
        # Mooncake evicts in its master, out of sight here
        ev0 = getattr(self.store, "evictions", None)
        for rid, sv in meta.saves.items():
            if rid in failed_loads:
                # computed on blocks that did not arrive; vLLM drops this step of it and the
                # recompute is saved from the restart point (scheduler side)
                logger.warning("store save of %s skipped: its load failed in this step", rid)
                continue
            rep = self.last_saves[rid] = self._save(sv)
            self.counters.add("store_keys_written", rep.written)
            self.counters.add("store_keys_failed", rep.failed + len(rep.refused_keys))
            if len(self.last_saves) > self.LOADED_HISTORY:
                del self.last_saves[next(iter(self.last_saves))]
        if isinstance(ev0, int):
            self.counters.add("store_evictions", max(0, int(self.store.evictions) - ev0))

    # -- results ----------------------------------------------------------------------------
    def get_transfer_results(self) -> tuple[set[str], set[str], set[str]]:
        """``(finished_sending, finished_recving, failed_recving)`` since the last call."""
        recving, failed = self._done_recving, self._failed_recving
        self._done_recving, self._failed_recving = set(), set()
        return set(), recving, failed

    def shutdown(self) -> None:
        for base in self._regions:
            try:
                self.store.unregister(base)
            except Exception:   # pragma: no cover - best effort
                pass
        self._regions = []
