"""Multi-group block tables and per-request trackers.

Units: a block table is one array of block ids per KV cache group; entry j of group g is
block j of that group (``block_size[g]`` tokens each; MAMBA: the state after ``(j+1)*bs``
tokens). Id 0 is the null block (placeholder for freed / skipped positions). Ids are int32.
"""
from __future__ import annotations

import copy as _copy
import enum
from _thread import get_ident as _get_ident
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Hashable, Union

import numpy as np

from ._fast import _tables as _k
from .errors import BlockTableError, TrackerStateError
from .spec import KVLayout

__all__ = [
    "BlockTable", "as_block_table", "to_wire", "from_wire", "to_tuple", "fill_blocks",
    "count_hashed", "ids_from_objects", "pair_block_spans", "RequestState", "TrackerSet",
    "BLOCK_ID_DTYPE", "TokenCountError", "TrackerThreadError",
]

BlockTable = tuple  # tuple[np.ndarray[int32], ...], one entry per group
BlockTableLike = Union[Sequence[Any], np.ndarray]

#: NumPy dtype of block ids, tied to the kernels' C ``block_id_t`` (hmacore/_fast/_types.pxd).
#: (BLOCK_ID_DTYPE and STATUS_CHANGED are missing from _fast/_tables.pyi, owned with the kernels)
BLOCK_ID_DTYPE = _k.BLOCK_ID_DTYPE  # type: ignore[attr-defined]
_INT32_MAX = 2**31 - 1
_TOKEN_MAX = 2**63 - 1          # token counts are int64 in the store
_EMPTY = np.empty(0, dtype=BLOCK_ID_DTYPE)
_EMPTY.flags.writeable = False


class TokenCountError(TrackerStateError, ValueError):
    """A token count (watermark, prompt length) is not an int in ``[0, 2**63)``."""


class TrackerThreadError(TrackerStateError):
    """A TrackerSet was used from a thread other than its owner (see TrackerSet)."""


# -- conversion / validation ------------------------------------------------------------
def _check_num_groups(num_groups: Any) -> int:
    if isinstance(num_groups, bool) or not isinstance(num_groups, (int, np.integer)) \
            or num_groups < 1:
        raise BlockTableError(f"num_groups must be an int >= 1, got {num_groups!r}")
    return int(num_groups)


def _check_num_blocks(num_blocks: Any) -> int:
    """0 means unknown pool size (only sign and int32 range are checked)."""
    if num_blocks is None:
        return 0
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, (int, np.integer)) \
            or not 1 <= num_blocks <= _INT32_MAX:
        raise BlockTableError(f"num_blocks must be None or an int in [1, 2**31-1], "
                              f"got {num_blocks!r}")
    return int(num_blocks)


def _is_group_like(x: Any) -> bool:
    return isinstance(x, (list, tuple, np.ndarray)) or x is None


def _split_groups(block_ids: Any, num_groups: int, name: str) -> Sequence[Any]:
    if isinstance(block_ids, np.ndarray):
        if block_ids.ndim == 1 and num_groups == 1:
            return (block_ids,)
        if block_ids.ndim == 1:
            raise BlockTableError(f"{name}: a flat array is a single-group table, but the "
                                  f"layout has {num_groups} groups; pass one array per group")
        raise BlockTableError(f"{name}: {block_ids.ndim}-D arrays are not accepted (groups "
                              "differ in length); pass a tuple with one 1-D array per group")
    if not isinstance(block_ids, (list, tuple)):
        raise BlockTableError(f"{name} must be a tuple/list with one id sequence per group, "
                              f"got {type(block_ids).__name__}")
    if num_groups == 1 and (len(block_ids) == 0 or not _is_group_like(block_ids[0])):
        return (block_ids,)  # single-group back-compat: a flat list of ids
    if len(block_ids) != num_groups:
        raise BlockTableError(f"{name} has {len(block_ids)} groups, the layout has "
                              f"{num_groups}")
    return block_ids


def _raise_status(name: str, g: int, i: int, status: int, value: Any, hi: int,
                  offset: int = 0) -> None:
    where = f"{name}: group {g}, index {i + offset}"
    if status == _k.STATUS_CHANGED:  # type: ignore[attr-defined]
        raise BlockTableError(f"{name}: group {g} changed size while being converted (at "
                              f"index {i + offset}); pass a table nothing else mutates")
    if status == _k.STATUS_NOT_INT:
        raise BlockTableError(f"{where}: block ids must be integers, got "
                              f"{type(value).__name__} {value!r}")
    if status == _k.STATUS_NEGATIVE:
        raise BlockTableError(f"{where}: block id {value} is negative")
    if status == _k.STATUS_PAST_INT32:
        raise BlockTableError(f"{where}: block id {value} does not fit in int32")
    raise BlockTableError(f"{where}: block id {value} is >= num_blocks ({hi})")


