"""``kv_connector_extra_config.transport``: which P/D transport driver the connector runs."""
from __future__ import annotations

from typing import Any

from ....errors import ConfigError
from ....transport.base import TRANSPORTS


def transport_name(vllm_config: Any, transfer_mode: str = "pull") -> str:
    """``"nixl"`` (default) or ``"mooncake"`` (Mooncake Transfer Engine, pull or push);
    anything else raises ConfigError naming the field, at start-up. ``transfer_mode`` is
    kept for callers; both modes run over both transports."""
    ktc = vllm_config.kv_transfer_config
    name = "nixl" if ktc is None else ktc.get_from_extra_config("transport", "nixl")
    if name not in TRANSPORTS:
        raise ConfigError(f"kv_connector_extra_config.transport must be one of "
                          f"{list(TRANSPORTS)}, got {name!r}")
    return name
