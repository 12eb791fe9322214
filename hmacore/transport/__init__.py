"""Transports: NIXL agent driver and KV stores. Imports nixl/mooncake lazily, never at import."""
from __future__ import annotations

import os
import threading
from typing import Any


def configure_ucx_env() -> None:
    """Set UCX defaults that keep NIXL healthy on hosts without RDMA devices.

    On a host with no InfiniBand/RoCE device, UCX's ``ib`` module still loads libibverbs when it
    is installed (Mooncake needs it), and NIXL 1.5.1's bundled libnl-route then crashes in a
    destructor at process exit (SIGSEGV after all work is done). Excluding the module with
    ``UCX_MODULES=^ib`` avoids that and costs nothing without devices. Hosts with RDMA devices
    and users who set ``UCX_MODULES`` themselves are left alone. Call before importing nixl.
    """
    if "UCX_MODULES" in os.environ:
        return
    ib = "/sys/class/infiniband"
    if os.path.isdir(ib) and os.listdir(ib):
        return
    os.environ["UCX_MODULES"] = "^ib"
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")


# Serialises the brief swap of nixl's config class in new_nixl_agent (module-global).
_AGENT_LOCK = threading.Lock()
DEFAULT_PROGRESS_DELAY_US = 1000


def new_nixl_agent(name: str, backends, *, progress_thread: bool = True,
                   progress_delay_us: int = DEFAULT_PROGRESS_DELAY_US):
    """A ``nixl._api.nixl_agent`` named ``name`` with ``backends``, UCX env configured first.

    NIXL 1.5.1's Python binding always starts UCX's shared progress thread with a *zero* poll
    delay: the thread never sleeps, so every agent spins one core at 100% for its whole life,
    idle or not (measured: 5.0 CPU-seconds per 5 s idle). On a CPU-only node that starves the
    engine's own threads. The thread itself is needed: a peer's READ of this agent's memory
    completes only while this side's UCX worker is progressed (seen on DRAM/UCX here), and the
    owner of that memory is usually not calling into NIXL at that moment.

    So by default the thread runs with ``progress_delay_us`` (units: microseconds, rounded up to
    whole milliseconds by NIXL): it sleeps in ``poll()`` on the UCX workers' event fds, wakes at
    once on any transfer or notification event, and otherwise every delay (measured at 1 ms:
    0.03 CPU-seconds per 1.5 s idle, tests/nixl/test_progress_thread.py).
    ``progress_delay_us=0`` restores NIXL's spinning thread; ``progress_thread=False`` runs
    none (progress only inside this process's own NIXL calls).

    The delay is set by handing ``nixl_agent`` a config class whose ``pthrDelay`` ignores the
    binding's zero (NIXL 1.5.1 has no parameter for it); the swap is serialised by a lock.
    """
    if progress_delay_us < 0:
        raise ValueError(f"progress_delay_us must be >= 0 (microseconds), got {progress_delay_us}")
    configure_ucx_env()  # before nixl loads UCX (exit-time SIGSEGV with libibverbs present)
    import nixl._api as api  # lazy: core never imports nixl
    conf = api.nixl_agent_config(enable_prog_thread=bool(progress_thread),
                                 backends=list(backends))
    if not progress_thread or progress_delay_us == 0:
        return api.nixl_agent(name, conf)
    base: Any = api.nixlBind.nixlAgentConfig   # NIXL's (untyped) pybind class
    delay = int(progress_delay_us)

    class _DelayedConfig(base):
        # nixl_agent.__init__ assigns pthrDelay = 0; this config keeps the requested delay.
        pthrDelay = property(lambda self: base.pthrDelay.__get__(self),
                             lambda self, _value: base.pthrDelay.__set__(self, delay))

    with _AGENT_LOCK:
        api.nixlBind.nixlAgentConfig = _DelayedConfig
        try:
            return api.nixl_agent(name, conf)
        finally:
            api.nixlBind.nixlAgentConfig = base
