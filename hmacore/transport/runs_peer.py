"""What every transport shares about byte-run peers (a block-size remap, :mod:`hmacore.regrain`):
the handshake rules and the peer's plan over its own layout (:func:`regrain_peer_plan`), and
the bounds check of a transfer's ``(addr, bytes, dev)`` rows (:func:`checked_runs`).

Used by :class:`~hmacore.transport.nixl.NixlAgent` and
:class:`~hmacore.transport.mooncake_te.MooncakeTeAgent` (``add_regrain_peer``, ``read_runs`` /
``write_runs``) and by the descriptor drivers' ``post_runs``. Imports no transport library.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import HandshakeError, HmacoreError, TransferError
from ..plan import TransferPlan
from ..runs import desc_table
from ..spec import GroupKind, KVLayout
from .base import Transfer
from .handshake import HandshakePayload

__all__ = ["checked_runs", "desc_runs", "regrain_peer_plan", "regrain_remote_layout",
           "runs_transfer"]


def regrain_remote_layout(mine: HandshakePayload, payload: HandshakePayload, layout: KVLayout,
                          remote_layout: KVLayout | None = None) -> KVLayout:
    """The layout of a same-TP peer whose attention block sizes differ from ``layout``'s.

    ``mine``: this side's handshake payload. TP-aware payloads: the TP rule (which allows one
    block-size ratio) is checked and the peer's layout comes from its TP description.
    Otherwise version, HMA on/off and group count must agree, and ``remote_layout`` defaults
    to ``layout`` with the peer's block size per attention group and page bytes scaled by the
    same ratio (Mamba groups: equal block sizes); its block sizes and fingerprint must equal
    the payload's. Raises HandshakeError naming the peer and the rule."""
    from ..regrain import block_size_ratio
    who = f"peer {payload.agent_name!r}"
    if payload.tp is not None or mine.tp is not None:
        mine.check_compatible(payload)
        assert payload.tp is not None
        return remote_layout or payload.tp.kv_layout()
    for field, a, b in (("version", mine.version, payload.version),
                        ("HMA on/off", mine.hma, payload.hma),
                        ("group count", len(mine.block_sizes), len(payload.block_sizes))):
        if a != b:
            raise HandshakeError(f"{who} disagrees on {field}: local {a!r}, remote {b!r}")
    if remote_layout is None:
        groups = []
        for g, (spec, bs) in enumerate(zip(layout.groups, payload.block_sizes)):
            bs = int(bs)
            try:
                if spec.kind == GroupKind.MAMBA or bs == spec.block_size:
                    if bs != spec.block_size:
                        raise HandshakeError(f"state group {g} has {spec.block_size}-token "
                                             f"blocks locally, {bs} remotely")
                    groups.append(spec)
                    continue
                block_size_ratio(bs, spec.block_size)
                pb = spec.page_bytes * bs // spec.block_size
                groups.append(dataclasses.replace(spec, block_size=bs, page_bytes=pb))
            except HmacoreError as e:
                raise HandshakeError(f"{who}: group {g}: {e}") from None
        remote_layout = dataclasses.replace(layout, groups=tuple(groups))
    if tuple(remote_layout.block_sizes) != tuple(payload.block_sizes) \
            or remote_layout.fingerprint() != payload.layout_fingerprint:
        raise HandshakeError(f"{who} disagrees on the layout beyond block sizes (its "
                             f"fingerprint {payload.layout_fingerprint}, block sizes "
                             f"{list(payload.block_sizes)}; expected "
                             f"{remote_layout.fingerprint()}, "
                             f"{list(remote_layout.block_sizes)})")
    return remote_layout


def regrain_peer_plan(mine: HandshakePayload, payload: HandshakePayload, layout: KVLayout,
                      remote_layout: KVLayout | None = None) -> TransferPlan:
    """The peer's TransferPlan over its own layout (:func:`regrain_remote_layout`) from its
    region table; HandshakeError naming the peer when the layout or the table is refused.
    Nothing is loaded into a transport: the caller adopts the peer once this returned."""
    layout_r = regrain_remote_layout(mine, payload, layout, remote_layout)
    try:
        return TransferPlan.from_region_table(layout_r, payload.regions,
                                              mem_type=payload.mem_type)
    except HmacoreError as e:
        raise HandshakeError(f"peer {payload.agent_name!r}: bad region table: {e}") from None


