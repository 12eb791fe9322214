"""KVEventSubscriber's drained path (``_on_drained``): the messages one loop turn received
from a stream, with runs of in-order batches applied from their bytes in one
``RoutingIndex.apply_payloads`` call, must leave the index and every counter exactly as
handling them one by one (``_on_live``) does, and exactly as the decoded path alone (msgspec
structs to ``apply_events``, what the subscriber did before reading the bytes) does: gaps,
duplicates, restarts, undecodable / other-rank / refused batches inside a run. Driven
without sockets or threads (the subscriber is not started: its streams have no socket and
no replay endpoint, so a gap resets the engine), so nothing waits on a clock.
"""
from __future__ import annotations

import random

import msgspec
import pytest

from hmacore.route_index import ApplyStats, RoutingIndex
from hmacore.spec import KVLayout
from hmacore.transport import kv_event_wire as W
from hmacore.transport.kv_events import EngineStream, KVEventSubscriber, _Stream

LAYOUT = KVLayout.from_dict({"groups": [
    {"kind": "full", "block_size": 16},
    {"kind": "sliding_window", "block_size": 16, "sliding_window": 64}]})
POOL = [1000 + 7 * i for i in range(24)]          # the hashes the batches store and remove
ENC = msgspec.msgpack.Encoder()
FULL_TYPES = (W.BlockStored, W.BlockRemoved, W.AllBlocksCleared)


class Counting(RoutingIndex):
    """A RoutingIndex recording its calls: ``("bytes", payloads given, applied)`` per
    ``apply_payloads``, ``("events", n)`` per ``apply_events``. ``decoded_only``: every
    payload is declined, so the subscriber takes the decoded path for each batch."""

    def __init__(self, decoded_only: bool = False) -> None:
        super().__init__(LAYOUT)
        self.calls: list[tuple] = []
        self.decoded_only = decoded_only

    def apply_payloads(self, key, payloads, **kw):  # type: ignore[override]
        if self.decoded_only:
            stats, done = ApplyStats(0, 0, 0, 0, 0, 0, 0), 0
        else:
            stats, done = RoutingIndex.apply_payloads(self, key, payloads, **kw)
        self.calls.append(("bytes", len(payloads), done))
        return stats, done

    def apply_events(self, key, events, types, **kw):  # type: ignore[override]
        self.calls.append(("events", len(events)))
        return RoutingIndex.apply_events(self, key, events, types, **kw)


def subscriber(index: RoutingIndex) -> tuple[KVEventSubscriber, _Stream]:
    spec = EngineStream("e0", "tcp://127.0.0.1:1")
    sub = KVEventSubscriber(index, [spec])
    st = _Stream(spec, None)          # type: ignore[arg-type]   (never started: no socket)
    sub._by_key[spec.key] = st
    index.add_engine(*spec.key)
    return sub, st


def payload(events: list, rank: int | None = None) -> bytes:
    return ENC.encode(W.EventBatch(ts=0.0, events=events, data_parallel_rank=rank))


def frames(seq: int, body: bytes) -> list[bytes]:
    return [b"", seq.to_bytes(8, "big"), body]


def stores(hashes: list[int], group: int = 0, **kw) -> W.BlockStored:
    return W.BlockStored(block_hashes=hashes, group_idx=group, medium="GPU", **kw)


def removes(hashes: list[int], group: int = 0) -> W.BlockRemoved:
    return W.BlockRemoved(block_hashes=hashes, group_idx=group, medium="GPU")


def residency(index: RoutingIndex) -> tuple[int, list]:
    """Every pool key's count on engine e0, read off by removing it (on a copy's worth of
    events: the index is changed, so call it last): per (group, hash) how many of three
    removes lowered a count."""
    key = ("e0", 0)
    held = index.resident_blocks(key)
    counts = []
    for g in (0, 1):
        for h in POOL:
            r = index.apply_events(key, [removes([h], g)] * 3, FULL_TYPES)
            counts.append(r.removed)
    return held, counts


