"""Group specs and layouts: the engine-neutral description of a hybrid KV cache.

Units: ``block_size``, ``sliding_window``, ``chunk_size`` and ``extra_retained_tokens`` are in
tokens; ``page_bytes`` is bytes of one block of one layer; window clip sizes are in blocks of
the group they belong to.
"""
from __future__ import annotations

import dataclasses
import difflib
import enum
import hashlib
import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeGuard, cast

from .errors import ArgumentTypeError, ConfigError, ConfigFileError, LayoutError, LayoutKeyError
from .grain import cdiv

__all__ = ["GroupKind", "MambaMode", "GroupSpec", "KVLayout", "HEAD_FIELDS"]

#: GroupSpec's optional head-shape fields (None = unknown), in declaration order.
HEAD_FIELDS = ("num_kv_heads", "head_size", "head_size_v", "dtype", "attn_type")


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


def _is_int(value: Any) -> TypeGuard[int]:
    """A real int: bools (and floats, numpy scalars, strings) are not."""
    return isinstance(value, int) and not isinstance(value, bool)


def _spec_error(field: str, rule: str, value: Any) -> LayoutError:
    return LayoutError(f"GroupSpec.{field} must be {rule}, got {value!r}")


def _resolve_kind(kind: Any) -> GroupKind:
    """A supported :class:`GroupKind` from a GroupKind or its int value (bools/floats refused)."""
    names = ", ".join(k.name for k in GroupKind if k in SUPPORTED_KINDS)
    if isinstance(kind, GroupKind):
        resolved = kind
    elif _is_int(kind) and kind in GroupKind._value2member_map_:
        resolved = GroupKind(kind)
    else:
        raise LayoutError(f"GroupSpec.kind must be one of {names} (a GroupKind or its int "
                          f"value), got {kind!r}")
    if resolved == GroupKind.CROSS_ATTENTION:
        raise LayoutError("GroupSpec.kind: cross-attention is not supported (its blocks are sized "
                          "by encoder length and are never prefix-cached or transferred)")
    if resolved not in SUPPORTED_KINDS:  # pragma: no cover - every other kind is supported
        raise LayoutError(f"GroupSpec.kind must be one of {names}, got {kind!r}")
    return resolved


