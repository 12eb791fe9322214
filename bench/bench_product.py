"""Product-level benchmark: the KV connectors users run, inside vLLM 0.32's real v1 Scheduler.

Every variant is its own ``Scheduler`` (scheduler role only, no model) over the same requests
(same token ids, same block hashes); all variants advance in lockstep in one process. One
step of a variant is ``schedule()`` + ``update_from_output()`` with a fake
``ModelRunnerOutput`` (one sampled token per request whose prompt is complete, as
tests/vllm/harness.py does); the connector's scheduler-side hooks run inside those two calls.

What is timed, in ms per step: ``schedule()`` plus ``update_from_output()`` of one variant,
as CPU time of the calling thread (``time.thread_time_ns``: the scheduler and these
connectors' scheduler sides run no other thread) -- the primary figure, since the machine is
shared and a wall-clock step that loses the core to another process gains a whole time
slice (~4 ms) -- and as wall time (``perf_counter_ns``, ``wall_*`` fields). Building the fake
model output (and the worker reports a real worker would send: finished loads, completed
offload jobs) is NOT timed. The variants run round-robin within each step, starting at a
rotating offset, so machine noise hits all of them alike. ``gc.freeze()`` after warm-up (as
vLLM's engine core does after start-up); gc stays enabled during the timed steps.

Cells: layout (``dsv4``: five groups 256/64/64/4/8 tokens per block, the harness's
``dsv4_like``; ``gptoss``: full attention + sliding window 128, block 16, 4 + 4 layers,
2 KV heads x 64) x running requests x prompt length (tokens) x step kind:

* ``decode``: every request in steady decode, one token each per step.
* ``prefill``: half the requests decode while the other half waits and is chunk-prefilled
  at ``max_num_batched_tokens`` (8192) tokens per step (minus the decode tokens); the timed
  phase ends early once no prompt chunk is left.

Warm-up (untimed) reaches those states fast: the per-step token budget is raised to
``requests x 2048`` with ``long_prefill_token_threshold`` 2048 (every request prefills
2048-token chunks concurrently, so all requests reach decode in the same step and hold the
same number of tokens in every variant), then restored to the cell's real budget (8192)
before the timed steps. Consumer (D) variants do not prefill: their requests carry a P
node's ``kv_transfer_params`` and load the prompt asynchronously (WAITING_FOR_REMOTE_KVS);
the fake output reports the load finished in the step it was issued. D variants therefore
take part in decode cells only (n/a for prefill).

Variants (``VARIANTS``): no connector; vLLM ``NixlConnector`` (pull) producer (P: requests
carry ``{"do_remote_decode": True}``) and consumer (D: params of
``harness.remote_params``); vLLM ``OffloadingConnector`` (``CPUOffloadingSpec``,
``cpu_bytes_to_use`` = twice the pool; the fake output completes every store/load job in
the step it was issued, as one worker would); hmacore ``HmaNixlConnector`` pull P / pull D,
push P (``transfer_mode: push`` + ``push_id``; D's registrations are fed to P's scheduler
side through ``update_connector_output`` before the requests arrive, so nothing is held) /
push D (registration + async load in warm-up); hmacore ``HmaStoreConnector`` (embedded
store, ``kv_both``; cold: without a worker nothing is written, every lookup misses). P
requests keep decoding in decode cells (a real P request stops after one token): the cell
measures the per-step bookkeeping of tracked requests. hmacore push P/D are compared with
vLLM's pull ``NixlConnector`` of the same role (vLLM's push connector is not run).

Memory: each cell's Python memory is estimated (``estimate_bytes``, calibrated on measured
RSS). A cell that does not fit ``--mem-gib`` (default 8) with every variant runs as
``SPLIT_GROUPS`` (each hmacore variant with its vLLM baseline and its own no-connector
reference, one lockstep run per group); a cell where even one group does not fit is skipped
with the reason in the output. With several cells each runs in its own child process.

Run: ``python bench/bench_product.py [--quick] [--layouts ...] [--requests ...]
[--prompts ...] [--kinds ...] [--variants ...] [--steps N] [--mem-gib G] [--out DIR]
[--name STEM] [--merge] [--worker] [--profile] [--in-process]``; outputs
``<out>/<name>.json`` and ``.md`` (rendered by product_report.py), written after every cell.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

for _k, _v in (("VLLM_TARGET_DEVICE", "cpu"), ("HF_HUB_OFFLINE", "1"), ("PYTHONHASHSEED", "0"),
               ("NIXL_LOG_LEVEL", "WARN"), ("UCX_NET_DEVICES", "lo"),
               ("VLLM_LOGGING_LEVEL", "WARNING")):
    os.environ.setdefault(_k, _v)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (ROOT, os.path.join(ROOT, "tests", "vllm")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

CHUNK = 8192            # max_num_batched_tokens of the timed phase (tokens per step)
WARM_CHUNK = 2048       # per-request chunk of the fast warm-up (tokens)
MEM_GIB = 8.0
LAYOUTS = ("dsv4", "gptoss")
REQUESTS = (64, 256)
PROMPTS = (4096, 32768, 131072)
KINDS = ("decode", "prefill")
HMA_PREFIX = "hma_"


# -- variants ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Variant:
    """One connector configuration.

    Attributes:
        name: column name. connector: vLLM connector class name (None: no connector).
        module: ``kv_connector_module_path`` (None: vLLM's registry). kv_role: vLLM kv_role.
        extra: ``kv_connector_extra_config``. side: "P" (requests carry do_remote_decode),
        "D" (requests carry a P node's params and load them), "" (plain requests).
        mode: "pull" / "push" for the NIXL connectors. baseline: the vLLM variant an hmacore
        variant is compared with (ratio column). kinds: step kinds this variant takes part in.
    """

    name: str
    connector: str | None = None
    module: str | None = None
    kv_role: str = "kv_both"
    extra: dict = field(default_factory=dict)
    side: str = ""
    mode: str = "pull"
    baseline: str | None = None
    kinds: tuple[str, ...] = KINDS
    note: str = ""


HMA_MOD = "hmacore.integrations.vllm"
VARIANTS: tuple[Variant, ...] = (
    Variant("none"),
    Variant("vllm_nixl_P", "NixlConnector", kv_role="kv_producer", side="P",
            extra={"kv_lease_duration": 3600}),
    Variant("vllm_nixl_D", "NixlConnector", kv_role="kv_consumer", side="D", kinds=("decode",),
            extra={"kv_lease_duration": 3600},
            note="D requests loaded their prompt (async) during warm-up"),
    Variant("vllm_offload", "OffloadingConnector", extra={"spec_name": "CPUOffloadingSpec"}),
    Variant("hma_pull_P", "HmaNixlConnector", HMA_MOD, "kv_producer", side="P",
            extra={"kv_lease_duration": 3600}, baseline="vllm_nixl_P"),
    Variant("hma_pull_D", "HmaNixlConnector", HMA_MOD, "kv_consumer", side="D",
            extra={"kv_lease_duration": 3600}, baseline="vllm_nixl_D", kinds=("decode",),
            note="D requests loaded their prompt (async) during warm-up"),
    Variant("hma_push_P", "HmaNixlConnector", HMA_MOD, "kv_producer", side="P", mode="push",
            extra={"transfer_mode": "push", "kv_lease_duration": 3600,
                   "push_register_timeout": 3600},
            baseline="vllm_nixl_P", note="push ids registered by D before the requests came"),
    Variant("hma_push_D", "HmaNixlConnector", HMA_MOD, "kv_consumer", side="D", mode="push",
            extra={"transfer_mode": "push", "kv_lease_duration": 3600},
            baseline="vllm_nixl_D", kinds=("decode",),
            note="D requests registered and received their prompt during warm-up"),
    Variant("hma_store", "HmaStoreConnector", HMA_MOD, "kv_both",
            extra={"store": "embedded"}, baseline="vllm_offload",
            note="embedded store; cold (no worker writes during the scheduler-only run)"),
)
VARIANT_NAMES = tuple(v.name for v in VARIANTS)


# -- layouts -------------------------------------------------------------------------------
def layout_groups(name: str) -> list[tuple[int, int]]:
    """``(block_size, sliding_window or 0)`` per KV cache group of a layout (tokens)."""
    if name == "dsv4":
        return [(256, 0), (64, 128), (64, 256), (4, 8), (8, 128)]
    if name == "gptoss":
        return [(16, 0), (16, 128)]
    raise ValueError(f"unknown layout {name!r} (known: {LAYOUTS})")


def make_kcc(name: str, num_blocks: int):
    """The layout's vLLM ``KVCacheConfig`` with ``num_blocks`` blocks in the shared pool."""
    import harness as H
    if name == "dsv4":
        return H.dsv4_like(num_blocks=num_blocks)
    layers = 4      # gpt-oss-like: alternating full / sliding-window layers; 2 KV heads x 64
    # (the fixture model has 2 KV heads: the worker side checks heads against it)
    full = [f"model.layers.{2 * i + 1}.self_attn.attn" for i in range(layers)]
    slide = [f"model.layers.{2 * i}.self_attn.attn" for i in range(layers)]
    return H.C.KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        H.group(full, H.attn(16, heads=2, head=64)),
        H.group(slide, H.swa(16, 128, heads=2, head=64)),
    ])


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def blocks_needed(name: str, requests: int, prompt: int, extra_tokens: int) -> int:
    """Pool size (blocks) that holds every request at ``prompt + extra_tokens`` tokens plus
    one warm-up chunk per request and one timed chunk: full groups keep every block, sliding
    window groups their window plus a chunk in flight."""
    total = 0
    length = prompt + extra_tokens
    for bs, window in layout_groups(name):
        live = cdiv(length, bs) if not window else cdiv(window, bs) + 2
        chunk = cdiv(WARM_CHUNK, bs) + 1
        total += requests * (live + chunk) + cdiv(CHUNK, bs) + 2
    return int(total * 1.1) + 64


