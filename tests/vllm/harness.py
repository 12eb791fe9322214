"""Build vLLM 0.32 configs, KV cache configs, a real v1 Scheduler with HmaNixlConnector, and
drive it without a model (fake ModelRunnerOutput), the way vLLM's own connector unit tests do.

Test-only; every vLLM constructor call used by the tests lives here.
"""
from __future__ import annotations

import copy
import functools
import os
import sys
from typing import Any

import torch

from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig,
                         ParallelConfig, SchedulerConfig, SpeculativeConfig, VllmConfig)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,
                                        MambaSpec, MLAAttentionSpec, SlidingWindowMLASpec,
                                        SlidingWindowSpec)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus  # noqa: F401 (re-exported for tests)
from vllm.v1.structured_output import StructuredOutputManager

from hmacore.integrations.vllm import _compat as C
from hmacore.integrations.vllm.nixl.metadata import HmaNixlWorkerMeta
from hmacore.integrations.vllm.nixl.push_metadata import HmaPushWorkerMeta

# tests/ on the path: the shared test helpers (ports) live there
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
GEMMA_DIR = os.path.join(FIXTURES, "gemma2_tiny")
EAGLE_DIR = os.path.join(FIXTURES, "eagle_tiny")     # a one-layer llama: an EAGLE draft config
MAX_LEN = 4096
DT = torch.float16


@functools.lru_cache(maxsize=None)
def model_config() -> ModelConfig:
    """One ModelConfig for the whole session (the first one costs seconds)."""
    return ModelConfig(model=GEMMA_DIR, tokenizer=GEMMA_DIR, skip_tokenizer_init=True,
                       dtype="auto", max_model_len=MAX_LEN)


#: store_capacity_bytes of the tests' HmaStoreConnector configs (see vllm_config)
STORE_TEST_CAPACITY = 64 << 20


def vllm_config(*, kv_role: str = "kv_both", block_size: int = 16, extra: dict | None = None,
                load_failure_policy: str = "fail", mamba_cache_mode: str | None = None,
                max_num_batched_tokens: int = 256, connector: bool = True,
                kv_connector: str = "HmaNixlConnector", tp: int = 1,
                engine_id: str | None = None, kv_cache_layout: str = "LBNHC",
                speculative: str | None = None, eagle_block_drop: bool = True,
                prefix_caching: bool = True) -> VllmConfig:
    """``speculative``: a speculative method drafting with the ``eagle_tiny`` config (e.g.
    ``"eagle"``; ``eagle_block_drop=False`` sets vLLM's ``disable_eagle_block_drop``)."""
    cache = CacheConfig(block_size=block_size, enable_prefix_caching=prefix_caching)
    if mamba_cache_mode is not None:
        cache.mamba_cache_mode = mamba_cache_mode
    ktc = None
    if connector:
        extra = dict(extra or {})
        if kv_connector == "HmaStoreConnector":
            # the shared store reserves its whole capacity in /dev/shm at creation (1 GiB by
            # default) and a pytest process keeps every store it opened: tests hold 64 MiB
            extra.setdefault("store_capacity_bytes", STORE_TEST_CAPACITY)
        ktc = KVTransferConfig(kv_connector=kv_connector,
                               kv_connector_module_path="hmacore.integrations.vllm",
                               kv_role=kv_role, kv_connector_extra_config=extra,
                               kv_load_failure_policy=load_failure_policy)
        if engine_id is not None:   # rank processes must share the scheduler's engine id
            ktc.engine_id = engine_id
    parallel = ParallelConfig(tensor_parallel_size=tp)
    spec = None
    if speculative is not None:
        spec = SpeculativeConfig(method=speculative, model=EAGLE_DIR, num_speculative_tokens=1,
                                 disable_eagle_block_drop=not eagle_block_drop,
                                 target_model_config=model_config(),
                                 target_parallel_config=parallel)
    vc = VllmConfig(model_config=model_config(),
                    scheduler_config=SchedulerConfig(max_num_seqs=16,
                                                     max_num_batched_tokens=max_num_batched_tokens,
                                                     max_model_len=MAX_LEN,
                                                     is_encoder_decoder=False),
                    cache_config=cache, kv_transfer_config=ktc, device_config=DeviceConfig("cpu"),
                    parallel_config=parallel, speculative_config=spec)
    vc.cache_config.kv_cache_layout = kv_cache_layout
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


