"""Routing index: hmacore's RoutingIndex next to the plain-Python dict-of-counts index doing the
same rule (tests/oracle_route.py: a dict (group, hash) -> count per engine + the Python
transcription of vLLM's hit rule), in one run, on the same events and queries.

    python bench/bench_route.py [--preset gpt-oss-120b] [--engines 16] [--repeat 5]
                                [--events-only]

Reports (every hmacore answer is checked equal to the Python index's before timing):
- events applied per second: one vLLM-like event stream (every group's blocks of 16 prompts
  stored, then half of them evicted) flattened to rows, as the KV event subscriber passes a
  decoded batch to ``RoutingIndex.apply``: hmacore takes Python lists (ops, groups and the
  64-bit int hashes vLLM publishes, as msgspec decodes them; converting them is timed), the
  Python index the same lists with pre-folded 8-byte keys (its conversion is not timed);
  each run starts from an emptied engine (``reset_engine`` / a new dict, timed);
- the subscriber's path (``bench_batches``): the same stream as vLLM emits it (a BlockStored
  per group per 2048-token prefill chunk, a BlockRemoved per evicted block), encoded and
  decoded by msgspec (not timed; hmacore's with the subscriber's ``index_decoder``), handed as
  ``batch.events`` to ``RoutingIndex.apply_events``
  (one call), against ``py_subscriber`` walking the same decoded events into a dict of counts
  (its hashes pre-folded to 8-byte keys, not timed); and one engine step's batch (per group a
  5-block BlockStored, then one BlockRemoved per hash: 20 rows for two groups), 2000 calls;
- the subscriber's whole work from the payload bytes (``bench_payload``): the same streams
  with vLLM's token ids and parent hash in the payload (token ids uniform below 30000, and
  once mixed over msgpack's int forms as a 151k vocabulary's are: ``token_ids``); hmacore's
  subscriber path (``RoutingIndex.apply_payload``: the bytes read in one compiled call), the
  decoded path it falls back to (msgspec's index decoder + ``apply_events``) and that path
  with the full schema, against the Python subscriber decoding with either decoder;
- query time for 4k / 32k / 128k-token prompts over N engines, engine i holding the first
  (i+1)/N of the prompt in every group, or engine 0 all of it and the others none: hash
  computation (vLLM's sha256 chain, the same
  Python code in both, reported once) and lookup separately;
- bytes per resident block per engine (hmacore: table bytes / keys; Python: tracemalloc of
  the dict with its keys), for one engine holding a 128k prompt and for N engines holding
  the spread residency of a 32k prompt (all engines' bytes / all engines' resident keys).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import tracemalloc

import msgspec
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]   # this checkout's hmacore and the oracle

from oracle_route import OracleRoute  # noqa: E402

from hmacore.presets import get_preset  # noqa: E402
from hmacore.route_index import OP_REMOVE, OP_STORE, RoutingIndex  # noqa: E402
from hmacore.transport import kv_event_wire as W  # noqa: E402
from hmacore.transport.kv_events import _EVENT_TYPES, SPEC_KINDS  # noqa: E402


SIZES = (4096, 32768, 131072)


def timed(fn, repeat):
    """Fastest of ``repeat`` calls (after one warm-up call) and the last result. Timed in this
    thread's CPU time (``time.thread_time``), not wall time: on a shared, loaded machine a
    long call (the Python index's) is descheduled far more often than a short one, which
    inflated wall-clock ratios (a 166x "events" ratio at load 20 for a 10x kernel)."""
    out = fn()
    ts = []
    for _ in range(repeat):
        t = time.thread_time()
        out = fn()
        ts.append(time.thread_time() - t)
    return min(ts), out


def block_rows(index, digests, fraction=1.0):
    """(groups, row indices) of every group's blocks in the first ``fraction`` of a prompt:
    block i of group g is hash row (i+1)*k - 1, k = bs_g / h."""
    groups, rows = [], []
    for g in index.finder.group_ids:
        k = index.finder.block_sizes[g] // index.hash_block_size
        nb = int(len(digests) // k * fraction)
        r = (np.arange(nb) + 1) * k - 1
        groups.append(np.full(nb, g, np.int32))
        rows.append(r)
    return np.concatenate(groups), np.concatenate(rows)


def event_stream(index, rng, prompts=16, tokens=8192):
    """A vLLM-like stream: all blocks of ``prompts`` random prompts stored, then half removed."""
    ops, groups, ints = [], [], []
    for _ in range(prompts):
        toks = rng.integers(1, 30000, tokens).tolist()
        d = index.block_hashes(toks)
        g, r = block_rows(index, d)
        h = [int.from_bytes(d[i][-8:], "big") for i in r]
        ops.append(np.full(len(h), OP_STORE, np.int8))
        groups.append(g)
        ints.extend(h)
    ops_a, groups_a = np.concatenate(ops), np.concatenate(groups)
    half = rng.permutation(len(ints))[:len(ints) // 2]
    ops_a = np.concatenate([ops_a, np.full(half.size, OP_REMOVE, np.int8)])
    groups_a = np.concatenate([groups_a, groups_a[half]])
    ints = ints + [ints[i] for i in half]
    return ops_a, groups_a, np.array(ints, np.uint64)


def bench_events(layout, engines, repeat, rng):
    index = RoutingIndex(layout)
    ops, groups, ints = event_stream(index, rng)
    keys8 = [int(v).to_bytes(8, "big") for v in ints]
    gl, ol = groups.tolist(), ops.tolist()
    ints_list = ints.tolist()        # as msgspec decodes an event batch: Python ints
    hm = RoutingIndex(layout)
    key = hm.add_engine("e")
    py = OracleRoute(layout)

    def run_hm():
        hm.reset_engine(key)
        hm.apply(key, ol, gl, ints_list)

    def run_py():
        py.engines[key] = {}
        py.apply(key, ol, gl, keys8)
    t_hm, _ = timed(run_hm, repeat)
    t_py, _ = timed(run_py, repeat)
    assert hm.resident_blocks(key) == len(py.engines[key])
    n = len(ops)
    return n, n / t_hm, n / t_py


CHUNK_TOKENS = 2048     # one prefill chunk: vLLM emits one BlockStored per group per step


def as_events(index, ops, groups, ints, chunk_tokens=CHUNK_TOKENS):
    """The flat rows as vLLM emits them: runs of stores of one group as BlockStored events of
    one prefill chunk's blocks, each remove its own BlockRemoved (vLLM evicts block by
    block), medium "GPU"; encoded and decoded as the subscriber does (msgspec). Returns
    (events with int hashes, the same events with 8-byte keys for the Python index)."""
    kind = {g: next(k for k, v in SPEC_KINDS.items() if v == s.kind)
            for g, s in enumerate(index.layout.groups)}
    evs, i, n = [], 0, len(ops)
    while i < n:
        g = int(groups[i])
        if ops[i] == OP_REMOVE:
            evs.append(W.BlockRemoved(block_hashes=[int(ints[i])], medium=W.MEDIUM_GPU,
                                      group_idx=g))
            i += 1
            continue
        per = max(1, chunk_tokens // index.finder.block_sizes[g])
        j = i
        while j < n and j - i < per and ops[j] == OP_STORE and groups[j] == g:
            j += 1
        evs.append(W.BlockStored(block_hashes=[int(v) for v in ints[i:j]], medium=W.MEDIUM_GPU,
                                 group_idx=g, kv_cache_spec_kind=kind[g],
                                 block_size=index.finder.block_sizes[g]))
        i = j
    payload = msgspec.msgpack.encode(W.EventBatch(ts=0.0, events=evs))
    ints_events = W.index_decoder().decode(payload).events     # the subscriber's decoding
    for ev in evs:
        ev.block_hashes = [v.to_bytes(8, "big") for v in ev.block_hashes]
    bytes_events = W.decoder().decode(msgspec.msgpack.encode(W.EventBatch(ts=0.0, events=evs)))
    return ints_events, bytes_events.events


def py_subscriber(counts, events, types=(W.BlockStored, W.BlockRemoved, W.AllBlocksCleared)):
    """The Python index's subscriber: walk the decoded events, count (group, key) per hash."""
    stored, _, cleared = types
    for ev in events:
        t = type(ev)
        if t is cleared:
            counts.clear()
            continue
        if ev.medium is not None and ev.medium != W.MEDIUM_GPU:
            continue
        g = ev.group_idx or 0
        if t is stored:
            for h in ev.block_hashes:
                counts[(g, h)] = counts.get((g, h), 0) + 1
        else:
            for h in ev.block_hashes:
                c = counts.get((g, h), 0)
                if c > 1:
                    counts[(g, h)] = c - 1
                elif c == 1:
                    del counts[(g, h)]


