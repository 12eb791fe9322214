"""Prefill-side send tracking: free a request's blocks only after every consumer read them.

With heterogeneous TP one prefill rank's blocks are read by several decode ranks (P=1/D=2:
both decode ranks read halves of the heads of prefill rank 0; MLA pages by every decode rank
``d`` with ``d % prefill_tp == rank``). The prefill rank must keep a request's blocks until
each of those *consumer ranks* has sent its done notification, or until the request's lease
ends (a decode rank that died never notifies). :class:`SendTracker` is that bookkeeping,
keyed by request id, with the consumer set computed once per deployment pair from the TP
mapping (:func:`hmacore.tp.consumer_ranks`).

Contract:

* ``add(req, lease_s=)`` before the request's block ids leave this process (a notification
  for a request that is not tracked is *stray*: counted, ignored, never remembered; that is
  also what a late notification after the lease ended is).
* ``notify(req, rank)``: ``rank`` must be one of the expected consumers (TrackerStateError
  otherwise, nothing changes). A second notification from the same rank counts once
  (``duplicates``). The notification that completes the set returns a DONE
  :class:`SendOutcome` and the request is forgotten: release its blocks then.
* ``poll()``: every request whose lease ended (``clock() >= added + lease_s``) returns as an
  EXPIRED outcome naming the consumers that did not notify, and is forgotten: release then.
* A tracker with no consumers (a prefill rank no decode rank reads, e.g. a spare copy of a
  replicated head) completes every request at ``add``.

Core module: no transport import. Units: ``lease_s`` seconds; the clock is
``time.monotonic`` unless another is passed (tests use a fake one).
"""
from __future__ import annotations

import dataclasses
import enum
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

from .errors import LayoutError, TrackerStateError
from .spec import KVLayout
from .tp import GroupSharding, consumer_ranks

__all__ = ["SendStatus", "SendOutcome", "SendTracker"]


class SendStatus(str, enum.Enum):
    DONE = "done"        # every expected consumer notified
    EXPIRED = "expired"  # the lease ended first


@dataclasses.dataclass(frozen=True)
class SendOutcome:
    """How a tracked request ended. ``notified``/``missing``: consumer ranks (ascending) that
    did / did not notify before it ended (``missing`` is empty when DONE)."""

    request_id: str
    status: SendStatus
    notified: tuple[int, ...]
    missing: tuple[int, ...]


@dataclasses.dataclass
class _Send:
    expires_at: float
    seen: set[int]