BASE_GIB = 0.5          # RSS of the process with vLLM imported and nothing built (measured)
#: measured peak RSS (less BASE_GIB) / the model below, the largest over the 32k and 128k
#: cells of a full run (decode 1.54-1.89, prefill 1.65-2.06)
EST_FACTOR = {"decode": 1.9, "prefill": 2.1}


def estimate_bytes(name: str, requests: int, prompt: int, nvariants: int,
                   kind: str = "decode") -> int:
    """Python memory of one cell (bytes), calibrated on measured peak RSS: per variant, every
    request's token list (8 B a token, waiting requests too) and, for the requests holding
    KV, their per-group tables (12 B a position, nulls included), hash lists and the pool's
    block objects (~240 B a block with its cache entry); shared: prompts and hashes; times
    EST_FACTOR[kind], plus BASE_GIB. Prefill cells hold half the requests at full length
    (the other half waits and gets a few chunks)."""
    hot = requests if kind == "decode" else requests // 2 + 2
    hash_bs = min(bs for bs, _ in layout_groups(name))
    positions = sum(cdiv(prompt, bs) for bs, _ in layout_groups(name))
    per_variant = requests * prompt * 8 \
        + hot * (positions * 12 + cdiv(prompt, hash_bs) * 8) \
        + blocks_needed(name, hot, prompt, 0) * 240
    shared = requests * (prompt * 8 + cdiv(prompt, hash_bs) * 90)
    return int(EST_FACTOR[kind] * (nvariants * per_variant + shared) + BASE_GIB * 2**30)


#: Variants that must share a lockstep run when a cell is split for memory: each hmacore
#: variant with its vLLM baseline ("none" joins every group).
SPLIT_GROUPS = (("vllm_nixl_P", "hma_pull_P", "hma_push_P"),
                ("vllm_nixl_D", "hma_pull_D", "hma_push_D"),
                ("vllm_offload", "hma_store"))


def plan_groups(cell, variants, mem_gib: float) -> tuple[list[tuple], str | None]:
    """Variant groups to run one after the other (each a lockstep run with "none") so each
    fits ``mem_gib``: all at once if possible, else ``SPLIT_GROUPS``. ``([], reason)`` when
    even a split group does not fit."""
    limit = mem_gib * 2**30
    active = [v for v in variants if cell.kind in v.kinds]

    def est(n):
        return estimate_bytes(cell.layout, cell.requests, cell.prompt, n, cell.kind)
    if est(len(active)) <= limit:
        return [tuple(variants)], None
    by_name = {v.name: v for v in variants}
    groups = []
    for names in SPLIT_GROUPS:
        g = tuple(by_name[n] for n in names if n in by_name)
        if any(cell.kind in v.kinds for v in g):     # a group of "none" alone says nothing
            groups.append((by_name["none"],) + g)
    worst = max(len([v for v in g if cell.kind in v.kinds]) for g in groups)
    if est(worst) > limit:
        return [], (f"skipped: estimated {est(worst) / 2**30:.1f} GiB of Python memory even "
                    f"for {worst} schedulers (all: {est(len(active)) / 2**30:.1f} GiB) > "
                    f"--mem-gib {mem_gib:g}")
    return groups, None


# -- configs -------------------------------------------------------------------------------
_MODEL_CONFIGS: dict[int, Any] = {}


def model_config(max_len: int):
    """A ModelConfig (the tests' tiny gemma2 fixture) allowing ``max_len`` tokens."""
    mc = _MODEL_CONFIGS.get(max_len)
    if mc is None:
        import harness as H
        from vllm.config import ModelConfig
        mc = ModelConfig(model=H.GEMMA_DIR, tokenizer=H.GEMMA_DIR, skip_tokenizer_init=True,
                         dtype="auto", max_model_len=max_len,
                         hf_overrides={"max_position_embeddings": max_len})
        _MODEL_CONFIGS[max_len] = mc
    return mc


