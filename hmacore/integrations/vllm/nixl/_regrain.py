"""The block-size remap plan between a prefill (source) and a decode (destination) rank, from
what each side knows of itself and what the other's TP-aware handshake said: page models of
each side's kernel (vLLM CPU: K transposed, ``_compat.regrain_page_layout``) and the
:class:`hmacore.regrain.RegrainPlan`. Shared by the pull worker (D builds it) and the push
worker (P builds it)."""
from __future__ import annotations

from typing import Any

from ....regrain import RegrainPlan, TokenPage, plan_pages
from ....spec import GroupKind, KVLayout
from .. import _compat as C

__all__ = ["side_pages", "payload_pages", "worker_pages", "regrain_plan"]


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
                 src_pages: Any, dst_pages: Any, *, tp: Any = None) -> RegrainPlan:
    """The RegrainPlan, logged once (both sides' block sizes and page models)."""
    plan = RegrainPlan(src_layout, dst_layout, src_plan, dst_plan, src_pages, dst_pages, tp=tp)
    C.get_logger(__name__).info(
        "block-size remap: P %s, D %s tokens per block; pages P %s, D %s",
        list(src_layout.block_sizes), list(dst_layout.block_sizes),
        [(p.layout, p.kernel_block_size, len(p.chunks)) for p in src_pages if p],
        [(p.layout, p.kernel_block_size, len(p.chunks)) for p in dst_pages if p])
    return plan