def gemma_like(num_blocks: int = 400, bs: int = 16, window: int = 64, heads: int = 2,
               head: int = 16) -> KVCacheConfig:
    """Full + sliding window (gemma-2-like), hand-made; ``heads`` KV heads per TP rank."""
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        group(["model.layers.1.attn", "model.layers.3.attn"], attn(bs, heads, head)),
        group(["model.layers.0.attn", "model.layers.2.attn"], swa(bs, window, heads, head)),
    ])


def qwen3_next_like(num_blocks: int = 400, bs: int = 64, mode: str = "align",
                    n_spec: int = 0) -> KVCacheConfig:
    """Full attention + Mamba (gated-DeltaNet-like) state, equal page sizes."""
    fa = attn(bs)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        group(["model.layers.3.attn"], fa),
        group(["model.layers.0.linear_attn"], mamba(bs, fa.page_size_bytes, mode, n_spec)),
    ])


def dsv4_like(num_blocks: int = 2000, sizes: tuple[int, ...] = (256, 64, 64, 4, 8)
              ) -> KVCacheConfig:
    """Five groups, 256/64/64/4/8 tokens per block (DeepSeek-V4-like), from 0.32 spec classes:
    compressed MLA (256), SWA MLA (64, window 128), a second SWA-like group (64), the C4
    compressor state as SWA-MLA (bs 4, window 8) and C128 (bs 8, window 128). ``sizes``:
    other block sizes per group (a block-size remap peer)."""
    def mla(bs):
        return MLAAttentionSpec(block_size=bs, num_kv_heads=1, head_size=64, dtype=DT)

    def swmla(bs, w):
        return SlidingWindowMLASpec(block_size=bs, num_kv_heads=1, head_size=64, dtype=DT,
                                    sliding_window=w)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        group(["layers.0.attn"], mla(sizes[0])),
        group(["layers.0.swa"], swmla(sizes[1], 128)),
        group(["layers.1.swa"], swmla(sizes[2], 256)),
        group(["layers.0.c4"], swmla(sizes[3], 8)),
        group(["layers.0.c128"], swmla(sizes[4], 128)),
    ])


def derived_gemma(vc: VllmConfig) -> KVCacheConfig:
    """vLLM's own grouping (get_kv_cache_configs) of the tiny gemma2's per-layer specs.

    The per-layer specs are what the model's attention layers report, built here from the
    fixture's config.json (layer_types, sliding_window, KV heads, head_dim) and the cache
    block size: instantiating the model needs the CUDA/CPU kernels this setup does not have.
    """
    hf = vc.model_config.hf_config
    bs = vc.cache_config.block_size
    specs = {}
    for i, kind in enumerate(hf.layer_types):
        name = f"model.layers.{i}.self_attn.attn"
        specs[name] = (swa(bs, hf.sliding_window, hf.num_key_value_heads, hf.head_dim)
                       if kind == "sliding_attention"
                       else attn(bs, hf.num_key_value_heads, hf.head_dim))
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


