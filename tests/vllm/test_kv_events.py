"""The KV event adapter (hmacore.transport.kv_events) against vLLM 0.32's own
``ZmqEventPublisher`` (in-process, real ZMQ over loopback TCP): replay of missed batches,
duplicates, restarts, uncovered gaps, bad frames, another DP rank, clean shutdown. Raw ZMQ
PUB sockets stand in only for what vLLM's publisher never sends (malformed frames, repeats).

Nothing here waits on a clock for correctness: each check waits (bounded, generous) until
the subscriber has accounted for a given sequence number, then compares the index.
"""
from __future__ import annotations

import socket
import time
import typing

import msgspec
import pytest
import vllm
import zmq
from vllm.distributed import kv_events as V

from hmacore.route_index import RoutingIndex
from hmacore.spec import KVLayout
from hmacore.transport import kv_event_wire as W
from hmacore.transport.kv_events import EngineStream, KVEventSubscriber
from ports import free_port

WAIT = 60.0
VERSION = ".".join(vllm.__version__.split(".")[:2])
STRANGER = 12345             # a hash no prompt here has: removing it is a no-op
BS = 16
LAYOUT = KVLayout.from_dict({"groups": [
    {"kind": "full", "block_size": BS},
    {"kind": "sliding_window", "block_size": BS, "sliding_window": 64}]})


def tcp(port: int) -> str:
    return f"tcp://127.0.0.1:{port}"


def prompt(seed: int, n: int = 8 * BS) -> list[int]:
    return [(seed * 7919 + i * 31) % 5000 + 1 for i in range(n)]


def int_hashes(index: RoutingIndex, tokens: list[int]) -> list[int]:
    return [int.from_bytes(d[-8:], "big") for d in index.block_hashes(tokens)]


def stored(hashes: list[int], group: int = 0, medium: str | None = "GPU") -> V.BlockStored:
    return V.BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[],
                         block_size=BS, lora_id=None, medium=medium, lora_name=None,
                         group_idx=group)


def removed(hashes: list[int], group: int = 0) -> V.BlockRemoved:
    return V.BlockRemoved(block_hashes=hashes, medium="GPU", group_idx=group)


def both_groups(hashes: list[int]) -> list:
    return [stored(hashes, 0), stored(hashes, 1)]


def batch(events: list, rank: int | None = None) -> V.KVEventBatch:
    return V.KVEventBatch(ts=time.time(), events=events, data_parallel_rank=rank)


def _wait_until_free(port: int, timeout: float = 30.0) -> None:
    """ZMQ releases a closed listener's port asynchronously: wait (bounded) until a plain
    bind of the loopback port succeeds, so a restarted publisher can take it."""
    deadline = time.monotonic() + timeout
    while True:
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(("127.0.0.1", port))
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
        time.sleep(0.1)


def publisher(port: int, replay: int | None, **kw) -> V.ZmqEventPublisher:
    """vLLM's publisher on these loopback ports: it connects to ``port`` (the subscriber
    binds it) and binds ``replay``, which a restarted engine takes over from its predecessor:
    wait until that one is released."""
    if replay:
        _wait_until_free(replay)
    return V.ZmqEventPublisher(0, endpoint=tcp(port),
                               replay_endpoint=tcp(replay) if replay else None, **kw)


def published(replay_port: int, seq: int) -> None:
    """Wait until the publisher holds batch ``seq`` (asked over its own replay protocol)."""
    ctx = zmq.Context.instance()
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(tcp(replay_port))
        try:
            s.send_multipart((b"", seq.to_bytes(8, "big")))
            while s.poll(2000):
                f = s.recv_multipart()
                if f[2] == W.REPLAY_END_SEQ:
                    break
                if int.from_bytes(f[2], "big") >= seq:
                    return
        finally:
            s.close()
        time.sleep(0.05)
    raise AssertionError(f"publisher never buffered batch {seq}")


