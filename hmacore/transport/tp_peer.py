"""What a peer of another TP size tells us: agent, TP size and rank, shardings, regions.

A TP-aware ``HandshakePayload`` (``HandshakePayload.for_tp_plan``, exchanged over the socket
handshake) carries it; :func:`tp_pair_plans` turns the payloads a decode rank received from its
source ranks into the TpMapping and TpPairPlans (one per source rank). :class:`TpPeerInfo` is
the same description without the handshake (kept for callers that carry it themselves), and
:meth:`TpPeerInfo.block_size_ratio` checks that two sides can pair: same groups (kinds, MLA
flags, layer names) and shardings, and every attention group's local block size an equal
whole multiple of the remote one (state groups equal).
No nixl import. Units: block sizes in tokens; regions as ``TransferPlan.region_table()``.
"""
from __future__ import annotations

import base64
import dataclasses
import json
from typing import Any

from collections.abc import Iterable

from ..errors import HandshakeError
from ..plan import TransferPlan
from ..spec import GroupKind, KVLayout
from ..tp import GroupSharding, TpMapping, TpPairPlan, build_pair_plans
from .handshake import HandshakePayload

__all__ = ["TpPeerInfo", "TP_INFO_VERSION", "tp_pair_plans"]

TP_INFO_VERSION = 1


