"""The store tier's KV events: ``HmaStoreConnector`` reports what its embedded store gains and
loses (saves, evictions) per group as vLLM KV events (``medium="HMACORE_STORE"``), through the
connector event hook, in vLLM's real Scheduler (worker ``get_kv_connector_kv_cache_events`` ->
``KVConnectorOutput.kv_cache_events`` -> scheduler ``update_connector_output`` ->
``take_events`` -> the scheduler's publisher). Fed into a RoutingIndex, the events give the
store's contents exactly, and the index's hit equals the hit the connector itself computes.

The shared-memory store (``store_scope: shared``): the scheduler side reports from the
segment's event log, so the puts and evictions of another process attached to the store
(spawned, bounded, stopped by PID) and of a second engine sharing it appear too; a reader that
fell behind the log's ring resyncs; both engines' tiers equal the store."""
import multiprocessing as mp
import os
import signal

import numpy as np
import pytest
from vllm.config import KVEventsConfig
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

import harness as H
from hmacore.integrations.vllm import HmaStoreConnector
from hmacore.integrations.vllm._compat import KVConnectorRole
from hmacore.integrations.vllm.store.backend import _segment_name, drop_store
from hmacore.integrations.vllm.store.events import STORE_MEDIUM
from hmacore.route_index import RoutingIndex
from hmacore.transport.store import lookup_hit_indexed
from route_events import event_rows
from store_churn_proc import TIMEOUT, churn
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


