"""Transports: NIXL agent driver and KV stores. Imports nixl/mooncake lazily, never at import."""
from __future__ import annotations

import os


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
