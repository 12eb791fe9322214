"""Detect two engines pinned to the same CPUs on one host (Linux; no NIXL import here).

vLLM's CPU worker pins its process to compute cores ("auto": the same cores for every engine
on the host) and its main thread busy-waits for each step there. Two engines pinned to one
core starve each other's transfer progress: with prefill and decode on one host and UCX over
TCP, a READ of the prefill engine's KV stalled 30-90 s per request under ``vllm serve``, until
the prefill engine went idle; with disjoint ``VLLM_CPU_OMP_THREADS_BIND`` lists it took under
a second (docs/vllm.md, "Several engines on one host"). Loopback shared memory hides it (the
reader copies without the owner's help), a network transport does not.

Each pinned process claims its CPUs with advisory locks on host-wide files; a CPU another live
process already claimed is reported, so the connector can warn at start-up.
"""
from __future__ import annotations

import fcntl
import os
import tempfile

__all__ = ["allowed_cpus", "claim_pinned_cpus"]

_HELD: dict[int, int] = {}        # cpu -> fd of our claim (kept open: the lock lives with it)


def allowed_cpus() -> set[int]:
    """Every CPU this process may use: the cgroup's effective cpuset (v2, then v1), else every
    online CPU. Not ``os.sched_getaffinity(0)``, which is this thread's (maybe pinned) mask."""
    for path in ("/sys/fs/cgroup/cpuset.cpus.effective",
                 "/sys/fs/cgroup/cpuset/cpuset.effective_cpus"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        cpus: set[int] = set()
        for part in filter(None, text.split(",")):
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
        if cpus:
            return cpus
    return set(range(os.cpu_count() or 1))


def claim_pinned_cpus(lock_dir: str | None = None) -> dict[int, int]:
    """Claim the CPUs this thread is pinned to; ``{cpu: pid}`` of those another live process
    claimed first. Not pinned (its mask is every allowed CPU), or not Linux: ``{}``."""
    try:
        mine = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return {}
    if not mine or mine >= allowed_cpus():
        return {}
    lock_dir = lock_dir or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    taken: dict[int, int] = {}
    for cpu in sorted(mine - set(_HELD)):
        path = os.path.join(lock_dir, f"hmacore-cpu-pin-{cpu}")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:        # another process holds it: who
            try:
                taken[cpu] = int(os.pread(fd, 32, 0).split(b"\0")[0] or b"0")
            except (OSError, ValueError):
                taken[cpu] = 0
            os.close(fd)
            continue
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        _HELD[cpu] = fd
    return taken