def bench_batches(layout, repeat, rng):
    """The subscriber's path: a decoded batch's events to ``RoutingIndex.apply_events`` (one
    call), against ``py_subscriber``; the big stream of :func:`bench_events` and one engine
    step's batch (per group a 5-block BlockStored, then 10 single-hash BlockRemoved)."""
    index = RoutingIndex(layout)
    out = []
    for label, (o, g, v), reps in (("stream", event_stream(index, rng), repeat),
                                   ("step", step_rows(index, rng), repeat)):
        ev_int, ev_bytes = as_events(index, o, g, v)
        key = index.add_engine(label)
        py_counts: dict = {}
        calls = 1 if label == "stream" else 2000

        def run_hm():
            if label == "stream":
                index.reset_engine(key)
            for _ in range(calls):
                index.apply_events(key, ev_int, _EVENT_TYPES, spec_kinds=SPEC_KINDS)

        def run_py():
            if label == "stream":
                py_counts.clear()
            for _ in range(calls):
                py_subscriber(py_counts, ev_bytes)
        t_hm, _ = timed(run_hm, reps)
        t_py, _ = timed(run_py, reps)
        assert index.resident_blocks(key) == len(py_counts)
        out.append((label, len(ev_int), len(o), t_hm / calls, t_py / calls))
    return out