def pump(pub: V.ZmqEventPublisher, sub: KVEventSubscriber, key, past: int) -> int:
    """Publish no-op batches until the subscriber is past batch ``past - 1`` (a PUB drops
    what it publishes before the SUB's subscription has reached it); returns how many."""
    deadline = time.monotonic() + WAIT
    n = 0
    while not sub.wait_for(key, past + 1, 0.1):
        assert time.monotonic() < deadline, sub.stats()
        pub.publish(batch([removed([STRANGER])]))
        n += 1
    return n


def full(tokens: list[int]) -> int:
    """The whole prompt's hit: whole blocks below ``len - 1`` (vLLM recomputes the last)."""
    return (len(tokens) - 1) // BS * BS


def hit(index: RoutingIndex, key, tokens: list[int]) -> int:
    return index.query(tokens).hits[key]


@pytest.fixture
def index():
    return RoutingIndex(LAYOUT, seed="0")


def test_wire_structs_match_vllm():
    """The pinned schema decodes what vLLM's own classes encode, field for field; vLLM's
    fields the adapter ignores are listed, so a new or renamed field fails here."""
    ignored = {"BlockStored": {"extra_keys", "locality", "ownership", "session_id"},
               "BlockRemoved": {"locality", "ownership"}, "AllBlocksCleared": set()}
    # fields of a later vLLM the pinned structs decode (absent, so None, from this one)
    later = {"0.32": {"BlockStored": {"lookahead_token_ids"}}, "0.33": {}}[VERSION]
    for name, extra in ignored.items():
        ours, theirs = getattr(W, name), getattr(V, name)
        assert set(theirs.__struct_fields__) == \
            (set(ours.__struct_fields__) - later.get(name, set())) | extra, name
        assert theirs.__struct_config__.tag == ours.__struct_config__.tag == name
        assert not theirs.__struct_config__.array_like
    assert V.KVEventBatch.__struct_fields__ == W.EventBatch.__struct_fields__
    assert V.KVEventBatch.__struct_config__.array_like and W.EventBatch.__struct_config__.array_like
    assert V.ZmqEventPublisher.END_SEQ == W.REPLAY_END_SEQ
    full = V.BlockStored(block_hashes=[1, 2**64 - 1], parent_block_hash=7, token_ids=[1, 2],
                         block_size=32, lora_id=3, medium="CPU", lora_name="l",
                         extra_keys=[("x",)], group_idx=2, kv_cache_spec_kind="sliding_window",
                         kv_cache_spec_sliding_window=128, locality="LOCAL", ownership="o",
                         session_id="s")
    digest = V.BlockRemoved(block_hashes=[b"\x01" * 32], medium=None, group_idx=None)
    src = V.KVEventBatch(ts=1.25, events=[full, digest, V.AllBlocksCleared()],
                         data_parallel_rank=3)
    # the full schema and the subscriber's index decoder (the index structs: the same tags, a
    # subset of the fields with their types, every field RoutingIndex.apply_events reads)
    from hmacore._fast._route import _FIELD_NAMES
    for whole, part in zip((W.BlockStored, W.BlockRemoved, W.AllBlocksCleared),
                           W.INDEX_EVENT_TYPES):
        assert part.__struct_config__.tag == whole.__struct_config__.tag
        want = typing.get_type_hints(whole)
        assert {f: want[f] for f in part.__struct_fields__} == typing.get_type_hints(part)
    assert set(_FIELD_NAMES) <= set(W.IndexBlockStored.__struct_fields__)
    for decoder, types in ((W.decoder(), (W.BlockStored, W.BlockRemoved, W.AllBlocksCleared)),
                           (W.index_decoder(), W.INDEX_EVENT_TYPES)):
        got = decoder.decode(msgspec.msgpack.encode(src))
        assert got.ts == 1.25 and got.data_parallel_rank == 3
        a, b, c = got.events
        assert tuple(map(type, got.events)) == types
        for f in types[0].__struct_fields__:
            assert getattr(a, f) == getattr(full, f, None), f
        assert (b.block_hashes, b.medium, b.group_idx) == ([b"\x01" * 32], None, None)


