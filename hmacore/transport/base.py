"""The P/D transport interface: what a connector needs from a KV transport driver.

Two drivers implement it: :class:`hmacore.transport.nixl.NixlAgent` (NIXL, UCX backend) and
:class:`hmacore.transport.mooncake_te.MooncakeTeAgent` (Mooncake Transfer Engine, TCP). Both
register one :class:`~hmacore.plan.TransferPlan`'s paged KV regions, describe themselves in a
:class:`~hmacore.transport.handshake.HandshakePayload` (``agent_metadata`` carries the
transport's own endpoint data; the region table and the per-group wire format are the same),
and move a request's per-group block lists as READ (pull) or WRITE (push), posted as the
coalesced descriptor runs of :mod:`hmacore.runs` or per block.

Contract shared by both (units: per-group block ids; seconds):
* ``read``/``write`` return a :class:`Transfer`; ``poll`` is non-blocking (``"PROC"`` /
  ``"DONE"``), ``wait`` is bounded by its timeout; a failure raises TransferError naming the
  request and is remembered (``failure``); the driver stays usable for other requests.
* a request's local blocks are valid (``valid_blocks``) only after its transfer is DONE.
* notifications are ``(request_id, body)`` pairs; ``notif=`` on a transfer is delivered to
  the peer only after the transfer succeeded.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ..errors import TransferError
from ..plan import TransferPlan
from .handshake import HandshakePayload

__all__ = ["TRANSPORTS", "DescTransport", "KvTransport", "PostCounts", "Transfer",
           "TransferPosting",
           "check_transport", "make_desc_transport", "make_transport"]

#: the transports a connector can be configured with (``"transport"`` in
#: ``kv_connector_extra_config``)
TRANSPORTS = ("nixl", "mooncake")


def check_transport(name: Any) -> str:
    """``name`` if it is one of :data:`TRANSPORTS`, else ValueError naming the rule."""
    if not isinstance(name, str) or name not in TRANSPORTS:
        raise ValueError(f"transport must be one of {list(TRANSPORTS)}, got {name!r}")
    return name


@dataclasses.dataclass
class Transfer:
    """One posted READ/WRITE of one request. ``descriptors``: what the transport was given
    (runs when posted as runs); ``block_descriptors``: the per-block descriptors of the plan;
    ``runs``: the maximal runs (-1 when not searched: ``posting="blocks"``); ``bytes``: what
    it moves; ``mechanism``: how it was posted; ``handle``: the driver's own handle."""

    request_id: str
    op: str
    peer: str
    local_block_ids: tuple[np.ndarray, ...]
    descriptors: int
    bytes: int
    handle: Any = None
    state: str = "PROC"   # PROC, DONE, FAILED
    posted_at: float = 0.0
    block_descriptors: int = 0
    runs: int = -1
    mechanism: str = ""


@runtime_checkable
class KvTransport(Protocol):
    """A KV transport driver over one TransferPlan's memory (see the module docstring)."""

    name: str
    plan: TransferPlan

    def metadata(self) -> bytes: ...

    def handshake_payload(self) -> HandshakePayload: ...

    def add_peer(self, payload: HandshakePayload, *, pair: Any = None) -> str: ...

    def add_notify_peer(self, payload: HandshakePayload) -> str: ...

    def remove_peer(self, name: str) -> None: ...

    @property
    def peers(self) -> tuple[str, ...]: ...

    def read(self, request_id: str, peer: str, local_block_ids: Sequence[Any],
             remote_block_ids: Sequence[Any], *, notif: bytes | None = None,
             expires_at: float | None = None) -> Transfer: ...

    def write(self, request_id: str, peer: str, local_block_ids: Sequence[Any],
              remote_block_ids: Sequence[Any], *, notif: bytes | None = None,
              expires_at: float | None = None) -> Transfer: ...

    def poll(self, transfer: Transfer) -> str: ...

    def wait(self, transfer: Transfer, timeout: float = 10.0) -> Transfer: ...

    def valid_blocks(self, request_id: str) -> tuple[np.ndarray, ...] | None: ...

    def failure(self, request_id: str) -> Any: ...

    def send_notif(self, peer: str, request_id: str, msg: bytes = b"done") -> None: ...

    def notifications(self, request_id: str, *, fetch: bool = True) -> list[bytes]: ...

    def notifications_from(self, request_id: str, *, fetch: bool = True
                           ) -> list[tuple[str, bytes]]: ...

    def has_notifications(self, request_id: str) -> bool: ...

    def fetch_notifs(self) -> None: ...

    def drop_unclaimed_notifs(self, older_than: float, live: Any, cap: int) -> int: ...

    def wait_notif(self, request_id: str, timeout: float = 10.0) -> bytes: ...

    def close(self) -> None: ...


def make_transport(transport: str, name: str, plan: TransferPlan, **kwargs: Any) -> KvTransport:
    """A driver of ``transport`` (one of :data:`TRANSPORTS`) named ``name`` over ``plan``;
    ``kwargs`` go to its constructor. Imports the transport's package only here."""
    if check_transport(transport) == "nixl":
        from .nixl import NixlAgent
        return NixlAgent(name, plan, **kwargs)
    from .mooncake_te import MooncakeTeAgent
    return MooncakeTeAgent(name, plan, **kwargs)


@dataclasses.dataclass
class PostCounts:
    """What a descriptor-level driver posted (summed over its transfers): ``transfers``
    posted, the ``bytes`` they move, the ``descriptors`` (entries) the transport was given and
    the per-block ``block_descriptors`` those stand for (equal when posted per block)."""

    transfers: int = 0
    bytes: int = 0
    descriptors: int = 0
    block_descriptors: int = 0

    def add(self, nbytes: int, descriptors: int, block_descriptors: int) -> None:
        self.transfers += 1
        self.bytes += int(nbytes)
        self.descriptors += int(descriptors)
        self.block_descriptors += int(block_descriptors)


