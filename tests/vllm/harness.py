"""Build vLLM 0.32 configs, KV cache configs, a real v1 Scheduler with HmaNixlConnector, and
drive it without a model (fake ModelRunnerOutput), the way vLLM's own connector unit tests do.

Test-only; every vLLM constructor call used by the tests lives here.
"""
from __future__ import annotations

import functools
import os
from typing import Any

import torch

from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig,
                         SchedulerConfig, VllmConfig)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,
                                        MambaSpec, MLAAttentionSpec, SlidingWindowMLASpec,
                                        SlidingWindowSpec)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from hmacore.integrations.vllm import _compat as C

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
GEMMA_DIR = os.path.join(FIXTURES, "gemma2_tiny")
MAX_LEN = 4096
DT = torch.float16


@functools.lru_cache(maxsize=None)
def model_config() -> ModelConfig:
    """One ModelConfig for the whole session (the first one costs seconds)."""
    return ModelConfig(model=GEMMA_DIR, tokenizer=GEMMA_DIR, skip_tokenizer_init=True,
                       dtype="auto", max_model_len=MAX_LEN)


def vllm_config(*, kv_role: str = "kv_both", block_size: int = 16, extra: dict | None = None,
                load_failure_policy: str = "fail", mamba_cache_mode: str | None = None,
                max_num_batched_tokens: int = 256, connector: bool = True) -> VllmConfig:
    cache = CacheConfig(block_size=block_size, enable_prefix_caching=True)
    if mamba_cache_mode is not None:
        cache.mamba_cache_mode = mamba_cache_mode
    ktc = None
    if connector:
        ktc = KVTransferConfig(kv_connector="HmaNixlConnector",
                               kv_connector_module_path="hmacore.integrations.vllm",
                               kv_role=kv_role, kv_connector_extra_config=dict(extra or {}),
                               kv_load_failure_policy=load_failure_policy)
    vc = VllmConfig(model_config=model_config(),
                    scheduler_config=SchedulerConfig(max_num_seqs=16,
                                                     max_num_batched_tokens=max_num_batched_tokens,
                                                     max_model_len=MAX_LEN,
                                                     is_encoder_decoder=False),
                    cache_config=cache, kv_transfer_config=ktc, device_config=DeviceConfig("cpu"))
    vc.cache_config.kv_cache_layout = "LBNHC"
    return vc


# -- KV cache configs -----------------------------------------------------------------------
def attn(bs: int, heads: int = 2, head: int = 16) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=bs, num_kv_heads=heads, head_size=head, dtype=DT)


def swa(bs: int, window: int, heads: int = 2, head: int = 16) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=bs, num_kv_heads=heads, head_size=head, dtype=DT,
                             sliding_window=window)


def mamba(bs: int, page: int, mode: str = "align", n_spec: int = 0) -> MambaSpec:
    return MambaSpec(block_size=bs, shapes=((4, 8), (16,)), dtypes=(DT, DT),
                     page_size_padded=page, mamba_cache_mode=mode, num_speculative_blocks=n_spec)


def group(names, spec) -> KVCacheGroupSpec:
    return KVCacheGroupSpec(list(names), spec)


def gemma_like(num_blocks: int = 400, bs: int = 16, window: int = 64) -> KVCacheConfig:
    """Full + sliding window (gemma-2-like), hand-made."""
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        group(["model.layers.1.attn", "model.layers.3.attn"], attn(bs)),
        group(["model.layers.0.attn", "model.layers.2.attn"], swa(bs, window)),
    ])


def qwen3_next_like(num_blocks: int = 400, bs: int = 64, mode: str = "align",
                    n_spec: int = 0) -> KVCacheConfig:
    """Full attention + Mamba (gated-DeltaNet-like) state, equal page sizes."""
    fa = attn(bs)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        group(["model.layers.3.attn"], fa),
        group(["model.layers.0.linear_attn"], mamba(bs, fa.page_size_bytes, mode, n_spec)),
    ])


