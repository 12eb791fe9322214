"""A worker's tensor-parallel self-description, read from vLLM, for the TP-aware handshake.

Every hmacore NIXL worker speaks the TP-aware handshake (``HandshakePayload.for_tp_plan``),
whatever its TP size, so that engines of different TP sizes can pair: the payload says the
rank, the TP size and how each group's pages are split across ranks.

Per group (``hmacore.tp.GroupSharding``): MLA groups are replicated (one latent per token on
every rank); attention groups are head-sharded over the model's total KV heads with the rule
of :func:`hmacore.tp.kv_heads_of_rank`, in 1 head-major chunk per block for vLLM's CPU
``LBHNC`` pages (``[heads, block_size, 2*head_size]``) and 2 (K then V) for ``HND``; Mamba
groups are declared as whole pages with their TP-independent state geometry
(``_compat.mamba_state_geometry``; None when the state type is not modelled): equal TP
sizes copy whole pages, and the handshake refuses peers whose geometries differ (e.g. a DS/SD
conv layout mix).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from ....errors import HandshakeError, LayoutError
from ....spec import GroupKind, KVLayout
from ....tp import GroupSharding, kv_heads_of_rank
from .. import _compat as C

__all__ = ["WorkerTp", "worker_tp", "check_rank_peer", "mamba_tp_refusal",
           "state_bytes_at"]


@dataclasses.dataclass(frozen=True)
class WorkerTp:
    """This worker's rank and TP size, shardings (one per group), KV dtype name, head size
    (elements) and page layout (one of hmacore.tp.PAGE_LAYOUTS)."""

    rank: int
    size: int
    shardings: tuple[GroupSharding, ...]
    kv_dtype: str
    head_dim: int
    page_layout: str
    #: per group why a Mamba group has no state geometry ("" otherwise): the worker names
    #: it when it refuses a peer of another TP size
    state_why: tuple[str, ...] = ()

    def handshake_args(self) -> dict[str, Any]:
        """Keyword arguments of ``HandshakePayload.for_tp_plan`` / ``NixlAgent(tp=...)``."""
        return dict(tp_size=self.size, tp_rank=self.rank, shardings=self.shardings,
                    kv_dtype=self.kv_dtype, head_dim=self.head_dim, page_layout=self.page_layout)

    def agent_name(self, engine_id: str) -> str:
        """NIXL agent name of this rank: the engine id at TP = 1, ``<engine>#tp<rank>`` else."""
        return engine_id if self.size == 1 else f"{engine_id}#tp{self.rank}"

    def port(self, base_port: int) -> int:
        """Handshake port of this rank: ``base_port + rank`` (vLLM's NIXL connector rule)."""
        return int(base_port) + self.rank


def _spec(group: Any) -> Any:
    spec = group.kv_cache_spec
    if isinstance(spec, C.UniformTypeKVCacheSpecs):
        spec = next(iter(spec.kv_cache_specs.values()))
    return spec


def worker_tp(vllm_config: Any, kv_cache_config: Any, layout: KVLayout) -> WorkerTp:
    """The TP description of this worker (rank from vLLM's TP group when TP > 1).

    Raises LayoutError naming the group when a group's per-rank KV heads do not follow vLLM's
    sharding of the model's total KV heads; RuntimeError when TP > 1 outside a vLLM worker.
    """
    rank, size = C.tp_rank_and_size(vllm_config)
    page_layout = C.kv_cache_layout_name(vllm_config) or "NHD"  # unknown: no head slicing
    chunks = 1 if page_layout in ("LBHNC", "LBNHC") else 2
    total = C.total_kv_heads(vllm_config)
    shardings = []
    why: list[str] = []
    kv_dtype, head_dim = "none", 1
    for g, (grp, gs) in enumerate(zip(kv_cache_config.kv_cache_groups, layout.groups)):
        spec = _spec(grp)
        why.append("")
        if gs.kind == GroupKind.MAMBA:
            # whole pages at equal TP; the state geometry (None when not modelled) lets a
            # peer of another TP size pair (hmacore.state_tp) and refuses DS/SD mixes
            ctx = getattr(getattr(vllm_config, "compilation_config", None),
                          "static_forward_context", None) or {}
            layer = ctx.get(grp.layer_names[0]) if grp.layer_names else None
            geo, why[g] = C.mamba_state_geometry(spec, size, layer)
            shardings.append(GroupSharding(1, 1, True, state=geo))
            continue
        if gs.mla:
            shardings.append(GroupSharding(1, 1, True))
            if gs.mla and kv_dtype == "none":
                kv_dtype, head_dim = str(spec.dtype), int(spec.head_size)
            continue
        per_rank = int(spec.num_kv_heads)
        h = total if total is not None else per_rank * size
        lo, hi = kv_heads_of_rank(h, size, rank)
        if hi - lo != per_rank:
            raise LayoutError(f"group {g}: {per_rank} KV heads per rank, but the model's {h} "
                              f"KV heads over TP {size} give rank {rank} {hi - lo} (vLLM's rule)")
        shardings.append(GroupSharding(h, chunks, False))
        if kv_dtype == "none":
            kv_dtype, head_dim = str(spec.dtype), int(spec.head_size)
    return WorkerTp(rank, size, tuple(shardings), kv_dtype, head_dim, page_layout, tuple(why))