def _as_group(x: Any, g: int, hi: int, name: str, offset: int = 0) -> np.ndarray:
    """One group as contiguous int32 (``offset``: index of x[0] in the caller's group, for
    messages about a slice)."""
    if isinstance(x, np.ndarray):
        if x.ndim != 1:
            raise BlockTableError(f"{name}: group {g} must be 1-D, got shape {x.shape}")
        kind = x.dtype.kind
        if kind == "O":
            x = x.tolist()
        elif kind not in "iu":
            raise BlockTableError(f"{name}: group {g} must hold integers, got dtype {x.dtype}")
        elif x.dtype == BLOCK_ID_DTYPE:
            x = np.ascontiguousarray(x)
            status, i = _k.scan_int32(x, hi)
            if status != _k.STATUS_OK:
                _raise_status(name, g, i, status, int(x[i]), hi, offset)
            return x
        else:
            bad = x > _INT32_MAX
            if hi:
                bad |= x >= hi
            if kind == "i":
                bad |= x < 0
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                v = int(x[i])
                status = (_k.STATUS_NEGATIVE if v < 0 else
                          _k.STATUS_PAST_INT32 if v > _INT32_MAX else _k.STATUS_PAST_POOL)
                _raise_status(name, g, i, status, v, hi, offset)
            return x.astype(BLOCK_ID_DTYPE)
    if isinstance(x, (list, tuple)):
        out, status, i = _k.seq_to_int32(x, hi)
        if status != _k.STATUS_OK:
            _raise_status(name, g, i, status, x[i] if 0 <= i < len(x) else None, hi, offset)
        # an array: _raise_status raised unless the status is OK (no cast(): a per-group path)
        return out  # type: ignore[return-value]
    if x is None:
        raise BlockTableError(f"{name}: group {g} is None (use an empty list for no blocks)")
    raise BlockTableError(f"{name}: group {g} must be a list/tuple/1-D array of ids, got "
                          f"{type(x).__name__}")


def index_identical(seq: Sequence[Any], item: Any) -> int:
    """Index of the first element of the list/tuple ``seq`` that *is* ``item``, else -1, in
    one C pass over its pointers (no element is read: cheap when the elements are out of
    cache, e.g. a scheduler step's request ids). Fall back to ``seq.index`` on -1 when an
    equal but distinct object may be there."""
    return _k.index_identical(seq, item)