def runner_output(so: Any, sched: Scheduler | None = None, *, token: int = 7,
                  finished_sending=None, finished_recving=None, failed_recving=None,
                  worker_meta=None, invalid_block_ids=None) -> ModelRunnerOutput:
    """One sampled token for every scheduled request whose prompt is complete after this
    step (a partial prefill chunk samples nothing, as in the real model runner)."""
    req_ids = list(so.num_scheduled_tokens)

    def sampled(rid):
        r = sched.requests.get(rid) if sched is not None else None
        if r is not None and r.num_computed_tokens < r.num_tokens:
            return []
        return [token]
    kvo = KVConnectorOutput(finished_sending=set(finished_sending or ()) or None,
                            finished_recving=set(finished_recving or ()) or None,
                            failed_recving=set(failed_recving or ()),
                            invalid_block_ids=set(invalid_block_ids or ()),
                            kv_connector_worker_meta=worker_meta)
    if not req_ids and hasattr(ModelRunnerOutput, "with_kv_conn_output_only"):
        # what vLLM's model runner returns on a step with nothing scheduled
        # (kv_connector_no_forward): no connector output at all when the workers reported
        # nothing, so the scheduler side's update_connector_output is not called. A copy:
        # vLLM's KVOutputAggregator (tp_harness) assigns into the output it returns, and
        # this may be vLLM's shared EMPTY_MODEL_RUNNER_OUTPUT (a worker's output crosses a
        # process boundary in vLLM, so each is its own object there)
        return copy.copy(ModelRunnerOutput.with_kv_conn_output_only(kvo))
    return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                             sampled_token_ids=[sampled(r) for r in req_ids], logprobs=None,
                             prompt_logprobs_dict={}, pooler_output=[],
                             kv_connector_output=kvo)


def free_blocks(sched: Scheduler) -> int:
    return sched.kv_cache_manager.block_pool.get_num_free_blocks()


# -- driving -------------------------------------------------------------------------------
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def assert_mirror(tracked, table, kcc: KVCacheConfig, where="") -> None:
    """A connector's incrementally followed table against vLLM's own: same length per group,
    equal at every position except where vLLM nulled a block in place (sliding-window blocks
    out of the window, superseded Mamba states), never in a full-attention group."""
    assert len(tracked) == len(table), where
    for g, (mine, theirs, grp) in enumerate(zip(tracked, table, kcc.kv_cache_groups)):
        mine, theirs = [int(x) for x in mine], [int(x) for x in theirs]
        assert len(mine) == len(theirs), (where, g, len(mine), len(theirs))
        stale = [p for p, (a, b) in enumerate(zip(mine, theirs)) if a != b]
        assert all(theirs[p] == 0 for p in stale), (where, g, stale[:5], mine, theirs)
        if stale:
            assert isinstance(grp.kv_cache_spec, (SlidingWindowSpec, MambaSpec)), (where, g)


def oracle_clip(table, kcc: KVCacheConfig) -> list[list[int]]:
    """Independent statement of the NIXL clip rule for a hybrid config (vllm-hma.md §4.2):
    sliding window keeps the last cdiv(window, bs) + 1 entries, Mamba its last entry (less
    speculative scratch), full attention everything."""
    out = []
    for ids, grp in zip(table, kcc.kv_cache_groups):
        spec, ids = grp.kv_cache_spec, list(ids)
        if isinstance(spec, SlidingWindowSpec):
            n = cdiv(spec.sliding_window, spec.block_size) + 1
            ids = ids[-n:] if len(ids) > n else ids
        elif isinstance(spec, MambaSpec) and ids:
            ids = ids[:len(ids) - min(spec.num_speculative_blocks, len(ids) - 1)][-1:]
        out.append(ids)
    return out


def remote_params(rid: str, kcc: KVCacheConfig, num_tokens: int, *, first_id: int = 1000):
    """kv_transfer_params a P node would send (per-group ids; values are P's namespace)."""
    ids, nxt = [], first_id
    for grp in kcc.kv_cache_groups:
        n = cdiv(num_tokens, grp.kv_cache_spec.block_size)
        ids.append(list(range(nxt, nxt + n)))
        nxt += n
    return dict(do_remote_prefill=True, do_remote_decode=False, remote_block_ids=ids,
                remote_engine_id="P-engine", remote_request_id="P-" + rid,
                remote_host="127.0.0.1", remote_port=5600, tp_size=1,
                remote_num_tokens=num_tokens)


