"""Store key strings for (group, block hash), Mooncake-store compatible (vllm-hma.md §5.3).

A key is ``"[{cache_prefix}@]{model}{store_namespace}@tp_rank:{t}@pcp{p}@dcp{d}@pp_rank:{pp}
@group:{g}@{hash hex}"``. The hash is the digest of the block's key (its last hash row, or the
concatenation of its rows with ``coarse="concat"``, see ``HitFinder.key_digests``). Keys are
built in bulk from an (N, width) uint8 array: one ``hex()`` over the whole array, then slices.

A group may be loaded from several rank namespaces (e.g. TP ranks that hold replicated MLA
shards): a key counts as present only if EVERY namespace that will load it has it
(``fold_presence``).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from .errors import HashInputError

__all__ = ["RankNamespace", "KeyBuilder"]

# The largest group id: ExistenceSet stores a key's group as an int32 tag (hits.py, _hits.pyx).
MAX_GROUP_ID = 2**31 - 1


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
        model: model name (no ``@``).
        rank: the namespace this rank writes and (by default) reads.
        cache_prefix: optional deployment prefix (``"{cache_prefix}@"`` leads every key).
        store_namespace: optional payload-format namespace appended to the model name.
        lookup_namespaces: per group id, the namespaces a lookup requires (default: ``rank``).
    """

    def __init__(self, model: str, rank: RankNamespace = RankNamespace(), *,
                 cache_prefix: str = "", store_namespace: str = "",
                 lookup_namespaces: Mapping[int, Sequence[RankNamespace]] | None = None) -> None:
        if not isinstance(model, str) or not model or "@" in model:
            raise HashInputError(f"model must be a non-empty str without '@', got {model!r}")
        if not isinstance(rank, RankNamespace):
            raise HashInputError("rank must be a RankNamespace")
        for name, v in (("cache_prefix", cache_prefix), ("store_namespace", store_namespace)):
            if not isinstance(v, str):
                raise HashInputError(f"{name} must be a str")
        self.model, self.rank = model, rank
        self.cache_prefix, self.store_namespace = cache_prefix, store_namespace
        self._lookup = {}
        for g, spaces in (lookup_namespaces or {}).items():
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
        res = np.asarray(results, dtype=np.int64).reshape(-1)
        if res.size != num_rows * r:
            raise HashInputError(f"results has {res.size} answers, expected {num_rows} rows x "
                                 f"{r} namespaces")
        if num_rows == 0:
            return np.zeros(0, dtype=np.uint8)
        return (res.reshape(num_rows, r) == 1).all(axis=1).astype(np.uint8)