def check_rank_peer(payload: Any, rank: int, tp_size: int, where: str, block_sizes,
                    why: str) -> None:
    """The handshake answered at ``where`` must come from rank ``rank`` of a TP-``tp_size``
    engine (``why`` says where that expectation comes from) with equal block sizes (the vLLM
    connector pairs only those); HandshakeError naming the peer otherwise."""
    said = (payload.tp.tp_rank, payload.tp.tp_size) if payload.tp is not None else (0, 1)
    if said != (rank, tp_size):
        raise HandshakeError(f"peer {payload.agent_name!r} at {where} is rank {said[0]} of TP "
                             f"{said[1]}; {why}")
    if tuple(payload.block_sizes) != tuple(block_sizes):
        raise HandshakeError(f"peer {payload.agent_name!r} has block sizes "
                             f"{list(payload.block_sizes)}, this engine {list(block_sizes)}: the "
                             "vLLM connector pairs engines with equal block sizes only")


def mamba_tp_refusal(layout: KVLayout, tp: WorkerTp | None, my_tp: int, peer_tp: int,
                     remap: bool = False) -> str | None:
    """Why this rank's Mamba groups cannot pair with a peer engine of TP ``peer_tp``, or None.
    Equal TP sizes move whole state pages (rank i to rank i). Between different TP sizes,
    with or without a block-size ``remap``, each Mamba group needs this rank's state geometry
    (hmacore.state_tp byte ranges; the handshake then requires the peer's equal, which
    refuses a DS/SD conv layout mix by field): a remap pairs those ranges inside its
    RegrainPlan (``tp=(mapping, source rank)``), block ids from each side's state table.
    Used by push mode per decode peer (both sides); pull checks the same in its worker."""
    if peer_tp == my_tp:
        return None
    for g, s in enumerate(layout.groups):
        if s.kind != GroupKind.MAMBA or not s.transfer:
            continue
        if tp is None:
            why = "this worker has no TP description"
        elif tp.shardings[g].state is None:
            why = (tp.state_why[g] if tp.state_why else "") or \
                "its state type is not modelled across TP sizes"
        else:
            continue
        via = " (a block-size remap included)" if remap else ""
        return (f"group {g} is Mamba state without a state geometry ({why}); its pages pair "
                f"only between equal TP sizes{via} (this rank: TP {my_tp}, peer: TP {peer_tp})")
    return None


def state_bytes_at(tp: WorkerTp | None, layout: KVLayout, tp_size: int) -> list[int | None]:
    """Per group the unpadded bytes of one layer's Mamba state on a rank of a TP-``tp_size``
    engine, from this worker's state geometry (``GlobalStateGeometry.at(tp_size).
    content_bytes``, which equals vLLM's ``MambaSpec.state_content_size_bytes`` at that TP
    size); None for other groups and Mamba groups without a geometry. A push remap across TP
    sizes bounds the other side's state ranges with it and checks D's registered ``state``
    against it."""
    out: list[int | None] = []
    for g, s in enumerate(layout.groups):
        geo = tp.shardings[g].state if tp is not None and s.kind == GroupKind.MAMBA else None
        out.append(None if geo is None else int(geo.at(tp_size).content_bytes))
    return out
