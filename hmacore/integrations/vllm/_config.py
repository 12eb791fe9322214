"""``kv_connector_extra_config`` of both connectors: an allow-list per connector and typed
reads, each error a :class:`~hmacore.errors.ConfigError` naming the key and the rule.

Checked when the connector is constructed (scheduler and worker alike), so a typo such as
``side_chanel_port`` stops the engine at start-up with "did you mean 'side_channel_port'?"
instead of being ignored.
"""
from __future__ import annotations

import difflib
import ipaddress
from collections.abc import Mapping
from typing import Any

from ...errors import ConfigError

__all__ = ["NIXL_KEYS", "STORE_KEYS", "check_keys", "number", "flag", "text", "side_channel",
           "is_loopback"]

#: every key HmaNixlConnector reads (pull and push)
NIXL_KEYS = frozenset({
    "kv_lease_duration", "side_channel_host", "side_channel_listen_host", "side_channel_port",
    "sync_load", "block_size_remap", "load_retries",
    "nixl_progress_delay_us", "nixl_posting", "transfer_mode", "push_register_timeout", "push_recv_timeout",
    "push_cancel_ack_timeout",
    "transport",
})
#: every key HmaStoreConnector reads (store selection, Mooncake client, keys, loads)
STORE_KEYS = frozenset({
    "store", "store_name", "store_capacity_bytes", "store_scope", "store_page_bytes", "master",
    "local_hostname", "protocol", "global_segment_size", "local_buffer_size",
    "connect_timeout_s", "load_async", "load_retries", "model_name", "cache_prefix", "store_namespace",
})

_PREFIX = "kv_connector_extra_config"


def check_keys(extra: Mapping[str, Any] | None, allowed: frozenset[str], connector: str) -> dict:
    """``extra`` as a dict, or ConfigError listing every unknown key with a suggestion."""
    if extra is None:
        return {}
    if not isinstance(extra, Mapping):
        raise ConfigError(f"{_PREFIX} of {connector} must be a mapping, got "
                          f"{type(extra).__name__}")
    unknown = sorted(k for k in extra if k not in allowed)
    if unknown:
        parts = []
        for k in unknown:
            near = difflib.get_close_matches(str(k), sorted(allowed), n=1)
            parts.append(f"{k!r}" + (f" (did you mean {near[0]!r}?)" if near else ""))
        raise ConfigError(f"{_PREFIX} of {connector}: unknown keys {', '.join(parts)}; "
                          f"known keys: {', '.join(sorted(allowed))}")
    return dict(extra)


def number(extra: Mapping[str, Any], key: str, default: float | int, *,
           minimum: float | None = None, positive: bool = False,
           integer: bool = False) -> Any:
    """A numeric key (``default`` when absent or None): ints and floats (numeric strings
    too, as vLLM's CLI may pass them); ``integer`` refuses fractions, ``minimum`` /
    ``positive`` bound it."""
    raw = extra.get(key)
    if raw is None:
        return default
    value: Any = raw
    if isinstance(raw, bool):
        value = None
    elif isinstance(raw, str):
        try:
            value = float(raw) if not integer else int(raw)
        except ValueError:
            value = None
    elif not isinstance(raw, (int, float)):
        value = None
    if value is not None and integer and float(value) != int(value):
        value = None
    rule = ("an integer" if integer else "a number") + (
        " > 0" if positive else f" >= {minimum:g}" if minimum is not None else "")
    if value is None or value != value or (positive and not value > 0) \
            or (minimum is not None and value < minimum):
        raise ConfigError(f"{_PREFIX}.{key} must be {rule}, got {raw!r}")
    return int(value) if integer else float(value)


def flag(extra: Mapping[str, Any], key: str, default: bool) -> bool:
    """A boolean key: JSON true/false (or the strings "true"/"false"); ``"no"``, 0 or 1 are
    refused (``bool("false")`` would be True)."""
    raw = extra.get(key)
    if raw is None:
        return default
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, str) and raw.lower() in ("true", "false"):
        return raw.lower() == "true"
    raise ConfigError(f"{_PREFIX}.{key} must be true or false, got {raw!r}")


def text(extra: Mapping[str, Any], key: str, default: str) -> str:
    """A string key (``default`` when absent, None or empty)."""
    raw = extra.get(key)
    if raw is None or raw == "":
        return default
    if not isinstance(raw, str):
        raise ConfigError(f"{_PREFIX}.{key} must be a string, got {raw!r}")
    return raw


_WILDCARDS = frozenset({"0.0.0.0", "::", "*"})


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or ``localhost``: only this host's processes can reach it."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def side_channel(extra: Mapping[str, Any]) -> tuple[str, str]:
    """(advertised host, listen host) of the handshake side channel.

    ``side_channel_host`` is what this engine tells its peers (in ``kv_transfer_params``), so
    it must be an address they can reach, never a wildcard; ``side_channel_listen_host`` is
    where the handshake servers bind (default: the advertised host; ``0.0.0.0`` for every
    interface, e.g. behind NAT or with several NICs)."""
    host = text(extra, "side_channel_host", "127.0.0.1")
    if host in _WILDCARDS:
        raise ConfigError(
            f"{_PREFIX}.side_channel_host is the address peers connect to and cannot be the "
            f"wildcard {host!r}; set it to this host's routable address and "
            f"side_channel_listen_host to {host!r} to listen on every interface")
    listen = text(extra, "side_channel_listen_host", host)
    return host, listen
