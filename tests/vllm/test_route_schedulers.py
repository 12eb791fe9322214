"""Scheduler-level proof of the routing index: several real vLLM 0.32 v1 Schedulers (no model,
fake sampled tokens) with KV events on, random traffic with shared prefixes, small block pools
(evictions), preemptions and prefix-cache resets; every event the schedulers emit is fed into one
RoutingIndex, and every time an engine's KV cache manager looks up a request's prefix
(``get_computed_blocks``: first scheduling and re-scheduling after preemption) the index's
prediction for that engine, made from the events emitted until that moment, must equal the hit
the manager finds. The prediction is made twice: from the request's own hashes and from its
token ids hashed by the index (which must equal vLLM's ``Request.block_hashes``).

``HMACORE_ROUTE_REQUESTS`` (default 350: 1050 requests over the three layouts) sets the requests per layout.
"""
from __future__ import annotations

import os
import random

import pytest

import harness as H
from vllm.config import KVEventsConfig
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

from hmacore.hits import HitFinder
from hmacore.integrations.vllm import _compat as C
from hmacore.integrations.vllm.layout import layout_from_kv_cache_config
from hmacore.route_hashing import BlockHasher
from hmacore.route_index import RoutingIndex
from hmacore.transport.kv_events import SPEC_KINDS

pytestmark = pytest.mark.vllm

REQUESTS = int(os.environ.get("HMACORE_ROUTE_REQUESTS", "350"))
ENGINES = 3
VLLM_EVENT_TYPES = (BlockStored, BlockRemoved, AllBlocksCleared)

# (vllm_config kwargs, KV cache config factory, prompt length range, max output tokens): pools
# sized so that traffic evicts cached blocks and preempts running requests
CASES = {
    "gpt-oss-like": (dict(block_size=16), lambda: H.gemma_like(num_blocks=160, window=128),
                     (20, 700), 24),
    "qwen3-next-like": (dict(block_size=64, mamba_cache_mode="align"),
                        lambda: H.qwen3_next_like(num_blocks=90), (40, 1200), 24),
    "dsv4-like": (dict(block_size=16, max_num_batched_tokens=512),
                  lambda: H.dsv4_like(num_blocks=400), (100, 1600), 400),
}


class Capture:
    """Stands in for the scheduler's event publisher: feeds each batch to the index."""

    def __init__(self, feed):
        self.feed = feed

    def publish(self, batch):
        self.feed(batch.events)

    def shutdown(self):
        pass


