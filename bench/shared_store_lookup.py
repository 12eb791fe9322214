"""The scheduler's store lookup on the shared store: which existence check (measured side by side
in one run; ratios, not absolute times, are the result).

    python bench/shared_store_lookup.py [--preset gpt-oss-120b] [--tokens 4096 32768]

A request of ``tokens`` tokens whose first 3/4 of blocks the store holds (every looked-up
group); its vLLM ``list[bytes]`` hashes. Per lookup (median of repeats, microseconds):

* ``embedded``: today's in-process path, the hit kernel over ``EmbeddedStore.digest_index``.
* ``mirror``: ``SharedStore.digest_index`` (this process's mirror; the log head unchanged, so
  no lock) + the same kernel: what the scheduler runs under the multiprocess engine.
* ``mirror+64``: the same after another process's handle put 64 new keys (the mirror reads
  and applies 64 log events under the lock first): a lookup right after a step's saves.
* ``keys-shared``: the key-string path over the shared index (``lookup_hit``: key strings,
  ``batch_exists`` probing the shared table per key under its lock, a temporary set).
* ``keys-embedded``: the same key path over the in-process dict: a lower bound for any
  per-lookup probe of a table by key string.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tests"))
from hits_scenarios import make_hashes  # noqa: E402

from hmacore.hits import HitFinder  # noqa: E402
from hmacore.keys import KeyBuilder  # noqa: E402
from hmacore.presets import get_preset  # noqa: E402
from hmacore.transport.shared_store import SharedStore  # noqa: E402
from hmacore.transport.store import EmbeddedStore, lookup_hit, lookup_hit_indexed  # noqa: E402


def _median_us(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def measure(preset: str, tokens: int, repeat: int) -> dict[str, float]:
    finder = HitFinder(get_preset(preset))
    keys = KeyBuilder("model")
    ns = keys.prefix(finder.group_ids[0]).rpartition("@group:")[0]
    rows = tokens // finder.hash_block_size
    hashes = make_hashes(rows, 32, 1)
    listed = [bytes(r) for r in hashes]
    value = np.zeros(64, np.uint8)
    name = "bench-" + uuid.uuid4().hex[:8]
    rounds = max(repeat // 4, 5)
    pages = 4 * rows + 64 * (rounds + 2) + 256                 # nothing is ever evicted
    shared = SharedStore(name, 64 * pages, 64)
    writer = SharedStore(name, 64 * pages, 64)                 # "the worker": another handle
    embedded = EmbeddedStore(1 << 30)
    try:
        for st in (shared, embedded, writer):
            st.register(value.ctypes.data, value.nbytes)
        plan = finder.lookup_keys(hashes[: rows * 3 // 4], tokens, keys)
        for st in (writer, embedded):
            st.batch_put(plan.keys, [[(value.ctypes.data, 64)]] * len(plan.keys))
        want = lookup_hit(finder, keys, embedded, hashes, tokens).tokens
        assert want > 0
        e_index = embedded.digest_index(ns)
        fresh = iter(range(10 ** 9))

        def embedded_path():
            return lookup_hit_indexed(finder, e_index, listed, tokens).tokens

        def mirror_path():
            return lookup_hit_indexed(finder, shared.digest_index(ns), listed, tokens).tokens

        def mirror_after_puts():
            ks = [keys.keys(0, np.frombuffer(os.urandom(32), np.uint8).reshape(1, 32))[0]
                  for _ in range(64)]
            writer.batch_put(ks, [[(value.ctypes.data, 64)]] * 64)
            t = time.perf_counter()
            hit = mirror_path()
            mirror_after_puts.elapsed = time.perf_counter() - t
            return hit

        def keys_shared():
            return lookup_hit(finder, keys, shared, hashes, tokens).tokens

        def keys_embedded():
            return lookup_hit(finder, keys, embedded, hashes, tokens).tokens

        for fn in (embedded_path, mirror_path, keys_shared, keys_embedded):
            assert fn() == want, fn.__name__
        out = {"embedded": _median_us(embedded_path, repeat),
               "mirror": _median_us(mirror_path, repeat)}
        after = []
        for _ in range(rounds):
            next(fresh)
            assert mirror_after_puts() == want
            after.append(mirror_after_puts.elapsed)       # the lookup only, not the puts
        out["mirror+64"] = statistics.median(after) * 1e6
        out["keys-shared"] = _median_us(keys_shared, max(repeat // 10, 3))
        out["keys-embedded"] = _median_us(keys_embedded, max(repeat // 10, 3))
        return out
    finally:
        writer.close()
        shared.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="gpt-oss-120b")
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--repeat", type=int, default=200)
    args = ap.parse_args()
    cols = ["embedded", "mirror", "mirror+64", "keys-shared", "keys-embedded"]
    print(f"preset {args.preset}; microseconds per lookup (median); ratio = time / mirror")
    print("| tokens | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for n in args.tokens:
        r = measure(args.preset, n, args.repeat)
        cells = [f"{r[c]:.1f} ({r[c] / r['mirror']:.2f}x)" for c in cols]
        print(f"| {n} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