def random_stream(rng: random.Random, n: int) -> list[list[bytes]]:
    """Messages of one stream: mostly in-order batches of stores and removes of the pool,
    with undecodable payloads, other-rank batches, batches the index refuses (a group out
    of range, a spec kind contradicting the layout), repeats of recent messages, gaps,
    restarts (seq back to 0) and malformed frames mixed in."""
    out: list[list[bytes]] = []
    seq = 0
    for _ in range(n):
        r = rng.random()
        if r < 0.05 and out:
            out.append(rng.choice(out[-6:]))                   # a repeat
            continue
        if r < 0.08:
            out.append([b"", b"\x00\x01"])                      # not (topic, seq, payload)
            continue
        if r < 0.11:
            seq += rng.randint(1, 3)                            # a gap
        elif r < 0.13:
            seq = 0                                             # a restart
        evs: list = []
        for _ in range(rng.randint(1, 4)):
            hs = rng.sample(POOL, rng.randint(1, 3))
            g = rng.randint(0, 1)
            evs.append(stores(hs, g) if rng.random() < 0.55 else removes(hs, g))
        if rng.random() < 0.05:
            evs.append(W.AllBlocksCleared())
        bad = rng.random()
        if bad < 0.04:
            body = b"\xc1not msgpack"
        elif bad < 0.07:
            body = payload(evs, rank=1)
        elif bad < 0.10:
            evs.insert(rng.randint(0, len(evs)), stores([POOL[0]], group=7))
            body = payload(evs)
        elif bad < 0.12:
            evs.insert(rng.randint(0, len(evs)),
                       stores([POOL[1]], 0, kv_cache_spec_kind="sliding_window"))
            body = payload(evs)
        else:
            body = payload(evs, rank=0 if rng.random() < 0.3 else None)
        out.append(frames(seq, body))
        seq += 1
    return out


@pytest.mark.parametrize("seed", range(12))
def test_drained_equals_one_by_one(seed):
    rng = random.Random(seed)
    msgs = random_stream(rng, 120)
    decoded, one, drained = Counting(decoded_only=True), Counting(), Counting()
    sub0, st0 = subscriber(decoded)
    sub1, st1 = subscriber(one)
    sub2, st2 = subscriber(drained)
    for f in msgs:
        sub0._on_live(st0, f)
        sub1._on_live(st1, f)
    i = 0
    while i < len(msgs):
        k = rng.randint(1, 40)
        sub2._on_drained(st2, msgs[i:i + k])
        i += k
    runs = [c for c in drained.calls if c[0] == "bytes"]
    assert len(runs) < len([c for c in one.calls if c[0] == "bytes"])  # runs were coalesced
    assert max(c[2] for c in runs) > 1
    # the bytes path declined exactly the batches the decoded path then dropped
    declined = sum(1 for c in one.calls if c[0] == "bytes" and c[2] == 0)
    assert declined == st1.stats.bad_batches > 0
    assert st2.stats == st1.stats == st0.stats
    assert st2.recent == st1.recent == st0.recent
    assert residency(drained) == residency(one) == residency(decoded)


def test_bad_batch_inside_a_drained_run_is_dropped_alone():
    """Batches 0-4 drained together, batch 2 refused (group 7): one call reads 0-2 from the
    bytes, applies 0 and 1 and declines 2; 2 takes the decoded path, is refused, dropped and
    the engine reset (which forgets 0 and 1, as one by one); 3 and 4 in one call."""
    index = Counting()
    sub, st = subscriber(index)
    good = [payload([stores([POOL[i]], 0), stores([POOL[i]], 1)]) for i in range(5)]
    bodies = good[:2] + [payload([stores([POOL[9]], 0), stores([POOL[2]], group=7)])] + good[3:]
    sub._on_drained(st, [frames(i, b) for i, b in enumerate(bodies)])
    assert index.calls == [("bytes", 5, 2), ("events", 2), ("bytes", 2, 2)]
    s = st.stats
    assert (s.batches, s.bad_batches, s.resets, s.next_seq, s.stored) == (4, 1, 1, 5, 8)
    assert sorted(st.recent) == [0, 1, 2, 3, 4]
    held, counts = residency(index)
    assert held == 4
    assert counts == [int(h in (POOL[3], POOL[4])) for g in (0, 1) for h in POOL]