class Driver:
    """Steps a real Scheduler with fake model output; records the connector metadata."""

    def __init__(self, sched: Scheduler, worker: Any = None):
        self.s = sched
        self.worker = worker   # a WORKER-role connector: real transfers instead of fakes
        self.metas: list = []
        self.outputs: list = []
        self.table_at_meta: list[dict] = []   # manager tables of scheduled reqs at meta time
        self.tracked_at_meta: list[dict] = []  # connector tracker tables at meta time
        self.preempted: set[str] = set()

    @property
    def conn(self):
        return self.s.connector.scheduler

    def step(self, **kv) -> Any:
        so = self.s.schedule()
        meta = so.kv_connector_metadata
        self.metas.append(meta)
        mgr = self.s.kv_cache_manager
        self.table_at_meta.append({rid: mgr.get_block_ids(rid) for rid in
                                   list(meta.reqs_to_recv)
                                   if rid in self.s.requests
                                   and rid in mgr.coordinator.single_type_managers[0].req_to_blocks})
        # only push mode follows tables (its P-side push requests); pull follows none
        trk = getattr(self.s.connector.scheduler, "trackers", None)
        self.tracked_at_meta.append({rid: [list(map(int, g)) for g in trk.block_ids(rid)]
                                     for rid in so.num_scheduled_tokens
                                     if trk is not None and rid in trk})
        self.table_at_meta[-1].update({rid: mgr.get_block_ids(rid)
                                       for rid in so.num_scheduled_tokens})
        self.preempted |= set(so.preempted_req_ids or ())
        if self.worker is not None:
            kv = {**kv, **worker_step(self.worker, so)}
        elif getattr(meta, "report_due", False) and kv.get("worker_meta") is None:
            # what the worker connector reports on such a step (build_connector_worker_meta)
            kv = {**kv, "worker_meta": (HmaPushWorkerMeta if hasattr(meta, "push_saves")
                                        else HmaNixlWorkerMeta)()}
        out = self.s.update_from_output(so, runner_output(so, self.s, **kv))
        self.outputs.append(out)
        return so

    def finished_params(self) -> dict[str, dict]:
        """kv_transfer_params of every finished request seen so far."""
        return finished_params(self.outputs)

    def run(self, max_steps: int = 60, **kv) -> int:
        n = 0
        while self.s.has_unfinished_requests() and n < max_steps:
            self.step(**kv)
            n += 1
        assert not self.s.has_unfinished_requests(), f"not done after {max_steps} steps"
        return n


def finished_params(outputs: list) -> dict[str, dict]:
    """kv_transfer_params of every finished request in a list of update_from_output results."""
    res = {}
    for out in outputs:
        for eco in out.values():
            for o in eco.outputs:
                if o.finish_reason is not None:
                    res[o.request_id] = o.kv_transfer_params
    return res


def assert_no_leak(sched: Scheduler) -> None:
    """Every request gone and every block back: free == num_blocks - 1 (the null block)."""
    assert not sched.requests, f"requests still held: {list(sched.requests)}"
    pool = sched.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1


def worker_step(worker: Any, so: Any) -> dict:
    """What the model runner's KV connector mixin does around a forward pass (no forward)."""
    worker.bind_connector_metadata(so.kv_connector_metadata)
    worker.start_load_kv(None)
    worker.wait_for_save()
    r = worker.get_transfer_results(so.finished_req_ids)
    meta = worker.build_connector_worker_meta()
    invalid = worker.get_block_ids_with_load_errors()
    worker.clear_connector_metadata()
    return dict(finished_sending=r.finished_sending, finished_recving=r.finished_recving,
                failed_recving=r.failed_recving, worker_meta=meta, invalid_block_ids=invalid)
