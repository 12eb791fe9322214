"""Real-Mooncake scenarios, run as the top process of a private network namespace.

``python scenario.py netns <mode> <port>`` must run inside ``unshare -n`` (see
``netns.py``): it brings ``lo`` up, starts ``mooncake_master`` on 127.0.0.1 (its wildcard
listeners are only reachable over this namespace's loopback), runs the mode, prints one JSON
line, and kills every process it started by PID. Modes:

* ``roundtrip``: a saver process (with a pool segment) stores a DeepSeek-V4-shaped hybrid
  request; a loader process with NO segment (bytes cross the TCP transport) looks it up and
  loads it into its own memory, then compares every byte.
* ``demo``: ``hmacore demo --store mooncake`` against this master; prints the demo's report.
* ``connector-<case>``: HmaStoreConnector (``tests/mooncake/connector_roles.py``): instance A
  (vLLM Scheduler + worker connector, one process) saves, instance B (another process) gets
  the prefix hit, loads and compares every needed block's bytes.
* ``master_killed``: store, look up (hit), SIGKILL the master, look up again (miss, bounded
  time), save again (failures counted, no exception).
* ``runs``: block-major pages (a block's layer slots adjacent): each key's per-layer buffers
  reach Mooncake as one buffer (hmacore.runs.buffer_runs); put, get into other memory,
  compare every byte.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))                          # tests/
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))         # repo root

from hmacore.hits import HitFinder  # noqa: E402
from hmacore.keys import KeyBuilder  # noqa: E402
from hmacore.presets import get_preset  # noqa: E402
from hmacore.transport.mooncake import MooncakeStore, wait_for_port  # noqa: E402
from hmacore.transport.store import GroupSegments, load_blocks, lookup_hit, save_blocks  # noqa: E402
from netns import master_log, start_master  # noqa: E402

NUM_BLOCKS = 512
LAYERS = 2


def request():
    layout = get_preset("deepseek-v4", num_blocks=NUM_BLOCKS)
    finder = HitFinder(layout)
    tokens = 3 * finder.scheduler_block_size + 7
    rng = np.random.default_rng(1234)
    hashes = rng.integers(0, 256, (tokens // finder.hash_block_size, 32), dtype=np.uint8)
    hashes[:, :4] = np.arange(hashes.shape[0], dtype=">u4").view(np.uint8).reshape(-1, 4)
    return layout, finder, tokens, np.ascontiguousarray(hashes)


def memory(layout, seed):
    """Per group, its own LAYERS arrays of (NUM_BLOCKS, 16 bytes per token)."""
    rng = np.random.default_rng(seed)
    arrays = [[rng.integers(0, 256, (NUM_BLOCKS, 16 * s.block_size), dtype=np.uint8)
               for _ in range(LAYERS)] for s in layout.groups]
    return arrays, [GroupSegments.from_arrays(a) for a in arrays]


def tables(finder, tokens, first):
    out, nxt = [], first
    for bs in finder.block_sizes:
        n = -(-tokens // bs)
        out.append(list(range(nxt, nxt + n)))
        nxt += n
    return out


def client(port, segment):
    return MooncakeStore(f"127.0.0.1:{port}", global_segment_size=segment,
                         local_buffer_size=16 << 20, connect_timeout_s=20)


def role_saver(port):
    layout, finder, tokens, hashes = request()
    arrays, segs = memory(layout, seed=1)
    st = client(port, 128 << 20)
    regions = st.register_group_segments(segs)
    rep = save_blocks(finder, KeyBuilder("dsv4"), st, hashes, tokens, tables(finder, tokens, 1), segs)
    print(json.dumps({"written": rep.written, "failed": rep.failed, "no_space": rep.no_space,
                      "regions": regions}), flush=True)
    sys.stdin.readline()           # keep the segment (the data) alive until the loader is done
    st.close()


def role_loader(port):
    layout, finder, tokens, hashes = request()
    src, _ = memory(layout, seed=1)
    dst, segs = memory(layout, seed=2)
    st = client(port, 0)           # no segment: every byte crosses the TCP transport
    st.register_group_segments(segs)
    keys = KeyBuilder("dsv4")
    hit = lookup_hit(finder, keys, st, hashes, tokens)
    dst_t, src_t = tables(finder, tokens, 100), tables(finder, tokens, 1)
    ok = load_blocks(finder, keys, st, hashes, hit, dst_t, segs)
    compared = mismatched = 0
    for g in finder.group_ids:
        for i in np.flatnonzero(hit.masks[g]):
            for s, d in zip(src[g], dst[g]):
                compared += 1
                mismatched += int(not np.array_equal(s[src_t[g][i]], d[dst_t[g][i]]))
    # a request that shares only the first 256 tokens
    other = hashes.copy()
    other[64:] ^= 0xFF
    partial = lookup_hit(finder, keys, st, other, tokens).tokens
    print(json.dumps({"hit": hit.tokens, "loaded": ok, "compared": compared,
                      "mismatched": mismatched, "partial_hit": partial,
                      "exists_calls": st.calls["exists"]}), flush=True)
    st.close()


def mode_master_killed(port, master):
    layout, finder, tokens, hashes = request()
    arrays, segs = memory(layout, seed=1)
    st = client(port, 128 << 20)
    st.register_group_segments(segs)
    keys = KeyBuilder("dsv4")
    rep = save_blocks(finder, keys, st, hashes, tokens, tables(finder, tokens, 1), segs)
    before = lookup_hit(finder, keys, st, hashes, tokens).tokens
    master.send_signal(signal.SIGKILL)
    master.wait(timeout=10)
    t0 = time.monotonic()
    after = lookup_hit(finder, keys, st, hashes, tokens).tokens
    lookup_s = time.monotonic() - t0
    t0 = time.monotonic()
    other = hashes.copy()
    other[:, 5] ^= 0x55            # new keys: the save must go through put, which fails
    rep2 = save_blocks(finder, keys, st, other, tokens, tables(finder, tokens, 1), segs)
    save_s = time.monotonic() - t0
    empty_ok = st.batch_exists([]) == [] and st.batch_put([], []) == []
    return {"written": rep.written, "before": before, "after": after, "lookup_s": lookup_s,
            "save_failed": rep2.failed, "save_written": rep2.written, "save_s": save_s,
            "empty_ok": empty_ok}


def mode_runs(port):
    """A key per block; its value = the block's LAYERS slots, adjacent in block-major memory."""
    rng = np.random.default_rng(5)
    src = rng.integers(0, 256, (64, LAYERS, 256), dtype=np.uint8)
    dst = np.zeros_like(src)
    st = client(port, 64 << 20)
    st.register(src.ctypes.data, src.nbytes)
    st.register(dst.ctypes.data, dst.nbytes)
    blocks = [3, 4, 9, 10, 11, 40]
    keys = [f"runs-{b}" for b in blocks]
    slot = lambda mem, b, j: (mem.ctypes.data + (b * LAYERS + j) * 256, 256)  # noqa: E731
    put = st.batch_put(keys, [[slot(src, b, j) for j in range(LAYERS)] for b in blocks])
    got = st.batch_get(keys, [[slot(dst, b + 1, j) for j in range(LAYERS)] for b in blocks])
    same = all(np.array_equal(src[b], dst[b + 1]) for b in blocks)
    out = {"put": put, "got": got, "same": same, "buffers": dict(st.buffers)}
    st.close()
    return out


