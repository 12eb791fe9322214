"""Group specs and layouts: the engine-neutral description of a hybrid KV cache.

Units: ``block_size``, ``sliding_window``, ``chunk_size`` and ``extra_retained_tokens`` are in
tokens; ``page_bytes`` is bytes of one block of one layer; window clip sizes are in blocks of
the group they belong to.
"""
from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .errors import LayoutError
from .grain import cdiv

__all__ = ["GroupKind", "MambaMode", "GroupSpec", "KVLayout"]


class GroupKind(enum.IntEnum):
    """What a KV cache group stores. The int values are stable (they travel in handshakes)."""

    FULL = 0            # full attention (MLA is FULL with ``mla=True``)
    SLIDING_WINDOW = 1
    CHUNKED_LOCAL = 2
    MAMBA = 3           # Mamba / linear-attention (GDN) recurrent state
    CROSS_ATTENTION = 4  # never accepted: sized by encoder length, not by prompt position


SUPPORTED_KINDS = frozenset({GroupKind.FULL, GroupKind.SLIDING_WINDOW,
                             GroupKind.CHUNKED_LOCAL, GroupKind.MAMBA})


class MambaMode(str, enum.Enum):
    """vLLM's ``mamba_cache_mode``. Only ``align`` keeps block positions hash-addressable."""

    NONE = "none"
    ALL = "all"
    ALIGN = "align"


