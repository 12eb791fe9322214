"""Standalone Mooncake TE notifications off the caller's thread: one bounded FIFO and one
sender thread per peer (both TE drivers).

A notification without a transfer is a synchronous engine call (a 1-byte doorbell write
carrying a ``TransferNotify``). A live peer answers at once and so does a killed one (its
port refuses), but a peer that stops answering (a stopped process, a host gone without a TCP
reset) holds the call up to the engine's ``MC_TRANSFER_TIMEOUT``. Made on vLLM's engine loop
(registrations, liveness pings, cancels, done / heartbeat messages), that call would stall
every request of the engine. So :meth:`NotifyQueues.send` only queues: the peer's thread
makes the calls, in order. A failed call marks the peer failed: its queued messages are
dropped, every later :meth:`~NotifyQueues.send` to it raises TransferError (as NIXL reports a
disconnected agent at the next send), and :meth:`~NotifyQueues.take_failures` reports it once,
for the caller's next step. A peer that drains nothing fills its queue
(``max_pending``): the next send raises at once instead of growing it.
Forgetting a peer (or a new endpoint under its name) starts it afresh.
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

from ..errors import TransferError

__all__ = ["MAX_PENDING_NOTIFS", "NotifyQueues"]

#: notifications queued per peer at most (sent and in flight not counted)
MAX_PENDING_NOTIFS = 256
_MAX_FAILURES = 1024   # unreported failures kept (the oldest go first)
_STOP = object()


class _PeerQueue:
    __slots__ = ("name", "endpoint", "items", "pending", "error", "stopped", "thread")

    def __init__(self, name: str, endpoint: tuple[str, int]):
        self.name = name
        self.endpoint = endpoint
        self.items: queue.SimpleQueue = queue.SimpleQueue()
        self.pending = 0               # queued or being sent (guarded by NotifyQueues._lock)
        self.error: str | None = None
        self.stopped = False
        self.thread: threading.Thread | None = None


class NotifyQueues:
    """Per-peer notification senders of one engine.

    Args:
        call: ``call(session, doorbell, note) -> rc`` (0 = delivered): the blocking engine
            call, made on the peer's thread.
        label: thread-name prefix.
        max_pending: notifications a peer may have queued (>= 1).
    """

    def __init__(self, call: Callable[[str, int, Any], int], label: str, *,
                 max_pending: int = MAX_PENDING_NOTIFS):
        if type(max_pending) is not int or max_pending < 1:
            raise ValueError(f"max_pending must be an int >= 1, got {max_pending!r}")
        self._call = call
        self._label = label
        self.max_pending = max_pending
        self._lock = threading.Lock()
        self._peers: dict[str, _PeerQueue] = {}
        self._threads: list[threading.Thread] = []   # every sender started (close joins them)
        self._failures: list[tuple[str, str]] = []
        self._closed = False

    def send(self, name: str, session: str, doorbell: int, note: Any) -> None:
        """Queue ``note`` for peer ``name`` at ``(session, doorbell)``; returns at once.
        TransferError (nothing queued) when an earlier notification to that peer failed, its
        queue is full, or the senders are closed."""
        with self._lock:
            if self._closed:
                raise TransferError("the agent is closed")
            q = self._peers.get(name)
            if q is None or q.endpoint != (session, doorbell):
                if q is not None:           # the peer came back at another endpoint
                    self._stop(q)
                q = self._peers[name] = _PeerQueue(name, (session, doorbell))
                q.thread = threading.Thread(target=self._run, args=(q,), daemon=True,
                                            name=f"{self._label}-notify-{name}")
                q.thread.start()
                self._threads = [t for t in self._threads if t.is_alive()] + [q.thread]
            if q.error is not None:
                raise TransferError(f"notification to {name!r} not sent: an earlier one "
                                    f"failed ({q.error})")
            if q.pending >= self.max_pending:
                raise TransferError(f"notification to {name!r} not sent: {q.pending} are "
                                    "still pending (the peer does not answer)")
            q.pending += 1
            q.items.put(note)

    def _run(self, q: _PeerQueue) -> None:
        while True:
            note = q.items.get()
            if note is _STOP:
                return
            err = None
            if q.error is None and not q.stopped:     # after a failure: dropped unsent
                try:
                    rc = self._call(q.endpoint[0], q.endpoint[1], note)
                except Exception as e:  # noqa: BLE001 - the engine raised: not delivered
                    err = f"{type(e).__name__}: {e}"
                else:
                    if rc != 0:
                        err = f"engine rc {rc}: peer dead or unreachable?"
            with self._lock:
                q.pending -= 1
                if err is not None and q.error is None:
                    q.error = err
                    if self._peers.get(q.name) is q:
                        self._failures.append((q.name, err))
                        del self._failures[:-_MAX_FAILURES]   # a caller that never takes them

    def _stop(self, q: _PeerQueue, *, drop: bool = True) -> None:
        q.stopped = q.stopped or drop
        q.items.put(_STOP)

    def pending(self, name: str) -> int:
        """Notifications to ``name`` queued or being sent."""
        with self._lock:
            q = self._peers.get(name)
            return q.pending if q is not None else 0

    def failed(self, name: str) -> str | None:
        """Why the last notification to ``name`` failed (None: none failed)."""
        with self._lock:
            q = self._peers.get(name)
            return q.error if q is not None else None

    def take_failures(self) -> list[tuple[str, str]]:
        """``(peer, error)`` of the peers whose notifications failed since the last call."""
        with self._lock:
            out, self._failures = self._failures, []
            return out

    def forget(self, name: str) -> None:
        """Drop a peer: its queued notifications are not sent, its failure is forgotten (a
        call in flight ends by the engine's timeout). Unknown names are ignored."""
        with self._lock:
            q = self._peers.pop(name, None)
            if q is not None:
                self._stop(q)

    def close(self) -> None:
        """Refuse new notifications, let each sender deliver what was queued before (a peer's
        first failure drops the rest, so a peer that does not answer costs one engine timeout,
        peers in parallel) and wait for every sender to end: after this the engine may go."""
        with self._lock:
            self._closed = True
            for q in self._peers.values():
                self._stop(q, drop=False)
            self._peers = {}
            threads = list(self._threads)
        for t in threads:       # forgotten peers' senders too: none may outlive the engine
            t.join()