def kill(proc, grace=5.0):
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)


def teardown(store, master, log):
    """End a scenario: close the store client (best effort: the master may be dead already),
    stop the master by its PID, close its log."""
    if store is not None:
        try:
            store.close()
        except Exception:  # noqa: BLE001
            pass
    kill(master)
    log.close()


def netns_main(mode, port):
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    log = master_log("mc_master")
    master = start_master(port, log, "--eviction_high_watermark_ratio=0.95")
    saver = None
    try:
        if not wait_for_port("127.0.0.1", port, 20):
            print(json.dumps({"error": "master did not start"}), flush=True)
            return 1
        if mode == "master_killed":
            print(json.dumps(mode_master_killed(port, master)), flush=True)
            return 0
        if mode == "runs":
            print(json.dumps(mode_runs(port)), flush=True)
            return 0
        if mode == "demo":   # `hmacore demo --store mooncake` against this master
            out = os.path.join(os.environ.get("HMACORE_MC_LOGDIR", "/tmp"), f"demo_{os.getpid()}.json")
            root = os.path.dirname(os.path.dirname(HERE))
            run = subprocess.run([sys.executable, "-m", "hmacore", "demo", "--store", "mooncake",
                                  "--master", f"127.0.0.1:{port}", "--preset", "deepseek-v4",
                                  "--requests", "2", "--tokens", "3000", "--json", out],
                                 cwd=root, capture_output=True, text=True, timeout=180,
                                 env=dict(os.environ, PYTHONPATH=root))
            rep = json.load(open(out)) if os.path.exists(out) else {"error": run.stderr[-2000:]}
            rep["returncode"] = run.returncode
            print(json.dumps(rep), flush=True)
            return 0
        if mode.startswith("connector-"):   # HmaStoreConnector, one instance per process
            case = mode.split("-", 1)[1]
            roles = os.path.join(HERE, "connector_roles.py")
            loader_args = ["B", case, str(port)]
            if case.startswith("partial-"):   # partial-<case>-<group>.<index>: a key removed
                _, case, fault = case.split("-")
                loader_args = ["B-partial", case, fault, str(port)]
            saver = subprocess.Popen([sys.executable, roles, "A", case, str(port)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            lines = []
            while True:
                ln = saver.stdout.readline()
                if not ln or ln.startswith("{"):
                    lines.append(ln)
                    break
            saved = json.loads(lines[-1] or "{}")
            loader = subprocess.run([sys.executable, roles, *loader_args],
                                    capture_output=True, text=True, timeout=180)
            lines = [ln for ln in loader.stdout.splitlines() if ln.startswith("{")]
            loaded = json.loads(lines[-1]) if lines else {"error": loader.stderr[-3000:]}
            saver.stdin.write("done\n")
            saver.stdin.flush()
            saver.wait(timeout=60)
            print(json.dumps({"saver": saved, "loader": loaded}), flush=True)
            return 0
        me = os.path.abspath(__file__)
        saver = subprocess.Popen([sys.executable, me, "saver", str(port)], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
        saved = json.loads(saver.stdout.readline() or "{}")
        loader = subprocess.run([sys.executable, me, "loader", str(port)], capture_output=True,
                                text=True, timeout=120)
        lines = [ln for ln in loader.stdout.splitlines() if ln.startswith("{")]
        loaded = json.loads(lines[-1]) if lines else {"error": loader.stderr[-2000:]}
        saver.stdin.write("done\n")
        saver.stdin.flush()
        saver.wait(timeout=60)
        print(json.dumps({"saver": saved, "loader": loaded}), flush=True)
        return 0
    finally:
        kill(saver)
        kill(master)
        log.close()


if __name__ == "__main__":
    os.environ.setdefault("GLOG_minloglevel", "2")
    role, port = sys.argv[1], int(sys.argv[-1])
    if role == "netns":
        sys.exit(netns_main(sys.argv[2], port))
    elif role == "saver":
        role_saver(port)
    elif role == "loader":
        role_loader(port)