def dsv4_like(num_blocks: int = 2000) -> KVCacheConfig:
    """Five groups, 256/64/64/4/8 tokens per block (DeepSeek-V4-like), from 0.32 spec classes:
    compressed MLA (256), SWA MLA (64, window 128), a second SWA-like group (64), the C4
    compressor state as SWA-MLA (bs 4, window 8) and C128 (bs 8, window 128)."""
    def mla(bs):
        return MLAAttentionSpec(block_size=bs, num_kv_heads=1, head_size=64, dtype=DT)

    def swmla(bs, w):
        return SlidingWindowMLASpec(block_size=bs, num_kv_heads=1, head_size=64, dtype=DT,
                                    sliding_window=w)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        group(["layers.0.attn"], mla(256)),
        group(["layers.0.swa"], swmla(64, 128)),
        group(["layers.1.swa"], swmla(64, 256)),
        group(["layers.0.c4"], swmla(4, 8)),
        group(["layers.0.c128"], swmla(8, 128)),
    ])


def derived_gemma(vc: VllmConfig, window: int = 128, bs: int = 16) -> KVCacheConfig:
    """vLLM's own grouping (get_kv_cache_configs) of the tiny gemma2 per-layer specs."""
    specs = {}
    for i in range(4):
        name = f"model.layers.{i}.self_attn.attn"
        specs[name] = swa(bs, window) if i % 2 == 0 else attn(bs)
    cfgs = C.get_kv_cache_configs(vc, [specs], [64 << 20])
    return C.generate_scheduler_kv_cache_config(cfgs)


def derived_hybrid_mamba(vc: VllmConfig, bs: int = 64, mode: str = "align") -> KVCacheConfig:
    """vLLM's own grouping of 3 Mamba layers : 1 full-attention layer (qwen3-next-like)."""
    fa = attn(bs)
    specs = {}
    for i in range(8):
        if i % 4 == 3:
            specs[f"model.layers.{i}.self_attn.attn"] = fa
        else:
            specs[f"model.layers.{i}.linear_attn"] = mamba(bs, fa.page_size_bytes, mode)
    cfgs = C.get_kv_cache_configs(vc, [specs], [64 << 20])
    return C.generate_scheduler_kv_cache_config(cfgs)


# -- scheduler -------------------------------------------------------------------------------
def make_scheduler(vc: VllmConfig, kcc: KVCacheConfig) -> Scheduler:
    sched_bs, hash_bs = C.resolve_kv_cache_block_sizes(kcc, vc)
    vc.cache_config.num_gpu_blocks = kcc.num_blocks
    return Scheduler(vllm_config=vc, kv_cache_config=kcc,
                     structured_output_manager=StructuredOutputManager(vc),
                     block_size=sched_bs, hash_block_size=hash_bs, log_stats=False)


_hashed_init = False


def make_request(rid: str, prompt: list[int], hash_bs: int, *, max_tokens: int = 4,
                 params: dict | None = None) -> Request:
    global _hashed_init
    if not _hashed_init:
        init_none_hash(sha256)
        _hashed_init = True
    extra = {"kv_transfer_params": dict(params)} if params is not None else None
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra)
    sp.update_from_generation_config({}, 1)
    return Request(request_id=rid, prompt_token_ids=list(prompt), sampling_params=sp,
                   pooling_params=None, mm_features=None,
                   block_hasher=get_request_block_hasher(hash_bs, sha256))


def runner_output(so: Any, *, token: int = 7, finished_sending=None, finished_recving=None,
                  failed_recving=None, worker_meta=None) -> ModelRunnerOutput:
    """One sampled token for every request that completed its prompt this step."""
    req_ids = list(so.num_scheduled_tokens)
    kvo = KVConnectorOutput(finished_sending=set(finished_sending or ()) or None,
                            finished_recving=set(finished_recving or ()) or None,
                            failed_recving=set(failed_recving or ()),
                            kv_connector_worker_meta=worker_meta)
    return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                             sampled_token_ids=[[token] for _ in req_ids], logprobs=None,
                             prompt_logprobs_dict={}, pooler_output=[],
                             kv_connector_output=kvo)


def free_blocks(sched: Scheduler) -> int:
    return sched.kv_cache_manager.block_pool.get_num_free_blocks()
