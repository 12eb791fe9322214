"""Mooncake master killed and restarted (run inside ``unshare -n``, see test_faults_store).

``python mc_restart.py <port>``: brings lo up, starts mooncake_master on 127.0.0.1, stores a
DeepSeek-V4-shaped request through a client with a segment, looks it up (hit), SIGKILLs the
master, looks up again (miss, bounded), restarts the master on the same port, looks up
(miss: the new master knows nothing, none of the old keys exists), re-stores with the SAME
client (MooncakeStore recovers by itself), looks up (hit) and loads every hit block into
other memory, comparing bytes; twice (two kill/restart cycles). Prints one JSON line; kills
everything it started by PID.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "mooncake"))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

import numpy as np  # noqa: E402
import scenario as sc  # noqa: E402 - tests/mooncake/scenario.py helpers (request, memory...)
from netns import master_log, start_master  # noqa: E402 - tests/mooncake/netns.py
from hmacore.keys import KeyBuilder  # noqa: E402
from hmacore.transport.mooncake import wait_for_port  # noqa: E402
from hmacore.transport.store import load_blocks, lookup_hit, save_blocks  # noqa: E402


def timed(fn, *a):
    t0 = time.monotonic()
    r = fn(*a)
    return r, round(time.monotonic() - t0, 2)


def compare(finder, src, src_t, dst, dst_t, hit):
    compared = mismatched = nbytes = 0
    for g in finder.group_ids:
        for i in np.flatnonzero(hit.masks[g]):
            for s, d in zip(src[g], dst[g]):
                compared += 1
                nbytes += s[src_t[g][i]].nbytes
                mismatched += int(not np.array_equal(s[src_t[g][i]], d[dst_t[g][i]]))
    return compared, mismatched, nbytes


CYCLES = 2


def main(port):
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    log = master_log("mc_restart")
    master = start_master(port, log)
    out = {"cycles": []}
    st = None
    try:
        assert wait_for_port("127.0.0.1", port, 20), "master did not start"
        layout, finder, tokens, hashes = sc.request()
        src, segs = sc.memory(layout, seed=1)
        dst, dsegs = sc.memory(layout, seed=2)
        keys = KeyBuilder("dsv4")
        st = sc.client(port, 128 << 20)          # ONE client for the whole run
        st.register_group_segments(segs)
        st.register_group_segments(dsegs)
        src_t = sc.tables(finder, tokens, 1)
        dst_t = sc.tables(finder, tokens, 100)
        out["written"] = save_blocks(finder, keys, st, hashes, tokens, src_t, segs).written
        out["hit_before"] = lookup_hit(finder, keys, st, hashes, tokens).tokens
        old_keys = [k for g in finder.group_ids
                    for k in keys.keys(g, finder.key_digests(hashes, g, np.arange(
                        hashes.shape[0], dtype=np.int64)))]
        for cycle in range(CYCLES):
            c = {}
            if cycle == 1:   # no fail-fast interval: the first call after the restart recovers,
                st.retry_interval_s = 0.0   # before the segment is re-mounted (waits, bounded)
            master.send_signal(signal.SIGKILL)
            master.wait(timeout=10)
            hit, c["down_lookup_s"] = timed(lookup_hit, finder, keys, st, hashes, tokens)
            c["hit_down"] = hit.tokens
            other = hashes.copy()
            other[:, 7] ^= 0x33 + cycle
            rep, c["down_save_s"] = timed(save_blocks, finder, keys, st, other, tokens, src_t, segs)
            c["down_save_written"], c["down_save_failed"] = rep.written, rep.failed
            c["suspect_while_down"] = st.suspect
            master = start_master(port, log)
            assert wait_for_port("127.0.0.1", port, 20), "master did not restart"
            if cycle == 0:
                time.sleep(1.1)                   # past the client's fail-fast retry interval
            c["probe_waits_before"] = st.recovery["probe_waits"]
            hit, c["restarted_lookup_s"] = timed(lookup_hit, finder, keys, st, hashes, tokens)
            c["hit_after_restart"] = hit.tokens
            c["suspect_after_restart"] = st.suspect
            # nothing stale: none of the old keys exists on the new master
            c["old_keys_present"] = sum(1 for e in st.batch_exists(old_keys) if e == 1)
            c["old_keys_asked"] = len(old_keys)
            for arr in dst:                       # a failed load must not leave old bytes
                for a in arr:
                    a[:] = 0
            c["load_of_old_hit"] = load_blocks(finder, keys, st, hashes,
                                               lookup_hit(finder, keys, st, hashes, tokens),
                                               dst_t, dsegs)
            rep, c["restore_s"] = timed(save_blocks, finder, keys, st, hashes, tokens, src_t, segs)
            c["restore_written"], c["restore_failed"] = rep.written, rep.failed
            c["restore_no_space"] = rep.no_space
            hit = lookup_hit(finder, keys, st, hashes, tokens)
            c["hit_final"] = hit.tokens
            c["loaded"] = load_blocks(finder, keys, st, hashes, hit, dst_t, dsegs)
            c["compared"], c["mismatched"], c["bytes_checked"] = compare(
                finder, src, src_t, dst, dst_t, hit)
            out["cycles"].append(c)
        out["recovery"] = dict(st.recovery)
        print(json.dumps(out), flush=True)
        return 0
    finally:
        sc.teardown(st, master, log)


if __name__ == "__main__":
    os.environ.setdefault("GLOG_minloglevel", "2")
    sys.exit(main(int(sys.argv[1])))
