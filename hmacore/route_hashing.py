"""vLLM's prefix-cache block hashes, re-implemented in the core (no vLLM import).

vLLM (``vllm/v1/core/kv_cache_utils.py``, ``vllm/utils/hashing.py``) names the first
``(j+1) * hash_block_size`` tokens of a prompt by a chained hash: row j is
``hash_fn((parent, tuple(block_token_ids), extra_keys))`` with ``parent`` the previous row (for
row 0 the seed hash ``NONE_HASH = hash_fn(seed)``). ``hash_fn`` is the engine's
``--prefix-caching-hash-algo``: ``sha256`` (pickle, protocol 5) or ``sha256_cbor`` (canonical
CBOR), 32-byte digests; ``xxhash`` / ``xxhash_cbor`` (xxh3-128 of the same encodings), 16 bytes.
The seed is ``PYTHONHASHSEED`` if the engine has it set, else the fixed ``"vllm-none-hash"`` for
the sha256 algorithms; xxhash engines without ``PYTHONHASHSEED`` use a random per-process seed
that no router can reproduce, so they are refused here.

Only prompts without LoRA, multimodal inputs, cache salt or prompt embeddings hash with
``extra_keys = None``; for the others pass vLLM's own hashes to ``RoutingIndex.query_hashes``.
"""
from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable, Sequence
from typing import Any

from .errors import ConfigError, HashInputError

__all__ = ["HASH_ALGOS", "DEFAULT_SEED", "BlockHasher"]

HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
#: vLLM's seed for the sha256 algorithms when PYTHONHASHSEED is unset
DEFAULT_SEED = "vllm-none-hash"


def _pickle(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _cbor(obj: Any) -> bytes:
    try:
        import cbor2
    except ImportError as e:   # optional: only the *_cbor algorithms need it
        raise ConfigError("hash_algo '*_cbor' needs the cbor2 package (pip install cbor2)") from e
    return cbor2.dumps(obj, canonical=True)


def _xxh3_128(data: bytes) -> bytes:
    try:
        import xxhash
    except ImportError as e:
        raise ConfigError("hash_algo 'xxhash*' needs the xxhash package (pip install xxhash)") from e
    return xxhash.xxh3_128_digest(data)


def _hash_fn(algo: str) -> Callable[[Any], bytes]:
    encode = _cbor if algo.endswith("_cbor") else _pickle
    if algo.startswith("sha256"):
        return lambda obj: hashlib.sha256(encode(obj)).digest()
    return lambda obj: _xxh3_128(encode(obj))


class BlockHasher:
    """Chained block hashes of token ids, equal to vLLM's ``Request.block_hashes``.

    Args:
        hash_block_size: tokens per hash row (vLLM's hash block size, the gcd of the group
            block sizes).
        hash_algo: the engine's ``--prefix-caching-hash-algo``.
        seed: the engine's ``PYTHONHASHSEED``; None reads this process's ``PYTHONHASHSEED``
            and falls back to vLLM's default for the sha256 algorithms.
    """

    def __init__(self, hash_block_size: int, hash_algo: str = "sha256",
                 seed: str | None = None) -> None:
        if isinstance(hash_block_size, bool) or not isinstance(hash_block_size, int) \
                or hash_block_size <= 0:
            raise ConfigError(f"hash_block_size must be an int > 0 (tokens), got {hash_block_size!r}")
        if hash_algo not in HASH_ALGOS:
            raise ConfigError(f"hash_algo must be one of {HASH_ALGOS}, got {hash_algo!r}")
        if seed is None:
            seed = os.environ.get("PYTHONHASHSEED")
        if seed is None:
            if hash_algo.startswith("xxhash"):
                raise ConfigError(f"hash_algo {hash_algo!r} without PYTHONHASHSEED: vLLM seeds "
                                  "it randomly per process; set PYTHONHASHSEED to the same "
                                  "value for the engines and pass it as seed")
            seed = DEFAULT_SEED
        if not isinstance(seed, str):
            raise ConfigError(f"seed must be a str (PYTHONHASHSEED), got {type(seed).__name__}")
        self.hash_block_size = hash_block_size
        self.hash_algo = hash_algo
        self.seed = seed
        self._fn = _hash_fn(hash_algo)
        self.none_hash = self._fn(seed)
        self.digest_size = len(self.none_hash)

    def hashes(self, token_ids: Sequence[int]) -> list[bytes]:
        """One digest per full ``hash_block_size``-token block of ``token_ids`` (a trailing
        partial block has none, as in vLLM)."""
        if hasattr(token_ids, "tolist"):
            token_ids = token_ids.tolist()     # numpy ints pickle differently from ints
        elif not isinstance(token_ids, list):
            token_ids = list(token_ids)
        if token_ids and not set(map(type, token_ids)) <= {int}:
            raise HashInputError("token_ids must be Python or numpy ints (not bool/float)")
        h = self.hash_block_size
        fn = self._fn
        parent = self.none_hash
        out = []
        for start in range(0, len(token_ids) - h + 1, h):
            block = tuple(token_ids[start:start + h])
            parent = fn((parent, block, None))
            out.append(parent)
        return out
