"""Unit conversions between tokens and blocks of group g, as named functions.

Units: ``tokens`` are token counts; ``blocks`` are blocks of one group (``block_size`` tokens
each). Nothing here guesses a "base block size": the caller names both grains.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

from .errors import ArgumentTypeError, ArgumentValueError

__all__ = [
    "cdiv", "blocks_covering", "complete_blocks", "grain_slice", "coarse_block_count",
]


def _as_int(name: str, value) -> int:
    """``value`` as a Python int: ints and numpy integers; never bools, floats or strings
    (a float would be truncated silently)."""
    if type(value) is int:
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            import numpy as np
        except ImportError:  # pragma: no cover - numpy is a dependency
            np = None  # type: ignore[assignment]  # the numpy-less fallback
        if np is not None and isinstance(value, np.integer):
            return int(value)
        raise ArgumentTypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return int(value)


def _check_nonneg(name: str, value: int) -> int:
    value = _as_int(name, value)
    if value < 0:
        raise ArgumentValueError(f"{name} must be >= 0, got {value}")
    return value


def _check_pos(name: str, value: int) -> int:
    value = _check_nonneg(name, value)
    if value == 0:
        raise ArgumentValueError(f"{name} must be > 0, got 0")
    return value


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ``a`` and positive ``b`` (ints or numpy integers).

    Raises ArgumentTypeError (a TypeError) for floats and bools, ArgumentValueError (a
    ValueError) for ``a < 0`` or ``b <= 0``.
    """
    if type(a) is int and type(b) is int and a >= 0 and b > 0:  # the common case, fast
        return -(-a // b)
    a = _check_nonneg("a", a)
    b = _check_pos("b", b)
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
        raise ArgumentValueError(f"end ({end}) must be >= start ({start})")
    if block_size >= grain:
        if block_size % grain:
            raise ArgumentValueError(f"block_size ({block_size}) must be a multiple of grain ({grain})")
        ratio = block_size // grain
        return start // ratio, end // ratio
    if grain % block_size:
        raise ArgumentValueError(f"grain ({grain}) must be a multiple of block_size ({block_size})")
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
    if isinstance(block_sizes, (str, bytes, Mapping)) or not hasattr(block_sizes, "__len__"):
        raise ArgumentTypeError(f"block_sizes must be a sequence of ints, got "
                                f"{type(block_sizes).__name__}")
    sizes = [_check_pos(f"block_sizes[{g}]", bs) for g, bs in enumerate(block_sizes)]
    if isinstance(lengths, Mapping):
        for g in lengths:
            if isinstance(g, bool) or not hasattr(g, "__index__") or not 0 <= g < len(sizes):
                raise ArgumentValueError(f"lengths has group {g!r}, block_sizes has "
                                         f"{len(sizes)} groups (ids 0..{len(sizes) - 1})")
        counts = [lengths.get(g, 0) for g in range(len(sizes))]
    elif isinstance(lengths, (str, bytes)) or not hasattr(lengths, "__len__"):
        raise ArgumentTypeError(f"lengths must be a sequence or a mapping of ints, got "
                                f"{type(lengths).__name__}")
    else:
        if len(lengths) != len(sizes):
            raise ArgumentValueError(f"lengths has {len(lengths)} groups, block_sizes has "
                                     f"{len(sizes)}")
        counts = [lengths[g] for g in range(len(sizes))]
    if not sizes:
        return 0
    best = None
    for g, (n, bs) in enumerate(zip(counts, sizes)):
        n = _check_nonneg(f"lengths[{g}]", n)
        units = n * bs // grain
        best = units if best is None else min(best, units)
    assert best is not None  # sizes is non-empty, so the loop ran
    return best
