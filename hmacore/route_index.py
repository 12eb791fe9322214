"""A KV-aware routing index: per engine, per KV cache group, the resident block hashes, fed
by vLLM's KV events; a query gives every engine's prefix hit by vLLM's hybrid rule.

Residency follows vLLM's prefix cache exactly when each engine's events arrive in order and
once each (the event adapter's job: ZMQ sequence numbers, replay or ``reset_engine`` on a gap):
a ``BlockStored`` hash is one insertion of (group, hash), a ``BlockRemoved`` hash one removal,
and vLLM may hold one key in several blocks, so each key carries a count per engine and is
resident while it is positive. All engines share one table: (group, hash) -> the mask of
engines holding it (see hmacore/_fast/_route.pyx), so a query probes each (group, hash row)
once for every engine. Odd input never corrupts the index:

- a remove of a key that is not resident is a no-op (counted as ``ignored``);
- a duplicated store raises the count, so the key stays resident until a matching remove;
- events of an engine that was never added (or was removed) are dropped and counted;
- ``AllBlocksCleared`` (op 0) and ``reset_engine`` empty that engine only;
- a batch with a bad row (group out of range, malformed hash) is refused whole, before any
  row is applied.

Hashes: block i of group g is named by hash row ``(i+1)*bs_g/h - 1`` (vLLM >= 0.32), which is
what vLLM's events carry, so one ``(group, row hash)`` key space serves every group whatever
its block size. With ``int_hashes=True`` (vLLM's default ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``)
events carry the low 64 bits of each digest (big-endian), the index keeps those 8 bytes, and
queries read the last 8 bytes of their digests in place; with False events carry the digest
bytes.
"""
from __future__ import annotations

import dataclasses
import threading
from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

import numpy as np

from ._fast import _route
from .errors import (ArgumentTypeError, ArgumentValueError, ConfigError, HashInputError,
                     LayoutError)
from .hits import HitFinder
from .route_hashing import BlockHasher
from .spec import GroupKind, KVLayout

__all__ = ["RoutingIndex", "RouteResult", "ApplyStats", "OP_STORE", "OP_REMOVE", "OP_CLEAR"]

OP_STORE, OP_REMOVE, OP_CLEAR = 1, -1, 0
_INT_WIDTH = 8      # an int hash is kept as its 8 big-endian bytes


@dataclasses.dataclass(frozen=True)
class RouteResult:
    """Per engine key, the hit in tokens; ``best`` the longest; ``best_engines`` the engines
    that hold it (empty when ``best`` is 0); ``num_tokens`` the prompt length."""

    hits: dict
    best: int
    best_engines: tuple
    num_tokens: int


class ApplyStats(NamedTuple):
    """What one ``apply`` / ``apply_events`` did: stores, removes that lowered a count,
    removes of keys not resident (no-ops), rows dropped because their engine is unknown,
    clears; ``apply_events`` also: hashes of events on another medium (left out), hashes of
    stores with lookahead tokens. (A NamedTuple: a frozen dataclass cost ~0.8 us per call,
    more than the kernel on one engine step's batch; ``apply_events`` fills one in C.)"""

    stored: int = 0
    removed: int = 0
    ignored: int = 0
    unknown_engine: int = 0
    cleared: int = 0
    other_medium: int = 0
    lookahead: int = 0


