"""The store connector counts the embedded store's evictions its saves caused
(``store_evictions`` in vLLM's KV connector stats, ``vllm:hma_store_evictions_total``), for the
in-process and the shared store, in vLLM's real Scheduler."""
import pytest

import harness as H
from hmacore.integrations.vllm.store.backend import drop_store
from test_store_connector import Instance

pytestmark = pytest.mark.vllm


def saved_bytes_and_stats(extra):
    a = Instance("gemma", extra)
    try:
        a.s.add_request(H.make_request("a", [1 + i % 900 for i in range(150)], a.hbs,
                                       max_tokens=4))
        a.run(write=True)
        return a.w.store, a.w.get_kv_connector_stats()
    finally:
        a.w.shutdown()


@pytest.mark.parametrize("scope", ["process", "shared"])
def test_evictions_counted(scope, request):
    name = f"ev-{scope}-{request.node.name}"[:40]
    try:
        store, stats = saved_bytes_and_stats({"store_name": name + "-big", "store_scope": scope})
        keys, used = len(store), store.used_bytes
        assert keys > 4 and stats.data.get("store_evictions", 0) == 0   # room for everything
        # a store with room for about half of what the request saves: the saves evict
        small = {"store_name": name + "-small", "store_scope": scope,
                 "store_capacity_bytes": max(1, used // 2)}
        if scope == "shared":
            small["store_page_bytes"] = store.page_bytes
        store2, stats2 = saved_bytes_and_stats(small)
        assert store2.evictions > 0
        assert stats2.data["store_evictions"] == store2.evictions
    finally:
        for suffix in ("-big", "-small"):
            drop_store("embedded:" + name + suffix)