def third_of_saves(case, reqs, name):
    """Store bytes of about a third of what ``reqs`` save (so saves evict)."""
    probe = Engine(case, {"store_name": name + "-probe", "store_scope": "process"})
    try:
        for i, p in enumerate(reqs):
            probe.s.add_request(H.make_request(f"p{i}", p, probe.hbs, max_tokens=3))
        probe.run()
        return max(1, probe.w.store.used_bytes // 3)
    finally:
        probe.w.shutdown()
        drop_store("embedded:" + name + "-probe")


@pytest.mark.parametrize("case", ["gemma", "qwen3next"])
def test_shared_store_events_follow_every_process(case, request):
    """Engine A (scheduler-side events from the log), a spawned process putting keys into
    A's namespace between requests (evicting A's keys; once more than the log's ring holds,
    so A resyncs), and engine B attached to the same store from request 4 on (saving the
    same prompts): after every request both engines' tiers hold exactly the store's keys and
    score every prompt as the store's own lookup does. A tier fed without removals does not
    (the negative control)."""
    name = f"shev-{case}-{os.getpid()}"
    rng = np.random.default_rng(11)
    reqs = prompts(case, 12, rng)
    extra = {"store_name": name, "store_scope": "shared", "store_page_bytes": 256,
             "store_capacity_bytes": third_of_saves(case, reqs, name)}
    a = Engine(case, extra)
    engines = [a]
    conn = a.conn
    src = a.s.connector.shared_events
    assert src is not None and a.w.store_events is None     # the scheduler side reports
    store = a.w.store
    assert type(store).__name__ == "SharedStore"
    index = RoutingIndex(conn.layout, finder=conn.finder)
    tiers = {"a": index.add_engine("a")}
    control = index.add_engine("a, stores only")
    fed = {"a": 0}
    ctx = mp.get_context("spawn")
    to_parent, from_parent = ctx.Queue(), ctx.Queue()
    width = len(H.make_request("w", reqs[0], a.hbs).block_hashes[0])
    prefixes = [conn.keys.prefix(g) for g in range(conn.layout.num_groups)]
    child = ctx.Process(target=churn, args=(_segment_name(name), store.capacity_bytes,
                                            store.page_bytes, prefixes, width, to_parent,
                                            from_parent), daemon=True)
    child.start()
    foreign = evicted = hits = 0
    try:
        assert to_parent.get(timeout=TIMEOUT) == ("ready", False)    # attached to A's store
        for i, p in enumerate(reqs):
            if i == 4:      # engine B joins the store: its first events are the store as is
                b = Engine(case, extra)
                engines.append(b)
                tiers["b"], fed["b"] = index.add_engine("b"), 0
            for key, eng in zip(("a", "b"), engines):
                eng.s.add_request(H.make_request(f"{key}{i}", p, eng.hbs, max_tokens=3))
                eng.run()
            for key, eng in zip(("a", "b"), engines):
                tier_events = eng.store_tier()
                assert not any(isinstance(e, AllBlocksCleared) for e in tier_events)
                new = tier_events[fed[key]:]
                index.apply(tiers[key], *event_rows(new))
                if key == "a":
                    index.apply(control, *event_rows([e for e in new
                                                      if isinstance(e, BlockStored)]))
                fed[key] = len(tier_events)
            es = store.digest_index(conn._index_ns)
            for key in tiers:
                assert index.resident_blocks(tiers[key]) == len(store) == len(es), (i, key)
            for j, q in enumerate(reqs[:i + 2]):
                qr = H.make_request(f"q{i}-{j}", q, a.hbs)
                want = lookup_hit_indexed(conn.finder, es, qr.block_hashes, len(q)).tokens
                got = index.query_hashes(qr.block_hashes, len(q)).hits
                assert all(got[t] == want for t in tiers.values()), (i, j, got, want)
                hits += want > 0
            # the other process puts between requests: a quarter of the store's pages, and
            # once (after request 6) more than the log's ring holds before A's next read
            n = 1100 if i == 6 else max(1, store.capacity_bytes // store.page_bytes // 4)
            resyncs = src.resyncs
            from_parent.put(("put", n))
            tag, written, ev = to_parent.get(timeout=TIMEOUT)
            assert tag == "put" and written == n
            foreign, evicted = foreign + written, evicted + ev
            if i == 6:
                a.s.add_request(H.make_request("after-ring", reqs[0], a.hbs, max_tokens=1))
                a.run()
                assert src.resyncs == resyncs + 1      # fell behind the ring: resynced
        events = a.store_tier()
        removed = sum(len(e.block_hashes) for e in events if isinstance(e, BlockRemoved))
        assert hits > len(reqs) and foreign > 0 and evicted > 0 and removed > 0
        assert src.resyncs == 2       # A's first read (an empty store) and the overrun
        assert engines[1].s.connector.shared_events.resyncs == 2   # B's first read, the overrun
        assert index.resident_blocks(control) > len(store)    # removals dropped: caught
    finally:
        if child.is_alive():
            from_parent.put(("close",))
            child.join(TIMEOUT)
        if child.is_alive():
            os.kill(child.pid, signal.SIGKILL)
            child.join(TIMEOUT)
        for eng in engines:
            eng.w.shutdown()
            eng.s.connector.shutdown()
        drop_store("embedded:" + name)


def test_shared_store_events_survive_a_store_closed_underneath(caplog):
    """A shared store closed under a live engine (a shut-down race): ``take_events`` logs
    and returns no events, the step goes on."""
    name = f"shev-closed-{os.getpid()}"
    eng = Engine("gemma", {"store_name": name, "store_scope": "shared",
                           "store_capacity_bytes": 1 << 20, "store_page_bytes": 256})
    try:
        eng.s.add_request(H.make_request("a", list(range(1, 150)), eng.hbs, max_tokens=3))
        eng.run()
        assert any(isinstance(e, BlockStored) for e in eng.store_tier())
        drop_store("embedded:" + name)                 # closes this process's handle
        with caplog.at_level("WARNING"):
            assert eng.s.connector.take_events() == []
        assert "store-tier events not read" in caplog.text
    finally:
        eng.w.shutdown()
        eng.s.connector.shutdown()
        drop_store("embedded:" + name)
        assert not os.path.exists(f"/dev/shm/hmacore-kv-{name}")
