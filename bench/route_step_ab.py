"""Issue 22's per-step path, two builds side by side: (a) one engine step's decoded batch
through ``RoutingIndex.apply_events`` and (b) a flood of step batches from the payload bytes
through the KV event subscriber (decode + apply, as its thread does), each against the
plain-Python subscriber on the same inputs, in one run with the builds' rounds interleaved
(old, new, old, new, ...: each round one child process per build and preset).

    PYTHONHASHSEED=0 python bench/route_step_ab.py --old /tmp/old-tree [--rounds 3]

``--old`` / ``--new``: hmacore checkouts with their Cython built in place (``setup.py
build_ext --inplace``); ``--new`` defaults to this checkout. Times are thread CPU time, the
best of 4 x ``--repeat`` timings per round for (a), of ``--repeat`` for (b): (a) of 2000
calls (bench_route.py's step rows: per group a 5-block BlockStored, then one BlockRemoved per
hash); (b) of a flood of ``--batches``
distinct step batches per engine, with vLLM's token ids and parent hash in each payload
(bench_route.py's ``payload_of``), ``--engines`` streams, as the subscriber's loop handles
them: per turn up to 256 messages of each stream (``_on_drained``; a build without it takes
them one by one, ``_on_live``), from a fresh subscriber state. The Python subscriber decodes
each payload with the same index decoder, checks the DP rank and walks the events into a dict
of counts (bench_route.py's ``py_subscriber``) per engine; it keeps no sequence numbers nor
digests (the hmacore subscriber does both).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRESETS = ("gpt-oss-120b", "deepseek-v4", "qwen3-next-80b")


def child(tree: str, preset: str, batches: int, engines: int, repeat: int) -> dict:
    sys.path[:0] = [tree, os.path.join(tree, "bench"), os.path.join(tree, "tests")]
    import numpy as np

    import bench_route as B
    import hmacore
    from hmacore.presets import get_preset
    from hmacore.route_index import RoutingIndex
    from hmacore.transport import kv_event_wire as W
    from hmacore.transport import kv_events as K
    assert os.path.dirname(os.path.dirname(hmacore.__file__)) == tree, hmacore.__file__
    layout = get_preset(preset)
    rng = np.random.default_rng(0)

    def best(fn, calls, n=4 * repeat):
        ts = []
        fn()
        for _ in range(n):
            t = time.thread_time()
            fn()
            ts.append(time.thread_time() - t)
        return min(ts) / calls

    # (a) one step's decoded batch
    index = RoutingIndex(layout)
    ev_int, ev_bytes = B.as_events(index, *B.step_rows(index, rng))
    key = index.add_engine("s")
    counts: dict = {}
    calls = 2000

    def hm_step():
        for _ in range(calls):
            index.apply_events(key, ev_int, K._EVENT_TYPES, spec_kinds=K.SPEC_KINDS)

    def py_step():
        for _ in range(calls):
            B.py_subscriber(counts, ev_bytes)
    out = {"step_events": len(ev_int), "step_hm": best(hm_step, calls),
           "step_py": best(py_step, calls)}
    assert index.resident_blocks(key) == len(counts)

    # (b) a flood of step batches from the payload bytes, per engine
    flood = []
    for e in range(engines):
        msgs = []
        for seq in range(batches):
            p = B.payload_of(index, *B.step_rows(index, rng), rng)
            msgs.append([b"", seq.to_bytes(8, "big"), p])
        flood.append(msgs)
    out["flood_bytes"] = sum(len(m[2]) for msgs in flood for m in msgs) / (engines * batches)
    specs = [K.EngineStream(f"e{e}", f"tcp://127.0.0.1:{1 + e}") for e in range(engines)]
    drained = hasattr(K.KVEventSubscriber, "_on_drained")
    state: dict = {}

    def fresh():
        ix = RoutingIndex(layout)
        sub = K.KVEventSubscriber(ix, specs)
        sts = []
        for spec in specs:
            st = K._Stream(spec, None)
            sub._by_key[spec.key] = st
            ix.add_engine(*spec.key)
            sts.append(st)
        state.update(ix=ix, sub=sub, sts=sts)

    def hm_flood(one_by_one):
        sub, sts = state["sub"], state["sts"]
        for lo in range(0, batches, 256):
            for st, msgs in zip(sts, flood):
                if one_by_one:
                    for f in msgs[lo:lo + 256]:
                        sub._on_live(st, f)
                else:
                    sub._on_drained(st, msgs[lo:lo + 256])

    dec = W.index_decoder()

    def py_flood():
        dicts = state["dicts"]
        for lo in range(0, batches, 256):
            for d, msgs in zip(dicts, flood):
                for f in msgs[lo:lo + 256]:
                    batch = dec.decode(f[2])
                    if batch.data_parallel_rank not in (None, 0):
                        raise ValueError("rank")
                    B.py_subscriber(d, batch.events, W.INDEX_EVENT_TYPES)

    def timed_fresh(fn, setup):
        ts = []
        for _ in range(repeat + 1):
            setup()
            t = time.thread_time()
            fn()
            ts.append(time.thread_time() - t)
        return min(ts[1:]) / (engines * batches)

    modes = [("flood_live", lambda: hm_flood(True))]
    if drained:
        modes.append(("flood_drained", lambda: hm_flood(False)))
    for name, fn in modes:
        out[name] = timed_fresh(fn, fresh)
        s = state["sub"].stats()
        assert all(v.batches == batches and v.bad_batches == 0 for v in s.values()), s
    out["flood_py"] = timed_fresh(py_flood, lambda: state.update(dicts=[{} for _ in specs]))
    assert [len(d) for d in state["dicts"]] == \
        [state["ix"].resident_blocks(sp.key) for sp in specs]
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old")
    ap.add_argument("--new", default=HERE)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--batches", type=int, default=1024)
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--preset", action="append")
    ap.add_argument("--child", nargs=2, metavar=("TREE", "PRESET"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(os.path.abspath(args.child[0]), args.child[1], args.batches,
                               args.engines, args.repeat)))
        return
    if not args.old:
        ap.error("--old is required (the build to compare against)")
    presets = args.preset or PRESETS
    trees = {"old": os.path.abspath(args.old), "new": os.path.abspath(args.new)}
    res: dict = {(p, b): [] for p in presets for b in trees}
    loads = [os.getloadavg()[0]]
    for _ in range(args.rounds):
        for p in presets:
            for b, tree in trees.items():
                cmd = [sys.executable, os.path.abspath(__file__), "--child", tree, p,
                       "--repeat", str(args.repeat), "--batches", str(args.batches),
                       "--engines", str(args.engines)]
                env = dict(os.environ, PYTHONPATH=tree)
                res[(p, b)].append(json.loads(subprocess.run(
                    cmd, env=env, check=True, capture_output=True, text=True).stdout))
        loads.append(os.getloadavg()[0])
    def col(rows, fn):
        return " ".join(fn(r) for r in rows)

    def us(k):
        return lambda r: f"{r[k] * 1e6:.2f}"

    def ratio(k):
        return lambda r: f"{r['step_py' if k == 'step_hm' else 'flood_py'] / r[k]:.1f}x"
    print(f"load average (1 min) before / after each round: "
          f"{' '.join(f'{x:.1f}' for x in loads)}\n")
    print("(a) one step's decoded batch, us per call (per round) and ratio Python / hmacore\n")
    print("| preset (events) | old | new | new / old | Python | ratio old | ratio new |")
    print("|---|---|---|---|---|---|---|")
    for p in presets:
        o, n = res[(p, "old")], res[(p, "new")]
        rel = " ".join(f"{b['step_hm'] / a['step_hm']:.2f}" for a, b in zip(o, n))
        print(f"| {p} ({o[0]['step_events']}) | {col(o, us('step_hm'))} | "
              f"{col(n, us('step_hm'))} | {rel} | {col(o + n, us('step_py'))} | "
              f"{col(o, ratio('step_hm'))} | {col(n, ratio('step_hm'))} |")
    print(f"\n(b) a flood of {args.batches} step batches x {args.engines} engines from the "
          f"payload bytes (decode + apply), us per batch (per round)\n")
    print("| preset (bytes/batch) | old, one by one | new, one by one | new, drained | "
          "Python | ratio old | ratio new, one by one | ratio new, drained |")
    print("|---|---|---|---|---|---|---|---|")
    for p in presets:
        o, n = res[(p, "old")], res[(p, "new")]
        print(f"| {p} ({o[0]['flood_bytes']:.0f}) | {col(o, us('flood_live'))} | "
              f"{col(n, us('flood_live'))} | {col(n, us('flood_drained'))} | "
              f"{col(o + n, us('flood_py'))} | {col(o, ratio('flood_live'))} | "
              f"{col(n, ratio('flood_live'))} | {col(n, ratio('flood_drained'))} |")

if __name__ == "__main__":
    main()