@pytest.mark.parametrize("bad", ["undecodable", "other rank"])
def test_batch_that_does_not_decode_splits_the_run(bad):
    """An undecodable or other-rank batch: the batches before it are applied in one call,
    it is declined, fails to decode (or names rank 3), is dropped (reset), and the ones
    after it are applied in one call."""
    index = Counting()
    sub, st = subscriber(index)
    bodies = [payload([stores([POOL[i]], 0)]) for i in range(6)]
    bodies[2] = b"\xc1not msgpack" if bad == "undecodable" else payload([stores([POOL[2]])], 3)
    sub._on_drained(st, [frames(i, b) for i, b in enumerate(bodies)])
    assert index.calls == [("bytes", 6, 2), ("bytes", 3, 3)]
    s = st.stats
    assert (s.batches, s.bad_batches, s.resets, s.next_seq) == (5, 1, 1, 6)
    assert residency(index)[1][:6] == [0, 0, 0, 1, 1, 1]


def test_gap_inside_a_drained_run():
    """Seqs 0, 1, 2, 5, 6, then a repeat of 5, then 7: the run 0-2 in one call; 5 is a gap
    (no replay endpoint: reset, then applied alone); 6 starts a new run, which the repeat
    of 5 ends (a duplicate, dropped); 7 alone."""
    index = Counting()
    sub, st = subscriber(index)
    msgs = [frames(s, payload([stores([POOL[s]], 1)])) for s in (0, 1, 2, 5, 6)]
    msgs += [msgs[3], frames(7, payload([removes([POOL[6]], 1)]))]
    sub._on_drained(st, msgs)
    assert index.calls == [("bytes", 3, 3), ("bytes", 1, 1), ("bytes", 1, 1), ("bytes", 1, 1)]
    s = st.stats
    assert (s.batches, s.gaps, s.resets, s.duplicates, s.next_seq) == (6, 1, 1, 1, 8)
    assert (s.stored, s.removed) == (5, 1)
    held, counts = residency(index)
    assert held == 1 and counts[24:] == [int(h == POOL[5]) for h in POOL]


def test_a_run_is_one_call():
    """What one loop turn drained in order (at most ``max_drain`` messages) is one call: no
    decoded objects, so no cap for the cache's sake."""
    index = Counting()
    sub, st = subscriber(index)
    sub._on_drained(st, [frames(i, payload([stores([POOL[i % 24]])])) for i in range(40)])
    assert index.calls == [("bytes", 40, 40)]
    assert (st.stats.batches, st.stats.next_seq, st.stats.stored) == (40, 40, 40)


@pytest.mark.parametrize("body", [
    b"\x92\xcb" + bytes(8) + b"\x91\x83\xa4type\xacBlockRemoved\xacblock_hashes\x90"
    b"\xa6medium\xa2\xff\xfe",                                      # a str that is not UTF-8
    b"\x92\xcb" + bytes(8) + b"\x91\x83\xa4type\xacBlockRemoved\xacblock_hashes\x90"
    b"\xa1x" + b"\x91" * 5000 + b"\x00",                          # nested past msgspec's limit
], ids=["not utf-8", "too deep"])
def test_payloads_msgspec_rejects_with_other_errors_are_dropped(body):
    """msgspec rejects these with UnicodeDecodeError / RecursionError, not its own
    DecodeError: the batch is dropped (the engine reset) and the stream goes on; before
    kv_event_wire.DECODE_ERRORS either ended the subscriber's thread (found by
    fuzz/fuzz_kv_payload.py)."""
    index = Counting()
    sub, st = subscriber(index)
    msgs = [frames(0, payload([stores([POOL[0]])])), frames(1, body),
            frames(2, payload([stores([POOL[2]])]))]
    for drained in (False, True):
        if drained:
            index = Counting()
            sub, st = subscriber(index)
            sub._on_drained(st, msgs)
        else:
            for f in msgs:
                sub._on_live(st, f)
        s = st.stats
        assert (s.batches, s.bad_batches, s.resets, s.next_seq) == (2, 1, 1, 3)
        assert residency(index)[1][:3] == [0, 0, 1]