def test_live_stream_with_replay_of_missed_batches(index):
    """Batches published before the subscriber exists are replayed from the publisher's
    buffer when the first live one reveals the gap; the index then holds exactly the last
    state: removes and an AllBlocksCleared included."""
    sub_port, rep_port = free_port(), free_port()
    pub = publisher(sub_port, rep_port)
    a, b, c = prompt(1), prompt(2), prompt(3)
    ha, hb, hc = (int_hashes(index, p) for p in (a, b, c))
    try:
        pub.publish(batch(both_groups(ha)))                     # 0: a stored
        pub.publish(batch(both_groups(hb)))                     # 1: b stored
        pub.publish(batch([removed(hb[4:], 0)]))                # 2: b's tail evicted (FA)
        published(rep_port, 2)                                  # nobody listened: all lost
        stream = EngineStream("e0", tcp(sub_port), tcp(rep_port))
        with KVEventSubscriber(index, [stream]) as sub:
            n = 3 + pump(pub, sub, stream.key, 3)               # 3..: the first one seen
            pub.publish(batch(both_groups(hc)))                 # reveals the gap
            assert sub.wait_for(stream.key, n + 1, WAIT), sub.stats()
            s = sub.stats()[stream.key]
            assert (s.gaps, s.replays, s.resets, s.bad_frames) == (1, 1, 0, 0), s
            assert s.replayed >= 3 and s.batches == n + 1 and s.ignored == n - 3
            assert hit(index, stream.key, a) == full(a)  # whole blocks below len - 1
            assert hit(index, stream.key, b) == 4 * BS
            assert hit(index, stream.key, c) == full(c)
            pub.publish(batch([V.AllBlocksCleared()]))
            assert sub.wait_for(stream.key, n + 2, WAIT)
            assert index.resident_blocks(stream.key) == 0
            assert sub.stats()[stream.key].cleared == 1
    finally:
        pub.shutdown()


def test_gap_the_replay_cannot_cover_resets_the_engine(index):
    """A publisher that buffers 2 batches cannot replay batch 0: the engine is reset at the
    first batch it still holds (under-predicting, never over-predicting)."""
    sub_port, rep_port = free_port(), free_port()
    pub = publisher(sub_port, rep_port, buffer_steps=2)
    a, b = prompt(4), prompt(5)
    ha, hb = int_hashes(index, a), int_hashes(index, b)
    try:
        pub.publish(batch(both_groups(ha)))                     # 0: lost and not buffered
        for _ in range(3):
            pub.publish(batch([removed([STRANGER])]))           # 1..3: no-op removes
        published(rep_port, 3)
        stream = EngineStream("e0", tcp(sub_port), tcp(rep_port))
        with KVEventSubscriber(index, [stream]) as sub:
            n = 4 + pump(pub, sub, stream.key, 4)
            pub.publish(batch(both_groups(hb)))
            assert sub.wait_for(stream.key, n + 1, WAIT), sub.stats()
            s = sub.stats()[stream.key]
            assert s.gaps == 1 and s.resets == 1 and s.replays == 1
            assert hit(index, stream.key, a) == 0               # batch 0 is gone for good
            assert hit(index, stream.key, b) == full(b)
    finally:
        pub.shutdown()


def test_gap_without_replay_endpoint_resets(index):
    sub_port, rep_port = free_port(), free_port()
    pub = publisher(sub_port, rep_port)
    a = prompt(6)
    try:
        pub.publish(batch(both_groups(int_hashes(index, a))))
        published(rep_port, 0)
        stream = EngineStream("e0", tcp(sub_port))              # no replay endpoint
        with KVEventSubscriber(index, [stream]) as sub:
            pump(pub, sub, stream.key, 1)
            s = sub.stats()[stream.key]
            assert (s.gaps, s.replays, s.resets, s.batches) == (1, 0, 1, 1), s
            assert hit(index, stream.key, a) == 0
    finally:
        pub.shutdown()


