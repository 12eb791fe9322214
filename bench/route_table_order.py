"""What bounds the routing table's event rows: ``SharedResidency.apply_rows`` on the packed
rows of bench_route.py's event stream, in stream order and sorted by home slot (the order a
radix partition of the batch by slot would give, its own cost left out), with the table
left in the cache from the previous run ("hot") or pushed out by 4 MiB of writes ("cold").

    PYTHONHASHSEED=0 python bench/route_table_order.py [--preset gpt-oss-120b] [--repeat 15]

The home slot is recomputed here with _route.pyx's hash of an 8-byte key (one splitmix64
round of key ^ group * golden ratio): keep the two in step.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "bench")]

from bench_route import event_stream  # noqa: E402

from hmacore._fast import _route  # noqa: E402
from hmacore.presets import get_preset  # noqa: E402
from hmacore.route_index import RoutingIndex  # noqa: E402


def _mix(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="gpt-oss-120b")
    ap.add_argument("--repeat", type=int, default=15)
    a = ap.parse_args(argv)
    index = RoutingIndex(get_preset(a.preset))
    ops, groups, ints = event_stream(index, np.random.default_rng(0))
    ops_a, groups_a, keys, _ = _route.pack_event_lists(ops.tolist(), groups.tolist(),
                                                       ints.tolist(), index.num_groups)
    res = _route.SharedResidency(8)
    bit = res.add_engine()
    res.apply_rows(bit, ops_a, groups_a, keys)         # sizes the table
    cap = res.nbytes // 24
    with np.errstate(over="ignore"):
        home = _mix(keys.copy().view("<u8").ravel()
                    ^ groups_a.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15))
    order = np.argsort(home & np.uint64(cap - 1), kind="stable")
    by_slot = ops_a[order].copy(), groups_a[order].copy(), keys[order].copy()
    junk = np.zeros(4 << 20, np.uint8)

    def best(rows, evict):
        ts = []
        for _ in range(a.repeat):
            res.clear_engine(bit)
            if evict:
                junk[::64] += 1
            t = time.thread_time()
            res.apply_rows(bit, *rows)
            ts.append(time.thread_time() - t)
        return min(ts) / len(ops_a) * 1e9

    print(f"{a.preset}: {len(ops_a)} rows, table {res.nbytes / 2**20:.1f} MiB")
    for label, evict in (("hot", False), ("cold", True)):
        print(f"  {label}: stream order {best((ops_a, groups_a, keys), evict):.1f} ns/row, "
              f"by home slot {best(by_slot, evict):.1f} ns/row")


if __name__ == "__main__":
    main()
