"""Scheduler -> worker (and worker -> scheduler) payloads of :class:`HmaNixlConnector`.

Everything here crosses process boundaries (pickle/msgspec), so block tables are plain
``list[list[int]]`` (one list per KV cache group, in vLLM's group order; block ids of that
group's namespace, null block 0 never included after clipping unless it is a position
placeholder the peer must mirror). Times are in the scheduler's ``time.perf_counter`` domain,
seconds; workers rebase them with ``scheduler_clock``.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from .._compat import KVConnectorMetadata, KVConnectorWorkerMetadata

__all__ = ["RemotePeer", "RecvRequest", "HmaNixlConnectorMetadata", "HmaNixlWorkerMeta"]


@dataclasses.dataclass
class RemotePeer:
    """Where a D-side request's KV lives on its prefill (P) peer."""

    engine_id: str
    request_id: str
    host: str
    port: int
    block_ids: list[list[int]]          # P's per-group ids, window/state-clipped by P
    num_tokens: int = 0                 # tokens P computed (remote_num_tokens)
    expiry_time: float | None = None    # P's lease deadline (P's clock), informational
    tp_size: int = 1
    block_sizes: list[int] | None = None    # P's block size per group (None: equal to D's)
    block_first: list[int] | None = None    # P's table position of block_ids[g][0]
    # a notify-only entry for params D refused for their layout or endpoint: tell P "done"
    # only through an agent of engine_id already loaded, never handshake on their word
    known_only: bool = False


@dataclasses.dataclass
class RecvRequest:
    """One D-side load: read ``remote.block_ids`` into ``local_block_ids``.

    ``local_block_ids`` are the blocks the connector must fill (unhashed, non-null), clipped
    to each group's window / Mamba state slot; an all-empty table means "full local prefix
    hit: only notify P so it can free its blocks". ``local_num_computed_blocks[g]`` counts
    the locally prefix-hit (hashed, non-null) blocks of group g. ``remote`` is None only for
    a notify-only entry of a request aborted before it was scheduled.
    """

    request_id: str
    local_block_ids: list[list[int]]
    local_num_computed_blocks: tuple[int, ...]
    remote: RemotePeer | None
    awaiting: bool                      # parked in WAITING_FOR_REMOTE_KVS (async load)
    num_external_tokens: int = 0
    start_tokens: int | None = None     # tokens computed before the load (its local hit)
    load_start: int = 0                 # first token loaded (D's local hit), tokens
    local_first: tuple[int, ...] = ()   # D's table position of local_block_ids[g][0]
    # a failure of the whole load is retried (scheduler's load_retries): D keeps P's blocks
    # leased (no "done" to P) so the retry can read them
    retry: bool = False


@dataclasses.dataclass
class HmaNixlConnectorMetadata(KVConnectorMetadata):
    """Per-step metadata built by :meth:`HmaNixlScheduler.build_connector_meta`.

    Attributes:
        reqs_to_recv: D side, loads to start this step.
        reqs_to_send: P side, request id -> lease deadline for blocks held for a D reader
            (new or renewed this step).
        expired: P side, requests whose lease expired this step (blocks already freed;
            the worker must drop them and refuse later reads).
        reqs_not_processed: P side, requests that finished abnormally (abort): nothing
            will be read, forget them.
        heartbeats: D side, remote engine id -> remote request ids still being waited on.
        scheduler_clock: ``time.perf_counter()`` of the scheduler when built.
        report_due: a deadline the scheduler side enforces in ``update_connector_output``
            has passed (a lease; in push mode also an unclaimed registration): the workers
            must report this step (vLLM hands the scheduler side a worker report only when
            it is not empty; see ``HmaNixlConnector.build_connector_worker_meta``).
    """

    reqs_to_recv: dict[str, RecvRequest] = dataclasses.field(default_factory=dict)
    reqs_to_send: dict[str, float] = dataclasses.field(default_factory=dict)
    expired: set[str] = dataclasses.field(default_factory=set)
    reqs_not_processed: set[str] = dataclasses.field(default_factory=set)
    heartbeats: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    scheduler_clock: float = 0.0
    report_due: bool = False


@dataclasses.dataclass
class HmaNixlWorkerMeta(KVConnectorWorkerMetadata):
    """Worker -> scheduler: P-side requests whose lease a D reader renewed (heartbeat)."""

    renewed: set[str] = dataclasses.field(default_factory=set)

    def aggregate(self, other: Any) -> HmaNixlWorkerMeta:
        """Union over workers (vLLM folds every worker's metadata pairwise)."""
        return HmaNixlWorkerMeta(renewed=set(self.renewed) | set(getattr(other, "renewed", ())))