def _unknown_keys(what: str, keys: Iterable[Any], allowed: Iterable[str]) -> None:
    """Raise LayoutError listing the keys not in ``allowed``, each with a "did you mean"."""
    allowed = sorted(allowed)
    unknown = sorted((k for k in keys if k not in allowed), key=str)
    if not unknown:
        return
    parts = []
    for k in unknown:
        near = difflib.get_close_matches(str(k), allowed, n=1, cutoff=0.6)
        parts.append(f"{k!r} (did you mean {near[0]!r}?)" if near else repr(k))
    raise LayoutError(f"unknown {what}: [{', '.join(parts)}]; allowed: {', '.join(allowed)}")


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
        num_kv_heads: KV heads of one layer (attention groups; vLLM: per TP rank).
        head_size: K head size in elements (attention groups).
        head_size_v: V head size in elements (attention groups; 0 = no separate V, as MLA).
            Left None with ``head_size`` given, it becomes vLLM's default: ``head_size``, or
            0 with ``mla=True``.
        dtype: the cache element type, e.g. ``"bfloat16"`` (a leading ``"torch."`` is
            dropped; Mamba groups from vLLM: the state dtypes joined by commas).
        attn_type: the engine's name for the layer type (vLLM: the KVCacheSpec class, e.g.
            ``"SlidingWindowSpec"``; Mamba specs add the backend, ``"MambaSpec:GDN_ATTN"``).

    The last five fields describe the head shape; ``None`` means unknown. With them the hit
    rule merges groups exactly when vLLM's specs are equal (see ``hmacore.hits._merge_key``);
    give them for every group or for none (an unknown field only equals an unknown field).

    Every field is checked on construction (and by ``dataclasses.replace``); a broken rule
    raises :class:`~hmacore.errors.LayoutError` naming the field and the rule, e.g.
    ``GroupSpec.block_size must be an int >= 1, got -5``. Int fields take real ints only
    (bools, floats and strings are refused, never truncated); ``eagle``/``mla``/``transfer``
    take real bools only (``"no"`` is refused, not truthy); ``layer_names`` is a sequence of
    distinct non-empty strings (a plain string is refused, not split into characters);
    ``sliding_window`` / ``chunk_size`` / ``extra_retained_tokens`` / ``num_speculative_blocks``
    / a non-``align`` ``mamba_mode`` are only valid on their kinds; ``num_kv_heads`` /
    ``head_size`` / ``head_size_v`` only on attention groups (``head_size_v`` needs
    ``head_size``); ``dtype`` / ``attn_type`` are None or non-empty strings.
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
    num_kv_heads: int | None = None
    head_size: int | None = None
    head_size_v: int | None = None
    dtype: str | None = None
    attn_type: str | None = None

    def __post_init__(self) -> None:
        self._validate()

    def _validate(self) -> None:
        """Check every field (type, range, kind-specific rules) and normalise enums and int
        subclasses; raise LayoutError naming the field and the rule."""
        put = object.__setattr__
        kind = _resolve_kind(self.kind)
        put(self, "kind", kind)
        label = f"a {kind.name} group"

        def integer(field: str, lo: int) -> int:
            v = getattr(self, field)
            if not _is_int(v) or v < lo:
                raise _spec_error(field, f"an int >= {lo}", v)
            put(self, field, int(v))
            return int(v)

        def flag(field: str) -> None:
            v = getattr(self, field)
            if not isinstance(v, bool):  # "no", 0 or numpy.bool_ are refused: real bools only
                raise _spec_error(field, "a bool (True or False)", v)

        def only_for(field: str, want: GroupKind, value: Any, unset: Any) -> None:
            if kind != want and value != unset:
                raise LayoutError(f"GroupSpec.{field} is only valid for {want.name} groups, got "
                                  f"{value!r} for {label}")

        bs = integer("block_size", 1)

        names = self.layer_names
        if isinstance(names, (str, bytes, Mapping, set, frozenset)) \
                or not isinstance(names, Iterable):
            hint = f" (one layer: layer_names=({names!r},))" if isinstance(names, str) else ""
            raise LayoutError(f"GroupSpec.layer_names must be a sequence of layer-name strings, "
                              f"got {type(names).__name__} {names!r}{hint}")
        names = tuple(names)
        for i, n in enumerate(names):
            if not isinstance(n, str) or not n:
                raise LayoutError(f"GroupSpec.layer_names[{i}] must be a non-empty str, got {n!r}")
        if len(set(names)) != len(names):
            dup = next(n for i, n in enumerate(names) if n in names[:i])
            raise LayoutError(f"GroupSpec.layer_names lists layer {dup!r} twice")
        put(self, "layer_names", names)

        if kind == GroupKind.SLIDING_WINDOW:
            if not _is_int(self.sliding_window) or self.sliding_window < 1:
                raise _spec_error("sliding_window", "an int >= 1 (tokens) for a SLIDING_WINDOW "
                                  "group", self.sliding_window)
            put(self, "sliding_window", int(self.sliding_window))
        else:
            only_for("sliding_window", GroupKind.SLIDING_WINDOW, self.sliding_window, None)
        if kind == GroupKind.CHUNKED_LOCAL:
            if not _is_int(self.chunk_size) or self.chunk_size < 1:
                raise _spec_error("chunk_size", "an int >= 1 (tokens) for a CHUNKED_LOCAL group",
                                  self.chunk_size)
            put(self, "chunk_size", int(self.chunk_size))
        else:
            only_for("chunk_size", GroupKind.CHUNKED_LOCAL, self.chunk_size, None)

        only_for("extra_retained_tokens", GroupKind.SLIDING_WINDOW,
                 integer("extra_retained_tokens", 0), 0)
        only_for("num_speculative_blocks", GroupKind.MAMBA, integer("num_speculative_blocks", 0), 0)

        mode = self.mamba_mode
        try:
            mode = MambaMode(mode)
        except ValueError:
            raise _spec_error("mamba_mode", "one of none/all/align", mode) from None
        put(self, "mamba_mode", mode)
        if kind != GroupKind.MAMBA and mode != MambaMode.ALIGN:
            raise LayoutError(f"GroupSpec.mamba_mode is only valid for MAMBA groups (leave the "
                              f"default 'align'), got {mode.value!r} for {label}")

        for field in ("eagle", "mla", "transfer"):
            flag(field)
        if self.mla and kind == GroupKind.MAMBA:
            raise LayoutError(f"GroupSpec.mla is only valid for attention groups (FULL, "
                              f"SLIDING_WINDOW, CHUNKED_LOCAL), got True for {label}")

        if self.kernel_block_size is not None:
            k = integer("kernel_block_size", 1)
            if bs % k:
                raise LayoutError(f"GroupSpec.kernel_block_size {k} does not divide block_size "
                                  f"{bs} (the kernel block must divide the logical block)")
        integer("page_bytes", 0)
        if not isinstance(self.name, str):
            raise _spec_error("name", "a str", self.name)
        self._validate_head(kind, label)

    def _validate_head(self, kind: GroupKind, label: str) -> None:
        """The head-shape fields: None (unknown) or in range; shapes on attention groups only."""
        put = object.__setattr__
        for field, lo in (("num_kv_heads", 1), ("head_size", 1), ("head_size_v", 0)):
            v = getattr(self, field)
            if v is None:
                continue
            if not _is_int(v) or v < lo:
                raise _spec_error(field, f"None (unknown) or an int >= {lo}", v)
            if kind == GroupKind.MAMBA:
                raise LayoutError(f"GroupSpec.{field} is only valid for attention groups (FULL, "
                                  f"SLIDING_WINDOW, CHUNKED_LOCAL), got {v!r} for {label}")
            put(self, field, int(v))
        if self.head_size_v is not None and self.head_size is None:
            raise LayoutError(f"GroupSpec.head_size_v needs head_size (vLLM's specs carry both), "
                              f"got head_size_v={self.head_size_v!r} and head_size=None")
        if self.head_size is not None and self.head_size_v is None:
            # vLLM's AttentionSpec default; MLA specs store one latent, no separate V
            put(self, "head_size_v", 0 if self.mla else self.head_size)
        for field in ("dtype", "attn_type"):
            raw = v = getattr(self, field)
            if v is None:
                continue
            if field == "dtype" and isinstance(v, str):
                v = v.removeprefix("torch.")    # str(torch.float16) is accepted as is
            if not isinstance(v, str) or not v.strip():
                raise _spec_error(field, "None (unknown) or a non-empty str", raw)
            put(self, field, v)

    def __repr__(self) -> str:
        """Non-default fields only, enums by name: ``eval``-able with hmacore's names."""
        parts = [f"kind=GroupKind.{self.kind.name}", f"block_size={self.block_size}"]
        for f in dataclasses.fields(self)[2:]:
            v = getattr(self, f.name)
            if v == f.default and type(v) is type(f.default):
                continue
            parts.append(f"{f.name}=" + (f"MambaMode.{v.name}" if isinstance(v, MambaMode)
                                          else repr(v)))
        return f"GroupSpec({', '.join(parts)})"

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
        window = cast(int, self.sliding_window)  # an int >= 1 on SLIDING_WINDOW groups
        if exact:
            return cdiv(window - 1 + self.extra_retained_tokens, self.block_size) + 1
        return cdiv(window, self.block_size) + 1

    def hit_run_blocks(self) -> int:
        """Contiguous cached blocks a sliding-window hit needs: ``cdiv(window - 1, bs)``."""
        if self.kind != GroupKind.SLIDING_WINDOW:
            return 0
        window = cast(int, self.sliding_window)  # an int >= 1 on SLIDING_WINDOW groups
        return cdiv(window - 1, self.block_size)

    def merge_key(self) -> tuple:
        """What a group's layers must share (kind, block size, window, chunk, eagle, Mamba
        mode ...): not the head shape or page bytes, which the layers of one vLLM
        ``UniformTypeKVCacheSpecs`` group may differ in. The hit rule's stricter key is
        ``hmacore.hits._merge_key``."""
        return (self.kind, self.block_size, self.sliding_window, self.chunk_size,
                self.extra_retained_tokens, self.eagle, self.mamba_mode, self.mla,
                self.num_speculative_blocks)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["kind"] = self.kind.name
        d["mamba_mode"] = self.mamba_mode.value
        d["layer_names"] = list(self.layer_names)
        return d

    #: keys a group document may hold: every field, plus ``num_layers`` (names the layers
    #: ``"{name or kind}.{i}"`` when ``layer_names`` is not given).
    DOCUMENT_KEYS = ("kind", "block_size", "layer_names", "num_layers", "sliding_window",
                     "chunk_size", "extra_retained_tokens", "eagle", "mamba_mode",
                     "num_speculative_blocks", "mla", "kernel_block_size", "page_bytes",
                     "transfer", "name", *HEAD_FIELDS)
    REQUIRED_KEYS = ("kind", "block_size")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> GroupSpec:
        """A group from a document (JSON object / TOML table), as :meth:`to_dict` writes it.

        ``kind`` may be a name (any case) or the int value; booleans must be real booleans
        (JSON/TOML ``true``/``false``: the string ``"false"`` is refused, not truthy).
        Unknown keys are refused with a "did you mean"; missing required keys raise
        :class:`~hmacore.errors.LayoutKeyError` naming the key.
        """
        if not isinstance(d, Mapping):
            raise LayoutError(f"a group must be a table/object of GroupSpec fields, got "
                              f"{type(d).__name__} {d!r}")
        d = dict(d)
        _unknown_keys("group fields", d, cls.DOCUMENT_KEYS)
        for key in cls.REQUIRED_KEYS:
            if key not in d:
                raise LayoutKeyError(f"group is missing required key {key!r} (every group needs "
                                     f"{' and '.join(cls.REQUIRED_KEYS)})")
        kind = d.pop("kind")
        if isinstance(kind, str):
            try:
                kind = GroupKind[kind.upper()]
            except KeyError:
                names = [k.name.lower() for k in GroupKind if k in SUPPORTED_KINDS]
                near = difflib.get_close_matches(kind.lower(), names, n=1)
                hint = f" (did you mean {near[0]!r}?)" if near else ""
                raise LayoutError(f"GroupSpec.kind must be one of {', '.join(names)}, got "
                                  f"{kind!r}{hint}") from None
        kind = _resolve_kind(kind)
        layers = d.pop("layer_names", None)
        num_layers = d.pop("num_layers", None)
        if num_layers is not None:
            if not _is_int(num_layers) or num_layers < 1:
                raise LayoutError(f"num_layers must be an int >= 1, got {num_layers!r}")
            if layers is None:
                prefix = d.get("name") or kind.name.lower()
                layers = tuple(f"{prefix}.{i}" for i in range(num_layers))
            elif isinstance(layers, (list, tuple)) and len(layers) != num_layers:
                raise LayoutError(f"num_layers is {num_layers} but layer_names lists "
                                  f"{len(layers)} layers (give one of them, or agree)")
        if isinstance(layers, list):
            layers = tuple(layers)
        return cls(kind=kind, layer_names=() if layers is None else layers, **d)


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
        groups = self.groups
        if isinstance(groups, GroupSpec):
            raise LayoutError("groups must be a sequence of GroupSpec, got one GroupSpec "
                              "(wrap it: groups=(spec,))")
        if isinstance(groups, (str, bytes, Mapping)) or not isinstance(groups, Iterable):
            raise LayoutError(f"groups must be a sequence of GroupSpec, got "
                              f"{type(groups).__name__}")
        groups = tuple(groups)
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
        # A GroupSpec validates itself when built; check again for ones that were not built
        # (unpickled, copied with object.__setattr__), naming the group.
        try:
            spec._validate()
        except LayoutError as e:
            raise type(e)(f"group {g}: {e}").with_traceback(e.__traceback__) from None

    def __repr__(self) -> str:
        """Groups and non-default fields: ``eval``-able with hmacore's names."""
        parts = [f"groups=({', '.join(repr(s) for s in self.groups)},)"]
        for f in dataclasses.fields(self)[1:]:
            v = getattr(self, f.name)
            if v != f.default:
                parts.append(f"{f.name}={v!r}")
        return f"KVLayout({', '.join(parts)})"

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

    def _digest(self, drop: tuple[str, ...] = (), *, unit: bool = True) -> str:
        # unknown head fields are left out: a layout that gives none keeps the digest it had
        # before GroupSpec carried them
        groups = [{k: v for k, v in s.to_dict().items()
                   if k not in drop and not (k in HEAD_FIELDS and v is None)}
                  for s in self.groups]
        doc: dict[str, Any] = {"groups": groups, "cp": self.context_parallel}
        if unit:
            doc["pmu"] = self.prefix_match_unit
        return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:32]

    def fingerprint(self) -> str:
        """Stable hex digest of everything two peers must agree on (not num_blocks)."""
        return self._digest()

    def pairing_fingerprint(self) -> str:
        """Like :meth:`fingerprint` without page bytes and KV heads: what two engines must
        agree on to exchange blocks whatever their TP sizes (a rank's page bytes scale with
        the KV heads it holds; the NIXL handshake checks bytes per head)."""
        return self._digest(drop=("page_bytes", "num_kv_heads"))

    def regrain_fingerprint(self) -> str:
        """Like :meth:`pairing_fingerprint` without everything that follows the block size
        (block and kernel block sizes, page bytes, the prefix-match unit): what two engines
        must agree on to exchange blocks through a block-size remap (hmacore.regrain), whose
        block sizes are compared by their own rule (integer multiples)."""
        return self._digest(drop=("page_bytes", "num_kv_heads", "block_size",
                                  "kernel_block_size"), unit=False)

    def to_dict(self) -> dict[str, Any]:
        return {"groups": [s.to_dict() for s in self.groups], "num_blocks": self.num_blocks,
                "context_parallel": self.context_parallel,
                "prefix_match_unit": self.prefix_match_unit}

    #: keys a layout document may hold (``groups`` is required).
    DOCUMENT_KEYS = ("groups", "num_blocks", "context_parallel", "prefix_match_unit")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> KVLayout:
        """A layout from a document (JSON object / TOML table), as :meth:`to_dict` writes it.

        Unknown keys (top level or in a group) are refused with a "did you mean"; a missing
        ``groups`` (or a group's ``kind``/``block_size``) raises
        :class:`~hmacore.errors.LayoutKeyError`. Group errors are prefixed with ``group {i}:``.
        """
        if not isinstance(d, Mapping):
            raise LayoutError(f"a layout document must be a table/object with a 'groups' list, "
                              f"got {type(d).__name__}")
        _unknown_keys("layout keys", d, cls.DOCUMENT_KEYS)
        if "groups" not in d:
            raise LayoutKeyError("layout document needs a 'groups' list (missing key 'groups')")
        groups = d["groups"]
        if not isinstance(groups, (list, tuple)):
            raise LayoutError(f"'groups' must be a list of group tables, got "
                              f"{type(groups).__name__}")
        specs = []
        for i, g in enumerate(groups):
            try:
                specs.append(GroupSpec.from_dict(g))
            except LayoutError as e:
                raise type(e)(f"group {i}: {e}").with_traceback(e.__traceback__) from None
        return cls(groups=tuple(specs), num_blocks=d.get("num_blocks"),
                   context_parallel=d.get("context_parallel", 1),
                   prefix_match_unit=d.get("prefix_match_unit"))

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> KVLayout:
        """Load a layout from a ``.toml`` file, or JSON (any other name; see docs/embedding.md).

        Raises :class:`~hmacore.errors.ConfigFileError` (an OSError) when the file cannot be
        read, :class:`~hmacore.errors.LayoutError` for a syntax error (with line and column)
        or a rule the layout breaks; every message starts with ``layout file '<path>':``.
        """
        try:
            p = os.fspath(path)
        except TypeError:
            raise ArgumentTypeError(f"path must be a str or os.PathLike, got "
                                    f"{type(path).__name__}") from None
        if isinstance(p, bytes):
            p = os.fsdecode(p)
        where = f"layout file {p!r}"
        is_toml = p.lower().endswith(".toml")
        try:
            with open(p, "rb") as f:
                data = f.read()
        except OSError as e:
            raise ConfigFileError(f"{where}: cannot read it ({e.strerror or e})") from e
        try:
            text = data.decode("utf-8-sig")
            doc = _load_toml(text) if is_toml else json.loads(
                text, object_pairs_hook=_no_duplicate_keys)
        except UnicodeDecodeError as e:
            raise LayoutError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        except _DuplicateKey as e:
            raise LayoutError(f"{where}: JSON object repeats key {e.args[0]!r}") from None
        except ValueError as e:  # json.JSONDecodeError and tomllib.TOMLDecodeError
            fmt = "TOML" if is_toml else "JSON"
            hint = "" if is_toml or p.lower().endswith(".json") else \
                " (files not named *.toml are read as JSON)"
            raise LayoutError(f"{where}: {fmt} syntax error: {e}{hint}") from None
        try:
            return cls.from_dict(doc)
        except LayoutError as e:
            raise type(e)(f"{where}: {e}").with_traceback(e.__traceback__) from None

    def with_num_blocks(self, num_blocks: int) -> KVLayout:
        return dataclasses.replace(self, num_blocks=num_blocks)


class _DuplicateKey(Exception):
    pass


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k)
        out[k] = v
    return out


def _load_toml(text: str) -> Any:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ModuleNotFoundError:
            raise ConfigError("TOML layout files need Python >= 3.11 (tomllib) or the tomli "
                              "package; or write the layout as JSON") from None
    return tomllib.loads(text)


def layer_names(prefix: str, indices: Iterable[int]) -> tuple[str, ...]:
    """``("{prefix}.{i}", ...)`` helper for presets and tests."""
    return tuple(f"{prefix}.{i}" for i in indices)


def groups_from_sequence(specs: Sequence[GroupSpec], **kw: Any) -> KVLayout:
    return KVLayout(groups=tuple(specs), **kw)
