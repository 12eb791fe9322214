"""Store key strings: hmacore's ``KeyBuilder.keys`` (all rows of a group in one call) next to
vLLM 0.32.0's Mooncake store layout (``RankLocalStoreLayout.key_for`` per block hash, what its
store worker calls), same digests, same key strings checked equal before timing.

vLLM's token hashing (``hash_block_tokens`` / ``get_request_block_hasher``) has no hmacore
counterpart: hmacore takes vLLM's digests as they are, so only key building is compared.
"""
from __future__ import annotations

import numpy as np
import pytest

from hmacore.keys import KeyBuilder, RankNamespace

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

ROWS = [256, 2048, 32768]       # hash rows of one group: 4k / 32k / 128k tokens at h = 16 / 16 / 4


def _vllm_layout():
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
        KeyMetadata, RankLocalStoreLayout)
    md = KeyMetadata(model_name="m", tp_rank=0, pcp_rank=0, dcp_rank=0, pp_rank=0, group_id=3)
    return RankLocalStoreLayout(md, block_size=16, hash_block_size=16)


@pytest.mark.parametrize("rows", ROWS, ids=lambda n: {256: "4k", 2048: "32k", 32768: "128k"}[n])
@pytest.mark.parametrize("impl", ["hmacore", "vllm"])
def test_keys(benchmark, rows, impl):
    rng = np.random.default_rng(0)
    digests = rng.integers(0, 256, (rows, 32), dtype=np.uint8)
    hashes = [bytes(r) for r in digests]
    kb = KeyBuilder("m", RankNamespace())
    lay = _vllm_layout()
    want = [lay.key_for(0, h) for h in hashes]
    assert kb.keys(3, digests) == want
    benchmark.group = f"keys-{ {256: '4k', 2048: '32k', 32768: '128k'}[rows]}"
    benchmark.extra_info["impl"] = impl
    benchmark.extra_info["keys"] = rows
    if impl == "hmacore":
        benchmark(kb.keys, 3, digests)
    else:
        benchmark(lambda: [lay.key_for(0, h) for h in hashes])
