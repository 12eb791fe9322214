"""External cache hits: the (group, block hash) existence set and vLLM's longest-hit rule.

Units: tokens for lengths and hits; *hash rows* are blocks of ``hash_block_size`` tokens
(row j names tokens ``[0, (j+1)*h)`` because hashes are chained); *blocks of group g* are
``block_size_g`` tokens. Block i of group g is named by hash row ``(i+1)*bs_g/h - 1`` (the
last row inside it, vLLM >= 0.32 "last" convention). With ``coarse="concat"`` (older vLLM) the
*key string* of block i is the concatenation of its ``bs_g/h`` rows; the existence set still
stores the last row, which names the same prefix because every row commits to its parent.

The rule (vLLM ``HybridKVCacheCoordinator.find_longest_cache_hit`` + the single-type managers):
full attention scans the prefix until the first miss; sliding window scans right to left for
``cdiv(window-1, bs)`` contiguous hits ending on an aligned boundary (or a shorter run anchored
at block 0); chunked-local looks up only the current chunk; Mamba takes the last aligned hit.
Groups with equal specs are merged (a hit needs every member). Full attention goes first and
the candidate length shrinks until no group lowers it (one pass for FA + one other spec).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import cast

import numpy as np

from ._fast import _hits
from ._fast._hits import ExistenceSet
from .errors import HashInputError, LayoutError
from .grain import cdiv
from .spec import GroupKind, KVLayout

__all__ = ["ExistenceSet", "HitFinder", "HitResult", "ExternalBlockPool", "as_hash_array",
           "SpecGroup", "LookupPlan"]

_FINE_KINDS = (GroupKind.FULL, GroupKind.MAMBA)   # managers that support sub-block lookups


def as_hash_array(hashes: Sequence[bytes] | np.ndarray, digest_size: int | None = None) -> np.ndarray:
    """Pack block hashes into an (N, digest_size) C-contiguous uint8 array.

    Accepts a sequence of equal-length ``bytes`` (16 or 32 each) or an array (returned as is
    when already valid). ``digest_size`` (bytes) is inferred from the first hash if omitted.
    """
    if isinstance(hashes, np.ndarray):
        ds = digest_size if digest_size is not None else (hashes.shape[1] if hashes.ndim == 2 else 32)
        return _hits._check_digests(hashes, ds, "hashes")
    hashes = list(hashes)
    if digest_size is None:
        digest_size = len(hashes[0]) if hashes else 32
    if digest_size not in (16, 32):
        raise HashInputError(f"digest_size must be 16 or 32 bytes, got {digest_size}")
    for i, h in enumerate(hashes):
        if not isinstance(h, (bytes, bytearray, memoryview)) or len(h) != digest_size:
            raise HashInputError(f"hashes[{i}] must be {digest_size} bytes")
    if not hashes:
        return np.zeros((0, digest_size), dtype=np.uint8)
    return np.frombuffer(b"".join(bytes(h) for h in hashes), dtype=np.uint8).reshape(-1, digest_size).copy()


@dataclasses.dataclass(frozen=True)
class SpecGroup:
    """Groups looked up together (equal specs): vLLM's ``SpecGroup``."""

    kind: GroupKind
    block_size: int          # tokens per block (context-parallel scaled)
    group_ids: tuple[int, ...]
    eagle: bool
    window: int = 0          # sliding window (tokens) the rule covers (coverage_window)
    chunk: int = 0           # attention chunk, tokens


