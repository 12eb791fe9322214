"""Engines' counted residency in one shared (group, hash) -> engine-mask table, and the
routing query (see _route.pyx)."""
from collections.abc import Hashable
from typing import Any, final

import numpy as np
import numpy.typing as npt

from hmacore.route_index import ApplyStats, RoutingIndex
from hmacore.spec import GroupKind

from ._hits import HitKernel

MAX_ENGINES: int
#: the event fields apply_events reads (per class: stored, then removed)
_FIELD_NAMES: tuple[str, ...]

@final
class SharedResidency:
    digest_size: int
    def __new__(cls, digest_size: int = 16) -> SharedResidency: ...
    def __reduce__(self) -> tuple[object, tuple[object, ...]]: ...
    def add_engine(self) -> int: ...
    def clear_engine(self, bit: int) -> None: ...
    def remove_engine(self, bit: int) -> None: ...
    def resident(self, bit: int) -> int: ...
    def duplicate_nbytes(self, bit: int) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def num_keys(self) -> int: ...
    def apply_rows(self, bit: int, ops: npt.NDArray[np.int8], groups: npt.NDArray[np.int32],
                   digests: npt.NDArray[np.uint8]) -> tuple[int, int, int, int]: ...
    def apply_events(self, bit: int, events: list[object], types: tuple[type, type, type],
                     medium: object, refused_kinds: tuple[dict[str, str], ...],
                     num_groups: int) -> tuple[int, int, int, int, int, int, int]: ...
    def apply_payload(self, bit: int, payload: bytes, medium: str | None,
                      refused_kinds: tuple[dict[str, str], ...], num_groups: int,
                      dp_rank: int) -> tuple[int, int, int, int, int, int, int] | None: ...
    def route(self, kernel: HitKernel, num_groups: int,
              hashes: list[bytes] | npt.NDArray[np.uint8], max_length: int,
              names: tuple[object, ...], bits: npt.NDArray[np.int64]
              ) -> tuple[dict[object, int], int, tuple[object, ...]]: ...

def apply_rows(residency: SharedResidency, bit: int, ops: npt.NDArray[np.int8],
               groups: npt.NDArray[np.int32],
               digests: npt.NDArray[np.uint8]) -> tuple[int, int, int, int]: ...
def apply_events(residency: SharedResidency, bit: int, events: list[object],
                 types: tuple[type, type, type], medium: object,
                 refused_kinds: tuple[dict[str, str], ...],
                 num_groups: int) -> tuple[int, int, int, int, int, int, int]: ...
def pack_event_lists(ops: list[int], groups: list[int], hashes: list[int], num_groups: int
                     ) -> tuple[npt.NDArray[np.int8], npt.NDArray[np.int32],
                                npt.NDArray[np.uint8], int]: ...

@final
class EventState:
    def __new__(cls, res: SharedResidency, engines: dict[Hashable, int], lock: Any,
                num_groups: int, no_refusals: tuple[dict[str, str], ...],
                stats_cls: type[ApplyStats]) -> EventState: ...
    def __reduce__(self) -> tuple[object, tuple[object, ...]]: ...

def index_apply_events(self: RoutingIndex, key: Hashable, events: list[Any],
                       types: tuple[type, type, type], *, medium: str | None = "GPU",
                       spec_kinds: dict[str, GroupKind] | None = None) -> ApplyStats: ...
def index_apply_payload(self: RoutingIndex, key: Hashable, payload: bytes, *, dp_rank: int = 0,
                        medium: str | None = "GPU",
                        spec_kinds: dict[str, GroupKind] | None = None) -> ApplyStats | None: ...
def index_apply_payloads(self: RoutingIndex, key: Hashable, payloads: list[bytes], *,
                         dp_rank: int = 0, medium: str | None = "GPU",
                         spec_kinds: dict[str, GroupKind] | None = None
                         ) -> tuple[ApplyStats, int]: ...
