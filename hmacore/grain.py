"""Unit conversions between tokens and blocks of group g, as named functions.

Units: ``tokens`` are token counts; ``blocks`` are blocks of one group (``block_size`` tokens
each). Nothing here guesses a "base block size": the caller names both grains.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = [
    "cdiv", "blocks_covering", "complete_blocks", "grain_slice", "coarse_block_count",
]


def _check_nonneg(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            import numpy as np
            if isinstance(value, np.integer):
                value = int(value)
            else:
                raise TypeError
        except TypeError:
            raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def _check_pos(name: str, value: int) -> int:
    value = _check_nonneg(name, value)
    if value == 0:
        raise ValueError(f"{name} must be > 0, got 0")
    return value


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ``a`` and positive ``b``."""
    return -(-a // b)


def blocks_covering(tokens: int, block_size: int) -> int:
    """Blocks of ``block_size`` tokens needed to hold ``tokens`` tokens (ceil).

    Use for allocation and for "which blocks does a request touch".
    """
    return cdiv(_check_nonneg("tokens", tokens), _check_pos("block_size", block_size))


def complete_blocks(tokens: int, block_size: int) -> int:
    """Blocks of ``block_size`` tokens that ``tokens`` tokens fill completely (floor).

    Use for hashing, caching and storing: only complete blocks have a hash.
    """
    return _check_nonneg("tokens", tokens) // _check_pos("block_size", block_size)


def grain_slice(start: int, end: int, grain: int, block_size: int) -> tuple[int, int]:
    """Map a ``[start, end)`` range counted in units of ``grain`` tokens to blocks of ``block_size``.

    The divide-or-multiply rule: when ``block_size >= grain`` the block is ``block_size // grain``
    grain units, so positions divide; when ``block_size < grain`` each grain unit spans
    ``grain // block_size`` blocks, so positions multiply. The naive ``grain // block_size``
    multiplier is 0 for ``block_size > grain`` and yields empty slices (vLLM PR 42437, DSv4:
    grain 4, group block sizes 256/64/64/4/8). The larger size must be a multiple of the smaller.

    Returns ``(block_start, block_end)`` in blocks of ``block_size``.
    """
    _check_nonneg("start", start)
    _check_nonneg("end", end)
    grain = _check_pos("grain", grain)
    block_size = _check_pos("block_size", block_size)
    if end < start:
        raise ValueError(f"end ({end}) must be >= start ({start})")
    if block_size >= grain:
        if block_size % grain:
            raise ValueError(f"block_size ({block_size}) must be a multiple of grain ({grain})")
        ratio = block_size // grain
        return start // ratio, end // ratio
    if grain % block_size:
        raise ValueError(f"grain ({grain}) must be a multiple of block_size ({block_size})")
    ratio = grain // block_size
    return start * ratio, end * ratio


def coarse_block_count(lengths: Mapping[int, int] | Sequence[int],
                       block_sizes: Sequence[int], grain: int) -> int:
    """Number of complete ``grain``-token units covered by EVERY group.

    ``lengths[g]`` is the number of blocks group g holds (blocks of ``block_sizes[g]``); a group
    missing from a mapping counts as 0 blocks, so the result is 0 until every group has blocks
    (the PR 42437 review bug: skipping absent groups over-counts). Returns grain units.
    """
    grain = _check_pos("grain", grain)
    if not block_sizes:
        return 0
    best = None
    for g, bs in enumerate(block_sizes):
        bs = _check_pos(f"block_sizes[{g}]", bs)
        if isinstance(lengths, Mapping):
            n = lengths.get(g, 0)
        else:
            if len(lengths) != len(block_sizes):
                raise ValueError(f"lengths has {len(lengths)} groups, block_sizes has {len(block_sizes)}")
            n = lengths[g]
        n = _check_nonneg(f"lengths[{g}]", n)
        units = n * bs // grain
        best = units if best is None else min(best, units)
    return best
