"""KV events of the store tier: what ``HmaStoreConnector``'s store gains and loses, per group.

The worker reads the store's change journal (``EmbeddedStore.watch_changes``: a put of a new
key, an eviction, a remove) after its saves and hands the changes of this engine's own keys
to vLLM as ``BlockStored`` / ``BlockRemoved`` events (``medium`` = :data:`STORE_MEDIUM`)
through ``get_kv_connector_kv_cache_events``; the scheduler side collects them in
``update_connector_output`` and vLLM publishes them with the engine's own events
(``take_events``). A store key of group g named by hash row r is reported as that row's hash
with ``group_idx`` g: the same ``(group, row hash)`` key space as the engine's events, so a
:class:`hmacore.RoutingIndex` fed with the store's events (a second tier) scores the store hit
the connector itself computes.

A shared-memory store (``store_scope`` ``"shared"``) is changed by every process attached to
it: this engine's worker, and any other engine naming the same store (``store_name``), whose
saves evict this engine's keys too. There the scheduler side reports instead
(:class:`SharedStoreEventSource`): at each ``take_events`` it reads the segment's event log
from its own position (:class:`~hmacore.transport.shared_changes.ChangeFeed`) and reports
every change of this engine's key namespace, whoever made it; when it fell behind the log's
ring (or the store was reset) it reports the difference between the store and what it had
reported. Every engine attached to one store so reports the same store contents (for its
own namespace).
"""
from __future__ import annotations

from typing import Any

from ....keys import KeyBuilder
from ....spec import KVLayout
from ....transport.store import split_key
from .. import _compat as C

__all__ = ["STORE_MEDIUM", "StoreKVEvents", "StoreEventSource", "SharedStoreEventSource",
           "own_namespaces"]

#: ``BlockStored.medium`` / ``BlockRemoved.medium`` of the store tier's events
STORE_MEDIUM = "HMACORE_STORE"


class StoreKVEvents(C.KVConnectorKVEvents):
    """vLLM's container of a connector's KV events (one worker: TP = PP = 1)."""

    def __init__(self, events: list | None = None, num_workers: int = 1) -> None:
        self._events: list = list(events or [])
        self._workers = num_workers

    def add_events(self, events: list) -> None:
        self._events.extend(events)

    def aggregate(self) -> StoreKVEvents:
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._workers += count

    def get_all_events(self) -> list:
        return list(self._events)

    def get_number_of_workers(self) -> int:
        return self._workers

    def clear_events(self) -> None:
        self._events = []


def own_namespaces(keys: KeyBuilder, layout: KVLayout) -> set[str]:
    """The key namespaces this engine's saves write (its groups' prefixes without the
    ``@group:<g>`` tail)."""
    return {keys.prefix(g).rpartition("@group:")[0] for g in range(layout.num_groups)}


def _events(kind: tuple[bool, int], hashes: list, layout: KVLayout) -> Any:
    present, g = kind
    if present:
        return C.BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[],
                             block_size=layout.groups[g].block_size, lora_id=None,
                             medium=STORE_MEDIUM, lora_name=None, group_idx=g)
    return C.BlockRemoved(block_hashes=hashes, medium=STORE_MEDIUM, group_idx=g)


class StoreEventSource:
    """This engine's store changes as vLLM KV events (worker side).

    Args:
        store: a store with a change journal (``watch_changes`` / ``take_changes``).
        keys: the engine's key builder (only keys of its own group namespaces are reported).
        layout: the store layout (block size per group).
    """

    def __init__(self, store: Any, keys: KeyBuilder, layout: KVLayout) -> None:
        self.store = store
        self.layout = layout
        self._own = own_namespaces(keys, layout)
        self._journal = store.watch_changes()

    def take(self) -> list:
        """Events of the changes since the last call, in order: one event per run of changes
        of one kind and one group."""
        events: list = []
        run: list = []
        kind: tuple[bool, int] | None = None
        for key, present in self.store.take_changes(self._journal):
            parts = split_key(key)
            if parts is None or parts[0] not in self._own or parts[1] >= self.layout.num_groups:
                continue
            if (present, parts[1]) != kind:
                self._emit(events, kind, run)
                kind, run = (present, parts[1]), []
            run.append(C.event_block_hash(parts[2]))
        self._emit(events, kind, run)
        return events

    def _emit(self, events: list, kind: tuple[bool, int] | None, hashes: list) -> None:
        if kind is not None and hashes:
            events.append(_events(kind, hashes, self.layout))

    def close(self) -> None:
        self.store.unwatch_changes(self._journal)


class SharedStoreEventSource:
    """A shared store's changes of this engine's keys as vLLM KV events (scheduler side;
    see the module docstring).

    Args:
        store: the :class:`~hmacore.transport.shared_store.SharedStore`.
        keys: the engine's key builder; layout: the store layout (groups, block sizes).
    """

    def __init__(self, store: Any, keys: KeyBuilder, layout: KVLayout) -> None:
        from ....transport.shared_changes import ChangeFeed
        self.layout = layout
        self.feed = ChangeFeed(store, sorted(own_namespaces(keys, layout)))

    @property
    def resyncs(self) -> int:
        """Times the feed compared the store with what it had reported (its first read, a
        fall behind the log's ring, a store reset)."""
        return self.feed.resyncs

    def take(self) -> list:
        """Events of the changes since the last call, in order (a resync: removals, then
        stores); groups this engine does not have are left out."""
        events: list = []
        for run in self.feed.read():
            if run.group < self.layout.num_groups:
                events.append(_events((run.present, run.group),
                                      [C.event_block_hash(d) for d in run.digests],
                                      self.layout))
        return events
