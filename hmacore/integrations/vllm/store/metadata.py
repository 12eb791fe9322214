"""Scheduler -> worker payloads of :class:`HmaStoreConnector` (they cross process boundaries:
lists, int32 arrays, bytes and ints, all picklable). Tokens are tokens; block tables per group, blocks of that
group (vLLM group order)."""
from __future__ import annotations

import dataclasses
from typing import Any

from .._compat import KVConnectorMetadata

__all__ = ["StoreLoad", "StoreSave", "HmaStoreConnectorMetadata"]


@dataclasses.dataclass
class StoreLoad:
    """One store load: fill the blocks of ``[skip_tokens, hit_tokens)`` from the store.

    ``block_ids`` is the request's full per-group table at allocation (positional, null
    block 0 included); ``hashes`` the raw hash rows (``num_rows * digest_size`` bytes) of the
    first ``hit_tokens // hash_block_size`` rows. The worker derives each group's load mask
    (``HitFinder.load_masks``) and skips blocks the local prefix cache already holds.
    """

    request_id: str
    hit_tokens: int
    skip_tokens: int
    block_ids: list[list[int]]
    hashes: bytes
    digest_size: int
    awaiting: bool = False              # async load: report finished_recving


@dataclasses.dataclass
class StoreSave:
    """One store save: the blocks of ``[start_token, num_tokens)`` the store mask keeps.

    Incremental: ``block_ids[g]`` holds group g's table positions ``[block_offsets[g],
    num_tokens // block_size_g)`` only (the positions this save may store), and ``hashes``
    the hash rows ``[row_offset, num_tokens // hash_block_size)``. ``num_tokens`` is a
    multiple of the hit alignment.
    """

    request_id: str
    start_token: int
    num_tokens: int
    block_ids: list[Any]         # per group an int32 array (or a list of ints)
    hashes: bytes
    digest_size: int
    #: (group, block id) of Mamba (align mode) groups whose state after exactly
    #: ``num_tokens`` tokens sits in that block: saved by a boundary put (``save_state``).
    state_blocks: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    #: per group, the table position of ``block_ids[g][0]``
    block_offsets: list[int] | None = None
    #: the hash row of the first row in ``hashes``
    row_offset: int = 0


@dataclasses.dataclass
class HmaStoreConnectorMetadata(KVConnectorMetadata):
    """Per-step metadata of :class:`HmaStoreConnector`. Loads come at allocation, saves once
    a request's tokens are computed: a sync load's request also saves the rest of its prompt
    in the step it loads (the worker skips that save when the load failed)."""

    loads: dict[str, StoreLoad] = dataclasses.field(default_factory=dict)
    saves: dict[str, StoreSave] = dataclasses.field(default_factory=dict)