def ids_from_objects(objs: Sequence[Any], *, id_attr: str = "block_id",
                     flag_attr: str = "block_hash", name: str = "blocks",
                     group: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, flags)`` of a list of block objects in one C pass: int32 ``obj.<id_attr>``
    (exact ints in ``[0, 2**31)``) and a bool mask of ``obj.<flag_attr> is not None``.

    What a connector reads from a group of vLLM ``KVCacheBlock`` objects (ids, "has a block
    hash") without a Python object per block. Raises BlockTableError naming ``name``, ``group``
    and the index of the first bad id.
    """
    if not isinstance(objs, (list, tuple)):
        try:                # the kernel reads a list; the error path below indexes it
            objs = list(objs)
        except TypeError:
            raise BlockTableError(f"{name}: group {group} must be a list of block objects, got "
                                  f"{type(objs).__name__}") from None
    try:
        ids, flags, status, i = _k.objects_to_ids(objs, id_attr, flag_attr)
    except AttributeError:
        i = next((j for j, o in enumerate(objs)
                  if not (hasattr(o, id_attr) and hasattr(o, flag_attr))), -1)
        raise BlockTableError(f"{name}: group {group}, index {i}: a block object needs the "
                              f"attributes {id_attr!r} and {flag_attr!r}") from None
    if status != _k.STATUS_OK:
        value = getattr(objs[i], id_attr, None) if 0 <= i < len(objs) else None
        _raise_status(f"{name} ({id_attr})", group, i, status, value, 0)
    assert ids is not None and flags is not None
    return ids, flags.view(np.bool_)


def pair_block_spans(mine: Sequence[np.ndarray], theirs: Sequence[np.ndarray],
                     block_sizes: Sequence[int], start: int,
                     end: int) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]]:
    """Pair two positional tables over the tokens ``[start, end)``: per group g, the blocks
    at positions ``start // bs .. cdiv(end, bs) - 1`` of ``mine[g]`` and ``theirs[g]``, skipping
    positions where either holds the null block 0 or that lie past either table. Returns
    ``(local, remote)``, int32 arrays per group. One C call for all groups (push mode's
    per-step WRITE pairs; no Python object per block). Tables: any form
    :func:`as_block_table` accepts; tuples of contiguous int32 arrays pass as they are,
    unscanned (the kernel reads only the span's positions and refuses a negative id there), so
    the cost follows the span, not the tables' length."""
    sizes = tuple(block_sizes)
    try:        # tuples of contiguous int32 arrays go straight in (the kernel's typed views)
        return _k.pair_block_spans(mine, theirs, sizes, start, end)  # type: ignore[arg-type]
    except (TypeError, ValueError, BufferError):
        pass    # anything else: converted and checked, so a bad table gets a clear error
    n = len(sizes)
    a = as_block_table(mine, n, name="mine")
    b = as_block_table(theirs, n, name="theirs")
    return _k.pair_block_spans(a, b, sizes, int(start), int(end))


def as_block_table(block_ids: BlockTableLike, num_groups: int, *, num_blocks: int | None = None,
                   name: str = "block_ids") -> tuple[np.ndarray, ...]:
    """Validate a per-group table and return it as a tuple of contiguous int32 arrays.

    Accepts a tuple/list of lists, tuples or 1-D integer arrays (one per group), and, when
    ``num_groups == 1``, a flat list/array of ids (single-group back-compat; an empty flat
    list is one empty group). Ids must be integers (not bools/floats) in ``[0, num_blocks)``
    (``[0, 2**31)`` when ``num_blocks`` is None). A group that already is a contiguous int32
    array is returned as is (no copy); everything else is copied.

    Raises:
        BlockTableError: naming ``name``, the group and the index of the first bad id.
    """
    num_groups = _check_num_groups(num_groups)
    hi = _check_num_blocks(num_blocks)
    groups = _split_groups(block_ids, num_groups, name)
    return tuple(_as_group(x, g, hi, name) for g, x in enumerate(groups))


def to_wire(table: Sequence[Any]) -> list[list[int]]:
    """Per-group lists of Python ints (JSON/msgpack friendly).

    Every entry must be a block id (an int, NumPy integer or integer array element in
    ``[0, 2**31)``): floats, bools and negative ids raise BlockTableError (never truncated).
    """
    if isinstance(table, np.ndarray) or not isinstance(table, (list, tuple)):
        raise BlockTableError(f"table must be a tuple/list with one id sequence per group, "
                              f"got {type(table).__name__}")
    return [_as_group(t, g, 0, "table").tolist() for g, t in enumerate(table)]


def from_wire(obj: Any, num_groups: int, *, num_blocks: int | None = None,
              name: str = "remote_block_ids") -> tuple[np.ndarray, ...]:
    """Parse a wire table (list of per-group lists; a flat list when ``num_groups == 1``).

    Same rules as :func:`as_block_table`.
    """
    return as_block_table(obj, num_groups, num_blocks=num_blocks, name=name)


def to_tuple(table: Sequence[Any]) -> tuple[list[int], ...]:
    """vLLM's ``tuple[list[int], ...]`` shape."""
    return tuple(to_wire(table))


def _as_masks(hashed: Any, table: tuple[np.ndarray, ...]) -> list[np.ndarray]:
    if not isinstance(hashed, (list, tuple)):
        raise BlockTableError(f"hashed must be a tuple/list with one mask per group, got "
                              f"{type(hashed).__name__}")
    if len(hashed) != len(table):
        raise BlockTableError(f"hashed has {len(hashed)} groups, the table has {len(table)}")
    masks = []
    for g, m in enumerate(hashed):
        m = np.asarray(m)
        if m.ndim != 1 or m.shape[0] != table[g].shape[0]:
            raise BlockTableError(f"hashed: group {g} must be a 1-D mask of length "
                                  f"{table[g].shape[0]}, got shape {m.shape}")
        if m.size == 0:
            m = np.zeros(0, dtype=np.uint8)  # np.asarray([]) is float64
        elif m.dtype == np.bool_:
            m = m.view(np.uint8)
        elif m.dtype != np.uint8:
            if m.dtype.kind not in "iu" or (m.size and (m.min() < 0 or m.max() > 1)):
                raise BlockTableError(f"hashed: group {g} must be a bool/uint8 mask (or 0/1 "
                                      f"integers), got dtype {m.dtype}")
            m = m.astype(np.uint8)
        masks.append(np.ascontiguousarray(m))
    return masks


def fill_blocks(table: BlockTableLike, hashed: Sequence[Any]) -> tuple[np.ndarray, ...]:
    """Blocks a connector must fill, per group (vLLM ``get_unhashed_block_ids_all_groups``).

    Per group: strip the leading null (0) run, then keep ids whose ``hashed`` flag is 0 and
    that are not null. ``table`` has one entry per group (any form :func:`as_block_table`
    accepts with ``num_groups=len(table)``); ``hashed[g]`` is a bool/uint8 mask of the same
    length. Returns fresh int32 arrays (blocks of group g).
    """
    t = as_block_table(table, _n_groups(table), name="table")
    masks = _as_masks(hashed, t)
    out = []
    for ids, m in zip(t, masks):
        buf = np.empty(ids.shape[0], dtype=BLOCK_ID_DTYPE)
        n = _k.select_unhashed(ids, m, buf)
        out.append(buf[:n])
    return tuple(out)


def count_hashed(table: BlockTableLike, hashed: Sequence[Any]) -> tuple[int, ...]:
    """Per group: positions that are hashed and not null (vLLM ``local_num_computed_blocks``)."""
    t = as_block_table(table, _n_groups(table), name="table")
    masks = _as_masks(hashed, t)
    return tuple(_k.count_hashed_nonnull(ids, m) for ids, m in zip(t, masks))


def _n_groups(table: Any) -> int:
    if isinstance(table, (list, tuple)) and len(table) and _is_group_like(table[0]):
        return len(table)
    if isinstance(table, (list, tuple)) and len(table) == 0:
        raise BlockTableError("table: a block table needs at least one group")
    return 1


# -- trackers ---------------------------------------------------------------------------
class RequestState(enum.IntEnum):
    """Lifecycle of a tracked request (FINISHED requests are removed from the set)."""

    NEW = 0                 # added, nothing scheduled yet
    WAITING_FOR_REMOTE = 1  # blocks allocated, waiting for an async load
    RUNNING = 2
    PREEMPTED = 3           # table and watermarks reset; comes back via replace()
    FINISHED = 4


_NEW, _RUNNING, _PREEMPTED = (int(RequestState.NEW), int(RequestState.RUNNING),
                              int(RequestState.PREEMPTED))
_SCHEDULED, _SAVED, _LOADED, _PROMPT = range(_k.NUM_MARKS)   # TableStore watermark slots
_MARKS = {"scheduled_tokens": _SCHEDULED, "saved_tokens": _SAVED, "loaded_tokens": _LOADED}


class _FastTable:
    """A table of Python-int lists that already passed ``check_int_table``."""

    __slots__ = ("groups",)

    def __init__(self, groups: Any) -> None:
        self.groups = groups


class TrackerSet:
    """Per-request, per-group block tables mirroring vLLM's scheduler contract.

    Tables live in growable contiguous int32 buffers, one per request and group, with the
    per-request metadata in slot-indexed C arrays (:class:`~hmacore._fast._tables.TableStore`:
    one slot per tracked request, no object per request or block). Every mutating method
    validates all of its input before changing anything: on any exception the set is
    unchanged.

    Units: tables in blocks of each group; watermarks in tokens (ints in ``[0, 2**63)``).

    Views: ``block_ids(copy=False)`` and :func:`hmacore.windows.clip_tracked` return
    read-only *snapshots*: a view shows the table as it was when it was taken and never
    changes afterwards (no later appends, no later in-place nulling, never another
    request's ids after a preempt/replace or a finish). The set copies a group before it
    rewrites a position that a live view can see, so keeping views is always safe; drop
    them promptly all the same (each live view keeps its buffer alive, and a rewrite under
    a live view costs a copy of that group).

    Threads: a TrackerSet is **not** thread-safe and has one owner thread: the first thread
    that reads or writes request data through it (construction does not bind). A call
    from any other thread raises :class:`TrackerThreadError` (a TrackerStateError) before
    anything is read or changed. To hand the set to another thread, call
    :meth:`bind_to_current_thread` from the new owner once the old one has stopped using it.
    ``len()``, ``in``, iteration and ``repr`` are not checked. Share TransferPlan /
    HitFinder objects freely instead (immutable); give each thread its own TrackerSet.

    Pickling and ``copy.copy`` / ``copy.deepcopy`` give an independent set with the same
    requests, tables, states and watermarks (the copy has no owner thread yet).
    """

    def __init__(self, layout: KVLayout) -> None:
        if not isinstance(layout, KVLayout):
            raise TypeError(f"layout must be a KVLayout, got {type(layout).__name__}")
        self._adopt(layout, _k.TableStore(layout.num_groups))

    def _adopt(self, layout: KVLayout, store: Any) -> None:
        self.layout = layout
        self.num_groups = layout.num_groups
        self._num_blocks = layout.num_blocks
        self._nb = self._num_blocks or 0   # kernels: 0 = pool size unknown
        self._store = store
        self._reqs: dict[Hashable, int] = self._store.index   # req_id -> slot (read-only here)
        self._owner: int | None = None     # thread ident of the owner (None: not bound yet)

    # -- threads, pickling, copies ------------------------------------------------------
    def _claim(self) -> None:
        """Bind the set to the calling thread, or raise if another thread owns it."""
        me = _get_ident()
        if self._owner is None:
            self._owner = me
        elif self._owner != me:
            raise TrackerThreadError(
                "TrackerSet used from a thread that does not own it (owner thread ident "
                f"{self._owner}, this thread {me}): a TrackerSet belongs to one thread; give "
                "each thread its own, or hand it over with bind_to_current_thread()")

    def bind_to_current_thread(self) -> None:
        """Make the calling thread the owner (a hand-off: the previous owner must have
        stopped using the set; nothing synchronises the two)."""
        self._owner = _get_ident()

    def __reduce__(self):
        return _tracker_from_store, (self.layout, self._store)

    def __copy__(self) -> TrackerSet:
        return _tracker_from_store(self.layout, _copy.copy(self._store))

    def __deepcopy__(self, memo: dict) -> TrackerSet:
        return _tracker_from_store(_copy.deepcopy(self.layout, memo), _copy.copy(self._store))

    def __repr__(self) -> str:
        return (f"TrackerSet(groups={self.num_groups}, requests={len(self._reqs)}, "
                f"num_blocks={self._num_blocks})")

    # -- helpers ----------------------------------------------------------------------
    def _table(self, block_ids: Any, name: str) -> tuple[np.ndarray, ...]:
        return as_block_table(block_ids, self.num_groups, num_blocks=self._num_blocks,
                              name=name)

    def _get(self, req_id: Hashable) -> int:
        """The request's slot in the store (the owner-thread check first)."""
        if self._owner != _get_ident():
            self._claim()
        try:
            return self._reqs[req_id]
        except KeyError:
            raise TrackerStateError(f"req_id {req_id!r} is not tracked (never added or "
                                    "already finished)") from None
        except TypeError:
            raise TrackerStateError(f"req_id must be hashable, got {type(req_id).__name__}") \
                from None

    def _new_ids(self, new_block_ids: Any) -> tuple[np.ndarray, ...] | None:
        """Appended ids of a running request; None (or all-empty) means no change."""
        if new_block_ids is None:
            return None
        if isinstance(new_block_ids, (list, tuple)) and any(x is None for x in new_block_ids):
            new_block_ids = [_EMPTY if x is None else x for x in new_block_ids]
        return self._table(new_block_ids, "new_block_ids")

    def _check_full(self, s: int, full: tuple[np.ndarray, ...], req_id: Hashable) -> None:
        st = self._store
        for g, ids in enumerate(full):
            i = st.first_illegal_change(s, g, ids)
            if i < 0:
                continue
            if i == ids.shape[0] and i < st.length(s, g):
                raise BlockTableError(
                    f"full_table: group {g} of {req_id!r} has {ids.shape[0]} blocks but "
                    f"{st.length(s, g)} are tracked; tables never shrink (positions are stable)")
            old = int(st.view_group(s, g)[i])
            raise BlockTableError(
                f"full_table: group {g}, index {i} of {req_id!r}: tracked block {old} changed "
                f"to {int(ids[i])}; a tracked position may only become the null block 0")

    @staticmethod
    def _check_tokens(name: str, n: Any) -> int:
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 0 <= n <= _TOKEN_MAX:
            raise TokenCountError(f"{name} must be an int >= 0 and < 2**63 (tokens), got {n!r}")
        return int(n)

    @staticmethod
    def _check_hashable(req_id: Any) -> None:
        """An unhashable req_id can never be tracked: TrackerStateError, as for an unknown one
        (not the TypeError of the dict lookup)."""
        try:
            hash(req_id)
        except TypeError:
            raise TrackerStateError(f"req_id must be hashable, got {type(req_id).__name__}") \
                from None

    # -- single-request operations ----------------------------------------------------
    def add(self, req_id: Hashable, block_ids: BlockTableLike, *, num_prompt_tokens: int = 0) -> None:
        """Track a new request with a copy of its full table (blocks per group).

        Everything (table, ``num_prompt_tokens`` in ``[0, 2**63)``) is validated before the
        request is stored: on any exception nothing is tracked."""
        if self._owner != _get_ident():
            self._claim()
        self._check_hashable(req_id)
        if req_id in self:
            raise TrackerStateError(f"req_id {req_id!r} is already tracked")
        n = self._check_tokens("num_prompt_tokens", num_prompt_tokens)
        table = self._fast_or_table(block_ids, "block_ids", allow_none=False)
        self._insert(req_id, table, n)

    def _fast_or_table(self, block_ids: Any, name: str, *, allow_none: bool) -> Any:
        """Lists of Python ints that pass the C pre-check are kept as they are (consumed by
        ``TableStore.extend_groups``); anything else becomes int32 arrays (or raises)."""
        if _k.check_int_table(block_ids, self.num_groups, self._num_blocks or 0, allow_none):
            return _FastTable(block_ids)
        if allow_none:
            return self._new_ids(block_ids)
        return self._table(block_ids, name)

    def _extend(self, s: int, table: Any) -> None:
        if table is None:
            return
        if isinstance(table, _FastTable):
            self._store.extend_groups(s, table.groups)
            return
        for g, ids in enumerate(table):
            self._store.append(s, g, ids)

    def _insert(self, req_id: Hashable, table: Any, prompt: int) -> None:
        s = self._store.add(req_id, int(RequestState.NEW))
        try:
            self._extend(s, table)
        except BaseException:        # validated input: only MemoryError gets here
            self._store.pop(req_id)
            raise
        self._store.set_mark(s, _PROMPT, prompt)

    def append(self, req_id: Hashable, new_block_ids: BlockTableLike | None) -> tuple[int, ...]:
        """Append newly allocated blocks of a running request (None / empty groups: no-op).

        Returns the new per-group lengths. A PREEMPTED request must come back via
        :meth:`replace` first.
        """
        s = self._get(req_id)
        table = self._fast_or_table(new_block_ids, "new_block_ids", allow_none=True)
        st = self._store
        self._check_appendable(req_id, st.get_state(s))
        self._extend(s, table)
        if st.get_state(s) == RequestState.NEW:
            st.set_state(s, int(RequestState.RUNNING))
        return st.lengths(s)

    @staticmethod
    def _check_appendable(req_id: Hashable, state: int) -> None:
        if state == RequestState.PREEMPTED:
            raise TrackerStateError(f"req_id {req_id!r} is PREEMPTED: a resumed request "
                                    "brings its full table (replace), not appended ids")

    def update_after_alloc(self, req_id: Hashable, full_table: BlockTableLike) -> tuple[int, ...]:
        """Merge the request's FULL table (vLLM ``update_state_after_alloc``); idempotent.

        Appends only the suffix beyond the tracked length of each group and nulls tracked
        positions that became 0 (vLLM frees out-of-window blocks in place). Any other change
        of a tracked position, or a shorter table, raises BlockTableError and changes nothing.
        Returns how many blocks were appended per group.
        """
        s = self._get(req_id)
        full = self._table(full_table, "full_table")
        self._check_full(s, full, req_id)
        return tuple(self._store.merge_full(s, g, ids) for g, ids in enumerate(full))

    def replace(self, req_id: Hashable, full_table: BlockTableLike) -> None:
        """Replace the table of a resumed request; state becomes RUNNING."""
        s = self._get(req_id)
        full = self._table(full_table, "full_table")
        for g, ids in enumerate(full):
            self._store.assign(s, g, ids)
        self._store.set_state(s, int(RequestState.RUNNING))

    def preempt(self, req_id: Hashable) -> None:
        """Empty the table, reset the watermarks to 0, state PREEMPTED."""
        s = self._get(req_id)
        st = self._store
        st.clear(s)
        for m in (_SCHEDULED, _SAVED, _LOADED):
            st.set_mark(s, m, 0)
        st.set_state(s, int(RequestState.PREEMPTED))

    def finish(self, req_id: Hashable) -> tuple[np.ndarray, ...]:
        """Remove the request (exactly once) and hand its per-group tables to the caller."""
        self._get(req_id)
        return self._store.pop(req_id)

    # -- queries ----------------------------------------------------------------------
    def block_ids(self, req_id: Hashable, *, copy: bool = True) -> tuple[np.ndarray, ...]:
        """The request's table (int32 per group, blocks of each group).

        ``copy=False`` returns read-only views of the tracker's buffers (no copy): snapshots
        of the table at this call that never change afterwards (later appends, nulling,
        preempt/replace and finish are not seen; see the class docstring).
        """
        s = self._get(req_id)
        st = self._store
        if copy:
            return tuple(st.copy_group(s, g) for g in range(self.num_groups))
        return tuple(st.view_group(s, g) for g in range(self.num_groups))

    def num_blocks(self, req_id: Hashable) -> tuple[int, ...]:
        """Tracked blocks per group (blocks of each group, nulls included)."""
        return self._store.lengths(self._get(req_id))

    def state(self, req_id: Hashable) -> RequestState:
        return RequestState(self._store.get_state(self._get(req_id)))

    def set_state(self, req_id: Hashable, state: RequestState) -> None:
        """Mark NEW / WAITING_FOR_REMOTE / RUNNING (use preempt()/finish() for the others)."""
        s = self._get(req_id)
        try:
            st = RequestState(state)
        except ValueError:
            raise TrackerStateError(f"state must be a RequestState, got {state!r}") from None
        if st in (RequestState.PREEMPTED, RequestState.FINISHED):
            raise TrackerStateError(f"state {st.name} is set by preempt()/finish(), not set_state")
        self._store.set_state(s, int(st))

    def num_prompt_tokens(self, req_id: Hashable) -> int:
        return self._store.mark(self._get(req_id), _PROMPT)

    def scheduled_tokens(self, req_id: Hashable) -> int:
        """Tokens scheduled so far (tokens)."""
        return self._store.mark(self._get(req_id), _SCHEDULED)

    def saved_tokens(self, req_id: Hashable) -> int:
        """Tokens whose KV was saved/stored (tokens)."""
        return self._store.mark(self._get(req_id), _SAVED)

    def loaded_tokens(self, req_id: Hashable) -> int:
        """Tokens whose KV was loaded (tokens)."""
        return self._store.mark(self._get(req_id), _LOADED)

    def _set_mark(self, req_id: Hashable, field: str, n: Any) -> None:
        s = self._get(req_id)
        n = self._check_tokens(field, n)
        m = _MARKS[field]
        cur = self._store.mark(s, m)
        if n < cur:
            raise TrackerStateError(f"{field} of {req_id!r} cannot run backwards: {cur} -> {n}")
        self._store.set_mark(s, m, n)

    def set_scheduled_tokens(self, req_id: Hashable, n: int) -> None:
        self._set_mark(req_id, "scheduled_tokens", n)

    def set_saved_tokens(self, req_id: Hashable, n: int) -> None:
        self._set_mark(req_id, "saved_tokens", n)

    def set_loaded_tokens(self, req_id: Hashable, n: int) -> None:
        self._set_mark(req_id, "loaded_tokens", n)

    def __len__(self) -> int:
        return len(self._reqs)

    def __contains__(self, req_id: object) -> bool:
        try:
            return req_id in self._reqs
        except TypeError:
            return False

    def __iter__(self) -> Iterator[Hashable]:
        return iter(list(self._reqs))

    # -- one scheduler step -----------------------------------------------------------
    def apply_step(self, new: Iterable[tuple[Hashable, BlockTableLike]] = (),
                   cached: Iterable[tuple[Hashable, BlockTableLike | None, bool]] = (),
                   finished: Iterable[Hashable] = (), *,
                   preempted: Iterable[Hashable] = ()) -> dict[Hashable, tuple[np.ndarray, ...]]:
        """Apply one scheduler step's updates atomically.

        Order: ``finished`` (removed), ``preempted`` (reset), ``new`` (added with their full
        tables), ``cached`` (``(req_id, new_ids_or_None, resumed)``: resumed -> replace with
        the full table, else append). Everything is validated against the state the earlier
        parts leave behind before anything is mutated; on error the set is unchanged.
        Returns the finished requests' tables.
        """
        if self._owner != _get_ident():
            self._claim()
        finished = list(finished)
        preempted = list(preempted)
        new = list(new)
        cached = list(cached)
        try:
            new_tables, cached_ops = self._check_step(finished, preempted, new, cached)
        except TypeError:
            # an unhashable req_id fails the dict lookups: name it like _get does
            for r in [*finished, *preempted, *(i[0] for i in new if len(i) == 2),
                      *(i[0] for i in cached if len(i) == 3)]:
                self._check_hashable(r)
            raise
        NEW, RUNNING = int(RequestState.NEW), int(RequestState.RUNNING)
        st = self._store
        # Phase 2: mutate (cannot fail on validated input).
        out = {r: self.finish(r) for r in finished}
        for r in preempted:
            self.preempt(r)
        for r, table in new_tables:
            self._insert(r, table, 0)
        reqs = self._reqs
        for r, kind, table in cached_ops:
            s = reqs[r]
            if kind == 1:
                if table is not None:
                    st.extend_groups(s, table)
            elif kind == 2:
                for g, ids in enumerate(table):
                    st.append(s, g, ids)
            else:
                for g, ids in enumerate(table):
                    st.assign(s, g, ids)
                st.set_state(s, RUNNING)
                continue
            if st.get_state(s) == NEW:
                st.set_state(s, RUNNING)
        return out

    def _check_step(self, finished: list, preempted: list, new: list, cached: list
                    ) -> tuple[list[tuple[Hashable, Any]], list[tuple[Hashable, int, Any]]]:
        """Phase 1 of :meth:`apply_step`: validate every part against a simulated
        membership/state view; returns the converted new tables and the cached operations."""
        check, G, nb = _k.check_int_table, self.num_groups, self._num_blocks or 0
        NEW, RUNNING, PREEMPTED = (int(RequestState.NEW), int(RequestState.RUNNING),
                                   int(RequestState.PREEMPTED))
        st = self._store
        live = {r: st.get_state(s) for r, s in self._reqs.items()}
        for r in finished:
            if r not in live:
                raise TrackerStateError(f"finished: req_id {r!r} is not tracked")
            del live[r]
        for r in preempted:
            if r not in live:
                raise TrackerStateError(f"preempted: req_id {r!r} is not tracked")
            live[r] = PREEMPTED
        new_tables = []
        item: Any   # a (req_id, ids) item of new, then a (req_id, ids, resumed) one of cached
        for item in new:
            if len(item) != 2:
                raise TrackerStateError("new: items must be (req_id, block_ids)")
            r, ids = item
            if r in live:
                raise TrackerStateError(f"new: req_id {r!r} is already tracked")
            new_tables.append((r, self._fast_or_table(ids, f"new[{r!r}]", allow_none=False)))
            live[r] = NEW
        # cached_ops: (req_id, kind, payload); kind 0 = replace (int32 arrays), 1 = append
        # lists that passed check_int_table (None = nothing), 2 = append int32 arrays.
        cached_ops: list[tuple[Hashable, int, Any]] = []
        for item in cached:
            if len(item) != 3:
                raise TrackerStateError("cached: items must be (req_id, new_block_ids, resumed)")
            r, ids, resumed = item
            state = live.get(r, -1)
            if state < 0:
                raise TrackerStateError(f"cached: req_id {r!r} is not tracked")
            if resumed:
                if ids is None:
                    raise BlockTableError(f"cached[{r!r}]: a resumed request needs its full table")
                cached_ops.append((r, 0, self._table(ids, f"cached[{r!r}]")))
                live[r] = RUNNING
                continue
            if state == PREEMPTED:
                self._check_appendable(r, state)
            if ids is None or check(ids, G, nb, True):
                cached_ops.append((r, 1, ids))
            else:
                cached_ops.append((r, 2, self._new_ids(ids)))
            if state == NEW:
                live[r] = RUNNING
        return new_tables, cached_ops

    def apply_step_flat(self, req_ids: Sequence[Hashable], new_ids: Any, offsets: Any) -> None:
        """Append one scheduler step's new blocks of many running requests in one call.

        ``new_ids``: 1-D int32 array (C-contiguous) holding every appended id, request by
        request and, within a request, group by group. ``offsets``: 1-D int64 array of
        ``len(req_ids) * num_groups + 1`` entries: request ``req_ids[r]`` gets the ids
        ``new_ids[offsets[r*G + g]:offsets[r*G + g + 1]]`` appended to group g (blocks of
        group g). Same effect as ``append(r, ...)`` per request; NEW requests become RUNNING.

        All-or-nothing: unknown / PREEMPTED requests, ids outside ``[0, num_blocks)``,
        malformed offsets or wrong dtypes raise (TrackerStateError / BlockTableError naming
        the argument and the rule) before anything changes.
        """
        if self._owner != _get_ident():
            self._claim()
        if not isinstance(req_ids, (list, tuple)):
            req_ids = list(req_ids)
        try:
            err = self._store.step_flat(req_ids, new_ids, offsets, self._nb, _PREEMPTED, _NEW,
                                        _RUNNING)
        except TypeError:
            self._slots_of(req_ids)   # raises the TrackerStateError naming the request
            raise
        if err is not None:
            code, detail = err
            if code == _k.STEP_UNKNOWN:
                self._get(req_ids[detail])
            cls = TrackerStateError if code == _k.STEP_STATE else BlockTableError
            raise cls(f"apply_step_flat: {detail}")

    def apply_step_lists(self, req_ids: Sequence[Hashable], new_block_ids: Sequence[Any]) -> None:
        """:meth:`apply_step_flat` straight from vLLM's ``CachedRequestData``: ``req_ids``
        and ``new_block_ids`` (per request None or one list of ids per group, blocks of each
        group) as the scheduler output carries them; flattened in one C pass. Same checks and
        all-or-nothing behaviour (errors name the entry, e.g. ``new_block_ids[3][1][0]``)."""
        ids, offsets, err = _k.flatten_step(new_block_ids, self.num_groups)
        if err is not None:
            raise BlockTableError(f"apply_step_lists: {err}")
        if len(req_ids) != len(new_block_ids):
            raise BlockTableError(f"apply_step_lists: {len(req_ids)} req_ids but "
                                  f"{len(new_block_ids)} new_block_ids entries")
        self.apply_step_flat(req_ids, ids, offsets)

    def step_pairs(self, req_ids: Sequence[Hashable], new_block_ids: Sequence[Any],
                   theirs: Sequence[Any], spans: Sequence[tuple[int, int] | None],
                   block_sizes: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One scheduler step of push-followed requests in one C call: append vLLM's new ids,
        mark every request RUNNING, and pair each one's positions of the step with the
        consumer's table (every WRITE pair of a push producer's step).

        ``req_ids``: distinct tracked ids. Per request r: ``new_block_ids[r]`` None or one
        list of ids per group (vLLM's ``CachedRequestData.new_block_ids`` entry), appended as
        :meth:`apply_step_lists` does; ``spans[r]`` None (follow only) or ``(start, end)``
        tokens, then ``theirs[r]`` is the consumer's positional table (any form
        :func:`as_block_table` accepts; tuples of contiguous int32 arrays pass as they are).
        The pairs of request r are :func:`pair_block_spans` of its appended table and
        ``theirs[r]`` over ``spans[r]`` (same rule, same order).

        Sparse appends: with a span, request r's new ids are read (and checked) only at the
        positions where ``theirs[r]`` holds a block, the only positions ever paired; the
        others are stored as 0. So ``theirs[r]`` must be the same table at every step of a
        request (a push registration is): a position skipped at one step is never re-read.
        Without a span every new id is read and checked.

        Returns ``(local, remote, offsets)``: every pair of the step in two int32 arrays
        (request by request, group by group) and int64 ``offsets`` of ``len(req_ids) * G + 1``
        entries: request r's group g pairs are ``local[offsets[r*G + g]:offsets[r*G + g + 1]]``
        (``remote`` likewise). All-or-nothing: an untracked, repeated or PREEMPTED-with-ids
        request (TrackerStateError), bad ids, spans, sizes or a consumer table with a negative
        id (BlockTableError naming the argument and the rule) change nothing.
        """
        if self._owner != _get_ident():
            self._claim()
        req_ids = _seq_arg(req_ids, "req_ids", TrackerStateError)
        sizes = _seq_arg(block_sizes, "block_sizes", BlockTableError, tuple)
        converted = False
        while True:
            try:
                local, remote, offsets, err = self._store.step_pairs(
                    req_ids, new_block_ids, theirs, spans, sizes, self._nb, _PREEMPTED, _RUNNING)
            except TypeError:
                self._slots_of(req_ids)   # raises the TrackerStateError naming the request
                raise
            if err is None:
                return local, remote, offsets
            code, detail = err
            if code == _k.STEP_THEIRS and not converted:
                # a consumer table in another form: converted (and checked) once, then again
                theirs = [t if s is None else as_block_table(t, self.num_groups,
                                                             name=f"theirs[{r}]")
                          for r, (t, s) in enumerate(zip(theirs, spans))]
                converted = True
                continue
            if code == _k.STEP_UNKNOWN:
                self._get(req_ids[detail])
            cls = TrackerStateError if code == _k.STEP_STATE else BlockTableError
            raise cls(f"step_pairs: {detail}")

    def reserve(self, req_id: Hashable, blocks: Sequence[int]) -> None:
        """Capacity hint: room for ``blocks[g]`` entries in each group of ``req_id``'s table
        (e.g. its prompt's positions), so the steps that fill it allocate nothing. The table
        itself is unchanged."""
        s = self._get(req_id)
        if len(blocks) != self.num_groups:
            raise BlockTableError(f"blocks must have {self.num_groups} entries, got {len(blocks)}")
        for g, n in enumerate(blocks):
            if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 0 <= n < 2**31:
                raise BlockTableError(f"blocks[{g}] must be an int in [0, 2**31), got {n!r}")
        for g, n in enumerate(blocks):
            self._store.reserve(s, g, int(n))

    def _slots_of(self, req_ids: Sequence[Hashable]) -> list[int]:
        return [self._get(r) for r in req_ids]

    def _clip_spans(self, req_ids: Sequence[Hashable], plan: np.ndarray) -> np.ndarray:
        """``[start, end)`` of each request's clipped groups (see windows.clip_tracked_spans)."""
        if self._owner != _get_ident():
            self._claim()
        if not isinstance(req_ids, (list, tuple)):
            req_ids = list(req_ids)
        try:
            out, bad = self._store.clip_spans(req_ids, plan)
        except TypeError:
            self._slots_of(req_ids)
            raise
        if bad >= 0:
            self._get(req_ids[bad])
        return out

    def _clip_views(self, req_ids: Sequence[Hashable], plan: np.ndarray) -> list:
        slots = self._slots_of(req_ids)   # all lookups first: unknown id -> no output
        clip = self._store.clip_views
        return [clip(s, plan) for s in slots]



def _seq_arg(x: Any, name: str, err: type[Exception], kind: type = list) -> Any:
    """``x`` as a list/tuple (an iterable is read once), or ``err`` naming ``name``."""
    if isinstance(x, (list, tuple)):
        return x if kind is list or type(x) is tuple else tuple(x)
    try:
        return kind(x)
    except TypeError:
        raise err(f"{name} must be a sequence, got {type(x).__name__}") from None


def _tracker_from_store(layout: KVLayout, store: Any) -> TrackerSet:
    """A TrackerSet around an existing TableStore (unpickling and copies)."""
    ts = TrackerSet.__new__(TrackerSet)
    ts._adopt(layout, store)
    return ts
