"""The subscriber's stream call alone, for A/B runs of a kernel change: bench_route.py's
decoded event stream (``event_stream`` + ``as_events``) applied by
``RoutingIndex.apply_events`` from an emptied engine (the reset timed, as bench_route.py's
``bench_batches`` does), repeated for ``--seconds`` of thread CPU time; prints the best call.

    PYTHONHASHSEED=0 python bench/route_events_best.py --preset deepseek-v4 [--seconds 2]

Best of many calls, not of 7: on a loaded shared machine the minimum of a few thousand calls
moves far less between runs than bench_route.py's ratios, so two builds run one after the
other (old, new, old, new, ...) can be compared to a few percent.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench"), os.path.join(ROOT, "tests")]

import bench_route as B  # noqa: E402

from hmacore.presets import get_preset  # noqa: E402
from hmacore.route_index import RoutingIndex  # noqa: E402
from hmacore.transport.kv_events import _EVENT_TYPES, SPEC_KINDS  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="gpt-oss-120b")
    ap.add_argument("--seconds", type=float, default=2.0)
    args = ap.parse_args(argv)
    index = RoutingIndex(get_preset(args.preset))
    ops, groups, ints = B.event_stream(index, np.random.default_rng(0))
    events, _ = B.as_events(index, ops, groups, ints)
    key = index.add_engine("s")

    def run():
        index.reset_engine(key)
        index.apply_events(key, events, _EVENT_TYPES, spec_kinds=SPEC_KINDS)
    run()
    best, calls, start = float("inf"), 0, time.thread_time()
    while time.thread_time() - start < args.seconds:
        t = time.thread_time()
        run()
        best = min(best, time.thread_time() - t)
        calls += 1
    print(f"{args.preset}: {len(events)} events, {len(ops)} rows, best {best * 1e6:.1f} us "
          f"({best / len(ops) * 1e9:.2f} ns/row) of {calls} calls")


if __name__ == "__main__":
    main()