def vllm_config(v: Variant, *, max_len: int, requests: int, extra: dict | None = None,
                engine_id: str | None = None):
    """The variant's VllmConfig: CPU, prefix caching on, HMA on, chunked prefill at CHUNK."""
    from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ParallelConfig,
                             SchedulerConfig, VllmConfig)
    ktc = None
    if v.connector is not None:
        kw = dict(kv_connector=v.connector, kv_role=v.kv_role,
                  kv_connector_extra_config={**v.extra, **(extra or {})})
        if v.module:
            kw["kv_connector_module_path"] = v.module
        ktc = KVTransferConfig(**kw)
        if engine_id is not None:
            ktc.engine_id = engine_id
    sc = SchedulerConfig(max_num_seqs=requests, max_num_batched_tokens=CHUNK,
                         max_model_len=max_len, is_encoder_decoder=False)
    vc = VllmConfig(model_config=model_config(max_len), scheduler_config=sc,
                    cache_config=CacheConfig(block_size=16, enable_prefix_caching=True),
                    kv_transfer_config=ktc, device_config=DeviceConfig("cpu"),
                    parallel_config=ParallelConfig(tensor_parallel_size=1))
    vc.cache_config.kv_cache_layout = "LBNHC"
    return vc


def kv_bytes_per_block(kcc) -> int:
    """Bytes of one block across every layer of every group (the offload chunk size)."""
    return sum(g.kv_cache_spec.page_size_bytes * len(g.layer_names) for g in kcc.kv_cache_groups)


# -- requests ------------------------------------------------------------------------------
@dataclass
class Workload:
    """The requests of one cell: prompts and block hashes, computed once, shared by every
    variant (each variant gets its own ``Request`` objects)."""

    layout: str
    requests: int
    prompt: int
    max_tokens: int
    hash_bs: int
    prompts: list[list[int]]
    hashes: list[list[Any]]


def make_workload(layout: str, requests: int, prompt: int, max_tokens: int, hash_bs: int,
                  ) -> Workload:
    """Distinct prompts (no cross-request prefix hits) and their vLLM block hashes (the
    harness's make_request also initialises vLLM's none-hash, once)."""
    import harness as H
    base = [1 + (i * 7919) % 30011 for i in range(prompt)]
    prompts, hashes = [], []
    for r in range(requests):
        p = list(base)
        p[0] = 30100 + r               # differs in block 0: every hash differs
        prompts.append(p)
        req = H.make_request(f"w{r}", p, hash_bs, max_tokens=1)
        hashes.append(list(req.block_hashes))
    return Workload(layout, requests, prompt, max_tokens, hash_bs, prompts, hashes)


def rid(r: int) -> str:
    return f"req-{r:04d}"


def request_params(v: Variant, r: int, wl: Workload, kcc) -> dict | None:
    """``kv_transfer_params`` request ``r`` carries in variant ``v`` (None: none)."""
    import harness as H
    if v.side == "P":
        if v.mode == "push":
            return {"do_remote_decode": True, "transfer_mode": "push", "push_id": f"push-{r}"}
        return {"do_remote_decode": True}
    if v.side == "D":
        if v.mode == "push":
            return {"do_remote_prefill": True, "transfer_mode": "push", "push_id": f"push-{r}",
                    "remote_host": "127.0.0.1", "remote_port": 5600}
        return H.remote_params(rid(r), kcc, wl.prompt)
    return None


def make_request(v: Variant, r: int, wl: Workload, kcc):
    """Request ``r`` for variant ``v``: the shared prompt list and a copy of the shared hash
    list (later blocks are hashed by the request's own hasher)."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request
    params = request_params(v, r, wl, kcc)
    extra = {"kv_transfer_params": params} if params is not None else None
    sp = SamplingParams(max_tokens=wl.max_tokens, ignore_eos=True, extra_args=extra)
    sp.update_from_generation_config({}, 1)
    req = Request(request_id=rid(r), prompt_token_ids=wl.prompts[r], sampling_params=sp,
                  pooling_params=None, mm_features=None, block_hasher=None)
    req.block_hashes = list(wl.hashes[r])
    req._block_hasher = get_request_block_hasher(wl.hash_bs, sha256)
    return req


def push_tables(kcc, wl: Workload) -> dict[str, list[list[int]]]:
    """What D's workers register with a push P engine: every push id's D-side positional
    table (ids of D's namespace; window groups hold only their last window's blocks)."""
    reg = {}
    for r in range(wl.requests):
        table, nxt = [], 1 + r * 100000
        for bs, window in layout_groups(wl.layout):
            n = cdiv(wl.prompt, bs)
            keep = n if not window else cdiv(window, bs) + 1
            table.append([0] * (n - keep) + list(range(nxt, nxt + keep)))
            nxt += keep
        reg[f"push-{r}"] = table
    return reg


def push_registration(kcc, wl: Workload):
    """What P's worker reports to its scheduler once D registered every push id (the ids
    only: D's tables stay on the worker)."""
    from hmacore.integrations.vllm.nixl.push_metadata import HmaPushWorkerMeta
    return HmaPushWorkerMeta(registered={k: [0] for k in push_tables(kcc, wl)})


