"""vLLM adapters (pinned target: vLLM 0.32.0). The ONLY hmacore package that imports vLLM.

Importing this package does not import vLLM; the names below load on first access
(PEP 562), so ``KVTransferConfig(kv_connector="HmaNixlConnector",
kv_connector_module_path="hmacore.integrations.vllm")`` works through vLLM's factory
(``getattr(module, name)``).

Exports:
    HmaNixlConnector: P/D connector over NIXL (KVConnectorBase_V1 + SupportsHMA): pull
        (default; nixl.scheduler / nixl.worker) or layer-wise push, decode first
        (``transfer_mode="push"``; HmaPushScheduler / HmaPushWorker); one worker per TP
        rank (prefill and decode TP sizes may differ), PP = 1 (PP > 1 is refused).
    HmaStoreConnector: KV offload / cross-instance prefix reuse through a hash-addressed
        store (embedded in-process store or Mooncake), KVConnectorBase_V1 + SupportsHMA:
        scheduler side (HmaStoreScheduler) and worker side (HmaStoreWorker; TP = PP = 1).
    layout_from_kv_cache_config: vLLM KVCacheConfig -> hmacore KVLayout.
"""
from __future__ import annotations

import importlib
from typing import Any

__all__ = ["HmaNixlConnector", "HmaStoreConnector", "layout_from_kv_cache_config",
           "HmaNixlConnectorMetadata", "HmaStoreConnectorMetadata"]

_LAZY = {
    "HmaNixlConnector": ".nixl.connector",
    "HmaNixlConnectorMetadata": ".nixl.metadata",
    "HmaStoreConnector": ".store.connector",
    "HmaStoreConnectorMetadata": ".store.metadata",
    "layout_from_kv_cache_config": ".layout",
}


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        module = importlib.import_module(mod, __name__)
    except ModuleNotFoundError as e:
        if e.name == __name__ + mod:
            raise AttributeError(f"{name} is not implemented yet ({__name__}{mod} does not "
                                 "exist)") from None
        raise
    value = getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
