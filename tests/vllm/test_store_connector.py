"""HmaStoreConnector inside vLLM 0.32's real v1 Scheduler (HMA on, loaded by
kv_connector_module_path), worker side fed with real CPU tensors shaped like vLLM's
(K/V-split attention ``(2, num_blocks, bs, heads, head)``, MLA ``(num_blocks, bs, head)``;
groups with equal page sizes alias one storage per layer slot).

Instance A runs a request; its worker writes known bytes into every block the request holds
(by layer and table position) and saves through the connector. Instance B (fresh scheduler
and worker sharing the store) gets the aligned prefix hit, loads, and the blocks it needs hold
A's bytes. No block leaks; a miss gives 0; a failing store gives 0 without a crash."""
import zlib

import numpy as np
import pytest
import torch

import harness as H
from vllm.config import KVEventsConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import MambaSpec, MLAAttentionSpec, SlidingWindowMLASpec, SlidingWindowSpec

from hmacore.integrations.vllm import HmaStoreConnector
from hmacore.integrations.vllm.store.backend import drop_store, register_store
from hmacore.integrations.vllm.store.scheduler import hashes_array
from hmacore.transport.store import lookup_hit
from hmacore.integrations.vllm.store.metadata import HmaStoreConnectorMetadata

CASES = {
    "gemma": (dict(), lambda: H.gemma_like(num_blocks=64), 150),
    "dsv4": (dict(max_num_batched_tokens=1024), lambda: H.dsv4_like(num_blocks=600), 600),
    # full attention + align-mode Mamba: states saved by boundary puts
    "qwen3next": (dict(block_size=64, mamba_cache_mode="align"),
                  lambda: H.qwen3_next_like(num_blocks=64), 200),
}