# -- one variant's engine --------------------------------------------------------------------
class Engine:
    """One variant: a real vLLM Scheduler (+ its scheduler-role connector) and the reports a
    real worker would send back (finished loads, completed offload jobs), built untimed."""

    def __init__(self, v: Variant, wl: Workload, num_blocks: int, max_len: int, tag: str):
        import harness as H
        self.v = v
        self.wl = wl
        self.kcc = make_kcc(wl.layout, num_blocks)
        extra = {}
        if v.connector == "OffloadingConnector":
            # room for every block of the pool twice over: the CPU tier never evicts here
            extra["cpu_bytes_to_use"] = 2 * num_blocks * kv_bytes_per_block(self.kcc)
        if v.connector == "HmaStoreConnector":
            extra["store_name"] = f"bench-{tag}"
            extra["store_capacity_bytes"] = 1 << 30
        self.vc = vllm_config(v, max_len=max_len, requests=wl.requests, extra=extra,
                              engine_id=f"{v.name}-{tag}")
        self.s = H.make_scheduler(self.vc, self.kcc)
        self.hook_ns = 0          # thread CPU ns inside the connector's scheduler-side hooks
        self._hook_depth = 0
        if self.s.connector is not None:
            self._time_hooks(self.s.connector)
        self._threshold = self.vc.scheduler_config.long_prefill_token_threshold
        self.reports_loads = v.side == "D"
        self.reports_jobs = v.connector == "OffloadingConnector"
        if v.side == "P" and v.mode == "push":
            self._register_pushes()

    def _time_hooks(self, conn) -> None:
        """Wrap every scheduler-side hook vLLM's Scheduler calls (``TIMED_HOOKS``) on this
        connector instance, vLLM's and hmacore's alike, to add its thread CPU time to
        ``hook_ns`` (outermost call only: a hook calling another counts once). The same
        wrapper cost (two clock reads per call) lands on both sides of a comparison."""
        clock = time.thread_time_ns

        def timed(fn):
            def wrapper(*a, **kw):
                if self._hook_depth:
                    return fn(*a, **kw)
                self._hook_depth = 1
                t0 = clock()
                try:
                    return fn(*a, **kw)
                finally:
                    self.hook_ns += clock() - t0
                    self._hook_depth = 0
            return wrapper

        for name in TIMED_HOOKS:
            fn = getattr(conn, name, None)
            if callable(fn):
                setattr(conn, name, timed(fn))

    def _register_pushes(self) -> None:
        """D's registrations reach P before P's requests do (fed through the real hook)."""
        from vllm.v1.outputs import KVConnectorOutput
        self.d_tables = push_tables(self.kcc, self.wl)    # what check_tables compares with
        out = KVConnectorOutput(finished_sending=None, finished_recving=None,
                                failed_recving=set(),
                                kv_connector_worker_meta=push_registration(self.kcc, self.wl))
        self.s.connector.update_connector_output(out)

    def add(self, r: int) -> None:
        self.s.add_request(make_request(self.v, r, self.wl, self.kcc))

    def fake_output(self, so):
        """The model runner's output for ``so`` (untimed): one token per request whose prompt
        is complete; D: every load issued is reported finished; offload: every job done."""
        import harness as H
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import \
            OffloadingWorkerMetadata
        from vllm.v1.request import RequestStatus
        kw = {}
        if self.reports_loads:
            waiting = [r.request_id for r in self.s.requests.values()
                       if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS]
            kw["finished_recving"] = waiting
        if self.reports_jobs:
            meta = so.kv_connector_metadata
            done = OffloadingWorkerMetadata()
            for jid in list(meta.store_jobs) + list(meta.load_jobs):
                done.mark_completed(jid)
            kw["worker_meta"] = done
        return H.runner_output(so, self.s, **kw)

    def step(self):
        """One untimed step; returns the SchedulerOutput."""
        so = self.s.schedule()
        self.s.update_from_output(so, self.fake_output(so))
        return so

    def timed_step(self) -> tuple[Any, int, int, int]:
        """One step: ``(SchedulerOutput, thread CPU ns, wall ns, allocated Python blocks
        delta)`` of ``schedule()`` + ``update_from_output()``; the fake output is built
        between the two timed calls and not counted."""
        cpu, wall = time.thread_time_ns, time.perf_counter_ns
        a0 = sys.getallocatedblocks()
        h0 = self.hook_ns
        c0, w0 = cpu(), wall()
        so = self.s.schedule()
        c1, w1 = cpu(), wall()
        h1 = self.hook_ns
        out = self.fake_output(so)
        h2 = self.hook_ns
        c2, w2 = cpu(), wall()
        self.s.update_from_output(so, out)
        c3, w3 = cpu(), wall()
        self.last_hook_ns = (h1 - h0) + (self.hook_ns - h2)
        return so, (c1 - c0) + (c3 - c2), (w1 - w0) + (w3 - w2), sys.getallocatedblocks() - a0

    def set_budget(self, per_step: int, per_request: int | None) -> None:
        """Per-step token budget and per-request chunk cap (tokens; None: the config's)."""
        self.s.max_num_scheduled_tokens = per_step
        self.vc.scheduler_config.max_num_batched_tokens = per_step
        self.vc.scheduler_config.long_prefill_token_threshold = \
            self._threshold if per_request is None else per_request

    def decoding(self, rids) -> bool:
        """True when every request of ``rids`` is running with its whole prompt computed."""
        reqs = self.s.requests
        return all(r in reqs and reqs[r].num_output_tokens > 0 for r in rids)

    def out_tokens(self, r: str) -> int:
        return self.s.requests[r].num_output_tokens

    def close(self) -> None:
        c = self.s.connector
        if c is not None:
            try:
                c.shutdown()
            except Exception:   # pragma: no cover - best effort
                pass


def warm_to_decode(e: Engine, rids: list[str], target_out: int, max_steps: int) -> int:
    """Untimed: step with the fast warm-up budget until every request of ``rids`` is decoding,
    then until each has exactly ``target_out`` output tokens. Returns the steps taken."""
    n = len(rids)
    e.set_budget(max(CHUNK, n * WARM_CHUNK), WARM_CHUNK)
    steps = 0
    while not e.decoding(rids):
        so = e.step()
        steps += 1
        if so.preempted_req_ids:
            raise RuntimeError(f"{e.v.name}: preemption during warm-up (pool too small)")
        if steps > max_steps:
            raise RuntimeError(f"{e.v.name}: not decoding after {steps} warm-up steps")
    outs = {e.out_tokens(r) for r in rids}
    if len(outs) != 1 or outs.pop() > target_out:
        raise RuntimeError(f"{e.v.name}: requests not aligned after warm-up "
                           f"({sorted({e.out_tokens(r) for r in rids})} output tokens)")
    while e.out_tokens(rids[0]) < target_out:
        e.step()
        steps += 1
    e.set_budget(CHUNK, None)
    return steps


# -- one cell ----------------------------------------------------------------------------------
WARM_OUT = 3            # output tokens every request holds when the timed steps start


@dataclass(frozen=True)
class Cell:
    layout: str
    requests: int
    prompt: int
    kind: str

    @property
    def key(self) -> str:
        return f"{self.layout}/{self.requests}x{self.prompt // 1024}k/{self.kind}"


def rss_bytes() -> int:
    """Resident set size of this process now (bytes)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:       # pragma: no cover - not Linux
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def percentile(xs: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]); NaN for no data."""
    if not xs:
        return float("nan")
    ys = sorted(xs)
    k = (len(ys) - 1) * q / 100.0
    lo, hi = int(k), min(int(k) + 1, len(ys) - 1)
    return ys[lo] + (ys[hi] - ys[lo]) * (k - lo)


def hash_block_size(layout: str) -> int:
    """vLLM's hash block size (tokens) for the layout's KV cache config."""
    import harness as H
    kcc = make_kcc(layout, 1000)
    vc = vllm_config(VARIANTS[0], max_len=4096, requests=16)
    return H.C.resolve_kv_cache_block_sizes(kcc, vc)[1]