class SendTracker:
    """Per-request completion tracking on one prefill rank.

    Args:
        consumers: the decode ranks that read this prefill rank (distinct ints >= 0; may be
            empty). See :meth:`for_deployment`.
        clock: returns seconds (monotonic); default ``time.monotonic``.
    """

    def __init__(self, consumers: Sequence[int], *, clock: Callable[[], float] = time.monotonic):
        if isinstance(consumers, (str, bytes)) or not hasattr(consumers, "__iter__"):
            raise LayoutError(f"consumers must be a sequence of decode ranks, got {consumers!r}")
        cs = list(consumers)
        for c in cs:
            if isinstance(c, bool) or not isinstance(c, int) or c < 0:
                raise LayoutError(f"consumers must be ints >= 0 (decode ranks), got {c!r}")
        if len(set(cs)) != len(cs):
            raise LayoutError(f"consumers must be distinct ranks, got {cs}")
        self.consumers: tuple[int, ...] = tuple(sorted(cs))
        self._set = frozenset(cs)
        self._clock = clock
        self._reqs: dict[str, _Send] = {}
        self.duplicates = 0  # notifications from a rank that had already notified
        self.stray = 0       # notifications for requests not tracked (late, or never added)

    @classmethod
    def for_deployment(cls, layout: KVLayout, shardings: Sequence[GroupSharding], *,
                       prefill_tp: int, prefill_rank: int, decode_tp: int,
                       clock: Callable[[], float] = time.monotonic) -> SendTracker:
        """The tracker of prefill rank ``prefill_rank`` (of ``prefill_tp``) serving a decode
        deployment of ``decode_tp`` ranks: its consumers are
        ``consumer_ranks(layout, shardings, local_tp=decode_tp, remote_tp=prefill_tp,
        remote_rank=prefill_rank)`` (the TpPairPlans' sources, inverted)."""
        return cls(consumer_ranks(layout, shardings, local_tp=decode_tp, remote_tp=prefill_tp,
                                  remote_rank=prefill_rank), clock=clock)

    def add(self, request_id: str, *, lease_s: float) -> SendOutcome | None:
        """Track a request whose blocks consumers will read; its lease ends ``lease_s`` seconds
        from now. Returns a DONE outcome at once when there are no consumers, else None.

        Raises TrackerStateError (nothing changes) if the request is already tracked, the id is
        not a non-empty str, or ``lease_s`` is not a positive finite number."""
        if not isinstance(request_id, str) or not request_id:
            raise TrackerStateError(f"request_id must be a non-empty str, got {request_id!r}")
        if isinstance(lease_s, bool) or not isinstance(lease_s, (int, float)) \
                or not math.isfinite(lease_s) or lease_s <= 0:
            raise TrackerStateError(f"lease_s must be a positive finite number of seconds, "
                                    f"got {lease_s!r}")
        if request_id in self._reqs:
            raise TrackerStateError(f"request {request_id!r} is already tracked")
        if not self.consumers:
            return SendOutcome(request_id, SendStatus.DONE, (), ())
        self._reqs[request_id] = _Send(self._clock() + float(lease_s), set())
        return None

    def notify(self, request_id: str, consumer_rank: int) -> SendOutcome | None:
        """Consumer ``consumer_rank`` finished reading ``request_id``. Returns the DONE outcome
        when this was the last missing consumer (the request is then forgotten), else None
        (also for a duplicate or a stray notification).

        Raises TrackerStateError (nothing changes) if ``consumer_rank`` is not one of
        :attr:`consumers`."""
        if isinstance(consumer_rank, bool) or consumer_rank not in self._set:
            raise TrackerStateError(f"consumer_rank {consumer_rank!r} is not an expected consumer "
                                    f"of this prefill rank (expected one of {list(self.consumers)})")
        req = self._reqs.get(request_id)
        if req is None:
            self.stray += 1
            return None
        if consumer_rank in req.seen:
            self.duplicates += 1
            return None
        req.seen.add(consumer_rank)
        if len(req.seen) < len(self.consumers):
            return None
        del self._reqs[request_id]
        return SendOutcome(request_id, SendStatus.DONE, self.consumers, ())

    def poll(self) -> list[SendOutcome]:
        """EXPIRED outcomes of every request whose lease ended (``clock() >= expiry``), in
        insertion order; those requests are forgotten (release their blocks)."""
        now = self._clock()
        out = []
        for rid, req in list(self._reqs.items()):
            if now >= req.expires_at:
                del self._reqs[rid]
                out.append(SendOutcome(rid, SendStatus.EXPIRED, tuple(sorted(req.seen)),
                                       tuple(c for c in self.consumers if c not in req.seen)))
        return out

    def missing(self, request_id: str) -> tuple[int, ...]:
        """Consumers that have not notified yet (TrackerStateError if not tracked)."""
        req = self._reqs.get(request_id)
        if req is None:
            raise TrackerStateError(f"request {request_id!r} is not tracked")
        return tuple(c for c in self.consumers if c not in req.seen)

    @property
    def requests(self) -> tuple[str, ...]:
        """Tracked request ids, in insertion order."""
        return tuple(self._reqs)

    def __contains__(self, request_id: Any) -> bool:
        return request_id in self._reqs

    def __len__(self) -> int:
        return len(self._reqs)
