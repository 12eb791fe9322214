"""A real Mooncake store filled up (run inside ``unshare -n``, see test_faults_store).

``python mc_full.py <port>``: brings lo up, starts mooncake_master on 127.0.0.1 and ONE
client whose segment is Mooncake's minimum (16 MiB), so the pool fills after a few
DeepSeek-V4-shaped requests (512 bytes per token per layer, 2 layers per group). Saves
REQUESTS distinct requests through ``save_blocks`` and records, per request, what was
written and which keys were refused (NO_SPACE) with ``SaveReport.raise_for_failures``'s
StoreError. Then checks against the real master: no refused key exists; every written key
exists; each request's lookup hits only written keys, and the hit loads byte-identical into
other memory. Then removes the first requests' keys and re-saves a refused request: it is
written, hit and loaded byte-identical (the store keeps serving). Prints one JSON line;
kills everything it started by PID.

The master runs with eviction off. With Mooncake's default (evict 5% of objects once the
pool passes 90%, objects whose 10 s lease expired), the re-saved request's keys were evicted
before its lookup when the machine was slow: the lookup then correctly missed (hit 0), and
the test flaked. Reproduced by sleeping 12 s between that save and the lookup: default
flags hit 0, eviction off hits 768 (25 Nov).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "mooncake"))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

import numpy as np  # noqa: E402
import scenario as sc  # noqa: E402 - tests/mooncake/scenario.py helpers
from netns import master_log, start_master  # noqa: E402 - tests/mooncake/netns.py
from hmacore.errors import StoreError  # noqa: E402
from hmacore.hits import HitFinder  # noqa: E402
from hmacore.keys import KeyBuilder  # noqa: E402
from hmacore.presets import get_preset  # noqa: E402
from hmacore.transport.mooncake import MooncakeStore, wait_for_port  # noqa: E402
from hmacore.transport.store import GroupSegments, load_blocks, lookup_hit, save_blocks  # noqa: E402

REQUESTS = 12
BYTES_PER_TOKEN = 512
LAYERS = 2
SEGMENT = 16 << 20          # Mooncake 0.3.13 refuses smaller segments


def memory(layout, tokens, seed):
    """Per group, LAYERS arrays big enough for REQUESTS requests' own blocks."""
    rng = np.random.default_rng(seed)
    arrays = []
    for s in layout.groups:
        nb = REQUESTS * -(-tokens // s.block_size) + 1
        arrays.append([rng.integers(0, 256, (nb, BYTES_PER_TOKEN * s.block_size), dtype=np.uint8)
                       for _ in range(LAYERS)])
    return arrays, [GroupSegments.from_arrays(a) for a in arrays]


def tables(finder, tokens, r):
    return [list(range(1 + r * -(-tokens // bs), 1 + (r + 1) * -(-tokens // bs)))
            for bs in finder.block_sizes]


def hashes_of(finder, tokens, r):
    rng = np.random.default_rng(1000 + r)
    h = rng.integers(0, 256, (tokens // finder.hash_block_size, 32), dtype=np.uint8)
    return np.ascontiguousarray(h)


def hit_keys(finder, keys, hashes, hit):
    """The keys a hit's masks stand for (the keys load_blocks would read)."""
    out = []
    h = finder.hash_block_size
    for g in finder.group_ids:
        blocks = np.flatnonzero(hit.masks[g]).astype(np.int64)
        if blocks.size == 0:
            continue
        k = finder.block_sizes[g] // h
        rows = np.minimum((blocks + 1) * k - 1, hit.tokens // h - 1)
        out.extend(keys.keys(g, finder.key_digests(hashes, g, rows)))
    return out


def load_and_compare(finder, keys, st, hashes, hit, src, src_t, dst, dsegs, dst_t):
    for arrs in dst:
        for a in arrs:
            a[:] = 0
    ok = load_blocks(finder, keys, st, hashes, hit, dst_t, dsegs)
    compared = mismatched = nbytes = 0
    for g in finder.group_ids:
        for i in np.flatnonzero(hit.masks[g]):
            for s, d in zip(src[g], dst[g]):
                compared += 1
                nbytes += s[src_t[g][i]].nbytes
                mismatched += int(not np.array_equal(s[src_t[g][i]], d[dst_t[g][i]]))
    return ok, compared, mismatched, nbytes


def main(port):
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    log = master_log("mc_full")
    # eviction off: this test is about NO_SPACE refusals, and Mooncake evicts objects in the
    # background past its high watermark (default 90%), which made "hit after removal"
    # depend on timing (keys written after the removal were evicted before the lookup)
    master = start_master(port, log, "--eviction_high_watermark_ratio=1.0",
                          "--eviction_ratio=0.0")
    st = None
    out = {"requests": []}
    try:
        assert wait_for_port("127.0.0.1", port, 20), "master did not start"
        layout = get_preset("deepseek-v4")
        finder = HitFinder(layout)
        keys = KeyBuilder("dsv4-full")
        tokens = 3 * finder.scheduler_block_size + 7
        src, segs = memory(layout, tokens, 1)
        dst, dsegs = memory(layout, tokens, 2)
        st = MooncakeStore(f"127.0.0.1:{port}", global_segment_size=SEGMENT,
                           local_buffer_size=16 << 20, connect_timeout_s=20)
        st.register_group_segments(segs)
        st.register_group_segments(dsegs)
        refused_keys = set()
        reports = []
        for r in range(REQUESTS):
            rid = f"req-{r}"
            hashes = hashes_of(finder, tokens, r)
            rep = save_blocks(finder, keys, st, hashes, tokens, tables(finder, tokens, r), segs)
            err = None
            try:
                rep.raise_for_failures(rid)
            except StoreError as e:
                err = e
            reports.append(rep)
            refused_keys.update(rep.refused_keys)
            out["requests"].append({
                "id": rid, "written": rep.written, "refused": len(rep.refused_keys),
                "failed": rep.failed, "skipped": rep.skipped, "no_space": rep.no_space,
                "error_names_request": err is not None and rid in str(err) and err.request_id == rid,
                "error_names_key": err is not None and bool(err.keys) and err.keys[0] in str(err),
                "error": None if err is None else str(err)[:160]})
        # the keys that were written (a key written by its request; present ones count too)
        all_keys = {}
        for r in range(REQUESTS):
            hashes = hashes_of(finder, tokens, r)
            rows = finder.store_rows(hashes.shape[0], tokens, 0)
            ks = [k for g in finder.group_ids
                  for k in keys.keys(g, finder.key_digests(hashes, g, rows[g]))]
            all_keys[r] = ks
        flat = [k for r in range(REQUESTS) for k in all_keys[r]]
        ex = st.batch_exists(flat)
        exists = {k for k, e in zip(flat, ex) if e == 1}
        out["keys_total"] = len(flat)
        out["refused_total"] = len(refused_keys)
        out["refused_present"] = len(refused_keys & exists)          # must be 0
        out["exists_errors"] = sum(1 for e in ex if e < 0)
        out["written_total"] = sum(rep.written for rep in reports)
        # a request never has more keys present than its save wrote (or found present):
        # nothing refused, skipped or failed is reported as existing
        out["present_beyond_written"] = sum(
            max(0, sum(1 for k in all_keys[r] if k in exists) - reports[r].written
                - reports[r].present) for r in range(REQUESTS))
        # every request: its hit reads only stored keys and loads byte-identical
        hits, hit_bad_keys, compared, mismatched, nbytes, loads_ok = [], 0, 0, 0, 0, True
        for r in range(REQUESTS):
            hashes = hashes_of(finder, tokens, r)
            hit = lookup_hit(finder, keys, st, hashes, tokens)
            hits.append(hit.tokens)
            hk = hit_keys(finder, keys, hashes, hit)
            hit_bad_keys += sum(1 for k in hk if k in refused_keys or k not in exists)
            if hit.tokens:
                ok, c, m, b = load_and_compare(finder, keys, st, hashes, hit, src,
                                               tables(finder, tokens, r), dst, dsegs,
                                               tables(finder, tokens, 0))
                loads_ok &= ok
                compared, mismatched, nbytes = compared + c, mismatched + m, nbytes + b
        out.update(hits=hits, hit_bad_keys=hit_bad_keys, loads_ok=loads_ok, compared=compared,
                   mismatched=mismatched, bytes_checked=nbytes)
        # removal frees space: a refused request is stored, hit and loaded afterwards
        victims = [k for r in range(3) for k in all_keys[r] if k in exists]
        rm = st.batch_remove(victims)
        out["removed"] = sum(1 for c in rm if c == 0)
        out["removed_still_present"] = sum(1 for e in st.batch_exists(victims) if e == 1)
        last = max(r for r in range(REQUESTS) if reports[r].no_space)
        hashes = hashes_of(finder, tokens, last)
        rep = save_blocks(finder, keys, st, hashes, tokens, tables(finder, tokens, last), segs)
        hit = lookup_hit(finder, keys, st, hashes, tokens)
        ok, c, m, b = load_and_compare(finder, keys, st, hashes, hit, src,
                                       tables(finder, tokens, last), dst, dsegs,
                                       tables(finder, tokens, 0))
        out["after_removal"] = {"request": last, "hit_before": hits[last], "written": rep.written,
                                "refused": len(rep.refused_keys), "failed": rep.failed,
                                "hit": hit.tokens, "loaded": ok, "compared": c,
                                "mismatched": m, "bytes_checked": b}
        print(json.dumps(out), flush=True)
        return 0
    finally:
        sc.teardown(st, master, log)


if __name__ == "__main__":
    os.environ.setdefault("GLOG_minloglevel", "2")
    sys.exit(main(int(sys.argv[1])))
