"""Where a timed section's wall time went: on a CPU, or waiting for one.

On a shared, loaded machine a section that runs longer than a scheduler time slice is
preempted and waits in the runqueue; a short one (a 9 MiB memcpy, ~1 ms) often is not. So a
wall-clock rate compared with a memcpy's measures the load as much as the transport. This
clock splits the wall time into process CPU time (every thread: the calling one and NIXL's
progress thread) and the calling thread's runqueue wait (Linux ``/proc/thread-self/schedstat``,
``None`` where unavailable), so a rate can also be given per CPU-second.
"""
from __future__ import annotations

import time

__all__ = ["Clock", "runqueue_wait_s"]

_SCHEDSTAT = "/proc/thread-self/schedstat"


def runqueue_wait_s() -> float | None:
    """Seconds the calling thread has waited runnable for a CPU (``None``: not on Linux)."""
    try:
        with open(_SCHEDSTAT) as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


class Clock:
    """Accumulates timed sections: ``with clock: ...``. Totals in seconds: ``wall``, ``cpu``
    (process CPU time), ``runq`` (runqueue wait of the timing thread, ``None`` if unknown);
    ``longest``: the longest section's wall seconds."""

    def __init__(self) -> None:
        self.wall = 0.0
        self.cpu = 0.0
        self.thread_cpu = 0.0   # the timing thread's own share of ``cpu``
        self.runq: float | None = 0.0
        self.sections = 0
        self.longest = 0.0      # wall seconds of the longest section
        self._start: tuple[float, float, float, float] | None = None

    def __enter__(self) -> Clock:
        # runqueue first, wall last: the section's own time is what lies between the reads
        self._start = (runqueue_wait_s() or 0.0, time.process_time(), time.thread_time(),
                       time.perf_counter())
        return self

    def __exit__(self, *exc: object) -> None:
        t = time.perf_counter()
        cpu = time.process_time()
        tcpu = time.thread_time()
        rq = runqueue_wait_s()
        if self._start is None:
            raise RuntimeError("Clock exited without being entered")
        rq0, cpu0, tcpu0, t0 = self._start
        self._start = None
        self.wall += t - t0
        self.longest = max(self.longest, t - t0)
        self.cpu += cpu - cpu0
        self.thread_cpu += tcpu - tcpu0
        # the runqueue reads bracket the wall reads, so a wait during the reads themselves
        # may count: a section never waited longer than it lasted
        self.runq = None if rq is None or self.runq is None else \
            self.runq + min(rq - rq0, t - t0)
        self.sections += 1