class RoutingIndex:
    """Which engines hold which prefix, by vLLM's cross-group longest-hit rule.

    Args:
        layout: the model's KV cache groups (the same on every engine).
        hash_block_size: vLLM's hash block size in tokens; None takes the layout's (the gcd of
            the group block sizes); anything else must equal it.
        finder: the hit rule; None builds ``HitFinder(layout, **rule)`` (vLLM's core
            coordinator with the default rule; the vLLM integration derives the engine's own:
            ``alignment`` from ``cache_hit_alignment_tokens``, eagle flags from
            ``_compat.core_hit_rule``).
        int_hashes: events carry 64-bit int hashes (vLLM's default) rather than digests.
        hash_algo / seed: the engines' ``--prefix-caching-hash-algo`` and ``PYTHONHASHSEED``
            (see hmacore.route_hashing), for :meth:`query` on token ids.

    Engine keys are any hashable, by convention ``(engine_id, data_parallel_rank)``.
    Thread-safe: one lock serialises event application and queries.
    """

    def __init__(self, layout: KVLayout, hash_block_size: int | None = None, *,
                 finder: HitFinder | None = None, int_hashes: bool = True,
                 hash_algo: str = "sha256", seed: str | None = None, **rule: Any) -> None:
        if not isinstance(layout, KVLayout):
            raise LayoutError(f"layout must be a KVLayout, got {type(layout).__name__}")
        if finder is None:
            finder = HitFinder(layout, **rule)
        elif rule:
            raise ConfigError(f"pass either finder or rule keywords, not both: {sorted(rule)}")
        if not isinstance(finder, HitFinder) or finder.layout != layout:
            raise ConfigError("finder must be a HitFinder built for this layout")
        if hash_block_size is not None and hash_block_size != finder.hash_block_size:
            raise ConfigError(f"hash_block_size must equal the layout's hash block size "
                              f"{finder.hash_block_size} tokens, got {hash_block_size!r}")
        self.layout = layout
        self.finder = finder
        self.num_groups = layout.num_groups
        self.hash_block_size = finder.hash_block_size
        self.int_hashes = bool(int_hashes)
        self.hasher = BlockHasher(self.hash_block_size, hash_algo, seed)
        self.digest_size = _INT_WIDTH if self.int_hashes else self.hasher.digest_size
        self._residency = _route.SharedResidency(self.digest_size)
        self._engines: dict[Hashable, int] = {}      # key -> engine bit in the shared table
        self._keys: tuple = ()                        # the engines' keys and bits, in order,
        self._bits = np.zeros(0, np.int64)            # rebuilt when engines come and go
        self._kernel = finder.kernel
        self._lock = threading.Lock()
        self._no_refusals: tuple = tuple({} for _ in range(self.num_groups))
        self._refused: tuple | None = None
        # what apply_events reads, in C fields (the dict and the lock are these objects)
        self._ev = _route.EventState(self._residency, self._engines, self._lock,
                                     self.num_groups, self._no_refusals, ApplyStats)

    # -- engines ----------------------------------------------------------------------------
    def add_engine(self, engine_id: str, dp_rank: int = 0) -> tuple[str, int]:
        """Register an engine (idempotent); returns its key ``(engine_id, dp_rank)``."""
        if not isinstance(engine_id, str) or not engine_id:
            raise ArgumentValueError(f"engine_id must be a non-empty str, got {engine_id!r}")
        if isinstance(dp_rank, bool) or not isinstance(dp_rank, (int, np.integer)) or dp_rank < 0:
            raise ArgumentValueError(f"dp_rank must be an int >= 0, got {dp_rank!r}")
        key = (engine_id, int(dp_rank))
        with self._lock:
            if key not in self._engines:
                self._engines[key] = self._residency.add_engine()
                self._index_engines()
        return key

    def remove_engine(self, key: Hashable) -> bool:
        """Forget an engine; its later events are dropped. False if it was unknown."""
        with self._lock:
            bit = self._engines.pop(key, None)
            if bit is None:
                return False
            self._residency.remove_engine(bit)
            self._index_engines()
            return True

    def _index_engines(self) -> None:
        self._keys = tuple(self._engines)
        self._bits = np.fromiter(self._engines.values(), np.int64, len(self._engines))

    def reset_engine(self, key: Hashable) -> bool:
        """Empty an engine (its event stream restarted or lost events). False if unknown."""
        with self._lock:
            bit = self._engines.get(key)
            if bit is None:
                return False
            self._residency.clear_engine(bit)
            return True

    @property
    def engines(self) -> tuple:
        with self._lock:
            return tuple(self._engines)

    def resident_blocks(self, key: Hashable) -> int:
        """Distinct resident (group, hash) keys of an engine."""
        with self._lock:
            return self._residency.resident(self._engines[key])

    def nbytes(self, key: Hashable) -> int:
        """Bytes attributed to an engine: its share of the shared table (table bytes x its
        resident keys / all engines' resident keys) plus its duplicate layers."""
        with self._lock:
            res = self._residency
            bit = self._engines[key]
            total = sum(res.resident(b) for b in self._engines.values())
            share = res.nbytes * res.resident(bit) // total if total else 0
            return share + res.duplicate_nbytes(bit)

    def total_nbytes(self) -> int:
        """Bytes of the whole index's residency (shared table and every duplicate layer)."""
        with self._lock:
            res = self._residency
            return res.nbytes + sum(res.duplicate_nbytes(b) for b in self._engines.values())

    # -- events -----------------------------------------------------------------------------
    def digests(self, hashes: Any) -> np.ndarray:
        """Event hashes as the index's (N, digest_size) uint8 keys: 64-bit ints (a sequence
        of ints in [0, 2**64) or an integer array) with ``int_hashes``, else digest bytes (a
        sequence of bytes or an (N, digest) uint8 array)."""
        if self.int_hashes:
            if isinstance(hashes, np.ndarray):
                if hashes.dtype.kind not in "iu" or hashes.ndim != 1:
                    raise HashInputError("hashes must be a 1-D integer array of 64-bit hashes")
                if hashes.dtype.kind == "i" and hashes.size and hashes.min() < 0:
                    raise HashInputError("hashes must be >= 0 (vLLM's unsigned 64-bit hashes)")
                values = hashes.astype(np.uint64)
            else:
                try:
                    values = np.array(list(hashes), dtype=np.uint64)
                except (OverflowError, TypeError, ValueError) as e:
                    raise HashInputError(f"hashes must be ints in [0, 2**64): {e}") from None
                if values.ndim != 1:
                    raise HashInputError("hashes must be a flat sequence of ints")
            return values.astype(">u8").view(np.uint8).reshape(-1, _INT_WIDTH)
        ds = self.digest_size
        if isinstance(hashes, np.ndarray):
            if hashes.dtype != np.uint8 or hashes.ndim != 2 or hashes.shape[1] != ds:
                raise HashInputError(f"hashes must be an (N, {ds}) uint8 array")
            return np.ascontiguousarray(hashes)
        rows = list(hashes)
        if not all(isinstance(b, bytes) and len(b) == ds for b in rows):
            raise HashInputError(f"hashes must be {ds}-byte digests")
        if not rows:
            return np.zeros((0, ds), dtype=np.uint8)
        return np.frombuffer(b"".join(rows), dtype=np.uint8).reshape(-1, ds).copy()

    def fold(self, hashes: np.ndarray | Sequence[bytes]) -> np.ndarray:
        """vLLM hash rows (digests, as ``Request.block_hashes`` or :meth:`block_hashes`) as
        the index's keys: the last 8 bytes with ``int_hashes`` (vLLM's
        ``maybe_convert_block_hash``), else the digests."""
        if not isinstance(hashes, np.ndarray):
            rows = list(hashes)
            width = len(rows[0]) if rows else self.hasher.digest_size
            if not all(isinstance(b, bytes) and len(b) == width for b in rows):
                raise HashInputError("hashes must be equal-length digests (bytes)")
            hashes = (np.frombuffer(b"".join(rows), dtype=np.uint8).reshape(-1, width) if rows
                      else np.zeros((0, width), dtype=np.uint8))
        if hashes.dtype != np.uint8 or hashes.ndim != 2 or hashes.shape[1] < 8:
            raise HashInputError("hashes must be an (N, digest) uint8 array")
        if not self.int_hashes:
            if hashes.shape[1] != self.digest_size:
                raise HashInputError(f"hashes must be {self.digest_size}-byte digests")
            return np.ascontiguousarray(hashes)
        return np.ascontiguousarray(hashes[:, -_INT_WIDTH:])

    def apply(self, key: Hashable, ops: Any, groups: Any, hashes: Any) -> ApplyStats:
        """Apply one engine's events in order, flattened to one row per block hash.

        Args:
            key: the engine key.
            ops: per row OP_STORE (1, a ``BlockStored`` hash), OP_REMOVE (-1, a
                ``BlockRemoved`` hash) or OP_CLEAR (0, ``AllBlocksCleared``; its group and
                hash are ignored).
            groups: per row the event's ``group_idx``.
            hashes: per row the hash (see :meth:`digests`).

        The whole batch is validated first; a bad row refuses the batch, nothing applied.
        Python lists of ints (as msgspec decodes vLLM's batches) take one compiled pass.
        """
        if self.int_hashes and type(ops) is list and type(groups) is list \
                and type(hashes) is list:
            try:
                ops_a, groups_a, keys, clears = _route.pack_event_lists(ops, groups, hashes,
                                                                        self.num_groups)
            except OverflowError as e:
                raise HashInputError(str(e)) from None
            except ValueError as e:
                raise ArgumentValueError(str(e)) from None
            except TypeError:
                pass                 # not plain ints (numpy scalars, ...): the general path
            else:
                return self._apply(key, ops_a, groups_a, keys, clears)
        ops_a = _int_array("ops", ops, np.int8)
        groups_a = _int_array("groups", groups, np.int32)
        if ops_a.size != groups_a.size:
            raise ArgumentValueError(f"ops and groups must have one entry per row: "
                                     f"{ops_a.size} ops, {groups_a.size} groups")
        if ops_a.size and (ops_a.min() < OP_REMOVE or ops_a.max() > OP_STORE):
            raise ArgumentValueError("ops must be 1 (store), -1 (remove) or 0 (clear)")
        events = ops_a != OP_CLEAR
        if groups_a.size and (((groups_a < 0) | (groups_a >= self.num_groups)) & events).any():
            raise ArgumentValueError(f"groups must be group ids in [0, {self.num_groups})")
        digests = self.digests(hashes)
        if digests.shape[0] != ops_a.size:
            raise ArgumentValueError(f"hashes must have one row per op: {digests.shape[0]} "
                                     f"hashes, {ops_a.size} ops")
        return self._apply(key, ops_a, groups_a, digests, int(ops_a.size - events.sum()))

    #: ``apply_events(key, events, types, *, medium="GPU", spec_kinds=None) -> ApplyStats``:
    #: apply a decoded KV event batch's events (vLLM's ``KVEventBatch.events``) in one compiled
    #: call, validated whole first (a bad event refuses the batch, nothing applied). A compiled
    #: function bound as the method (docs in hmacore/_fast/_route.pyx, ``index_apply_events``):
    #: the lock, the engine lookup and the result run without a Python frame, which was most
    #: of the cost of one engine step's batch (docs/routing.md, session 16).
    apply_events = _route.index_apply_events

    #: ``apply_payload(key, payload, *, dp_rank=0, medium="GPU", spec_kinds=None) ->
    #: ApplyStats | None``: apply one KV event batch from the msgpack bytes vLLM publishes, in
    #: one compiled call without decoding it into objects; None if declined (nothing applied:
    #: decode it and call ``apply_events``, which applies it or refuses it by name). Docs in
    #: hmacore/_fast/_route.pyx, ``index_apply_payload``.
    apply_payload = _route.index_apply_payload

    #: ``apply_payloads(key, payloads, *, dp_rank=0, medium="GPU", spec_kinds=None) ->
    #: (ApplyStats, applied)``: consecutive batches of one engine's stream from their bytes in
    #: one call, up to the first declined (``payloads[applied]``, nothing of it applied).
    apply_payloads = _route.index_apply_payloads

    def _refused_kinds(self, spec_kinds: dict[str, GroupKind] | None) -> tuple:
        """Per group, the spec-kind strings that contradict it -> its kind's name (cached
        for the last ``spec_kinds`` object)."""
        if spec_kinds is None:
            return self._no_refusals
        cached = self._refused
        if cached is not None and cached[0] is spec_kinds:
            return cached[1]
        if not isinstance(spec_kinds, dict):
            raise ArgumentTypeError("spec_kinds must be a dict: vLLM kind -> GroupKind")
        # str keys only: the compiled lookup then runs no Python code of the caller's
        refused = tuple({name: g.kind.name for name, kind in spec_kinds.items()
                         if type(name) is str and kind != g.kind} for g in self.layout.groups)
        self._refused = (spec_kinds, refused)
        return refused

    def _apply(self, key: Hashable, ops: np.ndarray, groups: np.ndarray, digests: np.ndarray,
               clears: int) -> ApplyStats:
        with self._lock:
            bit = self._engines.get(key)
            if bit is None:
                return ApplyStats(unknown_engine=int(ops.size))
            stored, removed, ignored, _ = _route.apply_rows(self._residency, bit, ops, groups,
                                                            digests)
        return ApplyStats(stored=stored, removed=removed, ignored=ignored, cleared=clears)

    def _event(self, key: Hashable, op: int, group: int, hashes: Any) -> ApplyStats:
        if isinstance(group, bool) or not isinstance(group, (int, np.integer)) \
                or not 0 <= group < self.num_groups:
            raise ArgumentValueError(f"group must be a group id in [0, {self.num_groups}), "
                                     f"got {group!r}")
        d = self.digests(hashes)
        n = d.shape[0]
        return self._apply(key, np.full(n, op, np.int8), np.full(n, group, np.int32), d, 0)

    def store(self, key: Hashable, group: int, hashes: Any) -> ApplyStats:
        """One ``BlockStored`` event (its ``group_idx`` and ``block_hashes``)."""
        return self._event(key, OP_STORE, group, hashes)

    def remove(self, key: Hashable, group: int, hashes: Any) -> ApplyStats:
        """One ``BlockRemoved`` event (its ``group_idx`` and ``block_hashes``)."""
        return self._event(key, OP_REMOVE, group, hashes)

    def clear(self, key: Hashable) -> ApplyStats:
        """``AllBlocksCleared``: the engine's prefix cache was reset."""
        d = np.zeros((1, self.digest_size), np.uint8)
        return self._apply(key, np.zeros(1, np.int8), np.zeros(1, np.int32), d, 1)

    # -- queries ----------------------------------------------------------------------------
    def block_hashes(self, token_ids: Sequence[int]) -> list[bytes]:
        """vLLM's hash rows of a prompt (see hmacore.route_hashing.BlockHasher)."""
        return self.hasher.hashes(token_ids)

    def query(self, token_ids: Sequence[int]) -> RouteResult:
        """Every engine's hit for a prompt: hash it the way the engines do, then
        :meth:`query_hashes`."""
        return self.query_hashes(self.block_hashes(token_ids), len(token_ids))

    def query_hashes(self, hashes: np.ndarray | Sequence[bytes], num_tokens: int) -> RouteResult:
        """Every engine's hit for a request of ``num_tokens`` tokens whose hash rows are
        ``hashes`` (digests: vLLM's ``Request.block_hashes`` or :meth:`block_hashes`). The hit
        is capped at ``num_tokens - 1`` as vLLM's scheduler caps it (the last token is always
        recomputed)."""
        if type(num_tokens) is not int and (isinstance(num_tokens, bool) or not isinstance(
                num_tokens, (int, np.integer))) or num_tokens < 0:
            raise ArgumentValueError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
        num_tokens = int(num_tokens)
        if type(hashes) is not list and not isinstance(hashes, np.ndarray):
            hashes = list(hashes)
        try:
            with self._lock:     # one compiled call: digests read in place, result built
                hits, best, best_engines = self._residency.route(
                    self._kernel, self.num_groups, hashes, max(num_tokens - 1, 0),
                    self._keys, self._bits)
        except (TypeError, ValueError) as e:
            raise HashInputError(str(e)) from None
        return RouteResult(hits, best, best_engines, num_tokens)


def _int_array(name: str, values: Any, dtype: Any) -> np.ndarray:
    a = np.asarray(values)
    if a.size == 0:
        return np.zeros(0, dtype)
    if a.ndim != 1 or a.dtype.kind not in "iu":
        raise ArgumentTypeError(f"{name} must be a flat sequence of ints")
    info = np.iinfo(dtype)
    if a.min() < info.min or a.max() > info.max:
        raise ArgumentValueError(f"{name} must fit {np.dtype(dtype).name}")
    return np.ascontiguousarray(a, dtype=dtype)