@dataclasses.dataclass(frozen=True)
class TpPeerInfo:
    """One rank's self-description for heterogeneous-TP peers."""

    agent_name: str
    agent_metadata: bytes
    tp_size: int
    tp_rank: int
    layout: dict[str, Any]
    shardings: tuple[tuple[int, int, bool], ...]
    regions: tuple[dict[str, Any], ...]
    mem_type: str = "DRAM"
    version: int = TP_INFO_VERSION

    @classmethod
    def for_plan(cls, plan: TransferPlan, agent_name: str, agent_metadata: bytes, *, tp_size: int,
                 tp_rank: int, shardings) -> TpPeerInfo:
        return cls(agent_name, bytes(agent_metadata), int(tp_size), int(tp_rank),
                   plan.layout.to_dict(),
                   tuple((s.num_heads, s.chunks, bool(s.replicated)) for s in shardings),
                   tuple(plan.region_table()), plan.mem_type)

    @classmethod
    def from_handshake(cls, payload: HandshakePayload) -> TpPeerInfo:
        """The TP description a TP-aware handshake payload delivered (HandshakeError if the
        payload has none)."""
        if payload.tp is None:
            raise HandshakeError(f"peer {payload.agent_name!r} sent no TP description")
        t = payload.tp
        return cls(payload.agent_name, payload.agent_metadata, t.tp_size, t.tp_rank,
                   dict(t.layout), tuple(t.shardings), tuple(payload.regions), payload.mem_type)

    def to_bytes(self) -> bytes:
        d = dataclasses.asdict(self)
        d["agent_metadata"] = base64.b64encode(self.agent_metadata).decode()
        return json.dumps(d).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> TpPeerInfo:
        try:
            d = json.loads(data)
            info = cls(str(d["agent_name"]), base64.b64decode(d["agent_metadata"]),
                       int(d["tp_size"]), int(d["tp_rank"]), dict(d["layout"]),
                       tuple((int(h), int(k), bool(r)) for h, k, r in d["shardings"]),
                       tuple(dict(r) for r in d["regions"]), str(d["mem_type"]), int(d["version"]))
        except (ValueError, KeyError, TypeError) as e:
            raise HandshakeError(f"malformed TP peer info: {e}") from None
        if info.version != TP_INFO_VERSION:
            raise HandshakeError(f"TP peer info version {info.version}, this side speaks "
                                 f"{TP_INFO_VERSION}")
        if not 0 <= info.tp_rank < info.tp_size:
            raise HandshakeError(f"tp_rank {info.tp_rank} is not in [0, {info.tp_size})")
        return info

    def kv_layout(self) -> KVLayout:
        return KVLayout.from_dict(self.layout)

    def group_shardings(self) -> tuple[GroupSharding, ...]:
        return tuple(GroupSharding(h, k, r) for h, k, r in self.shardings)

    def remote_plan(self, local_layout: KVLayout) -> TransferPlan:
        """The peer's plan over the local layout's group ids (addresses are the peer's)."""
        return TransferPlan.from_region_table(local_layout, self.regions, mem_type=self.mem_type)

    def block_size_ratio(self, local: TpPeerInfo) -> int:
        """Local block size / this peer's, equal for every attention group (state groups must
        match); raises HandshakeError naming the first disagreement."""
        mine, theirs = local.kv_layout(), self.kv_layout()
        if mine.num_groups != theirs.num_groups:
            raise HandshakeError(f"peer {self.agent_name!r} has {theirs.num_groups} groups, "
                                 f"local {mine.num_groups}")
        if local.shardings != self.shardings:
            raise HandshakeError(f"peer {self.agent_name!r} shards heads differently: "
                                 f"{list(self.shardings)} vs local {list(local.shardings)}")
        ratios = set()
        for g, (a, b) in enumerate(zip(mine.groups, theirs.groups)):
            if (a.kind, a.mla, a.layer_names) != (b.kind, b.mla, b.layer_names):
                raise HandshakeError(f"group {g}: peer {self.agent_name!r} has kind {b.kind.name}, "
                                     f"mla {b.mla}, {len(b.layer_names)} layers; local {a.kind.name}, "
                                     f"mla {a.mla}, {len(a.layer_names)} layers")
            if a.kind == GroupKind.MAMBA:
                if a.block_size != b.block_size:
                    raise HandshakeError(f"group {g}: state block size {b.block_size} != local "
                                         f"{a.block_size}")
                continue
            if a.block_size % b.block_size:
                raise HandshakeError(f"group {g}: local block size {a.block_size} is not a multiple "
                                     f"of the peer's {b.block_size}")
            ratios.add(a.block_size // b.block_size)
        if len(ratios) > 1:
            raise HandshakeError(f"block-size ratios differ between groups: {sorted(ratios)}")
        return ratios.pop() if ratios else 1


def tp_pair_plans(local: HandshakePayload, local_plan: TransferPlan,
                  peers: Iterable[HandshakePayload]
                  ) -> tuple[TpMapping, dict[int, TpPairPlan], int]:
    """``(mapping, {source rank: TpPairPlan}, block_size_ratio)`` for this (decode) rank from
    what the handshakes with the remote (prefill) ranks delivered.

    ``local`` is this rank's TP-aware payload (``for_tp_plan`` over ``local_plan``); ``peers``
    the payloads received from remote ranks (at least every rank the mapping reads; extra
    ranks are ignored). Checks every peer's compatibility again, that the peers agree on one
    TP size and name distinct ranks, that every source rank was reached, and the block-size
    ratio (local block = ratio x remote block). Raises HandshakeError naming what is wrong;
    LayoutError from the plan builders for unsupported layouts (see hmacore.tp)."""
    if local.tp is None:
        raise HandshakeError("local payload has no TP description (use for_tp_plan)")
    mine = TpPeerInfo.from_handshake(local)
    by_rank: dict[int, HandshakePayload] = {}
    sizes = set()
    for p in peers:
        local.check_compatible(p)
        assert p.tp is not None  # check_compatible requires it
        if p.tp.tp_rank in by_rank:
            raise HandshakeError(f"peers {by_rank[p.tp.tp_rank].agent_name!r} and "
                                 f"{p.agent_name!r} both claim remote rank {p.tp.tp_rank}")
        by_rank[p.tp.tp_rank] = p
        sizes.add(p.tp.tp_size)
    if not by_rank:
        raise HandshakeError("peers is empty: handshake with the remote ranks first")
    if len(sizes) > 1:
        raise HandshakeError(f"peers disagree on their TP size: {sorted(sizes)}")
    layout = local_plan.layout
    # the state geometries (equal on both sides when both sent one: check_compatible)
    shardings = tuple(dataclasses.replace(sh, state=local.tp.state_geometry(g))
                      for g, sh in enumerate(mine.group_shardings()))
    mapping = TpMapping(layout, shardings, local_tp=local.tp.tp_size,
                        local_rank=local.tp.tp_rank, remote_tp=sizes.pop(),
                        page_layout=local.tp.page_layout)
    missing = [r for r in mapping.remote_ranks if r not in by_rank]
    if missing:
        raise HandshakeError(f"local rank {local.tp.tp_rank} reads from remote ranks "
                             f"{list(mapping.remote_ranks)} but has no handshake with {missing}")
    ratios = {TpPeerInfo.from_handshake(by_rank[r]).block_size_ratio(mine)
              for r in mapping.remote_ranks}
    ratio = ratios.pop()  # one value: check_compatible enforces a single ratio
    plans = {r: by_rank[r].remote_plan(layout) for r in mapping.remote_ranks}
    return mapping, build_pair_plans(mapping, local_plan, plans, block_size_ratio=ratio), ratio
