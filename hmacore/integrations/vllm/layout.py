"""Translate vLLM's ``KVCacheConfig`` into hmacore's :class:`~hmacore.spec.KVLayout`.

One function, :func:`layout_from_kv_cache_config`. Units carried over unchanged: block sizes,
windows and chunks in tokens (attention block sizes scaled by the decode-context-parallel
factor exactly as vLLM's ``resolve_dcp_kv_block_size`` does); ``page_bytes`` is bytes of one
block of one layer. Group ids are vLLM's group indices.

Unsupported configurations raise :class:`~hmacore.errors.LayoutError` naming the group and
the rule: cross-attention and encoder-only groups, spec classes hmacore has no kind for
(R-SWA, sink, hidden-state, circular buffer, HiSparse), host-resident groups, bounded-replay
sliding-window MLA, ``UniformTypeKVCacheSpecs`` whose layers disagree on kind or window,
more than one group with context parallelism > 1, and (``for_store=True``) Mamba groups not in
``align`` mode or groups whose specs vLLM's hit rule keeps apart but hmacore's GroupSpec fields
cannot tell apart.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from ...errors import LayoutError
from ...hits import _merge_key
from ...spec import HEAD_FIELDS, GroupKind, GroupSpec, KVLayout, MambaMode
from . import _compat as C

__all__ = ["layout_from_kv_cache_config", "group_from_spec"]


def _name(spec: Any) -> str:
    return type(spec).__name__


def _head_fields(spec: Any) -> dict[str, Any]:
    """GroupSpec's head-shape fields read from a spec (the parts of vLLM's spec equality
    beyond kind, block size and window that GroupSpec carries)."""
    if isinstance(spec, C.MambaSpec):
        mamba_type = getattr(spec.mamba_type, "name", spec.mamba_type)
        return dict(dtype=",".join(str(d).removeprefix("torch.") for d in spec.dtypes),
                    attn_type=f"{_name(spec)}:{mamba_type}")
    return dict(num_kv_heads=int(spec.num_kv_heads), head_size=int(spec.head_size),
                head_size_v=int(spec.head_size_v), dtype=str(spec.dtype), attn_type=_name(spec))


def group_from_spec(g: int, spec: Any, *, layer_names=(), eagle: bool = False,
                    transfer: bool = True, dcp: int = 1) -> GroupSpec:
    """One vLLM ``KVCacheSpec`` (not a UniformTypeKVCacheSpecs) as a :class:`GroupSpec`.

    ``g`` is the group index used in error messages; ``dcp`` the decode-context-parallel
    size (attention block sizes are multiplied by it when the spec is DCP-sharded). The
    head-shape fields (``num_kv_heads``, ``head_size``, ``head_size_v``, ``dtype``,
    ``attn_type``) come from the spec, so the hit rule merges groups as vLLM does.
    """
    bs = int(spec.block_size) * (dcp if getattr(spec, "dcp_sharded", False) else 1)
    page = int(getattr(spec, "page_size_bytes", 0) or 0)
    common = dict(block_size=bs, layer_names=tuple(layer_names), eagle=bool(eagle),
                  transfer=bool(transfer), page_bytes=page, name=_name(spec))
    if isinstance(spec, C.CrossAttentionSpec):
        raise LayoutError(f"group {g}: {_name(spec)} (cross-attention) is not supported: its "
                          "blocks are sized by encoder length, never prefix-cached or transferred")
    if isinstance(spec, C.EncoderOnlyAttentionSpec):
        raise LayoutError(f"group {g}: {_name(spec)} (encoder-only attention) is not supported: "
                          "it holds no decoder KV to cache or transfer")
    if isinstance(spec, C.UNSUPPORTED_FULL_SUBCLASSES + C.UNSUPPORTED_OTHER):
        raise LayoutError(f"group {g}: {_name(spec)} is not supported: hmacore's group kinds "
                          "are FULL, SLIDING_WINDOW, CHUNKED_LOCAL and MAMBA only")
    if isinstance(spec, C.SlidingWindowSpec):  # includes SlidingWindowMLASpec
        if getattr(spec, "bounded_replay", False):
            raise LayoutError(f"group {g}: {_name(spec)} with bounded_replay=True is not "
                              "supported: its blocks are not prefix-cacheable (replayed window)")
        return GroupSpec(GroupKind.SLIDING_WINDOW, sliding_window=int(spec.sliding_window),
                         extra_retained_tokens=int(getattr(spec, "extra_retained_tokens", 0)),
                         mla=isinstance(spec, C.SlidingWindowMLASpec), **common,
                         **_head_fields(spec))
    if isinstance(spec, C.ChunkedLocalAttentionSpec):
        return GroupSpec(GroupKind.CHUNKED_LOCAL, chunk_size=int(spec.attention_chunk_size),
                         **common, **_head_fields(spec))
    if isinstance(spec, C.FullAttentionSpec):
        # A FullAttentionSpec with sliding_window / attention_chunk_size set is what vLLM
        # builds when HMA is off; its manager is the full-attention one (never frees).
        return GroupSpec(GroupKind.FULL, mla=isinstance(spec, C.MLAAttentionSpec), **common,
                         **_head_fields(spec))
    if isinstance(spec, C.MambaSpec):
        mode = str(spec.mamba_cache_mode)
        if mode not in {m.value for m in MambaMode}:
            raise LayoutError(f"group {g}: {_name(spec)} has unknown mamba_cache_mode {mode!r}")
        return GroupSpec(GroupKind.MAMBA, mamba_mode=MambaMode(mode),
                         num_speculative_blocks=int(spec.num_speculative_blocks), **common,
                         **_head_fields(spec))
    raise LayoutError(f"group {g}: spec class {_name(spec)} is not supported: hmacore's group "
                      "kinds are FULL, SLIDING_WINDOW, CHUNKED_LOCAL and MAMBA only")


def _unwrap(g: int, spec: Any, **kw: Any) -> GroupSpec:
    """Translate a group's spec; a UniformTypeKVCacheSpecs must agree on everything hmacore
    keys a group by (kind, block size, window, chunk, Mamba mode ...)."""
    if not isinstance(spec, C.UniformTypeKVCacheSpecs):
        return group_from_spec(g, spec, **kw)
    inner = list(spec.kv_cache_specs.items())
    if not inner:
        raise LayoutError(f"group {g}: UniformTypeKVCacheSpecs holds no layer specs")
    first = group_from_spec(g, inner[0][1], **kw)
    pages = set()
    heads: dict[str, set] = {f: set() for f in HEAD_FIELDS}
    for layer, s in inner:
        other = group_from_spec(g, s, **kw)
        for f in HEAD_FIELDS:
            heads[f].add(getattr(other, f))
        if other.merge_key() != first.merge_key():
            raise LayoutError(
                f"group {g}: UniformTypeKVCacheSpecs mixes layers hmacore cannot put in one "
                f"group (layer {layer!r} is {other.kind.name} bs={other.block_size} "
                f"window={other.sliding_window}, layer {inner[0][0]!r} is {first.kind.name} "
                f"bs={first.block_size} window={first.sliding_window}); rule: one group = one "
                "kind, block size and window")
        pages.add(other.page_bytes)
    # page_bytes is per layer; layers of a uniform-type group may differ (packed layouts):
    # 0 = "not one number", plans must then read the per-layer specs. Head fields the
    # layers disagree on are unknown (None); the three shape fields go together. (vLLM
    # builds such a group only as a model's single group: nothing to merge it with.)
    unknown = {f for f, values in heads.items() if len(values) > 1}
    if unknown & {"num_kv_heads", "head_size", "head_size_v"}:
        unknown |= {"num_kv_heads", "head_size", "head_size_v"}
    page = pages.pop() if len(pages) == 1 else 0
    return dataclasses.replace(first, page_bytes=page, **dict.fromkeys(unknown))


def _spec_difference(a: Any, b: Any) -> str:
    if type(a) is not type(b):
        return f"spec class {_name(a)} vs {_name(b)}"
    fields = [f.name for f in dataclasses.fields(a) if getattr(a, f.name) != getattr(b, f.name)]
    return "fields " + ", ".join(fields)


def _check_hit_merges(groups: list[GroupSpec], specs: list[Any]) -> None:
    """Refuse groups hmacore's hit rule would merge while vLLM's keeps them apart.

    vLLM looks up together the groups whose KVCacheSpecs are equal; hmacore those whose
    ``hits._merge_key`` fields are. Those fields are read from the spec, so equal specs
    always merge in both; specs equal in every field GroupSpec carries but different in
    another one (say Mamba state shapes under one padded page size) would merge in
    hmacore only, and the hit could differ from vLLM's.
    """
    first: dict[tuple, int] = {}
    for g, s in enumerate(groups):
        if not (s.transfer and s.prefix_cacheable):
            continue       # the hit rule looks up these groups only
        f = first.setdefault(_merge_key(s), g)
        if f != g and specs[f] != specs[g]:
            raise LayoutError(
                f"groups {f} and {g}: vLLM's hit rule looks them up apart (their "
                f"{_name(specs[g])}s differ in {_spec_difference(specs[f], specs[g])}) but "
                "hmacore's GroupSpec fields cannot tell them apart; rule: groups that agree on "
                "kind, block size, window, chunk, Mamba mode, MLA, head shape, dtype, type and "
                "page bytes must have equal vLLM specs")


def layout_from_kv_cache_config(kv_cache_config: Any, *, vllm_config: Any = None,
                                for_store: bool = False) -> KVLayout:
    """Build the :class:`KVLayout` equivalent of a vLLM ``KVCacheConfig``.

    Args:
        kv_cache_config: ``vllm.v1.kv_cache_interface.KVCacheConfig`` (scheduler's or a
            worker's; ``UniformTypeKVCacheSpecs`` groups are unwrapped).
        vllm_config: optional ``VllmConfig``; supplies the context-parallel sizes and
            ``cache_config.prefix_match_unit``. Without it, CP = 1 and the hash block size
            is the gcd of prefix-cacheable block sizes (or ``kv_cache_config.hash_block_size``
            when the engine core already resolved it).
        for_store: the layout is for a hash-addressed store (Mooncake / embedded store):
            additionally require every transferred Mamba group to be in ``align`` mode, and
            that hmacore's hit rule merges exactly the groups vLLM's merges (equal specs).

    Returns:
        KVLayout with one GroupSpec per vLLM group (same order), ``num_blocks`` from the
        config. Its ``scheduler_block_size`` / ``hash_block_size`` / ``window_blocks()``
        equal vLLM's values for the same config (tests/vllm/test_layout.py checks this),
        except that vLLM falls back to ``hash_block_size == scheduler_block_size`` when a
        Mamba group is not in ``align`` mode (hashes are then unused: no prefix caching of
        such models), where hmacore keeps the gcd of the prefix-cacheable groups.

    Raises:
        LayoutError: naming the group and the rule (see the module docstring).
    """
    groups_in = list(kv_cache_config.kv_cache_groups)
    if not groups_in:
        raise LayoutError("kv_cache_config has no KV cache groups (attention-free model): "
                          "nothing for a KV connector to move")
    dcp, pcp = C.context_parallel_sizes(vllm_config)
    if (dcp > 1 or pcp > 1) and len(groups_in) > 1:
        raise LayoutError(
            f"kv_cache_config has {len(groups_in)} groups with decode_context_parallel_size="
            f"{dcp}, prefill_context_parallel_size={pcp}: rule: context parallelism > 1 is "
            "only supported with a single KV cache group")
    groups = []
    for g, grp in enumerate(groups_in):
        if getattr(grp, "host_resident", False):
            raise LayoutError(f"group {g}: host-resident (HiSparse) groups live in a second "
                              "block pool; hmacore supports one shared pool only")
        groups.append(_unwrap(g, grp.kv_cache_spec, layer_names=grp.layer_names,
                              eagle=getattr(grp, "is_eagle_group", False),
                              transfer=getattr(grp, "enable_kv_transfer", True), dcp=dcp))
    if for_store:
        _check_hit_merges(groups, [grp.kv_cache_spec for grp in groups_in])
    unit = None
    if len(groups) > 1:
        if vllm_config is not None:
            unit = vllm_config.cache_config.prefix_match_unit
        if unit is None and getattr(kv_cache_config, "hash_block_size", None):
            resolved = int(kv_cache_config.hash_block_size)
            # The engine core's resolved value, when it is one hmacore can express.
            if all(s.block_size % resolved == 0 for s in groups if s.prefix_cacheable):
                unit = resolved
    layout = KVLayout(groups=tuple(groups), num_blocks=int(kv_cache_config.num_blocks),
                      context_parallel=max(dcp, 1) * max(pcp, 1), prefix_match_unit=unit)
    if for_store:
        layout.check_hash_addressable()
    return layout