class HitResult:
    """A longest hit.

    Attributes:
        tokens: the hit length in tokens (a multiple of ``HitFinder.alignment``).
        masks: one uint8 array per layout group: ``masks[g][i] == 1`` iff block i of group g
            (blocks of ``block_size_g`` tokens) must be loaded for the hit; its length is the
            group's hit block count including leading null positions (SW/Mamba/chunked
            groups load only a tail). Groups not looked up get an empty array. Built on
            first access when the result comes from :meth:`HitFinder.longest_hit` (a caller
            that only needs ``tokens`` never pays for them).

    ``HitResult(tokens, masks)`` builds one directly; results are immutable (shareable
    between threads; building the masks twice in a race is harmless). Pickling and
    ``copy`` give an equal result with its masks built.
    """

    __slots__ = ("tokens", "_masks", "_spans", "_finder")
    tokens: int
    _masks: tuple[np.ndarray, ...] | None       # None until built (lazy results)
    _spans: np.ndarray | None                   # lazy results only
    _finder: HitFinder | None                   # lazy results only

    def __init__(self, tokens: int, masks: tuple[np.ndarray, ...]) -> None:
        object.__setattr__(self, "tokens", int(tokens))
        object.__setattr__(self, "_masks", tuple(masks))
        object.__setattr__(self, "_spans", None)
        object.__setattr__(self, "_finder", None)

    @classmethod
    def _lazy(cls, tokens: int, spans: np.ndarray, finder: HitFinder) -> HitResult:
        self = object.__new__(cls)
        object.__setattr__(self, "tokens", tokens)
        object.__setattr__(self, "_masks", None)
        object.__setattr__(self, "_spans", spans)
        object.__setattr__(self, "_finder", finder)
        return self

    @property
    def masks(self) -> tuple[np.ndarray, ...]:
        m = self._masks
        if m is None:
            # a lazy result: _finder and _spans are set
            m = cast("HitFinder", self._finder)._masks_from_spans(cast(np.ndarray, self._spans))
            object.__setattr__(self, "_masks", m)
        return m

    def __setattr__(self, name, value):
        raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")

    def __eq__(self, other):
        if not isinstance(other, HitResult):
            return NotImplemented
        return self.tokens == other.tokens and len(self.masks) == len(other.masks) and all(
            np.array_equal(a, b) for a, b in zip(self.masks, other.masks))

    __hash__ = None  # type: ignore[assignment]  # unhashable: equality compares arrays

    def __reduce__(self):
        return HitResult, (self.tokens, self.masks)

    def __repr__(self) -> str:
        return f"HitResult(tokens={self.tokens}, masks={self.masks!r})"


@dataclasses.dataclass(frozen=True)
class LookupPlan:
    """The keys one external lookup asks for, in one batch.

    Attributes:
        keys: every key string, group by group (row-major over namespaces).
        spans: per probed group ``(group, rows, start, count)``: its hash rows (int64) and
            the slice ``keys[start:start+count]`` holding their keys.
    """

    keys: list
    spans: tuple

    def fold(self, results, hashes: np.ndarray, key_builder) -> ExistenceSet:
        """An ExistenceSet of the (group, row) keys every namespace answered 1 for
        (``results`` in ``keys`` order; anything else, errors included, is a miss)."""
        es = ExistenceSet(hashes.shape[1])
        if len(results) != len(self.keys):
            return es
        for g, rows, start, count in self.spans:
            present = key_builder.fold_presence(g, results[start:start + count], rows.size)
            if present.any():
                es.add_many(g, np.ascontiguousarray(hashes[rows[present.astype(bool)]]))
        return es


def _merge_key(spec, window: int = 0, retained_coverage: bool = False) -> tuple:
    """The groups the hit rule looks up together: vLLM merges groups whose KVCacheSpec objects
    are equal (dataclass equality), hmacore those whose keys are.

    With ``retained_coverage`` a sliding-window group is keyed by its coverage ``window``
    (``sliding_window + extra_retained_tokens``) and no extra tokens, like the spec vLLM's
    store coordinator compares (``_coverage_spec``): a window of 8 with 4 retained tokens
    merges with a window of 12 with none.

    The key is the kind, block size, window / chunk, extra retained tokens, Mamba mode and
    speculative slots, the MLA flag, the head shape (``num_kv_heads``, ``head_size``,
    ``head_size_v``, ``dtype``, ``attn_type``: None when unknown) and ``page_bytes``.

    Rule: never split what vLLM merges. Every key field is a function of the vLLM spec
    (``layout_from_kv_cache_config`` reads each from it; page bytes are the spec's
    ``page_size_bytes``), so equal specs always give equal keys. That is also why page bytes
    stay in the key when the head fields are known: they cannot split equal specs, and they
    tell apart specs that differ in fields GroupSpec does not carry whenever those change the
    page size (page padding, KV quantization scales, Mamba state shapes). The converse (two
    specs equal in every key field but different elsewhere, which hmacore alone would merge)
    is refused by ``layout_from_kv_cache_config(for_store=True)``. ``eagle`` is a property of
    the group (vLLM's ``is_eagle_group``), not of the spec: merged groups share the eagle
    drop."""
    sliding, extra = spec.sliding_window, spec.extra_retained_tokens
    if retained_coverage and spec.kind == GroupKind.SLIDING_WINDOW:
        sliding, extra = window, 0
    return (spec.kind, spec.block_size, sliding, spec.chunk_size, extra, spec.mamba_mode,
            spec.mla, spec.num_speculative_blocks,
            spec.num_kv_heads, spec.head_size, spec.head_size_v, spec.dtype, spec.attn_type,
            spec.page_bytes)