def _pos_int(group: int, field: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise LayoutError(f"group {group}: {field} must be a positive int, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class GroupSpec:
    """One KV cache group: what its blocks hold and how many tokens one block covers.

    Attributes:
        kind: the group's :class:`GroupKind`.
        block_size: tokens per block of this group.
        layer_names: the attention/state layers whose pages this group's block ids address.
        sliding_window: window in tokens (SLIDING_WINDOW only).
        chunk_size: attention chunk in tokens (CHUNKED_LOCAL only).
        extra_retained_tokens: tokens kept beyond the window (MTP re-prefill tail).
        eagle: the group serves a speculative (EAGLE/MTP) drafter; hits drop one block.
        mamba_mode: vLLM ``mamba_cache_mode`` (MAMBA only).
        num_speculative_blocks: trailing scratch state slots (MAMBA only).
        mla: MLA flavour (one latent region per layer instead of K and V).
        kernel_block_size: the attention kernel's block, in tokens; must divide ``block_size``.
        page_bytes: bytes of one block of one layer (0 = unknown; plans need it).
        transfer: vLLM ``enable_kv_transfer``; groups with False are never moved.
        name: a label for printing.
    """

    kind: GroupKind
    block_size: int
    layer_names: tuple[str, ...] = ()
    sliding_window: int | None = None
    chunk_size: int | None = None
    extra_retained_tokens: int = 0
    eagle: bool = False
    mamba_mode: MambaMode = MambaMode.ALIGN
    num_speculative_blocks: int = 0
    mla: bool = False
    kernel_block_size: int | None = None
    page_bytes: int = 0
    transfer: bool = True
    name: str = ""

    def __post_init__(self) -> None:
        try:
            kind = GroupKind(self.kind)
        except ValueError:
            raise LayoutError(f"kind must be one of {[k.name for k in GroupKind]}, "
                              f"got {self.kind!r}") from None
        object.__setattr__(self, "kind", kind)
        try:
            object.__setattr__(self, "mamba_mode", MambaMode(self.mamba_mode))
        except ValueError:
            raise LayoutError(f"mamba_mode must be one of none/all/align, got {self.mamba_mode!r}") from None
        object.__setattr__(self, "layer_names", tuple(self.layer_names))

    # -- derived quantities -------------------------------------------------------------
    @property
    def is_attention(self) -> bool:
        """True for groups whose blocks are token pages (everything but MAMBA)."""
        return self.kind != GroupKind.MAMBA

    @property
    def prefix_cacheable(self) -> bool:
        """True when block i of this group is addressable by the hash of tokens [0, (i+1)*bs)."""
        if self.kind == GroupKind.CROSS_ATTENTION:
            return False
        if self.kind == GroupKind.MAMBA:
            return self.mamba_mode == MambaMode.ALIGN
        return True

    @property
    def kernel_ratio(self) -> int:
        """Kernel blocks per logical block (1 when no kernel block size is set; MAMBA: 1)."""
        if self.kernel_block_size is None or not self.is_attention:
            return 1
        return self.block_size // self.kernel_block_size

    def window_blocks(self, exact: bool = False) -> int:
        """Blocks of this group a request must keep (and a connector must move); 0 = all.

        SLIDING_WINDOW: ``cdiv(window, bs) + 1`` (vLLM NIXL's bound), or with ``exact=True``
        the tight ``cdiv(window - 1 + extra_retained_tokens, bs) + 1``. Never ``window // bs``:
        4096/32 needs 129 blocks, not 128. Other kinds return 0 (MAMBA is clipped to its
        state slot separately).
        """
        if self.kind != GroupKind.SLIDING_WINDOW:
            return 0
        if exact:
            return cdiv(self.sliding_window - 1 + self.extra_retained_tokens, self.block_size) + 1
        return cdiv(self.sliding_window, self.block_size) + 1

    def hit_run_blocks(self) -> int:
        """Contiguous cached blocks a sliding-window hit needs: ``cdiv(window - 1, bs)``."""
        if self.kind != GroupKind.SLIDING_WINDOW:
            return 0
        return cdiv(self.sliding_window - 1, self.block_size)

    def merge_key(self) -> tuple:
        """Everything that makes two groups interchangeable for hit lookup (not their layers)."""
        return (self.kind, self.block_size, self.sliding_window, self.chunk_size,
                self.extra_retained_tokens, self.eagle, self.mamba_mode, self.mla,
                self.num_speculative_blocks)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["kind"] = self.kind.name
        d["mamba_mode"] = self.mamba_mode.value
        d["layer_names"] = list(self.layer_names)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> GroupSpec:
        d = dict(d)
        kind = d.pop("kind")
        if isinstance(kind, str):
            try:
                kind = GroupKind[kind.upper()]
            except KeyError:
                raise LayoutError(f"kind must be one of {[k.name for k in GroupKind]}, "
                                  f"got {kind!r}") from None
        layers = d.pop("layer_names", ())
        num_layers = d.pop("num_layers", None)
        if num_layers is not None and not layers:
            prefix = d.get("name") or f"{GroupKind(kind).name.lower()}"
            layers = tuple(f"{prefix}.{i}" for i in range(int(num_layers)))
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise LayoutError(f"unknown group fields: {sorted(unknown)}")
        return cls(kind=kind, layer_names=tuple(layers), **d)


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """The ordered KV cache groups of one model instance, validated against an allow-list.

    Attributes:
        groups: the groups, in vLLM's group order (group id = index).
        num_blocks: size of the shared block pool (block ids are ``0 .. num_blocks-1``; id 0 is
            the null block). ``None`` = unknown (ids are then only checked to be >= 0 and int32).
        context_parallel: decode/prefill context-parallel world size (> 1 only with one group).
        prefix_match_unit: explicit hash block size in tokens; must divide every prefix-cacheable
            group's block size. ``None`` = gcd of those block sizes.
    """

    groups: tuple[GroupSpec, ...]
    num_blocks: int | None = None
    context_parallel: int = 1
    prefix_match_unit: int | None = None

    def __post_init__(self) -> None:
        groups = tuple(self.groups)
        object.__setattr__(self, "groups", groups)
        if not groups:
            raise LayoutError("groups: a layout needs at least one group")
        seen: dict[str, int] = {}
        for g, spec in enumerate(groups):
            if not isinstance(spec, GroupSpec):
                raise LayoutError(f"groups[{g}] must be a GroupSpec, got {type(spec).__name__}")
            self._validate_group(g, spec)
            for name in spec.layer_names:
                if name in seen:
                    raise LayoutError(f"layer {name!r} is in group {seen[name]} and group {g}: "
                                      "a layer belongs to exactly one group")
                seen[name] = g
        if self.num_blocks is not None:
            if isinstance(self.num_blocks, bool) or not isinstance(self.num_blocks, int) \
                    or not 2 <= self.num_blocks <= 2**31 - 1:
                raise LayoutError(f"num_blocks must be an int in [2, 2**31-1] (id 0 is the null "
                                  f"block), got {self.num_blocks!r}")
        cp = self.context_parallel
        if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
            raise LayoutError(f"context_parallel must be an int >= 1, got {cp!r}")
        if cp > 1 and len(groups) > 1:
            raise LayoutError(f"context_parallel={cp} with {len(groups)} groups: context "
                              "parallelism > 1 is only supported with a single KV cache group")
        if self.prefix_match_unit is not None:
            unit = self.prefix_match_unit
            if isinstance(unit, bool) or not isinstance(unit, int) or unit <= 0:
                raise LayoutError(f"prefix_match_unit must be a positive int, got {unit!r}")
            for g, spec in enumerate(groups):
                if spec.prefix_cacheable and spec.block_size % unit:
                    raise LayoutError(f"group {g}: block_size {spec.block_size} is not a multiple "
                                      f"of prefix_match_unit {unit}")
        object.__setattr__(self, "_layer_to_group", seen)

    @staticmethod
    def _validate_group(g: int, spec: GroupSpec) -> None:
        if spec.kind == GroupKind.CROSS_ATTENTION:
            raise LayoutError(f"group {g}: cross-attention is not supported (its blocks are sized "
                              "by encoder length and are never prefix-cached or transferred)")
        if spec.kind not in SUPPORTED_KINDS:
            raise LayoutError(f"group {g}: kind {spec.kind!r} is not supported")
        _pos_int(g, "block_size", spec.block_size)
        if spec.kind == GroupKind.SLIDING_WINDOW:
            _pos_int(g, "sliding_window", spec.sliding_window)
        elif spec.sliding_window is not None:
            raise LayoutError(f"group {g}: sliding_window is only valid for SLIDING_WINDOW groups")
        if spec.kind == GroupKind.CHUNKED_LOCAL:
            _pos_int(g, "chunk_size", spec.chunk_size)
        elif spec.chunk_size is not None:
            raise LayoutError(f"group {g}: chunk_size is only valid for CHUNKED_LOCAL groups")
        if isinstance(spec.extra_retained_tokens, bool) or not isinstance(spec.extra_retained_tokens, int) \
                or spec.extra_retained_tokens < 0:
            raise LayoutError(f"group {g}: extra_retained_tokens must be an int >= 0")
        if spec.extra_retained_tokens and spec.kind != GroupKind.SLIDING_WINDOW:
            raise LayoutError(f"group {g}: extra_retained_tokens is only valid for SLIDING_WINDOW groups")
        if isinstance(spec.num_speculative_blocks, bool) or not isinstance(spec.num_speculative_blocks, int) \
                or spec.num_speculative_blocks < 0:
            raise LayoutError(f"group {g}: num_speculative_blocks must be an int >= 0")
        if spec.num_speculative_blocks and spec.kind != GroupKind.MAMBA:
            raise LayoutError(f"group {g}: num_speculative_blocks is only valid for MAMBA groups")
        if spec.kernel_block_size is not None:
            k = _pos_int(g, "kernel_block_size", spec.kernel_block_size)
            if spec.block_size % k:
                raise LayoutError(f"group {g}: kernel_block_size {k} does not divide block_size "
                                  f"{spec.block_size}")
        if isinstance(spec.page_bytes, bool) or not isinstance(spec.page_bytes, int) or spec.page_bytes < 0:
            raise LayoutError(f"group {g}: page_bytes must be an int >= 0")

    # -- derived quantities -------------------------------------------------------------
    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def block_sizes(self) -> tuple[int, ...]:
        """Tokens per block, per group."""
        return tuple(s.block_size for s in self.groups)

    @property
    def scheduler_block_size(self) -> int:
        """lcm of the group block sizes (tokens): the grain hybrid hits align to."""
        return math.lcm(*self.block_sizes)

    @property
    def hash_block_size(self) -> int:
        """Tokens per block hash: ``prefix_match_unit`` or gcd of prefix-cacheable block sizes."""
        if self.prefix_match_unit is not None:
            return self.prefix_match_unit
        sizes = [s.block_size for s in self.groups if s.prefix_cacheable]
        return math.gcd(*sizes) if sizes else self.scheduler_block_size

    @property
    def layer_to_group(self) -> Mapping[str, int]:
        """Layer name -> group id."""
        return dict(self._layer_to_group)  # type: ignore[attr-defined]

    @property
    def transfer_group_ids(self) -> tuple[int, ...]:
        return tuple(g for g, s in enumerate(self.groups) if s.transfer)

    @property
    def prefix_cacheable_group_ids(self) -> tuple[int, ...]:
        return tuple(g for g, s in enumerate(self.groups) if s.transfer and s.prefix_cacheable)

    @property
    def is_hybrid(self) -> bool:
        """True when some transferred group is not full attention (HMA actually matters)."""
        return any(self.groups[g].kind != GroupKind.FULL for g in self.transfer_group_ids)

    def window_blocks(self, exact: bool = False) -> tuple[int, ...]:
        """Per group: blocks kept by the window clip (0 = unclipped). See GroupSpec.window_blocks."""
        return tuple(s.window_blocks(exact) for s in self.groups)

    def blocks_for_tokens(self, num_tokens: int, *, clipped: bool = True,
                          exact: bool = False) -> tuple[int, ...]:
        """Per group: blocks of that group a ``num_tokens``-token request holds (``clipped=False``)
        or that a connector must move for it (``clipped=True``: sliding windows cut to
        ``window_blocks``, Mamba to its one running-state slot). Units: blocks of group g.
        """
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise LayoutError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
        out = []
        for spec in self.groups:
            n = cdiv(num_tokens, spec.block_size)
            if clipped:
                if spec.kind == GroupKind.SLIDING_WINDOW:
                    n = min(n, spec.window_blocks(exact))
                elif spec.kind == GroupKind.MAMBA:
                    n = min(n, 1)
            out.append(n)
        return tuple(out)

    def check_hash_addressable(self) -> None:
        """Raise LayoutError unless every transferred group can be looked up by block hash.

        Mamba groups must be in ``align`` mode: otherwise their block table is not positional
        and a hash names no state slot.
        """
        for g, spec in enumerate(self.groups):
            if spec.transfer and spec.kind == GroupKind.MAMBA and spec.mamba_mode != MambaMode.ALIGN:
                raise LayoutError(f"group {g}: Mamba cache mode {spec.mamba_mode.value!r} is not "
                                  "hash-addressable; use mamba_cache_mode='align' for stores and hits")

    def fingerprint(self) -> str:
        """Stable hex digest of everything two peers must agree on (not num_blocks)."""
        doc = {"groups": [s.to_dict() for s in self.groups], "cp": self.context_parallel,
               "pmu": self.prefix_match_unit}
        return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:32]

    def pairing_fingerprint(self) -> str:
        """Like :meth:`fingerprint` without page bytes: what two engines must agree on to
        exchange blocks whatever their TP sizes (a rank's page bytes scale with the KV heads
        it holds; the NIXL handshake checks bytes per head)."""
        groups = [{k: v for k, v in s.to_dict().items() if k != "page_bytes"} for s in self.groups]
        doc = {"groups": groups, "cp": self.context_parallel, "pmu": self.prefix_match_unit}
        return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:32]

    def to_dict(self) -> dict[str, Any]:
        return {"groups": [s.to_dict() for s in self.groups], "num_blocks": self.num_blocks,
                "context_parallel": self.context_parallel,
                "prefix_match_unit": self.prefix_match_unit}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> KVLayout:
        if "groups" not in d:
            raise LayoutError("layout document needs a 'groups' list")
        groups = d["groups"]
        if not isinstance(groups, (list, tuple)):
            raise LayoutError("'groups' must be a list of group tables")
        return cls(groups=tuple(GroupSpec.from_dict(g) for g in groups),
                   num_blocks=d.get("num_blocks"),
                   context_parallel=d.get("context_parallel", 1),
                   prefix_match_unit=d.get("prefix_match_unit"))

    @classmethod
    def from_file(cls, path: str) -> KVLayout:
        """Load a layout from a ``.json`` or ``.toml`` file (see docs/embedding.md)."""
        if str(path).endswith(".toml"):
            import tomllib
            with open(path, "rb") as f:
                return cls.from_dict(tomllib.load(f))
        with open(path) as f:
            return cls.from_dict(json.load(f))

    def with_num_blocks(self, num_blocks: int) -> KVLayout:
        return dataclasses.replace(self, num_blocks=num_blocks)


def layer_names(prefix: str, indices: Iterable[int]) -> tuple[str, ...]:
    """``("{prefix}.{i}", ...)`` helper for presets and tests."""
    return tuple(f"{prefix}.{i}" for i in indices)


def groups_from_sequence(specs: Sequence[GroupSpec], **kw: Any) -> KVLayout:
    return KVLayout(groups=tuple(specs), **kw)