def kv_caches(kcc):
    """Layer name -> tensor as vLLM's CPU model runner would hand them over."""
    groups = kcc.kv_cache_groups
    pages = {g.kv_cache_spec.page_size_bytes for g in groups}
    nlayers = {len(g.layer_names) for g in groups}
    shared = len(pages) == 1 and len(nlayers) == 1
    nb = kcc.num_blocks
    out, storages = {}, []

    def view(raw, spec):
        if isinstance(spec, MambaSpec):   # conv / ssm sub-states strided over one page
            page, off, views = spec.page_size_bytes, 0, []
            for shape, dt in zip(spec.shapes, spec.dtypes):
                esz = torch.tensor([], dtype=dt).element_size()
                n = int(np.prod(shape))
                inner = [int(np.prod(shape[i + 1:])) for i in range(len(shape))]
                views.append(torch.as_strided(raw.view(dt), (nb, *shape),
                                              (page // esz, *inner), off // esz))
                off += n * esz
            return tuple(views)
        t = raw.view(spec.dtype)
        if isinstance(spec, (MLAAttentionSpec, SlidingWindowMLASpec)):
            return t.view(nb, spec.block_size, spec.head_size)
        return t.view(2, nb, spec.block_size, spec.num_kv_heads, spec.head_size)

    if shared:
        for j in range(nlayers.pop()):
            raw = torch.zeros(nb * groups[0].kv_cache_spec.page_size_bytes, dtype=torch.int8)
            storages.append(raw)
            for g in groups:
                out[g.layer_names[j]] = view(raw, g.kv_cache_spec)
    else:
        for g in groups:
            for name in g.layer_names:
                raw = torch.zeros(nb * g.kv_cache_spec.page_size_bytes, dtype=torch.int8)
                storages.append(raw)
                out[name] = view(raw, g.kv_cache_spec)
    return out, storages


def _page_rows(views):
    """A state layer's page per block (the storage under its strided sub-views)."""
    t = views[0]
    nb = t.shape[0]
    page = t.stride(0) * t.element_size()
    return torch.as_strided(t, (nb, page // t.element_size()), (t.stride(0), 1),
                            t.storage_offset()).view(torch.uint8).numpy()


def block_bytes(t, b):
    """The bytes of block b of one layer (both K and V halves), as uint8."""
    if isinstance(t, tuple):
        return _page_rows(t)[b].copy()
    a = t.view(torch.uint8).numpy()
    if t.dim() == 5:
        return np.concatenate([a[0, b].reshape(-1), a[1, b].reshape(-1)])
    return a[b].reshape(-1)


def pattern(name, pos, n):
    seed = zlib.crc32(name.encode()) + 7919 * pos
    return ((np.arange(n, dtype=np.int64) * 131 + seed) % 251 + 1).astype(np.uint8)


def write_block(t, b, data):
    if isinstance(t, tuple):
        _page_rows(t)[b] = data
        return
    a = t.view(torch.uint8).numpy()
    if t.dim() == 5:
        half = data.size // 2
        a[0, b] = data[:half].reshape(a[0, b].shape)
        a[1, b] = data[half:].reshape(a[1, b].shape)
    else:
        a[b] = data.reshape(a[b].shape)


def fill(kcc, caches, table):
    """The 'model' wrote the KV of every block of ``table`` (per group, positional)."""
    for g, ids in zip(kcc.kv_cache_groups, table):
        for name in g.layer_names:
            for pos, b in enumerate(ids):
                if b:
                    write_block(caches[name], b, pattern(name, pos, block_bytes(caches[name], b).size))


class Instance:
    def __init__(self, case, extra, policy="fail", kv_events=False):
        vkw, make, _ = CASES[case]
        self.vc = H.vllm_config(kv_connector="HmaStoreConnector", extra=extra,
                                load_failure_policy=policy, **vkw)
        if kv_events:
            self.vc.kv_events_config = KVEventsConfig(enable_kv_cache_events=True,
                                                      publisher="null")
        self.kcc = make()
        self.s = H.make_scheduler(self.vc, self.kcc)
        self.w = HmaStoreConnector(self.vc, KVConnectorRole.WORKER, self.kcc)
        self.caches, self._storages = kv_caches(self.kcc)
        self.w.register_kv_caches(self.caches)
        self.metas = []

    @property
    def hbs(self):
        return H.C.resolve_kv_cache_block_sizes(self.kcc, self.vc)[1]

    def step(self, write=False):
        so = self.s.schedule()
        meta = so.kv_connector_metadata
        assert isinstance(meta, HmaStoreConnectorMetadata)
        self.metas.append(meta)
        w = self.w
        w.bind_connector_metadata(meta)
        w.start_load_kv(None)
        if write:
            for rid in so.num_scheduled_tokens:
                fill(self.kcc, self.caches, self.s.kv_cache_manager.get_block_ids(rid))
        w.wait_for_save()
        r = w.get_transfer_results(so.finished_req_ids)
        w.clear_connector_metadata()
        self.s.update_from_output(so, H.runner_output(
            so, self.s, finished_recving=r.finished_recving, failed_recving=r.failed_recving))
        return so

    def run(self, write=False, max_steps=60):
        n = 0
        while self.s.has_unfinished_requests():
            self.step(write)
            n += 1
            assert n < max_steps
        H.assert_no_leak(self.s)

    def close(self):
        self.w.shutdown()


def aligned_hit(inst, n_prompt, saved):
    a = inst.s.connector.scheduler.finder.alignment
    full = n_prompt // a * a
    if full >= n_prompt:
        full = (n_prompt - 1) // a * a
    return min(full, saved // a * a)


def needed_positions(kcc, g, hit):
    """Independent rule: full attention needs every block before the hit; sliding window
    the blocks holding the last window-1 tokens before it; Mamba the one state block at it."""
    spec = kcc.kv_cache_groups[g].kv_cache_spec
    bs = spec.block_size
    end = hit // bs
    if isinstance(spec, MambaSpec):
        return [end - 1] if end else []
    if isinstance(spec, SlidingWindowSpec):
        return list(range(max(0, (hit - spec.sliding_window + 1) // bs), end))
    return list(range(end))


def expected_keys(kcc, lcm, saved):
    """Keys a saver writes for ``saved`` tokens (independent statement of the store mask:
    sliding window keeps the cdiv(window - 1, bs) blocks before each scheduler-block
    boundary, full attention every block; align-mode Mamba one state: vLLM ends the prefill
    chunk on the last block boundary of these prompts)."""
    total = 0
    for grp in kcc.kv_cache_groups:
        spec = grp.kv_cache_spec
        bs, n = spec.block_size, saved // spec.block_size
        if isinstance(spec, MambaSpec):
            total += 1
        elif isinstance(spec, SlidingWindowSpec):
            need, per = H.cdiv(spec.sliding_window - 1, bs), lcm // bs
            total += sum(1 for i in range(n) if need >= per or i % per >= per - need)
        else:
            total += n
    return total


@pytest.fixture
def store_name(request):
    name = "t-" + request.node.name
    yield name
    drop_store("embedded:" + name)


@pytest.mark.vllm
@pytest.mark.parametrize("load_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("case", list(CASES))
def test_save_then_prefix_hit_on_a_second_instance(case, load_async, store_name):
    _, _, n = CASES[case]
    extra = {"store_name": store_name}
    A, B = Instance(case, extra), Instance(case, {**extra, "load_async": load_async})
    try:
        assert type(A.s.connector) is HmaStoreConnector
        assert not A.vc.scheduler_config.disable_hybrid_kv_cache_manager
        prompt = [1 + i % 900 for i in range(n)]
        A.s.add_request(H.make_request("a", prompt, A.hbs, max_tokens=4))
        A.run(write=True)
        saves = [m.saves["a"] for m in A.metas if "a" in m.saves]
        assert saves and not any(m.loads for m in A.metas)
        saved = max(s.num_tokens for s in saves)
        assert A.w.worker.last_saves["a"].failed == 0
        lcm = H.C.resolve_kv_cache_block_sizes(A.kcc, A.vc)[0]
        assert len(A.w.store) == expected_keys(A.kcc, lcm, saved)   # store masks applied
        ws = A.w.get_kv_connector_stats()                  # vLLM's stats: what the saves wrote
        assert ws.data["store_keys_written"] == len(A.w.store)
        assert ws.data.get("store_keys_failed", 0) == 0

        rb = H.make_request("b", prompt, B.hbs, max_tokens=2)
        # the embedded store's lookup runs on its digest index (vLLM's list[bytes] in place)
        # and equals the key-string lookup over the same store
        bs = B.s.connector.scheduler
        assert bs._index_ns is not None and bs.store.digest_index(bs._index_ns) is not None
        by_keys = lookup_hit(bs.finder, bs.keys, bs.store, hashes_array(rb.block_hashes),
                             int(rb.num_tokens)).tokens
        B.s.add_request(rb)
        B.step()
        expected = aligned_hit(B, n, saved)
        assert expected > 0 and by_keys == B.metas[-1].loads["b"].hit_tokens
        ld = B.metas[-1].loads["b"]
        assert ld.hit_tokens == expected and ld.skip_tokens == 0 and ld.awaiting == load_async
        if load_async:      # loaded, reported finished_recving; the rest runs next step
            assert rb.num_computed_tokens == expected
            assert rb.status == H.RequestStatus.WAITING_FOR_REMOTE_KVS or \
                rb.status == H.RequestStatus.WAITING
        else:               # hit loaded, rest computed this step
            assert rb.num_computed_tokens == n
        table = ld.block_ids
        checked = 0
        for g, grp in enumerate(B.kcc.kv_cache_groups):
            for pos in needed_positions(B.kcc, g, expected):
                b = table[g][pos]
                assert b != 0, (g, pos)
                for name in grp.layer_names:
                    got = block_bytes(B.caches[name], b)
                    assert np.array_equal(got, pattern(name, pos, got.size)), (g, pos, name)
                    checked += 1
        assert checked > 0
        # the worker filled exactly the blocks the hit needs, nothing else
        assert B.w.worker.loaded_blocks["b"] == [
            [table[g][p] for p in needed_positions(B.kcc, g, expected)]
            for g in range(len(B.kcc.kv_cache_groups))]
        B.run()
        assert rb.status == H.RequestStatus.FINISHED_LENGTH_CAPPED
        assert not B.metas[-1].loads and sum(1 for m in B.metas if m.loads) == 1
    finally:
        A.close()
        B.close()


@pytest.mark.vllm
@pytest.mark.parametrize("case", list(CASES))
def test_store_miss_is_zero(case, store_name):
    _, _, n = CASES[case]
    B = Instance(case, {"store_name": store_name})
    try:
        r = H.make_request("m", [3 + i % 700 for i in range(n)], B.hbs, max_tokens=2)
        assert B.s.connector.get_num_new_matched_tokens(r, 0) == (0, False)
        B.s.add_request(r)
        B.step()
        assert B.metas[-1].loads == {}
        B.run()
        # its own saves are found by the next request with that prompt
        r2 = H.make_request("m2", [3 + i % 700 for i in range(n)], B.hbs)
        assert B.s.connector.get_num_new_matched_tokens(r2, 0)[0] > 0
    finally:
        B.close()


class FailingStore:
    """Every call raises (master gone) unless ``only`` names the calls that fail."""

    def __init__(self, inner=None, only=None):
        self.inner, self.only = inner, only

    def _call(self, name, *a):
        if self.inner is None or self.only is None or name in self.only:
            raise ConnectionError(f"store down ({name})")
        return getattr(self.inner, name)(*a)

    def batch_exists(self, keys):
        return self._call("batch_exists", keys)

    def batch_put(self, keys, parts):
        return self._call("batch_put", keys, parts)

    def batch_get(self, keys, parts):
        return self._call("batch_get", keys, parts)

    def batch_remove(self, keys):
        return self._call("batch_remove", keys)

    def register(self, addr, size):
        if self.inner is not None:
            self.inner.register(addr, size)

    def unregister(self, addr):
        if self.inner is not None:
            self.inner.unregister(addr)


@pytest.mark.vllm
@pytest.mark.parametrize("case", list(CASES))
def test_failing_store_is_zero_and_no_crash(case):
    _, _, n = CASES[case]
    register_store("failing-store", FailingStore())
    try:
        A = Instance(case, {"store": "failing-store"})
        prompt = [1 + i % 900 for i in range(n)]
        A.s.add_request(H.make_request("a", prompt, A.hbs, max_tokens=3))
        A.run(write=True)                        # saves fail quietly
        A.s.add_request(H.make_request("b", [5 + i % 800 for i in range(n)], A.hbs))
        A.step()
        assert A.metas[-1].loads == {}
        A.run()
        A.close()
    finally:
        drop_store("failing-store")


@pytest.mark.vllm
def test_async_load_failure_is_failed_recving_and_recompute(store_name):
    from hmacore.transport.store import EmbeddedStore
    case = "gemma"
    _, _, n = CASES[case]
    inner = EmbeddedStore(capacity_bytes=1 << 28)
    register_store("half-failing", FailingStore(inner, only={"batch_get"}))
    try:
        A = Instance(case, {"store": "half-failing"})
        prompt = [1 + i % 900 for i in range(n)]
        A.s.add_request(H.make_request("a", prompt, A.hbs, max_tokens=2))
        A.run(write=True)
        B = Instance(case, {"store": "half-failing", "load_async": True, "load_retries": 0},
                     policy="recompute")
        r = H.make_request("b", prompt, B.hbs, max_tokens=2)
        B.s.add_request(r)
        B.step()
        assert r.status == H.RequestStatus.WAITING_FOR_REMOTE_KVS
        assert B.metas[-1].loads["b"].awaiting
        assert "b" in B.s.connector.scheduler.failed_recving
        assert r.num_computed_tokens == 0          # recompute policy
        B.run()
        assert r.status == H.RequestStatus.FINISHED_LENGTH_CAPPED
        A.close()
        B.close()
    finally:
        drop_store("half-failing")


@pytest.mark.vllm
def test_request_finished_returns_false_none(store_name):
    inst = Instance("gemma", {"store_name": store_name})
    try:
        r = H.make_request("x", list(range(1, 40)), inst.hbs)
        assert inst.s.connector.request_finished_all_groups(r, ([], [])) == (False, None)
        assert inst.s.connector.request_finished(r, []) == (False, None)
    finally:
        inst.close()


@pytest.mark.vllm
def test_local_prefix_hit_loads_only_the_rest(store_name):
    case = "gemma"
    _, _, n = CASES[case]
    extra = {"store_name": store_name}
    A, B = Instance(case, extra), Instance(case, extra)
    try:
        prompt = [1 + i % 900 for i in range(n)]
        A.s.add_request(H.make_request("a", prompt, A.hbs, max_tokens=2))
        A.run(write=True)
        # B computed the first 64 tokens itself (kv_consumer: it saves nothing over A's)
        B.s.connector.scheduler.do_save = False
        B.s.add_request(H.make_request("warm", prompt[:64], B.hbs, max_tokens=1))
        B.run()
        rb = H.make_request("b", prompt, B.hbs, max_tokens=2)
        B.s.add_request(rb)
        B.step()
        ld = B.metas[-1].loads["b"]
        assert ld.skip_tokens > 0 and ld.hit_tokens == 144
        table = ld.block_ids
        for g, grp in enumerate(B.kcc.kv_cache_groups):
            bs = grp.kv_cache_spec.block_size
            want = [p for p in needed_positions(B.kcc, g, ld.hit_tokens) if p >= ld.skip_tokens // bs]
            assert B.w.worker.loaded_blocks["b"][g] == [table[g][p] for p in want]
            for p in want:
                for name in grp.layer_names:
                    got = block_bytes(B.caches[name], table[g][p])
                    assert np.array_equal(got, pattern(name, p, got.size))
        B.run()
    finally:
        A.close()
        B.close()


@pytest.mark.vllm
def test_preemption_under_block_pressure(store_name):
    """A pool too small for three decoding requests: vLLM preempts; a resumed request loads
    its own saved prefix back from the store, every request finishes, no block leaks."""
    CASES["gemma_small"] = (dict(), lambda: H.gemma_like(num_blocks=40), 64)
    inst = Instance("gemma_small", {"store_name": store_name})
    try:
        for i in range(3):
            inst.s.add_request(H.make_request(f"p{i}", [1 + (i * 97 + j) % 900 for j in range(64)],
                                              inst.hbs, max_tokens=120))
        preempted = set()
        n = 0
        while inst.s.has_unfinished_requests():
            so = inst.step(write=True)
            preempted |= set(so.preempted_req_ids or ())
            n += 1
            assert n < 400
        H.assert_no_leak(inst.s)
        assert len(inst.s.connector.scheduler.trackers) == 0
        assert preempted, "the pool was meant to force a preemption"
        # a resumed request finds what it saved before being preempted
        assert any(rid in m.loads for m in inst.metas for rid in preempted)
    finally:
        CASES.pop("gemma_small", None)
        inst.close()


# -- vLLM's hit rule for the engine's config: EAGLE drop and hit alignment --------------------
def store_existence(conn, hashes):
    """Every (group, block) key the store holds for these hash rows, as an ExistenceSet
    (whatever a lookup would or would not probe)."""
    from hmacore.hits import ExistenceSet
    finder, keys = conn.scheduler.finder, conn.scheduler.keys
    es = ExistenceSet(hashes.shape[1])
    for g in finder.group_ids:
        k = finder.block_sizes[g] // finder.hash_block_size
        rows = (np.arange(hashes.shape[0] // k, dtype=np.int64) + 1) * k - 1
        if rows.size:
            ask = keys.lookup_keys(g, finder.key_digests(hashes, g, rows))
            present = keys.fold_presence(g, conn.store.batch_exists(ask), rows.size)
            es.add_many(g, np.ascontiguousarray(hashes[rows[present.astype(bool)]]))
    return es


def vllm_hit(kcc, vc, use_eagle, es, request):
    """vLLM's own coordinator (the one its scheduler builds for this config) over ``es``."""
    from vllm.v1.core.kv_cache_coordinator import get_kv_cache_coordinator
    from hmacore.hits import ExternalBlockPool
    sched_bs, hash_bs = H.C.resolve_kv_cache_block_sizes(kcc, vc)
    coord = get_kv_cache_coordinator(
        kcc, max_model_len=H.MAX_LEN, max_in_flight_tokens=1024, use_eagle=use_eagle,
        enable_caching=True, enable_kv_cache_events=False, dcp_world_size=1, pcp_world_size=1,
        scheduler_block_size=sched_bs, hash_block_size=hash_bs)
    pool = ExternalBlockPool(hash_bs, es)
    coord.block_pool = pool
    for m in coord.single_type_managers:
        m.block_pool = pool
    return coord.find_longest_cache_hit(request.block_hashes, request.num_tokens - 1)[1]


@pytest.mark.vllm
def test_eagle_speculative_config_gives_vllms_shorter_hit(store_name):
    """An engine drafting with EAGLE drops the last matched block of its hits (vLLM's
    use_eagle_block_drop), on the scheduler side and in the worker's masks."""
    from hmacore.integrations.vllm.store.scheduler import hashes_array
    case = "gemma"
    _, make, n = CASES[case]
    extra = {"store_name": store_name}
    A = Instance(case, extra)                 # a plain engine saves the prompt
    try:
        prompt = [1 + i % 900 for i in range(n)]
        A.s.add_request(H.make_request("a", prompt, A.hbs, max_tokens=2))
        A.run(write=True)
        configs = {"plain": H.vllm_config(kv_connector="HmaStoreConnector", extra=extra),
                   "eagle": H.vllm_config(kv_connector="HmaStoreConnector", extra=extra,
                                          speculative="eagle"),
                   "no-drop": H.vllm_config(kv_connector="HmaStoreConnector", extra=extra,
                                            speculative="eagle", eagle_block_drop=False)}
        assert configs["eagle"].speculative_config.use_eagle()
        kcc = make()
        conns = {k: HmaStoreConnector(vc, KVConnectorRole.SCHEDULER, kcc)
                 for k, vc in configs.items()}
        r = H.make_request("b", prompt, A.hbs, max_tokens=2)
        got = {k: c.get_num_new_matched_tokens(r, 0)[0] for k, c in conns.items()}
        assert 0 < got["eagle"] < got["plain"] == got["no-drop"]
        es = store_existence(conns["plain"], hashes_array(r.block_hashes))
        assert got["plain"] == vllm_hit(kcc, configs["plain"], False, es, r)
        assert got["eagle"] == vllm_hit(kcc, configs["eagle"], True, es, r)
        # the worker saves and loads with the same finder (store / load masks use the drop)
        w = HmaStoreConnector(configs["eagle"], KVConnectorRole.WORKER, kcc)
        assert w.worker.finder.eagle_group_ids == {0, 1}
        assert HmaStoreConnector(configs["plain"], KVConnectorRole.WORKER,
                                 kcc).worker.finder.eagle_group_ids == frozenset()
    finally:
        A.close()


def full_and_fine_mamba(num_blocks=64):
    """Full attention at 16 tokens + align-mode Mamba at 64: hashes every 16 tokens, and
    fine-grained (16-token) hits when prefix caching is on."""
    fa = H.attn(16)
    return H.KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        H.group(["model.layers.3.attn"], fa),
        H.group(["model.layers.0.linear_attn"], H.mamba(64, fa.page_size_bytes * 4))])


@pytest.mark.vllm
@pytest.mark.parametrize("caching, resolved, want", [
    (True, None, 16),       # vLLM's resolve: the hash block size (fine-grained Mamba hits)
    (False, None, 64),      # prefix caching off: the scheduler block size
    (True, 64, 64),         # the engine core's resolved value wins
])
def test_store_connector_hit_alignment_follows_vllm(store_name, caching, resolved, want):
    from vllm.v1.core.kv_cache_utils import resolve_cache_hit_alignment_tokens
    vc = H.vllm_config(kv_connector="HmaStoreConnector", extra={"store_name": store_name},
                       mamba_cache_mode="align", prefix_caching=caching)
    kcc = full_and_fine_mamba()
    kcc.cache_hit_alignment_tokens = resolved
    sched_bs, hash_bs = H.C.resolve_kv_cache_block_sizes(kcc, vc)
    assert (sched_bs, hash_bs) == (64, 16)
    if resolved is None:
        assert resolve_cache_hit_alignment_tokens(kcc, vc, sched_bs, hash_bs) == want
    s = HmaStoreConnector(vc, KVConnectorRole.SCHEDULER, kcc).scheduler
    assert (s.finder.alignment, s.finder.partial) == (want, want == 16)
    w = HmaStoreConnector(vc, KVConnectorRole.WORKER, kcc).worker
    assert w.finder.alignment == want
    # a request of 150 tokens asks at most its aligned length, never a finer boundary
    assert s.finder.align_length(150) == 150 // want * want


@pytest.mark.vllm
def test_store_connector_refuses_an_alignment_vllm_cannot_have(store_name):
    from hmacore.errors import LayoutError
    vc = H.vllm_config(kv_connector="HmaStoreConnector", extra={"store_name": store_name})
    kcc = H.gemma_like(num_blocks=64)
    kcc.cache_hit_alignment_tokens = 8
    with pytest.raises(LayoutError, match="alignment must be None or a hit grain .* 16 tokens"):
        HmaStoreConnector(vc, KVConnectorRole.SCHEDULER, kcc)
