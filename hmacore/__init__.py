"""hmacore: multi-group KV block bookkeeping for hybrid-attention KV-cache connectors.

The core (everything importable from here) needs numpy only. Transports live in
``hmacore.transport`` (NIXL, stores) and the vLLM connectors in ``hmacore.integrations.vllm``.
"""
from .errors import (ArgumentOverflowError, ArgumentTypeError, ArgumentValueError, BlockTableError,
                     ConfigError, ConfigFileError, DependencyError, HandshakeError,
                     HashInputError, HmacoreError, LayoutError, LayoutKeyError, PeerProcessError,
                     StoreError, TrackerStateError, TransferError)
from .grain import blocks_covering, cdiv, coarse_block_count, complete_blocks, grain_slice
from .hits import ExistenceSet, ExternalBlockPool, HitFinder, HitResult
from .keys import KeyBuilder, RankNamespace
from .plan import TransferPlan
from .presets import DEFAULT_PRESET, get_preset, preset_names
from .route_hashing import BlockHasher
from .route_index import ApplyStats, RouteResult, RoutingIndex
from .spec import GroupKind, GroupSpec, KVLayout, MambaMode
from .tables import (RequestState, TrackerSet, as_block_table, count_hashed, fill_blocks,
                     from_wire, to_wire)
from .windows import (clip_to_window, expand_to_kernel, map_block_size, trim_remote_to_local)

__all__ = ["ArgumentOverflowError", "ArgumentTypeError", "ArgumentValueError", "BlockTableError",
           "ConfigError", "ConfigFileError", "DependencyError", "HandshakeError", "HashInputError",
           "HmacoreError", "LayoutError", "LayoutKeyError", "PeerProcessError", "StoreError",
           "TrackerStateError", "TransferError", "blocks_covering", "cdiv", "coarse_block_count",
           "complete_blocks", "grain_slice", "ExistenceSet", "ExternalBlockPool", "HitFinder",
           "HitResult", "KeyBuilder", "RankNamespace", "TransferPlan", "DEFAULT_PRESET",
           "get_preset", "preset_names", "GroupKind", "GroupSpec", "KVLayout", "MambaMode",
           "RequestState", "TrackerSet", "as_block_table", "count_hashed", "fill_blocks",
           "from_wire", "to_wire", "clip_to_window", "expand_to_kernel", "map_block_size",
           "trim_remote_to_local", "RoutingIndex", "RouteResult", "ApplyStats", "BlockHasher"]

__version__ = "0.1.0"
