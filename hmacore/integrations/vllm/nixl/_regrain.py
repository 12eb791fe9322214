"""The block-size remap plan between a prefill (source) and a decode (destination) rank, from
what each side knows of itself and what the other's TP-aware handshake said: page models of
each side's kernel (vLLM CPU: K transposed, ``_compat.regrain_page_layout``) and the
:class:`hmacore.regrain.RegrainPlan`. Shared by the pull worker (D builds it) and the push
worker (P builds it).

Mamba groups (TP 1): a state page holds the state tensors back to back from its start
(vLLM ``MambaBase.bind_kv_cache`` views them so), padded to the engine's page size
(``MambaSpec.page_size_padded``: the attention page, which follows ``--block-size``). The
plan copies the unpadded state (``MambaSpec.state_content_size_bytes``, :func:`state_bytes`)
from P's state block to D's. Pull: D's scheduler has checked P's state bytes (its
``kv_transfer_params.remote_state_bytes``) equal D's before any load, so D's worker gives its
own for both sides. Push: P's worker gives its own, and refuses a registration whose
``state`` (D's state bytes) differs before any WRITE; its prompt's last step pairs P's state
block at P's state point with D's slot for the state D registered (``HmaPushWorker.
_state_pair``). A worker given no state bytes refuses Mamba groups of different block sizes
by name (:data:`PUSH_MAMBA_RULE`). Other TP sizes (pull and push): the plan gets the TP
mapping and source rank and pairs the state geometry's byte ranges (hmacore.state_tp); each
side gives its own state bytes and the other's from the geometry (pull: none for P's; push:
:func:`~._tp.state_bytes_at`, D's registration checked against it)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ....errors import LayoutError
from ....regrain import RegrainPlan, TokenPage, plan_pages
from ....spec import GroupKind, KVLayout
from .. import _compat as C

__all__ = ["side_pages", "payload_pages", "worker_pages", "regrain_plan", "state_bytes",
           "check_push_mamba"]

#: why a remap worker given no Mamba state bytes refuses Mamba groups of other block sizes
PUSH_MAMBA_RULE = ("a remap moves a Mamba state by its unpadded bytes and this worker was given "
                   "none (HmaPushWorker(state_bytes=...), which HmaNixlConnector passes from "
                   "its KV cache config); start both engines with the same --block-size")


def check_push_mamba(src_layout: KVLayout, dst_layout: KVLayout) -> None:
    """Without state bytes: LayoutError naming the Mamba groups of different block sizes
    (:data:`PUSH_MAMBA_RULE`); those of equal block sizes move whole pages of equal bytes."""
    mamba = [g for g, (a, b) in enumerate(zip(src_layout.groups, dst_layout.groups))
             if a.kind == GroupKind.MAMBA and a.transfer and b.transfer
             and a.block_size != b.block_size]
    if mamba:
        raise LayoutError(f"groups {mamba} (Mamba): {PUSH_MAMBA_RULE}")


def state_bytes(kv_cache_config: Any, layout: KVLayout) -> list[int | None]:
    """Per group, the unpadded bytes of one layer's Mamba state (None for other groups):
    ``sum(prod(shape) * dtype size)`` over the state tensors (``MambaSpec.
    state_content_size_bytes``), whatever page size the engine padded it to."""
    out: list[int | None] = []
    for grp, spec in zip(kv_cache_config.kv_cache_groups, layout.groups):
        if spec.kind != GroupKind.MAMBA:
            out.append(None)
            continue
        vs = grp.kv_cache_spec
        if isinstance(vs, C.UniformTypeKVCacheSpecs):
            sizes = {int(x.state_content_size_bytes) for x in vs.kv_cache_specs.values()}
            if len(sizes) != 1:
                raise ValueError(f"group of {list(grp.layer_names)}: its Mamba layers hold states "
                                 f"of different bytes {sorted(sizes)}")
            out.append(sizes.pop())
        else:
            out.append(int(vs.state_content_size_bytes))
    return out


def side_pages(layout: KVLayout, plan: Any, *, page_layout: str, kv_dtype: str, head_dim: int,
               shardings: Any, tp_size: int, tp_rank: int) -> list[TokenPage | None]:
    """One side's token pages: its page layout resolved to the model of the kernel that
    writes it (HandshakeError naming an unmodelled CPU kernel), then
    :func:`hmacore.regrain.plan_pages` for that rank's heads."""
    sizes = [s.block_size for s in layout.groups if s.kind != GroupKind.MAMBA]
    name = C.regrain_page_layout(page_layout, kv_dtype, head_dim, max(sizes, default=1))
    return plan_pages(layout, plan, page_layout=name, shardings=shardings, tp_size=tp_size,
                      tp_rank=tp_rank, head_dim=head_dim)


def payload_pages(payload: Any, plan: Any) -> list[TokenPage | None]:
    """:func:`side_pages` of a peer, from its TP-aware handshake payload and its plan."""
    t = payload.tp
    return side_pages(t.kv_layout(), plan, page_layout=t.page_layout, kv_dtype=t.kv_dtype,
                      head_dim=t.head_dim, shardings=t.shardings, tp_size=t.tp_size,
                      tp_rank=t.tp_rank)


def worker_pages(layout: KVLayout, plan: Any, tp: Any) -> list[TokenPage | None]:
    """:func:`side_pages` of this worker (``tp``: its ``WorkerTp``)."""
    return side_pages(layout, plan, page_layout=tp.page_layout, kv_dtype=tp.kv_dtype,
                      head_dim=tp.head_dim, shardings=tp.shardings, tp_size=tp.size,
                      tp_rank=tp.rank)


def regrain_plan(src_layout: KVLayout, dst_layout: KVLayout, src_plan: Any, dst_plan: Any,
                 src_pages: Any, dst_pages: Any, *, tp: Any = None,
                 state: Sequence[int | None] | None = None,
                 src_state: Any = "state") -> RegrainPlan:
    """The RegrainPlan, logged once (both sides' block sizes and page models). ``state``:
    per group the Mamba state bytes both sides hold (:func:`state_bytes`; pull: checked equal
    by D's scheduler; push: by P's worker on each registration); None:
    :func:`check_push_mamba`. ``src_state``: the source's, when they differ (another TP
    size: per-rank states differ and the plan pairs the state geometry's byte ranges; None:
    unknown, only the destination's bound its ranges); default ``state``."""
    if state is None:
        check_push_mamba(src_layout, dst_layout)
    plan = RegrainPlan(src_layout, dst_layout, src_plan, dst_plan, src_pages, dst_pages, tp=tp,
                       src_state_bytes=state if isinstance(src_state, str) else src_state,
                       dst_state_bytes=state)
    C.get_logger(__name__).info(
        "block-size remap: P %s, D %s tokens per block; pages P %s, D %s",
        list(src_layout.block_sizes), list(dst_layout.block_sizes),
        [(p.layout, p.kernel_block_size, len(p.chunks)) for p in src_pages if p],
        [(p.layout, p.kernel_block_size, len(p.chunks)) for p in dst_pages if p])
    return plan