def token_ids(rng, n, mixed=False):
    """``n`` token ids: uniform in [1, 30000) (msgpack's 3-byte form nearly always), or
    ``mixed`` as text over a 151k vocabulary spreads them over msgpack's int forms: 10% below
    128 (1 byte), 10% below 256 (2), 70% below 65536 (3), 10% above (5)."""
    if not mixed:
        return rng.integers(1, 30000, n).tolist()
    r = rng.random(n)
    return np.where(r < .1, rng.integers(1, 128, n), np.where(
        r < .2, rng.integers(128, 256, n), np.where(
            r < .9, rng.integers(256, 65536, n), rng.integers(65536, 151000, n)))).tolist()


def payload_of(index, ops, groups, ints, rng, mixed=False):
    """The rows as vLLM's publisher sends them (:func:`as_events`' events with what vLLM puts
    beside the hashes: each stored block's ``block_size`` token ids (:func:`token_ids`), the
    parent hash), one msgpack payload."""
    evs = []
    for ev in as_events(index, ops, groups, ints)[0]:
        if type(ev) is W.IndexBlockStored:
            n = len(ev.block_hashes) * index.finder.block_sizes[ev.group_idx]
            ev = W.BlockStored(block_hashes=ev.block_hashes, medium=ev.medium,
                               group_idx=ev.group_idx, kv_cache_spec_kind=ev.kv_cache_spec_kind,
                               block_size=index.finder.block_sizes[ev.group_idx],
                               parent_block_hash=ev.block_hashes[0],
                               token_ids=token_ids(rng, n, mixed))
        else:
            ev = W.BlockRemoved(block_hashes=ev.block_hashes, medium=ev.medium,
                                group_idx=ev.group_idx)
        evs.append(ev)
    return msgspec.msgpack.encode(W.EventBatch(ts=time.time(), events=evs))


def bench_payload(layout, repeat, rng):
    """The subscriber's whole work per batch, from the payload bytes it receives: decode, then
    apply. hmacore's subscriber (``index_decoder``: token ids skipped unbuilt, then
    ``apply_events``) against the same with the full schema (the subscriber before) and the
    Python subscriber with either decoder. Streams as :func:`bench_batches`."""
    index = RoutingIndex(layout)
    full, part = W.decoder(), W.index_decoder()
    full_types = (W.BlockStored, W.BlockRemoved, W.AllBlocksCleared)
    out = []
    stream = event_stream(index, rng)
    for label, (o, g, v), calls, mixed in (("stream", stream, 1, False),
                                           ("stream, mixed ids", stream, 1, True),
                                           ("step", step_rows(index, rng), 500, False)):
        payload = payload_of(index, o, g, v, rng, mixed)
        key = index.add_engine("p-" + label)
        counts: dict = {}

        def hm(dec, types):
            def run():
                if calls == 1:
                    index.reset_engine(key)
                for _ in range(calls):
                    index.apply_events(key, dec.decode(payload).events, types,
                                       spec_kinds=SPEC_KINDS)
            return run

        def hm_bytes():
            if calls == 1:
                index.reset_engine(key)
            for _ in range(calls):
                if index.apply_payload(key, payload, spec_kinds=SPEC_KINDS) is None:
                    raise AssertionError("apply_payload declined vLLM's batch")

        def py(dec, types):
            def run():
                if calls == 1:
                    counts.clear()
                for _ in range(calls):
                    py_subscriber(counts, dec.decode(payload).events, types)
            return run
        times, held = {}, set()
        for name, fn in (("hm_bytes", hm_bytes), ("hm", hm(part, W.INDEX_EVENT_TYPES)),
                         ("hm_full", hm(full, full_types)),
                         ("py", py(part, W.INDEX_EVENT_TYPES)), ("py_full", py(full, full_types))):
            times[name] = timed(fn, repeat)[0] / calls
            if name.startswith("py"):
                assert index.resident_blocks(key) == len(counts)
            elif calls == 1:          # every hmacore path leaves the same residency
                held.add(index.resident_blocks(key))
                assert len(held) == 1, held
        out.append((label, len(o), len(payload), times))
    return out


