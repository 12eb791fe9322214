"""hmacore: multi-group KV block bookkeeping for hybrid-attention KV-cache connectors."""
from .errors import (BlockTableError, HandshakeError, HmacoreError, LayoutError,
                     TrackerStateError, TransferError)
from .grain import blocks_covering, cdiv, coarse_block_count, complete_blocks, grain_slice
from .presets import DEFAULT_PRESET, get_preset, preset_names
from .spec import GroupKind, GroupSpec, KVLayout, MambaMode

__version__ = "0.1.0"
