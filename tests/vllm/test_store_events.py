"""The store tier's KV events: ``HmaStoreConnector`` reports what its embedded store gains and
loses (saves, evictions) per group as vLLM KV events (``medium="HMACORE_STORE"``), through the
connector event hook, in vLLM's real Scheduler (worker ``get_kv_connector_kv_cache_events`` ->
``KVConnectorOutput.kv_cache_events`` -> scheduler ``update_connector_output`` ->
``take_events`` -> the scheduler's publisher). Fed into a RoutingIndex, the events give the
store's contents exactly, and the index's hit equals the hit the connector itself computes."""
import numpy as np
import pytest
from vllm.config import KVEventsConfig
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

import harness as H
from hmacore.integrations.vllm import HmaStoreConnector
from hmacore.integrations.vllm._compat import KVConnectorRole
from hmacore.integrations.vllm.store.backend import drop_store
from hmacore.integrations.vllm.store.events import STORE_MEDIUM
from hmacore.route_index import RoutingIndex
from hmacore.transport.store import lookup_hit_indexed
from route_events import event_rows
from test_store_connector import CASES, fill, kv_caches

pytestmark = pytest.mark.vllm


class Capture:
    """The scheduler's event publisher: keeps every published event."""

    def __init__(self):
        self.events = []

    def publish(self, batch):
        self.events.extend(batch.events)

    def shutdown(self):
        pass


class Engine:
    def __init__(self, case, extra, events=True):
        vkw, make, _ = CASES[case]
        self.vc = H.vllm_config(kv_connector="HmaStoreConnector", extra=extra, **vkw)
        if events:
            self.vc.kv_events_config = KVEventsConfig(enable_kv_cache_events=True,
                                                      publisher="null")
        self.kcc = make()
        self.s = H.make_scheduler(self.vc, self.kcc)
        self.published = Capture()
        self.s.kv_event_publisher = self.published
        self.w = HmaStoreConnector(self.vc, KVConnectorRole.WORKER, self.kcc)
        self.caches, self._storages = kv_caches(self.kcc)
        self.w.register_kv_caches(self.caches)
        self.hbs = H.C.resolve_kv_cache_block_sizes(self.kcc, self.vc)[1]

    @property
    def conn(self):
        return self.s.connector.scheduler

    def step(self):
        so = self.s.schedule()
        w = self.w
        w.bind_connector_metadata(so.kv_connector_metadata)
        w.start_load_kv(None)
        for rid in so.num_scheduled_tokens:
            fill(self.kcc, self.caches, self.s.kv_cache_manager.get_block_ids(rid))
        w.wait_for_save()
        r = w.get_transfer_results(so.finished_req_ids)
        events = w.get_kv_connector_kv_cache_events()
        w.clear_connector_metadata()
        out = H.runner_output(so, self.s, finished_recving=r.finished_recving,
                              failed_recving=r.failed_recving)
        out.kv_connector_output.kv_cache_events = events
        self.s.update_from_output(so, out)

    def run(self, max_steps=200):
        for _ in range(max_steps):
            if not self.s.has_unfinished_requests():
                return
            self.step()
        raise AssertionError(f"not done after {max_steps} steps")

    def store_tier(self):
        return [e for e in self.published.events if getattr(e, "medium", None) == STORE_MEDIUM]


def prompts(case, n, rng):
    """Requests sharing prefixes (so lookups hit), long enough to save several blocks."""
    length = CASES[case][2]
    bases = [rng.integers(1, 900, length).tolist() for _ in range(3)]
    out = []
    for i in range(n):
        base = bases[i % 3]
        cut = int(rng.integers(length // 3, length))
        out.append(base[:cut] + rng.integers(1, 900, int(rng.integers(1, 40))).tolist())
    return out


@pytest.mark.parametrize("case", ["gemma", "qwen3next"])
@pytest.mark.parametrize("small", [False, True], ids=["roomy", "evicting"])
def test_store_events_mirror_the_store(case, small, request):
    name = f"sev-{case}-{small}-{request.node.name}"[:48]
    extra = {"store_name": name, "store_scope": "process"}
    rng = np.random.default_rng(7)
    reqs = prompts(case, 12, rng)
    if small:   # room for about a third of what the requests save: saves evict
        probe = Engine(case, {"store_name": name + "-probe", "store_scope": "process"})
        for i, p in enumerate(reqs):
            probe.s.add_request(H.make_request(f"p{i}", p, probe.hbs, max_tokens=3))
        probe.run()
        extra["store_capacity_bytes"] = max(1, probe.w.store.used_bytes // 3)
        probe.w.shutdown()
        drop_store("embedded:" + name + "-probe")
    eng = Engine(case, extra)
    conn = eng.conn
    index = RoutingIndex(conn.layout, finder=conn.finder)
    tier = index.add_engine("store")
    fed = 0
    hits = 0
    try:
        for i, p in enumerate(reqs):
            req = H.make_request(f"r{i}", p, eng.hbs, max_tokens=3)
            eng.s.add_request(req)
            eng.run()
            tier_events = eng.store_tier()
            assert not any(isinstance(e, AllBlocksCleared) for e in tier_events)
            index.apply(tier, *event_rows(tier_events[fed:]))
            fed = len(tier_events)
            store = eng.w.store
            es = store.digest_index(conn._index_ns)
            # events emitted == store contents: the same number of distinct keys, and every
            # prompt seen so far gets the same hit from the index as from the store itself
            assert index.resident_blocks(tier) == (len(es) if es is not None else 0)
            for j, q in enumerate(reqs[:i + 2]):
                probe_req = H.make_request(f"q{i}-{j}", q, eng.hbs)
                want = (lookup_hit_indexed(conn.finder, es, probe_req.block_hashes,
                                           len(q)).tokens if es is not None else 0)
                got = index.query_hashes(probe_req.block_hashes, len(q)).hits[tier]
                assert got == want, (i, j, got, want)
                hits += want > 0
        events = eng.store_tier()
        stored = sum(len(e.block_hashes) for e in events if isinstance(e, BlockStored))
        removed = sum(len(e.block_hashes) for e in events if isinstance(e, BlockRemoved))
        assert stored > 0 and hits > len(reqs)     # the comparisons are not all zero
        assert stored - removed == len(eng.w.store.digest_index(conn._index_ns))
        assert all(e.group_idx is not None and 0 <= e.group_idx < conn.layout.num_groups
                   for e in events)
        if small:
            assert eng.w.store.evictions > 0 and removed == eng.w.store.evictions
        else:
            assert removed == 0
        # the engine's own (GPU) events are still published beside the store tier's
        assert any(getattr(e, "medium", None) != STORE_MEDIUM for e in eng.published.events)
    finally:
        eng.w.shutdown()
        drop_store("embedded:" + name)


def test_no_store_events_without_kv_events(request):
    name = f"sev-off-{request.node.name}"[:48]
    eng = Engine("gemma", {"store_name": name, "store_scope": "process"}, events=False)
    try:
        assert eng.w.store_events is None
        eng.s.add_request(H.make_request("a", list(range(1, 150)), eng.hbs, max_tokens=3))
        eng.run()
        assert len(eng.w.store) > 0 and eng.w.get_kv_connector_kv_cache_events() is None
    finally:
        eng.w.shutdown()
        drop_store("embedded:" + name)