def test_engine_restart_resets_it_and_other_engines_keep_theirs(index):
    """Engine e0's publisher is replaced by a new one (a restarted engine counts from 0):
    e0 is reset and follows the new stream; e1 keeps its blocks."""
    p0, r0, p1, r1 = (free_port() for _ in range(4))
    a, b, c = prompt(7), prompt(8), prompt(9)
    ha, hb, hc = (int_hashes(index, p) for p in (a, b, c))
    s0 = EngineStream("e0", tcp(p0), tcp(r0))
    s1 = EngineStream("e1", tcp(p1), tcp(r1))
    with KVEventSubscriber(index, [s0, s1]) as sub:
        pub0, pub1 = publisher(p0, r0), publisher(p1, r1)
        try:
            n0 = pump(pub0, sub, s0.key, 0)
            n1 = pump(pub1, sub, s1.key, 0)
            pub0.publish(batch(both_groups(ha)))
            for _ in range(30):            # a long first stream: the new one restarts below it
                pub0.publish(batch([removed([STRANGER])]))
            pub1.publish(batch(both_groups(hc)))
            assert sub.wait_for(s0.key, n0 + 31, WAIT) and sub.wait_for(s1.key, n1 + 1, WAIT)
            assert hit(index, s0.key, a) == full(a)
        finally:
            pub0.shutdown()
        pub0 = publisher(p0, r0)                                # the engine restarted
        try:
            pub0.publish(batch(both_groups(hb)))                # its new batch 0
            deadline = time.monotonic() + WAIT
            m = 1
            while sub.stats()[s0.key].restarts == 0:
                assert time.monotonic() < deadline, sub.stats()
                pub0.publish(batch([removed([STRANGER])]))
                m += 1
                time.sleep(0.1)
            assert sub.wait_for(s0.key, m, WAIT)
            s = sub.stats()[s0.key]
            assert s.restarts == 1 and s.resets >= 1 and s.next_seq == m, s
            assert hit(index, s0.key, a) == 0
            assert hit(index, s0.key, b) == full(b)
            assert hit(index, s1.key, c) == full(c)
            res = index.query(b)
            assert res.best_engines == (s0.key,)
        finally:
            pub0.shutdown()
            pub1.shutdown()


def _raw_pub(port: int) -> zmq.Socket:
    s = zmq.Context.instance().socket(zmq.PUB)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(tcp(port))
    return s


def _send_until(sock: zmq.Socket, frames, sub, key, next_seq: int) -> None:
    """Resend (a PUB drops until the subscription arrives) until ``next_seq`` is reached."""
    deadline = time.monotonic() + WAIT
    while not sub.wait_for(key, next_seq, 0.1):
        assert time.monotonic() < deadline, sub.stats()
        sock.send_multipart(frames)


def test_duplicates_bad_frames_other_rank_never_corrupt(index):
    """Raw frames: a repeated batch is applied once; frames that are not (topic, seq,
    payload) change nothing; an undecodable payload, a batch of another DP rank, a batch the
    index refuses (group out of range) and one whose spec kind contradicts the layout (the
    router was given the groups in another order) reset that engine only, and are counted."""
    p0, p1 = free_port(), free_port()
    s0, s1 = EngineStream("e0", tcp(p0)), EngineStream("e1", tcp(p1))
    enc = msgspec.msgpack.Encoder()
    a, b = prompt(10), prompt(11)
    ha, hb = int_hashes(index, a), int_hashes(index, b)
    raw0, raw1 = _raw_pub(p0), _raw_pub(p1)
    try:
        with KVEventSubscriber(index, [s0, s1]) as sub:
            def frames(seq, ev, rank=None):
                return (b"", seq.to_bytes(8, "big"), enc.encode(batch(ev, rank)))

            f0 = frames(0, both_groups(ha))
            _send_until(raw0, f0, sub, s0.key, 1)
            _send_until(raw1, frames(0, both_groups(hb)), sub, s1.key, 1)
            for _ in range(3):
                raw0.send_multipart(f0)                         # repeats of batch 0
            raw0.send_multipart((b"", b"\x00\x01"))             # 2 frames
            raw0.send_multipart((b"", b"\x00" * 3, f0[2]))      # short seq
            # batch 1 removes a's blocks once: applied once, the count drops to 0
            _send_until(raw0, frames(1, [removed(ha, 0), removed(ha, 1)]), sub, s0.key, 2)
            s = sub.stats()[s0.key]
            assert s.batches == 2 and s.duplicates >= 3 and s.bad_frames == 2
            assert s.resets == 0 and hit(index, s0.key, a) == 0
            _send_until(raw0, frames(2, both_groups(ha)), sub, s0.key, 3)
            assert hit(index, s0.key, a) == full(a)
            bad = [(b"", (3).to_bytes(8, "big"), b"\xc1not msgpack"),
                   frames(5, both_groups(ha), rank=1),
                   frames(7, [stored(ha, group=7)]),
                   frames(9, [V.BlockStored(block_hashes=ha, parent_block_hash=None,
                                            token_ids=[], block_size=BS, lora_id=None,
                                            medium="GPU", lora_name=None, group_idx=0,
                                            kv_cache_spec_kind="sliding_window")])]
            for n, f in enumerate(bad, 1):
                seq = 2 * n + 1
                _send_until(raw0, f, sub, s0.key, seq + 1)
                s = sub.stats()[s0.key]
                assert (s.bad_batches, s.resets) == (n, n), s
                assert hit(index, s0.key, a) == 0               # reset: conservative
                _send_until(raw0, frames(seq + 1, both_groups(ha)), sub, s0.key, seq + 2)
                assert hit(index, s0.key, a) == full(a)
            assert hit(index, s1.key, b) == full(b)          # the other engine untouched
            assert sub.stats()[s1.key].resets == 0
    finally:
        raw0.close()
        raw1.close()