class Fleet:
    def __init__(self, case: str, seed: int, int_hashes: bool = True):
        self.int_hashes = int_hashes
        vkw, kcc_fn, self.prompt_range, self.max_out = CASES[case]
        self.rng = random.Random(seed)
        self.scheds = []
        self.index = None
        self.checks = self.mismatches = self.hits = self.preempted = self.resets = 0
        self.stored = self.removed = 0
        self.failures: list = []
        for e in range(ENGINES):
            vc = H.vllm_config(connector=False, **{"max_num_batched_tokens": 2048, **vkw})
            vc.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
            kcc = kcc_fn()
            s = H.make_scheduler(vc, kcc)
            if self.index is None:
                layout = layout_from_kv_cache_config(kcc, vllm_config=vc)
                finder = HitFinder(layout, alignment=C.cache_hit_alignment_tokens(kcc, vc),
                                   **C.core_hit_rule(vc))
                self.index = RoutingIndex(layout, finder=finder, int_hashes=int_hashes)
                self.hash_bs = C.resolve_kv_cache_block_sizes(kcc, vc)[1]
                assert self.hash_bs == self.index.hash_block_size
            key = self.index.add_engine(f"engine-{e}")
            s.kv_event_publisher = Capture(lambda evs, key=key: self.feed(key, evs))
            self.wrap(s, key)
            self.scheds.append((key, s))

    def feed(self, key, events):
        if not events:
            return
        # vLLM's own event objects, as the subscriber hands its decoded batch: one call
        st = self.index.apply_events(key, list(events), VLLM_EVENT_TYPES, spec_kinds=SPEC_KINDS)
        self.stored += st.stored
        self.removed += st.removed

    def wrap(self, s, key):
        mgr = s.kv_cache_manager
        lookup = mgr.get_computed_blocks

        def get_computed_blocks(request, max_cache_hit_length=None):
            # 0.33 passes vLLM's cap on the hit (default num_tokens - 1); 0.32 has none
            self.feed(key, mgr.take_events())   # emitted earlier in this schedule() call
            n = request.num_tokens if max_cache_hit_length is None else max_cache_hit_length + 1
            own = self.index.query_hashes(request.block_hashes, n).hits[key]
            hashed = self.index.block_hashes(request.all_token_ids)
            assert hashed == list(request.block_hashes[:len(hashed)]), "hashes differ from vLLM's"
            from_tokens = self.index.query(list(request.all_token_ids)[:n]).hits[key]
            # (blocks, hit tokens, shared-prefix boundary)
            out = lookup(request) if max_cache_hit_length is None \
                else lookup(request, max_cache_hit_length)
            found = out[1]
            self.checks += 1
            self.hits += found > 0
            if own != found or from_tokens != found:
                self.mismatches += 1
                self.failures.append((key, request.request_id, n, found, own, from_tokens))
            return out
        mgr.get_computed_blocks = get_computed_blocks

    def prompt(self, prefixes):
        lo, hi = self.prompt_range
        base = self.rng.choice(prefixes)
        cut = self.rng.randint(0, len(base))
        tail = [self.rng.randint(1, 30000) for _ in range(self.rng.randint(1, max(2, hi // 4)))]
        return (base[:cut] + tail)[:hi]

    def step_all(self):
        for _, s in self.scheds:
            if s.has_unfinished_requests():
                so = s.schedule()
                self.preempted += len(so.preempted_req_ids or ())
                s.update_from_output(so, H.runner_output(so, s))

    def run(self, n_requests):
        rng = self.rng
        lo, hi = self.prompt_range
        prefixes = [[rng.randint(1, 30000) for _ in range(rng.randint(lo, hi))] for _ in range(6)]
        sent = 0
        while sent < n_requests:
            for _ in range(rng.randint(1, 4)):
                if sent == n_requests:
                    break
                prompt = self.prompt(prefixes)
                res = self.index.query(prompt)
                # mostly to the best engine (hits), sometimes anywhere (misses, duplicates)
                if res.best_engines and rng.random() < 0.7:
                    key = rng.choice(res.best_engines)
                else:
                    key = rng.choice(self.scheds)[0]
                s = dict(self.scheds)[key]
                s.add_request(H.make_request(f"r{sent}", prompt, self.hash_bs,
                                             max_tokens=rng.randint(1, self.max_out)))
                sent += 1
            for _ in range(rng.randint(1, 3)):
                self.step_all()
            if rng.random() < 0.01:        # drain one engine and reset its prefix cache
                key, s = rng.choice(self.scheds)
                for _ in range(400):
                    if not s.has_unfinished_requests():
                        break
                    self.step_all()
                if s.reset_prefix_cache():
                    self.resets += 1
                    self.index_check_empty_after_flush(key, s)
        for _ in range(4000):
            if not any(s.has_unfinished_requests() for _, s in self.scheds):
                break
            self.step_all()
        # no engine stalled (a request the pool can never hold would stop the traffic)
        assert not any(s.has_unfinished_requests() for _, s in self.scheds), \
            [(k, len(s.waiting), len(s.running)) for k, s in self.scheds]

    def index_check_empty_after_flush(self, key, s):
        self.feed(key, s.kv_cache_manager.take_events())
        assert self.index.resident_blocks(key) == 0


@pytest.mark.parametrize("case", list(CASES))
def test_index_predicts_every_engine_lookup(case):
    fleet = Fleet(case, seed=sum(map(ord, case)))
    fleet.run(REQUESTS)
    summary = (f"{case}: {fleet.checks} lookups over {REQUESTS} requests on {ENGINES} engines, "
               f"{fleet.hits} with a hit, {fleet.preempted} preemptions, {fleet.resets} resets, "
               f"{fleet.stored} stored / {fleet.removed} removed hashes, "
               f"{fleet.mismatches} mismatches")
    print(summary)
    assert fleet.mismatches == 0, (summary, fleet.failures[:5])
    assert fleet.checks >= REQUESTS
    # the traffic did what the test claims: hits, evictions, preemptions
    assert fleet.hits > REQUESTS // 10, summary
    assert fleet.removed > 0, summary
    assert fleet.preempted > 0, summary


def test_digest_events(monkeypatch):
    """Events carrying digest bytes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0), index keyed by
    digests."""
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    fleet = Fleet("gpt-oss-like", seed=7, int_hashes=False)
    fleet.run(REQUESTS // 4)
    print(f"gpt-oss-like, digest events: {fleet.checks} lookups, {fleet.hits} hits, "
          f"{fleet.mismatches} mismatches")
    assert fleet.mismatches == 0, fleet.failures[:5]
    assert fleet.hits > 0 and fleet.removed > 0


def test_hasher_matches_installed_vllm():
    """Every algorithm against vLLM's own request block hasher, and its seed."""
    from vllm.utils import hashing
    from vllm.v1.core import kv_cache_utils as kcu
    toks = [7, 3, 900, 12] * 9
    for algo in ("sha256", "sha256_cbor"):
        fn = hashing.get_hash_fn_by_name(algo)
        kcu.init_none_hash(fn)
        parent, want = None, []
        for s in range(0, len(toks) - 3, 4):
            parent = kcu.hash_block_tokens(fn, parent, toks[s:s + 4], None)
            want.append(bytes(parent))
        assert BlockHasher(4, algo, seed=kcu.get_none_hash_seed()).hashes(toks) == want, algo
    kcu.init_none_hash(hashing.sha256)     # what the harness's requests use