def step_rows(index, rng):
    """One engine step's rows: per group a 5-block store, then one remove per hash."""
    ops, groups, ints = [], [], []
    for g in index.finder.group_ids:
        ops += [OP_STORE] * 5
        groups += [g] * 5
        ints += rng.integers(0, 2**63, 5).tolist()
    ops += [OP_REMOVE] * len(ints)
    groups += groups
    ints += ints
    return np.array(ops, np.int8), np.array(groups, np.int32), np.array(ints, np.uint64)


def split_events(layout, repeat, rng):
    """Where ``apply_events``'s time goes on the stream: the compiled call with engine bit -1
    (walk, validate and pack only) against the whole call from an emptied engine."""
    from hmacore._fast import _route
    index = RoutingIndex(layout)
    ev, _ = as_events(index, *event_stream(index, rng))
    key = index.add_engine("e")
    res, bit, refused = index._residency, index._engines[key], index._refused_kinds(SPEC_KINDS)
    args = (ev, _EVENT_TYPES, W.MEDIUM_GPU, refused, index.num_groups)
    t_walk, out = timed(lambda: _route.apply_events(res, -1, *args), repeat)
    t_all, _ = timed(lambda: (res.clear_engine(bit), _route.apply_events(res, bit, *args)),
                     repeat)
    t_clear, _ = timed(lambda: res.clear_engine(bit), repeat)
    return len(ev), out[4], t_walk, t_all - t_walk - t_clear


def memory(layout, engines_unused, rng):
    index = RoutingIndex(layout)
    toks = rng.integers(1, 30000, 131072).tolist()
    d = index.block_hashes(toks)
    g, r = block_rows(index, d)
    ints = [int.from_bytes(d[i][-8:], "big") for i in r]
    key = index.add_engine("e")
    index.apply(key, np.full(len(ints), OP_STORE, np.int8), g, ints)
    hm_bytes = index.nbytes(key) / index.resident_blocks(key)
    py = OracleRoute(layout)
    keys8 = [v.to_bytes(8, "big") for v in ints]
    gl = g.tolist()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    py.add_engine(key)
    py.apply(key, [OP_STORE] * len(ints), gl, keys8)
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    # the key bytes objects existed before (the events'); count them as the index's own copy
    py_bytes = (after - before + sum(sys.getsizeof(k) for k in keys8)) / len(py.engines[key])
    return hm_bytes, py_bytes, index.resident_blocks(key)


def memory_shared(layout, engines, rng):
    """N engines, engine i holding the first (i+1)/N of a 32k prompt in every group."""
    index = RoutingIndex(layout)
    py = OracleRoute(layout)
    d = index.block_hashes(rng.integers(1, 30000, 32768).tolist())
    rows = []
    for e in range(engines):
        g, r = block_rows(index, d, (e + 1) / engines)
        rows.append((g, [int.from_bytes(d[i][-8:], "big") for i in r]))
    keys8 = {v: v.to_bytes(8, "big") for _, ints in rows for v in ints}
    for e, (g, ints) in enumerate(rows):
        key = index.add_engine(f"e{e}")
        index.apply(key, np.full(len(ints), OP_STORE, np.int8), g, ints)
    held = sum(index.resident_blocks(k) for k in index.engines)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for e, (g, ints) in enumerate(rows):
        py.add_engine(e)
        py.apply(e, [OP_STORE] * len(ints), g.tolist(), [keys8[v] for v in ints])
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    py_bytes = (after - before + sum(sys.getsizeof(k) for k in keys8.values())) / held
    return index.total_nbytes() / held, py_bytes, held