def test_non_gpu_events_go_to_the_tier_index(index):
    tier = RoutingIndex(LAYOUT, seed="0")
    port = free_port()
    s0 = EngineStream("e0", tcp(port))
    a, b = prompt(12), prompt(13)
    ha, hb = int_hashes(index, a), int_hashes(index, b)
    enc = msgspec.msgpack.Encoder()
    raw = _raw_pub(port)
    try:
        with KVEventSubscriber(index, [s0], tier_index=tier) as sub:
            ev = [*both_groups(ha), stored(hb, 0, "CPU"), stored(hb, 1, "CPU")]
            _send_until(raw, (b"", bytes(8), enc.encode(batch(ev))), sub, s0.key, 1)
            assert hit(index, s0.key, a) == full(a) and hit(index, s0.key, b) == 0
            assert hit(tier, s0.key, b) == full(b) and hit(tier, s0.key, a) == 0
            assert sub.stats()[s0.key].tier_rows == 2 * len(hb)
    finally:
        raw.close()


def test_close_joins_and_frees_endpoints(index):
    port, rport = free_port(), free_port()
    sub = KVEventSubscriber(index, [EngineStream("e0", tcp(port), tcp(rport))]).start()
    thread = sub._thread
    sub.close()
    assert thread is not None and not thread.is_alive() and sub.error is None
    s = zmq.Context.instance().socket(zmq.SUB)
    try:
        s.bind(tcp(port))                                       # the endpoint is free again
    finally:
        s.close(linger=0)
    with pytest.raises(zmq.ZMQError):                           # an endpoint in use: at start
        blocker = zmq.Context.instance().socket(zmq.SUB)
        blocker.bind(tcp(port))
        try:
            KVEventSubscriber(index, [EngineStream("e0", tcp(port))]).start()
        finally:
            blocker.close(linger=0)


def test_bad_arguments_are_named(index):
    from hmacore.errors import ArgumentValueError
    with pytest.raises(ArgumentValueError, match="endpoint"):
        EngineStream("e0", "http://127.0.0.1:1")
    with pytest.raises(ArgumentValueError, match="dp_rank"):
        EngineStream("e0", "tcp://127.0.0.1:1", dp_rank=-1)
    s = EngineStream("e0", "tcp://127.0.0.1:1")
    with pytest.raises(ArgumentValueError, match="distinct"):
        KVEventSubscriber(index, [s, s])
    with pytest.raises(ArgumentValueError, match="replay_timeout"):
        KVEventSubscriber(index, [s], replay_timeout=0)
