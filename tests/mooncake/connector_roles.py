"""HmaStoreConnector against a real Mooncake master, one vLLM "instance" per process.

``python connector_roles.py A|B CASE PORT``: A runs a request through vLLM's real Scheduler with
a worker-side connector over torch tensors whose blocks hold known bytes, saves through
Mooncake, prints a JSON line and keeps its client (and its pool segment, where the data lives)
alive until stdin says so. B, a fresh scheduler + worker in another process, looks the same
prompt up, loads and compares the bytes of every block the hit needs.
"""
from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "vllm"))   # harness, test module
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))        # repo root
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("PYTHONHASHSEED", "0")

import numpy as np  # noqa: E402

import harness as H  # noqa: E402
import test_store_connector as T  # noqa: E402
import test_partial_recovery as R  # noqa: E402

# one KV cache group (full attention 16): the partial load vLLM is told of by block ids
T.CASES.setdefault("full", (dict(), R.full_only, 150))


def main(role: str, case: str, port: int) -> None:
    extra = {"store": "mooncake", "master": f"127.0.0.1:{port}", "connect_timeout_s": 20,
             "global_segment_size": 128 << 20}
    _, _, n = T.CASES[case]
    prompt = [1 + i % 900 for i in range(n)]
    inst = T.Instance(case, extra, kv_events=role == "A")
    if role == "A":
        inst.s.add_request(H.make_request("a", prompt, inst.hbs, max_tokens=4))
        inst.run(write=True)
        saves = [m.saves["a"] for m in inst.metas if "a" in m.saves]
        rep = inst.w.worker.last_saves["a"]
        out = {"saved": max(s.num_tokens for s in saves), "written": rep.written,
               "failed": rep.failed}
        # the store tier's KV events of the puts, fed into a RoutingIndex: its hit for the
        # prompt equals the connector's own lookup through the master
        from hmacore.route_index import RoutingIndex
        from route_events import event_rows
        written = sum(r.written for r in inst.w.worker.last_saves.values())
        events = inst.w.get_kv_connector_kv_cache_events()
        evs = events.get_all_events() if events is not None else []
        sched = inst.s.connector.scheduler
        index = RoutingIndex(sched.layout, finder=sched.finder)
        tier = index.add_engine("mooncake")
        if evs:
            index.apply(tier, *event_rows(evs))
        again = H.make_request("a2", prompt, inst.hbs)
        out.update(keys_written=written, events_stored=sum(len(e.block_hashes) for e in evs),
                   events_medium=sorted({e.medium for e in evs}),
                   index_hit=index.query_hashes(again.block_hashes, len(prompt)).hits[tier],
                   lookup_hit=sched.lookup(again))
        print(json.dumps(out), flush=True)
        sys.stdin.readline()
        inst.close()
        return
    r = H.make_request("b", prompt, inst.hbs, max_tokens=2)
    inst.s.add_request(r)
    inst.step()
    ld = inst.metas[-1].loads.get("b")
    out = {"hit": ld.hit_tokens if ld else 0, "compared": 0, "mismatched": 0}
    if ld is not None:
        for g, grp in enumerate(inst.kcc.kv_cache_groups):
            for pos in T.needed_positions(inst.kcc, g, ld.hit_tokens):
                b = ld.block_ids[g][pos]
                for name in grp.layer_names:
                    got = T.block_bytes(inst.caches[name], b)
                    out["compared"] += 1
                    out["mismatched"] += int(not np.array_equal(got, T.pattern(name, pos, got.size)))
    miss = H.make_request("m", [3 + i % 700 for i in range(n)], inst.hbs, max_tokens=2)
    out["miss"] = inst.s.connector.get_num_new_matched_tokens(miss, 0)[0]
    inst.run()
    out["leak_free"] = True
    print(json.dumps(out), flush=True)
    inst.close()


def partial(case: str, fault: str, port: int) -> None:
    """Role B of ``connector-partial-*``: the key of block ``fault`` ("group.index") is
    removed from the master between the scheduler's lookup and the worker's load; prints the
    recovery, what the request computed afterwards (tests/vllm/test_partial_recovery.py)
    and whether its recompute put the removed key back."""
    extra = {"store": "mooncake", "master": f"127.0.0.1:{port}", "connect_timeout_s": 20,
             "global_segment_size": 128 << 20, "load_async": True}
    _, _, n = T.CASES[case]
    prompt = [1 + i % 900 for i in range(n)]
    eng = R.Engine(case, extra)
    g, idx = (int(x) for x in fault.split("."))
    r = H.make_request("b", prompt, eng.hbs, max_tokens=2)
    eng.s.add_request(r)
    hook, done = R.remover(eng, "b", [(g, idx)])
    eng.step(before_load=hook)
    rep = eng.w.worker.recoveries.get("b")
    eng.run()
    # the recompute saved the removed key again (nothing else: the keys that arrived are
    # not rewritten), and a new request with the prompt hits the whole prefix again
    again = H.make_request("again", prompt, eng.hbs, max_tokens=1)
    resaved = bool(done) and all(e == 1 for e in eng.w.store.batch_exists(done[0]))
    first = next(i for i, sc in enumerate(eng.scheduled) if "b" in sc)
    prefill = sum(sc["b"] for sc, c in zip(eng.scheduled, eng.computed_before)
                  if "b" in sc and c["b"] < n)
    print(json.dumps({"removed": len(done[0]) if done else 0,
                      "per_request": rep.per_request if rep else None,
                      "safe": rep.safe_tokens if rep else None,
                      "lands_at": rep.lands_at if rep else None,
                      "invalid": sorted(eng.invalid[0]),
                      "restart": eng.computed_before[first]["b"], "prefill": prefill,
                      "status": r.status.name, "n": n, "resaved": resaved,
                      "written": sum(eng.written),
                      "again_hit": eng.s.connector.get_num_new_matched_tokens(again, 0)[0]}),
          flush=True)
    eng.close()


if __name__ == "__main__":
    os.environ.setdefault("GLOG_minloglevel", "2")
    if sys.argv[1] == "B-partial":
        partial(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