def bench_query(layout, engines, tokens, repeat, rng, spread=True):
    index = RoutingIndex(layout)
    py = OracleRoute(layout)
    toks = rng.integers(1, 30000, tokens).tolist()
    t_hash, digests = timed(lambda: index.block_hashes(toks), max(1, repeat // 2))
    for e in range(engines):
        key = index.add_engine(f"e{e}")
        py.add_engine(key)
        g, r = block_rows(index, digests, (e + 1) / engines if spread else float(e == 0))
        ints = [int.from_bytes(digests[i][-8:], "big") for i in r]
        index.apply(key, np.full(len(ints), OP_STORE, np.int8), g, ints)
        py.apply(key, [OP_STORE] * len(ints), g.tolist(), [v.to_bytes(8, "big") for v in ints])
    arr = np.frombuffer(b"".join(digests), np.uint8).reshape(-1, len(digests[0]))
    t_hm, got = timed(lambda: index.query_hashes(arr, tokens), repeat)
    t_py, want = timed(lambda: py.hits(digests, tokens), max(1, repeat // 2))
    assert got.hits == want, (got.hits, want)
    return t_hash, t_hm, t_py, got.best


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="gpt-oss-120b")
    ap.add_argument("--engines", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--events-only", action="store_true",
                    help="only the event tables (no queries, no memory)")
    args = ap.parse_args(argv)
    layout = get_preset(args.preset)
    rng = np.random.default_rng(0)
    print(f"## Routing index, {args.preset}, {args.engines} engines "
          f"(best of {args.repeat}; hmacore vs plain-Python dict index, same rule)\n")
    n, hm_rate, py_rate = bench_events(layout, args.engines, args.repeat, rng)
    print("| events | rows | hmacore rows/s | Python rows/s | ratio |")
    print("|---|---:|---:|---:|---:|")
    print(f"| store all + evict half | {n} | {hm_rate:,.0f} | {py_rate:,.0f} | "
          f"{hm_rate / py_rate:.1f}x |\n")
    print("| decoded batch -> apply_events | events | rows | hmacore | Python subscriber | "
          "hmacore rows/s | Python rows/s | ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for label, n_ev, n_rows, t_hm, t_py in bench_batches(layout, args.repeat, rng):
        print(f"| {label} | {n_ev} | {n_rows} | {t_hm * 1e6:.1f} us | {t_py * 1e6:.1f} us | "
              f"{n_rows / t_hm:,.0f} | {n_rows / t_py:,.0f} | {t_py / t_hm:.1f}x |")
    print("\n| payload -> apply | rows | bytes | hmacore apply_payload | hmacore, index "
          "decoder + apply_events | hmacore, full schema | Python, index decoder | Python, "
          "full schema | ratio, apply_payload | ratio, index decoders | ratio, full schemas |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for label, n_rows, nbytes, t in bench_payload(layout, args.repeat, rng):
        print(f"| {label} | {n_rows} | {nbytes} | {t['hm_bytes'] * 1e6:.1f} us | "
              f"{t['hm'] * 1e6:.1f} us | "
              f"{t['hm_full'] * 1e6:.1f} us | {t['py'] * 1e6:.1f} us | "
              f"{t['py_full'] * 1e6:.1f} us | {t['py'] / t['hm_bytes']:.1f}x | "
              f"{t['py'] / t['hm']:.1f}x | {t['py_full'] / t['hm_full']:.1f}x |")
    n_ev, rows, t_walk, t_table = split_events(layout, args.repeat, rng)
    print(f"\nstream split ({n_ev} events, {rows} rows): walk + validate + pack "
          f"{t_walk * 1e6:.0f} us ({t_walk / rows * 1e9:.1f} ns/row), table "
          f"{t_table * 1e6:.0f} us ({t_table / rows * 1e9:.1f} ns/row)")
    print()
    if args.events_only:
        return
    print("| prompt tokens | residency | hash rows | hash computation | hmacore lookup | "
          "Python lookup | ratio | best hit |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for tokens in SIZES:
        for spread, label in ((True, "engine i: (i+1)/N"), (False, "engine 0: all")):
            t_hash, t_hm, t_py, best = bench_query(layout, args.engines, tokens, args.repeat,
                                                   rng, spread)
            print(f"| {tokens} | {label} | {tokens // layout.hash_block_size} | "
                  f"{t_hash * 1e3:.2f} ms | {t_hm * 1e6:.1f} us | {t_py * 1e3:.2f} ms | "
                  f"{t_py / t_hm:.0f}x | {best} |")
    hm_b, py_b, blocks = memory(layout, args.engines, rng)
    print(f"\nbytes per resident block per engine, one engine ({blocks} blocks): "
          f"hmacore {hm_b:.1f}, Python {py_b:.1f} ({py_b / hm_b:.1f}x)")
    hm_b, py_b, held = memory_shared(layout, args.engines, rng)
    print(f"bytes per resident block per engine, {args.engines} engines sharing a 32k prompt "
          f"({held} engine-blocks): hmacore {hm_b:.1f}, Python {py_b:.1f} ({py_b / hm_b:.1f}x)")


if __name__ == "__main__":
    main()
