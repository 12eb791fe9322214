"""``ChangeFeed``: one reader's exact, ordered view of what a :class:`~.shared_store.SharedStore`
gains and loses in some key namespaces, whichever process made the change.

Every process attached to a shared store may put, overwrite, evict (CLOCK) or remove keys;
each change of a namespaced key is a row of the segment's event log (a ring of ``log_cap``
rows). A feed keeps its own position in the log and the set of keys it has reported, and
:meth:`ChangeFeed.read` returns the changes since the last call as runs of one kind and one
group, in log order. Its output has set semantics (a key is reported present at most once
until it is reported gone, and only a reported key is reported gone), so a consumer that
counts (``RoutingIndex``) holds exactly the store's keys.

When the log cannot be followed (the first read; the feed fell more than ``log_cap`` rows
behind and its rows were overwritten; the store was emptied by a crash reset, which logs no
removals) the feed resyncs: it compares a snapshot of the store's keys with what it reported
and returns the difference (removals of keys gone, then stores of keys new). The consumer
never sees a wrong residency and never needs a clear; ``resyncs`` counts them.

Memory: the reported set is a Python set of ``group + digest`` bytes (about 100 bytes per key
in the store).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import numpy as np

from ..errors import HashInputError
from .shared_store import REMOVED, SharedStore

__all__ = ["ChangeFeed", "ChangeRun"]


@dataclasses.dataclass(frozen=True)
class ChangeRun:
    """Keys of one group that entered (``present``) or left the store, in log order;
    ``digests`` at each key's own width."""

    present: bool
    group: int
    digests: list[bytes]


class ChangeFeed:
    """The changes of ``namespaces``' keys in ``store`` (see the module docstring).

    Args:
        store: an open SharedStore.
        namespaces: key namespaces to follow (KeyBuilder prefixes without ``@group:<g>``).
    """

    def __init__(self, store: SharedStore, namespaces: str | Iterable[str]) -> None:
        if not isinstance(store, SharedStore):
            raise HashInputError(f"store must be a SharedStore, got {type(store).__name__}")
        names = (namespaces,) if isinstance(namespaces, str) else tuple(namespaces)
        if not names or not all(isinstance(n, str) and n for n in names):
            raise HashInputError(f"namespaces must be one or more non-empty strs, got "
                                 f"{namespaces!r}")
        self.store = store
        self.namespaces = names
        self._seen = -1          # log position; -1: never read (the first read resyncs)
        self._gen = -1
        self._reported: set[bytes] = set()
        self.resyncs = 0
        self.skipped = 0         # log rows that changed nothing reported (0 unless a bug)

    def __len__(self) -> int:
        """Keys reported present and not reported gone."""
        return len(self._reported)

    def read(self) -> list[ChangeRun]:
        """The changes since the last call (a resync's difference when the log could not
        be followed), as runs of one kind and one group."""
        got = self.store.read_log(self.namespaces, self._seen, self._gen)
        self._seen, self._gen = got.head, got.gen
        if got.snapshot:
            self.resyncs += 1
            return self._resync(got.metas, got.digests)
        return self._follow(got.metas, got.digests)

    @staticmethod
    def _key(meta: int, digest: np.ndarray) -> bytes:
        width = (meta >> 48) & 0xFF
        return (meta & 0xFFFFFFFF).to_bytes(4, "little") + digest[:width].tobytes()

    def _follow(self, metas: np.ndarray, digests: np.ndarray) -> list[ChangeRun]:
        runs: list[ChangeRun] = []
        reported = self._reported
        for meta, d in zip(metas.tolist(), digests):
            present = not meta & REMOVED
            key = self._key(meta, d)
            if present == (key in reported):
                self.skipped += 1   # not a change of what this feed reported: keep sets exact
                continue
            if present:
                reported.add(key)
            else:
                reported.discard(key)
            self._append(runs, present, key)
        return runs

    def _resync(self, metas: np.ndarray, digests: np.ndarray) -> list[ChangeRun]:
        now = {self._key(m, d) for m, d in zip(metas.tolist(), digests)}
        runs: list[ChangeRun] = []
        for key in sorted(self._reported - now):
            self._append(runs, False, key)
        for key in sorted(now - self._reported):
            self._append(runs, True, key)
        self._reported = now
        return runs

    @staticmethod
    def _append(runs: list[ChangeRun], present: bool, key: bytes) -> None:
        group = int.from_bytes(key[:4], "little")
        if runs and runs[-1].present == present and runs[-1].group == group:
            runs[-1].digests.append(key[4:])
        else:
            runs.append(ChangeRun(present, group, [key[4:]]))