@runtime_checkable
class DescTransport(Protocol):
    """A descriptor-level driver: named local/remote descriptor-row pairs, transfers by
    descriptor ids (layer-wise push and its heterogeneous-TP pairs, where one plan per agent
    does not fit). Implemented by :class:`hmacore.transport.nixl_desc.DescAgent` (NIXL) and
    :class:`hmacore.transport.mooncake_desc.TeDescAgent` (Mooncake TE).

    Contract: ``post`` validates everything before posting (TransferError, nothing moved) and
    returns a handle; ``state(handle)`` is non-blocking (``"PROC"`` / ``"DONE"`` / ``"ERR"``;
    a dead peer ends as ``"ERR"``); ``notif`` rides the transfer and reaches the peer only
    after its data; ``send_notif`` raises TransferError when the peer is known unreachable
    (a driver that sends in the background reports a later failure by ``notif_failures``,
    ``(peer, error)`` pairs each reported once, and raises at the next send to that peer);
    ``notifs_by_agent`` yields ``(sender agent name, message)``, consumed; ``take_posted``
    returns the :class:`PostCounts` of the transfers posted since its last call."""

    name: str
    last_post: tuple[int, int, int]

    def take_posted(self) -> PostCounts: ...

    def metadata(self) -> bytes: ...

    def add_remote(self, agent_metadata: bytes) -> str: ...

    def prep_pair(self, key: str, remote: str, local_descs: np.ndarray,
                  remote_descs: np.ndarray,
                  remote_ranges: Sequence[tuple[int, int, int]] | None = None) -> None: ...

    def remove_remote(self, name: str) -> None: ...

    def post(self, op: str, key: str, local_ids: np.ndarray, remote_ids: np.ndarray,
             notif: bytes = b"") -> Any: ...

    def state(self, handle: Any) -> str: ...

    def release(self, handle: Any) -> None: ...

    def wait(self, handle: Any, timeout: float = 10.0) -> None: ...

    def send_notif(self, remote: str, msg: bytes) -> None: ...

    def notif_failures(self) -> list[tuple[str, str]]: ...

    def notifs(self) -> list[bytes]: ...

    def notifs_by_agent(self) -> list[tuple[str, bytes]]: ...

    def close(self) -> None: ...


def make_desc_transport(transport: str, name: str, ranges: Sequence[tuple[int, int, int]],
                        *, mem_type: str = "DRAM", hostname: str = "127.0.0.1",
                        posting: str = "auto", progress_delay_us: int | None = None
                        ) -> DescTransport:
    """A descriptor-level driver of ``transport`` named ``name`` over ``ranges``
    (``hostname``: where a Mooncake TE listens; ``progress_delay_us``: NIXL's progress
    thread). Imports the transport's package only here."""
    if check_transport(transport) == "nixl":
        from . import DEFAULT_PROGRESS_DELAY_US
        from .nixl_desc import DescAgent
        return DescAgent(name, ranges, mem_type=mem_type, posting=posting,
                         progress_delay_us=DEFAULT_PROGRESS_DELAY_US if progress_delay_us is None
                         else progress_delay_us)
    from .mooncake_desc import TeDescAgent
    return TeDescAgent(name, ranges, mem_type=mem_type, hostname=hostname, posting=posting)


class TransferPosting:
    """``read`` / ``write`` and the failure record, shared by the drivers. A driver provides
    ``_post(op, request_id, peer, local_ids, remote_ids, notif, expires_at)``, the ``_failed``
    and ``_valid`` dicts, and ``_release_failed`` (what a failed transfer gives back)."""

    _failed: dict[str, TransferError]
    _valid: dict[str, Any]

    def _post(self, op: str, request_id: str, peer: str, local_ids: Any, remote_ids: Any,
              notif: bytes | None, expires_at: float | None) -> Transfer:
        raise NotImplementedError

    def read(self, request_id: str, peer: str, local_block_ids: Sequence[Any],
             remote_block_ids: Sequence[Any], *, notif: bytes | None = None,
             expires_at: float | None = None) -> Transfer:
        """Post a READ (pull) of the peer's ``remote_block_ids`` into ``local_block_ids``.

        ``expires_at``: the peer's lease end on ``time.monotonic()``'s clock; a READ after it
        fails. ``notif``: message the peer receives as ``b"<request_id>:<notif>"`` once the
        READ completed.
        """
        return self._post("READ", request_id, peer, local_block_ids, remote_block_ids, notif,
                          expires_at)

    def write(self, request_id: str, peer: str, local_block_ids: Sequence[Any],
              remote_block_ids: Sequence[Any], *, notif: bytes | None = None,
              expires_at: float | None = None) -> Transfer:
        """Post a WRITE (push) of ``local_block_ids`` into the peer's ``remote_block_ids``."""
        return self._post("WRITE", request_id, peer, local_block_ids, remote_block_ids, notif,
                          expires_at)

    def _release_failed(self, transfer: Transfer) -> None:
        """Give back what a failed transfer holds (nothing by default)."""

    def _fail(self, request_id: str, msg: str, *, group=None, block_index=None,
              transfer: Transfer | None = None) -> TransferError:
        err = TransferError(f"request {request_id!r}: {msg}", request_id=request_id,
                            group=group, block_index=block_index)
        self._failed[request_id] = err
        self._valid.pop(request_id, None)
        if transfer is not None:
            transfer.state = "FAILED"
            self._release_failed(transfer)
        return err