def checked_runs(local_rows, remote_rows, local_ranges: Sequence[tuple[int, int, int]],
                 remote_ranges: Sequence[tuple[int, int, int]], *, allow_empty: bool = True
                 ) -> tuple[np.ndarray, np.ndarray]:
    """``(local, remote)`` as contiguous M x 3 uint64 ``(addr, bytes, dev)`` arrays, after
    checking that row i of one pairs with row i of the other (equal lengths; at least one row
    unless ``allow_empty``) and that every row lies inside its side's registered memory.
    Raises ValueError naming the rule or the row (callers turn it into their TransferError)."""
    loc = np.ascontiguousarray(local_rows, dtype=np.uint64).reshape(-1, 3)
    rem = np.ascontiguousarray(remote_rows, dtype=np.uint64).reshape(-1, 3)
    if loc.shape != rem.shape or (not allow_empty and not loc.shape[0]) \
            or not np.array_equal(loc[:, 1], rem[:, 1]):
        raise ValueError("runs: local and remote rows must pair up with equal lengths"
                         + ("" if allow_empty else " (at least one row)")
                         + f"; got {loc.shape[0]} local, {rem.shape[0]} remote rows")
    try:   # every row inside registered memory on its side (raises naming the row)
        desc_table(loc, local_ranges)
    except HmacoreError as e:
        raise ValueError(f"local runs outside registered memory: {e}") from None
    try:
        desc_table(rem, remote_ranges)
    except HmacoreError as e:
        raise ValueError(f"remote runs outside registered memory: {e}") from None
    return loc, rem


def runs_transfer(agent: Any, op: str, request_id: str, peer: str, runs,
                  peer_plan: TransferPlan, notif: bytes | None, mechanism: str
                  ) -> tuple[Transfer, np.ndarray, np.ndarray]:
    """The :class:`Transfer` of ``agent``'s (a :class:`~hmacore.transport.base.TransferPosting`
    driver with ``send_notif``) ``read_runs`` / ``write_runs`` (``runs.local`` /
    ``runs.remote`` rows inside ``agent.plan``'s and ``peer_plan``'s registration ranges,
    :func:`checked_runs`; one descriptor per row, posted by ``mechanism``) and its rows. A
    bad row: TransferError recorded by ``agent._fail`` (nothing posted). No rows: the transfer
    is DONE already (no valid blocks; ``notif`` sent alone); the caller returns it without
    posting."""
    try:
        loc, rem = checked_runs(runs.local, runs.remote, agent.plan.registration_ranges(),
                                peer_plan.registration_ranges())
    except ValueError as e:
        raise agent._fail(request_id, f"{op} to {peer!r}: {e}") from None
    m = int(loc.shape[0])
    t = Transfer(request_id, op, peer, (), m, int(loc[:, 1].sum()) if m else 0,
                 posted_at=time.monotonic(), block_descriptors=m, runs=m, mechanism=mechanism)
    if not m:
        t.state = "DONE"
        agent._valid[request_id] = ()
        if notif is not None:
            agent.send_notif(peer, request_id, bytes(notif))
    return t, loc, rem


def desc_runs(op: str, remote: str, run_ranges: dict, own_ranges, local_rows, remote_rows
              ) -> tuple[np.ndarray, np.ndarray]:
    """The rows of a descriptor driver's ``post_runs`` (:func:`checked_runs`, at least one
    row) to a peer of ``run_ranges`` (``add_runs_peer``); TransferError naming the op, the
    peer or the row (nothing posted)."""
    if op not in ("READ", "WRITE"):
        raise TransferError(f"op must be 'READ' or 'WRITE', got {op!r}")
    ranges = run_ranges.get(remote)
    if ranges is None:
        raise TransferError(f"remote agent {remote!r} takes no byte runs (add_runs_peer)")
    try:
        return checked_runs(local_rows, remote_rows, own_ranges, ranges, allow_empty=False)
    except ValueError as e:
        raise TransferError(f"{op} to {remote!r}: {e}") from None