def build_engines(cell: Cell, wl: Workload, variants, num_blocks: int, max_len: int,
                  tag: str) -> tuple[list[Engine], dict[str, str]]:
    """One Engine per variant taking part in the cell; refused variants -> ``{name: reason}``."""
    engines, na = [], {}
    for v in variants:
        if cell.kind not in v.kinds:
            na[v.name] = "n/a (D loads its prompt, it does not prefill)"
            continue
        try:
            engines.append(Engine(v, wl, num_blocks, max_len, tag))
        except Exception as e:   # a connector refusing the layout is a result, not a crash
            na[v.name] = f"n/a ({type(e).__name__}: {str(e).splitlines()[0][:160]})"
    return engines, na


def warm_engines(cell: Cell, engines: list[Engine], na: dict[str, str]) -> list[Engine]:
    """Untimed warm-up of every engine to the cell's starting state; engines that fail are
    moved to ``na``. Decode: all requests decoding. Prefill: the first half decoding, the
    second half added (waiting) for the timed steps."""
    R = cell.requests
    hot = list(range(R)) if cell.kind == "decode" else list(range(R // 2))
    cold = [] if cell.kind == "decode" else list(range(R // 2, R))
    max_steps = 4 * cdiv(cell.prompt, WARM_CHUNK) + 16
    ok = []
    for e in engines:
        try:
            for r in hot:
                e.add(r)
            warm_to_decode(e, [rid(r) for r in hot], WARM_OUT, max_steps)
            for r in cold:
                e.add(r)
            ok.append(e)
        except Exception as ex:
            na[e.v.name] = f"n/a (warm-up: {type(ex).__name__}: {str(ex).splitlines()[0][:160]})"
            e.close()
    return ok


@dataclass
class Samples:
    """Per-variant timed samples of one cell (thread CPU ns and wall ns per step, thread
    CPU ns inside the connector's hooks, allocated-block deltas)."""

    ns: list[int] = field(default_factory=list)
    hook: list[int] = field(default_factory=list)
    wall: list[int] = field(default_factory=list)
    alloc: list[int] = field(default_factory=list)
    sched_mismatch: int = 0


def timed_steps(cell: Cell, engines: list[Engine], steps: int) -> tuple[dict[str, Samples], int]:
    """Lockstep timed phase: per step, every engine once, round-robin from a rotating start.
    Prefill cells stop early once no prompt chunk is scheduled. Returns samples and steps."""
    samples = {e.v.name: Samples() for e in engines}
    ref = engines[0]
    assert ref.v.name == "none"
    n = len(engines)
    done = 0
    for step in range(steps):
        outs = {}
        for i in range(n):
            e = engines[(step + i) % n]
            so, ns, wall, alloc = e.timed_step()
            outs[e.v.name] = so
            s = samples[e.v.name]
            s.ns.append(ns)
            s.hook.append(e.last_hook_ns)
            s.wall.append(wall)
            s.alloc.append(alloc)
        want = dict(outs["none"].num_scheduled_tokens)
        for name, so in outs.items():
            if dict(so.num_scheduled_tokens) != want:
                samples[name].sched_mismatch += 1
        done += 1
        if cell.kind == "prefill" and all(t <= 1 for t in want.values()):
            break
    return samples, done


def check_tables(e: Engine, trk=None) -> str | None:
    """hmacore variants: every tracked request's followed table (``trk``, default the
    scheduler side's; push P: its worker's, see worker_bench) mirrors vLLM's KV cache manager
    view (equal wherever vLLM's entry is not the null block; stale entries only where vLLM
    nulled a block in place; push P: 0 also where D registered no block, the sparse rule of
    TrackerSet.step_pairs). None when it holds (or nothing is tracked: pull mode follows no
    request), else the first difference."""
    conn = e.s.connector
    sched = getattr(conn, "scheduler", None) if conn is not None else None
    trk = getattr(sched, "trackers", None) if trk is None else trk
    if trk is None:
        return None
    mgr = e.s.kv_cache_manager
    push_reqs = getattr(sched, "_push_reqs", {})
    registered = getattr(e, "d_tables", {})
    for r in trk:
        if r not in e.s.requests:
            return f"{r}: tracked but not held by vLLM"
        want = [list(g) for g in mgr.get_block_ids(r)]
        got = [g.tolist() for g in trk.block_ids(r)]
        # push P (sparse rule): where D's registration holds no block, P's entry is 0 or vLLM's
        entry = push_reqs.get(r)
        reg = registered.get(entry[1]) if entry is not None else None
        for g, (a, b) in enumerate(zip(got, want)):
            d_ids = list(reg[g]) if reg is not None else None
            if len(a) != len(b) or any(
                    x != y and y != 0
                    and not (x == 0 and d_ids is not None and (p >= len(d_ids) or not d_ids[p]))
                    for p, (x, y) in enumerate(zip(a, b))):
                return f"{r}: group {g} differs from vLLM's table"
    return None


def summarize(cell: Cell, samples: dict[str, Samples], na: dict[str, str], variants,
              ) -> dict[str, dict]:
    """Per variant, from thread CPU time: median / p90 / mean ms per step; overhead over no
    connector = median(variant) - median(none), ms and % of median(none)
    (``overhead_paired_ms``: median of the per-step paired differences, for reference);
    ratio to the vLLM baseline (median / median). Wall time: ``wall_median_ms``,
    ``wall_p90_ms``. Allocated Python blocks per step (median); the raw per-step CPU ms
    (``samples_ms``)."""
    out: dict[str, dict] = {}
    base = samples.get("none")
    base_med = percentile([x / 1e6 for x in base.ns], 50) if base else float("nan")
    for v in variants:
        if v.name in na:
            out[v.name] = {"status": na[v.name]}
            continue
        s = samples[v.name]
        ms = [x / 1e6 for x in s.ns]
        wall = [x / 1e6 for x in s.wall]
        med = percentile(ms, 50)
        row = {"status": "ran", "steps": len(ms), "median_ms": med, "p90_ms": percentile(ms, 90),
               "mean_ms": sum(ms) / len(ms), "wall_median_ms": percentile(wall, 50),
               "wall_p90_ms": percentile(wall, 90),
               "alloc_blocks_per_step": percentile([float(a) for a in s.alloc], 50),
               # the connector's own scheduler-side work, measured directly (no noisy
               # difference of two whole steps): mean over the timed steps
               "hook_mean_ms": sum(s.hook) / len(s.hook) / 1e6,
               "hook_median_ms": percentile([x / 1e6 for x in s.hook], 50),
               "hook_p90_ms": percentile([x / 1e6 for x in s.hook], 90),
               "sched_mismatch_steps": s.sched_mismatch}
        if v.name != "none" and base:
            row["overhead_ms"] = med - base_med
            row["overhead_pct"] = 100.0 * row["overhead_ms"] / base_med if base_med else None
            row["overhead_paired_ms"] = percentile(
                [(a - b) / 1e6 for a, b in zip(s.ns, base.ns)], 50)
        row["samples_ms"] = [round(x, 4) for x in ms]
        out[v.name] = row
    for v in variants:
        row, b = out[v.name], out.get(v.baseline or "", {})
        if row.get("status") == "ran" and b.get("status") == "ran":
            row["ratio_vs"] = v.baseline
            row["ratio"] = row["median_ms"] / b["median_ms"]
            if (b.get("overhead_pct") or 0) > 1.0:     # a ratio of noise says nothing
                row["overhead_ratio"] = row["overhead_ms"] / b["overhead_ms"]
    return out


def run_cell(cell: Cell, steps: int, variants=VARIANTS, *, mem_gib: float = MEM_GIB,
             keep: bool = False, log: Callable[[str], None] = print) -> dict:
    """Build, warm and time one cell. Returns its JSON record (``status`` "ran" or
    "skipped: reason"). When all variants do not fit ``mem_gib`` they run in
    ``SPLIT_GROUPS`` (one lockstep run per group, each with its own no-connector reference;
    ``groups`` in the record says so). ``keep``: also return the engines under
    ``"_engines"`` (not closed; single-group cells only)."""
    groups, reason = plan_groups(cell, variants, mem_gib)
    active = [v for v in variants if cell.kind in v.kinds]
    est = estimate_bytes(cell.layout, cell.requests, cell.prompt, len(active), cell.kind)
    rec: dict[str, Any] = {"cell": cell.key, "layout": cell.layout, "requests": cell.requests,
                           "prompt": cell.prompt, "kind": cell.kind,
                           "est_mem_gib": round(est / 2**30, 2)}
    if reason:
        rec["status"] = reason
        return rec
    keep = keep and len(groups) == 1
    if len(groups) > 1:
        rec["groups"] = [[v.name for v in g] for g in groups]
        rec["note"] = (f"all {len(active)} schedulers need ~{est / 2**30:.1f} GiB > --mem-gib "
                       f"{mem_gib:g}: run as {len(groups)} lockstep groups, each with its own "
                       "no-connector reference (overheads and ratios are within a group)")
    max_tokens = WARM_OUT + 3 * steps + 8     # timed, then profile / worker steps
    wl = make_workload(cell.layout, cell.requests, cell.prompt, max_tokens,
                       hash_block_size(cell.layout))
    parts = [run_group(cell, wl, steps, g, keep) for g in groups]
    if any(p.get("status") != "ran" for p in parts):
        bad = next(p for p in parts if p.get("status") != "ran")
        return {**rec, **bad}
    rec["status"] = "ran"
    for k in ("setup_s", "timed_s", "rss_gib", "num_blocks", "timed_steps"):
        vals = [p[k] for p in parts]
        rec[k] = max(vals) if k in ("rss_gib", "num_blocks") else (
            min(vals) if k == "timed_steps" else round(sum(vals), 1))
    rec["variants"] = {}
    for p in parts:
        for name, row in p["variants"].items():
            if name == "none" and "none" in rec["variants"]:
                rec["variants"].setdefault("none_groups", []).append(row)
                continue
            rec["variants"][name] = row
    none = rec["variants"].pop("none_groups", None)
    if none:
        rec["none_per_group"] = [rec["variants"]["none"]] + none
    if keep:
        rec["_engines"] = parts[0]["_engines"]
    log(f"[{cell.key}] setup {rec['setup_s']} s, {rec['timed_steps']} timed steps in "
        f"{rec['timed_s']} s, rss {rec['rss_gib']} GiB (est {rec['est_mem_gib']}"
        f"{', ' + str(len(groups)) + ' groups' if len(groups) > 1 else ''})")
    return rec


def run_group(cell: Cell, wl: Workload, steps: int, variants, keep: bool) -> dict:
    """One lockstep run of ``variants`` (the first is "none") over the cell's workload."""
    t0 = time.perf_counter()
    max_len = cell.prompt + wl.max_tokens + 8
    num_blocks = blocks_needed(cell.layout, cell.requests, cell.prompt, wl.max_tokens)
    tag = f"{cell.layout}-{cell.requests}-{cell.prompt}-{cell.kind}-{os.getpid()}-{id(wl)}"
    engines, na = build_engines(cell, wl, variants, num_blocks, max_len, tag)
    engines = warm_engines(cell, engines, na)
    rec: dict[str, Any] = {}
    if not engines or engines[0].v.name != "none":
        rec["status"] = "failed: the no-connector variant did not warm up"
        rec["variants"] = {k: {"status": v} for k, v in na.items()}
        return rec
    rec["setup_s"] = round(time.perf_counter() - t0, 1)
    rec["num_blocks"] = num_blocks
    gc.collect()
    gc.freeze()
    rec["rss_gib"] = round(rss_bytes() / 2**30, 2)
    t1 = time.perf_counter()
    samples, done = timed_steps(cell, engines, steps)
    rec["timed_s"] = round(time.perf_counter() - t1, 1)
    rec["timed_steps"] = done
    rec["variants"] = summarize(cell, samples, na, variants)
    for e in engines:
        err = check_tables(e)
        if err is not None:
            rec["variants"][e.v.name]["table_check"] = err
        elif e.v.name == "hma_push_P":     # its scheduler follows no table (design (b))
            rec["variants"][e.v.name]["table_check"] = "n/a (P's worker follows the tables: " \
                "--worker checks them)"
        elif e.v.connector and e.v.connector.startswith("Hma"):
            rec["variants"][e.v.name]["table_check"] = "equal"
    rec["status"] = "ran"
    if keep:
        rec["_engines"] = engines
    else:
        for e in engines:
            e.close()
        gc.unfreeze()
        del engines
        gc.collect()
    return rec


# -- profile of hmacore's scheduler-side hooks ---------------------------------------------------
HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
         "update_connector_output", "request_finished_all_groups", "on_new_request",
         "has_pending_block_frees")
# every connector method vLLM 0.32's Scheduler calls per step or per request (timed for all
# connector variants; `grep -o "connector\.[a-z_]*(" vllm/v1/core/sched/scheduler.py`)
TIMED_HOOKS = HOOKS + ("request_finished", "has_pending_push_work", "take_events",
                       "get_kv_connector_stats", "get_loaded_kv_cache_group_ids",
                       "take_unavailable_requests", "update_state_after_free",
                       "register_finished_partial_tail", "get_external_cache_hit_sources",
                       "take_output", "ensure_cache_available", "has_cache_item")


def profile_hooks(engines: list[Engine], steps: int, top: int = 15) -> dict[str, str]:
    """cProfile of the scheduler-side connector hooks vLLM calls (``HOOKS``) of each hmacore
    variant over ``steps`` more steps: the connector instance's bound hooks are wrapped so
    the profiler runs only inside them; its clock is the thread's CPU time (seconds, with
    the profiler's own overhead). Top ``top`` by cumulative time."""
    import cProfile
    import io
    import pstats
    out = {}
    for e in engines:
        if not (e.v.connector or "").startswith("Hma"):
            continue
        prof = cProfile.Profile(time.thread_time)
        conn = e.s.connector
        saved = {name: conn.__dict__.get(name) for name in HOOKS}
        for name in HOOKS:
            fn = getattr(conn, name, None)
            if fn is not None:
                setattr(conn, name, _profiled(prof, fn))
        for _ in range(steps):
            e.step()
        for name, fn in saved.items():       # back to the timing wrappers (or the class's)
            if fn is None:
                conn.__dict__.pop(name, None)
            else:
                setattr(conn, name, fn)
        buf = io.StringIO()
        st = pstats.Stats(prof, stream=buf)
        st.sort_stats("cumulative").print_stats(top)
        out[e.v.name] = f"{steps} steps\n" + _trim_pstats(buf.getvalue())
    return out


def _profiled(prof, fn):
    def wrapper(*a, **kw):
        return prof.runcall(fn, *a, **kw)
    return wrapper


def _trim_pstats(text: str) -> str:
    """pstats output without its blank header lines and with site-packages paths shortened."""
    lines = [ln.replace(os.path.dirname(os.path.dirname(os.__file__)), "")
             .replace(ROOT + "/", "") for ln in text.splitlines() if ln.strip()]
    return "\n".join(lines)


# -- worker side ---------------------------------------------------------------------------------
class StubStore:
    """A KV store that answers without moving bytes: ``batch_exists`` says absent (every save
    writes), ``batch_put`` / ``batch_get`` say OK. It stands in for the transport only."""

    def batch_exists(self, keys):
        return [0] * len(keys)

    def batch_put(self, keys, parts):
        return [0] * len(keys)

    def batch_get(self, keys, parts):
        return [0] * len(keys)

    def batch_remove(self, keys):
        return [0] * len(keys)

    def register(self, addr: int, size: int) -> None:
        return

    def unregister(self, addr: int) -> None:
        return


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_connector(e: Engine, tag: str):
    """A WORKER-role connector matching engine ``e`` (same layout and pool), its KV caches
    registered as small CPU tensors (64 B pages; bookkeeping does not depend on page size).
    HmaNixl: a real NIXL agent + loopback handshake server on a free port. HmaStore: the
    store is :class:`StubStore`."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from hmacore.integrations.vllm import HmaNixlConnector, HmaStoreConnector
    from hmacore.integrations.vllm.store.backend import register_store
    from hmacore.demo.paged_memory import allocate_paged_kv
    v = e.v
    if v.connector == "HmaStoreConnector":
        name = f"stub-{tag}"
        register_store(name, StubStore())
        vc = vllm_config(v, max_len=e.vc.model_config.max_model_len, requests=e.wl.requests,
                         extra={"store": name}, engine_id=e.vc.kv_transfer_config.engine_id)
        w = HmaStoreConnector(vc, KVConnectorRole.WORKER, e.kcc)
    else:
        vc = vllm_config(v, max_len=e.vc.model_config.max_model_len, requests=e.wl.requests,
                         extra={"side_channel_port": free_port()},
                         engine_id=e.vc.kv_transfer_config.engine_id)
        w = HmaNixlConnector(vc, KVConnectorRole.WORKER, e.kcc)
    paged = allocate_paged_kv(w.layout, e.kcc.num_blocks, page_bytes=64)
    w.register_kv_caches(paged.kv_caches)
    return w, paged


WORKER_VARIANTS = ("hma_pull_P", "hma_pull_D", "hma_store", "hma_push_P")


def seed_push_worker(e: Engine, w) -> None:
    """Push P: what P's worker would hold when the worker bench joins a running engine: D's
    registrations (as reported, consumed by no decode rank of this worker: its steps are
    planned in full, tables followed and pairs made, but no WRITE is posted, no NIXL peer
    being there) and the tables of the requests already pushing (vLLM's, dense)."""
    from hmacore.integrations.vllm.nixl.push_worker import _Reg
    worker = w.worker
    worker._consumers_of[1] = ()
    for pid, ids in push_tables(e.kcc, e.wl).items():
        worker._regs[pid] = _Reg(1, ids, reported=True)
    sched, mgr = e.s.connector.scheduler, e.s.kv_cache_manager
    for rid in sched._pushing:
        if rid in e.s.requests and sched._push_steps.get(rid):
            worker.tables.add(rid, [list(g) for g in mgr.get_block_ids(rid)])
            worker._followed[sched._push_reqs[rid][1]] = rid


def worker_bench(cell: Cell, engines: list[Engine], steps: int) -> dict[str, dict]:
    """Worker-side bookkeeping per step (thread CPU ms; ``wall_median_ms`` too): for
    ``steps`` more scheduler steps of each
    variant in ``WORKER_VARIANTS``, the metadata its scheduler side built is handed to a
    WORKER-role connector: ``bind_connector_metadata`` + ``start_load_kv`` +
    ``wait_for_save`` + ``get_finished`` + ``clear_connector_metadata`` is timed. NIXL: real
    agent, no transfer is due in these steps (loads happened in warm-up), so no NIXL call is
    stubbed; store: the store's bulk calls are stubbed (:class:`StubStore`)."""
    res: dict[str, dict] = {}
    for e in engines:
        if e.v.name not in WORKER_VARIANTS:
            continue
        try:
            w, paged = worker_connector(e, f"{cell.key}-{e.v.name}".replace("/", "-"))
        except Exception as ex:
            res[e.v.name] = {"status": f"n/a ({type(ex).__name__}: {str(ex)[:160]})"}
            continue
        ns, wall, saves, pushed = [], [], 0, 0
        push = e.v.name == "hma_push_P"
        try:
            if push:
                seed_push_worker(e, w)
            for _ in range(steps):
                so = e.s.schedule()
                meta = so.kv_connector_metadata
                saves += len(getattr(meta, "saves", ()) or ())
                pushed += len(getattr(meta, "push_saves", ()) or ())
                c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
                w.bind_connector_metadata(meta)
                w.start_load_kv(None)
                w.wait_for_save()
                w.get_finished(so.finished_req_ids)
                w.clear_connector_metadata()
                ns.append(time.thread_time_ns() - c0)
                wall.append(time.perf_counter_ns() - t0)
                if push:       # the worker's tables after the step, by the sparse rule
                    err = check_tables(e, w.worker.tables)
                    if err is not None:
                        raise AssertionError(f"P's worker table: {err}")
                e.s.update_from_output(so, e.fake_output(so))
            ms = [x / 1e6 for x in ns]
            wms = [x / 1e6 for x in wall]
            res[e.v.name] = {"status": "ran", "steps": len(ms), "median_ms": percentile(ms, 50),
                             "p90_ms": percentile(ms, 90), "wall_median_ms": percentile(wms, 50),
                             "mean_ms": sum(ms) / len(ms), "store_saves": saves}
            if push:
                res[e.v.name].update(push_saves=pushed, table_check="equal",
                                     failed=sum(not r["ok"] for r in w.worker.stats()))
        except Exception as ex:
            res[e.v.name] = {"status": f"failed ({type(ex).__name__}: {str(ex)[:160]})"}
        finally:
            w.shutdown()
            del paged
    return res


# -- CLI -----------------------------------------------------------------------------------------
QUICK = dict(layouts=LAYOUTS, requests=(8,), prompts=(4096,), steps=4)


def cells_of(layouts, requests, prompts, kinds) -> list[Cell]:
    return [Cell(lay, r, p, k) for lay in layouts for r in requests for p in prompts
            for k in kinds]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="tiny sizes (8 requests x 4k tokens, 4 steps) for the smoke test")
    ap.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=None)
    ap.add_argument("--requests", nargs="+", type=int, default=None)
    ap.add_argument("--prompts", nargs="+", type=int, default=None,
                    help="prompt lengths in tokens (multiples of 2048)")
    ap.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    ap.add_argument("--variants", nargs="+", choices=VARIANT_NAMES, default=None,
                    help="subset of variants ('none' is always included)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per cell (default 40)")
    ap.add_argument("--mem-gib", type=float, default=MEM_GIB,
                    help="skip cells whose estimated Python memory exceeds this (GiB)")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"),
                    help="directory for product.json / product.md")
    ap.add_argument("--name", default="product", help="file stem of the outputs")
    ap.add_argument("--merge", action="store_true",
                    help="merge into an existing <out>/<name>.json (cells replaced by key)")
    ap.add_argument("--worker", action="store_true",
                    help="also time the worker-side bookkeeping (HmaNixl, HmaStore)")
    ap.add_argument("--profile", action="store_true",
                    help="cProfile the hmacore connectors' scheduler-side hooks (top 15)")
    ap.add_argument("--no-print", action="store_true", help="do not print the markdown")
    ap.add_argument("--in-process", action="store_true",
                    help="run every cell in this process (default: one child process per "
                         "cell when there are several, so memory is returned between cells)")
    a = ap.parse_args(argv)
    q = QUICK if a.quick else {}
    a.layouts = a.layouts or list(q.get("layouts", LAYOUTS))
    a.requests = a.requests or list(q.get("requests", REQUESTS))
    a.prompts = a.prompts or list(q.get("prompts", PROMPTS))
    a.steps = a.steps or q.get("steps", 40)
    for p in a.prompts:
        if p % WARM_CHUNK:
            ap.error(f"--prompts: {p} is not a multiple of {WARM_CHUNK}")
    return a


def chosen_variants(names) -> tuple[Variant, ...]:
    if not names:
        return VARIANTS
    keep = set(names) | {"none"}
    return tuple(v for v in VARIANTS if v.name in keep)


def write_outputs(doc: dict, out_dir: str, name: str) -> tuple[str, str]:
    """``<out>/<name>.json`` and ``<out>/<name>.md``; returns both paths."""
    from product_report import render
    os.makedirs(out_dir, exist_ok=True)
    jp, mp = os.path.join(out_dir, name + ".json"), os.path.join(out_dir, name + ".md")
    with open(jp, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=False)
    with open(mp, "w") as f:
        f.write(render(doc))
    return jp, mp


def load_existing(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def child_args(a: argparse.Namespace, cell: Cell) -> list[str]:
    """Command line of a child process running one cell and merging it into the outputs."""
    args = [sys.executable, os.path.abspath(__file__), "--layouts", cell.layout,
            "--requests", str(cell.requests), "--prompts", str(cell.prompt),
            "--kinds", cell.kind, "--steps", str(a.steps), "--mem-gib", str(a.mem_gib),
            "--out", a.out, "--name", a.name, "--merge", "--in-process", "--no-print"]
    if a.variants:
        args += ["--variants", *a.variants]
    return args + (["--worker"] if a.worker else []) + (["--profile"] if a.profile else [])


def run_one(a: argparse.Namespace, cell: Cell, variants) -> dict:
    """Run one cell in this process (with the optional profile / worker phases)."""
    rec = run_cell(cell, a.steps, variants, mem_gib=a.mem_gib, keep=a.worker or a.profile)
    engines = rec.pop("_engines", None)
    if engines:
        if a.profile:
            rec["profile"] = profile_hooks(engines, a.steps)
            for name, text in rec["profile"].items():
                print(f"\n## cProfile {cell.key} {name}: scheduler-side hooks\n{text}")
        if a.worker:
            rec["worker"] = worker_bench(cell, engines, a.steps)
        for e in engines:
            e.close()
        gc.unfreeze()
        del engines
        gc.collect()
    rec["peak_rss_gib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)
    if rec.get("status") != "ran":
        print(f"[{cell.key}] {rec['status']}")
    return rec


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import vllm
    variants = chosen_variants(a.variants)
    meta = {"vllm": vllm.__version__, "python": platform.python_version(),
            "cpus": os.cpu_count(), "steps": a.steps, "chunk_tokens": CHUNK,
            "warm_chunk_tokens": WARM_CHUNK, "mem_gib": a.mem_gib,
            "variants": [v.name for v in variants]}
    jpath = os.path.join(a.out, a.name + ".json")
    doc = (load_existing(jpath) if a.merge else None) or {"meta": meta, "cells": []}
    doc["meta"] = {**doc.get("meta", {}), **meta}
    cells = cells_of(a.layouts, a.requests, a.prompts, a.kinds)
    t0 = time.perf_counter()
    isolate = len(cells) > 1 and not a.in_process
    if isolate:
        write_outputs(doc, a.out, a.name)
    for cell in cells:
        if isolate:
            import subprocess
            rc = subprocess.run(child_args(a, cell)).returncode
            doc = load_existing(jpath) or doc
            if rc != 0:
                rec = {"cell": cell.key, "layout": cell.layout, "requests": cell.requests,
                       "prompt": cell.prompt, "kind": cell.kind,
                       "status": f"failed: child process exit code {rc}"}
            else:
                continue
        else:
            rec = run_one(a, cell, variants)
            doc = (load_existing(jpath) if a.merge else None) or doc
        doc["cells"] = [c for c in doc["cells"] if c.get("cell") != rec["cell"]] + [rec]
        write_outputs(doc, a.out, a.name)      # after every cell: a long run keeps its results
    jp, mp = write_outputs(doc, a.out, a.name)
    if not a.no_print:
        with open(mp) as f:
            print(f.read())
    print(f"wrote {jp} and {mp} in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
