"""Per-request queues of received notifications (``b"<request id>:<body>"``), as the pull
transports keep them (:class:`~hmacore.transport.nixl.NixlAgent`,
:class:`~hmacore.transport.mooncake_te.MooncakeTeAgent`).

A message is consumed by whoever tracks its request. One that arrives for a request nobody
tracks any more (a ``done`` after the lease ended and its LATE window closed, an answer after
the reader gave up) would wait forever: :meth:`NotifQueues.drop_unclaimed` drops such queues
once their first message is older than a grace period (or the queue count passes a cap),
never a queue of a request the caller names as live.
"""
from __future__ import annotations

import time
from collections.abc import Container, Iterator

__all__ = ["NotifQueues"]


class NotifQueues:
    """Request id -> ``[(sender, body), ...]`` in arrival order, plus when each queue got its
    first message (``time.monotonic()``): queues are kept in that order."""

    def __init__(self) -> None:
        self._queues: dict[str, list[tuple[str, bytes]]] = {}
        self._since: dict[str, float] = {}

    def add(self, request_id: str, sender: str, body: bytes) -> None:
        queue = self._queues.get(request_id)
        if queue is None:
            self._queues[request_id] = queue = []
            self._since[request_id] = time.monotonic()
        queue.append((sender, body))

    def pop(self, request_id: str) -> list[tuple[str, bytes]]:
        """Every queued message of ``request_id`` (consumed; ``[]`` if none)."""
        self._since.pop(request_id, None)
        return self._queues.pop(request_id, [])

    def pop_first(self, request_id: str) -> tuple[str, bytes] | None:
        """The oldest queued message of ``request_id`` (consumed), None if none."""
        queue = self._queues.get(request_id)
        if not queue:
            return None
        first = queue.pop(0)
        if not queue:
            self.pop(request_id)
        return first

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._queues

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._queues))

    def __len__(self) -> int:
        return len(self._queues)

    def drop_unclaimed(self, older_than: float, live: Container[str], cap: int) -> int:
        """Drop the queues of requests not in ``live`` whose first message arrived before
        ``older_than`` (``time.monotonic()`` seconds), and, while more than ``cap`` queues
        remain, the oldest of the others. Returns the number of messages dropped."""
        if cap < 0:
            raise ValueError(f"cap must be >= 0, got {cap}")
        excess = len(self._queues) - cap
        dropped = 0
        for rid, since in list(self._since.items()):    # oldest first
            if since >= older_than and excess <= 0:
                break
            if rid in live:
                continue
            dropped += len(self.pop(rid))
            excess -= 1
        return dropped