class HitFinder:
    """vLLM's cross-group longest prefix hit over an external existence set.

    Args:
        layout: the model's groups. Looked-up groups are ``layout.prefix_cacheable_group_ids``.
        coarse: ``"last"`` (vLLM >= 0.32: block i of a group is named by its last hash row) or
            ``"concat"`` (older vLLM: key strings concatenate the block's rows). Only key
            strings differ; ``concat`` cannot be combined with fine-grained Mamba hits.
        eagle: vLLM's ``use_eagle`` as its coordinator receives it (the scheduler passes
            ``speculative_config.use_eagle_block_drop()``): the groups with
            ``GroupSpec.eagle`` drop their last matched block, or every group when none is
            flagged (vLLM's conservative fallback). Flagged groups drop it even when False,
            unless ``eagle_gated``.
        eagle_gated: True: no group drops a block unless ``eagle`` is True (the core
            coordinator's ``drop_eagle_group_ids = eagle_group_ids if use_eagle else set()``
            rule); False: flagged groups always drop (the older core rule, and the one vLLM's
            Mooncake store coordinator keeps). Which one a vLLM version uses is decided in
            ``hmacore.integrations.vllm._compat``.
        retained_coverage: True: a sliding-window group covers ``sliding_window +
            extra_retained_tokens`` tokens (the MTP re-prefill tail an external hit restores
            below the window) in the hit, the store / lookup masks and the merge of equal
            groups, as vLLM's Mooncake store coordinator does (``_coverage_spec``); False: the
            window alone, as the core coordinator does.
        single_spec_direct: True: when the looked-up groups form one spec group (all equal
            specs), the hit is that group's one lookup, with no fixed point and so no eagle
            look-ahead margin (vLLM's Mooncake store coordinator); False: only a one-group
            layout is looked up directly, several equal groups still run the fixed point
            (the core coordinator).
        alignment: the hit grain in tokens, vLLM's ``KVCacheConfig.cache_hit_alignment_tokens``.
            None: what vLLM's coordinator derives with prefix caching on (the hash block size
            when fine-grained Mamba hits apply, else the scheduler block size; one group: its
            block size). An int must be a grain vLLM can resolve for this layout: the
            scheduler block size (always; turns fine-grained hits off, as vLLM does when
            prefix caching is off) or that derived default.

    Attributes: ``hash_block_size`` (tokens per hash row), ``scheduler_block_size`` (lcm,
    tokens), ``partial`` (fine-grained hits), ``alignment`` (tokens every hit is a multiple
    of: hash_block_size if partial else scheduler_block_size), ``spec_groups``.

    Threads: immutable after construction (attributes cannot be rebound; the compiled
    kernel keeps private read-only tables and no scratch buffer), so one finder may serve
    any number of threads at once, also with a shared :class:`ExistenceSet` (thread-safe).
    Picklable (rebuilt from ``layout``, ``coarse``, ``eagle``, ``alignment`` and the three
    rule flags); ``copy`` gives an equal, independent finder.
    """

    def __setattr__(self, name, value):
        if self.__dict__.get("_frozen"):
            raise AttributeError(f"HitFinder is immutable (cannot set {name!r}); build a new one")
        object.__setattr__(self, name, value)

    def __reduce__(self):
        return _finder, (self.layout, self.coarse, self._eagle, self.alignment,
                         self.eagle_gated, self.retained_coverage, self.single_spec_direct)

    def __repr__(self) -> str:
        return (f"HitFinder(groups={self.group_ids}, spec_groups={len(self.spec_groups)}, "
                f"alignment={self.alignment}, hash_block_size={self.hash_block_size}, "
                f"partial={self.partial}, coarse={self.coarse!r}, "
                f"eagle_gated={self.eagle_gated}, retained_coverage={self.retained_coverage}, "
                f"single_spec_direct={self.single_spec_direct})")

    def __init__(self, layout: KVLayout, *, coarse: str = "last", eagle: bool = False,
                 alignment: int | None = None, eagle_gated: bool = False,
                 retained_coverage: bool = False, single_spec_direct: bool = False) -> None:
        if not isinstance(layout, KVLayout):
            raise LayoutError(f"layout must be a KVLayout, got {type(layout).__name__}")
        if coarse not in ("last", "concat"):
            raise LayoutError(f"coarse must be 'last' or 'concat', got {coarse!r}")
        for name, value in (("eagle_gated", eagle_gated),
                            ("retained_coverage", retained_coverage),
                            ("single_spec_direct", single_spec_direct)):
            if not isinstance(value, (bool, np.bool_)):
                raise LayoutError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
        layout.check_hash_addressable()
        self.layout = layout
        self.coarse = coarse
        self._eagle = bool(eagle)
        self.eagle_gated = bool(eagle_gated)
        self.retained_coverage = bool(retained_coverage)
        self.single_spec_direct = bool(single_spec_direct)
        #: per group, the tokens a sliding-window group's hit and masks must cover (0: not SW)
        self.windows = tuple(coverage_window(s, self.retained_coverage) for s in layout.groups)
        cp = layout.context_parallel
        self.num_groups = layout.num_groups
        self.group_ids = tuple(layout.prefix_cacheable_group_ids)
        if not self.group_ids:
            raise LayoutError("layout has no prefix-cacheable transferred group to look up")
        self.block_sizes = tuple(s.block_size * cp for s in layout.groups)
        self.hash_block_size = layout.hash_block_size * cp
        self.scheduler_block_size = layout.scheduler_block_size * cp
        self.unitary = layout.num_groups == 1
        h = self.hash_block_size
        cacheable_all = [g for g, s in enumerate(layout.groups) if s.prefix_cacheable]
        partial = (not self.unitary and any(
            layout.groups[g].kind == GroupKind.MAMBA and self.block_sizes[g] > h
            for g in cacheable_all))
        if partial and any(layout.groups[g].kind not in _FINE_KINDS and self.block_sizes[g] != h
                           for g in cacheable_all):
            partial = False   # SW / chunked-local need block-aligned lookups
        if self.unitary:
            derived = self.block_sizes[0]
        else:
            derived = h if partial else self.scheduler_block_size
        if alignment is not None:
            _check_alignment(alignment, derived, self.scheduler_block_size)
            if alignment != derived:
                partial = False     # the scheduler block size: vLLM's block-aligned lookups
        self.partial = partial
        self.alignment = derived if alignment is None else int(alignment)
        if partial and coarse == "concat":
            raise LayoutError("coarse='concat' (vLLM < 0.32 keys) cannot be combined with "
                              "fine-grained Mamba hits, which probe single hash rows")
        flagged = {g for g in self.group_ids if layout.groups[g].eagle}
        if eagle and not flagged:
            flagged = set(self.group_ids)
        if self.eagle_gated and not eagle:
            flagged = set()         # groups stay flagged in the layout; none drops
        self.eagle_group_ids = frozenset(flagged)

        buckets: dict[tuple, list[int]] = {}
        for g in self.group_ids:
            key = _merge_key(layout.groups[g], self.windows[g], self.retained_coverage)
            buckets.setdefault(key, []).append(g)
        groups = []
        for gids in buckets.values():
            s = layout.groups[gids[0]]
            groups.append(SpecGroup(kind=s.kind, block_size=self.block_sizes[gids[0]],
                                    group_ids=tuple(gids),
                                    eagle=any(g in flagged for g in gids),
                                    window=self.windows[gids[0]], chunk=s.chunk_size or 0))
        groups.sort(key=lambda sg: sg.kind != GroupKind.FULL)   # stable: FA first
        for sg in groups:
            if sg.kind == GroupKind.CHUNKED_LOCAL:
                if sg.eagle:
                    raise LayoutError(f"groups {sg.group_ids}: eagle with chunked-local "
                                      "attention has no hit rule (vLLM rejects it)")
                if sg.block_size != self.alignment:
                    raise LayoutError(f"groups {sg.group_ids}: chunked-local block size "
                                      f"{sg.block_size} must equal the hit alignment "
                                      f"{self.alignment} tokens")
        self.spec_groups = tuple(groups)
        # members of a merged spec group share its eagle drop (vLLM decides it per SpecGroup)
        self.eagle_group_ids = frozenset(g for sg in groups if sg.eagle for g in sg.group_ids)
        rows: list[list[int]] = []
        members: list[int] = []
        for sg in groups:
            start = len(members)
            members.extend(sg.group_ids)
            row = {"kind": int(sg.kind), "block_size": sg.block_size, "window": sg.window,
                   "chunk": sg.chunk, "eagle": int(sg.eagle), "member_start": start,
                   "member_end": len(members), "fine_lookup": int(sg.kind in _FINE_KINDS)}
            rows.append([row[c] for c in _hits.SPEC_COLUMNS])
        ncols = len(_hits.SPEC_COLUMNS)
        self._specs = np.ascontiguousarray(np.array(rows, dtype=np.int64).reshape(-1, ncols))
        self._specs_no_eagle = self._specs.copy()
        # SPEC_EAGLE_COLUMN / GROUP_ID_DTYPE: missing from _fast/_hits.pyi (owned with the kernels)
        self._specs_no_eagle[:, _hits.SPEC_EAGLE_COLUMN] = 0  # type: ignore[attr-defined]
        member_dtype = _hits.GROUP_ID_DTYPE  # type: ignore[attr-defined]
        self._members: np.ndarray = np.array(members, dtype=member_dtype)
        for a in (self._specs, self._specs_no_eagle, self._members):
            a.flags.writeable = False
        # the kernel's direct lookup (one spec group, no fixed point): a one-group layout,
        # or one spec group under the store coordinator's rule
        direct = self.unitary or (self.single_spec_direct and len(groups) == 1)
        self._kernel = _hits.HitKernel(self._specs, self._members, self.hash_block_size,
                                       self.alignment, self.partial, direct)
        self._frozen = True

    # -- lookups --------------------------------------------------------------------------
    def align_length(self, num_tokens: int) -> int:
        """``num_tokens`` rounded down to ``alignment`` tokens."""
        _check_tokens("num_tokens", num_tokens)
        return num_tokens // self.alignment * self.alignment

    def longest_hit(self, hashes: np.ndarray | list[bytes], exists: ExistenceSet | None,
                    max_length: int, *, apply_eagle: bool = True) -> HitResult:
        """The longest hit of a request whose hash rows are ``hashes``.

        Args:
            hashes: (N, digest_size) uint8 C-contiguous; row j names tokens [0, (j+1)*h).
                With an existence set, also vLLM's ``Request.block_hashes`` as it is (a list
                of ``digest_size``-byte ``bytes``): the kernel reads only the rows it probes,
                in place, with no conversion (a probed row that is not such a bytes object
                raises HashInputError naming it).
            exists: the existence set, or None for *mask mode* (every key present: gives the
                load masks of an already known hit length).
            max_length: cap of the hit in tokens (vLLM passes ``num_tokens - 1``); probes
                never go past the N*h tokens the rows cover.
            apply_eagle: False when ``max_length`` is a hit that already had the eagle drop
                (mask mode on the loading side), so the drop is not applied twice.

        One call into the compiled kernel (the layout's spec table was checked when the
        finder was built); bad ``hashes`` / ``exists`` / ``max_length`` raise HashInputError
        naming the argument before any probe. The result's ``masks`` are built on first
        access.
        """
        tokens, spans = self._kernel.run(exists, hashes, max_length, apply_eagle)
        return HitResult._lazy(tokens, spans, self)

    @property
    def kernel(self) -> _hits.HitKernel:
        """The compiled rule (immutable; the routing index runs it over engine masks)."""
        return self._kernel

    def hit_tokens(self, hashes: np.ndarray, exists: ExistenceSet | None, max_length: int,
                   *, apply_eagle: bool = True) -> int:
        """Only the length (tokens) of :meth:`longest_hit` (vLLM's
        ``get_num_new_matched_tokens`` needs nothing else)."""
        return self._kernel.run(exists, hashes, max_length, apply_eagle)[0]

    def _masks_from_spans(self, spans: np.ndarray) -> tuple[np.ndarray, ...]:
        masks = [_EMPTY] * self.num_groups
        for s, sg in enumerate(self.spec_groups):
            length, lo = int(spans[s, 0]), int(spans[s, 1])
            m = np.zeros(length, dtype=np.uint8)
            m[min(lo, length):] = 1
            for g in sg.group_ids:
                masks[g] = m if len(sg.group_ids) == 1 else m.copy()
        return tuple(masks)

    def load_masks(self, hashes: np.ndarray, hit_tokens: int) -> tuple[np.ndarray, ...]:
        """Blocks of each group to load for a hit of ``hit_tokens`` found earlier (mask mode,
        eagle not re-applied; Mooncake's ``load_mask``)."""
        return self.longest_hit(hashes, None, hit_tokens, apply_eagle=False).masks

    # -- store / lookup masks --------------------------------------------------------------
    def _reachable(self, g: int, start: int, end: int, lookup: bool) -> np.ndarray:
        spec = self.layout.groups[g]
        bs = self.block_sizes[g]
        n = end - start
        if spec.kind == GroupKind.MAMBA:
            # align-mode Mamba tables are not append-only: states are never stored
            # positionally (explicit boundary puts only), but every chunk may be probed.
            return np.full(n, 1 if lookup else 0, dtype=np.uint8)
        if spec.kind != GroupKind.SLIDING_WINDOW:
            return np.ones(n, dtype=np.uint8)
        align = self.scheduler_block_size
        if align % bs:
            return np.ones(n, dtype=np.uint8)
        eagle = g in self.eagle_group_ids
        need = cdiv(self.windows[g] - 1, bs) + (1 if eagle else 0)
        per_segment = align // bs
        if need >= per_segment:
            return np.ones(n, dtype=np.uint8)
        shift = 1 if eagle else 0
        i = np.arange(start, end, dtype=np.int64)
        keep = (i >= shift) & ((i - shift) % per_segment >= per_segment - need)
        return keep.astype(np.uint8)

    def _masks(self, num_tokens: int, start_token: int, lookup: bool) -> tuple[np.ndarray, ...]:
        _check_tokens("num_tokens", num_tokens)
        _check_tokens("start_token", start_token)
        if num_tokens % self.alignment:
            raise HashInputError(f"num_tokens ({num_tokens}) must be a multiple of the hit "
                                 f"alignment ({self.alignment} tokens); use align_length()")
        out = []
        for g in range(self.num_groups):
            if g not in self.group_ids:
                out.append(_EMPTY)
                continue
            bs = self.block_sizes[g]
            end = num_tokens // bs
            start = min(end, cdiv(start_token, bs))
            out.append(self._reachable(g, start, end, lookup))
        return tuple(out)

    def store_masks(self, num_tokens: int, start_token: int = 0) -> tuple[np.ndarray, ...]:
        """Per group, which blocks a saver writes: ``masks[g][i]`` covers block
        ``cdiv(start_token, bs_g) + i`` of group g, up to ``num_tokens // bs_g`` (exclusive).

        ``num_tokens`` must be a multiple of ``alignment``. Full attention / chunked-local:
        every block; sliding window: the ``need``-block tails before each scheduler-block
        boundary (vLLM's ``reachable_block_mask`` with dense retention); Mamba: none (states
        go through explicit boundary puts, see ``boundary_row``).
        """
        return self._masks(num_tokens, start_token, lookup=False)

    def lookup_masks(self, num_tokens: int) -> tuple[np.ndarray, ...]:
        """Per group, which blocks a lookup probes (same rule as ``store_masks`` but Mamba
        blocks are all probed), so a lookup never asks for a key no saver writes."""
        return self._masks(num_tokens, 0, lookup=True)

    def lookup_rows(self, num_hashes: int, num_tokens: int) -> tuple[np.ndarray, ...]:
        """Per group, the int64 hash rows whose keys one lookup must probe (Mooncake's
        ``lookup``): rows up to ``align_length(num_tokens)``. Fine-grained: every row; else
        the last row of each block selected by ``lookup_masks``. Empty when nothing to ask."""
        _check_tokens("num_hashes", num_hashes)
        token_len = self.align_length(num_tokens)
        h = self.hash_block_size
        out = []
        for g in range(self.num_groups):
            if g not in self.group_ids or num_hashes == 0 or token_len <= 0:
                out.append(np.zeros(0, dtype=np.int64))
                continue
            if self.partial:
                out.append(np.arange(min(num_hashes, token_len // h), dtype=np.int64))
                continue
            bs = self.block_sizes[g]
            k = bs // h
            nblk = min(num_hashes // k, cdiv(token_len, bs))
            mask = self._reachable(g, 0, nblk, lookup=True)
            blocks = np.flatnonzero(mask).astype(np.int64)
            out.append((blocks + 1) * k - 1)
        return tuple(out)

    def lookup_keys(self, hashes: np.ndarray, num_tokens: int, key_builder) -> LookupPlan:
        """The keys (``key_builder``: a hmacore.keys.KeyBuilder) of ``lookup_rows``, in every
        namespace each group requires; empty when there is nothing to ask."""
        hashes = _hits._check_digests(hashes, _width(hashes), "hashes")
        rows = self.lookup_rows(hashes.shape[0], num_tokens)
        keys: list[str] = []
        spans = []
        for g in self.group_ids:
            if rows[g].size == 0:
                continue
            k = key_builder.lookup_keys(g, self.key_digests(hashes, g, rows[g]))
            spans.append((g, rows[g], len(keys), len(k)))
            keys.extend(k)
        return LookupPlan(keys, tuple(spans))

    def store_rows(self, num_hashes: int, num_tokens: int, start_token: int = 0) -> tuple[np.ndarray, ...]:
        """Per group, the int64 hash rows a saver writes keys for: the last row of every
        block selected by ``store_masks(align_length(num_tokens), start_token)``, limited to
        blocks the ``num_hashes`` rows cover."""
        _check_tokens("num_hashes", num_hashes)
        token_len = self.align_length(num_tokens)
        masks = self._masks(token_len, start_token, lookup=False)
        out = []
        for g in range(self.num_groups):
            if g not in self.group_ids:
                out.append(np.zeros(0, dtype=np.int64))
                continue
            bs = self.block_sizes[g]
            k = bs // self.hash_block_size
            start = min(token_len // bs, cdiv(start_token, bs))
            blocks = start + np.flatnonzero(masks[g]).astype(np.int64)
            blocks = blocks[blocks < num_hashes // k]
            out.append((blocks + 1) * k - 1)
        return tuple(out)

    def boundary_row(self, num_tokens: int) -> int:
        """Hash row naming the state at ``align_length(num_tokens)`` tokens (the key of a
        Mamba boundary put); -1 when that is 0 tokens."""
        t = self.align_length(num_tokens)
        return t // self.hash_block_size - 1

    def key_digests(self, hashes: np.ndarray, group: int, rows: np.ndarray) -> np.ndarray:
        """The digest bytes of the keys of ``rows`` in group ``group``: (n, ds) uint8 (the rows
        themselves) with ``coarse="last"``; (n, k*ds) concatenations of each block's k rows
        with ``coarse="concat"`` (k = bs_g / h). Used to render key strings."""
        hashes = _hits._check_digests(hashes, _width(hashes), "hashes")
        g = self._check_group(group)
        rows = np.asarray(rows, dtype=np.int64)
        if rows.ndim != 1 or (rows.size and (rows.min() < 0 or rows.max() >= hashes.shape[0])):
            raise HashInputError(f"rows must be a 1-D array of hash rows in [0, {hashes.shape[0]})")
        k = self.block_sizes[g] // self.hash_block_size
        if self.coarse == "last" or k == 1:
            return hashes[rows]
        if rows.size and np.any((rows + 1) % k):
            raise HashInputError(f"rows must end blocks of group {g} (multiples of {k} minus 1) "
                                 "for concatenated keys")
        idx = rows[:, None] - (k - 1) + np.arange(k)[None, :]
        return hashes[idx].reshape(rows.size, k * hashes.shape[1])

    def _check_group(self, group) -> int:
        if isinstance(group, bool) or not isinstance(group, (int, np.integer)) \
                or not 0 <= int(group) < self.num_groups:
            raise HashInputError(f"group must be a group id in [0, {self.num_groups}), got {group!r}")
        return int(group)


def _finder(layout: KVLayout, coarse: str, eagle: bool, alignment: int | None = None,
            eagle_gated: bool = False, retained_coverage: bool = False,
            single_spec_direct: bool = False) -> HitFinder:
    """Unpickle a HitFinder."""
    return HitFinder(layout, coarse=coarse, eagle=eagle, alignment=alignment,
                     eagle_gated=eagle_gated, retained_coverage=retained_coverage,
                     single_spec_direct=single_spec_direct)


def coverage_window(spec, retained_coverage: bool) -> int:
    """The tokens a sliding-window group's hit must cover: its window, plus the
    ``extra_retained_tokens`` tail with ``retained_coverage``; 0 for other kinds."""
    if spec.kind != GroupKind.SLIDING_WINDOW:
        return 0
    window = cast(int, spec.sliding_window)   # an int >= 1 on SLIDING_WINDOW groups
    return window + spec.extra_retained_tokens if retained_coverage else window


def _check_alignment(alignment, derived: int, scheduler_block_size: int) -> None:
    """LayoutError unless ``alignment`` is a hit grain vLLM can resolve for the layout."""
    if isinstance(alignment, bool) or not isinstance(alignment, (int, np.integer)):
        raise LayoutError(f"alignment must be None or an int (tokens), got "
                          f"{type(alignment).__name__} {alignment!r}")
    if alignment in (derived, scheduler_block_size):
        return
    grains = sorted({derived, scheduler_block_size})
    raise LayoutError(
        f"alignment must be None or a hit grain vLLM resolves for this layout: "
        f"{' or '.join(map(str, grains))} tokens (the scheduler block size, or the hash block "
        f"size when fine-grained Mamba hits apply), got {alignment!r}")


def _width(hashes) -> int:
    if isinstance(hashes, np.ndarray) and hashes.ndim == 2 and hashes.shape[1] in (16, 32):
        return hashes.shape[1]
    raise HashInputError("hashes must be a uint8 array of shape (N, 16) or (N, 32)")


_EMPTY = np.zeros(0, dtype=np.uint8)
_EMPTY.setflags(write=False)


def _check_tokens(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise HashInputError(f"{name} must be an int (tokens), got {type(value).__name__}")
    if value < 0:
        raise HashInputError(f"{name} must be >= 0 tokens, got {value}")
    if value > 2**63 - 1:
        raise HashInputError(f"{name} must be < 2**63 tokens, got {value}")
    return int(value)


class _Block:
    """Stand-in for vLLM's KVCacheBlock (only ``block_id`` and ``is_null`` are read)."""

    __slots__ = ("block_id", "is_null")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.is_null = block_id == 0

    def __repr__(self) -> str:
        return f"_Block({self.block_id})"


class ExternalBlockPool:
    """Duck-typed vLLM ``BlockPool`` over an ExistenceSet, for vLLM's manager classmethods.

    ``get_cached_block(block_hash, kv_cache_group_ids)`` returns one present block per group
    id, or None if any group misses. ``exists=None`` is *mask mode*: every lookup hits.
    A hash longer than the set's digest (a concatenated coarse hash) is looked up by its
    last ``digest_size`` bytes: the last fine hash names the same chained prefix.
    Attributes ``null_block`` (id 0) and ``hash_block_size`` (tokens) are what vLLM reads.
    """

    def __init__(self, hash_block_size: int, exists: ExistenceSet | None = None) -> None:
        _check_tokens("hash_block_size", hash_block_size)
        if hash_block_size <= 0:
            raise HashInputError("hash_block_size must be > 0 tokens")
        if exists is not None and not isinstance(exists, ExistenceSet):
            raise HashInputError(f"exists must be an ExistenceSet or None, got {type(exists).__name__}")
        self.hash_block_size = hash_block_size
        self.exists = exists
        self.null_block = _Block(0)
        self.present_block = _Block(1)

    def get_cached_block(self, block_hash, kv_cache_group_ids):
        if self.exists is None:
            return [self.present_block] * len(kv_cache_group_ids)
        ds = self.exists.digest_size
        b = bytes(block_hash)
        if len(b) == 0 or len(b) % ds:
            raise HashInputError(f"block_hash must be a multiple of {ds} bytes, got {len(b)}")
        b = b[-ds:]
        for g in kv_cache_group_ids:
            if not self.exists.contains(g, b):
                return None
        return [self.present_block] * len(kv_cache_group_ids)

    def contains(self, group_id: int, block_hash) -> bool:
        """True if ``group_id`` holds ``block_hash`` (False in mask mode, like vLLM)."""
        if self.exists is None:
            return False
        b = bytes(block_hash)
        return self.exists.contains(group_id, b[-self.exists.digest_size:])
