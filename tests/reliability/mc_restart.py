"""Mooncake master killed and restarted (run inside ``unshare -n``, see test_faults_store).

``python mc_restart.py <port>``: brings lo up, starts mooncake_master on 127.0.0.1, stores a
DeepSeek-V4-shaped request through a client with a segment, looks it up (hit), SIGKILLs the
master, looks up again (miss, bounded), restarts the master on the same port, looks up
(miss: the new master knows nothing), re-stores (the same client first; a fresh client if
the old one cannot reach the new master), looks up (hit) and loads every hit block into
other memory, comparing bytes. Prints one JSON line; kills everything it started by PID.
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
from hmacore.keys import KeyBuilder  # noqa: E402
from hmacore.transport.mooncake import wait_for_port  # noqa: E402
from hmacore.transport.store import load_blocks, lookup_hit, save_blocks  # noqa: E402


def start_master(port, log):
    binary = os.path.join(os.path.dirname(sys.executable), "mooncake_master")
    return subprocess.Popen([binary, "--rpc_address=127.0.0.1", f"--rpc_port={port}",
                             "--metrics_host=127.0.0.1", f"--metrics_port={port + 1}",
                             "--rpc_thread_num=2", "--logtostderr"], stdout=log, stderr=log)


def timed(fn, *a):
    t0 = time.monotonic()
    r = fn(*a)
    return r, round(time.monotonic() - t0, 2)


def main(port):
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    log = open(os.path.join(os.environ.get("HMACORE_MC_LOGDIR", "/tmp"),
                            f"mc_restart_{os.getpid()}.log"), "w")
    master = start_master(port, log)
    out = {}
    clients = []
    try:
        assert wait_for_port("127.0.0.1", port, 20), "master did not start"
        layout, finder, tokens, hashes = sc.request()
        src, segs = sc.memory(layout, seed=1)
        keys = KeyBuilder("dsv4")
        st = sc.client(port, 128 << 20)
        clients.append(st)
        st.register_group_segments(segs)
        src_t = sc.tables(finder, tokens, 1)
        out["written"] = save_blocks(finder, keys, st, hashes, tokens, src_t, segs).written
        out["hit_before"] = lookup_hit(finder, keys, st, hashes, tokens).tokens
        master.send_signal(signal.SIGKILL)
        master.wait(timeout=10)
        hit, out["down_lookup_s"] = timed(lookup_hit, finder, keys, st, hashes, tokens)
        out["hit_down"] = hit.tokens
        master = start_master(port, log)
        assert wait_for_port("127.0.0.1", port, 20), "master did not restart"
        hit, out["restarted_lookup_s"] = timed(lookup_hit, finder, keys, st, hashes, tokens)
        out["hit_after_restart"] = hit.tokens
        rep, out["restore_s"] = timed(save_blocks, finder, keys, st, hashes, tokens, src_t, segs)
        out["same_client_restore_written"] = rep.written
        hit = lookup_hit(finder, keys, st, hashes, tokens)
        out["same_client_hit"] = hit.tokens
        reader = st
        if hit.tokens == 0:            # the old client lost its mount: a fresh client re-stores
            st2 = sc.client(port, 128 << 20)
            clients.append(st2)
            src2, segs2 = sc.memory(layout, seed=1)
            st2.register_group_segments(segs2)
            out["fresh_client_restore_written"] = save_blocks(finder, keys, st2, hashes, tokens,
                                                              src_t, segs2).written
            hit = lookup_hit(finder, keys, st2, hashes, tokens)
            reader = st2
        out["hit_final"] = hit.tokens
        dst, dsegs = sc.memory(layout, seed=2)
        reader.register_group_segments(dsegs)
        dst_t = sc.tables(finder, tokens, 100)
        out["loaded"] = load_blocks(finder, keys, reader, hashes, hit, dst_t, dsegs)
        compared = mismatched = nbytes = 0
        for g in finder.group_ids:
            for i in np.flatnonzero(hit.masks[g]):
                for s, d in zip(src[g], dst[g]):
                    compared += 1
                    nbytes += s[src_t[g][i]].nbytes
                    mismatched += int(not np.array_equal(s[src_t[g][i]], d[dst_t[g][i]]))
        out.update(compared=compared, mismatched=mismatched, bytes_checked=nbytes)
        print(json.dumps(out), flush=True)
        return 0
    finally:
        for c in clients:
            try:
                c.close()
            except Exception:  # noqa: BLE001
                pass
        sc.kill(master)
        log.close()


if __name__ == "__main__":
    os.environ.setdefault("GLOG_minloglevel", "2")
    sys.exit(main(int(sys.argv[1])))
