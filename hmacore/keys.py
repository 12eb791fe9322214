"""Store key strings for (group, block hash), Mooncake-store compatible (vllm-hma.md §5.3).

A key is ``"[{cache_prefix}@]{model}{store_namespace}@tp_rank:{t}@pcp{p}@dcp{d}@pp_rank:{pp}
@group:{g}@{hash hex}"``. The hash is the digest of the block's key (its last hash row, or the
concatenation of its rows with ``coarse="concat"``, see ``HitFinder.key_digests``). Keys are
built in bulk from an (N, width) uint8 array: one ``hex()`` over the whole array, then slices.

A group may be loaded from several rank namespaces (e.g. TP ranks that hold replicated MLA
shards): a key counts as present only if EVERY namespace that will load it has it
(``fold_presence``).

Keys are injective: two different (cache_prefix, model, store_namespace, ranks, group, digest)
tuples never build the same key, because the separators ``@`` and ``:`` cannot hide inside a
field. ``model`` and ``cache_prefix`` must not contain either; ``store_namespace`` is ``""`` or
``@name:value`` segments (e.g. ``"@store_tp:2"``) whose names and values contain neither; the
ranks and the group are ints. :func:`parse_key` inverts :meth:`KeyBuilder.keys`: after the
six fixed trailing segments, the leading ``@``-segments without ``:`` are the prefix (if two)
and the model, the ones with ``:`` the namespace.
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence

import numpy as np

from .errors import HashInputError

__all__ = ["RankNamespace", "KeyBuilder", "KeyParts", "parse_key", "SEPARATORS"]

# The largest group id: ExistenceSet stores a key's group as an int32 tag (hits.py, _hits.pyx).
MAX_GROUP_ID = 2**31 - 1
#: The characters that separate a key's fields; no free-text field may contain them.
SEPARATORS = ("@", ":")
_NAMESPACE = re.compile(r"(?:@[^@:]+:[^@:]+)+")


def _check_text(name: str, value, *, allow_empty: bool) -> str:
    if not isinstance(value, str):
        raise HashInputError(f"{name} must be a str, got {type(value).__name__} {value!r}")
    if not value and not allow_empty:
        raise HashInputError(f"{name} must be a non-empty str without the key separators "
                             f"'@' and ':', got ''")
    if any(c in value for c in SEPARATORS):
        kind = "a str" if allow_empty else "a non-empty str"
        raise HashInputError(f"{name} must be {kind} without the key separators '@' and ':' "
                             f"(they would let two different fields build the same key), got "
                             f"{value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class RankNamespace:
    """The ranks a key is written under (ints >= 0)."""

    tp_rank: int = 0
    pcp_rank: int = 0
    dcp_rank: int = 0
    pp_rank: int = 0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise HashInputError(f"{f.name} must be an int >= 0, got {v!r}")


def _check_digests(digests) -> np.ndarray:
    if not isinstance(digests, np.ndarray) or digests.dtype != np.uint8 or digests.ndim != 2:
        raise HashInputError("digests must be a uint8 array of shape (N, width)")
    if digests.shape[1] == 0 or digests.shape[1] % 16:
        raise HashInputError(f"digests width must be a positive multiple of 16 bytes, "
                             f"got {digests.shape[1]}")
    return np.ascontiguousarray(digests)


class KeyBuilder:
    """Builds the store keys of one model instance (one rank) for every group.

    Args:
        model: model name (non-empty, no ``@`` or ``:``).
        rank: the namespace this rank writes and (by default) reads.
        cache_prefix: optional deployment prefix (``"{cache_prefix}@"`` leads every key; no
            ``@`` or ``:``).
        store_namespace: optional payload-format namespace appended to the model name: ``""``
            or ``@name:value`` segments such as ``"@store_tp:2"`` (no ``@``/``:`` inside).

    Raises HashInputError for a field that could make two different field tuples build the
    same key (a separator inside a field) and for malformed digests, group ids and answers.
        lookup_namespaces: per group id, the namespaces a lookup requires (default: ``rank``).
    """

    def __init__(self, model: str, rank: RankNamespace = RankNamespace(), *,
                 cache_prefix: str = "", store_namespace: str = "",
                 lookup_namespaces: Mapping[int, Sequence[RankNamespace]] | None = None) -> None:
        _check_text("model", model, allow_empty=False)
        if not isinstance(rank, RankNamespace):
            raise HashInputError(f"rank must be a RankNamespace, got {type(rank).__name__}")
        _check_text("cache_prefix", cache_prefix, allow_empty=True)
        if not isinstance(store_namespace, str):
            raise HashInputError(f"store_namespace must be a str, got "
                                 f"{type(store_namespace).__name__} {store_namespace!r}")
        if store_namespace and not _NAMESPACE.fullmatch(store_namespace):
            raise HashInputError(f"store_namespace must be '' or '@name:value' segments (e.g. "
                                 f"'@store_tp:2') with no '@' or ':' inside a name or value, got "
                                 f"{store_namespace!r}")
        if lookup_namespaces is not None and not isinstance(lookup_namespaces, Mapping):
            raise HashInputError(f"lookup_namespaces must be a mapping group id -> namespaces, "
                                 f"got {type(lookup_namespaces).__name__}")
        self.model, self.rank = model, rank
        self.cache_prefix, self.store_namespace = cache_prefix, store_namespace
        self._lookup = {}
        for g, spaces in (lookup_namespaces or {}).items():
            if isinstance(spaces, (str, bytes, RankNamespace)):
                raise HashInputError(f"lookup_namespaces[{g}] must be a non-empty list of "
                                     f"RankNamespace, got {type(spaces).__name__}")
            spaces = tuple(spaces)
            if not spaces or not all(isinstance(s, RankNamespace) for s in spaces):
                raise HashInputError(f"lookup_namespaces[{g}] must be a non-empty list of RankNamespace")
            self._lookup[self._group(g)] = spaces
        self._prefixes: dict[tuple[int, RankNamespace], str] = {}

    @staticmethod
    def _group(group) -> int:
        if isinstance(group, bool) or not isinstance(group, (int, np.integer)) \
                or not 0 <= group <= MAX_GROUP_ID:
            raise HashInputError(f"group must be an int group id in [0, 2**31-1] (the ids "
                                 f"ExistenceSet accepts), got {group!r}")
        return int(group)

    def prefix(self, group: int, rank: RankNamespace | None = None) -> str:
        """Key prefix of ``group`` under ``rank`` (default: this builder's rank)."""
        g = self._group(group)
        r = self.rank if rank is None else rank
        p = self._prefixes.get((g, r))
        if p is None:
            lead = f"{self.cache_prefix}@" if self.cache_prefix else ""
            p = (f"{lead}{self.model}{self.store_namespace}@tp_rank:{r.tp_rank}@pcp{r.pcp_rank}"
                 f"@dcp{r.dcp_rank}@pp_rank:{r.pp_rank}@group:{g}")
            self._prefixes[(g, r)] = p
        return p

    def namespaces(self, group: int) -> tuple[RankNamespace, ...]:
        """The namespaces a lookup of ``group`` requires."""
        return self._lookup.get(self._group(group), (self.rank,))

    def keys(self, group: int, digests: np.ndarray) -> list[str]:
        """This rank's keys of ``group`` for each digest row (what a saver writes)."""
        d = _check_digests(digests)
        return self._render(self.prefix(group), d)

    @staticmethod
    def _render(prefix: str, d: np.ndarray) -> list[str]:
        n, w = d.shape
        if n == 0:
            return []
        hx = d.tobytes().hex()
        step = 2 * w
        head = prefix + "@"
        return [head + hx[i:i + step] for i in range(0, n * step, step)]

    def lookup_keys(self, group: int, digests: np.ndarray) -> list[str]:
        """Keys a lookup probes: for each digest row, one key per required namespace
        (row-major: row 0's namespaces first)."""
        d = _check_digests(digests)
        spaces = self.namespaces(group)
        per_ns = [self._render(self.prefix(group, r), d) for r in spaces]
        if len(per_ns) == 1:
            return per_ns[0]
        return [k for row in zip(*per_ns) for k in row]

    def fold_presence(self, group: int, results, num_rows: int) -> np.ndarray:
        """uint8 mask (num_rows,): 1 where every namespace of the row answered 1 (present).

        ``results`` are the store's answers to ``lookup_keys`` (1 present, 0 absent, < 0
        error); anything but 1 is a miss."""
        r = len(self.namespaces(group))
        if isinstance(num_rows, bool) or not isinstance(num_rows, (int, np.integer)) or num_rows < 0:
            raise HashInputError(f"num_rows must be an int >= 0, got {num_rows!r}")
        try:
            raw = np.asarray(results)
        except (ValueError, TypeError):   # ragged nested lists
            raise HashInputError(f"results must be a flat sequence of ints (1 present, 0 "
                                 f"absent, < 0 error), got {type(results).__name__}") from None
        if raw.size and raw.dtype.kind not in "iub":
            raise HashInputError(f"results must be ints (1 present, 0 absent, < 0 error), got "
                                 f"dtype {raw.dtype} (a float would be truncated)")
        res = raw.astype(np.int64).reshape(-1)
        if res.size != num_rows * r:
            raise HashInputError(f"results has {res.size} answers, expected {num_rows} rows x "
                                 f"{r} namespaces")
        if num_rows == 0:
            return np.zeros(0, dtype=np.uint8)
        return (res.reshape(num_rows, r) == 1).all(axis=1).astype(np.uint8)


@dataclasses.dataclass(frozen=True)
class KeyParts:
    """The fields one key was built from (see :func:`parse_key`)."""

    cache_prefix: str
    model: str
    store_namespace: str
    rank: RankNamespace
    group: int
    digest: bytes


_INT = r"(0|[1-9][0-9]*)"
_TAIL = [re.compile(p) for p in (rf"tp_rank:{_INT}", rf"pcp{_INT}", rf"dcp{_INT}",
                                 rf"pp_rank:{_INT}", rf"group:{_INT}", r"((?:[0-9a-f]{32})+)")]


def parse_key(key: str) -> KeyParts:
    """The fields of a key :meth:`KeyBuilder.keys` built (its exact inverse).

    Raises HashInputError when ``key`` is not such a key."""
    if not isinstance(key, str):
        raise HashInputError(f"key must be a str, got {type(key).__name__}")
    parts = key.split("@")
    head, tail = parts[:-6], parts[-6:]
    if not head or len(tail) != 6:
        raise HashInputError(f"key {key!r} has fewer than 7 '@'-separated fields")
    vals = []
    for piece, pat in zip(tail, _TAIL):
        m = pat.fullmatch(piece)
        if m is None:
            raise HashInputError(f"key {key!r}: field {piece!r} does not match {pat.pattern}")
        vals.append(m.group(1))
    if len(head) >= 2 and ":" not in head[1]:
        prefix, model, ns = head[0], head[1], head[2:]
    else:
        prefix, model, ns = "", head[0], head[1:]
    namespace = "".join("@" + n for n in ns)
    kb = KeyBuilder(model, cache_prefix=prefix, store_namespace=namespace)  # checks the fields
    tp, pcp, dcp, pp, group, hx = vals
    rank = RankNamespace(int(tp), int(pcp), int(dcp), int(pp))
    g = KeyBuilder._group(int(group))
    if kb.prefix(g, rank) + "@" + hx != key:  # e.g. an empty leading field
        raise HashInputError(f"key {key!r} is not one KeyBuilder builds")
    return KeyParts(prefix, model, namespace, rank, g, bytes.fromhex(hx))
