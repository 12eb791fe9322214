"""Where one hmacore connector variant's scheduler-side time goes, per method, inside vLLM's
real Scheduler (the product benchmark's workload; thread CPU time, no profiler).

    python bench/hook_split.py hma_push_P gptoss 256 32768 prefill [--steps 40]

Wraps the connector's hooks (bench_product.TIMED_HOOKS) and the scheduler-side object's own
methods named in SPLIT, runs ``--steps`` steps after the warm-up, and prints calls, ms per step
and us per call of each (nested methods are inside their callers' figures).
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_product as B  # noqa: E402

SPLIT = ("_follow_step", "_follow_entries", "_push_plan", "_track_full",
         "_is_push_producer", "_drop_stale_registrations", "_expire_leases", "lookup")
#: the followed requests' TrackerSet calls (the store's and pull's followers; push P's
#: scheduler follows no table: its worker does, bench_product.py --worker times that)
TRACKER_SPLIT = ("add", "reserve", "step_pairs", "apply_step_lists", "finish")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("variant")
    ap.add_argument("layout", choices=B.LAYOUTS)
    ap.add_argument("requests", type=int)
    ap.add_argument("prompt", type=int)
    ap.add_argument("kind", choices=B.KINDS)
    ap.add_argument("--steps", type=int, default=40)
    a = ap.parse_args(argv)
    cell = B.Cell(a.layout, a.requests, a.prompt, a.kind)
    wl = B.make_workload(a.layout, a.requests, a.prompt, B.WARM_OUT + a.steps + 8,
                         B.hash_block_size(a.layout))
    nb = B.blocks_needed(a.layout, a.requests, a.prompt, wl.max_tokens)
    engines, _ = B.build_engines(cell, wl, B.chosen_variants([a.variant]), nb,
                                 a.prompt + wl.max_tokens + 8, "split")
    engines = B.warm_engines(cell, engines, {})
    e = next(x for x in engines if x.v.name == a.variant)
    total: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()

    def timed(fn, name):
        def wrapper(*args, **kw):
            t0 = time.thread_time_ns()
            try:
                out = fn(*args, **kw)
                return list(out) if name == "_follow_step" else out   # a generator
            finally:
                total[name] += time.thread_time_ns() - t0
                calls[name] += 1
        return wrapper

    conn = e.s.connector
    trackers = getattr(conn.scheduler, "trackers", None)
    for obj, names in ((conn.scheduler, SPLIT), (conn, B.TIMED_HOOKS),
                       (trackers, TRACKER_SPLIT if trackers is not None else ())):
        for name in names:
            fn = getattr(obj, name, None)
            if callable(fn):
                setattr(obj, name, timed(fn, f"trackers.{name}" if obj is trackers else name))
    for _ in range(a.steps):
        e.step()
    for name, ns in total.most_common():
        print(f"{name:30s} calls {calls[name]:6d}  ms/step {ns / 1e6 / a.steps:8.4f}  "
              f"us/call {ns / 1e3 / calls[name]:8.1f}")
    for x in engines:
        x.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
