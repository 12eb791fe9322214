"""The connectors' statistics in vLLM's pipeline: each role counts what it did
(:class:`StatsCounter`), vLLM collects it through ``get_kv_connector_stats()`` as an
:class:`HmaConnectorStats` (summed across workers and steps, logged as "KV Transfer metrics")
and :class:`HmaPromMetrics` exports it on ``vllm serve``'s ``/metrics`` as
``vllm:hma_<name>_total`` counters (the per-group ones with a ``group`` label).

The data is a plain dict (vLLM ships it between processes): ``{name: number}`` for the
counters of :data:`COUNTERS`, ``{name: {group: number}}`` for those of
:data:`GROUP_COUNTERS` (group ids as strings, so the dict survives any serializer).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from . import _compat as C

__all__ = ["COUNTERS", "GROUP_COUNTERS", "StatsCounter", "HmaConnectorStats", "HmaPromMetrics"]

#: counter name -> help text (what one unit is)
COUNTERS: dict[str, str] = {
    "transfers": "KV transfers (NIXL READs / WRITEs) posted",
    "transfer_bytes": "Bytes the posted KV transfers move",
    "transfer_descriptors": "NIXL descriptors the posted KV transfers carry (one per maximal "
                            "run when posted as runs)",
    "transfer_block_descriptors": "Per-block descriptors of the posted KV transfers (what "
                                  "one descriptor per block per layer slot would post)",
    "transfer_seconds": "Seconds from post to completion, summed over completed transfers",
    "transfer_failures": "KV loads or pushes that failed (handshake, NIXL error, deadline)",
    "loads": "KV loads completed (every transfer of the request done)",
    "lease_expiries": "Prefill-side leases that expired before the decode side released them",
    "late_reads": "KV loads whose READ finished after the prefill engine's lease had ended "
                  "(its blocks may have been reused): reported failed",
    "loads_abandoned": "Failed KV loads after which the decode side told the prefill side "
                       "to free its blocks at once (instead of at its lease's end)",
    "late_messages_dropped": "Transfer notifications for a request this rank no longer tracks "
                             "(arrived after its release or timeout), dropped unclaimed after "
                             "kv_lease_duration",
    "read_confirm_timeouts": "KV loads whose READ finished but whose prefill rank never "
                             "confirmed its lease within kv_lease_duration: reported failed",
    "push_cancels_acknowledged": "Pushes the decode side cancelled whose blocks it held until "
                                 "every prefill rank confirmed none of its WRITEs was in flight",
    "push_cancels_unacknowledged": "Pushes the decode side cancelled whose blocks it released "
                                   "without that confirmation (prefill lost, or "
                                   "push_cancel_ack_timeout)",
    "push_cancels_answered": "Cancels from a decode engine the prefill side confirmed (sent once "
                             "none of the push's WRITEs was in flight)",
    "store_lookups": "Store lookups (one per request per scheduling pass)",
    "store_hit_tokens": "Tokens found in the store by lookups that led to a load",
    "store_loads": "Store loads scheduled",
    "store_load_retries": "Fresh store lookups for requests whose async load failed as a whole",
    "load_retries": "NIXL loads started again from the prefill engine after a load failed "
                    "as a whole",
    "store_load_failures": "Store loads where some block did not arrive (key missing or "
                           "evicted since the lookup, short or failed get)",
    "store_saves": "Store saves scheduled (one per request and step)",
    "store_keys_written": "Store keys written by saves",
    "store_keys_failed": "Store keys a save failed or was refused to write (NO_SPACE included)",
    "store_evictions": "Store keys the embedded store evicted to make room for this engine's "
                       "saves",
}
#: per-KV-cache-group counter name -> help text
GROUP_COUNTERS: dict[str, str] = {
    "blocks_moved": "Blocks moved by KV transfers, per KV cache group",
    "blocks_clipped": "Blocks left out by window / state clipping (never moved), per KV cache "
                      "group",
}


class StatsCounter:
    """What one connector role did since vLLM last asked (not thread-safe: one owner)."""

    def __init__(self) -> None:
        self._data: dict[str, Any] = {}

    def add(self, name: str, value: float = 1) -> None:
        self._data[name] = self._data.get(name, 0) + value

    def add_groups(self, name: str, per_group) -> None:
        """Add ``per_group[g]`` to group g's ``name`` (zeros are skipped)."""
        d = self._data.setdefault(name, {})
        for g, v in enumerate(per_group):
            if v:
                d[str(g)] = d.get(str(g), 0) + int(v)

    def take(self) -> dict[str, Any] | None:
        """The counts since the last call (None when nothing happened)."""
        if not self._data:
            return None
        out, self._data = self._data, {}
        return out


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for k, v in b.items():
        if isinstance(v, dict):
            d = dict(out.get(k) or {})
            for g, x in v.items():
                d[g] = d.get(g, 0) + x
            out[k] = d
        else:
            out[k] = out.get(k, 0) + v
    return out


@dataclasses.dataclass
class HmaConnectorStats(C.KVConnectorStats):
    """vLLM's KVConnectorStats over a :class:`StatsCounter` dict: aggregation sums."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: C.KVConnectorStats) -> HmaConnectorStats:
        return HmaConnectorStats(data=_merge(self.data, other.data or {}))

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for k, v in sorted(self.data.items()):
            if isinstance(v, dict):
                for g, x in sorted(v.items(), key=lambda kv: int(kv[0])):
                    out[f"{k}[group {g}]"] = x
            else:
                out[k] = round(v, 6) if isinstance(v, float) else v
        return out

    def is_empty(self) -> bool:
        return not any(v for v in self.data.values())


class HmaPromMetrics(C.KVConnectorPromMetrics):
    """One Prometheus counter per name of :data:`COUNTERS` / :data:`GROUP_COUNTERS`
    (``vllm:hma_<name>``, exported as ``..._total``), per engine."""

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: {i: c.labels(*vals) for i, vals in per_engine_labelvalues.items()}
            for name, c in ((n, self._counter_cls(name=f"vllm:hma_{n}", documentation=h,
                                                  labelnames=labelnames))
                            for n, h in COUNTERS.items())}
        self._group_counters = {
            n: self._counter_cls(name=f"vllm:hma_{n}", documentation=h,
                                 labelnames=[*labelnames, "group"])
            for n, h in GROUP_COUNTERS.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        vals = self.per_engine_labelvalues.get(engine_idx, [])
        for name, v in (transfer_stats_data or {}).items():
            if name in self._counters and v:
                self._counters[name][engine_idx].inc(v)
            elif name in self._group_counters and isinstance(v, dict):
                for g, x in v.items():
                    if x:
                        self._group_counters[name].labels(*vals, str(g)).inc(x)
